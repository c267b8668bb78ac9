"""``envscaler serve``: the command-line face of one environment server.

``python -m servers.cli ENV_DIR [serve's flags]`` runs the same command without loading every other
subcommand (``envscaler`` loads them all, and their imports, before it runs one): a farm starts
hundreds of servers this way (the process backend, its zygote, the Dockerfile's ENTRYPOINT).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from envscaler import Bundle, EnvScalerError, logs
from envscaler.arguments import int_at_least, non_negative_float, positive_float, with_examples
from envscaler.bundle import bundle_path, load_bundle
from envscaler.cgroups import MIN_WORKER_MEMORY_MB, MIN_WORKER_TASKS
from envscaler.loader import precheck_class
from envscaler.requirements import require_installed
from envscaler.confine import confine_problem
from envscaler.sandbox import no_new_privileges, sandbox_problem, warn_unprotected
from servers.app import ServerConfig
from servers.episodes.calls import QUEUE_WAIT_S
from servers.episodes.ids import new_replica_id
from servers.workers.checks import CHECK_IDLE_S
from servers.protocols.openenv.config import OpenEnvConfig

if TYPE_CHECKING:
    from servers.serve import Serving

# ServerConfig field -> the flag that sets it, so that a bad value is reported in the user's words.
_FLAGS = {
    "public_url": "--public-url",
    "max_episodes": "--max-episodes",
    "idle_ttl_s": "--idle-ttl",
    "call_timeout_s": "--call-timeout",
    "check_timeout_s": "--check-timeout",
    "max_body_bytes": "--max-body",
    "worker_threads": "--workers",
    "queue_wait_s": "--queue-wait",
    "inline_budget_s": "--inline-budget",
    "allowed_origins": "--allowed-origin",
    "memory_reserve_mb": "--memory-reserve",
    "openenv_port": "--openenv-port",
    "max_sessions": "--openenv-sessions",
    "session_idle_s": "--openenv-idle",
    "max_steps": "--openenv-max-steps",
    "replica_id": "--replica-id",
    "worker_memory_mb": "--worker-memory-mb",
    "worker_tasks": "--worker-tasks",
    "worker_cpus": "--worker-cpus",
    "check_idle_s": "--check-idle",
}


def _serve(args: argparse.Namespace) -> int:
    from servers.serve import serve_all, serve_in_sandbox

    token = args.token or _read_token_file(args.token_file) or os.environ.get("ENVSCALER_TOKEN")
    serving, problem = _prepare(args, token, load_bundle(str(bundle_path(args.env_dir))))
    if serving.config.worker_process:
        # This process runs no environment code: the workers it starts are what the sandbox holds.
        if problem is not None:
            warn_unprotected(problem)
        serve_all([serving], heartbeat=args.stop_when_stale)
        return 0
    if problem is None:
        serve_in_sandbox(serving.bundle, args.host, args.port, serving.config, announce_token=serving.announce_token,
                         heartbeat=args.stop_when_stale, log_level=args.log_level, listening=serving.listening,
                         openenv_listening=serving.openenv_listening)
    warn_unprotected(problem)
    serve_all([serving], heartbeat=args.stop_when_stale)
    return 0


def _prepare(args: argparse.Namespace, token: str | None, bundle: Bundle) -> tuple[Serving, str | None]:
    """What ``serve``'s arguments ask to serve (``bundle``, loaded from their ENV_DIR), checked (the token
    generated when ``token`` is None), and why its environment code would run unprotected here (None: sandboxed)."""
    from servers.serve import Serving, openenv_listener

    try:
        config = _config(args, token or secrets.token_urlsafe(24))
    except ValidationError as e:
        problems = "; ".join(f"{_FLAGS.get(str(item['loc'][0]), item['loc'][0])}: {item['msg']}" for item in e.errors())
        raise EnvScalerError(f"serve: {problems}") from None
    # A class that cannot compile, or whose Python requirements are not installed, is named once, here,
    # before any sandbox is started for it; where workers run it, the first one loads it before this server
    # listens, and says the same (compiling it here too took a third of a farm server's start-up).
    spec = bundle.spec
    if not config.worker_process:
        precheck_class(spec)
    require_installed(spec.env_id, spec.requires)
    if config.openenv is not None:
        openenv_listener()  # the extra is missing: said here, not by a sandboxed child's traceback
    listening = inherited_listener(args.listen_fd, "--listen-fd")
    openenv_listening = inherited_listener(args.openenv_listen_fd, "--openenv-listen-fd")
    logs.configure(args.log_level)
    if not args.sandbox:
        problem: str | None = "--no-sandbox"
    else:
        # Workers confine themselves once forked (no bubblewrap needed); a server without workers runs in bubblewrap's sandbox.
        problem = confine_problem() if config.worker_process else sandbox_problem()
    if config.worker_process:
        config = config.model_copy(update={"worker_sandbox": problem is None})
    return Serving(bundle, args.host, args.port, config, token is None, listening, openenv_listening), problem


def inherited_listener(fd: int | None, flag: str) -> socket.socket | None:
    """The listening TCP socket inherited at ``fd`` (``flag`` names it in the error), or None without one."""
    if fd is None:
        return None
    try:
        sock = socket.socket(fileno=fd)
        listening = sock.type == socket.SOCK_STREAM and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        listening = False
    if not listening:
        raise EnvScalerError(f"serve: {flag} {fd}: not a listening TCP socket (pass one this process inherits, or use --port)")
    return sock


def _read_token_file(path: str | None) -> str | None:
    """The token in ``path`` (a Docker or Kubernetes secret, say), surrounding whitespace dropped."""
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise EnvScalerError(f"serve: --token-file {path}: {e.strerror or e}") from None
    if not token:
        raise EnvScalerError(f"serve: --token-file {path} is empty")
    return token


def _config(args: argparse.Namespace, token: str) -> ServerConfig:
    return ServerConfig(
        token=token,
        public_url=args.public_url,
        max_episodes=args.max_episodes,
        idle_ttl_s=args.idle_ttl,
        call_timeout_s=args.call_timeout,
        check_timeout_s=args.check_timeout,
        max_body_bytes=args.max_body,
        worker_threads=args.workers,
        queue_wait_s=args.queue_wait,
        inline_budget_s=args.inline_budget,
        allowed_origins=args.allowed_origin or [],
        memory_reserve_mb=args.memory_reserve,
        worker_memory_mb=args.worker_memory_mb,
        worker_tasks=args.worker_tasks,
        worker_cpus=args.worker_cpus,
        check_idle_s=args.check_idle or None,
        max_result_chars=args.max_result_chars,
        max_trajectory_chars=args.max_trajectory_chars,
        openenv=None if args.openenv_port is None else OpenEnvConfig(
            openenv_port=args.openenv_port,
            max_sessions=args.openenv_sessions,
            session_idle_s=args.openenv_idle,
            max_steps=args.openenv_max_steps,
        ),
        replica_id=new_replica_id() if args.replica_id == "auto" else args.replica_id,
        worker_process=not args.in_process,
    )


def register_serve(commands: Any) -> None:
    """Add ``serve`` to the ``envscaler`` command line."""
    parser = commands.add_parser(
        "serve",
        help="serve one environment: control API + one MCP endpoint per episode",
        description=(
            "Serve one environment bundle over HTTP. Control routes (/episodes, /info, ...) need the bearer "
            "token; each episode's agent endpoint is /episodes/{id}/mcp. Prints one JSON line with the URL "
            "(and the token, when it was generated) once listening."
        ),
        **with_examples("envscaler serve envscaler/catalog/online_retail --port 8000 --token secret",
                        "envscaler serve my_bundles/shop --host 0.0.0.0 --public-url http://shop.example:8000"),
    )
    parser.add_argument("env_dir", metavar="ENV_DIR|ENV", help="bundle directory (env.json + scenarios.jsonl), or an env_id of the bundled catalog")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (default: 8000)")
    parser.add_argument("--token", help="control token (default: $ENVSCALER_TOKEN, else generated and printed)")
    parser.add_argument("--token-file", metavar="PATH",
                        help="read the control token from this file, e.g. a secret mounted by the orchestrator (used when --token is not given)")
    parser.add_argument("--public-url", help="base URL agents reach this server at; makes mcp_url absolute")
    parser.add_argument("--max-episodes", type=int, default=20_000, help="live episodes at most (default: 20000)")
    parser.add_argument("--idle-ttl", type=float, default=3600.0, help="seconds before an unused episode is ended (default: 3600)")
    parser.add_argument("--call-timeout", type=float, default=10.0, help="seconds a tool call may run (default: 10)")
    parser.add_argument("--check-timeout", type=float, default=5.0, help="seconds one check may run (default: 5)")
    parser.add_argument("--check-idle", type=non_negative_float, default=CHECK_IDLE_S, metavar="SECONDS",
                        help="seconds the check worker may sit idle before it is stopped, its memory freed; the next "
                             f"validation starts it again (a fork, milliseconds); 0: never stopped (default: {CHECK_IDLE_S:g})")
    parser.add_argument("--max-body", type=int, default=1_048_576, help="largest request body in bytes (default: 1 MiB)")
    parser.add_argument("--max-result-chars", type=int, default=1_000_000,
                        help="characters of one tool result the agent and the trajectory get; a longer result is cut, "
                             "and the cut is reported to the agent and in the trajectory (default: 1000000)")
    parser.add_argument("--max-trajectory-chars", type=int, default=16_000_000,
                        help="characters of results and arguments one episode's trajectory keeps; past it, results are "
                             "kept cut (marked truncated) (default: 16000000)")
    parser.add_argument("--workers", type=int, default=32, help="threads at most for tool calls that block or run long (default: 32)")
    parser.add_argument("--queue-wait", type=float, default=QUEUE_WAIT_S, metavar="SECONDS",
                        help="seconds a call may wait for one of those threads (all busy with slow calls) before it is "
                        "refused, never run: a tool call gets an error result that says so, a control request 503 "
                        f"(default: {QUEUE_WAIT_S:g}); a call's time limit runs from when it starts, not while it waits")
    parser.add_argument(
        "--inline-budget",
        type=float,
        default=0.02,
        help="seconds a tool call may run on the event loop before it is undone and rerun on a worker thread; "
        "0 runs every call on a worker (default: 0.02)",
    )
    parser.add_argument(
        "--memory-reserve",
        type=float,
        default=32.0,
        help="MB of memory kept free under the server's limit (cgroup or address space): below it, new episodes "
        "are refused with 507 and a reason rather than the server being killed (default: 32)",
    )
    parser.add_argument("--worker-memory-mb", type=int_at_least(MIN_WORKER_MEMORY_MB), default=1024,
                        help="memory in MB that each of the environment's sandboxed workers (its code's, its checks') may "
                        "hold, shared memory and its private /tmp included, where the server can make a memory cgroup "
                        "(as root); elsewhere what it cannot count is refused (default: 1024)")
    parser.add_argument("--worker-tasks", type=int_at_least(MIN_WORKER_TASKS), default=256,
                        help="threads and processes each sandboxed worker may have (a pids cgroup, and a user of its own "
                        "when the server runs as root) (default: 256)")
    parser.add_argument("--worker-cpus", type=positive_float, default=1.0,
                        help="the workers' share of the CPU against other environments' (a cpu cgroup): 1.0 is one "
                        "environment's fair share, not a core (default: 1.0)")
    parser.add_argument("--allowed-origin", action="append", help="browser Origin allowed on MCP routes (repeatable; '*' for any)")
    parser.add_argument(
        "--openenv-port",
        type=int,
        help="also serve the OpenEnv protocol (WebSocket /ws, /reset, /step, /state) on this port; 0 picks a free one "
        "(needs the [openenv] extra; no token: bind it where only trainers reach it)",
    )
    parser.add_argument("--openenv-sessions", type=int, default=2048, help="OpenEnv sessions at most (default: 2048)")
    parser.add_argument("--openenv-idle", type=float, default=600.0, help="seconds before an idle OpenEnv session is reaped (default: 600)")
    parser.add_argument("--openenv-max-steps", type=int, default=50, help="tool calls per OpenEnv episode before it is scored and done (default: 50)")
    parser.add_argument("--replica-id", metavar="ID",
                        help="this server is one replica of many: prefix episode ids with ID ('auto': a fresh random one) "
                             "so that a gateway can route each episode to the replica holding it")
    parser.add_argument("--in-process", action="store_true",
                        help="run the environment's code in this server's own process: one socket hop less per call, but "
                        "a call that freezes it (a C loop) or ends it takes the server and every episode with it, and "
                        "the code shares a process with the token. By default it runs in a worker process (sandboxed "
                        "where a forked process can confine itself) that the server kills and replaces when it must, rebuilding its episodes "
                        "there from their calls, and the checks run in another one that environment code never reaches")
    parser.add_argument("--listen-fd", type=int, metavar="FD",
                        help="serve the listening TCP socket inherited at descriptor FD instead of binding --port (a "
                        "supervisor that holds the port across restarts, as the farm does)")
    parser.add_argument("--openenv-listen-fd", type=int, metavar="FD",
                        help="with --openenv-port: serve OpenEnv on the listening socket inherited at FD instead of binding it")
    parser.add_argument("--stop-when-stale", metavar="FILE",
                        help="stop once FILE has not been touched for 15 s (a farm's heartbeat: no server outlives its daemon)")
    parser.add_argument("--no-sandbox", dest="sandbox", action="store_false",
                        help="run the environment's code without the sandbox (by default its workers confine themselves "
                        "where user namespaces and libseccomp work, and --in-process runs in bubblewrap's: no network, a "
                        "read-only view of only Python and the bundle, no new processes)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(func=_serve)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="envscaler-serve")
    register_serve(parser.add_subparsers(dest="command"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``serve`` arguments (ENV_DIR, --port, ...; the token from $ENVSCALER_TOKEN or --token-file) and serve."""
    no_new_privileges()
    args = _parser().parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except EnvScalerError as e:
        # One line and its exit code (2: the bundle cannot be served here), as from ``envscaler serve``: a
        # farm's process backend and a container's entry point start servers this way.
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


