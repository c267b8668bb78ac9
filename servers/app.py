"""One environment as an HTTP service: control API for the harness, MCP endpoint for the agent.

A plain ASGI application (no framework) because every microsecond on the tool-call path is paid
once per agent step. Routes are the table in DESIGN.md ("One environment server").
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote_to_bytes

import anyio
from pydantic import BaseModel, Field, ValidationError

from envscaler import Bundle, EnvRuntime, EnvScalerError
from envscaler.bundle import describe_validation_error
from envscaler.cgroups import MIN_WORKER_MEMORY_MB, MIN_WORKER_TASKS, GroupLimits
from envscaler.data_files import check_references
from envscaler.errors import BundleError, ChecklistError
from envscaler.wire import (
    EpisodeCreated,
    EpisodeEnded,
    EpisodeIds,
    EpisodeReset,
    EpisodeLease,
    EpisodeStart,
    EpisodeValidation,
    Health,
    ScenarioListing,
    ScenarioSummary,
    ServerInfo,
    TurnRequest,
    ValidationRequest,
)
from servers.transport.asgi import json_bytes, parse_json, read_body, send_json
from servers.transport.cors import CorsPolicy, request_origin
from servers.episodes.calls import QUEUE_WAIT_S
from servers.episodes.ids import REPLICA_ID_PATTERN
from servers.episodes.store import EpisodeRegistry, EpisodeStore, LiveEpisode
from servers.errors import (
    CallAbandoned,
    EpisodeLost,
    ErrorReply,
    LimitReached,
    NoTurnLeft,
    OutOfMemory,
    Overloaded,
    UnknownEpisode,
    UnknownScenario,
)
from servers.protocols.mcp import ROUTING_HEADERS, McpEndpoint, parse_error, parse_message
from servers.memory import memory_status, release_free_memory
from servers.protocols.openenv.config import OpenEnvConfig
from servers.protocols.sse import SseSessions
from servers.workers.checks import CHECK_IDLE_S, CheckWorker
from servers.workers.store import WorkerEpisodeStore
from servers.workers.wire import WorkerSettings

log = logging.getLogger("envscaler.server")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

Scope = dict[str, Any]

# A control answer larger than this (a state of big data) is followed by handing freed memory back to the system.
LARGE_BODY_BYTES = 16 * 1024 * 1024
_EPISODE_ACTIONS = ("state", "trajectory", "reset", "validate", "lease", "turn")
"""What ``/episodes/{id}/ACTION`` may name on the control API."""


def _is_control_path(parts: list[str]) -> bool:
    """Whether the path is one of the routes that need the bearer token (whatever its method)."""
    if parts[0] == "info":
        return len(parts) == 1
    if parts[0] == "scenarios":
        return len(parts) <= 2
    if parts[0] == "episodes":
        return len(parts) <= 2 or (len(parts) == 3 and parts[2] in _EPISODE_ACTIONS)
    return False


def _query_flag(scope: Scope, name: str) -> bool:
    """Whether the query sets flag ``name`` (``name=1``; absent or ``name=0``: not); ErrorReply 400 for any other value."""
    values = parse_qs((scope.get("query_string") or b"").decode("latin-1"), keep_blank_values=True).get(name)
    if values is None or values == ["0"]:
        return False
    if values == ["1"]:
        return True
    raise ErrorReply(400, f"?{name}= takes 0 or 1 (once), not {', '.join(map(repr, values))}")


class ServerConfig(BaseModel):
    """Limits and addresses of one environment server; all of them are reported by ``GET /info``."""

    token: str
    public_url: str | None = None
    max_episodes: int = Field(default=20_000, ge=1)
    idle_ttl_s: float = Field(default=3600.0, gt=0)
    call_timeout_s: float = Field(default=10.0, gt=0)
    check_timeout_s: float = Field(default=5.0, gt=0)
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    worker_threads: int = Field(default=32, ge=1)
    # How long a call may wait for one of those threads before it is refused (it never runs).
    queue_wait_s: float = Field(default=QUEUE_WAIT_S, gt=0)
    inline_budget_s: float = Field(default=0.02, ge=0)
    allowed_origins: list[str] = Field(default_factory=list)
    memory_reserve_mb: float = Field(default=32.0, ge=0)
    # One result as the agent sees it, and one episode's whole trajectory (results and arguments).
    max_result_chars: int = Field(default=1_000_000, ge=1)
    max_trajectory_chars: int = Field(default=16_000_000, ge=1)
    # The OpenEnv listener (``--openenv-port``), off unless asked for.
    openenv: OpenEnvConfig | None = None
    # Set when this server is one replica of many: episode ids then name it (servers.episodes.ids).
    replica_id: str | None = Field(default=None, pattern=REPLICA_ID_PATTERN)
    # Environment code in a worker process that is killed and replaced when it freezes (servers.workers.store),
    # inside the bubblewrap sandbox when ``worker_sandbox``; else in this process (``serve --in-process``).
    worker_process: bool = True
    worker_sandbox: bool = False
    # What the sandboxed workers may take together (envscaler.cgroups; the uid's RLIMIT_NPROC for tasks).
    worker_memory_mb: int = Field(default=1024, ge=MIN_WORKER_MEMORY_MB)
    worker_tasks: int = Field(default=256, ge=MIN_WORKER_TASKS)
    worker_cpus: float = Field(default=1.0, gt=0, le=100)
    # Seconds the check worker may sit idle before it is stopped (servers.workers.checks.CHECK_IDLE_S).
    check_idle_s: float | None = Field(default=CHECK_IDLE_S, gt=0)


class RawJson:
    """A reply's JSON text, made without the model it is the JSON of (see ``GET /episodes/{id}/state``)."""

    __slots__ = ("body",)

    def __init__(self, body: bytes) -> None:
        self.body = body


