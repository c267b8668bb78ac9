"""``envscaler farm up / status / down``: many environment servers behind one gateway.

``up`` plans the farm (ports, tokens, a farm id), hands the plan to a detached daemon
(``servers.farm.daemon``) and returns once every server is healthy, leaving the farm running. The
catalog file it names is the contract with users and ``envscaler run``; the daemon's plan, state and
logs live next to it in ``<catalog>.farm/``, so ``status`` and ``down`` work from the file alone,
also after the process that ran ``up`` was killed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from envscaler.arguments import int_at_least, non_negative_float, positive_float, positive_int, with_examples
from envscaler.bundle import default_catalog, find_bundles, load_bundle
from envscaler.cgroups import MIN_WORKER_MEMORY_MB, MIN_WORKER_TASKS, ChildGroup, combined
from envscaler.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from envscaler.loader import precheck_class
from envscaler.confine import confine_problem
from envscaler.sandbox import FARM_ID_VARIABLE, UNPROTECTED
from envscaler.wire import DEFAULT_FARM_CATALOG, FarmCatalog, WorkerResources
from servers.errors import FarmError
from servers.farm.backends.images import docker_answers
from servers.farm.models import MAX_ENVS_PER_SERVER, Backend, FarmPaths, FarmPlan, FarmState, Limits, RayPlacement, read_json, write_json
from servers.farm.plan import plan_farm
from servers.farm.backends.process import describe_exit
from servers.farm.teardown import describe_stopped, pid_alive, tear_down
from servers.serve import bind, openenv_listener

DEFAULT_CATALOG = DEFAULT_FARM_CATALOG
# When `up` fails, the servers it names before summing up the rest.
_UNHEALTHY_SHOWN = 20


def _state(paths: FarmPaths) -> FarmState | None:
    return read_json(paths.state, FarmState)


def _spawn_daemon(plan: FarmPlan, paths: FarmPaths) -> subprocess.Popen[bytes]:
    paths.dir.mkdir(parents=True, exist_ok=True)
    write_json(paths.plan, plan)
    with open(paths.daemon_log, "ab") as log:
        # A new session: the farm outlives this command and is not hit by its terminal's Ctrl-C.
        return subprocess.Popen(
            [sys.executable, "-m", "servers.farm.daemon", str(paths.dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, FARM_ID_VARIABLE: plan.farm_id},
        )


def _progress(state: FarmState | None, total: int, started: float) -> str:
    return f"farm: {_counts(state, total)} after {time.monotonic() - started:.1f} s"


def _counts(state: FarmState | None, total: int) -> str:
    """``3/5 healthy (1 restarting, 1 starting)``."""
    counts: dict[str, int] = {}
    for record in (state.envs.values() if state else []):
        counts[record.status] = counts.get(record.status, 0) + 1
    healthy = counts.pop("healthy", 0)
    rest = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return f"{healthy}/{total} healthy{' (' + rest + ')' if rest else ''}"


# A log gets a progress line this often (a terminal gets a live line): a few lines for a big farm, not one per server.
_PROGRESS_EVERY_S = 5.0
_LIVE_EVERY_S = 0.5
_STATE_POLL_S = 0.2


def _wait_ready(daemon: subprocess.Popen[bytes], paths: FarmPaths, total: int, timeout_s: float) -> tuple[FarmState | None, str | None]:
    """Poll the daemon's state file until ready; (state, problem)."""
    started = time.monotonic()
    interactive = sys.stderr.isatty()
    every_s = _LIVE_EVERY_S if interactive else _PROGRESS_EVERY_S
    last_print = started
    state = None
    while True:
        state = _state(paths)
        if state and state.ready:
            problem = None
            break
        if state and state.error:
            problem = state.error
            break
        if (code := daemon.poll()) is not None:
            problem = f"the farm daemon stopped ({describe_exit(code)})"
            break
        if time.monotonic() - started > timeout_s:
            problem = f"not every environment was healthy within {timeout_s:g} s"
            break
        if time.monotonic() - last_print >= every_s:
            line = _progress(state, total, started)
            print(("\r" + line) if interactive else line, end="" if interactive else "\n", file=sys.stderr, flush=True)
            last_print = time.monotonic()
        time.sleep(_STATE_POLL_S)
    line = _progress(state, total, started)
    print(("\r" + line) if interactive else line, file=sys.stderr, flush=True)
    return state, problem


