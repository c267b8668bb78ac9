"""One worker process of ``envscaler run --procs N``: runs the episodes its parent hands it, sends back their records.

The parent (``agent_client.pool``) starts ``python -m agent_client.worker`` and writes on its stdin a
:class:`WorkerSetup` (length-prefixed pickle: the agent factory is code, not data), then one job per
line (``INDEX REPEAT``: the scenario's place in ``WorkerSetup.scenarios`` and the repeat). The worker
runs every job as it arrives (the parent keeps the number in flight to the run's concurrency), and
writes each episode on stdout as two lines: its ``RecordScore`` as JSON, then its JSONL record, whole (the
parent writes those bytes to the output file without parsing them again). Closing stdin means "no more jobs":
the worker finishes those in flight and exits 0. SIGINT (the parent's Ctrl-C, forwarded: the worker
runs in a session of its own, out of the terminal's reach) ends the episodes in flight without a
record, as a single-process run does, and exits 130.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from agent_client.agents import Agent
from agent_client.interrupt import run_interruptible
from agent_client.remote import EnvControl, new_http_client
from agent_client.runner import RunOptions, record_entry, run_episode
from envscaler.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from envscaler.sandbox import die_with_parent
from envscaler.wire import FarmCatalog, ScenarioSummary

_LENGTH = struct.Struct(">Q")


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker needs besides its jobs: the farm, the agent and the run's options."""

    catalog: FarmCatalog
    make_agent: Callable[[], Agent]
    options: RunOptions
    scenarios: list[ScenarioSummary]

    def encode(self) -> bytes:
        """The setup as the first bytes of a worker's stdin; PicklingError when the agent factory cannot travel."""
        data = pickle.dumps(self)
        return _LENGTH.pack(len(data)) + data


def job_line(index: int, repeat: int) -> bytes:
    """The stdin line of one job: scenario ``index`` of the setup, repeat ``repeat``."""
    return f"{index} {repeat}\n".encode()


async def _serve(jobs: asyncio.StreamReader, records_fd: int) -> None:
    """Read the setup, then run each job as its line arrives until stdin closes, each record to ``records_fd``."""
    (size,) = _LENGTH.unpack(await jobs.readexactly(_LENGTH.size))
    setup: WorkerSetup = pickle.loads(await jobs.readexactly(size))
    agent = setup.make_agent()
    async with new_http_client() as http:
        controls = {env_id: EnvControl(http, env_id, endpoint) for env_id, endpoint in setup.catalog.envs.items()}
        async with anyio.create_task_group() as tasks:

            async def one(scenario: ScenarioSummary, repeat: int) -> None:
                record = await run_episode(http, controls[scenario.env_id], scenario, repeat, agent, setup.options)
                score, line = record_entry(record)
                try:
                    _write_all(records_fd, score.model_dump_json().encode() + b"\n" + line)
                except BrokenPipeError:
                    # The parent is gone: nobody will write these records; end the episodes in flight.
                    tasks.cancel_scope.cancel()

            # A line without its "\n" is one the parent was stopped in the middle of writing: no job.
            while (line := await jobs.readline()).endswith(b"\n"):
                index, repeat = map(int, line.split())
                tasks.start_soon(one, setup.scenarios[index], repeat)


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` whole; a blocking write, so a parent that reads slowly slows the episodes down."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def _main() -> None:
    loop = asyncio.get_running_loop()
    jobs = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(jobs), sys.stdin.buffer)
    # Records go to the original stdout alone; anything else printed (a library's warning) goes to stderr.
    records_fd = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    os.set_blocking(records_fd, True)
    await _serve(jobs, records_fd)


def main() -> int:
    """Entry point of ``python -m agent_client.worker``: the exit status (0, 130 when interrupted, 1 on failure)."""
    # Only the parent writes the records: once it is gone (killed), the episodes in flight are ended at
    # once, as on Ctrl-C, rather than run to their end for nobody. (A parent gone before this line sent no setup.)
    die_with_parent(signal.SIGINT)
    try:
        run_interruptible(_main)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the parent reports the worker's end; this line says why
        print(f"envscaler run worker {os.getpid()}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    status = main()
    # Every record is written (os.write) and every episode ended: tearing the interpreter down object by
    # object would only keep the run waiting for this process at its end (about 60 ms on 2 cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
