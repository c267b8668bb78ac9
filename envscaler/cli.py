"""The ``envscaler`` command line.

The core defines ``catalog`` and ``import``. Other packages add their commands (``serve``, ``farm``,
``run``, ...) through the ``envscaler.commands`` entry point group, so this package imports none of
them. Exit codes: 0 success, 1 the work ran and found failures, 2 bad usage or input, 130 interrupted;
an error that ends a command exits with its class's ``exit_code`` (see ``envscaler.errors``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from envscaler.arguments import OneLineParser, positive_float, positive_int, with_examples
from envscaler.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, EnvScalerError

if TYPE_CHECKING:
    from envscaler.gates import EnvReport, ScenarioReport
    from envscaler.importers import ImportReport

# What the commands need is imported when they run, inside ``main``'s handling of Ctrl-C: a command
# interrupted while it starts says "interrupted" (130), not a traceback of the imports it was in.


def _catalog_list(args: argparse.Namespace) -> int:
    from envscaler.bundle import load_bundles
    from envscaler.runtime import EnvRuntime

    bundles = load_bundles(args.dir)
    if not bundles:
        print(f"error: no bundles under {args.dir} (a bundle is a folder with env.json and scenarios.jsonl)", file=sys.stderr)
        return EXIT_USAGE
    print(f"{'env_id':<28} {'tools':>5} {'scenarios':>9} {'conv.':>5}  summary")
    totals = [0, 0, 0]
    for bundle in bundles:
        runtime = EnvRuntime(bundle.spec)
        conversational = sum(s.conversational for s in bundle.scenarios)
        totals[0] += len(runtime.tools)
        totals[1] += len(bundle.scenarios)
        totals[2] += conversational
        summary = bundle.spec.environment_summary[:60]
        print(f"{bundle.env_id:<28} {len(runtime.tools):>5} {len(bundle.scenarios):>9} {conversational:>5}  {summary}")
    print(f"{len(bundles)} environments, {totals[1]} scenarios ({totals[2]} conversational), {totals[0]} tools")
    return EXIT_OK


def _catalog_scenarios(args: argparse.Namespace) -> int:
    from envscaler.bundle import bundle_path, load_bundles

    bundles = load_bundles(bundle_path(args.where))
    if not bundles:
        print(f"error: no bundles under {args.where} (a bundle is a folder with env.json and scenarios.jsonl)", file=sys.stderr)
        return EXIT_USAGE
    for bundle in bundles:
        for scenario in bundle.scenarios:
            marks = (("user " if scenario.conversational else "") + (f"{len(scenario.turns)} turns " if scenario.turns else "")
                     + ("" if scenario.check_count() else "unscored "))
            task = " ".join(scenario.task.split())
            print(f"{bundle.env_id}/{scenario.task_id:<36} {marks:<14}{task[:100]}")
    return EXIT_OK


def _catalog_check(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from envscaler.bundle import find_bundles
    from envscaler.gate_workers import check_isolated
    from envscaler.gates import GATES

    directories = find_bundles(args.dir)
    if not directories:
        print(f"error: no bundles under {args.dir}", file=sys.stderr)
        return EXIT_USAGE
    print(f"checking {len(directories)} environment(s) with gates: {', '.join(GATES)}", flush=True)
    reports: list[EnvReport] = []
    # Every process the user allowed is busy: environments side by side, each one's scenarios split.
    parallel_envs = min(args.jobs, len(directories))
    workers = max(1, args.jobs // parallel_envs)

    def check(directory: Path) -> EnvReport:
        return check_isolated(directory, args.timeout, workers=workers, on_scenario=_print_scenario,
                              call_timeout_s=args.call_timeout, check_timeout_s=args.check_timeout)

    with ThreadPoolExecutor(max_workers=parallel_envs) as pool:
        for directory, report in zip(directories, pool.map(check, directories)):
            reports.append(report)
            _print_report(report)
            if args.write_annotations:
                _write_observed_hints(directory, report)
    failed = [r for r in reports if not r.passed]
    scenarios = sum(len(r.scenarios) for r in reports)
    tools = sum(r.tools for r in reports)
    if args.json:
        Path(args.json).write_text(json.dumps([r.model_dump() for r in reports], indent=2) + "\n")
    verdict = "all gates pass" if not failed else f"{len(failed)} environment(s) FAIL"
    print(f"{len(reports)} environments, {scenarios} scenarios, {tools} tools: {verdict}")
    return EXIT_FAILED if failed else EXIT_OK


def _print_scenario(env_id: str, report: ScenarioReport) -> None:
    """Progress on stderr as each scenario's gates finish (the report on stdout comes per environment)."""
    failed = [g.gate for g in report.gates if not g.passed]
    print(f"  {env_id}/{report.task_id}: {'FAIL ' + ', '.join(failed) if failed else 'ok'}", file=sys.stderr, flush=True)


