"""Every contract that crosses HTTP between an environment server and its clients, named once.

``servers`` builds these and ``agent_client`` parses them, so the two sides cannot drift apart.
Field names are wire names that users' scripts rely on: add fields freely, rename none (DESIGN.md,
"Wire names").

- Control API (bearer token): :class:`EpisodeStart` is the body of ``POST /episodes`` and
  ``POST /episodes/{id}/reset``; the replies are :class:`EpisodeCreated`, :class:`EpisodeReset`,
  :class:`EpisodeValidation` (for a :class:`ValidationRequest`), :class:`TurnEnded` (for a :class:`TurnRequest`), :class:`Trajectory`,
  :class:`EpisodeState`, :class:`EpisodeEnded`, :class:`EpisodeIds`, :class:`ScenarioListing`,
  :class:`ServerInfo` and :class:`Health`. Errors are ``{"error": message}`` with an HTTP status.
- The farm gateway's own ``GET /healthz``: :class:`GatewayHealth`.
- The farm catalog file: :class:`FarmCatalog` of :class:`EnvEndpoint`.
- MCP, both eras on ``/episodes/{id}/mcp``: protocol versions, ``_meta`` keys, header names, JSON-RPC
  error codes and the HTTP status each is sent with, and the header value codec. The values are the
  ``mcp`` SDK's (``mcp_types``, ``mcp.shared.inbound``), written out here so that nothing imports
  ``mcp`` at runtime; ``tests/test_wire.py`` compares every one with the installed SDK.
"""

from __future__ import annotations

import base64
import binascii
import re
from types import MappingProxyType
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field

from envscaler.models import CheckItem, CheckResult, ToolOutcome, ValidationResult, _Open

# -- control API -----------------------------------------------------------------------------------


class _Body(BaseModel):
    """A request body: a misspelt field is refused (422), not ignored."""

    model_config = ConfigDict(extra="forbid")


class EpisodeStart(_Body):
    """Body of ``POST /episodes`` and ``POST /episodes/{id}/reset``: a scenario, or a raw initial state."""

    scenario_id: str | None = None
    init_config: dict[str, Any] | None = None
    lease_s: float | None = Field(default=None, gt=0)
    """``POST /episodes``: end the episode once nothing has used it for this long (the server's idle
    timeout when not given, and never longer). A harness sets a short one and renews it
    (``POST /episodes/{id}/lease``) while it runs, so that the episodes of one that died are reaped soon."""


class EpisodeLease(BaseModel):
    """Reply of ``POST /episodes/{id}/lease``: the episode is kept for ``lease_s`` more seconds of disuse."""

    episode_id: str
    lease_s: float


class ValidationRequest(_Body):
    """Body of ``POST /episodes/{id}/validate``: a checklist here overrides the scenario's."""

    checklist: list[CheckItem] | None = None
    # The agent's texts to the user since the last turn ended (all of them, in a single-turn scenario):
    # the checks read them as ``agent_replies``.
    agent_replies: list[str] = Field(default_factory=list)


class TurnRequest(_Body):
    """Body of ``POST /episodes/{id}/turn`` (optional): the agent's texts to the user during the turn."""

    agent_replies: list[str] = Field(default_factory=list)


class TurnEnded(BaseModel):
    """Reply of ``POST /episodes/{id}/turn``: the ended turn's checks, and the user's next message.

    ``turn`` is the number of the turn that ended (1 for the first); ``score`` the share of its checks
    that passed (None when the turn has no checks of its own); ``next_message`` None after the last turn.
    """

    episode_id: str
    turn: int
    score: float | None = None
    checks: list[CheckResult] = Field(default_factory=list)
    next_message: str | None = None
    turns_left: int = 0
    # The ended turn's tool calls, as the trajectory counts them (``envscaler reverify`` replays each turn's own).
    calls: int = 0


class EpisodeCreated(BaseModel):
    """Reply of ``POST /episodes``: the agent's MCP URL and what it needs to start."""

    episode_id: str
    # Absolute when the server knows where agents reach it (its public URL, the gateway, the Host asked for).
    mcp_url: str
    mcp_path: str
    env_id: str
    scenario_id: str | None = None
    task: str = ""
    user_profile: Any = None
    env_introduction: str = ""
    # The tools in OpenAI's ``{"type": "function", "function": {...}}`` form.
    tools: list[dict[str, Any]] = Field(default_factory=list)
    # How many scripted user turns the scenario has (0: a single task); ``task`` is the first one's message.
    turns: int = 0


