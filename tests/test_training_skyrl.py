"""skyrl-gym's registry makes the envscaler_farm BaseTextEnv as SkyRL's generator does (skyrl_gym.make with
env_config and the row as extras), and a multi-turn loop like its agent_loop drives it over a real farm.

SkyRL's own generator (skyrl 0.3.0, ``SkyRLGymGenerator``) drives it too, on Python 3.12 and later: below
that its ``skyrl.tinker.types`` cannot be imported (pydantic refuses ``typing.TypedDict`` there), and the
test that runs it skips.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.support.extras import require

require("skyrl_gym", extra="skyrl")

import skyrl_gym  # noqa: E402

from agent_client.training.session import FarmConnection  # noqa: E402
from agent_client.training.skyrl import ENV_CLASS, skyrl_rows  # noqa: E402
from envscaler.errors import InfraError  # noqa: E402
from tests.support.openai_replay import ReplayServer  # noqa: E402
from tests.support.training import SOLUTION, kill_server, lamp_farm, lamp_turns_scenario  # noqa: E402


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    with lamp_farm(tmp_path_factory.mktemp("skyrl")) as catalog:
        yield catalog


def rollout(row: dict, policy: list[str], env_config: dict) -> tuple[list[dict], float, dict, dict]:
    """One trajectory as SkyRL's generator runs it: make, init, step until done, close on every path."""
    env = skyrl_gym.make(row["env_class"], env_config=env_config, extras={k: v for k, v in row.items() if k != "prompt"})
    try:
        chat, _ = env.init(list(row["prompt"]))
        for text in policy:
            output = env.step(text)
            chat += [{"role": "assistant", "content": text}, *output["observations"]]
            if output["done"]:
                return chat, output["reward"], output["metadata"], env.get_metrics()
        raise AssertionError("the policy ran out before the episode ended")
    finally:
        env.close()


def test_the_generators_loop_gets_the_validators_reward(catalog):
    rows = {r["scenario_id"]: r for r in skyrl_rows(FarmConnection(catalog))}
    assert set(rows) == {"lamp_dark", "lamp_lit"}  # the conversational one needs a user model
    assert rows["lamp_dark"]["env_class"] == ENV_CLASS and rows["lamp_dark"]["prompt"][1]["content"] == "Turn the lamp on and set it to 3."
    config = {"catalog": str(catalog)}
    chat, reward, metadata, metrics = rollout(rows["lamp_dark"], [SOLUTION, "Done."], config)
    assert reward == 1.0 and [m["role"] for m in chat[2:]] == ["assistant", "tool", "tool", "assistant"]
    assert [c["passed"] for c in metadata["envscaler"]["checks"]] == [True, True] and metrics["envscaler/tool_calls"] == 2.0
    assert [rollout(rows[s], ["Done."], config)[1] for s in ("lamp_dark", "lamp_lit")] == [0.0, 0.5]
    _, reward, metadata, _ = rollout(rows["lamp_dark"], ["<tool_call>{switch}</tool_call>", "Done."], {**config, "max_turns": 5})
    assert reward == 0.0 and metadata["envscaler"]["envscaler/agent_errors"] == 1.0


def test_a_conversational_row_opens_with_the_simulated_users_message(catalog):
    with ReplayServer({"user": [{"content": "Lamp on at 3, please."}, {"content": "Thanks! ###STOP###"}]}) as users:
        config = {"catalog": str(catalog), "user_model": "user", "user_base_url": users.base_url}
        row = next(r for r in skyrl_rows(FarmConnection(catalog), conversational=True) if r["scenario_id"] == "lamp_chat")
        assert len(row["prompt"]) == 1  # the system prompt alone: the task is the user's brief
        chat, reward, _, _ = rollout(row, [SOLUTION, "It is on, at 3."], config)
        assert chat[1] == {"role": "user", "content": "Lamp on at 3, please."} and reward == 1.0


