"""Live episodes of one environment: creation, limits, idle expiry, guarded tool calls, records.

A tool call first runs right on the event loop with a small budget (``inline_budget_s``): almost
every call of a synthesized environment takes microseconds, and handing each one to another thread
costs more than the call (two thread wake-ups across CPUs). A call that outruns the budget is
preempted, what it changed undone (``Episode.call``), and it runs again on a call thread
(``servers.episodes.calls``) where it can take its full limit without stalling anyone; its tool goes to the
call thread directly for a while (``THREADED_RETRY_S``, longer each time it is still slow), then is
tried inline again: one call slowed down by a busy machine does not cost a tool its speed for good.
Constructors and checks always run on a call thread; an episode of a scenario whose state is
already built shares that state and is created right here.

Calls on one episode take turns at its gate (``servers.episodes.gate``); environment state is not
thread-safe, so here they run one at a time (a worker's store sends them on in turn). A call still
running past its limit is abandoned: the agent gets an ``is_error`` result at once, and the episode
refuses further calls until it is reset or ended, because the stuck call may still change its state.

The gates are asyncio's, not anyio's: the server only runs on asyncio, and anyio's checkpoints
cost ~25 us on every tool call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from envscaler import Bundle, EnvCodeError, EnvRuntime, Episode, Scenario, ToolOutcome, ValidationResult
from envscaler.errors import ChecklistError, EnvScalerError
from envscaler.guard import Preempted, can_preempt
from envscaler.models import CheckContext, CheckItem, CheckResult, ToolAnnotations, ToolSchema, Turn
from envscaler.turns import of_turn, unreached, validation
from envscaler.wire import MemoryStatus, Trajectory, TurnEnded, WorkerResources
from servers.transport.asgi import find_bad_number, json_bytes
from servers.episodes.calls import QUEUE_WAIT_S, CallRunner
from servers.episodes.gate import EpisodeGate
from servers.episodes.ids import new_episode_id, replica_of
from servers.errors import (
    CallAbandoned,
    EpisodeLost,
    LimitReached,
    NoTurnLeft,
    OutOfMemory,
    Overloaded,
    UnknownEpisode,
    UnknownScenario,
)
from servers.memory import memory_status

log = logging.getLogger("envscaler.server")

T = TypeVar("T")

# Grace period past the limit (the guard in the call stops it then) before the server stops waiting.
ABANDON_GRACE_S = 0.5
# A tool that outran the inline budget runs on a call thread for this long, then is tried inline again;
# the period doubles each time it is still too slow, up to the maximum.
THREADED_RETRY_S = 5.0
THREADED_RETRY_MAX_S = 300.0


def checks_limit_s(checklist: list[CheckItem] | None, check_timeout_s: float) -> float:
    """How long the checks of ``checklist`` may take in all before they are abandoned."""
    return len(checklist or ()) * (check_timeout_s + ABANDON_GRACE_S) + ABANDON_GRACE_S


class CallStats(BaseModel):
    """How the calls of one environment stand (``GET /info``, ``/healthz``)."""

    call_threads: int
    stuck_calls: int
    threaded_tools: list[str]
    # Why no new call could run now (``/healthz`` answers 503 with it), or None.
    capacity_problem: str | None = None
    # Memory where the episodes live, when that is not the server's own process (a worker's).
    memory: MemoryStatus | None = None
    # With a worker process (servers.workers.store): its replacements, and the episodes rebuilt or lost.
    worker_restarts: int | None = None
    episodes_rebuilt: int | None = None
    episodes_lost: int | None = None
    worker_resources: WorkerResources | None = None


class LiveEpisode:
    """One episode with its scenario, gate, counters and call record."""

    def __init__(self, episode_id: str, env_id: str, episode: Episode | None, scenario: Scenario | None,
                 init_config: dict[str, Any] | None) -> None:
        self.episode_id = episode_id
        self.env_id = env_id
        # None when the episode's state lives in a worker process (servers.workers.store).
        self.episode = episode
        self.scenario = scenario
        # A raw episode's state (no scenario): what a reset with no body goes back to.
        self.init_config = init_config
        self.gate = EpisodeGate()
        # Taken by each call of the episode asked again after a fall, in turn (servers.workers.store), once there is one.
        self.recovery: asyncio.Lock | None = None
        self.calls: list[ToolOutcome] = []
        self.last_used = time.monotonic()
        # Disuse after which it ends (``EpisodeStart.lease_s``); None: the server's idle timeout.
        self.lease_s: float | None = None
        self.stuck = False
        # Characters of results and arguments the trajectory holds (capped: ``keep``).
        self.kept_chars = 0
        # Why the episode's state is gone (its worker process was restarted), or None.
        self.lost: str | None = None
        self._start_turns()

    def _start_turns(self) -> None:
        """Back to the first scripted turn: none ended, no reply heard."""
        # The scripted turns ended so far, each with its checks' verdicts.
        self.turn_checks: list[list[CheckResult]] = []
        # Where the current turn's calls start in ``calls``.
        self.turn_start = 0
        # The agent's texts to the user in the turns ended so far.
        self.replies: list[str] = []

    @property
    def turns(self) -> list[Turn]:
        """The scenario's scripted user turns ([] for a single task)."""
        return (self.scenario.turns or []) if self.scenario else []

    def keep(self, outcome: ToolOutcome, limit_chars: int) -> None:
        """Add ``outcome`` to the trajectory; past ``limit_chars`` in all, its diff is dropped (``diff_dropped``)
        and its result kept cut (``truncated``)."""
        text = outcome.result_text if outcome.result_text is not None else ""
        diff_size = len(json_bytes(outcome.diff)) if outcome.diff else 0
        size = len(text) + len(outcome.error or "") + len(json_bytes(outcome.arguments)) + diff_size
        left = limit_chars - self.kept_chars
        if size > left and diff_size:
            outcome = outcome.model_copy(update={"diff": None, "diff_dropped": True})
            size -= diff_size
        if size > left and text:
            cut = text[: max(left - (size - len(text)), 0)]
            outcome = outcome.model_copy(update={"result": cut, "result_text": cut, "truncated": True,
                                                 "result_chars": outcome.result_chars or len(text)})
            size -= len(text) - len(cut)
        self.kept_chars += size
        self.calls.append(outcome)

    def close(self) -> None:
        """Let go of the episode's state (if it lives here)."""
        if self.episode is not None:
            self.episode.close()

    def reset(self, episode: Episode | None, scenario: Scenario | None, init_config: dict[str, Any] | None) -> None:
        self.close()
        self.episode = episode
        self.scenario = scenario
        self.init_config = init_config
        self.calls = []
        self.kept_chars = 0
        self.stuck = False
        self.lost = None
        self._start_turns()
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
            env_id=self.env_id,
            scenario_id=self.scenario.task_id if self.scenario else None,
            calls=self.calls,
            **self.counts(),
        )


