"""A CPU kept busy by other processes: what a test's code runs on to see a machine short of CPU."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def one_crowded_cpu(busy: int) -> Iterator[int]:
    """Pin the calling thread, and whatever it starts from now on, to one CPU that ``busy`` looping
    processes share with it; its CPU. Each loop is a session of its own, as is a server a test starts: where
    the kernel shares a CPU between sessions first (its autogroups), each still gets about 1 / (busy + 1) of it."""
    before = os.sched_getaffinity(0)
    cpu = max(before)
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True) for _ in range(busy)]
    try:
        for loop in loops:
            os.sched_setaffinity(loop.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        yield cpu
    finally:
        os.sched_setaffinity(0, before)
        for loop in loops:
            loop.kill()
            loop.wait()