class EpisodeReset(BaseModel):
    """Reply of ``POST /episodes/{id}/reset``: the same episode (and URL), back at a scenario's start."""

    episode_id: str
    scenario_id: str | None = None
    task: str = ""
    turns: int = 0


class ErrorCounts(BaseModel):
    """The episode's failed tool calls by cause, as the server counted them."""

    agent_errors: int = 0
    env_errors: int = 0
    timeouts: int = 0
    # Answers the environment's error policy marks as failures (``tool_errors`` in env.json).
    tool_errors: int = 0


class EpisodeValidation(ErrorCounts, ValidationResult):
    """Reply of ``POST /episodes/{id}/validate``: score, per-check results, state hash, and error counts;
    with ``?end=1`` (the last thing a harness asks of an episode), also every tool call of the episode,
    which has then ended. A server that predates ``end`` ignores it: ``ended`` stays false."""

    ended: bool = False
    calls: list[ToolOutcome] | None = None


class Trajectory(ErrorCounts):
    """Reply of ``GET /episodes/{id}/trajectory``: the server-side record of every tool call."""

    episode_id: str
    env_id: str
    scenario_id: str | None
    calls: list[ToolOutcome]


class EpisodeState(BaseModel):
    """Reply of ``GET /episodes/{id}/state``: the environment's public attributes as JSON."""

    episode_id: str
    state: dict[str, Any]


class EpisodeEnded(ErrorCounts):
    """Reply of ``DELETE /episodes/{id}``."""

    episode_id: str
    ended: bool = True
    calls: int


class EpisodeIds(BaseModel):
    """Reply of ``GET /episodes``: the ids of the live episodes."""

    episodes: list[str]


class ScenarioSummary(BaseModel):
    """One item of ``GET /scenarios``."""

    env_id: str
    task_id: str
    task: str = ""
    conversational: bool = False
    checks: int = 0
    has_reference: bool = False
    # How many scripted user turns the scenario has (0: a single task).
    turns: int = 0


class ScenarioListing(BaseModel):
    """Reply of ``GET /scenarios``; ``GET /scenarios/{id}`` answers the whole ``Scenario``."""

    env_id: str
    scenarios: list[ScenarioSummary]


class MemoryStatus(BaseModel):
    """The server's memory: what it uses, its tightest limit, and what is left under that limit."""

    rss_mb: float
    limit_mb: float | None = None
    used_mb: float | None = None
    headroom_mb: float | None = None
    limited_by: str | None = None
    """``cgroup`` (a container's memory limit) or ``address space`` (RLIMIT_AS); None when unlimited."""


class ServerInfo(BaseModel):
    """Reply of ``GET /info``: what the server holds, its limits and its load."""

    env_id: str
    spec_hash: str
    environment_summary: str
    tools: list[str]
    scenarios: int
    limits: dict[str, Any]
    live_episodes: int
    stuck_calls: int
    call_threads: int
    threaded_tools: list[str]
    expired_episodes: int
    memory: MemoryStatus | None = None
    # With the environment's code in a worker process (None without): how often the worker was
    # replaced, and how many of its episodes were rebuilt in the new one, or could not be (lost).
    worker_restarts: int | None = None
    episodes_rebuilt: int | None = None
    episodes_lost: int | None = None
    # What the workers hold and may hold, and what counts it (None: environment code runs in the server).
    worker_resources: WorkerResources | None = None


class WorkerResources(BaseModel):
    """What an environment's worker processes hold together, and what bounds them (``GET /info``)."""

    counted_by: str
    """``cgroup v1`` or ``cgroup v2``; ``none`` where no cgroup could be made (then the sandbox refuses
    memory it cannot count, such as memfds, and each worker has an address-space limit)."""
    uid: int | None = None
    """The host uid the environment worker runs as; None when it is the server's own."""
    memory_mb: float | None = None
    memory_limit_mb: float | None = None
    tasks: int | None = None
    tasks_limit: int | None = None
    cpu_s: float | None = None
    oom_kills: int | None = None


class Health(BaseModel):
    """Reply of ``GET /healthz`` (no token needed): 200, or 503 when the server is alive but cannot serve."""

    # "ok", or why it cannot serve.
    status: str = "ok"
    env_id: str
    episodes: int
    # The replica id that this server's episode ids start with (``serve --replica-id``); None when it is alone.
    replica: str | None = None


