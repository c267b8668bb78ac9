"""The quality gates in limited child processes: a time limit per scenario, results as they come, in parallel.

Gates run untrusted code (constructors, tools, checks), so they never run in the process that drives
the check. A worker (``python -m envscaler.check_worker BUNDLE_DIR [TASK_ID ...]``) checks the
environment, then one scenario after another, and reports each step as a JSON line
(:class:`WorkerEvent`): the environment's gate, each scenario gate as it starts, each scenario's
report as it ends.

The driver gives every scenario ``timeout_s``. A worker that goes quiet for longer, or dies, is
stopped; the scenario it was on fails alone, under the gate it was running, and a fresh worker takes
the scenarios left. A bundle's scenarios are split over ``workers`` processes, so a large bundle uses
every core it is given.
"""

from __future__ import annotations

import queue
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from pydantic import BaseModel, Field, ValidationError

from envscaler.bundle import load_bundle
from envscaler.errors import EnvScalerError
from envscaler.gates import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_CHECK_TIMEOUT_S,
    EnvReport,
    GateResult,
    ScenarioReport,
    ToolObservation,
    merge_observations,
)
from envscaler.jsonl import validate_json
from envscaler.sandbox import start_module

# Memory a worker may use: a benchmark-sized scenario is built three times by the gates.
WORKER_MEMORY_MB = 2048

ScenarioCallback = Callable[[str, ScenarioReport], None]
"""Called with (env_id, report) as each scenario's report arrives, from the driver's threads."""


class WorkerEvent(BaseModel):
    """One line a gate worker prints: exactly one of its fields is set."""

    error: str | None = None
    """The bundle could not be read."""
    env: EnvReport | None = None
    """The environment-wide gates; ``scenarios_follow`` says whether scenario checks come next."""
    scenarios_follow: bool = True
    gate: str | None = None
    """A scenario gate starts (with ``task_id``): a worker stopped now is blamed on it."""
    task_id: str | None = None
    scenario: ScenarioReport | None = None
    """A scenario's report, with what its reference solution's calls of each tool did."""
    observed: dict[str, ToolObservation] = Field(default_factory=dict)


def check_isolated(
    directory: Path,
    timeout_s: float,
    *,
    workers: int = 1,
    on_scenario: ScenarioCallback | None = None,
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    check_timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
) -> EnvReport:
    """Every gate on one bundle, in limited child processes.

    ``timeout_s`` applies to loading the environment and to each scenario. A worker that dies or
    hangs fails the scenario it was on (or ``class_loads``, while loading); the others still run.
    ``call_timeout_s`` and ``check_timeout_s`` limit each tool call and each check inside the worker.
    """
    try:
        bundle = load_bundle(directory)  # JSON only: no environment code runs here
    except EnvScalerError as e:
        return _broken(directory.name, str(e))
    ids = [s.task_id for s in bundle.scenarios]
    shards = [ids[start :: max(workers, 1)] for start in range(max(1, min(workers, len(ids))))]
    limits = ["--call-timeout", f"{call_timeout_s:g}", "--check-timeout", f"{check_timeout_s:g}"]
    runs = [_ShardRun(directory, bundle.env_id, shard, timeout_s, on_scenario, limits) for shard in shards]
    with ThreadPoolExecutor(len(runs)) as pool:
        list(pool.map(_ShardRun.run, runs))
    report = runs[0].env  # every run ends with the environment's report (read, or broken)
    assert report is not None
    reports = {task_id: r for run in runs for task_id, r in run.reports.items()}
    report.scenarios = [reports[task_id] for task_id in ids if task_id in reports]
    if any(run.checked_scenarios for run in runs):
        for run in runs:
            report.observe(run.observed)
    return report


def _broken(env_id: str, detail: str) -> EnvReport:
    return EnvReport(env_id=env_id, env_gates=[GateResult(gate="class_loads", passed=False, detail=detail)])


class _ShardRun:
    """Some scenarios of one bundle, checked by one worker process at a time."""

    def __init__(self, directory: Path, env_id: str, task_ids: list[str], timeout_s: float, on_scenario: ScenarioCallback | None,
                 limits: list[str]) -> None:
        """``limits``: the worker's options for its time limits per call and per check."""
        self.directory = directory
        self.limits = limits
        self.env_id = env_id
        self.remaining = list(task_ids)
        self.timeout_s = timeout_s
        self.on_scenario = on_scenario
        self.env: EnvReport | None = None
        self.reports: dict[str, ScenarioReport] = {}
        self.observed: dict[str, ToolObservation] = {}
        self.checked_scenarios = False

    def run(self) -> None:
        while True:
            stopped = self._one_worker()
            if stopped is None:
                return
            gate, task_id, reason = stopped
            if self.env is None:
                self.env = _broken(self.env_id, f"loading the environment {reason}")
                return
            blamed = task_id or self.remaining[0]
            self._keep(ScenarioReport(task_id=blamed, gates=[GateResult(gate=gate if task_id else "instantiates", passed=False, detail=reason)]))
            if not self.remaining:
                return

    def _keep(self, report: ScenarioReport) -> None:
        self.reports[report.task_id] = report
        if report.task_id in self.remaining:
            self.remaining.remove(report.task_id)
        if self.on_scenario is not None:
            self.on_scenario(self.env_id, report)

    def _one_worker(self) -> tuple[str, str | None, str] | None:
        """Run a worker over the remaining scenarios: None when it finished, else (gate, task_id, why) it stopped."""
        with tempfile.TemporaryFile() as errors:
            cpu_s = int(self.timeout_s * (len(self.remaining) + 1)) + 1
            process = start_module("envscaler.check_worker", [*self.limits, str(self.directory.resolve()), *self.remaining],
                                   memory_mb=WORKER_MEMORY_MB, cpu_s=cpu_s, stderr=errors, readable=[self.directory])
            lines = _line_queue(process.stdout)  # type: ignore[arg-type]
            gate, task_id = "class_loads", None
            try:
                while True:
                    try:
                        line = lines.get(timeout=self.timeout_s)
                    except queue.Empty:
                        return gate, task_id, f"did not finish within {self.timeout_s:g} s (the limit per scenario); its worker was stopped"
                    if line is None:
                        break
                    try:
                        event = validate_json(WorkerEvent, line)
                    except ValidationError:
                        continue  # not ours: the worker's stdout is only ever the driver's
                    if event.error is not None:
                        self.env = _broken(self.env_id, event.error)
                        return None
                    if event.env is not None:
                        self.env = event.env
                        if not event.scenarios_follow:
                            self.remaining.clear()
                            return None
                    elif event.scenario is not None:
                        self.checked_scenarios = True
                        merge_observations(self.observed, event.observed)
                        self._keep(event.scenario)
                        gate, task_id = "instantiates", None
                    elif event.gate is not None:
                        gate, task_id = event.gate, event.task_id
            finally:
                process.kill()
                process.wait()
            if not self.remaining and self.env is not None:
                return None
            errors.seek(0)
            tail = (errors.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            return gate, task_id, f"killed its checker process (exit {process.returncode}): {tail[:300]}"


def _line_queue(stream: IO[bytes]) -> queue.Queue[bytes | None]:
    """The stream's lines as they arrive, then None at its end (read by a daemon thread)."""
    lines: queue.Queue[bytes | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="gate-worker-output", daemon=True).start()
    return lines