def _print_report(report: EnvReport) -> None:
    gates = len(report.env_gates) + sum(len(s.gates) for s in report.scenarios)
    passed = sum(g.passed for g in report.env_gates) + sum(g.passed for s in report.scenarios for g in s.gates)
    unscored = sum(1 for s in report.scenarios if s.skipped)
    status = "ok  " if report.passed else "FAIL"
    extra = f", {unscored} unscored" if unscored else ""
    changing = f" ({report.state_changing_tools} change state)" if report.state_changing_tools is not None else ""
    print(
        f"{status} {report.env_id:<28} {report.tools:>3} tools{changing} {len(report.scenarios):>4} scenarios"
        f"  {passed}/{gates} gates{extra}",
        flush=True,
    )
    for line in report.failures():
        print(f"     {line}", flush=True)


def _write_observed_hints(directory: Path, report: EnvReport) -> None:
    """Write what the reference calls proved into the bundle's hints; list where the code read otherwise."""
    from envscaler.observed_hints import findings, write_observed_hints

    written = {finding.tool for finding in write_observed_hints(directory, report)}
    for finding in findings(report):
        if finding.disagrees or finding.tool in written:
            action = "  -> readOnlyHint false written to env.json" if finding.tool in written else ""
            print(f"     hint {finding.describe()}{action}", flush=True)


def _import_envscaler(args: argparse.Namespace) -> int:
    from envscaler.importers import import_envscaler

    report = import_envscaler(Path(args.envs), [Path(p) for p in args.scenarios], Path(args.out))
    print(
        f"imported {report.environments} environments and {report.scenarios} scenarios "
        f"({report.unscored} unscored) into {args.out}"
    )
    for env_id, count in sorted(report.orphans.items()):
        print(f"warning: {count} scenario(s) name env_id {env_id!r}, which the metadata lacks: skipped", file=sys.stderr)
    return EXIT_OK


def _print_import_report(report: ImportReport, out: str) -> None:
    """What an import wrote on stdout, and each thing it left out (with why) on stderr."""
    print(f"imported {report.environments} environment(s) and {report.scenarios} scenario(s) into {out} "
          f"({len(report.left_out)} item(s) left out)")
    for item in report.left_out:
        print(f"left out {item.item}: {item.reason}", file=sys.stderr)


def _import_tau_bench(args: argparse.Namespace) -> int:
    from envscaler.importers import import_tau_bench

    report = import_tau_bench(Path(args.checkout), Path(args.out), domains=args.domain, splits=args.split,
                              timeout_s=args.gold_timeout)
    _print_import_report(report, args.out)
    return EXIT_OK


