"""``envscaler reverify``: score stored episodes again against the validators a farm serves now.

After a check was fixed, the old rewards of a run are stale. Each stored episode is replayed on a
fresh episode of the same scenario: its tool calls, in order, with the same arguments, over MCP (as
an agent would make them); then the current checklist scores the final state. Calls the server
refused as the agent's error (an unknown tool, bad arguments) ran nothing, so they are not sent again.
The new file holds the same records with the new reward and checks; what flipped is reported.

A replay is faithful only if the environment is deterministic: where a replayed call answers
differently from the stored one, the episode is counted as diverged (its new score stands, but the
agent saw something else).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import anyio
from pydantic import BaseModel

from agent_client.agents import texts_by_turn
from agent_client.errors import HarnessError
from agent_client.export import read_records
from agent_client.models import Record, load_farm_catalog
from agent_client.progress import Progress
from agent_client.remote import EnvControl, McpTools, new_http_client
from envscaler.arguments import positive_int, with_examples
from envscaler.errors import EXIT_FAILED, EXIT_OK, InfraError
from envscaler.jsonl import dumps
from envscaler.models import ToolOutcome
from envscaler.wire import DEFAULT_FARM_CATALOG, FarmCatalog, TurnEnded

_END_TIMEOUT_S = 10.0


class Change(BaseModel):
    """One episode whose score moved: its old and new reward and the checks whose verdict changed."""

    env_id: str
    task_id: str
    repeat: int
    old_reward: float | None
    new_reward: float | None
    checks: list[str]

    @property
    def flipped(self) -> bool:
        """Full success before and not now, or the other way round."""
        return (self.old_reward == 1.0) != (self.new_reward == 1.0)


class Outcome(BaseModel):
    """What a reverification found."""

    records: list[Record]
    rescored: int
    changes: list[Change]
    diverged: list[str]
    failed: list[str]

    @property
    def flips(self) -> list[Change]:
        """Episodes whose full success changed."""
        return [c for c in self.changes if c.flipped]


def _same(stored: ToolOutcome, replayed: ToolOutcome) -> bool:
    return stored.error_kind == replayed.error_kind and stored.result == replayed.result


def _changed_checks(old: Record, new: Record) -> list[str]:
    before = {c.check_item: c.passed for c in old.checks}
    after = {c.check_item: c.passed for c in new.checks}
    return [f"{item}: {_verdict(before.get(item))} -> {_verdict(after.get(item))}"
            for item in sorted(before.keys() | after.keys()) if before.get(item) != after.get(item)]


def _verdict(passed: bool | None) -> str:
    return "absent" if passed is None else "pass" if passed else "FAIL"


async def _replay(http, control: EnvControl, record: Record) -> tuple[Record, bool]:
    """``record`` scored again on a fresh episode of its scenario; and whether the replay diverged.

    A scenario with scripted user turns is replayed turn by turn: each turn's calls, then the turn ended with
    what the agent told the user in it; the texts after the last ended turn go with the validation."""
    info = await control.create(record.task_id)
    try:
        tools = McpTools(http, info.mcp_url)
        calls = iter(record.trajectory)
        said = texts_by_turn(record.messages)
        if not record.turns:
            said = [[text for turn in said for text in turn]]
        turns: list[TurnEnded] = []
        for number, ended in enumerate([*record.turns, None]):
            for call in itertools.islice(calls, ended.calls if ended is not None else None):
                if call.error_kind != "agent":
                    await tools.call(call.name, call.arguments)
            replies = said[number] if number < len(said) else []
            if ended is not None:
                turns.append(await control.end_turn(info.episode_id, replies))
        validation = await control.validate(info.episode_id, replies)
        trajectory = await control.trajectory(info.episode_id)
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_END_TIMEOUT_S):
            await control.end(info.episode_id)
    kept = [c for c in record.trajectory if c.error_kind != "agent"]
    diverged = len(kept) != len(trajectory.calls) or not all(map(_same, kept, trajectory.calls))
    return record.model_copy(update={"reward": validation.score, "checks": validation.checks, "turns": turns}), diverged


async def reverify(catalog: FarmCatalog, records: list[Record], *, concurrency: int = 8, progress: bool = True) -> Outcome:
    """Replay and score every judged record again on the farm of ``catalog``; the rest are kept as they are."""
    missing = sorted({r.env_id for r in records} - catalog.envs.keys())
    if missing:
        raise HarnessError(f"the farm does not serve {', '.join(missing)}: start one that does (envscaler farm up ...)")
    results = list(records)
    changes: list[Change] = []
    diverged: list[str] = []
    failed: list[str] = []
    judged = [i for i, r in enumerate(records) if r.judged]
    shown = Progress(len(judged), sys.stderr, progress)
    limiter = anyio.Semaphore(concurrency)
    async with new_http_client() as http:
        controls = {env_id: EnvControl(http, env_id, endpoint) for env_id, endpoint in catalog.envs.items()}

        async def one(index: int) -> None:
            old = records[index]
            name = f"{old.env_id}/{old.task_id} repeat {old.repeat}"
            async with limiter:
                try:
                    new, drifted = await _replay(http, controls[old.env_id], old)
                except InfraError as e:
                    failed.append(f"{name}: {e}")
                    shown.add(old.model_copy(update={"termination": "infra_error"}))
                    return
            results[index] = new
            if drifted:
                diverged.append(name)
            checks = _changed_checks(old, new)
            if checks or new.reward != old.reward:
                changes.append(Change(env_id=old.env_id, task_id=old.task_id, repeat=old.repeat, old_reward=old.reward,
                                      new_reward=new.reward, checks=checks))
            shown.add(new)

        async with anyio.create_task_group() as tasks:
            for index in judged:
                tasks.start_soon(one, index)
    changes.sort(key=lambda c: (c.env_id, c.task_id, c.repeat))
    return Outcome(records=results, rescored=len(judged) - len(failed), changes=changes,
                   diverged=sorted(diverged), failed=sorted(failed))


def _reverify(args: argparse.Namespace) -> int:
    source, out = Path(args.run), Path(args.out)
    if out.is_dir():
        raise HarnessError(f"--out {out} is a folder; give a file in it, such as {out / source.name}")
    records = read_records(source)
    if not records:
        raise HarnessError(f"{source}: no run records in it (a run file is the JSONL that 'envscaler run --out' writes)")
    catalog = load_farm_catalog(args.farm)
    outcome = anyio.run(lambda: reverify(catalog, records, concurrency=args.concurrency, progress=not args.quiet))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text("".join(dumps(r) + "\n" for r in outcome.records), encoding="utf-8")
    partial.replace(out)
    flips = outcome.flips
    print(f"rescored {outcome.rescored} of {len(records)} episode(s) into {out}: {len(outcome.changes)} changed reward "
          f"or checks, {len(flips)} flipped success")
    for change in outcome.changes:
        mark = "FLIP " if change.flipped else "     "
        old = "-" if change.old_reward is None else f"{change.old_reward:.3f}"
        new = "-" if change.new_reward is None else f"{change.new_reward:.3f}"
        print(f"{mark}{change.env_id}/{change.task_id} repeat {change.repeat}: {old} -> {new}")
        for check in change.checks:
            print(f"       {check}")
    if outcome.diverged:
        print(f"{len(outcome.diverged)} replay(s) answered differently from the stored calls (the environment is not "
              f"deterministic there; their new scores stand): {', '.join(outcome.diverged[:5])}"
              + (" ..." if len(outcome.diverged) > 5 else ""), file=sys.stderr)
    for problem in outcome.failed:
        print(f"not rescored (kept as it was): {problem}", file=sys.stderr)
    return EXIT_FAILED if outcome.failed else EXIT_OK


def register_reverify(commands: argparse._SubParsersAction) -> None:
    """Add ``envscaler reverify``."""
    parser = commands.add_parser(
        "reverify", help="score a run's stored episodes again against the farm's current validators; report the flips",
        description="For each judged episode of RUN: a fresh episode of its scenario on the farm, the stored tool "
                    "calls replayed in order over MCP (calls refused as the agent's error are skipped: they ran "
                    "nothing), then the current checklist. --out gets every record with its new reward and checks "
                    "(episodes that could not be judged are copied as they are). Prints each episode whose reward or "
                    "checks changed, FLIP where full success changed. Exit 0 when every episode was rescored (flips "
                    "or not), 1 when some could not be (a server failed), 2 for bad input.",
        **with_examples("envscaler reverify runs/qwen.jsonl --out runs/qwen.rescored.jsonl",
                        "envscaler reverify runs/qwen.jsonl --farm .envscaler/farm.json --out runs/qwen.v2.jsonl")
    )
    parser.add_argument("run", metavar="RUN.jsonl", help="a file that 'envscaler run --out' wrote")
    parser.add_argument("--out", required=True, metavar="NEW.jsonl", help="where the rescored records go (replaced)")
    parser.add_argument("--farm", default=DEFAULT_FARM_CATALOG, metavar="CATALOG",
                        help=f"catalog of a farm serving the run's environments with the new checks (default: {DEFAULT_FARM_CATALOG})")
    parser.add_argument("--concurrency", type=positive_int, default=8, help="episodes replayed at once (default: 8)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.set_defaults(func=_reverify)
