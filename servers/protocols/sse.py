"""The HTTP+SSE transport of MCP 2024-11-05, for clients that still speak only that.

``GET /episodes/{id}/sse`` opens an event stream whose first event, ``endpoint``, names where to post
messages: ``messages?session_id=...``, relative to the stream's URL so that it stays behind the
gateway's prefix. Each ``POST /episodes/{id}/messages?session_id=...`` is answered 202 at once, and
its JSON-RPC answer goes out on the stream as a ``message`` event. The episode id stays the key to
state; the session id only names the stream, and lives as long as it.
"""

from __future__ import annotations

import secrets
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from servers.transport.asgi import json_bytes
from servers.errors import ErrorReply

# Idle streams get a comment this often, so that proxies (the gateway's read timeout) keep them open.
KEEPALIVE_S = 15.0
# Answers a stream may hold before a POST waits for the client to read.
_OUTBOX_SIZE = 64
MAX_STREAMS_PER_EPISODE = 4
"""Open event streams one episode may hold: a client that keeps opening them holds no more of the server."""


def _event(name: str, data: bytes) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


class SseSessions:
    """The open event streams of one server, by session id."""

    def __init__(self) -> None:
        self._outboxes: dict[str, tuple[str, MemoryObjectSendStream[bytes]]] = {}

    def episode_of(self, session_id: str) -> str | None:
        """The episode a session's stream belongs to, or None when no such stream is open."""
        entry = self._outboxes.get(session_id)
        return entry[0] if entry else None

    async def deliver(self, session_id: str, message: Any) -> None:
        """Send one JSON-RPC message down the session's stream (a closed stream drops it)."""
        entry = self._outboxes.get(session_id)
        if entry is not None:
            try:
                await entry[1].send(_event("message", json_bytes(message)))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    async def stream(self, episode_id: str, receive: Any, send: Any) -> None:
        """Serve one event stream until the client goes away; ErrorReply 429 past MAX_STREAMS_PER_EPISODE."""
        if sum(1 for owner, _ in self._outboxes.values() if owner == episode_id) >= MAX_STREAMS_PER_EPISODE:
            raise ErrorReply(429, f"episode {episode_id} holds {MAX_STREAMS_PER_EPISODE} open event streams already: close one first")
        session_id = secrets.token_hex(16)
        outbox, inbox = anyio.create_memory_object_stream[bytes](_OUTBOX_SIZE)
        self._outboxes[session_id] = (episode_id, outbox)
        try:
            headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store"), (b"x-accel-buffering", b"no")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": _event("endpoint", f"messages?session_id={session_id}".encode()), "more_body": True})
            async with anyio.create_task_group() as tasks:

                async def end_on_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tasks.cancel_scope.cancel()

                tasks.start_soon(end_on_disconnect)
                while True:
                    chunk = b": keep-alive\n\n"
                    with anyio.move_on_after(KEEPALIVE_S):
                        chunk = await inbox.receive()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            del self._outboxes[session_id]
            outbox.close()
            inbox.close()
