"""Time limits that count a task's own time: wall-clock time less the time it waited for a CPU.

On a machine with more runnable threads than cores (1,000 environments on 2 cores, a benchmark beside
other busy processes), a call that needs 5 ms of CPU can take seconds of wall-clock time, nearly all of
it in the kernel's run queue. A wall-clock limit would end that call, and replace the worker that runs
it, though nothing was stuck. The kernel counts, for each thread, how long it was ready to run but
waited for a CPU (the second field of ``/proc/<pid>/task/<tid>/schedstat``, in nanoseconds). A limit
here is reached when wall-clock time less that wait reaches it: running counts, and so does blocking (a
sleep, a lock, I/O: the task's own doing); waiting for a CPU does not. So a stuck task is still ended
(a loop runs whenever it gets a CPU, a sleep blocks), only later on a busy machine.

For a process, the wait is that of its busiest thread since the mark (the one that ran most: the one
doing the request's work, which the process cannot be trusted to name), less what its other threads
ran meanwhile. A sum over threads would count one starved second once per thread; the thread that
waited most could be one kept waiting on purpose (the lowest priority on a CPU the process keeps busy);
and threads of one process that take the CPU from each other wait on themselves, not on the machine.
Any of those would let a stuck process outlive its limit.

The kernel adds a wait to that count only once it ends, when the thread gets a CPU: a thread kept
waiting the whole while (a server a busy machine has not let run since a probe reached it) shows none.
So a reading also notes, for each thread, whether it is ready to run (state ``R``) and how much it has
run: a task whose busiest thread is ready, and of which nothing has run since the previous reading,
waits for a CPU now, and its limit is not reached while it does (it is looked at again ``RECHECK_S``
later). One that is ready but ran since the previous reading may be running or waiting: once per
decision, a limit looks again ``RECHECK_S`` later to tell.

Reading ``/proc`` costs a few microseconds, so a limit is a wall-clock deadline first. The waits are
read once the task has run ``MARK_AFTER_S`` (the mark: waits before it count as the task's own time,
which only makes the limit stricter), and again each time the deadline, moved later by the waits
since the mark, comes. Where the kernel does not count waits (no ``/proc``, no scheduler statistics), a
limit is wall-clock time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

# Bound now: environment code that runs in this process may replace the module attributes.
_open, _read, _close, _listdir, _monotonic = os.open, os.read, os.close, os.listdir, time.monotonic
_native_id = threading.get_native_id

MARK_AFTER_S = 0.5
"""How long a task runs before its waits are first read (at most a quarter of its limit: :func:`mark_delay_s`)."""

RECHECK_S = 0.1
"""How soon a limit looks again at a task that waits for a CPU now, or may."""


class ThreadCpu(NamedTuple):
    """One thread at one reading of ``/proc``."""

    waited_s: float
    """Its waits for a CPU that have ended, in seconds since it started."""
    ran: tuple[int, int]
    """Its time on a CPU (ns) and how many times it got one: both change whenever it runs."""
    ready: bool
    """Running or ready to run: not asleep, blocked or stopped."""


class CpuReading(NamedTuple):
    """A task (one thread, or a process) at one reading of ``/proc``."""

    threads: dict[int, ThreadCpu]
    """Its threads now, by the operating system's id."""
    ran_s: float
    """Its time on a CPU so far, a process's threads that have ended included."""


GONE = CpuReading({}, 0.0)
"""The reading of a task that has ended, or that the kernel says nothing of; also the mark of a process
forked at a limit's start (it has waited for nothing yet)."""

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _read_small(path: str) -> bytes | None:
    try:
        fd = _open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _read(fd, 512)
    except OSError:
        return None
    finally:
        _close(fd)


def _after_name(stat: bytes) -> list[bytes]:
    # "pid (name) S ...": the name may hold spaces and parentheses; the fields follow its last ")".
    return stat.rpartition(b")")[2].split()


def _thread_cpu(task: str) -> ThreadCpu | None:
    """The thread whose ``/proc`` folder is ``task``, read now; None once it has ended, or where the kernel does not say."""
    schedstat, stat = _read_small(f"{task}/schedstat"), _read_small(f"{task}/stat")
    if schedstat is None or stat is None:
        return None
    fields = schedstat.split()
    if len(fields) < 3:
        return None
    return ThreadCpu(int(fields[1]) / 1e9, (int(fields[0]), int(fields[2])), _after_name(stat)[:1] == [b"R"])


def thread_reading(native_id: int) -> CpuReading:
    """Thread ``native_id`` of this process, read now."""
    thread = _thread_cpu(f"/proc/self/task/{native_id}")
    return GONE if thread is None else CpuReading({native_id: thread}, thread.ran[0] / 1e9)


def process_reading(pid: int) -> CpuReading:
    """Process ``pid`` and each of its threads, read now."""
    stat = _read_small(f"/proc/{pid}/stat")
    if stat is None:
        return GONE
    try:
        tasks = _listdir(f"/proc/{pid}/task")
    except OSError:
        return GONE
    threads = {}
    for task in tasks:
        thread = _thread_cpu(f"/proc/{pid}/task/{task}")
        if thread is not None:
            threads[int(task)] = thread
    fields = _after_name(stat)
    # utime and stime, in clock ticks: those of its threads that have ended are in them too.
    return CpuReading(threads, (int(fields[11]) + int(fields[12])) / _TICKS_PER_S)


def mark_delay_s(limit_s: float) -> float:
    """How long into a task with limit ``limit_s`` its waits are first read."""
    return min(MARK_AFTER_S, limit_s / 4)


def _ran_ns(mark: CpuReading, tid: int, thread: ThreadCpu) -> int:
    before = mark.threads.get(tid)
    return thread.ran[0] - (before.ran[0] if before is not None else 0)


