"""Gold final states: a bundle's reference solutions run in a limited child, each final state's digest back.

Benchmarks score by comparing the data after the agent with the data after the gold actions
(tau-bench). The importer cannot run the benchmark's tool code itself (it is untrusted), so it
writes the bundle, runs ``python -m envscaler.importers.gold_worker BUNDLE_DIR`` through the sandbox
(``envscaler.sandbox.run_module``) and reads one :class:`GoldRun` per scenario. The digest is
computed by :data:`DIGEST_CODE`, the same text a check function embeds, so the check and the import
agree on what equal data is.
"""

from __future__ import annotations

import json
from pathlib import Path
from subprocess import TimeoutExpired
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from envscaler.errors import InfraError
from envscaler.sandbox import run_module

DIGEST_CODE = '''
def state_digest(state):
    """sha256 of the state as canonical JSON (keys sorted)."""
    import hashlib
    import json

    # dict.items and list.__iter__ read what a container holds as envscaler.state.state_hash does: a
    # check's copy-on-access view of the state is read without a copy of every container in it.
    def plain(value):
        if isinstance(value, dict):
            return {key: plain(child) for key, child in dict.items(value)}
        if isinstance(value, list):
            return [plain(child) for child in list.__iter__(value)]
        return value

    text = json.dumps(plain(state), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
'''
"""Defines ``state_digest(state) -> str``. Check code embeds this text; the worker runs the same text."""

# The worker holds a benchmark's whole data (tau-bench's domains: over 100 MB of JSON) a few times over.
GOLD_MEMORY_MB = 8192


def state_digest(state: dict[str, Any]) -> str:
    """The digest :data:`DIGEST_CODE` computes, for ``state`` (plain JSON data)."""
    namespace: dict[str, Any] = {}
    exec(compile(DIGEST_CODE, "<state_digest>", "exec"), namespace)  # our own text, not environment code
    return str(namespace["state_digest"](state))


class GoldCall(BaseModel):
    """One reference call as the worker ran it."""

    name: str
    error: str | None = None
    error_kind: str | None = None
    changed: bool = False
    read_only: bool | None = None
    """The tool's readOnlyHint, as the runtime serves it."""


class GoldRun(BaseModel):
    """One scenario's reference solution run on its initial state: the final state's digest, or why there is none."""

    task_id: str
    digest: str | None = None
    initial_digest: str | None = None
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
