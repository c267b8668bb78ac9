"""The farm's one base URL: ``/envs/{env_id}/...`` is proxied to that environment's server.

A raw ASGI application over one pooled httpx client, because it sits on every tool call. It sets
``X-Envscaler-Base-Url`` so the servers hand out MCP URLs that go through the gateway too.

Routes of its own: ``GET /healthz`` (open) and ``GET /envs`` (the environment ids, no tokens).
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any

import httpx

from envscaler.wire import GatewayHealth
from servers.asgi import json_bytes, read_body, send_json
from servers.farm.routing import ReplicaRouter, RouteError

Scope = dict[str, Any]

# Headers that describe one hop, not the message (RFC 9110 section 7.6.1), and the ones we set.
_HOP_BY_HOP = {
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"host", b"x-envscaler-base-url",
}
_MAX_BODY = 16 * 1024 * 1024


class Gateway:
    """ASGI proxy from ``/envs/{env_id}/rest`` to ``routes[env_id] + /rest``."""

    def __init__(self, routes: Mapping[str, str], *, read_timeout_s: float = 300.0, router: ReplicaRouter | None = None) -> None:
        # A live mapping: a restarted container may come back at another address.
        self.routes = routes
        # Replicated environments (swarm): the router picks the replica for each request instead of ``routes``.
        self.router = router
        # Tool calls are short; validation and long tool calls are bounded by the servers themselves.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=30.0),
            trust_env=False,
        )

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
                await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Any, send: Any) -> None:
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
        body = await read_body(receive, _MAX_BODY)
        if body is None:
            await send_json(send, 413, json_bytes({"error": f"request body is larger than {_MAX_BODY} bytes"}))
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP_BY_HOP]
        headers.append((b"x-envscaler-base-url", f"{_origin(scope)}/envs/{env_id}".encode()))
        query = scope.get("query_string") or b""
        target = rest.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")

        def attempt(base: str) -> Awaitable[httpx.Response]:
            return self.client.send(self.client.build_request(scope["method"], base + target, headers=headers, content=body), stream=True)

        try:
            if self.router is None:
                response = await attempt(upstream)
            else:
                response = await self.router.forward(env_id, scope["method"], rest, attempt)
        except RouteError as e:
            await send_json(send, e.status, json_bytes({"error": e.message}))
            return
        except httpx.TimeoutException:
            await send_json(send, 504, json_bytes({"error": f"environment {env_id!r} did not answer in time at {upstream}"}))
            return
        except httpx.HTTPError as e:
            await send_json(send, 502, json_bytes({"error": f"environment {env_id!r} is not answering at {upstream}: {e!r}"}))
            return
        try:
            out_headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP]
            await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


def _origin(scope: Scope) -> str:
    """The scheme and host the client used to reach the gateway."""
    for name, value in scope["headers"]:
        if name == b"host":
            return f"{scope.get('scheme', 'http')}://{value.decode('latin-1')}"
    host, port = scope.get("server") or ("127.0.0.1", 80)
    return f"{scope.get('scheme', 'http')}://{host}:{port}"
