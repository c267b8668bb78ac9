"""The ray backend: the farm's servers in actors of an existing Ray cluster, Ray placing and restarting them.

``envscaler farm up --backend ray --ray-address ADDR`` runs the farm daemon where it is typed (the
gateway, the health probes, the state file) as a Ray driver and, for every ``--envs-per-actor``
environments, one actor (``servers.farm.backends.ray_node.EnvGroup``) that reserves their
``--cpus-per-env`` CPUs, memory and any ``--ray-resource`` on the node Ray picks (spread over the
nodes) and starts their servers there: the process backend's ``envscaler serve``, workers sandboxed,
listening on the node's cluster address. The bundles travel through Ray's object store, so the nodes
share no filesystem with the daemon; they need only this package installed.

Ray supervises the actors: they restart without limit, on a live node when theirs is lost. A server
that exits, or that the daemon's prober finds hung, is started again by its actor. Every start is a new
replica id, so an episode of an earlier start is answered 410: lost, never scored. The actors belong
to the daemon's Ray job and die with it.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from pydantic import BaseModel

from envscaler.sandbox import FARM_ID_VARIABLE
from servers.errors import FarmError
from servers.farm.backends.ray_node import EnvGroup, ServerPlace, ServerStart
from servers.farm.board import Board
from servers.farm.models import EnvPlan, FarmPaths, FarmPlan, RayPlacement

log = logging.getLogger("envscaler.farm")

# A server that fails this many starts, before it was ever healthy, is broken, not unlucky.
_STARTUP_ATTEMPTS = 3
# While Ray brings an actor back, a call can still reach the old one: look again after this.
_RESTART_POLL_S = 0.5
# How long the daemon waits for Ray to declare dead the node a server moved off (its health checks take a
# while, longer on a loaded cluster) before it takes the move for a plain restart.
_NODE_DEATH_WAIT_S = 60.0
_STOP_S = 10.0
_CONNECT_ATTEMPTS, _CONNECT_PAUSE_S = 3, 2.0
_PROBE_TIMEOUT_S = 5.0


def namespace(farm_id: str) -> str:
    """The Ray namespace of one farm's actors."""
    return f"envscaler-{farm_id}"


def bundle_files(bundle_dir: str) -> dict[str, bytes]:
    """Every file of a bundle, by path relative to it (caches left out): what the node writes back."""
    root = Path(bundle_dir)
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def connect(placement: RayPlacement, farm_id: str) -> None:
    """Join the cluster as a driver in the farm's namespace; FarmError when no cluster answers.

    A few tries: a Ray Client server (``ray://``) starts a server process for each client, and gives up
    on one that a busy head did not start within its own 30 s.
    """
    import ray

    _answers(placement.address)
    for attempt in range(1, _CONNECT_ATTEMPTS + 1):
        try:
            ray.init(address=placement.address, namespace=namespace(farm_id), log_to_driver=False, logging_level=logging.WARNING,
                     configure_logging=False)
            return
        except (ConnectionError, RuntimeError, ValueError) as e:
            if attempt == _CONNECT_ATTEMPTS:
                raise FarmError(f"no Ray cluster answers at {placement.address} ({str(e).splitlines()[0]}): start one with "
                                "'ray start --head', or give its address with --ray-address") from None
            log.warning("the Ray cluster did not take the connection; trying again",
                        extra={"address": placement.address, "error": str(e).splitlines()[0], "attempt": attempt})
            time.sleep(_CONNECT_PAUSE_S)


