"""SkyRL: a skyrl-gym ``BaseTextEnv`` holding one farm episode per trajectory, registered as ``envscaler_farm``.

SkyRL's generator makes one environment per trajectory, ``skyrl_gym.make(env_class, env_config=...,
extras=row)``, where ``extras`` are the dataset row's columns. Here:

- ``init(prompt)`` opens the row's scenario (``env_id``, ``scenario_id`` columns) on the farm; for a
  conversational scenario it appends the simulated user's opening message to the prompt;
- ``step(text)`` reads the tool calls in the model's text (Hermes/Qwen ``<tool_call>`` or OpenAI JSON),
  runs them on the episode and answers ``tool`` messages (the chat template renders them); a plain
  answer ends the episode (or, in a conversation, gets the simulated user's reply as a ``user``
  message; in a scenario with scripted user turns, ends the turn and gets the next turn's message); at the end the reward is the validator's score and ``metadata["envscaler"]`` holds every
  check's result;
- ``close()`` ends the episode (the generator calls it on every path; done also ends it).

A server that cannot be reached raises :class:`InfraError` out of ``init`` / ``step``: the generator
fails the batch instead of training on a reward of 0.

Config: ``environment.env_class=envscaler_farm``; the catalog comes from the env config's ``catalog``
key when SkyRL passes one (``skyrl_gym.register`` kwargs or ``environment.skyrl_gym.envscaler_farm``
where its config schema allows it), else ``$ENVSCALER_FARM_CATALOG`` (set it in the Ray runtime env),
else ``.envscaler/farm.json``. Conversational scenarios need ``user_model`` (and ``user_base_url``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skyrl_gym.envs.registration import register, registry
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from agent_client.errors import HarnessError
from agent_client.training.session import (Background, EpisodeScore, FarmConnection, FarmEpisode, FarmSettings, HeldEpisode, Turn,
                                           farm_scenarios, scenario_prompt, track)

__all__ = ["ENV_CLASS", "FarmTextEnv", "skyrl_rows"]

ENV_CLASS = "envscaler_farm"


class FarmTextEnv(HeldEpisode, BaseTextEnv):
    """One trajectory on one farm episode; text in (the model's turn), chat messages out."""

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        extras = dict(extras or {})
        settings = FarmSettings.model_validate({k: v for k, v in dict(env_config or {}).items() if k in FarmSettings.model_fields})
        self.farm = settings.connection()
        # SkyRL puts the row's columns in extras (and may nest them under extra_info).
        row = {**dict(extras.get("extra_info") or {}), **extras}
        if not isinstance(row.get("env_id"), str) or not isinstance(row.get("scenario_id"), str):
            raise HarnessError("each row needs env_id and scenario_id columns: build the dataset with agent_client.training.skyrl.skyrl_rows()")
        self.env_id, self.scenario_id = row["env_id"], row["scenario_id"]
        self.max_turns = int(row.get("max_turns") or settings.max_turns or 0) or None
        self.episode: FarmEpisode | None = None
        self.score: EpisodeScore | None = None

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Open the row's scenario; the prompt, with the simulated user's opening message in a conversation."""
        self.close()
        self.score = None
        self.episode = track(Background.run(FarmEpisode.open(self.farm, Background.http(), self.env_id, self.scenario_id, self.max_turns)))
        opening = self._run(self.episode.opening())
        if opening is not None:
            prompt = [*prompt, {"role": "user", "content": opening}]
        return prompt, {"env_id": self.env_id, "scenario_id": self.scenario_id, "episode_id": self.episode.created.episode_id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """The model's turn as text: its tool calls' results, the user's reply, or the end and the validator's reward."""
        episode = self.episode
        if episode is None:
            raise HarnessError(f"{self.env_id}: step before init: no episode")
        self.turns += 1
        turn = self._run(episode.act(action))
        if not turn.done:
            return BaseTextEnvStepOutput(observations=_messages(turn), reward=0.0, done=False, metadata={})
        score = self.score = self._run(episode.score())
        self.close()
        return BaseTextEnvStepOutput(observations=[], reward=score.reward, done=True, metadata={"envscaler": score.details()})

    def get_metrics(self) -> dict[str, Any]:
        """The validator's verdict as numbers (SkyRL averages them over the batch)."""
        return self.score.metrics() if self.score is not None else {}


def _messages(turn: Turn) -> list[dict[str, Any]]:
    if turn.user is not None:
        return [{"role": "user", "content": turn.user}]
    if turn.style == "openai":
        return [{"role": "tool", "content": r.text, "tool_call_id": r.call_id} for r in turn.replies]
    return [{"role": "tool", "content": r.text} for r in turn.replies]


def skyrl_rows(farm: FarmConnection, env_ids: list[str] | None = None, repeats: int = 1, conversational: bool = False) -> list[dict[str, Any]]:
    """Dataset rows for SkyRL (write them to parquet): ``prompt``, ``env_class``, ``env_id``, ``scenario_id``.

    Conversational scenarios are included with ``conversational=True`` (the farm needs a user model).
    """
    rows = []
    for description, scenario in farm_scenarios(farm, env_ids, conversational):
        row = {"prompt": scenario_prompt(description, scenario), "env_class": ENV_CLASS, "env_id": description.env_id, "scenario_id": scenario.scenario_id}
        rows.extend(dict(row) for _ in range(repeats))
    return rows


if ENV_CLASS not in registry:
    register(id=ENV_CLASS, entry_point="agent_client.training.skyrl:FarmTextEnv")
