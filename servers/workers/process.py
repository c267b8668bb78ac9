"""A child process that runs untrusted code for the server, asked over a socket pair, killed when it must.

The server keeps what has to outlive untrusted code (the HTTP and MCP surface, the token, the
episode ids, the trajectories) and asks a :class:`WorkerProcess` for the rest: the environment's code
(``servers.workers.env_worker``) or the checks (``servers.workers.check_worker``). The process is forked by
the server's spawner (``servers.workers.spawner``), in the server's process group (a farm that kills
the server's group kills it and what it forked), confined in the sandbox where asked, with a clean
environment; its settings arrive as its first frame,
never through argv or the environment, and the server is made undumpable so that the child cannot
read the token from the server's memory.

The child's output (stdout and stderr, one pipe) is read here, never passed to the server's own log
file: each line is logged under the child's environment and role, cut to ``OUTPUT_LINE_CHARS``, and
past ``OUTPUT_BYTES`` in one child's life the rest is counted and dropped. Where the server can make
one (``envscaler.cgroups``), the child starts in its environment's control group.

Every request has a deadline: its own limit plus ``GRACE_S``, counted from when it was sent or from
the child's last answer, whichever is later, and moved later by what the child's threads waited for a
CPU (``envscaler.own_time``, read from ``/proc`` once the request has waited ``MARK_AFTER_S``): a machine
short of CPU slows the child, it does not make it late. A child that keeps answering is not frozen: a request
that waits in it behind others (all its call threads busy with slow but legitimate calls, a machine
short of CPU) is the child's to refuse (``Overloaded``, after ``queue_wait_s``), or to run under its
own limit, which runs from when it starts there. Its deadline moves at most ``GRACE_S`` (or
``queue_wait_s``, when shorter) past its limit plus the grace, however busy the child: one request
stuck past that while the child answers others (a thread that holds the GIL in C) must not hold up
the child's other episodes. A child that misses a deadline is frozen (SIGALRM
ignored and a loop, the GIL held by a C loop, a catastrophic regex, SIGSTOP): nothing comes from it at
all. One whose socket closes has died (``SystemExit`` at the top, a crash). Either way its process group is killed, what waits on it
fails with :class:`WorkerGone`, the owner is told (``on_lost``), and the next request starts a new
child.

Which request to blame, nothing the child says can tell: the untrusted code it runs can write
whatever the child can, the shared page that names the request each of its threads runs
(:class:`servers.workers.wire.RunningMarks`) included. So a request is blamed only when it was the
only one in flight on the child (hint first, verify alone). When several were, none is blamed, and
each whose caller asks again gets a :class:`Turn` (:meth:`WorkerProcess.alone`):

- the others first: those the page does not name get a pass and are asked again at once, together on
  the new child (with whatever new requests come meanwhile). An honest page costs them nothing more.
- then the suspects, those the page names (its event loop's, else its threads'): once every pass has
  ended and nothing else is in flight, each is asked again alone, with nothing else sent until it
  ends. One that brings that child down is blamed; one that completes stands (the page lied, or it
  was only waiting for the GIL).
- a request that falls with others again after a fall it was caught up in (the page lied, and the
  culprit was among those with passes) is asked again alone too, in its turn.

So a request that is blamed has brought a child down with nothing else in flight there.

The one rule of time: when the owner replaces a child that still answers, because a request's code
runs on past its limit on a thread that cannot be stopped (:meth:`WorkerProcess.restart`), every
request already past its own limit by the server's clock (less what the child waited for a CPU) is blamed, at once, and the others are asked
again together: a flood of such calls costs no more than one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from pydantic import BaseModel

from envscaler import EnvCodeError
from envscaler.cgroups import ChildGroup
from envscaler.errors import BundleError, ChecklistError
from envscaler.own_time import RECHECK_S, CpuWaitCredit, mark_delay_s, process_reading
from envscaler.sandbox import CHILD_TASKS, SANDBOX_ENVIRONMENT, clean_environment, make_undumpable, process_uid, sandbox_plan
from servers.errors import CallAbandoned, EpisodeLost, OutOfMemory, Overloaded, UnknownEpisode, UnknownScenario
from servers.memory import oom_kills
from servers.workers.spawner import ForkRequest, SpawnedWorker, spawner
from servers.workers.wire import (
    EXIT_REASONS,
    FAILED,
    HELLO_ID,
    FrameReader,
    FrameTooLarge,
    RunningMarks,
    WorkerFailure,
    decode,
    frame,
    recv_frame,
)

log = logging.getLogger("envscaler.server")

GRACE_S = 2.0
"""How long past a request's own limit the child may take to answer before it counts as frozen."""
CAUGHT_UP_TRIES = 4
"""How many times a request is asked in all, at most, when the child keeps falling under it without blaming it."""
START_TIMEOUT_S = 60.0
_TICK_S = 0.1
_EXIT_STATUS_WAIT_S = 0.2
# SIGKILL's exit status: of the child itself, or of bubblewrap around it (128 + the signal, as a shell says).
_KILLED = (-signal.SIGKILL, 128 + signal.SIGKILL)
OUTPUT_BYTES = 256 * 1024
"""How much of one child's output is logged; the rest is counted, not kept."""
OUTPUT_LINE_CHARS = 4000
# What a child's interpreter is told unless the server's own environment says otherwise. Two malloc arenas at most: each
# call thread that allocates gets an arena of its own, which keeps what it once held (16 busy threads: 1.3 to 1.9 MB more
# than with two, benchmarks/worker_imports.py). No pydantic plugins: the search for them reads every installed
# distribution's metadata into each child (0.5 MB), and a plugin is code the child needs no more than the server does.
CHILD_ENVIRONMENT = {"MALLOC_ARENA_MAX": "2", "PYDANTIC_DISABLE_PLUGINS": "1"}
OUT_OF_MEMORY = "out of memory: the kernel killed it"
"""Why a child that the kernel's OOM killer killed is gone."""
_ERRORS: dict[str, type[Exception]] = {
    "EnvCodeError": EnvCodeError, "UnknownScenario": UnknownScenario, "UnknownEpisode": UnknownEpisode,
    "OutOfMemory": OutOfMemory, "ChecklistError": ChecklistError, "CallAbandoned": CallAbandoned, "EpisodeLost": EpisodeLost,
    "BundleError": BundleError,
    "Overloaded": Overloaded,
}


