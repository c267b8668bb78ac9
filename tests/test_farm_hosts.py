"""A process-backend farm whose servers each serve several environments (``farm up --envs-per-server``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from envscaler import default_catalog
from servers.farm.teardown import farm_processes
from tests.support.bundles import COUNTER_CODE, counter_scenario, counter_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.farm import farm_members, process_farm, read_state
from tests.support.gateway import replay_through_gateway
from tests.support.waiting import wait_until

# The first two share a server; the third has one of its own.
ENVS = ["library_circulation", "online_retail", "it_helpdesk"]


@pytest.fixture
def farm(tmp_path):
    with process_farm(tmp_path, [default_catalog() / env_id for env_id in ENVS], "--envs-per-server", "2") as catalog:
        yield catalog


def process_names_below(pid: int) -> list[str]:
    """The names (comm) of every process below ``pid``."""
    names, parents = [], {pid}
    for _ in range(3):  # server -> spawner -> worker -> a check worker's child
        children = set()
        for parent in parents:
            for task in Path(f"/proc/{parent}/task").iterdir():
                children |= {int(child) for child in (task / "children").read_text().split()}
        names += [Path(f"/proc/{child}/comm").read_text().strip() for child in children if Path(f"/proc/{child}").exists()]
        parents = children
    return names


def test_environments_that_share_a_server_keep_their_own_ports_tokens_and_workers(farm):
    state = read_state(farm)
    pids = [state["envs"][env_id]["pid"] for env_id in ENVS]
    assert pids[0] == pids[1] != pids[2]
    envs = json.loads(farm.read_text())["envs"]
    assert len({envs[env_id]["url"] for env_id in ENVS}) == 3
    for env_id, endpoint in envs.items():
        assert httpx.get(endpoint["url"] + "/healthz").json()["env_id"] == env_id
        own = httpx.get(endpoint["url"] + "/info", headers={"Authorization": f"Bearer {endpoint['token']}"})
        assert own.status_code == 200 and own.json()["env_id"] == env_id
        for other_id, other in envs.items():
            if other_id != env_id:
                assert httpx.get(endpoint["url"] + "/info", headers={"Authorization": f"Bearer {other['token']}"}).status_code == 401
    # One environment worker per environment, the two of the shared server forked by its one spawner.
    below = process_names_below(pids[0])
    assert below.count("spawner") == 1 and below.count("env-worker") == 2, below
    members = farm_members(state)
    assert sorted(members["server"]) == sorted(set(pids)) and len(members["spawner"]) == 2 and not members["stray"], members
    for env_id in ENVS[:2]:
        assert replay_through_gateway(farm, env_id).score == 1.0
    status = envscaler("farm", "status", "--catalog", str(farm))
    assert status.returncode == 0 and "3/3 healthy, 0 restart(s)" in status.stdout


def test_a_shared_server_that_dies_takes_its_environments_with_it_and_they_come_back(farm):
    before = read_state(farm)
    shared, alone = before["envs"][ENVS[0]]["pid"], before["envs"][ENVS[2]]["pid"]
    os.kill(shared, signal.SIGKILL)

    def back() -> bool:
        records = read_state(farm)["envs"]
        return all(records[env_id]["restarts"] == 1 and records[env_id]["status"] == "healthy" for env_id in ENVS[:2])

    wait_until(back)
    after = read_state(farm)["envs"]
    assert after[ENVS[0]]["pid"] == after[ENVS[1]]["pid"] != shared
    assert all(after[env_id]["last_exit"] == "killed by SIGKILL" for env_id in ENVS[:2])
    assert after[ENVS[2]]["restarts"] == 0 and after[ENVS[2]]["pid"] == alone
    envs = json.loads(farm.read_text())["envs"]
    for env_id in ENVS:
        endpoint = envs[env_id]
        assert httpx.get(endpoint["url"] + "/info", headers={"Authorization": f"Bearer {endpoint['token']}"}).status_code == 200
    down = envscaler("farm", "down", "--catalog", str(farm))
    assert down.returncode == 0 and "farm: down (2 servers stopped)" in down.stderr, down.stderr
    wait_until(lambda: not farm_processes(before["farm_id"]), 10)


@pytest.mark.parametrize(("flags", "said"), [
    (["--envs-per-server", "0"], "--envs-per-server"),
    (["--envs-per-server", "65", "--backend", "process"], "64 environments at most"),
    (["--envs-per-server", "2", "--backend", "docker"], "for the process backend"),
    (["--envs-per-server", "2", "--backend", "process", "--openenv"], "do not go together"),
])
def test_envs_per_server_that_cannot_be_served_is_a_usage_error(tmp_path, flags, said):
    catalog = tmp_path / "farm.json"
    up = envscaler("farm", "up", str(default_catalog() / "it_helpdesk"), "--catalog", str(catalog), *flags)
    assert up.returncode == 2 and said in up.stderr, up.stderr
    assert not catalog.exists() and not (tmp_path / "farm.json.farm").exists()


def test_an_environment_whose_code_fails_to_load_fails_alone_and_its_neighbour_is_served(tmp_path):
    bundles = tmp_path / "bundles"
    write_bundle(bundles, counter_spec(), [counter_scenario()])
    write_bundle(bundles, counter_spec(env_id="broken", env_class_code=COUNTER_CODE + "\nraise RuntimeError('no table today')\n"),
                 [counter_scenario(env_id="broken")])
    catalog = tmp_path / "farm.json"
    up = envscaler("farm", "up", str(bundles), "--backend", "process", "--catalog", str(catalog), "--envs-per-server", "2")
    # farm up wants every environment healthy: it fails, naming the broken one alone, and cleans up.
    assert up.returncode == 1, up.stderr
    assert "broken: failed (broken: class code failed to load: RuntimeError: no table today)" in up.stderr, up.stderr
    assert "counter: " not in up.stderr.replace("counter_001", "")
    assert not catalog.exists()


def test_a_shared_server_refuses_an_environment_without_its_token_or_in_process():
    bundle = str(default_catalog() / ENVS[0])

    def host(argv: list[str], token: str) -> subprocess.CompletedProcess:
        # Its own process: host_main sets no_new_privs on the process that calls it.
        return subprocess.run([sys.executable, "-c", "import sys; from servers.cli import host_main; "
                               f"sys.exit(host_main([{argv!r}], [{token!r}]))"], capture_output=True, text=True, timeout=60)

    refused = host([bundle, "--port", "0"], "")
    assert refused.returncode == 2 and refused.stderr.strip() == f"error: serve: no control token was passed for {bundle}"
    refused = host([bundle, "--port", "0", "--in-process"], "a-token")
    assert refused.returncode == 2 and "run their code in workers, not --in-process" in refused.stderr
