"""The few ASGI helpers the environment server and the farm gateway share: whole bodies and JSON replies."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic_core import PydanticSerializationError, to_json, to_jsonable_python

from envscaler.jsonl import escape_unsafe


def json_bytes(value: Any) -> bytes:
    """Compact JSON, UTF-8 (not ASCII-escaped), of plain data or a pydantic model (wire replies).

    pydantic's Rust encoder, public API: 2-4x faster than ``json.dumps`` on replies from a tool
    result to a trajectory (``benchmarks/server.py`` measures it), and it writes models directly.
    """
    try:
        return to_json(value)
    except PydanticSerializationError:
        # A lone surrogate (an agent's "\udfff", echoed by a tool or kept in the state) cannot be
        # UTF-8: it goes out as its JSON escape, so the reply, the trajectory and the state stay readable.
        return escape_unsafe(json.dumps(to_jsonable_python(value), ensure_ascii=False, separators=(",", ":"))).encode()


MAX_JSON_DEPTH = 64
"""How deeply a request body may nest arrays and objects: deeper is refused before it is parsed.

A JSON-RPC tool call needs a handful of levels; a parser fed a million nested brackets recurses
once per level, which at a raised recursion limit overflows the C stack and kills the server."""


class JsonTooDeep(ValueError):
    """A request body nests deeper than MAX_JSON_DEPTH (or its brackets do not balance)."""


def parse_json(raw: bytes) -> Any:
    """``json.loads(raw)`` for a request body, refusing one that nests deeper than MAX_JSON_DEPTH.

    Raises JsonTooDeep, json.JSONDecodeError or UnicodeDecodeError (all ValueErrors).
    """
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        _check_depth(raw)
    return json.loads(raw)


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _check_depth(raw: bytes) -> None:
    # Without its strings and everything but brackets, a body of depth d empties in d passes of
    # removing innermost pairs; each pass runs at C speed, and at most MAX_JSON_DEPTH of them run.
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(MAX_JSON_DEPTH):
        if not brackets:
            return
        brackets = brackets.replace(b"[]", b"").replace(b"{}", b"")
    if brackets:
        raise JsonTooDeep(f"the JSON nests deeper than {MAX_JSON_DEPTH} levels (or its brackets do not balance)")


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
