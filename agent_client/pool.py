"""``envscaler run --procs N``: a run's episodes spread over N worker processes, one writer of its records.

One harness process spends its CPU on HTTP, JSON and pydantic for every tool step, so past a thousand
or two steps per second a run is limited by that one core. Here each worker (``agent_client.worker``)
runs a share of the episodes, and this process stays the only writer of the output file, the one
progress display and the one summary: workers send every record back as a line, written here whole
(with its score beside it, so that it is never parsed here).

The workers are started before the run lists its scenarios, so that each imports the harness (most
of a second) meanwhile; they get their setup once the jobs are known, and those the jobs leave without
work are stopped. Jobs are handed out one at a time: each worker starts with its part of
``concurrency`` and gets the next job when an episode of its own ends, so a slow worker takes fewer and
the run's concurrency holds.
A worker that dies is reported on stderr, and each episode it had in flight is recorded as an infra
error (a rerun runs it again); the others take over what was still waiting. On Ctrl-C (or a record
that cannot be written) every worker is interrupted, ends its live episodes, and the records of the
episodes that finished meanwhile are still written.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

import agent_client
from agent_client.agents import Agent
from agent_client.errors import HarnessError, WorkersLost
from agent_client.models import Record, RecordScore
from agent_client.runner import RecordSink, RunOptions, record_entry
from agent_client.worker import WorkerSetup, job_line
from envscaler.wire import FarmCatalog, ScenarioSummary

# A record line longer than this is taken for a broken worker (a record is rarely above a few MB).
_MAX_RECORD_BYTES = 1 << 30
# How long interrupted workers get to end their live episodes (each end waits 10 s at most) before they are killed.
_STOP_GRACE_S = 20.0

Key = tuple[str, str, int]


def default_procs() -> int:
    """Worker processes for this machine: one per 4 usable cores, since the environment servers of a farm
    on the same machine need about three cores for each that the harness uses; 1 (no worker processes,
    which is faster there) below 8 cores."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, usable // 4)


