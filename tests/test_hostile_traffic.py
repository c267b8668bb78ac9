"""Nothing an agent sends costs more than its own episode: hostile traffic against a real farm on loopback.

The attacker connects from 127.0.0.2, a bystander agent from 127.0.0.1 keeps calling through the
gateway with correct results while each attack runs, and the daemon and its servers stay up with
their memory and descriptors under the stated bounds. Every attack is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from servers.transport.http_server import Bounds
from servers.protocols.sse import MAX_STREAMS_PER_EPISODE
from tests.support.bundles import counter_bundle
from tests.support.cli import envscaler
from tests.support.farm import read_state
from tests.support.hostile import call
from tests.support.rogue import rogue_bundle

pytestmark = pytest.mark.timeout(600)

ATTACKER = "127.0.0.2"
PER_CLIENT = 100
HEAD_TIMEOUT_S = Bounds().head_timeout_s
MB = 1024 * 1024


@dataclass
class Farm:
    catalog: Path
    gateway: str
    envs: dict

    @property
    def state(self) -> dict:
        return read_state(self.catalog)

    def episode(self, env_id: str, scenario_id: str) -> dict:
        endpoint = self.envs[env_id]
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {endpoint['token']}"}) as http:
            created = http.post(f"{self.gateway}/envs/{env_id}/episodes", json={"scenario_id": scenario_id})
            assert created.status_code == 201, created.text
            return created.json()

    def bystander_calls(self, calls: int = 5) -> None:
        """A fresh counter episode, through the gateway from 127.0.0.1: every call answers, and the count adds up."""
        episode = self.episode("counter", "counter_001")
        with httpx.Client(timeout=60) as http:
            for number in range(1, calls + 1):
                result = call(http, episode["mcp_url"], "add", {"item_id": "a"})
                assert not result["isError"] and json.loads(result["content"][0]["text"])["data"]["count"] == number, result


@contextlib.contextmanager
def farm_up(root: Path, *flags: str, env: dict | None = None) -> Iterator[Farm]:
    catalog = root / "farm.json"
    up = envscaler("farm", "up", str(rogue_bundle(root / "rogue")), str(counter_bundle(root / "counter")), "--backend", "process",
                   "--catalog", str(catalog), "--connections-per-client", str(PER_CLIENT), *flags, env=env)
    assert up.returncode == 0, up.stderr
    try:
        data = json.loads(catalog.read_text())
        yield Farm(catalog, data["gateway"], data["envs"])
    finally:
        assert envscaler("farm", "down", "--catalog", str(catalog)).returncode == 0


@pytest.fixture(scope="module")
def python_gateway(tmp_path_factory) -> Iterator[Farm]:
    with farm_up(tmp_path_factory.mktemp("python"), env={**os.environ, "ENVSCALER_GATEWAY": "python"}) as farm:
        assert farm.state["gateway_proxy"] == "python", farm.state
        yield farm


@pytest.fixture(scope="module")
def haproxy_gateway(tmp_path_factory) -> Iterator[Farm]:
    with farm_up(tmp_path_factory.mktemp("haproxy")) as farm:
        assert "haproxy" in farm.state["gateway_proxy"], farm.state
        yield farm


@pytest.fixture(scope="module", autouse=True)
def enough_descriptors() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    return host, int(port)


def attacker_connection(url: str) -> socket.socket | None:
    """A connection from the attacker's address; None when it was refused before connect() returned (on
    loopback haproxy's reset of a connection past the per-client limit can arrive that soon)."""
    try:
        return socket.create_connection(address(url), timeout=10, source_address=(ATTACKER, 0))
    except ConnectionResetError:
        return None


def open_slow(url: str, count: int) -> list[socket.socket]:
    """Up to ``count`` connections from the attacker's address, each with half a request head sent (those
    refused while they were opened are left out)."""
    sockets = []
    for _ in range(count):
        sock = attacker_connection(url)
        if sock is None:
            continue
        with contextlib.suppress(OSError):  # refused already
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        sockets.append(sock)
    return sockets


def wait_for_the_attackers_slots(url: str) -> None:
    """Until a request from the attacker's address is answered again: a gateway counts a client's
    connections until it has closed its own side of them, after the client closed its."""
    deadline = time.monotonic() + 30
    while True:
        sock = attacker_connection(url)
        if sock is not None:
            with sock:
                with contextlib.suppress(OSError):
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if answer_or_eof(sock, 5):
                    return
        assert time.monotonic() < deadline, "the attacker's earlier connections still count at the gateway after 30 s"
        time.sleep(0.2)


