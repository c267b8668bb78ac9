"""GEM (and ROLL, OpenRLHF through it): a ``gem.Env`` holding one farm episode per trajectory, registered as ``envscaler:farm``.

``gem.make("envscaler:farm", catalog=..., scenarios=[...])`` makes one; ROLL makes it from its YAML
(``custom_envs.<tag>.env_type: envscaler:farm`` and ``env_config``, in the env manager that
``agent_client.training.roll`` registers it for; see ``examples/roll_envscaler_farm.yaml`` and the README).

- ``reset(seed)`` ends the previous episode and opens a scenario: ``scenarios[seed % len]`` with a
  seed, else the next one in order (``scenarios``: ``"env_id/scenario_id"`` strings; default every
  scored scenario of the farm, conversational ones only with ``conversational=True``). The observation is the system prompt, the tools
  (as Qwen's and Hermes' templates list them) and the task, or in a conversation the simulated user's
  opening message; ``info["tools"]`` has the OpenAI tool schemas for env managers that template them.
- ``step(text)`` reads the tool calls in the model's text (Hermes/Qwen ``<tool_call>`` or OpenAI JSON)
  and answers their results (``<tool_response>`` blocks, or a JSON list for OpenAI calls); in a scenario
  with scripted user turns, a plain answer ends the turn and the next turn's message is the observation
  (not done); a plain answer (or the simulated user ending the conversation, or the last turn ending) terminates the episode with the validator's
  score as reward, every check's result in ``info["envscaler"]`` and the verdict's numbers in
  ``info["metrics"]`` (which ROLL logs); running out of ``max_turns`` truncates it, scored the same way.
- ``close()`` ends the episode. A server that cannot be reached raises :class:`InfraError`.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import gem
from gem.envs.registration import ENV_REGISTRY

from agent_client.agents import SYSTEM_PROMPT
from agent_client.errors import HarnessError
from agent_client.training.session import Background, EpisodeScore, FarmEpisode, FarmSettings, HeldEpisode, farm_scenarios, track
from agent_client.training.toolcalls import hermes_results

__all__ = ["ENV_ID", "FarmGemEnv"]

ENV_ID = "envscaler:farm"

_TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class FarmGemEnv(HeldEpisode, gem.Env):
    """Text in (the model's turn), text out; one farm episode from ``reset`` to the end."""

    def __init__(self, scenarios: list[str] | None = None, catalog: str | None = None, user_model: str | None = None,
                 user_base_url: str | None = None, max_turns: int | None = None, conversational: bool = False, **_unused: Any) -> None:
        super().__init__()
        settings = FarmSettings(catalog=catalog, user_model=user_model, user_base_url=user_base_url, max_turns=max_turns)
        self.farm = settings.connection()
        self.max_turns = max_turns
        if scenarios is None:
            scenarios = [f"{d.env_id}/{s.scenario_id}" for d, s in farm_scenarios(self.farm, conversational=conversational)]
        self.scenarios = [_split(s) for s in scenarios]
        if not self.scenarios:
            raise HarnessError("no scenarios to play: name some (env_id/scenario_id) or start a farm with scored scenarios")
        self._order = itertools.cycle(range(len(self.scenarios)))
        self.episode: FarmEpisode | None = None
        self.score: EpisodeScore | None = None

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """End the previous episode and open the next scenario (``seed`` picks it); its first observation."""
        super().reset(seed)
        self.close()
        self.score = None
        env_id, scenario_id = self.scenarios[seed % len(self.scenarios) if seed is not None else next(self._order)]
        episode = self.episode = track(Background.run(FarmEpisode.open(self.farm, Background.http(), env_id, scenario_id, self.max_turns)))
        opening = self._run(episode.opening())
        created = episode.created
        tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in created.tools)
        system = SYSTEM_PROMPT.format(introduction=created.env_introduction)
        observation = f"{system}\n\n{_TOOLS_SECTION.format(tools=tools)}\n\n{opening if opening is not None else created.task}"
        return observation, {"env_id": env_id, "scenario_id": scenario_id, "episode_id": created.episode_id, "tools": created.tools}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """The model's turn: (observation, reward, terminated, truncated, info); the reward is the validator's, at the end."""
        episode = self.episode
        if episode is None:
            raise HarnessError("step before reset: no episode")
        turn = self._run(episode.act(action))
        if not turn.done:
            if turn.user is not None:
                return turn.user, 0.0, False, False, {}
            if turn.style == "openai":
                observation = json.dumps([{"tool_call_id": r.call_id, "content": r.text} for r in turn.replies], ensure_ascii=False)
            else:
                observation = hermes_results([r.text for r in turn.replies])
            return observation, 0.0, False, False, {}
        # The agent ended it with a plain answer (or its user did); else the turn budget ran out.
        finished = not turn.replies and turn.user is None
        score = self.score = self._run(episode.score())
        self.close()
        # ROLL's env managers log info["metrics"] per trajectory (as env/<tag>/<name>).
        return "", score.reward, finished, not finished, {"envscaler": score.details(), "metrics": score.metrics()}


def _split(name: str) -> tuple[str, str]:
    env_id, slash, scenario_id = name.partition("/")
    if not slash or not env_id or not scenario_id:
        raise HarnessError(f"scenario {name!r}: write it as env_id/scenario_id")
    return env_id, scenario_id


if ENV_ID not in ENV_REGISTRY:
    gem.register(ENV_ID, "agent_client.training.gem:FarmGemEnv")
