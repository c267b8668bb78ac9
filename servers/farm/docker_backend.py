"""The docker backend: one hardened container per environment on an internal network.

Every container: a non-root user, a read-only root filesystem (a small tmpfs at /tmp), all
capabilities dropped, no-new-privileges, memory (no swap), CPU and pids limits, and only the
environment variables we set. The network is internal (no route out through Docker's NAT), the
host refuses new connections coming from it and the container's default route is deleted, so a
container can answer but never call out, not even to the host or a sibling (no inter-container
traffic on the bridge). A container stops itself when the daemon's heartbeat file goes stale, so a
killed daemon leaves no running server behind. Docker publishes no ports from an
internal network, so the daemon publishes each one on 127.0.0.1 itself (``servers.farm.publish``).
Containers and the network carry the farm's label: ``remove_farm_resources`` finds them all, also
after the daemon was killed.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from servers.farm.board import Board
from servers.farm.images import LABEL_ENV, LABEL_FARM, build_env_image, docker_client, current_runtime
from servers.farm.models import EnvPlan, FarmPaths, FarmPlan
from servers.farm.publish import LoopbackPort

log = logging.getLogger("envscaler.farm")

SERVER_PORT = 8000
SERVER_USER = "10001:10001"
HEARTBEAT_PATH = "/run/envscaler/heartbeat"
_POLL_S = 0.5


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
    for container in client.containers.list(all=True, filters={"label": f"{LABEL_FARM}={farm_id}"}):
        container.remove(force=True)
        removed += 1
    while _iptables("-D", _input_rule(farm_id)):
        continue
    for network in client.networks.list(filters={"label": f"{LABEL_FARM}={farm_id}"}):
        network.remove()
        removed += 1
    return removed


class DockerBackend:
    """Builds missing images, starts one container per environment, restarts the ones that die."""

    def __init__(self, plan: FarmPlan, paths: FarmPaths, board: Board) -> None:
        self.plan = plan
        self.paths = paths
        self.board = board
        self.client: Any = None
        self.network: Any = None
        self.containers: dict[str, Any] = {}
        # env_id -> (container address, port) while its container runs; read by the loopback relays.
        self.targets: dict[str, tuple[str, int]] = {}
        self._warned_route = False

    async def run(self) -> None:
        """Start and supervise every environment until cancelled."""
        ports = []
        for env in self.plan.envs:
            try:
                ports.append(await LoopbackPort.open(env.env_id, env.port, lambda env_id=env.env_id: self.targets.get(env_id)))
            except OSError as e:
                for port in ports:
                    await port.listener.aclose()
                self.board.set(error=f"cannot publish {env.env_id} on 127.0.0.1:{env.port} ({e}); run 'farm up' again")
                return
        self.client = await anyio.to_thread.run_sync(docker_client)
        await anyio.to_thread.run_sync(self._create_network)
        runtime = await anyio.to_thread.run_sync(current_runtime, self.client)
        limiter = anyio.CapacityLimiter(8)
        async with anyio.create_task_group() as tasks:
            for env, port in zip(self.plan.envs, ports):
                tasks.start_soon(port.serve)
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

    async def _start_and_supervise(self, env: EnvPlan, runtime: str, limiter: anyio.CapacityLimiter) -> None:
        async with limiter:
            image, _ = await anyio.to_thread.run_sync(build_env_image, self.client, Path(env.bundle_dir), runtime)
            container = await anyio.to_thread.run_sync(self._run_container, env, image)
        self.containers[env.env_id] = container
        await self._publish_address(env, container)
        while True:
            await anyio.sleep(_POLL_S)
            await anyio.to_thread.run_sync(container.reload)
            if container.status in ("running", "created", "restarting"):
                continue
            state = container.attrs["State"]
            record = self.board.env(env.env_id)
            oom = bool(state.get("OOMKilled"))
            exit_text = "out of memory" if oom else f"exit {state.get('ExitCode')}"
            log.warning("environment container died; restarting", extra={"env": env.env_id, "exit": exit_text})
            self.targets.pop(env.env_id, None)
            self.board.update(env.env_id, status="restarting", restarts=record.restarts + 1, last_exit=exit_text,
                              oom_killed=oom or record.oom_killed, address=None)
            await anyio.to_thread.run_sync(container.start)
            await self._publish_address(env, container)

    def _run_container(self, env: EnvPlan, image: str) -> Any:
        limits = self.plan.limits
        self.paths.heartbeat.touch()  # a bind mount needs its source to exist
        return self.client.containers.run(
            image,
            # The image's command, and: stop when the daemon's heartbeat stops (kill -9 of the daemon).
            command=["/bundle", "--host", "0.0.0.0", "--port", str(SERVER_PORT), "--stop-when-stale", HEARTBEAT_PATH],
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
        await anyio.to_thread.run_sync(remove_farm_resources, self.plan.farm_id)
