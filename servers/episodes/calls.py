"""Environment code off the event loop: one worker thread that hands over when a call is slow.

Constructors, checks and tool calls too slow for the event loop (see ``servers.episodes.store``) are
synchronous, untrusted code that may block (``time.sleep``) or loop, while the event loop must keep
answering every other episode. Sending each call to a pool thread costs two thread wake-ups and two
GIL hand-overs per call (~70 us when the threads sit on different CPUs). Instead the calls that reach
the runner during one event-loop iteration are handed over together at its end, one worker thread
runs them back to back, and their results come back to the loop in one batch: under load, one
hand-over serves many calls.

A call that runs longer than ``handover_after_s`` retires its worker (it finishes that call, reports
it, and exits) and a fresh worker takes the queue, so a slow or stuck call only holds up its own
caller. A call's limit runs from when a thread starts it, never from when it was queued: a call that
waited behind others (every thread busy with slow but legitimate calls) gets its whole limit. It
counts the call's own time (``envscaler.own_time``): what its thread waited for a CPU on a machine
short of them is added to its deadline. A call still running at its deadline is abandoned: its caller gets
:class:`CallAbandoned` at once. The thread cannot be killed; it stays retired until the call returns,
if ever, and at most ``max_threads`` threads exist, so a flood of stuck calls cannot exhaust the
process. A call that waits longer than ``wait_s`` for a thread is refused with :class:`Overloaded`,
and never runs: nothing of it happened, so it can be asked again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from envscaler.guard import block_alarm_in_this_thread
from envscaler.own_time import OwnTimeLimit, thread_reading
from servers.errors import CallAbandoned, Overloaded

T = TypeVar("T")

log = logging.getLogger("envscaler.server")


class _Job(Generic[T]):
    __slots__ = ("fn", "future", "limit_s", "queued", "thread_id", "started", "limit", "abandoned")

    def __init__(self, fn: Callable[[], T], future: asyncio.Future[T], limit_s: float, queued: float) -> None:
        self.fn = fn
        self.future = future
        self.limit_s = limit_s
        self.queued = queued
        # The thread that took it, and when (``CallRunner._claims`` held): from then on its limit runs.
        self.thread_id = 0
        self.started: float | None = None
        # Made by the supervisor once it sees the job started.
        self.limit: OwnTimeLimit | None = None
        self.abandoned = False


class _Worker:
    __slots__ = ("thread", "job", "started", "retired")

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.job: _Job[Any] | None = None
        self.started = 0.0
        self.retired = False


QUEUE_WAIT_S = 30.0
"""How long a call may wait for a call thread before it is refused (``serve --queue-wait``)."""

SWITCH_INTERVAL_S = 0.0005
"""How often a thread that runs Python code gives the others their turn, in a process that runs
environment code (Python's own: 5 ms). A call that computes for long on a call thread would otherwise
add up to 5 ms to every call of every other episode (the event loop waits for its turn)."""


def share_the_interpreter() -> None:
    """Set :data:`SWITCH_INTERVAL_S` for this process (before environment code loads: it is refused that)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


class CallRunner:
    """Runs blocking callables for the one event loop that awaits them (bound on first use)."""

    def __init__(self, name: str, *, handover_after_s: float = 0.05, max_threads: int = 32, tick_s: float = 0.02,
                 wait_s: float = QUEUE_WAIT_S) -> None:
        self.name = name
        self.handover_after_s = handover_after_s
        self.max_threads = max_threads
        self.tick_s = tick_s
        self.wait_s = wait_s
        self.abandoned = 0
        self.refused = 0
        # Held while a thread takes a job and while the loop refuses one: a job is either run or refused, never both.
        self._claims = threading.Lock()
        # Why the last call thread could not be started, until one is.
        self.start_error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: queue.SimpleQueue[_Job[Any]] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._ending: list[threading.Thread] = []
        self._active: _Worker | None = None
        self._pending: set[_Job[Any]] = set()
        self._batch: list[_Job[Any]] = []
        self._ticking = False

    @property
    def threads(self) -> int:
        """Worker threads alive now, retired ones included."""
        return len(self._workers)

    def thread_ids(self) -> set[int]:
        """The operating system's ids of this runner's threads, those still ending included."""
        # Kept until the system no longer lists it: a thread is not alive for Python a moment before it
        # has ended, and a busy machine can stretch that moment (it would be taken for someone else's).
        self._ending = [thread for thread in self._ending if thread.is_alive() or os.path.exists(f"/proc/self/task/{thread.native_id}")]
        threads = [worker.thread for worker in self._workers if worker.thread is not None] + self._ending
        return {thread.native_id for thread in threads if thread.native_id is not None}

    @property
    def busy(self) -> bool:
        """Whether calls are queued or running on the runner's threads."""
        return bool(self._pending)

    @property
    def exhausted(self) -> bool:
        """Whether every thread is held by a call that outran its hand-over: a new call waits until one
        returns, if ever (each is abandoned at its deadline meanwhile)."""
        return self._active is None and (len(self._workers) >= self.max_threads or self.start_error is not None)

    async def run(self, fn: Callable[[], T], limit_s: float) -> T:
        """``fn()`` on a worker thread. Raises what it raises, CallAbandoned once it has run for ``limit_s``,
        or Overloaded (it never ran) when no thread took it within ``wait_s``."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        job: _Job[T] = _Job(fn, loop.create_future(), limit_s, time.monotonic())
        self._pending.add(job)
        if self._active is None:
            self._start_worker()
        if not self._ticking:
            self._ticking = True
            loop.call_later(self.tick_s, self._supervise)
        if not self._batch:
            loop.call_soon(self._hand_over)
        self._batch.append(job)
        try:
            return await job.future
        finally:
            self._pending.discard(job)
            job.abandoned = True  # a caller that gave up (cancelled) must not have its call run later

    # -- on the event loop -----------------------------------------------------------------------

    def _start_worker(self) -> None:
        if len(self._workers) >= self.max_threads:
            self._active = None  # every thread is stuck: queued calls wait, and are abandoned on time
            return
        worker = _Worker()
        worker.thread = threading.Thread(target=self._work, args=(worker,), name=f"{self.name}-calls", daemon=True)
        try:
            worker.thread.start()
        except RuntimeError as e:  # "can't start new thread": no memory or pids left for one
            if self.start_error is None:
                log.error("cannot start a call thread; queued calls wait, and are abandoned on time",
                          extra={"runner": self.name, "threads": len(self._workers), "error": str(e)})
            self.start_error = str(e)
            self._active = None
            return
        self.start_error = None
        self._workers.append(worker)
        self._active = worker

    def _hand_over(self) -> None:
        # The first put wakes the worker, which then waits for the GIL until this loop iteration
        # ends: by then every job of the batch is queued and it runs them all in one go.
        batch, self._batch = self._batch, []
        for job in batch:
            self._queue.put(job)

    def _supervise(self) -> None:
        now = time.monotonic()
        for job in list(self._pending):
            if job.future.done():
                continue
            started = job.started
            if started is not None:
                if job.limit is None:
                    job.limit = OwnTimeLimit(job.limit_s, functools.partial(thread_reading, job.thread_id), start=started)
                if job.limit.reached(now):
                    job.abandoned = True
                    self.abandoned += 1
                    job.future.set_exception(CallAbandoned())
            elif now - job.queued > self.wait_s:
                self._refuse(job, now)
        active = self._active
        if active is None or (active.job is not None and now - active.started > self.handover_after_s):
            if active is not None:
                active.retired = True
            self._start_worker()
        if self._pending:
            self._loop.call_later(self.tick_s, self._supervise)  # type: ignore[union-attr]
        else:
            self._ticking = False

    def _refuse(self, job: _Job[Any], now: float) -> None:
        """Refuse ``job``, which has waited too long for a thread, unless a thread is taking it right now."""
        with self._claims:
            if job.started is not None:
                return
            job.abandoned = True
        self.refused += 1
        log.warning("a call waited too long for a call thread and was refused", extra={"runner": self.name, "waited_s": round(now - job.queued, 1)})
        job.future.set_exception(Overloaded(
            f"overloaded: the call waited {now - job.queued:.0f} s for one of {self.max_threads} call threads, all busy, and was "
            "not run; nothing of it happened, so it can be made again once the environment is less busy"))

    def _settle(self, done: list[tuple[_Job[Any], bool, Any]]) -> None:
        for job, ok, value in done:
            if job.future.done():
                continue
            if ok:
                job.future.set_result(value)
            else:
                job.future.set_exception(value)

    def _exited(self, worker: _Worker) -> None:
        self._workers.remove(worker)
        if worker.thread is not None:
            self._ending.append(worker.thread)  # its thread ends a moment after it says so
        if self._active is worker:
            self._active = None
            if self._pending:
                self._start_worker()

    # -- on a worker thread ----------------------------------------------------------------------

    def _work(self, worker: _Worker) -> None:
        block_alarm_in_this_thread()
        thread_id = threading.get_native_id()
        done: list[tuple[_Job[Any], bool, Any]] = []
        get, get_nowait = self._queue.get, self._queue.get_nowait
        while not worker.retired:
            try:
                job = get_nowait()
            except queue.Empty:
                if done:
                    self._report(done)
                    done = []
                job = get()
                if worker.retired:
                    # Retired while idle (a hand-over raced with the end of a call): the active worker takes it.
                    self._queue.put(job)
                    break
            with self._claims:
                if job.abandoned:
                    continue
                job.thread_id = thread_id
                job.started = worker.started = time.monotonic()  # before job: the supervisor reads job, then started
            worker.job = job
            try:
                done.append((job, True, job.fn()))
            except BaseException as e:  # noqa: BLE001 - the caller gets whatever the call raised
                done.append((job, False, e))
            worker.job = None
        if done:
            self._report(done)
        self._call_soon(self._exited, worker)

    def _report(self, done: list[tuple[_Job[Any], bool, Any]]) -> None:
        self._call_soon(self._settle, done)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:
            pass  # the loop is closed: the server is gone and nobody waits for this
