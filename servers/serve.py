"""Run one environment server: bind, print where it listens, serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import json
import socket
import sys

import uvicorn
from uvicorn._compat import asyncio_run

from envscaler import load_bundle
from envscaler.guard import keep_alarm_handler
from servers.app import EnvServerApp, ServerConfig


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def serve(bundle_dir: str, host: str, port: int, config: ServerConfig, *, announce_token: bool) -> None:
    """Serve ``bundle_dir`` until stopped. Prints one JSON line with the URL once listening."""
    bundle = load_bundle(bundle_dir)
    sock = bind(host, port)
    actual_port = sock.getsockname()[1]
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{actual_port}"
    app = EnvServerApp(bundle, config)
    keep_alarm_handler()  # tool calls on the event loop are preempted with SIGALRM
    ready: dict[str, object] = {"event": "listening", "env_id": bundle.env_id, "url": url, "port": actual_port}
    if announce_token:
        ready["token"] = config.token
    try:
        import uvloop  # noqa: F401 - optional speed-up

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            http="httptools",
            loop=loop,
            lifespan="on",
            access_log=False,
            log_config=None,
            log_level="warning",
            timeout_graceful_shutdown=5,
            server_header=False,
            date_header=False,
        )
    )

    async def serve_and_announce() -> None:
        # Announce only once uvicorn has started: its SIGTERM handler is in place by then, so a
        # supervisor that stops us right after the line still gets a graceful shutdown.
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.005)
        if server.started:
            print(json.dumps(ready), flush=True)
        await task

    asyncio_run(serve_and_announce(), loop_factory=server.config.get_loop_factory())
    sys.stdout.flush()
