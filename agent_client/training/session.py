"""The core every trainer adapter shares: a farm seen from a trainer, and one farm episode per trajectory.

- :class:`FarmConnection`: a farm catalog (any backend), each environment reached through the farm's
  gateway when the catalog names one; its scored scenarios (:func:`describe_environment`) and the
  chat prompt of each (:func:`scenario_prompt`).
- :class:`FarmEpisode`: one episode, opened on a row's scenario, driven by tool calls (from the
  framework, or read from the model's text by :meth:`FarmEpisode.act`), scored by the validator at the
  end (:meth:`FarmEpisode.score`: reward and per-check results), and ended on every path.
- :class:`Background`: one event loop on a thread, for frameworks that call environments synchronously.

A server that cannot be reached, or an episode it no longer knows, raises :class:`InfraError`: a
reward that was never measured must stop the trainer's step, never pass for 0. Conversational
scenarios (a simulated user holds the task) need a user model, as in the harness; their task is never
shown to the agent, only the simulated user's messages. In a scenario with scripted user turns, a
plain answer ends the current turn, and the next turn's message is the next observation.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import threading
import weakref
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel

from agent_client.agents import SYSTEM_PROMPT
from agent_client.errors import HarnessError
from agent_client.http import LeanHttp
from agent_client.llm import LlmEndpoint
from agent_client.models import Usage, load_farm_catalog
from agent_client.remote import EnvControl, McpTools, new_http_client
from agent_client.training.toolcalls import ParsedCall, parse_tool_calls
from agent_client.user import SimulatedUser
from envscaler.errors import InfraError
from envscaler.models import CheckResult, ToolSchema
from envscaler.wire import DEFAULT_FARM_CATALOG, EnvEndpoint, EpisodeCreated, FarmCatalog, TurnEnded

__all__ = [
    "CATALOG_ENV", "Background", "EpisodeScore", "FarmConnection", "FarmSettings", "FarmEnvDescription", "FarmEpisode", "FarmScenario", "ToolReply", "Turn",
    "describe_environment", "farm_scenarios", "scenario_prompt",
]

T = TypeVar("T")


class Background:
    """One event loop on a daemon thread, running the async farm clients for frameworks that call synchronously.

    Every environment instance shares it and its pooled HTTP client; frameworks may call from several threads.
    """

    _lock = threading.Lock()
    _loop: ClassVar[asyncio.AbstractEventLoop | None] = None
    _http: ClassVar[LeanHttp | None] = None

    @classmethod
    def http(cls) -> LeanHttp:
        """The pooled client (its connections belong to the background loop)."""
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="envscaler-training", daemon=True).start()
                cls._loop = loop
                cls._http = new_http_client()
            assert cls._http is not None
            return cls._http

    @classmethod
    def run(cls, work: Coroutine[Any, Any, T]) -> T:
        """``work`` run to its end on the background loop; its exception is raised here."""
        cls.http()
        assert cls._loop is not None
        return asyncio.run_coroutine_threadsafe(work, cls._loop).result()


# A pooled client's connections belong to the loop that opened them: async frameworks (verl) get one per loop.
_loop_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LeanHttp] = weakref.WeakKeyDictionary()


def loop_http() -> LeanHttp:
    """The pooled HTTP client of the running event loop."""
    loop = asyncio.get_running_loop()
    if loop is Background._loop:
        return Background.http()
    client = _loop_clients.get(loop)
    if client is None:
        client = _loop_clients[loop] = new_http_client()
    return client


CATALOG_ENV = "ENVSCALER_FARM_CATALOG"
"""Where adapters made by a framework (in its Ray workers) find the farm catalog when their config names none."""


class FarmSettings(BaseModel):
    """What an adapter made by a framework is configured with (its env config / agent loop config keys)."""

    # The catalog ``envscaler farm up`` wrote; default: $ENVSCALER_FARM_CATALOG, else .envscaler/farm.json.
    catalog: str | None = None
    # The OpenAI-compatible model that plays conversational scenarios' simulated user (key from OPENAI_API_KEY).
    user_model: str | None = None
    user_base_url: str | None = None
    # Model turns before the episode is scored and ends (None: the framework's own limit only).
    max_turns: int | None = None

    def connection(self) -> FarmConnection:
        """The farm these settings name (one per catalog and user model in a process)."""
        catalog = self.catalog or os.environ.get(CATALOG_ENV) or DEFAULT_FARM_CATALOG
        return _connection(catalog, self.user_model, self.user_base_url)


@functools.cache
def _connection(catalog: str, user_model: str | None, user_base_url: str | None) -> FarmConnection:
    user = LlmEndpoint(base_url=user_base_url, model=user_model) if user_model else None
    return FarmConnection(catalog, user)


class FarmConnection:
    """A running farm as its catalog describes it; each environment through the gateway when there is one."""

    def __init__(self, catalog: str | Path | FarmCatalog, user: LlmEndpoint | None = None) -> None:
        self.catalog = catalog if isinstance(catalog, FarmCatalog) else load_farm_catalog(catalog)
        # The model that plays the simulated user of conversational scenarios (None: they cannot be opened).
        self.user = user

    def endpoint(self, env_id: str) -> EnvEndpoint:
        """Where ``env_id``'s control API answers: the gateway's route to it, else the server itself."""
        endpoint = self.catalog.envs.get(env_id)
        if endpoint is None:
            raise HarnessError(f"the farm has no environment {env_id!r} (it has {', '.join(sorted(self.catalog.envs))})")
        if self.catalog.gateway:
            return EnvEndpoint(url=f"{self.catalog.gateway.rstrip('/')}/envs/{env_id}", token=endpoint.token)
        return endpoint

    def control(self, env_id: str, http: LeanHttp) -> EnvControl:
        """The control API of ``env_id`` over ``http``."""
        return EnvControl(http, env_id, self.endpoint(env_id))


@dataclass(frozen=True)
class FarmScenario:
    """One scored scenario of a farm environment."""

    env_id: str
    scenario_id: str
    task: str
    conversational: bool = False
    # Scripted user turns (0: one task): the first is ``task``, the others come as the agent ends each turn.
    turns: int = 0


@dataclass(frozen=True)
class FarmEnvDescription:
    """What training needs to know about one farm environment."""

    env_id: str
    endpoint: EnvEndpoint
    introduction: str
    tools: list[ToolSchema]
    scenarios: list[FarmScenario]


def describe_environment(env_id: str, endpoint: EnvEndpoint) -> FarmEnvDescription:
    """Ask one server for its scored scenarios, tools and introduction.

    Tool schemas come with an episode (``POST /episodes``), so one is opened on the first scenario
    and ended at once.
    """

    async def describe() -> FarmEnvDescription:
        control = EnvControl(Background.http(), env_id, endpoint)
        scenarios = [FarmScenario(env_id, s.task_id, s.task, s.conversational, s.turns) for s in await control.scenarios() if s.checks > 0]
        if not scenarios:
            raise HarnessError(f"{env_id} has no scored scenarios (with a checklist) to train on")
        created = await control.create(scenarios[0].scenario_id)
        await control.end(created.episode_id)
        tools = [ToolSchema.model_validate(t.get("function", t)) for t in created.tools]
        return FarmEnvDescription(env_id, endpoint, created.env_introduction, tools, scenarios)

    return Background.run(describe())


def farm_scenarios(farm: FarmConnection, env_ids: list[str] | None = None, conversational: bool = False) -> list[tuple[FarmEnvDescription, FarmScenario]]:
    """Every scored scenario of the farm's environments (``env_ids``: all), with its environment's description.

    Conversational scenarios are included only with ``conversational=True``: they need a user model.
    """
    found = []
    for env_id in env_ids or sorted(farm.catalog.envs):
        description = describe_environment(env_id, farm.endpoint(env_id))
        found.extend((description, s) for s in description.scenarios if conversational or not s.conversational)
    return found


def scenario_prompt(description: FarmEnvDescription, scenario: FarmScenario) -> list[dict[str, str]]:
    """The chat prompt of a scenario: the system prompt, then the task as the user's message.

    A conversational scenario's task is the simulated user's brief (its persona and goal), never the
    agent's to read: its prompt is the system prompt alone, and the simulated user's opening message
    is added when the episode opens.
    """
    system = {"role": "system", "content": SYSTEM_PROMPT.format(introduction=description.introduction)}
    if scenario.conversational:
        return [system]
    return [system, {"role": "user", "content": scenario.task}]


class ToolReply(BaseModel):
    """One tool call's outcome as the model sees it: the result text, or an error message."""

    call_id: str
    name: str
    text: str
    is_error: bool


