"""GEM's own vector env loop (gem.make_vec) drives the registered envscaler:farm env on a real farm."""

from __future__ import annotations

import pytest

from tests.support.extras import require

require("gem", extra="gem")

import gem  # noqa: E402

from agent_client.training.gem import ENV_ID, FarmGemEnv  # noqa: E402
from envscaler.errors import InfraError  # noqa: E402
from tests.support.openai_replay import ReplayServer  # noqa: E402
from tests.support.training import SOLUTION, kill_server, lamp_farm  # noqa: E402


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    with lamp_farm(tmp_path_factory.mktemp("gem")) as catalog:
        yield catalog


def test_gem_vector_loop_scores_each_trajectory_with_the_validator(catalog):
    # Four trajectories at once, one episode each: two play the reference calls, two answer at once.
    scenarios = [["lamp/lamp_dark"], ["lamp/lamp_lit"], ["lamp/lamp_dark"], ["lamp/lamp_lit"]]
    envs = gem.make_vec([ENV_ID] * 4, vec_kwargs=[{"scenarios": s, "catalog": str(catalog)} for s in scenarios], autoreset=False)
    observations, _ = envs.reset()
    assert all("Turn the lamp on and set it to 3." in o and '"name": "switch"' in o for o in observations)
    policies = [[SOLUTION, "Done."], [SOLUTION, "Done."], ["Done."], ["Done."]]
    rewards: list[float | None] = [None] * 4
    for turn in range(2):
        actions = [p[turn] if turn < len(p) and rewards[i] is None else "" for i, p in enumerate(policies)]
        observations, reward, terminated, truncated, _ = envs.step(actions)
        for i in range(4):
            if rewards[i] is None and (terminated[i] or truncated[i]):
                rewards[i] = float(reward[i])
        if turn == 0:
            assert observations[0].count("<tool_response>") == 2 and '"brightness":3' in observations[0]
    # The validator's verdicts: solved 1.0; doing nothing scores 0 on the dark lamp, 0.5 on the lit one.
    assert rewards == [1.0, 1.0, 0.0, 0.5]


def test_malformed_calls_are_agent_errors_the_model_reads(catalog):
    env = gem.make(ENV_ID, scenarios=["lamp/lamp_dark"], catalog=str(catalog), max_turns=3)
    env.reset()
    observation, reward, terminated, truncated, _ = env.step('<tool_call>{"name": "switch", "arguments": {"on": tru}}</tool_call>')
    assert "could not be read: it is not valid JSON" in observation and "<tool_call>{" in observation
    assert (reward, terminated, truncated) == (0.0, False, False)
    observation, *_ = env.step('{"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "switch", "arguments": "{\\"on\\": true}"}}]}')
    assert observation == '[{"tool_call_id": "c1", "content": "{\\"success\\":true,\\"data\\":{\\"on\\":true}}"}]'
    # The third turn spends the budget: truncated, and scored (on, not dimmed: one check of two).
    _, reward, terminated, truncated, info = env.step("<tool_call>{\"name\": \"dim\"}</tool_call>")
    assert (reward, terminated, truncated) == (0.5, False, True)
    assert [c["passed"] for c in info["envscaler"]["checks"]] == [True, False] and info["envscaler"]["envscaler/agent_errors"] == 1.0
    assert env.episode is None  # ended


def test_a_conversational_scenario_talks_through_its_simulated_user(catalog):
    with ReplayServer({"user": [{"content": "Hi, lamp on at 3 please."}, {"content": "###STOP###"}]}) as users:
        env = FarmGemEnv(scenarios=["lamp/lamp_chat"], catalog=str(catalog), user_model="user", user_base_url=users.base_url)
        observation, _ = env.reset()
        assert observation.endswith("Hi, lamp on at 3 please.") and "You are Ada" not in observation
        env.step(SOLUTION)
        _, reward, terminated, _, _ = env.step("All set.")
        assert (reward, terminated) == (1.0, True)
        assert "Ada, who never says her surname" in users.requests[0]["messages"][0]["content"]


def test_a_killed_server_is_an_infra_error(tmp_path):
    with lamp_farm(tmp_path) as catalog:
        env = gem.make(ENV_ID, scenarios=["lamp/lamp_dark"], catalog=str(catalog))
        env.reset()
        kill_server(catalog)
        with pytest.raises(InfraError):
            env.step(SOLUTION)
        assert env.episode is None
