"""The ray backend on the 3-node Ray cluster of .ci/ray-setup.sh, against the process backend on the same machine.

Needs that cluster running (``bash .ci/ray-setup.sh``). The ray farm is started on the head node (in its
network namespace, where its daemon joins the cluster and its gateway listens), the process farm here;
both serve ``--envs`` copies of the bundled catalog, sandboxed:

1. start-up: from ``farm up`` to every server healthy behind the gateway, each backend (ray: one
   environment per actor, and ``--group`` per actor); and memory per environment once healthy, USS of
   every process of the farm but its daemon (ray: the actors, their servers and workers) over the
   environments;
2. throughput: ``--clients`` clients calling a tool on their own episodes through the farm's one
   gateway for ``--seconds`` (the copies of one environment), each backend: the ray farm's calls cross
   the nodes' bridge to servers on three nodes, the process farm's stay on loopback;
3. failover (ray): a worker node is killed and the time runs until each of its environments is healthy
   again on another node, by the farm's state.

    python benchmarks/ray.py [--envs 12] [--group 6] [--clients 16] [--seconds 10]

All nodes share this machine's CPUs, so spreading over nodes cannot add CPU here: the throughput
comparison shows what Ray's placement and the hop between nodes cost against local processes. Exits 1
when a target is missed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from common import Verdict, argument_parser, envscaler, report, tool_calls_per_s, tree_memory

from envscaler import default_catalog, load_bundle
from servers.farm.teardown import farm_processes
from tests.support.farm import catalog_copies, read_state
from tests.support.ray_cluster import RayCluster, find_cluster, kill_node, restore_nodes

THROUGHPUT_ENV = "library_circulation"
VICTIM = "w2"
FAILOVER_LIMIT_S = 60.0
# The ray farm's calls cross a bridge and its servers share the machine with three Ray nodes: half the
# process farm's rate is the floor. Its start-up starts an interpreter for each actor besides each
# server (the process backend forks servers from a zygote): it must fit in farm up's default wait.
THROUGHPUT_FLOOR = 0.5
STARTUP_LIMIT_S = 120.0


def up(command: list[str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise SystemExit(f"farm up failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return time.perf_counter() - started


def uss_per_env(catalog: Path) -> float:
    """USS in MB of the farm's servers and what runs below them (ray: from each actor down), per environment."""
    state = read_state(catalog)
    if state["backend"] == "ray":
        roots = [pid for pid in farm_processes(state["farm_id"]) if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::")]
    else:
        roots = [record["pid"] for record in state["envs"].values()]
    return sum(tree_memory(pid).uss for pid in roots) / len(state["envs"])


def measure(catalog_path: Path, clients: int, seconds: float) -> float:
    catalog = json.loads(catalog_path.read_text())
    env_ids = [env_id for env_id in catalog["envs"] if env_id.startswith(THROUGHPUT_ENV)]
    scenario = load_bundle(default_catalog() / THROUGHPUT_ENV).scenarios[0]
    return anyio.run(tool_calls_per_s, catalog, [catalog["gateway"]], env_ids, scenario, clients, seconds)


def failover(cluster: RayCluster, catalog: Path) -> tuple[int, float]:
    """Kill the victim node; how many environments it held, and the seconds until all are healthy elsewhere."""
    homes = {env_id: cluster.node_named(record["url"]) for env_id, record in read_state(catalog)["envs"].items()}
    victims = [env_id for env_id, node in homes.items() if node == VICTIM]
    killed = time.perf_counter()
    kill_node(VICTIM)
    try:
        while True:
            state = read_state(catalog)["envs"]
            if all(state[v]["status"] == "healthy" and cluster.node_named(state[v]["url"]) != VICTIM for v in victims):
                return len(victims), time.perf_counter() - killed
            if time.perf_counter() - killed > 3 * FAILOVER_LIMIT_S:
                raise SystemExit(f"failover: {victims} not healthy {3 * FAILOVER_LIMIT_S:g} s after {VICTIM} died")
            time.sleep(0.2)
    finally:
        restore_nodes()


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--envs", type=int, default=12, help="environments in each farm (default: 12)")
    parser.add_argument("--group", type=int, default=6, help="environments per actor in the second ray farm (default: 6)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients in the throughput test (default: 16)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each throughput measurement (default: 10)")
    args = parser.parse_args()
    cluster = find_cluster()
    if cluster is None:
        raise SystemExit("no Ray cluster answers: run 'bash .ci/ray-setup.sh' first")
    restore_nodes()
    verdicts: list[Verdict] = []
    with tempfile.TemporaryDirectory(prefix="envscaler-ray-bench-") as scratch_dir:
        scratch = Path(scratch_dir)
        bundles = scratch / "bundles"
        catalog_copies(bundles, args.envs)
        process_catalog, ray_catalog, grouped_catalog = scratch / "process.json", scratch / "ray.json", scratch / "grouped.json"
        try:
            process_up = up([sys.executable, "-m", "envscaler.cli", "farm", "up", str(bundles), "--backend", "process",
                             "--catalog", str(process_catalog)])
            process_uss = uss_per_env(process_catalog)
            process_rate = measure(process_catalog, args.clients, args.seconds)
        finally:
            envscaler("farm", "down", "--catalog", str(process_catalog))
        try:
            grouped_up = up(cluster.envscaler_on_head("farm", "up", str(bundles), "--backend", "ray", "--ray-address", cluster.address,
                                                      "--envs-per-actor", str(args.group), "--catalog", str(grouped_catalog)))
            grouped_uss = uss_per_env(grouped_catalog)
        finally:
            envscaler("farm", "down", "--catalog", str(grouped_catalog))
        try:
            ray_up = up(cluster.envscaler_on_head("farm", "up", str(bundles), "--backend", "ray", "--ray-address", cluster.address,
                                                  "--catalog", str(ray_catalog)))
            ray_uss = uss_per_env(ray_catalog)
            nodes = sorted({cluster.node_named(r["url"]) for r in read_state(ray_catalog)["envs"].values()})
            ray_rate = measure(ray_catalog, args.clients, args.seconds)
            lost, back = failover(cluster, ray_catalog)
        finally:
            envscaler("farm", "down", "--catalog", str(ray_catalog))
    print(f"start-up, {args.envs} sandboxed environments: process backend {process_up:.1f} s; ray backend on {', '.join(nodes)} "
          f"{ray_up:.1f} s (ray/process = {ray_up / process_up:.2f}), {grouped_up:.1f} s with {args.group} per actor")
    print(f"memory per environment (USS, servers and workers, ray: and actors): process backend {process_uss:.1f} MB; "
          f"ray backend {ray_uss:.1f} MB, {grouped_uss:.1f} MB with {args.group} per actor")
    print(f"throughput, {args.clients} clients through the gateway: process backend {process_rate:,.0f} tool calls/s; "
          f"ray backend {ray_rate:,.0f} tool calls/s (ray/process = {ray_rate / process_rate:.2f})")
    print(f"failover: {VICTIM} killed; its {lost} environment(s) healthy on the other nodes after {back:.1f} s")
    verdicts.append(Verdict("start-up, ray", f"{ray_up:.1f} s", f"<= {STARTUP_LIMIT_S:g} s", ray_up <= STARTUP_LIMIT_S))
    verdicts.append(Verdict("throughput, ray/process", f"{ray_rate / process_rate:.2f}", f">= {THROUGHPUT_FLOOR:g}",
                            ray_rate / process_rate >= THROUGHPUT_FLOOR))
    verdicts.append(Verdict(f"memory, {args.group} per actor vs 1", f"{grouped_uss:.1f} MB", f"< {ray_uss:.1f} MB", grouped_uss < ray_uss))
    verdicts.append(Verdict("failover: healthy elsewhere", f"{back:.1f} s", f"<= {FAILOVER_LIMIT_S:g} s", back <= FAILOVER_LIMIT_S))
    return report(verdicts)


if __name__ == "__main__":
    sys.exit(main())
