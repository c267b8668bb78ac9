"""verl's own rollout path drives the envscaler_farm agent loop over a real farm: verl's config (composed from its
ppo_trainer.yaml with the README's overrides), its dataset class reading write_verl_dataset's parquet, and its
AgentLoopWorker (the class AgentLoopManager hosts as a Ray actor, here in-process: no Ray cluster) running
generate_sequences on the batch. A scripted policy stands in for the LLM server (verl's LLMServerClient)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.support.extras import require

require("verl", "hydra", "transformers", "trl", extra="verl")

import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.reward import extract_reward  # noqa: E402
from verl.trainer.ppo.utils import create_rl_dataset  # noqa: E402
from verl.utils.dataset.rl_dataset import collate_fn  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from agent_client.training.session import FarmConnection  # noqa: E402
from agent_client.training.verl import AGENT_NAME, write_verl_dataset  # noqa: E402
from envscaler.errors import InfraError  # noqa: E402
from tests.support.openai_replay import ReplayServer  # noqa: E402
from tests.support.training import PERSONA, SOLUTION, kill_server, lamp_farm, lamp_turns_scenario  # noqa: E402
from tests.test_training import tiny_qwen  # noqa: E402


class ScriptedPolicy:
    """Stands in for verl's LLMServerClient: answers each generate from the prompt so far, as token ids.

    ``solve``: the reference calls first, then ``closing`` once their results are in; else ``closing`` at once.
    ``before``: called once, before the batch's first answer.
    """

    def __init__(self, tokenizer, solve: bool, closing: str = "Done.", before=None) -> None:
        self.tokenizer, self.solve, self.closing, self.before = tokenizer, solve, closing, before
        self.prompts: list[str] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        before, self.before = self.before, None
        if before is not None:
            before()
        prompt = self.tokenizer.decode(prompt_ids)
        self.prompts.append(prompt)
        text = SOLUTION if self.solve and "<tool_response>" not in prompt else self.closing
        return TokenOutput(token_ids=self.tokenizer.encode(text + "<|im_end|>", add_special_tokens=False), stop_reason="completed")


def verl_config(root: Path, catalog: Path, conversational: bool = False, user_base_url: str | None = None, *more: str) -> DictConfig:
    """verl's trainer config with the README's overrides: the farm's dataset and agent loop config file, a tiny local model."""
    model_dir = root / "model"
    if not model_dir.exists():
        model, tokenizer = tiny_qwen()
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    train = write_verl_dataset(FarmConnection(catalog), root / f"train-{conversational}.parquet", conversational=conversational)
    loop_config = root / f"farm_agent_loop-{conversational}.yaml"
    user = f"\n  user_model: user\n  user_base_url: {user_base_url}" if user_base_url else ""
    loop_config.write_text(f"- name: {AGENT_NAME}\n  _target_: agent_client.training.verl.FarmAgentLoop\n  catalog: {catalog}{user}\n")
    overrides = [
        f"data.train_files={train}", "data.return_raw_chat=True", "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=8",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loop_config}",
        # What a test on CPU sets: a local model, room for the prompt (the tools' schemas), the rollout engine's name.
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=vllm",
        "data.max_prompt_length=4096", "data.max_response_length=2048", "data.dataloader_num_workers=0", *more,
    ]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def rollout(config: DictConfig, policy_options: dict, n: int = 2) -> tuple[DataProto, ScriptedPolicy]:
    """One generation step as verl's trainer runs it: the dataset's rows collated into a batch, each row repeated
    ``n`` times (rollout.n), AgentLoopWorker.generate_sequences on it."""

    async def step() -> tuple[DataProto, ScriptedPolicy]:
        worker = AgentLoopWorker(config, llm_client=None)
        # The worker loads the tokenizer from the model path: the policy decodes with that same one.
        policy = worker.llm_client = ScriptedPolicy(worker.tokenizer, **policy_options)
        dataset = create_rl_dataset(config.data.train_files, config.data, worker.tokenizer, worker.processor)
        batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
        batch.meta_info["global_steps"] = 1
        return await worker.generate_sequences(batch.repeat(repeat_times=n, interleave=True)), policy

    return asyncio.run(step())


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl")
    with lamp_farm(root) as catalog:
        yield root, catalog


