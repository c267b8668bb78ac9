"""What the farm keeps on disk besides the catalog: the plan and the live state.

The catalog file itself (``envscaler.wire.FarmCatalog``) is the public contract that users and
``envscaler run --farm`` read. Next to it, ``<catalog>.farm/`` holds the farm daemon's plan (what to run), its state (what runs,
health, restarts, pids or containers) and logs, so ``status`` and ``down`` work from the file alone,
even after the process that ran ``up`` was killed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from envscaler.bundle import describe_validation_error
from envscaler.cgroups import MIN_WORKER_MEMORY_MB, MIN_WORKER_TASKS
from envscaler.wire import WorkerResources
from servers.errors import FarmError

Backend = Literal["docker", "process", "ray", "swarm"]
EnvStatusName = Literal["starting", "healthy", "unhealthy", "restarting", "failed"]

MAX_ENVS_PER_SERVER = 64
"""The most environments one process-backend server serves (``FarmPlan.envs_per_server``)."""

M = TypeVar("M", bound=BaseModel)


class Limits(BaseModel):
    """Resources of one environment server, and its time limits (None: the server's own defaults)."""

    memory_mb: int = Field(default=256, ge=MIN_WORKER_MEMORY_MB)
    cpus: float = Field(default=1.0, gt=0)
    pids: int = Field(default=128, ge=MIN_WORKER_TASKS)
    call_timeout_s: float | None = Field(default=None, gt=0)
    check_timeout_s: float | None = Field(default=None, gt=0)
    # How long a server's check worker may sit idle before it is stopped (None: the server's own default; 0: never stopped).
    check_idle_s: float | None = Field(default=None, ge=0)

    def serve_flags(self) -> list[str]:
        """The ``envscaler serve`` flags that give a server these time limits, and its sandboxed workers
        these resources (a container holds its server and workers within its own)."""
        flags = ["--worker-memory-mb", str(self.memory_mb), "--worker-tasks", str(self.pids), "--worker-cpus", f"{self.cpus:g}"]
        if self.call_timeout_s is not None:
            flags += ["--call-timeout", f"{self.call_timeout_s:g}"]
        if self.check_timeout_s is not None:
            flags += ["--check-timeout", f"{self.check_timeout_s:g}"]
        if self.check_idle_s is not None:
            flags += ["--check-idle", f"{self.check_idle_s:g}"]
        return flags


class Probes(BaseModel):
    """How the daemon looks for servers that are alive but hung (``servers.farm.health``)."""

    # Each server is asked for /healthz once per period, the farm's probes spread evenly over it;
    # None: 10 s, longer for farms so big that the daemon would send more than 20 probes a second.
    period_s: float | None = Field(default=None, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)
    # Missed probes in a row after which the server is killed and restarted.
    misses_allowed: int = Field(default=3, ge=1)


class RayPlacement(BaseModel):
    """Where and how the ray backend places servers on an existing Ray cluster (``servers.farm.backends.ray``)."""

    # What ``ray.init`` takes: ``HOST:PORT`` of the cluster's GCS, ``ray://HOST:PORT`` (Ray Client) or ``auto``.
    address: str
    # Ray's logical CPUs each environment's server reserves on its node.
    cpus_per_env: float = Field(default=0.25, gt=0)
    # Custom resources each server needs (one unit of ``{"farm_node": 0.01}`` keeps it to nodes that offer it).
    resources: dict[str, float] = Field(default_factory=dict)
    # Environments per Ray actor: an actor process costs ~60 MB, and all of its environments move together.
    envs_per_actor: int = Field(default=1, ge=1)


class EnvPlan(BaseModel):
    """One environment the daemon must run."""

    env_id: str
    bundle_dir: str
    token: str
    port: int
    # The server's OpenEnv listener (``farm up --openenv``, process backend).
    openenv_port: int | None = None
    image: str | None = None
    spec_hash: str

    @property
    def url(self) -> str:
        """The environment's own base URL, on 127.0.0.1 with either backend."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def openenv_url(self) -> str | None:
        """The server's OpenEnv listener on 127.0.0.1, when one is planned."""
        return None if self.openenv_port is None else f"http://127.0.0.1:{self.openenv_port}"


class FarmPlan(BaseModel):
    """Everything the farm daemon needs to start and supervise a farm."""

    farm_id: str
    backend: Backend
    catalog: str
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 0
    limits: Limits = Field(default_factory=Limits)
    probes: Probes = Field(default_factory=Probes)
    # Browser origins the gateway answers with CORS headers ('*' for any).
    allowed_origins: list[str] = Field(default_factory=list)
    # Connections one client address may hold at the gateway (haproxy's and the Python gateway's).
    connections_per_client: int = Field(default=1024, ge=1)
    # Process backend: each server's environment code in a bubblewrap sandbox (envscaler.sandbox). Containers isolate the others.
    sandbox: bool = False
    # Ray backend: the cluster and what each server reserves there.
    ray: RayPlacement | None = None
    # Process backend: environments one server process serves (each keeps its port, token and sandboxed
    # workers; they share the server's event loop and limits, and start, stop and restart together).
    envs_per_server: int = Field(default=1, ge=1, le=MAX_ENVS_PER_SERVER)
    envs: list[EnvPlan]

    def server_flags(self) -> list[str]:
        """The ``envscaler serve`` flags every process-backend server of the plan gets besides its own."""
        return self.limits.serve_flags() + ([] if self.sandbox else ["--no-sandbox"])


class EnvStatus(BaseModel):
    """One environment as the daemon last saw it."""

    env_id: str
    url: str
    # Where the server itself answers when that is not ``url`` (docker: the container's address).
    address: str | None = None
    # Ray backend: the node it runs on now (its address and Ray's node id).
    node: str | None = None
    status: EnvStatusName = "starting"
    restarts: int = 0
    pid: int | None = None
    container: str | None = None
    last_exit: str | None = None
    oom_killed: bool = False
    healthy_at: float | None = None
    # Process backend: what its sandboxed workers hold (read from their cgroup by ``farm status``, not kept).
    resources: WorkerResources | None = None


class FarmState(BaseModel):
    """The daemon's live view of the farm, rewritten whenever something changes."""

    farm_id: str
    backend: Backend
    daemon_pid: int
    gateway: str | None = None
    # What serves the gateway's hot path: "haproxy 2.6.12" in front of the Python gateway, or "python".
    gateway_proxy: str | None = None
    # Process backend: whether each server's environment code runs in a bubblewrap sandbox (FarmPlan.sandbox).
    sandbox: bool = False
    ready: bool = False
    error: str | None = None
    started_at: float
    updated_at: float
    envs: dict[str, EnvStatus]


class FarmPaths:
    """The files of the farm that a catalog path names."""

    def __init__(self, catalog: str | Path) -> None:
        self.catalog = Path(catalog).absolute()
        self.dir = self.catalog.with_name(self.catalog.name + ".farm")
        self.plan = self.dir / "plan.json"
        self.state = self.dir / "state.json"
        self.daemon_log = self.dir / "daemon.log"
        self.logs = self.dir / "logs"
        # Touched by the daemon every few seconds; its servers stop when it goes stale (the daemon died).
        self.heartbeat = self.dir / "heartbeat"

    def env_log(self, env_id: str) -> Path:
        """The log file of one environment server (process backend)."""
        return self.logs / f"{env_id}.log"


def write_json(path: Path, model: BaseModel, indent: int | None = 2) -> None:
    """Write ``model`` atomically (readers never see half a file), readable by the owner only: it holds tokens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(model.model_dump_json(indent=indent, exclude_none=True) + "\n")
    os.replace(temporary, path)


def read_json(path: Path, model: type[M]) -> M | None:
    """Parse ``path`` as ``model``; None when it does not exist, FarmError naming the file when it is bad."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise FarmError(f"{path}: unreadable: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise FarmError(f"{path}: {describe_validation_error(e)}") from None
