"""Run-to-run spread: per-scenario success over repeats, and whether two agents really differ.

Repeats of one scenario are not independent samples of an agent's skill (they share the task), so a
comparison treats the scenario as the unit: each scenario's repeats are averaged first, and the
standard error of the difference comes from the spread of those per-scenario differences (a
clustered standard error, as in Miller 2024, "Adding Error Bars to Evals"). Significance is a
permutation test over the same units: a sign flip per scenario between two runs, a shuffle of the
repeats within one scenario.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from itertools import combinations
from math import ceil, comb, sqrt
from statistics import fmean, variance

from pydantic import BaseModel

from agent_client.models import ScoredRecord

# z for a two-sided 95% test plus z for 80% power: a difference this many standard errors wide is
# found four times out of five.
_DETECT_Z = 1.96 + 0.84
# Beyond this many arrangements a permutation test samples them instead (seeded: the same file
# always gives the same p-value).
_EXACT_LIMIT = 5000
_SAMPLES = 5000


class ScenarioSpread(BaseModel):
    """One scenario's outcomes over its repeats in one run."""

    env_id: str
    task_id: str
    runs: int
    successes: int
    success_rate: float
    mean_reward: float
    # The sample standard deviation of the reward over repeats; 0.0 with one repeat.
    reward_sd: float
    rewards: list[float]

    @property
    def flaky(self) -> bool:
        """Some repeats fully succeeded and some did not."""
        return 0 < self.successes < self.runs


class RunSpread(BaseModel):
    """How much a run's outcomes move between repeats of the same scenario."""

    scenarios: int
    repeated: int
    flaky: int
    mean_reward_sd: float


class ScenarioDifference(BaseModel):
    """One scenario run by agents A and B: their mean rewards and success rates, and a p-value."""

    env_id: str
    task_id: str
    a: ScenarioSpread
    b: ScenarioSpread
    difference: float
    # Two-sided permutation test of the repeats (1.0 when either side has a single repeat and they tie).
    p_value: float


class Comparison(BaseModel):
    """Run A against run B over the scenarios both ran: mean reward difference B - A with its error."""

    name_a: str
    name_b: str
    scenarios: int
    only_a: int
    only_b: int
    mean_a: float
    mean_b: float
    difference: float
    standard_error: float
    ci_low: float
    ci_high: float
    p_value: float
    # Repeats per scenario (each agent) for an 80% chance to find this difference at the 5% level,
    # with the same scenarios; None with ``repeats_note`` saying why when it cannot be said.
    repeats_needed: int | None
    repeats_note: str
    per_scenario: list[ScenarioDifference]


def scenario_spread(records: Sequence[ScoredRecord]) -> list[ScenarioSpread]:
    """Each scenario's success rate and reward spread over its repeats (episodes that could not be judged left out)."""
    by_task: dict[tuple[str, str], list[float]] = defaultdict(list)
    for record in [r for r in records if r.judged]:
        by_task[(record.env_id, record.task_id)].append(record.reward or 0.0)
    rows = []
    for (env_id, task_id), rewards in sorted(by_task.items()):
        successes = sum(r == 1.0 for r in rewards)
        rows.append(ScenarioSpread(env_id=env_id, task_id=task_id, runs=len(rewards), successes=successes,
                                   success_rate=successes / len(rewards), mean_reward=fmean(rewards),
                                   reward_sd=sqrt(variance(rewards)) if len(rewards) > 1 else 0.0, rewards=rewards))
    return rows


def run_spread(rows: list[ScenarioSpread]) -> RunSpread:
    """The run's spread in one line: how many repeated scenarios flip, and the mean reward deviation."""
    repeated = [r for r in rows if r.runs > 1]
    return RunSpread(scenarios=len(rows), repeated=len(repeated), flaky=sum(r.flaky for r in repeated),
                     mean_reward_sd=fmean(r.reward_sd for r in repeated) if repeated else 0.0)


def _two_sample_p(a: list[float], b: list[float]) -> float:
    """Two-sided permutation p-value of mean(b) - mean(a): the repeats shuffled between the two sides."""
    pooled, size = a + b, len(a)
    observed = abs(fmean(b) - fmean(a))
    total = sum(pooled)

    def extreme(chosen: tuple[float, ...] | list[float]) -> bool:
        mean_a = sum(chosen) / size
        mean_b = (total - sum(chosen)) / (len(pooled) - size)
        return abs(mean_b - mean_a) >= observed - 1e-12

    if comb(len(pooled), size) <= _EXACT_LIMIT:
        splits = list(combinations(pooled, size))
        return sum(extreme(s) for s in splits) / len(splits)
    rng = random.Random(0)
    hits = sum(extreme(rng.sample(pooled, size)) for _ in range(_SAMPLES))
    return (hits + 1) / (_SAMPLES + 1)


