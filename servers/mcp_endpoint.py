"""The agent's MCP endpoint: JSON-RPC over streamable HTTP, answered with plain JSON.

Both protocol eras are served on one URL, ``/episodes/{id}/mcp``:

- 2026-07-28 (sessionless): ``server/discover``, then self-contained requests whose ``_meta`` names
  the protocol version;
- handshake era (2024-11-05 ... 2025-11-25): ``initialize`` + ``notifications/initialized``.

No ``Mcp-Session-Id`` is ever issued or read: the episode id in the URL is the only key to state.
Only the environment's tools are listed and callable; reset, validate and state never appear here.
This lean handler exists because the SDK's transport costs several times more CPU and memory per call
than the environment itself; the tests drive it with the official ``mcp`` client in both eras.
"""

from __future__ import annotations

import json
from typing import Any

from servers.episodes import EpisodeStore, LiveEpisode

MODERN_VERSION = "2026-07-28"
HANDSHAKE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
_PROTOCOL_META = "io.modelcontextprotocol/protocolVersion"
_SERVER_INFO_META = "io.modelcontextprotocol/serverInfo"

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
UNSUPPORTED_PROTOCOL_VERSION = -32022
# HTTP status the modern transport sends with each JSON-RPC error code.
_ERROR_STATUS = {PARSE_ERROR: 400, INVALID_REQUEST: 400, INVALID_PARAMS: 400, UNSUPPORTED_PROTOCOL_VERSION: 400, METHOD_NOT_FOUND: 404}


def _error(request_id: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def _tool_result(outcome_text: str, is_error: bool, modern: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"content": [{"type": "text", "text": outcome_text}], "isError": is_error}
    if modern:
        result["resultType"] = "complete"
    return result


class McpEndpoint:
    """Answers JSON-RPC messages for the episodes of one store."""

    def __init__(self, store: EpisodeStore, server_name: str, instructions: str) -> None:
        self.store = store
        self.server_info = {"name": server_name, "version": "1"}
        self.instructions = instructions
        tools = [tool.mcp() for tool in store.runtime.tool_list()]
        self._tools_legacy = {"tools": tools}
        self._tools_modern = {"tools": tools, "cacheScope": "private", "ttlMs": 0, "resultType": "complete"}

    async def handle(self, live: LiveEpisode, message: Any, version_header: str | None) -> tuple[int, dict[str, Any] | None]:
        """One JSON-RPC message -> (HTTP status, response body or None for a notification)."""
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
        version = meta.get(_PROTOCOL_META) or version_header
        modern = version == MODERN_VERSION
        if version and version not in HANDSHAKE_VERSIONS and not modern and method != "initialize":
            data = {"supported": [*HANDSHAKE_VERSIONS, MODERN_VERSION], "requested": version}
            return 400, _error(request_id, UNSUPPORTED_PROTOCOL_VERSION, f"unsupported protocol version {version!r}", data)

        if method == "tools/call":
            return 200, await self._call(live, request_id, params, modern)
        if method == "tools/list":
            return 200, {"jsonrpc": "2.0", "id": request_id, "result": self._tools_modern if modern else self._tools_legacy}
        if method == "server/discover":
            return 200, {"jsonrpc": "2.0", "id": request_id, "result": self._discover()}
        if method == "initialize":
            return 200, {"jsonrpc": "2.0", "id": request_id, "result": self._initialize(params)}
        if method == "ping":
            return 200, {"jsonrpc": "2.0", "id": request_id, "result": {}}
        code = METHOD_NOT_FOUND
        return (_ERROR_STATUS[code] if modern else 200), _error(request_id, code, f"method {method!r} is not supported by this server")

    async def _call(self, live: LiveEpisode, request_id: Any, params: dict[str, Any], modern: bool) -> dict[str, Any]:
        name = params.get("name")
        if not isinstance(name, str):
            return _error(request_id, INVALID_PARAMS, "tools/call needs params.name (a string)")
        outcome = await self.store.call_tool(live, name, params.get("arguments"))
        return {"jsonrpc": "2.0", "id": request_id, "result": _tool_result(outcome.agent_text, outcome.error is not None, modern)}

    def _discover(self) -> dict[str, Any]:
        return {
            "supportedVersions": [MODERN_VERSION],
            "capabilities": {"tools": {"listChanged": False}},
            "instructions": self.instructions,
            "cacheScope": "private",
            "ttlMs": 0,
            "resultType": "complete",
            "_meta": {_SERVER_INFO_META: self.server_info},
        }

    def _initialize(self, params: dict[str, Any]) -> dict[str, Any]:
        requested = params.get("protocolVersion")
        version = requested if requested in HANDSHAKE_VERSIONS else HANDSHAKE_VERSIONS[-1]
        return {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": self.server_info,
            "instructions": self.instructions,
        }
