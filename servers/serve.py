"""Run one environment server: bind, print where it listens, serve until SIGINT/SIGTERM; or several
environments from one process (:func:`serve_all`: a farm's ``--envs-per-server``), each on its own port.

In a sandbox (:func:`serve_in_sandbox`), the server binds its sockets here, on the host's network,
then replaces itself with bubblewrap running ``python -m servers.serve``: inside, with no network of
its own, it serves the sockets it inherited, and reads its settings (the token among them) from an
inherited memory file, never from its command line or environment.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
from pydantic import BaseModel

from envscaler import Bundle, EnvScalerError, load_bundle, logs
from envscaler.guard import keep_alarm_handler, protect_time_limits
from envscaler.sandbox import FARM_ID_VARIABLE, clean_environment, sandboxed
from servers.app import EnvServerApp, ServerConfig, worker_limits
from servers.episodes.calls import share_the_interpreter
from servers.errors import CannotListen, PortTaken
from servers.memory import release_free_memory
from servers.transport.event_loop import loop_factory
from servers.transport.fair_share import FairShare
from servers.transport.http_server import Bounds, HttpServer, descriptor_room
from servers.workers.checks import CheckWorker

log = logging.getLogger("envscaler.server")

# A supervisor that passes a pipe's write end in this variable learns that the server listens
# (one JSON line, then EOF) without polling it.
READY_FD_VARIABLE = "ENVSCALER_READY_FD"


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortTaken(f"cannot listen on {host}:{port}: {e.strerror or e} (another program holds it: pick another port, "
                            "or 0 for a free one)") from None
        raise CannotListen(f"cannot listen on {host}:{port}: {e.strerror or e} (check the address)") from None
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


class SandboxedServe(BaseModel):
    """What a sandboxed server is told by the process that started it (through an inherited file)."""

    bundle_dir: str
    host: str
    config: ServerConfig
    announce_token: bool
    heartbeat: str | None = None
    log_level: str = "info"
    listen_fd: int
    openenv_listen_fd: int | None = None


_SANDBOX_PASSES = (READY_FD_VARIABLE, FARM_ID_VARIABLE, "MALLOC_ARENA_MAX")


def serve_in_sandbox(
    bundle: Bundle, host: str, port: int, config: ServerConfig, *, announce_token: bool,
    heartbeat: str | None = None, log_level: str = "info", listening: socket.socket | None = None,
    openenv_listening: socket.socket | None = None,
) -> None:
    """Bind here, then become ``serve`` inside a bubblewrap sandbox (see the module's doc); never returns.

    Check ``envscaler.sandbox.sandbox_problem()`` first. bwrap forwards no signal, so it is made to
    ignore SIGTERM and SIGINT and the server stays in this process group: SIGTERM or Ctrl-C to the
    group (what a terminal, systemd and the farm send) stops the server gracefully, and bwrap exits
    with its status. SIGKILL to bwrap kills the server with it. ``listening`` (and ``openenv_listening``):
    sockets already listening, passed on instead of binding ``port``.
    """
    if bundle.directory is None:
        raise EnvScalerError(f"{bundle.env_id}: a sandboxed server serves a bundle from its folder; this one was not loaded from one")
    sock = listening if listening is not None else bind(host, port)
    openenv_sock = openenv_listening
    if openenv_sock is None and config.openenv is not None:
        openenv_sock = bind(host, config.openenv.openenv_port)
    settings = SandboxedServe(
        bundle_dir=str(bundle.directory.resolve()), host=host, config=config, announce_token=announce_token,
        heartbeat=str(Path(heartbeat).resolve()) if heartbeat else None, log_level=log_level, listen_fd=sock.fileno(),
        openenv_listen_fd=openenv_sock.fileno() if openenv_sock is not None else None,
    )
    settings_fd = os.memfd_create("envscaler-serve", 0)
    os.write(settings_fd, settings.model_dump_json().encode())
    os.lseek(settings_fd, 0, os.SEEK_SET)
    readable = [settings.bundle_dir] + ([settings.heartbeat] if settings.heartbeat else [])
    command = [sys.executable, "-m", "servers.serve", str(settings_fd)]
    with sandboxed(command, readable=readable) as launch:
        for fd in (*launch.fds, settings_fd, sock.fileno(), *((openenv_sock.fileno(),) if openenv_sock else ())):
            os.set_inheritable(fd, True)
        # The supervisor's ready pipe, the farm id, the allocator's setting: no token, no host secrets.
        environment = clean_environment({key: value for key, value in os.environ.items() if key in _SANDBOX_PASSES})
        sys.stdout.flush()
        sys.stderr.flush()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)  # inherited by bwrap; the server installs its own handlers
        launch.enter()
        os.execvpe(launch.argv[0], launch.argv, environment)


@dataclass
class Serving:
    """One environment a server process serves: its bundle, where it listens, its limits and token."""

    bundle: Bundle
    host: str
    port: int
    config: ServerConfig
    announce_token: bool = False
    # Sockets already listening, served instead of binding ``port`` (and the OpenEnv port).
    listening: socket.socket | None = None
    openenv_listening: socket.socket | None = None


def serve(
    bundle: Bundle, host: str, port: int, config: ServerConfig, *, announce_token: bool, heartbeat: str | None = None,
    listening: socket.socket | None = None, openenv_listening: socket.socket | None = None,
) -> None:
    """Serve ``bundle`` until stopped. Prints one JSON line with the URL once listening.

    With ``heartbeat`` (a file its supervisor touches), the server stops itself once the file has not
    been touched for ``HEARTBEAT_STALE_S``: a farm's servers never outlive its daemon. ``listening``
    (and ``openenv_listening``) are sockets already listening, used instead of binding ``port``.
    """
    serve_all([Serving(bundle, host, port, config, announce_token, listening, openenv_listening)], heartbeat=heartbeat)


def serve_all(servings: list[Serving], *, heartbeat: str | None = None, unserved: dict[str, str] | None = None) -> None:
    """Serve every environment of ``servings`` from this one process until stopped (SIGTERM/SIGINT stop
    them all); each keeps its own port, token, limits and workers. Prints one JSON line per environment
    once it listens, and tells a supervisor (``READY_FD_VARIABLE``) once all of them do.

    Several environments share this process's event loop, descriptors and address space: each gets
    an equal share of the connections and buffered bodies one server may hold, so that clients of one
    cannot take what the others need, and a fair share of the event loop (``servers.transport.fair_share``),
    so that a flood of one's requests does not hold up the others' calls. One whose code fails to load
    is not served, and the others are: the supervisor's line names it under ``unserved``, with why
    (alone, it ends the process with its error, as ``envscaler serve`` does). ``unserved``:
    environments of this process already found unservable (env_id: why), named with them.
    ``heartbeat``: as for :func:`serve`.
    """
    protect_time_limits()
    share_the_interpreter()  # for environment code run in this process (--in-process)
    if heartbeat is not None:
        threading.Thread(target=_stop_when_stale, args=(Path(heartbeat),), name="heartbeat", daemon=True).start()
    served: list[_Served] = []
    unserved = dict(unserved or {})
    several = len(servings) + len(unserved) > 1
    fair_share = FairShare() if len(servings) > 1 else None
    for serving, checks in zip(servings, _check_workers(servings)):
        try:
            served.append(_Served(serving, share=len(servings), checks=checks, fair_share=fair_share))
        except EnvScalerError as e:
            if not several:
                raise
            unserved[serving.bundle.env_id] = str(e)
    for env_id, why in unserved.items():
        print(json.dumps({"event": "not served", "env_id": env_id, "error": why}), flush=True)
    if not served:
        raise EnvScalerError("no environment of this server could start: " + "; ".join(unserved.values()))
    keep_alarm_handler()  # tool calls on the event loop are preempted with SIGALRM
    waiting = len(served)

    def announce(one: _Served) -> None:
        nonlocal waiting
        # Only once SIGTERM stops us gracefully: a supervisor may stop us right after this line.
        print(json.dumps(one.ready), flush=True)
        waiting -= 1
        if waiting == 0:
            release_free_memory()  # loading a bundle left garbage: about 1.7 MB of a farm server's 12 MB
            ready = served[0].ready
            if several:
                ready = {"event": "listening", "env_ids": [one.ready["env_id"] for one in served], "unserved": unserved}
            _notify_supervisor(json.dumps({key: value for key, value in ready.items() if key != "token"}))

    def stop_all() -> None:
        for one in served:
            one.server.stop()

    async def serve_everything() -> None:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
        for signum in signals:
            loop.add_signal_handler(signum, stop_all)
        try:
            async with anyio.create_task_group() as tasks:
                for one in served:
                    tasks.start_soon(one.serve, announce)
        finally:
            for signum in signals:
                loop.remove_signal_handler(signum)

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve_everything())
    sys.stdout.flush()


def _check_workers(servings: list[Serving]) -> list[CheckWorker | None]:
    """The check worker of each of ``servings``: one for all those whose checks may run together (in worker
    processes, with the same sandbox, limits and idle time); None for one whose code runs in this process."""
    together: dict[tuple[object, ...], list[Serving]] = {}
    for serving in servings:
        config = serving.config
        if config.worker_process:
            key = (config.worker_sandbox, config.worker_memory_mb, config.worker_tasks, config.worker_cpus, config.check_idle_s)
            together.setdefault(key, []).append(serving)
    workers: dict[int, CheckWorker] = {}
    for group in together.values():
        config = group[0].config
        worker = CheckWorker([(serving.bundle, serving.config.check_timeout_s) for serving in group], sandbox=config.worker_sandbox,
                             group=worker_limits(config), idle_s=config.check_idle_s)
        workers |= {id(serving): worker for serving in group}
    return [workers.get(id(serving)) for serving in servings]


class _Served:
    """One environment of a server process: its application, HTTP server, OpenEnv listener and ready line."""

    def __init__(self, serving: Serving, share: int, checks: CheckWorker | None, fair_share: FairShare | None) -> None:
        config = serving.config
        listener_class = openenv_listener() if config.openenv is not None else None
        self.sock = serving.listening if serving.listening is not None else bind(serving.host, serving.port)
        actual_port = self.sock.getsockname()[1]
        shown_host = "127.0.0.1" if serving.host in ("0.0.0.0", "") else serving.host
        self.app = EnvServerApp(serving.bundle, config, checks)
        self.ready: dict[str, object] = {"event": "listening", "env_id": serving.bundle.env_id, "url": f"http://{shown_host}:{actual_port}",
                                         "port": actual_port}
        if serving.announce_token:
            self.ready["token"] = config.token
        bounds = None if share == 1 else Bounds(max_connections=max(16, descriptor_room() // share),
                                                max_buffered_bytes=Bounds().max_buffered_bytes // share)
        self.server = HttpServer(self.app, max_body_bytes=config.max_body_bytes, bounds=bounds, fair_share=fair_share)
        self.listener = None
        if listener_class is not None and config.openenv is not None:
            openenv_sock = serving.openenv_listening
            if openenv_sock is None:
                openenv_sock = bind(serving.host, config.openenv.openenv_port)
            self.ready["openenv_url"] = f"http://{shown_host}:{openenv_sock.getsockname()[1]}"
            self.listener = listener_class(self.app, config.openenv, openenv_sock)

    async def serve(self, announce: Callable[[_Served], None]) -> None:
        """Serve until the HTTP server is stopped; ``announce`` this environment once it listens."""
        if self.listener is not None:
            await self.listener.start()
        try:
            await self.server.serve(self.sock, on_ready=lambda: announce(self), handle_signals=False)
        finally:
            if self.listener is not None:
                await self.listener.stop()


def _notify_supervisor(line: str) -> None:
    """Write the listening line to the pipe named by ``ENVSCALER_READY_FD`` and close it, if there is one."""
    value = os.environ.pop(READY_FD_VARIABLE, None)
    if value is None:
        return
    try:
        fd = int(value)
        with os.fdopen(fd, "w", closefd=True) as pipe:
            pipe.write(line + "\n")
    except (ValueError, OSError) as e:
        log.warning("could not tell the supervisor that the server listens", extra={"ready_fd": value, "error": repr(e)})


HEARTBEAT_STALE_S = 15.0


def _stop_when_stale(heartbeat: Path) -> None:
    started = time.time()
    while True:
        time.sleep(1.0)
        try:
            touched = heartbeat.stat().st_mtime
        except OSError:
            touched = started  # not there yet (or gone): the grace period counts from our start
        if time.time() - max(touched, started) > HEARTBEAT_STALE_S:
            log.warning("the supervisor's heartbeat stopped; stopping", extra={"heartbeat": str(heartbeat)})
            os.kill(os.getpid(), signal.SIGTERM)  # the graceful stop, as if the supervisor had asked
            return


def openenv_listener() -> type:
    """The OpenEnv listener class; a clear error when the [openenv] extra is not installed."""
    try:
        from servers.protocols.openenv.app import OpenEnvListener
    except ImportError as e:
        raise EnvScalerError(f"the OpenEnv protocol (serve --openenv-port, farm up --openenv) needs openenv-core ({e}); "
                             "install it with: pip install 'envscaler-farm[openenv]'") from None
    return OpenEnvListener


def _serve_sandboxed(settings_fd: int) -> None:
    """Inside the sandbox: read the settings ``serve_in_sandbox`` left, and serve."""
    with os.fdopen(settings_fd, "rb") as file:
        settings = SandboxedServe.model_validate_json(file.read())
    logs.configure(settings.log_level)
    listening = socket.socket(fileno=settings.listen_fd)
    openenv_listening = socket.socket(fileno=settings.openenv_listen_fd) if settings.openenv_listen_fd is not None else None
    serve(load_bundle(settings.bundle_dir), settings.host, 0, settings.config, announce_token=settings.announce_token,
          heartbeat=settings.heartbeat, listening=listening, openenv_listening=openenv_listening)


if __name__ == "__main__":
    _serve_sandboxed(int(sys.argv[1]))
