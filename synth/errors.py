"""The errors the synthesis pipeline raises on purpose.

Part of the tree drawn in ``envscaler.errors``; the exit code applies when one reaches a command::

    EnvScalerError (envscaler.errors)
    ├── SynthError              2   the run cannot start: bad settings, no seed tasks, no bundles
    │   ├── InvalidAnswer       1   a stage's answer was still not the JSON asked for: the draft is dropped
    │   └── Rejected            1   a draft failed its checks after every repair round: the draft is dropped
    └── InfraError (envscaler)
        └── LlmUnavailable      1   the LLM endpoint kept failing, or refused the request: the run stops

InvalidAnswer and Rejected are caught by the pipeline, which records the dropped draft in the run
report; LlmUnavailable (raised by ``envscaler.llm``, given the stage's name here) stops the run
with exit 1 after the partial report is written.
"""

from __future__ import annotations

from envscaler.errors import EXIT_FAILED, EnvScalerError


class SynthError(EnvScalerError):
    """Base of the errors synth raises on purpose; on its own, bad settings or input."""


class InvalidAnswer(SynthError):
    """A stage's answer was still not the JSON asked for after every re-ask: the draft is dropped."""

    exit_code = EXIT_FAILED

    def __init__(self, stage: str, attempts: int, problem: str) -> None:
        super().__init__(f"stage {stage!r}: no valid JSON answer after {attempts} attempt(s); last problem: {problem}")
        self.stage = stage
        self.attempts = attempts
        self.problem = problem


class Rejected(SynthError):
    """A draft failed its checks after every repair round: the draft is dropped with this reason."""

    exit_code = EXIT_FAILED

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(f"{stage}: {reason}")
        self.stage = stage
        self.reason = reason
