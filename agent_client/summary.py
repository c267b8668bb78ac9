"""The score table printed at the end of a run: per environment and overall, then the spread over repeats."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from math import comb

from pydantic import BaseModel

from agent_client.models import ScoredRecord
from agent_client.spread import run_spread, scenario_spread


class Row(BaseModel):
    name: str
    episodes: int
    mean_reward: float
    success_rate: float
    pass_k: float
    k: int
    mean_steps: float
    tokens: int
    env_errors: int
    tool_errors: int
    infra_errors: int


def pass_hat_k(records: Sequence[ScoredRecord], k: int) -> float:
    """tau-bench's pass^k: the chance that k repeats of a task all fully succeed, averaged over tasks."""
    by_task: dict[tuple[str, str], list[ScoredRecord]] = defaultdict(list)
    for record in records:
        by_task[(record.env_id, record.task_id)].append(record)
    values = []
    for runs in by_task.values():
        n = len(runs)
        successes = sum(r.reward == 1.0 for r in runs)
        if n >= k:
            values.append(comb(successes, k) / comb(n, k))
    return sum(values) / len(values) if values else 0.0


def row(name: str, records: Sequence[ScoredRecord], k: int) -> Row:
    judged = [r for r in records if r.judged]
    return Row(
        name=name,
        episodes=len(records),
        mean_reward=sum(r.reward or 0.0 for r in judged) / len(judged) if judged else 0.0,
        success_rate=sum(r.reward == 1.0 for r in judged) / len(judged) if judged else 0.0,
        pass_k=pass_hat_k(judged, k),
        k=k,
        mean_steps=sum(r.steps for r in judged) / len(judged) if judged else 0.0,
        tokens=sum(r.usage.prompt_tokens + r.usage.completion_tokens + r.user_usage.prompt_tokens + r.user_usage.completion_tokens for r in records),
        env_errors=sum(r.env_errors for r in records),
        tool_errors=sum(r.tool_errors for r in records),
        infra_errors=sum(r.infra_failed for r in records),
    )


def infra_reasons(records: Sequence[ScoredRecord], limit: int = 5) -> list[tuple[str, int]]:
    """The most common reasons of infra errors, first line of each, with their counts."""
    reasons = Counter((r.error or "no reason recorded").splitlines()[0][:200] for r in records if r.infra_failed)
    return reasons.most_common(limit)


def summarize(records: Sequence[ScoredRecord], k: int) -> list[Row]:
    """One row per environment, then ``overall``."""
    by_env: dict[str, list[ScoredRecord]] = defaultdict(list)
    for record in records:
        by_env[record.env_id].append(record)
    return [row(env_id, by_env[env_id], k) for env_id in sorted(by_env)] + [row("overall", records, k)]


def render(rows: list[Row], title: str = "") -> str:
    """The table as text."""
    k = rows[-1].k if rows else 1
    lines = [title] if title else []
    lines.append(f"{'environment':<24} {'episodes':>8} {'reward':>7} {'success':>8} {f'pass^{k}':>7} {'steps':>6} {'tokens':>8} {'env err':>7} {'tool err':>8} {'infra':>6}")
    for r in rows:
        if r.infra_errors == r.episodes:  # nothing was scored: a 0.000 here would read as a result
            scores = f"{'-':>7} {'-':>8} {'-':>7} {'-':>6}"
        else:
            scores = f"{r.mean_reward:>7.3f} {r.success_rate:>8.1%} {r.pass_k:>7.3f} {r.mean_steps:>6.1f}"
        lines.append(f"{r.name:<24} {r.episodes:>8} {scores} {r.tokens:>8} {r.env_errors:>7} {r.tool_errors:>8} {r.infra_errors:>6}")
    return "\n".join(lines)


def render_turns(records: Sequence[ScoredRecord]) -> str | None:
    """For episodes of scenarios with scripted user turns: per turn, how many episodes ended it and the mean
    score of its checks there (turns without checks of their own left out); None when no episode has turns."""
    scored: dict[int, list[float]] = defaultdict(list)
    ended: Counter[int] = Counter()
    scripted = [r for r in records if r.turns]
    for record in scripted:
        for turn in record.turns:
            ended[turn.turn] += 1
            if turn.score is not None:
                scored[turn.turn].append(turn.score)
    if not scripted:
        return None
    parts = [f"turn {number}: ended in {ended[number]}" + (f", score {sum(scored[number]) / len(scored[number]):.3f}" if scored[number] else "")
             for number in sorted(ended)]
    return f"scripted user turns over {len(scripted)} episode(s): " + "; ".join(parts)


def pass_curve(records: Sequence[ScoredRecord], repeats: int) -> list[float]:
    """pass^k for k = 1..``repeats`` over the judged episodes (the chance that k repeats all succeed)."""
    judged = [r for r in records if r.judged]
    return [pass_hat_k(judged, k) for k in range(1, repeats + 1)]


def render_spread(records: Sequence[ScoredRecord], repeats: int, limit: int = 10) -> str:
    """pass^k for every k, and the scenarios whose repeats disagree (at most ``limit`` of them), as text."""
    spread = scenario_spread(records)
    summary = run_spread(spread)
    curve = ", ".join(f"pass^{k} {value:.3f}" for k, value in enumerate(pass_curve(records, repeats), start=1))
    lines = [f"over {repeats} repeats: {curve}",
             f"{summary.flaky} of {summary.repeated} repeated scenario(s) succeed in some repeats and fail in others; "
             f"mean reward deviation between repeats {summary.mean_reward_sd:.3f}"]
    flaky = sorted((s for s in spread if s.flaky), key=lambda s: (s.success_rate, s.env_id, s.task_id))
    for item in flaky[:limit]:
        lines.append(f"  {item.env_id}/{item.task_id}: {item.successes}/{item.runs} succeeded, "
                     f"reward {item.mean_reward:.3f} +- {item.reward_sd:.3f}")
    if len(flaky) > limit:
        lines.append(f"  ... and {len(flaky) - limit} more ('envscaler report' lists them all)")
    return "\n".join(lines)
