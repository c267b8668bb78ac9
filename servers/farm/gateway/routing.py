"""Replica-aware routes for the farm's gateway: sticky episodes without shared state.

An environment may run as several replicas (Swarm tasks, Kubernetes pods), each holding its episodes
in its own memory. Every gateway replica finds an environment's replicas by itself: ``discover``
gives their addresses (by default DNS, ``tasks.<service>``: one address per running task) and each
replica's ``/healthz`` gives its replica id and live episode count, polled every ``poll_s``. Then:

- a request about an episode goes to the replica that its id names (``servers.episodes.ids``), so any
  gateway replica routes it, and the gateways share nothing;
- creating an episode goes to the replica with the fewest live episodes (as last reported, plus the
  ones this gateway created since); a replica that cannot be connected to is skipped;
- other control requests (scenarios, info) go to the least-loaded replica too;
- a request about an episode whose replica is gone (stopped, rescheduled, its node dead) is answered
  410 with an error that says so: the episode is lost and must never be scored. Requests waiting on a
  replica when it is found gone are cut short with the same answer.
"""

from __future__ import annotations

import logging
import random
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import anyio
import httpx
from pydantic import ValidationError

from envscaler.wire import Health
from servers.episodes.ids import replica_of
from servers.farm.gateway.upstream import UpstreamConnectError, UpstreamError, UpstreamResponse, UpstreamTimeout

log = logging.getLogger("envscaler.farm")

Attempt = Callable[[str], Awaitable[UpstreamResponse]]
# Addresses of an environment's replicas now, or None when they cannot be looked up now.
Discover = Callable[[str], Awaitable[list[str] | None]]