def _tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def farm_up(args: argparse.Namespace) -> int:
    paths = FarmPaths(args.catalog)
    existing = _state(paths)
    if existing and pid_alive(existing.daemon_pid):
        raise FarmError(f"a farm is already running for {paths.catalog} (daemon pid {existing.daemon_pid}); run 'envscaler farm down --catalog {args.catalog}' first")
    previous = read_json(paths.plan, FarmPlan)
    if previous and previous.backend == "swarm" and paths.catalog.exists():
        raise FarmError(f"a swarm farm is already running for {paths.catalog}; run 'envscaler farm down --catalog {args.catalog}' first")
    if paths.dir.exists():
        # Leftovers of a farm whose daemon was killed: remove them before starting over.
        tear_down(paths)
    backend: Backend = args.backend or ("docker" if docker_answers() else "process")
    if backend != "ray" and (args.ray_address or args.ray_resource or args.envs_per_actor != 1):
        raise FarmError("--ray-address, --ray-resource and --envs-per-actor are for the ray backend: add --backend ray")
    if args.openenv and backend != "process":
        raise FarmError("--openenv needs the process backend: add --backend process")
    if args.envs_per_server != 1 and backend != "process":
        raise FarmError("--envs-per-server is for the process backend: add --backend process")
    if args.envs_per_server > MAX_ENVS_PER_SERVER:
        raise FarmError(f"--envs-per-server {args.envs_per_server}: a server process serves {MAX_ENVS_PER_SERVER} environments at most")
    if args.envs_per_server != 1 and args.openenv:
        raise FarmError("--envs-per-server and --openenv do not go together yet: a server that serves OpenEnv serves one environment")
    if args.openenv:
        openenv_listener()  # the extra is missing: one line now, not a daemon's traceback later
    limits = Limits(memory_mb=args.memory_mb, cpus=args.cpus, pids=args.pids, call_timeout_s=args.call_timeout,
                    check_timeout_s=args.check_timeout, check_idle_s=args.check_idle)
    plan = plan_farm(args.env_dirs or [str(default_catalog())], backend, paths.catalog, limits, args.gateway_port, args.openenv)
    if backend == "ray":
        _place_on_ray(args, plan)
    if backend != "swarm" and plan.gateway_port:
        bind(plan.gateway_host, plan.gateway_port).close()  # a busy port: one line now, not a daemon's traceback later
    plan.allowed_origins = args.allowed_origin or []
    plan.connections_per_client = args.connections_per_client
    plan.probes.period_s = args.probe_period
    plan.probes.timeout_s = args.probe_timeout
    plan.envs_per_server = args.envs_per_server
    if backend == "ray":
        plan.sandbox = args.sandbox  # each node checks its own, and refuses to run environment code unsandboxed
    if backend == "process":
        problem = confine_problem() if args.sandbox else "--no-sandbox"  # what its servers' workers need
        plan.sandbox = problem is None
        if problem is not None:
            print(f"farm: warning: {UNPROTECTED} ({problem}); the docker backend isolates every server", file=sys.stderr)
    print(f"farm: starting {len(plan.envs)} environment(s) with the {backend} backend (farm {plan.farm_id})", file=sys.stderr)
    if backend == "swarm":
        from servers.farm.backends.swarm import swarm_up

        return swarm_up(args, paths, plan)
    try:
        daemon = _spawn_daemon(plan, paths)
        state, problem = _wait_ready(daemon, paths, len(plan.envs), args.timeout)
    except KeyboardInterrupt:
        tear_down(paths)
        print("farm: interrupted; stopped everything it had started", file=sys.stderr)
        return EXIT_INTERRUPTED
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        unhealthy = [record for record in (state.envs.values() if state else []) if record.status != "healthy"]
        for record in unhealthy[:_UNHEALTHY_SHOWN]:
            print(f"  {record.env_id}: {record.status}{' (' + record.last_exit + ')' if record.last_exit else ''}", file=sys.stderr)
        if len(unhealthy) > _UNHEALTHY_SHOWN:
            print(f"  ... and {len(unhealthy) - _UNHEALTHY_SHOWN} more not healthy", file=sys.stderr)
        # Tearing down deletes the farm's folder, logs included: show what the daemon said first.
        for line in _tail(paths.daemon_log):
            print(f"  daemon: {line}", file=sys.stderr)
        tear_down(paths)
        return EXIT_FAILED
    print(f"farm: ready; catalog {paths.catalog}, gateway {state.gateway if state else ''}", file=sys.stderr)
    print(paths.catalog)
    return EXIT_OK


