"""The data contracts: environment specs, scenarios, and what running them produces.

Field names follow EnvScaler's released files so its environments and scenarios load as they are.
Unknown fields are kept (``extra="allow"``) and written back out unchanged.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from envscaler.requirements import parse_requirement
from envscaler.strict import strict_schema


class _Open(BaseModel):
    """A model that keeps fields it does not know about."""

    model_config = ConfigDict(extra="allow")


class ToolSchema(BaseModel):
    """One tool as an OpenAI function: name, description and a JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    # The JSON schema of the tool's result when it is an object (from the method's return annotation):
    # MCP's ``outputSchema``, whose results also go out as ``structuredContent``. None: results are text only.
    output_schema: dict[str, Any] | None = None

    def openai(self) -> dict[str, Any]:
        """The tool in OpenAI's ``{"type": "function", "function": {...}}`` form."""
        return {"type": "function", "function": self.model_dump(exclude={"output_schema"})}

    def mcp(self, annotations: ToolAnnotations | None = None) -> dict[str, Any]:
        """The tool as an MCP ``tools/list`` entry, its arguments in strict mode's form (``envscaler.strict``)."""
        entry: dict[str, Any] = {"name": self.name, "description": self.description, "inputSchema": strict_schema(self.parameters)}
        if self.output_schema is not None:
            entry["outputSchema"] = self.output_schema
        if annotations is not None:
            entry["annotations"] = annotations.mcp()
        return entry


_DOTTED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# Declared as the agent's fault, these would hide every environment bug.
_TOO_BROAD = frozenset({"BaseException", "Exception"})


class ToolErrorPolicy(BaseModel):
    """Which tool results count as errors, besides exceptions (``tool_errors`` in env.json).

    One policy per environment, used everywhere a tool error is counted: the MCP result's
    ``isError``, the quality gates, the trajectory's error counts and the harness's summaries.
    The agent still sees the result's text.
    """

    model_config = ConfigDict(extra="forbid")

    success_false: bool = True
    """A dict result with ``"success": false`` is an error (EnvScaler's tool convention)."""
    text_prefixes: list[str] = Field(default_factory=list)
    """A string result starting with one of these (``"Error:"``, as benchmark tools answer) is an error."""
    agent_errors: list[str] = Field(default_factory=list)
    """Exceptions that mean the caller got it wrong (``"ValueError"``, ``"LookupError"``, ``"json.JSONDecodeError"``,
    a class of the environment's own code by its name): a tool that raises one (or a subclass) answers the agent
    with a tool error, counted as the agent's mistake. Any other exception is an environment error."""

    @field_validator("agent_errors")
    @classmethod
    def _exception_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _DOTTED_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an exception class name (a name such as 'ValueError', or a "
                                 "dotted one such as 'json.JSONDecodeError')")
            if name.rsplit(".", 1)[-1] in _TOO_BROAD:
                raise ValueError(f"{name!r} would make every bug in the environment's code the agent's fault: "
                                 "name the exceptions its tools raise on bad input")
        return list(dict.fromkeys(names))


class ToolAnnotations(BaseModel):
    """MCP tool annotations: hints clients use to decide whether to ask before a call.

    Field names are MCP's. A field left None is not sent, so the client applies MCP's default.
    """

    model_config = ConfigDict(extra="forbid")

    title: str | None = None
    readOnlyHint: bool | None = None  # noqa: N815 - MCP's wire name
    destructiveHint: bool | None = None  # noqa: N815
    idempotentHint: bool | None = None  # noqa: N815
    openWorldHint: bool | None = None  # noqa: N815

    def mcp(self) -> dict[str, Any]:
        """The ``annotations`` object of a ``tools/list`` entry."""
        return self.model_dump(exclude_none=True)


