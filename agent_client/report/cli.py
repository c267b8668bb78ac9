"""``envscaler report``: run files -> one HTML page."""

from __future__ import annotations

import argparse
from pathlib import Path

from agent_client.errors import HarnessError
from agent_client.report import write_report
from envscaler.arguments import with_examples
from envscaler.errors import EXIT_OK


def _report(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise HarnessError(f"--out {out} is a folder; give a file in it, such as {out / 'report.html'}")
    runs = write_report([Path(p) for p in args.runs], out)
    episodes = sum(len(run.records) for run in runs)
    print(f"wrote {out}: {len(runs)} run(s), {episodes} episode(s) (open it in any browser; it needs no network)")
    return EXIT_OK


def register_report(commands: argparse._SubParsersAction) -> None:
    """Add ``envscaler report``."""
    parser = commands.add_parser(
        "report", help="one self-contained HTML page about run files: scores, plots, spread, A/B, every episode",
        description="Reads the JSONL files that 'envscaler run --out' writes and writes one HTML file with no "
                    "outside references (inline CSS, SVG plots, a small script), to open in any browser or attach "
                    "to a message. It shows, per run: an overview per environment and overall (reward, success, "
                    "pass^k for k = 1..repeats, failed tool calls by cause, infra errors, steps, tokens, duration); "
                    "plots (reward distribution, pass^k curves, per-environment rewards, tool use and tool errors, "
                    "latency percentiles); per-scenario success over repeats and its spread; tool use; and each "
                    "episode's task, checks, tool calls, state change and messages. With two or more files the "
                    "first is A and each other is compared with it, scenario by scenario, with a significance "
                    "test that treats a scenario's repeats as one unit and the repeats a difference needs. "
                    "Open one episode directly with report.html#ep-RUN-ENV-TASK-REPEAT (RUN counts files from 0).",
        **with_examples("envscaler report runs/replay.jsonl --out report.html",
                        "envscaler report runs/model-a.jsonl runs/model-b.jsonl --out a-vs-b.html")
    )
    parser.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="run files; the first is A in comparisons")
    parser.add_argument("--out", default="report.html", metavar="FILE.html", help="where the page goes (default: report.html)")
    parser.set_defaults(func=_report)