def _place_on_ray(args: argparse.Namespace, plan: FarmPlan) -> None:
    """Name the cluster in the plan, and check now that it answers and has room for every environment."""
    from servers.farm.backends.ray import survey

    resources: dict[str, float] = {}
    for item in args.ray_resource or []:
        name, _, amount = item.partition("=")
        try:
            resources[name.strip()] = float(amount)
        except ValueError:
            raise FarmError(f"--ray-resource {item!r}: give NAME=AMOUNT, e.g. farm_node=0.01") from None
    plan.ray = RayPlacement(address=args.ray_address or os.environ.get("RAY_ADDRESS") or "auto", cpus_per_env=args.cpus_per_env,
                            resources=resources, envs_per_actor=args.envs_per_actor)
    capacity = survey(plan.ray, plan.farm_id, plan.limits.memory_mb)
    print(f"farm: Ray cluster at {plan.ray.address}: {capacity.nodes} node(s), room for {capacity.fits} environment(s)", file=sys.stderr)
    if capacity.fits < len(plan.envs):
        wanted = ", ".join(f"{name} {amount:g}" for name, amount in {"CPU": plan.ray.cpus_per_env, **resources}.items())
        raise FarmError(f"the Ray cluster has room for {capacity.fits} of the {len(plan.envs)} environments (each takes {wanted} "
                        f"and {plan.limits.memory_mb} MB): add nodes, or lower --cpus-per-env or --memory-mb")
    plan.gateway_host = args.gateway_host or capacity.address


