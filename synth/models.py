"""Contracts of the synthesis pipeline: seed tasks, each stage's answer, settings, and the run report.

Every LLM stage answers one JSON object that is validated as one of the ``*Answer`` models below; an
answer that does not validate counts as invalid JSON and is asked again (a bounded number of times).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, field_validator, model_validator

from envscaler.models import ToolCall


class SeedTask(BaseModel):
    """One seed task in the shape of ToolACE / API-Bank samples: a user request and the APIs around it."""

    model_config = ConfigDict(extra="allow")

    task_id: str
    source: str = "envscaler-farm"
    domain: str = ""
    task: str
    apis: list[dict[str, Any]] = Field(default_factory=list)


# ---- SkelBuilder answers ----------------------------------------------------------------------


class StatefulAnswer(BaseModel):
    """Stage 1: does the task read or change a persistent state?"""

    stateful: bool
    reason: str = ""


class TopicAnswer(BaseModel):
    """Stage 2: the environment the task lives in, scored for usefulness and modelability."""

    env_name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_ ]{2,60}$")
    summary: str
    introduction: str = ""
    usefulness: int = Field(ge=1, le=10)
    modelability: int = Field(ge=1, le=10)


class Entity(BaseModel):
    name: str
    description: str = ""
    attributes: dict[str, str]


class StateAnswer(BaseModel):
    """Stage 3: entities (TypedDicts), the instance attributes that hold them, and the rules."""

    entities: list[Entity] = Field(min_length=1)
    state_attributes: dict[str, str] = Field(min_length=1)
    rules: list[str] = Field(default_factory=list)


class CodeAnswer(BaseModel):
    """Stages 4 and 6: Python source."""

    code: str = Field(min_length=1)


class SkeletonAnswer(CodeAnswer):
    """Stage 4: the class skeleton (TypedDict entities and ``__init__(self, init_config)``)."""

    class_name: str = Field(pattern=r"^[A-Z][A-Za-z0-9_]*$")


class Parameter(BaseModel):
    name: str = Field(pattern=r"^[a-z_][a-z0-9_]*$")
    type: str = "str"
    description: str = ""
    required: bool = True


class Operation(BaseModel):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    kind: Literal["query", "change"]
    description: str
    parameters: list[Parameter] = Field(default_factory=list)


class OperationsAnswer(BaseModel):
    """Stage 5: the tools, split into queries and state changes (at least one of each)."""

    operations: list[Operation] = Field(min_length=2)

    @model_validator(mode="after")
    def _both_kinds(self) -> OperationsAnswer:
        kinds = {op.kind for op in self.operations}
        if kinds != {"query", "change"}:
            raise ValueError("plan at least one 'query' and at least one 'change' operation")
        names = [op.name for op in self.operations]
        if len(set(names)) != len(names):
            raise ValueError("operation names must be unique")
        return self


class TesterCall(BaseModel):
    """One tester call: a tool on one of the tester's initial states, expected to succeed or not."""

    state: int = Field(ge=0)
    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    kind: Literal["positive", "negative"]
    intent: str = ""


class TesterAnswer(BaseModel):
    """Stage 9a: initial states and positive/negative calls covering the tools."""

    initial_states: list[dict[str, Any]] = Field(min_length=1)
    cases: list[TesterCall] = Field(min_length=1)

    @model_validator(mode="after")
    def _states_exist(self) -> TesterAnswer:
        for number, case in enumerate(self.cases):
            if case.state >= len(self.initial_states):
                raise ValueError(f"case {number} uses state {case.state}, but only {len(self.initial_states)} are given")
        return self


Verdict = Literal["pass", "warning", "fail"]


class JudgeVerdict(BaseModel):
    case: int = Field(ge=0)
    verdict: Verdict
    reason: str = ""


class JudgeAnswer(BaseModel):
    """Stage 9b: one verdict per tester case."""

    verdicts: list[JudgeVerdict]


