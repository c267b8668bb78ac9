"""``envscaler run / export / episode / demo``: the harness on the command line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from urllib.parse import quote

import anyio

from agent_client.agents import CommandAgent, OpenAIAgent, RandomAgent, ReplayAgent
from agent_client.export import export, read_records, rewarded
from agent_client.inspect_log import write_inspect_log
from agent_client.interrupt import run_interruptible
from agent_client.llm import LlmEndpoint
from agent_client.errors import HarnessError
from agent_client.models import load_farm_catalog
from agent_client.pool import default_procs
from agent_client.remote import EnvControl, new_http_client
from agent_client.runner import RunOptions, run
from agent_client.summary import infra_reasons, render, render_spread, render_turns, summarize
from envscaler.arguments import non_negative_float, non_negative_int, positive_float, positive_int, with_examples
from envscaler.bundle import bundle_path, find_bundles
from envscaler.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from envscaler.wire import DEFAULT_FARM_CATALOG


def _agent_factory(args: argparse.Namespace):
    if args.agent == "replay":
        return ReplayAgent
    # Factories that pickle (classes and partials, no lambdas): --procs sends them to its worker processes.
    if args.agent == "random":
        return partial(RandomAgent, steps=args.random_steps)
    if args.agent == "openai":
        if not args.model:
            raise HarnessError("--agent openai needs --model (and --base-url for endpoints other than OpenAI's)")
        from envscaler.llm import check_endpoint  # with the OpenAI client: loaded only for the agents that use it

        check_endpoint(args.base_url, None, "--agent openai")
        endpoint = LlmEndpoint(base_url=args.base_url, model=args.model, temperature=args.temperature,
                               retries=args.retries, backoff_s=args.backoff)
        return partial(OpenAIAgent, endpoint)
    if not args.command:
        raise HarnessError("--agent command needs --command 'PROGRAM ARGS...' (with {mcp_url} and {task} placeholders)")
    harness_own = [name for name in args.agent_env or [] if name.startswith("ENVSCALER_")]
    if harness_own:
        raise HarnessError(f"--agent-env {harness_own[0]}: ENVSCALER_* variables are the harness's and never reach an agent")
    return partial(CommandAgent, args.command, timeout_s=args.time_limit, passed_env=tuple(args.agent_env or ()))


def _user_endpoint(args: argparse.Namespace) -> LlmEndpoint | None:
    model = args.user_model or (args.model if args.agent == "openai" else None)
    if model is None:
        return None
    from envscaler.llm import check_endpoint

    check_endpoint(args.user_base_url or args.base_url, None, "the simulated user")
    return LlmEndpoint(base_url=args.user_base_url or args.base_url, model=model, retries=args.retries, backoff_s=args.backoff)


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise HarnessError(f"--out {out} is a folder; give a file in it, such as {out / 'run.jsonl'}")
    options = RunOptions(repeats=args.repeats, concurrency=args.concurrency, max_steps=args.max_steps,
                         time_limit_s=args.time_limit, user_endpoint=_user_endpoint(args), progress=not args.quiet,
                         rerun_infra_errors=not args.keep_infra_errors, lease_s=args.lease, procs=args.procs or default_procs())
    make_agent = _agent_factory(args)
    catalog = load_farm_catalog(args.farm)
    records = run_interruptible(partial(run, catalog, make_agent, out, patterns=args.scenario, options=options))
    print(render(summarize(records, args.repeats), f"agent {args.agent}, {len(records)} episode(s) in {out}"))
    if args.repeats > 1:
        print(render_spread(records, args.repeats))
    turns = render_turns(records)
    if turns is not None:
        print(turns)
    reasons = infra_reasons(records)
    if reasons:
        print("infra errors (rerun the same command to retry them):", file=sys.stderr)
        for reason, count in reasons:
            print(f"  {count:>5} x {reason}", file=sys.stderr)
    return EXIT_FAILED if any(r.infra_failed for r in records) else EXIT_OK


def _export(args: argparse.Namespace) -> int:
    if args.format == "inspect":
        return _export_inspect(args)
    min_reward = 1.0 if args.min_reward is None else args.min_reward
    target = Path(args.out or Path(args.input).with_suffix(f".{args.format}.jsonl"))
    written, read = export(Path(args.input), target, min_reward=min_reward, fmt=args.format)
    print(f"wrote {written} of {read} record(s) with reward >= {min_reward:g} to {target} ({args.format} format)")
    return EXIT_OK


def _export_inspect(args: argparse.Namespace) -> int:
    source = Path(args.input)
    target = Path(args.out or source.with_suffix(".eval"))
    records = read_records(source)
    if args.min_reward is not None:
        records = rewarded(records, args.min_reward)
    write_inspect_log(records, source, target)
    print(f"wrote {len(records)} episode(s) to {target} (Inspect log: 'inspect view --log-dir {target.parent}')")
    return EXIT_OK


def _control(args: argparse.Namespace, env_id: str, http) -> EnvControl:
    catalog = load_farm_catalog(args.farm)
    if env_id not in catalog.envs:
        raise HarnessError(f"environment {env_id!r} is not in {args.farm}; it has: {', '.join(sorted(catalog.envs))}")
    return EnvControl(http, env_id, catalog.envs[env_id])


def _split(value: str, what: str) -> tuple[str, str]:
    env_id, _, rest = value.partition("/")
    if not env_id or not rest:
        raise HarnessError(f"expected ENV/{what}, got {value!r}")
    return env_id, rest


def _episode_new(args: argparse.Namespace) -> int:
    env_id, task_id = _split(args.scenario, "TASK")

    async def go():
        async with new_http_client() as http:
            return await _control(args, env_id, http).create(task_id)

    info = anyio.run(go)
    gateway = load_farm_catalog(args.farm).gateway
    # The gateway is the farm's one public address; a server's own URL may be unreachable from the agent.
    url = f"{gateway.rstrip('/')}/envs/{quote(env_id, safe='')}{info.mcp_path}" if gateway else info.mcp_url
    config = {"mcpServers": {f"envscaler-{env_id}": {"type": "http", "url": url}}}
    print(f"episode:  {env_id}/{info.episode_id}")
    print(f"MCP URL:  {url}")
    print(f"task:     {info.task}")
    if info.user_profile:
        print(f"user:     {info.user_profile}")
    print("MCP client config for clients that take a URL (Cursor, Claude Code, the mcp SDKs, ...):")
    print(json.dumps(config, indent=2))
    print(f"hosts that start programs (Claude Desktop, Codex): envscaler connect {url}  ('envscaler connect --help' prints their config)")
    print(f"then: envscaler episode validate --farm {args.farm} {env_id}/{info.episode_id}")
    return EXIT_OK


def _episode_validate(args: argparse.Namespace) -> int:
    env_id, episode_id = _split(args.episode, "EPISODE_ID")

    async def go():
        async with new_http_client() as http:
            return await _control(args, env_id, http).validate(episode_id)

    result = anyio.run(go)
    for check in result.checks:
        mark = "pass" if check.passed else "FAIL"
        print(f"{mark}  {check.check_item}" + (f"  ({check.error})" if check.error else ""))
    print(f"score {result.score:.3f}  state {result.state_hash}")
    return EXIT_OK if result.score == 1.0 else EXIT_FAILED


def _episode_end(args: argparse.Namespace) -> int:
    env_id, episode_id = _split(args.episode, "EPISODE_ID")

    async def go():
        async with new_http_client() as http:
            return await _control(args, env_id, http).finish(episode_id)  # an unknown or ended episode: exit 2

    ended = anyio.run(go)
    print(f"ended {env_id}/{episode_id} after {ended.calls} tool call(s)")
    return EXIT_OK


def _envscaler(*args: str, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    """``envscaler ARGS`` in a child of its own session: Ctrl-C is the demo's to handle, not the child's too.

    Ctrl-C is held off while the child starts (a handler that only notes it; a blocked signal would be
    inherited): a KeyboardInterrupt raised inside ``Popen`` once the child exists would leave no
    handle to kill it with, and an orphaned ``farm up`` brings a farm up after the demo tore it down.
    """
    interrupted = False

    def note(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True

    previous = signal.signal(signal.SIGINT, note)
    try:
        process = subprocess.Popen([sys.executable, "-m", "envscaler.cli", *args], text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL if quiet else None, start_new_session=True)
    except BaseException:
        signal.signal(signal.SIGINT, previous)
        raise
    try:
        signal.signal(signal.SIGINT, previous)
        if interrupted:
            raise KeyboardInterrupt
        stdout, _ = process.communicate()
    except BaseException:
        process.kill()  # the demo tears the farm down itself
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout)


def _demo(args: argparse.Namespace) -> int:
    for where in args.env_dirs:
        if not find_bundles(bundle_path(where)):  # a wrong folder is the user's to fix (2), before anything starts
            raise HarnessError(f"{where}: no bundles there (a bundle is a folder with env.json and scenarios.jsonl)")
    out_dir = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="envscaler-demo-") as scratch:
        catalog = os.path.join(scratch, "farm.json")
        try:
            return _demo_on_farm(args, out_dir, catalog)
        except KeyboardInterrupt:
            print("demo: interrupted; its farm is stopped and its temporary files removed", file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            _envscaler("farm", "down", "--catalog", catalog, quiet=True)


def _demo_on_farm(args: argparse.Namespace, out_dir: Path, catalog: str) -> int:
    """The demo's work on a farm whose catalog goes to ``catalog`` (the caller stops the farm)."""
    started = time.monotonic()
    print(f"demo: starting a process farm of {', '.join(args.env_dirs) if args.env_dirs else 'the bundled catalog'}", file=sys.stderr)
    up = _envscaler("farm", "up", *(str(bundle_path(where)) for where in args.env_dirs), "--backend", "process", "--catalog", catalog)
    if up.returncode != 0:
        print("error: the farm did not start (see the lines above)", file=sys.stderr)
        return up.returncode if up.returncode == EXIT_USAGE else EXIT_FAILED
    farm = load_farm_catalog(catalog)
    results = {}
    for name, make_agent in (("replay", ReplayAgent), ("random", RandomAgent)):
        path = out_dir / f"{name}.jsonl"
        path.unlink(missing_ok=True)
        print(f"demo: running the {name} agent over MCP on every scenario", file=sys.stderr)
        options = RunOptions(concurrency=args.concurrency)
        results[name] = run_interruptible(partial(run, farm, make_agent, path, options=options))
        print()
        print(render(summarize(results[name], 1), f"{name} agent ({path})"))
    replay = results["replay"]
    perfect = sum(r.reward == 1.0 for r in replay)
    print(f"\ndemo: {perfect}/{len(replay)} replays scored 1.0; trajectories in {out_dir}/; {time.monotonic() - started:.1f} s")
    return EXIT_OK if perfect == len(replay) and replay else EXIT_FAILED


