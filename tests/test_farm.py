"""The process farm: up, gateway, status, restarts, down (also after kill -9 of the daemon)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from envscaler import default_catalog, load_bundle
from envscaler.sandbox import sandbox_problem
from servers.farm.teardown import farm_processes
from tests.support.bundles import counter_scenario, counter_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.farm import bundled_farm, farm_members, read_state, two_counters_up
from tests.support.gateway import replay_through_gateway
from tests.support.waiting import wait_until

ENVS = ["library_circulation", "online_retail", "it_helpdesk"]



@pytest.fixture
def farm(tmp_path):
    with bundled_farm(tmp_path, ENVS) as catalog:
        yield catalog


def test_up_writes_the_catalog_and_status_reports_health(farm):
    catalog = json.loads(farm.read_text())
    assert sorted(catalog["envs"]) == sorted(ENVS)
    assert catalog["gateway"].startswith("http://127.0.0.1:")
    for env_id, endpoint in catalog["envs"].items():
        health = httpx.get(endpoint["url"] + "/healthz").json()
        assert health["env_id"] == env_id
        assert httpx.get(endpoint["url"] + "/info").status_code == 401
    status = envscaler("farm", "status", "--catalog", str(farm))
    assert status.returncode == 0
    # A summary line; the healthy servers are listed only on request.
    assert "3/3 healthy, 0 restart(s)" in status.stdout and not any(e in status.stdout for e in ENVS)
    everything = envscaler("farm", "status", "--catalog", str(farm), "--all")
    assert everything.returncode == 0
    assert all(f"{e} " in everything.stdout for e in ENVS) and everything.stdout.count(" healthy ") == 3


def test_reference_replay_through_the_gateway_scores_one(farm):
    replay = replay_through_gateway(farm, "online_retail")
    gateway = replay.gateway
    assert replay.mcp_url.startswith(f"{gateway}/envs/online_retail/episodes/")
    assert replay.listed_tools >= replay.reference_tools
    assert replay.score == 1.0
    with httpx.Client(base_url=gateway) as http:
        assert http.get("/envs").json() == {"envs": sorted(ENVS)}
        assert http.get("/envs/nope/healthz").status_code == 404
        # Only control routes want the token: a strict client reads 401 as "this server wants OAuth".
        assert http.get("/envs/online_retail/.well-known/oauth-protected-resource").status_code == 404
        assert http.get("/.well-known/oauth-protected-resource").status_code == 404
        assert http.get("/envs/online_retail/info").status_code == 401
    task_id = load_bundle(default_catalog() / "online_retail").scenarios[0].task_id
    new = envscaler("episode", "new", "--farm", str(farm), "--scenario", f"online_retail/{task_id}")
    assert new.returncode == 0, new.stderr
    url = next(line.split(":", 1)[1].strip() for line in new.stdout.splitlines() if line.startswith("MCP URL:"))
    assert url.startswith(f"{gateway}/envs/online_retail/episodes/")
    listed = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).json()["result"]["tools"]
    assert {t["name"] for t in listed} >= replay.reference_tools


def test_a_killed_server_is_restarted_and_reported(farm):
    state = read_state(farm)
    victim = state["envs"]["it_helpdesk"]["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: read_state(farm)["envs"]["it_helpdesk"]["restarts"] == 1
               and read_state(farm)["envs"]["it_helpdesk"]["status"] == "healthy")
    record = read_state(farm)["envs"]["it_helpdesk"]
    assert record["pid"] != victim and record["last_exit"] == "killed by SIGKILL"
    status = envscaler("farm", "status", "--catalog", str(farm))
    assert "killed by SIGKILL" in status.stdout
    others = json.loads(farm.read_text())["envs"]
    assert httpx.get(others["online_retail"]["url"] + "/healthz").status_code == 200


def test_down_leaves_nothing_also_after_kill_9_of_the_daemon(tmp_path):
    catalog = tmp_path / "farm.json"
    up = envscaler("farm", "up", str(default_catalog() / "library_circulation"), "--backend", "process", "--catalog", str(catalog))
    assert up.returncode == 0, up.stderr
    state = read_state(catalog)
    # The daemon, the zygote the server was forked from, the server, its spawner and its environment worker (in
    # the sandbox), haproxy in front of the gateway (a master and a worker): nothing else.
    members = farm_members(state)
    assert members["daemon"] == [state["daemon_pid"]] and members["server"] == [state["envs"]["library_circulation"]["pid"]]
    assert len(members["zygote"]) == 1 and len(members["spawner"]) == 1, members
    assert len(members["under a server"]) == 1, members
    assert len(members["haproxy"]) == (2 if state["gateway_proxy"].startswith("haproxy") else 0) and not members["stray"], members
    os.kill(state["daemon_pid"], signal.SIGKILL)
    down = envscaler("farm", "down", "--catalog", str(catalog))
    assert down.returncode == 0
    wait_until(lambda: not farm_processes(state["farm_id"]), 10)
    assert not catalog.exists() and not (tmp_path / "farm.json.farm").exists()


def test_a_second_up_on_a_running_farm_is_refused(farm):
    again = envscaler("farm", "up", "--backend", "process", "--catalog", str(farm))
    assert again.returncode == 2 and "already running" in again.stderr


def test_up_with_a_broken_bundle_fails_and_cleans_up(tmp_path):
    broken = tmp_path / "bundles" / "broken"
    broken.mkdir(parents=True)
    (broken / "env.json").write_text("{not json")
    (broken / "scenarios.jsonl").write_text("")
    result = envscaler("farm", "up", str(tmp_path / "bundles"), "--backend", "process", "--catalog", str(tmp_path / "farm.json"))
    assert result.returncode == 2 and "env.json" in result.stderr
    assert not (tmp_path / "farm.json").exists()


def test_up_with_a_bundle_whose_python_requirements_are_missing_names_them_and_cleans_up(tmp_path):
    write_bundle(tmp_path / "bundles", counter_spec(requires=["envscaler-test-absent-distribution>=1.0"]), [counter_scenario()])
    result = envscaler("farm", "up", str(tmp_path / "bundles"), "--backend", "process", "--catalog", str(tmp_path / "farm.json"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert ("counter: failed (exit 2: error: counter: needs Python distributions this interpreter lacks: "
            "envscaler-test-absent-distribution>=1.0 (not installed). Install them with:") in result.stderr
    assert not (tmp_path / "farm.json").exists()


def test_a_farm_whose_files_are_deleted_stops_itself(tmp_path):
    catalog = tmp_path / "farm.json"
    up = envscaler("farm", "up", str(default_catalog() / "library_circulation"), "--backend", "process", "--catalog", str(catalog))
    assert up.returncode == 0, up.stderr
    farm_id = read_state(catalog)["farm_id"]
    # What a test runner's temporary-folder cleanup does when nobody ran `farm down`.
    shutil.rmtree(tmp_path / "farm.json.farm")
    catalog.unlink()
    wait_until(lambda: not farm_processes(farm_id), 15)
    assert not (tmp_path / "farm.json.farm").exists()


def test_up_whose_daemon_dies_says_so_and_cleans_up(tmp_path):
    # A busy gateway port is refused before any daemon starts (tests/test_cli_misuse.py); a daemon that
    # dies while the farm comes up (the kernel's OOM killer, say) is what is left to report.
    catalog = tmp_path / "farm.json"
    up = subprocess.Popen([sys.executable, "-m", "envscaler.cli", "farm", "up", str(default_catalog() / "library_circulation"),
                           "--backend", "process", "--catalog", str(catalog)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state = catalog.parent / "farm.json.farm" / "state.json"
    deadline = time.monotonic() + 60
    while not state.exists():
        assert time.monotonic() < deadline and up.poll() is None, up.communicate()
        time.sleep(0.02)
    os.kill(read_state(catalog)["daemon_pid"], signal.SIGKILL)
    _, stderr = up.communicate(timeout=120)
    assert up.returncode == 1 and "the farm daemon stopped (killed by SIGKILL)" in stderr, stderr
    assert not (tmp_path / "farm.json.farm").exists()


def _zombie_children(pid: int) -> list[int]:
    zombies = []
    for entry in os.scandir("/proc"):
        try:
            fields = open(f"/proc/{entry.name}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == pid:
            zombies.append(int(entry.name))
    return zombies


@pytest.mark.skipif(sandbox_problem() is not None, reason="needs a working bubblewrap sandbox")
def test_a_sandboxed_farm_leaves_no_zombie_with_its_daemon(tmp_path):
    catalog = two_counters_up(tmp_path)
    try:
        daemon = read_state(catalog)["daemon_pid"]
        # Each server's start leaves bubblewrap's sandbox init to the daemon (the subreaper), which reaps it.
        deadline = time.monotonic() + 30
        while _zombie_children(daemon) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _zombie_children(daemon) == []
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))
