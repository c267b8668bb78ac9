"""Live episodes of one environment: creation, limits, idle expiry, guarded tool calls, records.

Tool calls run on worker threads so that a call which blocks (``time.sleep`` in environment code)
never stalls the event loop. Calls on one episode are serialised by its lock; environment state is
not thread-safe. A call that is still running past its limit is abandoned: the agent gets an
``is_error`` result at once, and the episode refuses further calls until it is reset or ended,
because the stuck call may still change its state.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel

from envscaler import Bundle, EnvRuntime, Episode, EnvScalerError, Scenario, ToolOutcome, ValidationResult
from envscaler.models import CheckItem

log = logging.getLogger("envscaler.server")

T = TypeVar("T")

# Grace period past the call limit before the server stops waiting for a worker thread.
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
        self.lock = anyio.Lock()
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
    ) -> None:
        self.bundle = bundle
        self.runtime = runtime
        self.max_episodes = max_episodes
        self.idle_ttl_s = idle_ttl_s
        self.episodes: dict[str, LiveEpisode] = {}
        self.scenarios = {s.task_id: s for s in bundle.scenarios}
        # A plain executor rather than anyio.to_thread: it costs ~25 us less per hop, paid on every call.
        self.executor = ThreadPoolExecutor(worker_threads, thread_name_prefix=f"env-{runtime.env_id}")
        self.stuck_calls = 0
        self.expired = 0

    def _scenario(self, scenario_id: str) -> Scenario:
        scenario = self.scenarios.get(scenario_id)
        if scenario is None:
            raise UnknownScenario(f"{self.runtime.env_id} has no scenario {scenario_id!r}; GET /scenarios lists them")
        return scenario

    def _build(self, scenario_id: str | None, init_config: dict[str, Any] | None) -> tuple[Episode, Scenario | None]:
        scenario = self._scenario(scenario_id) if scenario_id else None
        config = scenario.init_config if scenario else (init_config or {})
        return self.runtime.new_episode(config), scenario

    def create(self, scenario_id: str | None, init_config: dict[str, Any] | None) -> LiveEpisode:
        """A new episode. Raises LimitReached, UnknownScenario or EnvCodeError."""
        if len(self.episodes) >= self.max_episodes:
            raise LimitReached(
                f"{self.runtime.env_id} already holds {self.max_episodes} live episodes; end some (DELETE) or raise --max-episodes"
            )
        episode, scenario = self._build(scenario_id, init_config)
        live = LiveEpisode(secrets.token_urlsafe(24), episode, scenario)
        self.episodes[live.episode_id] = live
        log.info("episode created", extra={"env": self.runtime.env_id, "episode": live.episode_id, "scenario": scenario_id})
        return live

    def get(self, episode_id: str) -> LiveEpisode:
        live = self.episodes.get(episode_id)
        if live is None:
            raise UnknownEpisode(f"no live episode {episode_id!r} (ended, expired, or never created)")
        live.last_used = time.monotonic()
        return live

    def reset(self, live: LiveEpisode, scenario_id: str | None, init_config: dict[str, Any] | None) -> None:
        episode, scenario = self._build(scenario_id, init_config)
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
        """Run one tool on a worker thread; always returns an outcome, never raises for tool trouble."""
        async with live.lock:
            if live.stuck:
                message = "This episode is unusable: an earlier tool call is still stuck. It must be reset or ended."
                return ToolOutcome(name=name, arguments=arguments if isinstance(arguments, dict) else {}, error=message, error_kind="timeout")
            episode = live.episode
            limit = self.runtime.call_timeout_s + _ABANDON_GRACE_S
            outcome: ToolOutcome | None = None
            with anyio.move_on_after(limit):
                outcome = await self._in_worker(lambda: episode.call(name, arguments, track_diff=True))
            if outcome is None:
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

    async def validate(self, live: LiveEpisode, checklist: list[CheckItem] | None) -> ValidationResult:
        """Run the checklist (the scenario's unless one is given) on a worker thread."""
        items = checklist if checklist is not None else (live.scenario.checklist_with_func if live.scenario else None)
        async with live.lock:
            episode = live.episode
            return await self._in_worker(lambda: episode.validate(items))

    async def _in_worker(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on a worker thread. Cancelling the wait abandons the thread, it is not stopped."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