def register_run(commands: argparse._SubParsersAction) -> None:
    """Add ``envscaler run``."""
    parser = commands.add_parser(
        "run", help="run an agent over MCP on a farm's scenarios; score and record every episode",
        description="Each episode: create, hand the MCP URL to the agent, validate, fetch the server trajectory, "
                    "append one JSONL record, end. Records already in --out are skipped (resume).",
        **with_examples("envscaler run --agent replay --out runs/replay.jsonl",
                        "envscaler run --agent openai --base-url http://localhost:8000/v1 --model qwen3-8b --out runs/qwen.jsonl --repeats 4",
                        "envscaler run --agent command --command \"python $PWD/my_agent.py --url {mcp_url} --task {task}\" --agent-env OPENAI_API_KEY --out runs/mine.jsonl")
    )
    parser.add_argument("--farm", default=DEFAULT_FARM_CATALOG, metavar="CATALOG",
                        help=f"catalog file written by 'envscaler farm up' (default: {DEFAULT_FARM_CATALOG})")
    parser.add_argument("--agent", choices=["replay", "random", "openai", "command"], default="replay",
                        help="replay: reference solutions (default); random: random tools; openai: a chat model; command: an external MCP program")
    parser.add_argument("--out", required=True, metavar="FILE.jsonl", help="where records go (appended; resumable)")
    parser.add_argument("--scenario", action="append", metavar="ENV[/TASK]", help="only these environments or scenarios (repeatable)")
    parser.add_argument("--repeats", type=positive_int, default=1, help="runs per scenario, for pass^k (default: 1)")
    parser.add_argument("--concurrency", type=positive_int, default=8, help="episodes at once, in all processes together (default: 8)")
    parser.add_argument("--procs", type=positive_int, metavar="N",
                        help=f"processes that run the episodes, one output file and summary still (default: one per 4 cores, "
                             f"at least 1: {default_procs()} here)")
    parser.add_argument("--max-steps", type=positive_int, default=30, help="tool calls per episode at most (default: 30)")
    parser.add_argument("--time-limit", type=positive_float, default=300.0, help="seconds per episode (default: 300)")
    parser.add_argument("--lease", type=positive_float, default=60.0, metavar="SECONDS",
                        help="servers end an episode of this run once unused for this long; the run renews its live "
                             "episodes' leases, so those of a run that was killed end within about that long (default: 60)")
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint of the agent model (key: $OPENAI_API_KEY)")
    parser.add_argument("--model", help="the agent model (--agent openai)")
    parser.add_argument("--temperature", type=float, help="sampling temperature of the agent model")
    parser.add_argument("--user-base-url", help="endpoint of the simulated user (default: --base-url)")
    parser.add_argument("--user-model", help="model of the simulated user in conversational scenarios (default: --model)")
    parser.add_argument("--retries", type=non_negative_int, default=4, help="retries on 429/5xx/connection errors (default: 4)")
    parser.add_argument("--backoff", type=non_negative_float, default=1.0, help="first retry delay in seconds, doubled each time, plus jitter; a longer Retry-After wins (default: 1)")
    parser.add_argument("--command",
                        help="--agent command: program template, e.g. \"python $PWD/my_agent.py --url {mcp_url} --task {task}\". "
                             "It runs in an empty temporary directory (give absolute paths) with only PATH, HOME, LANG, LANGUAGE, LC_ALL, LC_CTYPE, "
                             "TERM, TZ, USER, LOGNAME, SHELL, the --agent-env variables and ENVSCALER_MCP_URL, ENVSCALER_TASK, "
                             "ENVSCALER_ENV_ID, ENVSCALER_TASK_ID: never the harness's other variables, tokens or farm catalog")
    parser.add_argument("--agent-env", action="append", metavar="NAME",
                        help="--agent command: also pass this variable of the harness's environment, e.g. OPENAI_API_KEY (repeatable)")
    parser.add_argument("--random-steps", type=positive_int, default=5, help="tool calls of the random agent (default: 5)")
    parser.add_argument("--keep-infra-errors", action="store_true",
                        help="on resume, count episodes that ended in an infra error as done (default: run them again)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.set_defaults(func=_run)


def register_export(commands: argparse._SubParsersAction) -> None:
    """Add ``envscaler export``."""
    parser = commands.add_parser(
        "export", help="turn run records into SFT files or an Inspect AI eval log",
        **with_examples("envscaler export --in runs/replay.jsonl --out sft.jsonl --min-reward 1.0",
                        "envscaler export --in runs/qwen.jsonl --format inspect --out logs/qwen.eval")
    )
    parser.add_argument("--in", dest="input", required=True, metavar="FILE", help="records written by 'envscaler run'")
    parser.add_argument("--out", metavar="FILE", help="output JSONL (default: next to the input)")
    parser.add_argument("--min-reward", type=float,
                        help="keep records with at least this reward (default: 1.0 for openai and sharegpt, every episode for inspect)")
    parser.add_argument("--format", choices=["openai", "sharegpt", "inspect"], default="openai",
                        help="openai: chat messages + tools (JSONL); sharegpt: ShareGPT (JSONL); inspect: an Inspect AI "
                             "eval log (.eval, or .json by --out's suffix; default next to the input) with one sample per "
                             "episode, for 'inspect view', Docent and Inspect Scout (needs the [inspect] extra)")
    parser.set_defaults(func=_export)


def register_episode(commands: argparse._SubParsersAction) -> None:
    """Add ``envscaler episode new / validate / end``."""
    parser = commands.add_parser(
        "episode", help="a hand-driven episode for any MCP-capable agent",
        **with_examples("envscaler episode new --scenario online_retail/online_retail_001")
    )
    actions = parser.add_subparsers(dest="episode_command", metavar="ACTION", required=True)
    new = actions.add_parser(
        "new", help="create an episode; print its MCP URL, task and a client config snippet",
        **with_examples("envscaler episode new --scenario online_retail/online_retail_001")
    )
    new.add_argument("--farm", default=DEFAULT_FARM_CATALOG, metavar="CATALOG",
                     help=f"catalog file written by 'envscaler farm up' (default: {DEFAULT_FARM_CATALOG})")
    new.add_argument("--scenario", required=True, metavar="ENV/TASK",
                     help="the scenario to start ('envscaler catalog scenarios' lists them)")
    new.set_defaults(func=_episode_new)
    for name, func, text in (("validate", _episode_validate, "score the episode's current state; exit 1 below 1.0"),
                             ("end", _episode_end, "end the episode")):
        action = actions.add_parser(
            name, help=text, **with_examples(f"envscaler episode {name} online_retail/EPISODE_ID")
        )
        action.add_argument("--farm", default=DEFAULT_FARM_CATALOG, metavar="CATALOG",
                            help=f"catalog file written by 'envscaler farm up' (default: {DEFAULT_FARM_CATALOG})")
        action.add_argument("episode", metavar="ENV/EPISODE_ID", help="as printed by 'episode new'")
        action.set_defaults(func=func)


def register_demo(commands: argparse._SubParsersAction) -> None:
    """Add ``envscaler demo``."""
    parser = commands.add_parser(
        "demo", help="the main job: a process farm of the bundled catalog, replay and random agents over MCP, scores",
        description="Needs no Docker and no API key. Exit 1 unless every replay scores 1.0.",
        **with_examples("envscaler demo", "envscaler demo --out runs/demo")
    )
    parser.add_argument("env_dirs", nargs="*", metavar="ENV_DIR", help="bundles to use (default: the bundled catalog)")
    parser.add_argument("--out", metavar="DIR", help="where trajectories go (default: runs/demo-TIMESTAMP)")
    parser.add_argument("--concurrency", type=positive_int, default=16, help="episodes at once (default: 16)")
    parser.set_defaults(func=_demo)
