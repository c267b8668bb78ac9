"""``envscaler report``: one self-contained HTML page about one or more run files.

``measures`` computes what one run shows, ``charts`` draws plots as SVG, ``page`` lays it all out and
``cli`` registers the command.
"""

from __future__ import annotations

from pathlib import Path

from agent_client.errors import HarnessError
from agent_client.export import read_records
from agent_client.report.measures import Run, labels_for
from agent_client.report.page import render


def load_runs(paths: list[Path]) -> list[Run]:
    """The run files at ``paths`` as report runs; HarnessError for a missing, malformed or empty file."""
    runs = []
    for path, label in zip(paths, labels_for(paths)):
        records = read_records(path)
        if not records:
            raise HarnessError(f"{path}: no run records in it (a run file is the JSONL that 'envscaler run --out' writes)")
        runs.append(Run(label=label, path=str(path), agents=sorted({r.agent for r in records}),
                        models=sorted({r.model for r in records if r.model}), records=records))
    return runs


def write_report(paths: list[Path], out: Path) -> list[Run]:
    """Write the report of the run files ``paths`` to ``out``; the runs it shows."""
    runs = load_runs(paths)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(runs), encoding="utf-8")
    return runs
