"""``envscaler serve``: environment code in a worker process that the server kills.

Real servers and real workers (sandboxed where they can confine themselves). A tool that holds the GIL in a C loop
(the cooperative time limit cannot stop it), that ends its process, or whose thread cannot be
stopped costs only its own call: the call gets an error and is undone (within its limit plus the
grace when it ran alone; when other calls were in flight, it is run again alone before it is
blamed), and every episode the worker held is rebuilt in the new worker from its calls, a call that
was only caught up in the fall included. What the worker says about which call it ran cannot make
the server blame another. An episode whose calls do not replay the same way is reported lost (its
validation answers 410, never a score).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from envscaler.bundle import load_bundle
from envscaler.models import CheckItem
from envscaler.sandbox import sandbox_problem
from envscaler.runtime import EnvRuntime
from servers.episodes.store import EpisodeStore
from servers.errors import LimitReached, UnknownEpisode
from servers.workers.env_worker import THREAD_CHECK_S
from servers.workers.process import GRACE_S
from servers.workers.store import WorkerEpisodeStore
from servers.workers.wire import WorkerSettings
from tests.support.bundles import COUNTER_CODE, counter_scenario, counter_spec, write_bundle
from tests.support.server import serve

pytestmark = pytest.mark.timeout(120)

CALL_TIMEOUT_S = 1.0
WORKER_TOOLS = '''
    def c_loop(self) -> dict:
        """Hold the GIL in one C call far longer than any limit."""
        import itertools
        return {"success": True, "data": sum(itertools.repeat(1, 10**12))}

    def die(self) -> dict:
        """End the process at once, with no exception to catch."""
        import os
        os._exit(3)

    def roll(self, item_id: str) -> dict:
        """Set an item's count to a random number (a replay cannot give it again)."""
        import random
        self.items[item_id]["count"] = random.randrange(10**9)
        return {"success": True, "data": self.items[item_id]}

    def cheat(self) -> dict:
        """Make every check pass, as far as this process goes."""
        import builtins
        import envscaler.checks
        import envscaler.runtime
        from envscaler.models import CheckResult
        envscaler.checks.run_check = lambda item, views, limit: CheckResult(check_item=item.check_item, passed=True)
        envscaler.checks.check_states = lambda checklist, *args: [CheckResult(check_item=i.check_item, passed=True) for i in checklist]
        envscaler.runtime.Episode.changes = lambda episode: []
        builtins.bool = lambda value=False: True
        return {"success": True}

    def frame(self) -> dict:
        """Name another episode (when this process holds one) as the one whose code every thread runs, in
        the page of marks the server reads when this process freezes, then freeze it."""
        import gc
        import itertools
        import threading
        found = gc.get_objects()
        marks = next(o for o in found if type(o).__name__ == "RunningMarks")
        store = next(o for o in found if type(o).__name__ == "MarkedEpisodeStore")
        mine = marks.read()[store._slots[threading.get_ident()]]
        other = next((o.episode_id for o in found if type(o).__name__ == "LiveEpisode" and o.episode_id != mine), mine)
        for slot in range(marks.SLOTS):
            marks.set(slot, other)
        return {"success": True, "data": sum(itertools.repeat(1, 10**12))}

    def where(self) -> dict:
        """Which process runs this code: its pid and start time (pids repeat in a PID namespace)."""
        with open("/proc/self/stat") as stat:
            fields = stat.read().split()
        return {"success": True, "data": [fields[0], fields[21]]}

    def get_item('''
MCP_HEADERS = {"MCP-Protocol-Version": "2026-07-28"}
# How long a call that freezes its worker may take: its limit, the grace before it is abandoned and the
# grace before its worker counts as frozen...
DEADLINE_S = CALL_TIMEOUT_S + 0.5 + GRACE_S
# ... twice when other calls were in flight (it is run again alone before it is blamed), with a new
# worker started in between (a few seconds at most on a small, shared machine).
SHARED_FALL_S = 2 * DEADLINE_S + 3.0
# How long a call caught up in another's fall may take: that one deadline, and a new worker to run it again on.
CAUGHT_UP_S = DEADLINE_S + 3.0


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    spec = counter_spec(env_id="workerhost", env_class_code=COUNTER_CODE.replace("\n    def get_item(", WORKER_TOOLS, 1))
    return write_bundle(tmp_path_factory.mktemp("worker"), spec, [counter_scenario(env_id="workerhost", task_id="workerhost_001")])


def new_episode(http: httpx.Client) -> str:
    created = http.post("/episodes", json={"scenario_id": "workerhost_001"})
    assert created.status_code == 201, created.text
    return created.json()["episode_id"]


def call(http: httpx.Client, episode_id: str, name: str, arguments: dict | None = None) -> dict:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments or {}}}
    # json.dumps escapes what UTF-8 cannot carry (a lone surrogate), as every JSON writer does.
    reply = http.post(f"/episodes/{episode_id}/mcp", content=json.dumps(body).encode(),
                      headers={**MCP_HEADERS, "Content-Type": "application/json"})
    assert reply.status_code == 200, reply.text
    return reply.json()["result"]


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took."""
    started = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - started


def worker_pid(http: httpx.Client, episode_id: str) -> str:
    result = call(http, episode_id, "where")
    assert not result["isError"], result
    return result["content"][0]["text"]


def count_of(http: httpx.Client, episode_id: str) -> int:
    result = call(http, episode_id, "get_item", {"item_id": "a"})
    assert not result["isError"], result
    return json.loads(result["content"][0]["text"])["data"]["count"]


def test_a_tool_that_holds_the_gil_costs_only_its_own_call(bundle):
    with serve(bundle, "--call-timeout", str(CALL_TIMEOUT_S)) as server, server.client() as http:
        bystander, attacker = new_episode(http), new_episode(http)
        for episode in (bystander, attacker):
            assert not call(http, episode, "add", {"item_id": "a"})["isError"]
        with ThreadPoolExecutor(2) as pool:
            # A call on a thread when the worker freezes: it is only caught up in the fall.
            caught_up = pool.submit(timed, call, http, bystander, "slow_add", {"item_id": "a", "seconds": 0.3})
            time.sleep(0.1)
            result, took = timed(call, http, attacker, "c_loop")
            answer, waited = caught_up.result()
            assert not answer["isError"], answer
        # The call caught up in the fall ran again at once on the new worker, before the attacker's ran alone.
        assert waited < CAUGHT_UP_S, waited
        text = result["content"][0]["text"]
        assert result["isError"] and "did not answer tool 'c_loop'" in text and "the call was undone" in text, result
        assert took < SHARED_FALL_S, took
        # A health probe alone finds the server able to serve again: it starts the new worker.
        health = httpx.get(f"{server.url}/healthz")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text

        # Nothing else was lost: both episodes were rebuilt in the new worker from their calls, the
        # call that was caught up ran once, and the attacker goes on from before its bad call.
        assert count_of(http, bystander) == 2 and count_of(http, attacker) == 1
        for episode in (bystander, attacker):
            assert http.post(f"/episodes/{episode}/validate").status_code == 200
            assert http.get(f"/episodes/{episode}/state").json()["state"]["items"]["a"]["count"] in (1, 2)
        assert [c["name"] for c in http.get(f"/episodes/{bystander}/trajectory").json()["calls"]] == ["add", "slow_add", "get_item"]
        trajectory = http.get(f"/episodes/{attacker}/trajectory").json()
        assert trajectory["timeouts"] == 1 and [c["error_kind"] for c in trajectory["calls"]] == [None, "timeout", None]
        # Two restarts: the fall the two calls shared, and the attacker's when it ran again alone. Each
        # episode was rebuilt twice: after the first fall (to run again), and after the second (for its next call).
        info = http.get("/info").json()
        assert info["worker_restarts"] == 2 and info["episodes_rebuilt"] == 4 and info["episodes_lost"] == 0, info


# How the victim's call is in flight when the attacker freezes the worker: asleep on a call thread, or
# sent while the worker is already frozen (queued behind the attacker's call on its event loop).
VICTIM_CALLS = {"on_a_thread": ("slow_add", {"item_id": "a", "seconds": 0.3}), "queued": ("add", {"item_id": "a"})}


@pytest.mark.parametrize("victim_call", list(VICTIM_CALLS))
def test_environment_code_cannot_make_the_server_blame_another_episode(bundle, victim_call):
    name, arguments = VICTIM_CALLS[victim_call]
    with serve(bundle, "--call-timeout", str(CALL_TIMEOUT_S)) as server, server.client() as http:
        victim, attacker = new_episode(http), new_episode(http)
        assert not call(http, victim, "add", {"item_id": "a"})["isError"]
        with ThreadPoolExecutor(2) as pool:
            first, second = (victim, attacker) if victim_call == "on_a_thread" else (attacker, victim)
            started = time.monotonic()
            calls = {first: pool.submit(call, http, first, *((name, arguments) if first == victim else ("frame",)))}
            time.sleep(0.1 if victim_call == "on_a_thread" else 0.5)
            calls[second] = pool.submit(call, http, second, *((name, arguments) if second == victim else ("frame",)))
            added, framed = calls[victim].result(), calls[attacker].result()
            took = time.monotonic() - started
        # The victim's call ran as if nothing had happened: once, with its right answer, and it stays.
        assert not added["isError"] and json.loads(added["content"][0]["text"])["data"]["count"] == 2, added
        text = framed["content"][0]["text"]
        assert framed["isError"] and "did not answer tool 'frame'" in text and "the call was undone" in text, framed
        assert took < SHARED_FALL_S, took
        trajectory = http.get(f"/episodes/{victim}/trajectory").json()
        assert [(c["name"], c["error_kind"]) for c in trajectory["calls"]] == [("add", None), (name, None)], trajectory
        assert http.get(f"/episodes/{victim}/state").json()["state"]["items"]["a"]["count"] == 2
        assert count_of(http, victim) == 2
        assert [c["error_kind"] for c in http.get(f"/episodes/{attacker}/trajectory").json()["calls"]] == ["timeout"]
        assert http.get("/info").json()["episodes_lost"] == 0


# When the caller of a call that fell with another's, and whose episode the page names (so it is to run
# again alone, once the other has run again), gives up: as the fall hands it its turn, or while it waits for it.
GIVE_UP = ["at_the_fall", "waiting_for_its_turn"]


@pytest.mark.parametrize("when", GIVE_UP)
def test_a_suspect_whose_caller_gives_up_holds_up_no_one(bundle, when):
    async def scenario() -> None:
        store = worker_store(bundle)
        try:
            victim, attacker = [await store.create("workerhost_001", None) for _ in range(2)]
            assert not (await store.call_tool(victim, "add", {"item_id": "a"})).error
            suspect = asyncio.create_task(store.call_tool(victim, "slow_add", {"item_id": "a", "seconds": 0.3}))
            await asyncio.sleep(0.1)
            if when == "at_the_fall":
                lost = store.worker.on_lost
                store.worker.on_lost = lambda reason: (lost(reason), asyncio.get_running_loop().call_soon(suspect.cancel))
            framed = asyncio.create_task(store.call_tool(attacker, "frame", {}))
            if when == "waiting_for_its_turn":
                while store.worker.restarts == 0:  # the attacker runs again on a new worker; the victim waits for its turn
                    await asyncio.sleep(0.05)
                suspect.cancel()
            outcome = await framed
            assert outcome.error_kind == "timeout" and "did not answer tool 'frame'" in (outcome.error or ""), outcome
            assert suspect.cancelled()
            # No turn is left for a caller that is gone: the worker serves the others at once.
            later = await asyncio.wait_for(store.create("workerhost_001", None), CALL_TIMEOUT_S + GRACE_S)
            for live in (later, victim):
                outcome = await asyncio.wait_for(store.call_tool(live, "get_item", {"item_id": "a"}), CALL_TIMEOUT_S + GRACE_S)
                assert not outcome.error, outcome
            assert store.lost == 0
        finally:
            store.close()

    asyncio.run(scenario())


def worker_store(bundle: Path) -> WorkerEpisodeStore:
    """A store whose episodes live in a real worker process (unsandboxed: the store is driven from this test's loop)."""
    settings = WorkerSettings(bundle=load_bundle(bundle), call_timeout_s=CALL_TIMEOUT_S, check_timeout_s=CALL_TIMEOUT_S,
                              max_result_chars=100_000, worker_threads=4, inline_budget_s=0.02, memory_reserve_mb=0)
    return WorkerEpisodeStore(load_bundle(bundle), settings, sandbox=False, max_episodes=8, idle_ttl_s=600)


def counts(live) -> list[int | None]:
    """Item a's count as each call of the episode's record left it (None for a call that failed)."""
    return [None if outcome.error else outcome.result["data"]["count"] for outcome in live.calls]


def test_concurrent_calls_of_one_episode_go_out_together_and_run_in_the_order_recorded(bundle):
    async def scenario() -> None:
        store = worker_store(bundle)
        try:
            live, bystander = [await store.create("workerhost_001", None) for _ in range(2)]
            slow = asyncio.create_task(store.call_tool(live, "slow_add", {"item_id": "a", "seconds": 0.3}))
            await asyncio.sleep(0.05)
            adds = [asyncio.create_task(store.call_tool(live, "add", {"item_id": "a"})) for _ in range(5)]
            await asyncio.sleep(0.05)
            # All six are out to the worker while the first still sleeps there: none waited for another's answer.
            assert live.gate.in_flight == 6
            # A validation asked now waits for them all, and a call asked after it waits for it.
            six = CheckItem(check_item="a counts 6", check_func="def check_func(final_state):\n    return final_state['items']['a']['count'] == 6")
            validation = asyncio.create_task(store.validate(live, [six]))
            await asyncio.sleep(0)
            after = asyncio.create_task(store.call_tool(live, "add", {"item_id": "a"}))
            await asyncio.sleep(0.05)
            assert live.gate.in_flight == 6 and not validation.done() and not after.done()
            outcomes = [await slow, *[await add for add in adds]]
            assert not any(outcome.error for outcome in outcomes), outcomes
            assert (await validation).score == 1.0
            assert (await after).result["data"]["count"] == 7
            # The worker ran them one at a time, in the order the record holds them.
            assert counts(live) == [1, 2, 3, 4, 5, 6, 7]
            # A new worker rebuilds the episode from that record: each call gives the same answer again.
            assert (await store.call_tool(bystander, "die", {})).error
            assert (await store.call_tool(live, "get_item", {"item_id": "a"})).result["data"]["count"] == 7
            assert store.lost == 0 and store.rebuilt >= 1
        finally:
            store.close()

    asyncio.run(scenario())


def in_process_store(bundle: Path, max_episodes: int = 8) -> EpisodeStore:
    """A store whose episodes live in this process, as a worker process's own store holds them."""
    loaded = load_bundle(bundle)
    return EpisodeStore(loaded, EnvRuntime(loaded.spec), worker_threads=4, inline_budget_s=0.02, max_episodes=max_episodes, idle_ttl_s=600)


@pytest.mark.parametrize("make_store", [worker_store, in_process_store], ids=["in_a_worker", "in_process"])
def test_requests_waiting_at_an_episode_ended_meanwhile_are_told_so_and_leave_nothing_behind(bundle, make_store):
    async def scenario() -> None:
        store = make_store(bundle)
        try:
            live = await store.create("workerhost_001", None)
            slow = asyncio.create_task(store.call_tool(live, "slow_add", {"item_id": "a", "seconds": 0.3}))
            await asyncio.sleep(0.05)
            one = CheckItem(check_item="a counts 1", check_func="def check_func(final_state):\n    return final_state['items']['a']['count'] == 1")
            waiting = [asyncio.create_task(store.validate(live, [one])),
                       asyncio.create_task(store.call_tool(live, "add", {"item_id": "a"})),
                       asyncio.create_task(store.reset(live, "workerhost_001", None))]
            await asyncio.sleep(0.05)
            assert not any(task.done() for task in waiting)
            store.end(live.episode_id)
            # The call already out ran to its end; each request that waited for its turn learns the episode ended.
            outcome = await slow
            assert not outcome.error, outcome.error
            assert outcome.result["data"]["count"] == 1
            for task in waiting:
                with pytest.raises(UnknownEpisode, match="ended while this request waited for its turn"):
                    await task
            if isinstance(store, WorkerEpisodeStore):
                # No record to rebuild it from and no name for it in the worker is left behind.
                assert live.episode_id not in store._histories and live.episode_id not in store._handles
            other = await store.create("workerhost_001", None)
            assert (await store.call_tool(other, "add", {"item_id": "a"})).result["data"]["count"] == 1
        finally:
            store.close()

    asyncio.run(scenario())


def test_an_ended_episode_whose_call_still_runs_counts_against_the_episode_limit(bundle):
    async def scenario() -> None:
        store = in_process_store(bundle, max_episodes=1)
        try:
            live = await store.create("workerhost_001", None)
            slow = asyncio.create_task(store.call_tool(live, "slow_add", {"item_id": "a", "seconds": 0.3}))
            await asyncio.sleep(0.05)
            store.end(live.episode_id)
            # Its state is held until the call ends: a create and delete loop cannot hold more than the limit.
            with pytest.raises(LimitReached, match="ended ones whose calls still run"):
                await store.create("workerhost_001", None)
            assert not (await slow).error
            await asyncio.sleep(0.05)
            assert (await store.create("workerhost_001", None)).episode_id != live.episode_id
        finally:
            store.close()

    asyncio.run(scenario())


def test_calls_of_one_episode_caught_up_in_its_own_calls_fall_are_asked_again_one_at_a_time(bundle):
    async def scenario() -> None:
        store = worker_store(bundle)
        try:
            live = await store.create("workerhost_001", None)
            frozen = asyncio.create_task(store.call_tool(live, "c_loop", {}))
            await asyncio.sleep(0.1)
            # Sent behind it: the worker's event loop is frozen, so they wait in its socket.
            adds = [asyncio.create_task(store.call_tool(live, "add", {"item_id": "a"})) for _ in range(3)]
            await asyncio.sleep(0.05)
            assert live.gate.in_flight == 4
            while store.worker.restarts == 0:
                await asyncio.sleep(0.05)
            # A call asked after the fall joins none of those asked again: it waits until they have all ended.
            later = asyncio.create_task(store.call_tool(live, "add", {"item_id": "a"}))
            outcome = await frozen
            assert outcome.error_kind == "timeout" and "did not answer tool 'c_loop'" in (outcome.error or ""), outcome
            assert not any(outcome.error for outcome in [await add for add in adds]), adds
            assert (await later).result["data"]["count"] == 4
            # The freezing call was blamed once it ran again alone; the others ran once each, in the order recorded.
            assert [outcome.error_kind for outcome in live.calls] == ["timeout", None, None, None, None]
            assert counts(live) == [None, 1, 2, 3, 4]
            assert store.worker.restarts == 2 and store.lost == 0
        finally:
            store.close()

    asyncio.run(scenario())


def test_an_episode_whose_calls_do_not_replay_the_same_is_reported_lost_never_scored(bundle):
    with serve(bundle, "--call-timeout", str(CALL_TIMEOUT_S)) as server, server.client() as http:
        random_one, steady = new_episode(http), new_episode(http)
        assert not call(http, random_one, "roll", {"item_id": "a"})["isError"]
        assert not call(http, steady, "add", {"item_id": "a"})["isError"]
        assert call(http, new_episode(http), "die")["isError"]

        lost = call(http, random_one, "get_item", {"item_id": "a"})
        text = lost["content"][0]["text"]
        assert lost["isError"] and "This episode is lost" in text and "replaying call 1 of 1 (roll)" in text, lost
        validation = http.post(f"/episodes/{random_one}/validate")
        assert validation.status_code == 410 and "lost" in validation.json()["error"], validation.text
        assert http.get(f"/episodes/{random_one}/state").status_code == 410
        # Its record is kept, and a reset builds it again.
        assert [c["name"] for c in http.get(f"/episodes/{random_one}/trajectory").json()["calls"]] == ["roll", "get_item"]
        assert http.post(f"/episodes/{random_one}/reset").status_code == 200
        assert count_of(http, random_one) == 0
        assert count_of(http, steady) == 1
        assert http.get("/info").json()["episodes_lost"] == 1


@pytest.mark.parametrize("flags", [(), ("--no-sandbox",)], ids=["sandboxed", "unsandboxed"])
def test_a_worker_that_exits_costs_only_its_call_and_the_server_keeps_serving(bundle, flags):
    with serve(bundle, "--call-timeout", str(CALL_TIMEOUT_S), *flags) as server, server.client() as http:
        first, bystander = new_episode(http), new_episode(http)
        assert not call(http, bystander, "add", {"item_id": "a"})["isError"]
        before = worker_pid(http, first)
        started = time.monotonic()
        result = call(http, first, "die")
        assert time.monotonic() - started < 2.0
        text = result["content"][0]["text"]
        assert result["isError"] and "environment worker exited" in text and "the call was undone" in text, result
        assert http.get(f"/episodes/{first}/trajectory").json()["env_errors"] == 1
        assert worker_pid(http, first) != before
        assert count_of(http, bystander) == 1
        assert server.process.poll() is None


def test_a_server_whose_spawner_was_killed_starts_its_next_worker_from_a_new_one(bundle):
    with serve(bundle, "--call-timeout", str(CALL_TIMEOUT_S)) as server, server.client() as http:
        episode = new_episode(http)
        assert not call(http, episode, "add", {"item_id": "a"})["isError"]
        spawners = [pid for pid in children(server.process.pid) if Path(f"/proc/{pid}/comm").read_text().strip() == "spawner"]
        assert len(spawners) == 1, spawners
        # Its workers die with it. The next call finds its worker gone, and a new spawner forks another,
        # where the episode is rebuilt from its calls: the call answers as before.
        os.kill(spawners[0], signal.SIGKILL)
        time.sleep(0.5)
        assert count_of(http, episode) == 1
        assert server.process.poll() is None
        assert [pid for pid in children(server.process.pid) if pid != spawners[0]], "no new spawner"


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_call_whose_thread_cannot_be_stopped_is_undone_with_its_worker(bundle):
    with serve(bundle, "--call-timeout", str(CALL_TIMEOUT_S)) as server, server.client() as http:
        episode = new_episode(http)
        assert not call(http, episode, "add", {"item_id": "a"})["isError"]
        before = worker_pid(http, episode)
        started = time.monotonic()
        # A sleep on a call thread: the limit's exception only lands when the sleep ends.
        result = call(http, episode, "nap", {"seconds": 1000})
        assert time.monotonic() - started < CALL_TIMEOUT_S + 0.5 + GRACE_S, result
        text = result["content"][0]["text"]
        assert result["isError"] and "abandoned" in text and "the call was undone" in text, result
        assert worker_pid(http, episode) != before
        assert count_of(http, episode) == 1
        assert http.get("/info").json()["stuck_calls"] == 0


def test_an_idle_server_and_its_worker_do_not_wake(bundle):
    # The worker looks for threads left running only while environment code may have run since its last look;
    # the server sweeps connections only while it holds some, and looks for expired episodes while it holds some.
    with serve(bundle) as server:
        with server.client() as http:
            episode = new_episode(http)
            assert not call(http, episode, "add", {"item_id": "a"})["isError"]
            assert http.delete(f"/episodes/{episode}").status_code == 200
        (worker,) = [pid for pid in descendants(server.process.pid) if Path(f"/proc/{pid}/comm").read_text().strip() == "env-worker"]
        time.sleep(3 * THREAD_CHECK_S)  # the worker's looks after the call, the server's last sweep
        before = [wakeups(server.process.pid), wakeups(worker)]
        time.sleep(4 * THREAD_CHECK_S)
        assert [wakeups(server.process.pid), wakeups(worker)] == before
        with server.client() as http:
            assert http.get("/healthz").status_code == 200


def descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [grandchild for child in found for grandchild in descendants(child)]


def wakeups(pid: int) -> int:
    """How many times process ``pid``'s threads have gone to sleep and woken so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def test_environment_code_that_patches_the_checker_does_not_decide_its_reward(bundle):
    with serve(bundle) as server, server.client() as http:
        honest, cheater = new_episode(http), new_episode(http)
        for episode in (honest, cheater):
            assert not call(http, episode, "add", {"item_id": "a"})["isError"]
        assert not call(http, cheater, "cheat")["isError"]
        # The checks (a counts 3, ...) run in the check worker, on the state the episodes really have.
        scores = [http.post(f"/episodes/{episode}/validate").json()["score"] for episode in (honest, cheater)]
        assert scores[0] == scores[1] < 1.0, scores


def test_a_check_that_freezes_costs_only_its_validation(bundle):
    with serve(bundle, "--check-timeout", "1") as server, server.client() as http:
        episode = new_episode(http)
        assert not call(http, episode, "add", {"item_id": "a"})["isError"]
        frozen = {"check_item": "never ends", "check_func": "def check_func(final_state):\n    import itertools\n"
                  "    return sum(itertools.repeat(1, 10**12)) > 0"}
        started = time.monotonic()
        answer = http.post(f"/episodes/{episode}/validate", json={"checklist": [frozen]})
        assert answer.status_code == 504 and time.monotonic() - started < 1 + 0.5 + 0.5 + GRACE_S + 1.0, answer.text
        # The episode and the environment worker are untouched; the checks' own process was killed.
        assert count_of(http, episode) == 1
        assert http.post(f"/episodes/{episode}/validate").status_code == 200


# Checks that make every later check pass, were they run in the same process.
POISONING_CHECKS = [
    {"check_item": "bool", "check_func": "def check_func(final_state):\n    import builtins\n    builtins.bool = lambda *a: True\n"
     "    return True"},
    {"check_item": "checker", "check_func": (
        "def check_func(final_state):\n"
        "    import envscaler.checks\n"
        "    from envscaler.models import CheckResult\n"
        "    envscaler.checks.run_check = lambda item, views, limit: CheckResult(check_item=item.check_item, passed=True)\n"
        "    envscaler.checks.check_states = lambda checklist, *args: [CheckResult(check_item=i.check_item, passed=True) for i in checklist]\n"
        "    return True")},
]


@pytest.mark.parametrize("flags", [(), ("--no-sandbox",)], ids=["sandboxed", "unsandboxed"])
def test_a_check_that_poisons_its_process_decides_no_other_validation(bundle, flags):
    with serve(bundle, *flags) as server, server.client() as http:
        untouched = new_episode(http)
        poisoner = new_episode(http)
        poisoned = http.post(f"/episodes/{poisoner}/validate", json={"checklist": POISONING_CHECKS})
        assert poisoned.status_code == 200 and poisoned.json()["score"] == 1.0, poisoned.text
        exits = {"check_item": "exits", "check_func": "def check_func(final_state):\n    import os\n    os._exit(3)"}
        died = http.post(f"/episodes/{poisoner}/validate", json={"checklist": [exits]})
        assert died.status_code == 409 and "exit code 3" in died.json()["error"], died.text
        # The scenario's checks on its initial state: a counts 0 (fails), its name and the one item are kept.
        validation = http.post(f"/episodes/{untouched}/validate").json()
        assert [c["passed"] for c in validation["checks"]] == [False, True, True], validation
        assert validation["score"] == pytest.approx(2 / 3)


# A check that finds its process untouched by any earlier check, marks it, and reports which process it is
# and how many files it holds open besides stdin, stdout and stderr.
FRESH_PROCESS_CHECKS = [
    {"check_item": "fresh", "check_func": "def check_func(final_state):\n    import builtins\n"
     "    fresh = not hasattr(builtins, 'earlier_check')\n    builtins.earlier_check = True\n    return fresh"},
    {"check_item": "which process", "check_func": (
        "def check_func(final_state):\n"
        "    import os\n"
        "    with open('/proc/self/stat') as stat:\n"
        "        fields = stat.read().split()\n"
        "    fds = [fd for fd in os.listdir('/proc/self/fd') if int(fd) > 2 and os.path.exists('/proc/self/fd/' + fd)]\n"
        "    raise RuntimeError(f'{fields[0]} started at {fields[21]} holds {len(fds)} files')")},
]


@pytest.mark.parametrize("flags", [(), ("--no-sandbox",)], ids=["sandboxed", "unsandboxed"])
def test_each_validation_runs_its_checks_in_a_process_of_its_own(bundle, flags):
    with serve(bundle, *flags) as server, server.client() as http:
        episodes = [new_episode(http), new_episode(http)]
        # A private episode whose states are too large to hand to a waiting process: one is forked for it.
        large = http.post("/episodes", json={"init_config": {"items": {"a": {"name": "A" * 300_000, "count": 0}}}})
        assert large.status_code == 201, large.text
        processes = []
        for episode in [*episodes, episodes[0], large.json()["episode_id"], episodes[1]]:
            validation = http.post(f"/episodes/{episode}/validate", json={"checklist": FRESH_PROCESS_CHECKS})
            assert validation.status_code == 200, validation.text
            fresh, which = validation.json()["checks"]
            assert fresh["passed"] and fresh["error"] is None, validation.text
            processes.append(which["error"])
        # Its answer's pipe only: not the pipe of a process kept ready for a later validation.
        assert all(process.endswith(" holds 1 files (check line 6)") for process in processes), processes
        assert len(set(processes)) == len(processes), processes


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")
def test_the_checks_process_cannot_start_processes_even_past_the_guard(bundle):
    # posix.fork is the C function itself: the guard only wraps os.fork. The seccomp policy refuses it.
    forks = {"check_item": "forks", "check_func": "def check_func(final_state):\n    import posix\n    return posix.fork() > 0"}
    with serve(bundle) as server, server.client() as http:
        validation = http.post(f"/episodes/{new_episode(http)}/validate", json={"checklist": [forks]}).json()
        assert validation["checks"][0]["error"].startswith("PermissionError: [Errno 1] Operation not permitted"), validation


# A check that opens the memory of the process that forked it (the check zygote, which forks every later
# validation's process): were it writable, the check could rewrite that zygote and decide later rewards.
REACHES_ITS_ZYGOTE = {"check_item": "zygote", "check_func": (
    "def check_func(final_state):\n"
    "    import os\n"
    "    with open(f'/proc/{os.getppid()}/mem', 'r+b'):\n"
    "        return True")}


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")
def test_the_checks_process_cannot_reach_the_memory_of_its_zygote(bundle):
    with serve(bundle) as server, server.client() as http:
        episode = new_episode(http)
        for _ in range(2):
            validation = http.post(f"/episodes/{episode}/validate", json={"checklist": [REACHES_ITS_ZYGOTE, *FRESH_PROCESS_CHECKS]}).json()
            reached, fresh, _which = validation["checks"]
            assert reached["error"].startswith("PermissionError: [Errno 13] Permission denied: '/proc/1/mem'"), validation
            assert fresh["passed"], validation


def test_the_worker_holds_no_token_and_normal_episodes_score_as_without_it(bundle):
    with serve(bundle) as server, server.client() as http:
        episode = new_episode(http)
        for step in counter_scenario()["reference_solution"]:
            assert not call(http, episode, step["name"], step["arguments"])["isError"]
        assert http.post(f"/episodes/{episode}/validate").json()["score"] == 1.0
        assert http.get(f"/episodes/{episode}/state").json()["state"]["items"]["a"]["count"] == 3
        assert f'"{server.process.pid}"' not in worker_pid(http, episode)
        info = http.get("/info").json()
        assert info["limits"]["worker_process"] is True and info["call_threads"] >= 0


def test_a_lone_surrogate_crosses_the_worker_socket_both_ways_and_costs_no_episode(bundle):
    with serve(bundle) as server, server.client() as http:
        bystander = new_episode(http)
        episode = new_episode(http)
        renamed = call(http, episode, "rename", {"item_id": "a", "name": "q\udfffz"})
        assert not renamed["isError"], renamed
        read = call(http, episode, "get_item", {"item_id": "a"})
        assert not read["isError"] and json.loads(read["content"][0]["text"])["data"]["name"] == "q\udfffz", read
        state = http.get(f"/episodes/{episode}/state")
        assert state.status_code == 200 and state.json()["state"]["items"]["a"]["name"] == "q\udfffz"
        assert http.get(f"/episodes/{episode}/trajectory").json()["calls"][0]["arguments"] == {"item_id": "a", "name": "q\udfffz"}
        assert not call(http, bystander, "get_item", {"item_id": "a"})["isError"]


@pytest.mark.parametrize("module", ["servers.workers.env_worker", "servers.workers.check_worker"])
def test_a_worker_started_by_hand_says_how_it_is_started(module):
    for argv in ([], ["not-a-fd"], ["3", "4"]):
        started = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=60)
        assert started.returncode == 2 and "started by an environment server, not by hand" in started.stderr, (argv, started.stderr)
