"""What the OpenEnv protocol adds to a tool call: one server, the same tool, two ways, in one run.

``envscaler serve --openenv-port 0`` serves one environment; each round measures, back to back:

- mcp: a direct MCP ``tools/call`` on an episode (``/episodes/{id}/mcp``) from the harness's
  keep-alive HTTP client (``agent_client.http``);
- openenv: an OpenEnv ``step`` with a ``call_tool`` action on a WebSocket session (``/ws``) of the
  same server, from a raw ``websockets`` client, so that client-side parsing is as thin on both sides;
- openenv-client: the same step through openenv-core's own ``GenericEnvClient`` (for reference).

Sequential round trips give p50 and round trips/s for one client; 16 concurrent clients give
throughput. Rounds alternate between the ways, so a machine whose speed drifts moves both alike.

    python benchmarks/openenv_step.py [--env DIR] [--rounds 5] [--calls 400] [--seconds 1]

Target: the OpenEnv step's p50 at most 0.3 ms above the direct MCP call's. Exits 1 when missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import websockets
from openenv.core.generic_client import GenericEnvClient

from common import Verdict, argument_parser, percentile, read_only_call, report

from agent_client.http import LeanHttp
from agent_client.remote import EnvControl, McpTools
from envscaler import default_catalog
from envscaler.wire import EnvEndpoint
from tests.support.openenv_servers import serve_openenv

CONCURRENCY = 16
MAX_STEPS = 1_000_000_000  # no episode reaches the step limit during the benchmark
BAR_MS = 0.3

Call = Callable[[], Awaitable[None]]


class Way:
    """One way to call the tool: a factory of clients, each a ready-to-call coroutine function."""

    def __init__(self, name: str, open_client: Callable[[], Awaitable[tuple[Call, Callable[[], Awaitable[None]]]]]) -> None:
        self.name, self.open_client = name, open_client
        self.latencies: list[float] = []
        self.rates: list[float] = []


async def mcp_way(http: LeanHttp, endpoint: EnvEndpoint, scenario_id: str, tool: str, arguments: dict) -> Way:
    control = EnvControl(http, "bench", endpoint)

    async def open_client() -> tuple[Call, Callable[[], Awaitable[None]]]:
        created = await control.create(scenario_id)
        tools = McpTools(http, endpoint.url + created.mcp_path)

        async def call() -> None:
            text, is_error = await tools.call(tool, arguments)
            if is_error:
                raise RuntimeError(f"mcp: tool call failed: {text[:300]}")

        async def close() -> None:
            await control.end(created.episode_id)

        return call, close

    return Way("mcp", open_client)


def openenv_way(openenv_url: str, scenario_id: str, tool: str, arguments: dict) -> Way:
    async def open_client() -> tuple[Call, Callable[[], Awaitable[None]]]:
        socket = await websockets.connect(openenv_url.replace("http://", "ws://") + "/ws", max_size=None)
        await socket.send(json.dumps({"type": "reset", "data": {"scenario_id": scenario_id}}))
        json.loads(await socket.recv())
        step = json.dumps({"type": "step", "data": {"type": "call_tool", "tool_name": tool, "arguments": arguments}})

        async def call() -> None:
            await socket.send(step)
            answer = json.loads(await socket.recv())
            if answer.get("type") != "observation" or answer["data"]["observation"]["result"]["is_error"]:
                raise RuntimeError(f"openenv: step failed: {str(answer)[:300]}")

        return call, socket.close

    return Way("openenv", open_client)


def openenv_client_way(openenv_url: str, scenario_id: str, tool: str, arguments: dict) -> Way:
    async def open_client() -> tuple[Call, Callable[[], Awaitable[None]]]:
        client = GenericEnvClient(base_url=openenv_url)
        await client.reset(scenario_id=scenario_id)
        action = {"type": "call_tool", "tool_name": tool, "arguments": arguments}

        async def call() -> None:
            result = await client.step(action)
            if result.observation["result"]["is_error"]:
                raise RuntimeError(f"openenv-client: step failed: {result.observation}")

        return call, client.close

    return Way("openenv-client", open_client)


async def sequential(way: Way, calls: int) -> list[float]:
    call, close = await way.open_client()
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        latencies.append((time.perf_counter() - started) * 1e3)
    await close()
    return latencies


async def throughput(way: Way, seconds: float) -> float:
    clients = [await way.open_client() for _ in range(CONCURRENCY)]
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(call: Call) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await call()
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(call) for call, _ in clients))
    elapsed = time.perf_counter() - started
    for _, close in clients:
        await close()
    return done / elapsed


async def run(args: argparse.Namespace) -> int:
    scenario_id, tool, arguments = read_only_call(Path(args.env))
    print(f"environment {Path(args.env).name}, tool {tool}({json.dumps(arguments)}), one server, {CONCURRENCY} concurrent clients "
          "for throughput", flush=True)
    with serve_openenv([Path(args.env)], "--openenv-max-steps", str(MAX_STEPS)) as (server,):
        async with LeanHttp() as http:
            ways = [
                await mcp_way(http, EnvEndpoint(url=server.url, token=server.token), scenario_id, tool, arguments),
                openenv_way(server.openenv_url, scenario_id, tool, arguments),
                openenv_client_way(server.openenv_url, scenario_id, tool, arguments),
            ]
            for way in ways:
                await sequential(way, 200)  # warm-up
            for number in range(args.rounds):
                for way in ways:
                    way.latencies += await sequential(way, args.calls)
                    way.rates.append(await throughput(way, args.seconds))
                print(f"round {number + 1}/{args.rounds}: " + "  ".join(f"{w.name} {w.rates[-1]:,.0f}/s" for w in ways), flush=True)

    print(f"\n{'':38}" + "".join(f"{w.name:>16}" for w in ways))
    rows = [
        ("sequential p50 (ms)", [f"{statistics.median(w.latencies):.3f}" for w in ways]),
        ("sequential p99 (ms)", [f"{percentile(w.latencies, 0.99):.3f}" for w in ways]),
        ("sequential round trips/s", [f"{1e3 / statistics.mean(w.latencies):,.0f}" for w in ways]),
        (f"round trips/s, {CONCURRENCY} concurrent (median)", [f"{statistics.median(w.rates):,.0f}" for w in ways]),
    ]
    for label, values in rows:
        print(f"{label:38}" + "".join(f"{v:>16}" for v in values))
    mcp, openenv = ways[0], ways[1]
    added = statistics.median(openenv.latencies) - statistics.median(mcp.latencies)
    return report([Verdict("OpenEnv step p50 - direct MCP call p50", f"{added:+.3f} ms", f"<= +{BAR_MS} ms", added <= BAR_MS)])


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--env", default=str(default_catalog() / "library_circulation"), help="bundle to serve (default: library_circulation)")
    parser.add_argument("--rounds", type=int, default=5, help="measurement rounds, alternating between the ways (default: 5)")
    parser.add_argument("--calls", type=int, default=400, help="sequential calls per way and round (default: 400)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each throughput run in a round (default: 1)")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
