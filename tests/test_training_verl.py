"""verl's agent loop registry makes the envscaler_farm loop as its AgentLoopWorker does (hydra instantiate of the
registered config, per trajectory), and its run drives a real farm with a scripted generator in place of the LLM server."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.extras import require

require("verl", "hydra", "transformers", "trl", extra="verl")

import hydra  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from agent_client.training.session import FarmConnection  # noqa: E402
from agent_client.training.verl import AGENT_NAME, verl_rows  # noqa: E402
from envscaler.errors import InfraError  # noqa: E402
from tests.support.training import SOLUTION, kill_server, lamp_farm  # noqa: E402
from tests.test_training import tiny_qwen  # noqa: E402


class ScriptedServer:
    """Stands in for verl's LLMServerClient: each generate answers the next scripted text as token ids."""

    def __init__(self, tokenizer, texts: list[str], before=None) -> None:
        self.tokenizer, self.texts, self.before = tokenizer, list(texts), before

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        if self.before is not None:
            self.before()
        text = self.texts.pop(0) + "<|im_end|>"
        return TokenOutput(token_ids=self.tokenizer.encode(text, add_special_tokens=False), stop_reason="completed")


CONFIG = OmegaConf.create({
    "actor_rollout_ref": {"rollout": {
        "prompt_length": 4096, "response_length": 2048, "full_determinism": False,
        "multi_turn": {"max_user_turns": 5, "max_assistant_turns": 5, "max_parallel_calls": 4, "max_tool_response_length": 4096,
                       "tool_response_truncate_side": "right", "format": "hermes"},
    }},
    "data": {"apply_chat_template_kwargs": {}, "mm_processor_kwargs": {}},
})


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    with lamp_farm(tmp_path_factory.mktemp("verl")) as catalog:
        yield catalog


def run_loop(catalog, row: dict, texts: list[str], before=None):
    """One trajectory: the registered loop instantiated as AgentLoopWorker._run_agent_loop does, then run."""
    _, tokenizer = tiny_qwen()

    async def trajectory():
        # Made inside the running loop, as the worker makes it: the loop keeps a handle on it.
        loop = hydra.utils.instantiate(
            config={**_agent_loop_registry[row["agent_name"]], "catalog": str(catalog)}, trainer_config=DictConfigWrap(CONFIG),
            server_manager=ScriptedServer(tokenizer, texts, before), tokenizer=tokenizer, processor=None, hf_model_type="qwen2",
            dataset_cls=None, data_config=DictConfigWrap(CONFIG.data), tools=ToolListWrap([]),
        )
        return await loop.run({"temperature": 1.0}, raw_prompt=row["prompt"], extra_info=row["extra_info"])

    return asyncio.run(trajectory())


def test_the_agent_loop_runs_episodes_to_the_validators_reward(catalog):
    rows = {r["extra_info"]["scenario_id"]: r for r in verl_rows(FarmConnection(catalog))}
    assert set(rows) == {"lamp_dark", "lamp_lit"} and rows["lamp_dark"]["agent_name"] == AGENT_NAME
    output = run_loop(catalog, rows["lamp_dark"], [SOLUTION, "Done."])
    assert output.reward_score == 1.0 and [c["passed"] for c in output.extra_fields["envscaler"]["checks"]] == [True, True]
    assert output.num_turns == 4 and 0 in output.response_mask and 1 in output.response_mask  # tool results masked out
    assert [run_loop(catalog, rows[s], ["Done."]).reward_score for s in ("lamp_dark", "lamp_lit")] == [0.0, 0.5]


def test_a_killed_server_is_an_infra_error(tmp_path):
    with lamp_farm(tmp_path) as catalog:
        row = verl_rows(FarmConnection(catalog))[0]
        with pytest.raises(InfraError):  # the server dies while the model writes its first turn
            run_loop(catalog, row, [SOLUTION, "Done."], before=lambda: kill_server(catalog))
