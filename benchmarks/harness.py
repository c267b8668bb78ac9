"""Harness cost: CPU time of the harness per tool step, and steps/s, with one process and with worker processes.

Starts a process farm of the bundled catalog (``envscaler farm up --backend process``), then runs the
replay agent over every scenario once to warm it up, then ``--repeats`` times with 64 episodes at once, first in one process
(``--procs 1``, the baseline) and then spread over ``--procs`` worker processes, on the same farm. The
harness CPU time is that of this process plus its worker processes (user + system, everything
included: episode creation, MCP calls, validation, trajectory fetch, sending records to the writer,
JSONL writing), divided by the number of tool steps. The servers run in their own processes and are
not counted; on a small machine they share its cores with the harness.

    python benchmarks/harness.py [--repeats 10] [--concurrency 64] [--procs 2]

Targets: 0.5 ms of harness CPU per tool step or less in one process; every episode written once and
scored 1.0 in both runs. Exits 1 when one is missed.
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import anyio

from common import Verdict, argument_parser, envscaler, report

from agent_client.agents import ReplayAgent
from agent_client.models import load_farm_catalog
from agent_client.pool import default_procs
from agent_client.runner import RunOptions, run
from envscaler.wire import FarmCatalog

TARGET_MS = 0.5


class Measured(NamedTuple):
    procs: int
    episodes: int
    distinct: int
    perfect: int
    steps: int
    cpu_s: float
    # Of cpu_s, what this process spent (with --procs above 1: listing, dispatching, writing the records).
    own_cpu_s: float
    wall_s: float

    @property
    def per_step_ms(self) -> float:
        return self.cpu_s / self.steps * 1e3

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(catalog: FarmCatalog, out: Path, procs: int, repeats: int, concurrency: int) -> Measured:
    """One run of every scenario ``repeats`` times in ``procs`` processes: its steps, CPU (this process and
    the workers it waited for) and wall time."""
    options = RunOptions(repeats=repeats, concurrency=concurrency, progress=False, procs=procs)
    cpu, children, wall = time.process_time(), _children_cpu(), time.perf_counter()
    records = anyio.run(lambda: run(catalog, ReplayAgent, out, options=options), backend_options={"use_uvloop": True})
    own = time.process_time() - cpu
    wall = time.perf_counter() - wall
    return Measured(procs, len(records), len({(r.env_id, r.task_id, r.repeat) for r in records}),
                    sum(r.reward == 1.0 for r in records), sum(r.steps for r in records),
                    own + _children_cpu() - children, own, wall)


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=10, help="runs per scenario (default: 10)")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes at once, all processes together (default: 64)")
    parser.add_argument("--procs", type=int, default=2, help="worker processes of the second run (default: 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="envscaler-bench-") as scratch:
        catalog_file = Path(scratch) / "farm.json"
        envscaler("farm", "up", "--backend", "process", "--catalog", str(catalog_file))
        try:
            catalog = load_farm_catalog(catalog_file)
            # Untimed: a farm's first episodes start its environment workers, which would count against the baseline.
            measure(catalog, Path(scratch) / "warm-up.jsonl", 1, 1, args.concurrency)
            runs = [measure(catalog, Path(scratch) / f"procs{procs}.jsonl", procs, args.repeats, args.concurrency)
                    for procs in (1, args.procs)]
        finally:
            envscaler("farm", "down", "--catalog", str(catalog_file))
    baseline, spread = runs
    print(f"concurrency {args.concurrency}; --procs default on this machine: {default_procs()}")
    for m in runs:
        print(f"--procs {m.procs}: {m.episodes} episodes ({m.perfect} scored 1.0), {m.steps} tool steps; harness CPU "
              f"{m.cpu_s:.2f} s ({m.own_cpu_s:.2f} s of it in the run's own process) -> {m.per_step_ms:.3f} ms per tool step; {m.steps_per_s:.0f} tool steps/s, "
              f"{m.episodes / m.wall_s:.1f} episodes/s (wall {m.wall_s:.1f} s)")
    print(f"--procs {spread.procs} against --procs 1: {spread.steps_per_s / baseline.steps_per_s:.2f}x the steps/s, "
          f"{spread.per_step_ms / baseline.per_step_ms:.2f}x the harness CPU per step (servers share this machine's cores)")
    expected = baseline.episodes
    return report([
        Verdict("harness CPU per tool step, --procs 1", f"{baseline.per_step_ms:.3f} ms", f"<= {TARGET_MS} ms",
                baseline.per_step_ms <= TARGET_MS),
        *(Verdict(f"episodes written once, --procs {m.procs}", f"{m.distinct}/{m.episodes}", f"{expected}",
                  m.distinct == m.episodes == expected) for m in runs),
        *(Verdict(f"episodes scored 1.0, --procs {m.procs}", f"{m.perfect}/{m.episodes}", "all", m.perfect == m.episodes)
          for m in runs),
    ])


if __name__ == "__main__":
    sys.exit(main())
