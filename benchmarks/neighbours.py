"""What one agent's flood costs the environments beside it: a server per environment, or 8 per server.

``envscaler farm up`` brings up a process farm of 8 copies of the bundled library_circulation twice: with
a server per environment (the default), and with ``--envs-per-server 8``, where the 8 share one server
process (each keeps its own worker, port, token and limits; the event loop is shared). A bystander agent
calls a read-only tool of environment 1 in a loop, one call at a time on one episode, straight to its
server; after ``--seconds`` a flooding agent, in a process of its own, calls the same tool of environment 0
from ``--flood`` connections at once (an episode each), as fast as it is answered, for ``--seconds`` more.

It prints, for each layout, the bystander's calls/s and p50/p99 latency alone and during the flood, and
the flood's calls/s. No target: it measures the price of ``--envs-per-server`` that the README states (one
agent's flood slows the other environments of its server, each of which keeps its fair share of the event
loop: ``servers/transport/fair_share.py``), on this machine's cores (with 2 cores, the flood's client and
servers also take CPU from the bystander in both layouts).

    python benchmarks/neighbours.py [--flood 64] [--seconds 5]
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import argument_parser, envscaler, percentile, read_only_call

from agent_client.remote import EnvControl, McpTools, new_http_client
from envscaler.wire import EnvEndpoint
from tests.support.farm import catalog_copies

ENVS = 8
BYSTANDER, FLOODED = "library_circulation_001", "library_circulation_000"


async def call_loop(endpoint: EnvEndpoint, env_id: str, scenario_id: str, tool: str, arguments: dict, until: float,
                    latencies: list[float] | None = None) -> int:
    """Call ``tool`` on a new episode of ``env_id`` one call at a time until ``until``; the number of calls."""
    async with new_http_client() as http:
        control = EnvControl(http, env_id, endpoint)
        created = await control.create(scenario_id)
        tools = McpTools(http, created.mcp_url)
        calls = 0
        try:
            while time.monotonic() < until:
                started = time.perf_counter()
                _, is_error = await tools.call(tool, arguments)
                if is_error:
                    raise SystemExit(f"{env_id}: {tool} answered with an error")
                if latencies is not None:
                    latencies.append(time.perf_counter() - started)
                calls += 1
        finally:
            await control.end(created.episode_id)
        return calls


async def flood(endpoint: EnvEndpoint, env_id: str, scenario_id: str, tool: str, arguments: dict, connections: int, seconds: float) -> int:
    """``connections`` call loops at once on ``env_id``, for ``seconds``; the calls made in all."""
    until = time.monotonic() + seconds
    counts = await asyncio.gather(*(call_loop(endpoint, env_id, scenario_id, tool, arguments, until) for _ in range(connections)))
    return sum(counts)


def bystander_phase(endpoint: EnvEndpoint, env_id: str, call: tuple[str, str, dict], seconds: float) -> list[float]:
    latencies: list[float] = []
    asyncio.run(call_loop(endpoint, env_id, *call, time.monotonic() + seconds, latencies))
    return latencies


def describe(latencies: list[float], seconds: float) -> str:
    return (f"{len(latencies) / seconds:6.0f} calls/s, p50 {percentile(latencies, 0.5) * 1e3:6.2f} ms, "
            f"p99 {percentile(latencies, 0.99) * 1e3:6.2f} ms")


def measure(root: Path, bundles: list[Path], per_server: int, connections: int, seconds: float) -> None:
    catalog = root / f"farm-{per_server}.json"
    envscaler("farm", "up", *map(str, bundles), "--backend", "process", "--envs-per-server", str(per_server), "--catalog", str(catalog))
    try:
        envs = {env_id: EnvEndpoint.model_validate(e) for env_id, e in json.loads(catalog.read_text())["envs"].items()}
        call = read_only_call(bundles[0])
        alone = bystander_phase(envs[BYSTANDER], BYSTANDER, call, seconds)
        flooder = subprocess.Popen([sys.executable, __file__, "--flood-worker", envs[FLOODED].model_dump_json(), json.dumps(call),
                                    str(connections), str(seconds + 1.0)], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # its episodes are made and its calls under way
        flooded = bystander_phase(envs[BYSTANDER], BYSTANDER, call, seconds)
        out, _ = flooder.communicate(timeout=seconds + 120)
        if flooder.returncode != 0:
            raise SystemExit(f"the flooding agent failed ({flooder.returncode})")
        layout = "a server per environment" if per_server == 1 else f"{per_server} environments per server"
        print(f"{layout}:")
        print(f"  bystander alone:          {describe(alone, seconds)}")
        print(f"  bystander during a flood: {describe(flooded, seconds)}")
        print(f"  the flood ({connections} connections on its neighbour): {int(out) / (seconds + 1.0):.0f} calls/s")
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))


def main() -> int:
    if sys.argv[1:2] == ["--flood-worker"]:
        endpoint, call, connections, seconds = sys.argv[2:]
        scenario_id, tool, arguments = json.loads(call)
        print(asyncio.run(flood(EnvEndpoint.model_validate_json(endpoint), FLOODED, scenario_id, tool, arguments,
                                int(connections), float(seconds))))
        return 0
    parser = argument_parser(__doc__)
    parser.add_argument("--flood", type=int, default=64, help="connections the flooding agent calls from at once (default: 64)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of each phase (default: 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="envscaler-neighbours-") as tmp:
        bundles = catalog_copies(Path(tmp) / "bundles", ENVS, of="library_circulation")
        for per_server in (1, ENVS):
            measure(Path(tmp), bundles, per_server, args.flood, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
