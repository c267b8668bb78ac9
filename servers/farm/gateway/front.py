"""haproxy in front of the farm's gateway: tool calls go to the servers without a Python hop.

Every agent that uses the farm's one URL sends every tool call through the gateway, so its cost per
call caps the whole farm. The Python gateway (``servers.farm.gateway.app``) costs ~230 us of CPU per
call on a 2-core machine, about as much as the tool call itself; haproxy costs ~60-100 us. When
``haproxy`` is installed, the daemon runs it on the farm's public socket and keeps the Python
gateway on a private loopback port behind it:

- haproxy forwards ``/envs/{env_id}/...`` itself (path rewritten, ``X-Envscaler-Base-Url`` set, as
  the Python gateway does) when the request is a plain one: a known environment, a Host header, no
  Origin (CORS is the Python gateway's), no chunked body, a body within the gateway's cap;
- everything else (``/healthz``, ``/envs``, unknown environments, CORS, large or chunked bodies)
  goes to the Python gateway, so its answers stay the farm's answers.

Servers that move (a restarted container gets a new address) are followed through haproxy's
runtime API. Without haproxy, or with ``ENVSCALER_GATEWAY=python``, the Python gateway serves the
public socket itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

import anyio

from envscaler.sandbox import FARM_ID_VARIABLE, clean_environment, die_with_parent
from servers.transport.http_server import Bounds, descriptor_room

log = logging.getLogger("envscaler.farm")

GATEWAY_VARIABLE = "ENVSCALER_GATEWAY"
_RESTART_PAUSE_S = 0.5


def haproxy_executable() -> str | None:
    """The haproxy to put in front, or None: not installed, or ``ENVSCALER_GATEWAY=python``."""
    if os.environ.get(GATEWAY_VARIABLE, "").lower() == "python":
        return None
    return shutil.which("haproxy")


def _server_address(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 80}"


def _quoted(text: str) -> str:
    """A haproxy configuration string in double quotes."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_config(
    env_ids: list[str], routes: Mapping[str, str], fallback: str, listen_fd: int, routes_map: Path, admin_socket: Path, max_body: int,
    bounds: Bounds | None = None,
) -> str:
    """The haproxy configuration: one backend per environment, the Python gateway as the default.

    ``listen_fd`` is the farm's public socket, inherited: the daemon binds it (and knows its port).
    ``bounds`` are what the farm's clients may hold (``servers.transport.http_server.Bounds``, the Python
    gateway's too): connections in all and per client address (a connection past either is refused
    at once), and the time a request head may take.
    """
    bounds = bounds or Bounds()
    max_connections = min(bounds.max_connections or descriptor_room(), descriptor_room())
    error_bodies = {
        503: "environment %[var(txn.env)] is not answering: no connection to its server",
        504: "environment %[var(txn.env)] did not answer in time",
        502: "environment %[var(txn.env)] gave a broken answer",
    }
    lines = [
        "global",
        f"    stats socket {admin_socket} mode 600 level admin",
        "    hard-stop-after 5s",
        f"    maxconn {max_connections}",
        "defaults",
        "    mode http",
        "    timeout connect 5s",
        # A client that neither sends nor reads for this long is cut; it waits on no one while a
        # server works (tool calls and validations are bounded by the servers themselves).
        f"    timeout client {bounds.write_timeout_s:g}s",
        "    timeout server 300s",
        f"    timeout http-request {bounds.head_timeout_s:g}s",
        "    timeout http-keep-alive 75s",
        "    option http-keep-alive",
        "    http-reuse always",
        "    retries 2",
    ]
    for status, text in error_bodies.items():
        body = '{"error":"' + text + '"}'
        lines.append(f"    http-error status {status} content-type application/json lf-string {_quoted(body)}")
    lines += [
        "frontend gateway",
        f"    bind fd@{listen_fd}",
        f"    maxconn {max_connections}",
        # Connections per client address, counted as they open: one client cannot hold every slot.
        "    stick-table type ip size 1m expire 60s store conn_cur",
        "    tcp-request connection track-sc0 src",
        f"    tcp-request connection reject if {{ sc0_conn_cur gt {bounds.max_connections_per_client} }}",
        "    acl env_path path_beg /envs/",
        "    acl has_host req.hdr(host) -m found",
        "    acl from_browser req.hdr(origin) -m found",
        "    acl chunked req.hdr(transfer-encoding) -m found",
        f"    acl too_large req.hdr_val(content-length) gt {max_body}",
        "    http-request set-var(txn.env) path,field(3,/)",
        f"    http-request set-var(txn.backend) var(txn.env),map({routes_map}) if env_path has_host !from_browser !chunked !too_large",
        "    acl routed var(txn.backend) -m found",
        "    http-request set-header x-envscaler-base-url http://%[req.hdr(host)]/envs/%[var(txn.env)] if routed",
        "    http-request set-path / if routed { path_reg ^/envs/[^/]*$ }",
        r"    http-request replace-path ^/envs/[^/]*(/.*)$ \1 if routed",
        "    use_backend %[var(txn.backend)] if routed",
        "    default_backend python_gateway",
        "backend python_gateway",
        f"    server gateway {_server_address(fallback)}",
    ]
    for number, env_id in enumerate(env_ids):
        lines += [f"backend env_{number}", f"    server server {_server_address(routes[env_id])}"]
    return "\n".join(lines) + "\n"


