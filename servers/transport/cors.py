"""CORS for browser-hosted MCP clients: preflight answers and the headers MCP needs a page to read.

Used by an environment server (``envscaler serve --allowed-origin``) and by the farm's gateway
(``envscaler farm up --allowed-origin``). An Origin that is not allowed gets no CORS headers, so the
browser keeps the page from reading the answer; the server also refuses it on MCP routes (403).
"""

from __future__ import annotations

from typing import Any

Scope = dict[str, Any]

# A page can read only the response headers it is told about; MCP clients read these two.
EXPOSED_HEADERS = b"Mcp-Session-Id, MCP-Protocol-Version"
_DEFAULT_ALLOWED_HEADERS = (
    b"Content-Type, Accept, Authorization, Mcp-Session-Id, MCP-Protocol-Version, Mcp-Method, Mcp-Name, Last-Event-ID"
)
_METHODS = b"GET, POST, DELETE, OPTIONS"


def request_origin(scope: Scope) -> str | None:
    """The request's ``Origin`` header, or None (requests that are not from a browser page have none)."""
    for name, value in scope["headers"]:
        if name == b"origin":
            return value.decode("latin-1")
    return None


class CorsPolicy:
    """Which browser origins may call, and the headers that tell the browser so."""

    def __init__(self, allowed_origins: list[str]) -> None:
        self.allowed_origins = list(allowed_origins)

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)

    def allows(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def response_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        """Headers for an answer to an allowed ``origin``: the origin itself (never ``*``), so that it may send credentials."""
        return [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-expose-headers", EXPOSED_HEADERS),
            (b"vary", b"Origin"),
        ]

    async def preflight(self, scope: Scope, origin: str, send: Any) -> None:
        """Answer an ``OPTIONS`` preflight: 204 with what may be sent, or 403 for an origin not allowed."""
        if not self.allows(origin):
            body = f'{{"error": "origin {origin!r} is not allowed (see --allowed-origin)"}}'.encode()
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        requested = next((v for k, v in scope["headers"] if k == b"access-control-request-headers"), None)
        headers = [
            *self.response_headers(origin),
            (b"access-control-allow-methods", _METHODS),
            (b"access-control-allow-headers", requested or _DEFAULT_ALLOWED_HEADERS),
            (b"access-control-max-age", b"600"),
            (b"content-length", b"0"),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    def wrap(self, origin: str, send: Any) -> Any:
        """``send`` that adds the CORS headers for ``origin`` to the response start (replacing any from upstream)."""
        extra = self.response_headers(origin)

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if not k.lower().startswith(b"access-control-") and k.lower() != b"vary"]
                message = {**message, "headers": [*kept, *extra]}
            await send(message)

        return send_with_cors
