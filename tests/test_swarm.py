"""The swarm backend on a real swarm of one manager and two workers (.ci/swarm-setup.sh).

Skipped when no such swarm answers, unless ENVSCALER_REQUIRE_SWARM=1 (set by .ci/run): then they fail.
One farm of 3 environments x 2 replicas serves the tests in order; a worker node is killed in the
last but one and restored whatever happens; the last one takes the farm down and looks at every node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from envscaler import default_catalog, load_bundle
from servers.episodes.ids import replica_of
from servers.farm.backends.images import LABEL_ENV, LABEL_FARM
from tests.support.swarm import Swarm, find_swarm, kill_node, restore_nodes
from tests.support.waiting import wait_until

pytestmark = pytest.mark.swarm

SWARM = find_swarm()
if SWARM is None:
    if os.environ.get("ENVSCALER_REQUIRE_SWARM") == "1":
        raise RuntimeError("ENVSCALER_REQUIRE_SWARM=1 but no swarm answers: run .ci/swarm-setup.sh")
    pytest.skip("no swarm answers (run .ci/swarm-setup.sh; ENVSCALER_REQUIRE_SWARM=1 makes this a failure)", allow_module_level=True)

ENVS = ["online_retail", "it_helpdesk", "library_circulation"]
SCENARIOS = {env_id: load_bundle(default_catalog() / env_id).scenarios for env_id in ENVS}
MCP_HEADERS = {"MCP-Protocol-Version": "2026-07-28"}
HEALTH = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/healthz').read().decode())"


def envscaler(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "envscaler.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "DOCKER_HOST": SWARM.manager})


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def swarm() -> Swarm:
    return SWARM


@pytest.fixture(scope="module")
def farm(tmp_path_factory, swarm):
    catalog = tmp_path_factory.mktemp("swarm-farm") / "farm.json"
    try:
        up = envscaler("farm", "up", *(str(default_catalog() / e) for e in ENVS), "--backend", "swarm", "--registry", swarm.registry,
                       "--replicas", "2", "--gateway-publish", "host", "--memory-mb", "256", "--catalog", str(catalog), timeout=900)
        assert up.returncode == 0, up.stderr
        yield catalog
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))


def farm_id(catalog: Path) -> str:
    return json.loads(catalog.read_text())["farm_id"]


def running_tasks(swarm: Swarm, catalog: Path) -> dict[str, list[str]]:
    """env_id -> the node of each running replica."""
    manager = swarm.client("mgr")
    hostnames = {node.id: node.attrs["Description"]["Hostname"] for node in manager.nodes.list()}
    found = defaultdict(list)
    for service in manager.services.list(filters={"label": f"{LABEL_FARM}={farm_id(catalog)}"}):
        env_id = service.attrs["Spec"]["Labels"].get(LABEL_ENV)
        for task in service.tasks(filters={"desired-state": "running"}):
            if env_id and task["Status"]["State"] == "running":
                found[env_id].append(swarm.node_named(hostnames[task["NodeID"]]))
    return dict(found)


def replica_homes(swarm: Swarm, catalog: Path) -> dict[str, tuple[str, str]]:
    """replica id -> (env_id, node), asked of each replica inside its container."""
    homes = {}
    for name in swarm.nodes:
        label = [f"{LABEL_FARM}={farm_id(catalog)}", LABEL_ENV]
        for container in swarm.client(name).containers.list(filters={"label": label}):
            health = json.loads(container.exec_run(["python3", "-c", HEALTH]).output)
            homes[health["replica"]] = (health["env_id"], name)
    return homes


def gateway_on(swarm: Swarm, catalog: Path, node: str) -> str:
    """The gateway of one node (host publishing: every node serves the farm's port)."""
    port = httpx.URL(json.loads(catalog.read_text())["gateway"]).port
    return f"http://{swarm.nodes[node].address}:{port}"


def test_replicas_spread_over_the_nodes_and_replay_scores_one_on_every_scenario(farm, swarm, tmp_path):
    # 'farm up' returned, so the gateway of every node (host publishing), not just the catalog's, sees every replica.
    for node in swarm.nodes:
        health = httpx.get(f"{gateway_on(swarm, farm, node)}/healthz", timeout=5).json()
        assert health["replicas"] == {env_id: 2 for env_id in ENVS}, (node, health)
    placement = running_tasks(swarm, farm)
    assert sorted(placement) == sorted(ENVS) and all(len(nodes) == 2 for nodes in placement.values())
    assert all(len(set(nodes)) == 2 for nodes in placement.values()), placement
    assert len({node for nodes in placement.values() for node in nodes}) >= 2

    status = envscaler("farm", "status", "--catalog", str(farm))
    assert status.returncode == 0, status.stdout + status.stderr
    assert all(env_id in status.stdout for env_id in ENVS)

    out = tmp_path / "replay.jsonl"
    run = envscaler("run", "--farm", str(farm), "--agent", "replay", "--out", str(out), "--concurrency", "8", "--quiet")
    assert run.returncode == 0, run.stderr
    records = read_records(out)
    assert len(records) == sum(len(s) for s in SCENARIOS.values())
    assert all(r["reward"] == 1.0 and r["termination"] == "finished" for r in records)
    # Creation went to the least-loaded replica: both replicas of every environment held episodes.
    holders = defaultdict(set)
    for record in records:
        holders[record["env_id"]].add(replica_of(record["episode_id"]))
    assert all(len(replicas) == 2 for replicas in holders.values()), holders


def test_any_gateway_replica_routes_every_episode_and_episode_commands_work(farm, swarm):
    catalog = json.loads(farm.read_text())
    env_id = "library_circulation"
    scenario = SCENARIOS[env_id][0]
    headers = {"Authorization": f"Bearer {catalog['envs'][env_id]['token']}"}
    first, second, third = (gateway_on(swarm, farm, node) for node in ("mgr", "w1", "w2"))
    with httpx.Client(timeout=30) as http:
        episodes = [http.post(f"{first}/envs/{env_id}/episodes", json={"scenario_id": scenario.task_id}, headers=headers).json()
                    for _ in range(4)]
        # New episodes go to the replica with the fewest live ones as its last health report said: both get some
        # (an exact 2 and 2 depends on when the reports arrive between the creations).
        assert len({replica_of(e["episode_id"]) for e in episodes}) == 2, [e["episode_id"] for e in episodes]
        for episode in episodes:
            # Tool calls through another node's gateway, validation through a third: no state is shared.
            mcp_url = episode["mcp_url"].replace(first, second)
            for step in scenario.reference_solution:
                body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": step.name, "arguments": step.arguments}}
                result = http.post(mcp_url, json=body, headers=MCP_HEADERS)
                assert result.status_code == 200 and not result.json()["result"].get("isError"), result.text
            validation = http.post(f"{third}/envs/{env_id}/episodes/{episode['episode_id']}/validate", headers=headers)
            assert validation.json()["score"] == 1.0
            assert http.delete(f"{second}/envs/{env_id}/episodes/{episode['episode_id']}", headers=headers).status_code == 200

    new = envscaler("episode", "new", "--farm", str(farm), "--scenario", f"{env_id}/{scenario.task_id}")
    assert new.returncode == 0, new.stderr
    episode = next(line.split()[-1] for line in new.stdout.splitlines() if line.startswith("episode:"))
    assert f"MCP URL:  {catalog['gateway']}/envs/{env_id}/episodes/" in new.stdout
    untouched = envscaler("episode", "validate", "--farm", str(farm), episode)
    assert untouched.returncode == 1 and "score 0." in untouched.stdout
    assert envscaler("episode", "end", "--farm", str(farm), episode).returncode == 0


def test_every_hardening_property_holds_on_a_running_task(farm, swarm):
    catalog = json.loads(farm.read_text())
    token = catalog["envs"]["online_retail"]["token"]
    homes = replica_homes(swarm, farm)
    node = next(node for env_id, node in homes.values() if env_id == "online_retail" and node in swarm.workers())
    engine = swarm.client(node)
    [container, *_] = engine.containers.list(filters={"label": [f"{LABEL_FARM}={farm_id(farm)}", f"{LABEL_ENV}=online_retail"]})
    config, host = container.attrs["Config"], container.attrs["HostConfig"]
    assert config["User"] == "10001:10001"
    assert host["ReadonlyRootfs"] is True and host["CapDrop"] == ["ALL"] and not host.get("CapAdd")
    assert host["Memory"] == 256 * 1024 * 1024 and host["NanoCpus"] == 1_000_000_000 and host["PidsLimit"] == 128
    assert any(m["Type"] == "tmpfs" and m["Target"] == "/tmp" for m in host["Mounts"])
    # The token is a secret file: in no environment variable, no argument, no label, no spec.
    assert token not in json.dumps(container.attrs)
    spec = swarm.client("mgr").services.get(container.labels["com.docker.swarm.service.id"]).attrs["Spec"]
    assert "Env" not in spec["TaskTemplate"]["ContainerSpec"] and token not in json.dumps(spec)

    probe = container.exec_run(["python3", "-c", (
        "import os, json\n"
        "status = open('/proc/1/status').read()\n"
        "try:\n"
        "    environ = open('/proc/1/environ').read()\n"
        "except PermissionError:\n"
        "    environ = None\n"
        "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'env': sorted(os.environ),\n"
        "  'cap': [l for l in status.splitlines() if l.startswith('CapEff')][0].split()[1],\n"
        "  'nnp': [l for l in status.splitlines() if l.startswith('NoNewPrivs')][0].split()[1],\n"
        "  'token': open('/run/secrets/envscaler_token').read(),\n"
        "  'argv': open('/proc/1/cmdline').read(), 'environ': environ}))")])
    facts = json.loads(probe.output)
    assert (facts["uid"], facts["gid"]) == (10001, 10001)
    assert facts["cap"] == "0000000000000000" and facts["nnp"] == "1"
    # The server (pid 1) makes itself undumpable for its workers' sake: its environment is not even readable.
    assert facts["token"] == token and token not in facts["argv"] and facts["environ"] is None
    assert not any("TOKEN" in name for name in facts["env"])
    written = container.exec_run(["python3", "-c", "open('/etc/x', 'w')"])
    assert written.exit_code != 0 and b"Read-only file system" in written.output

    # No egress: the one network is the farm's internal overlay, with no route off its subnet.
    [network_name] = container.attrs["NetworkSettings"]["Networks"]
    network = swarm.client("mgr").networks.get(network_name)
    assert network.attrs["Internal"] is True and network.attrs["Driver"] == "overlay"
    routes = container.exec_run(["python3", "-c", "print(open('/proc/net/route').read())"]).output.decode().splitlines()[1:]
    assert routes and all(line.split()[1] != "00000000" for line in routes if line.strip())
    for address in ("192.0.2.1", swarm.registry.split(":")[0]):
        unreachable = container.exec_run(["python3", "-c", (
            "import socket\ns = socket.socket(); s.settimeout(3)\n"
            f"try:\n    s.connect(('{address}', 80)); print('CONNECTED')\nexcept OSError as e:\n    print(e.errno)")])
        assert unreachable.output.strip() == b"101", address  # ENETUNREACH


def test_a_dead_worker_leaves_every_episode_finished_or_an_infra_error_and_a_rerun_completes(farm, swarm, tmp_path):
    catalog = json.loads(farm.read_text())
    homes = replica_homes(swarm, farm)
    per_worker = {node: sum(home == node for _, home in homes.values()) for node in swarm.workers()}
    victim = max(per_worker, key=per_worker.get)
    doomed_env = next(env_id for env_id, node in homes.values() if node == victim)
    headers = {"Authorization": f"Bearer {catalog['envs'][doomed_env]['token']}"}
    url = catalog["envs"][doomed_env]["url"]
    with httpx.Client(timeout=60) as http:
        # An episode held on the victim, made before it dies: afterwards it must say it is gone.
        doomed = next(episode for episode in (http.post(url + "/episodes", json={"scenario_id": SCENARIOS[doomed_env][0].task_id},
                                                        headers=headers).json() for _ in range(6))
                      if homes[replica_of(episode["episode_id"])][1] == victim)

        out = tmp_path / "run.jsonl"
        command = [sys.executable, "-m", "envscaler.cli", "run", "--farm", str(farm), "--agent", "replay", "--out", str(out),
                   "--repeats", "8", "--concurrency", "8", "--quiet"]
        run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: out.exists() and len(out.read_text().splitlines()) >= 40, 120, "40 records", poll_s=0.5)
            assert run.poll() is None, "the run ended before the node could be killed; make it longer"
            kill_node(victim)
            _, errors = run.communicate(timeout=300)
            records = read_records(out)
            assert len(records) == 8 * sum(len(s) for s in SCENARIOS.values())
            for record in records:
                finished = record["termination"] == "finished" and record["reward"] == 1.0
                lost = record["termination"] == "infra_error" and record["reward"] is None
                assert finished or lost, {k: record[k] for k in ("env_id", "task_id", "termination", "reward", "error")}
            infra = [r for r in records if r["termination"] == "infra_error"]
            assert run.returncode == (1 if infra else 0), errors

            called = http.post(doomed["mcp_url"], headers=MCP_HEADERS,
                               json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}})
            assert called.status_code == 410 and "environment instance gone" in called.json()["error"]
            validation = http.post(f"{url}/episodes/{doomed['episode_id']}/validate", headers=headers)
            assert validation.status_code == 410 and "score" not in validation.json()

            # Swarm reschedules the victim's replicas onto the nodes left.
            def rescheduled() -> bool:
                placement = running_tasks(swarm, farm)
                return all(len(nodes) == 2 and victim not in nodes for nodes in placement.values()) and len(placement) == len(ENVS)

            wait_until(rescheduled, 120, "every environment back at 2 replicas on the nodes left", poll_s=0.5)
            wait_until(lambda: httpx.get(catalog["gateway"] + "/healthz").json()["replicas"] == {e: 2 for e in ENVS}, 60,
                       "the gateway seeing every new replica", poll_s=0.5)
            rerun = envscaler("run", "--farm", str(farm), "--agent", "replay", "--out", str(out), "--repeats", "8", "--quiet")
            assert rerun.returncode == 0, rerun.stderr
            if infra:
                assert f"{len(records) - len(infra)} record(s) already in" in rerun.stderr
            done = {(r["env_id"], r["task_id"], r["repeat"]) for r in read_records(out) if r["termination"] == "finished" and r["reward"] == 1.0}
            assert len(done) == len(records)
        finally:
            if run.poll() is None:
                run.kill()
            restore_nodes()


def test_down_leaves_nothing_on_any_node_or_the_manager(farm, swarm):
    farm_ident = farm_id(farm)
    farm_label = f"{LABEL_FARM}={farm_ident}"
    down = envscaler("farm", "down", "--catalog", str(farm))
    assert down.returncode == 0, down.stderr
    assert not farm.exists() and not (farm.parent / (farm.name + ".farm")).exists()
    manager = swarm.client("mgr")
    assert manager.services.list(filters={"label": farm_label}) == []
    assert manager.secrets.list(filters={"label": farm_label}) == []
    assert manager.configs.list(filters={"label": farm_label}) == []
    assert manager.networks.list(filters={"label": farm_label}) == []

    def nodes_clean() -> bool:
        for name in swarm.nodes:
            engine = swarm.client(name)
            # ignore_removed: a container the node removes between the list and its inspection is gone, as wanted.
            if engine.containers.list(all=True, filters={"label": farm_label}, ignore_removed=True):
                return False
            if any(network.name.startswith(f"envscaler-{farm_ident}") for network in engine.networks.list()):
                return False
        return True

    # The nodes remove their stopped containers a moment after the manager forgot their tasks.
    wait_until(nodes_clean, 30, "every node without the farm's containers and networks", poll_s=0.5)
