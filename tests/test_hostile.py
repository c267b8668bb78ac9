"""One bad environment breaks only itself: hostile environment code against a process farm and ``catalog check``.

Each attack is a tool of the ``wall`` bundle (``tests/support/hostile.py``): one that gets past the
in-process guard with the originals it keeps, or that no guard inside a process can stop (a C loop,
a crash, a result nested a million deep). A process farm (sandboxed where workers can confine themselves) runs it next to
a plain counter environment, with a call and check limit of 1 s. For each attack:

- the bad call gets an error within its limit plus the grace, twice over when other calls were in
  flight on its worker (it is run again alone before it is blamed); on a machine short of CPU, later by
  what the server says the machine cost it (its deadlines moved by the worker's waits for a CPU, its
  worker's replacements slower than the bound allows);
- an episode of the same environment and one of the other keep calling while it happens, and answer
  every call correctly, each within a bound tied to the limits (the other environment's within one
  bad call's time, the same environment's, caught up in a fall and run again, within two);
- nothing else is lost: both bystanders end with exactly the state and the records their calls made.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from servers.episodes.store import ABANDON_GRACE_S
from servers.workers.process import GRACE_S, START_TIMEOUT_S
from tests.support.bundles import counter_bundle, counter_scenario
from tests.support.cli import envscaler
from tests.support.hostile import wall_bundle

pytestmark = pytest.mark.timeout(600)

CALL_TIMEOUT_S = 1.0
# What starting a sandboxed worker may take on a small machine that is busy (1.3-2.6 s seen on 2 cores
# at a load of 5-7).
RESTART_S = 3.0
# The longest a bad call may take: its limit, the grace before it is abandoned, the grace before its
# worker counts as frozen, and the worker's replacement.
WITHIN_S = CALL_TIMEOUT_S + ABANDON_GRACE_S + GRACE_S + RESTART_S
# The longest a bystander's call may take: one of its own environment's may be caught up in a fall and
# run again once the worker is replaced. Bounds tied to the limits, not to how fast the machine is today.
BYSTANDER_WITHIN_S = {"same": 2 * WITHIN_S, "other": WITHIN_S}
# The longest a bad call may take when a bystander's call was in flight on its worker when it fell: it
# is run again alone before it is blamed, a second deadline on a second new worker.
SHARED_WITHIN_S = 2 * WITHIN_S


@dataclass
class Endpoint:
    """One environment of the farm, as its catalog names it."""

    url: str
    token: str

    def control(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=60)

    def new_episode(self, http: httpx.Client, scenario_id: str) -> dict:
        created = http.post("/episodes", json={"scenario_id": scenario_id})
        assert created.status_code == 201, created.text
        return created.json()


def call(http: httpx.Client, mcp_url: str, name: str, arguments: dict) -> dict:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    reply = http.post(mcp_url, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert reply.status_code == 200, reply.text
    return reply.json()["result"]


@dataclass
class Bystander:
    """An episode that keeps adding 1 to item ``a``: every call must answer, and the count must add up."""

    endpoint: Endpoint
    episode: dict
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60))
    adds: int = 0

    def step(self) -> float:
        started = time.perf_counter()
        result = call(self.http, self.episode["mcp_url"], "add", {"item_id": "a"})
        took = time.perf_counter() - started
        assert not result["isError"], result
        self.adds += 1
        assert json.loads(result["content"][0]["text"])["data"]["count"] == self.adds, result
        return took


@dataclass
class Farm:
    wall: Endpoint
    victim: Endpoint
    same: Bystander
    other: Bystander
    logs: Path  # the servers' logs, one file per environment


@pytest.fixture(scope="module")
def farm(tmp_path_factory) -> Iterator[Farm]:
    root = tmp_path_factory.mktemp("hostile")
    wall, victim = wall_bundle(root / "wall"), counter_bundle(root / "victim")
    catalog = root / "farm.json"
    up = envscaler("farm", "up", str(wall), str(victim), "--backend", "process", "--catalog", str(catalog),
                   "--call-timeout", f"{CALL_TIMEOUT_S:g}", "--check-timeout", f"{CALL_TIMEOUT_S:g}")
    assert up.returncode == 0, up.stderr
    try:
        envs = json.loads(catalog.read_text())["envs"]
        endpoints = {env_id: Endpoint(envs[env_id]["url"], envs[env_id]["token"]) for env_id in ("wall", "counter")}
        with endpoints["wall"].control() as wall_http, endpoints["counter"].control() as victim_http:
            same = Bystander(endpoints["wall"], endpoints["wall"].new_episode(wall_http, "wall_001"))
            other = Bystander(endpoints["counter"], endpoints["counter"].new_episode(victim_http, "counter_001"))
        yield Farm(endpoints["wall"], endpoints["counter"], same, other, root / "farm.json.farm" / "logs")
    finally:
        # The servers' logs stay in the test's folder for whoever reads a failure.
        shutil.copytree(root / "farm.json.farm" / "logs", root / "logs", dirs_exist_ok=True)
        envscaler("farm", "down", "--catalog", str(catalog))


def while_bystanders_call(farm: Farm, attack) -> tuple[object, float]:
    """Run ``attack()`` while both bystanders keep calling; (its result, seconds it took). Then each
    bystander's every call must have answered within its bound (``BYSTANDER_WITHIN_S``)."""
    latencies: dict[str, list[float]] = {"same": [], "other": []}
    done = threading.Event()

    def keep_calling(name: str, bystander: Bystander) -> None:
        after = 0
        while after < 10:
            latencies[name].append(bystander.step())
            after += done.is_set()

    with ThreadPoolExecutor(2) as pool:
        loops = [pool.submit(keep_calling, name, bystander) for name, bystander in (("same", farm.same), ("other", farm.other))]
        started = time.monotonic()
        try:
            result = attack()
        finally:
            took = time.monotonic() - started
            done.set()
        for loop in loops:
            loop.result()  # every call of both bystanders answered, and the counts added up
    for name, values in latencies.items():
        assert max(values) <= BYSTANDER_WITHIN_S[name], (name, max(values), values)
    return result, took


