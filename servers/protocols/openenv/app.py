"""The OpenEnv listener: ``openenv-core``'s own HTTP/WebSocket server over this server's episodes.

``openenv-core`` serves the protocol (``/ws`` sessions, ``/reset``, ``/step``, ``/state``,
``/schema``, ``/health``), keeps one session per WebSocket up to ``max_sessions`` and reaps the
ones idle past ``session_idle_s``. It runs under uvicorn on a second socket, on the environment
server's event loop, so its sessions share the server's episode store.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import ConcurrencyConfig
from starlette.websockets import WebSocketDisconnect

from servers.app import EnvServerApp
from servers.protocols.openenv.config import OpenEnvConfig
from servers.protocols.openenv.environment import EndpointContext, FarmEpisodeEnvironment

log = logging.getLogger("envscaler.openenv")

Scope = dict[str, Any]


def build_app(server: EnvServerApp, config: OpenEnvConfig) -> Any:
    """The ASGI application of the OpenEnv listener for one environment server."""
    context = EndpointContext(
        store=server.store,
        env_id=server.bundle.env_id,
        introduction=server.bundle.spec.environment_introduction,
        summary=server.bundle.spec.environment_summary,
        tools=server.store.tool_list(),
        scenarios=server.bundle.scenarios,
        max_steps=config.max_steps,
    )
    concurrency = ConcurrencyConfig(max_concurrent_envs=config.max_sessions, session_timeout=config.session_idle_s)
    app = create_fastapi_app(functools.partial(FarmEpisodeEnvironment, context), CallToolAction, CallToolObservation, concurrency_config=concurrency)
    renamed = {public: real for public, real in context.names.items() if public != real}
    if renamed:
        log.info("tools renamed on the OpenEnv endpoint", extra={"env": context.env_id, "renamed": renamed})
    return _QuietDisconnects(app)


class _QuietDisconnects:
    """Drop the error openenv-core raises when it closes a WebSocket the client already closed."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        with contextlib.suppress(WebSocketDisconnect):
            await self.app(scope, receive, send)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the environment server owns SIGTERM/SIGINT and stops us."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class OpenEnvListener:
    """Serves the OpenEnv application on ``sock`` until ``stop``."""

    def __init__(self, server: EnvServerApp, config: OpenEnvConfig, sock: socket.socket) -> None:
        self.sock = sock
        uvicorn_config = uvicorn.Config(
            build_app(server, config),
            lifespan="on",  # openenv-core starts its session reaper at startup
            ws="websockets-sansio",
            log_level="warning",
            timeout_graceful_shutdown=2,
        )
        self._server = _EmbeddedServer(uvicorn_config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve in the background; returns once the listener answers (the server's ready line promises it)."""
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its startup error
                raise RuntimeError("the OpenEnv listener stopped before it started")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
