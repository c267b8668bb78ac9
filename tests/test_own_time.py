"""Time limits count a call's own time: what its thread waited for a CPU on a crowded machine does not
count, while running and blocking do. So a call slowed by other processes gets its whole limit, and a
loop or a sleep is still ended.

The crowd is real: busy processes pinned to the CPU the test's own thread is pinned to.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from envscaler.guard import TimeLimitExceeded, call_with_limit
from envscaler.own_time import GONE, RECHECK_S, CpuReading, CpuWaitCredit, OwnTimeLimit, ThreadCpu, process_reading, thread_reading, waited_since
from tests.support.crowding import BUSY_LOOP, one_crowded_cpu, starvation_problem, starved

pytestmark = pytest.mark.timeout(60)

LIMIT_S = 0.8
WORK_S = 0.3  # of CPU: on a CPU shared four ways, over a second on the clock
BUSY = 3


def work(cpu_seconds: float = WORK_S) -> float:
    """Compute until this thread has used ``cpu_seconds`` of CPU; the wall-clock time it took."""
    started = time.monotonic()
    until = time.thread_time() + cpu_seconds
    while time.thread_time() < until:
        pass
    return time.monotonic() - started


def on_a_thread(fn, *args):
    """``fn(*args)`` on a new thread (the guard's watchdog, not SIGALRM): what it returned or raised."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append((False, e))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


@pytest.mark.parametrize("where", ["main thread", "other thread"])
def test_a_call_slowed_by_a_crowded_cpu_is_not_ended_before_its_own_time_is_up(where):
    with one_crowded_cpu(BUSY):
        if where == "main thread":
            wall = call_with_limit(work, LIMIT_S)
        else:
            wall = on_a_thread(call_with_limit, work, LIMIT_S)
    # It ran past its limit on the clock (the crowd's doing), and was let finish.
    assert wall > LIMIT_S


@pytest.mark.parametrize("where", ["main thread", "other thread"])
def test_a_loop_on_a_crowded_cpu_is_still_ended_once_it_has_run_its_limit(where):
    def loop() -> None:
        while True:
            pass

    def timed() -> tuple[float, float]:
        started, cpu = time.monotonic(), time.thread_time()
        with pytest.raises(TimeLimitExceeded):
            call_with_limit(loop, LIMIT_S)
        return time.monotonic() - started, time.thread_time() - cpu

    with one_crowded_cpu(BUSY):
        wall, cpu = timed() if where == "main thread" else on_a_thread(timed)
    # Ended by what it ran, not by the clock: the clock alone would have stopped it with about a
    # quarter of that.
    assert cpu > LIMIT_S / 2
    assert wall > LIMIT_S


def test_a_sleep_counts_as_the_calls_own_time_on_a_crowded_cpu():
    with one_crowded_cpu(BUSY):
        started = time.monotonic()
        with pytest.raises(TimeLimitExceeded):
            call_with_limit(time.sleep, LIMIT_S, 100)
        assert time.monotonic() - started < LIMIT_S + 2


def test_the_waits_of_a_crowded_process_are_its_most_waited_threads():
    with one_crowded_cpu(BUSY):
        crowded = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        try:
            time.sleep(0.2)
            mark = process_reading(crowded.pid)
            assert list(mark.threads) == [crowded.pid]
            time.sleep(1.0)
            # Four runnable on one CPU: it waited about three quarters of that second.
            assert 0.4 < waited_since(mark, process_reading(crowded.pid)) <= 1.0
        finally:
            crowded.kill()
            crowded.wait()
    assert process_reading(crowded.pid) == GONE
    mine = threading.get_native_id()
    assert list(thread_reading(mine).threads) == [mine]


def held_to(limit: OwnTimeLimit, seconds: float) -> bool:
    """Whether ``limit`` stays unreached for ``seconds``, asked whenever it says it may answer otherwise."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if limit.reached():
            return False
        time.sleep(max(0.0, min(limit.next_check(), until) - time.monotonic()))
    return True


def seconds_to_reach(limit: OwnTimeLimit) -> float:
    started = time.monotonic()
    while not limit.reached():
        time.sleep(max(0.0, limit.next_check() - time.monotonic()))
    return time.monotonic() - started


@pytest.mark.skipif(starvation_problem() is not None, reason=str(starvation_problem()))
def test_a_process_kept_waiting_for_a_cpu_the_whole_while_is_not_past_its_limit_until_it_has_run_it():
    # The kernel counts a wait only once it ends: a process that never gets a CPU shows none.
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        time.sleep(0.3)
        with starved(loop.pid):
            limit = OwnTimeLimit(0.5, functools.partial(process_reading, loop.pid))
            assert held_to(limit, 3.0)
        # Let run, it loops, and is past its limit once it has run it.
        assert seconds_to_reach(limit) < 0.5 + 2.0
    finally:
        loop.kill()
        loop.wait()


STARVED_SIBLING = """
import os, threading
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
def kept_waiting():
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only
    while True:
        pass
threading.Thread(target=kept_waiting, daemon=True).start()
while True:
    pass
"""


def test_a_loop_with_a_sibling_kept_waiting_on_purpose_is_still_past_its_limit_in_time():
    # The sibling, at the lowest priority, waits nearly all the time behind the loop on their one CPU: counting
    # the most-waited thread's waits, the loop would never be past its limit.
    stuck = subprocess.Popen([sys.executable, "-c", STARVED_SIBLING])
    try:
        time.sleep(0.5)
        assert len(os.listdir(f"/proc/{stuck.pid}/task")) == 2
        assert seconds_to_reach(OwnTimeLimit(0.5, functools.partial(process_reading, stuck.pid))) < 0.5 + 2.0
    finally:
        stuck.kill()
        stuck.wait()


def test_a_stopped_process_is_past_its_limit_in_time():
    stopped = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        assert seconds_to_reach(OwnTimeLimit(0.5, functools.partial(process_reading, stopped.pid))) < 0.5 + 2 * RECHECK_S
    finally:
        stopped.kill()
        stopped.wait()


def asleep(waited_s: float, ran: int = 0) -> ThreadCpu:
    return ThreadCpu(waited_s, (ran, ran), ready=False)


def ready(waited_s: float, ran: int = 0) -> ThreadCpu:
    return ThreadCpu(waited_s, (ran, ran), ready=True)


def reading(threads: dict[int, ThreadCpu]) -> CpuReading:
    """A process of these threads, that ran what they ran."""
    return CpuReading(threads, sum(thread.ran[0] for thread in threads.values()) / 1e9)


def test_a_thread_that_started_since_the_mark_counts_whole_and_one_that_ended_keeps_its_credit():
    readings = iter([reading({1: asleep(5.0)}), reading({1: asleep(5.5), 2: ready(0.75)}), GONE])
    credit = CpuWaitCredit(lambda: next(readings))
    assert credit.update() == 0.0  # no mark yet
    credit.take_mark()
    assert credit.update() == 0.75
    assert credit.update() == 0.75


def test_a_thread_ready_that_has_not_run_since_the_last_reading_waits_for_a_cpu_now():
    readings = iter(reading(threads) for threads in [
        {1: asleep(0.0), 2: asleep(0.0, 5)},
        {1: ready(0.0), 2: asleep(0.0, 5)},  # 1 woke since, and has not run: it waits for a CPU now
        {1: ready(2.0, 1), 2: asleep(0.0, 5)},  # 1 got a CPU (the kernel adds its wait), and may be waiting again
        {1: ready(2.0, 2), 2: asleep(0.0, 5)},  # 1 ran again: a thread that keeps running is running
    ])
    credit = CpuWaitCredit(lambda: next(readings))
    credit.take_mark()
    assert credit.update() == 0.0
    assert credit.waiting and credit.holds_off()
    assert credit.update() == 2.0
    assert (credit.waiting, credit.unsure) == (False, True)
    assert credit.holds_off()  # once, to tell
    credit.update()
    assert (credit.waiting, credit.unsure) == (False, True)
    assert not credit.holds_off()


def test_a_limit_reads_the_waits_at_its_mark_and_at_its_deadline_only():
    reads: list[float] = []
    waits = {7: asleep(0.0)}

    def read():
        reads.append(time.monotonic())
        return reading(dict(waits))

    limit = OwnTimeLimit(2.0, read, start=100.0)
    assert limit.next_check() == 100.5
    assert not limit.reached(100.4) and reads == []
    assert not limit.reached(100.6) and len(reads) == 1  # the mark
    assert limit.next_check() == 102.0
    waits[7] = asleep(1.5, 1)
    assert not limit.reached(101.9) and len(reads) == 1
    assert not limit.reached(102.0) and len(reads) == 2
    assert limit.deadline == 103.5 and limit.next_check() == 103.5
    assert limit.reached(103.5)


def test_a_limit_is_not_reached_while_its_task_waits_for_a_cpu():
    waits = {7: ready(0.0)}
    limit = OwnTimeLimit(2.0, lambda: reading(dict(waits)), start=100.0)
    assert not limit.reached(100.5)  # the mark: ready, and it has not run since
    assert not limit.reached(102.0)
    assert limit.next_check() == 102.0 + RECHECK_S
    assert not limit.reached(102.0 + RECHECK_S) and not limit.reached(105.0)
    waits[7] = asleep(4.0, 1)  # it ran at last: the kernel counts the wait, and moves the limit by it
    assert not limit.reached(105.5) and limit.deadline == 106.0
    assert limit.reached(106.0)
