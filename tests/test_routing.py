"""Replicated environments behind the gateway: replica ids in episode ids, sticky routes, least-loaded
creation, dead and stalled replicas answering "gone", the gateway service's own process.

Real ``envscaler serve`` replicas and a real gateway over HTTP; only discovery is a fixed list of
addresses here instead of the orchestrator's DNS (tests/test_swarm.py runs it on a real swarm).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from envscaler import default_catalog, load_bundle
from servers.episodes.ids import replica_of
from servers.farm.gateway.app import Gateway
from servers.farm.gateway.routing import ReplicaRouter
from servers.transport.http_server import HttpServer
from servers.serve import bind
from tests.support.server import TOKEN, RunningServer, serve
from tests.support.waiting import wait_until

ENV = "library_circulation"
BUNDLE = default_catalog() / ENV
SCENARIO = load_bundle(BUNDLE).scenarios[0]
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
MCP_HEADERS = {"MCP-Protocol-Version": "2026-07-28"}


@contextmanager
def gateway(addresses: dict[str, list[str]], *, poll_s: float = 0.2) -> Iterator[str]:
    """A gateway on 127.0.0.1 routing over ``addresses`` (a live dict: change it to add or drop replicas)."""

    async def discover(env_id: str) -> list[str]:
        return list(addresses[env_id])

    router = ReplicaRouter(list(addresses), discover, poll_s=poll_s, probe_timeout_s=0.3)
    server = HttpServer(Gateway({env_id: env_id for env_id in addresses}, router=router), max_body_bytes=1 << 20)
    sock = bind("127.0.0.1", 0)
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    async def main() -> None:
        poller = asyncio.create_task(router.run())
        try:
            await server.serve(sock, on_ready=ready.set)
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/envs/{ENV}"
    finally:
        loop.call_soon_threadsafe(server.stop)
        thread.join(10)


@contextmanager
def replicas(*replica_ids: str) -> Iterator[list[RunningServer]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serve(BUNDLE, "--replica-id", replica_id)) for replica_id in replica_ids]


def seen_replicas(base: str) -> int:
    return httpx.get(base.split("/envs/")[0] + "/healthz").json()["replicas"][ENV]


def create(http: httpx.Client, base: str) -> dict:
    response = http.post(base + "/episodes", json={"scenario_id": SCENARIO.task_id}, headers=HEADERS)
    assert response.status_code == 201, response.text
    return response.json()


def episode_on_r2(http: httpx.Client, base: str) -> dict:
    """Once the gateway sees replicas r1 and r2, create one episode on each; the one r2 holds."""
    wait_until(lambda: seen_replicas(base) == 2)
    episodes = [create(http, base) for _ in range(2)]
    return next(e for e in episodes if e["episode_id"].startswith("r2."))


def call_tool(http: httpx.Client, mcp_url: str, name: str, arguments: dict) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    return http.post(mcp_url, json=body, headers=MCP_HEADERS)


def test_episode_ids_name_the_replica_that_healthz_reports():
    with replicas("r1") as [server], serve(BUNDLE) as plain, httpx.Client(timeout=30) as http:
        assert http.get(server.url + "/healthz").json()["replica"] == "r1"
        episode = http.post(server.url + "/episodes", json={"scenario_id": SCENARIO.task_id}, headers=HEADERS).json()
        assert episode["episode_id"].startswith("r1.") and replica_of(episode["episode_id"]) == "r1"
        assert episode["mcp_url"].endswith(f"/episodes/{episode['episode_id']}/mcp")
        # A server that is not a replica hands out bare ids, as before.
        assert http.get(plain.url + "/healthz").json()["replica"] is None
        bare = http.post(plain.url + "/episodes", json={"scenario_id": SCENARIO.task_id}, headers=HEADERS).json()
        assert replica_of(bare["episode_id"]) is None


def test_an_episode_of_another_replica_is_answered_lost_not_unknown():
    """A restarted server is a new replica (ray backend): an episode of the one before is lost (410), never 404."""
    with replicas("r2") as [server], httpx.Client(timeout=30) as http:
        for method, path in (("POST", "/validate"), ("GET", "/trajectory"), ("DELETE", "")):
            answer = http.request(method, f"{server.url}/episodes/r1.{'x' * 32}{path}", headers=HEADERS)
            assert answer.status_code == 410, (method, path, answer.text)
            assert "replica r1" in answer.json()["error"] and "lost" in answer.json()["error"]
        # Its own replica id, or none, names an episode that is simply not live.
        for episode_id in (f"r2.{'x' * 32}", "x" * 32):
            assert http.post(f"{server.url}/episodes/{episode_id}/validate", headers=HEADERS).status_code == 404


def test_a_bad_replica_id_is_refused_by_its_flag():
    done = subprocess.run([sys.executable, "-m", "envscaler.cli", "serve", str(BUNDLE), "--replica-id", "a.b"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--replica-id" in done.stderr and "Traceback" not in done.stderr


def test_serve_reads_its_token_from_a_file(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("from-a-file\n")
    with serve(BUNDLE, "--token-file", str(secret), token="") as server, httpx.Client(base_url=server.url) as http:
        assert http.get("/info", headers={"Authorization": "Bearer from-a-file"}).status_code == 200
        assert http.get("/info", headers=HEADERS).status_code == 401
    missing = subprocess.run([sys.executable, "-m", "envscaler.cli", "serve", str(BUNDLE), "--token-file", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--token-file" in missing.stderr and "Traceback" not in missing.stderr


def test_creation_goes_to_the_least_loaded_replica_and_each_episode_to_its_holder():
    with replicas("r1", "r2") as servers, gateway({ENV: [s.url for s in servers]}) as base, httpx.Client(timeout=30) as http:
        wait_until(lambda: seen_replicas(base) == 2)
        episodes = [create(http, base) for _ in range(4)]
        holders = [replica_of(e["episode_id"]) for e in episodes]
        assert sorted(holders) == ["r1", "r1", "r2", "r2"]
        for server, replica_id in zip(servers, ("r1", "r2")):
            held = http.get(server.url + "/episodes", headers=HEADERS).json()["episodes"]
            assert sorted(held) == sorted(e["episode_id"] for e in episodes if e["episode_id"].startswith(replica_id + "."))
        for episode in episodes:
            assert episode["mcp_url"].startswith(base)
            for step in SCENARIO.reference_solution:
                result = call_tool(http, episode["mcp_url"], step.name, step.arguments)
                assert result.status_code == 200 and not result.json()["result"].get("isError"), result.text
            validation = http.post(f"{base}/episodes/{episode['episode_id']}/validate", headers=HEADERS)
            assert validation.json()["score"] == 1.0
            assert http.delete(f"{base}/episodes/{episode['episode_id']}", headers=HEADERS).status_code == 200


def test_a_dead_replica_answers_gone_never_a_score_and_creation_goes_elsewhere():
    with replicas("r1", "r2") as servers, gateway({ENV: [s.url for s in servers]}) as base, httpx.Client(timeout=30) as http:
        lost = episode_on_r2(http, base)
        servers[1].process.send_signal(signal.SIGKILL)
        servers[1].process.wait()
        called = call_tool(http, lost["mcp_url"], SCENARIO.reference_solution[0].name, SCENARIO.reference_solution[0].arguments)
        assert called.status_code == 410 and "environment instance gone" in called.json()["error"]
        assert lost["episode_id"] in called.json()["error"]
        validation = http.post(f"{base}/episodes/{lost['episode_id']}/validate", headers=HEADERS)
        assert validation.status_code == 410 and "score" not in validation.json()
        assert all(replica_of(create(http, base)["episode_id"]) == "r1" for _ in range(3))


def test_a_request_waiting_on_a_replica_that_stops_answering_is_cut_short():
    with replicas("r1", "r2") as servers, gateway({ENV: [s.url for s in servers]}) as base, httpx.Client(timeout=60) as http:
        stalled = episode_on_r2(http, base)
        os.killpg(servers[1].process.pid, signal.SIGSTOP)  # the server's group: in its sandbox, past bubblewrap
        try:
            started = time.monotonic()
            answer = http.post(f"{base}/episodes/{stalled['episode_id']}/validate", headers=HEADERS)
            waited = time.monotonic() - started
        finally:
            os.killpg(servers[1].process.pid, signal.SIGCONT)
        # Cut short once two health checks failed, not at the gateway's 300 s read timeout.
        assert answer.status_code == 410 and "environment instance gone" in answer.json()["error"]
        assert waited < 10


def test_an_unknown_replica_is_gone_and_a_new_one_is_found_on_demand():
    with replicas("r1", "r2") as servers:
        addresses = {ENV: [servers[0].url]}
        # Polls far apart: finding r2 below can only come from the lookup a request makes.
        with gateway(addresses, poll_s=3600) as base, httpx.Client(timeout=30) as http:
            wait_until(lambda: seen_replicas(base) == 1)
            missing = http.post(f"{base}/episodes/zz.nothing/validate", headers=HEADERS)
            assert missing.status_code == 410 and "replica zz" in missing.json()["error"]
            direct = http.post(servers[1].url + "/episodes", json={"scenario_id": SCENARIO.task_id}, headers=HEADERS).json()
            addresses[ENV].append(servers[1].url)
            state = http.get(f"{base}/episodes/{direct['episode_id']}/state", headers=HEADERS)
            assert state.status_code == 200 and state.json()["episode_id"] == direct["episode_id"]


def test_the_gateway_service_process_serves_and_stops_on_sigterm(tmp_path):
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({"services": {ENV: "no-such-service.invalid"}, "port": 8000}))
    process = subprocess.Popen([sys.executable, "-m", "servers.farm.gateway.swarm", str(routes), "--port", "0"],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout is not None
        port = json.loads(process.stdout.readline())["port"]
        health = httpx.get(f"http://127.0.0.1:{port}/healthz").json()
        assert health["replicas"] == {ENV: 0}
        nobody = httpx.post(f"http://127.0.0.1:{port}/envs/{ENV}/episodes", json={}, headers=HEADERS)
        assert nobody.status_code == 503 and "no replica" in nobody.json()["error"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_bad_routes_file_is_one_clear_line(tmp_path):
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({"services": "nope"}))
    done = subprocess.run([sys.executable, "-m", "servers.farm.gateway.swarm", str(routes)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and str(routes) in done.stderr and "Traceback" not in done.stderr


@pytest.fixture(autouse=True)
def _no_token_in_environment(monkeypatch):
    monkeypatch.delenv("ENVSCALER_TOKEN", raising=False)
