"""What the ray backend runs on a node of the cluster: an actor holding a few environments' servers.

:class:`EnvGroup` is the Ray actor class (``servers.farm.backends.ray`` makes it remote): Ray places it
with the resources of its environments, and starts it again (on a live node when its own is lost).
In it, each environment's server is a :class:`ServerSlot`: the same ``envscaler serve`` process as the
process backend (its workers sandboxed), listening on the node's cluster address. A server that exits
is started again by its actor, in a new slot; every start is a new replica id, so an episode of an
earlier start is answered 410 (lost). Nothing here talks to the farm's daemon: it asks.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from pydantic import BaseModel

from envscaler.sandbox import FARM_ID_VARIABLE, clean_environment
from servers.episodes.ids import new_replica_id
from servers.farm.backends.process import describe_exit, log_tail, server_preexec
from servers.farm.backends.spawning import listening_line, serve_command
from servers.serve import READY_FD_VARIABLE

_LISTEN_TIMEOUT_S = 60.0
_STOP_GRACE_S = 5.0


class ServerStart(BaseModel):
    """What a node needs to start one environment's server."""

    farm_id: str
    env_id: str
    token: str
    flags: list[str]
    memory_mb: int
    sandbox: bool


class ServerPlace(BaseModel):
    """Where one start of an environment's server runs, or why it did not start."""

    # The replica id of this start: every start makes a new one.
    incarnation: str
    # ``ADDRESS (node ID…)``, and Ray's whole node id.
    node: str
    node_id: str
    url: str | None = None
    pid: int | None = None
    problem: str | None = None


NODE_FILES = Path(tempfile.gettempdir()) / "envscaler-ray"
"""Where a node keeps the bundles and server logs of the environments it runs, one folder each."""


def node_directory(farm_id: str, env_id: str) -> Path:
    """Where a node keeps one environment's bundle and server log while the farm runs."""
    return NODE_FILES / f"{farm_id}.{env_id}"


