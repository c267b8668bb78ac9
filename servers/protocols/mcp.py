"""The agent's MCP endpoint: JSON-RPC over streamable HTTP, answered with plain JSON.

Both protocol eras are served on one URL, ``/episodes/{id}/mcp``:

- 2026-07-28 (sessionless): ``server/discover``, then self-contained requests whose ``_meta`` names
  the protocol version;
- handshake era (2024-11-05 ... 2025-11-25): ``initialize`` + ``notifications/initialized``.

No ``Mcp-Session-Id`` is ever issued or read: the episode id in the URL is the only key to state.
A sessionless request is checked as the SDK's validation ladder checks it: a routing header
(``MCP-Protocol-Version``, ``Mcp-Method``, ``Mcp-Name``) that is sent must agree with the body and
appear once, else HEADER_MISMATCH; its errors go out with the SDK's HTTP status for their code.
Only the environment's tools are listed and callable; reset, validate and state never appear here.
Tools are listed in strict mode's form, with an ``outputSchema`` where results are objects (sent as
``structuredContent`` too); a call's W3C trace context in ``_meta`` goes into its record.
This lean handler exists because the SDK's transport costs several times more CPU and memory per call
than the environment itself; the tests drive it with the official ``mcp`` client in both eras.
"""

from __future__ import annotations

import re
from typing import Any

from envscaler.models import ToolOutcome
from envscaler.wire import (
    ERROR_CODE_HTTP_STATUS,
    HANDSHAKE_PROTOCOL_VERSIONS,
    HEADER_MISMATCH,
    INVALID_PARAMS,
    INVALID_REQUEST,
    LATEST_HANDSHAKE_VERSION,
    MCP_METHOD_HEADER,
    MCP_NAME_HEADER,
    MCP_PROTOCOL_VERSION_HEADER,
    METHOD_NOT_FOUND,
    MODERN_PROTOCOL_VERSIONS,
    NAME_BEARING_METHODS,
    PARSE_ERROR,
    PROTOCOL_VERSION_META_KEY,
    SERVER_INFO_META_KEY,
    UNSUPPORTED_PROTOCOL_VERSION,
    decode_header_value,
)
from servers.transport.asgi import NotAJsonNumber, find_bad_number, parse_json
from servers.episodes.store import EpisodeRegistry, LiveEpisode

ROUTING_HEADERS = (MCP_PROTOCOL_VERSION_HEADER.encode(), MCP_METHOD_HEADER.encode(), MCP_NAME_HEADER.encode())
"""The request headers (lower case) the endpoint reads; the application hands over these only."""


