"""Run untrusted work in a child Python process with resource limits and no inherited secrets."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
from typing import Any

# Variables a child needs to run Python and nothing else: no tokens, keys or proxies leak in.
_KEPT_ENV = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "TMPDIR", "HOME")
_PR_SET_PDEATHSIG = 1


def clean_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment reduced to what a Python child needs, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k in _KEPT_ENV}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


def limit_resources(memory_mb: int, cpu_s: int | None = None) -> None:
    """Apply limits to the current process (a ``preexec_fn``): address space, CPU, no core dumps."""
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cpu_s is not None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 5))


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``signum`` to the current process when its parent (thread) dies; Linux only.

    Usable as a ``preexec_fn``.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's own stop is all there is


def start_module(
    module: str, args: list[str], *, memory_mb: int, cpu_s: int, stderr: Any
) -> subprocess.Popen[bytes]:
    """``python -m module args`` started in a limited child, its stdout a pipe for the caller to read."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        env=clean_environment(),
        preexec_fn=lambda: limit_resources(memory_mb, cpu_s),
    )


def run_module(
    module: str, args: list[str], *, timeout_s: float, memory_mb: int = 2048
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` in a limited child; TimeoutExpired when it runs past ``timeout_s``."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=clean_environment(),
        preexec_fn=lambda: limit_resources(memory_mb, int(timeout_s) + 1),
        stdin=subprocess.DEVNULL,
    )