def _answers(address: str) -> None:
    """FarmError at once when nothing listens at a ``HOST:PORT`` or ``ray://HOST:PORT`` address (Ray itself
    tries for minutes); ``auto`` is Ray's to find."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise FarmError(f"no Ray cluster answers at {address} ({e.strerror or e}): start one with 'ray start --head', "
                        "or give its address with --ray-address") from None


class Capacity(BaseModel):
    """What ``farm up`` learns of the cluster before it starts anything."""

    nodes: int
    # Environments the cluster's free resources can hold (by CPU, memory and each custom resource).
    fits: int
    # This machine's address on the cluster: where the gateway listens for the cluster's trainers.
    address: str


def survey(placement: RayPlacement, farm_id: str, memory_mb: int) -> Capacity:
    """Connect, measure what the farm can get, disconnect (``farm up`` does this before the daemon starts)."""
    import ray

    connect(placement, farm_id)
    try:
        free = ray.available_resources()
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        group = placement.envs_per_actor
        needs = {"CPU": placement.cpus_per_env, "memory": memory_mb * 2**20, **placement.resources}
        fits = min(int(free.get(name, 0.0) // (amount * group)) for name, amount in needs.items()) * group
        return Capacity(nodes=nodes, fits=fits, address=ray.util.get_node_ip_address())
    finally:
        ray.shutdown()


def _cut_off(error: BaseException) -> str:
    """What Ray said when a call to an actor failed, on one line."""
    text = str(error).strip().splitlines()
    return f"its Ray actor went away ({(text[0] if text else type(error).__name__)[:200]})"


def _node_alive(node_id: str) -> bool:
    import ray

    return any(node.get("NodeID") == node_id and node.get("Alive") for node in ray.nodes())


class RayBackend:
    """One :class:`EnvGroup` actor per ``envs_per_actor`` environments, each environment followed as it
    starts, ends and starts again."""

    servers_here = False  # EnvStatus.pid is a process of the node the server runs on

    def __init__(self, plan: FarmPlan, paths: FarmPaths, board: Board) -> None:
        if plan.ray is None:
            raise FarmError("a ray farm's plan names no cluster (--ray-address)")
        self.plan = plan
        self.placement: RayPlacement = plan.ray
        self.paths = paths
        self.board = board
        # Every actor made, and env_id -> the actor that holds it.
        self.groups: list[Any] = []
        self.actors: dict[str, Any] = {}
        # The bundles in Ray's object store (ObjectRefs), held for the farm's life: Ray restarts an actor
        # from its arguments, which must still exist then.
        self.bundles: list[Any] = []
        # env_id -> why the daemon killed its server (it was hung): reported instead of "killed by SIGKILL".
        self._kill_reasons: dict[str, str] = {}
        self._stopping = False
        # The task group that follows the environments, once run() has made it.
        self._tasks: anyio.abc.TaskGroup | None = None

    async def run(self) -> None:
        """Create every actor and follow every environment until cancelled."""
        import ray

        await anyio.to_thread.run_sync(connect, self.placement, self.plan.farm_id)
        actor_class = ray.remote(EnvGroup)
        size = self.placement.envs_per_actor
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            for first in range(0, len(self.plan.envs), size):
                envs = self.plan.envs[first:first + size]
                refs = [ray.put(await anyio.to_thread.run_sync(bundle_files, env.bundle_dir)) for env in envs]
                self.bundles += refs
                actor = actor_class.options(
                    max_restarts=-1, max_task_retries=0, max_concurrency=2 * len(envs) + 4,
                    num_cpus=self.placement.cpus_per_env * len(envs), memory=self.plan.limits.memory_mb * 2**20 * len(envs),
                    resources={name: amount * len(envs) for name, amount in self.placement.resources.items()} or None,
                    scheduling_strategy="SPREAD", runtime_env={"env_vars": {FARM_ID_VARIABLE: self.plan.farm_id}},
                ).remote([self._start(env) for env in envs], *refs)
                self.groups.append(actor)
                for env in envs:
                    self.actors[env.env_id] = actor
                    tasks.start_soon(self._follow, env)

    def _start(self, env: EnvPlan) -> ServerStart:
        return ServerStart(farm_id=self.plan.farm_id, env_id=env.env_id, token=env.token, flags=self.plan.server_flags(),
                           memory_mb=self.plan.limits.memory_mb, sandbox=self.plan.sandbox)

    async def _follow(self, env: EnvPlan) -> None:
        """Record each start of ``env``'s server on the board, and why each one ended."""
        from ray.exceptions import ActorDiedError, RayActorError

        actor, env_id = self.actors[env.env_id], env.env_id
        seen: set[str] = set()
        failures = 0
        previous: ServerPlace | None = None
        while not self._stopping:
            try:
                place: ServerPlace = await actor.place.remote(env_id)
            except ActorDiedError as e:
                if "creation task" in str(e):  # Ray gives up on an actor whose constructor failed
                    self.board.update(env_id, status="failed", pid=None, last_exit=_cut_off(e))
                    return
                await anyio.sleep(_RESTART_POLL_S)
                continue
            except RayActorError:
                await anyio.sleep(_RESTART_POLL_S)  # Ray is starting it again: why it ended is recorded already
                continue
            if place.incarnation in seen:
                await anyio.sleep(_RESTART_POLL_S)  # the call reached the start that is being replaced
                continue
            seen.add(place.incarnation)
            if previous is not None and previous.node_id != place.node_id:
                # Ray may start the actor again elsewhere before it has declared the old node dead: the server is
                # healthy at once, and why it moved is told once Ray says so.
                self._tasks.start_soon(self._report_lost_node, env_id, previous, place, self.board.env(env_id).restarts)
            previous = place
            if place.url is not None:
                record = self.board.env(env_id)
                self.board.update(env_id, status="healthy", url=place.url, node=place.node, pid=place.pid,
                                  healthy_at=record.healthy_at or time.time())
                try:
                    ended = await actor.ended.remote(env_id, place.incarnation)
                except RayActorError as e:
                    ended = self._kill_reasons.pop(env_id, None) or _cut_off(e)
                else:
                    ended = self._kill_reasons.pop(env_id, None) or ended
                    if self._stopping:
                        return
                    actor.restart.remote(env_id, place.incarnation)
            else:
                ended = place.problem or "did not start"
                failures += 1
                if failures >= _STARTUP_ATTEMPTS and self.board.env(env_id).healthy_at is None:
                    self.board.update(env_id, status="failed", pid=None, node=place.node, last_exit=ended)
                    log.error("environment server failed to start", extra={"env": env_id, "exit": ended})
                    return
                actor.restart.remote(env_id, place.incarnation)
            if self._stopping:
                return
            record = self.board.env(env_id)
            log.warning("environment server stopped; starting it again", extra={"env": env_id, "exit": ended})
            self.board.update(env_id, status="restarting", restarts=record.restarts + 1, last_exit=ended, pid=None)

    async def _report_lost_node(self, env_id: str, previous: ServerPlace, place: ServerPlace, restarts: int) -> None:
        """Record that ``env_id``'s server left ``previous``'s node because the node was lost, once Ray declares it
        dead (within _NODE_DEATH_WAIT_S), unless the server has been restarted again since (``restarts``)."""
        deadline = time.monotonic() + _NODE_DEATH_WAIT_S
        while await anyio.to_thread.run_sync(_node_alive, previous.node_id):
            if time.monotonic() >= deadline or self._stopping:
                return
            await anyio.sleep(_RESTART_POLL_S)
        if self.board.env(env_id).restarts == restarts:
            self.board.update(env_id, last_exit=f"its node {previous.node} was lost; restarted on {place.node}")

    async def kill(self, env_id: str, reason: str) -> None:
        """Kill ``env_id``'s server (it is hung) for its actor to start it again; its restart reports ``reason``."""
        actor = self.actors.get(env_id)
        if actor is None or self._stopping:
            return
        self._kill_reasons[env_id] = reason
        log.warning("killing an environment server", extra={"env": env_id, "reason": reason})
        actor.kill.remote(env_id)

    async def stop(self) -> None:
        """Stop every server (each removes its files from its node), then the actors, then leave the cluster."""
        import ray

        self._stopping = True
        refs = [actor.stop.remote() for actor in self.groups]
        with anyio.move_on_after(_STOP_S):
            for ref in refs:
                try:
                    await ref
                except Exception:  # noqa: BLE001 - an actor that died meanwhile has nothing left to stop
                    continue
        for actor in self.groups:
            ray.kill(actor, no_restart=True)
        await anyio.to_thread.run_sync(ray.shutdown)