def busiest(mark: CpuReading, now: CpuReading) -> int | None:
    """The thread that ran most between two readings, a ready one first among equals: the one that does the
    task's work (a process cannot be trusted to name it). None when the task has ended."""
    return max(now.threads, key=lambda tid: (_ran_ns(mark, tid, now.threads[tid]), now.threads[tid].ready), default=None)


def waited_since(mark: CpuReading, now: CpuReading) -> float:
    """What the task waited for a CPU between two readings: its busiest thread's waits that have ended
    (one that started since the mark counts whole), less what its other threads ran meanwhile: threads of
    one process that take the CPU from each other wait on themselves, not on the machine."""
    return _waited_by(mark, now, busiest(mark, now))


def _waited_by(mark: CpuReading, now: CpuReading, tid: int | None) -> float:
    if tid is None:
        return 0.0
    thread, before = now.threads[tid], mark.threads.get(tid)
    waited = thread.waited_s - (before.waited_s if before is not None else 0.0)
    others_ran = (now.ran_s - mark.ran_s) - _ran_ns(mark, tid, thread) / 1e9
    return max(0.0, waited - max(0.0, others_ran))


def _waits_now(before: CpuReading, now: CpuReading, tid: int | None) -> bool:
    """Whether the task waits for a CPU now: its busiest thread ``tid`` is ready at the reading ``now`` and
    nothing of the task has run since the reading ``before``."""
    return (tid is not None and now.threads[tid].ready and now.ran_s == before.ran_s and now.threads.keys() <= before.threads.keys()
            and all(before.threads[other].ran == thread.ran for other, thread in now.threads.items()))


class CpuWaitCredit:
    """The time a task has waited for a CPU since its mark: what a limit on it adds to its wall-clock deadline.

    ``read`` reads the task (:func:`thread_reading` or :func:`process_reading` bound to it). Until
    :meth:`take_mark`, the credit is 0; ``seconds`` is its value at the last :meth:`update`. Once the
    deadline it moves has come, :meth:`holds_off` says whether to look again before deciding.
    """

    __slots__ = ("read", "mark", "seconds", "last", "waiting", "unsure", "_looked_again")

    def __init__(self, read: Callable[[], CpuReading], mark: CpuReading | None = None) -> None:
        self.read = read
        self.mark = mark
        self.seconds = 0.0
        # The last reading; whether the task waited for a CPU at it, and whether it was ready and may have.
        self.last = mark
        self.waiting = False
        self.unsure = False
        self._looked_again = False

    def take_mark(self) -> None:
        """Count the waits from now on."""
        self.mark = self.last = self.read()

    def update(self) -> float:
        """Read the waits again: the credit now."""
        if self.mark is not None and self.last is not None:
            now = self.read()
            tid = busiest(self.mark, now)
            self.seconds = max(self.seconds, _waited_by(self.mark, now, tid))
            self.waiting = _waits_now(self.last, now, tid)
            # The thread that reads is running, not waiting.
            self.unsure = not self.waiting and tid is not None and now.threads[tid].ready and tid != _native_id()
            self.last = now
        return self.seconds

    def holds_off(self) -> bool:
        """Whether, with the deadline come at the last :meth:`update`, the task must be looked at again in
        ``RECHECK_S`` rather than found past its limit: it waits for a CPU now; or it is ready but ran
        since the reading before, which a reading ``RECHECK_S`` later tells apart (once: after it, a task
        that ran again is running)."""
        if self.waiting:
            self._looked_again = False
            return True
        if self.unsure and not self._looked_again:
            self._looked_again = True
            return True
        return False


class OwnTimeLimit:
    """``limit_s`` seconds of a task's own time, counted from ``start`` (``time.monotonic``).

    Ask :meth:`reached` as often as it suits (it reads ``/proc`` only at the mark and once the
    wall-clock deadline, moved by the waits seen so far, has come); :meth:`next_check` says when it is
    worth asking again. ``mark``: the task read at ``start``, where known (a process forked at
    ``start``: :data:`GONE`); otherwise it is read ``MARK_AFTER_S`` into it.
    """

    __slots__ = ("start", "limit_s", "credit", "mark_at", "recheck_at")

    def __init__(self, limit_s: float, read: Callable[[], CpuReading], start: float | None = None, mark: CpuReading | None = None) -> None:
        self.start = _monotonic() if start is None else start
        self.limit_s = limit_s
        self.credit = CpuWaitCredit(read, mark)
        self.mark_at = self.start + mark_delay_s(limit_s)
        # When to look again at a task found at its deadline waiting for a CPU (or perhaps): None otherwise.
        self.recheck_at: float | None = None

    @property
    def deadline(self) -> float:
        """The wall-clock time it is reached at, unless the task waits for a CPU from now on."""
        return self.start + self.limit_s + self.credit.seconds

    def reached(self, now: float | None = None) -> bool:
        """Whether the task has had ``limit_s`` of its own time by ``now``."""
        now = _monotonic() if now is None else now
        if self.recheck_at is not None:
            if now < self.recheck_at:
                return False
        elif now < self.deadline:
            if self.credit.mark is None and now >= self.mark_at:
                self.credit.take_mark()
            return False
        self.recheck_at = None
        self.credit.update()
        if now < self.deadline:
            return False
        if self.credit.holds_off():
            self.recheck_at = now + RECHECK_S
            return False
        return True

    def next_check(self) -> float:
        """When :meth:`reached` may next answer otherwise, or take the mark."""
        if self.recheck_at is not None:
            return self.recheck_at
        return self.mark_at if self.credit.mark is None and self.mark_at < self.deadline else self.deadline
