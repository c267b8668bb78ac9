"""``envscaler run``'s engine: episodes in parallel, each validated, recorded and ended.

For every selected scenario (times ``repeats``): create an episode through the control API, hand its
MCP URL to the agent, stop at the agent's end, ``max_steps`` or the time limit, validate, fetch the
server-side trajectory, append one Record to the output JSONL, end the episode. Records already in
the output are skipped, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
from pydantic import ValidationError

from agent_client.agents import Agent, EpisodeContext
from agent_client.llm import LlmEndpoint
from agent_client.http import LeanHttp
from agent_client.errors import HarnessError, RecordsUnwritable
from agent_client.models import AgentResult, Record, RecordScore
from agent_client.progress import Progress
from agent_client.remote import EnvControl, McpTools, new_http_client
from envscaler.errors import InfraError
from envscaler.bundle import describe_validation_error
from envscaler.jsonl import drop_lines, dumps, iter_lines, validate_json
from envscaler.wire import EpisodeValidation, FarmCatalog, ScenarioSummary, Trajectory
from agent_client.user import SimulatedUser


@dataclass
class RunOptions:
    repeats: int = 1
    concurrency: int = 8
    max_steps: int = 30
    time_limit_s: float = 300.0
    user_endpoint: LlmEndpoint | None = None
    progress: bool = True
    # Records of episodes that could not be judged (infra errors) count as not done: a rerun redoes them.
    rerun_infra_errors: bool = True
    # How long a server keeps an episode of this run unused: renewed every third of it while the episode
    # runs, so the episodes of a run that was killed end within about that long.
    lease_s: float = 60.0
    # Processes that run the episodes (``concurrency`` is shared among them); 1 runs them in this one.
    procs: int = 1


@dataclass(frozen=True)
class RunIdentity:
    """What made a run's records: resuming into a file written by another agent or model would mix them."""

    agent: str
    model: str | None
    env_ids: frozenset[str]

    def mismatch(self, record: _KeptRecord) -> str | None:
        """Why ``record`` cannot belong to this run, or None."""
        if record.agent != self.agent:
            return f"agent {record.agent!r}, not {self.agent!r}"
        if record.model and self.model and record.model != self.model:
            return f"model {record.model!r}, not {self.model!r}"
        if record.env_id not in self.env_ids:
            return f"environment {record.env_id!r}, which this farm does not serve"
        return None


class _KeptRecord(RecordScore):
    """What resuming reads of a record already in the output file: its score, and who made it."""

    agent: str | None = None
    model: str | None = None


class DoneRecords:
    """The records already in a run's output file that it keeps: their keys (env, task, repeat), and their scores."""

    def __init__(self) -> None:
        self.keys: set[tuple[str, str, int]] = set()
        self.scores: list[RecordScore] = []

    def __contains__(self, key: tuple[str, str, int]) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.scores)

    def add(self, record: RecordScore) -> None:
        self.keys.add((record.env_id, record.task_id, record.repeat))
        self.scores.append(record)


def read_done(path: Path, identity: RunIdentity, *, rerun_infra_errors: bool = True) -> DoneRecords:
    """The records already in ``path`` that stay, rewriting it without what will run again.

    Dropped: a torn last line (a killed run's last write: the only line without its ``"\\n"``) and,
    with ``rerun_infra_errors``, the records of episodes that could not be judged (a server or
    endpoint failed), so that a rerun redoes them. The rewrite is atomic (``envscaler.jsonl.drop_lines``).
    HarnessError when a record was made by another agent, model or farm than ``identity``, or when a
    whole line is not a record: it is reported, never deleted.
    """
    done = DoneRecords()
    if not path.exists():
        return done
    dropped: set[int] = set()
    for number, raw in iter_lines(path):
        if not raw.endswith(b"\n"):
            dropped.add(number)
            break
        if not raw.strip():
            dropped.add(number)
            continue
        try:
            record = validate_json(_KeptRecord, raw)
        except ValidationError as e:
            raise HarnessError(f"{path}:{number} is not a run record ({describe_validation_error(e)}): remove that line, "
                               "or write this run to another --out") from None
        problem = identity.mismatch(record)
        if problem is not None:
            raise HarnessError(f"{path}:{number} is a record of {problem}: write this run to another --out, "
                               "or remove the file to start over")
        if rerun_infra_errors and record.infra_failed:
            dropped.add(number)
            continue
        done.add(record)
    if dropped:
        drop_lines(path, dropped)
    return done


