"""haproxy in front of a process farm's gateway: what it forwards itself, what it leaves to Python.

.ci/run installs haproxy; the fallback without it is tested by forcing ``ENVSCALER_GATEWAY=python``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest

from envscaler import default_catalog, load_bundle
from servers.farm.gateway.front import GATEWAY_VARIABLE
from servers.farm.teardown import farm_processes
from tests.support.cli import envscaler
from tests.support.farm import bundled_farm, read_state
from tests.support.gateway import replay_through_gateway

ENVS = ["library_circulation", "online_retail"]

def farm_dir(catalog):
    return catalog.parent / (catalog.name + ".farm")


def haproxy_admin(catalog, command: str) -> str:
    """One command to the farm's haproxy over its runtime API; its whole answer."""
    with socket.socket(socket.AF_UNIX) as admin:
        admin.connect(str(farm_dir(catalog) / "haproxy.sock"))
        admin.sendall(command.encode() + b"\n")
        answer = b""
        while chunk := admin.recv(65536):
            answer += chunk
    return answer.decode()


def haproxy_stats(catalog) -> dict[str, int]:
    """Requests each haproxy backend has answered."""
    lines = haproxy_admin(catalog, "show stat").splitlines()
    header = lines[0].lstrip("# ").split(",")
    counts = {}
    for line in lines[1:]:
        row = dict(zip(header, line.split(",")))
        if row.get("svname") == "BACKEND":
            counts[row["pxname"]] = int(row["stot"] or 0)
    return counts


@pytest.fixture
def farm(tmp_path):
    with bundled_farm(tmp_path, ENVS) as catalog:
        yield catalog


def test_tool_calls_go_through_haproxy_and_everything_else_through_the_python_gateway(farm):
    state = read_state(farm)
    assert state["gateway_proxy"].startswith("haproxy ")
    before = haproxy_stats(farm)
    replay = replay_through_gateway(farm, "online_retail")
    assert replay.score == 1.0 and replay.mcp_url.startswith(f"{replay.gateway}/envs/online_retail/episodes/")
    after = haproxy_stats(farm)
    env_backend = "env_" + str(sorted(ENVS).index("online_retail"))
    # Create, list, every reference call and validate went straight to the server.
    assert after[env_backend] - before[env_backend] >= 3 + len(replay.reference_tools)
    assert after["python_gateway"] == before["python_gateway"]
    gateway = replay.gateway
    with httpx.Client(base_url=gateway) as http:
        assert http.get("/healthz").json()["envs"] == 2
        assert http.get("/envs").json() == {"envs": sorted(ENVS)}
        unknown = http.get("/envs/nope/healthz")
        assert unknown.status_code == 404 and "nope" in unknown.json()["error"]
        # A client's own base URL header never reaches a server: haproxy sets it.
        scenario_id = load_bundle(default_catalog() / "online_retail").scenarios[0].task_id
        episode = http.post("/envs/online_retail/episodes", json={"scenario_id": scenario_id}, headers={
            "Authorization": f"Bearer {json.loads(farm.read_text())['envs']['online_retail']['token']}",
            "X-Envscaler-Base-Url": "http://evil.example"})
        assert episode.status_code == 201 and episode.json()["mcp_url"].startswith(f"{gateway}/envs/online_retail/")
        # Large bodies pass through haproxy whole, and so does the server's own answer to a body over its cap.
        listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {"padding": "x" * 900_000}}}
        listed = http.post(replay.mcp_url, json=listing)
        assert listed.status_code == 200 and len(listed.json()["result"]["tools"]) >= len(replay.reference_tools)
        listing["params"]["_meta"]["padding"] = "x" * 1_500_000
        refused = http.post(replay.mcp_url, json=listing)
        assert refused.status_code == 413 and "limit" in refused.text
        # Bodies over the gateway's cap, chunked bodies and browser requests are the Python gateway's.
        too_big = http.post("/envs/online_retail/episodes", content=b"x" * (16 * 1024 * 1024 + 1))
        assert too_big.status_code == 413 and "larger than" in too_big.json()["error"]
        chunked = http.post("/envs/online_retail/episodes", content=iter([b"{", b"}"]))
        assert chunked.status_code == 401  # forwarded by Python, answered by the server
        assert http.get("/envs/online_retail/healthz", headers={"Origin": "http://page.example"}).status_code == 200
    assert haproxy_stats(farm)["python_gateway"] - after["python_gateway"] >= 6


def test_an_unreachable_server_is_a_json_error_naming_it_and_a_killed_haproxy_comes_back(farm):
    state = read_state(farm)
    gateway = state["gateway"]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
    backend = "env_" + str(sorted(ENVS).index("library_circulation"))
    try:
        haproxy_admin(farm, f"set server {backend}/server addr 127.0.0.1 port {closed.getsockname()[1]}")
        answer = httpx.get(f"{gateway}/envs/library_circulation/healthz", timeout=30)
    finally:
        closed.close()
    assert answer.status_code == 503 and answer.headers["content-type"] == "application/json"
    assert answer.json() == {"error": "environment library_circulation is not answering: no connection to its server"}
    assert httpx.get(f"{gateway}/envs/online_retail/healthz").status_code == 200
    haproxies = [pid for pid in farm_processes(state["farm_id"]) if _is_haproxy(pid)]
    assert haproxies
    for pid in haproxies:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while True:
        try:
            # The new haproxy is started from the configuration: the server's own address again.
            if httpx.get(f"{gateway}/envs/library_circulation/healthz", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the gateway did not come back after haproxy was killed"
        time.sleep(0.2)


def _is_haproxy(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().split(b"\0")[0].endswith(b"haproxy")
    except OSError:
        return False


def test_without_haproxy_the_python_gateway_serves_the_farm(tmp_path):
    catalog = tmp_path / "farm.json"
    up = envscaler("farm", "up", str(default_catalog() / "online_retail"), "--backend", "process", "--catalog", str(catalog),
                   env={**os.environ, GATEWAY_VARIABLE: "python"})
    try:
        assert up.returncode == 0, up.stderr
        assert read_state(catalog)["gateway_proxy"] == "python"
        assert not (farm_dir(catalog) / "haproxy.cfg").exists()
        assert replay_through_gateway(catalog, "online_retail").score == 1.0
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))
