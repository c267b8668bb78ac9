"""One environment served several ways, measured with the same raw HTTP client in one run.

- ours: ``envscaler serve`` (episodes, guards, trajectories, validator), tools at
  ``/episodes/{id}/mcp``; by default with the environment's code in a worker process (sandboxed where
  a forked worker can confine itself) and the checks in a check worker, and with ``--in-process`` as it ran before: in the
  server's own process, in its bubblewrap sandbox (``envscaler.sandbox``) and without it;
- baseline: what a user would otherwise write, a plain ``mcp`` ``MCPServer`` with the same tools
  (bound methods of one shared instance: no episodes, no reset, no guards) at ``/mcp`` with the SDK's
  default settings (``server.run("streamable-http")``), under the same uvicorn (httptools + uvloop).

All get the same modern (2026-07-28) ``tools/call`` requests from the harness's keep-alive HTTP/1.1
client (``agent_client.http``), so client overhead is small and equal; the baseline is also measured
inside initialize-handshake sessions (2025-06-18), as older clients use it. All servers run for the
whole benchmark, and the measurements alternate between them in short rounds, each server alone while
it is measured: a shared machine whose speed drifts then moves every side of each comparison alike.
Ratios are the median of the per-round ratios. CPU per call and memory count every process of a
server (its workers included), read from /proc.

    python benchmarks/server.py [--env DIR] [--rounds 5] [--seconds 1] [--episodes 10000]

Targets: throughput >= 4x the baseline and sequential p50 <= 1 ms, with the worker process (the
default) and in-process; in-process idle RSS <= 45 MB; 10,000 live episodes within +300 MB (default
server, all its processes); in-process in the sandbox, throughput and p50 within 10% of the server
without it. Exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (META, Verdict, argument_parser, cpu_seconds, percentile, process_tree, read_only_call, report, rss_mb, start, stop,
                    tree_memory)

from agent_client.http import LeanHttp
from envscaler import EnvRuntime, default_catalog, load_bundle
from envscaler.sandbox import innermost_process, sandbox_problem

TOKEN = "bench-token"
CONCURRENCY = 16
SEQUENTIAL_CALLS = 400
LEGACY_VERSION = "2025-06-18"


class Target:
    """A server under test: where its MCP endpoint is and how to call a tool there.

    With ``legacy`` set, every client first runs the initialize handshake (2025-06-18) and calls
    inside its own MCP session, as clients that predate the sessionless protocol do.
    """

    def __init__(self, name: str, process: subprocess.Popen, url: str, mcp_path: str, legacy: bool = False,
                 sandboxed: bool = False) -> None:
        self.name, self.process, self.url, self.mcp_path, self.legacy = name, process, url, mcp_path, legacy
        # Whether the started process is bubblewrap, with the server inside it.
        self.sandboxed = sandboxed
        self.rates: list[float] = []
        self.latencies: list[float] = []
        self.cpu_s = 0.0
        self.calls = 0

    async def session(self, http: LeanHttp) -> str | None:
        """A new MCP session id in legacy mode; None for the sessionless protocol."""
        if not self.legacy:
            return None
        headers = {"Accept": "application/json, text/event-stream"}
        body = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
                "params": {"protocolVersion": LEGACY_VERSION, "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}}
        response = await http.request("POST", self.url + self.mcp_path, body, headers)
        session = response.headers.get("mcp-session-id")
        if response.status != 200 or not session:
            raise RuntimeError(f"{self.name}: initialize failed ({response.status}): {response.body[:300]!r}")
        headers.update({"Mcp-Session-Id": session, "MCP-Protocol-Version": LEGACY_VERSION})
        await http.request("POST", self.url + self.mcp_path, {"jsonrpc": "2.0", "method": "notifications/initialized"}, headers)
        return session

    @property
    def pid(self) -> int:
        """The server's own process (in the sandbox: not bubblewrap's)."""
        return innermost_process(self.process.pid) if self.sandboxed else self.process.pid

    def rss_mb(self) -> float:
        """The server process's resident memory (in-process: where the episodes live)."""
        return rss_mb(self.pid)

    def pss_mb(self) -> float:
        """Proportional memory of all the server's processes (shared pages split between them)."""
        return tree_memory(self.process.pid).pss

    def cpu_seconds(self) -> float:
        """User + system CPU time of all the server's processes so far."""
        return cpu_seconds(process_tree(self.process.pid))

    async def call(self, http: LeanHttp, session: str | None, name: str, arguments: dict, number: int) -> None:
        if session:
            body = {"jsonrpc": "2.0", "id": number, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
            headers = {"MCP-Protocol-Version": LEGACY_VERSION, "Mcp-Session-Id": session,
                       "Accept": "application/json, text/event-stream"}
        else:
            body = {"jsonrpc": "2.0", "id": number, "method": "tools/call", "params": {"name": name, "arguments": arguments, "_meta": META}}
            headers = {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": name,
                       "Accept": "application/json, text/event-stream"}
        response = await http.request("POST", self.url + self.mcp_path, body, headers)
        if response.status != 200 or b'"isError":false' not in response.body:
            raise RuntimeError(f"{self.name}: tool call failed ({response.status}): {response.body[:300]!r}")



async def sequential(target: Target, http: LeanHttp, tool: str, arguments: dict, calls: int) -> list[float]:
    session = await target.session(http)
    latencies = []
    for number in range(calls):
        started = time.perf_counter()
        await target.call(http, session, tool, arguments, number)
        latencies.append((time.perf_counter() - started) * 1e3)
    return latencies


async def throughput(target: Target, http: LeanHttp, tool: str, arguments: dict, seconds: float) -> float:
    """Calls/s with CONCURRENCY clients for ``seconds``; adds the server's CPU time to ``target``."""
    sessions = [await target.session(http) for _ in range(CONCURRENCY)]
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(session: str | None) -> None:
        nonlocal done
        number = 0
        while time.perf_counter() < deadline:
            await target.call(http, session, tool, arguments, number)
            number += 1
            done += 1

    cpu_before = target.cpu_seconds()
    started = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in sessions))
    elapsed = time.perf_counter() - started
    target.cpu_s += target.cpu_seconds() - cpu_before
    target.calls += done
    return done / elapsed


