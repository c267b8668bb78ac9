"""A worker's deadlines measure the call, not the queue: a call that waits behind slow but legitimate
calls gets its whole limit once it starts, and its worker is not replaced; a call that really hangs
still is; a call that waits too long for a thread is refused, never run, and says so. Nor do they
measure the machine: calls and checks slowed past their limits by a crowded CPU are not ended, and
replace nothing.

Real servers and real workers (sandboxed where they can confine themselves); ``--workers 1`` gives the worker one call
thread, so that calls queue behind each other as they do behind many on a busy server.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from servers.episodes.store import ABANDON_GRACE_S
from servers.workers.process import GRACE_S
from tests.support.bundles import COUNTER_CODE, counter_scenario, counter_spec, counter_bundle, write_bundle
from tests.support.crowding import one_crowded_cpu
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


WORK_METHOD = '''
    def work(self, cpu_seconds: float) -> dict:
        """Compute until this call has used some CPU time.

        Args:
            cpu_seconds (float): How much.
        """
        until = time.thread_time() + cpu_seconds
        while time.thread_time() < until:
            pass
        return {"success": True}
'''
HEAVY_CHECK = {"check_item": "computes a while, then passes",
               "check_func": "import time\n\ndef check_func(final_state):\n    until = time.thread_time() + 0.3\n"
                             "    while time.thread_time() < until:\n        pass\n    return True"}
# On one CPU with this many busy processes, a call gets about an eighth of it: its 0.6 s of CPU take
# some 5 s on the clock, past its 1 s limit and the server's wait for the worker (the graces).
CROWD = 7
WORK_CPU_S = 0.6


def test_calls_and_checks_slowed_by_a_crowded_cpu_are_not_ended_and_replace_no_worker(tmp_path):
    spec = counter_spec(env_class_code=COUNTER_CODE + WORK_METHOD)
    heavy = write_bundle(tmp_path, spec, [counter_scenario(checklist_with_func=[HEAVY_CHECK])])
    with one_crowded_cpu(CROWD):
        with serve(heavy, "--call-timeout", str(CALL_TIMEOUT_S), "--check-timeout", str(CALL_TIMEOUT_S)) as server, \
                server.client() as http:
            episode = new_episode(http)
            started = time.monotonic()
            worked = call(http, episode, "work", {"cpu_seconds": WORK_CPU_S})
            took = time.monotonic() - started
            assert not worked["isError"], worked
            validated = http.post(f"/episodes/{episode}/validate", json={}, timeout=60)
            assert validated.status_code == 200 and validated.json()["score"] == 1.0, validated.text
            assert worker_restarts(http) == 0
            # The crowd slowed the call past what its worker, and the server, would have waited on the clock.
            assert took > CALL_TIMEOUT_S + ABANDON_GRACE_S + GRACE_S, took

            hung = call(http, episode, "spin", {})
            assert hung["isError"] and "ran longer than" in hung["content"][0]["text"], hung
