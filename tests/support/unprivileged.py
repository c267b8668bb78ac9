"""This project's command line run as an unprivileged user (``nobody``), from a test that runs as root.

The test's interpreter may live where that user cannot reach it (a virtual environment made from an
interpreter under ``/root``): then the system's interpreter of the same version runs it, with this
interpreter's packages and this checkout on its path.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
_CHECKOUT = Path(__file__).resolve().parents[2]
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Unprivileged:
    """How to run this project's command line as user ``NOBODY``, in ``home``: a folder of its own."""

    python: str
    env: dict[str, str]
    home: Path

    def envscaler(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``envscaler ARGS...`` as that user, from its home, stdout and stderr captured as text."""
        return subprocess.run([self.python, "-m", "envscaler.cli", *args], capture_output=True, text=True, timeout=timeout,
                              env=self.env, cwd=self.home, user=NOBODY, group=NOBODY, extra_groups=[])


def _runs_as_nobody(python: str, env: dict[str, str]) -> bool:
    try:
        done = subprocess.run([python, "-c", "import envscaler, servers"], capture_output=True, env=env, cwd="/",
                              user=NOBODY, group=NOBODY, extra_groups=[], timeout=60)
    except OSError:
        return False
    return done.returncode == 0


def _interpreter(home: Path) -> tuple[str, dict[str, str]] | None:
    env = {"PATH": _SYSTEM_PATH, "HOME": str(home), "LANG": "C.UTF-8"}
    if _runs_as_nobody(sys.executable, env):
        return sys.executable, env
    system = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path=_SYSTEM_PATH)
    # Site folders are read for .pth files only as site folders: the checkout (installed editable) goes on the path itself.
    with_packages = env | {"PYTHONPATH": os.pathsep.join([str(_CHECKOUT), *site.getsitepackages()])}
    if system is not None and _runs_as_nobody(system, with_packages):
        return system, with_packages
    return None


def unprivileged_problem() -> str | None:
    """Why :func:`unprivileged` cannot work here, or None."""
    if os.geteuid() != 0:
        return "running commands as another user needs root (.ci/run is root)"
    with tempfile.TemporaryDirectory() as scratch:
        if _interpreter(Path(scratch)) is None:
            return (f"user {NOBODY} can run neither {sys.executable} nor a system python{sys.version_info.major}."
                    f"{sys.version_info.minor} with this checkout's packages")
    return None


@contextmanager
def unprivileged() -> Iterator[Unprivileged]:
    """User ``NOBODY``'s command line, with a home of its own under /tmp (removed after)."""
    home = Path(tempfile.mkdtemp(prefix="envscaler-nobody-", dir="/tmp"))
    try:
        os.chown(home, NOBODY, NOBODY)
        found = _interpreter(home)
        assert found is not None, unprivileged_problem()
        yield Unprivileged(found[0], found[1], home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