class Turn:
    """A request's turn to be asked again after a fall it was not blamed for (:meth:`WorkerProcess.alone`):
    ``alone`` (a suspect's, or a second fall's), or a pass (with the others, before any turn alone)."""

    __slots__ = ("alone",)

    def __init__(self, alone: bool) -> None:
        self.alone = alone


# The turn the current task runs in, if any (it ends when one of the task's requests falls).
_HOLDING: contextvars.ContextVar[Turn | None] = contextvars.ContextVar("envscaler_worker_turn", default=None)


class WorkerGone(Exception):
    """The child was killed or died before it answered.

    ``blamed``: this request is what brought it down (``hung``: by missing its deadline or running on
    past its limit). Otherwise it may be innocent: ask it again, in ``turn`` when it has one (it was
    asked with ``again`` and fell with others, see the module's doc); a caller that has a turn must
    enter it (:meth:`WorkerProcess.alone`), else the turns after it never come.
    """

    def __init__(self, reason: str, *, hung: bool, blamed: bool, turn: Turn | None = None, out_of_memory: bool = False) -> None:
        super().__init__(reason)
        self.hung = hung
        self.blamed = blamed
        # The kernel killed the child for its memory (its control group's limit).
        self.out_of_memory = out_of_memory
        self.turn = turn


