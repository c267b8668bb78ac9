"""The child behind ``envscaler.importers.gold_runs``: ``python -m envscaler.importers.gold_turns_worker REQUEST.json``
prints a GoldAnswer as one JSON line.

The benchmark's code runs here only through EnvRuntime and Episode (allowlisted tools, argument
schemas, time limits). It is its own module, not imported by the package, so that ``-m`` runs it
without importing it twice.
"""

from __future__ import annotations

import sys
from pathlib import Path

from envscaler.errors import EnvScalerError
from envscaler.guard import protect_time_limits
from envscaler.importers.gold_runs import GoldAnswer, GoldOutcome, GoldRequest, GoldTurn
from envscaler.jsonl import dumps
from envscaler.models import CallResult
from envscaler.runtime import EnvRuntime


def play(request: GoldRequest) -> GoldAnswer:
    """Load the environment once, then play each run on a fresh episode, keeping the state after each turn."""
    answer = GoldAnswer()
    try:
        runtime = EnvRuntime(request.spec)
    except EnvScalerError as e:
        answer.outcomes = [GoldOutcome(task_id=run.task_id, error=str(e)) for run in request.runs]
        return answer
    for run in request.runs:
        try:
            episode = runtime.new_episode(run.init_config)
        except EnvScalerError as e:
            answer.outcomes.append(GoldOutcome(task_id=run.task_id, error=str(e)))
            continue
        outcome = GoldOutcome(task_id=run.task_id)
        for calls in run.turns:
            played = [episode.call(call.name, call.arguments) for call in calls]
            outcome.turns.append(GoldTurn(calls=[CallResult.of(o) for o in played], state=episode.state(),
                                          changed_by=sorted({o.name for o in played if o.diff}),
                                          env_errors=[o.error for o in played if o.error and o.error_kind in ("env", "timeout")]))
        answer.outcomes.append(outcome)
    return answer


def main(argv: list[str] | None = None) -> int:
    """Read the request file named on the command line and print the answer as one JSON line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m envscaler.importers.gold_turns_worker REQUEST.json", file=sys.stderr)
        return 2
    request = GoldRequest.model_validate_json(Path(args[0]).read_text(encoding="utf-8"))
    protect_time_limits()
    print(dumps(play(request).model_dump(mode="json")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
