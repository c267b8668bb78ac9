"""The farm's gateway over real sockets: keep-alive and pipelined clients, both MCP eras, event streams,
large and chunked bodies, servers that restart, stall, or die in the middle of an answer.

The gateway is the one the farm daemon serves (``Gateway`` on ``HttpServer``), in a thread; behind it
either a real ``envscaler serve`` or a small scripted HTTP server (``Upstream``) that misbehaves on
purpose in ways a real environment server only does when it crashes.
"""

from __future__ import annotations

import asyncio
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from envscaler import default_catalog, load_bundle
from servers.farm.gateway.app import MAX_BODY, Gateway
from servers.transport.http_server import HttpServer
from servers.serve import bind
from tests.support.server import TOKEN, serve

ENV = "library_circulation"
BUNDLE = default_catalog() / ENV
SCENARIO = load_bundle(BUNDLE).scenarios[0]
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODERN = {"MCP-Protocol-Version": "2026-07-28", "Accept": "application/json, text/event-stream"}


@contextmanager
def gateway(routes: dict[str, str], *, read_timeout_s: float = 30.0) -> Iterator[tuple[str, Gateway]]:
    """The farm's gateway on 127.0.0.1 over ``routes`` (a live dict); yields its base URL."""
    app = Gateway(routes, read_timeout_s=read_timeout_s)
    server = HttpServer(app, max_body_bytes=MAX_BODY)
    sock = bind("127.0.0.1", 0)
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(sock, on_ready=ready.set),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        loop.call_soon_threadsafe(server.stop)
        thread.join(10)
        loop.close()


class Upstream(socketserver.ThreadingTCPServer):
    """A scripted HTTP/1.1 server: what it answers depends on the request path (see ``_Handler``)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.release = threading.Event()
        self.upstream_closed = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(socketserver.StreamRequestHandler):
    server: Upstream

    def handle(self) -> None:
        self.server.connections += 1
        while True:
            line = self.rfile.readline()
            if not line:
                return
            path = line.split()[1].decode()
            headers = {}
            while (header := self.rfile.readline()) not in (b"\r\n", b""):
                name, _, value = header.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            body = self.rfile.read(int(headers.get("content-length", "0")))
            self.server.requests.append((path, headers, body))
            if not self.answer(path, body):
                return

    def answer(self, path: str, body: bytes) -> bool:
        """Answer one request; False to close the connection."""
        out = self.wfile
        if path == "/echo":
            out.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        elif path == "/die-mid-body":
            out.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"x" * 10)
            out.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return False
        elif path in ("/stream", "/die-mid-stream", "/endless"):
            out.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            out.write(b"6\r\nfirst\n\r\n")
            out.flush()
            if path == "/die-mid-stream":
                time.sleep(0.2)
                self.connection.shutdown(socket.SHUT_RDWR)
                return False
            if path == "/endless":
                # Keep the stream open until the gateway closes its side.
                self.connection.settimeout(30)
                if self.connection.recv(1) == b"":
                    self.server.upstream_closed.set()
                return False
            self.server.release.wait(10)
            out.write(b"7\r\nsecond\n\r\n0\r\n\r\n")
        elif path == "/slow":
            time.sleep(2)
            out.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        else:
            out.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        out.flush()
        return True


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, bytes]:
    """One Content-Length response from ``sock`` (leftover bytes stay in ``buffer``)."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before a whole response head"
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines[1:] if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed in the middle of a body"
        rest += chunk
    buffer[:] = rest[length:]
    return int(lines[0].split()[1]), rest[:length]


def create_episode(base: str) -> dict:
    response = httpx.post(f"{base}/episodes", json={"scenario_id": SCENARIO.task_id}, headers=AUTH, timeout=30)
    assert response.status_code == 201, response.text
    return response.json()


