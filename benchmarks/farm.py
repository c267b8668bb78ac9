"""Farm start-up and footprint: 50 environments with each backend, memory per server, image builds.

The 50 environments are copies of the bundled catalog under distinct env_ids (``<env>_NN``). For each
backend, the time runs from ``envscaler farm up`` to every server answering ``/healthz`` (what
``farm up`` waits for). Memory is read from /proc/PID/smaps_rollup for each server process (for
docker: the container's main process): USS (its own pages: Private_Clean + Private_Dirty), PSS (its
own plus its share of shared pages) and RSS. The process backend runs twice: servers forked from the
zygote (the default) and each as its own interpreter (``ENVSCALER_SPAWNER=popen``), in the same run.
Image builds: one environment image cold (its tag absent) and cached (a no-op).

    python benchmarks/farm.py [--envs 50] [--backend process|docker|both]

Targets: docker 50 healthy <= 60 s, process 50 healthy <= 20 s (200: <= 30 s), <= 45 MB RSS per
server, <= 12 MB USS per server forked from the zygote. Exits 1 when one is missed (docker is skipped,
and says so, when no engine answers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from envscaler import default_catalog, load_bundles, save_bundle
from servers.farm.images import docker_answers

TARGETS_S = {"process": 20.0, "docker": 60.0}
# The bar for a big process farm on a 2-core machine.
PROCESS_200_TARGET_S = 30.0
RSS_TARGET_MB = 45.0
ZYGOTE_USS_TARGET_MB = 12.0


class Memory(NamedTuple):
    uss: float
    pss: float
    rss: float


def envscaler(*args: str, spawner: str | None = None) -> float:
    started = time.perf_counter()
    env = {**os.environ, "ENVSCALER_SPAWNER": spawner} if spawner else None
    result = subprocess.run([sys.executable, "-m", "envscaler.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"envscaler {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return time.perf_counter() - started


def copies(root: Path, count: int) -> list[Path]:
    """``count`` bundles cycling through the catalog, each with its own env_id."""
    bundles = load_bundles(default_catalog())
    written = []
    for number in range(count):
        bundle = bundles[number % len(bundles)].model_copy(deep=True)
        env_id = f"{bundle.env_id}_{number:02d}"
        bundle.spec.env_id = env_id
        for scenario in bundle.scenarios:
            scenario.env_id = env_id
        written.append(save_bundle(bundle, root))
    return written


def memory_mb(pid: int) -> Memory:
    """USS, PSS and RSS of one process in MB, from /proc/PID/smaps_rollup."""
    kb: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[2] == "kB":
            kb[fields[0].rstrip(":")] = int(fields[1])
    return Memory(uss=(kb["Private_Clean"] + kb["Private_Dirty"]) / 1024, pss=kb["Pss"] / 1024, rss=kb["Rss"] / 1024)


def server_pids(catalog: Path, backend: str) -> list[int]:
    state = json.loads((catalog.parent / (catalog.name + ".farm") / "state.json").read_text())
    if backend == "process":
        return [record["pid"] for record in state["envs"].values()]
    import docker

    client = docker.from_env()
    return [client.containers.get(record["container"]).attrs["State"]["Pid"] for record in state["envs"].values()]


def remove_images(client, bundle_dirs: list[Path]) -> None:
    """Remove the environment images of these benchmark copies."""
    for directory in bundle_dirs:
        for image in client.images.list(filters={"label": f"envscaler.env_id={directory.name}"}):
            client.images.remove(image.id, force=True)


def measure(backend: str, bundle_root: Path, scratch: Path, count: int, spawner: str | None = None) -> tuple[float, list[Memory]]:
    catalog = scratch / f"{backend}.json"
    seconds = envscaler("farm", "up", str(bundle_root), "--backend", backend, "--catalog", str(catalog), "--timeout", "300", spawner=spawner)
    try:
        time.sleep(1.0)  # let every server finish its start-up allocations
        memory = [memory_mb(pid) for pid in server_pids(catalog, backend)]
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))
    assert len(memory) == count
    return seconds, memory


def describe_memory(memory: list[Memory]) -> str:
    parts = []
    for name in Memory._fields:
        values = [getattr(m, name) for m in memory]
        parts.append(f"{name.upper()} median {statistics.median(values):.1f} max {max(values):.1f}")
    return "; ".join(parts) + " MB per server"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=50, help="environments per farm (default: 50)")
    parser.add_argument("--backend", choices=["process", "docker", "both"], default="both")
    args = parser.parse_args()
    backends = ["process", "docker"] if args.backend == "both" else [args.backend]
    ok = True
    with tempfile.TemporaryDirectory(prefix="envscaler-farm-bench-") as scratch_dir:
        scratch = Path(scratch_dir)
        bundle_root = scratch / "bundles"
        bundle_dirs = copies(bundle_root, args.envs)
        for backend in backends:
            if backend == "docker":
                if not docker_answers():
                    print("docker: no engine answers, skipped")
                    ok = False
                    continue
                import docker

                client = docker.from_env()
                remove_images(client, bundle_dirs)  # left by an interrupted run: the cold builds must be cold
                runtime = envscaler("build", "--runtime-only")
                probe = bundle_dirs[0]
                cold = envscaler("build", str(probe))
                cached = envscaler("build", str(probe))
                all_cold = envscaler("build", *map(str, bundle_dirs[1:]))
                print(f"docker runtime image (host wheels + docker build --runtime-only): {runtime:.1f} s")
                print(f"docker image build per environment: cold {cold:.2f} s, cached {cached:.2f} s "
                      f"(CLI start-up included); {len(bundle_dirs) - 1} more cold in {all_cold:.1f} s "
                      f"= {all_cold / (len(bundle_dirs) - 1):.2f} s each")
            for spawner in (["zygote", "popen"] if backend == "process" else [None]):
                seconds, memory = measure(backend, bundle_root, scratch, args.envs, spawner)
                target_s = PROCESS_200_TARGET_S if backend == "process" and args.envs >= 200 else TARGETS_S[backend]
                fast = seconds <= target_s
                lean = max(m.rss for m in memory) <= RSS_TARGET_MB
                unique = spawner != "zygote" or max(m.uss for m in memory) <= ZYGOTE_USS_TARGET_MB
                ok = ok and fast and lean and unique
                name = f"{backend} ({spawner})" if spawner else backend
                print(f"{name}: {args.envs} environments healthy in {seconds:.1f} s (target <= {target_s:g} s: "
                      f"{'ok' if fast else 'MISSED'}); {describe_memory(memory)} (RSS target <= {RSS_TARGET_MB:g} MB: "
                      f"{'ok' if lean else 'MISSED'}"
                      + (f"; USS target <= {ZYGOTE_USS_TARGET_MB:g} MB: {'ok' if unique else 'MISSED'})" if spawner == "zygote" else ")"))
            if backend == "docker":
                remove_images(client, bundle_dirs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
