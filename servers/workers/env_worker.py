"""The environment worker: ``python -m servers.workers.env_worker FD``, started by a server (``servers.workers.store``).

Everything the environment's code does happens in this process: loading the class, constructors,
tool calls, and turning what they return into JSON. It runs the same engine as a server without a
worker (``servers.episodes.store``: calls inline on the event loop within a budget, slow ones on call
threads, each under its limit), but keeps no trajectory, holds no token, listens on no socket and
runs no checks (``servers.workers.check_worker`` does, on what this process says an episode changed): it
answers the server's requests on the inherited socket FD (``servers.workers.wire``). It never learns an
episode's id (the key to its MCP endpoint): the server names each episode by a handle of its own,
which is the episode's id here.

The server kills this process (its whole process group) when an answer is overdue, or when a call
outlived its limit on a thread that cannot be stopped, and starts a new one, where it rebuilds the
episodes held here from their calls. So whatever the code does here (ignore SIGALRM, hold the GIL in
a C loop, exit, crash, fork) costs at most the call that did it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from envscaler import EnvCodeError, EnvRuntime, ToolOutcome
from envscaler.errors import BundleError, ChecklistError
from envscaler.guard import guard_thread_ids, keep_alarm_handler, protect_time_limits
from servers.episodes.calls import share_the_interpreter
from servers.episodes.store import EpisodeStore, LiveEpisode
from servers.transport.event_loop import loop_factory
from servers.errors import CallAbandoned, EpisodeLost, OutOfMemory, Overloaded, UnknownEpisode, UnknownScenario
from servers.memory import memory_status, release_free_memory
from servers.workers.child import child_main
from servers.workers.wire import (
    EXIT_FOREIGN_THREAD,
    FAILED,
    HELLO_ID,
    OK,
    EpisodeFinal,
    FrameReader,
    RunningMarks,
    WorkerFailure,
    WorkerHello,
    WorkerOutcome,
    WorkerRequest,
    WorkerSettings,
    decode,
    frame,
    outcome_digest,
    read_settings,
)

log = logging.getLogger("envscaler.worker")

T = TypeVar("T")

THREAD_CHECK_S = 0.5
"""How often the worker looks for threads that environment code left running."""

_FAILURES = (EnvCodeError, UnknownScenario, UnknownEpisode, OutOfMemory, ChecklistError, CallAbandoned, EpisodeLost, BundleError,
             Overloaded)


class WorkerLink(asyncio.Protocol):
    """Reads the server's requests and writes each answer as one frame.

    A tool call whose episode is free and that ends within the inline budget (almost every call) is
    answered right where its frame is read; anything else runs as a task. The answers ready by the
    end of one read go out in one write: under load, one system call carries many answers.
    """

    def __init__(self, store: MarkedEpisodeStore, closed: asyncio.Future[None]) -> None:
        self.store = store
        self.closed = closed
        self.transport: asyncio.Transport | None = None
        self.frames = FrameReader()
        self.outbox: list[bytes] = []
        # Threads seen at the last check that are not this process's own.
        self.foreign: set[int] = set()
        # Whether environment code may have run since the last check (the class's own, as it loaded, at first),
        # and the next check's timer, while one is due.
        self.active = True
        self.watch: asyncio.TimerHandle | None = None
        # Set when this process must end as soon as its current answer is out.
        self.exit_status: int | None = None
        # Episodes being rebuilt (their replay's frame read, its answer not yet sent) -> set when it is: a call
        # of the episode that came after the replay waits for it, never runs between two of its calls.
        self.rebuilding: dict[str, asyncio.Event] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        # The server is trusted and caps its own frames: a FrameTooLarge here is a bug, and ends the worker.
        loop = asyncio.get_running_loop()
        self.active = True
        self.arm_thread_watch()
        for request_id, _, payload in self.frames.feed(data):
            try:
                request = decode(WorkerRequest, payload)
            except Exception as e:  # noqa: BLE001 - a request this worker cannot read costs only its answer
                self.outbox.append(frame(request_id, WorkerFailure(error="EnvCodeError", message=f"unreadable request: {e}"), FAILED))
                continue
            if request.op == "replay":
                self.rebuilding.setdefault(request.handle, asyncio.Event())
            answer = self.answer_now(request)
            if answer is None:
                loop.create_task(self.answer(request_id, request))
            else:
                self.outbox.append(frame(request_id, answer))
        self.flush()

    def flush(self) -> None:
        if self.outbox and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.outbox))
        self.outbox.clear()

    def answer_now(self, request: WorkerRequest) -> WorkerOutcome | None:
        """The answer to a tool call that could run to its end at once, else None."""
        if request.op != "call" or request.handle in self.rebuilding:
            return None
        live = self.store.episodes.get(request.handle)
        if live is None:
            return None
        outcome = self.store.call_now(live, request.name, request.arguments)
        return None if outcome is None else _answer(outcome, stuck=False)

    async def answer(self, request_id: int, request: WorkerRequest) -> None:
        try:
            answer, status = await self.run(request), OK
        except _FAILURES as e:
            kind = next(cls.__name__ for cls in _FAILURES if isinstance(e, cls))
            answer, status = WorkerFailure(error=kind, message=str(e)), FAILED  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - whatever else environment code made of this request
            message = f"{self.store.env_id}: {request.op} failed: {type(e).__name__}: {e}"
            answer, status = WorkerFailure(error="EnvCodeError", message=message), FAILED
        self.outbox.append(frame(request_id, answer, status))
        self.flush()
        if self.exit_status is not None:
            os._exit(self.exit_status)

    async def run(self, request: WorkerRequest) -> Any:
        """What ``request`` asks for, as a model or plain data."""
        store = self.store
        if request.op == "call":
            while (rebuilding := self.rebuilding.get(request.handle)) is not None:
                await rebuilding.wait()
            live = store.get(request.handle)
            outcome = await store.call_tool(live, request.name, request.arguments)
            return _answer(outcome, stuck=live.stuck)
        if request.op == "create":  # of a new episode, or again of one this worker holds (a reset)
            await self.build(request)
            return {}
        if request.op == "replay":
            try:
                await self.replay(request)
            finally:
                rebuilt = self.rebuilding.pop(request.handle, None)
                if rebuilt is not None:
                    rebuilt.set()
            return {}
        if request.op == "final":
            return await self.final(store.get(request.handle))
        if request.op == "initial":  # for the check worker, which loads the data files itself
            live = store.get(request.handle)
            assert live.episode is not None
            return live.episode.initial_by_reference()
        if request.op == "state":
            return await store.state(store.get(request.handle))
        if request.op == "end":
            if request.handle in store.episodes:
                store.end(request.handle)
            return {}
        stats = await store.stats()  # stats: with the memory the episodes live in
        return stats.model_copy(update={"memory": memory_status()})

    async def final(self, live: LiveEpisode) -> EpisodeFinal:
        """The episode's state as its checks will see it (under the call limit: a private state's
        conversion to JSON may run environment code, a ``__repr__``)."""
        episode = live.episode
        assert episode is not None

        def read() -> EpisodeFinal:
            changes = episode.changes()
            if changes is None:
                return EpisodeFinal(state_hash=episode.state_hash(), final=episode.state(), initial=episode.initial_state())
            return EpisodeFinal(state_hash=episode.state_hash(), initial_hash=episode.initial_hash(), changes=changes)

        async with live.gate.alone():
            return await self.store.runner.run(read, self.store.runtime.call_timeout_s)

    async def build(self, request: WorkerRequest) -> LiveEpisode:
        """The episode built from the request's scenario (or init_config), new or in place of the one held."""
        store = self.store
        live = store.episodes.get(request.handle)
        if live is None:
            return await store.create(request.scenario_id, request.init_config, request.handle)
        await store.reset(live, request.scenario_id, request.init_config)
        return live

    async def replay(self, request: WorkerRequest) -> None:
        """Build the episode, then run its calls again; EpisodeLost when one comes out differently, or
        leaves a thread running (then this process ends itself once it has answered)."""
        live = await self.build(request)
        for number, call in enumerate(request.calls, 1):
            outcome = await self.store.call_tool(live, call.name, call.arguments)
            what = None
            if foreign_threads(self.store):
                self.exit_status = EXIT_FOREIGN_THREAD
                what = "a thread that runs on after the call"
            elif outcome_digest(outcome) != call.digest or live.stuck:
                what = f"an error: {outcome.error}" if outcome.error else "a different change of state"
            if what is not None:
                self.store.end(live.episode_id)
                raise EpisodeLost(f"replaying call {number} of {len(request.calls)} ({call.name}) gave {what} "
                                  "(the environment does not answer the same calls the same way)")

    def watch_threads(self) -> None:
        """End this process when a thread environment code started (past the guard) runs on after its
        call: it would share the CPU with every episode here. Seen twice in a row, to let a call thread
        that is ending end. The server rebuilds the episodes elsewhere; the one whose call starts the
        thread again cannot be rebuilt (:meth:`replay`).

        Looked for again only while environment code may have run since (a request came, or a call runs
        on a thread) or a thread is seen: an idle worker does not wake (200 idle workers checking twice
        a second took 6% of a core)."""
        self.watch = None
        seen = foreign_threads(self.store)
        if seen & self.foreign:
            log.error("a thread started by environment code runs on after its call; ending this worker",
                      extra={"env": self.store.env_id, "threads": len(seen)})
            os._exit(EXIT_FOREIGN_THREAD)
        self.foreign = seen
        if seen or self.active or self.store.runner.busy:
            self.active = False
            self.arm_thread_watch()

    def arm_thread_watch(self) -> None:
        """Check for such threads :data:`THREAD_CHECK_S` from now, unless a check is due already."""
        if self.watch is None:
            self.watch = asyncio.get_running_loop().call_later(THREAD_CHECK_S, self.watch_threads)


