"""Start real ``envscaler serve --openenv-port 0`` processes, in parallel (each imports openenv-core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.server import TOKEN, RunningServer, stop


@dataclass
class OpenEnvServer(RunningServer):
    openenv_url: str = ""


@contextmanager
def serve_openenv(bundle_dirs: list[Path], *flags: str) -> Iterator[list[OpenEnvServer]]:
    """One server per bundle, each with its OpenEnv listener, until the block ends."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "envscaler.cli", "serve", str(d), "--port", "0", "--token", TOKEN, "--openenv-port", "0",
             "--log-level", "warning", *flags],
            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )
        for d in bundle_dirs
    ]
    try:
        servers = []
        for process in processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"envscaler serve exited with {process.wait(10)} before listening")
            event = json.loads(line)
            servers.append(OpenEnvServer(url=event["url"], token=TOKEN, process=process, openenv_url=event["openenv_url"]))
        yield servers
    finally:
        for process in processes:
            stop(process)