class ClassPart(BaseModel):
    """One class of a multi-class environment (``EnvSpec.classes``).

    ``name`` is the part's key in the state and in a scenario's ``init_config``; ``class_name`` the class
    in ``env_class_code``; ``loader`` the method that takes the part's configuration after ``cls()``
    (BFCL's ``_load_scenario``), or None for EnvScaler's construction; ``loader_arguments`` keyword
    arguments the loader gets besides the configuration (BFCL's ``long_context``).
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    class_name: str
    loader: str | None = None
    loader_arguments: dict[str, Any] | None = None

    @field_validator("name", "class_name", "loader")
    @classmethod
    def _identifier(cls, value: str | None) -> str | None:
        if value is not None and not value.isidentifier():
            raise ValueError(f"{value!r} is not a Python identifier")
        return value


class EnvSpec(_Open):
    """One environment: EnvScaler's env metadata item.

    With ``classes``, the environment is several classes of ``env_class_code`` side by side (BFCL's
    API classes): the state is ``{part.name: that instance's public attributes}``, a scenario's
    ``init_config`` is ``{part.name: config}``, and the tools are the public methods of every part
    (``envscaler.composite``).
    """

    env_id: str
    env_class_name: str
    env_class_code: str
    environment_summary: str = ""
    environment_introduction: str = ""
    constraints_rules: Any = None
    state_space_definition: Any = None
    tools: list[dict[str, Any]] | None = None
    tool_errors: ToolErrorPolicy | None = None
    # Per tool, hints that override the ones derived from the code (envscaler/annotations.py).
    tool_annotations: dict[str, ToolAnnotations] | None = None
    # Python distributions the code imports beyond the standard library, as PEP 508 requirements
    # (``"mpmath>=1.3"``): checked where the environment is served (envscaler/requirements.py).
    requires: list[str] | None = None
    classes: list[ClassPart] | None = None

    @field_validator("classes")
    @classmethod
    def _distinct_parts(cls, classes: list[ClassPart] | None) -> list[ClassPart] | None:
        if classes is not None:
            if not classes:
                raise ValueError("classes is empty: list at least one class, or leave it out")
            names = [part.name for part in classes]
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:
                raise ValueError(f"part names must differ; repeated: {', '.join(twice)}")
            hidden = [name for name in names if name.startswith("_")]
            if hidden:
                raise ValueError(f"part names become state keys and may not start with '_': {', '.join(hidden)}")
        return classes

    @field_validator("requires")
    @classmethod
    def _pep_508(cls, requires: list[str] | None) -> list[str] | None:
        for text in requires or []:
            parse_requirement(text)
        return requires

    def content_hash(self) -> str:
        """A stable 16-hex-digit digest of the whole spec (image tags, caches)."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def listed_tools(self) -> list[ToolSchema] | None:
        """The spec's own tool list in one shape, or None when the spec lists none."""
        if self.tools is None:
            return None
        return [ToolSchema.model_validate(t.get("function", t)) for t in self.tools]


class CheckItem(_Open):
    """One checklist entry: what must hold, and the Python function that decides it."""

    check_item: str
    check_func: str


class ToolCall(_Open):
    """One tool invocation, as in a reference solution."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Turn(_Open):
    """One user turn of a scripted multi-turn scenario: the user's message, and what must hold when the agent ends it.

    The turn's checks run when the agent ends the turn (``POST /episodes/{id}/turn``), on the state then, with
    ``turn_results`` holding the turn's own tool calls (a turn that changes nothing is checked on those).
    """

    message: str
    checklist_with_func: list[CheckItem] | None = None
    reference_solution: list[ToolCall] | None = None
    # The text the replay agent answers with at the end of the turn (checks may read it in ``agent_replies``).
    reference_reply: str | None = None


class Scenario(_Open):
    """One task on one environment: EnvScaler's task item plus our extensions.

    ``checklist_with_func`` is None for unscored scenarios (EnvScaler's SFT split ships without).
    With ``turns`` (a scripted multi-turn user), ``task`` is the first turn's message, each turn carries its
    own checks and reference solution, ``checklist_with_func`` holds the final checks (run at validation)
    and the scenario-level ``reference_solution`` is empty.
    """

    task_id: str
    env_id: str
    env_class_name: str | None = None
    init_config: dict[str, Any] = Field(default_factory=dict)
    task: str = ""
    checklist_with_func: list[CheckItem] | None = None
    reference_solution: list[ToolCall] | None = None
    # The text the replay agent answers with when it is done (single-turn scenarios; see Turn for the others).
    reference_reply: str | None = None
    user_profile: Any = None
    turns: list[Turn] | None = None

    @model_validator(mode="after")
    def _scripted_turns(self) -> Scenario:
        if self.turns is None:
            return self
        if not self.turns:
            raise ValueError("turns is empty: a scripted scenario needs at least one turn (or leave turns out)")
        if self.reference_solution:
            raise ValueError("a scenario with turns has its reference solution in each turn: move the scenario-level "
                             "reference_solution into the turns' reference_solution and leave it empty")
        if self.reference_reply is not None:
            raise ValueError("a scenario with turns has its reference_reply in each turn, not at scenario level")
        if not self.task:
            self.task = self.turns[0].message
        elif self.task != self.turns[0].message:
            raise ValueError("task differs from the first turn's message: with turns, the task is the first turn's "
                             "message (leave task out, or make them equal)")
        return self

    def check_count(self) -> int:
        """How many checks score the scenario: every turn's, plus the scenario-level ones."""
        return len(self.checklist_with_func or []) + sum(len(t.checklist_with_func or []) for t in self.turns or [])

    @property
    def conversational(self) -> bool:
        """True when a simulated user holds the task (the scenario has a ``user_profile``)."""
        return bool(self.user_profile)


class Bundle(BaseModel):
    """An environment with its scenarios, as stored in ``<dir>/<env_id>/``."""

    spec: EnvSpec
    scenarios: list[Scenario] = Field(default_factory=list)
    # The folder it was loaded from: its data files are under ``directory/data`` (``envscaler.data_files``).
    # None for a bundle made in memory, which has none.
    directory: Path | None = None

    @property
    def env_id(self) -> str:
        return self.spec.env_id


ErrorKind = Literal["agent", "env", "timeout", "tool"]
"""Why a tool call failed: the caller's arguments, an exception in the environment's code, a hang, or
the tool's own answer (``success: false`` and the like: see ToolErrorPolicy)."""


class StateChange(BaseModel):
    """One changed value in the state, addressed by a path of keys and indexes."""

    path: list[str | int]
    before: Any = None
    after: Any = None
    op: Literal["add", "remove", "replace"] = "replace"


class ToolOutcome(BaseModel):
    """What one tool call did."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    result: Any = None
    # What the agent is shown for ``result``: a string as itself, anything else as JSON. Not part of
    # the record (it repeats ``result``).
    result_text: str | None = Field(default=None, exclude=True)
    # True when ``result`` is cut: the result was longer than the server's limit for one result, or
    # than what was left of the episode's trajectory limit. ``result`` is then the cut text.
    truncated: bool = False
    # The length in characters of the whole result text, when ``truncated``.
    result_chars: int | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    # The class of the exception the tool raised (``ValueError``, ``mymodule.NotFound``): with ``error_kind``
    # "agent", one the environment declares the caller's fault (``ToolErrorPolicy.agent_errors``).
    exception: str | None = None
    latency_s: float = 0.0
    diff: list[StateChange] | None = None
    # True when ``diff`` was not kept: the episode's trajectory had reached its limit.
    diff_dropped: bool = False
    # The W3C trace context the agent's request carried (MCP ``_meta``), so a call can be found in its traces.
    traceparent: str | None = None
    tracestate: str | None = None

    @classmethod
    def failure(cls, name: str, arguments: Any, kind: ErrorKind, message: str, latency_s: float = 0.0) -> ToolOutcome:
        """A failed call, recording its arguments however malformed: a non-object as ``{"_raw": value}``."""
        if arguments is None:
            arguments = {}
        elif not isinstance(arguments, dict):
            arguments = {"_raw": arguments}
        return cls(name=name, arguments=arguments, error=message, error_kind=kind, latency_s=latency_s)

    @property
    def agent_text(self) -> str:
        """What the agent is shown: the result's text, or the error message when there is no result."""
        if self.error_kind == "tool" or self.error is None:
            text = self.result_text if self.result_text is not None else _result_text(self.result)
            if self.truncated and self.result_chars is not None:
                text += f"\n[truncated: the result has {self.result_chars} characters; the first {len(text)} are shown]"
            return text
        return self.error


def _result_text(result: Any) -> str:
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, separators=(",", ":"))


class CheckResult(BaseModel):
    """One check's verdict. ``error`` is set when the check raised or ran too long."""

    check_item: str
    passed: bool
    error: str | None = None
    # The turn (1 for the first) whose checks this is, in a scenario with turns; None for the scenario-level checks.
    turn: int | None = None


class CallResult(BaseModel):
    """One tool call as check functions see it in ``turn_results``."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    result: Any = None
    error: str | None = None

    @classmethod
    def of(cls, outcome: ToolOutcome) -> CallResult:
        """The call ``outcome`` recorded."""
        return cls(name=outcome.name, arguments=outcome.arguments, result=outcome.result, error=outcome.error)


class CheckContext(BaseModel):
    """What check functions may read besides the states: the globals ``turn_results`` and ``agent_replies``.

    ``turn_results``: the tool calls of the turn being checked (for scenario-level checks, all the
    episode's calls). ``agent_replies``: the agent's texts to the user that the harness passed.
    """

    turn_results: list[CallResult] = Field(default_factory=list)
    agent_replies: list[str] = Field(default_factory=list)

    @classmethod
    def of_calls(cls, outcomes: list[ToolOutcome], agent_replies: list[str] | None = None) -> CheckContext:
        """The context of checks over the calls ``outcomes``."""
        return cls(turn_results=[CallResult.of(o) for o in outcomes], agent_replies=list(agent_replies or []))

    def check_globals(self) -> dict[str, Any]:
        """The globals as JSON-shaped data (``envscaler.checks`` gives each check copy-on-access views of them, so
        the values are shared here, not copied: a dump of every result would cost more than the checks)."""
        calls = [{"name": c.name, "arguments": c.arguments, "result": c.result, "error": c.error} for c in self.turn_results]
        return {"turn_results": calls, "agent_replies": self.agent_replies}


class ValidationResult(BaseModel):
    """The checklist run on a state: reward and its parts."""

    score: float
    checks: list[CheckResult]
    state_hash: str
    check_errors: int = 0
