"""``envscaler synth skeleton | scenarios | all``: LLM synthesis of environments and gated scenarios."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import ValidationError

from envscaler.arguments import non_negative_float, non_negative_int, positive_int, with_examples
from envscaler.bundle import describe_validation_error, find_bundles, read_json
from envscaler.errors import EXIT_FAILED, EXIT_OK, LlmUnavailable
from envscaler.logs import configure
from synth.errors import SynthError
from synth.corpus import bundled_seeds, load_seeds
from synth.models import RunReport, SynthConfig
from synth.prompts import STAGES

if TYPE_CHECKING:
    from synth.pipeline import Synthesis

REPORT_FILE = "synth_report.json"


def _logs(level: str) -> None:
    configure(level)
    # One line per HTTP request says nothing the run report does not; keep them out unless debugging.
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def config_from(args: argparse.Namespace) -> SynthConfig:
    """The run settings from flags, ``--stage-config`` and the environment."""
    values: dict[str, Any] = {}
    if args.config:
        loaded = read_json(Path(args.config))
        if not isinstance(loaded, dict):
            raise SynthError(f"{args.config}: expected a JSON object of settings")
        values.update(loaded)
    flags = {
        "base_url": args.base_url or os.environ.get("OPENAI_BASE_URL"),
        "model": args.model, "temperature": args.temperature, "concurrency": args.concurrency,
        "retries": args.retries, "backoff_s": args.backoff, "json_retries": args.json_retries,
        "max_repairs": args.max_repairs, "judge_threshold": args.threshold, "min_score": args.min_score,
    }
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        config = SynthConfig.model_validate(values)
    except ValidationError as e:
        raise SynthError(f"invalid synthesis settings: {describe_validation_error(e)}") from None
    from envscaler.llm import check_endpoint

    for stage in STAGES:
        check_endpoint(config.stage(stage).base_url, config.api_key, f"stage {stage!r}")
    return config


def _add_common(parser: argparse.ArgumentParser) -> None:
    llm = parser.add_argument_group("LLM (any OpenAI-compatible endpoint; API key from $OPENAI_API_KEY)")
    llm.add_argument("--base-url", help="endpoint base URL (default: $OPENAI_BASE_URL, else OpenAI)")
    llm.add_argument("--model", help="model for every stage (default: gpt-4o-mini)")
    llm.add_argument("--temperature", type=float, help="temperature for every stage (default: 0.7)")
    llm.add_argument("--config", metavar="FILE",
                     help='JSON settings; per-stage endpoints as {"stages": {"method": {"model": ..., '
                          f'"base_url": ..., "temperature": ...}}}}}}. Stages: {", ".join(STAGES)}')
    llm.add_argument("--concurrency", type=positive_int, help="LLM requests in flight at once (default: 4)")
    llm.add_argument("--retries", type=non_negative_int, help="retries per request on 429/5xx/connection errors (default: 4)")
    llm.add_argument("--backoff", type=non_negative_float, help="first retry delay in seconds, doubling, plus jitter; a longer Retry-After wins (default: 1)")
    llm.add_argument("--json-retries", type=non_negative_int, help="re-asks after an answer that is not the JSON asked for (default: 2)")
    quality = parser.add_argument_group("quality")
    quality.add_argument("--max-repairs", type=non_negative_int, help="repair rounds before a draft is dropped (default: 2)")
    quality.add_argument("--threshold", type=float, help="dual-agent (pass+warning)/total to keep an env (default: 0.85)")
    quality.add_argument("--min-score", type=int, help="minimum usefulness and modelability, 1-10 (default: 7)")
    run = parser.add_argument_group("run")
    run.add_argument("--cache", metavar="DIR", help="stage cache; a rerun repeats no finished request "
                                                    "(default: .synth_cache next to the output)")
    run.add_argument("--report", metavar="FILE", help=f"run report (default: {REPORT_FILE} next to the output)")
    run.add_argument("--log-level", default="warning", help="JSON logs on stderr at this level (default: warning)")


def register_synth(subparsers: Any) -> None:
    """Add ``synth skeleton``, ``synth scenarios`` and ``synth all`` to the envscaler command line."""
    synth = subparsers.add_parser("synth", help="synthesize environments and gated scenarios with an LLM",
                                  **with_examples("envscaler synth all --base-url http://localhost:8000/v1 --model qwen3-32b --out new_envs/"))
    actions = synth.add_subparsers(dest="synth_command", metavar="ACTION", required=True)
    seeds_help = f"seed tasks: a JSONL file or a folder of them (default: the bundled corpus, {bundled_seeds()})"

    skeleton = actions.add_parser("skeleton", help="seed tasks -> environment bundles (SkelBuilder)",
                                  **with_examples("envscaler synth skeleton --base-url http://localhost:8000/v1 --model qwen3-32b --out new_envs/ --limit 5"))
    skeleton.add_argument("--tasks", default=str(bundled_seeds()), help=seeds_help)
    skeleton.add_argument("--out", required=True, metavar="DIR", help="folder to write one bundle per environment into")
    skeleton.add_argument("--limit", type=positive_int, help="use only the first N seed tasks")
    _add_common(skeleton)
    skeleton.set_defaults(func=_skeleton)

    scenarios = actions.add_parser("scenarios", help="append gated scenarios to bundles (ScenGenerator)",
                                   **with_examples("envscaler synth scenarios --env new_envs/ --n 5 --base-url http://localhost:8000/v1 --model qwen3-32b"))
    scenarios.add_argument("--env", required=True, metavar="DIR", help="a bundle, or a folder of bundles")
    scenarios.add_argument("--n", type=positive_int, default=3, help="scenarios to add per environment (default: 3)")
    _add_common(scenarios)
    scenarios.set_defaults(func=_scenarios)

    everything = actions.add_parser("all", help="skeleton, then scenarios for every accepted environment",
                                    **with_examples("envscaler synth all --base-url http://localhost:8000/v1 --model qwen3-32b --out new_envs/"))
    everything.add_argument("--tasks", default=str(bundled_seeds()), help=seeds_help)
    everything.add_argument("--out", required=True, metavar="DIR", help="folder to write the bundles into")
    everything.add_argument("--limit", type=positive_int, help="use only the first N seed tasks")
    everything.add_argument("--n", type=positive_int, default=3, help="scenarios per environment (default: 3)")
    _add_common(everything)
    everything.set_defaults(func=_all)


def _paths(args: argparse.Namespace, base: Path) -> tuple[Path, Path]:
    cache = Path(args.cache) if args.cache else base / ".synth_cache"
    report = Path(args.report) if args.report else base / REPORT_FILE
    return cache, report


def _seeds(args: argparse.Namespace) -> list:
    seeds = load_seeds(args.tasks)
    return seeds[: args.limit] if args.limit else seeds


def _skeleton(args: argparse.Namespace) -> int:
    _logs(args.log_level)
    config, seeds, out = config_from(args), _seeds(args), Path(args.out)
    cache, report_path = _paths(args, out)

    async def main(run: Synthesis) -> bool:
        return bool(await run.environments(seeds, out))

    return _execute(config, cache, report_path, main)


def _scenarios(args: argparse.Namespace) -> int:
    _logs(args.log_level)
    config, count = config_from(args), args.n
    directories = find_bundles(args.env)
    if not directories:
        raise SynthError(f"{args.env}: no bundles (a bundle is a folder with env.json)")
    base = Path(args.env) if len(directories) > 1 or Path(args.env) != directories[0] else directories[0].parent
    cache, report_path = _paths(args, base)

    async def main(run: Synthesis) -> bool:
        results = [await run.scenarios(directory, count) for directory in directories]
        return all(results)

    return _execute(config, cache, report_path, main)


def _all(args: argparse.Namespace) -> int:
    _logs(args.log_level)
    config, seeds, out, count = config_from(args), _seeds(args), Path(args.out), args.n
    cache, report_path = _paths(args, out)

    async def main(run: Synthesis) -> bool:
        directories = await run.environments(seeds, out)
        # Topping up to --n (not adding --n) makes a rerun of an interrupted `all` resume it.
        results = [await run.scenarios(directory, count, total=True) for directory in directories]
        return bool(directories) and all(results)

    return _execute(config, cache, report_path, main)


def _execute(config: SynthConfig, cache: Path, report_path: Path, main: Any) -> int:
    """Run ``main(synthesis)``, print the report; exit 0 when it says everything asked for was made."""
    # The pipeline and its OpenAI client load here, not with the command line: they take most of a second.
    from synth.pipeline import synthesis

    async def run() -> tuple[bool, RunReport]:
        async with synthesis(config, cache, report_path) as current:
            ok = await main(current)
        return ok, current.report

    try:
        ok, report = anyio.run(run)
    except LlmUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        print(f"partial report written to {report_path}", file=sys.stderr)
        return EXIT_FAILED
    print(summary(report))
    print(f"report: {report_path}")
    return EXIT_OK if ok else EXIT_FAILED


def summary(report: RunReport) -> str:
    """The run report as a table: per stage requests, cache hits, tokens and acceptance; then totals."""
    lines = [f"{'stage':<16} {'requests':>8} {'cached':>6} {'tokens':>8} {'invalid':>7} {'accepted':>9}"]
    for stage, stats in report.stages.items():
        rate = f"{stats.accepted}/{stats.attempts}" if stats.attempts else "-"
        tokens = stats.prompt_tokens + stats.completion_tokens
        lines.append(f"{stage:<16} {stats.requests:>8} {stats.cached:>6} {tokens:>8} {stats.invalid_answers:>7} {rate:>9}")
    lines.append(f"accepted: {len(report.accepted_envs)} environment(s), {len(report.accepted_scenarios)} scenario(s); "
                 f"dropped: {len(report.rejections)}")
    for rejection in report.rejections:
        lines.append(f"  dropped {rejection.subject} at {rejection.stage}: {rejection.reason}")
    lines.append(f"requests per accepted environment: {report.requests_per_env}; "
                 f"per accepted scenario: {report.requests_per_scenario}")
    if report.catalog_check:
        lines.append("catalog check: " + json.dumps(report.catalog_check))
    return "\n".join(lines)
