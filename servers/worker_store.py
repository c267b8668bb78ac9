"""Episodes whose environment code runs in a worker process that the server kills when it must.

With ``--worker-process`` the server keeps what has to outlive the environment's code: the HTTP and
MCP surface, the token, the episode ids and their trajectories. The environment's code (loading,
constructors, tool calls, checks, and the JSON of what they return) runs in one worker process
(``servers.env_worker``), started here in a process group of its own, and talked to over a socket
pair in frames (``servers.worker_wire``). It is never given the token, and this process is made
undumpable so that the worker cannot read it from this one's memory.

Every request has a deadline: its own limit (the call's, the constructor's, every check's) plus
``GRACE_S``. The worker enforces the limits itself; one that misses a deadline is frozen (SIGALRM
ignored and a loop, the GIL held by a C loop, a catastrophic regex), and one whose socket closes
has died (``SystemExit`` at the top, a crash). Either way its process group is killed, a new worker
is started, and each episode it held is marked lost: its calls say so, its validation answers 410,
never a reward of 0, and a reset builds it again in the new worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from envscaler import Bundle, EnvCodeError, Episode, Scenario, ToolOutcome, ValidationResult
from envscaler.errors import ChecklistError
from envscaler.models import CheckItem, ToolAnnotations, ToolSchema
from envscaler.sandbox import clean_environment, make_undumpable, sandboxed
from servers.episodes import ABANDON_GRACE_S, CallStats, EpisodeRegistry, LiveEpisode, checks_limit_s
from servers.errors import CallAbandoned, EpisodeLost, OutOfMemory, UnknownEpisode, UnknownScenario
from servers.worker_wire import (
    FAILED,
    HELLO_ID,
    FrameReader,
    FrameTooLarge,
    WorkerFailure,
    WorkerHello,
    WorkerOutcome,
    WorkerRequest,
    WorkerSettings,
    decode,
    frame,
    recv_frame,
)

log = logging.getLogger("envscaler.server")

GRACE_S = 2.0
"""How long past a request's own limit the worker may take to answer before it counts as frozen."""
START_TIMEOUT_S = 60.0
_TICK_S = 0.1
_ERRORS: dict[str, type[Exception]] = {
    "EnvCodeError": EnvCodeError, "UnknownScenario": UnknownScenario, "UnknownEpisode": UnknownEpisode,
    "OutOfMemory": OutOfMemory, "ChecklistError": ChecklistError, "CallAbandoned": CallAbandoned,
}


class WorkerGone(Exception):
    """The worker was killed or died before it answered; ``hung`` when it missed a deadline."""

    def __init__(self, reason: str, hung: bool) -> None:
        super().__init__(reason)
        self.hung = hung


class _Link(asyncio.Protocol):
    """This side of the socket pair: frames in, answers handed to the store."""

    def __init__(self, store: WorkerEpisodeStore, worker: _Worker) -> None:
        self.store = store
        self.worker = worker
        self.transport: asyncio.Transport | None = None
        self.frames = FrameReader()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.frames.feed(data)
        except FrameTooLarge as e:
            self.store.lose(self.worker, f"the environment worker sent {e}")
            return
        for request_id, status, payload in frames:
            self.store.answered(request_id, status, payload)

    def connection_lost(self, exc: Exception | None) -> None:
        code = self.worker.process.poll()
        self.store.lose(self.worker, f"the environment worker exited ({'exit code ' + str(code) if code is not None else 'closed its socket'})")


class _Worker:
    """One worker process, its socket, and (once the event loop has it) the link over it."""

    def __init__(self, settings: WorkerSettings, sandbox: bool) -> None:
        ours, theirs = socket.socketpair()
        self.sock = ours
        command = [sys.executable, "-m", "servers.env_worker", str(theirs.fileno())]
        # Its own process group: what it forks dies with it. The bundle comes over the socket: no path is readable.
        with contextlib.ExitStack() as stack:
            fds: tuple[int, ...] = ()
            if sandbox:
                command, fds = stack.enter_context(sandboxed(command, readable=[]))
            self.process = subprocess.Popen(command, pass_fds=[theirs.fileno(), *fds], env=clean_environment(), start_new_session=True)
        theirs.close()
        ours.sendall(frame(0, settings))
        self.link: _Link | None = None
        self.gone = False
        # Frames to send at the end of this event-loop iteration: under load, one write carries many.
        self.outbox: list[bytes] = []

    def read_hello(self, timeout_s: float) -> bytes:
        """The first frame, read before the event loop runs (the server needs the tools to start)."""
        self.sock.settimeout(timeout_s)
        try:
            _, status, payload = recv_frame(self.sock)
        except (EOFError, OSError, FrameTooLarge):
            self.kill()
            raise EnvCodeError(f"the environment worker did not start (exit code {self.process.poll()})") from None
        self.sock.setblocking(False)
        if status == FAILED:
            raise EnvCodeError(decode(WorkerFailure, payload).message)
        return payload

    def kill(self) -> None:
        self.gone = True
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        if self.link is not None and self.link.transport is not None:
            self.link.transport.abort()
        self.sock.close()

    def send(self, data: bytes) -> None:
        """Queue a frame; all frames queued in one loop iteration go out in one write."""
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self.outbox.append(data)

    def _flush(self) -> None:
        data, self.outbox = b"".join(self.outbox), []
        if not self.gone and self.link is not None and self.link.transport is not None:
            self.link.transport.write(data)


