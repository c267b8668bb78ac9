"""The ray backend on a real Ray cluster of three nodes, each in its own network namespace (.ci/ray-setup.sh).

Skipped when no such cluster answers, unless ENVSCALER_REQUIRE_RAY=1 (set by .ci/run): then they fail.
One farm of 12 environments serves the tests in order, started on the head node as a user there would;
a worker node is killed in the last but one and restored whatever happens; the last one takes the farm
down and looks at every node.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from envscaler import default_catalog, load_bundle
from servers.farm.backends.ray_node import NODE_FILES
from servers.farm.teardown import farm_processes, pid_alive
from tests.support.farm import catalog_copies, read_state
from tests.support.ray_cluster import RayCluster, find_cluster, kill_node, restore_nodes
from tests.support.waiting import wait_until

pytestmark = pytest.mark.ray

CLUSTER = find_cluster()
if CLUSTER is None:
    if os.environ.get("ENVSCALER_REQUIRE_RAY") == "1":
        raise RuntimeError("ENVSCALER_REQUIRE_RAY=1 but no Ray cluster answers: run .ci/ray-setup.sh")
    pytest.skip("no Ray cluster answers (run .ci/ray-setup.sh; ENVSCALER_REQUIRE_RAY=1 makes this a failure)", allow_module_level=True)

ENVS = 12
VICTIM = "w2"
# The bar: a lost node's environments are healthy again on the others within this.
RECOVERY_S = 60.0


def envscaler(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "envscaler.cli", *args], capture_output=True, text=True, timeout=timeout)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def nodes_of(cluster: RayCluster, catalog: Path) -> dict[str, str]:
    """env_id -> the node its server runs on now."""
    return {env_id: cluster.node_named(record["url"]) for env_id, record in read_state(catalog)["envs"].items()}


def wait_until_gone(farm_id: str, timeout_s: float = 30.0) -> None:
    """Until no process of the farm is left on any node (its actors end with the daemon's Ray job)."""
    deadline = time.monotonic() + timeout_s
    while farm_processes(farm_id):
        assert time.monotonic() < deadline, [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in farm_processes(farm_id)]
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster() -> RayCluster:
    return CLUSTER


@pytest.fixture(scope="module")
def farm(tmp_path_factory, cluster):
    root = tmp_path_factory.mktemp("ray-farm")
    catalog_copies(root / "envs", ENVS)
    catalog = root / "farm.json"
    restore_nodes()  # all three nodes, whatever an earlier run left
    try:
        up = subprocess.run(cluster.envscaler_on_head("farm", "up", str(root / "envs"), "--backend", "ray", "--ray-address", cluster.address,
                                                      "--catalog", str(catalog), "--probe-period", "1", "--envs-per-actor", "2"),
                             capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stderr
        yield catalog
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))
        restore_nodes()


def test_environments_spread_over_every_node_and_replay_scores_one_on_every_scenario(farm, cluster, tmp_path):
    state = read_state(farm)
    assert state["backend"] == "ray" and state["sandbox"] is True
    placement = Counter(nodes_of(cluster, farm).values())
    assert set(placement) == set(cluster.nodes), placement
    # Ray's SPREAD strategy on three equal nodes: no node is left with fewer than half its share.
    assert min(placement.values()) >= ENVS // len(cluster.nodes) // 2, placement

    catalog = json.loads(farm.read_text())
    gateway = catalog["gateway"]
    assert gateway.startswith(f"http://{cluster.nodes['head'].address}:")
    assert all(endpoint["url"] == f"{gateway}/envs/{env_id}" for env_id, endpoint in catalog["envs"].items())

    out = tmp_path / "replay.jsonl"
    run = envscaler("run", "--farm", str(farm), "--agent", "replay", "--out", str(out), "--concurrency", "8", "--quiet")
    assert run.returncode == 0, run.stderr
    records = read_records(out)
    assert len({record["env_id"] for record in records}) == ENVS
    assert all(record["reward"] == 1.0 for record in records), [r for r in records if r["reward"] != 1.0][:3]


