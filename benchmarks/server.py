"""One environment served two ways, measured with the same raw HTTP client in one run.

- ours: ``envscaler serve`` (episodes, guards, trajectories, validator), tools at
  ``/episodes/{id}/mcp``;
- baseline: what a user would otherwise write, a plain ``mcp`` ``MCPServer`` with the same tools
  (bound methods of one shared instance: no episodes, no reset, no guards) at ``/mcp`` with the SDK's
  default settings (``server.run("streamable-http")``), under the same uvicorn (httptools + uvloop).

Both get the same modern (2026-07-28) ``tools/call`` requests from a minimal keep-alive HTTP/1.1
client, so client overhead is small and equal; the baseline is measured a second time inside an
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
from typing import Any

from envscaler import EnvRuntime, default_catalog, load_bundle

TOKEN = "bench-token"
CONCURRENCY = 16
LEGACY_VERSION = "2025-06-18"
META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}


class RawHttp:
    """One keep-alive HTTP/1.1 connection that sends JSON and reads Content-Length responses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host
        self.last_head = b""
        self.session: str | None = None

    @classmethod
    async def connect(cls, url: str) -> RawHttp:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, f"{host}:{port}")

    async def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        payload = json.dumps(body).encode() if body is not None else b""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}", f"Content-Length: {len(payload)}", "Content-Type: application/json"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        head = self.last_head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lowered = head.lower()
        for line in lowered.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                return status, await self.reader.readexactly(int(line.split(b":", 1)[1]))
        if b"transfer-encoding: chunked" in lowered:
            return status, await self._read_chunked()
        return status, b""  # 202 Accepted for a notification: no body

    async def _read_chunked(self) -> bytes:
        """A chunked body, as the SDK's SSE responses come (one event, then the stream ends)."""
        chunks = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return b"".join(chunks)
            chunks.append(chunk[:-2])

    def close(self) -> None:
        self.writer.close()


class Target:
    """A server under test: where its MCP endpoint is and how to call a tool there.

    With ``legacy`` set, every connection first runs the initialize handshake (2025-06-18) and
    calls inside its own MCP session, as clients that predate the sessionless protocol do.
    """

    def __init__(self, name: str, process: subprocess.Popen, url: str, mcp_path: str, legacy: bool = False) -> None:
        self.name, self.process, self.url, self.mcp_path, self.legacy = name, process, url, mcp_path, legacy

    async def connect(self) -> RawHttp:
        http = await RawHttp.connect(self.url)
        if self.legacy:
            await self._open_session(http)
        return http

    async def _open_session(self, http: RawHttp) -> None:
        headers = {"Accept": "application/json, text/event-stream"}
        body = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
                "params": {"protocolVersion": LEGACY_VERSION, "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}}
        status, raw = await http.request("POST", self.mcp_path, body, headers)
        for line in http.last_head.split(b"\r\n"):
            if line.lower().startswith(b"mcp-session-id:"):
                http.session = line.split(b":", 1)[1].strip().decode()
        if status != 200 or not http.session:
            raise RuntimeError(f"{self.name}: initialize failed ({status}): {raw[:300]!r}")
        headers.update({"Mcp-Session-Id": http.session, "MCP-Protocol-Version": LEGACY_VERSION})
        await http.request("POST", self.mcp_path, {"jsonrpc": "2.0", "method": "notifications/initialized"}, headers)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    async def call(self, http: RawHttp, name: str, arguments: dict, number: int) -> None:
        if http.session:
            body = {"jsonrpc": "2.0", "id": number, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
            headers = {"MCP-Protocol-Version": LEGACY_VERSION, "Mcp-Session-Id": http.session,
                       "Accept": "application/json, text/event-stream"}
        else:
            body = {"jsonrpc": "2.0", "id": number, "method": "tools/call", "params": {"name": name, "arguments": arguments, "_meta": META}}
            headers = {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": name,
                       "Accept": "application/json, text/event-stream"}
        status, raw = await http.request("POST", self.mcp_path, body, headers)
        if status != 200 or b'"isError":false' not in raw:
            raise RuntimeError(f"{self.name}: tool call failed ({status}): {raw[:300]!r}")

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


async def sequential(target: Target, tool: str, arguments: dict, calls: int) -> list[float]:
    http = await target.connect()
    latencies = []
    for number in range(calls):
        started = time.perf_counter()
        await target.call(http, tool, arguments, number)
        latencies.append((time.perf_counter() - started) * 1e3)
    http.close()
    return latencies


async def throughput(target: Target, tool: str, arguments: dict, seconds: float) -> float:
    connections = [await target.connect() for _ in range(CONCURRENCY)]
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(http: RawHttp) -> None:
        nonlocal done
        number = 0
        while time.perf_counter() < deadline:
            await target.call(http, tool, arguments, number)
            number += 1
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    elapsed = time.perf_counter() - started
    for c in connections:
        c.close()
    return done / elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(target: Target, tool: str, arguments: dict, seconds: float) -> dict[str, float]:
    idle = target.rss_mb()
    await sequential(target, tool, arguments, 200)  # warm-up
    latencies = await sequential(target, tool, arguments, 2000)
    rate = await throughput(target, tool, arguments, seconds)
    return {"calls_per_s": rate, "p50_ms": percentile(latencies, 0.5), "p99_ms": percentile(latencies, 0.99), "idle_rss_mb": idle}


async def episode_costs(target: Target, scenario_id: str, episodes: int) -> dict[str, float]:
    """RSS with ``episodes`` live episodes, and create / validate p50 on our server."""
    http = await RawHttp.connect(target.url)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = target.rss_mb()
    creates, ids = [], []
    for _ in range(episodes):
        started = time.perf_counter()
        status, raw = await http.request("POST", "/episodes", {"scenario_id": scenario_id}, auth)
        creates.append((time.perf_counter() - started) * 1e3)
        if status != 201:
            raise RuntimeError(f"episode creation failed ({status}): {raw[:200]!r}")
        ids.append(json.loads(raw)["episode_id"])
    loaded = target.rss_mb()
    validates = []
    for episode_id in ids[:300]:
        started = time.perf_counter()
        status, raw = await http.request("POST", f"/episodes/{episode_id}/validate", None, auth)
        validates.append((time.perf_counter() - started) * 1e3)
        if status != 200:
            raise RuntimeError(f"validate failed ({status}): {raw[:200]!r}")
    http.close()
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
        http = await RawHttp.connect(ready["url"])
        status, raw = await http.request("POST", "/episodes", {"scenario_id": scenario_id}, {"Authorization": f"Bearer {TOKEN}"})
        http.close()
        if status != 201:
            raise RuntimeError(f"episode creation failed ({status}): {raw[:200]!r}")
        ours = Target("ours", process, ready["url"], json.loads(raw)["mcp_path"])
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
