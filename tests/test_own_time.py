"""Time limits count a call's own time: what its thread waited for a CPU on a crowded machine does not
count, while running and blocking do. So a call slowed by other processes gets its whole limit, and a
loop or a sleep is still ended.

The crowd is real: busy processes pinned to the CPU the test's own thread is pinned to.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from envscaler.guard import TimeLimitExceeded, call_with_limit
from envscaler.own_time import CpuWaitCredit, OwnTimeLimit, process_waits, thread_waits, waited_since
from tests.support.crowding import BUSY_LOOP, one_crowded_cpu

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
            mark = process_waits(crowded.pid)
            assert list(mark) == [crowded.pid]
            time.sleep(1.0)
            # Four runnable on one CPU: it waited about three quarters of that second.
            assert 0.4 < waited_since(mark, process_waits(crowded.pid)) <= 1.0
        finally:
            crowded.kill()
            crowded.wait()
    assert process_waits(crowded.pid) == {}
    mine = threading.get_native_id()
    assert list(thread_waits(mine)) == [mine]


def test_a_thread_that_started_since_the_mark_counts_whole_and_one_that_ended_keeps_its_credit():
    readings = iter([{1: 5.0}, {1: 5.5, 2: 0.75}, {}])
    credit = CpuWaitCredit(lambda: next(readings))
    assert credit.update() == 0.0  # no mark yet
    credit.take_mark()
    assert credit.update() == 0.75
    assert credit.update() == 0.75


def test_a_limit_reads_the_waits_at_its_mark_and_at_its_deadline_only():
    reads: list[float] = []
    waits = {7: 0.0}

    def read():
        reads.append(time.monotonic())
        return dict(waits)

    limit = OwnTimeLimit(2.0, read, start=100.0)
    assert limit.next_check() == 100.5
    assert not limit.reached(100.4) and reads == []
    assert not limit.reached(100.6) and len(reads) == 1  # the mark
    assert limit.next_check() == 102.0
    waits[7] = 1.5
    assert not limit.reached(101.9) and len(reads) == 1
    assert not limit.reached(102.0) and len(reads) == 2
    assert limit.deadline == 103.5 and limit.next_check() == 103.5
    assert limit.reached(103.5)
