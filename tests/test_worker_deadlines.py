"""A worker's deadlines measure the call, not the queue: a call that waits behind slow but legitimate
calls gets its whole limit once it starts, and its worker is not replaced; a call that really hangs
still is; a call that waits too long for a thread is refused, never run, and says so.

Real servers and real workers (sandboxed where they can confine themselves); ``--workers 1`` gives the worker one call
thread, so that calls queue behind each other as they do behind many on a busy server.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.bundles import counter_bundle
from tests.support.hostile import call as mcp_call
from tests.support.server import serve

pytestmark = pytest.mark.timeout(120)

CALL_TIMEOUT_S = 1.0
# Each under the limit, and together several times over it: the last ones wait far longer than their limit.
SLOW_CALLS = 6
SLOW_CALL_S = 0.6


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return counter_bundle(tmp_path_factory.mktemp("deadlines"))


def new_episode(http: httpx.Client) -> str:
    created = http.post("/episodes", json={"scenario_id": "counter_001"})
    assert created.status_code == 201, created.text
    return created.json()["episode_id"]


def call(http: httpx.Client, episode_id: str, name: str, arguments: dict) -> dict:
    return mcp_call(http, f"/episodes/{episode_id}/mcp", name, arguments)


def worker_restarts(http: httpx.Client) -> int:
    return http.get("/info").json()["worker_restarts"]


def test_calls_queued_behind_slow_legitimate_ones_replace_no_worker_while_a_hung_call_still_does(bundle):
    with serve(bundle, "--call-timeout", str(CALL_TIMEOUT_S), "--workers", "1") as server, server.client() as http:
        episodes = [new_episode(http) for _ in range(SLOW_CALLS)]
        with ThreadPoolExecutor(SLOW_CALLS) as pool:
            results = list(pool.map(lambda episode: call(http, episode, "nap", {"seconds": SLOW_CALL_S}), episodes))
        assert [result["isError"] for result in results] == [False] * SLOW_CALLS, results
        assert worker_restarts(http) == 0
        assert http.get("/info").json()["stuck_calls"] == 0

        hung = call(http, episodes[0], "nap", {"seconds": 1000})
        text = hung["content"][0]["text"]
        assert hung["isError"] and "abandoned" in text and "the call was undone" in text, hung
        assert worker_restarts(http) == 1


def count_of(http: httpx.Client, episode_id: str) -> int:
    result = call(http, episode_id, "get_item", {"item_id": "a"})
    assert not result["isError"], result
    return json.loads(result["content"][0]["text"])["data"]["count"]


def test_a_call_that_waits_too_long_for_a_thread_is_refused_never_run_and_says_so(bundle):
    flags = ("--call-timeout", "5", "--workers", "1", "--queue-wait", "0.5")
    with serve(bundle, *flags) as server, server.client() as http:
        busy, waiting, validated = new_episode(http), new_episode(http), new_episode(http)
        before = count_of(http, waiting)
        with ThreadPoolExecutor(3) as pool:
            holding = pool.submit(call, http, busy, "nap", {"seconds": 3.0})
            time.sleep(0.5)  # the nap holds the one call thread from here on
            queued = pool.submit(call, http, waiting, "slow_add", {"item_id": "a", "seconds": 0.1})
            validation = pool.submit(http.post, f"/episodes/{validated}/validate", json={}, timeout=60)
            refused, answered = queued.result(), validation.result()
            assert not holding.result()["isError"]
        text = refused["content"][0]["text"]
        assert refused["isError"] and "counter: overloaded" in text and "was not run" in text, refused
        assert answered.status_code == 503 and "overloaded" in answered.json()["error"], answered.text
        assert count_of(http, waiting) == before
        assert worker_restarts(http) == 0
        calls = http.get(f"/episodes/{waiting}/trajectory").json()["calls"]
        assert [c["name"] for c in calls if c["error_kind"] == "env"] == ["slow_add"], calls
