"""Gold final states: a bundle's reference solutions run in a limited child, what each changed comes back as a digest.

Benchmarks score by comparing the data after the agent with the data after the gold actions
(tau-bench). The importer cannot run the benchmark's tool code itself (it is untrusted), so it
writes the bundle, runs ``python -m envscaler.importers.gold_worker BUNDLE_DIR`` through the sandbox
(``envscaler.sandbox.run_module``) and reads one :class:`GoldRun` per scenario.

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


class GoldCall(BaseModel):
    """One reference call as the worker ran it."""

    name: str
    error: str | None = None
    error_kind: str | None = None
    changed: bool = False
    read_only: bool | None = None
    """The tool's readOnlyHint, as the runtime serves it."""


class GoldRun(BaseModel):
    """One scenario's reference solution run on its initial state: the digest of what it changed, or why there is none."""

    task_id: str
    digest: str | None = None
    """``changes_digest(initial state, final state)``: :data:`NO_CHANGE` when the calls changed nothing."""
    error: str | None = None
    calls: list[GoldCall] = Field(default_factory=list)


def run_gold(bundle_dir: Path, timeout_s: float) -> dict[str, GoldRun]:
    """Each scenario's GoldRun (task_id -> run) for the bundle at ``bundle_dir``, from a sandboxed child.

    Raises InfraError, naming the environment (the bundle folder's name), when the child fails as a whole
    (the environment does not load, it dies or it runs past ``timeout_s``).
    """
    try:
        done = run_module("envscaler.importers.gold_worker", [str(bundle_dir)], timeout_s=timeout_s,
                          memory_mb=GOLD_MEMORY_MB, readable=[bundle_dir])
    except TimeoutExpired:
        raise InfraError(f"{bundle_dir.name}: running the gold actions took longer than {timeout_s:g} s "
                         "(raise --timeout, or import fewer tasks with --split)") from None
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
