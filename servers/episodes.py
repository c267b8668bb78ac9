"""Live episodes of one environment: creation, limits, idle expiry, guarded tool calls, records.

A tool call first runs right on the event loop with a small budget (``inline_budget_s``): almost
every call of a synthesized environment takes microseconds, and handing each one to another thread
costs more than the call (two thread wake-ups across CPUs). A call that outruns the budget is
preempted, what it changed undone (``Episode.call``), and it runs again on a worker thread
(``servers.calls``) where it can take its full limit without stalling anyone; its tool goes to the
worker directly from then on. Constructors and checks always run on the worker; an episode of a
scenario whose state is already built shares that state and is created right here.

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

from envscaler import Bundle, EnvCodeError, EnvRuntime, Episode, Scenario, ToolOutcome, ValidationResult
from envscaler.guard import Preempted, can_preempt
from envscaler.models import CheckItem
from envscaler.wire import Trajectory
from servers.asgi import json_bytes
from servers.calls import CallRunner
from servers.episode_ids import new_episode_id
from servers.errors import CallAbandoned, LimitReached, OutOfMemory, UnknownEpisode, UnknownScenario
from servers.memory import memory_status

log = logging.getLogger("envscaler.server")

# Grace period past the limit (the guard in the call stops it then) before the server stops waiting.
_ABANDON_GRACE_S = 0.5


class LiveEpisode:
    """One episode with its scenario, lock, counters and call record."""

    def __init__(self, episode_id: str, episode: Episode, scenario: Scenario | None, init_config: dict[str, Any] | None) -> None:
        self.episode_id = episode_id
        self.episode = episode
        self.scenario = scenario
        # A raw episode's state (no scenario): what a reset with no body goes back to.
        self.init_config = init_config
        self.lock = asyncio.Lock()
        self.calls: list[ToolOutcome] = []
        self.last_used = time.monotonic()
        self.stuck = False
        # Characters of results and arguments the trajectory holds (capped: ``keep``).
        self.kept_chars = 0

    def keep(self, outcome: ToolOutcome, limit_chars: int) -> None:
        """Add ``outcome`` to the trajectory; past ``limit_chars`` in all, its result is kept cut (``truncated``)."""
        text = outcome.result_text if outcome.result_text is not None else ""
        size = len(text) + len(outcome.error or "") + len(json_bytes(outcome.arguments))
        left = limit_chars - self.kept_chars
        if size > left and text:
            cut = text[: max(left - (size - len(text)), 0)]
            outcome = outcome.model_copy(update={"result": cut, "result_text": cut, "truncated": True,
                                                 "result_chars": outcome.result_chars or len(text)})
            size -= len(text) - len(cut)
        self.kept_chars += size
        self.calls.append(outcome)

    def reset(self, episode: Episode, scenario: Scenario | None, init_config: dict[str, Any] | None) -> None:
        self.episode.close()
        self.episode = episode
        self.scenario = scenario
        self.init_config = init_config
        self.calls = []
        self.kept_chars = 0
        self.stuck = False
        self.last_used = time.monotonic()

    def counts(self) -> dict[str, int]:
        """Errors by who is to blame: the agent, the environment code, or a hang."""
        kinds = [c.error_kind for c in self.calls]
        return {
            "agent_errors": kinds.count("agent"),
            "env_errors": kinds.count("env"),
            "timeouts": kinds.count("timeout"),
            "tool_errors": kinds.count("tool"),
        }

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
        memory_reserve_mb: float = 0.0,
        replica_id: str | None = None,
        max_trajectory_chars: int = 16_000_000,
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
        self.memory_reserve_mb = memory_reserve_mb
        self.max_trajectory_chars = max_trajectory_chars
        # Tools that once outran the inline budget: they go to the worker thread directly.
        self.threaded_tools: set[str] = set()
        self.stuck_calls = 0
        self.expired = 0

    def _scenario(self, scenario_id: str) -> Scenario:
        scenario = self.scenarios.get(scenario_id)
        if scenario is None:
            raise UnknownScenario(f"{self.runtime.env_id} has no scenario {scenario_id!r}; 'envscaler catalog scenarios' (or GET /scenarios) lists them")
        return scenario

    async def _build(self, scenario_id: str | None, init_config: dict[str, Any] | None) -> tuple[Episode, Scenario | None]:
        """The episode, built with room to spare. Raises UnknownScenario, OutOfMemory or EnvCodeError."""
        scenario = self._scenario(scenario_id) if scenario_id else None
        self._check_memory()
        try:
            return await self._construct(scenario_id, scenario, init_config)
        except MemoryError:
            raise OutOfMemory(f"{self.runtime.env_id}: ran out of memory building the episode; {self._memory_advice()}") from None

    def _check_memory(self) -> None:
        if not self.memory_reserve_mb:
            return
        status = memory_status()
        if status.headroom_mb is not None and status.headroom_mb < self.memory_reserve_mb:
            raise OutOfMemory(
                f"{self.runtime.env_id}: only {status.headroom_mb:.0f} MB of memory left under the {status.limited_by} limit of "
                f"{status.limit_mb:.0f} MB (the server keeps {self.memory_reserve_mb:g} MB in reserve); {self._memory_advice()}"
            )

    def _memory_advice(self) -> str:
        return f"{len(self.episodes)} episodes are live: end some (DELETE /episodes/{{id}}) or give the server more memory"

    async def _construct(self, scenario_id: str | None, scenario: Scenario | None, init_config: dict[str, Any] | None) -> tuple[Episode, Scenario | None]:
        config = scenario.init_config if scenario else (init_config or {})
        if scenario_id is not None and self.runtime.shares(scenario_id):
            return self.runtime.new_episode(config, scenario_key=scenario_id), scenario  # runs no env code
        limit = self.runtime.call_timeout_s + _ABANDON_GRACE_S
        try:
            return await self.runner.run(lambda: self.runtime.new_episode(config, scenario_key=scenario_id), limit), scenario
        except CallAbandoned:
            raise EnvCodeError(f"{self.runtime.env_id}: constructor ran longer than {self.runtime.call_timeout_s:g} s") from None

    async def create(self, scenario_id: str | None, init_config: dict[str, Any] | None) -> LiveEpisode:
        """A new episode. Raises LimitReached, UnknownScenario or EnvCodeError."""
        self._check_room()
        episode, scenario = await self._build(scenario_id, init_config)
        self._check_room()  # others may have been created while this one was built
        live = LiveEpisode(new_episode_id(self.replica_id), episode, scenario, None if scenario else (init_config or {}))
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
            live.reset(episode, scenario, None if scenario else (init_config or {}))
        log.info("episode reset", extra={"env": self.runtime.env_id, "episode": live.episode_id, "scenario": scenario_id})

    def end(self, episode_id: str) -> LiveEpisode:
        live = self.episodes.pop(episode_id, None)
        if live is None:
            raise UnknownEpisode(f"no live episode {episode_id!r} (ended, expired, or never created)")
        live.episode.close()
        log.info("episode ended", extra={"env": self.runtime.env_id, "episode": episode_id, "calls": len(live.calls)})
        return live

    def expire_idle(self) -> int:
        """End episodes idle for longer than the TTL; returns how many."""
        cutoff = time.monotonic() - self.idle_ttl_s
        stale = [eid for eid, live in self.episodes.items() if live.last_used < cutoff and not live.lock.locked()]
        for episode_id in stale:
            self.episodes.pop(episode_id).episode.close()
            log.info("episode expired", extra={"env": self.runtime.env_id, "episode": episode_id})
        self.expired += len(stale)
        return len(stale)

    async def call_tool(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome:
        """Run one tool; always returns an outcome, never raises for tool trouble."""
        async with live.lock:
            if live.stuck:
                message = "This episode is unusable: an earlier tool call is still stuck. It must be reset or ended."
                return ToolOutcome.failure(name, arguments, "timeout", message)
            episode = live.episode
            outcome = self._call_inline(live, name, arguments)
            if outcome is None:
                try:
                    outcome = await self.runner.run(
                        lambda: episode.call(name, arguments), self.runtime.call_timeout_s + _ABANDON_GRACE_S
                    )
                except CallAbandoned:
                    live.stuck = True
                    self.stuck_calls += 1
                    message = f"Tool {name!r} ran longer than {self.runtime.call_timeout_s:g} s and was abandoned"
                    outcome = ToolOutcome.failure(name, arguments, "timeout", message)
            live.keep(outcome, self.max_trajectory_chars)
            live.last_used = time.monotonic()
        if outcome.error:
            level = logging.INFO if outcome.error_kind in ("agent", "tool") else logging.WARNING
            log.log(
                level,
                "tool error",
                extra={"env": self.runtime.env_id, "episode": live.episode_id, "tool": name, "kind": outcome.error_kind, "error": outcome.error},
            )
        return outcome

    def _call_inline(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome | None:
        """The call run here on the event loop within the budget, or None: run it on the worker."""
        episode = live.episode
        if not self.inline_budget_s or name in self.threaded_tools or not episode.preemptible or not can_preempt():
            return None
        try:
            return episode.call(name, arguments, inline_budget_s=self.inline_budget_s)
        except Preempted:
            if episode.preemptible:  # it outran the budget (rather than: its state cannot be shared)
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