def test_both_mcp_eras_and_the_control_routes_go_through(tmp_path):
    with serve(BUNDLE) as server, gateway({ENV: server.url}) as (url, _), httpx.Client(timeout=30) as http:
        base = f"{url}/envs/{ENV}"
        episode = create_episode(base)
        # The server hands out MCP URLs on the gateway (X-Envscaler-Base-Url).
        assert episode["mcp_url"].startswith(f"{base}/episodes/")
        tool = SCENARIO.reference_solution[0]
        call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": tool.name, "arguments": tool.arguments}}
        modern = http.post(episode["mcp_url"], json=call, headers={**MODERN, **AUTH, "Mcp-Method": "tools/call", "Mcp-Name": tool.name})
        assert modern.status_code == 200 and modern.json()["result"]["isError"] is False, modern.text

        # The handshake era: initialize, then plain requests (the episode id, not a session, keys state).
        legacy = {**AUTH, "Accept": "application/json, text/event-stream"}
        init = http.post(episode["mcp_url"], headers=legacy, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}})
        assert init.status_code == 200 and init.json()["result"]["protocolVersion"] == "2025-06-18", init.text
        legacy["MCP-Protocol-Version"] = "2025-06-18"
        http.post(episode["mcp_url"], headers=legacy, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        listed = http.post(episode["mcp_url"], headers=legacy, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
        assert listed.status_code == 200 and tool.name in listed.text

        episode_url = f"{base}/episodes/{episode['episode_id']}"
        assert http.get(f"{episode_url}/state", headers=AUTH).status_code == 200
        assert http.get(f"{episode_url}/trajectory", headers=AUTH).json()["calls"]
        assert "score" in http.post(f"{episode_url}/validate", headers=AUTH).json()
        assert http.delete(episode_url, headers=AUTH).status_code in (200, 204)
        assert http.get(f"{url}/healthz").json()["envs"] == 1
        assert http.get(f"{url}/envs").json() == {"envs": [ENV]}
        missing = http.get(f"{url}/envs/nope/info")
        assert missing.status_code == 404 and "'nope'" in missing.json()["error"]


def test_pipelined_requests_on_one_keep_alive_connection_reuse_one_upstream_connection(upstream):
    with gateway({"echoer": upstream.url}) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            requests = b"".join(b"POST /envs/echoer/echo HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                                for body in (b"one", b"two", b"three"))
            sock.sendall(requests)  # all three in one write: answered in order
            buffer = bytearray()
            assert [read_response(sock, buffer) for _ in range(3)] == [(200, b"one"), (200, b"two"), (200, b"three")]
            for number in range(20):
                sock.sendall(b"GET /envs/echoer/ok HTTP/1.1\r\nhost: x\r\n\r\n")
                assert read_response(sock, buffer) == (200, b"ok")
    assert upstream.connections == 1
    # Framing is the gateway's own: a Content-Length, never the client's Host or hop-by-hop headers.
    path, headers, _ = upstream.requests[0]
    assert path == "/echo" and headers["content-length"] == "3" and headers["host"] == upstream.url.removeprefix("http://")
    assert headers["x-envscaler-base-url"] == "http://x/envs/echoer"


def test_large_and_chunked_request_bodies(upstream):
    with gateway({"echoer": upstream.url}) as (url, _), httpx.Client(timeout=60) as http:
        big = bytes(range(256)) * (15 * 1024 * 1024 // 256)
        echoed = http.post(f"{url}/envs/echoer/echo", content=big)
        assert echoed.status_code == 200 and echoed.content == big

        def parts() -> Iterator[bytes]:
            yield b"chunked "
            yield b"request body"

        chunked = http.post(f"{url}/envs/echoer/echo", content=parts())  # sent with Transfer-Encoding: chunked
        assert chunked.status_code == 200 and chunked.content == b"chunked request body"
        assert upstream.requests[-1][1]["content-length"] == "20" and "transfer-encoding" not in upstream.requests[-1][1]

        too_big = http.post(f"{url}/envs/echoer/echo", content=b"x" * (MAX_BODY + 1))
        assert too_big.status_code == 413
        assert len(upstream.requests) == 2  # the refused body never reached the server


def test_a_chunked_answer_streams_as_it_comes(upstream):
    with gateway({"streamer": upstream.url}) as (url, _), httpx.Client(timeout=30) as http:
        with http.stream("GET", f"{url}/envs/streamer/stream") as response:
            parts = response.iter_raw()
            assert next(parts) == b"first\n"  # before the server has sent the rest
            upstream.release.set()
            assert b"".join(parts) == b"second\n"
        # Then the connection to the server is used again.
        assert http.get(f"{url}/envs/streamer/ok").text == "ok"
    assert upstream.connections == 1


def test_an_event_stream_from_a_real_server_streams_and_carries_answers():
    with serve(BUNDLE) as server, gateway({ENV: server.url}) as (url, _), httpx.Client(timeout=30) as http:
        episode_url = f"{url}/envs/{ENV}/episodes/{create_episode(f'{url}/envs/{ENV}')['episode_id']}"
        with http.stream("GET", f"{episode_url}/sse", headers=AUTH) as stream:
            lines = stream.iter_lines()
            assert next(lines) == "event: endpoint"
            endpoint = next(lines).removeprefix("data: ")
            assert endpoint.startswith("messages?session_id=")
            posted = http.post(f"{episode_url}/{endpoint}", headers=AUTH, json={"jsonrpc": "2.0", "id": 7, "method": "tools/list"})
            assert posted.status_code == 202
            for line in lines:
                if line.startswith("data: ") and '"id":7' in line:
                    assert "tools" in line
                    break


def test_a_client_leaving_a_stream_closes_the_upstream_connection(upstream):
    with gateway({"streamer": upstream.url}) as (url, _):
        with httpx.Client(timeout=30) as http, http.stream("GET", f"{url}/envs/streamer/endless") as response:
            assert next(response.iter_raw()) == b"first\n"
        assert upstream.upstream_closed.wait(10)


def test_a_server_dying_mid_answer_is_a_502_or_a_cut_stream_and_nothing_hangs(upstream):
    with gateway({"crasher": upstream.url}) as (url, _), httpx.Client(timeout=15) as http:
        started = time.monotonic()
        answer = http.get(f"{url}/envs/crasher/die-mid-body")
        assert answer.status_code == 502 and "'crasher'" in answer.json()["error"], answer.text
        with pytest.raises(httpx.RemoteProtocolError):
            with http.stream("GET", f"{url}/envs/crasher/die-mid-stream") as response:
                for _ in response.iter_raw():
                    pass
        assert http.get(f"{url}/envs/crasher/ok").text == "ok"  # the gateway goes on
        assert time.monotonic() - started < 10


def test_a_stopped_server_is_a_502_and_a_silent_one_a_504(upstream):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    nobody = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    with gateway({"gone": nobody, "slow": upstream.url}, read_timeout_s=0.5) as (url, _), httpx.Client(timeout=15) as http:
        gone = http.post(f"{url}/envs/gone/episodes", json={})
        assert gone.status_code == 502 and "environment 'gone' is not answering" in gone.json()["error"]
        slow = http.get(f"{url}/envs/slow/slow")
        assert slow.status_code == 504 and "environment 'slow' did not answer in time" in slow.json()["error"]


def test_a_server_restarted_on_its_port_is_reached_again_and_routes_are_live(tmp_path):
    routes: dict[str, str] = {}
    with gateway(routes) as (url, _), httpx.Client(timeout=30) as http:
        with serve(BUNDLE) as first:
            routes[ENV] = first.url
            port = first.url.rsplit(":", 1)[1]
            assert http.post(f"{url}/envs/{ENV}/episodes", json={"scenario_id": SCENARIO.task_id}, headers=AUTH).status_code == 201
        # Same port, new process (the process backend's restart): a POST, which is never sent twice,
        # goes on a new connection because the old one was seen closed.
        with serve(BUNDLE, "--port", port) as second:
            assert second.url == routes[ENV]
            again = http.post(f"{url}/envs/{ENV}/episodes", json={"scenario_id": SCENARIO.task_id}, headers=AUTH)
            assert again.status_code == 201, again.text
        # A server that moved (docker): the route is read on every request.
        with serve(BUNDLE) as moved:
            routes[ENV] = moved.url
            assert http.post(f"{url}/envs/{ENV}/episodes", json={"scenario_id": SCENARIO.task_id}, headers=AUTH).status_code == 201
