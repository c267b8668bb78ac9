"""The harness's only ways into an environment: its control API and its MCP endpoint, over HTTP.

One pooled LeanHttp client serves every episode. The MCP side speaks the sessionless 2026-07-28
protocol as plain JSON-RPC POSTs: the official SDK client builds a transport, task group and session
per connection, which costs more CPU than the tool call itself at harness scale.
"""

from __future__ import annotations

import itertools
from typing import Any


from agent_client.errors import EnvServerError, TransportError
from agent_client.http import LeanHttp
from agent_client.models import EpisodeInfo, ScenarioRef
from envscaler.models import EnvEndpoint, Scenario, ToolOutcome, ValidationResult

MCP_VERSION = "2026-07-28"
_META = {"io.modelcontextprotocol/protocolVersion": MCP_VERSION, "io.modelcontextprotocol/clientCapabilities": {}}


def new_http_client() -> LeanHttp:
    """The one HTTP client a run shares: its connection pool serves every episode."""
    return LeanHttp()


class EnvControl:
    """The control API of one environment server (or of it through the gateway)."""

    def __init__(self, http: LeanHttp, env_id: str, endpoint: EnvEndpoint) -> None:
        self.http = http
        self.env_id = env_id
        self.base = endpoint.url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {endpoint.token}"}

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            response = await self.http.request(method, self.base + path, body, self.headers)
        except TransportError as e:
            raise TransportError(f"{self.env_id}: {e}") from None
        if response.status >= 400:
            raise EnvServerError(f"{self.env_id}: {method} {path} -> {response.status}: {response.text[:300]}", response.status)
        return response.json()

    async def scenarios(self) -> list[ScenarioRef]:
        listing = await self._request("GET", "/scenarios")
        return [ScenarioRef(env_id=self.env_id, **{k: s[k] for k in ("task_id", "task", "conversational")}) for s in listing["scenarios"]]

    async def scenario(self, task_id: str) -> Scenario:
        return Scenario.model_validate(await self._request("GET", f"/scenarios/{task_id}"))

    async def create(self, task_id: str) -> EpisodeInfo:
        return EpisodeInfo.model_validate(await self._request("POST", "/episodes", {"scenario_id": task_id}))

    async def validate(self, episode_id: str) -> dict[str, Any]:
        return await self._request("POST", f"/episodes/{episode_id}/validate", {})

    async def trajectory(self, episode_id: str) -> dict[str, Any]:
        return await self._request("GET", f"/episodes/{episode_id}/trajectory")

    async def end(self, episode_id: str) -> None:
        try:
            await self.http.request("DELETE", self.base + f"/episodes/{episode_id}", None, self.headers)
        except TransportError:
            pass  # the server expires idle episodes itself


class McpTools:
    """``tools/list`` and ``tools/call`` on one episode's MCP URL."""

    def __init__(self, http: LeanHttp, url: str) -> None:
        self.http = http
        self.url = url
        self._ids = itertools.count(1)

    async def _rpc(self, method: str, params: dict[str, Any], name: str = "") -> dict[str, Any]:
        headers = {"MCP-Protocol-Version": MCP_VERSION, "Mcp-Method": method}
        if name:
            headers["Mcp-Name"] = name
        body = {"jsonrpc": "2.0", "id": next(self._ids), "method": method, "params": {**params, "_meta": _META}}
        try:
            response = await self.http.request("POST", self.url, body, headers)
        except TransportError as e:
            raise TransportError(f"MCP {method}: {e}") from None
        payload = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        if "error" in payload or response.status != 200:
            raise EnvServerError(f"MCP {method} at {self.url} -> {response.status}: {payload.get('error') or response.text[:300]}",
                                 response.status)
        return payload["result"]

    async def list_tools(self) -> list[dict[str, Any]]:
        return (await self._rpc("tools/list", {}))["tools"]

    async def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """(text the model sees, is_error)."""
        result = await self._rpc("tools/call", {"name": name, "arguments": arguments}, name)
        text = "\n".join(part.get("text", "") for part in result.get("content", []) if part.get("type") == "text")
        return text, bool(result.get("isError"))


def parse_validation(payload: dict[str, Any]) -> ValidationResult:
    return ValidationResult.model_validate(payload)


def parse_trajectory(payload: dict[str, Any]) -> list[ToolOutcome]:
    return [ToolOutcome.model_validate(call) for call in payload.get("calls", [])]
