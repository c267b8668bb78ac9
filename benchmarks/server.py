"""One environment served two ways, measured with the same raw HTTP client in one run.

- ours: ``envscaler serve`` (episodes, guards, trajectories, validator), tools at
  ``/episodes/{id}/mcp``;
- baseline: what a user would otherwise write, a plain ``mcp`` ``MCPServer`` with the same tools
  (bound methods of one shared instance: no episodes, no reset, no guards) at ``/mcp`` with the SDK's
  default settings (``server.run("streamable-http")``), under the same uvicorn (httptools + uvloop).

Both get the same modern (2026-07-28) ``tools/call`` requests from the harness's keep-alive HTTP/1.1
client (``agent_client.http``), so client overhead is small and equal; the baseline is measured a second time inside an
initialize-handshake session (2025-06-18), as older clients use it. Each server runs alone while it
is measured.

    python benchmarks/server.py [--env DIR] [--seconds 5] [--episodes 10000]

Targets: throughput >= 4x the baseline, sequential p50 <= 1 ms, idle RSS <= 45 MB, 10,000 live
episodes within +300 MB. Exits 1 when one is missed.
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

from agent_client.http import LeanHttp
from envscaler import EnvRuntime, default_catalog, load_bundle

TOKEN = "bench-token"
CONCURRENCY = 16
LEGACY_VERSION = "2025-06-18"
META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}


class Target:
    """A server under test: where its MCP endpoint is and how to call a tool there.

    With ``legacy`` set, every client first runs the initialize handshake (2025-06-18) and calls
    inside its own MCP session, as clients that predate the sessionless protocol do.
    """

    def __init__(self, name: str, process: subprocess.Popen, url: str, mcp_path: str, legacy: bool = False) -> None:
        self.name, self.process, self.url, self.mcp_path, self.legacy = name, process, url, mcp_path, legacy

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

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

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

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start(command: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = process.stdout.readline() if process.stdout else ""
    if not line:
        raise RuntimeError(f"{command[:4]} exited before listening")
    return process, json.loads(line)


async def sequential(target: Target, http: LeanHttp, tool: str, arguments: dict, calls: int) -> list[float]:
    session = await target.session(http)
    latencies = []
    for number in range(calls):
        started = time.perf_counter()
        await target.call(http, session, tool, arguments, number)
        latencies.append((time.perf_counter() - started) * 1e3)
    return latencies


async def throughput(target: Target, http: LeanHttp, tool: str, arguments: dict, seconds: float) -> float:
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

    started = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in sessions))
    return done / (time.perf_counter() - started)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(target: Target, tool: str, arguments: dict, seconds: float) -> dict[str, float]:
    idle = target.rss_mb()
    async with LeanHttp() as http:
        await sequential(target, http, tool, arguments, 200)  # warm-up
        latencies = await sequential(target, http, tool, arguments, 2000)
        rate = await throughput(target, http, tool, arguments, seconds)
    return {"calls_per_s": rate, "p50_ms": percentile(latencies, 0.5), "p99_ms": percentile(latencies, 0.99), "idle_rss_mb": idle}


async def control(http: LeanHttp, url: str, path: str, body: dict | None, expected: int) -> dict:
    """One control-API request to our server; RuntimeError unless it answers ``expected``."""
    response = await http.request("POST", url + path, body, {"Authorization": f"Bearer {TOKEN}"})
    if response.status != expected:
        raise RuntimeError(f"POST {path} failed ({response.status}): {response.body[:200]!r}")
    return response.json()


async def episode_costs(target: Target, scenario_id: str, episodes: int) -> dict[str, float]:
    """RSS with ``episodes`` live episodes, and create / validate p50 on our server."""
    before = target.rss_mb()
    creates, ids, validates = [], [], []
    async with LeanHttp() as http:
        for _ in range(episodes):
            started = time.perf_counter()
            ids.append((await control(http, target.url, "/episodes", {"scenario_id": scenario_id}, 201))["episode_id"])
            creates.append((time.perf_counter() - started) * 1e3)
        loaded = target.rss_mb()
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
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, http="httptools", loop="uvloop", log_level="warning", access_log=False))
    print(json.dumps({"event": "listening", "url": f"http://127.0.0.1:{sock.getsockname()[1]}"}), flush=True)
    uvicorn_server.run(sockets=[sock])


def read_only_call(env_dir: Path) -> tuple[str, str, dict]:
    """(scenario id, tool, arguments) of the first reference call that leaves the state unchanged."""
    bundle = load_bundle(env_dir)
    runtime = EnvRuntime(bundle.spec)
    for scenario in bundle.scenarios:
        episode = runtime.new_episode(scenario.init_config)
        for call in scenario.reference_solution or []:
            outcome = episode.call(call.name, call.arguments, track_diff=True)
            if not outcome.error and not outcome.diff and outcome.result.get("success"):
                return scenario.task_id, call.name, call.arguments
    raise SystemExit(f"{env_dir}: no read-only reference call to benchmark with")


async def run(args: argparse.Namespace) -> int:
    scenario_id, tool, arguments = read_only_call(Path(args.env))
    print(f"environment {Path(args.env).name}, tool {tool}({json.dumps(arguments)}), {CONCURRENCY} concurrent clients, "
          f"{args.seconds:g} s per throughput run")

    process, _ = start([sys.executable, __file__, "--serve-baseline", args.env])
    baseline = Target("baseline", process, _["url"], "/mcp")
    try:
        base = await measure(baseline, tool, arguments, args.seconds)
        baseline.legacy = True
        legacy = await measure(baseline, tool, arguments, args.seconds)
    finally:
        baseline.stop()

    env = {**os.environ, "ENVSCALER_TOKEN": TOKEN}
    process, ready = start([sys.executable, "-m", "servers.farm.launch", args.env, "--port", "0", "--log-level", "warning"], env)
    ours = None
    try:
        async with LeanHttp() as http:
            episode = await control(http, ready["url"], "/episodes", {"scenario_id": scenario_id}, 201)
        ours = Target("ours", process, ready["url"], episode["mcp_path"])
        mine = await measure(ours, tool, arguments, args.seconds)
        mine.update(await episode_costs(ours, scenario_id, args.episodes))
    finally:
        (ours or Target("ours", process, "", "")).stop()

    rows = [("tool calls/s, 16 concurrent", "calls_per_s", "{:.0f}"), ("sequential p50 (ms)", "p50_ms", "{:.3f}"),
            ("sequential p99 (ms)", "p99_ms", "{:.3f}"), ("idle RSS (MB)", "idle_rss_mb", "{:.1f}")]
    print(f"\n{'':<34} {'ours':>10} {'baseline':>10} {'baseline':>10}")
    print(f"{'':<34} {'2026-07-28':>10} {'2026-07-28':>10} {LEGACY_VERSION:>10}")
    for label, key, fmt in rows:
        print(f"{label:<34} {fmt.format(mine[key]):>10} {fmt.format(base[key]):>10} {fmt.format(legacy[key]):>10}")
    print(f"{f'RSS with {args.episodes} live episodes (MB)':<34} {mine['rss_loaded_mb']:>10.1f} {'n/a':>10} {'n/a':>10}  (+{mine['rss_delta_mb']:.1f} MB)")
    print(f"{'episode create p50 (ms)':<34} {mine['create_p50_ms']:>10.3f} {'n/a':>10} {'n/a':>10}")
    print(f"{'validate p50 (ms)':<34} {mine['validate_p50_ms']:>10.3f} {'n/a':>10} {'n/a':>10}")
    print("(the baseline has one shared state: no episodes to create, reset or validate)")

    ratio = mine["calls_per_s"] / base["calls_per_s"]
    legacy_ratio = mine["calls_per_s"] / legacy["calls_per_s"]
    verdicts = [
        (f"throughput {ratio:.1f}x the baseline", ratio >= 4.0, ">= 4x"),
        (f"throughput {legacy_ratio:.1f}x the baseline, handshake era", legacy_ratio >= 4.0, ">= 4x"),
        (f"sequential p50 {mine['p50_ms']:.3f} ms", mine["p50_ms"] <= 1.0, "<= 1 ms"),
        (f"idle RSS {mine['idle_rss_mb']:.1f} MB", mine["idle_rss_mb"] <= 45.0, "<= 45 MB"),
        (f"{args.episodes} episodes +{mine['rss_delta_mb']:.1f} MB", mine["rss_delta_mb"] <= 300.0, "<= +300 MB"),
    ]
    print()
    for text, ok, target in verdicts:
        print(f"{text:<48} target {target:<10} {'ok' if ok else 'MISSED'}")
    return 0 if all(ok for _, ok, _ in verdicts) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default=str(default_catalog() / "library_circulation"), help="bundle to serve (default: library_circulation)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each throughput run (default: 5)")
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
