"""The few ASGI helpers the environment server and the farm gateway share: whole bodies, JSON requests and replies."""

from __future__ import annotations

import json
import math
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


class BadNumber(str):
    """A number JSON cannot carry (``NaN``, ``Infinity``, ``-Infinity``, or one past a float's range such
    as ``1e400``), as its text: what ``parse_json(..., mark_bad_numbers=True)`` leaves in its place."""

    def problem(self) -> str:
        """Why it is no valid JSON number, for a message."""
        if self[-1].isdigit():
            return f"{self} is out of range (a JSON number must fit a 64-bit float)"
        return f"{self} is not part of JSON (it has no NaN or Infinity)"


class NotAJsonNumber(ValueError):
    """A request body holds a number JSON cannot carry (see BadNumber)."""

    def __init__(self, literal: str) -> None:
        super().__init__(f"not a valid JSON number: {BadNumber(literal).problem()}")


def _refuse_constant(literal: str) -> Any:
    raise NotAJsonNumber(literal)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise NotAJsonNumber(literal)
    return value


def _float_or_mark(literal: str) -> float | BadNumber:
    value = float(literal)
    return BadNumber(literal) if math.isinf(value) else value


# Python's parser takes NaN and Infinity, and turns 1e400 into inf, where JSON has neither: written
# out again they become null (or invalid JSON), so the value would change silently. The hooks cost a
# call per float literal and nothing per other value; built once, not per body.
_STRICT = json.JSONDecoder(parse_float=_finite_float, parse_constant=_refuse_constant)
_MARKING = json.JSONDecoder(parse_float=_float_or_mark, parse_constant=BadNumber)


def parse_json(raw: bytes, *, mark_bad_numbers: bool = False) -> Any:
    """``json.loads(raw)`` for a request body, refusing one that nests deeper than MAX_JSON_DEPTH and
    numbers JSON cannot carry (NotAJsonNumber); ``mark_bad_numbers`` leaves a BadNumber in their place instead.

    Raises JsonTooDeep, NotAJsonNumber, json.JSONDecodeError or UnicodeDecodeError (all ValueErrors).
    """
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        _check_depth(raw)
    decoder = _MARKING if mark_bad_numbers else _STRICT
    # What json.loads does with bytes, on a decoder built once.
    return decoder.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))


def find_bad_number(value: Any, where: str) -> str | None:
    """Where in ``value`` (named from ``where``) the first number JSON cannot carry is, and why, or None.

    Finds a BadNumber, and a float that is not finite (what a parser without the hooks makes of one).
    A loop, not recursion: a value parsed elsewhere may nest as deep as the parser's own limit.
    """
    stack = [(where, value)]
    while stack:
        place, item = stack.pop()
        if isinstance(item, BadNumber):
            return f"{place} is not a valid JSON number: {item.problem()}"
        if isinstance(item, float) and not math.isfinite(item):
            literal = BadNumber("NaN" if math.isnan(item) else "Infinity" if item > 0 else "-Infinity")
            return f"{place} is not a valid JSON number: {literal.problem()}"
        # Pushed last first, so that the first bad number in the text is the one named.
        if isinstance(item, dict):
            stack.extend((f"{place}.{key}", child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((f"{place}[{index}]", item[index]) for index in reversed(range(len(item))))
    return None


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