class GatewayHealth(BaseModel):
    """Reply of the farm gateway's ``GET /healthz`` (no token needed)."""

    status: str = "ok"
    envs: int
    # Replicated environments (swarm): env_id -> replicas answering now, as this gateway sees them.
    replicas: dict[str, int] | None = None


# -- the farm catalog ------------------------------------------------------------------------------


class EnvEndpoint(_Open):
    """Where one environment server answers, and its control token."""

    url: str
    token: str
    # Its OpenEnv listener, when the farm was started with ``--openenv`` (no token there).
    openenv_url: str | None = None


DEFAULT_FARM_CATALOG = ".envscaler/farm.json"
"""Where ``farm up`` writes its catalog and ``run`` / ``episode`` read it, unless told otherwise."""


class FarmCatalog(_Open):
    """The catalog file ``envscaler farm up`` writes and ``envscaler run`` reads: the contract between them.

    ``{"envs": {env_id: {"url", "token"}}, "gateway": url, ...}``; fields may be added, none renamed.
    """

    envs: dict[str, EnvEndpoint]
    gateway: str | None = None
    backend: str | None = None
    farm_id: str | None = None


# -- MCP -------------------------------------------------------------------------------------------

HANDSHAKE_PROTOCOL_VERSIONS: Final = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
"""Protocol versions of the ``initialize`` handshake era, oldest first."""

MODERN_PROTOCOL_VERSIONS: Final = ("2026-07-28",)
"""Sessionless protocol versions: each request carries its version in ``params._meta``."""

LATEST_HANDSHAKE_VERSION: Final = HANDSHAKE_PROTOCOL_VERSIONS[-1]
LATEST_MODERN_VERSION: Final = MODERN_PROTOCOL_VERSIONS[-1]

PROTOCOL_VERSION_META_KEY: Final = "io.modelcontextprotocol/protocolVersion"
CLIENT_CAPABILITIES_META_KEY: Final = "io.modelcontextprotocol/clientCapabilities"
SERVER_INFO_META_KEY: Final = "io.modelcontextprotocol/serverInfo"

# Header names in lower case, as the server's transport hands them over.
MCP_PROTOCOL_VERSION_HEADER: Final = "mcp-protocol-version"
MCP_METHOD_HEADER: Final = "mcp-method"
MCP_NAME_HEADER: Final = "mcp-name"

NAME_BEARING_METHODS: Final = MappingProxyType({"tools/call": "name", "prompts/get": "name", "resources/read": "uri"})
"""Method -> the ``params`` field that the ``Mcp-Name`` header repeats."""

PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
METHOD_NOT_FOUND: Final = -32601
INVALID_PARAMS: Final = -32602
HEADER_MISMATCH: Final = -32020
MISSING_REQUIRED_CLIENT_CAPABILITY: Final = -32021
UNSUPPORTED_PROTOCOL_VERSION: Final = -32022

ERROR_CODE_HTTP_STATUS: Final = MappingProxyType(
    {
        PARSE_ERROR: 400,
        INVALID_REQUEST: 400,
        INVALID_PARAMS: 400,
        HEADER_MISMATCH: 400,
        MISSING_REQUIRED_CLIENT_CAPABILITY: 400,
        UNSUPPORTED_PROTOCOL_VERSION: 400,
        METHOD_NOT_FOUND: 404,
    }
)
"""The HTTP status a sessionless-era error is sent with; other codes, and the handshake era, use 200."""

_BASE64_SENTINEL = re.compile(r"^=\?base64\?(?P<payload>.*)\?=$")
_HEADER_SAFE = re.compile(r"^[\x20-\x7E]*$")


def encode_header_value(value: str) -> str:
    """``value`` as an HTTP header value: as it is when it is plain printable ASCII, else ``=?base64?...?=``."""
    if _HEADER_SAFE.fullmatch(value) and value == value.strip() and not _BASE64_SENTINEL.fullmatch(value):
        return value
    return f"=?base64?{base64.b64encode(value.encode()).decode('ascii')}?="


def decode_header_value(value: str | None) -> str | None:
    """The inverse of :func:`encode_header_value`; None for a malformed sentinel, so it never matches."""
    if value is None:
        return None
    match = _BASE64_SENTINEL.fullmatch(value)
    if match is None:
        return value
    payload = match.group("payload")
    try:
        decoded = base64.b64decode(payload, validate=True)
    except binascii.Error:
        return None
    if base64.b64encode(decoded).decode("ascii") != payload:  # only the canonical form is ever sent
        return None
    try:
        return decoded.decode()
    except UnicodeDecodeError:
        return None
