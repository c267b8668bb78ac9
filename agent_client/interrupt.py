"""How the harness's commands run their async work: on uvloop, with fewer garbage collections, stopped
cleanly by Ctrl-C."""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def interruptible(work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` and return what it returns; on SIGINT cancel it through anyio (its live episodes are
    ended, shielded) and raise KeyboardInterrupt once it has stopped.

    asyncio's own Ctrl-C handling cancels the main task natively, and a cancel scope inside the work can
    take that cancellation for its own: the run then goes on as if nothing happened.
    """
    interrupted = False
    result: list[T] = []
    try:
        async with anyio.create_task_group() as tasks:

            async def watch() -> None:
                nonlocal interrupted
                with anyio.open_signal_receiver(signal.SIGINT) as signals:
                    async for _ in signals:
                        interrupted = True
                        tasks.cancel_scope.cancel()
                        return

            tasks.start_soon(watch)
            result.append(await work())
            tasks.cancel_scope.cancel()  # done: stop watching
    except BaseExceptionGroup as group:
        # The work's own error (a usage error, say) is the caller's to see, not a group around it.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    if interrupted or not result:
        raise KeyboardInterrupt
    return result[0]


COLLECTOR_THRESHOLDS = (10_000, 10, 10)
"""The garbage collector's thresholds while a command's work runs (Python's: 700, 10, 10). A run
allocates hundreds of objects per tool step, most freed at once, some in reference cycles (asyncio's
tasks, exceptions). With Python's thresholds, a run of 3,120 episodes (17,000 tool steps) on 2 cores
collected 850 times, 1.1 s of its 11.7 s of CPU, its full collections walking every record score it
keeps; with these, 150 times, 0.25 s."""


def run_interruptible(work: Callable[[], Awaitable[T]]) -> T:
    """:func:`interruptible` ``work`` in a new event loop: uvloop's (a third less CPU per request than
    asyncio's own), except on Windows, which it does not support; under :data:`COLLECTOR_THRESHOLDS`."""
    before = gc.get_threshold()
    gc.set_threshold(*COLLECTOR_THRESHOLDS)
    try:
        return anyio.run(interruptible, work, backend_options={"use_uvloop": sys.platform != "win32"})
    finally:
        gc.set_threshold(*before)