async def measure_rounds(targets: list[Target], tool: str, arguments: dict, rounds: int, seconds: float) -> None:
    """Alternate between the targets: each round, sequential latencies then throughput for each."""
    async with LeanHttp() as http:
        for target in targets:
            await sequential(target, http, tool, arguments, 200)  # warm-up
        for number in range(rounds):
            for target in targets:
                target.latencies += await sequential(target, http, tool, arguments, SEQUENTIAL_CALLS)
                target.rates.append(await throughput(target, http, tool, arguments, seconds))
            line = "  ".join(f"{t.name} {t.rates[-1]:,.0f}/s" for t in targets)
            print(f"round {number + 1}/{rounds}: {line}", flush=True)


def ratio(ours: Target, other: Target) -> float:
    """Median over rounds of ours / other, each pair measured back to back."""
    return statistics.median(a / b for a, b in zip(ours.rates, other.rates))


async def control(http: LeanHttp, url: str, path: str, body: dict | None, expected: int) -> dict:
    """One control-API request to our server; RuntimeError unless it answers ``expected``."""
    response = await http.request("POST", url + path, body, {"Authorization": f"Bearer {TOKEN}"})
    if response.status != expected:
        raise RuntimeError(f"POST {path} failed ({response.status}): {response.body[:200]!r}")
    return response.json()


async def episode_costs(target: Target, scenario_id: str, episodes: int) -> dict[str, float]:
    """Memory (all the server's processes) with ``episodes`` live episodes, and create / validate p50."""
    before = target.pss_mb()
    creates, ids, validates = [], [], []
    async with LeanHttp() as http:
        for _ in range(episodes):
            started = time.perf_counter()
            ids.append((await control(http, target.url, "/episodes", {"scenario_id": scenario_id}, 201))["episode_id"])
            creates.append((time.perf_counter() - started) * 1e3)
        loaded = target.pss_mb()
        for episode_id in ids[:300]:
            started = time.perf_counter()
            await control(http, target.url, f"/episodes/{episode_id}/validate", None, 200)
            validates.append((time.perf_counter() - started) * 1e3)
    return {"rss_loaded_mb": loaded, "rss_delta_mb": loaded - before, "create_p50_ms": statistics.median(creates),
            "validate_p50_ms": statistics.median(validates)}