class MarkedEpisodeStore(EpisodeStore):
    """The engine, marking whose code each thread runs (the server reads the marks when this process
    freezes or dies, to know which request to blame): slot 0 for the event loop's thread, one slot
    for each call thread."""

    def __init__(self, *args: Any, marks: RunningMarks | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marks = marks
        self._slots: dict[int, int] = {threading.get_ident(): 0}

    def _marked(self, episode_id: str, work: Callable[[], T]) -> T:
        slot = self._slot()
        if self.marks is None or slot is None:
            return work()
        self.marks.set(slot, episode_id)
        try:
            result = work()
        except Exception:
            self.marks.clear(slot)
            raise
        # Not cleared for what else escapes (SystemExit from a __repr__ that runs after the call): it ends
        # this process, and the mark tells the server whose call did.
        self.marks.clear(slot)
        return result

    def _slot(self) -> int | None:
        thread = threading.get_ident()
        slot = self._slots.get(thread)
        if slot is None and len(self._slots) < RunningMarks.SLOTS:
            slot = self._slots[thread] = len(self._slots)
        return slot

    def _call_inline(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome | None:
        return self._marked(live.episode_id, lambda: super(MarkedEpisodeStore, self)._call_inline(live, name, arguments))

    def _on_thread(self, episode_id: str, work: Callable[[], T]) -> Callable[[], T]:
        return lambda: self._marked(episode_id, work)


def foreign_threads(store: EpisodeStore) -> set[int]:
    """Threads of this process that it did not start itself (none where /proc is not there to tell)."""
    try:
        running = {int(task) for task in os.listdir("/proc/self/task")}
    except OSError:
        return set()
    return running - {threading.main_thread().native_id, *store.runner.thread_ids(), *guard_thread_ids()}


def _answer(outcome: ToolOutcome, *, stuck: bool) -> WorkerOutcome:
    return WorkerOutcome(outcome=outcome, text=outcome.result_text, digest=outcome_digest(outcome), stuck=stuck)


def run_worker(sock: socket.socket) -> None:
    """Load the environment named by the server's settings, say hello, answer requests until EOF."""
    settings = read_settings(sock, WorkerSettings)
    protect_time_limits()
    share_the_interpreter()
    bundle = settings.bundle
    try:
        runtime = EnvRuntime(bundle.spec, call_timeout_s=settings.call_timeout_s, check_timeout_s=settings.check_timeout_s,
                             max_result_chars=settings.max_result_chars, bundle_dir=bundle.directory)
        runtime.load_data(bundle.scenarios)
    except Exception as e:  # noqa: BLE001 - loading is environment code: report it to the server, then stop
        # The loader's own errors name the environment already; anything else it raised does not.
        message = str(e) if isinstance(e, EnvCodeError) else f"{bundle.env_id}: {e}"
        sock.sendall(frame(HELLO_ID, WorkerFailure(error="EnvCodeError", message=message), FAILED))
        raise SystemExit(1) from None
    marks = RunningMarks(settings.mark_fd) if settings.mark_fd is not None else None
    store = MarkedEpisodeStore(bundle, runtime, max_episodes=2**31, idle_ttl_s=float("inf"), worker_threads=settings.worker_threads,
                               queue_wait_s=settings.queue_wait_s, inline_budget_s=settings.inline_budget_s, memory_reserve_mb=settings.memory_reserve_mb, records=False,
                               marks=marks)
    keep_alarm_handler()
    # What compiling the modules and loading the environment left free in the heap (1 to 2 MB where no bytecode caches
    # exist, as in a checkout with PYTHONDONTWRITEBYTECODE) goes back to the kernel.
    release_free_memory()
    hello = WorkerHello(tools=runtime.tool_list(), annotations=runtime.annotations)
    sock.sendall(frame(HELLO_ID, hello))
    sock.setblocking(False)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()
        _, link = await loop.connect_accepted_socket(lambda: WorkerLink(store, closed), sock=sock)
        link.watch_threads()
        await closed

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve())


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m servers.workers.env_worker FD`` (FD: the server's end of a socket pair)."""
    return child_main("servers.workers.env_worker", run_worker, argv)


if __name__ == "__main__":
    sys.exit(main())
