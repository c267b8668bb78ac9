"""Who may act on one episode now: one holder alone, or a pipeline of tool calls.

An episode's state is not thread-safe, so what reads or changes it runs alone: a validation, a state
read, a reset, a turn's end, and every tool call of a store that runs the calls itself. A store whose
calls run elsewhere, one at a time (the environment worker), lets concurrent tool calls of one episode
go out without waiting for each other's answers: they share the gate, and the worker runs them in
turn. Without that, 16 clients calling one episode at once would leave the worker idle while the
server handles each answer before it sends the next call.

The gate is taken in the order asked: a call asked after a validation waits for it, and the
validation waits for the calls before it. At most :data:`PIPELINE_DEPTH` calls of one episode are out
at once: one agent's flood waits here, in its own episode's queue, rather than in the worker that all
episodes share. After a fall of the worker (:meth:`EpisodeGate.hold_joins`), the calls that were out
are asked again before any new call joins them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType

PIPELINE_DEPTH = 16
"""How many tool calls of one episode may be out at once, at most."""


class EpisodeGate:
    """One episode's gate: :meth:`alone` for what runs by itself, :meth:`call` for a tool call."""

    __slots__ = ("_queue", "_alone", "_held", "in_flight")

    def __init__(self) -> None:
        # Who waits, in the order asked: (shares the gate, granted when set).
        self._queue: deque[tuple[bool, asyncio.Future[None]]] = deque()
        self._alone = False
        # No call joins those out until they have all been answered.
        self._held = False
        # Calls that share the gate now.
        self.in_flight = 0

    def busy(self) -> bool:
        """Whether anything holds the gate now."""
        return self._alone or self.in_flight > 0

    def hold_joins(self) -> None:
        """Let no call join the calls out now until they have all been answered (they are asked again)."""
        if self.in_flight:
            self._held = True

    def alone(self) -> _Holding:
        """``async with gate.alone():`` holds the gate alone for the body, once everything asked before has ended."""
        return _Holding(self, False)

    def call(self, shared: bool) -> _Holding:
        """``async with gate.call(shared):`` for a tool call: sharing the gate with the other calls out
        (``shared``: its store runs them in turn elsewhere), else alone."""
        return _Holding(self, shared)

    def _may(self, shared: bool) -> bool:
        if self._alone:
            return False
        if not shared:
            return not self.in_flight
        return not self.in_flight or (self.in_flight < PIPELINE_DEPTH and not self._held)

    async def _enter(self, shared: bool) -> None:
        if not self._queue and self._may(shared):
            self._grant(shared)
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((shared, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._leave(shared)  # let in, then given up before it ran
            else:
                self._wake()  # it may have kept those behind it waiting
            raise

    def _grant(self, shared: bool) -> None:
        if shared:
            self.in_flight += 1
        else:
            self._alone = True

    def _leave(self, shared: bool) -> None:
        if shared:
            self.in_flight -= 1
            if not self.in_flight:
                self._held = False
        else:
            self._alone = False
        self._wake()

    def _wake(self) -> None:
        """Let in those at the head of the queue who may come in now."""
        while self._queue:
            shared, granted = self._queue[0]
            if granted.done():  # given up while it waited
                self._queue.popleft()
                continue
            if not self._may(shared):
                return
            self._queue.popleft()
            self._grant(shared)
            granted.set_result(None)


class _Holding:
    """The gate held for an ``async with`` body (a class, not a generator: it is on every tool call's path)."""

    __slots__ = ("gate", "shared")

    def __init__(self, gate: EpisodeGate, shared: bool) -> None:
        self.gate = gate
        self.shared = shared

    async def __aenter__(self) -> None:
        await self.gate._enter(self.shared)

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.gate._leave(self.shared)
