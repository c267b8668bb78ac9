"""Train on a farm with TRL: an environment class per farm environment, and a dataset of its scenarios.

    from agent_client.training import TrainingFarm

    farm = TrainingFarm.connect("farm.json")
    trainer = GRPOTrainer(model=..., args=..., train_dataset=farm.dataset(), environment_factory=farm.environment_factory())

TRL's ``environment_factory`` builds instances of a class whose public methods are tools. Here each
farm environment gets such a class, made from the tool schemas its server lists: one method per tool,
with a signature and a Google-style docstring that give TRL (through transformers) the tool's schema.
``reset(**row)`` ends the instance's previous episode and opens the row's scenario on the farm;
every tool call is an MCP ``tools/call`` on that episode; ``get_reward()`` asks the server's
validator for the score. Everything goes over HTTP/MCP, as for any other client of the farm.

TRL's tool loop has no user turn: conversational scenarios and scenarios with scripted user turns are
left out of the dataset, and ``reset`` refuses them (train on them with verl, SkyRL or GEM).

A server that cannot be reached raises :class:`InfraError` from ``reset`` and ``get_reward``: a
reward that was never measured must stop training, not pass for 0. TRL's tool loop turns an error
raised by a tool into a tool message, so the model sees those.

Tool names that TRL reserves (``reset``, ``get_reward``) are renamed ``<name>_tool``; argument names
that are not Python identifiers (or are keywords) get a trailing ``_`` in the signature and are sent
under their own name. Schemas more detailed than Python hints can say (nested object properties) reach
the model as ``object`` / ``array``; the server still validates every call against the full schema.
"""

from __future__ import annotations

import atexit
import inspect
import keyword
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

from agent_client.errors import HarnessError
from agent_client.remote import EnvControl, McpTools
from agent_client.training.session import Background, FarmConnection, FarmEnvDescription, describe_environment, scenario_prompt
from envscaler.errors import InfraError
from envscaler.models import ToolSchema
from envscaler.wire import FarmCatalog

__all__ = ["FarmEnvironment", "TrainingFarm", "environment_class"]

_RESERVED = {"reset", "get_reward"}
_OMITTED: Any = type("Omitted", (), {"__repr__": lambda self: "<omitted>"})()
_JSON_TYPES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "object": dict, "null": type(None)}


# -- the environment classes ----------------------------------------------------------------------

_live_instances: weakref.WeakSet[FarmEnvironment] = weakref.WeakSet()


class FarmEnvironment:
    """Base of the generated classes: TRL treats every public method but ``reset``/``get_reward`` as a tool."""

    _description: ClassVar[FarmEnvDescription]

    def __init__(self) -> None:
        description = self._description
        self._control = EnvControl(Background.http(), description.env_id, description.endpoint)
        self._episode_id: str | None = None
        self._tools: McpTools | None = None
        _live_instances.add(self)

    def reset(self, **row: Any) -> str | None:
        """End the previous episode and open the row's scenario (its ``scenario_id``).

        Returns None when the row has a prompt (the dataset's already holds the task), else the
        introduction and task, which TRL appends to the prompt.
        """
        env_id = self._description.env_id
        scenario_id = row.get("scenario_id")
        if not isinstance(scenario_id, str):
            raise HarnessError(f"{env_id}: each row needs a scenario_id column; build the dataset with TrainingFarm.dataset()")
        if row.get("env_id", env_id) != env_id:
            raise HarnessError(f"row for {row['env_id']!r} given to the {env_id!r} environment; pass the dict from environment_factory()")
        self._end_episode()
        created = Background.run(self._control.create(scenario_id))
        if created.turns:
            Background.run(self._control.end(created.episode_id))
            raise HarnessError(f"{env_id}/{scenario_id} has {created.turns} scripted user turns: TRL's tool loop has no user turn to give "
                               "the next ones in; train on it with verl, SkyRL or GEM, or leave it out (TrainingFarm.dataset() does)")
        if created.user_profile:
            # Its task is the simulated user's brief (persona, goal): returned here, it would be the agent's prompt.
            Background.run(self._control.end(created.episode_id))
            raise HarnessError(f"{env_id}/{scenario_id} is conversational: TRL's tool loop has no user turn for its simulated user; "
                               "train on it with verl, SkyRL or GEM, or leave it out (TrainingFarm.dataset() does)")
        self._episode_id = created.episode_id
        self._tools = McpTools(self._control.http, created.mcp_url)
        if "prompt" in row:
            return None
        return f"{self._description.introduction}\n\n{created.task}"

    def get_reward(self) -> float:
        """The validator's score of the episode's current state."""
        episode_id = self._episode_id
        if episode_id is None:
            raise HarnessError(f"{self._description.env_id}: get_reward before reset: no episode to score")
        return Background.run(self._control.validate(episode_id)).score

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        """The text the model sees: the tool's result, or its error message, as on MCP."""
        tools = self._tools
        if tools is None:
            raise HarnessError(f"{self._description.env_id}: tool {name} called before reset")
        text, _is_error = Background.run(tools.call(name, arguments))
        return text

    def _end_episode(self) -> None:
        episode_id, self._episode_id, self._tools = self._episode_id, None, None
        if episode_id is not None:
            Background.run(self._control.end(episode_id))


@atexit.register
def _end_open_episodes() -> None:
    # TRL never closes its environments: end their last episodes rather than leave them to expire.
    for instance in list(_live_instances):
        try:
            instance._end_episode()
        except (InfraError, HarnessError):
            pass  # the farm is gone already; its servers expire idle episodes anyway


