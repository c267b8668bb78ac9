"""``servers.episodes.gate``: one episode's gate, taken in the order asked.

Tool calls of a store that pipelines share it (up to ``PIPELINE_DEPTH`` at once); everything else holds
it alone, once all asked before have ended; after a worker's fall, no call joins those out until they
have ended. A waiter that gives up holds up no one.
"""

from __future__ import annotations

import asyncio

from servers.episodes.gate import PIPELINE_DEPTH, EpisodeGate


class Trace:
    """Enters the gate as asked and records who is inside when."""

    def __init__(self, gate: EpisodeGate) -> None:
        self.gate = gate
        self.entered: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    def start(self, name: str, kind: str) -> asyncio.Task[None]:
        """``kind``: "shared" (a pipelined call), "call" (a call that runs alone) or "alone"."""
        self.release[name] = asyncio.Event()

        async def body() -> None:
            holder = self.gate.alone() if kind == "alone" else self.gate.call(kind == "shared")
            async with holder:
                self.entered.append(name)
                await self.release[name].wait()

        return asyncio.ensure_future(body())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_pipelined_calls_share_the_gate_up_to_the_depth_and_the_next_waits_for_a_place():
    async def scenario() -> None:
        gate = EpisodeGate()
        trace = Trace(gate)
        tasks = [trace.start(f"c{number}", "shared") for number in range(PIPELINE_DEPTH + 1)]
        await settle()
        assert gate.in_flight == PIPELINE_DEPTH and trace.entered == [f"c{number}" for number in range(PIPELINE_DEPTH)]
        trace.release["c3"].set()
        await settle()
        assert trace.entered[-1] == f"c{PIPELINE_DEPTH}" and gate.in_flight == PIPELINE_DEPTH
        for event in trace.release.values():
            event.set()
        await asyncio.gather(*tasks)
        assert gate.in_flight == 0 and not gate.busy()

    asyncio.run(scenario())


def test_calls_that_do_not_pipeline_run_one_at_a_time():
    async def scenario() -> None:
        gate = EpisodeGate()
        trace = Trace(gate)
        tasks = [trace.start(name, "call") for name in ("a", "b")]
        await settle()
        assert trace.entered == ["a"]
        trace.release["a"].set()
        await settle()
        assert trace.entered == ["a", "b"]
        trace.release["b"].set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_what_runs_alone_waits_for_the_calls_before_it_and_no_call_asked_after_overtakes_it():
    async def scenario() -> None:
        gate = EpisodeGate()
        trace = Trace(gate)
        tasks = [trace.start("c1", "shared"), trace.start("c2", "shared")]
        await settle()
        tasks.append(trace.start("validation", "alone"))
        await settle()
        tasks.append(trace.start("c3", "shared"))
        await settle()
        assert trace.entered == ["c1", "c2"]
        trace.release["c1"].set()
        await settle()
        assert trace.entered == ["c1", "c2"]
        trace.release["c2"].set()
        await settle()
        assert trace.entered == ["c1", "c2", "validation"]
        trace.release["validation"].set()
        await settle()
        assert trace.entered[-1] == "c3"
        trace.release["c3"].set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_after_a_fall_no_call_joins_those_out_until_they_have_all_ended():
    async def scenario() -> None:
        gate = EpisodeGate()
        trace = Trace(gate)
        tasks = [trace.start("c1", "shared"), trace.start("c2", "shared")]
        await settle()
        gate.hold_joins()
        tasks.append(trace.start("late", "shared"))
        await settle()
        trace.release["c1"].set()
        await settle()
        assert trace.entered == ["c1", "c2"]
        trace.release["c2"].set()
        await settle()
        # Once they have ended, calls share the gate again.
        tasks.append(trace.start("later", "shared"))
        await settle()
        assert trace.entered == ["c1", "c2", "late", "later"]
        for event in trace.release.values():
            event.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_a_waiter_that_gives_up_holds_up_no_one():
    async def scenario() -> None:
        gate = EpisodeGate()
        trace = Trace(gate)
        first = trace.start("c1", "shared")
        await settle()
        alone = trace.start("validation", "alone")
        await settle()
        behind = trace.start("c2", "shared")
        await settle()
        assert trace.entered == ["c1"]
        # The validation's caller gives up while it waits: the call behind it joins the one out at once.
        alone.cancel()
        await settle()
        assert trace.entered == ["c1", "c2"] and gate.in_flight == 2
        trace.release["c1"].set()
        trace.release["c2"].set()
        await asyncio.gather(first, behind)
        # Let in, then given up before it ran: its place is given back.
        async with gate.alone():
            waiter = trace.start("w", "alone")
            await settle()
        waiter.cancel()
        await settle()
        assert waiter.cancelled() and "w" not in trace.entered and not gate.busy()

    asyncio.run(scenario())
