"""One chat completion from any OpenAI-compatible endpoint, retried the same way by the harness and synth.

Transient failures (429, 5xx, timeouts, connection errors) are retried by tenacity: the first wait
is ``backoff_s``, doubled each time, plus up to ``backoff_s`` of random jitter (so that many clients
refused together do not come back together), and never shorter than the endpoint's ``Retry-After``
(up to a minute). Any other refusal (400, 401, 404, ...) stops at once: asking again cannot help.
Either way the caller gets :class:`~envscaler.errors.LlmUnavailable`, an InfraError, saying how many
attempts were made.

The SDK's own retries are off (``max_retries=0``): they can neither be counted per request (synth
reports its retries per stage, through ``on_retry``) nor start from the delay a user asked for.
Callers keep what is theirs: the harness counts tokens, synth re-asks for valid JSON and caches.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import openai
from openai.types.chat import ChatCompletion
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_exponential, wait_random

from envscaler.errors import EnvScalerError, LlmUnavailable

TRANSIENT = (openai.RateLimitError, openai.InternalServerError, openai.APIConnectionError, openai.APITimeoutError)
"""What is worth asking again: rate limits, server errors, timeouts and connection failures."""

_MAX_WAIT_S = 60.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often to ask again after a transient failure, and how long to wait before the first retry."""

    retries: int = 4
    backoff_s: float = 1.0


def new_client(base_url: str | None, api_key: str | None = None, timeout_s: float = 120.0) -> openai.AsyncOpenAI:
    """An async client of ``base_url`` (None: OpenAI's API); the key defaults to ``$OPENAI_API_KEY``."""
    key = api_key or os.environ.get("OPENAI_API_KEY") or "not-needed"  # local servers take any key
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=timeout_s)


def check_endpoint(base_url: str | None, api_key: str | None, who: str) -> None:
    """EnvScalerError (bad usage) when ``who`` would call OpenAI's API without a key.

    Every request would fail as a connection or auth error, and retrying them would only hide why:
    commands check this before they start.
    """
    if base_url is None and not (api_key or os.environ.get("OPENAI_API_KEY")):
        raise EnvScalerError(
            f"{who}: no LLM endpoint: set $OPENAI_API_KEY for OpenAI's API, or pass --base-url with an "
            "OpenAI-compatible endpoint (a local vLLM or llama.cpp server, say)"
        )


def _retry_after_s(error: BaseException | None) -> float:
    """The wait the endpoint asked for in ``Retry-After`` (seconds) or ``retry-after-ms``; 0 when none."""
    response = getattr(error, "response", None)
    if response is None:
        return 0.0
    for header, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            return min(max(float(response.headers.get(header, "")) * scale, 0.0), _MAX_WAIT_S)
        except ValueError:
            continue  # absent, or an HTTP date: the backoff decides
    return 0.0


class _Wait:
    """Exponential backoff with jitter, stretched to the endpoint's Retry-After."""

    def __init__(self, backoff_s: float) -> None:
        self.backoff = wait_exponential(multiplier=backoff_s, max=_MAX_WAIT_S) + wait_random(0, backoff_s)

    def __call__(self, state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome else None
        return max(self.backoff(state), _retry_after_s(error))


async def chat_completion(
    client: openai.AsyncOpenAI,
    policy: RetryPolicy,
    *,
    on_retry: Callable[[BaseException], None] | None = None,
    **request: Any,
) -> ChatCompletion:
    """``client.chat.completions.create(**request)``, retried; LlmUnavailable when it cannot be had.

    ``on_retry`` is called with the failure before each retry (to count them).
    """

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None and (error := state.outcome.exception()) is not None:
            on_retry(error)

    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.retries + 1),
        wait=_Wait(policy.backoff_s),
        retry=retry_if_exception_type(TRANSIENT),
        before_sleep=before_sleep,
        sleep=anyio.sleep,
        reraise=True,
    )
    where = f"LLM endpoint {client.base_url} ({request.get('model')})"
    try:
        async for attempt in retrying:
            with attempt:
                return await client.chat.completions.create(**request)
    except TRANSIENT as e:
        attempts = retrying.statistics.get("attempt_number", 1)
        raise LlmUnavailable(f"{where} failed {attempts} time{'s' if attempts != 1 else ''}, last: {e}", attempts=attempts) from None
    except openai.APIStatusError as e:
        attempts = retrying.statistics.get("attempt_number", 1)
        raise LlmUnavailable(
            f"{where} refused the request (HTTP {e.status_code}): {e.message}; check the base URL, model name and API key",
            attempts=attempts,
            status=e.status_code,
        ) from None
    raise AssertionError("tenacity neither returned nor raised")  # pragma: no cover
