"""What the report measures in one run: per-environment overview rows, tool use and latencies."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel

from agent_client.models import Record
from agent_client.summary import pass_curve

# The causes of a failed tool call as the server classifies them (``ToolOutcome.error_kind``), then
# episodes that could not be judged at all.
ERROR_KINDS = ("agent", "tool", "env", "timeout", "infra")


class Run(BaseModel):
    """One run file as the report shows it."""

    label: str
    path: str
    agents: list[str]
    models: list[str]
    records: list[Record]


class Overview(BaseModel):
    """One environment's (or the whole run's) numbers."""

    name: str
    episodes: int
    judged: int
    mean_reward: float
    success_rate: float
    # pass^k for k = 1..the most repeats any scenario has.
    pass_k: list[float]
    errors: dict[str, int]
    steps_per_episode: float
    tokens_per_episode: float
    duration_p50_s: float


class ToolUse(BaseModel):
    """One tool of one environment over a run: calls, failures by kind, latency percentiles."""

    env_id: str
    tool: str
    calls: int
    errors: dict[str, int]
    latency_ms: dict[str, float]

    @property
    def failed(self) -> int:
        """Calls that failed, whatever the cause."""
        return sum(self.errors.values())


def percentile(values: list[float], share: float) -> float:
    """The ``share`` quantile of ``values`` with linear interpolation; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = share * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def max_repeats(records: list[Record]) -> int:
    """The most episodes any one scenario has (the k of pass^k's longest curve)."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for record in records:
        counts[(record.env_id, record.task_id)] += 1
    return max(counts.values(), default=1)


def error_counts(records: list[Record]) -> dict[str, int]:
    """Failed tool calls by kind, and ``infra``: episodes that could not be judged."""
    counts = dict.fromkeys(ERROR_KINDS, 0)
    for record in records:
        counts["infra"] += record.infra_failed
        for call in record.trajectory:
            if call.error_kind is not None:
                counts[call.error_kind] += 1
    return counts


def overview(name: str, records: list[Record], repeats: int) -> Overview:
    """The overview row of ``records``: judged episodes for rewards, every episode for errors and cost."""
    judged = [r for r in records if r.judged]
    tokens = sum(u.prompt_tokens + u.completion_tokens for r in records for u in (r.usage, r.user_usage))
    return Overview(
        name=name, episodes=len(records), judged=len(judged),
        mean_reward=sum(r.reward or 0.0 for r in judged) / len(judged) if judged else 0.0,
        success_rate=sum(r.reward == 1.0 for r in judged) / len(judged) if judged else 0.0,
        pass_k=pass_curve(judged, repeats), errors=error_counts(records),
        steps_per_episode=sum(r.steps for r in records) / len(records) if records else 0.0,
        tokens_per_episode=tokens / len(records) if records else 0.0,
        duration_p50_s=percentile([r.duration_s for r in records], 0.5),
    )


def overviews(records: list[Record]) -> list[Overview]:
    """One row per environment, then ``overall``."""
    repeats = max_repeats(records)
    by_env: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_env[record.env_id].append(record)
    return [overview(env_id, by_env[env_id], repeats) for env_id in sorted(by_env)] + [overview("overall", records, repeats)]


def tool_use(records: list[Record]) -> list[ToolUse]:
    """Every tool called in the run, most called first."""
    calls: dict[tuple[str, str], list] = defaultdict(list)
    for record in records:
        for call in record.trajectory:
            calls[(record.env_id, call.name)].append(call)
    rows = []
    for (env_id, tool), made in calls.items():
        errors = {kind: sum(c.error_kind == kind for c in made) for kind in ERROR_KINDS[:-1]}
        latencies = [c.latency_s * 1000 for c in made]
        rows.append(ToolUse(env_id=env_id, tool=tool, calls=len(made), errors={k: v for k, v in errors.items() if v},
                            latency_ms={p: percentile(latencies, share) for p, share in (("p50", .5), ("p90", .9), ("p99", .99))}))
    return sorted(rows, key=lambda r: (-r.calls, r.env_id, r.tool))


def labels_for(paths: list[Path]) -> list[str]:
    """A short, distinct name per run file: its stem, numbered where two stems are the same."""
    seen: dict[str, int] = defaultdict(int)
    labels = []
    for path in paths:
        seen[path.stem] += 1
        labels.append(path.stem if seen[path.stem] == 1 else f"{path.stem} #{seen[path.stem]}")
    return labels
