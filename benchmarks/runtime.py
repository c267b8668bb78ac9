"""Runtime overhead: a guarded tool call against a direct method call, and episode creation.

Runs on the largest bundled environment (most tools, then most code). The baseline is measured in
the same run: the same method called directly on an instance built from the same init_config. The
runtime adds the allowlist, JSON-schema validation of the arguments, the time limit, and turning the
result into JSON-ready data.

    python benchmarks/runtime.py [--calls N]

Exits 1 when a target is missed: overhead <= 20 us per call, episode creation <= 1 ms.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from common import Verdict, argument_parser, report

from envscaler import Bundle, EnvRuntime, default_catalog, load_bundles

OVERHEAD_TARGET_US = 20.0
CREATION_TARGET_MS = 1.0


def largest(bundles: list[Bundle]) -> Bundle:
    return max(bundles, key=lambda b: (len(EnvRuntime(b.spec).tools), len(b.spec.env_class_code)))


def per_call_us(fn: Callable[[], object], calls: int, rounds: int = 5) -> float:
    """Best-of-rounds mean time per call, in microseconds (the best round has the least noise)."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def read_only_calls(runtime: EnvRuntime, bundle: Bundle) -> list[tuple[str, dict]]:
    """Reference calls that leave the state unchanged, so repeating them measures the same work."""
    found: dict[str, tuple[str, dict]] = {}
    for scenario in bundle.scenarios:
        episode = runtime.new_episode(scenario.init_config)
        for call in scenario.reference_solution or []:
            outcome = episode.call(call.name, call.arguments)
            if not outcome.error and not outcome.diff and call.name not in found:
                found[call.name] = (call.name, call.arguments)
    return list(found.values())


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--calls", type=int, default=20_000, help="calls per measurement round (default: 20000)")
    args = parser.parse_args()

    bundle = largest(load_bundles(default_catalog()))
    runtime = EnvRuntime(bundle.spec)
    scenario = max(bundle.scenarios, key=lambda s: len(repr(s.init_config)))
    print(f"environment: {bundle.env_id} ({len(runtime.tools)} tools, {len(bundle.spec.env_class_code)} bytes of code)")

    overheads = []
    print(f"{'tool':<28} {'direct us':>10} {'runtime us':>11} {'overhead us':>12} {'+diff us':>9}")
    for name, arguments in read_only_calls(runtime, bundle):
        episode = runtime.new_episode(scenario.init_config)
        if episode.call(name, arguments).error:
            continue  # the call needs another scenario's state; other tools cover the measurement
        instance = runtime.instantiate(scenario.init_config)
        method = getattr(instance, name)
        direct = per_call_us(lambda: method(**arguments), args.calls)
        guarded = per_call_us(lambda: episode.call(name, arguments), args.calls)
        tracked = per_call_us(lambda: episode.call(name, arguments), max(args.calls // 10, 100))
        overheads.append(guarded - direct)
        print(f"{name:<28} {direct:>10.2f} {guarded:>11.2f} {guarded - direct:>12.2f} {tracked - guarded:>9.1f}")

    creations = []
    for _ in range(2_000):
        started = time.perf_counter()
        runtime.new_episode(scenario.init_config)
        creations.append((time.perf_counter() - started) * 1e3)
    overhead = statistics.median(overheads)
    creation = statistics.median(creations)
    print("(+diff: extra cost when the call also records a state diff, as the server's trajectory does)")
    return report([
        Verdict(f"per-call overhead (median over {len(overheads)} tools)", f"{overhead:.2f} us", f"<= {OVERHEAD_TARGET_US:g} us",
                overhead <= OVERHEAD_TARGET_US),
        Verdict(f"episode creation p50 ({scenario.task_id}, {len(repr(scenario.init_config))} chars of init_config)", f"{creation:.3f} ms",
                f"<= {CREATION_TARGET_MS:g} ms", creation <= CREATION_TARGET_MS),
    ])


if __name__ == "__main__":
    sys.exit(main())