def select(scenarios: list[ScenarioSummary], patterns: list[str] | None) -> list[ScenarioSummary]:
    """Scenarios matching ``ENV``, ``ENV/TASK`` or ``TASK`` patterns (all when none are given)."""
    if not patterns:
        return scenarios
    chosen = [s for s in scenarios if any(p in (s.env_id, s.task_id, f"{s.env_id}/{s.task_id}") for p in patterns)]
    if not chosen:
        raise HarnessError(f"no scenario matches {', '.join(patterns)}")
    return chosen


# How long an episode's end may take; past it the server's idle timeout ends the episode.
_END_TIMEOUT_S = 10.0


async def run_episode(http: LeanHttp, control: EnvControl, scenario: ScenarioSummary, repeat: int,
                      agent: Agent, options: RunOptions) -> Record:
    """One episode from creation to end; never raises for agent, infrastructure or harness trouble."""
    started_wall, started = time.time(), time.monotonic()
    record = Record(env_id=scenario.env_id, task_id=scenario.task_id, repeat=repeat, agent=agent.name, model=agent.model,
                    termination="infra_error", started_at=started_wall, duration_s=0.0)
    try:
        await _episode(http, control, scenario, repeat, agent, options, record)
    except Exception as e:  # noqa: BLE001 - one episode's trouble (a harness bug included) must not end the run
        record.termination, record.reward = "infra_error", None
        record.error = f"the harness failed in this episode: {type(e).__name__}: {e}"
    record.duration_s = time.monotonic() - started
    return record


async def _episode(http: LeanHttp, control: EnvControl, scenario: ScenarioSummary, repeat: int, agent: Agent,
                   options: RunOptions, record: Record) -> None:
    try:
        # Shielded: a run stopped now (Ctrl-C, a full disk) still learns the episode's id, and ends it below.
        with anyio.CancelScope(shield=True):
            info = await control.create(scenario.task_id, lease_s=options.lease_s)
    except InfraError as e:
        record.error = str(e)
        return
    record.episode_id, record.tools = info.episode_id, info.tools
    user = None
    # Scripted user turns are the user: no simulated one speaks besides them.
    if info.user_profile and options.user_endpoint is not None and agent.converses and not info.turns:
        user = SimulatedUser(options.user_endpoint, info.task, info.user_profile)
    ctx = EpisodeContext(env_id=scenario.env_id, task_id=scenario.task_id, info=info, tools=McpTools(http, info.mcp_url),
                         control=control, max_steps=options.max_steps, user=user, seed=repeat)
    ended = False
    try:
        async with anyio.create_task_group() as renewing:
            renewing.start_soon(_renew_forever, control, info.episode_id, options.lease_s)
            ended = await _play_and_score(ctx, agent, control, info.episode_id, record, options)
            renewing.cancel_scope.cancel()
    finally:
        # Shielded: an interrupted run (Ctrl-C) still ends its live episodes rather than leave them to
        # the servers' idle timeout.
        if not ended:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_END_TIMEOUT_S):
                await control.end(info.episode_id)


async def _renew_forever(control: EnvControl, episode_id: str, lease_s: float) -> None:
    """Renew the episode's lease while its agent works (thinking for minutes between calls, say)."""
    while True:
        await anyio.sleep(lease_s / 3)
        await control.renew(episode_id)


async def _play_and_score(ctx: EpisodeContext, agent: Agent, control: EnvControl, episode_id: str, record: Record,
                          options: RunOptions) -> bool:
    """The agent's run, then the validator's score and the server's trajectory, into ``record``; whether
    the server has ended the episode meanwhile (with the validation, in one request)."""
    try:
        with anyio.fail_after(options.time_limit_s):
            result = await agent.run(ctx)
    except TimeoutError:
        result = AgentResult(messages=ctx.messages, termination="time_limit", error=f"ran past {options.time_limit_s:g} s")
    except InfraError as e:
        result = AgentResult(messages=ctx.messages, termination="infra_error", error=str(e))
    except Exception as e:  # noqa: BLE001 - one episode's trouble (a harness bug included) must not end the run
        result = AgentResult(messages=ctx.messages, termination="infra_error",
                             error=f"the harness failed in this episode's agent: {type(e).__name__}: {e}")
    record.messages, record.termination, record.error = result.messages, result.termination, result.error
    record.replaced_surrogates = result.replaced_surrogates
    record.steps, record.usage, record.user_usage = result.steps, result.usage, result.user_usage
    record.turns = ctx.turns_ended
    try:
        final: EpisodeValidation | Trajectory | None = None
        if result.termination != "infra_error":
            final = await control.validate(episode_id, ctx.pending_replies(), end=True)
            record.reward, record.checks = final.score, final.checks
        if final is None or final.calls is None:
            final = await control.trajectory(episode_id)
        record.trajectory = final.calls
        record.steps = record.steps or len(final.calls)
        record.env_errors, record.agent_errors, record.tool_errors = final.env_errors, final.agent_errors, final.tool_errors
    except InfraError as e:
        record.termination, record.error, record.reward = "infra_error", str(e), None
        return False
    return isinstance(final, EpisodeValidation) and final.ended