class Turn(BaseModel):
    """What one model turn led to.

    ``replies``: the results of its tool calls (unreadable calls get an error in place of a result);
    ``user``: the user's message after a plain answer (the simulated user's in a conversation, the next
    scripted turn's in a scenario with turns); ``done``: the episode is over (a plain answer outside a
    conversation, the user ended it, the last scripted turn ended, or the turn budget is spent).
    """

    style: Literal["hermes", "openai"] | None = None
    replies: list[ToolReply] = []
    user: str | None = None
    done: bool = False


class EpisodeScore(BaseModel):
    """The validator's verdict on an episode's final state."""

    reward: float
    checks: list[CheckResult]
    turns: int
    tool_calls: int
    agent_errors: int

    def metrics(self) -> dict[str, float]:
        """Numbers for a trainer's logs: the reward, the share of checks passed, the counts."""
        passed = sum(c.passed for c in self.checks)
        return {
            "envscaler/reward": self.reward, "envscaler/checks_passed": passed / len(self.checks) if self.checks else 0.0,
            "envscaler/turns": float(self.turns), "envscaler/tool_calls": float(self.tool_calls), "envscaler/agent_errors": float(self.agent_errors),
        }

    def details(self) -> dict[str, Any]:
        """The verdict with every check's result, for a trainer's per-trajectory metadata."""
        return {"reward": self.reward, "checks": [c.model_dump() for c in self.checks], **self.metrics()}


