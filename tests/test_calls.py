"""The server's call runner: results in order, slow calls handed over, stuck calls abandoned on time."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from servers.episodes.calls import CallRunner
from servers.errors import CallAbandoned, Overloaded

pytestmark = pytest.mark.anyio



async def test_results_and_exceptions_come_back_to_their_callers():
    runner = CallRunner("test")
    results: dict[int, object] = {}

    async def one(n: int) -> None:
        results[n] = await runner.run(lambda: (n, threading.current_thread().name), 5)

    async with anyio.create_task_group() as tasks:
        for n in range(50):
            tasks.start_soon(one, n)
    assert [results[n][0] for n in range(50)] == list(range(50))
    assert all(name == "test-calls" for _, name in results.values())  # never on the event loop
    with pytest.raises(ZeroDivisionError):
        await runner.run(lambda: 1 / 0, 5)


async def test_a_slow_call_does_not_hold_up_the_next_one():
    runner = CallRunner("test", handover_after_s=0.05)
    finished: dict[str, float] = {}
    started = time.monotonic()

    async def call(name: str, seconds: float) -> None:
        await runner.run(lambda: time.sleep(seconds), 5)
        finished[name] = time.monotonic() - started

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(call, "slow", 1.0)
        await anyio.sleep(0.01)
        tasks.start_soon(call, "fast", 0)
    assert finished["fast"] < 0.5 < 1.0 <= finished["slow"]
    await anyio.sleep(0.1)
    assert runner.threads == 1  # the retired worker left once its call ended


async def test_a_stuck_call_is_abandoned_at_its_limit():
    runner = CallRunner("test", handover_after_s=0.05)
    started = time.monotonic()
    with pytest.raises(CallAbandoned):
        await runner.run(lambda: time.sleep(1.5), 0.2)
    assert time.monotonic() - started < 0.6
    assert runner.abandoned == 1
    assert await runner.run(lambda: "still serving", 1) == "still serving"


async def test_stuck_threads_are_bounded_and_calls_resume_when_they_end():
    runner = CallRunner("test", handover_after_s=0.02, max_threads=2, wait_s=0.2)

    async def stuck() -> None:
        with pytest.raises(CallAbandoned):
            await runner.run(lambda: time.sleep(1.0), 0.3)

    ran = []
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(stuck)
        tasks.start_soon(stuck)
        await anyio.sleep(0.1)
        assert runner.threads == 2 and runner.exhausted
        # No thread takes it within the wait: refused, and never run, though a thread comes free later.
        with pytest.raises(Overloaded):
            await runner.run(lambda: ran.append("no thread left for me"), 0.2)
    assert runner.threads <= 2 and runner.refused == 1
    await anyio.sleep(1.0)
    assert not runner.exhausted
    assert await runner.run(lambda: "served again", 1) == "served again"
    assert ran == []


async def test_a_call_limit_runs_from_its_start_not_while_it_waits_for_a_thread():
    runner = CallRunner("test", max_threads=1)
    results = []

    async def slow(number: int) -> None:
        results.append(await runner.run(lambda: time.sleep(0.15) or number, 0.3))

    # One thread: the last calls wait twice their limit before they start, and each runs within it.
    async with anyio.create_task_group() as tasks:
        for number in range(5):
            tasks.start_soon(slow, number)
    assert sorted(results) == list(range(5))
    assert runner.abandoned == 0 and runner.refused == 0


def test_a_call_thread_that_python_says_has_ended_stays_ours_while_the_system_still_lists_it():
    # On a busy machine that moment is long enough for a worker's thread watch to take it for a thread
    # that environment code left running, and end the worker.
    class Ended:
        def __init__(self, native_id: int) -> None:
            self.native_id = native_id

        def is_alive(self) -> bool:
            return False

    runner = CallRunner("test")
    listed, gone = threading.get_native_id(), 4_000_000_000
    runner._ending = [Ended(listed), Ended(gone)]
    assert runner.thread_ids() == {listed}
    assert [thread.native_id for thread in runner._ending] == [listed]
