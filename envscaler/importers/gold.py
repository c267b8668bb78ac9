"""Gold runs: a bundle's reference solutions played turn by turn in a limited child, what they did reported back.

An importer that reproduces a benchmark's scoring needs what the benchmark's gold calls do before it
writes the checks: tau-bench compares the data after the agent with the data after the gold actions,
BFCL compares each turn's state and results with the gold calls'. Computing that runs the benchmark's
code, which never happens in the importer's process: the importer writes the bundle (data files
included), and :func:`run_gold` runs ``python -m envscaler.importers.gold_worker BUNDLE_DIR`` through
the sandbox (``envscaler.sandbox.run_module``), which plays every scenario on a fresh episode through
the runtime's guards and prints one :class:`GoldRun` per scenario.

Two states that grew from the same initial state are equal exactly when they changed it in the same
places to the same values, so the digest is of the change set (:data:`CHANGES_CODE`, over
``envscaler.state.changes_since``, which the trajectories' diffs use): a check that compares it costs
in proportion to what changed, not to the size of the data (a benchmark's data is megabytes), as it
skips every container the episode shares, unchanged, with its initial state. The check embeds the
same text that the worker runs, so both agree on what equal data is.
"""

from __future__ import annotations

import json
from pathlib import Path
from subprocess import TimeoutExpired
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from envscaler.errors import InfraError
from envscaler.models import CallResult
from envscaler.sandbox import run_module

CHANGES_CODE = '''
def changes_digest(before, after):
    """sha256 of where and how ``after`` differs from ``before`` (``envscaler.state.changes_since``), as canonical JSON."""
    import hashlib
    import json

    from envscaler.state import changes_since

    changes = sorted(([change.path, change.op, change.after] for change in changes_since(before, after)),
                     key=lambda change: json.dumps(change[0]))
    text = json.dumps(changes, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
'''
"""Defines ``changes_digest(before, after) -> str``. Check code embeds this text; the worker runs the same text."""

# The worker holds a benchmark's whole data (tau-bench's domains: megabytes of JSON) a few times over.
GOLD_MEMORY_MB = 8192


def changes_digest(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The digest :data:`CHANGES_CODE` computes, for two states (plain JSON data)."""
    namespace: dict[str, Any] = {}
    exec(compile(CHANGES_CODE, "<changes_digest>", "exec"), namespace)  # our own text, not environment code
    return str(namespace["changes_digest"](before, after))


NO_CHANGE = changes_digest({}, {})
"""The digest of a state that changed nothing."""


class GoldCall(CallResult):
    """One reference call as the worker played it: what check functions see of it, and how it went."""

    error_kind: str | None = None
    changed: bool = False
    read_only: bool | None = None
    """The tool's readOnlyHint, as the runtime serves it."""

    @property
    def env_fault(self) -> bool:
        """True when it failed by the environment's fault (its code raised an undeclared exception, changed
        what every episode shares, or ran out of time): a reference no agent could be held to."""
        return self.error_kind in ("env", "timeout")


class GoldTurn(BaseModel):
    """One turn's reference calls as played, and the state they left (only when the run asked for states)."""

    calls: list[GoldCall] = Field(default_factory=list)
    state: dict[str, Any] | None = None


class GoldRun(BaseModel):
    """One scenario's reference solution played on its initial state, turn by turn, or why it could not be."""

    task_id: str
    error: str | None = None
    turns: list[GoldTurn] = Field(default_factory=list)
    """One per scenario turn; a single-turn scenario has one."""
    digest: str | None = None
    """``changes_digest(initial state, final state)``: :data:`NO_CHANGE` when the calls changed nothing."""

    @property
    def calls(self) -> list[GoldCall]:
        """Every turn's calls, in the order they ran."""
        return [call for turn in self.turns for call in turn.calls]


def run_gold(bundle_dir: Path, timeout_s: float, *, states: bool = False) -> dict[str, GoldRun]:
    """Each scenario's GoldRun (task_id -> run) for the bundle at ``bundle_dir``, from a sandboxed child.

    ``states``: report the state after each turn too (a benchmark's data can be megabytes per turn).
    Raises InfraError, naming the environment (the bundle folder's name), when the child fails as a whole
    (the environment does not load, it dies or it runs past ``timeout_s``).
    """
    try:
        done = run_module("envscaler.importers.gold_worker", [str(bundle_dir), *(["--states"] if states else [])],
                          timeout_s=timeout_s, memory_mb=GOLD_MEMORY_MB, readable=[bundle_dir])
    except TimeoutExpired:
        raise InfraError(f"{bundle_dir.name}: running the gold calls took longer than {timeout_s:g} s "
                         "(raise --gold-timeout, or import fewer tasks)") from None
    runs: dict[str, GoldRun] = {}
    # Split on "\n" only: a message can hold U+2028 and the like, which splitlines() breaks on.
    for line in done.stdout.strip().split("\n"):
        if not line:
            continue
        try:
            run = GoldRun.model_validate(json.loads(line))
        except (ValueError, ValidationError):
            continue
        runs[run.task_id] = run
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise InfraError(f"{bundle_dir.name}: the gold run failed (exit {done.returncode}): {tail}")
    return runs
