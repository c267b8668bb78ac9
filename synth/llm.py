"""Stage requests to any OpenAI-compatible endpoint: cached, bounded, retried, counted.

Each request goes through three bounded loops and nothing else:
- transport (``envscaler.llm``, shared with the harness): 429, 5xx, timeouts and connection errors
  are retried ``retries`` times with exponential backoff and jitter, honouring Retry-After, then the
  run stops with LlmUnavailable (other 4xx stop it at once); retries are counted per stage;
- answer: an answer that is not the JSON object the stage asks for is sent back with the problem
  ``json_retries`` times, then the draft is dropped with InvalidAnswer;
- cache: every finished answer is on disk before it is used, keyed by model, temperature and messages.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, TypeVar

import anyio
import openai
from pydantic import BaseModel, ValidationError

from envscaler.bundle import describe_validation_error
from envscaler.errors import LlmUnavailable
from envscaler.llm import RetryPolicy, chat_completion, new_client
from synth.cache import DiskCache, request_key
from synth.errors import InvalidAnswer
from synth.models import RunReport, StageStats, SynthConfig

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("synth.llm")

_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n(.*)\n```\s*$", re.DOTALL)


def parse_object(content: str | None) -> dict[str, Any]:
    """The JSON object in an answer, tolerating a Markdown fence around it; ValueError otherwise."""
    text = (content or "").strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text:
        raise ValueError("the answer is empty")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


class StageLlm:
    """Asks stages their questions and records what it cost in the run report."""

    def __init__(self, config: SynthConfig, cache: DiskCache, report: RunReport) -> None:
        self.config = config
        self.cache = cache
        self.report = report
        self._limiter = anyio.CapacityLimiter(config.concurrency)
        self._clients: dict[str | None, openai.AsyncOpenAI] = {}

    def stats(self, stage: str) -> StageStats:
        """The report entry of ``stage`` (created on first use)."""
        return self.report.stages.setdefault(stage, StageStats())

    def _client(self, base_url: str | None) -> openai.AsyncOpenAI:
        client = self._clients.get(base_url)
        if client is None:
            client = new_client(base_url, self.config.api_key, self.config.request_timeout_s)
            self._clients[base_url] = client
        return client

    async def aclose(self) -> None:
        """Close the HTTP clients."""
        for client in self._clients.values():
            await client.close()

    async def ask(self, stage: str, answer: type[M], messages: list[dict[str, str]], subject: str = "") -> M:
        """The stage's answer as ``answer``; re-asks on invalid JSON, then raises InvalidAnswer."""
        conversation = list(messages)
        problem = ""
        attempts = self.config.json_retries + 1
        for attempt in range(attempts):
            content = await self.complete(stage, conversation)
            try:
                return answer.model_validate(parse_object(content))
            except ValidationError as e:
                problem = f"the JSON does not have the requested shape: {describe_validation_error(e)}"
            except ValueError as e:
                problem = str(e)
            self.stats(stage).invalid_answers += 1
            log.warning("invalid answer", extra={"stage": stage, "subject": subject, "attempt": attempt + 1,
                                                 "problem": problem})
            conversation = [
                *conversation,
                {"role": "assistant", "content": content or ""},
                {"role": "user", "content": f"That answer was rejected: {problem}. "
                                            "Answer again with only the JSON object requested."},
            ]
        raise InvalidAnswer(stage, attempts, problem)

    async def complete(self, stage: str, messages: list[dict[str, str]]) -> str:
        """One chat completion's text, from the cache when this exact request was answered before."""
        settings = self.config.stage(stage)
        key = request_key({"model": settings.model, "temperature": settings.temperature, "messages": messages})
        stats = self.stats(stage)
        cached = self.cache.get(stage, key)
        if cached is not None:
            stats.cached += 1
            return cached["content"]
        retries = 0

        def count_retry(_: BaseException) -> None:
            nonlocal retries
            retries += 1
            stats.http_retries += 1

        policy = RetryPolicy(self.config.retries, self.config.backoff_s)
        async with self._limiter:
            try:
                response = await chat_completion(
                    self._client(settings.base_url), policy, on_retry=count_retry,
                    model=settings.model, temperature=settings.temperature, messages=messages,
                )
            except LlmUnavailable as e:
                stats.requests += e.attempts
                advice = "" if e.status is not None else "; check the endpoint, then rerun: finished requests are cached"
                raise LlmUnavailable(f"stage {stage!r}: {e}{advice}", attempts=e.attempts, status=e.status) from None
        stats.requests += retries + 1
        if response.usage is not None:
            stats.prompt_tokens += response.usage.prompt_tokens or 0
            stats.completion_tokens += response.usage.completion_tokens or 0
        content = response.choices[0].message.content if response.choices else ""
        self.cache.put(stage, key, {"content": content or "", "model": settings.model})
        return content or ""