def log_records(logs: Path, env_id: str) -> list[dict]:
    """The JSON records of ``env_id``'s server log, in order."""
    return [json.loads(line) for line in (logs / f"{env_id}.log").read_text().splitlines() if line.startswith("{")]


def machine_delays(logs: Path, env_id: str, since: float) -> float:
    """What the machine added since ``since`` (``time.time()``) to the bad calls of ``env_id``, by its
    server's log: the waits for a CPU its worker's missed deadlines were moved by, and each replacement's
    start past ``RESTART_S``. Nothing on a machine with CPU to spare."""
    mine = [record for record in log_records(logs, env_id) if record.get("env") == env_id and record.get("ts", 0) >= since]
    waits = sum(record["cpu_wait_s"] for record in mine if record["event"] == "environment worker missed a deadline")
    starts = sum(max(0.0, record["start_s"] - RESTART_S) for record in mine if record["event"] == "environment worker restarted")
    return waits + starts


# (tool, arguments, text of the error the bad call gets, the error's kind); a list of texts and kinds
# where the attack ends one way or the other by the machine's speed.
FREEZES = [
    ("bypass_alarm", {}, "did not answer tool 'bypass_alarm'", "timeout"),
    ("stop_timer", {}, "did not answer tool 'stop_timer'", "timeout"),
    ("slow_switch", {}, "did not answer tool 'slow_switch'", "timeout"),
    ("c_loop", {}, "did not answer tool 'c_loop'", "timeout"),
    ("backtrack", {"text": "a" * 40 + "b"}, "did not answer tool 'backtrack'", "timeout"),
    ("slow_state", {}, "did not answer tool 'slow_state'", "timeout"),
    ("slow_result", {}, "ran longer than 1 s", "timeout"),
    ("exit_now", {}, "SystemExit", "env"),
    ("interrupt", {}, "KeyboardInterrupt", "env"),
    ("exit_in_state", {}, "environment worker exited", "env"),
    # A million-deep result: the C stack overflows (a crash), or making it outruns the limit on a thread
    # (stopped there, or abandoned), or (on a slow machine) it is still being made inline when its worker's deadline passes.
    ("deep", {}, ["environment worker exited", "ran longer than 1 s", "abandoned", "did not answer tool 'deep'"], ["env", "timeout"]),
    ("nap", {"seconds": 90}, "abandoned", "timeout"),
    ("double", {}, "module global SHARED", "env"),
    ("add", {"item_id": "a", "bogus": 1}, "unexpected argument 'bogus'", "agent"),
]


