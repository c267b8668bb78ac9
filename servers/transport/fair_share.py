"""A fair share of one server process's event loop for each of the environments it serves.

A server process that serves several environments (``farm up --envs-per-server``) runs all their
requests on one event loop: a request's MCP handling, its worker's answer and the response are
callbacks there, run in the order they became ready. An agent that floods its environment from many
connections keeps as many requests in flight, and a neighbour's call waits behind all of their
callbacks at every step (on 2 cores, 64 connections took a bystander's p99 from 3 to 18 ms and its
calls/s to half; `benchmarks/neighbours.py`).

:class:`FairShare` bounds that. Alone, an environment runs as many requests at once as its clients
send. While another environment of the process is busy, each runs at most ``while_shared`` at once
(a request takes a :class:`Slot` to start); the rest wait, parsed, in their connections (what their
clients send next stays in the kernel's buffers) and start as their environment's slots come free.
A neighbour's call then waits behind a few of the flood's callbacks, not all of them, and the flood
costs the agent that sends it: an environment's own episodes share its slots.

- A slot is held for at most ``slot_s``: a request that runs longer is waiting for something (its
  worker, its checks, its episode's other calls), not running on the loop, and must not hold up its
  environment's other episodes.
- An environment counts as busy for ``recent_s`` after its last request ended: an agent that calls one
  step at a time has a gap between its calls, which must not let the whole flood back in.
- Health probes (``/healthz``) take no slot: a farm must not find a busy server hung.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable


class Slot:
    """One request's place at the loop; :meth:`Seat.give_back` it when the request ends."""

    __slots__ = ("taken", "counted")

    def __init__(self, taken: float) -> None:
        self.taken = taken
        self.counted = True  # it counts against its environment's share: not given back, not past slot_s


class Seat:
    """One environment's part of a :class:`FairShare`: its slots, and the requests waiting for one."""

    def __init__(self, share: FairShare) -> None:
        self.share = share
        self.running = 0  # slots that count
        self.last_ended = float("-inf")
        self.waiting: deque[Callable[[], None]] = deque()
        self._held: deque[Slot] = deque()  # in the order taken, each until it is past slot_s or given back and first
        self._timer: asyncio.TimerHandle | None = None

    def busy(self, now: float) -> bool:
        """Slots that count, requests waiting, or one that ended within ``recent_s``."""
        self.expire(now)
        return bool(self.running or self.waiting) or now - self.last_ended < self.share.recent_s

    def take(self, start_later: Callable[[], None]) -> Slot | None:
        """A slot for one request if it may start now; else None, and ``start_later`` is called once it may
        (it takes its slot then)."""
        now = time.monotonic()
        if self.share.may_start(self, now):
            slot = Slot(now)
            self._held.append(slot)
            self.running += 1
            return slot
        self.waiting.append(start_later)
        self.look_again(now)
        return None

    def look_again(self, now: float) -> None:
        """Requests wait, and nothing may end for a while (slow calls): start them when the oldest slot stops
        counting, at ``slot_s``."""
        if self._timer is None and self._held:
            delay = self._held[0].taken + self.share.slot_s - now
            self._timer = asyncio.get_running_loop().call_later(max(delay, 0.0), self._on_timer)

    def withdraw(self, start_later: Callable[[], None]) -> None:
        """The request ``start_later`` was to start is gone (its connection closed): forget it."""
        self.waiting.remove(start_later)

    def give_back(self, slot: Slot) -> None:
        """``slot``'s request ended."""
        self._uncount(slot)
        self.last_ended = time.monotonic()
        self.share.start_waiting()

    def expire(self, now: float) -> None:
        """Slots taken ``slot_s`` ago or more stop counting."""
        held, limit = self._held, self.share.slot_s
        while held and (not held[0].counted or now - held[0].taken >= limit):
            self._uncount(held.popleft())

    def _uncount(self, slot: Slot) -> None:
        if slot.counted:
            slot.counted = False
            self.running -= 1

    def _on_timer(self) -> None:
        self._timer = None
        self.share.start_waiting()


class FairShare:
    """Shared by the HTTP servers of one process's environments (see the module's doc)."""

    def __init__(self, while_shared: int = 2, slot_s: float = 0.01, recent_s: float = 0.5) -> None:
        if while_shared < 1:
            raise ValueError(f"while_shared must be at least 1, not {while_shared}")
        self.while_shared = while_shared
        self.slot_s = slot_s
        self.recent_s = recent_s
        self.seats: list[Seat] = []

    def seat(self) -> Seat:
        """The seat of one more environment of this process."""
        seat = Seat(self)
        self.seats.append(seat)
        return seat

    def may_start(self, seat: Seat, now: float) -> bool:
        """Whether ``seat``'s environment may start one more request now."""
        seat.expire(now)
        if seat.running < self.while_shared:
            return True
        return not any(other is not seat and other.busy(now) for other in self.seats)

    def start_waiting(self) -> None:
        """Start what waits, in every environment: a request's end may let its neighbours run more."""
        now = time.monotonic()
        for seat in self.seats:
            while seat.waiting and self.may_start(seat, now):
                seat.waiting.popleft()()
            if seat.waiting:
                seat.look_again(now)
