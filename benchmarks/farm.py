"""Farm start-up and footprint: N environments with each backend, memory per server, the idle daemon.

The environments are copies of the bundled catalog under distinct env_ids (``<env>_NN``). For each
backend, the time runs from ``envscaler farm up`` to every server answering (what ``farm up`` waits
for). Memory is read from /proc/PID/smaps_rollup: of each server process (for docker: the
container's main process), and of each environment as a whole (the server and its environment
worker, with bubblewrap's processes when sandboxed; the check worker starts at the first validation):
USS (private pages, what one more costs), PSS (shared pages split among their users) and RSS. The
daemon's CPU while the farm is idle is read from /proc/PID/stat over 10 s. The process backend runs
three ways in one run: the default (servers forked from the zygote, their workers in bubblewrap
sandboxes where bwrap works), and without the sandbox (``--no-sandbox``) forked from the zygote or
each server as its own interpreter (``ENVSCALER_SPAWNER=popen``).
Image builds (docker): one environment image cold (its tag absent) and cached (a no-op).

    python benchmarks/farm.py [--envs 50] [--backend process|docker|both] [--spawner sandbox|zygote|popen|all]

Targets: process: all healthy within 30 s up to 200 environments, 60 s up to 1,000 (issue 13: on a
machine with at least 16 cores) with servers forked from the zygote (the popen run's times are shown
for comparison); docker: 50 healthy within 60 s; USS <= 12 MB per forked server; RSS <= 45 MB per
server; the idle daemon under 5% of a core. Exits 1 when one is missed (docker is skipped, and says
so, when no engine answers).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.processes import process_tree  # noqa: E402
from envscaler import default_catalog, load_bundles, save_bundle  # noqa: E402
from servers.farm.backends.images import docker_answers  # noqa: E402

RSS_TARGET_MB = 45.0
USS_TARGET_MB = 12.0
IDLE_CPU_TARGET = 0.05
IDLE_WINDOW_S = 10.0


def target_s(backend: str, count: int) -> float:
    """Seconds to all healthy that issue 13 asks for."""
    if backend == "docker":
        return 60.0
    return 30.0 if count <= 200 else 60.0


def envscaler(*args: str, spawner: str | None = None) -> float:
    started = time.perf_counter()
    environment = {**os.environ, "ENVSCALER_SPAWNER": spawner} if spawner in ("zygote", "popen") else None
    result = subprocess.run([sys.executable, "-m", "envscaler.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=environment)
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


class Memory(NamedTuple):
    uss: float
    pss: float
    rss: float


def memory(pid: int) -> Memory:
    """USS, PSS and RSS of one process from /proc/PID/smaps_rollup."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value)
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return Memory(uss / 1024, fields.get("Pss", 0) / 1024, fields.get("Rss", 0) / 1024)


def describe_memory(used: list[Memory]) -> str:
    """``USS median 10.9 max 11.4; PSS ...; RSS ... MB per server``."""
    parts = []
    for name in Memory._fields:
        values = [getattr(m, name) for m in used]
        parts.append(f"{name.upper()} median {statistics.median(values):.1f} max {max(values):.1f}")
    return "; ".join(parts) + " MB per server"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(pid: int, window_s: float) -> float:
    """The share of one core that process ``pid`` uses over ``window_s``."""
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(window_s)
    return (cpu_seconds(pid) - before) / (time.monotonic() - started)


def farm_state(catalog: Path) -> dict:
    return json.loads((catalog.parent / (catalog.name + ".farm") / "state.json").read_text())


def server_pids(catalog: Path, backend: str) -> list[int]:
    state = farm_state(catalog)
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


def tree_memory(pid: int) -> Memory:
    """USS, PSS and RSS of process ``pid`` and all below it, added up."""
    parts = [memory(member) for member in process_tree(pid)]
    return Memory(*(sum(getattr(part, name) for part in parts) for name in Memory._fields))


class Measured(NamedTuple):
    seconds: float
    memory: list[Memory]
    environments: list[Memory]
    daemon_cpu: float
    daemon_startup_cpu_s: float


