"""The docker backend: one hardened container per environment on an internal network.

Every container: a non-root user, a read-only root filesystem (a small tmpfs at /tmp), all
capabilities dropped, no-new-privileges, memory (no swap), CPU and pids limits, and only the
environment variables we set. The network is internal (no route out through Docker's NAT), the
host refuses new connections coming from it and the container's default route is deleted, so a
container can answer but never call out, not even to the host or a sibling (no inter-container
traffic on the bridge). A container stops itself when the daemon's heartbeat file goes stale, so a
killed daemon leaves no running server behind. Docker publishes no ports from an
internal network, so the daemon publishes each one on 127.0.0.1 itself (``servers.farm.backends.publish``).
Containers and the network carry the farm's label: ``remove_farm_resources`` finds them all, also
after the daemon was killed.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import docker.errors
from anyio.abc import SocketListener

from servers.farm.board import Board
from servers.farm.health import answers_healthz
from servers.farm.backends.images import LABEL_ENV, LABEL_FARM, build_env_image, docker_client, current_runtime
from servers.farm.models import EnvPlan, FarmPaths, FarmPlan
from servers.farm.backends.ports import hold_plan_ports
from servers.farm.backends.publish import LoopbackPort

log = logging.getLogger("envscaler.farm")

SERVER_PORT = 8000
SERVER_USER = "10001:10001"
HEARTBEAT_PATH = "/run/envscaler/heartbeat"
_READY_PROBE_TIMEOUT_S = 2.0
# A container death this soon after an OOM kill in it is that kill (the kernel killed its server).
_OOM_DEATH_S = 5.0


def network_name(farm_id: str) -> str:
    return f"envscaler-{farm_id}"


def bridge_name(farm_id: str) -> str:
    """The host-side bridge interface (at most 15 characters)."""
    return f"es-{farm_id[:12]}"


def _input_rule(farm_id: str) -> list[str]:
    return ["INPUT", "-i", bridge_name(farm_id), "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"]


def _iptables(action: str, rule: list[str]) -> bool:
    try:
        return subprocess.run(["iptables", "-w", action, *rule], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def drop_default_route(pid: int) -> bool:
    """Delete the default route in the network namespace of process ``pid``; whether none is left.

    Docker gives containers on an internal network a default route all the same (via the bridge),
    and a container cannot delete it itself without CAP_NET_ADMIN. Without it, even a missing host
    firewall rule would not let a packet find a way off the container's subnet.
    """
    command = ["nsenter", f"--target={pid}", "--net", "ip", "-4", "route"]
    try:
        subprocess.run([*command, "del", "default"], capture_output=True, timeout=10)
        left = subprocess.run([*command, "show", "default"], capture_output=True, text=True, timeout=10)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return left.returncode == 0 and not left.stdout.strip()


def remove_farm_resources(farm_id: str) -> int:
    """Remove every container and network labelled with this farm, and the host rule; how many."""
    client = docker_client()
    removed = 0
    # A container may go while this runs (its engine removing it, another 'farm down'): gone is what we want.
    for container in client.containers.list(all=True, filters={"label": f"{LABEL_FARM}={farm_id}"}, ignore_removed=True):
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            continue
        removed += 1
    while _iptables("-D", _input_rule(farm_id)):
        continue
    for network in client.networks.list(filters={"label": f"{LABEL_FARM}={farm_id}"}):
        network.remove()
        removed += 1
    return removed


class DockerBackend:
    """Builds missing images, starts one container per environment, restarts the ones that die.

    Deaths come from Docker's event stream (one for the whole farm, filtered by its label): a die or
    oom event wakes the environment's supervisor at once, with no per-container polling.
    """

    servers_here = False  # its servers are containers, named by EnvStatus.container

    def __init__(self, plan: FarmPlan, paths: FarmPaths, board: Board) -> None:
        self.plan = plan
        self.paths = paths
        self.board = board
        self.client: Any = None
        self.network: Any = None
        self.containers: dict[str, Any] = {}
        # env_id -> (container address, port) while its container runs; read by the loopback relays.
        self.targets: dict[str, tuple[str, int]] = {}
        # env_id -> set when its current container dies (from the event stream), with what was seen.
        self._deaths: dict[str, anyio.Event] = {}
        self._exit_codes: dict[str, str] = {}
        # env_id -> when its container last reported an OOM kill.
        self._oom: dict[str, float] = {}
        self._kill_reasons: dict[str, str] = {}
        self._warned_route = False
        self._stopping = False

    async def run(self) -> None:
        """Start and supervise every environment until cancelled."""
        listeners = hold_plan_ports(self.plan, self.board)
        published: list[tuple[EnvPlan, LoopbackPort]] = []
        for env in self.plan.envs:
            if env.env_id in listeners:
                relay = LoopbackPort(env.env_id, await SocketListener.from_socket(listeners[env.env_id].main),
                                     lambda env_id=env.env_id: self.targets.get(env_id))
                published.append((env, relay))
        self.client = await anyio.to_thread.run_sync(docker_client)
        await anyio.to_thread.run_sync(self._create_network)
        runtime = await anyio.to_thread.run_sync(current_runtime, self.client)
        limiter = anyio.CapacityLimiter(8)
        for env, _ in published:
            self._deaths[env.env_id] = anyio.Event()
        async with anyio.create_task_group() as tasks:
            # Listening before the first container starts: no death can slip by unseen.
            events = await anyio.to_thread.run_sync(self._open_events)
            tasks.start_soon(self._follow_events, events)
            for env, relay in published:
                tasks.start_soon(relay.serve)
                tasks.start_soon(self._start_and_supervise, env, runtime, limiter)

    def _create_network(self) -> None:
        farm_id = self.plan.farm_id
        self.network = self.client.networks.create(
            network_name(farm_id), driver="bridge", internal=True, labels={LABEL_FARM: farm_id},
            # No inter-container traffic: a container answers the daemon's proxy, never a sibling.
            options={"com.docker.network.bridge.name": bridge_name(farm_id), "com.docker.network.bridge.enable_icc": "false"},
        )
        if not _iptables("-I", _input_rule(farm_id)):
            log.warning("cannot add the host firewall rule (needs root and iptables): containers can reach the host",
                        extra={"farm": farm_id})

    def _open_events(self) -> Any:
        return self.client.events(
            decode=True,
            filters={"type": "container", "label": f"{LABEL_FARM}={self.plan.farm_id}", "event": ["die", "oom"]},
        )

    async def _follow_events(self, events: Any) -> None:
        """Read Docker's event stream in a worker thread; each event is handled on the event loop."""

        def pump() -> None:
            for event in events:
                anyio.from_thread.run_sync(self._on_event, event)

        try:
            await anyio.to_thread.run_sync(pump, abandon_on_cancel=True)
        finally:
            events.close()  # ends the worker thread's blocking read

    def _on_event(self, event: dict[str, Any]) -> None:
        attributes = event.get("Actor", {}).get("Attributes", {})
        env_id = attributes.get(LABEL_ENV)
        if env_id not in self._deaths:
            return
        if event.get("Action") == "oom":
            # The container dies of it only when the killed process was its server; a worker killed
            # inside it is replaced by its server, and the container lives on.
            self._oom[env_id] = time.monotonic()
            return
        self._exit_codes[env_id] = attributes.get("exitCode", "?")
        self._deaths[env_id].set()

    async def _start_and_supervise(self, env: EnvPlan, runtime: str, limiter: anyio.CapacityLimiter) -> None:
        async with limiter:
            image, _ = await anyio.to_thread.run_sync(build_env_image, self.client, Path(env.bundle_dir), runtime)
            container = await anyio.to_thread.run_sync(self._run_container, env, image)
            self.containers[env.env_id] = container
            await self._publish_address(env, container)
            await self._wait_listening(env)
        while True:
            await self._deaths[env.env_id].wait()
            if self._stopping:
                return
            self._deaths[env.env_id] = anyio.Event()
            await anyio.to_thread.run_sync(container.reload)
            oom_at = self._oom.pop(env.env_id, None)
            oom = (oom_at is not None and time.monotonic() - oom_at < _OOM_DEATH_S) or bool(container.attrs["State"].get("OOMKilled"))
            exit_text = self._kill_reasons.pop(env.env_id, None) or (
                "out of memory" if oom else f"exit {self._exit_codes.pop(env.env_id, '?')}"
            )
            record = self.board.env(env.env_id)
            log.warning("environment container died; restarting", extra={"env": env.env_id, "exit": exit_text})
            self.targets.pop(env.env_id, None)
            self.board.update(env.env_id, status="restarting", restarts=record.restarts + 1, last_exit=exit_text,
                              oom_killed=oom or record.oom_killed, address=None)
            await anyio.to_thread.run_sync(container.start)
            await self._publish_address(env, container)
            await self._wait_listening(env)

    async def _wait_listening(self, env: EnvPlan) -> None:
        """Mark ``env`` healthy once its server answers; a container that dies first is left to its supervisor.

        The server's ready pipe cannot cross into a container: this asks it, quickly at first, then
        every second, only while it starts.
        """
        address = self.board.env(env.env_id).address or env.url
        pause_s = 0.05
        while not self._deaths[env.env_id].is_set():
            if await answers_healthz(address, _READY_PROBE_TIMEOUT_S):
                record = self.board.env(env.env_id)
                self.board.update(env.env_id, status="healthy", healthy_at=record.healthy_at or time.time())
                return
            with anyio.move_on_after(pause_s):
                await self._deaths[env.env_id].wait()
            pause_s = min(pause_s * 2, 1.0)

    async def kill(self, env_id: str, reason: str) -> None:
        """Kill ``env_id``'s container (it is hung); the die event restarts it and ``reason`` is reported."""
        container = self.containers.get(env_id)
        if container is None:
            return
        self._kill_reasons[env_id] = reason
        log.warning("killing an environment container", extra={"env": env_id, "reason": reason})
        try:
            await anyio.to_thread.run_sync(container.kill)
        except docker.errors.APIError as e:  # it stopped meanwhile: its die event does the rest
            log.warning("could not kill an environment container", extra={"env": env_id, "error": str(e)})

    def _run_container(self, env: EnvPlan, image: str) -> Any:
        limits = self.plan.limits
        self.paths.heartbeat.touch()  # a bind mount needs its source to exist
        return self.client.containers.run(
            image,
            # The image's command, and: stop when the daemon's heartbeat stops (kill -9 of the daemon).
            command=["/bundle", "--host", "0.0.0.0", "--port", str(SERVER_PORT), "--stop-when-stale", HEARTBEAT_PATH, *limits.serve_flags()],
            volumes={str(self.paths.heartbeat): {"bind": HEARTBEAT_PATH, "mode": "ro"}},
            name=f"envscaler-{self.plan.farm_id}-{env.env_id}",
            detach=True,
            labels={LABEL_FARM: self.plan.farm_id, LABEL_ENV: env.env_id},
            environment={"ENVSCALER_TOKEN": env.token},
            user=SERVER_USER,
            read_only=True,
            tmpfs={"/tmp": "rw,noexec,nosuid,size=16m"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m",
            nano_cpus=int(limits.cpus * 1e9),
            pids_limit=limits.pids,
            network=self.network.name,
        )

    async def _publish_address(self, env: EnvPlan, container: Any) -> None:
        """Record where the server answers (its address may change when it is restarted).

        Nothing reaches the server before this, so its default route is gone before any tool runs.
        """
        address = ""
        while not address:
            await anyio.to_thread.run_sync(container.reload)
            address = container.attrs["NetworkSettings"]["Networks"].get(self.network.name, {}).get("IPAddress", "")
            if not address:
                await anyio.sleep(0.1)
        pid = container.attrs["State"].get("Pid")
        if pid and not await anyio.to_thread.run_sync(drop_default_route, pid) and not self._warned_route:
            self._warned_route = True
            log.warning("cannot remove the containers' default route (needs root, nsenter and ip); egress is still "
                        "blocked by the internal network", extra={"farm": self.plan.farm_id, "env": env.env_id})
        self.targets[env.env_id] = (address, SERVER_PORT)
        self.board.update(env.env_id, address=f"http://{address}:{SERVER_PORT}", container=container.name)

    async def stop(self) -> None:
        """Remove every container and the network of this farm."""
        self._stopping = True
        await anyio.to_thread.run_sync(remove_farm_resources, self.plan.farm_id)
