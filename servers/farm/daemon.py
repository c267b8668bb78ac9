"""The farm daemon: runs detached from ``farm up``, owns the servers and serves the gateway.

``python -m servers.farm.daemon FARM_DIR`` reads ``FARM_DIR/plan.json``, starts the backend, watches
health, writes ``FARM_DIR/state.json`` as things change and the catalog file once every server is
healthy, and on SIGTERM or SIGINT stops its servers and exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

import anyio

from envscaler import logs
from envscaler.wire import EnvEndpoint, FarmCatalog
from servers.farm.board import Board
from servers.farm.gateway.front import FrontProxy, haproxy_executable
from servers.farm.gateway.app import MAX_BODY, Gateway
from servers.farm.health import Prober
from servers.errors import FarmError
from servers.farm.models import FarmPaths, FarmPlan, read_json, write_json
from servers.transport.http_server import Bounds, HttpServer, descriptor_room
from servers.serve import bind

log = logging.getLogger("envscaler.farm")

_READY_POLL_S = 0.1
_ORPHAN_POLL_S = 2.0
_HEARTBEAT_S = 3.0


class FarmBackend(Protocol):
    """What the daemon needs from a backend."""

    # Whether the servers' pids (``EnvStatus.pid``) are processes of this machine: their health probes then
    # leave out what the servers waited for a CPU (``servers.farm.health``).
    servers_here: bool

    async def run(self) -> None:
        """Start every environment and keep them running until cancelled."""

    async def stop(self) -> None:
        """Stop what ``run`` started that must not outlive the daemon."""

    async def kill(self, env_id: str, reason: str) -> None:
        """Kill ``env_id``'s server now (it is hung); its restart is reported with ``reason``."""


class LiveRoutes(Mapping[str, str]):
    """env_id -> where the server answers now, read from the board on every request.

    The container's own address when there is one: the gateway skips the loopback relay's hop.
    """

    def __init__(self, board: Board) -> None:
        self.board = board

    def __getitem__(self, env_id: str) -> str:
        record = self.board.state.envs[env_id]
        return record.address or record.url

    def __iter__(self) -> Iterator[str]:
        return iter(self.board.state.envs)

    def __len__(self) -> int:
        return len(self.board.state.envs)


def _backend(plan: FarmPlan, paths: FarmPaths, board: Board) -> FarmBackend:
    if plan.backend == "docker":
        from servers.farm.backends.docker import DockerBackend

        return DockerBackend(plan, paths, board)
    if plan.backend == "ray":
        from servers.farm.backends.ray import RayBackend

        return RayBackend(plan, paths, board)
    from servers.farm.backends.process import ProcessBackend

    return ProcessBackend(plan, paths, board)


async def watch_ready(plan: FarmPlan, paths: FarmPaths, board: Board) -> None:
    """Write the catalog once every server is healthy; report servers that failed to start until then.

    The backends set each server's status as it changes (ready pipe, exit, Docker events, probes);
    this only looks at the board, a few times a second, and stops once the farm is ready.
    """
    while not board.state.ready:
        statuses = [record.status for record in board.state.envs.values()]
        if all(s == "healthy" for s in statuses):
            _write_catalog(plan, paths, board)
            board.set(ready=True)
            log.info("every environment is healthy", extra={"envs": len(statuses)})
            return
        if "failed" in statuses and board.state.error is None:
            failed = [e for e, r in board.state.envs.items() if r.status == "failed"]
            board.set(error=f"{len(failed)} environment(s) failed to start: {', '.join(failed)}")
        await anyio.sleep(_READY_POLL_S)


def _write_catalog(plan: FarmPlan, paths: FarmPaths, board: Board) -> None:
    catalog = FarmCatalog(
        envs={env.env_id: EnvEndpoint(url=_catalog_url(plan, board, env.env_id), token=env.token, openenv_url=env.openenv_url)
              for env in plan.envs},
        gateway=board.state.gateway or "",
        backend=plan.backend,
        farm_id=plan.farm_id,
    )
    write_json(paths.catalog, catalog)


def _catalog_url(plan: FarmPlan, board: Board, env_id: str) -> str:
    """Where the catalog sends users of one environment: its server, or the gateway where servers move
    between machines (ray: Ray restarts a server on whichever node it picks)."""
    if plan.backend == "ray":
        return f"{board.state.gateway}/envs/{env_id}"
    return board.env(env_id).url


async def _stop_on_signal(server: HttpServer) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            server.stop()
            return


