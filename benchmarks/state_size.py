"""Per-call cost against state size: one environment at ~10 KB and at ~1.3 MB of state per scenario.

Benchmark environments (retail, airline) hold about 1.3 MB of state per scenario; the catalog's hold
about 10 KB. Both sizes of the same generated shop environment (``tests/support/large_state.py``)
are served by ``envscaler serve`` side by side, and measured from a client over HTTP/MCP in
alternating rounds (a machine whose speed drifts moves both sides alike):

- no-op call (``ping``), state-changing call (``set_city``, a new city each time), episode create
  and validate (the scenario's checks read one user and one order), p50 each;
- memory per live episode: the growth of the server's memory (its workers' included) over ``--episodes`` live episodes that each changed
  one user, as a share of the scenario's state size.

    python benchmarks/state_size.py [--rounds 3] [--calls 300] [--episodes 300]

Targets (at the large size): no-op call <= 1.5x and validate <= 3x the small size's p50, memory
per live episode <= 10% of the state's size. Exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import META, Verdict, argument_parser, report, start, stop, tree_memory

from agent_client.http import LeanHttp
from tests.support.bundles import write_bundle
from tests.support.large_state import shop_spec, shop_scenario, state_size, users_for

TOKEN = "bench-token"
MODERN = "2026-07-28"
CHECKS = [
    {"check_item": "user_1 lives in Oslo",
     "check_func": "def check_func(final_state):\n    return final_state['users']['user_1']['address']['city'] == 'Oslo'"},
    {"check_item": "order #1-0 still pending",
     "check_func": "def check_func(final_state):\n    return final_state['users']['user_1']['orders'][0]['status'] == initial_state['users']['user_1']['orders'][0]['status']"},
]


class Server:
    """One ``envscaler serve`` process over a shop bundle of a given state size."""

    def __init__(self, label: str, root: Path, state_bytes: int) -> None:
        self.label = label
        scenario = {**shop_scenario(users_for(state_bytes)), "env_id": f"shop_{label}", "checklist_with_func": CHECKS}
        bundle = write_bundle(root, shop_spec(f"shop_{label}"), [scenario])
        env = {**os.environ, "ENVSCALER_TOKEN": TOKEN}
        command = [sys.executable, "-m", "servers.cli", str(bundle), "--port", "0", "--log-level", "warning",
                   "--max-episodes", "100000"]
        self.process, ready = start(command, env)
        self.url = ready["url"]
        self.scenario_id = scenario["task_id"]
        self.state_bytes = 0
        self.times: dict[str, list[float]] = {"no-op call": [], "state-changing call": [], "create": [], "validate": []}

    def memory_mb(self) -> float:
        """Proportional memory of the server and its workers (where the episodes live)."""
        return tree_memory(self.process.pid).pss

    async def control(self, http: LeanHttp, method: str, path: str, body: dict | None = None) -> dict:
        response = await http.request(method, self.url + path, body, {"Authorization": f"Bearer {TOKEN}"})
        if response.status >= 300:
            raise SystemExit(f"{self.label}: {method} {path} -> {response.status}: {response.body[:300]!r}")
        return response.json()

    async def call(self, http: LeanHttp, mcp_path: str, name: str, arguments: dict) -> None:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments, "_meta": META}}
        headers = {"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call", "Mcp-Name": name}
        response = await http.request("POST", self.url + mcp_path, body, headers)
        if response.status != 200 or b'"isError":false' not in response.body:
            raise SystemExit(f"{self.label}: {name} failed ({response.status}): {response.body[:300]!r}")

    async def round(self, http: LeanHttp, calls: int) -> None:
        """One round of every measurement."""
        created = []
        for _ in range(calls // 3):
            started = time.perf_counter()
            created.append(await self.control(http, "POST", "/episodes", {"scenario_id": self.scenario_id}))
            self.times["create"].append(time.perf_counter() - started)
        episode = created[0]
        for _ in range(calls):
            started = time.perf_counter()
            await self.call(http, episode["mcp_path"], "ping", {})
            self.times["no-op call"].append(time.perf_counter() - started)
        for number in range(calls):
            started = time.perf_counter()
            await self.call(http, episode["mcp_path"], "set_city", {"user_id": "user_1", "city": f"City {number}"})
            self.times["state-changing call"].append(time.perf_counter() - started)
        for live in created:
            await self.call(http, live["mcp_path"], "set_city", {"user_id": "user_1", "city": "Oslo"})
            started = time.perf_counter()
            await self.control(http, "POST", f"/episodes/{live['episode_id']}/validate")
            self.times["validate"].append(time.perf_counter() - started)
        for live in created:
            await self.control(http, "DELETE", f"/episodes/{live['episode_id']}")

    async def memory_per_episode(self, http: LeanHttp, episodes: int) -> float:
        """Bytes of memory per live episode that changed one user."""
        before = self.memory_mb()
        for _ in range(episodes):
            live = await self.control(http, "POST", "/episodes", {"scenario_id": self.scenario_id})
            await self.call(http, live["mcp_path"], "set_city", {"user_id": "user_1", "city": "Oslo"})
            await self.call(http, live["mcp_path"], "get_order", {"user_id": "user_2", "order_id": "#2-0"})
        return (self.memory_mb() - before) * 1024 * 1024 / episodes


def p50_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


async def run(args: argparse.Namespace) -> int:
    servers: list[Server] = []
    with tempfile.TemporaryDirectory() as root:
        try:
            servers = [Server("small", Path(root), 10_000), Server("large", Path(root), 1_300_000)]
            async with LeanHttp() as http:
                for server in servers:
                    live = await server.control(http, "POST", "/episodes", {"scenario_id": server.scenario_id})
                    server.state_bytes = state_size((await server.control(http, "GET", f"/episodes/{live['episode_id']}/state"))["state"])
                    await server.control(http, "DELETE", f"/episodes/{live['episode_id']}")
                    await server.round(http, 60)  # warm-up
                    for times in server.times.values():
                        times.clear()
                for number in range(args.rounds):
                    for server in servers:
                        await server.round(http, args.calls)
                    print(f"round {number + 1}/{args.rounds} done", flush=True)
                memory = {s.label: await s.memory_per_episode(http, args.episodes) for s in servers}
        finally:
            # The whole group: a sandboxed server's bubblewrap ignores SIGTERM sent to it alone.
            for server in servers:
                stop(server.process)

    small, large = servers
    print(f"\nstate per scenario: small {small.state_bytes / 1e3:,.1f} KB, large {large.state_bytes / 1e6:,.2f} MB")
    print(f"{'p50 (ms)':<22} {'small':>9} {'large':>9} {'ratio':>7}")
    ratios = {}
    for name in small.times:
        a, b = p50_ms(small.times[name]), p50_ms(large.times[name])
        ratios[name] = b / a
        print(f"{name:<22} {a:>9.3f} {b:>9.3f} {b / a:>6.2f}x")
    share = {label: memory[label] / s.state_bytes for label, s in zip(memory, servers)}
    print(f"{'memory per episode':<22} {memory['small'] / 1e3:>7.1f}KB {memory['large'] / 1e3:>7.1f}KB"
          f"   ({100 * share['large']:.1f}% of the large state)")
    return report([
        Verdict("no-op call p50, large vs small", f"{ratios['no-op call']:.2f}x", "<= 1.5x", ratios["no-op call"] <= 1.5),
        Verdict("validate p50, large vs small", f"{ratios['validate']:.2f}x", "<= 3x", ratios["validate"] <= 3.0),
        Verdict("memory per episode, share of the large state", f"{100 * share['large']:.1f}%", "<= 10%", share["large"] <= 0.10),
    ])


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="measurement rounds, alternating between the sizes (default: 3)")
    parser.add_argument("--calls", type=int, default=300, help="calls of each kind per round (default: 300)")
    parser.add_argument("--episodes", type=int, default=300, help="live episodes for the memory measurement (default: 300)")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
