"""Harness cost: CPU time of the harness process per tool step, and steps/s, at concurrency 64.

Starts a process farm of the bundled catalog (``envscaler farm up --backend process``), runs the
replay agent over every scenario ``--repeats`` times with 64 episodes at once, and divides the
harness process's CPU time (user + system, everything included: episode creation, MCP calls,
validation, trajectory fetch, JSONL writing) by the number of tool steps. The servers run in their
own processes and are not counted.

    python benchmarks/harness.py [--repeats 10] [--concurrency 64]

Target: 0.5 ms of harness CPU per tool step or less. Exits 1 when missed.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import anyio

from common import Verdict, argument_parser, envscaler, report

from agent_client.agents import ReplayAgent
from agent_client.models import load_farm_catalog
from agent_client.runner import RunOptions, run

TARGET_MS = 0.5


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=10, help="runs per scenario (default: 10)")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes at once (default: 64)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="envscaler-bench-") as scratch:
        catalog_file = Path(scratch) / "farm.json"
        envscaler("farm", "up", "--backend", "process", "--catalog", str(catalog_file))
        try:
            catalog = load_farm_catalog(catalog_file)
            options = RunOptions(repeats=args.repeats, concurrency=args.concurrency, progress=False)
            cpu, wall = time.process_time(), time.perf_counter()
            records = anyio.run(lambda: run(catalog, ReplayAgent, Path(scratch) / "out.jsonl", options=options),
                                backend_options={"use_uvloop": True})
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        finally:
            envscaler("farm", "down", "--catalog", str(catalog_file))
    steps = sum(r.steps for r in records)
    perfect = sum(r.reward == 1.0 for r in records)
    per_step_ms = cpu / steps * 1e3
    print(f"{len(records)} episodes ({perfect} scored 1.0), {steps} tool steps, concurrency {args.concurrency}")
    print(f"harness CPU: {cpu:.2f} s -> {per_step_ms:.3f} ms per tool step (everything included)")
    print(f"throughput: {steps / wall:.0f} tool steps/s, {len(records) / wall:.1f} episodes/s (wall {wall:.1f} s, "
          f"servers share this machine's cores)")
    return report([
        Verdict("harness CPU per tool step", f"{per_step_ms:.3f} ms", f"<= {TARGET_MS} ms", per_step_ms <= TARGET_MS),
        Verdict("episodes scored 1.0", f"{perfect}/{len(records)}", "all", perfect == len(records)),
    ])


if __name__ == "__main__":
    sys.exit(main())
