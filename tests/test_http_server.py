"""The environment server's HTTP/1.1 transport, byte for byte over real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from servers.transport.http_server import HttpServer
from tests.support.http_responses import read_response
from servers.serve import bind


@dataclass
class Running:
    port: int
    server: HttpServer
    loop: asyncio.AbstractEventLoop
    lifespan: list[str] = field(default_factory=list)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.stop)


def make_app(lifespan: list[str]):
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                lifespan.append(message["type"])
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = (await receive())["body"]
        path = scope["path"]
        if path == "/boom":
            raise RuntimeError("application bug")
        if path == "/slow":
            await asyncio.sleep(0.3)
        if path.startswith("/stream"):
            headers = [(b"content-length", b"10")] if path == "/stream-length" else []
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"hello", "more_body": True})
            await send({"type": "http.response.body", "body": b"world"})
            return
        reply = json.dumps({"method": scope["method"], "path": path, "query": scope["query_string"].decode(),
                            "body": body.decode(), "http": scope["http_version"]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": reply})

    return app


@contextmanager
def running(**options) -> Iterator[Running]:
    lifespan: list[str] = []
    server = HttpServer(make_app(lifespan), max_body_bytes=options.pop("max_body_bytes", 1000), **options)
    sock = bind("127.0.0.1", 0)
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(sock, on_ready=ready.set)), daemon=True)
    thread.start()
    assert ready.wait(5)
    handle = Running(sock.getsockname()[1], server, loop, lifespan)
    try:
        yield handle
    finally:
        handle.stop()
        thread.join(10)
        loop.close()


def closed_by_server(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)


def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    with running() as server, server.connect() as conn:
        conn.sendall(post("/slow?x=1", b"first") + post("/a%20b", b"second") + b"GET /third HTTP/1.1\r\nHost: t\r\n\r\n")
        buffer = bytearray()
        answers = [json.loads(read_response(conn, buffer)[2]) for _ in range(3)]
        assert [(a["path"], a["body"]) for a in answers] == [("/slow", "first"), ("/a b", "second"), ("/third", "")]
        assert answers[0]["query"] == "x=1"
        conn.sendall(post("/again", b"{}"))
        status, headers, _ = read_response(conn, buffer)
        assert status == b"HTTP/1.1 200 OK" and b"connection" not in headers
    assert server.lifespan == ["lifespan.startup", "lifespan.shutdown"]


def test_chunked_request_bodies_are_assembled():
    with running() as server, server.connect() as conn:
        conn.sendall(b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        assert json.loads(read_response(conn, bytearray())[2])["body"] == "hello world"


def test_a_body_over_the_limit_gets_413_and_the_connection_closes():
    with running(max_body_bytes=100) as server:
        with server.connect() as conn:
            conn.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n")  # refused before the body
            status, headers, body = read_response(conn, bytearray())
            assert status.startswith(b"HTTP/1.1 413") and headers[b"connection"] == b"close"
            assert "limit of 100 bytes" in json.loads(body)["error"]
            assert closed_by_server(conn)
        with server.connect() as conn:
            chunk = b"x" * 80
            conn.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + (b"50\r\n" + chunk + b"\r\n") * 2 + b"0\r\n\r\n")
            assert read_response(conn, bytearray())[0].startswith(b"HTTP/1.1 413")


def test_a_client_that_sends_its_whole_refused_body_still_reads_the_413():
    # Far more than the socket buffers hold: a server that closed with this unread would reset the
    # connection, and the client would lose the answer (or get EPIPE while it still sends).
    body = b"x" * (16 * 1024 * 1024)
    with running(max_body_bytes=100) as server, server.connect() as conn:
        conn.sendall(post("/x", body))
        status, headers, answer = read_response(conn, bytearray())
        assert status.startswith(b"HTTP/1.1 413") and headers[b"connection"] == b"close"
        assert "limit of 100 bytes" in json.loads(answer)["error"]
        assert closed_by_server(conn)


def test_expect_100_continue_is_answered_before_the_body():
    with running() as server, server.connect() as conn:
        conn.sendall(b"POST /e HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        buffer = bytearray()
        assert read_response(conn, buffer)[0] == b"HTTP/1.1 100 Continue"
        conn.sendall(b"ok")
        assert json.loads(read_response(conn, buffer)[2])["body"] == "ok"


def test_malformed_requests_and_upgrades_are_refused():
    with running() as server:
        with server.connect() as conn:
            conn.sendall(b"NOT-HTTP\r\n\r\n")
            status, _, body = read_response(conn, bytearray())
            assert status.startswith(b"HTTP/1.1 400") and "malformed" in json.loads(body)["error"]
            assert closed_by_server(conn)
        with server.connect() as conn:
            conn.sendall(b"GET /ws HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
            assert read_response(conn, bytearray())[0].startswith(b"HTTP/1.1 501")


def test_http_1_0_head_and_application_errors():
    with running() as server:
        with server.connect() as conn:
            conn.sendall(b"GET /old HTTP/1.0\r\n\r\n")
            status, headers, body = read_response(conn, bytearray())
            assert headers[b"connection"] == b"close" and json.loads(body)["http"] == "1.0"
            assert closed_by_server(conn)
        with server.connect() as conn:
            buffer = bytearray()
            conn.sendall(b"HEAD /h HTTP/1.1\r\nHost: t\r\n\r\n")
            status, headers, _ = read_response(conn, buffer)
            assert headers[b"content-length"] == b"0" and buffer == b""
            conn.sendall(post("/boom", b""))
            assert read_response(conn, buffer)[0].startswith(b"HTTP/1.1 500")
            conn.sendall(post("/after", b"still here"))  # an application error does not cost the connection
            assert json.loads(read_response(conn, buffer)[2])["body"] == "still here"


def test_responses_sent_in_parts_stream_chunked_or_with_their_length():
    with running() as server, server.connect() as conn:
        buffer = bytearray()
        conn.sendall(post("/stream", b""))
        _, headers, body = read_response(conn, buffer)
        assert headers[b"transfer-encoding"] == b"chunked" and body == b"helloworld"
        conn.sendall(post("/stream-length", b""))
        _, headers, body = read_response(conn, buffer)
        assert headers[b"content-length"] == b"10" and body == b"helloworld"


def test_stop_lets_requests_in_progress_finish_and_closes_idle_connections():
    with running() as server, server.connect() as busy, server.connect() as idle:
        busy.sendall(post("/slow", b"finish me"))
        time.sleep(0.05)
        server.stop()
        assert json.loads(read_response(busy, bytearray())[2])["body"] == "finish me"
        assert closed_by_server(idle)
        with pytest.raises(OSError):
            server.connect()


def test_idle_keep_alive_connections_are_closed():
    with running(keep_alive_s=0.2) as server, server.connect() as conn:
        conn.sendall(post("/x", b""))
        read_response(conn, bytearray())
        conn.settimeout(3)
        assert closed_by_server(conn)


def test_a_long_request_target_gets_414_and_too_many_or_too_large_headers_get_431():
    with running(max_url_bytes=100, max_headers=5, max_header_bytes=300) as server:
        with server.connect() as conn:
            conn.sendall(b"GET /" + b"a" * 200 + b" HTTP/1.1\r\nHost: t\r\n\r\n")
            status, headers, body = read_response(conn, bytearray())
            assert status.startswith(b"HTTP/1.1 414") and headers[b"connection"] == b"close"
            assert "limit of 100 bytes" in json.loads(body)["error"]
            assert closed_by_server(conn)
        with server.connect() as conn:
            conn.sendall(b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(6)) + b"\r\n")
            status, _, body = read_response(conn, bytearray())
            assert status.startswith(b"HTTP/1.1 431") and "more than 5 headers" in json.loads(body)["error"]
        with server.connect() as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * 400 + b"\r\n\r\n")
            status, _, body = read_response(conn, bytearray())
            assert status.startswith(b"HTTP/1.1 431") and "limit of 300 bytes" in json.loads(body)["error"]
        with server.connect() as conn:  # within the limits, all is well
            conn.sendall(b"GET /" + b"a" * 90 + b" HTTP/1.1\r\nHost: t\r\nX-Ok: " + b"o" * 200 + b"\r\n\r\n")
            assert read_response(conn, bytearray())[0] == b"HTTP/1.1 200 OK"


def test_a_header_that_never_ends_is_cut_off_while_it_arrives():
    with running(max_url_bytes=100, max_headers=5, max_header_bytes=300) as server, server.connect() as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        buffer = bytearray()
        for _ in range(200):  # a slow sender: the parser never sees the header end
            try:
                conn.sendall(b"z" * 16)
            except OSError:
                break
            time.sleep(0.002)
            conn.setblocking(False)
            try:
                buffer += conn.recv(65536)
            except BlockingIOError:
                pass
            conn.setblocking(True)
            if buffer:
                break
        status, _, body = read_response(conn, buffer)
        assert status.startswith(b"HTTP/1.1 431") and "limit of 300 bytes" in json.loads(body)["error"]


def test_a_head_over_the_limit_is_refused_after_the_requests_before_it_are_answered():
    with running(max_header_bytes=300) as server, server.connect() as conn:
        conn.sendall(post("/slow", b"first") + b"GET / HTTP/1.1\r\nX-Big: " + b"b" * 400 + b"\r\n\r\n")
        buffer = bytearray()
        first = read_response(conn, buffer)
        assert first[0] == b"HTTP/1.1 200 OK" and json.loads(first[2])["body"] == "first"
        assert read_response(conn, buffer)[0].startswith(b"HTTP/1.1 431")
        assert closed_by_server(conn)


def test_the_path_is_decoded_once():
    with running() as server, server.connect() as conn:
        conn.sendall(post("/ids/50%2525%2Fx/caf%C3%A9", b""))
        assert json.loads(read_response(conn, bytearray())[2])["path"] == "/ids/50%25/x/café"
