"""One OpenEnv session as an ``openenv-core`` Environment over the server's episode store.

The session speaks OpenEnv's MCP flavour: ``reset`` opens an episode for a scenario (by id, by seed,
or at random), ``step`` takes ``ListToolsAction`` and ``CallToolAction``, ``state`` reports the
episode. The agent ends the episode by calling the ``finish`` tool, or the server ends it at the
step limit; either way the validator scores the final state, and that score is the step's
``reward`` with ``done`` set.

Only the store's public calls are used (``create``, ``get``, ``call_tool``, ``validate``, ``end``):
tools run exactly as they do for the episode's MCP endpoint, with the same guards and record.
``openenv-core``'s own ``MCPEnvironment`` is not the base class because it routes every call
through an in-process FastMCP client, which costs more than the tool call itself.

Tool names: OpenEnv reserves ``reset``, ``step``, ``state`` and ``close`` and this endpoint adds
``finish``; an environment tool with one of those names is listed and called as ``<name>_tool``
(``<name>_tool2`` ... if that is taken too).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import (
    RESERVED_TOOL_NAMES,
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
    Tool,
    ToolError,
    ToolErrorType,
)
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

from envscaler import Scenario, ToolOutcome, ToolSchema, ValidationResult
from servers.episodes.store import EpisodeRegistry, LiveEpisode
from servers.errors import CallAbandoned, OpenEnvSessionError, UnknownEpisode

FINISH_TOOL = "finish"
_FINISH_SCHEMA = Tool(
    name=FINISH_TOOL,
    description="End the episode when the task is done (or cannot be done). Your work is then scored; no tool can be called after this.",
    input_schema={
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "Optional final answer or summary for the user."}},
    },
)


def protocol_names(tool_names: Sequence[str]) -> dict[str, str]:
    """Name on the OpenEnv endpoint -> the environment's tool name; clashing names get ``_tool``."""
    clashing = RESERVED_TOOL_NAMES | {FINISH_TOOL}
    taken = set(tool_names) | clashing
    names: dict[str, str] = {}
    for name in tool_names:
        public = name
        if name in clashing:
            public, suffix = f"{name}_tool", 2
            while public in taken:
                public, suffix = f"{name}_tool{suffix}", suffix + 1
            taken.add(public)
        names[public] = name
    return names


class EpisodeObservation(Observation):
    """What ``reset`` returns: the scenario the episode runs and what an agent is told about it."""

    env_id: str
    scenario_id: str
    episode_id: str
    task: str
    env_introduction: str
    max_steps: int


class EpisodeState(State):
    """What ``state`` reports: the episode, its progress and, once over, its score and checks."""

    env_id: str = ""
    scenario_id: str | None = None
    max_steps: int = 0
    done: bool = False
    reward: float | None = None
    checks: list[dict[str, Any]] = Field(default_factory=list)


@dataclass
class EndpointContext:
    """What every session of one server shares: the store, the tools as listed, the scenarios."""

    store: EpisodeRegistry
    env_id: str
    introduction: str
    summary: str
    tools: list[ToolSchema]
    scenarios: list[Scenario]
    max_steps: int
    names: dict[str, str] = field(init=False)
    listed: list[Tool] = field(init=False)

    def __post_init__(self) -> None:
        self.scenarios = sorted(self.scenarios, key=lambda s: s.task_id)
        self.names = protocol_names([t.name for t in self.tools])
        public = {real: name for name, real in self.names.items()}
        self.listed = [Tool(name=public[t.name], description=t.description, input_schema=t.parameters) for t in self.tools]
        self.listed.append(_FINISH_SCHEMA)

    def choose(self, scenario_id: str | None, seed: int | None) -> Scenario:
        """The scenario asked for by id, else the one a seed picks, else one at random."""
        if not self.scenarios:
            raise OpenEnvSessionError(f"{self.env_id} has no scenarios to open an episode from")
        if scenario_id is not None:
            for scenario in self.scenarios:
                if scenario.task_id == scenario_id:
                    return scenario
            known = ", ".join(s.task_id for s in self.scenarios[:5])
            raise OpenEnvSessionError(f"{self.env_id} has no scenario {scenario_id!r} (e.g. {known}); GET /scenarios on the control API lists them")
        if seed is not None:
            return self.scenarios[seed % len(self.scenarios)]
        return random.choice(self.scenarios)


def _tool_result(text: str, data: Any, is_error: bool) -> dict[str, Any]:
    # The shape of FastMCP's CallToolResult, which OpenEnv's MCPToolClient unwraps (``data``).
    return {"content": [{"type": "text", "text": text}], "structured_content": None, "meta": None, "data": data, "is_error": is_error}


