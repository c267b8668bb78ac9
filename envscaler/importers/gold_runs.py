"""Run a benchmark's gold calls in a limited child process, turn by turn, to learn what its checks expect.

An importer that reproduces a benchmark's outcome checks (BFCL's state after each turn, the results
its gold calls answer) needs those values before it writes the checks, and computing them runs the
benchmark's code: that never happens in the importer's process. :func:`run_gold` sends the spec and
the calls to ``python -m envscaler.importers.gold_turns_worker`` (``envscaler.sandbox.run_module``: a clean
environment, memory and time limits, sandboxed where bwrap works), which plays them through the
runtime's guards (``EnvRuntime``/``Episode``) and answers with the state after each turn and every
call's result.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from subprocess import TimeoutExpired
from typing import Any

from pydantic import BaseModel, Field

from envscaler.models import CallResult, EnvSpec, ToolCall
from envscaler.sandbox import run_module


class GoldRun(BaseModel):
    """One task's gold: its initial configuration and the calls of each turn."""

    task_id: str
    init_config: dict[str, Any] = Field(default_factory=dict)
    turns: list[list[ToolCall]] = Field(default_factory=list)


class GoldRequest(BaseModel):
    spec: EnvSpec
    runs: list[GoldRun] = Field(default_factory=list)


class GoldTurn(BaseModel):
    """What one turn's gold calls answered, and the state they left."""

    calls: list[CallResult] = Field(default_factory=list)
    state: dict[str, Any] = Field(default_factory=dict)
    changed_by: list[str] = Field(default_factory=list)
    """The tools whose calls in this turn changed the state."""
    env_errors: list[str] = Field(default_factory=list)
    """The errors of calls that failed by the environment's fault (its code raised an undeclared exception,
    changed what every episode shares, or ran out of time): a reference no agent could be held to."""


class GoldOutcome(BaseModel):
    """One run's turns, or why it could not be played (the environment did not load or build)."""

    task_id: str
    error: str | None = None
    turns: list[GoldTurn] = Field(default_factory=list)


class GoldAnswer(BaseModel):
    outcomes: list[GoldOutcome] = Field(default_factory=list)


def run_gold(spec: EnvSpec, runs: list[GoldRun], timeout_s: float) -> list[GoldOutcome]:
    """Every run of ``runs`` played in the child; a child that fails or hangs fails every run, saying why."""
    with tempfile.TemporaryDirectory(prefix="envscaler-gold-") as folder:
        path = Path(folder) / "request.json"
        path.write_text(GoldRequest(spec=spec, runs=runs).model_dump_json(), encoding="utf-8")
        try:
            done = run_module("envscaler.importers.gold_turns_worker", [str(path)], timeout_s=timeout_s, readable=[path])
        except TimeoutExpired:
            return _all_failed(runs, f"{spec.env_id}: the gold calls did not finish within {timeout_s:g} s")
    # Split on "\n" only: a result can hold U+2028 and the like, which splitlines() breaks on.
    lines = done.stdout.strip().split("\n")
    try:
        return GoldAnswer.model_validate(json.loads(lines[-1])).outcomes
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return _all_failed(runs, f"{spec.env_id}: the gold process failed (exit {done.returncode}): {tail}")


def _all_failed(runs: list[GoldRun], reason: str) -> list[GoldOutcome]:
    return [GoldOutcome(task_id=run.task_id, error=reason) for run in runs]