def farm_status(args: argparse.Namespace) -> int:
    paths = FarmPaths(args.catalog)
    plan = read_json(paths.plan, FarmPlan)
    if plan and plan.backend == "swarm":
        from servers.farm.backends.swarm import swarm_status

        return swarm_status(paths, args.json)
    state = _state(paths)
    if state is None:
        # A file that is no catalog is the user's to fix (exit 2), not a farm that stopped.
        read_json(paths.catalog, FarmCatalog)
        print(f"no farm at {paths.catalog}", file=sys.stderr)
        return EXIT_FAILED
    alive = pid_alive(state.daemon_pid)
    if alive and state.backend == "process":
        _read_resources(state)
    if args.json:
        print(state.model_dump_json(indent=2))
    else:
        total = len(state.envs)
        restarts = sum(record.restarts for record in state.envs.values())
        sandboxed = " (sandboxed)" if state.sandbox else " (NOT sandboxed)" if state.backend == "process" else ""
        print(f"farm {state.farm_id}: {state.backend} backend{sandboxed}, daemon pid {state.daemon_pid} "
              f"{'running' if alive else 'NOT RUNNING'}, gateway {state.gateway}"
              f"{f' ({state.gateway_proxy})' if state.gateway_proxy else ''}, {'ready' if state.ready else 'not ready'}; "
              f"{_counts(state, total) if alive else f'{total} environment(s), status unknown'}, {restarts} restart(s)")
        # At a thousand servers the healthy ones are noise: the list is what needs a look, unless --all.
        shown = [r for r in state.envs.values() if args.all or r.status != "healthy" or r.last_exit]
        if shown:
            print(f"{'env_id':<28} {'status':<11} {'restarts':>8}  {'url':<24} {'workers: MB':>11} {'tasks':>5}  last exit")
        for record in shown:
            oom = " (out of memory)" if record.oom_killed and "out of memory" not in (record.last_exit or "") else ""
            # Without its daemon nobody watches the servers: their last known status says nothing now.
            status = record.status if alive else "unknown"
            used = record.resources or WorkerResources(counted_by="none")
            memory = f"{used.memory_mb:.0f}/{used.memory_limit_mb:.0f}" if used.memory_mb is not None and used.memory_limit_mb else "-"
            tasks = str(used.tasks) if used.tasks is not None else "-"
            print(f"{record.env_id:<28} {status:<11} {record.restarts:>8}  {record.url:<24} {memory:>11} {tasks:>5}  "
                  f"{record.last_exit or ''}{oom}")
        if not alive:
            print(f"the farm's daemon is gone: run 'envscaler farm down --catalog {args.catalog}' to stop what it left running",
                  file=sys.stderr)
    healthy = alive and all(r.status == "healthy" for r in state.envs.values())
    return EXIT_OK if healthy else EXIT_FAILED


def _read_resources(state: FarmState) -> None:
    """Each server's workers' use, from the cgroup the server made for them (where it could)."""
    for record in state.envs.values():
        if record.pid is not None:
            record.resources = combined(ChildGroup.find(record.pid, record.env_id))


def farm_down(args: argparse.Namespace) -> int:
    paths = FarmPaths(args.catalog)
    if not paths.dir.exists() and not paths.catalog.exists():
        print(f"no farm at {paths.catalog}: nothing to do", file=sys.stderr)
        return EXIT_OK
    print(f"farm: down ({describe_stopped(tear_down(paths))})", file=sys.stderr)
    return EXIT_OK


