"""Run generated code in a limited child process, only through the runtime's guards.

The synth process never imports or executes generated code itself: it sends a ProbeRequest to
``python -m synth.probe_worker`` (through envscaler.sandbox.run_module: clean environment, memory and
CPU limits, a time limit), where EnvRuntime loads the class and Episode runs every call and check.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from subprocess import TimeoutExpired
from typing import Any

import anyio
from pydantic import BaseModel, Field

from envscaler.models import EnvSpec, ToolCall, ToolOutcome, ToolSchema
from envscaler.sandbox import run_module


class ProbeCase(BaseModel):
    """A fresh instance built from ``init_config``, then ``calls`` in order."""

    init_config: dict[str, Any] = Field(default_factory=dict)
    calls: list[ToolCall] = Field(default_factory=list)


class ProbeRequest(BaseModel):
    spec: EnvSpec
    init_configs: list[dict[str, Any]] = Field(default_factory=list)
    cases: list[ProbeCase] = Field(default_factory=list)


class Instantiation(BaseModel):
    error: str | None = None
    state: dict[str, Any] | None = None
    conversions: list[str] = Field(default_factory=list)


class ProbeRun(BaseModel):
    error: str | None = None
    outcomes: list[ToolOutcome] = Field(default_factory=list)
    conversions: list[str] = Field(default_factory=list)


class ProbeResult(BaseModel):
    """What the child saw: the class error (nothing else then), tools, instances, runs."""

    class_error: str | None = None
    tools: list[ToolSchema] = Field(default_factory=list)
    instances: list[Instantiation] = Field(default_factory=list)
    runs: list[ProbeRun] = Field(default_factory=list)


def probe_sync(request: ProbeRequest, timeout_s: float) -> ProbeResult:
    """Run ``request`` in the child and return its result; a crash or hang comes back as class_error."""
    with tempfile.TemporaryDirectory(prefix="synth-probe-") as folder:
        path = Path(folder) / "request.json"
        path.write_text(request.model_dump_json(), encoding="utf-8")
        try:
            done = run_module("synth.probe_worker", [str(path)], timeout_s=timeout_s, readable=[path])
        except TimeoutExpired:
            return ProbeResult(class_error=f"the generated code did not finish within {timeout_s:g} s")
    # Split on "\n" only: a result can hold U+2028 and the like, which splitlines() breaks on.
    lines = done.stdout.strip().split("\n")
    try:
        return ProbeResult.model_validate(json.loads(lines[-1]))
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return ProbeResult(class_error=f"the probe process failed (exit {done.returncode}): {tail}")


async def probe(request: ProbeRequest, timeout_s: float) -> ProbeResult:
    """probe_sync on a worker thread, so other drafts keep going meanwhile."""
    return await anyio.to_thread.run_sync(probe_sync, request, timeout_s)