def record_line(record: Record) -> str:
    """The JSONL line of ``record``; one that cannot be serialised becomes a line that says why.

    That line is an infra error (so a rerun tries the episode again) without the messages,
    trajectory and score, which held what could not be written.
    """
    return _written(record)[0]


def record_entry(record: Record) -> tuple[RecordScore, bytes]:
    """``record``'s JSONL line (with its ``"\\n"``, see :func:`record_line`) and the score of what that line holds."""
    line, written = _written(record)
    return written.score(), (line + "\n").encode()


def _written(record: Record) -> tuple[str, Record]:
    """The line of ``record`` and the record it holds: ``record``, or the stand-in that says why it could not be written."""
    try:
        return dumps(record), record
    except Exception as e:  # noqa: BLE001 - whatever the value, the run goes on and the episode is accounted for
        stand_in = Record(env_id=record.env_id, task_id=record.task_id, repeat=record.repeat, agent=record.agent,
                          model=record.model, episode_id=record.episode_id, termination="infra_error",
                          error=f"this episode's record could not be written ({type(e).__name__}: {e}); "
                                "its messages, trajectory and score were left out",
                          started_at=record.started_at, duration_s=record.duration_s)
        return dumps(stand_in), stand_in


async def run(catalog: FarmCatalog, make_agent: Callable[[], Agent], out: Path, *, patterns: list[str] | None = None,
              options: RunOptions | None = None) -> list[RecordScore]:
    """Run every selected scenario ``repeats`` times; append records to ``out``; return the scores of every
    record in ``out`` once it has ended, those it resumed from first (the whole records are in ``out``)."""
    options = options or RunOptions()
    out.parent.mkdir(parents=True, exist_ok=True)
    with _only_writer(out):
        return await _run(catalog, make_agent, out, patterns, options)