def register_farm(commands: argparse._SubParsersAction) -> None:
    """Add ``envscaler farm up / status / down``."""
    farm = commands.add_parser("farm", help="run many environment servers behind one gateway",
                               **with_examples("envscaler farm up", "envscaler farm status", "envscaler farm down"))
    actions = farm.add_subparsers(dest="farm_command", metavar="ACTION", required=True)

    def catalog_flag(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--catalog", default=DEFAULT_CATALOG, metavar="FILE",
                            help=f"the farm's catalog file: env_id -> url + token, and the gateway (default: {DEFAULT_CATALOG})")

    up = actions.add_parser(
        "up", help="start one server per environment, wait until all are healthy, write the catalog",
        description="Starts a detached farm daemon and returns once every server answers /healthz.",
        **with_examples("envscaler farm up", "envscaler farm up my_bundles/ --backend process --memory-mb 512",
                        "envscaler farm up --backend swarm --registry 10.0.0.5:5000 --replicas 2"),
    )
    up.add_argument("env_dirs", nargs="*", metavar="ENV_DIR", help="bundles or folders of bundles (default: the bundled catalog)")
    up.add_argument("--backend", choices=["docker", "process", "ray", "swarm"],
                    help="docker (hardened containers), process (local subprocesses), ray (actors of an existing Ray "
                         "cluster, each running a sandboxed server on its node) or swarm (services of the Docker Swarm "
                         "that DOCKER_HOST or the local engine manages); default: docker when an engine answers, else process")
    catalog_flag(up)
    up.add_argument("--gateway-port", type=int, default=0,
                    help="port of the gateway: on 127.0.0.1 (default: a free one); swarm: the published port (default: "
                         "Swarm's choice on the ingress, or one derived from the farm id with --gateway-publish host)")
    up.add_argument("--memory-mb", type=int_at_least(MIN_WORKER_MEMORY_MB), default=256,
                    help="memory limit per environment in MB: a container's, its server and workers together (about 130 MB "
                         "in use once they run); process backend: the address-space limit (x4) on each process, and "
                         "the sandboxed workers' memory cgroup, shared memory included (default: 256)")
    up.add_argument("--cpus", type=positive_float, default=1.0,
                    help="CPU limit per server, docker and swarm backends; process backend: the sandboxed workers' CPU "
                         "share against other environments' (default: 1.0)")
    up.add_argument("--pids", type=int_at_least(MIN_WORKER_TASKS), default=128,
                    help="process/thread limit per server, docker and swarm backends; process backend: of the sandboxed "
                         "workers (default: 128)")
    up.add_argument("--call-timeout", type=positive_float, metavar="SECONDS",
                    help="seconds a tool call may run in each server (default: the server's own, 10)")
    up.add_argument("--check-timeout", type=positive_float, metavar="SECONDS",
                    help="seconds one check may run in each server (default: the server's own, 5)")
    up.add_argument("--check-idle", type=non_negative_float, metavar="SECONDS",
                    help="seconds a server's check worker may sit idle before it is stopped, its memory given back; the "
                         "next validation starts it again (a fork, milliseconds); 0: never stopped (default: the server's own, 30)")
    up.add_argument("--connections-per-client", type=positive_int, default=1024, metavar="N",
                    help="connections one client address may hold at the gateway; past it a new one is refused at once "
                         "(a request head must also arrive within 10 s, a body within 60 s) (default: 1024)")
    up.add_argument("--allowed-origin", action="append", metavar="ORIGIN",
                    help="browser Origin the gateway answers with CORS headers (repeatable; '*' for any)")
    up.add_argument("--openenv", action="store_true",
                    help="also serve the OpenEnv protocol from every server (process backend, needs the [openenv] extra); "
                    "the catalog gives each environment's openenv_url")
    up.add_argument("--probe-period", type=positive_float, metavar="SECONDS",
                    help="each server is asked for /healthz once per this many seconds, the farm's probes spread over it; "
                         "one that misses 3 in a row is hung and is restarted (default: 10, or environments/20 when more)")
    up.add_argument("--probe-timeout", type=positive_float, default=2.0, metavar="SECONDS",
                    help="how long a server has to answer a probe; with the process backend this counts the server's own time: "
                         "what it waited for a CPU on a busy machine does not count, so a slow machine does not restart it "
                         "(default: 2)")
    up.add_argument("--no-sandbox", dest="sandbox", action="store_false",
                    help="process backend: run environment code without the sandbox (by default each server's "
                    "environment and check workers confine themselves where user namespaces and libseccomp work: no "
                    "network, nothing of your files but Python, no new processes)")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for every server to be healthy (default: 120)")
    process = up.add_argument_group("process backend")
    process.add_argument("--envs-per-server", type=positive_int, default=1, metavar="N",
                         help=f"environments one server process serves (at most {MAX_ENVS_PER_SERVER}): each keeps its own "
                              "port, token and sandboxed workers, and the server's memory (about 10 MB) is shared among "
                              "them; but they share its event loop (each a fair share of it while another is busy) and its "
                              "limits (--memory-mb times N), and a server that crashes or hangs is restarted with all of "
                              "them (default: 1, a server per environment)")
    swarm = up.add_argument_group("swarm backend")
    swarm.add_argument("--registry", metavar="HOST:PORT", help="registry the farm's images are pushed to and every node pulls from (required)")
    swarm.add_argument("--replicas", type=int, default=1, help="servers per environment, spread over the nodes (default: 1)")
    swarm.add_argument("--gateway-publish", choices=["ingress", "host"], default="ingress",
                       help="ingress: --gateway-replicas gateways behind Swarm's routing mesh; host: one gateway on every "
                            "node, on the same port (for kernels without IPVS) (default: ingress)")
    swarm.add_argument("--gateway-replicas", type=int, default=2, help="gateways with --gateway-publish ingress (default: 2)")
    swarm.add_argument("--gateway-host", metavar="HOST",
                       help="address the catalog names for the gateway (default: the manager's advertised address); ray: "
                            "the address the gateway listens on (default: this machine's address on the Ray cluster)")
    ray = up.add_argument_group("ray backend")
    ray.add_argument("--ray-address", metavar="ADDRESS",
                     help="the cluster: HOST:PORT of its head (GCS), ray://HOST:PORT for Ray Client, or auto "
                          "(default: $RAY_ADDRESS, else auto: the cluster this machine is a node of)")
    ray.add_argument("--cpus-per-env", type=positive_float, default=0.25, metavar="CPUS",
                     help="Ray CPUs each environment's server reserves on its node (default: 0.25)")
    ray.add_argument("--envs-per-actor", type=positive_int, default=1, metavar="N",
                     help="environments each Ray actor holds (their servers are still one process each): an actor "
                          "process costs about 60 MB, and Ray places and moves an actor's environments together (default: 1)")
    ray.add_argument("--ray-resource", action="append", metavar="NAME=AMOUNT",
                     help="a custom Ray resource each server needs, to keep the farm on the nodes that offer it "
                          "(repeatable; e.g. farm_node=0.01 with 'ray start --resources {\"farm_node\": 1}' on the CPU nodes)")
    up.set_defaults(func=farm_up)

    status = actions.add_parser("status", help="show each environment's health and restarts; exit 1 unless all are healthy",
                                **with_examples("envscaler farm status", "envscaler farm status --all",
                                                "envscaler farm status --catalog runs/farm.json --json"))
    catalog_flag(status)
    status.add_argument("--all", action="store_true",
                        help="list every environment (default: a summary, then only those not healthy or ever restarted)")
    status.add_argument("--json", action="store_true", help="print the daemon's full state as JSON")
    status.set_defaults(func=farm_status)

    down = actions.add_parser("down", help="stop the farm and remove every process, container and network it started",
                              **with_examples("envscaler farm down", "envscaler farm down --catalog runs/farm.json"))
    catalog_flag(down)
    down.set_defaults(func=farm_down)


