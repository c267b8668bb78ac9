"""The isolated worker behind ``envscaler catalog check`` (see ``envscaler.gate_workers``).

``python -m envscaler.check_worker [--call-timeout S] [--check-timeout S] BUNDLE_DIR [TASK_ID ...]`` runs the
environment's gate, then every gate on each scenario (all, or the ones named, in that order), printing a JSON line
(``WorkerEvent``) per step as it happens. It is its own module, not imported by the package, so
that ``-m`` runs it without importing it twice.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from envscaler.bundle import load_bundle
from envscaler.errors import EnvScalerError
from envscaler.gate_workers import WorkerEvent
from envscaler.gates import DEFAULT_CALL_TIMEOUT_S, DEFAULT_CHECK_TIMEOUT_S, ToolObservation, check_environment, check_scenario
from envscaler.guard import protect_time_limits
from envscaler.jsonl import dumps


def main(argv: list[str] | None = None) -> int:
    """Check one bundle directory, reporting each step on stdout as a JSON line."""
    parser = argparse.ArgumentParser(prog="python -m envscaler.check_worker")
    parser.add_argument("--call-timeout", type=float, default=DEFAULT_CALL_TIMEOUT_S)
    parser.add_argument("--check-timeout", type=float, default=DEFAULT_CHECK_TIMEOUT_S)
    parser.add_argument("bundle")
    parser.add_argument("task_ids", nargs="*")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    events = own_stdout()
    protect_time_limits()
    try:
        bundle = load_bundle(args.bundle)
    except EnvScalerError as e:
        _emit(events, WorkerEvent(error=str(e)))
        return 1
    report, runtime = check_environment(bundle, call_timeout_s=args.call_timeout, check_timeout_s=args.check_timeout)
    _emit(events, WorkerEvent(env=report, scenarios_follow=runtime is not None))
    if runtime is None:
        return 0
    by_id = {s.task_id: s for s in bundle.scenarios}
    for scenario in [by_id[t] for t in args.task_ids if t in by_id] if args.task_ids else bundle.scenarios:
        observed: dict[str, ToolObservation] = {}

        def started(gate: str, task_id: str = scenario.task_id) -> None:
            _emit(events, WorkerEvent(gate=gate, task_id=task_id))

        result = check_scenario(runtime, scenario, observed, on_gate=started)
        _emit(events, WorkerEvent(scenario=result, observed=observed))
    return 0


def own_stdout() -> TextIO:
    """A private copy of stdout for the events; what environment code prints goes to stderr instead."""
    events = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return events


def _emit(events: TextIO, event: WorkerEvent) -> None:
    events.write(dumps(event.model_dump(mode="json", exclude_defaults=True)) + "\n")
    events.flush()


if __name__ == "__main__":
    raise SystemExit(main())