def host_main(argvs: list[list[str]], tokens: list[str]) -> int:
    """Serve several environments from this one process (a farm's ``--envs-per-server``): ``argvs`` are
    their ``serve`` arguments, ``tokens`` their control tokens, in the same order. Each keeps its own
    port, token, limits and sandboxed workers; they share the event loop and this process's limits."""
    from servers.serve import serve_all

    no_new_privileges()
    parser = _parser()
    try:
        servings: list[Serving] = []
        unserved: dict[str, str] = {}
        heartbeat = problem = None
        for argv, token in zip(argvs, tokens, strict=True):
            args = parser.parse_args(["serve", *argv])
            if not token:
                raise EnvScalerError(f"serve: no control token was passed for {args.env_dir}")
            if args.in_process:
                raise EnvScalerError("serve: environments that share a server process run their code in workers, not --in-process")
            bundle = load_bundle(str(bundle_path(args.env_dir)))  # the farm loaded it before it started: it loads
            try:
                serving, problem = _prepare(args, token, bundle)
            except EnvScalerError as e:  # its requirements are missing: its neighbours are served all the same
                unserved[bundle.env_id] = str(e)
                continue
            servings.append(serving)
            heartbeat = args.stop_when_stale
        if problem is not None:
            warn_unprotected(problem)
        serve_all(servings, heartbeat=heartbeat, unserved=unserved)
        return 0
    except EnvScalerError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
