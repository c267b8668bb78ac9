"""Live episodes of one environment: creation, limits, idle expiry, guarded tool calls, records.

A tool call first runs right on the event loop with a small budget (``inline_budget_s``): almost
every call of a synthesized environment takes microseconds, and handing each one to another thread
costs more than the call (two thread wake-ups across CPUs). A call that outruns the budget is
preempted, its episode restored to the state before it, and it runs again on a worker thread
(``servers.calls``) where it can take its full limit without stalling anyone; its tool goes to the
worker directly from then on. Constructors and checks always run on the worker.

Calls on one episode are serialised by its lock; environment state is not thread-safe. A call still
running past its limit is abandoned: the agent gets an ``is_error`` result at once, and the episode
refuses further calls until it is reset or ended, because the stuck call may still change its state.

The locks are asyncio's, not anyio's: the server only runs on asyncio, and anyio's checkpoints
cost ~25 us on every tool call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import BaseModel

from envscaler import Bundle, EnvCodeError, EnvRuntime, Episode, EnvScalerError, Scenario, ToolOutcome, ValidationResult
from envscaler.guard import Preempted, can_preempt
from envscaler.models import CheckItem
from servers.calls import CallAbandoned, CallRunner
from servers.episode_ids import new_episode_id

log = logging.getLogger("envscaler.server")

# Grace period past the limit (the guard in the call stops it then) before the server stops waiting.
_ABANDON_GRACE_S = 0.5


class LimitReached(EnvScalerError):
    """The server already holds its maximum number of live episodes."""


class UnknownEpisode(EnvScalerError):
    """No live episode has this id (never created, ended, or expired)."""


class UnknownScenario(EnvScalerError):
    """The environment has no scenario with this id."""


class Trajectory(BaseModel):
    """The server-side record of one episode."""

    episode_id: str
    env_id: str
    scenario_id: str | None
    calls: list[ToolOutcome]
    agent_errors: int
    env_errors: int
    timeouts: int


class LiveEpisode:
    """One episode with its scenario, lock, counters and call record."""

    def __init__(self, episode_id: str, episode: Episode, scenario: Scenario | None) -> None:
        self.episode_id = episode_id
        self.episode = episode
        self.scenario = scenario
        self.lock = asyncio.Lock()
        self.calls: list[ToolOutcome] = []
        self.last_used = time.monotonic()
        self.stuck = False

    def reset(self, episode: Episode, scenario: Scenario | None) -> None:
        self.episode = episode
        self.scenario = scenario
        self.calls = []
        self.stuck = False
        self.last_used = time.monotonic()

    def counts(self) -> dict[str, int]:
        """Errors by who is to blame: the agent, the environment code, or a hang."""
        kinds = [c.error_kind for c in self.calls]
        return {"agent_errors": kinds.count("agent"), "env_errors": kinds.count("env"), "timeouts": kinds.count("timeout")}

    def trajectory(self) -> Trajectory:
        return Trajectory(
            episode_id=self.episode_id,
            env_id=self.episode.runtime.env_id,
            scenario_id=self.scenario.task_id if self.scenario else None,
            calls=self.calls,
            **self.counts(),
        )


class EpisodeStore:
    """Every live episode of one environment, keyed by an unguessable id."""

    def __init__(
        self,
        bundle: Bundle,
        runtime: EnvRuntime,
        *,
        max_episodes: int,
        idle_ttl_s: float,
        worker_threads: int,
        inline_budget_s: float,
        replica_id: str | None = None,
    ) -> None:
        self.bundle = bundle
        # Prefixes every episode id when this server is one replica of many (servers.episode_ids).
        self.replica_id = replica_id
        self.runtime = runtime
        self.max_episodes = max_episodes
        self.idle_ttl_s = idle_ttl_s
        self.episodes: dict[str, LiveEpisode] = {}
        self.scenarios = {s.task_id: s for s in bundle.scenarios}
        self.runner = CallRunner(f"env-{runtime.env_id}", max_threads=worker_threads)
        self.inline_budget_s = inline_budget_s
        # Tools that once outran the inline budget: they go to the worker thread directly.
        self.threaded_tools: set[str] = set()
        self.stuck_calls = 0
        self.expired = 0

    def _scenario(self, scenario_id: str) -> Scenario:
        scenario = self.scenarios.get(scenario_id)
        if scenario is None:
            raise UnknownScenario(f"{self.runtime.env_id} has no scenario {scenario_id!r}; GET /scenarios lists them")
        return scenario

    async def _build(self, scenario_id: str | None, init_config: dict[str, Any] | None) -> tuple[Episode, Scenario | None]:
        scenario = self._scenario(scenario_id) if scenario_id else None
        config = scenario.init_config if scenario else (init_config or {})
        limit = self.runtime.call_timeout_s + _ABANDON_GRACE_S
        try:
            return await self.runner.run(lambda: self.runtime.new_episode(config), limit), scenario
        except CallAbandoned:
            raise EnvCodeError(f"{self.runtime.env_id}: constructor ran longer than {self.runtime.call_timeout_s:g} s") from None

    async def create(self, scenario_id: str | None, init_config: dict[str, Any] | None) -> LiveEpisode:
        """A new episode. Raises LimitReached, UnknownScenario or EnvCodeError."""
        self._check_room()
        episode, scenario = await self._build(scenario_id, init_config)
        self._check_room()  # others may have been created while this one was built
        live = LiveEpisode(new_episode_id(self.replica_id), episode, scenario)
        self.episodes[live.episode_id] = live
        log.info("episode created", extra={"env": self.runtime.env_id, "episode": live.episode_id, "scenario": scenario_id})
        return live

    def _check_room(self) -> None:
        if len(self.episodes) >= self.max_episodes:
            raise LimitReached(
                f"{self.runtime.env_id} already holds {self.max_episodes} live episodes; end some (DELETE) or raise --max-episodes"
            )

    def get(self, episode_id: str) -> LiveEpisode:
        live = self.episodes.get(episode_id)
        if live is None:
            raise UnknownEpisode(f"no live episode {episode_id!r} (ended, expired, or never created)")
        live.last_used = time.monotonic()
        return live

    async def reset(self, live: LiveEpisode, scenario_id: str | None, init_config: dict[str, Any] | None) -> None:
        """Put ``live`` back to a scenario's (or a raw) initial state; its id and URL stay."""
        episode, scenario = await self._build(scenario_id, init_config)
        async with live.lock:
            live.reset(episode, scenario)
        log.info("episode reset", extra={"env": self.runtime.env_id, "episode": live.episode_id, "scenario": scenario_id})

    def end(self, episode_id: str) -> LiveEpisode:
        live = self.episodes.pop(episode_id, None)
        if live is None:
            raise UnknownEpisode(f"no live episode {episode_id!r} (ended, expired, or never created)")
        log.info("episode ended", extra={"env": self.runtime.env_id, "episode": episode_id, "calls": len(live.calls)})
        return live

    def expire_idle(self) -> int:
        """End episodes idle for longer than the TTL; returns how many."""
        cutoff = time.monotonic() - self.idle_ttl_s
        stale = [eid for eid, live in self.episodes.items() if live.last_used < cutoff and not live.lock.locked()]
        for episode_id in stale:
            del self.episodes[episode_id]
            log.info("episode expired", extra={"env": self.runtime.env_id, "episode": episode_id})
        self.expired += len(stale)
        return len(stale)

    async def call_tool(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome:
        """Run one tool; always returns an outcome, never raises for tool trouble."""
        async with live.lock:
            if live.stuck:
                message = "This episode is unusable: an earlier tool call is still stuck. It must be reset or ended."
                return ToolOutcome(name=name, arguments=arguments if isinstance(arguments, dict) else {}, error=message, error_kind="timeout")
            episode = live.episode
            outcome = self._call_inline(live, name, arguments)
            if outcome is None:
                try:
                    outcome = await self.runner.run(
                        lambda: episode.call(name, arguments, track_diff=True), self.runtime.call_timeout_s + _ABANDON_GRACE_S
                    )
                except CallAbandoned:
                    live.stuck = True
                    self.stuck_calls += 1
                    message = f"Tool {name!r} ran longer than {self.runtime.call_timeout_s:g} s and was abandoned"
                    outcome = ToolOutcome(
                        name=name, arguments=arguments if isinstance(arguments, dict) else {}, error=message, error_kind="timeout"
                    )
            live.calls.append(outcome)
            live.last_used = time.monotonic()
        if outcome.error:
            level = logging.INFO if outcome.error_kind == "agent" else logging.WARNING
            log.log(
                level,
                "tool error",
                extra={"env": self.runtime.env_id, "episode": live.episode_id, "tool": name, "kind": outcome.error_kind, "error": outcome.error},
            )
        return outcome

    def _call_inline(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome | None:
        """The call run here on the event loop within the budget, or None: run it on the worker."""
        episode = live.episode
        if not self.inline_budget_s or name in self.threaded_tools or not episode.restorable or not can_preempt():
            return None
        try:
            return episode.call(name, arguments, track_diff=True, inline_budget_s=self.inline_budget_s)
        except Preempted:
            if episode.restorable:  # it outran the budget (rather than: its state cannot be saved)
                self.threaded_tools.add(name)
                log.info(
                    "tool moved to the worker thread",
                    extra={"env": self.runtime.env_id, "episode": live.episode_id, "tool": name, "budget_s": self.inline_budget_s},
                )
            return None

    async def validate(self, live: LiveEpisode, checklist: list[CheckItem] | None) -> ValidationResult:
        """Run the checklist (the scenario's unless one is given) off the event loop.

        Raises ChecklistError when there is no checklist, CallAbandoned when the checks as a whole
        outlive their limits (each check is stopped at its own limit first).
        """
        items = checklist if checklist is not None else (live.scenario.checklist_with_func if live.scenario else None)
        limit = len(items or ()) * (self.runtime.check_timeout_s + _ABANDON_GRACE_S) + _ABANDON_GRACE_S
        async with live.lock:
            episode = live.episode
            return await self.runner.run(lambda: episode.validate(items), limit)
