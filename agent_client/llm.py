"""OpenAI-compatible chat endpoints, shared by the agent and the simulated user."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent_client.models import Usage

if TYPE_CHECKING:
    import openai
    from openai.types.chat import ChatCompletion

# envscaler.llm is imported where a model is called: it imports the openai SDK, a second of CPU that
# every worker process of a replay or command run would spend for nothing.


@dataclass
class LlmEndpoint:
    """An OpenAI-compatible endpoint and model (key from the environment)."""

    base_url: str | None
    model: str
    api_key: str | None = None
    temperature: float | None = None
    retries: int = 4
    backoff_s: float = 1.0

    def client(self) -> openai.AsyncOpenAI:
        """A client of this endpoint (the retries are ``complete``'s, not the SDK's)."""
        from envscaler.llm import new_client

        return new_client(self.base_url, self.api_key)


async def complete(endpoint: LlmEndpoint, client: openai.AsyncOpenAI, usage: Usage, **request: Any) -> ChatCompletion:
    """One chat completion, retried on 429, 5xx and connection errors, its tokens added to ``usage``.

    Raises LlmUnavailable (an InfraError: the episode is recorded as an infra error) when the
    endpoint stays down or refuses the request.
    """
    from envscaler.llm import RetryPolicy, chat_completion

    if endpoint.temperature is not None:
        request["temperature"] = endpoint.temperature
    response = await chat_completion(client, RetryPolicy(endpoint.retries, endpoint.backoff_s), model=endpoint.model, **request)
    if response.usage:
        usage.add(response.usage.prompt_tokens, response.usage.completion_tokens)
    else:
        usage.add(0, 0)
    return response