TRAJECTORY_LEASE_S = 900.0
"""How long a server keeps a trajectory's episode unused (every tool call renews it): a trainer that dies
leaves its episodes for a quarter of an hour at most, not the server's idle hour."""


class FarmEpisode:
    """One farm episode, for one trajectory. Open it with :meth:`open`; :meth:`end` it on every path."""

    def __init__(self, control: EnvControl, created: EpisodeCreated, user: SimulatedUser | None, max_turns: int | None) -> None:
        self.control = control
        self.created = created
        self.tools = McpTools(control.http, created.mcp_url)
        self.user = user
        self.user_usage = Usage()
        self.max_turns = max_turns
        self.turns = self.tool_calls = self.agent_errors = 0
        self.ended = False
        # What the server answered as each scripted user turn ended.
        self.turns_ended: list[TurnEnded] = []
        # The agent's plain answers not yet passed to the server (the checks read them as ``agent_replies``).
        self.pending_replies: list[str] = []
        # verl runs a turn's tool calls concurrently (asyncio.gather); the environment is stateful, so they run one
        # at a time, in the order the model wrote them (the lock is FIFO and gather starts them in order).
        self._calls = asyncio.Lock()

    @classmethod
    async def open(cls, farm: FarmConnection, http: LeanHttp, env_id: str, scenario_id: str, max_turns: int | None = None) -> FarmEpisode:
        """A new episode of ``env_id``'s scenario ``scenario_id``; a conversational one gets its simulated user."""
        control = farm.control(env_id, http)
        # Shielded: a trajectory cancelled now still learns the episode's id and ends it below.
        created = await asyncio.shield(control.create(scenario_id, lease_s=TRAJECTORY_LEASE_S))
        user = None
        if created.user_profile:
            if farm.user is None:
                await control.end(created.episode_id)
                raise HarnessError(f"{env_id}/{scenario_id} is conversational: give the adapter a user model (user=LlmEndpoint(...)) "
                                   "to play its simulated user, or leave conversational scenarios out of the dataset")
            user = SimulatedUser(farm.user, created.task, str(created.user_profile))
        return cls(control, created, user, max_turns)

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The episode's tools in OpenAI's ``{"type": "function", "function": {...}}`` form."""
        return self.created.tools

    async def opening(self) -> str | None:
        """The simulated user's first message in a conversational scenario, else None (the prompt holds the task)."""
        if self.user is None:
            return None
        return await self.user.start(self.user_usage)

    async def call(self, call_id: str, name: str, arguments: dict[str, Any]) -> ToolReply:
        """One tool call on the episode (after the calls asked before it); a tool's own error is a reply the model
        sees, a lost server raises InfraError."""
        self.tool_calls += 1
        async with self._calls:
            text, is_error = await self.tools.call(name, arguments)
        return ToolReply(call_id=call_id, name=name, text=text, is_error=is_error)

    async def act(self, text: str) -> Turn:
        """One model turn given as text: its tool calls run in order, or, for a plain answer, the simulated
        user's reply (in a conversation) or the end of the episode."""
        self.turns += 1
        parsed = parse_tool_calls(text)
        if parsed.calls:
            replies = [await self._reply(call) for call in parsed.calls]
            return Turn(style=parsed.style, replies=replies, done=self._out_of_turns())
        if not self.converses:
            self.pending_replies.append(text)
            return Turn(done=True)
        reply = await self.next_user_message(text)
        return Turn(user=reply, done=reply is None or self._out_of_turns())

    @property
    def converses(self) -> bool:
        """True when a plain answer gets a user's message back: scripted user turns, or a simulated user."""
        return self.created.turns > 0 or self.user is not None

    async def next_user_message(self, answer: str) -> str | None:
        """The user's message after the agent's plain ``answer``: in a scenario with scripted turns, the next
        turn's (the current turn ends, its checks run), else the simulated user's; None when it is over."""
        if self.created.turns > 0:
            return await self.end_turn(answer)
        return await self.user_reply(answer)

    async def end_turn(self, answer: str | None = None) -> str | None:
        """End the current scripted user turn, passing ``answer`` (and earlier unpassed answers) as the agent's
        replies: the next turn's message, or None after the last."""
        if answer:
            self.pending_replies.append(answer)
        ended = await self.control.end_turn(self.created.episode_id, self.pending_replies)
        self.pending_replies = []
        self.turns_ended.append(ended)
        return ended.next_message

    async def user_reply(self, answer: str) -> str | None:
        """The simulated user's answer to the agent's plain ``answer``; None when the user ends the conversation."""
        assert self.user is not None
        reply, stop = await self.user.reply(answer, self.user_usage)
        return None if stop else reply

    async def _reply(self, call: ParsedCall) -> ToolReply:
        if call.error is not None:
            self.agent_errors += 1
            return ToolReply(call_id=call.call_id, name=call.name, text=call.error, is_error=True)
        return await self.call(call.call_id, call.name, call.arguments)

    def _out_of_turns(self) -> bool:
        return self.max_turns is not None and self.turns >= self.max_turns

    async def score(self) -> EpisodeScore:
        """The validator's score of the episode's state now, with every check's result."""
        validation = await self.control.validate(self.created.episode_id, self.pending_replies)
        return EpisodeScore(reward=validation.score, checks=validation.checks, turns=self.turns, tool_calls=self.tool_calls,
                            agent_errors=self.agent_errors)

    async def end(self) -> None:
        """End the episode (once; a server that is gone already is not an error here)."""
        if not self.ended:
            self.ended = True
            await asyncio.shield(self.control.end(self.created.episode_id))


class HeldEpisode:
    """What a synchronous adapter (SkyRL's, GEM's) holds: one episode at a time, ended by ``close`` and
    on any failure of the work it runs on the background loop."""

    episode: FarmEpisode | None = None

    def close(self) -> None:
        """End the episode, if one is open."""
        episode, self.episode = self.episode, None
        if episode is not None:
            Background.run(episode.end())

    def _run(self, work: Any) -> Any:
        # Any failure (a lost server included) ends the episode before the framework sees it.
        try:
            return Background.run(work)
        except BaseException:
            self.close()
            raise


# Synchronous adapters (SkyRL, GEM) may be dropped without close(): their open episodes end at exit.
_open_episodes: weakref.WeakSet[FarmEpisode] = weakref.WeakSet()


def track(episode: FarmEpisode) -> FarmEpisode:
    """``episode``, ended at interpreter exit if no one ends it before."""
    _open_episodes.add(episode)
    return episode


@atexit.register
def _end_open_episodes() -> None:
    for episode in list(_open_episodes):
        try:
            Background.run(episode.end())
        except (InfraError, HarnessError):
            pass  # the farm is gone already; its servers expire idle episodes anyway

