"""How much memory this server may still use: its limit (cgroup or address-space rlimit) minus its use.

A server in a container is killed by the kernel at its cgroup limit, and one under the process
farm's ``RLIMIT_AS`` gets ``MemoryError`` wherever an allocation fails. Either way the episode being
created is lost without a word. Knowing the headroom lets the server refuse a new episode with a
reason instead (``507``), and ``/info`` reports it.
"""

from __future__ import annotations

import ctypes
import os
import resource
from pathlib import Path

from envscaler.wire import MemoryStatus

_MB = 1024 * 1024
# cgroup v1 reports "no limit" as a huge number near 2**63.
_NO_LIMIT = 1 << 60


def memory_status() -> MemoryStatus:
    """The current status; reads a few small files under /proc and /sys (about 20 microseconds: a server
    reads it before every episode it builds)."""
    size_mb, rss_mb = _statm_mb()
    status = MemoryStatus(rss_mb=rss_mb or 0.0)
    for source, limit, used in (_cgroup(), _address_space(size_mb)):
        if limit is None or used is None:
            continue
        headroom = limit - used
        if status.headroom_mb is None or headroom < status.headroom_mb:
            status.limit_mb, status.used_mb, status.headroom_mb, status.limited_by = limit, used, headroom, source
    return status


def release_free_memory() -> None:
    """Give the allocator's free pages back to the kernel (glibc keeps freed heap pages otherwise): after a
    start-up's garbage, or after bodies that a flood of clients made a server hold were dropped."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator keeps what it keeps


def oom_kills() -> int | None:
    """How many processes of this cgroup the kernel's OOM killer has killed, or None where it is not told."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):  # cgroup v2, v1
        try:
            for line in Path(path).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
)
# The pair of files this process found first (index into _CGROUP_FILES): where a group's files are, they stay.
_cgroup_found: int | None = None
_PAGE_MB = resource.getpagesize() / _MB


def _cgroup() -> tuple[str, float | None, float | None]:
    global _cgroup_found
    order = range(len(_CGROUP_FILES)) if _cgroup_found is None else (_cgroup_found,)
    for index in order:
        limit_file, usage_file = _CGROUP_FILES[index]
        limit, used = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and used is not None:
            _cgroup_found = index
            if limit < _NO_LIMIT:
                return "cgroup", limit / _MB, used / _MB
    return "cgroup", None, None


def _address_space(size_mb: float | None) -> tuple[str, float | None, float | None]:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return "address space", None, None
    return "address space", soft / _MB, size_mb


def _read(path: str) -> bytes | None:
    # os, not pathlib: a server reads these before every episode it builds, and pathlib costs ten times the read.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_int(path: str) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:  # "max" (no limit)
        return None


def _statm_mb() -> tuple[float | None, float | None]:
    """This process's address space (VmSize) and resident memory (VmRSS), in MB."""
    text = _read("/proc/self/statm")
    if text is None:
        return None, None
    size, resident = text.split()[:2]
    return int(size) * _PAGE_MB, int(resident) * _PAGE_MB
