"""The 3-node Ray cluster that .ci/ray-setup.sh runs on this machine: where its nodes are, and killing one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SETUP = Path(__file__).resolve().parents[2] / ".ci" / "ray-setup.sh"
DESCRIPTION = Path(os.environ.get("ENVSCALER_RAY", "/run/envscaler-ray/ray.json"))


@dataclass
class Node:
    name: str
    address: str
    namespace: str
    resource: str


@dataclass
class RayCluster:
    # The head's GCS, HOST:PORT: what --ray-address takes on a node of the cluster.
    address: str
    # Its Ray Client server, ray://HOST:PORT: what --ray-address takes off the cluster.
    client: str
    nodes: dict[str, Node]

    def on_node(self, node: str, command: list[str]) -> list[str]:
        """``command`` run in ``node``'s network namespace: on that node, as far as the network goes."""
        return ["ip", "netns", "exec", self.nodes[node].namespace, *command]

    def envscaler_on_head(self, *args: str) -> list[str]:
        """``envscaler ARGS`` on the head node, where a farm's daemon joins the cluster and its gateway listens."""
        return self.on_node("head", [sys.executable, "-m", "envscaler.cli", *args])

    def node_named(self, address: str) -> str:
        """The node whose address ``address`` starts with (a server URL, a state file's node field)."""
        return next(name for name, node in self.nodes.items() if address.removeprefix("http://").startswith(node.address + ":")
                    or address.startswith(node.address + " "))


def find_cluster() -> RayCluster | None:
    """The cluster described by .ci/ray-setup.sh, when its head answers; else None."""
    try:
        data = json.loads(DESCRIPTION.read_text())
    except (OSError, ValueError):
        return None
    host, _, port = data["address"].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError:
        return None
    return RayCluster(address=data["address"], client=data["client"], nodes={name: Node(name=name, **node) for name, node in data["nodes"].items()})


def kill_node(name: str) -> None:
    """The node dies: every process of it SIGKILLed at once."""
    subprocess.run(["bash", str(SETUP), "kill", name], check=True, capture_output=True, timeout=60)


def restore_nodes() -> None:
    """Start whatever node is down again (the setup is idempotent) and wait until all are alive."""
    subprocess.run(["bash", str(SETUP)], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "ENVSCALER_PYTHON": sys.executable})
