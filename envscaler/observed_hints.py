"""Read-only hints confirmed by observation: what ``catalog check`` saw each tool's reference calls do.

The hints a tool carries are read from its code (``envscaler.annotations``), a guess. The gates run
every scenario's reference solution and see which calls changed the state. ``catalog check
--write-annotations`` reports, per tool the references called, what its calls did and where the code
read otherwise, and writes into env.json's ``tool_annotations`` what the calls prove: a tool whose call
changed the state writes (``readOnlyHint: false``), whatever its code looks like or env.json said.

The other way round proves nothing: calls that left the state alone did not take the path that
writes, if there is one. A tool whose code reads as writing stays so (the disagreement is reported),
so a client never runs a tool unprompted on the strength of what some inputs did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from envscaler.bundle import ENV_FILE, read_json, write_env_json
from envscaler.gates import EnvReport


class HintFinding(BaseModel):
    """One tool whose observed behaviour settles its ``readOnlyHint``."""

    tool: str
    read_only: bool
    """What its reference calls showed."""
    calls: int
    changed: int
    code_read_only: bool | None = None
    """What its code reads as (None: unknown)."""

    @property
    def disagrees(self) -> bool:
        """Whether the code's reading differs from what was observed."""
        return self.code_read_only is not None and self.code_read_only != self.read_only

    def describe(self) -> str:
        """``tool: read-only (0 of 3 reference calls changed the state); the code reads as writing``."""
        seen = f"{self.changed} of {self.calls} reference call{'s' if self.calls != 1 else ''} changed the state"
        code = {None: "", True: "; the code reads as read-only", False: "; the code reads as writing"}[self.code_read_only]
        return f"{self.tool}: {'read-only' if self.read_only else 'writes'} ({seen}){code}"


def findings(report: EnvReport) -> list[HintFinding]:
    """A finding per tool the reference solutions called without error, in tool name order."""
    return [HintFinding(tool=name, read_only=seen.changed == 0, calls=seen.calls, changed=seen.changed,
                        code_read_only=report.code_read_only.get(name))
            for name, seen in sorted(report.observed.items()) if seen.calls]


def write_observed_hints(directory: Path, report: EnvReport) -> list[HintFinding]:
    """Mark in the bundle's env.json every tool seen to change the state that its hints call read-only;
    the findings written."""
    spec: dict[str, Any] = read_json(directory / ENV_FILE)
    hints: dict[str, Any] = spec.get("tool_annotations") or {}
    written = []
    for finding in findings(report):
        tool_hints = hints.get(finding.tool) or {}
        said = tool_hints.get("readOnlyHint", finding.code_read_only)
        if finding.read_only or said is False:
            continue
        # What a read-only reading implied (not destructive, idempotent) is not known of a write: MCP's defaults.
        tool_hints.update(readOnlyHint=False, destructiveHint=True, idempotentHint=False)
        hints[finding.tool] = tool_hints
        written.append(finding)
    if written:
        spec["tool_annotations"] = hints
        write_env_json(directory, spec)
    return written
