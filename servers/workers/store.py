"""Episodes whose environment code runs in a worker process that the server kills when it must.

The server keeps what has to outlive the environment's code: the HTTP and MCP surface, the token, the
episode ids and their trajectories. The environment's code (loading, constructors, tool calls, and
the JSON of what they return) runs in a worker process (``servers.workers.env_worker``) that a
:class:`servers.workers.process.WorkerProcess` starts, watches and replaces. The checks run in a
second one (``servers.workers.check_worker``) that environment code never reaches, on what the environment
worker says the episode changed since its scenario's initial state: a call cannot patch the checker
and so decide its own reward. That worker runs each validation's checks in a process of their own,
so that a check cannot decide another validation's reward either.

Neither worker ever sees an episode's id, the key to its MCP endpoint: environment code could find
every id in its process and hand it to an agent. Each episode gets a handle here that names it to
the workers alone (no route accepts one); the server maps it back, and its logs and errors name the
episode by its id. Nor do the descriptions of requests name it, since the reason of a worker's fall
reaches the errors of every episode caught up in it.

When a worker is killed (it froze past a deadline, or a call outlived its limit on a thread that
could not be stopped) or dies, nothing else is lost: each episode it held is rebuilt in the new
worker, the next time it is used, by building its scenario again and replaying its calls, each of
which must give the digest it gave the first time. The call that brought the worker down gets an
error and is undone (it is not replayed); a call that was only caught up in the fall is run again
once the episode is rebuilt. An episode is reported lost (its calls say so, its validation answers
410, never a score) only when it cannot be rebuilt: a replayed call comes out differently (the
environment is not deterministic), or a call of it ran past its limit (what it did is unknown).

Concurrent calls of one episode go out to the worker together (``servers.episodes.gate``), which runs
them one at a time and answers each as it ends: the record, and the calls a rebuild replays, keep them
in the order their answers come, which is the order they ran. A call that reaches the worker while the
episode is being rebuilt there waits for the rebuild. When the worker falls with several of one
episode's calls out, they are asked again one at a time, the first in its turn (the others give theirs
up: each would wait for the other), and no new call of the episode goes out until they have ended.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from envscaler import Bundle, EnvCodeError, Episode, Scenario, ToolOutcome
from envscaler.cgroups import ChildGroup, GroupLimits, combined
from envscaler.data_files import data_folders, data_megabytes
from envscaler.models import CheckContext, CheckItem, CheckResult, ToolAnnotations, ToolSchema
from envscaler.sandbox import CHILD_TASKS
from envscaler.wire import WorkerResources
from servers.memory import memory_status
from servers.episodes.store import ABANDON_GRACE_S, CallStats, EpisodeRegistry, LiveEpisode, checks_limit_s
from servers.errors import CallAbandoned, EpisodeLost, OutOfMemory, Overloaded, UnknownEpisode
from servers.workers.checks import CHECK_IDLE_S, START_S_PER_DATA_MB, CheckWorker
from servers.workers.process import CAUGHT_UP_TRIES, START_TIMEOUT_S, Turn, WorkerGone, WorkerProcess
from servers.workers.wire import (
    CheckRequest,
    CheckResults,
    EpisodeFinal,
    RunningMarks,
    ReplayCall,
    WorkerHello,
    WorkerOutcome,
    WorkerRequest,
    WorkerSettings,
    checked_object,
    decode,
)

log = logging.getLogger("envscaler.server")

T = TypeVar("T")

ROLE = "environment worker"


class _History:
    """What it takes to build an episode again in a new worker: the calls that changed or read its state."""

    __slots__ = ("calls", "unreplayable")

    def __init__(self) -> None:
        self.calls: list[ReplayCall] = []
        # Why the episode cannot be rebuilt (a call of it ran past its limit), or None.
        self.unreplayable: str | None = None


class WorkerEpisodeStore(EpisodeRegistry):
    """Episodes whose state lives in a worker process (see the module's doc)."""

    # The worker runs one episode's calls one at a time, and answers each as it ends.
    pipelines = True

    def __init__(self, bundle: Bundle, settings: WorkerSettings, *, sandbox: bool, group: GroupLimits | None = None,
                 checks: CheckWorker | None = None, check_idle_s: float | None = CHECK_IDLE_S, **limits: Any) -> None:
        super().__init__(bundle, **limits)
        mark = RunningMarks()
        self.settings = settings = settings.model_copy(update={"mark_fd": mark.fd})
        # A control group for the environment worker, with the environment's limits: its memory, tasks and CPU share
        # counted, and a worker that fills its memory cannot starve the checks (in a group of their own).
        self.group = ChildGroup.create(group, self.env_id, "env") if sandbox and group is not None else None
        # The memory the worker may hold, when its control group counts it (else the server's own limit holds).
        self.memory_limit_mb = group.memory_mb if self.group is not None and group is not None else None
        try:
            self.worker = WorkerProcess("servers.workers.env_worker", settings, role=ROLE, on_lost=self._worker_lost, mark=mark,
                                        group=self.group, queue_wait_s=settings.queue_wait_s, sandbox=sandbox, env_id=self.env_id,
                                        tasks=group.pids if group is not None else CHILD_TASKS, readable=data_folders(bundle),
                                        start_timeout_s=START_TIMEOUT_S + START_S_PER_DATA_MB * data_megabytes(bundle))
        except OutOfMemory as e:
            self.close_groups()
            raise OutOfMemory(self._out_of_memory(None, "as it started", str(e))) from None
        # The server's check worker (one for all its environments), or one of its own.
        self.checks = checks if checks is not None else CheckWorker([(bundle, settings.check_timeout_s)], sandbox=sandbox, group=group,
                                                                    idle_s=check_idle_s)
        self.checks.joins(self.env_id)
        self._checking = asyncio.Lock()
        hello = decode(WorkerHello, self.worker.hello)
        self._tools, self._annotations = hello.tools, hello.annotations
        self._histories: dict[str, _History] = {}
        # Episode id -> the handle that names the episode to the workers.
        self._handles: dict[str, str] = {}
        self._handle_numbers = itertools.count(1)
        # Episodes whose state went with a lost worker -> why; rebuilt when next used.
        self._stale: dict[str, str] = {}
        # Episodes being rebuilt -> set once the rebuild has ended, however it ended.
        self._rebuilding: dict[str, asyncio.Event] = {}
        self.rebuilt = 0
        self.lost = 0

    # -- losing a worker, rebuilding its episodes ------------------------------------------------

    def _worker_lost(self, reason: str) -> None:
        held = [episode_id for episode_id, live in self.episodes.items() if live.lost is None and episode_id not in self._stale]
        for episode_id in held:
            self._stale[episode_id] = reason
        for live in self.episodes.values():
            live.gate.hold_joins()  # the calls that were out are asked again first, one at a time (_ask_about)
        log.error("environment worker lost; its episodes are rebuilt as they are used",
                  extra={"env": self.env_id, "reason": reason, "episodes": len(held)})

    def _out_of_memory(self, episode_id: str | None, what: str, detail: str, tool: str | None = None) -> str:
        """What to say (and log) when a worker ran out of memory: the environment, the episode, the limit, how to raise it."""
        if self.memory_limit_mb is not None:
            limit_mb: float | None = self.memory_limit_mb
            limit = (f"the limit is {self.memory_limit_mb} MB per worker: raise it with --worker-memory-mb (envscaler serve) "
                     "or --memory-mb (envscaler farm up)")
        else:
            status = memory_status()
            limit_mb = status.limit_mb
            limit = (f"the server's {status.limited_by} limit is {status.limit_mb:.0f} MB: raise it with --memory-mb (envscaler farm up)"
                     if status.limit_mb is not None else "no limit is set: the machine's memory ran out")
        episode = f": episode {episode_id}" if episode_id is not None else ""
        message = f"{self.env_id}{episode}: out of memory {what}: {detail}; {limit}"
        log.error("environment out of memory", extra={"env": self.env_id, "episode": episode_id, "tool": tool, "limit_mb": limit_mb,
                                                       "error": message})
        return message

    async def _ensure_built(self, live: LiveEpisode) -> None:
        """Rebuild ``live`` in the current worker if its state went with a lost one (the episode's gate is held);
        marks it lost when that cannot be done. A call of the episode that comes meanwhile waits for the rebuild."""
        while (rebuilding := self._rebuilding.get(live.episode_id)) is not None:
            await rebuilding.wait()
        if live.episode_id not in self._stale:
            return
        done = self._rebuilding[live.episode_id] = asyncio.Event()
        try:
            await self._rebuild(live)
        finally:
            del self._rebuilding[live.episode_id]
            done.set()

    async def _rebuild(self, live: LiveEpisode) -> None:
        turn: Turn | None = None
        for tries in range(1, CAUGHT_UP_TRIES + 1):
            async with self.worker.alone(turn):
                reason = self._stale.pop(live.episode_id, None)
                if reason is None or live.lost is not None:
                    return
                handle = self._handle(live)
                history = self._histories.setdefault(live.episode_id, _History())
                if history.unreplayable is not None:
                    self._mark_lost(live, f"{reason}; it cannot be rebuilt: {history.unreplayable}")
                    return
                request = WorkerRequest(op="replay", handle=handle, scenario_id=live.scenario.task_id if live.scenario else None,
                                        init_config=None if live.scenario else (live.init_config or {}), calls=history.calls)
                limit = (len(history.calls) + 1) * (self.settings.call_timeout_s + ABANDON_GRACE_S)
                try:
                    await self.worker.ask(request, limit, "the rebuild of an episode", handle, again=tries < CAUGHT_UP_TRIES)
                except WorkerGone as e:
                    if e.blamed:
                        self._mark_lost(live, f"{reason}; rebuilding it brought the new worker down too ({e})")
                        return
                    self._stale[live.episode_id] = reason  # it may be innocent: once more
                    turn = e.turn
                    continue
                except (EpisodeLost, EnvCodeError, UnknownEpisode) as e:
                    self._mark_lost(live, f"{reason}; it cannot be rebuilt: {e}")
                    return
                except Overloaded:
                    self._stale[live.episode_id] = reason  # not rebuilt yet: the next request tries again
                    raise
                self.rebuilt += 1
                log.info("episode rebuilt in a new environment worker",
                         extra={"env": self.env_id, "episode": live.episode_id, "calls": len(history.calls)})
                return
        self._mark_lost(live, f"{self._stale.pop(live.episode_id, 'its worker was lost')}; the workers that were to rebuild it "
                              f"were lost {CAUGHT_UP_TRIES} times in a row")

    async def _ask_about(self, request: WorkerRequest, limit_s: float, what: str, live: LiveEpisode | None = None) -> tuple[bytes, int]:
        """The worker's answer to ``request`` about one episode (``live``, once it is built).

        The episode is rebuilt first if its worker was lost. When the worker goes down and this request
        is not blamed, it may be innocent: the episode is rebuilt in the new worker and the request asked
        again, in its turn when it has one (see ``servers.workers.process``), a few times at most. Raises WorkerGone when this request is to
        blame or the tries run out, EpisodeLost when the episode cannot be rebuilt.
        """
        tries, turn = 1, None
        recovering = False
        try:
            while True:
                if tries > 1 and live is not None and not recovering:
                    turn = await self._recover(live, turn)
                    recovering = True
                async with self.worker.alone(turn):
                    if live is not None:
                        await self._ensure_usable(live)
                    try:
                        return await self.worker.ask_child(request, limit_s, what, request.handle, again=tries < CAUGHT_UP_TRIES)
                    except UnknownEpisode:
                        # The worker it was built in fell before this request went (it waited for another's turn
                        # alone): the new worker, which has not built it yet, ran nothing. Built there, ask again.
                        if live is None or live.episode_id not in self._stale or tries == CAUGHT_UP_TRIES:
                            raise
                        tries, turn = tries + 1, None
                    except WorkerGone as e:
                        if e.blamed or tries == CAUGHT_UP_TRIES:
                            raise
                        tries, turn = tries + 1, e.turn
        finally:
            if recovering:
                assert live is not None and live.recovery is not None
                live.recovery.release()

    async def _recover(self, live: LiveEpisode, turn: Turn | None) -> Turn | None:
        """Wait until this request, caught up in a fall, is the one of its episode to be asked again (the
        calls of an episode that fell together are asked again one at a time); its turn, or None when it had
        to wait for another: then it gives its turn up, which the other's turn could otherwise wait for."""
        if live.recovery is None:
            live.recovery = asyncio.Lock()
        if live.recovery.locked() and turn is not None:
            self.worker.forgo(turn)
            turn = None
        await live.recovery.acquire()
        return turn

    async def _ensure_usable(self, live: LiveEpisode) -> None:
        """Rebuild ``live`` if it must be (the episode's gate is held); raises EpisodeLost when it is lost."""
        await self._ensure_built(live)
        if live.lost is not None:
            raise EpisodeLost(f"episode {live.episode_id} is lost ({live.lost}); reset it to run its scenario again")

    async def _read(self, live: LiveEpisode, op: str, what: str, parse: Callable[[bytes], T]) -> T:
        """The worker's answer to a read of ``live`` (``op``), parsed; EnvCodeError when the worker
        goes down for this read's sake or answers what ``parse`` cannot read."""
        request = WorkerRequest(op=op, handle=self._handle(live))
        try:
            payload, _ = await self._ask_about(request, self.settings.call_timeout_s, what, live)
            return parse(payload)
        except WorkerGone as e:
            raise EnvCodeError(f"{self.env_id}: {e}") from None
        except (ValueError, RecursionError):
            raise EnvCodeError(f"{self.env_id}: the environment worker answered {what} with a malformed answer") from None

    async def _read_object(self, live: LiveEpisode, op: str, what: str) -> dict[str, Any]:
        """A read of ``live`` whose answer is a JSON object (a state)."""
        value = await self._read(live, op, what, json.loads)
        if not isinstance(value, dict):
            raise EnvCodeError(f"{self.env_id}: the environment worker answered {what} with no object")
        return value

    def _handle(self, live: LiveEpisode) -> str:
        """The worker's name for ``live``; UnknownEpisode when the episode ended while this request was under way."""
        handle = self._handles.get(live.episode_id)
        if handle is None:
            raise UnknownEpisode(f"episode {live.episode_id} of {self.env_id} ended while this request was under way")
        return handle

    def _mark_lost(self, live: LiveEpisode, reason: str) -> None:
        live.lost = reason
        self.lost += 1
        log.warning("episode lost", extra={"env": self.env_id, "episode": live.episode_id, "reason": reason})

    def _remember(self, live: LiveEpisode, name: str, arguments: Any, reply: WorkerOutcome) -> None:
        """Keep what a rebuild of the episode must replay of this call."""
        outcome = reply.outcome
        history = self._histories.get(live.episode_id)
        if history is None or outcome.error_kind == "agent":
            return  # the episode ended while the call ran, or the call was refused before any environment code ran
        if outcome.error_kind == "timeout":
            history.unreplayable = f"its call {name!r} ran past its limit, so what it did cannot be done again"
            return
        history.calls.append(ReplayCall(name=name, arguments=arguments, digest=reply.digest))

    def _lost_outcome(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome:
        return ToolOutcome.failure(name, arguments, "env", f"This episode is lost ({live.lost}). It must be reset or ended.")

    # -- the hooks -------------------------------------------------------------------------------

    def tool_list(self) -> list[ToolSchema]:
        return list(self._tools)

    @property
    def annotations(self) -> dict[str, ToolAnnotations]:
        return self._annotations

    def health_problem(self) -> str | None:
        # Not the worker's answer: a frozen worker is replaced by this server in time, and must not make a
        # farm restart the server. A stuck call replaces the worker, so its call threads never all stick.
        return self.worker.start_problem()

    async def stats(self) -> CallStats:
        try:
            stats = decode(CallStats, await self.worker.ask(WorkerRequest(op="stats"), 0.0, "a health question"))
        except (WorkerGone, EnvCodeError) as e:
            stats = CallStats(call_threads=0, stuck_calls=0, threaded_tools=[], capacity_problem=str(e))
        return stats.model_copy(update={"worker_restarts": self.worker.restarts, "episodes_rebuilt": self.rebuilt,
                                        "episodes_lost": self.lost, "worker_resources": self.resources()})

    def resources(self) -> WorkerResources:
        """What the workers hold together (their control groups' counts: the check worker's where it is this
        environment's alone), and the user the environment worker runs as."""
        groups = [self.group, None if self.checks.shared else self.checks.group]
        usage = combined([group for group in groups if group is not None]) or WorkerResources(counted_by="none")
        return usage.model_copy(update={"uid": self.worker.uid})

    async def state(self, live: LiveEpisode) -> dict[str, Any]:
        async with live.gate.alone():
            await self._ensure_usable(live)
            return await self._read_object(live, "state", "a state read")

    async def state_json(self, live: LiveEpisode) -> bytes:
        # Passed on as the worker wrote it, once checked: parsed here, a state of big data would cost the server
        # several times its size (the objects, then their text again).
        async with live.gate.alone():
            await self._ensure_usable(live)
            return await self._read(live, "state", "a state read", checked_object)

    async def _construct(self, episode_id: str, scenario: Scenario | None, init_config: dict[str, Any] | None) -> Episode | None:
        fresh = episode_id not in self._handles
        if fresh:  # a new episode (else a reset): its handle lives as long as it does
            self._handles[episode_id] = str(next(self._handle_numbers))
        request = WorkerRequest(op="create", handle=self._handles[episode_id], scenario_id=scenario.task_id if scenario else None,
                                init_config=None if scenario else (init_config or {}))
        try:
            await self._ask_about(request, self.settings.call_timeout_s + ABANDON_GRACE_S, "the constructor")
        except Exception as e:
            if fresh:
                del self._handles[episode_id]
            if isinstance(e, WorkerGone) and e.out_of_memory or isinstance(e, OutOfMemory):
                raise OutOfMemory(self._out_of_memory(episode_id, "building the episode", str(e))) from None
            if isinstance(e, WorkerGone):
                raise EnvCodeError(f"{self.env_id}: {e}") from None
            raise
        self._histories[episode_id] = _History()
        self._stale.pop(episode_id, None)
        return None

    async def _run_call(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome:
        await self._ensure_built(live)
        if live.lost is not None:
            return self._lost_outcome(live, name, arguments)
        request = WorkerRequest(op="call", handle=self._handle(live), name=name, arguments=arguments)
        try:
            payload, worker = await self._ask_about(request, self.settings.call_timeout_s + ABANDON_GRACE_S, f"tool {name!r}", live)
            reply = decode(WorkerOutcome, payload)
        except WorkerGone as e:
            said = self._out_of_memory(live.episode_id, f"in tool {name!r}", str(e), name) if e.out_of_memory else str(e)
            message = f"{said}; the call was undone, and the episode goes on from before it"
            return ToolOutcome.failure(name, arguments, "timeout" if e.hung else "env", message)
        except EpisodeLost:
            return self._lost_outcome(live, name, arguments)
        except (EnvCodeError, UnknownEpisode, ValueError, RecursionError) as e:
            return ToolOutcome.failure(name, arguments, "env", f"Environment error in {name!r}: {e}")
        reply.outcome.result_text = reply.text
        if reply.outcome.exception == "MemoryError":  # under an address-space limit, an allocation fails instead
            reply.outcome.error = self._out_of_memory(live.episode_id, f"in tool {name!r}", str(reply.outcome.error), name)
        if reply.stuck:
            # Its thread runs on and cannot be stopped: only a new worker is rid of it. The episode is
            # rebuilt there without this call.
            reply.outcome.error = f"{reply.outcome.error}; the call was undone, and the episode goes on from before it"
            self.worker.restart(f"tool {name!r} outlived its limit on a thread that could not be stopped", worker)
        else:
            self._remember(live, name, arguments, reply)
        return reply.outcome

    async def _run_checks(self, live: LiveEpisode, checklist: list[CheckItem], context: CheckContext) -> tuple[list[CheckResult], str]:
        await self._ensure_usable(live)
        final = await self._read(live, "final", "the final state", partial(decode, EpisodeFinal))
        if not checklist:
            return [], final.state_hash
        request = CheckRequest(env_id=self.env_id, handle=self._handle(live), checklist=checklist, initial_key=final.initial_hash,
                               changes=final.changes, final=final.final, initial=final.initial, context=context)
        results = await self._check(request, live.episode_id)
        if results.missing_initial:
            request.initial = await self._read_object(live, "initial", "the initial state")
            results = await self._check(request, live.episode_id)
        return results.checks, final.state_hash

    async def _check(self, request: CheckRequest, episode_id: str) -> CheckResults:
        """The check worker's verdicts, one request of this environment's at a time (a request's deadline runs from when it is sent)."""
        limit = checks_limit_s(request.checklist, self.settings.check_timeout_s)
        async with self._checking:
            try:
                payload = await self.checks.ask(request, limit)
            except WorkerGone as e:
                if e.out_of_memory:
                    raise OutOfMemory(self._out_of_memory(episode_id, "in its checks", str(e))) from None
                if e.hung:
                    raise CallAbandoned() from None
                # It ended without being overdue (at its start, say): no limit was outlived, and the server's log has its output.
                raise EnvCodeError(f"{self.env_id}: the check worker ended before it answered ({e}); the server's log shows "
                                   "what it said") from None
            except OutOfMemory as e:  # the check worker's start
                raise OutOfMemory(self._out_of_memory(episode_id, "in its checks", str(e))) from None
        try:
            return decode(CheckResults, payload)
        except (ValueError, RecursionError):
            raise EnvCodeError(f"{self.env_id}: the check worker answered with a malformed result") from None

    def _release(self, live: LiveEpisode) -> None:
        self._histories.pop(live.episode_id, None)
        handle = self._handles.pop(live.episode_id, None)
        stale = self._stale.pop(live.episode_id, None) is not None
        if handle is not None and live.lost is None and not stale and self.worker.alive:
            self.worker.tell(WorkerRequest(op="end", handle=handle))

    def close(self) -> None:
        """Stop the workers (the server is shutting down)."""
        self.worker.close()
        self.checks.leaves(self.env_id)
        self.close_groups()

    def close_groups(self) -> None:
        """Remove the environment worker's control group."""
        if self.group is not None:
            self.group.remove()
