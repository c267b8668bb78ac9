"""The farm's gateway against a direct call: the same server, the same client, alternating in one run.

``envscaler farm up`` brings up a one-environment process farm (library_circulation by default). One
episode is created, and its read-only reference tool call is made two ways, with the harness's
keep-alive HTTP/1.1 client (``agent_client.http``):

- direct: to the environment server's own URL (``/episodes/{id}/mcp``);
- gateway: to the farm's one URL (``/envs/{env_id}/episodes/{id}/mcp``): haproxy in front of the
  daemon's Python gateway when haproxy is installed (``servers.farm.gateway.front``), else the Python gateway.

Each round measures sequential latencies, then throughput with 16 concurrent clients, for one target
and then the other, so that a shared machine whose speed drifts moves both sides alike. The ratio is
the median of the per-round ratios, the added p50 the median of the per-round p50 differences. CPU per
call of the gateway (the daemon and haproxy) and of the server is read from /proc.

    python benchmarks/gateway.py [--env DIR] [--rounds 7] [--seconds 1] [--gateway python]

Targets: gateway throughput >= 0.8x direct, added sequential p50 <= 0.2 ms. Exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import META, Verdict, argument_parser, cpu_seconds, envscaler, percentile, read_only_call, report

from agent_client.http import LeanHttp
from envscaler import default_catalog
from envscaler.wire import FarmCatalog
from servers.farm.gateway.front import GATEWAY_VARIABLE
from servers.farm.teardown import farm_processes

CONCURRENCY = 16
SEQUENTIAL_CALLS = 400
RATIO_TARGET = 0.8
ADDED_P50_TARGET_MS = 0.2
HEADERS = {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Accept": "application/json, text/event-stream"}


def haproxy_pids(farm_id: str) -> list[int]:
    """The farm's haproxy processes (none when the Python gateway serves alone)."""
    pids = []
    for pid in farm_processes(farm_id):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if cmdline.read().split(b"\0")[0].endswith(b"haproxy"):
                pids.append(pid)
    return pids


class Target:
    """One way to reach the tool: its MCP URL, and the process whose CPU per call is reported."""

    def __init__(self, name: str, url: str, pids: list[int]) -> None:
        self.name, self.url, self.pids = name, url, pids
        self.rates: list[float] = []
        self.p50s: list[float] = []
        self.latencies: list[float] = []
        self.cpu_s = 0.0
        self.calls = 0

    async def call(self, http: LeanHttp, token: str, tool: str, arguments: dict, number: int) -> None:
        body = {"jsonrpc": "2.0", "id": number, "method": "tools/call", "params": {"name": tool, "arguments": arguments, "_meta": META}}
        response = await http.request("POST", self.url, body, {**HEADERS, "Mcp-Name": tool, "Authorization": f"Bearer {token}"})
        if response.status != 200 or b'"isError":false' not in response.body:
            raise RuntimeError(f"{self.name}: tool call failed ({response.status}): {response.body[:300]!r}")


async def sequential(target: Target, http: LeanHttp, token: str, tool: str, arguments: dict, calls: int) -> list[float]:
    latencies = []
    for number in range(calls):
        started = time.perf_counter()
        await target.call(http, token, tool, arguments, number)
        latencies.append((time.perf_counter() - started) * 1e3)
    return latencies