def test_a_row_with_scripted_turns_gets_each_next_message_as_an_observation(tmp_path):
    with lamp_farm(tmp_path, lamp_turns_scenario()) as catalog:
        row = next(r for r in skyrl_rows(FarmConnection(catalog)) if r["scenario_id"] == "lamp_turns")
        assert row["prompt"][1] == {"role": "user", "content": "Turn the lamp on and set it to 3."}
        config = {"catalog": str(catalog)}
        chat, reward, metadata, _ = rollout(row, [SOLUTION, "Done.", "It is on, at 3."], config)
        # The plain answer ended turn 1: the next user message came back as an observation, not as the end.
        assert [m["role"] for m in chat[2:]] == ["assistant", "tool", "tool", "assistant", "user", "assistant"]
        assert chat[6] == {"role": "user", "content": "How is the lamp now?"} and reward == 1.0
        assert [c["turn"] for c in metadata["envscaler"]["checks"]] == [1, 1, 2]
        # Turn 2 changes nothing: only what the agent told the user tells it apart.
        assert rollout(row, [SOLUTION, "Done.", "Done."], config)[1] == 2 / 3


def test_a_killed_server_is_an_infra_error(tmp_path):
    with lamp_farm(tmp_path) as catalog:
        env = skyrl_gym.make(ENV_CLASS, env_config={"catalog": str(catalog)}, extras={"env_id": "lamp", "scenario_id": "lamp_dark"})
        env.init([])
        kill_server(catalog)
        with pytest.raises(InfraError):
            env.step(SOLUTION)
        assert env.episode is None


class ScriptedEngine:
    """Stands in for SkyRL's inference engine client: answers each prompt (token ids) with the reference calls,
    then, once their results are in, with a plain answer; ``solve=False``: the plain answer at once."""

    def __init__(self, tokenizer, solve: bool) -> None:
        self.tokenizer, self.solve = tokenizer, solve

    async def generate(self, engine_input, model=None):
        prompt = self.tokenizer.decode(engine_input["prompt_token_ids"][0])
        text = SOLUTION if self.solve and "<tool_response>" not in prompt else "Done."
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return {"responses": [text], "response_ids": [ids], "stop_reasons": ["stop"], "response_logprobs": None}

    async def finish_session(self, session_id) -> None:
        return None


@pytest.mark.skipif(sys.version_info < (3, 12), reason="SkyRL's generator imports only on Python 3.12 and later")
def test_skyrls_generator_runs_episodes_to_the_validators_reward(catalog, monkeypatch):
    from skyrl.train.config.config import GeneratorConfig, SamplingParams, SkyRLGymConfig
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator

    from tests.test_training import tiny_qwen

    # SkyRL's config has no key for this env: the catalog comes from the environment, as the README says.
    monkeypatch.setenv("ENVSCALER_FARM_CATALOG", str(catalog))
    _, tokenizer = tiny_qwen()
    rows = skyrl_rows(FarmConnection(catalog))
    config = GeneratorConfig(max_turns=5, max_input_length=8192, sampling_params=SamplingParams(max_generate_length=256, logprobs=None),
                             use_cache_salt=False)
    batch = {"prompts": [r["prompt"] for r in rows], "env_classes": [r["env_class"] for r in rows],
             "env_extras": [{k: v for k, v in r.items() if k != "prompt"} for r in rows], "sampling_params": None}
    rewards = {}
    for solve in (True, False):
        generator = SkyRLGymGenerator(config, SkyRLGymConfig(max_env_workers=0), ScriptedEngine(tokenizer, solve), tokenizer)
        output = asyncio.run(generator.generate({**batch, "env_extras": [dict(e) for e in batch["env_extras"]]}, disable_tqdm=True))
        rewards[solve] = {r["scenario_id"]: sum(reward) if isinstance(reward, list) else reward for r, reward in zip(rows, output["rewards"])}
        assert any(0 in mask for mask in output["loss_masks"]) == solve  # tool results are masked out of the loss
    assert rewards == {True: {"lamp_dark": 1.0, "lamp_lit": 1.0}, False: {"lamp_dark": 0.0, "lamp_lit": 0.5}}