@pytest.mark.parametrize(("tool", "arguments", "text", "kind"), FREEZES, ids=[f[0] for f in FREEZES])
def test_a_bad_call_gets_an_error_in_time_and_costs_nobody_else(farm, tool, arguments, text, kind):
    with farm.wall.control() as http:
        bad = farm.wall.new_episode(http, "wall_001")
        since = time.time()
        result, took = while_bystanders_call(farm, lambda: call(http, bad["mcp_url"], tool, arguments))
        texts, kinds = (text, kind) if isinstance(text, list) else ([text], [kind])
        assert result["isError"] and any(t in result["content"][0]["text"] for t in texts), result
        assert took < SHARED_WITHIN_S + machine_delays(farm.logs, "wall", since), took
        calls = http.get(f"/episodes/{bad['episode_id']}/trajectory").json()["calls"]
        assert len(calls) == 1 and calls[0]["error_kind"] in kinds, calls
        # The bad episode goes on from before its call (or was never touched by it).
        assert not call(http, bad["mcp_url"], "get_item", {"item_id": "a"})["isError"]
        assert json.loads(call(http, bad["mcp_url"], "shared", {})["content"][0]["text"])["data"] == 0


def test_parallel_calls_that_fill_every_call_thread_cost_nobody_else(farm):
    with farm.wall.control() as http:
        bad = [farm.wall.new_episode(http, "wall_001") for _ in range(33)]

        def flood() -> list[dict]:
            with ThreadPoolExecutor(len(bad)) as pool:
                return list(pool.map(lambda episode: call(http, episode["mcp_url"], "nap", {"seconds": 90}), bad))

        since = time.time()
        results, took = while_bystanders_call(farm, flood)
    assert all(r["isError"] for r in results), results
    assert took < WITHIN_S + 2.0 + machine_delays(farm.logs, "wall", since), took
    assert httpx.get(f"{farm.wall.url}/healthz").json()["status"] == "ok"


def test_a_thread_left_running_past_the_guard_costs_only_its_episode(farm):
    with farm.wall.control() as http:
        bad = farm.wall.new_episode(http, "wall_001")

        def linger() -> dict:
            assert not call(http, bad["mcp_url"], "linger_past", {})["isError"]
            time.sleep(2.0)  # the worker finds the thread and ends itself; its episodes are rebuilt
            return call(http, bad["mcp_url"], "get_item", {"item_id": "a"})

        result, _ = while_bystanders_call(farm, linger)
        text = result["content"][0]["text"]
        assert result["isError"] and "lost" in text and "a thread that runs on after the call" in text, result
        assert http.post(f"/episodes/{bad['episode_id']}/validate").status_code == 410


def test_checks_that_exit_or_freeze_cost_only_their_validation(farm):
    exits = {"check_item": "exits", "check_func": "def check_func(final_state):\n    raise SystemExit(1)"}
    freezes = {"check_item": "freezes", "check_func": "def check_func(final_state):\n    import itertools\n"
               "    return sum(itertools.repeat(1, 10**12)) > 0"}
    with farm.wall.control() as http:
        episode = farm.wall.new_episode(http, "wall_001")
        path = f"/episodes/{episode['episode_id']}/validate"
        exited, _ = while_bystanders_call(farm, lambda: http.post(path, json={"checklist": [exits]}))
        assert exited.status_code == 200 and "SystemExit" in exited.json()["checks"][0]["error"], exited.text
        frozen, took = while_bystanders_call(farm, lambda: http.post(path, json={"checklist": [freezes]}))
        assert frozen.status_code == 504 and took < WITHIN_S + 0.5, (frozen.text, took)
        assert http.post(path).status_code == 200


def test_what_an_agent_sends_costs_nobody_else(farm):
    with farm.wall.control() as http:
        episode = farm.wall.new_episode(http, "wall_001")
        nested = "[" * 100_000 + "]" * 100_000
        body = '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": ' + json.dumps("x") + "}, \"x\": " + nested + "}}"
        refused, _ = while_bystanders_call(farm, lambda: http.post(episode["mcp_url"], content=body.encode(),
                                                                   headers={"Content-Type": "application/json"}))
        assert refused.status_code == 400, refused.text
        echoed, _ = while_bystanders_call(farm, lambda: call(http, episode["mcp_url"], "echo", {"text": "a\udfffb"}))
        assert not echoed["isError"] and json.loads(echoed["content"][0]["text"])["data"] == "a\udfffb"
        huge, took = while_bystanders_call(farm, lambda: call(http, episode["mcp_url"], "huge", {}))
        assert not huge["isError"] and "[truncated: the result has 100000000 characters" in huge["content"][0]["text"]
        assert took < WITHIN_S, took
        [*_, last] = http.get(f"/episodes/{episode['episode_id']}/trajectory").json()["calls"]
        assert last["truncated"] and last["result_chars"] == 100_000_000