def test_status_shows_the_node_of_every_environment(farm, cluster):
    status = envscaler("farm", "status", "--catalog", str(farm), "--all")
    assert status.returncode == 0, status.stderr
    assert "ray backend (sandboxed)" in status.stdout
    for env_id, node in nodes_of(cluster, farm).items():
        line = next(line for line in status.stdout.splitlines() if line.startswith(env_id + " "))
        assert f"http://{cluster.nodes[node].address}:" in line


def test_a_farm_started_off_the_cluster_through_ray_client(cluster, tmp_path):
    """The daemon on a machine that is no node of the cluster (here: outside every node's namespace), a Ray
    Client of its head; its gateway on this machine, the servers on the nodes."""
    catalog = tmp_path / "farm.json"
    bundles = catalog_copies(tmp_path / "envs", 3, scenarios_per_env=2)
    try:
        up = envscaler("farm", "up", *map(str, bundles), "--backend", "ray", "--ray-address", cluster.client, "--catalog", str(catalog))
        assert up.returncode == 0, up.stderr
        assert f"Ray cluster at {cluster.client}: {len(cluster.nodes)} node(s)" in up.stderr
        out = tmp_path / "replay.jsonl"
        run = envscaler("run", "--farm", str(catalog), "--agent", "replay", "--out", str(out), "--quiet")
        assert run.returncode == 0, run.stderr
        records = read_records(out)
        assert len(records) == 6 and all(r["reward"] == 1.0 for r in records)
        farm_id = read_state(catalog)["farm_id"]
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))
    wait_until_gone(farm_id)


def wait_for_restart(catalog: Path, env_id: str, pid: int) -> dict:
    deadline = time.monotonic() + RECOVERY_S
    while True:
        record = read_state(catalog)["envs"][env_id]
        if record["status"] == "healthy" and record.get("pid") not in (None, pid):
            return record
        assert time.monotonic() < deadline, record
        time.sleep(0.3)


def test_a_server_that_exits_or_hangs_is_started_again_by_ray(farm):
    first, second = sorted(read_state(farm)["envs"].items())[:2]
    os.kill(first[1]["pid"], signal.SIGKILL)
    record = wait_for_restart(farm, first[0], first[1]["pid"])
    assert record["restarts"] == first[1]["restarts"] + 1
    assert record["last_exit"].startswith("killed by SIGKILL on ")

    # A server that stops answering is found by the daemon's probes, and its actor killed for Ray to restart.
    os.kill(second[1]["pid"], signal.SIGSTOP)
    record = wait_for_restart(farm, second[0], second[1]["pid"])
    assert record["last_exit"].startswith("hung: no answer to 3 health probes"), record
    deadline = time.monotonic() + 10
    while pid_alive(second[1]["pid"]):  # the hung server went with its actor
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_lost_node_s_environments_come_back_on_the_others_and_its_episodes_are_lost(farm, cluster, tmp_path):
    catalog = json.loads(farm.read_text())
    victims = [env_id for env_id, node in nodes_of(cluster, farm).items() if node == VICTIM]
    assert victims
    endpoint = catalog["envs"][victims[0]]
    headers = {"Authorization": f"Bearer {endpoint['token']}"}
    scenario_id = load_bundle(default_catalog() / victims[0].rsplit("_", 1)[0]).scenarios[0].task_id
    created = httpx.post(f"{endpoint['url']}/episodes", json={"scenario_id": scenario_id}, headers=headers, timeout=30)
    assert created.status_code == 201, created.text
    episode = created.json()["episode_id"]

    killed_at = time.monotonic()
    kill_node(VICTIM)
    while True:
        state = read_state(farm)["envs"]
        back = all(state[v]["status"] == "healthy" and cluster.node_named(state[v]["url"]) != VICTIM for v in victims)
        if back:
            break
        assert time.monotonic() - killed_at < RECOVERY_S, {v: (state[v]["status"], state[v].get("last_exit")) for v in victims}
        time.sleep(0.5)
    for victim in victims:
        assert state[victim]["restarts"] >= 1
    # Why they moved is told once Ray has declared the node dead, which on a loaded cluster may come after the restart.
    lost = f"its node {cluster.nodes[VICTIM].address}"
    wait_until(lambda: all(lost in (read_state(farm)["envs"][v].get("last_exit") or "") for v in victims), RECOVERY_S,
               "the farm saying the victims' node was lost")
    # The gateway follows a server that moved within a moment of the daemon's seeing it healthy (haproxy is
    # given its new address every 0.5 s); until then a request is answered 503, "not answering".
    wait_until(lambda: httpx.get(f"{endpoint['url']}/healthz", timeout=5).status_code == 200, 10, "the gateway reaching the new server")

    # The episode's state went with its node: never scored, and said so.
    validated = httpx.post(f"{endpoint['url']}/episodes/{episode}/validate", json={}, headers=headers, timeout=30)
    assert validated.status_code == 410, validated.text
    assert "lost" in validated.json()["error"]

    out = tmp_path / "after.jsonl"
    run = envscaler("run", "--farm", str(farm), "--agent", "replay", "--out", str(out), *(a for v in victims for a in ("--scenario", v)),
                    "--quiet")
    assert run.returncode == 0, run.stderr
    records = read_records(out)
    # (a pattern also names the scenarios whose task id it is: their environments run too)
    assert set(victims) <= {r["env_id"] for r in records}
    assert all(r["reward"] == 1.0 for r in records)