def answer_or_eof(sock: socket.socket, timeout_s: float) -> bytes | None:
    """What the server sent before closing (b"" for a plain close or a reset), or None when it has neither
    answered nor closed within ``timeout_s``."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None if not received else received
    return received


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


@pytest.mark.parametrize("gateway", ["python_gateway", "haproxy_gateway"])
def test_slow_heads_past_the_per_client_limit_are_refused_and_the_rest_cut_in_time(gateway, request):
    farm: Farm = request.getfixturevalue(gateway)
    daemon = farm.state["daemon_pid"]
    before = descriptors(daemon)
    slow = open_slow(farm.gateway, PER_CLIENT + 50)
    try:
        opened = time.monotonic()
        farm.bystander_calls()
        # Past the per-client limit a connection is refused at once: the Python gateway's 503, haproxy's
        # close (its threads count as connections come, so which ones it refuses may interleave).
        time.sleep(1.0)
        poller = select.poll()
        for sock in slow:
            poller.register(sock, select.POLLIN)
        answered = {fd for fd, _ in poller.poll(0)}
        readable = [sock for sock in slow if sock.fileno() in answered]
        held = [sock for sock in slow if sock not in readable]
        refused = [answer_or_eof(sock, 5) for sock in readable]
        assert all(answer == b"" or answer.startswith(b"HTTP/1.1 503") for answer in refused), {(a or b"")[:60] for a in refused}
        assert PER_CLIENT - 2 <= len(held) <= PER_CLIENT + 2, len(held)
        assert descriptors(daemon) <= before + PER_CLIENT + 10
        # The others are cut once their head has not arrived within the limit, whatever they still send.
        for sock in held:
            with contextlib.suppress(OSError):
                sock.sendall(b"X-Slow: 1\r\n")
        answers = [answer_or_eof(sock, HEAD_TIMEOUT_S + 10) for sock in held]
        assert time.monotonic() - opened < HEAD_TIMEOUT_S + 15
        assert all(answer == b"" or answer.startswith(b"HTTP/1.1 408") for answer in answers), {(a or b"")[:60] for a in answers}
        farm.bystander_calls()
    finally:
        for sock in slow:
            sock.close()
    assert envscaler("farm", "status", "--catalog", str(farm.catalog)).returncode == 0
    assert descriptors(daemon) <= before + 10


def test_answers_that_are_never_read_hold_one_answer_per_connection(python_gateway):
    farm = python_gateway
    server = farm.state["envs"]["rogue"]["pid"]
    episode = farm.episode("rogue", "rogue_001")
    path = f"/episodes/{episode['episode_id']}/mcp"  # on the server itself, not through the gateway
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "blob", "arguments": {"kb": 1024}}}).encode()
    one = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
    before = rss_mb(server)
    attackers = []
    try:
        for _ in range(20):
            sock = socket.create_connection(address(farm.envs["rogue"]["url"]), timeout=10, source_address=(ATTACKER, 0))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(one * 10)  # ten calls pipelined, whose 1 MB answers are never read
            attackers.append(sock)
        time.sleep(3)
        farm.bystander_calls()
        # 20 connections x 10 answers would be 200 MB; one answer each is held, the rest wait unrun.
        assert rss_mb(server) - before < 80, (before, rss_mb(server))
    finally:
        for sock in attackers:
            sock.close()
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {farm.envs['rogue']['token']}"}) as http:
        trajectory = http.get(f"{farm.envs['rogue']['url']}/episodes/{episode['episode_id']}/trajectory").json()
    # What ran: the answers the kernel's socket buffers took (a few MB per connection on loopback), one more
    # held by the server; never all 200.
    assert len(trajectory["calls"]) <= 20 * 5, len(trajectory["calls"])


def test_unfinished_chunked_bodies_hold_at_most_the_gateways_bound(haproxy_gateway):
    farm = haproxy_gateway
    wait_for_the_attackers_slots(farm.gateway)
    daemon = farm.state["daemon_pid"]
    before = rss_mb(daemon)
    chunk = b"%x\r\n%s\r\n" % (MB, b"y" * MB)
    attackers, refused = [], 0
    try:
        for _ in range(12):
            sock = attacker_connection(farm.gateway)
            if sock is None:
                refused += 1
                continue
            sock.sendall(b"POST /envs/counter/episodes HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            try:
                for _ in range(10):
                    sock.sendall(chunk)  # never the last chunk
            except OSError:
                refused += 1
            attackers.append(sock)
        time.sleep(1)
        farm.bystander_calls()
        # 120 MB sent; the gateway holds at most four of its largest bodies (64 MB), and refuses the rest.
        assert rss_mb(daemon) - before < 64 + 30, (before, rss_mb(daemon))
    finally:
        for sock in attackers:
            sock.close()
    farm.bystander_calls()
    # And the memory is given back once those clients are gone (their refusals linger 2 s, the sweep runs each second).
    deadline = time.monotonic() + 10
    while rss_mb(daemon) - before > 20:
        assert time.monotonic() < deadline, (before, rss_mb(daemon))
        time.sleep(0.5)


def test_an_episode_holds_a_bounded_number_of_event_streams(haproxy_gateway):
    farm = haproxy_gateway
    episode = farm.episode("counter", "counter_001")
    sse_url = episode["mcp_url"].removesuffix("/mcp") + "/sse"
    with contextlib.ExitStack() as streams:
        clients = [streams.enter_context(httpx.Client(timeout=30)) for _ in range(MAX_STREAMS_PER_EPISODE + 1)]
        for client in clients[:MAX_STREAMS_PER_EPISODE]:
            response = streams.enter_context(client.stream("GET", sse_url))
            assert response.status_code == 200
        refused = clients[-1].get(sse_url)
        assert refused.status_code == 429 and "open event streams" in refused.json()["error"], refused.text
        farm.bystander_calls()