def _bad_argument(arguments: Any) -> str | None:
    """The first argument holding a number JSON cannot carry, named as schema errors name it, or None."""
    if not isinstance(arguments, dict):
        return find_bad_number(arguments, "arguments")
    for key, value in arguments.items():
        if (found := find_bad_number(value, f"argument {key!r}")) is not None:
            return found
    return None


class EpisodeRegistry:
    """Every live episode of one environment, keyed by an unguessable id: ids, limits, records, logs.

    Where the environment's code runs is up to a subclass: :class:`EpisodeStore` runs it in this
    process, ``servers.workers.store.WorkerEpisodeStore`` in a worker process. They fill in the
    hooks below (building an episode, one call, the checks, letting go of a state).
    """

    pipelines = False
    """Whether concurrent calls of one episode go out without waiting for each other's answers: the
    store sends them somewhere that runs them in turn (``servers.episodes.gate``)."""

    def __init__(
        self,
        bundle: Bundle,
        *,
        max_episodes: int,
        idle_ttl_s: float,
        memory_reserve_mb: float = 0.0,
        replica_id: str | None = None,
        max_trajectory_chars: int = 16_000_000,
        records: bool = True,
    ) -> None:
        self.bundle = bundle
        self.env_id = bundle.env_id
        # Prefixes every episode id when this server is one replica of many (servers.episodes.ids).
        self.replica_id = replica_id
        self.max_episodes = max_episodes
        self.idle_ttl_s = idle_ttl_s
        self.episodes: dict[str, LiveEpisode] = {}
        # Set while any episode is held (what waits for one to expire sleeps otherwise).
        self.held = asyncio.Event()
        self.scenarios = {s.task_id: s for s in bundle.scenarios}
        self.memory_reserve_mb = memory_reserve_mb
        self.max_trajectory_chars = max_trajectory_chars
        # False in a worker process: the server in front of it keeps the trajectories and logs the calls.
        self.records = records
        self.expired = 0
        # Releases waiting for the requests under way at an ended episode's gate (``_released``).
        self._releasing: set[asyncio.Task[None]] = set()

    # -- the hooks -----------------------------------------------------------------------------

    def tool_list(self) -> list[ToolSchema]:
        """The environment's tools, in its spec's order."""
        raise NotImplementedError

    @property
    def annotations(self) -> dict[str, ToolAnnotations]:
        """Each tool's MCP hints."""
        raise NotImplementedError

    async def stats(self) -> CallStats:
        """How the calls stand: threads, stuck calls, and whether a new call could run now."""
        raise NotImplementedError

    def health_problem(self) -> str | None:
        """Why no new call could run now (``/healthz`` answers 503 with it), or None; answered at once."""
        raise NotImplementedError

    async def state(self, live: LiveEpisode) -> dict[str, Any]:
        """The episode's state as JSON-able data."""
        raise NotImplementedError

    async def state_json(self, live: LiveEpisode) -> bytes:
        """The episode's state as the JSON text of an object (what ``GET /episodes/{id}/state`` sends)."""
        return json_bytes(await self.state(live))

    async def _construct(self, episode_id: str, scenario: Scenario | None, init_config: dict[str, Any] | None) -> Episode | None:
        """Build the state of episode ``episode_id``: the Episode when it lives here, else None."""
        raise NotImplementedError

    async def _run_call(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome:
        """One tool call under its limits (the episode's gate is held)."""
        raise NotImplementedError

    async def _run_checks(self, live: LiveEpisode, checklist: list[CheckItem], context: CheckContext) -> tuple[list[CheckResult], str]:
        """The checklist (possibly empty) run on the episode's state with ``context``'s globals, and the state's
        hash (the episode's gate is held)."""
        raise NotImplementedError

    def _release(self, live: LiveEpisode) -> None:
        """Let go of an ended episode's state."""
        live.close()

    def close(self) -> None:
        """Let go of what the store holds besides its episodes (the server is stopping)."""

    # -- the episodes --------------------------------------------------------------------------

    def _scenario(self, scenario_id: str) -> Scenario:
        scenario = self.scenarios.get(scenario_id)
        if scenario is None:
            raise UnknownScenario(f"{self.env_id} has no scenario {scenario_id!r}; 'envscaler catalog scenarios' (or GET /scenarios) lists them")
        return scenario

    async def _build(self, episode_id: str, scenario_id: str | None, init_config: dict[str, Any] | None) -> tuple[Episode | None, Scenario | None]:
        """The episode, built with room to spare. Raises UnknownScenario, OutOfMemory or EnvCodeError."""
        scenario = self._scenario(scenario_id) if scenario_id else None
        self._check_memory()
        try:
            return await self._construct(episode_id, scenario, init_config), scenario
        except MemoryError:
            raise OutOfMemory(f"{self.env_id}: ran out of memory building the episode; {self._memory_advice()}") from None

    def _check_memory(self) -> None:
        if not self.memory_reserve_mb:
            return
        status = memory_status()
        if status.headroom_mb is not None and status.headroom_mb < self.memory_reserve_mb:
            raise OutOfMemory(
                f"{self.env_id}: only {status.headroom_mb:.0f} MB of memory left under the {status.limited_by} limit of "
                f"{status.limit_mb:.0f} MB (the server keeps {self.memory_reserve_mb:g} MB in reserve); {self._memory_advice()}"
            )

    def _memory_advice(self) -> str:
        return f"{len(self.episodes)} episodes are live: end some (DELETE /episodes/{{id}}) or give the server more memory"

    async def create(self, scenario_id: str | None, init_config: dict[str, Any] | None, episode_id: str | None = None) -> LiveEpisode:
        """A new episode (its id given, or a new one). Raises LimitReached, UnknownScenario or EnvCodeError."""
        self._check_room()
        episode_id = episode_id or new_episode_id(self.replica_id)
        episode, scenario = await self._build(episode_id, scenario_id, init_config)
        live = LiveEpisode(episode_id, self.env_id, episode, scenario, None if scenario else (init_config or {}))
        if self._held_count() >= self.max_episodes:  # others may have been created while this one was built
            self._release(live)
            self._check_room()
        self.episodes[live.episode_id] = live
        self.held.set()
        log.info("episode created", extra={"env": self.env_id, "episode": live.episode_id, "scenario": scenario_id})
        return live

    def _check_room(self) -> None:
        if self._held_count() >= self.max_episodes:
            raise LimitReached(
                f"{self.env_id} already holds {self.max_episodes} live episodes (or ended ones whose calls still run); "
                "end some (DELETE) or raise --max-episodes"
            )

    def _held_count(self) -> int:
        """The episodes whose state is held: the live ones, and the ended ones whose calls still run (``_released``)."""
        return len(self.episodes) + len(self._releasing)

    def get(self, episode_id: str) -> LiveEpisode:
        live = self.episodes.get(episode_id)
        if live is None:
            raise self._missing(episode_id)
        live.last_used = time.monotonic()
        return live

    def _missing(self, episode_id: str) -> EnvScalerError:
        """Why ``episode_id`` is not here: held by an earlier server of this environment (another replica id:
        this one replaced it, and its state went with it), or simply not live."""
        holder = replica_of(episode_id)
        if holder is not None and self.replica_id is not None and holder != self.replica_id:
            return EpisodeLost(f"episode {episode_id!r} was held by replica {holder} of {self.env_id}, which is gone (its server "
                               f"was restarted, here or on another node): its state is lost and it cannot be scored; create a new episode")
        return UnknownEpisode(f"no live episode {episode_id!r} (ended, expired, or never created)")

    async def reset(self, live: LiveEpisode, scenario_id: str | None, init_config: dict[str, Any] | None) -> None:
        """Put ``live`` back to a scenario's (or a raw) initial state; its id and URL stay."""
        episode, scenario = await self._build(live.episode_id, scenario_id, init_config)
        async with live.gate.alone():
            if self.episodes.get(live.episode_id) is not live:
                # It ended while its new state was built: that state goes too.
                self._release(LiveEpisode(live.episode_id, self.env_id, episode, scenario, init_config))
                self._check_live(live)
            live.reset(episode, scenario, None if scenario else (init_config or {}))
        log.info("episode reset", extra={"env": self.env_id, "episode": live.episode_id, "scenario": scenario_id})

    def end(self, episode_id: str) -> LiveEpisode:
        live = self.episodes.pop(episode_id, None)
        if live is None:
            raise self._missing(episode_id)
        self._released(live)
        log.info("episode ended", extra={"env": self.env_id, "episode": episode_id, "calls": len(live.calls)})
        return live

    def _released(self, live: LiveEpisode) -> None:
        """Release ``live``, taken out of :attr:`episodes`: at once, or once the requests under way at its
        gate have ended, so that no running call has its state pulled from under it (the requests still
        waiting are told it ended: ``_check_live``)."""
        if live.gate.busy():
            release = asyncio.get_running_loop().create_task(self._release_when_free(live))
            self._releasing.add(release)
            release.add_done_callback(self._releasing.discard)
        else:
            self._release(live)
        if not self.episodes:
            self.held.clear()

    async def _release_when_free(self, live: LiveEpisode) -> None:
        async with live.gate.alone():
            self._release(live)

    def expire_idle(self) -> int:
        """End episodes idle for longer than their lease (else the TTL); returns how many."""
        now = time.monotonic()
        stale = [eid for eid, live in self.episodes.items()
                 if live.last_used < now - min(live.lease_s or self.idle_ttl_s, self.idle_ttl_s) and not live.gate.busy()]
        for episode_id in stale:
            self._released(self.episodes.pop(episode_id))
            log.info("episode expired", extra={"env": self.env_id, "episode": episode_id})
        self.expired += len(stale)
        return len(stale)

    async def call_tool(
        self, live: LiveEpisode, name: str, arguments: Any, *, check_numbers: bool = False, trace: tuple[str, str | None] | None = None,
    ) -> ToolOutcome:
        """Run one tool; always returns an outcome, never raises for tool trouble.

        ``check_numbers``: the arguments may hold numbers JSON cannot carry (``asgi.BadNumber``, a float
        that is not finite). A call with one is the agent's error, recorded, and runs nothing: passed on,
        the number would reach the tool and the record as null or as invalid JSON.
        ``trace``: the request's (traceparent, tracestate), kept in the call's record.
        """
        bad_number = _bad_argument(arguments) if check_numbers else None
        async with live.gate.call(self.pipelines):
            self._check_live(live)
            if live.stuck:
                message = "This episode is unusable: an earlier tool call is still stuck. It must be reset or ended."
                return ToolOutcome.failure(name, arguments, "timeout", message)
            if bad_number is not None:
                outcome = ToolOutcome.failure(name, arguments, "agent", f"Invalid arguments for {name!r}: {bad_number}")
            elif live.lost is not None:  # recorded: the agent was answered
                outcome = ToolOutcome.failure(name, arguments, "env", f"This episode is lost ({live.lost}). It must be reset or ended.")
            else:
                try:
                    outcome = await self._run_call(live, name, arguments)
                except Overloaded as e:
                    if not self.records:
                        raise  # a worker process: the server in front of it answers the agent
                    # Nothing ran: the agent is told so, and a rebuild of the episode has nothing of it to replay.
                    outcome = ToolOutcome.failure(name, arguments, "env", f"{self.env_id}: {e}")
            if trace is not None:
                outcome.traceparent, outcome.tracestate = trace
            self._called(live, name, outcome)
        return outcome

    def _called(self, live: LiveEpisode, name: str, outcome: ToolOutcome) -> None:
        """Record and log a finished call (a worker process does neither: the server in front of it does)."""
        live.last_used = time.monotonic()
        if not self.records:
            return
        live.keep(outcome, self.max_trajectory_chars)
        if outcome.error:
            level = logging.INFO if outcome.error_kind in ("agent", "tool") else logging.WARNING
            log.log(
                level,
                "tool error",
                extra={"env": self.env_id, "episode": live.episode_id, "tool": name, "kind": outcome.error_kind, "error": outcome.error},
            )

    async def validate(self, live: LiveEpisode, checklist: list[CheckItem] | None, agent_replies: list[str] | None = None) -> ValidationResult:
        """Run the checklist (the scenario's unless one is given) off the event loop.

        ``agent_replies``: the agent's texts to the user since the last turn ended. In a scenario with
        scripted turns, the score covers every turn's checks: those of the turns ended, the current
        turn's on the state now, and the turns never reached as failed; then the scenario's final checks.
        Raises EpisodeLost when the episode's state is gone, ChecklistError when there is no
        checklist, CallAbandoned when the checks as a whole outlive their limits (each check is
        stopped at its own limit first).
        """
        replies = list(agent_replies or [])
        async with live.gate.alone():
            self._check_usable(live)
            if checklist is not None or not live.turns:
                items = checklist if checklist is not None else (live.scenario.checklist_with_func if live.scenario else None)
                if not items:
                    raise ChecklistError("the scenario has no checklist, so it cannot be scored")
                return validation(*await self._run_checks(live, items, CheckContext.of_calls(live.calls, replies)))
            turns = live.turns
            results = [check for ended in live.turn_checks for check in ended]
            current = len(live.turn_checks)
            if current < len(turns):
                results += await self._turn_checks(live, current, replies)
                for later in range(current + 1, len(turns)):
                    results += unreached(turns[later].checklist_with_func, later + 1, len(turns), current)
            assert live.scenario is not None
            final, state_hash = await self._run_checks(live, live.scenario.checklist_with_func or [],
                                                       CheckContext.of_calls(live.calls, live.replies + replies))
            return validation(results + final, state_hash)

    async def end_turn(self, live: LiveEpisode, agent_replies: list[str]) -> TurnEnded:
        """End the episode's current scripted turn: run its checks on the state now, with its calls as
        ``turn_results``, and move to the next turn. Raises NoTurnLeft when the scenario has no turns or
        all have ended, EpisodeLost, CallAbandoned as :meth:`validate`."""
        turns = live.turns
        async with live.gate.alone():
            self._check_usable(live)
            current = len(live.turn_checks)
            scenario = f"scenario {live.scenario.task_id}" if live.scenario else "a raw episode"
            if not turns:
                raise NoTurnLeft(f"{scenario} of {self.env_id} has no scripted user turns: there is no turn to end; "
                                 "validate the episode instead")
            if current >= len(turns):
                raise NoTurnLeft(f"all {len(turns)} turns of {scenario} of {self.env_id} have ended: no user message is left; "
                                 "validate the episode (POST /episodes/{id}/validate) or reset it")
            checks = await self._turn_checks(live, current, agent_replies)
            calls = len(live.calls) - live.turn_start
            live.turn_checks.append(checks)
            live.replies += agent_replies
            live.turn_start = len(live.calls)
        next_message = turns[current + 1].message if current + 1 < len(turns) else None
        passed = [c.passed for c in checks]
        log.info("turn ended", extra={"env": self.env_id, "episode": live.episode_id, "turn": current + 1, "checks": len(checks)})
        return TurnEnded(episode_id=live.episode_id, turn=current + 1, score=sum(passed) / len(passed) if passed else None,
                         checks=checks, next_message=next_message, turns_left=len(turns) - current - 1, calls=calls)

    async def _turn_checks(self, live: LiveEpisode, index: int, agent_replies: list[str]) -> list[CheckResult]:
        """The checks of turn ``index`` (from 0) on the state now, over the calls since the turn started."""
        checklist = live.turns[index].checklist_with_func
        if not checklist:
            return []
        checks, _ = await self._run_checks(live, checklist, CheckContext.of_calls(live.calls[live.turn_start:], agent_replies))
        return of_turn(checks, index + 1)

    def _check_live(self, live: LiveEpisode) -> None:
        """Raise UnknownEpisode when ``live`` ended (a DELETE, an expiry) while this request waited for its turn."""
        if self.episodes.get(live.episode_id) is not live:
            raise UnknownEpisode(f"episode {live.episode_id} of {self.env_id} ended while this request waited for its turn")

    def _check_usable(self, live: LiveEpisode) -> None:
        self._check_live(live)
        if live.lost is not None:
            raise EpisodeLost(f"episode {live.episode_id} is lost ({live.lost}); reset it to run its scenario again")


class EpisodeStore(EpisodeRegistry):
    """Episodes whose environment code runs in this process, inline or on call threads."""

    def __init__(self, bundle: Bundle, runtime: EnvRuntime, *, worker_threads: int, inline_budget_s: float,
                 queue_wait_s: float = QUEUE_WAIT_S, **limits: Any) -> None:
        super().__init__(bundle, **limits)
        self.runtime = runtime
        self.runner = CallRunner(f"env-{runtime.env_id}", max_threads=worker_threads, wait_s=queue_wait_s)
        self.inline_budget_s = inline_budget_s
        # Tools that outran the inline budget: they go to a call thread directly until then (time.monotonic()).
        self._threaded_until: dict[str, float] = {}
        # How long each such tool stays there before it is tried inline again: doubled while it stays slow.
        self._threaded_for: dict[str, float] = {}
        self.stuck_calls = 0

    def tool_list(self) -> list[ToolSchema]:
        return self.runtime.tool_list()

    @property
    def annotations(self) -> dict[str, ToolAnnotations]:
        return self.runtime.annotations

    async def stats(self) -> CallStats:
        return CallStats(call_threads=self.runner.threads, stuck_calls=self.stuck_calls, threaded_tools=self.threaded_tools(),
                         capacity_problem=self.health_problem())

    def health_problem(self) -> str | None:
        if not self.runner.exhausted:
            return None
        if self.runner.start_error is not None:
            return f"no call capacity: no call thread can be started ({self.runner.start_error})"
        return f"no call capacity: all {self.runner.max_threads} call threads are stuck"

    def threaded_tools(self) -> list[str]:
        """The tools that run on a call thread for now, having outrun the inline budget."""
        now = time.monotonic()
        return sorted(name for name, until in self._threaded_until.items() if until > now)

    async def state(self, live: LiveEpisode) -> dict[str, Any]:
        assert live.episode is not None
        return live.episode.state()

    async def _construct(self, episode_id: str, scenario: Scenario | None, init_config: dict[str, Any] | None) -> Episode:
        config = scenario.init_config if scenario else (init_config or {})
        key = scenario.task_id if scenario else None
        if key is not None and self.runtime.shares(key):
            return self.runtime.new_episode(config, scenario_key=key)  # runs no env code
        limit = self.runtime.call_timeout_s + ABANDON_GRACE_S
        try:
            return await self.runner.run(self._on_thread(episode_id, lambda: self.runtime.new_episode(config, scenario_key=key)), limit)
        except CallAbandoned:
            raise EnvCodeError(f"{self.env_id}: constructor ran longer than {self.runtime.call_timeout_s:g} s") from None

    async def _run_call(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome:
        episode = live.episode
        assert episode is not None
        outcome = self._call_inline(live, name, arguments)
        if outcome is not None:
            return outcome
        try:
            return await self.runner.run(self._on_thread(live.episode_id, lambda: episode.call(name, arguments)),
                                         self.runtime.call_timeout_s + ABANDON_GRACE_S)
        except CallAbandoned:
            live.stuck = True
            self.stuck_calls += 1
            return ToolOutcome.failure(name, arguments, "timeout", f"Tool {name!r} ran longer than {self.runtime.call_timeout_s:g} s and was abandoned")

    def call_now(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome | None:
        """The call run to its end right here, without waiting, when it can be: the episode is free and
        the call ends within the inline budget. Else None, and the caller awaits :meth:`call_tool`."""
        if live.gate.busy() or live.stuck or live.lost is not None:
            return None
        outcome = self._call_inline(live, name, arguments)
        if outcome is not None:
            self._called(live, name, outcome)
        return outcome

    def _call_inline(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome | None:
        """The call run here on the event loop within the budget, or None: run it on the worker."""
        episode = live.episode
        assert episode is not None
        if not self.inline_budget_s or not episode.preemptible or not can_preempt():
            return None
        until = self._threaded_until.get(name)
        if until is not None and until > time.monotonic():
            return None
        try:
            outcome = episode.call(name, arguments, inline_budget_s=self.inline_budget_s, check_shared=not self.runner.busy)
        except Preempted:
            if episode.preemptible:  # it outran the budget (rather than: its state cannot be shared)
                self._thread_for_now(live, name)
            return None
        if until is not None:  # fast again: a busy machine, a first call that warmed a cache
            del self._threaded_until[name]
            self._threaded_for.pop(name, None)
        return outcome

    def _thread_for_now(self, live: LiveEpisode, name: str) -> None:
        """Send ``name`` to a call thread for a while. One slow call (the machine was busy) must not cost
        the tool its inline speed for good, so it is tried inline again later, later each time it stays slow."""
        period = min(self._threaded_for.get(name, THREADED_RETRY_S / 2) * 2, THREADED_RETRY_MAX_S)
        self._threaded_for[name] = period
        self._threaded_until[name] = time.monotonic() + period
        log.info(
            "tool moved to a call thread",
            extra={"env": self.env_id, "episode": live.episode_id, "tool": name, "budget_s": self.inline_budget_s, "for_s": period},
        )

    async def _run_checks(self, live: LiveEpisode, checklist: list[CheckItem], context: CheckContext) -> tuple[list[CheckResult], str]:
        episode = live.episode
        assert episode is not None
        if not checklist:
            return [], episode.state_hash()
        result = await self.runner.run(self._on_thread(live.episode_id, lambda: episode.validate(checklist, context)),
                                       checks_limit_s(checklist, self.runtime.check_timeout_s))
        return result.checks, result.state_hash

    def _on_thread(self, episode_id: str, work: Callable[[], T]) -> Callable[[], T]:
        """What a call thread runs of episode ``episode_id``'s ``work``: the work itself (a worker process
        wraps it to say, while it runs, whose code its thread runs)."""
        return work
