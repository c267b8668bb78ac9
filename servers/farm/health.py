"""Finding servers that are alive but hung: cheap probes spread evenly over time.

A dead server is seen by its backend at once (its process exit, or Docker's die event); a server
that is alive but stuck (an infinite loop on the event loop, SIGSTOP) answers nothing. The prober
asks the servers for ``/healthz`` a few at a time, once a second, so each one is asked every
``period_s``; the period stretches with the farm's size so that the daemon never sends more than
``_MAX_PROBES_PER_S`` probes a second: an idle farm of 1,000 costs the daemon the same as one of 200.
A probe is a bare request on a non-blocking socket (no name lookup, no thread hop). A server that
misses ``misses_allowed`` probes in a row is killed through its backend, which restarts it and
reports why.

A probe's timeout counts the server's own time (``envscaler.own_time``) where its process is on this
machine: what it, or the daemon, waited for a CPU does not count. A server starved of CPU by a busy
machine is slow, not hung, and a restart would lose its episodes for nothing; a server stopped, or stuck
in a loop or a system call, still misses its probes in time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

import anyio

from envscaler.own_time import CpuReading, OwnTimeLimit, process_reading, thread_reading
from servers.farm.board import Board
from servers.farm.models import EnvStatus

log = logging.getLogger("envscaler.farm")

DEFAULT_PERIOD_S = 10.0
# What an automatic period allows: under 1% of a core at a few tenths of a millisecond per probe (the
# idle daemon's target is 2% at 1,000 environments; 50 a second cost it 5.3%).
_MAX_PROBES_PER_S = 20.0
# How often the prober wakes: each time, it sends the probes due since the last time.
_TICK_S = 1.0
# At most this many probes in flight: with every server hung, the daemon still does a bounded amount.
_MAX_IN_FLIGHT = 32
_PROBE_STATUSES = ("healthy", "unhealthy")


class _Cutoff:
    """Cancels ``scope`` once every one of ``limits`` is reached, looking only when one may be (a timer on
    the running loop); with none, at ``timeout_s``."""

    def __init__(self, limits: list[OwnTimeLimit], timeout_s: float, scope: anyio.CancelScope) -> None:
        self.limits = limits
        self.scope = scope
        self.loop = asyncio.get_running_loop()
        self.timer = self._arm(limits, time.monotonic() + timeout_s)

    def _arm(self, left: list[OwnTimeLimit], otherwise: float) -> asyncio.TimerHandle:
        when = min((limit.next_check() for limit in left), default=otherwise)
        return self.loop.call_later(max(0.0, when - time.monotonic()), self._check)

    def _check(self) -> None:
        left = [limit for limit in self.limits if not limit.reached()]
        if not left:
            self.scope.cancel()
            return
        self.timer = self._arm(left, time.monotonic())


async def answers_healthz(url: str, timeout_s: float, tasks: Sequence[Callable[[], CpuReading]] = ()) -> bool:
    """Whether the server at ``url`` answers ``GET /healthz`` with 200 within ``timeout_s``: wall-clock
    time less what each of ``tasks`` (the server's process, the caller's thread, read by
    ``envscaler.own_time``) waited for a CPU meanwhile, whichever waited most.

    A bare HTTP/1.1 request on a fresh non-blocking socket, straight on the event loop (an address is
    connected to without a name lookup in a thread): a fraction of a full client's cost per probe.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()
    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as scope, socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        cutoff = _Cutoff([OwnTimeLimit(timeout_s, task) for task in tasks], timeout_s, scope)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
            await loop.sock_sendall(sock, request)
            status_line = b""
            while b"\r\n" not in status_line and len(status_line) < 64:
                chunk = await loop.sock_recv(sock, 64)
                if not chunk:
                    return False
                status_line += chunk
            return status_line.split(b" ", 2)[1:2] == [b"200"]
        except OSError:
            return False
        finally:
            cutoff.timer.cancel()
    return False


def probe_period(configured_s: float | None, servers: int) -> float:
    """Seconds between two probes of the same server: ``configured_s``, or by default 10 s, stretched so
    that the whole farm needs at most 20 probes a second."""
    if configured_s is not None:
        return configured_s
    return max(DEFAULT_PERIOD_S, servers / _MAX_PROBES_PER_S)


Kill = Callable[[str, str], Awaitable[None]]


class Prober:
    """Probes the farm's listening servers one at a time; kills the ones that stopped answering.

    ``servers_here``: the servers' pids (``EnvStatus.pid``) are processes of this machine, whose waits for
    a CPU a probe's timeout leaves out; elsewhere only the daemon's own waits are left out."""

    def __init__(self, board: Board, kill: Kill, *, period_s: float | None, timeout_s: float, misses_allowed: int,
                 servers_here: bool = False) -> None:
        self.board = board
        self.kill = kill
        self.period_s = probe_period(period_s, len(board.state.envs))
        self.timeout_s = timeout_s
        self.misses_allowed = misses_allowed
        self.servers_here = servers_here
        # The thread the probes run on: the event loop's.
        self._thread = threading.get_native_id()
        # env_id -> (its restart count when the misses began, misses in a row): a restart starts over.
        self._misses: dict[str, tuple[int, int]] = {}
        self._in_flight = anyio.CapacityLimiter(_MAX_IN_FLIGHT)

    async def run(self) -> None:
        """Probe forever: every server once per ``period_s``, the probes due sent together once a second
        (one wake-up a second, not one per probe)."""
        env_ids = list(self.board.state.envs)
        if not env_ids:
            return
        tick_s = min(_TICK_S, self.period_s)
        per_tick = len(env_ids) * tick_s / self.period_s
        due = 0.0
        turn = 0
        async with anyio.create_task_group() as tasks:
            while True:
                await anyio.sleep(tick_s)
                due += per_tick
                while due >= 1.0:
                    due -= 1.0
                    env_id = env_ids[turn]
                    turn = (turn + 1) % len(env_ids)
                    # A full limiter means many probes are waiting on hung servers: skip rather than pile up.
                    if self.board.env(env_id).status in _PROBE_STATUSES and self._in_flight.available_tokens:
                        tasks.start_soon(self._probe, env_id)

    def _tasks(self, record: EnvStatus) -> list[Callable[[], CpuReading]]:
        """Whose waits for a CPU a probe of ``record``'s server leaves out: the daemon's, and the server's when here."""
        tasks = [functools.partial(thread_reading, self._thread)]
        if self.servers_here and record.pid is not None:
            tasks.append(functools.partial(process_reading, record.pid))
        return tasks

    async def _probe(self, env_id: str) -> None:
        async with self._in_flight:
            record = self.board.env(env_id)
            generation = record.restarts
            healthy = await answers_healthz(record.address or record.url, self.timeout_s, self._tasks(record))
        record = self.board.env(env_id)
        if record.restarts != generation or record.status not in _PROBE_STATUSES:
            return  # it died or restarted meanwhile: this answer is about a server that is gone
        if healthy:
            self._misses.pop(env_id, None)
            if record.status != "healthy":
                self.board.update(env_id, status="healthy")
            return
        since, misses = self._misses.get(env_id, (generation, 0))
        misses = (misses if since == generation else 0) + 1
        if record.status == "healthy":
            self.board.update(env_id, status="unhealthy")
        if misses < self.misses_allowed:
            self._misses[env_id] = (generation, misses)
            return
        self._misses.pop(env_id, None)
        await self.kill(env_id, f"hung: no answer to {misses} health probes in a row")
