"""The one LLM-call helper (envscaler.llm) over a real OpenAI-compatible replay server."""

from __future__ import annotations

import socket

import openai
import pytest

from envscaler.errors import InfraError, LlmUnavailable
from envscaler.llm import RetryPolicy, chat_completion, new_client
from tests.support.openai_replay import ReplayServer

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_a_rate_limit_waits_as_long_as_retry_after_asks_and_each_retry_is_counted():
    retried: list[BaseException] = []
    script = [{"status": 429, "headers": {"retry-after": "0.4"}}, {"status": 503}, {"content": "hi"}]
    with ReplayServer({"m": script}) as server:
        client = new_client(server.base_url)
        response = await chat_completion(client, RetryPolicy(retries=2, backoff_s=0.01), on_retry=retried.append,
                                         model="m", messages=MESSAGES)
        await client.close()
    assert response.choices[0].message.content == "hi"
    assert [type(e) for e in retried] == [openai.RateLimitError, openai.InternalServerError]
    first, second, third = server.arrivals
    assert second - first >= 0.4, "Retry-After is a floor under the backoff"
    assert third - second < 0.4, "without Retry-After the (small) backoff decides"


async def test_an_endpoint_that_stays_down_raises_one_infra_error_after_every_retry():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    client = new_client(dead)
    with pytest.raises(LlmUnavailable) as caught:
        await chat_completion(client, RetryPolicy(retries=2, backoff_s=0.01), model="m", messages=MESSAGES)
    await client.close()
    assert isinstance(caught.value, InfraError) and caught.value.exit_code == 1
    assert caught.value.attempts == 3 and caught.value.status is None
    assert "failed 3 times" in str(caught.value) and dead in str(caught.value)


async def test_a_refusal_is_not_retried():
    with ReplayServer({"m": [{"status": 400, "message": "no such model"}, {"content": "never"}]}) as server:
        client = new_client(server.base_url)
        with pytest.raises(LlmUnavailable) as caught:
            await chat_completion(client, RetryPolicy(retries=5, backoff_s=0.01), model="m", messages=MESSAGES)
        await client.close()
    assert len(server.requests) == 1
    assert caught.value.status == 400 and caught.value.attempts == 1 and "no such model" in str(caught.value)
