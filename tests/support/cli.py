"""Run the ``envscaler`` command line in a child process, as a user would."""

from __future__ import annotations

import subprocess
import sys


def envscaler(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``envscaler ARGS...`` with stdout and stderr captured as text; TimeoutExpired past ``timeout``.

    ``env``: the child's whole environment (default: this process's).
    """
    return subprocess.run([sys.executable, "-m", "envscaler.cli", *args], capture_output=True, text=True, timeout=timeout, env=env)
