"""Time limits that count a task's own time: wall-clock time less the time it waited for a CPU.

On a machine with more runnable threads than cores (1,000 environments on 2 cores, a benchmark beside
other busy processes), a call that needs 5 ms of CPU can take seconds of wall-clock time, nearly all of
it in the kernel's run queue. A wall-clock limit would end that call, and replace the worker that runs
it, though nothing was stuck. The kernel counts, for each thread, how long it was ready to run but
waited for a CPU (the second field of ``/proc/<pid>/task/<tid>/schedstat``, in nanoseconds). A limit
here is reached when wall-clock time less that wait reaches it: running counts, and so does blocking (a
sleep, a lock, I/O: the task's own doing); waiting for a CPU does not. So a stuck task is still ended
(a loop runs whenever it gets a CPU, a sleep blocks), only later on a busy machine.

For a process, the wait is that of its thread that waited most since the mark (a request's limit counts
the thread that runs it, which the process cannot be trusted to name). A sum over threads would count
one starved second once per thread, and let a stuck process outlive any limit on a busy machine.

Reading ``/proc`` costs a few microseconds, so a limit is a wall-clock deadline first. The waits are
read once the task has run ``MARK_AFTER_S`` (the mark: waits before it count as the task's own time,
which only makes the limit stricter), and again each time the deadline, moved later by the waits
since the mark, comes. Where the kernel does not count waits (no ``/proc``, no scheduler statistics), a
limit is wall-clock time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# Bound now: environment code that runs in this process may replace the module attributes.
_open, _read, _close, _listdir, _monotonic = os.open, os.read, os.close, os.listdir, time.monotonic

MARK_AFTER_S = 0.5
"""How long a task runs before its waits are first read (at most a quarter of its limit: :func:`mark_delay_s`)."""

CpuWaits = dict[int, float]
"""Seconds each thread (by the operating system's id) has waited for a CPU since it started."""


def _waited_s(path: str) -> float | None:
    try:
        fd = _open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fields = _read(fd, 128).split()
    except OSError:
        return None
    finally:
        _close(fd)
    return int(fields[1]) / 1e9 if len(fields) >= 2 else None


def thread_waits(native_id: int) -> CpuWaits:
    """How long thread ``native_id`` of this process has waited for a CPU (empty once it has ended, or
    where the kernel does not say)."""
    waited = _waited_s(f"/proc/self/task/{native_id}/schedstat")
    return {} if waited is None else {native_id: waited}


def process_waits(pid: int) -> CpuWaits:
    """How long each thread of process ``pid`` has waited for a CPU (empty once it has ended, or where
    the kernel does not say)."""
    try:
        threads = _listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    waits: CpuWaits = {}
    for thread in threads:
        waited = _waited_s(f"/proc/{pid}/task/{thread}/schedstat")
        if waited is not None:
            waits[int(thread)] = waited
    return waits


def mark_delay_s(limit_s: float) -> float:
    """How long into a task with limit ``limit_s`` its waits are first read."""
    return min(MARK_AFTER_S, limit_s / 4)


def waited_since(mark: CpuWaits, now: CpuWaits) -> float:
    """How long the thread that waited most between two readings waited (one that started since the
    mark counts whole)."""
    return max((waited - mark.get(thread, 0.0) for thread, waited in now.items()), default=0.0)


class CpuWaitCredit:
    """The time a task has waited for a CPU since its mark: what a limit on it adds to its wall-clock deadline.

    ``read`` gives the task's waits (:func:`thread_waits` or :func:`process_waits` bound to it). Until
    :meth:`take_mark`, the credit is 0; ``seconds`` is its value at the last :meth:`update`.
    """

    __slots__ = ("read", "mark", "seconds")

    def __init__(self, read: Callable[[], CpuWaits], mark: CpuWaits | None = None) -> None:
        self.read = read
        self.mark = mark
        self.seconds = 0.0

    def take_mark(self) -> None:
        """Count the waits from now on."""
        self.mark = self.read()

    def update(self) -> float:
        """Read the waits again: the credit now."""
        if self.mark is not None:
            self.seconds = max(self.seconds, waited_since(self.mark, self.read()))
        return self.seconds


class OwnTimeLimit:
    """``limit_s`` seconds of a task's own time, counted from ``start`` (``time.monotonic``).

    Ask :meth:`reached` as often as it suits (it reads ``/proc`` only at the mark and once the
    wall-clock deadline, moved by the waits seen so far, has come); :meth:`next_check` says when it is
    worth asking again. ``mark``: the task's waits at ``start``, where known (a process forked at
    ``start``: ``{}``); otherwise they are read ``MARK_AFTER_S`` into it.
    """

    __slots__ = ("start", "limit_s", "credit", "mark_at")

    def __init__(self, limit_s: float, read: Callable[[], CpuWaits], start: float | None = None, mark: CpuWaits | None = None) -> None:
        self.start = _monotonic() if start is None else start
        self.limit_s = limit_s
        self.credit = CpuWaitCredit(read, mark)
        self.mark_at = self.start + mark_delay_s(limit_s)

    @property
    def deadline(self) -> float:
        """The wall-clock time it is reached at, unless the task waits for a CPU from now on."""
        return self.start + self.limit_s + self.credit.seconds

    def reached(self, now: float | None = None) -> bool:
        """Whether the task has had ``limit_s`` of its own time by ``now``."""
        now = _monotonic() if now is None else now
        if now < self.deadline:
            if self.credit.mark is None and now >= self.mark_at:
                self.credit.take_mark()
            return False
        self.credit.update()
        return now >= self.deadline

    def next_check(self) -> float:
        """When :meth:`reached` may next answer otherwise, or take the mark."""
        return self.mark_at if self.credit.mark is None and self.mark_at < self.deadline else self.deadline
