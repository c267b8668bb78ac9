"""A control group per environment: what its untrusted processes take, counted and bounded by the kernel.

An address-space limit does not count what a process holds outside its address space: a memfd or a
file in a tmpfs (``/dev/shm``, the sandbox's ``/tmp``) stays in memory after it is unmapped, and no
rlimit bounds the threads of one environment. A memory cgroup charges shared memory and tmpfs pages
to the group whose process touched them, a pids cgroup bounds its threads and processes together, and
a cpu cgroup gives it one share of the CPU beside the other environments.

:meth:`ChildGroup.create` makes ``envscaler-<pid>-<env>-<role>`` (``pid``: the server that owns it;
``env``: a digest of the environment's id, as one server may serve several; one group per worker
role, so that an environment worker that fills its memory cannot starve the checks of the same
environment) below this process's own group in each controller it can write: cgroup v1 (``memory``,
``pids``, ``cpu``, each its own hierarchy) or v2 (one hierarchy, where this process's group already delegates the
controllers to its children). A worker writes itself into it (:attr:`ChildGroup.procs_files`) as soon
as it is forked, as root, before it confines itself: everything it starts is counted from its first page.
Where no memory controller can be written it answers None, and the caller falls back to what it can
refuse instead (see ``envscaler.sandbox``). Only groups made here are ever written or removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from pydantic import BaseModel

from envscaler.wire import WorkerResources

_ROOT = Path("/sys/fs/cgroup")
_PREFIX = "envscaler-"
# v1: one hierarchy per controller, each mounted at /sys/fs/cgroup/<name>.
_V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
_MB = 1024 * 1024

MIN_WORKER_MEMORY_MB, MIN_WORKER_TASKS = 64, 16
"""The least memory (MB) and tasks (processes and threads) an environment's workers may be given: an
interpreter and the threads a worker runs need them (``serve --worker-memory-mb/--worker-tasks``,
``farm up --memory-mb/--pids``)."""


class GroupLimits(BaseModel):
    """What one environment's untrusted processes may take together."""

    memory_mb: int
    pids: int
    cpu_weight: int = 100
    """Relative to the other environments' (v2 ``cpu.weight``; v1 ``cpu.shares`` is 10.24x this)."""