def _episode_store(bundle: Bundle, config: ServerConfig, checks: CheckWorker | None) -> EpisodeRegistry:
    """Where the environment's code runs: a worker process (``worker_process``; its checks in ``checks``, else a
    check worker of its own), or this one."""
    limits: dict[str, Any] = dict(max_episodes=config.max_episodes, idle_ttl_s=config.idle_ttl_s, memory_reserve_mb=config.memory_reserve_mb,
                                  replica_id=config.replica_id, max_trajectory_chars=config.max_trajectory_chars)
    if config.worker_process:
        settings = WorkerSettings(bundle=bundle, call_timeout_s=config.call_timeout_s, check_timeout_s=config.check_timeout_s,
                                  max_result_chars=config.max_result_chars, worker_threads=config.worker_threads,
                                  queue_wait_s=config.queue_wait_s, inline_budget_s=config.inline_budget_s,
                                  memory_reserve_mb=config.memory_reserve_mb)
        return WorkerEpisodeStore(bundle, settings, sandbox=config.worker_sandbox, group=worker_limits(config), checks=checks,
                                  check_idle_s=config.check_idle_s, **limits)
    runtime = EnvRuntime(bundle.spec, call_timeout_s=config.call_timeout_s, check_timeout_s=config.check_timeout_s,
                         max_result_chars=config.max_result_chars, bundle_dir=bundle.directory)
    return EpisodeStore(bundle, runtime, worker_threads=config.worker_threads, queue_wait_s=config.queue_wait_s,
                        inline_budget_s=config.inline_budget_s, **limits)


def worker_limits(config: ServerConfig) -> GroupLimits:
    """What each sandboxed worker of a server may take (its control group's limits)."""
    return GroupLimits(memory_mb=config.worker_memory_mb, pids=config.worker_tasks, cpu_weight=round(config.worker_cpus * 100))