def _build(args: argparse.Namespace) -> int:
    from servers.farm.backends.images import build_images

    bundle_dirs = [Path(d) for root in (args.env_dirs or []) for d in find_bundles(root)]
    if not bundle_dirs and not args.runtime_only:
        raise FarmError("name at least one ENV_DIR (or pass --runtime-only)")
    for directory in bundle_dirs:
        precheck_class(load_bundle(directory).spec)  # before minutes of image building, not in a crash loop after
    results = build_images(bundle_dirs, runtime_only=args.runtime_only, base=args.base_image)
    if args.runtime_only:
        print("built the runtime image (envscaler-runtime:latest)", file=sys.stderr)
    for tag, built, seconds in results:
        print(f"{'built  ' if built else 'cached '} {tag}  ({seconds:.1f} s)")
    return EXIT_OK


def register_build(commands: argparse._SubParsersAction) -> None:
    """Add ``envscaler build``."""
    build = commands.add_parser(
        "build", help="build one image per environment (runtime image + bundle), tagged by spec hash",
        description="Rebuilding an unchanged environment is a no-op. The runtime image (top-level Dockerfile) is "
                    "built first when missing, from wheels made on this host, so no registry or index is needed.",
        **with_examples("envscaler build envscaler/catalog", "envscaler build --runtime-only"),
    )
    build.add_argument("env_dirs", nargs="*", metavar="ENV_DIR", help="bundles or folders of bundles")
    build.add_argument("--runtime-only", action="store_true", help="(re)build the runtime image only (and ENV_DIRs if given)")
    build.add_argument("--base-image", help="base of the runtime image (default: python:3.11-slim if present, else envscaler-base:bookworm)")
    build.set_defaults(func=_build)