async def throughput(target: Target, http: LeanHttp, token: str, tool: str, arguments: dict, seconds: float) -> float:
    """Calls/s with CONCURRENCY clients for ``seconds``; adds the CPU time of ``target.pids`` to it."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        number = 0
        while time.perf_counter() < deadline:
            await target.call(http, token, tool, arguments, number)
            number += 1
            done += 1

    cpu_before = cpu_seconds(target.pids)
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    elapsed = time.perf_counter() - started
    target.cpu_s += cpu_seconds(target.pids) - cpu_before
    target.calls += done
    return done / elapsed


async def measure(direct: Target, gateway: Target, token: str, tool: str, arguments: dict, rounds: int, seconds: float) -> None:
    async with LeanHttp() as http:
        for target in (direct, gateway):
            await sequential(target, http, token, tool, arguments, 300)  # warm-up
        for number in range(rounds):
            # Which side goes first alternates too: neither always runs on a machine just warmed by the other.
            for target in (direct, gateway) if number % 2 == 0 else (gateway, direct):
                latencies = await sequential(target, http, token, tool, arguments, SEQUENTIAL_CALLS)
                target.latencies += latencies
                target.p50s.append(statistics.median(latencies))
                target.rates.append(await throughput(target, http, token, tool, arguments, seconds))
            print(f"round {number + 1}/{rounds}: direct {direct.rates[-1]:,.0f}/s p50 {direct.p50s[-1]:.3f} ms   "
                  f"gateway {gateway.rates[-1]:,.0f}/s p50 {gateway.p50s[-1]:.3f} ms", flush=True)


async def run(args: argparse.Namespace) -> int:
    env_dir = Path(args.env)
    scenario_id, tool, arguments = read_only_call(env_dir)
    print(f"environment {env_dir.name}, tool {tool}({json.dumps(arguments)}), {CONCURRENCY} concurrent clients, "
          f"{args.rounds} rounds of {args.seconds:g} s per target, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as scratch:
        root = Path(scratch) / "envs"
        shutil.copytree(env_dir, root / env_dir.name)
        catalog_path = Path(scratch) / "farm.json"
        gateway_choice = {**os.environ, GATEWAY_VARIABLE: args.gateway} if args.gateway else None
        envscaler("farm", "up", str(root), "--backend", "process", "--catalog", str(catalog_path), "--timeout", "120", env=gateway_choice)
        try:
            catalog = FarmCatalog.model_validate_json(catalog_path.read_text())
            state = json.loads((Path(scratch) / "farm.json.farm" / "state.json").read_text())
            env_id, endpoint = next(iter(catalog.envs.items()))
            print(f"the farm's gateway: {state.get('gateway_proxy') or 'python'}", flush=True)
            # haproxy's worker is the master's child: the gateway's CPU is the daemon's, or both haproxies'.
            gateway_pids = [state["daemon_pid"], *haproxy_pids(state["farm_id"])]
            async with LeanHttp() as http:
                response = await http.request("POST", endpoint.url + "/episodes", {"scenario_id": scenario_id},
                                              {"Authorization": f"Bearer {endpoint.token}"})
                if response.status != 201:
                    raise RuntimeError(f"creating an episode failed ({response.status}): {response.body[:300]!r}")
                mcp_path = response.json()["mcp_path"]
            direct = Target("direct", endpoint.url + mcp_path, [state["envs"][env_id]["pid"]])
            gateway = Target("gateway", f"{catalog.gateway}/envs/{env_id}{mcp_path}", gateway_pids)
            await measure(direct, gateway, endpoint.token, tool, arguments, args.rounds, args.seconds)
            server_cpu_us = 1e6 * direct.cpu_s / direct.calls
        finally:
            envscaler("farm", "down", "--catalog", str(catalog_path))

    ratios = [g / d for g, d in zip(gateway.rates, direct.rates)]
    added = [g - d for g, d in zip(gateway.p50s, direct.p50s)]
    ratio, added_p50 = statistics.median(ratios), statistics.median(added)
    print()
    print(f"{'':<38} {'direct':>10} {'gateway':>10}")
    print(f"{'tool calls/s, 16 concurrent (median)':<38} {statistics.median(direct.rates):>10,.0f} {statistics.median(gateway.rates):>10,.0f}")
    print(f"{'sequential p50 (ms)':<38} {percentile(direct.latencies, 0.5):>10.3f} {percentile(gateway.latencies, 0.5):>10.3f}")
    print(f"{'sequential p99 (ms)':<38} {percentile(direct.latencies, 0.99):>10.3f} {percentile(gateway.latencies, 0.99):>10.3f}")
    print(f"{'CPU per call (us): server / gateway':<38} {server_cpu_us:>10.0f} {1e6 * gateway.cpu_s / gateway.calls:>10.0f}")
    print(f"\nper-round throughput ratios: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"added p50 per round (ms): {', '.join(f'{a:.3f}' for a in added)}")
    return report([
        Verdict("gateway throughput vs direct", f"{ratio:.2f}x", f">= {RATIO_TARGET}x", ratio >= RATIO_TARGET),
        Verdict("gateway's addition to sequential p50", f"{added_p50:+.3f} ms", f"<= {ADDED_P50_TARGET_MS} ms", added_p50 <= ADDED_P50_TARGET_MS),
    ])


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--env", default=str(default_catalog() / "library_circulation"), help="bundle to serve (default: library_circulation)")
    parser.add_argument("--rounds", type=int, default=7, help="measurement rounds, alternating between the targets (default: 7)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each throughput run in a round (default: 1)")
    parser.add_argument("--gateway", choices=["python"], help="measure the Python gateway alone (no haproxy in front, as without haproxy installed)")
    args = parser.parse_args()
    import uvloop

    return uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