class ChildGroup:
    """``envscaler-<pid>`` in each controller this process can write (see the module's doc)."""

    def __init__(self, version: str, paths: dict[str, Path]) -> None:
        self.version = version
        self.paths = paths
        self._procs = [str(path / "cgroup.procs") for path in dict.fromkeys(paths.values())]

    @classmethod
    def create(cls, limits: GroupLimits, env_id: str, role: str, owner: int | None = None) -> ChildGroup | None:
        """A new group for the ``role`` processes of environment ``env_id``'s server ``owner`` (this process by
        default), or None where no memory controller can be written here (not root, no cgroup file system, v2
        without delegation)."""
        version, parents = _writable_parents()
        if "memory" not in parents:
            return None
        _remove_stale(parents)
        paths = {}
        for controller, parent in parents.items():
            path = parent / f"{_PREFIX}{os.getpid() if owner is None else owner}-{_env_tag(env_id)}-{role}"
            with contextlib.suppress(OSError):
                path.mkdir(exist_ok=True)
                paths[controller] = path
        if "memory" not in paths:
            return None
        group = cls(version, paths)
        group._limit(limits)
        return group

    @classmethod
    def find(cls, owner: int, env_id: str) -> list[ChildGroup]:
        """The groups that server ``owner`` made for environment ``env_id`` (``farm status`` reads them)."""
        version, parents = _writable_parents()
        memory = parents.get("memory")
        if memory is None:
            return []
        groups = []
        for entry in sorted(memory.glob(f"{_PREFIX}{owner}-{_env_tag(env_id)}-*")):
            paths = {controller: parent / entry.name for controller, parent in parents.items() if (parent / entry.name).is_dir()}
            groups.append(cls(version, paths))
        return groups

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes "0" into to join the group (as root, before any uid change)."""
        return list(self._procs)

    def usage(self) -> WorkerResources:
        """What the group's processes hold now."""
        usage = WorkerResources(counted_by=f"cgroup {self.version}")
        memory = self.paths.get("memory")
        if self.version == "v1":
            if memory is not None:
                usage.memory_mb = _mb(_read_int(memory / "memory.usage_in_bytes"))
                usage.memory_limit_mb = _mb(_read_int(memory / "memory.limit_in_bytes"))
                usage.oom_kills = _read_field(memory / "memory.oom_control", "oom_kill")
            if "pids" in self.paths:
                usage.tasks, usage.tasks_limit = _read_int(self.paths["pids"] / "pids.current"), _read_int(self.paths["pids"] / "pids.max")
            if "cpuacct" in self.paths:
                nanoseconds = _read_int(self.paths["cpuacct"] / "cpuacct.usage")
                usage.cpu_s = nanoseconds / 1e9 if nanoseconds is not None else None
        elif memory is not None:
            usage.memory_mb = _mb(_read_int(memory / "memory.current"))
            usage.memory_limit_mb = _mb(_read_int(memory / "memory.max"))
            usage.oom_kills = _read_field(memory / "memory.events", "oom_kill")
            usage.tasks, usage.tasks_limit = _read_int(memory / "pids.current"), _read_int(memory / "pids.max")
            usage_us = _read_field(memory / "cpu.stat", "usage_usec")
            usage.cpu_s = usage_us / 1e6 if usage_us is not None else None
        return usage

    def memory_files(self) -> dict[str, Path]:
        """The group's memory limit and use, by where a process inside a sandbox reads its own
        (``servers.memory``): so that a worker refuses an episode before the kernel kills it for one."""
        memory = self.paths["memory"]
        if self.version == "v1":
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            return {f"{_ROOT}/memory/{name}": memory / name for name in names}
        return {f"{_ROOT}/{name}": memory / name for name in ("memory.max", "memory.current")}

    def oom_kills(self) -> int | None:
        """How many of the group's processes the kernel's OOM killer has killed."""
        return self.usage().oom_kills

    def remove(self) -> None:
        """Remove the group once its processes are gone (a group that still holds some stays)."""
        for path in dict.fromkeys(self.paths.values()):
            with contextlib.suppress(OSError):
                path.rmdir()

    def _limit(self, limits: GroupLimits) -> None:
        memory_bytes = str(limits.memory_mb * _MB)
        if self.version == "v1":
            memory = self.paths["memory"]
            _write(memory / "memory.limit_in_bytes", memory_bytes)
            # No swap beyond the limit either, where swap is accounted.
            with contextlib.suppress(OSError):
                _write(memory / "memory.memsw.limit_in_bytes", memory_bytes)
            if "pids" in self.paths:
                _write(self.paths["pids"] / "pids.max", str(limits.pids))
            if "cpu" in self.paths:
                _write(self.paths["cpu"] / "cpu.shares", str(max(2, limits.cpu_weight * 1024 // 100)))
        else:
            path = self.paths["memory"]
            _write(path / "memory.max", memory_bytes)
            with contextlib.suppress(OSError):
                _write(path / "memory.swap.max", "0")
            with contextlib.suppress(OSError):
                _write(path / "pids.max", str(limits.pids))
            with contextlib.suppress(OSError):
                _write(path / "cpu.weight", str(limits.cpu_weight))


def _env_tag(env_id: str) -> str:
    """A short, file-name-safe stand-in for ``env_id`` in a group's name."""
    return hashlib.sha256(env_id.encode()).hexdigest()[:12]


def _writable_parents() -> tuple[str, dict[str, Path]]:
    """The cgroup version, and controller -> this process's own group in it, for the controllers whose
    groups can be made here. v2 only where /sys/fs/cgroup is its one hierarchy (no v1 controllers)."""
    if os.geteuid() != 0:
        return "v1", {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "v1", {}
    if (_ROOT / "cgroup.controllers").exists():
        relative = next((line.split(":", 2)[2].lstrip("/") for line in lines if line.startswith("0::")), None)
        if relative is None:
            return "v2", {}
        base = _ROOT / relative
        delegated = _read_text(base / "cgroup.subtree_control").split()
        return "v2", {controller: base for controller in ("memory", "pids", "cpu") if controller in delegated}
    parents: dict[str, Path] = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            base = _ROOT / controller / path.lstrip("/")
            if controller in _V1_CONTROLLERS and os.access(base, os.W_OK):
                parents[controller] = base
    return "v1", parents


_stale_removed = False


def remove_stale_groups() -> None:
    """Remove the groups of servers that are gone, once per process and in what it forks afterwards: a farm's
    zygote does it before its first fork, so that a thousand servers do not each scan a thousand groups."""
    _remove_stale(_writable_parents()[1])


def _remove_stale(parents: dict[str, Path]) -> None:
    """Once per process: remove the groups of servers that are gone (killed before they could)."""
    global _stale_removed
    if _stale_removed:
        return
    _stale_removed = True
    for parent in set(parents.values()):
        with contextlib.suppress(OSError):
            for entry in os.scandir(parent):
                owner = entry.name[len(_PREFIX):].split("-", 1)[0]
                if entry.name.startswith(_PREFIX) and owner.isdigit() and not Path(f"/proc/{owner}").exists():
                    with contextlib.suppress(OSError):
                        os.rmdir(entry.path)  # refused while it holds a process: then it is not stale


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # absent, or "max"
        return None


def _read_field(path: Path, name: str) -> int | None:
    for line in _read_text(path).splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def _mb(value: int | None) -> float | None:
    # v1 reports "no limit" as a number near 2**63.
    return None if value is None or value >= 1 << 60 else round(value / _MB, 1)


def combined(groups: list[ChildGroup]) -> WorkerResources | None:
    """What several groups (one environment's workers) hold together, and may hold; None for none."""
    if not groups:
        return None
    usages = [group.usage() for group in groups]

    def total(field: str) -> float | None:
        values = [getattr(usage, field) for usage in usages]
        return None if any(value is None for value in values) else sum(values)

    return WorkerResources(counted_by=usages[0].counted_by, memory_mb=total("memory_mb"), memory_limit_mb=total("memory_limit_mb"),
                           tasks=total("tasks"), tasks_limit=total("tasks_limit"), cpu_s=total("cpu_s"), oom_kills=total("oom_kills"))
