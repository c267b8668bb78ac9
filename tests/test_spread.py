"""Run-to-run spread and agent comparisons (agent_client.spread), and the live progress lines."""

from __future__ import annotations

import io

import pytest

from agent_client.models import Record
from agent_client.progress import Progress
from agent_client.spread import compare, run_spread, scenario_spread


def _records(agent: str, rewards: dict[str, list[float]]) -> list[Record]:
    return [Record(env_id="env", task_id=task, repeat=repeat, agent=agent, reward=reward, termination="finished",
                   started_at=0.0, duration_s=1.0)
            for task, values in rewards.items() for repeat, reward in enumerate(values)]


def test_scenario_spread_counts_flaky_scenarios_and_leaves_out_infra_errors():
    records = _records("a", {"t1": [1.0, 0.0, 1.0], "t2": [0.5, 0.5, 0.5]})
    records.append(Record(env_id="env", task_id="t2", repeat=3, agent="a", termination="infra_error", started_at=0, duration_s=0))
    rows = {r.task_id: r for r in scenario_spread(records)}
    assert rows["t1"].successes == 2 and rows["t1"].flaky and rows["t1"].reward_sd == pytest.approx(0.57735, abs=1e-4)
    assert rows["t2"].runs == 3 and not rows["t2"].flaky and rows["t2"].reward_sd == 0.0
    summary = run_spread(list(rows.values()))
    assert (summary.scenarios, summary.repeated, summary.flaky) == (2, 2, 1)


def test_a_consistent_difference_is_significant_and_a_tie_is_not():
    tasks = [f"t{i}" for i in range(10)]
    a = _records("a", {t: [0.0, 0.0] for t in tasks})
    b = _records("b", {t: [1.0, 1.0] for t in tasks})
    result = compare(a, b, "a", "b")
    assert result.difference == 1.0 and result.p_value == pytest.approx(2 / 1024)
    assert result.repeats_needed == 1
    tie = compare(a, a)
    assert tie.p_value == 1.0 and tie.repeats_needed is None and tie.repeats_note == "no difference to detect"


def test_repeat_noise_sets_how_many_repeats_a_difference_needs():
    # Every scenario: A succeeds half the time, B three times in four; the same true gap everywhere.
    tasks = [f"t{i}" for i in range(20)]
    a = _records("a", {t: [1.0, 0.0, 1.0, 0.0] for t in tasks})
    b = _records("b", {t: [1.0, 1.0, 1.0, 0.0] for t in tasks})
    result = compare(a, b)
    assert result.difference == pytest.approx(0.25)
    # within-scenario variance 1/3 + 1/4 = 7/12, no spread between scenarios:
    # K >= (7/12) / (20 * (0.25 / 2.8)^2) = 3.66 -> 4
    assert result.repeats_needed == 4
    one_repeat = compare(_records("a", {t: [1.0] for t in tasks}), _records("b", {t: [0.0] for t in tasks}))
    assert one_repeat.repeats_needed is None and "two or more repeats" in one_repeat.repeats_note


def test_progress_in_a_log_writes_plain_lines_with_rate_eta_and_rewards():
    stream = io.StringIO()
    progress = Progress(30, stream, enabled=True)
    for record in _records("a", {f"t{i}": [1.0 if i % 2 else 0.5] for i in range(30)}):
        progress.add(record)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2  # every 25 episodes, and the end
    assert lines[0].startswith("[####################....] 25/30") and "ETA" in lines[0] and "/s" in lines[0]
    assert "30/30" in lines[1] and "elapsed" in lines[1] and "mean reward 0.750, success 15/30" in lines[1]
    assert "\r" not in stream.getvalue()