@contextlib.contextmanager
def _only_writer(out: Path) -> Iterator[None]:
    """Hold ``out`` for this run alone (a lock beside it, released when the run ends or dies): two runs
    appending to one file would interleave their records and run the same episodes twice."""
    lock_path = out.with_name(f".{out.name}.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise HarnessError(f"another run (pid {holder or '?'}) is writing {out}: wait for it to end, or give another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
    finally:
        os.close(fd)


async def _run(catalog: FarmCatalog, make_agent: Callable[[], Agent], out: Path, patterns: list[str] | None,
               options: RunOptions) -> list[RecordScore]:
    agent = make_agent()
    identity = RunIdentity(agent.name, agent.model, frozenset(catalog.envs))
    done = read_done(out, identity, rerun_infra_errors=options.rerun_infra_errors)
    async with new_http_client() as http:
        controls = {env_id: EnvControl(http, env_id, endpoint) for env_id, endpoint in catalog.envs.items()}
        # Imported here: the pool imports this module (its workers run ``run_episode``).
        from agent_client.pool import dismiss, run_in_processes, spawn_workers

        procs = min(options.procs, options.concurrency)
        # Started first: each imports the harness (most of a second) while the scenarios are listed.
        workers = await spawn_workers(procs) if procs > 1 else []
        try:
            listed = await _list_scenarios(controls, options.concurrency)
            jobs = spread_over_environments(
                [(s, r) for s in select(listed, patterns) for r in range(options.repeats) if (s.env_id, s.task_id, r) not in done])
        except BaseException:
            await dismiss(workers)
            raise
        # One job per worker at most, and none for a single job: this process runs it with less start-up.
        keep = len(jobs) if len(jobs) > 1 else 0
        await dismiss(workers[keep:])
        workers = workers[:keep]
        if len(done):
            print(f"resuming: {len(done)} record(s) already in {out}, {len(jobs)} to run", file=sys.stderr)
        fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        sink = RecordSink(fd, Progress(len(jobs), sys.stderr, options.progress))
        try:
            if workers:
                await run_in_processes(catalog, make_agent, agent, jobs, options, workers, sink)
            else:
                await _run_here(http, controls, agent, jobs, options, sink)
        finally:
            os.close(fd)
    if sink.unwritable:
        raise RecordsUnwritable(f"cannot write {out}: {sink.unwritable}; {len(sink.scores)} record(s) of this run are in it, "
                                "whole. Make room and run the same command again to finish")
    return [*done.scores, *sink.scores]


async def _list_scenarios(controls: dict[str, EnvControl], concurrency: int) -> list[ScenarioSummary]:
    """Every environment's scenarios, in the catalog's order, asked of up to ``concurrency`` environments at once.
    Raises what asking the first environment (in that order) that failed raised."""
    listed: dict[str, list[ScenarioSummary] | Exception] = {}
    limiter = anyio.Semaphore(max(1, concurrency))

    async def one(env_id: str, control: EnvControl) -> None:
        async with limiter:
            try:
                listed[env_id] = await control.scenarios()
            except Exception as e:  # noqa: BLE001 - raised below, alone, as a sequential listing would
                listed[env_id] = e

    async with anyio.create_task_group() as tasks:
        for env_id, control in controls.items():
            tasks.start_soon(one, env_id, control)
    scenarios: list[ScenarioSummary] = []
    for env_id in controls:
        answer = listed[env_id]
        if isinstance(answer, Exception):
            raise answer
        scenarios += answer
    return scenarios


def spread_over_environments(jobs: list[tuple[ScenarioSummary, int]]) -> list[tuple[ScenarioSummary, int]]:
    """``jobs`` taken from each environment in turn (each environment's in their order).

    An environment runs its tool calls one at a time (one worker) and its checks one at a time, and
    a farm may serve several environments from one process: episodes started in catalog order would
    queue on a few environments while the rest of the farm idles.
    """
    queues: dict[str, list[tuple[ScenarioSummary, int]]] = {}
    for job in jobs:
        queues.setdefault(job[0].env_id, []).append(job)
    longest = max((len(queue) for queue in queues.values()), default=0)
    return [queue[turn] for turn in range(longest) for queue in queues.values() if turn < len(queue)]


class RecordSink:
    """The one writer of a run's output file: each record appended whole, counted in the progress display."""

    def __init__(self, fd: int, progress: Progress) -> None:
        self.fd, self.progress = fd, progress
        self.scores: list[RecordScore] = []
        # Why a record could not be written (a full disk), once one could not: the run then stops.
        self.unwritable: str | None = None

    def write(self, score: RecordScore, line: bytes) -> bool:
        """Append ``line``, the record whose score is ``score``; False when it could not be written."""
        problem = _append(self.fd, line)
        if problem is not None:
            self.unwritable = self.unwritable or problem
            return False
        self.scores.append(score)
        self.progress.add(score)
        return True


async def _run_here(http: LeanHttp, controls: dict[str, EnvControl], agent: Agent, jobs: list[tuple[ScenarioSummary, int]],
                    options: RunOptions, sink: RecordSink) -> None:
    """The episodes of ``jobs`` in this process, ``options.concurrency`` at once, into ``sink``."""
    limiter = anyio.Semaphore(options.concurrency)
    async with anyio.create_task_group() as tasks:

        async def one(scenario: ScenarioSummary, repeat: int) -> None:
            async with limiter:
                record = await run_episode(http, controls[scenario.env_id], scenario, repeat, agent, options)
            # Written per episode: a killed run loses at most the episodes in flight.
            if not sink.write(*record_entry(record)):
                # No room for this record: stop, ending the episodes in flight; rerunning finishes the run.
                tasks.cancel_scope.cancel()

        for scenario, repeat in jobs:
            tasks.start_soon(one, scenario, repeat)


def _append(fd: int, line: bytes) -> str | None:
    """Append ``line`` whole, or not at all: None, or why it could not be written (what was written
    of it is cut off again, so that the file ends with a whole record)."""
    end = os.lseek(fd, 0, os.SEEK_END)
    try:
        written = 0
        while written < len(line):
            written += os.write(fd, line[written:])
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, end)
        return e.strerror or str(e)
    return None
