"""GEM's own vector env loop (gem.make_vec) drives the registered envscaler:farm env on a real farm, and the ROLL
example's env entries make and play it as ROLL's env manager does (ROLL itself is not on PyPI: its own env manager
runs only where a checkout is given, see the last test)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.support.extras import require

require("gem", "omegaconf", extra="gem")

import gem  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from agent_client.training.gem import ENV_ID, FarmGemEnv  # noqa: E402
from envscaler.errors import InfraError  # noqa: E402
from tests.support.openai_replay import ReplayServer  # noqa: E402
from tests.support.training import SOLUTION, kill_server, lamp_farm, lamp_turns_scenario  # noqa: E402


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


def test_scripted_turns_give_the_next_message_as_the_observation(tmp_path):
    with lamp_farm(tmp_path, lamp_turns_scenario()) as catalog:
        env = FarmGemEnv(scenarios=["lamp/lamp_turns"], catalog=str(catalog))
        observation, _ = env.reset()
        assert observation.endswith("Turn the lamp on and set it to 3.")
        env.step(SOLUTION)
        observation, reward, terminated, truncated, _ = env.step("Done.")
        assert (observation, reward, terminated, truncated) == ("How is the lamp now?", 0.0, False, False)
        _, reward, terminated, _, info = env.step("It is on, at 3.")
        assert (reward, terminated) == (1.0, True) and [c["turn"] for c in info["envscaler"]["checks"]] == [1, 1, 2]
        assert env.episode is None


def test_a_killed_server_is_an_infra_error(tmp_path):
    with lamp_farm(tmp_path) as catalog:
        env = gem.make(ENV_ID, scenarios=["lamp/lamp_dark"], catalog=str(catalog))
        env.reset()
        kill_server(catalog)
        with pytest.raises(InfraError):
            env.step(SOLUTION)
        assert env.episode is None


ROLL_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "roll_envscaler_farm.yaml"


def roll_env_entry(tag: str, **overrides: str) -> dict:
    """``custom_envs.<tag>`` of the ROLL example, resolved, as ROLL's AgenticConfig.make_env_configs hands it to an
    env manager: the template's keys, with ``env_config`` moved to ``config``."""
    config = OmegaConf.load(ROLL_EXAMPLE)
    for key, value in overrides.items():
        OmegaConf.update(config, key, value)
    template = OmegaConf.to_container(config, resolve=True)["custom_envs"][tag]
    return {**{k: v for k, v in template.items() if k != "env_config"}, "tag": tag, "config": dict(template["env_config"])}


def roll_trajectory(entry: dict, seed: int, policy: list[str]) -> tuple[str, float, dict]:
    """One trajectory as ROLL's TrajEnvManager plays it: gem.make(env_type, **config), reset(seed=group seed +
    episode id), step with the model's text until terminated or max_steps; the trajectory's score is the rewards' sum."""
    env = gem.make(env_id=entry["env_type"], **entry["config"])
    try:
        _, info = env.reset(seed=seed)
        rewards, last = [], {}
        for step, text in enumerate(policy, 1):
            _, reward, terminated, _, last = env.step(action=text)
            rewards.append(reward)
            if terminated or step >= entry["max_steps"]:
                return info["scenario_id"], sum(rewards), last
        raise AssertionError("the policy ran out before the trajectory ended")
    finally:
        env.close()


def test_the_roll_example_makes_and_plays_the_env_as_rolls_env_manager_does(catalog):
    entry = roll_env_entry("EnvScalerFarm", farm_catalog=str(catalog))
    assert entry["env_type"] == ENV_ID and entry["env_manager_cls"] == "agent_client.training.roll.TrajEnvManager"
    assert entry["config"]["max_turns"] == entry["max_steps"] == 40  # the env scores before ROLL's limit cuts it
    assert "{observation}" in entry["agent_template"] and entry["agent_system_template"]
    # A group's envs share a seed (one scenario); seeds 7 and 8 pick the two scenarios.
    played = {}
    for seed in (7, 8):
        for name, policy in (("solved", [SOLUTION, "Done."]), ("idle", ["Done."])):
            scenario, score, info = roll_trajectory(entry, seed, policy)
            played[scenario, name] = score
            assert info["metrics"]["envscaler/reward"] == score  # ROLL logs info["metrics"] as env/<tag>/<name>
    assert played == {("lamp_dark", "solved"): 1.0, ("lamp_dark", "idle"): 0.0, ("lamp_lit", "solved"): 1.0, ("lamp_lit", "idle"): 0.5}


def test_the_roll_examples_conversational_entry_plays_its_simulated_user(catalog):
    with ReplayServer({"user": [{"content": "Lamp on at 3, please."}, {"content": "###STOP###"}]}) as users:
        entry = roll_env_entry("EnvScalerFarmConversation", farm_catalog=str(catalog),
                               **{"custom_envs.EnvScalerFarmConversation.env_config.user_model": "user",
                                  "custom_envs.EnvScalerFarmConversation.env_config.user_base_url": users.base_url})
        seed = next(s for s in range(3) if FarmGemEnv(**entry["config"]).scenarios[s][1] == "lamp_chat")
        scenario, score, _ = roll_trajectory(entry, seed, [SOLUTION, "It is on, at 3."])
        assert (scenario, score) == ("lamp_chat", 1.0)


@pytest.mark.skipif(not os.environ.get("ENVSCALER_ROLL_CHECKOUT"), reason="ROLL is not on PyPI: set ENVSCALER_ROLL_CHECKOUT "
                    "(its source) and ENVSCALER_ROLL_PYTHON (a Python with its dependencies) to run its env manager")
def test_rolls_own_env_manager_plays_the_example_on_the_farm(catalog, tmp_path):
    from tests.test_training import tiny_qwen

    _, tokenizer = tiny_qwen()
    tokenizer.save_pretrained(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, never a cluster already there
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env.update(PYTHONPATH=os.pathsep.join([os.environ["ENVSCALER_ROLL_CHECKOUT"], str(ROLL_EXAMPLE.parents[1])]), RAY_TMPDIR=ray_dir)
    with ReplayServer({"policy": [{"content": SOLUTION}, {"content": "Done."}, {"content": "Done."}]}) as llm:
        run = subprocess.run([os.environ["ENVSCALER_ROLL_PYTHON"], str(ROLL_EXAMPLE.parents[1] / "tests" / "interop" / "roll_env_manager.py"),
                              str(catalog), llm.base_url, str(tmp_path / "model"), "2"], capture_output=True, text=True, env=env, timeout=300,
                             cwd=tmp_path)  # ROLL writes its logs under ./output
    shutil.rmtree(ray_dir, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    solved, idle = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    # The group seed is random: episode 0 plays one scenario (solved), episode 1 the other (doing nothing).
    assert solved["score"] == 1.0 and idle["score"] == {"lamp_dark": 0.0, "lamp_lit": 0.5}[idle["scenario"]]
    assert solved["metrics"]["env/EnvScalerFarm/envscaler/checks_passed"] == 1.0 and solved["metrics"]["env/EnvScalerFarm/envscaler/tool_calls"] == 2.0