def _python_name(name: str, taken: set[str]) -> str:
    """``name`` when it can name a parameter, else a close identifier ending in ``_``."""
    candidate = re.sub(r"\W", "_", name) or "arg"
    if candidate[0].isdigit():
        candidate = "arg_" + candidate
    if candidate != name or keyword.iskeyword(candidate) or candidate == "self":
        candidate += "_"
    while candidate in taken:
        candidate += "_"
    taken.add(candidate)
    return candidate


def _hint(schema: Any) -> Any:
    """A Python type hint that transformers turns back into (a coarser form of) this JSON schema."""
    if not isinstance(schema, dict):
        return Any
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, (str, int, float, bool)) for v in enum):
        return Literal[tuple(enum)]
    kind = schema.get("type")
    if isinstance(kind, list):
        hints = tuple(_hint({**schema, "type": k}) for k in kind)
        return Union[hints] if len(hints) > 1 else hints[0]  # noqa: UP007 - built at run time from a tuple
    if kind == "array":
        return list[_hint(schema["items"])] if isinstance(schema.get("items"), dict) and "type" in schema["items"] else list
    return _JSON_TYPES.get(kind, Any)


def _one_line(text: str, fallback: str) -> str:
    # A Google-style "Args:" entry is one "name: text" line; a line break inside it could start a false one.
    return " ".join(text.split()) or fallback


def _tool_method(public_name: str, tool: ToolSchema) -> Callable[..., str]:
    properties: dict[str, Any] = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or [])
    taken: set[str] = set()
    wire_names: dict[str, str] = {}
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    arg_lines = []
    for wire_name, schema in properties.items():
        name = _python_name(wire_name, taken)
        wire_names[name] = wire_name
        default = inspect.Parameter.empty if wire_name in required else _OMITTED
        annotations[name] = _hint(schema)
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotations[name]))
        description = schema.get("description", "") if isinstance(schema, dict) else ""
        arg_lines.append(f"    {name}: {_one_line(description, wire_name)}")
    real_name = tool.name

    def method(self: FarmEnvironment, **kwargs: Any) -> str:
        arguments = {wire_names.get(key, key): value for key, value in kwargs.items() if value is not _OMITTED}
        return self._call(real_name, arguments)

    doc = tool.description.strip() or f"The {real_name} tool."
    method.__doc__ = doc + ("\n\nArgs:\n" + "\n".join(arg_lines) if arg_lines else "")
    method.__name__ = method.__qualname__ = public_name
    method.__signature__ = inspect.Signature(parameters, return_annotation=str)  # type: ignore[attr-defined]
    method.__annotations__ = {**annotations, "return": str}
    return method


def _class_name(env_id: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[^0-9A-Za-z]+", env_id) if part) + "Env"


def environment_class(description: FarmEnvDescription) -> type[FarmEnvironment]:
    """A class whose public methods are ``description``'s tools (TRL-reserved names get ``_tool``)."""
    names = {t.name for t in description.tools}
    members: dict[str, Any] = {"_description": description, "__doc__": f"The {description.env_id} environment of a farm.\n\n{description.introduction}"}
    for tool in description.tools:
        public = tool.name
        if public in _RESERVED:
            public = f"{tool.name}_tool"
            while public in names or public in members:
                public += "_"
        members[public] = _tool_method(public, tool)
    return type(_class_name(description.env_id), (FarmEnvironment,), members)


# -- the farm ---------------------------------------------------------------------------------------


class TrainingFarm:
    """A running farm seen by a trainer: its environments' classes, and its scenarios as a dataset."""

    def __init__(self, descriptions: list[FarmEnvDescription]) -> None:
        if not descriptions:
            raise HarnessError("no environments to train on")
        self.descriptions = {d.env_id: d for d in descriptions}
        self.classes = {d.env_id: environment_class(d) for d in descriptions}

    @classmethod
    def connect(cls, catalog: str | Path | FarmCatalog, env_ids: list[str] | None = None) -> TrainingFarm:
        """The farm that ``catalog`` (a file written by ``envscaler farm up``, or its model) describes."""
        farm = FarmConnection(catalog)
        return cls([describe_environment(env_id, farm.endpoint(env_id)) for env_id in env_ids or sorted(farm.catalog.envs)])

    def environment_factory(self) -> dict[str, type[FarmEnvironment]]:
        """``{env_id: class}`` for ``GRPOTrainer(environment_factory=...)``; rows pick theirs by ``environment``."""
        return dict(self.classes)

    def rows(self, repeats: int = 1) -> list[dict[str, Any]]:
        """One row per scored scenario (times ``repeats``): prompt, env_id, scenario_id, environment.

        Conversational scenarios are left out: TRL's tool loop has no user turn for their simulated
        user to speak in, and their task (the user's brief) must not reach the agent as its prompt.
        So are scenarios with scripted user turns, for the same want of a user turn.
        """
        rows = []
        for description in self.descriptions.values():
            for scenario in description.scenarios:
                if scenario.conversational or scenario.turns:
                    continue
                row = {
                    "prompt": scenario_prompt(description, scenario),
                    "env_id": scenario.env_id,
                    "scenario_id": scenario.scenario_id,
                    "environment": scenario.env_id,
                }
                rows.extend(dict(row) for _ in range(repeats))
        return rows

    def dataset(self, repeats: int = 1) -> Any:
        """The rows as a ``datasets.Dataset`` (needs the ``[trl]`` extra)."""
        try:
            from datasets import Dataset
        except ImportError as e:
            raise HarnessError(f"the dataset needs the datasets package ({e}): pip install 'envscaler-farm[trl]'") from None
        return Dataset.from_list(self.rows(repeats))

