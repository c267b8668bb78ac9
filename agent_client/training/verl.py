"""verl: an agent loop registered as ``envscaler_farm`` that holds one farm episode per trajectory.

verl makes one agent loop per trajectory (``AgentLoopWorker`` instantiates the registered class for each
dataset row) and awaits its ``run``. This loop is verl's own ``ToolAgentLoop`` (its token handling,
tool-call parser, turn and length limits) with the farm in place of verl's tools:

- ``run`` opens the row's scenario (``extra_info.env_id`` / ``extra_info.scenario_id``), takes the
  episode's tools as the tool schemas the chat template shows, and in a conversational scenario adds the
  simulated user's opening message to the prompt;
- every tool call the parser finds (up to ``multi_turn.max_parallel_calls``) goes to the episode over
  MCP, one at a time in order; its result is cut to ``multi_turn.max_tool_response_length`` as verl
  cuts its own tools' results;
- a plain answer ends the trajectory, or, in a conversation, gets the simulated user's reply as a
  user turn (masked out of the loss like tool results) until the user ends it; in a scenario with
  scripted user turns it ends the current turn, and the next turn's message is the user turn;
- at the end ``reward_score`` is the validator's score, ``extra_fields["reward_extra_info"]`` the
  verdict's numbers (verl's trainer logs them: share of checks passed, turns, tool calls, agent errors)
  and ``extra_fields["envscaler"]`` every check's result; the episode is ended on every path (done,
  error, cancellation).

A server that cannot be reached raises :class:`InfraError` out of ``run``: verl's worker fails the
step instead of training on a reward of 0. Verl's own ``BaseTool`` path could not do this: it creates
and releases a tool instance around every call, so nothing holds an episode for a whole trajectory.

Config (see the README): an agent loop config file (``actor_rollout_ref.rollout.agent.agent_loop_config_path``)
with ``- name: envscaler_farm``, ``_target_: agent_client.training.verl.FarmAgentLoop`` and
``catalog: farm.json`` (optional ``user_model``, ``user_base_url``); ``multi_turn.format: hermes`` (or
the parser matching the model); a dataset from :func:`write_verl_dataset`, whose ``agent_name`` column
picks this loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from agent_client.errors import HarnessError
from agent_client.training.session import FarmConnection, FarmEpisode, FarmSettings, farm_scenarios, loop_http, scenario_prompt

__all__ = ["AGENT_NAME", "FarmAgentLoop", "verl_rows", "write_verl_dataset"]

AGENT_NAME = "envscaler_farm"


class _EpisodeTool:
    """What ToolAgentLoop reads of a tool: its name and schema (calls go to the episode, not here)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.tool_schema = OpenAIFunctionToolSchema.model_validate(schema)
        self.name = self.tool_schema.function.name


