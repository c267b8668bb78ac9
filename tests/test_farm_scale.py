"""A process farm of 100 environments: up, a replay of every environment through the gateway,
a killed server and a hung one restarted and reported, down leaving nothing behind."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from servers.farm.teardown import farm_processes
from tests.support.cli import envscaler
from tests.support.farm import catalog_copies, farm_members, gateway_only_catalog, read_state
from tests.support.waiting import wait_until

ENVS = 100
# Each server is probed every 2 s; three misses in a row make it hung.
PROBE_PERIOD_S = 2.0



@pytest.fixture(scope="module")
def big_farm(tmp_path_factory):
    root = tmp_path_factory.mktemp("big-farm")
    catalog_copies(root / "bundles", ENVS, scenarios_per_env=1)
    catalog = root / "farm.json"
    up = envscaler("farm", "up", str(root / "bundles"), "--backend", "process", "--catalog", str(catalog),
                   "--probe-period", str(PROBE_PERIOD_S), "--timeout", "300", timeout=360)
    assert up.returncode == 0, up.stderr
    # Progress comes as a few lines of counts, not one line per server.
    assert f"farm: {ENVS}/{ENVS} healthy" in up.stderr and up.stderr.count("\n") < 40, up.stderr
    yield catalog
    envscaler("farm", "down", "--catalog", str(catalog), timeout=120)


def test_every_environment_replays_to_one_through_the_gateway(big_farm, tmp_path):
    status = envscaler("farm", "status", "--catalog", str(big_farm))
    assert status.returncode == 0
    assert f"{ENVS}/{ENVS} healthy" in status.stdout and len(status.stdout.splitlines()) == 1
    through_gateway = gateway_only_catalog(big_farm, tmp_path / "gateway.json")
    out = tmp_path / "replay.jsonl"
    run = envscaler("run", "--farm", str(through_gateway), "--agent", "replay", "--out", str(out),
                    "--concurrency", "16", "--quiet", timeout=300)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == ENVS and len({r["env_id"] for r in records}) == ENVS
    assert [r for r in records if r["reward"] != 1.0] == []


def test_a_killed_server_is_restarted_and_reported(big_farm):
    state = read_state(big_farm)
    env_id = sorted(state["envs"])[7]
    victim = state["envs"][env_id]["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: read_state(big_farm)["envs"][env_id]["restarts"] == 1
               and read_state(big_farm)["envs"][env_id]["status"] == "healthy", 30, "restart after kill -9")
    record = read_state(big_farm)["envs"][env_id]
    assert record["pid"] != victim and record["last_exit"] == "killed by SIGKILL"
    # Nothing of it is left, not even a zombie: in the sandbox, its init was orphaned to the daemon, which reaped it.
    with pytest.raises(ProcessLookupError):
        os.killpg(victim, 0)
    status = envscaler("farm", "status", "--catalog", str(big_farm))
    assert f"{ENVS}/{ENVS} healthy, 1 restart(s)" in status.stdout
    listed = [line for line in status.stdout.splitlines()[1:] if line.split()[0] != "env_id"]
    assert len(listed) == 1 and env_id in listed[0] and "killed by SIGKILL" in listed[0]
    catalog = json.loads(big_farm.read_text())
    assert httpx.get(catalog["envs"][env_id]["url"] + "/healthz", timeout=5).json()["env_id"] == env_id


def test_a_hung_server_is_restarted_and_reported(big_farm):
    state = read_state(big_farm)
    env_id = sorted(state["envs"])[42]
    before = state["envs"][env_id]["restarts"]
    victim = state["envs"][env_id]["pid"]
    os.killpg(victim, signal.SIGSTOP)  # alive, but answers nothing (its group: in the sandbox, bubblewrap and the server)
    # Three missed probes, one every PROBE_PERIOD_S, then a restart.
    wait_until(lambda: read_state(big_farm)["envs"][env_id]["restarts"] == before + 1
               and read_state(big_farm)["envs"][env_id]["status"] == "healthy", 8 * PROBE_PERIOD_S + 20, "restart of a hung server")
    record = read_state(big_farm)["envs"][env_id]
    assert record["pid"] != victim
    with pytest.raises(ProcessLookupError):
        os.killpg(victim, 0)
    assert record["last_exit"] == "hung: no answer to 3 health probes in a row"
    status = envscaler("farm", "status", "--catalog", str(big_farm))
    assert "hung: no answer to 3 health probes" in status.stdout
    healthy = sum(r["status"] == "healthy" for r in read_state(big_farm)["envs"].values())
    assert healthy == ENVS


def test_down_leaves_nothing_behind(big_farm):
    state = read_state(big_farm)
    groups = [r["pid"] for r in state["envs"].values()]
    # The daemon, the zygote the servers were forked from, the servers and their workers, haproxy's
    # master and worker in front: nothing else.
    members = farm_members(state)
    assert len(members["daemon"]) == 1 and len(members["zygote"]) == 1 and sorted(members["server"]) == sorted(groups)
    assert len(members["under a server"]) >= ENVS and not members["stray"], members["stray"]
    assert len(members["haproxy"]) == (2 if state["gateway_proxy"].startswith("haproxy") else 0)
    down = envscaler("farm", "down", "--catalog", str(big_farm), timeout=120)
    assert down.returncode == 0, down.stderr
    assert farm_processes(state["farm_id"]) == []
    for group in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
    assert not big_farm.exists() and not (big_farm.parent / "farm.json.farm").exists()
