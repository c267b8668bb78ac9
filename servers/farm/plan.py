"""Planning a farm: one environment server per bundle, each with a free port and its own token."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

from envscaler.bundle import find_bundles, load_bundle
from envscaler.loader import precheck_class
from servers.errors import FarmError
from servers.farm.models import Backend, EnvPlan, FarmPlan, Limits


def free_ports(count: int) -> list[int]:
    """Ports that are free now; held open together so that no two are the same."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def plan_farm(
    env_dirs: list[str], backend: Backend, catalog: Path, limits: Limits, gateway_port: int, openenv: bool = False
) -> FarmPlan:
    """One EnvPlan per bundle found under ``env_dirs``; FarmError on duplicates or nothing found.

    With ``openenv`` each server also gets a port for its OpenEnv listener.
    """
    bundle_dirs = [d for root in env_dirs for d in find_bundles(root)]
    if not bundle_dirs:
        raise FarmError(f"no bundles (env.json + scenarios.jsonl) under {', '.join(env_dirs)}")
    envs: list[EnvPlan] = []
    seen: dict[str, Path] = {}
    ports = free_ports(len(bundle_dirs) * (2 if openenv else 1))
    openenv_ports: list[int | None] = list(ports[len(bundle_dirs):]) if openenv else [None] * len(bundle_dirs)
    for directory, port, openenv_port in zip(bundle_dirs, ports, openenv_ports):
        bundle = load_bundle(directory)
        precheck_class(bundle.spec)
        if bundle.env_id in seen:
            raise FarmError(f"env_id {bundle.env_id!r} appears twice: {seen[bundle.env_id]} and {directory}")
        seen[bundle.env_id] = directory
        envs.append(
            EnvPlan(
                env_id=bundle.env_id,
                bundle_dir=str(Path(directory).absolute()),
                token=secrets.token_urlsafe(24),
                port=port,
                openenv_port=openenv_port,
                spec_hash=bundle.spec.content_hash(),
            )
        )
    return FarmPlan(
        farm_id=secrets.token_hex(6), backend=backend, catalog=str(catalog), gateway_port=gateway_port, limits=limits, envs=envs
    )