@register(AGENT_NAME)
class FarmAgentLoop(ToolAgentLoop):
    """verl's tool agent loop on one farm episode per trajectory, rewarded by the farm's validator."""

    def __init__(self, *args: Any, catalog: str | None = None, user_model: str | None = None, user_base_url: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.farm = FarmSettings(catalog=catalog, user_model=user_model, user_base_url=user_base_url).connection()
        self.episode: FarmEpisode | None = None

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """One trajectory on a new episode of the row's scenario; the output carries the validator's reward."""
        row = {**dict(kwargs.get("extra_info") or {}), **{k: v for k, v in kwargs.items() if k in ("env_id", "scenario_id")}}
        env_id, scenario_id = row.get("env_id"), row.get("scenario_id")
        if not isinstance(env_id, str) or not isinstance(scenario_id, str):
            raise HarnessError("each row needs extra_info.env_id and extra_info.scenario_id: build the dataset with write_verl_dataset()")
        episode = self.episode = await FarmEpisode.open(self.farm, loop_http(), env_id, scenario_id)
        try:
            tools = [_EpisodeTool(schema) for schema in episode.tool_schemas]
            self.tools = {tool.name: tool for tool in tools}
            self.tool_schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools]
            opening = await episode.opening()
            if opening is not None:
                kwargs["raw_prompt"] = [*kwargs["raw_prompt"], {"role": "user", "content": opening}]
            output = await super().run(sampling_params, **kwargs)
            score = await episode.score()
        finally:
            await episode.end()
        output.reward_score = score.reward
        # verl logs reward_extra_info (numbers under the same keys in every row) and keeps extra_fields per trajectory.
        output.extra_fields["reward_extra_info"] = score.metrics()
        output.extra_fields["envscaler"] = score.details()
        return output

    async def _call_tool(self, tool_call: FunctionCall, tools_kwargs: dict[str, Any], agent_data: AgentData) -> tuple[ToolResponse, float, dict]:
        episode = self.episode
        assert episode is not None
        try:
            arguments = json.loads(tool_call.arguments)
        except (json.JSONDecodeError, TypeError) as e:
            episode.agent_errors += 1
            return ToolResponse(text=f"Error: the arguments of {tool_call.name!r} are not valid JSON ({e}). Send a JSON object."), 0.0, {}
        if not isinstance(arguments, dict):
            episode.agent_errors += 1
            return ToolResponse(text=f"Error: the arguments of {tool_call.name!r} must be a JSON object."), 0.0, {}
        reply = await episode.call(tool_call.tool_call_id or "", tool_call.name, arguments)
        return ToolResponse(text=self._truncated(reply.text)), 0.0, {}

    def _truncated(self, text: str) -> str:
        # verl's bound on what one tool result adds to the context (multi_turn.max_tool_response_length, _side).
        limit, side = self.max_tool_response_length, self.tool_response_truncate_side
        if len(text) <= limit:
            return text
        if side == "left":
            return "(truncated)..." + text[-limit:]
        if side == "right":
            return text[:limit] + "...(truncated)"
        return text[: limit // 2] + "...(truncated)..." + text[-(limit // 2):]

    async def _handle_generating_state(self, agent_data: AgentData, sampling_params: dict[str, Any],
                                       ignore_termination: bool = False) -> AgentState:
        messages_before = len(agent_data.messages)
        state = await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        episode = self.episode
        assert episode is not None
        episode.turns += 1
        answered = len(agent_data.messages) > messages_before and not agent_data.tool_calls
        if state != AgentState.TERMINATED or not answered or not episode.converses:
            return state
        # A plain answer in a conversation: the user speaks next (the simulated one, or the next scripted turn),
        # unless the conversation is over.
        reply = await episode.next_user_message(agent_data.messages[-1].get("content") or "")
        if reply is None:
            return AgentState.TERMINATED
        previous = list(agent_data.messages)
        agent_data.messages.append({"role": "user", "content": reply})
        merged, mask, logprobs = await self.ct_merge_context_msg(
            previous, agent_data.messages, agent_data.prompt_ids, agent_data.response_mask,
            agent_data.response_logprobs or None, tools=self.tool_schemas,
        )
        if len(mask) >= self.response_length:
            return AgentState.TERMINATED
        agent_data.prompt_ids, agent_data.response_mask = merged.token_ids, mask
        if agent_data.response_logprobs:
            agent_data.response_logprobs = logprobs or []
        agent_data.user_turns += 1
        return AgentState.GENERATING


def verl_rows(farm: FarmConnection, env_ids: list[str] | None = None, repeats: int = 1, conversational: bool = False) -> list[dict[str, Any]]:
    """Rows for verl's RLHFDataset: ``prompt`` (chat messages), ``agent_name``, ``data_source``, ``extra_info``
    (``env_id``, ``scenario_id``, ``index``), and the ``reward_model`` column verl expects (unused: the
    agent loop scores)."""
    rows = []
    for description, scenario in farm_scenarios(farm, env_ids, conversational):
        for _ in range(repeats):
            rows.append({
                "data_source": f"envscaler/{description.env_id}", "prompt": scenario_prompt(description, scenario), "agent_name": AGENT_NAME,
                "ability": "tools", "reward_model": {"style": "envscaler", "ground_truth": ""},
                "extra_info": {"env_id": description.env_id, "scenario_id": scenario.scenario_id, "index": len(rows)},
            })
    return rows


def write_verl_dataset(farm: FarmConnection, path: str | Path, **options: Any) -> Path:
    """:func:`verl_rows` written as the parquet file ``data.train_files`` names."""
    import pandas

    path = Path(path)
    pandas.DataFrame(verl_rows(farm, **options)).to_parquet(path)
    return path