class WorkerEpisodeStore(EpisodeRegistry):
    """Episodes whose state lives in a worker process (see the module's doc)."""

    def __init__(self, bundle: Bundle, settings: WorkerSettings, *, sandbox: bool, **limits: Any) -> None:
        super().__init__(bundle, **limits)
        self.settings = settings
        self.sandbox = sandbox
        self.restarts = 0
        make_undumpable()
        self._worker = _Worker(settings, sandbox)
        hello = decode(WorkerHello, self._worker.read_hello(START_TIMEOUT_S))
        self._tools, self._annotations = hello.tools, hello.annotations
        self._starting: asyncio.Future[_Worker] | None = None
        self._pending: dict[int, tuple[asyncio.Future[tuple[int, bytes]], float, float, str]] = {}
        self._next_id = HELLO_ID + 1
        self._ticking = False
        self._ending: set[asyncio.Task[None]] = set()

    # -- the worker's life -----------------------------------------------------------------------

    async def _ready(self) -> _Worker:
        worker = self._worker
        if worker.link is not None and not worker.gone:
            return worker
        starting = self._starting
        if starting is None or (starting.done() and (starting.cancelled() or starting.exception() is not None or starting.result().gone)):
            self._starting = starting = asyncio.ensure_future(self._attach())
        return await asyncio.shield(starting)

    async def _attach(self) -> _Worker:
        loop = asyncio.get_running_loop()
        if self._worker.gone:
            self._worker = _Worker(self.settings, self.sandbox)  # on the loop's thread: PDEATHSIG follows the thread that forks
            self.restarts += 1
            fresh = True
        else:
            fresh = False
        worker = self._worker
        _, worker.link = await loop.connect_accepted_socket(lambda: _Link(self, worker), sock=worker.sock)
        if fresh:
            status, payload = await self._wait(worker, HELLO_ID, START_TIMEOUT_S, 0.0, "its start")
            if status == FAILED:
                raise EnvCodeError(decode(WorkerFailure, payload).message)
            log.warning("environment worker restarted", extra={"env": self.env_id, "restarts": self.restarts})
        return worker

    def lose(self, worker: _Worker, reason: str, hung: bool = False) -> None:
        """Kill ``worker``, fail what waits on it, mark its episodes lost; the next request starts a new one."""
        if worker.gone or worker is not self._worker:
            return
        worker.kill()
        held = [live for live in self.episodes.values() if live.lost is None]
        for live in held:
            live.lost = reason
        log.error("environment worker lost", extra={"env": self.env_id, "reason": reason, "episodes": len(held)})
        for future, _, _, _ in list(self._pending.values()):
            if not future.done():
                future.set_exception(WorkerGone(reason, hung))

    def answered(self, request_id: int, status: int, payload: bytes) -> None:
        pending = self._pending.get(request_id)
        if pending is not None and not pending[0].done():
            pending[0].set_result((status, payload))

    def _supervise(self) -> None:
        now = time.monotonic()
        for future, deadline, limit_s, what in list(self._pending.values()):
            if deadline <= now and not future.done():
                self.lose(self._worker, f"the environment worker did not answer {what} within {limit_s:g} s and was restarted", hung=True)
                break
        if self._pending:
            asyncio.get_running_loop().call_later(_TICK_S, self._supervise)
        else:
            self._ticking = False

    async def _wait(self, worker: _Worker, request_id: int, limit_s: float, grace_s: float, what: str) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        self._pending[request_id] = (future, time.monotonic() + limit_s + grace_s, limit_s, what)
        if not self._ticking:
            self._ticking = True
            loop.call_later(_TICK_S, self._supervise)
        try:
            return await future
        finally:
            self._pending.pop(request_id, None)

    async def _ask(self, request: WorkerRequest, limit_s: float, what: str) -> bytes:
        """The worker's answer to ``request``; raises the error it reports, or WorkerGone."""
        worker = await self._ready()
        request_id = self._next_id
        self._next_id = request_id + 1 if request_id < 0xFFFF_FFFF else HELLO_ID + 1
        worker.send(frame(request_id, request))
        status, payload = await self._wait(worker, request_id, limit_s, GRACE_S, what)
        if status == FAILED:
            try:
                failure = decode(WorkerFailure, payload)
            except (ValueError, RecursionError):
                raise EnvCodeError(f"{self.env_id}: the environment worker answered {what} with a malformed error") from None
            raise _ERRORS[failure.error](failure.message)
        return payload

    # -- the hooks -------------------------------------------------------------------------------

    def tool_list(self) -> list[ToolSchema]:
        return list(self._tools)

    @property
    def annotations(self) -> dict[str, ToolAnnotations]:
        return self._annotations

    async def stats(self) -> CallStats:
        # Asking starts a new worker when the last one was lost: a health probe alone brings it back.
        try:
            return decode(CallStats, await self._ask(WorkerRequest(op="stats"), 0.0, "a health question"))
        except (WorkerGone, EnvCodeError) as e:
            return CallStats(call_threads=0, stuck_calls=0, threaded_tools=[], capacity_problem=str(e))

    async def state(self, live: LiveEpisode) -> dict[str, Any]:
        if live.lost is not None:
            raise EpisodeLost(f"episode {live.episode_id} is lost ({live.lost}); reset it to run its scenario again")
        try:
            payload = await self._ask(WorkerRequest(op="state", episode_id=live.episode_id), self.settings.call_timeout_s, "a state read")
            state = json.loads(payload)
        except WorkerGone as e:
            raise EpisodeLost(f"episode {live.episode_id} is lost ({e})") from None
        except (ValueError, RecursionError):
            raise EnvCodeError(f"{self.env_id}: the environment worker answered a state read with malformed JSON") from None
        if not isinstance(state, dict):
            raise EnvCodeError(f"{self.env_id}: the environment worker answered a state read with no object")
        return state

    async def _construct(self, episode_id: str, scenario: Scenario | None, init_config: dict[str, Any] | None) -> Episode | None:
        request = WorkerRequest(op="create", episode_id=episode_id, scenario_id=scenario.task_id if scenario else None,
                                init_config=None if scenario else (init_config or {}))
        try:
            await self._ask(request, self.settings.call_timeout_s + ABANDON_GRACE_S, "a constructor")
        except WorkerGone as e:
            raise EnvCodeError(f"{self.env_id}: {e}") from None
        return None

    async def _run_call(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome:
        request = WorkerRequest(op="call", episode_id=live.episode_id, name=name, arguments=arguments)
        try:
            payload = await self._ask(request, self.settings.call_timeout_s + ABANDON_GRACE_S, f"tool {name!r}")
            reply = decode(WorkerOutcome, payload)
        except WorkerGone as e:
            return ToolOutcome.failure(name, arguments, "timeout" if e.hung else "env", f"{e}; this episode is lost: it must be reset or ended")
        except (EnvCodeError, UnknownEpisode, ValueError, RecursionError) as e:
            return ToolOutcome.failure(name, arguments, "env", f"Environment error in {name!r}: {e}")
        reply.outcome.result_text = reply.text
        return reply.outcome

    async def _run_checks(self, live: LiveEpisode, checklist: list[CheckItem] | None) -> ValidationResult:
        limit = checks_limit_s(live.checklist(checklist), self.settings.check_timeout_s)
        try:
            payload = await self._ask(WorkerRequest(op="validate", episode_id=live.episode_id, checklist=checklist), limit, "the checks")
            return decode(ValidationResult, payload)
        except WorkerGone as e:
            raise EpisodeLost(f"episode {live.episode_id} is lost ({e}); reset it to run its scenario again") from None
        except (ValueError, RecursionError):
            raise EnvCodeError(f"{self.env_id}: the environment worker answered the checks with a malformed result") from None

    def _release(self, live: LiveEpisode) -> None:
        if live.lost is None and not self._worker.gone:
            task = asyncio.get_running_loop().create_task(self._end(live.episode_id))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

    async def _end(self, episode_id: str) -> None:
        try:
            await self._ask(WorkerRequest(op="end", episode_id=episode_id), 0.0, "an episode's end")
        except (WorkerGone, EnvCodeError):
            pass  # the worker, or its copy of the episode, is gone already

    def close(self) -> None:
        """Stop the worker (the server is shutting down)."""
        if not self._worker.gone:
            self._worker.kill()
