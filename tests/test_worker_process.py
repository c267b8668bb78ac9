"""``envscaler serve --worker-process``: environment code in a worker process that the server kills.

Real servers and real workers (sandboxed where bwrap works). A tool that holds the GIL in a C loop
(the cooperative time limit cannot stop it) or that ends its process costs only the worker: the
call gets an error within its limit plus the grace, the episodes the worker held are reported lost
(their validation answers 410, never a score), and a new episode is served by a new worker.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from servers.worker_store import GRACE_S
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

    def where(self) -> dict:
        """Which process runs this code: its pid and start time (pids repeat in a PID namespace)."""
        with open("/proc/self/stat") as stat:
            fields = stat.read().split()
        return {"success": True, "data": [fields[0], fields[21]]}

    def get_item('''
MCP_HEADERS = {"MCP-Protocol-Version": "2026-07-28"}


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


def worker_pid(http: httpx.Client, episode_id: str) -> str:
    result = call(http, episode_id, "where")
    assert not result["isError"], result
    return result["content"][0]["text"]


def test_a_worker_that_holds_the_gil_is_killed_and_its_episodes_are_reported_lost_not_scored(bundle):
    with serve(bundle, "--worker-process", "--call-timeout", str(CALL_TIMEOUT_S)) as server, server.client() as http:
        bystander = new_episode(http)
        assert not call(http, bystander, "add", {"item_id": "a"})["isError"]
        attacker = new_episode(http)
        started = time.monotonic()
        result = call(http, attacker, "c_loop")
        took = time.monotonic() - started
        assert result["isError"] and "did not answer tool 'c_loop'" in result["content"][0]["text"], result
        assert took < CALL_TIMEOUT_S + 0.5 + GRACE_S + 1.0, took
        # A health probe alone finds the server able to serve again: it starts the new worker.
        health = httpx.get(f"{server.url}/healthz")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        trajectory = http.get(f"/episodes/{attacker}/trajectory").json()
        assert trajectory["timeouts"] == 1 and trajectory["calls"][-1]["error_kind"] == "timeout"

        # The bystander's state went with the worker: it says so, and is never scored.
        lost = call(http, bystander, "get_item", {"item_id": "a"})
        assert lost["isError"] and "This episode is lost" in lost["content"][0]["text"], lost
        validation = http.post(f"/episodes/{bystander}/validate")
        assert validation.status_code == 410 and "lost" in validation.json()["error"], validation.text
        assert http.get(f"/episodes/{bystander}/state").status_code == 410
        # Its record is kept: the call before the loss is in its trajectory.
        assert [c["name"] for c in http.get(f"/episodes/{bystander}/trajectory").json()["calls"]] == ["add", "get_item"]

        # A reset builds it again in the new worker; new episodes are served too.
        assert http.post(f"/episodes/{bystander}/reset").status_code == 200
        assert not call(http, bystander, "add", {"item_id": "a"})["isError"]
        assert http.post(f"/episodes/{bystander}/validate").status_code == 200
        fresh = new_episode(http)
        assert not call(http, fresh, "get_item", {"item_id": "a"})["isError"]
        assert httpx.get(f"{server.url}/healthz").json()["status"] == "ok"


@pytest.mark.parametrize("flags", [(), ("--no-sandbox",)], ids=["sandboxed", "unsandboxed"])
def test_a_worker_that_exits_costs_only_itself_and_the_server_keeps_serving(bundle, flags):
    with serve(bundle, "--worker-process", "--call-timeout", str(CALL_TIMEOUT_S), *flags) as server, server.client() as http:
        first = new_episode(http)
        before = worker_pid(http, first)
        started = time.monotonic()
        result = call(http, first, "die")
        assert time.monotonic() - started < 2.0
        assert result["isError"] and "environment worker exited" in result["content"][0]["text"], result
        assert http.get(f"/episodes/{first}/trajectory").json()["env_errors"] == 1
        second = new_episode(http)
        assert worker_pid(http, second) != before
        assert server.process.poll() is None


def test_the_worker_holds_no_token_and_normal_episodes_score_as_without_it(bundle):
    with serve(bundle, "--worker-process") as server, server.client() as http:
        episode = new_episode(http)
        for step in counter_scenario()["reference_solution"]:
            assert not call(http, episode, step["name"], step["arguments"])["isError"]
        assert http.post(f"/episodes/{episode}/validate").json()["score"] == 1.0
        assert http.get(f"/episodes/{episode}/state").json()["state"]["items"]["a"]["count"] == 3
        assert f'"{server.process.pid}"' not in worker_pid(http, episode)
        info = http.get("/info").json()
        assert info["limits"]["worker_process"] is True and info["call_threads"] >= 0


def test_a_lone_surrogate_crosses_the_worker_socket_both_ways_and_costs_no_episode(bundle):
    with serve(bundle, "--worker-process") as server, server.client() as http:
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


def test_the_worker_started_by_hand_says_how_it_is_started():
    for argv in ([], ["not-a-fd"], ["3", "4"]):
        started = subprocess.run([sys.executable, "-m", "servers.env_worker", *argv], capture_output=True, text=True, timeout=60)
        assert started.returncode == 2 and "started by an environment server, not by hand" in started.stderr, (argv, started.stderr)
