"""TRL's GRPOTrainer on a real farm server, through agent_client.training, with a tiny local model."""

from __future__ import annotations

import inspect

import pytest

from tests.support.extras import require

require("trl", "datasets", "torch", "transformers", extra="trl")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import qwen3_chat_template  # noqa: E402

from agent_client.errors import HarnessError  # noqa: E402
from agent_client.training import TrainingFarm  # noqa: E402
from envscaler.errors import InfraError  # noqa: E402
from envscaler.wire import EnvEndpoint, FarmCatalog  # noqa: E402
from tests.support.bundles import write_bundle  # noqa: E402
from tests.support.server import serve  # noqa: E402
from tests.support.training import PERSONA, lamp_farm, lamp_turns_scenario  # noqa: E402

LAMP_CODE = '''
class Lamp:
    def __init__(self, init_config: dict):
        self.on = False
        self.brightness = 0

    def switch(self, on: bool) -> dict:
        """Turn the lamp on or off.

        Args:
            on (bool): True to turn it on.
        """
        self.on = on
        return {"success": True, "data": {"on": self.on}}

    def dim(self, level: int, **unused) -> dict:
        """Set the brightness.

        Args:
            level (int): From 0 to 10.
        """
        self.brightness = level
        return {"success": True, "data": {"brightness": level}}

    def reset(self) -> dict:
        """Put the lamp back in its box (shares a name with TRL's reset)."""
        self.on = False
        return {"success": True}
'''

LAMP_IS_ON = {"check_item": "the lamp is on", "check_func": "def check_func(final_state):\n    return final_state['on'] is True"}


def lamp_scenario(task_id: str, on: bool) -> dict:
    return {
        "task_id": task_id,
        "env_id": "lamp",
        "init_config": {"on": on},
        "task": "Make sure the lamp is on.",
        "checklist_with_func": [LAMP_IS_ON],
        "reference_solution": [{"name": "switch", "arguments": {"on": True}}],
    }


@pytest.fixture(scope="module")
def lamp_server(tmp_path_factory):
    spec = {"env_id": "lamp", "env_class_name": "Lamp", "env_class_code": LAMP_CODE, "environment_introduction": "A desk lamp."}
    # One scenario already passes its check, the other does not: the validator's mean over both is 0.5.
    directory = write_bundle(tmp_path_factory.mktemp("lamp"), spec, [lamp_scenario("lamp_lit", True), lamp_scenario("lamp_dark", False)])
    with serve(directory) as server:
        yield server


@pytest.fixture(scope="module")
def farm(lamp_server):
    return TrainingFarm.connect(FarmCatalog(envs={"lamp": EnvEndpoint(url=lamp_server.url, token=lamp_server.token)}))


