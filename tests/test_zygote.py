"""The zygote fork server: real servers forked from it, their exits, their groups, their environments."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from pathlib import Path

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from envscaler import default_catalog, load_bundle
from envscaler.sandbox import FARM_ID_VARIABLE, clean_environment
from servers.farm.models import EnvPlan
from servers.farm.teardown import farm_processes, pid_alive
from servers.farm.backends.zygote import ZygoteSpawner
from tests.support.bundles import counter_scenario, counter_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.farm import farm_members, parent_of
from tests.support.waiting import wait_until

pytestmark = pytest.mark.anyio

FARM_ID = "zygote-test"

def reporting_code(report: Path) -> str:
    """Environment code that runs when its bundle loads (in the server's environment worker): it writes
    what it sees of its process to ``report``, and leaves a child (``sleep``) in its process group."""
    return f'''
import json, os, subprocess

_sleeper = subprocess.Popen(["sleep", "300"])
with open({str(report)!r}, "w") as report:
    json.dump({{"environ": dict(os.environ), "sleeper": _sleeper.pid}}, report)
''' + counter_spec()["env_class_code"]


def reporting_bundle(root: Path, report: Path) -> Path:
    spec = counter_spec(env_id="reporter", env_class_code=reporting_code(report))
    return write_bundle(root, spec, [counter_scenario(env_id="reporter")])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def plan(bundle_dir: Path | str, env_id: str, token: str) -> EnvPlan:
    return EnvPlan(env_id=env_id, bundle_dir=str(bundle_dir), token=token, port=free_port(), spec_hash="test")


def environment(token: str, **extra: str) -> dict[str, str]:
    return clean_environment({"ENVSCALER_TOKEN": token, FARM_ID_VARIABLE: FARM_ID, **extra})


@pytest.fixture
async def spawner():
    spawner = ZygoteSpawner(clean_environment({FARM_ID_VARIABLE: FARM_ID, "MALLOC_ARENA_MAX": "2"}), ["--no-sandbox"])
    yield spawner
    await spawner.aclose()


async def test_a_forked_server_listens_answers_and_a_replay_scores_one(spawner, tmp_path):
    bundle_dir = default_catalog() / "library_circulation"
    env = plan(bundle_dir, "library_circulation", "secret-1")
    server = await spawner.spawn(env, environment("secret-1"), tmp_path / "server.log", 256)
    assert await server.wait_ready()
    assert parent_of(server.pid) != os.getpid()  # forked by the zygote, not started by us
    assert os.getpgid(server.pid) == server.pid and os.getsid(server.pid) == server.pid
    async with httpx.AsyncClient(base_url=env.url, headers={"Authorization": "Bearer secret-1"}) as control:
        health = await control.get("/healthz")
        assert health.status_code == 200 and health.json()["env_id"] == "library_circulation"
        scenario = load_bundle(bundle_dir).scenarios[0]
        episode = (await control.post("/episodes", json={"scenario_id": scenario.task_id})).json()
        async with httpx2.AsyncClient() as http, Client(streamable_http_client(episode["mcp_url"], http_client=http)) as client:
            for call in scenario.reference_solution:
                result = await client.call_tool(call.name, call.arguments)
                assert not result.is_error, result.content[0].text
        score = (await control.post(f"/episodes/{episode['episode_id']}/validate")).json()["score"]
    assert score == 1.0
    # Limits as the Popen path sets them: address space from the memory limit, no core dumps.
    limits = Path(f"/proc/{server.pid}/limits").read_text()
    assert re.search(r"Max address space\s+1073741824\s+1073741824", limits)
    assert re.search(r"Max core file size\s+0\s+0", limits)
    server.send_signal(signal.SIGTERM)
    assert await server.wait_exit() == 0
    assert '"event": "listening"' in (tmp_path / "server.log").read_text()


async def test_a_killed_server_reports_minus_nine_and_a_broken_one_its_exit(spawner, tmp_path):
    server = await spawner.spawn(plan(default_catalog() / "it_helpdesk", "it_helpdesk", "t"), environment("t"), tmp_path / "a.log", 256)
    assert await server.wait_ready()
    server.send_signal(signal.SIGKILL)
    assert await server.wait_exit() == -signal.SIGKILL
    assert not pid_alive(server.pid)

    broken = await spawner.spawn(plan(tmp_path / "missing", "missing", "t"), environment("t"), tmp_path / "b.log", 256)
    assert not await broken.wait_ready()
    # As `python -m servers.cli` ends on a bundle that is not there: one line, exit 2 (the user's to fix).
    assert await broken.wait_exit() == 2
    log = (tmp_path / "b.log").read_text()
    assert "missing" in log and "Traceback" not in log


async def test_killing_the_servers_group_kills_what_it_forked(spawner, tmp_path):
    report = tmp_path / "report.json"
    bundle = reporting_bundle(tmp_path / "bundles", report)
    server = await spawner.spawn(plan(bundle, "reporter", "t"), environment("t"), tmp_path / "s.log", 256)
    assert await server.wait_ready()
    sleeper = json.loads(report.read_text())["sleeper"]  # forked by environment code in the server's worker
    assert pid_alive(sleeper) and os.getpgid(sleeper) == server.pid
    server.send_signal(signal.SIGKILL)
    assert await server.wait_exit() == -signal.SIGKILL
    wait_until(lambda: not pid_alive(sleeper))


async def test_environment_code_sees_nothing_of_its_servers_environment(spawner, tmp_path):
    reports, servers = [], []
    for name in ("one", "two"):
        report = tmp_path / f"{name}.json"
        bundle = reporting_bundle(tmp_path / name, report)
        env = plan(bundle, "reporter", f"token-{name}")
        server = await spawner.spawn(env, environment(f"token-{name}", ONLY_IN=name), tmp_path / f"{name}.log", 256)
        assert await server.wait_ready()
        reports.append(json.loads(report.read_text())["environ"])
        servers.append(server)
        # The server got its own environment: its token opens its control routes.
        assert httpx.get(f"http://127.0.0.1:{env.port}/info", headers={"Authorization": f"Bearer token-{name}"}).status_code == 200
    for seen in reports:
        assert "ENVSCALER_TOKEN" not in seen and "ONLY_IN" not in seen and seen[FARM_ID_VARIABLE] == FARM_ID, seen
        assert not any("token-" in value for value in seen.values())
    # /proc/PID/environ is the zygote's (what ``farm down`` finds a farm's processes by): no token there.
    for server in servers:
        shown = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        assert f"{FARM_ID_VARIABLE}={FARM_ID}".encode() in shown
        assert not any(b"token-" in item for item in shown)
        assert server.pid in farm_processes(FARM_ID)
    # The tokens never passed through the zygote, so no later server can find them in memory it inherits.
    zygote = parent_of(servers[0].pid)
    assert _memory_contains(zygote, [f"{FARM_ID_VARIABLE}={FARM_ID}".encode()])  # its own environment: the scan reads its memory
    assert not _memory_contains(zygote, [b"token-one", b"token-two"])
    for server in servers:
        server.send_signal(signal.SIGTERM)
        assert await server.wait_exit() == 0


async def test_the_zygote_killed_takes_its_servers_and_the_next_spawn_starts_another(spawner, tmp_path):
    servers = []
    for env_id in ("library_circulation", "online_retail"):
        server = await spawner.spawn(plan(default_catalog() / env_id, env_id, "t"), environment("t"), tmp_path / f"{env_id}.log", 256)
        assert await server.wait_ready()
        servers.append(server)
    zygote = parent_of(servers[0].pid)
    assert parent_of(servers[1].pid) == zygote
    os.kill(zygote, signal.SIGKILL)
    for server in servers:
        assert await server.wait_exit() == -signal.SIGKILL
        assert not pid_alive(server.pid)
    again = await spawner.spawn(plan(default_catalog() / "it_helpdesk", "it_helpdesk", "t"), environment("t"), tmp_path / "again.log", 256)
    assert await again.wait_ready()
    assert parent_of(again.pid) not in (zygote, os.getpid())
    again.send_signal(signal.SIGTERM)
    assert await again.wait_exit() == 0


def test_a_process_farm_can_be_forced_to_start_each_server_as_its_own_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVSCALER_SPAWNER", "popen")
    catalog = tmp_path / "farm.json"
    up = envscaler("farm", "up", str(default_catalog() / "library_circulation"), "--backend", "process", "--catalog", str(catalog))
    assert up.returncode == 0, up.stderr
    try:
        state = json.loads((tmp_path / "farm.json.farm" / "state.json").read_text())
        server = state["envs"]["library_circulation"]["pid"]
        assert parent_of(server) == state["daemon_pid"]  # no zygote between them
        # The daemon, its server, the server's spawner and environment worker (in the sandbox; the check
        # worker starts at the first validation), haproxy in front: no zygote.
        members = farm_members(state)
        assert not members["zygote"] and len(members["spawner"]) == 1 and not members["stray"], members
        assert len(members["under a server"]) == 1, members
        assert httpx.get(json.loads(catalog.read_text())["envs"]["library_circulation"]["url"] + "/healthz").status_code == 200
    finally:
        assert envscaler("farm", "down", "--catalog", str(catalog)).returncode == 0


def _memory_contains(pid: int, needles: list[bytes]) -> bool:
    """Whether any readable, writable mapping of ``pid`` holds one of ``needles`` (we are root, or its parent)."""
    found = False
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as memory:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if not fields[1].startswith("rw"):
                continue
            try:
                memory.seek(start)
                chunk = memory.read(end - start)
            except OSError:
                continue
            found = found or any(needle in chunk for needle in needles)
    return found
