"""What tau-bench's data check costs at validation, against a check that reads one record.

An imported tau-bench domain scores the final data by the digest of what changed in it
(``envscaler.importers.gold.CHANGES_CODE``), walking the final and initial states side by side and
skipping what they share. Measured on the shop of ``tests/support/large_state.py`` at tau-bench's
size (retail: about 1.3 MB of data; ``--mb 3`` is about airline's), in this process, after the
reference solution ran: the validate p50 with the data check, against the p50 of a check that reads
one record (the baseline, measured in the same run, alternating).

    python benchmarks/tau_data_check.py [--mb 1.3] [--rounds 20]

Target: the data check's validate p50 stays under a tenth of the gates' default check limit (2 s) at
that size: it reads what changed, not the whole data (a digest of the whole data took 0.7 s at 3 MB).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from common import EnvRuntime, Verdict, argument_parser, load_bundle, report

from envscaler.gates import DEFAULT_CHECK_TIMEOUT_S
from envscaler.importers.gold import CHANGES_CODE, changes_digest
from envscaler.models import CheckItem
from tests.support.large_state import shop_bundle, state_size


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--mb", type=float, default=1.3, help="state size in MB (default: 1.3)")
    parser.add_argument("--rounds", type=int, default=20, help="validations of each kind (default: 20)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        bundle = load_bundle(shop_bundle(Path(folder), int(args.mb * 1_000_000)))
    scenario = bundle.scenarios[0]
    runtime = EnvRuntime(bundle.spec, check_timeout_s=60.0)
    episode = runtime.new_episode(scenario.init_config, scenario_key=scenario.task_id)
    for call in scenario.reference_solution or []:
        episode.call(call.name, call.arguments)
    state = episode.state()
    digest = changes_digest(episode.initial_state(), state)
    data_check = [CheckItem(check_item="data", check_func=f"{CHANGES_CODE}\ndef check_func(final_state):\n"
                                                          f"    return changes_digest(initial_state, final_state) == {digest!r}\n")]
    one_record = [CheckItem(check_item="one record", check_func=scenario.checklist_with_func[0].check_func)]
    times: dict[str, list[float]] = {"data": [], "one record": []}
    for _ in range(args.rounds):
        for name, checklist in (("data", data_check), ("one record", one_record)):
            started = time.perf_counter()
            result = episode.validate(checklist)
            times[name].append(time.perf_counter() - started)
            assert result.score == 1.0, result.checks
    data_p50, baseline_p50 = statistics.median(times["data"]), statistics.median(times["one record"])
    print(f"state {state_size(state) / 1e6:.2f} MB; validate p50: data check {data_p50 * 1000:.1f} ms, "
          f"one record {baseline_p50 * 1000:.1f} ms (x{data_p50 / baseline_p50:.1f})")
    limit = DEFAULT_CHECK_TIMEOUT_S / 10
    return report([Verdict("validate with the data check (p50)", f"{data_p50 * 1000:.1f} ms", f"< {limit * 1000:g} ms",
                           data_p50 < limit)])


if __name__ == "__main__":
    raise SystemExit(main())
