"""What the benchmarks share: their command line, their verdicts, the servers and commands they run, and
what they read of processes from /proc.

A benchmark runs as a script (``python benchmarks/server.py``), so it imports this module as ``common``
from its own folder, before the project's packages: importing it puts the checkout it is in first on
``sys.path``, so that a benchmark measures the code beside it and can use ``tests.support``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envscaler import EnvRuntime, load_bundle  # noqa: E402
from tests.support.server import stop  # noqa: E402

__all__ = ["META", "Memory", "Verdict", "argument_parser", "cpu_seconds", "describe_memory", "envscaler", "memory", "percentile",
           "process_tree", "read_only_call", "report", "rss_mb", "start", "stop", "tree_memory"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# The ``_meta`` of a sessionless (2026-07-28) MCP request.
META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser, described by the first paragraph of its docstring."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


class Verdict(NamedTuple):
    """One target of a benchmark: what was measured, the value, the target, and whether it was met."""

    what: str
    measured: str
    target: str
    ok: bool


def report(verdicts: list[Verdict]) -> int:
    """Print the verdicts as a table, alike in every benchmark; the exit status: 1 when one was missed."""
    width = max((len(v.what) for v in verdicts), default=0)
    print()
    for v in verdicts:
        print(f"{v.what:<{width}}  {v.measured:>12}  target {v.target:<14} {'ok' if v.ok else 'MISSED'}")
    return 0 if all(v.ok for v in verdicts) else 1


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest sample at or above it)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def envscaler(*args: str, env: dict[str, str] | None = None) -> str:
    """Run ``python -m envscaler.cli ARGS``; its stderr. Exits with its stderr's end when it fails."""
    result = subprocess.run([sys.executable, "-m", "envscaler.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    if result.returncode != 0:
        raise SystemExit(f"envscaler {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result.stderr


def start(command: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict]:
    """Start a server in its own process group (``stop`` signals the group); it and its first line, as JSON."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    line = process.stdout.readline() if process.stdout else ""
    if not line:
        raise RuntimeError(f"{command[:4]} exited before listening")
    return process, json.loads(line)


def read_only_call(env_dir: Path) -> tuple[str, str, dict]:
    """(scenario id, tool, arguments) of the first reference call that leaves the state unchanged."""
    bundle = load_bundle(env_dir)
    runtime = EnvRuntime(bundle.spec)
    for scenario in bundle.scenarios:
        episode = runtime.new_episode(scenario.init_config)
        for call in scenario.reference_solution or []:
            outcome = episode.call(call.name, call.arguments)
            if not outcome.error and not outcome.diff and outcome.result.get("success"):
                return scenario.task_id, call.name, call.arguments
    raise SystemExit(f"{env_dir}: no read-only reference call to benchmark with")


# -- processes, read from /proc ----------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants that are alive now (a server, its workers, bubblewrap's)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        try:
            queue += [int(child) for child in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            pass
    return found


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time so far of processes ``pids``, each alone (one that has gone counts nothing)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


class Memory(NamedTuple):
    """USS (private pages: what one more costs), PSS (shared pages split among their users) and RSS, in MB."""

    uss: float
    pss: float
    rss: float


def memory(pid: int) -> Memory:
    """USS, PSS and RSS of one process from /proc/PID/smaps_rollup."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value)
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return Memory(uss / 1024, fields.get("Pss", 0) / 1024, fields.get("Rss", 0) / 1024)


def tree_memory(pid: int) -> Memory:
    """USS, PSS and RSS of process ``pid`` and all below it, added up (one that has gone counts nothing)."""
    parts = []
    for member in process_tree(pid):
        try:
            parts.append(memory(member))
        except OSError:
            pass
    return Memory(*(sum(getattr(part, name) for part in parts) for name in Memory._fields))


def describe_memory(used: list[Memory]) -> str:
    """``USS median 10.9 max 11.4; PSS ...; RSS ... MB per server``."""
    parts = []
    for name in Memory._fields:
        values = [getattr(m, name) for m in used]
        parts.append(f"{name.upper()} median {statistics.median(values):.1f} max {max(values):.1f}")
    return "; ".join(parts) + " MB per server"


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` alone, as the kernel counts it (/proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
