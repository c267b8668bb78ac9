"""The few ASGI helpers the environment server and the farm gateway share: whole bodies and JSON replies."""

from __future__ import annotations

from json.encoder import c_make_encoder, encode_basestring
from typing import Any


def _unserialisable(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# One compact C encoder for every reply: json.dumps builds a new one per call, which is half its cost
# for a small reply. No circular-reference markers: replies are built here, never cyclic.
_encode = c_make_encoder(None, _unserialisable, encode_basestring, None, ":", ",", False, False, True)


def json_bytes(value: Any) -> bytes:
    """Compact JSON, UTF-8."""
    return "".join(_encode(value, 0)).encode()


async def send_json(send: Any, status: int, body: bytes | None, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """One JSON response from already-encoded ``body`` (None: empty)."""
    body = body or b""
    # An explicit length spares the client chunked decoding on every tool call.
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Any, limit: int) -> bytes | None:
    """The whole request body, or None as soon as it grows past ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)