# ---- ScenGenerator answers --------------------------------------------------------------------


class InitialStateAnswer(BaseModel):
    init_config: dict[str, Any] = Field(min_length=1)


class TaskAnswer(BaseModel):
    task: str = Field(min_length=10)


class ChecklistAnswer(BaseModel):
    checklist: list[str] = Field(min_length=1, max_length=8)


class CheckFuncsAnswer(BaseModel):
    check_funcs: list[str] = Field(min_length=1)


class ReferenceAnswer(BaseModel):
    reference_solution: list[ToolCall] = Field(min_length=1)


class ScenarioRepairAnswer(BaseModel):
    """The repair of a scenario that failed a gate: corrected checks and reference solution."""

    check_funcs: list[str] = Field(min_length=1)
    reference_solution: list[ToolCall] = Field(min_length=1)


# ---- settings ---------------------------------------------------------------------------------


class StageConfig(BaseModel):
    """Where one stage's requests go. Unset fields fall back to the run's defaults."""

    base_url: str | None = None
    model: str | None = None
    temperature: float | None = None


class SynthConfig(BaseModel):
    """Settings of one synthesis run."""

    base_url: str | None = None
    api_key: str | None = None
    model: str = "gpt-4o-mini"
    temperature: float = 0.7
    stages: dict[str, StageConfig] = Field(default_factory=dict)
    concurrency: int = Field(default=4, ge=1)
    retries: int = Field(default=4, ge=0, description="retries of a request on 429, 5xx and connection errors")
    backoff_s: float = Field(default=1.0, ge=0)
    request_timeout_s: float = Field(default=120.0, gt=0)
    json_retries: int = Field(default=2, ge=0, description="re-asks after an answer that is not the JSON asked for")
    max_repairs: int = Field(default=2, ge=0, description="repair rounds before a draft is dropped")
    min_score: int = Field(default=7, ge=1, le=10, description="minimum usefulness and modelability")
    judge_threshold: float = Field(default=0.85, ge=0, le=1, description="(pass + warning) / total to keep an env")
    probe_timeout_s: float = Field(default=120.0, gt=0)

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, stages: dict[str, StageConfig]) -> dict[str, StageConfig]:
        from synth.prompts import STAGES

        unknown = sorted(set(stages) - set(STAGES))
        if unknown:
            raise ValueError(f"unknown stage(s) {', '.join(unknown)}; stages are: {', '.join(STAGES)}")
        return stages

    def stage(self, name: str) -> StageConfig:
        """The effective settings of stage ``name``."""
        own = self.stages.get(name, StageConfig())
        return StageConfig(
            base_url=own.base_url or self.base_url,
            model=own.model or self.model,
            temperature=self.temperature if own.temperature is None else own.temperature,
        )


# ---- report -----------------------------------------------------------------------------------


class StageStats(BaseModel):
    """What one stage cost and how many of its drafts survived."""

    requests: int = 0
    cached: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    http_retries: int = 0
    invalid_answers: int = 0
    attempts: int = 0
    accepted: int = 0

    @computed_field
    @property
    def acceptance(self) -> float | None:
        """Share of this stage's drafts that passed their checks (None before any draft)."""
        return round(self.accepted / self.attempts, 4) if self.attempts else None


class Rejection(BaseModel):
    """A seed task, environment or scenario that was dropped, and why."""

    subject: str
    stage: str
    reason: str


class RunReport(BaseModel):
    """Tokens, requests and acceptance per stage, and the cost of each accepted env and scenario."""

    stages: dict[str, StageStats] = Field(default_factory=dict)
    accepted_envs: list[str] = Field(default_factory=list)
    accepted_scenarios: list[str] = Field(default_factory=list)
    rejections: list[Rejection] = Field(default_factory=list)
    env_requests: int = 0
    scenario_requests: int = 0
    requests_per_env: float | None = None
    requests_per_scenario: float | None = None
    catalog_check: dict[str, bool] = Field(default_factory=dict)