class ServerSlot:
    """One start of one environment's server on this node.

    The server is started by a thread that lives as long as the server does: its death-with-parent
    signal follows the thread that forked it, so it dies with the actor and never before.
    """

    def __init__(self, start: ServerStart, address: str, node: str, node_id: str, problem: str | None) -> None:
        self.start = start
        self.incarnation = new_replica_id()
        self.address, self.node, self.node_id = address, node, node_id
        self.directory = node_directory(start.farm_id, start.env_id)
        self.log_path = self.directory / "server.log"
        self.url: str | None = None
        self.problem = problem
        self.child: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None
        self.ready = threading.Event()
        self.exited = threading.Event()
        if problem is not None:
            self.ready.set()
            self.exited.set()
            return
        threading.Thread(target=self._run, name=f"server {start.env_id}", daemon=True).start()

    def _run(self) -> None:
        command = serve_command(str(self.directory / "bundle"), self.address, 0, ["--replica-id", self.incarnation, *self.start.flags])
        environment = clean_environment({"ENVSCALER_TOKEN": self.start.token, FARM_ID_VARIABLE: self.start.farm_id,
                                         "MALLOC_ARENA_MAX": "2"})
        read_fd, write_fd = os.pipe()
        try:
            with open(self.log_path, "ab") as log_file:
                self.child = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    env={**environment, READY_FD_VARIABLE: str(write_fd)}, pass_fds=(write_fd,), start_new_session=True,
                    preexec_fn=functools.partial(server_preexec, self.start.memory_mb),
                )
        except OSError as e:
            os.close(read_fd)
            self.problem = f"could not start on {self.node}: {e}"
            self.ready.set()
            self.exited.set()
            return
        finally:
            os.close(write_fd)
        port = _read_ready_port(read_fd)
        if port is None:
            self.problem = f"exited before it listened on {self.node} ({describe_exit(self.child.wait())}): {log_tail(self.log_path)}"
        else:
            self.url = f"http://{self.address}:{port}"
        self.ready.set()
        self.exit_code = self.child.wait()
        self.exited.set()

    def place(self) -> ServerPlace:
        """Where the server listens once it does (or why it did not start), waiting up to a minute."""
        if not self.ready.wait(_LISTEN_TIMEOUT_S):
            self.signal(signal.SIGKILL)
            return ServerPlace(incarnation=self.incarnation, node=self.node, node_id=self.node_id,
                               problem=f"did not listen within {_LISTEN_TIMEOUT_S:g} s on {self.node}: {log_tail(self.log_path)}")
        return ServerPlace(incarnation=self.incarnation, node=self.node, node_id=self.node_id, url=self.url, problem=self.problem,
                           pid=self.child.pid if self.child else None)

    def ended(self) -> str:
        """Block until the server exits; how it ended."""
        self.exited.wait()
        if self.exit_code is None:
            return self.problem or "did not start"
        return f"{describe_exit(self.exit_code)} on {self.node}: {log_tail(self.log_path)}"

    def signal(self, signum: int) -> None:
        """Signal the server's whole process group (what it forked goes with it)."""
        if self.child is not None:
            try:
                os.killpg(self.child.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass  # gone already

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; then its files leave the node."""
        self.signal(signal.SIGTERM)
        if not self.exited.wait(_STOP_GRACE_S):
            self.signal(signal.SIGKILL)
            self.exited.wait(1.0)
        shutil.rmtree(self.directory, ignore_errors=True)


def _read_ready_port(fd: int) -> int | None:
    """The port in the server's ready line (``servers.serve``), or None when it closed the pipe first."""
    data = b""
    try:
        while b"\n" not in data:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    ready = listening_line(data)
    return None if ready is None else ready.get("port")


def node_confine_problem() -> str | None:
    """Why this node's servers could not confine their workers (``envscaler.confine.confine_problem``: user
    namespaces and seccomp, no bubblewrap needed), or None. Asked of a fresh interpreter with the servers'
    environment: the probe forks, which this actor's process, with its threads, must not."""
    probe = "from envscaler.confine import confine_problem; print(confine_problem() or '', end='')"
    try:
        done = subprocess.run([sys.executable, "-c", probe], env=clean_environment(), capture_output=True, text=True, timeout=_LISTEN_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"its sandbox probe could not run: {e}"
    if done.returncode != 0:
        return f"its sandbox probe failed: {done.stderr.strip()[-500:] or f'exit status {done.returncode}'}"
    return done.stdout or None


class EnvGroup:
    """A few environments' servers on the node Ray placed this actor on (a Ray actor class).

    ``bundles`` are each environment's files by relative path, in the order of ``starts``. Calls come
    from the farm's daemon, several at once (a threaded actor): one ``ended`` per environment waits
    the whole life of its server.
    """

    def __init__(self, starts: list[ServerStart], *bundles: dict[str, bytes]) -> None:
        import ray

        self.starts = {start.env_id: start for start in starts}
        self.address = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node = f"{self.address} (node {self.node_id[:12]})"
        self.problems: dict[str, str | None] = {}
        unsandboxed = None
        if any(start.sandbox for start in starts) and (problem := node_confine_problem()) is not None:
            unsandboxed = f"node {self.node} cannot sandbox environment code ({problem}); start the farm with --no-sandbox to run it there unsandboxed"
        for start, files in zip(starts, bundles):
            self.problems[start.env_id] = unsandboxed or self._write(start, files)
        self._lock = threading.Lock()
        self.slots = {env_id: self._slot(env_id) for env_id in self.starts}

    def _write(self, start: ServerStart, files: dict[str, bytes]) -> str | None:
        """Write a bundle on this node; why it could not, or None."""
        directory = node_directory(start.farm_id, start.env_id)
        shutil.rmtree(directory, ignore_errors=True)  # an earlier start's, on this node
        try:
            for name, data in files.items():
                path = directory / "bundle" / name
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                path.write_bytes(data)
        except OSError as e:
            return f"node {self.node} cannot write the bundle to {directory}: {e}"
        return None

    def _slot(self, env_id: str) -> ServerSlot:
        return ServerSlot(self.starts[env_id], self.address, self.node, self.node_id, self.problems[env_id])

    def place(self, env_id: str) -> ServerPlace:
        """Where ``env_id``'s current server listens (waiting until it does), or why it did not start."""
        return self.slots[env_id].place()

    def ended(self, env_id: str, incarnation: str) -> str:
        """Block until that start of ``env_id``'s server exits; how it ended."""
        slot = self.slots[env_id]
        return slot.ended() if slot.incarnation == incarnation else "replaced"

    def restart(self, env_id: str, incarnation: str) -> None:
        """Start ``env_id``'s server again, unless that start was replaced already."""
        with self._lock:
            if self.slots[env_id].incarnation == incarnation:
                self.slots[env_id].signal(signal.SIGKILL)
                self.slots[env_id] = self._slot(env_id)

    def kill(self, env_id: str) -> None:
        """SIGKILL ``env_id``'s server (it is hung): its ``ended`` returns, and the daemon restarts it."""
        self.slots[env_id].signal(signal.SIGKILL)

    def stop(self) -> None:
        """Stop every server, at once, and remove their files from this node."""
        stoppers = [threading.Thread(target=slot.stop) for slot in self.slots.values()]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join()