class _Link(asyncio.Protocol):
    """This side of the socket pair: frames in, answers handed to the owner."""

    def __init__(self, owner: WorkerProcess, child: _Child) -> None:
        self.owner = owner
        self.child = child
        self.transport: asyncio.Transport | None = None
        self.frames = FrameReader()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.child.gone:
            transport.abort()  # killed while the link was being made: the transport owns the socket, and closes it

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.frames.feed(data)
        except FrameTooLarge as e:
            self.owner.lose(self.child, f"the {self.owner.role} sent {e}")
            return
        for request_id, status, payload in frames:
            self.owner.answered(request_id, status, payload)

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            # A dying process closes its socket a moment before its exit status can be collected.
            code: int | None = self.child.process.wait(_EXIT_STATUS_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        if code in EXIT_REASONS:
            # It ended itself for a reason of its own, not for a request it was answering.
            self.owner.lose(self.child, f"the {self.owner.role} exited ({EXIT_REASONS[code]})", blame=False)
            return
        out_of_memory = code is not None and self.child.killed_for_memory(code)
        if code is None:
            why = "closed its socket"
        elif out_of_memory:
            why = OUT_OF_MEMORY
        else:
            why = f"exit code {code}"
        self.owner.lose(self.child, f"the {self.owner.role} exited ({why})", out_of_memory=out_of_memory)


class _Output(asyncio.Protocol):
    """The child's stdout and stderr: logged line by line under its environment and role, up to a budget."""

    def __init__(self, owner: WorkerProcess, child: _Child) -> None:
        self.owner = owner
        self.child = child
        self.partial = b""
        self.logged = 0
        self.dropped = 0

    def data_received(self, data: bytes) -> None:
        if self.logged >= OUTPUT_BYTES:
            self.dropped += len(data)
            return
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if len(self.partial) > OUTPUT_LINE_CHARS:
            lines.append(self.partial)
            self.partial = b""
        for line in lines:
            self._line(line)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.partial:
            self._line(self.partial)
        if self.dropped:
            log.warning(f"{self.owner.role} output dropped", extra={"env": self.owner.env_id, "serial": self.child.serial,
                                                                    "dropped_bytes": self.dropped})

    def _line(self, line: bytes) -> None:
        if self.logged + len(line) > OUTPUT_BYTES:
            self.logged = OUTPUT_BYTES  # the rest is only counted
            self.dropped += len(line) + 1
            log.warning(f"{self.owner.role} output cut: the rest of it is counted, not logged",
                        extra={"env": self.owner.env_id, "serial": self.child.serial, "logged_bytes": OUTPUT_BYTES})
            return
        self.logged += len(line) + 1
        text = line[:OUTPUT_LINE_CHARS].decode("utf-8", "replace")
        try:
            said = json.loads(text)  # the child's own log records stay readable; they are nested, never the server's
        except ValueError:
            said = text
        log.warning(f"{self.owner.role} output", extra={"env": self.owner.env_id, "serial": self.child.serial, "said": said})


class _Child:
    """One child process, its socket, and (once the event loop has it) the link over it."""

    def __init__(self, module: str, settings: BaseModel, sandbox: bool, new_processes: bool, inherited: tuple[int, ...],
                 group: ChildGroup | None, tasks: int, readable: tuple[Path, ...] = ()) -> None:
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.group = group
        # The OOM kills so far (its group's, else the server's): one more when it is killed means the kernel's OOM killer did it.
        self.oom_kills = self.oom_kills_now()
        # Forked by this server's spawner (``servers.workers.spawner``), in the server's process group: whatever
        # kills the server's group (a farm restarting or stopping it) takes the child and what it forked.
        # Whatever it reads comes over the socket, but for the ``readable`` paths (a bundle's data files),
        # shown read-only, and its group's memory files, where it reads its own (it refuses an episode before
        # the kernel kills it).
        environment = {**CHILD_ENVIRONMENT, **clean_environment()}
        fds = [theirs.fileno(), *inherited]
        forker = spawner()
        if forker is not None:
            placed = group.memory_files() if group is not None else None
            plan = sandbox_plan(readable=readable, placed=placed, tasks=tasks) if sandbox else None
            request = ForkRequest(module=module, fds=fds, groups=group.procs_files if group is not None else [], sandbox=plan,
                                  new_processes=new_processes, memfd=group is not None,
                                  environment={**environment, **SANDBOX_ENVIRONMENT} if sandbox else environment)
            self.process: SpawnedWorker | subprocess.Popen[bytes] = forker.spawn(request, fds)
        elif sandbox:
            raise EnvCodeError(f"{module} cannot be sandboxed: this platform cannot fork a worker from a spawner")
        else:
            self.process = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())], pass_fds=fds, env=environment,
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        theirs.close()
        try:
            ours.sendall(frame(0, settings))
        except OSError:
            pass  # it ended before it read them (its sandbox could not be made): the wait for its hello tells how it ended
        self.link: _Link | None = None
        self.output: asyncio.BaseTransport | None = None
        # Whether its output pipe is (being) read by a transport, which then closes it.
        self.reading = False
        self.gone = False
        self.serial = 0  # set by its WorkerProcess: which of its children this is
        # Frames to send at the end of this event-loop iteration: under load, one write carries many.
        self.outbox: list[bytes] = []

    def killed_for_memory(self, code: int) -> bool:
        """Whether exit status ``code`` is the kernel's OOM killer's doing (its group counts one more kill)."""
        return code in _KILLED and self.oom_kills is not None and (self.oom_kills_now() or 0) > self.oom_kills

    def oom_kills_now(self) -> int | None:
        """How many processes the kernel's OOM killer has killed in its group (else the server's) so far."""
        return self.group.oom_kills() if self.group is not None else oom_kills()

    def read_hello(self, timeout_s: float, role: str) -> bytes:
        """The first frame, read before the event loop runs (the server needs the tools to start)."""
        self.sock.settimeout(timeout_s)
        try:
            _, status, payload = recv_frame(self.sock)
        except (EOFError, OSError, FrameTooLarge):
            self.kill()
            code = self.process.poll()
            if code is not None and self.killed_for_memory(code):
                raise OutOfMemory(f"the {role} did not start ({OUT_OF_MEMORY}, as it loaded the environment and its data files)") from None
            raise EnvCodeError(f"the {role} did not start (exit code {code})") from None
        self.sock.setblocking(False)
        if status == FAILED:
            self.kill()
            raise EnvCodeError(decode(WorkerFailure, payload).message)
        return payload

    def send(self, data: bytes) -> None:
        """Queue a frame; all frames queued in one loop iteration go out in one write."""
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self.outbox.append(data)

    def _flush(self) -> None:
        data, self.outbox = b"".join(self.outbox), []
        if not self.gone and self.link is not None and self.link.transport is not None:
            self.link.transport.write(data)

    def kill(self) -> None:
        # In the sandbox the process is the first of its PID namespace: the namespace, and all in it, dies with it.
        self.gone = True
        self.process.kill()
        self.process.wait()
        if self.link is not None:
            # The transport closes the socket (uvloop's on a later turn of the loop; one still being made, once
            # made): closing it here as well could close a descriptor that a new connection got meanwhile, under
            # the loop's feet (it aborts).
            if self.link.transport is not None:
                self.link.transport.abort()
        else:
            self.sock.close()
        if not self.reading and self.process.stdout is not None:
            self.process.stdout.close()  # never read: a child killed before the event loop had it