def measure(backend: str, bundle_root: Path, scratch: Path, count: int, spawner: str | None) -> Measured:
    catalog = scratch / f"{backend}-{spawner}.json"
    unboxed = ["--no-sandbox"] if spawner in ("zygote", "popen") else []
    seconds = envscaler("farm", "up", str(bundle_root), "--backend", backend, "--catalog", str(catalog), "--timeout", "900",
                        *unboxed, spawner=spawner)
    try:
        daemon = farm_state(catalog)["daemon_pid"]
        startup_cpu_s = cpu_seconds(daemon)
        time.sleep(2.0)  # let every server finish its start-up allocations, the daemon its start-up work
        servers = server_pids(catalog, backend)
        used = [memory(pid) for pid in servers]
        environments = [tree_memory(pid) for pid in servers] if backend == "process" else used
        daemon_cpu = idle_cpu(daemon, IDLE_WINDOW_S)
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))
    assert len(used) == count
    return Measured(seconds, used, environments, daemon_cpu, startup_cpu_s)


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def report(backend: str, spawner: str | None, result: Measured, count: int) -> bool:
    """Print one farm's numbers against the targets; whether all were met."""
    name = f"{backend} ({spawner})" if spawner else backend
    target = target_s(backend, count)
    fast = result.seconds <= target
    uss = [m.uss for m in result.memory]
    rss = [m.rss for m in result.memory]
    # Only a forked server can be that small: one interpreter per server is the comparison, not a target.
    unique = spawner == "popen" or statistics.median(uss) <= USS_TARGET_MB
    lean = max(rss) <= RSS_TARGET_MB
    quiet = result.daemon_cpu <= IDLE_CPU_TARGET
    cores = len(os.sched_getaffinity(0))
    # One interpreter per server is the comparison (and the fallback), not what the targets are for.
    judged = f"target <= {target:g} s: {verdict(fast)}" if spawner != "popen" else "for comparison"
    print(f"{name}: {count} environments healthy in {result.seconds:.1f} s on {cores} cores "
          f"({judged}); the daemon used {result.daemon_startup_cpu_s:.1f} s of CPU "
          f"meanwhile (supervision, state file, gateway start-up)")
    print(f"{name}: {describe_memory(result.memory)}"
          f"{f' (USS target <= {USS_TARGET_MB:g} MB: ' + verdict(unique) + ')' if spawner != 'popen' else ''}"
          f" (RSS target <= {RSS_TARGET_MB:g} MB: {verdict(lean)}); all servers together: USS {sum(uss):.0f} MB, "
          f"PSS {sum(m.pss for m in result.memory):.0f} MB")
    if backend == "process":
        print(f"{name}: per environment (server and workers): {describe_memory(result.environments)}; all together: "
              f"USS {sum(m.uss for m in result.environments):.0f} MB, PSS {sum(m.pss for m in result.environments):.0f} MB")
    print(f"{name}: idle daemon CPU {result.daemon_cpu * 100:.2f}% of a core over {IDLE_WINDOW_S:g} s "
          f"(target <= {IDLE_CPU_TARGET * 100:g}%: {verdict(quiet)})")
    return (fast or spawner == "popen") and unique and lean and quiet


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=50, help="environments per farm (default: 50)")
    parser.add_argument("--backend", choices=["process", "docker", "both"], default="both")
    parser.add_argument("--spawner", choices=["sandbox", "zygote", "popen", "all"], default="all",
                        help="process backend: the default (forked servers, sandboxed workers), or unsandboxed forked servers "
                             "or one interpreter each, or all three in one run (default: all)")
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
            spawners = (["sandbox", "zygote", "popen"] if args.spawner == "all" else [args.spawner]) if backend == "process" else [None]
            for spawner in spawners:
                ok = report(backend, spawner, measure(backend, bundle_root, scratch, args.envs, spawner), args.envs) and ok
            cores = len(os.sched_getaffinity(0))
            if backend == "process" and args.envs > 200 and cores < 16:
                print(f"{backend}: note: issue 13's {args.envs}-environment target assumes at least 16 cores; this machine has {cores}")
            if backend == "docker":
                remove_images(client, bundle_dirs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