class EnvServerApp:
    """The ASGI application serving one bundle (``checks``: the check worker it shares with the other
    environments of its process, if any)."""

    def __init__(self, bundle: Bundle, config: ServerConfig, checks: CheckWorker | None = None) -> None:
        self.bundle = bundle
        self.config = config
        self.store = _episode_store(bundle, config, checks)
        self.mcp = McpEndpoint(self.store, f"envscaler-{bundle.env_id}", bundle.spec.environment_introduction)
        self._token = f"Bearer {config.token}".encode()
        self.cors = CorsPolicy(config.allowed_origins)
        self.sse = SseSessions()
        self._tools_openai = [tool.openai() for tool in self.store.tool_list()]

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        origin = request_origin(scope)
        if origin is not None and self.cors.enabled:
            if scope["method"] == "OPTIONS":
                await self.cors.preflight(scope, origin, send)
                return
            if self.cors.allows(origin):
                send = self.cors.wrap(origin, send)
        try:
            await self._route(scope, receive, send)
        except ErrorReply as e:
            await send_json(send, e.status, json_bytes({"error": e.message}))

    async def _lifespan(self, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as tasks:
            message = await receive()
            if message["type"] == "lifespan.startup":
                tasks.start_soon(self._expire_idle_forever)
                log.info("server ready", extra={"env": self.bundle.env_id, "tools": len(self.store.tool_list())})
                await send({"type": "lifespan.startup.complete"})
            message = await receive()
            tasks.cancel_scope.cancel()
        self.store.close()
        log.info("server stopping", extra={"env": self.bundle.env_id, "episodes": len(self.store.episodes)})
        await send({"type": "lifespan.shutdown.complete"})

    async def _expire_idle_forever(self) -> None:
        # Often enough for short leases (a harness's, a minute or two) to end within seconds of running out;
        # never while no episode is held, so that an idle server does not wake.
        interval = min(max(self.config.idle_ttl_s / 4, 0.5), 5.0)
        while True:
            await self.store.held.wait()
            await anyio.sleep(interval)
            self.store.expire_idle()

    # -- routing ---------------------------------------------------------------------------------

    async def _route(self, scope: Scope, receive: Any, send: Any) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        # Split the raw path, then decode each segment exactly once: an id may hold "%" or "/".
        raw_path: bytes = scope.get("raw_path") or path.encode()
        parts = [unquote_to_bytes(p).decode(errors="replace") for p in raw_path.strip(b"/").split(b"/")]
        if len(parts) == 3 and parts[0] == "episodes" and parts[2] == "mcp":
            await self._mcp(scope, receive, send, parts[1])
            return
        if len(parts) == 3 and parts[0] == "episodes" and parts[2] in ("sse", "messages"):
            await self._legacy_sse(scope, receive, send, parts[1], parts[2])
            return
        if path == "/healthz":
            # Alive is not enough: a server whose every call thread is stuck cannot serve (503 makes a farm restart it).
            problem = self.store.health_problem()
            health = Health(status=problem or "ok", env_id=self.bundle.env_id, episodes=len(self.store.episodes), replica=self.config.replica_id)
            await send_json(send, 503 if problem else 200, json_bytes(health))
            return
        if not _is_control_path(parts):
            # Not a control route: no token could help (a strict client would read 401 as "OAuth here").
            raise ErrorReply(404, f"no route {method} {path}")
        self._authorize(scope)
        result: BaseModel | dict[str, Any] | RawJson
        if parts == ["info"] and method == "GET":
            result, status = await self._info(), 200
        elif parts == ["scenarios"] and method == "GET":
            result, status = self._scenarios(), 200
        elif len(parts) == 2 and parts[0] == "scenarios" and method == "GET":
            result, status = self._scenario(parts[1]), 200
        elif parts == ["episodes"] and method == "POST":
            result, status = await self._create(scope, await self._body(receive, EpisodeStart)), 201
        elif parts == ["episodes"] and method == "GET":
            result, status = EpisodeIds(episodes=list(self.store.episodes)), 200
        elif len(parts) in (2, 3) and parts[0] == "episodes":
            result, status = await self._episode_route(parts, method, scope, receive), 200
        else:
            raise ErrorReply(404, f"no route {method} {path}")
        body = result.body if isinstance(result, RawJson) else json_bytes(result)
        del result
        await send_json(send, status, body)
        if len(body) > LARGE_BODY_BYTES:
            del body
            release_free_memory()  # a state read of big data parsed it here: its pages go back, not only to the heap

    async def _episode_route(self, parts: list[str], method: str, scope: Scope, receive: Any) -> BaseModel | RawJson:
        action = parts[2] if len(parts) == 3 else None
        live = self._live(parts[1])
        if action is None and method == "DELETE":
            self.store.end(live.episode_id)
            return EpisodeEnded(episode_id=live.episode_id, calls=len(live.calls), **live.counts())
        if action == "state" and method == "GET":
            # EpisodeState's JSON, with the state's text as the store gives it (a state of big data is never parsed here).
            state = await self._guard(self.store.state_json(live))
            return RawJson(b'{"episode_id":%s,"state":%s}' % (json_bytes(live.episode_id), state))
        if action == "trajectory" and method == "GET":
            return live.trajectory()
        if action == "reset" and method == "POST":
            request = await self._body(receive, EpisodeStart)
            if request.scenario_id is None and request.init_config is None:
                # No body: back to where this episode started.
                request = EpisodeStart(scenario_id=live.scenario.task_id if live.scenario else None,
                                       init_config=None if live.scenario else live.init_config)
            self._check_episode_start(request)
            await self._guard(self.store.reset(live, request.scenario_id, request.init_config))
            return EpisodeReset(episode_id=live.episode_id, scenario_id=request.scenario_id, task=live.scenario.task if live.scenario else "",
                                turns=len(live.turns))
        if action == "lease" and method == "POST":
            # ``_live`` has renewed it: what the harness asks for while its agent works.
            return EpisodeLease(episode_id=live.episode_id, lease_s=min(live.lease_s or self.config.idle_ttl_s, self.config.idle_ttl_s))
        if action == "validate" and method == "POST":
            end = _query_flag(scope, "end")  # read first: a malformed query runs no checks
            body = await self._body(receive, ValidationRequest)
            result = await self._checking(self.store.validate(live, body.checklist, body.agent_replies))
            validation = EpisodeValidation(**dict(result), **live.counts())
            if end:
                # The harness's last two requests of an episode (its trajectory, its end) folded into this one.
                validation.calls, validation.ended = live.calls, True
                self.store.end(live.episode_id)
            return validation
        if action == "turn" and method == "POST":
            replies = (await self._body(receive, TurnRequest)).agent_replies
            return await self._checking(self.store.end_turn(live, replies))
        raise ErrorReply(405,
                         f"no route {method} /episodes/{{id}}/{action or ''}")

    # -- control handlers ------------------------------------------------------------------------

    def _authorize(self, scope: Scope) -> None:
        for name, value in scope["headers"]:
            if name == b"authorization" and hmac.compare_digest(value, self._token):
                return
        raise ErrorReply(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'")

    async def _body(self, receive: Any, model: type[M]) -> M:
        raw = await self._read_body(receive)
        try:
            data = parse_json(raw) if raw.strip() else {}
        except ValueError as e:
            raise ErrorReply(400, f"malformed JSON body: {e}") from None
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise ErrorReply(422, f"invalid body: {describe_validation_error(e)}") from None

    async def _read_body(self, receive: Any) -> bytes:
        body = await read_body(receive, self.config.max_body_bytes)
        if body is None:
            raise ErrorReply(413, f"request body is larger than the limit of {self.config.max_body_bytes} bytes")
        return body

    def _live(self, episode_id: str) -> LiveEpisode:
        try:
            return self.store.get(episode_id)
        except UnknownEpisode as e:
            raise ErrorReply(404, str(e)) from None
        except EpisodeLost as e:
            raise ErrorReply(410, str(e)) from None

    def _check_episode_start(self, request: EpisodeStart) -> None:
        if request.scenario_id is None and request.init_config is None:
            raise ErrorReply(422, "give either scenario_id or init_config")
        if request.scenario_id is not None and request.init_config is not None:
            raise ErrorReply(422, "give scenario_id or init_config, not both")
        if request.init_config is not None:
            try:
                check_references(self.bundle.directory, request.init_config, f"{self.bundle.env_id}: the request's init_config")
            except BundleError as e:
                raise ErrorReply(422, str(e)) from None

    async def _checking(self, checks: Awaitable[T]) -> T:
        """Await a store action that runs checks: ``_guard``'s statuses, and the checks' own troubles."""

        async def checked() -> T:
            try:
                return await checks
            except ChecklistError as e:
                raise ErrorReply(409, f"{e}; pass a checklist in the body or create the episode from a scenario") from None
            except NoTurnLeft as e:
                raise ErrorReply(409, str(e)) from None
            except CallAbandoned:
                raise ErrorReply(504, f"the checks outlived their limit of {self.config.check_timeout_s:g} s each and were abandoned") from None

        return await self._guard(checked())

    async def _guard(self, action: Awaitable[T]) -> T:
        """Await a store action, turning its errors into HTTP statuses."""
        try:
            return await action
        except ErrorReply:
            raise
        except (UnknownScenario, UnknownEpisode) as e:
            raise ErrorReply(404, str(e)) from None
        except LimitReached as e:
            raise ErrorReply(429, str(e)) from None
        except OutOfMemory as e:
            raise ErrorReply(507, str(e)) from None
        except EpisodeLost as e:
            raise ErrorReply(410, str(e)) from None
        except Overloaded as e:
            raise ErrorReply(503, f"{self.bundle.env_id}: {e}") from None
        except EnvScalerError as e:
            raise ErrorReply(500, f"environment error: {e}") from None

    async def _create(self, scope: Scope, request: EpisodeStart) -> EpisodeCreated:
        self._check_episode_start(request)
        live = await self._guard(self.store.create(request.scenario_id, request.init_config))
        live.lease_s = request.lease_s
        path = f"/episodes/{live.episode_id}/mcp"
        return EpisodeCreated(
            episode_id=live.episode_id,
            mcp_url=self._public_base(scope) + path,
            mcp_path=path,
            env_id=self.bundle.env_id,
            scenario_id=request.scenario_id,
            task=live.scenario.task if live.scenario else "",
            user_profile=live.scenario.user_profile if live.scenario else None,
            env_introduction=self.bundle.spec.environment_introduction,
            tools=self._tools_openai,
            turns=len(live.turns),
        )

    def _public_base(self, scope: Scope) -> str:
        """Where agents reach this server: the gateway's prefix, the configured URL, or the Host asked for."""
        host = ""
        for name, value in scope["headers"]:
            if name == b"x-envscaler-base-url":
                return value.decode().rstrip("/")
            if name == b"host":
                host = value.decode("latin-1")
        if self.config.public_url:
            return self.config.public_url.rstrip("/")
        # In a container or behind NAT our own bind address means nothing to the caller; its Host does.
        return f"{scope.get('scheme', 'http')}://{host}" if host else ""

    async def _info(self) -> ServerInfo:
        stats = await self.store.stats()
        return ServerInfo(
            env_id=self.bundle.env_id,
            spec_hash=self.bundle.spec.content_hash(),
            environment_summary=self.bundle.spec.environment_summary,
            tools=[t.name for t in self.store.tool_list()],
            scenarios=len(self.bundle.scenarios),
            limits=self.config.model_dump(exclude={"token"}),
            live_episodes=len(self.store.episodes),
            stuck_calls=stats.stuck_calls,
            call_threads=stats.call_threads,
            threaded_tools=stats.threaded_tools,
            expired_episodes=self.store.expired,
            memory=stats.memory or memory_status(),
            worker_restarts=stats.worker_restarts,
            episodes_rebuilt=stats.episodes_rebuilt,
            episodes_lost=stats.episodes_lost,
            worker_resources=stats.worker_resources,
        )

    def _scenarios(self) -> ScenarioListing:
        env_id = self.bundle.env_id
        return ScenarioListing(
            env_id=env_id,
            scenarios=[
                ScenarioSummary(
                    env_id=env_id,
                    task_id=s.task_id,
                    task=s.task,
                    conversational=s.conversational,
                    checks=s.check_count(),
                    has_reference=bool(s.reference_solution) or any(t.reference_solution for t in s.turns or []),
                    turns=len(s.turns or []),
                )
                for s in self.bundle.scenarios
            ],
        )

    def _scenario(self, task_id: str) -> dict[str, Any]:
        scenario = self.store.scenarios.get(task_id)
        if scenario is None:
            raise ErrorReply(404, f"{self.bundle.env_id} has no scenario {task_id!r}; 'envscaler catalog scenarios' (or GET /scenarios) lists them")
        return scenario.model_dump(mode="json", exclude_none=True)

    # -- MCP -----------------------------------------------------------------------------------

    async def _mcp(self, scope: Scope, receive: Any, send: Any, episode_id: str) -> None:
        routing = []
        for name, value in scope["headers"]:
            if name == b"origin" and not self.cors.allows(value.decode()):
                raise ErrorReply(403, f"origin {value.decode()!r} is not allowed (see --allowed-origin)")
            if name in ROUTING_HEADERS:
                routing.append((name, value))
        if scope["method"] != "POST":
            await send_json(send, 405, json_bytes({"error": "this MCP endpoint answers POST only (no SSE stream, no sessions)"}), [(b"allow", b"POST")])
            return
        live = self._live(episode_id)
        raw = await self._read_body(receive)
        try:
            message, bad_numbers = parse_message(raw)
        except ValueError as e:
            await send_json(send, 400, json_bytes(parse_error(str(e))))
            return
        status, body = await self.mcp.handle(live, message, routing, bad_numbers=bad_numbers)
        await send_json(send, status, json_bytes(body) if body is not None else None)

    async def _legacy_sse(self, scope: Scope, receive: Any, send: Any, episode_id: str, action: str) -> None:
        """The 2024-11-05 HTTP+SSE transport: ``GET .../sse`` streams answers to ``POST .../messages`` (servers/sse.py)."""
        origin = request_origin(scope)
        if origin is not None and not self.cors.allows(origin):
            raise ErrorReply(403, f"origin {origin!r} is not allowed (see --allowed-origin)")
        live = self._live(episode_id)
        if action == "sse":
            if scope["method"] != "GET":
                raise ErrorReply(405, "GET opens the event stream; POST messages to the URL its endpoint event names")
            await self.sse.stream(live.episode_id, receive, send)
            return
        if scope["method"] != "POST":
            raise ErrorReply(405, "POST one JSON-RPC message here; its answer comes on the event stream")
        session_id = parse_qs((scope.get("query_string") or b"").decode("latin-1")).get("session_id", [""])[0]
        if self.sse.episode_of(session_id) != live.episode_id:
            raise ErrorReply(404, f"no open event stream {session_id!r} for episode {live.episode_id}: GET .../sse first")
        raw = await self._read_body(receive)
        try:
            message, bad_numbers = parse_message(raw)
        except ValueError as e:
            raise ErrorReply(400, f"malformed JSON-RPC message: {e}") from None
        _, body = await self.mcp.handle(live, message, [], bad_numbers=bad_numbers)
        if body is not None:
            await self.sse.deliver(session_id, body)
        await send_json(send, 202, None)