class FarmEpisodeEnvironment(Environment[Action, Observation, EpisodeState]):
    """One OpenEnv session: at most one live episode at a time, ended on reset, close or reaping."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    # Sessions do no blocking work of their own (the store runs environment code), so all of them
    # share OpenEnv's one executor thread instead of a thread each.
    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    def __init__(self, context: EndpointContext) -> None:
        super().__init__()
        self.context = context
        self._live: LiveEpisode | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._state = EpisodeState(env_id=context.env_id, max_steps=context.max_steps)

    # -- the OpenEnv interface -------------------------------------------------------------------

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        raise OpenEnvSessionError("this environment runs on the server's event loop: the server calls reset_async")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        raise OpenEnvSessionError("this environment runs on the server's event loop: the server calls step_async")

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, scenario_id: str | None = None, **kwargs: Any
    ) -> EpisodeObservation:
        """End the current episode, if any, and open one for ``scenario_id`` (or the one ``seed`` picks).

        ``episode_id`` is accepted as OpenEnv clients send it, but the server names episodes itself
        (``state().episode_id``): episode ids are capabilities and must be unguessable.
        """
        self._check_open()
        if kwargs:
            raise OpenEnvSessionError(f"unknown reset parameters {sorted(kwargs)}; reset takes scenario_id or seed")
        scenario = self.context.choose(scenario_id, seed)
        self._loop = asyncio.get_running_loop()
        self._end_current()
        live = await self.context.store.create(scenario.task_id, None)
        self._live = live
        self._state = EpisodeState(
            episode_id=live.episode_id, env_id=self.context.env_id, scenario_id=scenario.task_id, max_steps=self.context.max_steps
        )
        return EpisodeObservation(
            env_id=self.context.env_id,
            scenario_id=scenario.task_id,
            episode_id=live.episode_id,
            task=scenario.task,
            env_introduction=self.context.introduction,
            max_steps=self.context.max_steps,
        )

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """List the tools, or call one (``finish`` ends and scores the episode)."""
        self._check_open()
        if isinstance(action, ListToolsAction):
            return ListToolsObservation(tools=self.context.listed)
        if not isinstance(action, CallToolAction):
            raise OpenEnvSessionError(f"unsupported action {type(action).__name__}: send list_tools or call_tool")
        live = self._current()
        if action.tool_name == FINISH_TOOL:
            return await self._finish(live, _tool_result("The episode is over; your work has been scored.", None, False))
        self._state.step_count += 1
        name = self.context.names.get(action.tool_name)
        if name is None:
            message = f"no tool named {action.tool_name!r}; list_tools lists them"
            observation = CallToolObservation(tool_name=action.tool_name, error=ToolError(error_type=ToolErrorType.TOOL_NOT_FOUND, message=message))
        else:
            # openenv-core parses with json.loads, which takes NaN and Infinity and makes 1e400 inf: refused here.
            outcome = await self.context.store.call_tool(live, name, action.arguments, check_numbers=True)
            observation = self._observe(action.tool_name, outcome)
        if self._state.step_count >= self.context.max_steps:
            return await self._finish(live, observation.result, observation)
        return observation

    @property
    def state(self) -> EpisodeState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name=self.context.env_id, description=self.context.summary or self.context.introduction, version="1")

    def close(self) -> None:
        """End the live episode. OpenEnv may call this from its executor thread: the store lives on the loop."""
        self._closed = True
        loop = self._loop
        if self._live is None or loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._end_current()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._end_current)

    # -- helpers ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise OpenEnvSessionError("this session was closed (idle past the server's limit, or shut down); open a new one")

    def _current(self) -> LiveEpisode:
        if self._live is None:
            if self._state.done:
                raise OpenEnvSessionError("this episode is over (done); call reset to start another")
            raise OpenEnvSessionError("no episode yet: call reset (with scenario_id or seed) first")
        try:
            return self.context.store.get(self._live.episode_id)
        except UnknownEpisode:
            self._live = None
            raise OpenEnvSessionError("this episode expired on the server after being idle; call reset to start another") from None

    def _end_current(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            try:
                self.context.store.end(live.episode_id)
            except UnknownEpisode:
                pass  # expired on the server already

    def _observe(self, public_name: str, outcome: ToolOutcome) -> CallToolObservation:
        # The text and error flag the episode's MCP endpoint gives. ``data`` (what OpenEnv's
        # MCPToolClient returns) is the result itself, or the error message when there is none.
        data = outcome.agent_text if outcome.error is not None and outcome.result is None else outcome.result
        return CallToolObservation(tool_name=public_name, result=_tool_result(outcome.agent_text, data, outcome.error is not None))

    async def _finish(self, live: LiveEpisode, result: Any, observation: CallToolObservation | None = None) -> CallToolObservation:
        """Score the episode, mark it done, and end it on the server."""
        try:
            validation: ValidationResult = await self.context.store.validate(live, None)
        except CallAbandoned:
            raise OpenEnvSessionError(f"{self.context.env_id}: the checks of episode {live.episode_id} ran past their limit; reset to try again") from None
        self._end_current()
        self._state.done = True
        self._state.reward = validation.score
        self._state.checks = [check.model_dump() for check in validation.checks]
        if observation is None:
            observation = CallToolObservation(tool_name=FINISH_TOOL, result=result)
        observation.done = True
        observation.reward = validation.score
        return observation
