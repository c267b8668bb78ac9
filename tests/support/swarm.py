"""The multi-node swarm that .ci/swarm-setup.sh runs on this machine: where its nodes are, and killing one."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SETUP = Path(__file__).resolve().parents[2] / ".ci" / "swarm-setup.sh"
DESCRIPTION = Path(os.environ.get("ENVSCALER_SWARM", "/run/envscaler-swarm/swarm.json"))


@dataclass
class Node:
    name: str
    docker_host: str
    address: str
    hostname: str


@dataclass
class Swarm:
    registry: str
    manager: str
    nodes: dict[str, Node]

    def client(self, node: str) -> Any:
        """A Docker client of one node's own engine."""
        import docker

        return docker.DockerClient(base_url=self.nodes[node].docker_host, timeout=60)

    def workers(self) -> list[str]:
        return [name for name, node in self.nodes.items() if node.docker_host != self.manager]

    def node_named(self, hostname: str) -> str:
        return next(name for name, node in self.nodes.items() if node.hostname == hostname)


def find_swarm() -> Swarm | None:
    """The swarm described by .ci/swarm-setup.sh, when its manager answers; else None."""
    try:
        data = json.loads(DESCRIPTION.read_text())
    except (OSError, ValueError):
        return None
    swarm = Swarm(registry=data["registry"], manager=data["manager"],
                  nodes={name: Node(name=name, **node) for name, node in data["nodes"].items()})
    import docker

    try:
        client = docker.DockerClient(base_url=swarm.manager, timeout=10)
        active = client.info()["Swarm"]["LocalNodeState"] == "active"
        client.close()
    except Exception:  # noqa: BLE001 - any failure means "no swarm here"
        return None
    return swarm if active else None


def kill_node(name: str) -> None:
    """The node dies: off the network and every process of it SIGKILLed."""
    subprocess.run(["bash", str(SETUP), "kill", name], check=True, capture_output=True, timeout=60)


def restore_nodes() -> None:
    """Start whatever node is down again (the setup is idempotent) and wait until all are Ready."""
    subprocess.run(["bash", str(SETUP)], check=True, capture_output=True, timeout=300)
