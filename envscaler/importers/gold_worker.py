"""The child behind ``envscaler.importers.gold``: ``python -m envscaler.importers.gold_worker BUNDLE_DIR [--states]``.

Plays every scenario's reference solution, turn by turn, on a fresh episode through EnvRuntime
(allowlisted tools, argument schemas, time limits, the bundle's data files), and prints one GoldRun
per scenario as a JSON line. Every call runs, failed ones included, as the benchmarks' own scoring
does. It is its own module, not imported by the package, so that ``-m`` runs it without importing it
twice.
"""

from __future__ import annotations

import argparse
import sys

from envscaler.bundle import load_bundle
from envscaler.check_worker import own_stdout
from envscaler.errors import EnvScalerError
from envscaler.guard import protect_time_limits
from envscaler.importers.gold import GoldCall, GoldRun, GoldTurn, changes_digest
from envscaler.jsonl import dumps
from envscaler.models import Scenario, ToolCall
from envscaler.runtime import EnvRuntime, Episode


def main(argv: list[str] | None = None) -> int:
    """Play the bundle's reference solutions, printing a GoldRun per scenario; exit 1 if the environment does not load."""
    parser = argparse.ArgumentParser(prog="python -m envscaler.importers.gold_worker")
    parser.add_argument("bundle")
    parser.add_argument("--states", action="store_true", help="report the state after each turn")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    events = own_stdout()
    protect_time_limits()
    try:
        bundle = load_bundle(args.bundle)
        runtime = EnvRuntime(bundle.spec, bundle_dir=bundle.directory)
    except EnvScalerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for scenario in bundle.scenarios:
        run = GoldRun(task_id=scenario.task_id)
        try:
            episode = runtime.new_episode(scenario.init_config)
        except EnvScalerError as e:
            run.error = str(e)
        else:
            for calls in _turn_calls(scenario):
                turn = GoldTurn(calls=[_play(runtime, episode, call) for call in calls])
                if args.states:
                    turn.state = episode.state()
                run.turns.append(turn)
            run.digest = changes_digest(episode.initial_state(), episode.state())
            episode.close()
        events.write(dumps(run.model_dump(mode="json", exclude_defaults=True)) + "\n")
        events.flush()
    return 0


def _turn_calls(scenario: Scenario) -> list[list[ToolCall]]:
    """The reference calls of each turn: a single-turn scenario is one turn."""
    if scenario.turns is None:
        return [scenario.reference_solution or []]
    return [turn.reference_solution or [] for turn in scenario.turns]


def _play(runtime: EnvRuntime, episode: Episode, call: ToolCall) -> GoldCall:
    outcome = episode.call(call.name, call.arguments)
    hints = runtime.annotations.get(call.name)
    return GoldCall(name=outcome.name, arguments=outcome.arguments, result=outcome.result, error=outcome.error,
                    error_kind=outcome.error_kind, changed=bool(outcome.diff), read_only=hints.readOnlyHint if hints else None)


if __name__ == "__main__":
    raise SystemExit(main())
