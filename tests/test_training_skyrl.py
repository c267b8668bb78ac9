"""skyrl-gym's registry makes the envscaler_farm BaseTextEnv as SkyRL's generator does (skyrl_gym.make with
env_config and the row as extras), and a multi-turn loop like its agent_loop drives it over a real farm.

SkyRL's own generator (skyrl 0.3.0, ``SkyRLGymGenerator``) cannot be imported on Python 3.11: its
``skyrl.tinker.types`` builds pydantic models from ``typing.TypedDict``, which pydantic refuses below 3.12.
"""

from __future__ import annotations

import pytest

from tests.support.extras import require

require("skyrl_gym", extra="skyrl")

import skyrl_gym  # noqa: E402

from agent_client.training.session import FarmConnection  # noqa: E402
from agent_client.training.skyrl import ENV_CLASS, skyrl_rows  # noqa: E402
from envscaler.errors import InfraError  # noqa: E402
from tests.support.openai_replay import ReplayServer  # noqa: E402
from tests.support.training import SOLUTION, kill_server, lamp_farm  # noqa: E402


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


def test_a_killed_server_is_an_infra_error(tmp_path):
    with lamp_farm(tmp_path) as catalog:
        env = skyrl_gym.make(ENV_CLASS, env_config={"catalog": str(catalog)}, extras={"env_id": "lamp", "scenario_id": "lamp_dark"})
        env.init([])
        kill_server(catalog)
        with pytest.raises(InfraError):
            env.step(SOLUTION)
        assert env.episode is None
