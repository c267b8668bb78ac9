"""What each trainer adapter adds to a tool call: one server, one tool, a direct MCP call against each adapter's step.

``envscaler serve`` serves the test lamp; each round measures, back to back, the median time of:

- mcp: a direct MCP ``tools/call`` on an episode (``agent_client.remote.McpTools``), on the adapters'
  background loop, called from the main thread as the synchronous adapters are;
- skyrl: ``FarmTextEnv.step`` with the same call written as a Hermes ``<tool_call>`` in the model's text;
- gem: ``FarmGemEnv.step`` with the same text;
- verl: ``FarmAgentLoop._call_tool`` with verl's parsed ``FunctionCall``, on the loop's own event loop.

The adapters' per-step overhead is their median minus the direct call's (same run, same server).

    python benchmarks/training_step.py [--calls 400] [--rounds 3]

Target: under 1 ms per step for every adapter. Exits 1 when missed.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import Verdict, argument_parser, report

from agent_client.remote import McpTools  # noqa: E402
from agent_client.training.session import Background, FarmEpisode, loop_http  # noqa: E402
from envscaler.wire import EnvEndpoint, FarmCatalog  # noqa: E402
from tests.support.bundles import write_bundle  # noqa: E402
from tests.support.server import serve  # noqa: E402
from tests.support.training import LAMP_SPEC, lamp_scenario  # noqa: E402

CALL = '<tool_call>{"name": "dim", "arguments": {"level": 3}}</tool_call>'


def median_ms(step: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--calls", type=int, default=400, help="calls per way and round (default: 400)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the ways alternating within each (default: 3)")
    args = parser.parse_args()
    from agent_client.training.gem import FarmGemEnv
    from agent_client.training.skyrl import FarmTextEnv
    from agent_client.training.verl import FarmAgentLoop
    from verl.experimental.agent_loop.tool_parser import FunctionCall

    with tempfile.TemporaryDirectory() as root, serve(write_bundle(Path(root), LAMP_SPEC, [lamp_scenario("lamp_dark", False)])) as server:
        catalog = FarmCatalog(envs={"lamp": EnvEndpoint(url=server.url, token=server.token)})
        catalog_file = Path(root) / "farm.json"
        catalog_file.write_text(catalog.model_dump_json())
        skyrl = FarmTextEnv({"catalog": str(catalog_file)}, {"env_id": "lamp", "scenario_id": "lamp_dark"})
        skyrl.init([])
        gem = FarmGemEnv(scenarios=["lamp/lamp_dark"], catalog=str(catalog_file))
        gem.reset()
        direct = McpTools(Background.http(), gem.episode.created.mcp_url)

        # verl's loop runs on its worker's event loop: measured there, with the call its parser hands over.
        verl_loop = FarmAgentLoop.__new__(FarmAgentLoop)
        # What the loop reads of verl's multi_turn config on a call (results here are far below the limit).
        verl_loop.max_tool_response_length, verl_loop.tool_response_truncate_side = 4096, "middle"
        event_loop = asyncio.new_event_loop()

        async def open_verl() -> None:
            verl_loop.episode = await FarmEpisode.open(gem.farm, loop_http(), "lamp", "lamp_dark")

        event_loop.run_until_complete(open_verl())
        call = FunctionCall(name="dim", arguments='{"level": 3}')

        def verl_step() -> None:
            event_loop.run_until_complete(verl_loop._call_tool(call, {}, None))

        ways = {
            "mcp": lambda: Background.run(direct.call("dim", {"level": 3})),
            "skyrl": lambda: skyrl.step(CALL),
            "gem": lambda: gem.step(CALL),
            "verl": verl_step,
        }
        results: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, step in ways.items():
                results[name].append(median_ms(step, args.calls))
        event_loop.run_until_complete(verl_loop.episode.end())
        skyrl.close()
        gem.close()
    base = statistics.median(results["mcp"])
    print(f"mcp (direct call): p50 {base:.3f} ms")
    verdicts = []
    for name in ("skyrl", "gem", "verl"):
        p50 = statistics.median(results[name])
        print(f"{name}: p50 {p50:.3f} ms, overhead {p50 - base:+.3f} ms per step")
        verdicts.append(Verdict(f"{name}: overhead per step over a direct MCP call", f"{p50 - base:+.3f} ms", "< 1 ms", p50 - base < 1.0))
    return report(verdicts)


if __name__ == "__main__":
    sys.exit(main())
