"""Run one environment server: bind, print where it listens, serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from envscaler import EnvScalerError, load_bundle
from envscaler.guard import keep_alarm_handler
from servers.app import EnvServerApp, ServerConfig
from servers.http_server import HttpServer

log = logging.getLogger("envscaler.server")

# A supervisor that passes a pipe's write end in this variable learns that the server listens
# (one JSON line, then EOF) without polling it.
READY_FD_VARIABLE = "ENVSCALER_READY_FD"


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def serve(
    bundle_dir: str, host: str, port: int, config: ServerConfig, *, announce_token: bool, heartbeat: str | None = None
) -> None:
    """Serve ``bundle_dir`` until stopped. Prints one JSON line with the URL once listening.

    With ``heartbeat`` (a file its supervisor touches), the server stops itself once the file has not
    been touched for ``HEARTBEAT_STALE_S``: a farm's servers never outlive its daemon.
    """
    bundle = load_bundle(bundle_dir)
    if heartbeat is not None:
        threading.Thread(target=_stop_when_stale, args=(Path(heartbeat),), name="heartbeat", daemon=True).start()
    listener_class = _openenv_listener() if config.openenv is not None else None
    sock = bind(host, port)
    actual_port = sock.getsockname()[1]
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    url = f"http://{shown_host}:{actual_port}"
    app = EnvServerApp(bundle, config)
    keep_alarm_handler()  # tool calls on the event loop are preempted with SIGALRM
    ready: dict[str, object] = {"event": "listening", "env_id": bundle.env_id, "url": url, "port": actual_port}
    if announce_token:
        ready["token"] = config.token
    server = HttpServer(app, max_body_bytes=config.max_body_bytes)
    listener = None
    if listener_class is not None and config.openenv is not None:
        openenv_sock = bind(host, config.openenv.openenv_port)
        ready["openenv_url"] = f"http://{shown_host}:{openenv_sock.getsockname()[1]}"
        listener = listener_class(app, config.openenv, openenv_sock)

    def announce() -> None:
        _release_free_memory()
        # Only once SIGTERM stops us gracefully: a supervisor may stop us right after this line.
        print(json.dumps(ready), flush=True)
        _notify_supervisor(json.dumps({key: value for key, value in ready.items() if key != "token"}))

    async def serve_all() -> None:
        if listener is not None:
            await listener.start()
        try:
            await server.serve(sock, on_ready=announce)
        finally:
            if listener is not None:
                await listener.stop()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(serve_all())
    sys.stdout.flush()


def _release_free_memory() -> None:
    """Give the allocator's free pages back to the kernel: loading a bundle parses and builds much that
    is garbage once the server listens (about 1.7 MB of a farm server's 12 MB of its own memory)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator keeps what it keeps


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


def _openenv_listener() -> type:
    """The OpenEnv listener class; a clear error when the [openenv] extra is not installed."""
    try:
        from servers.openenv_endpoint.app import OpenEnvListener
    except ImportError as e:
        raise EnvScalerError(f"--openenv-port needs openenv-core ({e}); install it with: pip install 'envscaler-farm[openenv]'") from None
    return OpenEnvListener


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # uvloop is optional (no Windows build): asyncio's own loop works too
        return asyncio.new_event_loop
    return uvloop.new_event_loop