def _paired_p(differences: list[float]) -> float:
    """Two-sided sign-flip permutation p-value of the mean of per-scenario differences."""
    observed = abs(fmean(differences))
    if len(differences) <= 12:
        flips = [[(1 if mask >> i & 1 else -1) for i in range(len(differences))] for mask in range(2 ** len(differences))]
    else:
        rng = random.Random(0)
        flips = [[rng.choice((1, -1)) for _ in differences] for _ in range(_SAMPLES)]
    hits = sum(abs(fmean(s * d for s, d in zip(signs, differences))) >= observed - 1e-12 for signs in flips)
    return hits / len(flips) if len(differences) <= 12 else (hits + 1) / (len(flips) + 1)


def _repeats_needed(diffs: list[ScenarioDifference], difference: float) -> tuple[int | None, str]:
    """Repeats per scenario at which this difference is found with 80% power, and a note on the answer.

    The variance of one scenario's difference is the true spread between scenarios (s_b^2) plus the
    repeat noise of each side over its repeats; the noise is estimated from the repeats and the rest
    of the observed spread is taken as s_b^2, which no number of repeats removes.
    """
    noise = [d for d in diffs if d.a.runs > 1 and d.b.runs > 1]
    if not noise:
        return None, "needs two or more repeats per scenario on both sides to measure repeat noise"
    if abs(difference) < 1e-12:
        return None, "no difference to detect"
    within = fmean(d.a.reward_sd ** 2 + d.b.reward_sd ** 2 for d in noise)
    observed = variance([d.difference for d in diffs]) if len(diffs) > 1 else 0.0
    noise_now = fmean(d.a.reward_sd ** 2 / d.a.runs + d.b.reward_sd ** 2 / d.b.runs for d in noise)
    between = max(0.0, observed - noise_now)
    room = len(diffs) * (difference / _DETECT_Z) ** 2 - between
    if within == 0.0:
        return (1, "repeats agree exactly: one repeat is enough") if room > 0 else \
            (None, "the scenarios disagree too much: more scenarios are needed, not repeats")
    if room <= 0:
        return None, "the scenarios disagree too much: more scenarios are needed, not repeats"
    needed = max(1, ceil(within / room))
    return needed, f"at {len(diffs)} scenarios, 80% power, 5% level"


def compare(a: Sequence[ScoredRecord], b: Sequence[ScoredRecord], name_a: str = "A", name_b: str = "B") -> Comparison:
    """Run ``b`` against run ``a`` on the scenarios both judged, each scenario one unit (its repeats averaged)."""
    spread_a = {(s.env_id, s.task_id): s for s in scenario_spread(a)}
    spread_b = {(s.env_id, s.task_id): s for s in scenario_spread(b)}
    common = sorted(spread_a.keys() & spread_b.keys())
    diffs = [ScenarioDifference(env_id=key[0], task_id=key[1], a=spread_a[key], b=spread_b[key],
                                difference=spread_b[key].mean_reward - spread_a[key].mean_reward,
                                p_value=_two_sample_p(spread_a[key].rewards, spread_b[key].rewards))
             for key in common]
    values = [d.difference for d in diffs]
    difference = fmean(values) if values else 0.0
    error = sqrt(variance(values) / len(values)) if len(values) > 1 else 0.0
    needed, note = _repeats_needed(diffs, difference) if diffs else (None, "no scenario in common")
    return Comparison(
        name_a=name_a, name_b=name_b, scenarios=len(common),
        only_a=len(spread_a.keys() - spread_b.keys()), only_b=len(spread_b.keys() - spread_a.keys()),
        mean_a=fmean(d.a.mean_reward for d in diffs) if diffs else 0.0,
        mean_b=fmean(d.b.mean_reward for d in diffs) if diffs else 0.0,
        difference=difference, standard_error=error, ci_low=difference - 1.96 * error, ci_high=difference + 1.96 * error,
        p_value=_paired_p(values) if values else 1.0, repeats_needed=needed, repeats_note=note, per_scenario=diffs,
    )