# Replicas remembered as gone, per environment, for a precise answer about their episodes.
_GONE_MEMORY = 4096
# A replica id this gateway never saw may be new (its DNS record still spreading to this node):
# look this many times, this far apart, before calling it gone.
_UNSEEN_LOOKS, _UNSEEN_PAUSE_S = 3, 0.5
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class RouteError(Exception):
    """Ends a gateway request with this status and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Replica:
    """One replica of an environment as this gateway last saw it."""

    replica_id: str
    address: str
    episodes: int = 0
    # Polls in a row it did not answer; 0 while healthy.
    failures: int = 0
    # Requests waiting on it now: cancelled when it is found gone.
    waiting: set[anyio.CancelScope] = field(default_factory=set)


@dataclass
class _Env:
    replicas: dict[str, Replica] = field(default_factory=dict)
    gone: OrderedDict[str, str] = field(default_factory=OrderedDict)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    # When the last refresh began: a request that waited for it needs no other.
    refresh_began: float = 0.0


def dns_discovery(services: Mapping[str, str], port: int) -> Discover:
    """Addresses of every running task of each environment's service, from the orchestrator's DNS."""

    async def discover(env_id: str) -> list[str] | None:
        try:
            found = await anyio.getaddrinfo(f"tasks.{services[env_id]}", port, family=socket.AF_INET, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            # No such name: no task runs now. Anything else (a timeout): the resolver did not answer.
            return [] if e.errno in _NO_SUCH_NAME else None
        except OSError:
            return None
        return sorted({f"http://{info[4][0]}:{port}" for info in found})

    return discover


def _episode_in(rest: bytes) -> str | None:
    """The episode id in ``/episodes/{id}[/...]``, or None."""
    parts = rest.split(b"/", 3)
    if len(parts) >= 3 and parts[1] == b"episodes" and parts[2]:
        return parts[2].decode(errors="replace")
    return None


class ReplicaRouter:
    """Picks the replica for each gateway request; ``run`` keeps the view of the replicas current."""

    def __init__(self, env_ids: list[str], discover: Discover, *, poll_s: float = 1.0, probe_timeout_s: float = 1.0,
                 dead_after: int = 2) -> None:
        self.envs = {env_id: _Env() for env_id in env_ids}
        self.discover = discover
        self.poll_s = poll_s
        self.dead_after = dead_after
        self.http = httpx.AsyncClient(timeout=probe_timeout_s, trust_env=False)

    async def run(self) -> None:
        """Refresh every environment every ``poll_s`` until cancelled."""
        try:
            while True:
                async with anyio.create_task_group() as tasks:
                    for env_id in self.envs:
                        tasks.start_soon(self.refresh, env_id)
                await anyio.sleep(self.poll_s)
        finally:
            with anyio.CancelScope(shield=True):
                await self.http.aclose()

    def health(self) -> dict[str, int]:
        """env_id -> replicas answering now."""
        return {env_id: sum(r.failures == 0 for r in env.replicas.values()) for env_id, env in self.envs.items()}

    # -- the view of the replicas ------------------------------------------------------------------

    async def refresh(self, env_id: str, since: float | None = None) -> None:
        """Discover ``env_id``'s replicas and probe each; forget the ones that are gone.

        With ``since``, a refresh that began at or after that moment (while this one waited) is enough.
        """
        env = self.envs[env_id]
        async with env.lock:
            if since is not None and env.refresh_began >= since:
                return
            env.refresh_began = time.monotonic()
            addresses = await self.discover(env_id)
            if addresses is None:
                # A lookup that failed says nothing about the replicas: probe the ones known.
                addresses = [replica.address for replica in env.replicas.values()]
            answers: dict[str, tuple[str, int]] = {}
            async with anyio.create_task_group() as tasks:
                for address in addresses:
                    tasks.start_soon(self._probe, address, answers)
            now_at = {address: replica_id for address, (replica_id, _) in answers.items()}
            for address, (replica_id, episodes) in answers.items():
                replica = env.replicas.setdefault(replica_id, Replica(replica_id, address))
                replica.address, replica.episodes, replica.failures = address, episodes, 0
                env.gone.pop(replica_id, None)
            for replica in list(env.replicas.values()):
                if replica.replica_id in now_at.values():
                    continue
                if replica.address not in addresses:
                    self._lose(env_id, replica, "its task is no longer running")
                elif replica.address in now_at:
                    self._lose(env_id, replica, "its server was restarted")
                else:
                    replica.failures += 1
                    if replica.failures >= self.dead_after:
                        self._lose(env_id, replica, f"not answering for {replica.failures} health checks")

    async def _probe(self, address: str, answers: dict[str, tuple[str, int]]) -> None:
        try:
            health = Health.model_validate_json((await self.http.get(address + "/healthz")).content)
        except (httpx.HTTPError, ValidationError):
            return
        if health.replica is not None:
            answers[address] = (health.replica, health.episodes)

    def _lose(self, env_id: str, replica: Replica, reason: str) -> None:
        env = self.envs[env_id]
        if env.replicas.pop(replica.replica_id, None) is None:
            return
        env.gone[replica.replica_id] = reason
        while len(env.gone) > _GONE_MEMORY:
            env.gone.popitem(last=False)
        for scope in replica.waiting:
            scope.cancel()
        log.warning("environment replica gone", extra={"env": env_id, "replica": replica.replica_id, "reason": reason,
                                                        "address": replica.address, "waiting": len(replica.waiting)})

    # -- routing -----------------------------------------------------------------------------------

    async def forward(self, env_id: str, method: str, rest: bytes, attempt: Attempt) -> UpstreamResponse:
        """Send one request (``attempt(replica_address)``) to the right replica; RouteError when none can take it."""
        episode_id = _episode_in(rest)
        replica_id = replica_of(episode_id) if episode_id else None
        if episode_id and replica_id:
            replica = await self._holder(env_id, replica_id, episode_id)
            response = await self._on_holder(env_id, replica, episode_id, attempt)
            if method == "DELETE" and rest.rstrip(b"/").count(b"/") == 2 and response.status < 300:
                replica.episodes = max(replica.episodes - 1, 0)
            return response
        creating = method == "POST" and rest.rstrip(b"/") == b"/episodes"
        tried: set[str] = set()
        while True:
            replica = await self._least_loaded(env_id, tried)
            tried.add(replica.replica_id)
            try:
                response = await self._send(replica, attempt)
            except UpstreamConnectError:
                replica.failures += 1
                continue  # it never got the request: another replica can take it
            if response is None:
                continue  # it was found gone while this waited: whatever it did is gone with it
            if creating and response.status < 300:
                replica.episodes += 1
            return response

    async def _send(self, replica: Replica, attempt: Attempt) -> UpstreamResponse | None:
        """``attempt`` on ``replica``; None when the replica was found gone while the request waited on it."""
        with anyio.CancelScope() as waiting:
            replica.waiting.add(waiting)
            try:
                return await attempt(replica.address)
            finally:
                replica.waiting.discard(waiting)
        return None

    async def _holder(self, env_id: str, replica_id: str, episode_id: str) -> Replica:
        env = self.envs[env_id]
        replica = env.replicas.get(replica_id)
        for look in range(_UNSEEN_LOOKS if replica is None and replica_id not in env.gone else 0):
            if look:
                await anyio.sleep(_UNSEEN_PAUSE_S)
            await self.refresh(env_id, since=time.monotonic())
            replica = env.replicas.get(replica_id)
            if replica is not None or replica_id in env.gone:
                break
        if replica is None:
            raise RouteError(410, self._gone(env_id, episode_id, replica_id))
        return replica

    async def _on_holder(self, env_id: str, replica: Replica, episode_id: str, attempt: Attempt) -> UpstreamResponse:
        try:
            response = await self._send(replica, attempt)
        except UpstreamError as e:
            if isinstance(e, UpstreamTimeout):
                raise  # slow, not gone: the gateway answers 504
            # It refused the connection or dropped it: gone, unless a probe finds it well.
            await self.refresh(env_id)
            if replica.replica_id in self.envs[env_id].replicas and replica.failures == 0:
                raise RouteError(502, f"environment {env_id!r} replica {replica.replica_id} failed this request "
                                      f"({type(e).__name__}) but still answers: retry") from None
            self._lose(env_id, replica, f"a request and a health check failed ({type(e).__name__})")
            response = None
        if response is None:
            raise RouteError(410, self._gone(env_id, episode_id, replica.replica_id))
        return response

    async def _least_loaded(self, env_id: str, tried: set[str]) -> Replica:
        for refreshed in (False, True):
            candidates = [r for r in self.envs[env_id].replicas.values() if r.replica_id not in tried]
            healthy = [r for r in candidates if r.failures == 0] or candidates
            if healthy:
                return min(healthy, key=lambda r: (r.episodes, random.random()))
            if not refreshed:
                await self.refresh(env_id, since=time.monotonic())
        raise RouteError(503, f"no replica of environment {env_id!r} is answering now; the orchestrator is starting "
                              "or rescheduling it: retry in a few seconds")

    def _gone(self, env_id: str, episode_id: str, replica_id: str) -> str:
        reason = self.envs[env_id].gone.get(replica_id, "not running")
        return (f"environment instance gone: the replica {replica_id} of {env_id!r} that held episode {episode_id!r} "
                f"is gone ({reason}); the episode's state is lost and it cannot be scored: create a new episode")