class WorkerProcess:
    """One child at a time running ``python -m module FD``, asked requests with deadlines (see the module's doc).

    ``role`` names it in errors ("environment worker"). ``on_lost(reason)`` is called each time a
    child is killed or dies. ``mark``, shared with each child (its ``mark_fd`` setting), names the
    subjects the child's threads run: a request is asked about a subject (an episode's handle), and
    when the child falls with several requests in flight, the one whose subject it names is asked
    again alone first (a hint, never a reason to blame: see the module's doc). ``readable``: paths its
    sandbox shows, read-only (an environment's data files); ``start_timeout_s``: how long a child may take
    to say hello (loading them included).

    The first child starts here, before any event loop: :attr:`hello` is its first frame (with
    ``lazy``, there is no first child and no hello: the first request starts one). Later ones start
    on the loop, when a request finds the last one gone. ``new_processes``: its sandbox lets it fork
    (a zygote that runs no untrusted code itself, see ``envscaler.sandbox.sandboxed``). ``queue_wait_s``:
    how long the child may keep a request waiting (for a call thread) while it answers others.
    ``idle_s`` (with ``lazy``: a child that holds nothing its next request needs): a child with nothing in
    flight for that long is stopped, and the next request starts another. That is no loss: ``on_lost`` is
    not called and :attr:`restarts` does not count it.
    """

    def __init__(self, module: str, settings: BaseModel, *, role: str, sandbox: bool, on_lost: Callable[[str], None],
                 mark: RunningMarks | None = None, lazy: bool = False, new_processes: bool = False, env_id: str = "",
                 group: ChildGroup | None = None, tasks: int = CHILD_TASKS, readable: tuple[Path, ...] = (),
                 queue_wait_s: float = 0.0, start_timeout_s: float = START_TIMEOUT_S, idle_s: float | None = None) -> None:
        if idle_s is not None and not lazy:
            raise ValueError("idle_s needs lazy: a child that is stopped when idle is started by the next request")
        self.module = module
        self.idle_s = idle_s
        # When the current child last had something in flight (time.monotonic()), and the timer that stops it once idle.
        self._used = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self.readable = readable
        self.queue_wait_s = queue_wait_s
        self.start_timeout_s = start_timeout_s
        # When the current child last answered anything (time.monotonic()): a child that answers is not frozen.
        self._heard = 0.0
        self.settings = settings
        self.role = role
        self.env_id = env_id
        self.group = group
        self.tasks = tasks
        self.sandbox = sandbox
        self.new_processes = new_processes
        self.on_lost = on_lost
        self.mark = mark
        self.restarts = 0
        make_undumpable()
        self._serials = 0
        self._child: _Child | None = None
        self.hello = b""
        if not lazy:
            self._child = self._spawn()
            self.hello = self._child.read_hello(self.start_timeout_s, role)
        self._starting: asyncio.Future[_Child] | None = None
        # request id -> what waits for it, in the order sent
        self._pending: dict[int, _Pending] = {}
        self._next_id = HELLO_ID + 1
        self._ticking = False
        self._telling: set[asyncio.Task[None]] = set()
        # Turns alone, in order: once no pass is left, the first one's task is the only one that may send.
        self._turns: list[Turn] = []
        # Passes not yet ended: requests asked again together, which the turns alone wait for.
        self._passes: set[Turn] = set()
        # Set (and replaced) when a turn or pass ends, or the child has nothing more in flight.
        self._changed = asyncio.Event()

    def _spawn(self) -> _Child:
        if self.mark is not None:
            self.mark.clear()
        child = _Child(self.module, self.settings, self.sandbox, self.new_processes, () if self.mark is None else (self.mark.fd,),
                       self.group, self.tasks, self.readable)
        self._serials += 1
        child.serial = self._serials
        return child

    @property
    def uid(self) -> int | None:
        """The host uid the current child runs as, when that is not this server's own (a root server's sandbox)."""
        if self._child is None or self._child.gone or not self.sandbox or os.geteuid() != 0:
            return None
        return process_uid(self._child.process.pid)

    @property
    def alive(self) -> bool:
        """Whether a child is up (a request may still have to start a new one)."""
        return self._child is not None and not self._child.gone

    def start_problem(self) -> str | None:
        """Why the last child could not be started, or None; starts one in the background when none is up
        (a health probe alone then brings a lost child back)."""
        starting = self._starting
        if self.alive or (starting is not None and not starting.done()):
            return None
        if starting is not None and not starting.cancelled() and starting.exception() is not None:
            problem = f"the {self.role} cannot start: {starting.exception()}"
        else:
            problem = None
        if self._child is not None:
            self._starting = asyncio.ensure_future(self._attach())
            self._starting.add_done_callback(lambda future: future.cancelled() or future.exception())  # seen by the next probe
        return problem

    async def ask(self, request: BaseModel, limit_s: float, what: str, subject: str = "", *, again: bool = False) -> bytes:
        """The child's answer to ``request`` (about ``subject``): raises the error it reports, or WorkerGone.

        ``again``: the caller asks again, in the WorkerGone's turn when it has one.
        """
        payload, _ = await self.ask_child(request, limit_s, what, subject, again=again)
        return payload

    async def ask_child(self, request: BaseModel, limit_s: float, what: str, subject: str = "", *,
                        again: bool = False) -> tuple[bytes, int]:
        """:meth:`ask`, with the serial number of the child that answered (for :meth:`restart`)."""
        child = await self._admitted()
        request_id = self._next_id
        self._next_id = request_id + 1 if request_id < 0xFFFF_FFFF else HELLO_ID + 1
        child.send(frame(request_id, request))
        self._used = time.monotonic()
        status, payload = await self._wait(request_id, limit_s + GRACE_S, limit_s, what, subject, again, _HOLDING.get())
        if status == FAILED:
            try:
                failure = decode(WorkerFailure, payload)
            except (ValueError, RecursionError):
                raise EnvCodeError(f"the {self.role} answered {what} with a malformed error") from None
            raise _ERRORS[failure.error](failure.message)
        return payload, child.serial

    @contextlib.asynccontextmanager
    async def alone(self, turn: Turn | None) -> AsyncIterator[None]:
        """Run the body in ``turn`` (a WorkerGone's). A pass: at once. A turn alone: once the turns before
        it and every pass have ended and nothing else is in flight on the child, with no other task's
        request sent until it ends. With None, the body runs at once. The turn ends with the body, or
        when one of the body's requests falls."""
        if turn is None:
            yield
            return
        try:
            while turn.alone and not (self._turns and self._turns[0] is turn and not self._passes and not self._pending):
                await self._changed.wait()
            holding = _HOLDING.set(turn)
            try:
                yield
            finally:
                _HOLDING.reset(holding)
        finally:
            self._end(turn)

    def forgo(self, turn: Turn) -> None:
        """Give up ``turn`` (a WorkerGone's) without entering it: its request is asked again later, with none."""
        self._end(turn)

    def tell(self, request: BaseModel) -> None:
        """Send ``request`` and forget it: its answer, or the child's loss, changes nothing here."""
        # In a context of its own: never sent in its caller's turn alone, which it must not share.
        task = asyncio.get_running_loop().create_task(self._tell(request), context=contextvars.Context())
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def _tell(self, request: BaseModel) -> None:
        try:
            await self.ask(request, 0.0, "a notice")
        except (WorkerGone, EnvCodeError):
            pass

    def restart(self, reason: str, serial: int) -> None:
        """Replace child ``serial`` though it answers (it runs code that cannot be stopped otherwise), if it
        is still the current one. What waits on it was caught up in this, but a request already past
        its own limit was running on past it (it answers at once, else): it is not run again."""
        if self._child is not None and self._child.serial == serial:
            self.lose(self._child, reason, blame=False, late_blamed=True)

    def close(self) -> None:
        """Stop the child (the server is shutting down)."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._child is not None and not self._child.gone:
            self._child.kill()

    # -- the child's life ------------------------------------------------------------------------

    async def _admitted(self) -> _Child:
        """The child to send a request to, once the request may go: at once, unless a turn alone is up (a
        turn is queued and no pass is left): then only the requests of the task whose turn it is."""
        while True:
            child = await self._ready()
            if not self._turns or self._passes or _HOLDING.get() is self._turns[0]:
                return child
            await self._changed.wait()

    def _end(self, turn: Turn) -> None:
        """End ``turn`` (a pass or a turn alone), if it has not ended yet, and wake whoever waits for it."""
        if turn in self._turns:
            self._turns.remove(turn)
        self._passes.discard(turn)
        self._wake()

    def _wake(self) -> None:
        woken, self._changed = self._changed, asyncio.Event()
        woken.set()

    async def _ready(self) -> _Child:
        while True:
            child = self._child
            if child is not None and child.link is not None and child.link.transport is not None and not child.gone:
                return child
            starting = self._starting
            if starting is None or (starting.done() and (starting.cancelled() or starting.exception() is not None
                                                         or starting.result().gone)):
                self._starting = starting = asyncio.ensure_future(self._attach())
            child = await asyncio.shield(starting)
            if not child.gone:
                return child
            # It fell while its link was being made (it had died before): the next turn starts another.

    async def _attach(self) -> _Child:
        loop = asyncio.get_running_loop()
        fresh = self._child is None or self._child.gone
        started = time.monotonic()
        if fresh:
            if self._child is not None:
                self.restarts += 1
            self._child = self._spawn()  # on the loop's thread: PDEATHSIG follows the thread that forks
        child = self._child
        # Expected before the link reads anything: a forked child may say hello before the link is even made.
        hello = self._expect(HELLO_ID, self.start_timeout_s, self.start_timeout_s, "its start", "") if fresh else None
        # The link is the child's before it is made: a child lost meanwhile leaves its socket to the transport.
        link = child.link = _Link(self, child)
        await loop.connect_accepted_socket(lambda: link, sock=child.sock)
        if child.process.stdout is not None and child.output is None and not child.gone:
            child.reading = True  # the pipe is the transport's from now on, though the child be lost meanwhile
            child.output, _ = await loop.connect_read_pipe(lambda: _Output(self, child), child.process.stdout)
        if hello is not None:
            status, payload = await self._answer(hello)
            if status == FAILED:
                raise EnvCodeError(decode(WorkerFailure, payload).message)
            if self.restarts:
                log.warning(f"{self.role} restarted", extra={"env": self.env_id, "restarts": self.restarts,
                                                              "start_s": round(time.monotonic() - started, 3)})
        return child

    def lose(self, child: _Child, reason: str, hung: bool = False, blame: bool = True, late_blamed: bool = False,
             out_of_memory: bool = False) -> None:
        """Kill ``child``, fail what waits on it, tell the owner; the next request starts a new one.

        With ``blame``, the only request in flight is blamed (``hung``: it missed its deadline); when
        several were, those whose callers ask again get turns (see the module's doc). ``late_blamed``
        (the owner replaces a child that still answers): every request already past its own limit is
        blamed instead, and the others are asked again. ``out_of_memory``: the kernel killed it for its memory.
        """
        if child.gone or child is not self._child:
            return
        # Every request the child was running, those whose callers gave up included: any could have done it.
        in_flight = list(self._pending.values())
        self._pending.clear()
        falling = [pending for pending in in_flight if not pending.future.done()]
        for pending in falling:
            if pending.holding is not None:
                self._end(pending.holding)  # its request fell: what it was asked again for is over
        shared = blame and len(in_flight) > 1
        turns = self._turns_after(falling) if shared else {}
        now = time.monotonic()
        # Read while the child lives: what it waited for a CPU is not its requests' own time.
        late = {pending for pending in falling if late_blamed and now - pending.sent - self._waited(pending) > pending.limit_s}
        child.kill()
        self.on_lost(reason)
        for pending in falling:
            if blame and not shared:
                gone = WorkerGone(reason, hung=hung, blamed=True, out_of_memory=out_of_memory)
            elif pending in late:
                # Caught up, but already past its own limit by this server's clock: it would have timed out anyway.
                gone = WorkerGone(f"{reason}; {pending.what} had run past its own limit of {pending.limit_s:g} s", hung=True, blamed=True)
            else:
                gone = WorkerGone(reason, hung=False, blamed=False, turn=turns.get(pending), out_of_memory=out_of_memory)
            pending.future.set_exception(gone)
        self._wake()

    def _turns_after(self, falling: list[_Pending]) -> dict[_Pending, Turn]:
        """The turns of the requests that fell together whose callers ask again: alone for the suspects
        (those the marks name: the event loop's, else its threads') and for those asked again already
        (they fell with others twice), in that order; a pass for the rest."""
        marks = self.mark.read() if self.mark is not None else {}
        on_loop = [pending for pending in falling if pending.subject == marks.get(0)]
        suspects = on_loop or [pending for pending in falling if pending.subject in marks.values()]
        again = [pending for pending in falling if pending.again]
        turns = {pending: Turn(alone=True) for pending in suspects if pending.again}
        turns |= {pending: Turn(alone=pending.holding is not None) for pending in again if pending not in turns}
        self._turns.extend(turn for turn in turns.values() if turn.alone)
        self._passes.update(turn for turn in turns.values() if not turn.alone)
        return turns

    def answered(self, request_id: int, status: int, payload: bytes) -> None:
        self._heard = self._used = time.monotonic()
        pending = self._pending.pop(request_id, None)
        if pending is not None and not pending.future.done():
            pending.future.set_result((status, payload))
        if not self._pending and self._turns:
            self._wake()  # a turn alone may wait for the child to have nothing in flight
        if not self._pending and self.idle_s is not None and self._idle_timer is None:
            self._idle_timer = asyncio.get_running_loop().call_later(self.idle_s, self._stop_if_idle)

    def _stop_if_idle(self) -> None:
        """Stop the child once it has had nothing in flight for ``idle_s``; else look again when it may have."""
        self._idle_timer = None
        assert self.idle_s is not None
        child = self._child
        starting = self._starting is not None and not self._starting.done()
        if child is None or child.gone or starting or self._pending:
            return  # gone already, or busy: its next answer with nothing left in flight sets the timer again
        left = self._used + self.idle_s - time.monotonic()
        if left > 0:
            self._idle_timer = asyncio.get_running_loop().call_later(left, self._stop_if_idle)
            return
        child.kill()
        self._child = None  # the next request starts a child, and that is no restart
        log.info(f"{self.role} stopped: idle for {self.idle_s:g} s; the next request starts it again",
                 extra={"env": self.env_id, "serial": child.serial})

    def _supervise(self) -> None:
        now = time.monotonic()
        child = self._child
        deadlines: dict[_Pending, float] = {}
        for pending in self._pending.values():
            deadline = deadlines[pending] = self._deadline(pending)
            if child is None:
                continue
            if pending.credit is None:
                if now - pending.sent >= mark_delay_s(pending.wait_s):
                    pending.credit = CpuWaitCredit(functools.partial(process_reading, child.process.pid))
                    pending.credit.take_mark()
            elif deadline <= now:
                pending.credit.update()
                deadlines[pending] = self._deadline(pending)
                if deadlines[pending] <= now and pending.credit.holds_off():
                    deadlines[pending] = now + RECHECK_S  # it waits for a CPU now, or may: looked at again then
        overdue = [pending for pending, deadline in deadlines.items() if deadline <= now]
        if overdue and child is not None:
            late = min(overdue, key=deadlines.__getitem__)
            # What the deadline was moved by: on a machine short of CPU, why the loss came that much past the limit.
            log.warning(f"{self.role} missed a deadline", extra={"env": self.env_id, "serial": child.serial, "request": late.what,
                                                                "limit_s": late.limit_s, "cpu_wait_s": round(late.credited_s, 3)})
            self.lose(self._child, f"the {self.role} did not answer {late.what} within {late.limit_s:g} s and was restarted", hung=True)
        if self._pending:
            asyncio.get_running_loop().call_later(_TICK_S, self._supervise)
        else:
            self._ticking = False

    def _deadline(self, pending: _Pending) -> float:
        """When ``pending`` counts as missed: its wait from when it was sent or from the child's last
        answer, whichever is later, and at most ``GRACE_S`` past its wait from when it was sent (a child
        that answers others while one request outlives its wait by more is stuck on it: a thread that holds
        the GIL in C, say, and its other episodes must not wait on it for ``queue_wait_s``); both moved later
        by what the child waited for a CPU since the request's mark."""
        return (min(max(pending.sent, self._heard) + pending.wait_s, pending.sent + pending.wait_s + min(self.queue_wait_s, GRACE_S))
                + pending.credited_s)

    @staticmethod
    def _waited(pending: _Pending) -> float:
        """What the child has waited for a CPU since ``pending``'s mark, read now (0 before the mark)."""
        return 0.0 if pending.credit is None else pending.credit.update()

    async def _wait(self, request_id: int, wait_s: float, limit_s: float, what: str, subject: str, again: bool = False,
                    holding: Turn | None = None) -> tuple[int, bytes]:
        """The child's answer to request ``request_id``. Until it answers or falls, the request stays in
        flight, though its caller give up: the child still runs it."""
        return await self._answer(self._expect(request_id, wait_s, limit_s, what, subject, again, holding))

    def _expect(self, request_id: int, wait_s: float, limit_s: float, what: str, subject: str, again: bool = False,
                holding: Turn | None = None) -> _Pending:
        """Put request ``request_id`` in flight: its answer, or its deadline, is watched from now."""
        loop = asyncio.get_running_loop()
        pending = _Pending(loop.create_future(), time.monotonic(), wait_s, limit_s, what, subject, again, holding)
        self._pending[request_id] = pending
        if not self._ticking:
            self._ticking = True
            loop.call_later(_TICK_S, self._supervise)
        return pending

    async def _answer(self, pending: _Pending) -> tuple[int, bytes]:
        try:
            return await pending.future
        except asyncio.CancelledError:
            # Given up after its fall gave it a turn: no one will enter that turn, so it ends here.
            if pending.future.done() and not pending.future.cancelled():
                gone = pending.future.exception()
                if isinstance(gone, WorkerGone) and gone.turn is not None:
                    self._end(gone.turn)
            raise


class _Pending:
    """A request the child has not answered yet (``again``: as :meth:`WorkerProcess.ask` was told; ``holding``:
    the turn its task was in when it was sent, if any)."""

    __slots__ = ("future", "sent", "wait_s", "limit_s", "what", "subject", "again", "holding", "credit")

    def __init__(self, future: asyncio.Future[tuple[int, bytes]], sent: float, wait_s: float, limit_s: float, what: str,
                 subject: str, again: bool, holding: Turn | None) -> None:
        self.future = future
        self.sent = sent
        self.wait_s = wait_s
        self.limit_s = limit_s
        self.what = what
        self.subject = subject
        self.again = again
        self.holding = holding
        # Taken by the supervisor once it has waited MARK_AFTER_S (most requests are answered long before).
        self.credit: CpuWaitCredit | None = None

    @property
    def credited_s(self) -> float:
        """What the child waited for a CPU since this request's mark, at the last reading: what its deadline is moved by."""
        return 0.0 if self.credit is None else self.credit.seconds
