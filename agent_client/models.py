"""The harness's own contracts: what agents hand back and the records it writes.

What crosses HTTP (the farm catalog, episodes, validation, trajectories) is in ``envscaler.wire``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from agent_client.errors import HarnessError
from envscaler.bundle import parse_model, read_json
from envscaler.models import CheckResult, ToolOutcome
from envscaler.wire import FarmCatalog, TurnEnded

Termination = Literal["finished", "max_steps", "time_limit", "user_stop", "agent_error", "infra_error"]


def load_farm_catalog(path: str | Path) -> FarmCatalog:
    """The farm catalog file at ``path``; an error that says how to make one when it is missing."""
    path = Path(path)
    if not path.exists():
        raise HarnessError(f"{path}: no such farm catalog; start a farm with 'envscaler farm up --catalog {path}'")
    return parse_model(FarmCatalog, read_json(path), str(path))


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0

    def add(self, prompt: int, completion: int) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.requests += 1


class AgentResult(BaseModel):
    """What an agent hands back when its episode is over."""

    messages: list[dict[str, Any]] = Field(default_factory=list)
    termination: Termination = "finished"
    steps: int = 0
    usage: Usage = Field(default_factory=Usage)
    user_usage: Usage = Field(default_factory=Usage)
    error: str | None = None
    # Lone surrogates in model replies or tool results replaced by U+FFFD before they went to a model
    # (no UTF-8 request can carry them); the server's trajectory keeps the originals.
    replaced_surrogates: int = 0


class Record(BaseModel):
    """One line of ``envscaler run``'s output: a whole episode, ready for training and analysis."""

    env_id: str
    task_id: str
    repeat: int
    agent: str
    # The model (openai agent) or command line (command agent) that made the record.
    model: str | None = None
    episode_id: str | None = None
    reward: float | None = None
    checks: list[CheckResult] = Field(default_factory=list)
    # In a scenario with scripted user turns: what the server answered as each turn ended, in order.
    turns: list[TurnEnded] = Field(default_factory=list)
    termination: Termination
    error: str | None = None
    steps: int = 0
    env_errors: int = 0
    agent_errors: int = 0
    tool_errors: int = 0
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    trajectory: list[ToolOutcome] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    user_usage: Usage = Field(default_factory=Usage)
    # How many lone surrogates (text no UTF-8 request can carry) were replaced by U+FFFD in ``messages``.
    replaced_surrogates: int = 0
    started_at: float
    duration_s: float

    @property
    def infra_failed(self) -> bool:
        """The episode could not be judged: nothing here says anything about the agent."""
        return self.termination == "infra_error"

    @property
    def judged(self) -> bool:
        """The episode was judged and has a reward: it counts in success rates and reward statistics."""
        return not self.infra_failed and self.reward is not None

    def score(self) -> RecordScore:
        """What a run keeps of this record once it is written."""
        return RecordScore.model_validate(self, from_attributes=True)


class RecordScore(BaseModel):
    """What the score table (``agent_client.summary``) reads of a record: which episode, how it ended,
    its reward, steps, errors, turns and tokens. It is all a run keeps of each record it writes or finds
    in its output file: the whole record (messages, tools, trajectory) is in the file only, so that a long
    run holds no more in memory than a short one, worker processes send their records as bytes that
    nobody parses again, and the table at the end reads no file. Resuming reads the file's records as
    these: the fields left unparsed are most of a record's bytes (13,000 records of 22 KB: 20 s read whole,
    1.5 s read as these)."""

    env_id: str
    task_id: str
    repeat: int
    termination: Termination
    reward: float | None = None
    steps: int = 0
    env_errors: int = 0
    tool_errors: int = 0
    error: str | None = None
    turns: list[TurnEnded] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    user_usage: Usage = Field(default_factory=Usage)

    @property
    def infra_failed(self) -> bool:
        """The episode could not be judged."""
        return self.termination == "infra_error"

    @property
    def judged(self) -> bool:
        """The episode was judged and has a reward (as :attr:`Record.judged`)."""
        return not self.infra_failed and self.reward is not None


ScoredRecord = Record | RecordScore
"""A record as the score table and the spread read it: whole, or only what they read."""
