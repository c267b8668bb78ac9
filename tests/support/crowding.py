"""A CPU kept busy by other processes: what a test's code runs on to see a machine short of CPU."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def one_crowded_cpu(busy: int) -> Iterator[int]:
    """Pin the calling thread, and whatever it starts from now on, to one CPU that ``busy`` looping
    processes share with it; its CPU. Each loop is a session of its own, as is a server a test starts: where
    the kernel shares a CPU between sessions first (its autogroups), each still gets about 1 / (busy + 1) of it."""
    before = os.sched_getaffinity(0)
    with _busy_loops(busy) as cpu:
        os.sched_setaffinity(0, {cpu})
        try:
            yield cpu
        finally:
            os.sched_setaffinity(0, before)


@contextlib.contextmanager
def _busy_loops(busy: int) -> Iterator[int]:
    """``busy`` looping processes, each a session of its own, pinned to one CPU (this thread's last); that CPU."""
    cpu = max(os.sched_getaffinity(0))
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True) for _ in range(busy)]
    try:
        for loop in loops:
            os.sched_setaffinity(loop.pid, {cpu})
        yield cpu
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def starvation_problem() -> str | None:
    """Why :func:`starved` cannot work here (it needs root and a CPU controller of control groups), or None."""
    if os.geteuid() != 0:
        return "starving a process of CPU takes a control group of its own, which needs root"
    if _cpu_parent(os.getpid()) is None:
        return "no CPU controller of control groups to starve a process with"
    return None


@contextlib.contextmanager
def starved(pid: int, busy: int = 7) -> Iterator[None]:
    """Keep process ``pid`` waiting for a CPU while inside: it is moved to a control group of its own with the
    least CPU weight the kernel allows, under the one it was in, and pinned with ``busy`` looping processes to
    one CPU. Ready to run, it gets a few milliseconds every few seconds (weight 2 against their 1,024 each). After,
    it is moved back and the group removed."""
    parent = _cpu_parent(pid)
    assert parent is not None, starvation_problem()
    directory, weight_file, weight = parent
    group = directory / f"envscaler-starved-{pid}"
    group.mkdir()
    pinned: dict[int, set[int]] = {}
    try:
        with _busy_loops(busy) as cpu:
            (group / weight_file).write_text(weight)
            (group / "cgroup.procs").write_text(str(pid))
            try:
                for thread in os.listdir(f"/proc/{pid}/task"):
                    pinned[int(thread)] = os.sched_getaffinity(int(thread))
                    os.sched_setaffinity(int(thread), {cpu})
                yield
            finally:
                with contextlib.suppress(OSError):  # it may have ended meanwhile
                    (directory / "cgroup.procs").write_text(str(pid))
                    for thread, cpus in pinned.items():
                        os.sched_setaffinity(thread, cpus)
    finally:
        group.rmdir()


def _cpu_parent(pid: int) -> tuple[Path, str, str] | None:
    """Where ``pid``'s CPU control group is, the file that sets a group's CPU weight and its lowest value:
    cgroup v1's cpu hierarchy, or v2's unified one where its cpu controller is enabled for children."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            directory = Path("/sys/fs/cgroup/cpu") / path.lstrip("/")
            if (directory / "cpu.shares").exists() and os.access(directory, os.W_OK):
                return directory, "cpu.shares", "2"
        elif controllers == "":
            directory = Path("/sys/fs/cgroup") / path.lstrip("/")
            enabled = (directory / "cgroup.subtree_control")
            if enabled.exists() and "cpu" in enabled.read_text().split() and os.access(directory, os.W_OK):
                return directory, "cpu.weight", "1"
    return None
