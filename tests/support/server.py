"""Start a real ``envscaler serve`` process for a test and talk to its control API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

TOKEN = "test-token"


@dataclass
class RunningServer:
    url: str
    token: str
    process: subprocess.Popen

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, **kwargs: Any) -> httpx.Client:
        """An httpx client for the control API, authorised unless ``headers`` says otherwise."""
        kwargs.setdefault("headers", self.headers)
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)


@contextmanager
def serve(bundle_dir: Path | str, *flags: str, token: str = TOKEN, log: Any = None) -> Iterator[RunningServer]:
    """Run ``envscaler serve BUNDLE --port 0`` until the block ends; stderr goes to ``log`` (a file) or the test log.

    ``token=""`` passes no --token: the server takes it from ``flags`` (--token-file) or the environment.
    """
    command = [sys.executable, "-m", "envscaler.cli", "serve", str(bundle_dir), "--port", "0", *(["--token", token] if token else []), *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Its own process group: in the sandbox, a graceful stop is a signal to the group (bwrap forwards none).
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"envscaler serve exited with {process.wait(10)} before listening")
        event = json.loads(line)
        assert event["event"] == "listening", event
        yield RunningServer(url=event["url"], token=token, process=process)
    finally:
        stop(process)


def stop(process: subprocess.Popen, signum: int = signal.SIGTERM) -> None:
    """Signal a server started by ``serve`` (its whole process group) and wait for it; SIGKILL after 10 s."""
    try:
        os.killpg(process.pid, signum)
        process.wait(10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
