"""The harness's only ways into an environment: its control API and its MCP endpoint, over HTTP.

One pooled LeanHttp client serves every episode. Every reply is parsed into its wire model
(``envscaler.wire``), the same one the server built. The MCP side speaks the sessionless 2026-07-28
protocol as plain JSON-RPC POSTs: the official SDK client builds a transport, task group and session
per connection, which costs more CPU than the tool call itself at harness scale.
"""

from __future__ import annotations

import itertools
from typing import Any, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, ValidationError

from agent_client.errors import EnvServerError, TransportError
from agent_client.http import LeanHttp, Response
from envscaler.bundle import describe_validation_error
from envscaler.errors import InfraError
from envscaler.jsonl import validate_json
from envscaler.models import Scenario
from envscaler.wire import (
    CLIENT_CAPABILITIES_META_KEY,
    LATEST_MODERN_VERSION,
    MCP_METHOD_HEADER,
    MCP_NAME_HEADER,
    MCP_PROTOCOL_VERSION_HEADER,
    PROTOCOL_VERSION_META_KEY,
    EnvEndpoint,
    EpisodeCreated,
    EpisodeEnded,
    EpisodeStart,
    EpisodeValidation,
    ScenarioListing,
    ScenarioSummary,
    Trajectory,
    TurnEnded,
    TurnRequest,
    ValidationRequest,
    encode_header_value,
)

M = TypeVar("M", bound=BaseModel)

_META = {PROTOCOL_VERSION_META_KEY: LATEST_MODERN_VERSION, CLIENT_CAPABILITIES_META_KEY: {}}


def new_http_client() -> LeanHttp:
    """The one HTTP client a run shares: its connection pool serves every episode."""
    return LeanHttp()


def _parse(model: type[M], response: Response, what: str) -> M:
    """The reply as ``model``; EnvServerError when the server sent something else."""
    try:
        return validate_json(model, response.body)
    except ValidationError as e:
        raise EnvServerError(f"{what}: the reply is not a {model.__name__}: {describe_validation_error(e)}", response.status) from None


class EnvControl:
    """The control API of one environment server (or of it through the gateway)."""

    def __init__(self, http: LeanHttp, env_id: str, endpoint: EnvEndpoint) -> None:
        self.http = http
        self.env_id = env_id
        self.base = endpoint.url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {endpoint.token}"}

    async def _request(self, model: type[M], method: str, path: str, body: BaseModel | None = None) -> M:
        payload = None if body is None else body.model_dump(mode="json", exclude_none=True)
        try:
            response = await self.http.request(method, self.base + path, payload, self.headers)
        except TransportError as e:
            raise TransportError(f"{self.env_id}: {e}") from None
        if response.status >= 400:
            raise EnvServerError(f"{self.env_id}: {method} {path} -> {response.status}: {response.text[:300]}", response.status)
        return _parse(model, response, f"{self.env_id}: {method} {path}")

    async def scenarios(self) -> list[ScenarioSummary]:
        """Every scenario the server holds."""
        return (await self._request(ScenarioListing, "GET", "/scenarios")).scenarios

    async def scenario(self, task_id: str) -> Scenario:
        """One whole scenario, reference solution and checklist included."""
        return await self._request(Scenario, "GET", f"/scenarios/{quote(task_id, safe='')}")

    async def create(self, task_id: str, lease_s: float | None = None) -> EpisodeCreated:
        """A new episode of scenario ``task_id``; with ``lease_s``, the server ends it after that long
        unused unless :meth:`renew` keeps it (a harness that dies leaves nothing behind for long)."""
        return await self._request(EpisodeCreated, "POST", "/episodes", EpisodeStart(scenario_id=task_id, lease_s=lease_s))

    async def renew(self, episode_id: str) -> None:
        """Keep the episode for its lease again; a failure is ignored (the next renewal, or the agent's
        next call, renews it too)."""
        try:
            await self.http.request("POST", self.base + f"/episodes/{episode_id}/lease", None, self.headers)
        except TransportError:
            pass

    async def validate(self, episode_id: str, agent_replies: list[str] | None = None, *, end: bool = False) -> EpisodeValidation:
        """The scenario's checklist run on the episode's state now, with the server's error counts.

        ``agent_replies``: the agent's texts to the user since its last ended turn (the checks read them).
        ``end``: then end the episode, its trajectory in the reply (``calls``); where ``ended`` comes back
        false (a server older than this), the episode still runs and the trajectory is not there."""
        # No body when there is nothing to pass: what every server of the farm has always accepted.
        body = ValidationRequest(agent_replies=agent_replies) if agent_replies else None
        return await self._request(EpisodeValidation, "POST", f"/episodes/{episode_id}/validate{'?end=1' if end else ''}", body)

    async def end_turn(self, episode_id: str, agent_replies: list[str]) -> TurnEnded:
        """End the episode's current scripted user turn: its checks' verdicts, and the user's next message."""
        return await self._request(TurnEnded, "POST", f"/episodes/{episode_id}/turn", TurnRequest(agent_replies=agent_replies))

    async def trajectory(self, episode_id: str) -> Trajectory:
        """The server's record of every tool call of the episode."""
        return await self._request(Trajectory, "GET", f"/episodes/{episode_id}/trajectory")

    async def finish(self, episode_id: str) -> EpisodeEnded:
        """End the episode; EnvServerError (404) when the server holds no such live episode."""
        return await self._request(EpisodeEnded, "DELETE", f"/episodes/{episode_id}")

    async def end(self, episode_id: str) -> None:
        """End the episode; a failure is ignored, since the server expires idle episodes itself."""
        try:
            await self.finish(episode_id)
        except InfraError:
            pass


class McpTools:
    """``tools/list`` and ``tools/call`` on one episode's MCP URL."""

    def __init__(self, http: LeanHttp, url: str) -> None:
        self.http = http
        self.url = url
        self._ids = itertools.count(1)

    async def _rpc(self, method: str, params: dict[str, Any], name: str = "") -> dict[str, Any]:
        headers = {MCP_PROTOCOL_VERSION_HEADER: LATEST_MODERN_VERSION, MCP_METHOD_HEADER: method}
        if name:
            headers[MCP_NAME_HEADER] = encode_header_value(name)
        body = {"jsonrpc": "2.0", "id": next(self._ids), "method": method, "params": {**params, "_meta": _META}}
        try:
            response = await self.http.request("POST", self.url, body, headers)
        except TransportError as e:
            raise TransportError(f"MCP {method}: {e}") from None
        try:
            payload = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        except ValueError:
            payload = {}
        if response.status != 200 or not isinstance(payload, dict) or not isinstance(payload.get("result"), dict):
            problem = payload.get("error") if isinstance(payload, dict) and "error" in payload else response.text[:300]
            raise EnvServerError(f"MCP {method} at {self.url} -> {response.status}: {problem}", response.status)
        return payload["result"]

    async def list_tools(self) -> list[dict[str, Any]]:
        """The episode's tools as MCP lists them (``name``, ``description``, ``inputSchema``)."""
        return (await self._rpc("tools/list", {}))["tools"]

    async def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """(text the model sees, is_error)."""
        result = await self._rpc("tools/call", {"name": name, "arguments": arguments}, name)
        text = "\n".join(part.get("text", "") for part in result.get("content", []) if part.get("type") == "text")
        return text, bool(result.get("isError"))
