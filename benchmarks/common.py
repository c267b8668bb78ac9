"""What the benchmarks share: their command line, their verdicts, the servers and commands they run, and
what they read of processes from /proc.

A benchmark runs as a script (``python benchmarks/server.py``), so it imports this module as ``common``
from its own folder, before the project's packages: importing it puts the checkout it is in first on
``sys.path``, so that a benchmark measures the code beside it and can use ``tests.support``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envscaler import EnvRuntime, Scenario, load_bundle  # noqa: E402
from tests.support.server import stop  # noqa: E402

__all__ = ["MCP_HEADERS", "META", "Memory", "Verdict", "argument_parser", "cpu_seconds", "describe_memory", "envscaler", "memory", "percentile",
           "process_tree", "read_only_call", "report", "rss_mb", "start", "stop", "tool_calls_per_s", "tree_memory"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# The ``_meta`` of a sessionless (2026-07-28) MCP request.
# The header of a sessionless (2026-07-28) MCP request over HTTP.
MCP_HEADERS = {"MCP-Protocol-Version": "2026-07-28"}
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
        try:
            threads = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue  # it ended meanwhile
        found.append(current)
        # Every thread's children: a process started from a thread (a Ray actor's servers) is that thread's.
        for thread in threads:
            try:
                queue += [int(child) for child in Path(f"/proc/{current}/task/{thread}/children").read_text().split()]
            except OSError:
                continue  # a thread that ended meanwhile
    return found


def tree_cpu_by_name(pid: int) -> dict[str, float]:
    """User + system CPU time so far of process ``pid`` and all below it, by process name (:func:`_process_name`:
    ``server``, ``env-worker``, ``check-worker``, ``haproxy``...), each with what its ended children used: the
    same total before and after a child is reaped, so that a difference counts every process."""
    by_name: dict[str, float] = {}
    for member in process_tree(pid):
        try:
            name = _process_name(member)
        except OSError:
            continue  # ended meanwhile: its parent counts it once reaped
        by_name[name] = by_name.get(name, 0.0) + _cpu_ticks(member, with_children=True) / CLOCK_TICKS
    return by_name


class BusiestProcesses:
    """The CPU each process below ``roots`` used over a stretch, read from /proc every ``period_s`` by a
    thread (:meth:`start`, :meth:`stop`): which one, if any, ran a whole core, the bottleneck of a farm
    whose other cores wait. A process that ends between two readings loses its last period."""

    def __init__(self, roots: Callable[[], list[int]], period_s: float = 0.5) -> None:
        self._roots, self._period_s = roots, period_s
        self._first: dict[int, int] = {}
        self._last: dict[int, tuple[str, int]] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._started = 0.0

    def start(self) -> None:
        self._first = {pid: ticks for pid, (_, ticks) in self._read().items()}
        self._started = time.monotonic()
        self._thread.start()

    def stop(self, count: int = 5) -> list[tuple[str, int, float]]:
        """The ``count`` busiest: (name, pid, share of one core over the stretch), busiest first."""
        self._stopping.set()
        self._thread.join()
        self._note(self._read())
        seconds = time.monotonic() - self._started
        used = [(name, pid, (ticks - self._first.get(pid, 0)) / CLOCK_TICKS / seconds) for pid, (name, ticks) in self._last.items()]
        return sorted(used, key=lambda entry: -entry[2])[:count]

    def _watch(self) -> None:
        while not self._stopping.wait(self._period_s):
            self._note(self._read())

    def _note(self, read: dict[int, tuple[str, int]]) -> None:
        for pid, (name, ticks) in read.items():
            # A process gone between its two files reads as 0: what was seen of it before stands.
            self._last[pid] = (name, max(ticks, self._last.get(pid, (name, 0))[1]))

    def _read(self) -> dict[int, tuple[str, int]]:
        found = {}
        for root in self._roots():
            for pid in process_tree(root):
                try:
                    name = _process_name(pid)
                except OSError:
                    continue
                found[pid] = (name, _cpu_ticks(pid, with_children=False))
        return found


def _process_name(pid: int) -> str:
    """What ``ps`` calls ``pid``, or for a Python process that named itself nothing, what it runs (``envscaler.cli run``,
    ``servers.farm.daemon``: no path, which differs from farm to farm)."""
    name = Path(f"/proc/{pid}/comm").read_text().strip()
    if not name.startswith("python"):
        return name
    words = [word for word in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[1:]
             if word and word != "-m" and "/" not in word]
    return " ".join(words[:2]) or name


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time so far of processes ``pids``, each alone (one that has gone counts nothing)."""
    return sum(_cpu_ticks(pid, with_children=False) for pid in pids) / CLOCK_TICKS


