"""What tau-bench's data check costs at validation: the whole data digested, against a check that reads one record.

An imported tau-bench domain scores the final data by a digest of all of it
(``envscaler.importers.gold.DIGEST_CODE``): a validation reads the whole state, where a synthesized
scenario's checks read a few records. Measured on the shop of ``tests/support/large_state.py`` at
tau-bench's size (retail and airline: about 1.3 MB of data), in this process, after the reference
solution ran: the validate p50 with the digest check, against the p50 of a check that reads one
record (the baseline, measured in the same run, alternating). ``--mb 3`` is about airline's size.

    python benchmarks/tau_data_check.py [--mb 1.3] [--rounds 20]

Target: the digest check's validate stays under the gates' default check limit (2 s) at that size.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from common import EnvRuntime, Verdict, argument_parser, load_bundle, report

from envscaler.gates import DEFAULT_CHECK_TIMEOUT_S
from envscaler.importers.gold import DIGEST_CODE, state_digest
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
    digest = state_digest(state)
    data_check = [CheckItem(check_item="data", check_func=f"{DIGEST_CODE}\ndef check_func(final_state):\n"
                                                          f"    return state_digest(final_state) == {digest!r}\n")]
    one_record = [CheckItem(check_item="one record", check_func=scenario.checklist_with_func[0].check_func)]
    times: dict[str, list[float]] = {"digest": [], "one record": []}
    for _ in range(args.rounds):
        for name, checklist in (("digest", data_check), ("one record", one_record)):
            started = time.perf_counter()
            result = episode.validate(checklist)
            times[name].append(time.perf_counter() - started)
            assert result.score == 1.0, result.checks
    digest_p50, baseline_p50 = statistics.median(times["digest"]), statistics.median(times["one record"])
    print(f"state {state_size(state) / 1e6:.2f} MB; validate p50: digest {digest_p50 * 1000:.1f} ms, "
          f"one record {baseline_p50 * 1000:.1f} ms (x{digest_p50 / baseline_p50:.0f})")
    return report([Verdict("validate with the data digest (p50)", f"{digest_p50:.3f} s", f"< {DEFAULT_CHECK_TIMEOUT_S:g} s",
                           digest_p50 < DEFAULT_CHECK_TIMEOUT_S)])


if __name__ == "__main__":
    raise SystemExit(main())