def tiny_qwen():
    """A randomly initialised Qwen2-shaped model and a byte-level BPE tokenizer with Qwen3's chat template."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ['{"name": "switch", "arguments": {"on": true}}', "user assistant system tool Make sure the lamp is on.", "# Tools"]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = qwen3_chat_template
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(fast), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=4096, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config), fast


def test_the_environment_class_has_the_tools_as_documented_methods(farm):
    lamp = farm.environment_factory()["lamp"]
    tools = {name for name, _ in inspect.getmembers(lamp, inspect.isfunction) if not name.startswith("_")} - {"reset", "get_reward"}
    assert tools == {"switch", "dim", "reset_tool"}
    assert str(inspect.signature(lamp.switch)) == "(self, *, on: bool) -> str"
    assert lamp.switch.__doc__.startswith("Turn the lamp on or off.") and "on: True to turn it on." in lamp.switch.__doc__
    rows = farm.rows()
    assert [(r["env_id"], r["scenario_id"], r["environment"]) for r in rows] == [("lamp", "lamp_lit", "lamp"), ("lamp", "lamp_dark", "lamp")]
    assert "A desk lamp." in rows[0]["prompt"][0]["content"] and rows[0]["prompt"][1] == {"role": "user", "content": "Make sure the lamp is on."}


def test_reset_reuses_the_instance_and_tools_reach_the_episode(farm, lamp_server):
    lamp = farm.environment_factory()["lamp"]()
    assert lamp.reset(env_id="lamp", scenario_id="lamp_dark", prompt=[]) is None
    first = lamp._episode_id
    assert lamp.get_reward() == 0.0
    assert lamp.switch(on=True) == '{"success":true,"data":{"on":true}}'
    assert "level" in lamp.dim(level="bright")  # the server validates arguments; the error is what the model sees
    assert lamp.get_reward() == 1.0
    lamp.reset_tool()
    assert lamp.get_reward() == 0.0
    # TRL reuses instances: a second reset ends the first episode and starts from the scenario's initial state.
    assert "Make sure the lamp is on." in lamp.reset(env_id="lamp", scenario_id="lamp_lit")
    with lamp_server.client() as http:
        assert first not in http.get("/episodes").json()["episodes"]
    assert lamp.get_reward() == 1.0


def test_a_dead_server_is_an_error_not_a_zero_reward(tmp_path):
    spec = {"env_id": "lamp", "env_class_name": "Lamp", "env_class_code": LAMP_CODE, "environment_introduction": "A desk lamp."}
    directory = write_bundle(tmp_path, spec, [lamp_scenario("lamp_dark", False)])
    with serve(directory) as server:
        farm = TrainingFarm.connect(FarmCatalog(envs={"lamp": EnvEndpoint(url=server.url, token=server.token)}))
        lamp = farm.environment_factory()["lamp"]()
        lamp.reset(env_id="lamp", scenario_id="lamp_dark")
        server.process.kill()
        server.process.wait()
        with pytest.raises(InfraError, match="lamp: POST .*/validate"):
            lamp.get_reward()
        with pytest.raises(InfraError, match=r"lamp: POST \S*/episodes: "):
            lamp.reset(env_id="lamp", scenario_id="lamp_dark")


def test_grpo_trainer_trains_on_the_farm_with_the_validators_reward(farm, tmp_path):
    model, tokenizer = tiny_qwen()
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=12, logging_steps=1, report_to="none", save_strategy="no", max_tool_calling_iterations=2, seed=0,
    )
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, args=args, train_dataset=farm.dataset(), environment_factory=farm.environment_factory(),
    )
    trainer.train()
    assert trainer.state.global_step == 2
    steps = [entry for entry in trainer.state.log_history if "rewards/LampEnv/mean" in entry]
    assert len(steps) == 2
    # Each batch holds both scenarios (two rollouts each): the validator scores lamp_lit 1 and lamp_dark 0.
    assert [entry["rewards/LampEnv/mean"] for entry in steps] == [0.5, 0.5]
    assert [entry["reward"] for entry in steps] == [0.5, 0.5]
    assert all("loss" in entry for entry in steps)


def test_conversational_and_scripted_scenarios_stay_out_of_trls_rows_and_prompts(tmp_path):
    with lamp_farm(tmp_path, lamp_turns_scenario()) as catalog:
        farm = TrainingFarm.connect(catalog)
        rows = farm.rows()
        assert sorted(r["scenario_id"] for r in rows) == ["lamp_dark", "lamp_lit"]
        assert not any("You are Ada" in m["content"] or PERSONA in m["content"] for r in rows for m in r["prompt"])
        lamp = farm.environment_factory()["lamp"]()
        # A row made by hand cannot open one either: reset would hand the user's brief to the agent as its task.
        with pytest.raises(HarnessError, match="lamp/lamp_chat is conversational"):
            lamp.reset(env_id="lamp", scenario_id="lamp_chat")
        # Nor one with scripted user turns: TRL's tool loop has no user turn to give the next message in.
        with pytest.raises(HarnessError, match="lamp/lamp_turns has 2 scripted user turns"):
            lamp.reset(env_id="lamp", scenario_id="lamp_turns")
        assert lamp.reset(env_id="lamp", scenario_id="lamp_dark", prompt=[]) is None and lamp.get_reward() == 0.0
