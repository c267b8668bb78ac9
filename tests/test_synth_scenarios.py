"""ScenGenerator's gates: the same as ``catalog check``, run on every draft, repaired when they fail."""

from __future__ import annotations

import json

import pytest

from envscaler import Bundle, EnvSpec, load_bundle, save_bundle
from envscaler.models import CheckItem, Scenario, ToolCall
from synth.assemble import assemble_class
from synth.models import SynthConfig
from synth.pipeline import synthesis
from synth.scenarios import run_gates
from tests.support.synth_script import (
    CLASS_NAME,
    ENV_ID,
    METHODS,
    SKELETON,
    MatchingReplayServer,
    answer,
    scenario_answers,
    stage_models,
)

pytestmark = pytest.mark.anyio

# Both hold before anything is done: a do-nothing agent would score 1.0.
ALWAYS_TRUE = [
    'def check_func(final_state):\n    return len(final_state["rooms"]) == 2\n',
    'def check_func(final_state):\n    return final_state["bookings"]["BK001"] == initial_state["bookings"]["BK001"]\n',
]


@pytest.fixture
def env_dir(tmp_path):
    code = assemble_class(SKELETON, CLASS_NAME, list(METHODS.values()))
    spec = EnvSpec(env_id=ENV_ID, env_class_name=CLASS_NAME, env_class_code=code, environment_summary="Rooms.",
                   state_space_definition={"state_attributes": {"rooms": "rooms", "bookings": "bookings"}})
    return save_bundle(Bundle(spec=spec), tmp_path / "envs")


def good_steps() -> dict[str, list]:
    return scenario_answers("Aurora", 1, 1)


def bad_scenario() -> Scenario:
    steps = good_steps()
    content = {stage: json.loads(s[0]["content"]) for stage, s in steps.items()}
    return Scenario(
        task_id="draft", env_id=ENV_ID, init_config=content["initial_state"]["init_config"], task=content["task"]["task"],
        checklist_with_func=[CheckItem(check_item=i, check_func=f)
                             for i, f in zip(content["checklist"]["checklist"], ALWAYS_TRUE)],
        reference_solution=[ToolCall.model_validate(c) for c in content["reference"]["reference_solution"]],
    )


async def test_a_check_passing_on_the_initial_state_fails_the_gates(env_dir):
    report = await run_gates(load_bundle(env_dir).spec, bad_scenario(), 120)
    verdicts = {g.gate: g for g in report.scenarios[0].gates}
    assert not report.passed
    assert not verdicts["check_fails_on_initial"].passed
    assert "every check already passes" in verdicts["check_fails_on_initial"].detail
    assert not verdicts["do_nothing_below_one"].passed
    assert verdicts["reference_runs"].passed and verdicts["checks_pass_on_reference"].passed


async def scenarios(server, env_dir, tmp_path, count: int, **settings):
    config = SynthConfig(base_url=server.base_url, stages=stage_models(), backoff_s=0.01, retries=1, **settings)
    async with synthesis(config, tmp_path / "cache", tmp_path / "report.json") as run:
        ok = await run.scenarios(env_dir, count)
    return ok, run.report


async def test_a_scenario_failing_a_gate_is_repaired(env_dir, tmp_path):
    script = good_steps()
    proper = json.loads(script["check_funcs"][0]["content"])["check_funcs"]
    reference = json.loads(script["reference"][0]["content"])["reference_solution"]
    script["check_funcs"] = [answer({"check_funcs": ALWAYS_TRUE})]
    script["scenario_repair"] = [answer({"check_funcs": proper, "reference_solution": reference})]
    with MatchingReplayServer(script) as server:
        ok, report = await scenarios(server, env_dir, tmp_path, 1)
    assert ok and report.accepted_scenarios == [f"{ENV_ID}_synth_001"]
    repair_prompt = server.requests_for("scenario_repair")[0]["messages"][-1]["content"]
    assert "check_fails_on_initial: no check fails cleanly before any action" in repair_prompt
    assert report.stages["gates"].attempts == 2 and report.stages["gates"].accepted == 1
    saved = load_bundle(env_dir).scenarios
    assert [c.check_func for c in saved[0].checklist_with_func] == proper
    assert report.catalog_check == {ENV_ID: True}


async def test_a_scenario_that_stays_broken_is_dropped_after_bounded_repairs(env_dir, tmp_path):
    script = good_steps()
    reference = json.loads(script["reference"][0]["content"])["reference_solution"]
    script["check_funcs"] = [answer({"check_funcs": ALWAYS_TRUE})]
    script["scenario_repair"] = [answer({"check_funcs": ALWAYS_TRUE, "reference_solution": reference}) for _ in range(5)]
    with MatchingReplayServer(script) as server:
        ok, report = await scenarios(server, env_dir, tmp_path, 1, max_repairs=1)
    assert not ok and report.accepted_scenarios == []
    assert len(server.requests_for("scenario_repair")) == 1
    assert report.stages["gates"].attempts == 2 and report.stages["gates"].accepted == 0
    assert report.rejections[0].stage == "gates" and "check_fails_on_initial" in report.rejections[0].reason
    assert load_bundle(env_dir).scenarios == []


async def test_an_initial_state_with_unknown_attributes_is_repaired(env_dir, tmp_path):
    script = good_steps()
    good_state = script["initial_state"][0]
    misspelt = json.loads(good_state["content"])["init_config"]
    misspelt["room"] = misspelt.pop("rooms")
    script["initial_state"] = [answer({"init_config": misspelt}, match="initial state 1 of 1"), good_state]
    with MatchingReplayServer(script) as server:
        ok, report = await scenarios(server, env_dir, tmp_path, 1)
    assert ok, report.rejections
    requests = server.requests_for("initial_state")
    assert len(requests) == 2
    assert "init_config key 'room' is not a state attribute (known: bookings, rooms)" in requests[1]["messages"][-1]["content"]
    assert report.stages["initial_state"].attempts == 2 and report.stages["initial_state"].accepted == 1