def test_verls_worker_runs_episodes_to_the_validators_reward(farm):
    root, catalog = farm
    # Results are cut as verl cuts its own tools' (switch's result is 35 characters, dim's 40).
    cut = "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=36", "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=right"
    solved, policy = rollout(verl_config(root, catalog, False, None, *cut), {"solve": True})
    assert any('{"success":true,"data":{"on":true}}' in p and '{"success":true,"data":{"brightness"...(truncated)' in p for p in policy.prompts)
    rows = [info["scenario_id"] for info in solved.non_tensor_batch["extra_info"]]
    assert rows == ["lamp_dark", "lamp_dark", "lamp_lit", "lamp_lit"]  # the conversational one needs a user model
    rewards, extra = extract_reward(solved)  # what verl's trainer reads: the score at each response's last token
    assert rewards.sum(dim=1).tolist() == [1.0] * 4
    assert list(extra["envscaler/checks_passed"]) == [1.0] * 4 and list(extra["envscaler/tool_calls"]) == [2.0] * 4
    checks = solved.non_tensor_batch["envscaler"][0]["checks"]
    assert [(c["check_item"], c["passed"]) for c in checks] == [("the lamp is on", True), ("the lamp is at 3", True)]
    mask = solved.batch["response_mask"][0]
    assert 0 in mask[: int(solved.batch["attention_mask"][0, solved.batch["prompts"].size(1):].sum())]  # tool results masked out
    assert list(solved.non_tensor_batch["__num_turns__"]) == [4] * 4
    # Doing nothing scores what the validator says: 0 on the dark lamp, 0.5 on the lit one (one check of two).
    idle, _ = rollout(verl_config(root, catalog), {"solve": False})
    rewards, extra = extract_reward(idle)
    assert rewards.sum(dim=1).tolist() == [0.0, 0.0, 0.5, 0.5] and list(extra["envscaler/tool_calls"]) == [0.0] * 4
    assert [[c["passed"] for c in e["checks"]] for e in idle.non_tensor_batch["envscaler"]][2] == [True, False]


def test_a_conversational_row_talks_through_its_simulated_user(farm):
    root, catalog = farm
    user_script = [{"content": "Lamp on at 3, please."}, {"content": "Is it at 3 now?"}, {"content": "Thanks! ###STOP###"}]
    with ReplayServer({"user": user_script}) as users:
        config = verl_config(root, catalog, conversational=True, user_base_url=users.base_url)
        output, policy = rollout(config, {"solve": True, "closing": "It is on, at 3."}, n=1)
        chat = [info["scenario_id"] for info in output.non_tensor_batch["extra_info"]].index("lamp_chat")
        rewards, _ = extract_reward(output)
        assert rewards[chat].sum().item() == 1.0 and len(users.requests) == 3
        assert PERSONA in users.requests[0]["messages"][0]["content"]
        opened = [p for p in policy.prompts if "Lamp on at 3, please." in p]
        assert opened and not any("You are Ada" in p or PERSONA in p for p in policy.prompts)  # the brief never reaches the agent
        # The user's reply came back as a user turn, and the model answered it: 3 model turns, a tool turn, a user turn.
        assert any("Is it at 3 now?" in p for p in policy.prompts) and output.non_tensor_batch["__num_turns__"][chat] == 6


def test_a_row_with_scripted_turns_gets_each_next_message_as_a_user_turn(tmp_path):
    with lamp_farm(tmp_path, lamp_turns_scenario()) as catalog:
        output, policy = rollout(verl_config(tmp_path, catalog), {"solve": True, "closing": "It is on, at 3."}, n=1)
    rows = [info["scenario_id"] for info in output.non_tensor_batch["extra_info"]]
    turns = rows.index("lamp_turns")
    rewards, _ = extract_reward(output)
    assert rewards[turns].sum().item() == 1.0
    assert [c["turn"] for c in output.non_tensor_batch["envscaler"][turns]["checks"]] == [1, 1, 2]
    # The next turn's message came back as a user turn and the model answered it: calls, answer, user turn, answer.
    assert any("How is the lamp now?" in p for p in policy.prompts) and output.non_tensor_batch["__num_turns__"][turns] == 6


def test_a_killed_server_is_an_infra_error_out_of_the_worker(tmp_path):
    with lamp_farm(tmp_path) as catalog:
        config = verl_config(tmp_path, catalog)
        with pytest.raises(InfraError):  # the server dies while the model writes its first turn
            rollout(config, {"solve": True, "before": lambda: kill_server(catalog)}, n=1)
