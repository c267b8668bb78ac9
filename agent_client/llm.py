"""OpenAI-compatible chat endpoints, shared by the agent and the simulated user."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import anyio
import openai

from agent_client.models import Usage
from envscaler.errors import InfraError


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
        key = self.api_key or os.environ.get("OPENAI_API_KEY") or "not-needed"
        # Retries are ours (with backoff) so that an endpoint that stays down ends as an infra error.
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=120.0)


async def complete(endpoint: LlmEndpoint, client: openai.AsyncOpenAI, usage: Usage, **request: Any) -> Any:
    """One chat completion with retries on 429, 5xx and connection errors; InfraError when they run out."""
    if endpoint.temperature is not None:
        request["temperature"] = endpoint.temperature
    delay = endpoint.backoff_s
    for attempt in range(endpoint.retries + 1):
        try:
            response = await client.chat.completions.create(model=endpoint.model, **request)
        except (openai.RateLimitError, openai.InternalServerError, openai.APIConnectionError, openai.APITimeoutError) as e:
            if attempt == endpoint.retries:
                raise InfraError(f"LLM endpoint {endpoint.base_url} ({endpoint.model}) failed {attempt + 1} times: {e}") from None
            await anyio.sleep(delay)
            delay *= 2
            continue
        except openai.APIStatusError as e:
            raise InfraError(f"LLM endpoint {endpoint.base_url} ({endpoint.model}) refused the request: {e}") from None
        if response.usage:
            usage.add(response.usage.prompt_tokens, response.usage.completion_tokens)
        else:
            usage.add(0, 0)
        return response
    raise AssertionError("unreachable")