def render_map(env_ids: list[str]) -> str:
    """env_id -> backend name, one per line (haproxy map file)."""
    return "".join(f"{env_id} env_{number}\n" for number, env_id in enumerate(env_ids))


class FrontProxy:
    """Runs haproxy on the farm's public socket, restarts it if it dies, follows servers that move."""

    def __init__(
        self, executable: str, farm_dir: Path, farm_id: str, sock: socket.socket, routes: Mapping[str, str], fallback: str, max_body: int,
        bounds: Bounds,
    ) -> None:
        self.executable = executable
        self.bounds = bounds
        self.farm_id = farm_id
        self.sock = sock
        self.env_ids = sorted(routes)
        self.routes = routes
        self.config = farm_dir / "haproxy.cfg"
        self.admin_socket = farm_dir / "haproxy.sock"
        routes_map = farm_dir / "haproxy.map"
        routes_map.write_text(render_map(self.env_ids))
        self._sent = {env_id: routes[env_id] for env_id in self.env_ids}
        self.config.write_text(
            render_config(self.env_ids, self._sent, fallback, sock.fileno(), routes_map, self.admin_socket, max_body, self.bounds)
        )
        self.process: subprocess.Popen[bytes] | None = None
        self._stopping = False

    def version(self) -> str:
        """``haproxy 2.6.12``."""
        result = subprocess.run([self.executable, "-v"], capture_output=True, text=True, check=False)
        words = result.stdout.split()
        return f"haproxy {words[2].split('-')[0]}" if len(words) > 2 else "haproxy"

    def check(self) -> None:
        """Refuse a configuration haproxy would not load (raises RuntimeError with its words)."""
        result = subprocess.run(
            [self.executable, "-c", "-f", str(self.config)], capture_output=True, text=True, check=False, pass_fds=[self.sock.fileno()]
        )
        if result.returncode != 0:
            raise RuntimeError(f"haproxy refused {self.config}: {(result.stderr or result.stdout).strip()[-2000:]}")

    async def run(self, log_path: Path) -> None:
        """Serve the public socket with haproxy until cancelled; a haproxy that dies is started again."""
        while not self._stopping:
            self.process = self._start(log_path)
            try:
                while self.process.poll() is None:
                    await anyio.sleep(0.5)
                    self._follow_moves()
            finally:
                if self.process.poll() is None:
                    self.stop()
            if not self._stopping:
                log.warning("haproxy exited; starting it again", extra={"exit": self.process.returncode, "log": str(log_path)})
                await anyio.sleep(_RESTART_PAUSE_S)

    def _start(self, log_path: Path) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as output:
            return subprocess.Popen(
                [self.executable, "-W", "-db", "-f", str(self.config)],
                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                # The farm id lets ``farm down`` find it after the daemon was killed.
                env=clean_environment({FARM_ID_VARIABLE: self.farm_id}),
                pass_fds=[self.sock.fileno()],
                preexec_fn=die_with_parent,
            )

    def _follow_moves(self) -> None:
        """Point haproxy at servers whose address changed (a container restarted elsewhere)."""
        for number, env_id in enumerate(self.env_ids):
            target = self.routes.get(env_id)
            if target is None or target == self._sent[env_id]:
                continue
            host, _, port = _server_address(target).rpartition(":")
            if self._admin(f"set server env_{number}/server addr {host} port {port}"):
                self._sent[env_id] = target

    def _admin(self, command: str) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as admin:
                admin.settimeout(2.0)
                admin.connect(str(self.admin_socket))
                admin.sendall(command.encode() + b"\n")
                answer = admin.recv(4096).decode(errors="replace")
        except OSError as e:
            log.warning("haproxy's runtime API did not answer", extra={"command": command, "error": repr(e)})
            return False
        return "No such" not in answer and "Require" not in answer

    def stop(self) -> None:
        """Stop haproxy (gracefully: it finishes the answers under way, within hard-stop-after)."""
        self._stopping = True
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)
            try:
                self.process.wait(6.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

