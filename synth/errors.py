"""Errors of the synthesis pipeline."""

from __future__ import annotations

from envscaler.errors import EnvScalerError


class SynthError(EnvScalerError):
    """Base of the errors synth raises on purpose."""


class LlmUnavailable(SynthError):
    """The LLM endpoint kept failing (or refused the request) after every retry: the run stops."""


class InvalidAnswer(SynthError):
    """A stage's answer was still not the JSON asked for after every re-ask: the draft is dropped."""

    def __init__(self, stage: str, attempts: int, problem: str) -> None:
        super().__init__(f"stage {stage!r}: no valid JSON answer after {attempts} attempt(s); last problem: {problem}")
        self.stage = stage
        self.attempts = attempts
        self.problem = problem


class Rejected(SynthError):
    """A draft failed its checks after every repair round: the draft is dropped with this reason."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(f"{stage}: {reason}")
        self.stage = stage
        self.reason = reason