def test_nothing_else_was_lost(farm):
    # Runs last: every attack above happened while these two kept calling.
    for bystander in (farm.same, farm.other):
        with bystander.endpoint.control() as http:
            episode_id = bystander.episode["episode_id"]
            state = http.get(f"/episodes/{episode_id}/state").json()["state"]
            assert state["items"]["a"]["count"] == bystander.adds
            calls = http.get(f"/episodes/{episode_id}/trajectory").json()["calls"]
            assert len(calls) == bystander.adds and all(c["error"] is None for c in calls)
            assert http.post(f"/episodes/{episode_id}/validate").status_code == 200
    info = farm.wall.control().get("/info").json()
    assert info["episodes_lost"] == 1 and info["worker_restarts"] >= 10, info  # the lingering thread's episode only
    # Each replacement is in the wall's log, naming its environment and how long the new worker took to start.
    restarts = [record for record in log_records(farm.logs, "wall") if record.get("event") == "environment worker restarted"]
    assert len(restarts) == info["worker_restarts"], restarts
    assert all(r["env"] == "wall" and 0 < r["start_s"] < START_TIMEOUT_S for r in restarts), restarts
    assert "restarted" not in (farm.logs / "counter.log").read_text()
    assert httpx.get(f"{farm.victim.url}/info", headers={"Authorization": f"Bearer {farm.victim.token}"}).json()["worker_restarts"] == 0


def test_environment_code_finds_no_episode_id_and_the_handles_it_finds_open_nothing(tmp_path):
    catalog = tmp_path / "farm.json"
    # A limit long enough for a walk through every object of the worker on a slow machine.
    up = envscaler("farm", "up", str(wall_bundle(tmp_path / "wall")), "--backend", "process", "--catalog", str(catalog),
                   "--call-timeout", "20")
    assert up.returncode == 0, up.stderr
    try:
        farm = json.loads(catalog.read_text())
        wall = Endpoint(farm["envs"]["wall"]["url"], farm["envs"]["wall"]["token"])
        with wall.control() as http:
            episodes = [wall.new_episode(http, "wall_001") for _ in range(3)]
            for episode in episodes:
                assert not call(http, episode["mcp_url"], "add", {"item_id": "a"})["isError"]
            harvest = call(http, episodes[0]["mcp_url"], "harvest", {})
            assert not harvest["isError"], harvest
            found = json.loads(harvest["content"][0]["text"])["data"]
            ids = [episode["episode_id"] for episode in episodes]
            assert len(found["tokens"]) > 100 and not [token for token in found["tokens"] if any(i in token for i in ids)]
            assert len(found["names"]) == 3 and not set(found["names"]) & set(ids), found["names"]
            listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
            routes = [wall.url, f"{farm['gateway']}/envs/wall"]
            for route in routes:
                assert http.post(f"{route}/episodes/{ids[0]}/mcp", json=listing).status_code == 200
                for name in found["names"]:
                    assert http.post(f"{route}/episodes/{name}/mcp", json=listing).status_code == 404, (route, name)
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))


def test_catalog_check_fails_each_hostile_scenario_alone(tmp_path):
    tools = ["bypass_alarm", "c_loop", "deep", "exit_in_state", "double"]
    scenarios = [counter_scenario(env_id="wall", task_id=f"wall_{tool}", reference_solution=[{"name": tool, "arguments": {}}])
                 for tool in tools]
    wall_bundle(tmp_path / "bundles", scenarios=[counter_scenario(env_id="wall", task_id="wall_001"), *scenarios])
    victim = counter_bundle(tmp_path / "bundles")
    started = time.monotonic()
    checked = envscaler("catalog", "check", str(tmp_path / "bundles"), "--timeout", "5", "--jobs", "2", timeout=300)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    report = checked.stdout + checked.stderr
    for tool in tools:
        assert f"wall/wall_{tool}: FAIL" in report or f"wall_{tool}: reference_runs" in report, (tool, report)
    assert "wall/wall_001: ok" in report and "counter/counter_001: ok" in report, report
    assert time.monotonic() - started < 120
    passed = envscaler("catalog", "check", str(victim), timeout=120)
    assert passed.returncode == 0, passed.stdout
