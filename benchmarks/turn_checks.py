"""What ``turn_results`` and ``agent_replies`` cost a validation: the checks with the episode's calls as globals, against the same checks without them.

Every check may read the tool calls it is checked over (``turn_results``) and the agent's replies. They
reach each check as copy-on-access views (``envscaler.checks``), so a check that does not read them
should cost about what it did before they existed, however long the trajectory. Measured in this
process, on ``envscaler.checks.check_states`` (what both check workers run), in alternating rounds:

- baseline: ten checks over the state, no calls in their globals;
- with calls: the same ten checks, the globals holding ``--calls`` calls of about 1 KB of result each;
- reading: the same, one of the checks reading every call's result;
- copying: the same ten checks plus what isolating them by a deep copy of the globals per check would
  cost instead of views (the alternative the views replace).

    python benchmarks/turn_checks.py [--rounds 200] [--calls 200]

Targets: with calls <= 1.5x the baseline's p50 at 200 calls; reading <= 1x copying. Exits 1 when one is missed.
"""

from __future__ import annotations

import copy
import statistics
import time

from common import Verdict, argument_parser, report

from envscaler.checks import check_states
from envscaler.models import CallResult, CheckContext, CheckItem

STATE = {"items": {f"item_{i}": {"count": i, "name": f"Item {i}"} for i in range(200)}}
CHECKS = [CheckItem(check_item=f"item {i} counts {i}", check_func=f"def check_func(final_state):\n    return final_state['items']['item_{i}']['count'] == {i}")
          for i in range(10)]
READING = CheckItem(check_item="every call answered", check_func=(
    "def check_func(final_state):\n    return all(len(c['result']['data']) > 0 for c in turn_results)"))


def context(calls: int) -> CheckContext:
    """``calls`` lookups with about 1 KB of result each, and one reply."""
    return CheckContext(turn_results=[CallResult(name="lookup", arguments={"item_id": f"item_{i}"},
                                                 result={"success": True, "data": [{"field": "x" * 40, "n": n} for n in range(20)]})
                                      for i in range(calls)], agent_replies=["Done."])


def timed(checklist: list[CheckItem], given: CheckContext | None) -> float:
    started = time.perf_counter()
    results = check_states(checklist, STATE, STATE, 5.0, given)
    elapsed = time.perf_counter() - started
    assert all(r.passed for r in results), results
    return elapsed


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    calls = context(args.calls)
    plain = calls.check_globals()
    times: dict[str, list[float]] = {"baseline": [], "with calls": [], "reading": [], "copying": []}
    for _ in range(args.rounds):
        times["baseline"].append(timed(CHECKS, None))
        times["with calls"].append(timed(CHECKS, calls))
        times["reading"].append(timed([*CHECKS[:-1], READING], calls))
        started = time.perf_counter()
        for _ in CHECKS:
            copy.deepcopy(plain)
        times["copying"].append(times["baseline"][-1] + time.perf_counter() - started)
    p50 = {name: statistics.median(values) for name, values in times.items()}
    for name, value in p50.items():
        print(f"{name:<12} p50 {value * 1000:8.3f} ms  (10 checks, {args.calls if name != 'baseline' else 0} calls in their globals)")
    return report([
        Verdict("with calls / baseline", f"{p50['with calls'] / p50['baseline']:.2f}x", "<= 1.5x", p50["with calls"] <= 1.5 * p50["baseline"]),
        Verdict("reading / copying", f"{p50['reading'] / p50['copying']:.2f}x", "<= 1x", p50["reading"] <= p50["copying"]),
    ])


if __name__ == "__main__":
    raise SystemExit(main())