def test_farm_down_leaves_nothing_on_any_node(farm):
    farm_id = read_state(farm)["farm_id"]
    assert farm_processes(farm_id)  # the servers and their actors carry the farm's id, on every node
    down = envscaler("farm", "down", "--catalog", str(farm))
    assert down.returncode == 0, down.stderr
    wait_until_gone(farm_id)
    assert not list(NODE_FILES.glob(f"{farm_id}.*"))
    assert not farm.exists()


def test_an_address_where_no_cluster_answers_is_one_line_at_once(tmp_path):
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    up = envscaler("farm", "up", "--backend", "ray", "--ray-address", f"127.0.0.1:{port}", "--catalog", str(tmp_path / "farm.json"),
                   timeout=60)
    assert up.returncode == 2
    assert up.stderr.strip().splitlines()[-1] == (f"error: no Ray cluster answers at 127.0.0.1:{port} (Connection refused): start one "
                                                  "with 'ray start --head', or give its address with --ray-address")
    assert not (tmp_path / "farm.json.farm").exists()


def test_ray_flags_that_cannot_be_used_are_one_line_before_anything_starts(cluster, tmp_path):
    catalog = str(tmp_path / "farm.json")
    cases = [
        (["--backend", "process", "--ray-address", cluster.address],
         "error: --ray-address, --ray-resource and --envs-per-actor are for the ray backend: add --backend ray"),
        (["--backend", "ray", "--ray-address", cluster.address, "--ray-resource", "farm_node"],
         "error: --ray-resource 'farm_node': give NAME=AMOUNT, e.g. farm_node=0.01"),
        (["--backend", "ray", "--ray-address", cluster.address, "--cpus-per-env", "1000"],
         "error: the Ray cluster has room for 0 of the 6 environments (each takes CPU 1000 and 256 MB): add nodes, or lower "
         "--cpus-per-env or --memory-mb"),
    ]
    for flags, message in cases:
        up = envscaler("farm", "up", *flags, "--catalog", catalog, timeout=120)
        assert up.returncode == 2, (flags, up.stderr)
        assert up.stderr.strip().splitlines()[-1] == message
        assert not (tmp_path / "farm.json.farm").exists() and not (tmp_path / "farm.json").exists()