def _describe_end(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"was killed by signal {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


class _Worker:
    """One worker process and the jobs it has in flight."""

    def __init__(self, number: int, process: Process) -> None:
        self.number, self.process = number, process
        assert process.stdout is not None and process.stdin is not None
        self.lines = BufferedByteReceiveStream(process.stdout)
        self.in_flight: dict[Key, tuple[ScenarioSummary, int, float]] = {}
        self.closed = False

    @property
    def name(self) -> str:
        return f"worker {self.number} (pid {self.process.pid})"

    async def send(self, scenario: ScenarioSummary, repeat: int, index: int) -> None:
        """Hand it a job. The job is its own from now on: should it have died, the job is recorded with
        the others it had in flight once its end is seen."""
        self.in_flight[(scenario.env_id, scenario.task_id, repeat)] = (scenario, repeat, time.time())
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self.process.stdin.send(job_line(index, repeat))  # type: ignore[union-attr]

    async def close(self) -> None:
        """No more jobs: it exits once those in flight have ended."""
        if not self.closed:
            self.closed = True
            await self.process.stdin.aclose()  # type: ignore[union-attr]

    async def next_record(self) -> tuple[RecordScore, bytes] | None:
        """The score and line of the next record it sends back; None once it has ended (or sent something else)."""
        try:
            head = await self.lines.receive_until(b"\n", _MAX_RECORD_BYTES)
            line = await self.lines.receive_until(b"\n", _MAX_RECORD_BYTES)
        except (anyio.IncompleteRead, anyio.EndOfStream, anyio.DelimiterNotFound, anyio.BrokenResourceError):
            return None
        try:
            parsed = RecordScore.model_validate_json(head)
        except ValueError as e:
            print(f"envscaler run: {self.name} sent a line that is no record score ({e}); it is stopped", file=sys.stderr)
            self.kill()
            return None
        self.in_flight.pop((parsed.env_id, parsed.task_id, parsed.repeat), None)
        return parsed, line + b"\n"

    def interrupt(self) -> None:
        """Ask it to end its live episodes and exit (what Ctrl-C does to a single-process run)."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGINT)

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


async def spawn_workers(procs: int) -> list[_Worker]:
    """Start ``procs`` worker processes, which import the harness and then wait for their setup
    (:func:`run_in_processes` sends it): started before the run lists its scenarios, they import meanwhile."""
    # The workers import the harness from where this process imported it (a source tree, say), not
    # from wherever their own sys.path would find another copy first.
    root = str(Path(agent_client.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    workers: list[_Worker] = []
    try:
        for number in range(1, procs + 1):
            # A session of its own: the terminal's Ctrl-C reaches this process alone, which interrupts the workers.
            process = await anyio.open_process([sys.executable, "-m", "agent_client.worker"], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=None, env=env, start_new_session=True)
            workers.append(_Worker(number, process))
    except BaseException:
        await dismiss(workers)
        raise
    return workers


async def dismiss(workers: list[_Worker]) -> None:
    """Stop workers that were given no setup (the run failed before, or has fewer jobs than workers)."""
    with anyio.CancelScope(shield=True):
        for worker in workers:
            worker.kill()
            await worker.process.aclose()


async def run_in_processes(catalog: FarmCatalog, make_agent: Callable[[], Agent], agent: Agent,
                           jobs: list[tuple[ScenarioSummary, int]], options: RunOptions, workers: list[_Worker],
                           sink: RecordSink) -> None:
    """Run ``jobs`` in ``workers`` (from :func:`spawn_workers`, now this function's to stop), ``options.concurrency``
    episodes at once in all; every record into ``sink``. WorkersLost when every worker died with jobs still waiting."""
    procs = len(workers)
    scenarios = list({(s.env_id, s.task_id): s for s, _ in jobs}.values())
    index = {(s.env_id, s.task_id): number for number, s in enumerate(scenarios)}
    try:
        setup = WorkerSetup(catalog, make_agent, options, scenarios).encode()
        # All at once: a worker reads its setup only once it has imported the harness, and a setup larger
        # than the pipe holds would otherwise make each worker's start wait for the last's.
        async with anyio.create_task_group() as sending:
            for worker in workers:
                sending.start_soon(worker.process.stdin.send, setup)  # type: ignore[union-attr]
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        await dismiss(workers)
        raise HarnessError(f"--procs {procs}: the agent factory cannot be sent to a worker process ({e}); give a "
                           "class or a functools.partial of one defined at module level, or run with --procs 1") from None
    except BaseException:
        await dismiss(workers)
        raise
    waiting = deque(jobs)
    stopping = False

    async def dispatch(worker: _Worker) -> None:
        """Give ``worker`` the next waiting job, or tell it there are none left."""
        if waiting and not stopping:
            scenario, repeat = waiting.popleft()
            await worker.send(scenario, repeat, index[(scenario.env_id, scenario.task_id)])
        else:
            await worker.close()

    async def serve(worker: _Worker, share: int) -> None:
        nonlocal stopping
        for _ in range(share):
            await dispatch(worker)
        while (received := await worker.next_record()) is not None:
            if not sink.write(*received):
                stopping = True  # no room for records: stop the run, as a single-process run does
                tasks.cancel_scope.cancel()
                return
            await dispatch(worker)
        await worker.process.wait()
        if worker.in_flight or worker.process.returncode != 0:
            # The jobs still waiting go to the workers alive, which take the next one as each episode ends.
            _lost(worker, agent, sink)

    try:
        async with anyio.create_task_group() as tasks:
            for number, worker in enumerate(workers):
                share = options.concurrency // procs + (number < options.concurrency % procs)
                tasks.start_soon(serve, worker, share)
    finally:
        stopping = True
        with anyio.CancelScope(shield=True):
            await _stop(workers, sink)
    if waiting and not sink.unwritable:
        raise WorkersLost(f"every worker process died; {len(waiting)} episode(s) were not run and "
                          f"{len(sink.scores)} record(s) of this run are written, whole: run the same command again "
                          "to run the rest (or with --procs 1)")


def _lost(worker: _Worker, agent: Agent, sink: RecordSink) -> None:
    """Report a worker that died, and record each episode it had in flight as an infra error."""
    ended = _describe_end(worker.process.returncode)
    print(f"envscaler run: {worker.name} {ended} with {len(worker.in_flight)} episode(s) in flight; they are "
          "recorded as infra errors, which a rerun of the same command runs again", file=sys.stderr)
    now = time.time()
    for scenario, repeat, started in worker.in_flight.values():
        record = Record(env_id=scenario.env_id, task_id=scenario.task_id, repeat=repeat, agent=agent.name, model=agent.model,
                        termination="infra_error", started_at=started, duration_s=now - started,
                        error=f"the harness's {worker.name} running this episode {ended}")
        if not sink.write(*record_entry(record)):
            break
    worker.in_flight.clear()


async def _stop(workers: list[_Worker], sink: RecordSink) -> None:
    """Interrupt the workers still running, write the records they finish meanwhile, kill those that
    outlast the grace period."""
    running = [w for w in workers if w.process.returncode is None]
    for worker in running:
        worker.interrupt()

    async def drain(worker: _Worker) -> None:
        while (received := await worker.next_record()) is not None:
            sink.write(*received)
        await worker.process.wait()

    with anyio.move_on_after(_STOP_GRACE_S):
        async with anyio.create_task_group() as draining:
            for worker in running:
                draining.start_soon(drain, worker)
    for worker in workers:
        worker.kill()
        await worker.process.aclose()