def _cpu_ticks(pid: int, with_children: bool) -> int:
    """utime + stime of ``pid`` from /proc/PID/stat, plus cutime + cstime ``with_children``; 0 once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return sum(int(field) for field in fields[11:15 if with_children else 13])


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
    """USS, PSS and RSS of process ``pid`` and all below it, added up (one that has gone counts nothing).

    The USS is the tree's as a whole where this process may read page frames (root): the pages that only
    processes of the tree map, each counted once (:func:`unique_mb`). Added up process by process, a page
    that two of them share (a forked process and its parent, before either writes it) counts for neither.
    """
    members = process_tree(pid)
    parts = []
    for member in members:
        try:
            parts.append(memory(member))
        except OSError:
            pass
    total = Memory(*(sum(getattr(part, name) for part in parts) for name in Memory._fields))
    whole = unique_mb(members)
    return total if whole is None else total._replace(uss=whole)


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_PRESENT = 1 << 63
_FRAME = (1 << 55) - 1


def unique_mb(pids: list[int]) -> float | None:
    """The memory, in MB, of the pages that processes ``pids`` map and no other process does, each counted
    once (from /proc/PID/pagemap and /proc/kpagecount: root only); None where those cannot be read."""
    mapped: collections.Counter[int] = collections.Counter()
    try:
        for pid in pids:
            mapped.update(_frames(pid))
        with open("/proc/kpagecount", "rb", buffering=0) as counts:
            unique = sum(1 for frame, mappings in mapped.items()
                         if array("Q", os.pread(counts.fileno(), 8, frame * 8))[0] == mappings)
    except PermissionError:
        return None
    return unique * _PAGE_BYTES / 1024 / 1024


def _frames(pid: int) -> collections.Counter[int]:
    """How many times process ``pid`` maps each page frame it has in memory (none once it has gone)."""
    frames: collections.Counter[int] = collections.Counter()
    try:
        with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as smaps, open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
            start = end = 0
            for line in smaps:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):
                    start, end = (int(address, 16) for address in first.split("-"))
                elif first == "Rss:" and int(line.split()[1]) > 0:
                    entries = array("Q", os.pread(pagemap.fileno(), (end - start) // _PAGE_BYTES * 8, start // _PAGE_BYTES * 8))
                    frames.update(entry & _FRAME for entry in entries if entry & _PRESENT)
    except (FileNotFoundError, ProcessLookupError):
        pass
    return frames


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


async def tool_calls_per_s(catalog: dict, gateways: list[str], env_ids: list[str], scenario: Scenario, clients: int,
                           seconds: float) -> float:
    """Tool calls answered per second through a farm's gateways: each client calls the first step of
    ``scenario``'s reference solution on its own episode of one of ``env_ids`` (which all serve that
    scenario), over and over, the clients spread over ``gateways`` and ``env_ids``."""
    step = scenario.reference_solution[0]
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": step.name, "arguments": step.arguments}}
    counts = [0] * clients
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=30, limits=limits, trust_env=False) as http:

        async def client(number: int, deadline: float) -> None:
            gateway = gateways[number % len(gateways)]
            env_id = env_ids[number % len(env_ids)]
            headers = {"Authorization": f"Bearer {catalog['envs'][env_id]['token']}"}
            created = await http.post(f"{gateway}/envs/{env_id}/episodes", json={"scenario_id": scenario.task_id}, headers=headers)
            created.raise_for_status()
            episode = created.json()
            mcp_url = episode["mcp_url"].replace(catalog["gateway"], gateway)
            while time.perf_counter() < deadline:
                answer = await http.post(mcp_url, json=body, headers=MCP_HEADERS)
                if answer.status_code != 200 or "result" not in answer.json():
                    raise SystemExit(f"tool call failed: {answer.status_code} {answer.text[:300]}")
                counts[number] += 1
            await http.delete(f"{gateway}/envs/{env_id}/episodes/{episode['episode_id']}", headers=headers)

        # Warm-up: connections open, every server's code paths run once.
        async with anyio.create_task_group() as tasks:
            for number in range(clients):
                tasks.start_soon(client, number, time.perf_counter() + 1.0)
        counts[:] = [0] * clients
        started = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            for number in range(clients):
                tasks.start_soon(client, number, started + seconds)
        return sum(counts) / (time.perf_counter() - started)