def _import_bfcl(args: argparse.Namespace) -> int:
    from envscaler.importers import import_bfcl

    report = import_bfcl(Path(args.path), Path(args.out), gold_timeout_s=args.gold_timeout)
    _print_import_report(report, args.out)
    return EXIT_OK


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with the commands that other packages register: only the one ``argv`` names when it names
    one of theirs (each loads its package, and all of them cost every command a third of a second), else all."""
    from importlib.metadata import entry_points

    from envscaler.bundle import default_catalog
    from envscaler.gates import DEFAULT_CALL_TIMEOUT_S, DEFAULT_CHECK_TIMEOUT_S, GATES

    parser = OneLineParser(
        prog="envscaler",
        description="Synthesized tool environments as isolated, resettable, scorable MCP servers.",
        **with_examples("envscaler demo", "envscaler catalog scenarios online_retail", "envscaler farm up && envscaler run --agent replay --out runs/replay.jsonl")
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    catalog = commands.add_parser("catalog", help="list bundles or scenarios, or run every quality gate on them")
    catalog_commands = catalog.add_subparsers(dest="catalog_command", metavar="ACTION", required=True)
    listing = catalog_commands.add_parser(
        "list", help="show each bundle's tools and scenarios",
        **with_examples("envscaler catalog list", "envscaler catalog list my_bundles/")
    )
    listing.add_argument("dir", nargs="?", default=str(default_catalog()), help="bundle or folder of bundles (default: the bundled catalog)")
    listing.set_defaults(func=_catalog_list)
    scenarios = catalog_commands.add_parser(
        "scenarios", help="list task ids with their tasks (what 'run --scenario' and 'episode new --scenario' take)",
        **with_examples("envscaler catalog scenarios online_retail", "envscaler catalog scenarios my_bundles/")
    )
    scenarios.add_argument("where", nargs="?", default=str(default_catalog()), metavar="DIR|ENV",
                           help="bundle, folder of bundles, or an env_id of the bundled catalog (default: the bundled catalog)")
    scenarios.set_defaults(func=_catalog_scenarios)
    check = catalog_commands.add_parser(
        "check",
        help="run every quality gate on every scenario; exit 1 if any fails",
        description="Gates run in limited worker processes. Gates: " + ", ".join(GATES),
        **with_examples("envscaler catalog check", "envscaler catalog check my_bundles/ --timeout 60 --json report.json")
    )
    check.add_argument("dir", nargs="?", default=str(default_catalog()), help="bundle or folder of bundles (default: the bundled catalog)")
    check.add_argument(
        "--jobs", type=positive_int, default=os.cpu_count() or 2,
        help="worker processes at once, over environments and their scenarios (default: one per core)",
    )
    check.add_argument(
        "--timeout", type=positive_float, default=300.0,
        help="seconds allowed per scenario (and for loading each environment): a scenario that runs longer, or "
        "kills its worker, fails alone under the gate it was in, and the others go on (default: 300)",
    )
    check.add_argument(
        "--call-timeout", type=positive_float, default=DEFAULT_CALL_TIMEOUT_S, metavar="SECONDS",
        help=f"seconds allowed for one tool call (default: {DEFAULT_CALL_TIMEOUT_S:g})",
    )
    check.add_argument(
        "--check-timeout", type=positive_float, default=DEFAULT_CHECK_TIMEOUT_S, metavar="SECONDS",
        help=f"seconds allowed for one check function; a check stopped there fails, named as a timeout (default: {DEFAULT_CHECK_TIMEOUT_S:g})",
    )
    check.add_argument("--json", metavar="FILE", help="also write the full report as JSON (with what each tool's reference calls did)")
    check.add_argument(
        "--write-annotations", action="store_true",
        help="write readOnlyHint false into env.json for each tool whose reference calls changed the state though its "
        "hints said read-only, and list every tool whose code reads otherwise than its calls behaved",
    )
    check.set_defaults(func=_catalog_check)

    importer = commands.add_parser("import", help="convert released data sets into bundles")
    sources = importer.add_subparsers(dest="source", metavar="SOURCE", required=True)
    envscaler = sources.add_parser(
        "envscaler", help="EnvScaler's env metadata and scenario files",
        **with_examples("envscaler import envscaler --envs env_metadata.json --scenarios tasks.json --out bundles/")
    )
    envscaler.add_argument("--envs", required=True, metavar="FILE", help="*_env_metadata.json (object keyed by env_id)")
    envscaler.add_argument("--scenarios", required=True, nargs="+", metavar="FILE", help="scenario lists (JSON list or JSONL)")
    envscaler.add_argument("--out", required=True, metavar="DIR", help="folder to write one bundle per environment into")
    envscaler.set_defaults(func=_import_envscaler)
    tau = sources.add_parser(
        "tau-bench", help="tau-bench's domains, from your own checkout (its tools, data, tasks and policy)",
        description="Reads a tau-bench checkout as text (nothing of it runs here; the gold actions run in a sandboxed "
                    "child for their final data) and writes one bundle per domain. What cannot be expressed is listed on stderr.",
        **with_examples("envscaler import tau-bench ~/src/tau-bench --out bundles/",
                        "envscaler import tau-bench ~/src/tau-bench --domain retail --split test train --out bundles/")
    )
    tau.add_argument("checkout", metavar="PATH", help="the root of a tau-bench checkout (holding tau_bench/envs/)")
    tau.add_argument("--out", required=True, metavar="DIR", help="folder to write one bundle per domain into")
    tau.add_argument("--domain", nargs="+", metavar="NAME", help="domains to import (default: every one found)")
    tau.add_argument("--split", nargs="+", default=["test"], metavar="SPLIT", help="task splits, tasks_<SPLIT>.py (default: test)")
    tau.add_argument("--gold-timeout", type=positive_float, default=600.0, metavar="SECONDS",
                     help="seconds one domain's gold actions may take to play, in a sandboxed child (default: 600)")
    tau.set_defaults(func=_import_tau_bench)
    bfcl = sources.add_parser(
        "bfcl", help="BFCL's multi-turn categories, from a local checkout of the benchmark",
        **with_examples("envscaler import bfcl ~/gorilla/berkeley-function-call-leaderboard --out bundles/")
    )
    bfcl.add_argument("path", metavar="PATH", help="the checkout (gorilla, or a folder within it holding the data and the API classes)")
    bfcl.add_argument("--out", required=True, metavar="DIR", help="folder to write one bundle per combination of classes into")
    bfcl.add_argument("--gold-timeout", type=positive_float, default=300.0, metavar="SECONDS",
                      help="seconds the gold calls of one bundle may take to play, in a sandboxed child (default: 300)")
    bfcl.set_defaults(func=_import_bfcl)

    registered = sorted(entry_points(group="envscaler.commands"), key=lambda e: e.name)
    named = next((arg for arg in (sys.argv[1:] if argv is None else argv) if not arg.startswith("-")), None)
    if any(entry.name == named for entry in registered):
        registered = [entry for entry in registered if entry.name == named]
    for entry in registered:
        try:
            register = entry.load()
        except Exception as e:  # noqa: BLE001 - any failure to load, syntax errors included
            # A broken or missing add-on must not take the core commands down with it.
            print(f"warning: command {entry.name!r} is unavailable ({entry.value}: {e})", file=sys.stderr)
            continue
        register(commands)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("envscaler-farm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``envscaler`` console script."""
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return EXIT_USAGE
        return args.func(args)
    except EnvScalerError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - a bug of ours: one line for the user, the traceback on request
        if os.environ.get("ENVSCALER_DEBUG"):
            raise
        print(f"internal error: {type(e).__name__}: {e} (a bug: please report it; ENVSCALER_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