def serve_baseline(env_dir: str) -> None:
    """The baseline server process: a plain MCPServer over one shared instance."""
    import uvicorn
    from mcp.server.mcpserver import MCPServer

    bundle = load_bundle(env_dir)
    runtime = EnvRuntime(bundle.spec)
    instance = runtime.instantiate(bundle.scenarios[0].init_config)
    server = MCPServer(f"baseline-{bundle.env_id}", log_level="WARNING")
    for tool in runtime.tool_list():
        server.add_tool(getattr(instance, tool.name), name=tool.name, description=tool.description)
    # The defaults, as ``server.run("streamable-http")`` would use them.
    app = server.streamable_http_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)  # connections queue until uvicorn accepts them
    # Idle connections kept as long as ours keeps them (75 s): with uvicorn's 5 s, those of the baseline's clients,
    # idle while the other servers are measured, could be closed just as a round sent on them (a failed run).
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, http="httptools", loop="uvloop", log_level="warning", access_log=False,
                                                   timeout_keep_alive=75))
    print(json.dumps({"event": "listening", "url": f"http://127.0.0.1:{sock.getsockname()[1]}"}), flush=True)
    uvicorn_server.run(sockets=[sock])


async def run(args: argparse.Namespace) -> int:
    scenario_id, tool, arguments = read_only_call(Path(args.env))
    problem = sandbox_problem()
    if problem is not None:
        print(f"the sandbox is not measured: {problem}")
    print(f"environment {Path(args.env).name}, tool {tool}({json.dumps(arguments)}), {CONCURRENCY} concurrent clients, "
          f"{args.rounds} rounds of {args.seconds:g} s per server")

    targets: list[Target] = []
    try:
        process, ready = start([sys.executable, __file__, "--serve-baseline", args.env])
        base = Target("baseline", process, ready["url"], "/mcp")
        legacy = Target("baseline-handshake", process, ready["url"], "/mcp", legacy=True)
        targets += [base, legacy]
        env = {**os.environ, "ENVSCALER_TOKEN": TOKEN}
        command = [sys.executable, "-m", "servers.cli", args.env, "--port", "0", "--log-level", "warning"]
        process, ready = start(command, env)
        ours = Target("ours", process, ready["url"], "")
        process, ready = start([*command, "--in-process", "--no-sandbox"], env)
        inline = Target("in-process", process, ready["url"], "")
        targets += [ours, inline]
        boxed: Target | None = None
        if problem is None:
            process, ready = start([*command, "--in-process"], env)
            boxed = Target("in-process-sandboxed", process, ready["url"], "", sandboxed=True)
            targets.append(boxed)
        ours_servers = [ours, inline, *([boxed] if boxed else [])]
        idle = {t.name: t.rss_mb() for t in targets}
        idle_pss = {t.name: t.pss_mb() for t in targets}
        async with LeanHttp() as http:
            for server in ours_servers:
                server.mcp_path = (await control(http, server.url, "/episodes", {"scenario_id": scenario_id}, 201))["mcp_path"]
        await measure_rounds([base, legacy, *ours_servers], tool, arguments, args.rounds, args.seconds)
        costs = await episode_costs(ours, scenario_id, args.episodes)
    finally:
        # The whole group: a sandboxed server's bubblewrap ignores SIGTERM sent to it alone. Two targets
        # share the baseline's process: stopping it again finds it gone.
        for target in targets:
            stop(target.process)

    def row(label: str, values: list[str]) -> None:
        print(f"{label:<36}" + "".join(f" {value:>15}" for value in values))

    print()
    measured = [*ours_servers, base, legacy]
    row("", [t.name for t in measured[:-2]] + ["baseline", "baseline"])
    row("", ["(default)", "--no-sandbox", *(["(sandboxed)"] if boxed else []), "2026-07-28", LEGACY_VERSION])
    row("tool calls/s, 16 concurrent (median)", [f"{statistics.median(t.rates):,.0f}" for t in measured])
    row("CPU per call, all processes (us)", [f"{1e6 * t.cpu_s / t.calls:.0f}" for t in measured])
    row("sequential p50 (ms)", [f"{percentile(t.latencies, 0.5):.3f}" for t in measured])
    row("sequential p99 (ms)", [f"{percentile(t.latencies, 0.99):.3f}" for t in measured])
    row("idle RSS, server process (MB)", [f"{idle[t.name]:.1f}" for t in measured[:-1]] + ["(same)"])
    row("idle PSS, all processes (MB)", [f"{idle_pss[t.name]:.1f}" for t in measured[:-1]] + ["(same)"])
    print(f"{f'PSS with {args.episodes} live episodes (MB)':<36} {costs['rss_loaded_mb']:>10.1f}  (+{costs['rss_delta_mb']:.1f} MB, default server)")
    print(f"{'episode create p50 (ms)':<36} {costs['create_p50_ms']:>10.3f}")
    print(f"{'validate p50 (ms)':<36} {costs['validate_p50_ms']:>10.3f}")
    print("(the baseline has one shared state: no episodes to create, reset or validate)")

    p50 = percentile(ours.latencies, 0.5)
    inline_p50 = percentile(inline.latencies, 0.5)
    print(f"\nper-round throughput ratios vs baseline: {', '.join(f'{a / b:.1f}' for a, b in zip(ours.rates, base.rates))} (default), "
          f"{', '.join(f'{a / b:.1f}' for a, b in zip(inline.rates, base.rates))} (in-process)")
    print(f"worker process (default) vs in-process: throughput {ratio(ours, inline):.2f}x, p50 {p50 - inline_p50:+.3f} ms")
    verdicts = [
        Verdict("throughput vs the baseline", f"{ratio(ours, base):.1f}x", ">= 4x", ratio(ours, base) >= 4.0),
        Verdict("throughput vs the baseline, handshake era", f"{ratio(ours, legacy):.1f}x", ">= 4x", ratio(ours, legacy) >= 4.0),
        Verdict("sequential p50", f"{p50:.3f} ms", "<= 1 ms", p50 <= 1.0),
        Verdict(f"{args.episodes} live episodes", f"+{costs['rss_delta_mb']:.1f} MB", "<= +300 MB", costs["rss_delta_mb"] <= 300.0),
        Verdict("in-process throughput vs the baseline", f"{ratio(inline, base):.1f}x", ">= 4x", ratio(inline, base) >= 4.0),
        Verdict("in-process sequential p50", f"{inline_p50:.3f} ms", "<= 1 ms", inline_p50 <= 1.0),
        Verdict("in-process idle RSS", f"{idle['in-process']:.1f} MB", "<= 45 MB", idle["in-process"] <= 45.0),
    ]
    if boxed is not None:
        boxed_p50 = percentile(boxed.latencies, 0.5)
        verdicts += [
            Verdict("in-process sandboxed throughput vs unsandboxed", f"{ratio(boxed, inline):.2f}x", ">= 0.9x", ratio(boxed, inline) >= 0.9),
            Verdict("in-process sandboxed p50 vs unsandboxed", f"{boxed_p50 / inline_p50:.2f}x", "<= 1.1x", boxed_p50 <= 1.1 * inline_p50),
        ]
    return report(verdicts)


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--env", default=str(default_catalog() / "library_circulation"), help="bundle to serve (default: library_circulation)")
    parser.add_argument("--rounds", type=int, default=5, help="measurement rounds, alternating between the servers (default: 5)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each throughput run in a round (default: 1)")
    parser.add_argument("--episodes", type=int, default=10_000, help="live episodes for the memory measurement (default: 10000)")
    parser.add_argument("--serve-baseline", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_baseline:
        serve_baseline(args.serve_baseline)
        return 0
    import uvloop

    return uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