async def _stop_when_orphaned(paths: FarmPaths, server: HttpServer) -> None:
    """Stop once the plan file is gone: nobody can run ``farm down`` on a farm whose files were deleted
    (a test's temporary folder cleaned up after the test runner was killed, say), so it stops itself."""
    while paths.plan.exists():
        await anyio.sleep(_ORPHAN_POLL_S)
    log.warning("farm files are gone; stopping the farm", extra={"farm_dir": str(paths.dir)})
    server.stop()


async def _beat(paths: FarmPaths) -> None:
    """Touch the heartbeat file in place (a bind mount follows the inode, not the name)."""
    paths.heartbeat.touch()
    while True:
        os.utime(paths.heartbeat)
        await anyio.sleep(_HEARTBEAT_S)


async def run_daemon(paths: FarmPaths) -> None:
    """Run the farm described by ``paths.plan`` until SIGTERM or SIGINT."""
    plan = read_json(paths.plan, FarmPlan)
    if plan is None:
        raise FarmError(f"{paths.plan}: no plan")
    board = Board(plan, paths)
    backend = _backend(plan, paths, board)
    sock = bind(plan.gateway_host, plan.gateway_port)
    board.set(gateway=f"http://{plan.gateway_host}:{sock.getsockname()[1]}")
    board.flush()
    routes = LiveRoutes(board)
    gateway = Gateway(routes, allowed_origins=plan.allowed_origins)
    # The daemon takes the signals: it stops its servers first, then the gateway.
    bounds = _gateway_bounds(plan)
    front, gateway_sock = _front_proxy(plan, paths, sock, routes, bounds)
    if front is not None:
        # Behind haproxy every connection comes from haproxy's address: haproxy keeps the per-client count.
        bounds = bounds.model_copy(update={"max_connections_per_client": bounds.max_connections})
    server = HttpServer(gateway, max_body_bytes=MAX_BODY, graceful_s=3.0, bounds=bounds)
    board.set(gateway_proxy=front.version() if front is not None else "python")
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_stop_on_signal, server)
        tasks.start_soon(_stop_when_orphaned, paths, server)
        tasks.start_soon(board.flush_forever)
        tasks.start_soon(_beat, paths)
        tasks.start_soon(backend.run)
        tasks.start_soon(watch_ready, plan, paths, board)
        prober = Prober(board, backend.kill, period_s=plan.probes.period_s, timeout_s=plan.probes.timeout_s,
                        misses_allowed=plan.probes.misses_allowed, servers_here=backend.servers_here)
        tasks.start_soon(prober.run)
        if front is not None:
            tasks.start_soon(front.run, paths.dir / "haproxy.log")
        await server.serve(gateway_sock, handle_signals=False)
        if front is not None:
            front.stop()
        await backend.stop()
        tasks.cancel_scope.cancel()
    board.flush()


def _gateway_bounds(plan: FarmPlan) -> Bounds:
    """What the farm's clients may hold of the gateway. Its connections: half the descriptors the
    daemon has left once it holds four per server (a pidfd, a start-up pipe, its listening sockets) and
    its reserve, the other half for the connections it opens to the servers on their behalf. Bodies
    being read: four of the largest it forwards."""
    return Bounds(max_connections=max(16, (descriptor_room() - 4 * len(plan.envs)) // 2),
                  max_connections_per_client=plan.connections_per_client, max_buffered_bytes=4 * MAX_BODY)


def _front_proxy(plan: FarmPlan, paths: FarmPaths, sock: socket.socket, routes: LiveRoutes,
                 bounds: Bounds) -> tuple[FrontProxy | None, socket.socket]:
    """haproxy on the public socket with the Python gateway on a private one behind it, when haproxy is
    installed and takes its configuration; else none, and the Python gateway serves ``sock`` itself."""
    executable = haproxy_executable()
    if executable is None:
        return None, sock
    private = bind("127.0.0.1", 0)
    front = FrontProxy(executable, paths.dir, plan.farm_id, sock, routes, f"http://127.0.0.1:{private.getsockname()[1]}", MAX_BODY,
                       bounds)
    try:
        front.check()
    except RuntimeError as e:
        log.warning("the gateway runs without haproxy in front", extra={"reason": str(e)})
        private.close()
        return None, sock
    return front, private


def _raise_open_files_limit() -> None:
    """Up to the hard limit: the daemon holds a pidfd per server and the gateway's connections (1,024
    by default is less than a farm of 1,000 needs)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m servers.farm.daemon FARM_DIR``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m servers.farm.daemon FARM_DIR", file=sys.stderr)
        return 2
    logs.configure("info")
    _raise_open_files_limit()
    farm_dir = Path(args[0])
    paths = FarmPaths(farm_dir.with_name(farm_dir.name.removesuffix(".farm")))
    anyio.run(run_daemon, paths, backend_options={"use_uvloop": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