def _error(request_id: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def parse_error(problem: str) -> dict[str, Any]:
    """The reply to a body that is not JSON (sent with HTTP 400)."""
    return _error(None, PARSE_ERROR, f"parse error: {problem}")


def parse_message(raw: bytes) -> tuple[Any, bool]:
    """An agent's JSON-RPC message, and whether its tool arguments hold numbers JSON cannot carry.

    Such numbers (NaN, Infinity, 1e400) are left as ``asgi.BadNumber`` for ``handle(..., bad_numbers=True)``,
    which refuses the call as the agent's error and records it. Anywhere else they make the body no
    JSON. Raises ValueError for a body that is not JSON.
    """
    try:
        return parse_json(raw), False
    except NotAJsonNumber:
        # Parsed again, only for such a body: the common one costs a single parse.
        message = parse_json(raw, mark_bad_numbers=True)
    envelope = message
    if isinstance(message, dict) and message.get("method") == "tools/call" and isinstance(message.get("params"), dict):
        # The arguments are the call's, refused and recorded as such; the rest is the envelope.
        envelope = {**message, "params": {key: value for key, value in message["params"].items() if key != "arguments"}}
    problem = find_bad_number(envelope, "message")
    if problem is not None:
        raise ValueError(problem)
    return message, True


def _header_mismatch(method: str, params: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why the routing headers disagree with the body, or None: a header that is sent must match, once."""
    seen: dict[bytes, str] = {}
    for name, raw in headers:
        if name in seen:
            return f"{name.decode()} header appears more than once"
        seen[name] = raw.decode("latin-1")
    meta = params.get("_meta")
    body_version = meta.get(PROTOCOL_VERSION_META_KEY) if isinstance(meta, dict) else None
    version = seen.get(ROUTING_HEADERS[0])
    if version is not None and body_version is not None and version != body_version:
        return f"{MCP_PROTOCOL_VERSION_HEADER} header does not match the request envelope's protocol version"
    sent_method = seen.get(ROUTING_HEADERS[1])
    if sent_method is not None and sent_method != method:
        return f"{MCP_METHOD_HEADER} header does not match the request body's method"
    name_key = NAME_BEARING_METHODS.get(method)
    sent_name = seen.get(ROUTING_HEADERS[2])
    if name_key is not None and sent_name is not None and params.get(name_key) is not None:
        if decode_header_value(sent_name) != params[name_key]:
            return f"{MCP_NAME_HEADER} header does not match the request body's {name_key!r} parameter"
    return None


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE_MAX_CHARS = 512  # W3C Trace Context: a longer tracestate may be dropped


def trace_context(meta: dict[str, Any]) -> tuple[str, str | None] | None:
    """A request's W3C trace context from its ``_meta`` (``traceparent``, ``tracestate``), or None.

    A malformed ``traceparent`` (or version ``ff``, or an all-zero id) is ignored, as the W3C
    specification tells receivers; ``tracestate`` counts only beside a valid ``traceparent``.
    """
    parent = meta.get("traceparent")
    if not isinstance(parent, str) or not _TRACEPARENT.fullmatch(parent):
        return None
    version, trace_id, span_id, _flags = parent.split("-")
    if version == "ff" or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    state = meta.get("tracestate")
    return parent, state if isinstance(state, str) and len(state) <= _TRACESTATE_MAX_CHARS else None


def _tool_result(outcome: ToolOutcome, structured: bool, modern: bool) -> dict[str, Any]:
    """The ``tools/call`` result: the text for every client, and the result itself as ``structuredContent``
    when the tool declares an ``outputSchema`` (``structured``) and the result is that object."""
    result: dict[str, Any] = {"content": [{"type": "text", "text": outcome.agent_text}], "isError": outcome.error is not None}
    if structured and isinstance(outcome.result, dict) and not outcome.truncated and outcome.error_kind in (None, "tool"):
        result["structuredContent"] = outcome.result
    if modern:
        result["resultType"] = "complete"
    return result


class McpEndpoint:
    """Answers JSON-RPC messages for the episodes of one store."""

    def __init__(self, store: EpisodeRegistry, server_name: str, instructions: str) -> None:
        self.store = store
        self.server_info = {"name": server_name, "version": "1"}
        self.instructions = instructions
        annotations = store.annotations
        tools = [tool.mcp(annotations[tool.name]) for tool in store.tool_list()]
        self._structured = {tool.name for tool in store.tool_list() if tool.output_schema is not None}
        self._tools_legacy = {"tools": tools}
        self._tools_modern = {"tools": tools, "cacheScope": "private", "ttlMs": 0, "resultType": "complete"}

    async def handle(
        self, live: LiveEpisode, message: Any, headers: list[tuple[bytes, bytes]], *, bad_numbers: bool = False,
    ) -> tuple[int, dict[str, Any] | None]:
        """One JSON-RPC message -> (HTTP status, response body or None for a notification).

        ``headers`` are the request's routing headers (:data:`ROUTING_HEADERS`), names in lower case;
        ``bad_numbers`` is what :func:`parse_message` said of the message.
        """
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0" or not isinstance(message.get("method"), str):
            return 400, _error(message.get("id") if isinstance(message, dict) else None, INVALID_REQUEST, "expected one JSON-RPC 2.0 request object")
        method: str = message["method"]
        if "id" not in message:
            return 202, None  # notifications (initialized, cancelled) need no answer here
        request_id = message["id"]
        params = message.get("params") or {}
        if not isinstance(params, dict):
            return 400, _error(request_id, INVALID_PARAMS, "params must be an object")
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
        version = meta.get(PROTOCOL_VERSION_META_KEY) or next((v.decode("latin-1") for k, v in headers if k == ROUTING_HEADERS[0]), None)
        modern = version in MODERN_PROTOCOL_VERSIONS
        if version and version not in HANDSHAKE_PROTOCOL_VERSIONS and not modern and method != "initialize":
            data = {"supported": [*HANDSHAKE_PROTOCOL_VERSIONS, *MODERN_PROTOCOL_VERSIONS], "requested": version}
            return 400, _error(request_id, UNSUPPORTED_PROTOCOL_VERSION, f"unsupported protocol version {version!r}", data)
        if modern and headers and (mismatch := _header_mismatch(method, params, headers)):
            return ERROR_CODE_HTTP_STATUS[HEADER_MISMATCH], _error(request_id, HEADER_MISMATCH, mismatch)

        if method == "tools/call":
            reply = await self._call(live, request_id, params, modern, bad_numbers)
            return (ERROR_CODE_HTTP_STATUS.get(reply["error"]["code"], 200) if modern and "error" in reply else 200), reply
        if method == "tools/list":
            return 200, {"jsonrpc": "2.0", "id": request_id, "result": self._tools_modern if modern else self._tools_legacy}
        if method == "server/discover":
            return 200, {"jsonrpc": "2.0", "id": request_id, "result": self._discover()}
        if method == "initialize":
            return 200, {"jsonrpc": "2.0", "id": request_id, "result": self._initialize(params)}
        if method == "ping":
            return 200, {"jsonrpc": "2.0", "id": request_id, "result": {}}
        code = METHOD_NOT_FOUND
        return (ERROR_CODE_HTTP_STATUS[code] if modern else 200), _error(request_id, code, f"method {method!r} is not supported by this server")

    async def _call(self, live: LiveEpisode, request_id: Any, params: dict[str, Any], modern: bool, bad_numbers: bool) -> dict[str, Any]:
        name = params.get("name")
        if not isinstance(name, str):
            return _error(request_id, INVALID_PARAMS, "tools/call needs params.name (a string)")
        meta = params.get("_meta")
        trace = trace_context(meta) if isinstance(meta, dict) else None
        outcome = await self.store.call_tool(live, name, params.get("arguments"), check_numbers=bad_numbers, trace=trace)
        return {"jsonrpc": "2.0", "id": request_id, "result": _tool_result(outcome, name in self._structured, modern)}

    def _discover(self) -> dict[str, Any]:
        return {
            "supportedVersions": list(MODERN_PROTOCOL_VERSIONS),
            "capabilities": {"tools": {"listChanged": False}},
            "instructions": self.instructions,
            "cacheScope": "private",
            "ttlMs": 0,
            "resultType": "complete",
            "_meta": {SERVER_INFO_META_KEY: self.server_info},
        }

    def _initialize(self, params: dict[str, Any]) -> dict[str, Any]:
        requested = params.get("protocolVersion")
        version = requested if requested in HANDSHAKE_PROTOCOL_VERSIONS else LATEST_HANDSHAKE_VERSION
        return {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": self.server_info,
            "instructions": self.instructions,
        }
