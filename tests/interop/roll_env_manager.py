"""ROLL's own TrajEnvManager.run_rollout_loop on a farm, run by tests/test_training_gem.py where a ROLL checkout is given.

The env manager is made as ROLL's pipeline makes it: examples/roll_envscaler_farm.yaml composed by hydra, parsed into
ROLL's AgenticConfig (whose make_env_configs builds each env's entry), the class imported by the entry's
env_manager_cls; ROLL's openai LLM proxy points at a scripted OpenAI-compatible server. The queue stands in for
ROLL's GroupQueueManager actor (episode ids in, finished rollouts out). Prints one JSON line per episode.

    python roll_env_manager.py FARM_CATALOG LLM_BASE_URL MODEL_DIR EPISODES
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
from dacite import from_dict
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.agentic.agentic_config import AgenticConfig, LLMProxyConfig
from roll.utils.import_utils import safe_import_class
from transformers import AutoTokenizer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class _Call:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return ray.put(self.fn(*args))


class OneEpisodeQueue:
    """What run_rollout_loop asks of ROLL's GroupQueueManager: an episode id, then the finished rollout (and stop)."""

    def __init__(self, episode_id: int, manager) -> None:
        self.episodes, self.manager, self.rollouts = [episode_id], manager, []
        self.get_episode_id = _Call(lambda group_id, env_id=None: self.episodes.pop(0) if self.episodes else None)
        self.put = _Call(self._put)

    def _put(self, group_id, episode_id, start_step, rollout, env_id=None) -> None:
        if rollout is not None:
            self.rollouts.append({"score": float(rollout.non_tensor_batch["episode_scores"][0]), "metrics": rollout.meta_info["metrics"]})
            self.manager.running = False  # what the scheduler does when it has enough


def main(catalog: str, llm_base_url: str, model_dir: str, episodes: int) -> None:
    with initialize_config_dir(config_dir=str(EXAMPLES), job_name="app", version_base=None):
        cfg = compose(config_name="roll_envscaler_farm", overrides=[f"farm_catalog={catalog}", f"model_name={model_dir}"])
    config = from_dict(data_class=AgenticConfig, data=OmegaConf.to_container(cfg, resolve=True))
    workers = config.train_env_manager
    workers.llm_proxy = LLMProxyConfig(proxy_type="openai", proxy_config={"base_url": llm_base_url, "model_name": "policy", "api_key": "-"})
    entry = workers.env_configs[0][0]
    manager_cls = safe_import_class(entry["env_manager_cls"])
    for episode_id in range(episodes):
        manager = manager_cls(worker_config=workers, pipeline_config=config, env_config=entry, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                              generate_scheduler=None, output_queue=None, thread_lock=None, mode="train")
        manager.output_queue = queue = OneEpisodeQueue(episode_id, manager)
        manager.run_rollout_loop(DataProto(meta_info={"seed": 0}))
        scenario = manager.env.scenarios[(entry["group_seed"] + episode_id) % len(manager.env.scenarios)][1]
        manager.env.close()
        print(json.dumps({"scenario": scenario, **queue.rollouts[0]}), flush=True)


if __name__ == "__main__":
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    finally:
        ray.shutdown()
