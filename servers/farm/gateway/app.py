"""The farm's one base URL: ``/envs/{env_id}/...`` is proxied to that environment's server.

A raw ASGI application over a pool of keep-alive upstream connections (``servers.farm.gateway.upstream``),
served by ``servers.transport.http_server``: it sits on every tool call. It sets ``X-Envscaler-Base-Url`` so
the servers hand out MCP URLs that go through the gateway too. The farm daemon serves it over fixed
routes, the swarm's gateway service (``servers.farm.gateway.swarm``) over a ``ReplicaRouter``.

An answer with a length of at most the body cap is read whole before it is passed on, so a server
that dies halfway through it is answered 502. Any other answer (an event stream, a chunked body)
streams as it comes, and is cut off, closing the connection, if the server stops short; the
upstream connection is closed when the client goes away.

Routes of its own: ``GET /healthz`` (open) and ``GET /envs`` (the environment ids, no tokens).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from envscaler.wire import GatewayHealth
from servers.transport.asgi import json_bytes, read_body, send_json
from servers.transport.cors import CorsPolicy, request_origin
from servers.farm.gateway.routing import ReplicaRouter, RouteError
from servers.farm.gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTimeout

log = logging.getLogger("envscaler.farm")

Scope = dict[str, Any]

# Headers that describe one hop, not the message (RFC 9110 section 7.6.1), and the ones we set.
_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"transfer-encoding", b"upgrade",
})
# The upstream client frames the request itself, and gets the whole body at once (no 100 Continue).
_NOT_FORWARDED = _HOP_BY_HOP | {b"host", b"content-length", b"expect", b"x-envscaler-base-url"}
MAX_BODY = 16 * 1024 * 1024


class Gateway:
    """ASGI proxy from ``/envs/{env_id}/rest`` to ``routes[env_id] + /rest``."""

    def __init__(
        self,
        routes: Mapping[str, str],
        *,
        read_timeout_s: float = 300.0,
        router: ReplicaRouter | None = None,
        allowed_origins: Sequence[str] = (),
    ) -> None:
        # A live mapping: a restarted container may come back at another address.
        self.routes = routes
        # Replicated environments (swarm): the router picks the replica for each request instead of ``routes``.
        self.router = router
        self.cors = CorsPolicy(list(allowed_origins))
        # Tool calls are short; validation and long tool calls are bounded by the servers themselves.
        self.upstream = UpstreamPool(read_timeout_s=read_timeout_s)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.upstream.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Any, send: Any) -> None:
        if self.cors.enabled:
            origin = request_origin(scope)
            if origin is not None:
                if scope["method"] == "OPTIONS":
                    await self.cors.preflight(scope, origin, send)
                    return
                if not self.cors.allows(origin):
                    await send_json(send, 403, json_bytes({"error": f"origin {origin!r} is not allowed (see farm up --allowed-origin)"}))
                    return
                # The gateway is the farm's browser boundary: the servers behind it see a checked request.
                send = self.cors.wrap(origin, send)
                scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"origin"]}
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.split(b"?", 1)[0]
        if path == b"/healthz":
            replicas = self.router.health() if self.router is not None else None
            await send_json(send, 200, json_bytes(GatewayHealth(envs=len(self.routes), replicas=replicas)))
            return
        if path in (b"/envs", b"/envs/") and scope["method"] == "GET":
            await send_json(send, 200, json_bytes({"envs": sorted(self.routes)}))
            return
        parts = path.split(b"/", 3)  # b"", b"envs", env_id, rest
        if len(parts) < 3 or parts[1] != b"envs":
            await send_json(send, 404, json_bytes({"error": f"no route {scope['method']} {scope['path']}: use /envs/{{env_id}}/..."}))
            return
        env_id = parts[2].decode(errors="replace")
        upstream = self.routes.get(env_id)
        if upstream is None:
            await send_json(send, 404, json_bytes({"error": f"no environment {env_id!r} in this farm; GET /envs lists them"}))
            return
        await self._proxy(scope, receive, send, env_id, upstream.rstrip("/"), b"/" + (parts[3] if len(parts) == 4 else b""))

    async def _proxy(self, scope: Scope, receive: Any, send: Any, env_id: str, upstream: str, rest: bytes) -> None:
        body = await read_body(receive, MAX_BODY)
        if body is None:
            await send_json(send, 413, json_bytes({"error": f"request body is larger than {MAX_BODY} bytes"}))
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in _NOT_FORWARDED]
        headers.append((b"x-envscaler-base-url", f"{_origin(scope)}/envs/{env_id}".encode()))
        query = scope.get("query_string") or b""
        target = rest.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        method = scope["method"]

        def attempt(base: str) -> Awaitable[UpstreamResponse]:
            return self.upstream.request(base, method, target, headers, body)

        response: UpstreamResponse | None = None
        try:
            if self.router is None:
                response = await attempt(upstream)
            else:
                response = await self.router.forward(env_id, method, rest, attempt)
            if not response.complete and _length(response.headers) <= MAX_BODY:
                await response.read()
        except RouteError as e:
            await send_json(send, e.status, json_bytes({"error": e.message}))
        except UpstreamTimeout as e:
            await send_json(send, 504, json_bytes({"error": f"environment {env_id!r} did not answer in time at {upstream}: {e}"}))
        except UpstreamError as e:
            await send_json(send, 502, json_bytes({"error": f"environment {env_id!r} is not answering at {upstream}: {e}"}))
        else:
            await self._pass_on(response, receive, send, env_id)
        finally:
            if response is not None:
                response.release()

    async def _pass_on(self, response: UpstreamResponse, receive: Any, send: Any, env_id: str) -> None:
        """Send the upstream answer to the client: whole when it is here, else as it arrives."""
        headers = [(k, v) for k, v in response.headers if k not in _HOP_BY_HOP]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        if response.complete:
            await send({"type": "http.response.body", "body": response.body})
            return
        # A stream may run for as long as the client stays: when it leaves, stop reading the server.
        watcher = asyncio.ensure_future(_disconnect(receive))
        watcher.add_done_callback(lambda done: done.cancelled() or response.abort())
        try:
            async for chunk in response.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as e:
            if not watcher.done():
                # The response has begun: closing the connection without its end is how the client learns.
                log.warning("environment server stopped in the middle of an answer", extra={"env": env_id, "error": str(e)})
            return
        finally:
            watcher.cancel()
        await send({"type": "http.response.body", "body": b""})


async def _disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _length(headers: list[tuple[bytes, bytes]]) -> int:
    """The Content-Length of a response, or more than any cap when it has none (a stream)."""
    for name, value in headers:
        if name == b"content-length" and value.isdigit():
            return int(value)
    return MAX_BODY + 1


def _origin(scope: Scope) -> str:
    """The scheme and host the client used to reach the gateway."""
    for name, value in scope["headers"]:
        if name == b"host":
            return f"{scope.get('scheme', 'http')}://{value.decode('latin-1')}"
    host, port = scope.get("server") or ("127.0.0.1", 80)
    return f"{scope.get('scheme', 'http')}://{host}:{port}"
