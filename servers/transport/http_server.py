"""A small HTTP/1.1 server for one ASGI application: the environment server's transport.

uvicorn is general, and costs ~40 us of CPU per request on top of the application (a cycle object
and a timer per request, the head and the body written apart): a quarter of a whole tool call at the
environment server's rates. This server does what the environment server needs and no more:

- keep-alive, and pipelined requests answered in order;
- whole request bodies (``Content-Length`` or chunked) up to a limit, 413 beyond it;
- a request target of at most ``max_url_bytes`` (414 beyond it) and at most ``max_headers`` headers
  of ``max_header_bytes`` in all (431 beyond them), counted as the bytes arrive, so that a slow
  sender cannot grow a request head without bound;
- ``Expect: 100-continue``, HTTP/1.0 clients, HEAD;
- one write per response (``Content-Length`` added when the application gives none); a response
  sent in several parts goes out as it comes, chunked unless it has a length;
- lifespan events, idle connections closed after ``keep_alive_s``, and a graceful stop: on
  SIGTERM/SIGINT it stops accepting, lets requests in progress finish (up to ``graceful_s``), then
  runs the lifespan shutdown.

Nothing one client sends costs more than a stated bound (:class:`Bounds`): connections in all (below
the process's descriptor limit, with a reserve kept for its own files) and per client address,
past which a new connection gets a 503 and is closed; a request head must arrive whole within
``head_timeout_s`` (a connection that sends nothing is closed then too) and a body within
``body_timeout_s`` (408); request bodies being read hold at most ``max_buffered_bytes`` in all (503
past it); and an answer the client does not read holds up its connection: nothing more is run for
it, and after ``write_timeout_s`` it is closed.

No TLS, no WebSockets, no HTTP/2: put a proxy in front for those.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import resource
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote_to_bytes

import httptools
from pydantic import BaseModel, Field

from servers.memory import release_free_memory
from servers.transport.asgi import json_bytes
from servers.transport.fair_share import FairShare, Slot

log = logging.getLogger("envscaler.http")

Message = dict[str, Any]
App = Callable[[dict[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SWEEP_S = 5.0
_JOIN_LIMIT = 65536
# How long a refused client may go on sending (its body) before the connection is cut.
_LINGER_S = 2.0
# Descriptors kept free for the process's own files (logs, state, its workers' sockets).
FD_RESERVE = 256
# Bodies dropped since the most held: past this, the allocator's free pages go back to the kernel.
_TRIM_AFTER_BYTES = 16 * 1024 * 1024


class Bounds(BaseModel):
    """What the clients of one server may hold of it (see the module's doc)."""

    max_connections: int | None = Field(default=None, ge=1)
    """Connections in all; None: the descriptor limit less FD_RESERVE."""
    max_connections_per_client: int = Field(default=1024, ge=1)
    head_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=60.0, gt=0)
    write_timeout_s: float = Field(default=60.0, gt=0)
    max_buffered_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    """Request bodies being read, all connections together."""


def descriptor_room() -> int:
    """Connections this process can hold and still keep FD_RESERVE descriptors for itself."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 20) - FD_RESERVE)


class HttpServer:
    """Serves ``app`` on a listening socket until stopped."""

    def __init__(
        self,
        app: App,
        *,
        max_body_bytes: int,
        keep_alive_s: float = 75.0,
        graceful_s: float = 5.0,
        max_pipelined: int = 32,
        max_url_bytes: int = 8192,
        max_headers: int = 100,
        max_header_bytes: int = 65536,
        bounds: Bounds | None = None,
        fair_share: FairShare | None = None,
    ) -> None:
        self.app = app
        self.bounds = bounds = bounds or Bounds()
        self.max_connections = min(bounds.max_connections or descriptor_room(), descriptor_room())
        self.max_body_bytes = max_body_bytes
        self.max_url_bytes = max_url_bytes
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes
        # The whole head as it arrives: request line, headers, and their separators.
        self.max_head_bytes = max_url_bytes + max_header_bytes + 4 * max_headers + 1024
        self.keep_alive_s = keep_alive_s
        self.graceful_s = graceful_s
        self.max_pipelined = max_pipelined
        # This environment's part of an event loop it shares with other environments' servers, or None.
        self.seat = fair_share.seat() if fair_share is not None else None
        self.connections: set[_Connection] = set()
        self.per_client: dict[str, int] = {}
        self.buffered_bytes = 0
        self.buffered_peak = 0
        # How many connections were refused or cut, by why (``/info`` of a server, the gateway's health).
        self.refused: dict[str, int] = {}
        # Made here, not in ``serve``: a stop asked for while the server starts is kept.
        self._stop = asyncio.Event()
        # Set while connections are held: the sweep below sleeps through the time when there are none.
        self._connected = asyncio.Event()

    def stop(self) -> None:
        """Begin the graceful stop (call it on the server's event loop)."""
        self._stop.set()

    async def serve(self, sock: socket.socket, on_ready: Callable[[], None] | None = None, *, handle_signals: bool = True) -> None:
        """Lifespan startup, serve until stopped, graceful stop, lifespan shutdown.

        ``on_ready`` runs once connections are accepted and, on the main thread (the only one that
        can take signals), SIGTERM/SIGINT stop the server unless ``handle_signals`` is false (a
        caller that stops other things first calls ``stop`` itself).
        """
        loop = asyncio.get_running_loop()
        lifespan = _Lifespan(self.app)
        await lifespan.startup()
        server = await loop.create_server(lambda: _Connection(self), sock=sock)
        signals = _STOP_SIGNALS if handle_signals and threading.current_thread() is threading.main_thread() else ()
        for signum in signals:
            loop.add_signal_handler(signum, self.stop)
        sweeper = loop.create_task(self._close_idle_forever())
        try:
            if on_ready is not None:
                on_ready()
            await self._stop.wait()
        finally:
            for signum in signals:
                loop.remove_signal_handler(signum)
            sweeper.cancel()
            server.close()
            await self._drain()
            await lifespan.shutdown()

    async def _drain(self) -> None:
        """Close connections as their requests finish; after ``graceful_s``, close the rest."""
        deadline = time.monotonic() + self.graceful_s
        while True:
            for connection in list(self.connections):
                if connection.idle:
                    connection.close()
            if not self.connections or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.01)
        for connection in list(self.connections):
            connection.close()

    async def _close_idle_forever(self) -> None:
        # One sweep a second instead of a timer per request: timeouts are kept to within a second. None while
        # no connection is held: an idle server does not wake (a farm's thousand servers would, a thousand times a second).
        bounds = self.bounds
        while True:
            if not self.connections:
                self._connected.clear()
                await self._connected.wait()
            await asyncio.sleep(min(_SWEEP_S, self.keep_alive_s, 1.0))
            now = time.monotonic()
            for connection in list(self.connections):
                if connection.idle and not connection.reading and connection.last_active < now - (
                        self.keep_alive_s if connection.served else bounds.head_timeout_s):
                    connection.close()
                elif connection.reading and connection.in_head and connection.reading_since < now - bounds.head_timeout_s:
                    self.count("slow head")
                    connection.refuse(408, f"the request head did not arrive within {bounds.head_timeout_s:g} s")
                elif connection.reading and not connection.in_head and connection.reading_since < now - bounds.body_timeout_s:
                    self.count("slow body")
                    connection.refuse(408, f"the request body did not arrive within {bounds.body_timeout_s:g} s")
                elif connection.write_blocked_since is not None and connection.write_blocked_since < now - bounds.write_timeout_s:
                    self.count("answer not read")
                    connection.close()
            if self.buffered_peak - self.buffered_bytes > _TRIM_AFTER_BYTES:
                release_free_memory()  # what a flood of bodies held goes back, not only to this process's heap
                self.buffered_peak = self.buffered_bytes

    def connected(self) -> None:
        """A connection is held now: the sweep of idle and slow connections runs again."""
        self._connected.set()

    def count(self, why: str) -> None:
        """Count a connection refused or cut for ``why``."""
        self.refused[why] = self.refused.get(why, 0) + 1


class _Request:
    __slots__ = ("scope", "body", "keep_alive", "too_large", "slot")

    def __init__(self, scope: dict[str, Any], body: bytes, keep_alive: bool, too_large: bool) -> None:
        self.scope = scope
        self.body = body
        self.keep_alive = keep_alive
        self.too_large = too_large
        self.slot: Slot | None = None  # its place at an event loop shared with other environments (:mod:`.fair_share`)


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs them one at a time, writes the responses."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.queue: deque[_Request] = deque()
        self.running: asyncio.Task[None] | None = None
        self.awaiting_slot = False  # its next request waits for a slot of its environment's (:mod:`.fair_share`)
        self.closed = False
        self.last_active = time.monotonic()
        self.disconnected: asyncio.Future[None] | None = None
        self._reading = True
        self._write_blocked = False
        # When the answer waiting in the write buffer stopped going out (the client does not read), or None.
        self.write_blocked_since: float | None = None
        # A request is being read (since ``reading_since``), its head (``in_head``) or its body.
        self.reading = False
        self.reading_since = self.last_active
        self.served = False  # some request was read whole
        self._buffered = 0
        # The request being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0
        self._in_head = False
        self._head_bytes = 0
        self._begun = 0
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False
        # Set once a head outgrew a limit: nothing more is read, and this answer closes the connection.
        self._head_refusal: tuple[int, str] | None = None

    @property
    def idle(self) -> bool:
        """No request running or waiting."""
        return self.running is None and not self.queue

    @property
    def in_head(self) -> bool:
        """The request being read has not sent its whole head yet."""
        return self._in_head or not self.served and self._begun == 0

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.client = _address(transport.get_extra_info("peername"))
        self.local = _address(transport.get_extra_info("sockname"))
        server = self.server
        host = self.client[0] if self.client is not None else ""
        if len(server.connections) >= server.max_connections:
            self._turn_away("too many connections", f"the server holds its limit of {server.max_connections} connections; try again later")
            return
        if server.per_client.get(host, 0) >= server.bounds.max_connections_per_client:
            self._turn_away("too many connections from one client",
                            f"{host} holds the limit of {server.bounds.max_connections_per_client} connections per client")
            return
        server.per_client[host] = server.per_client.get(host, 0) + 1
        server.connections.add(self)
        server.connected()

    def _turn_away(self, why: str, message: str) -> None:
        self.server.count(why)
        self.closed = True
        assert self.transport is not None
        body = json_bytes({"error": message})
        head = _head(503, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"retry-after", b"1")],
                     keep_alive=False)
        self.transport.write(head + body)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        # Now, not when the cyclic collector gets round to this connection (its parser refers back to it).
        self._body = []
        self.queue.clear()
        self._release_buffered()
        if self.awaiting_slot:
            self.awaiting_slot = False
            self.server.seat.withdraw(self._slot_came)  # type: ignore[union-attr]
        if self in self.server.connections:
            self.server.connections.discard(self)
            host = self.client[0] if self.client is not None else ""
            left = self.server.per_client.get(host, 1) - 1
            if left > 0:
                self.server.per_client[host] = left
            else:
                self.server.per_client.pop(host, None)
        if self.disconnected is not None and not self.disconnected.done():
            self.disconnected.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.closed or self._head_refusal is not None:
            return  # after a refusal, what the client still sends is read and dropped
        self.last_active = time.monotonic()
        if not self.reading and not self.served and self._begun == 0:
            self.reading = True  # the first request's head has begun: its timeout counts from the connection's start
        in_head, begun = self._in_head, self._begun
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.refuse(501, "protocol upgrades (WebSocket, h2c) are not supported")
        except httptools.HttpParserError as e:
            self.refuse(400, f"malformed HTTP request: {e}")
        # The parser buffers a header until it is whole: count what it holds, exactly when the chunk
        # lies inside one head (a chunk that starts or ends one may also hold another request's bytes).
        if in_head and self._in_head and begun == self._begun and self._head_refusal is None:
            self._head_bytes += len(data)
            if self._head_bytes > self.server.max_head_bytes:
                self._refuse_head(431, f"request headers are larger than the limit of {self.server.max_header_bytes} bytes")

    def pause_writing(self) -> None:
        self._write_blocked = True
        self.write_blocked_since = time.monotonic()
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_blocked = False
        self.write_blocked_since = None
        self._update_reading()
        if self.running is None and self.queue:
            self._next()  # what waited for the client to read its last answer

    def _update_reading(self) -> None:
        """Read while the client waits for nothing from us: no full write buffer, no long queue."""
        wanted = not self._write_blocked and len(self.queue) < self.server.max_pipelined and self._head_refusal is None
        if wanted != self._reading and self.transport is not None and not self.closed:
            self._reading = wanted
            if wanted:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self.reading:
            self.reading_since = time.monotonic()
        self.reading = True
        self._url = b""
        self._headers = []
        self._header_bytes = 0
        self._in_head = True
        self._head_bytes = 0
        self._begun += 1
        self._body = []
        self._size = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        if self._head_refusal is not None:
            return
        self._url += url
        if len(self._url) > self.server.max_url_bytes:
            self._refuse_head(414, f"the request target is longer than the limit of {self.server.max_url_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_refusal is not None:
            return
        self._headers.append((name.lower(), value))
        self._header_bytes += len(name) + len(value)
        if len(self._headers) > self.server.max_headers:
            self._refuse_head(431, f"the request has more than {self.server.max_headers} headers")
        elif self._header_bytes > self.server.max_header_bytes:
            self._refuse_head(431, f"request headers are larger than the limit of {self.server.max_header_bytes} bytes")

    def _refuse_head(self, status: int, message: str) -> None:
        """Stop reading; answer ``status`` now, or once the requests before this one are answered."""
        self._head_refusal = (status, message)
        self._update_reading()
        if self.idle:
            self.refuse(status, message)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self.reading_since = time.monotonic()  # the body's own timeout
        if self._head_refusal is not None:
            return
        expects_continue = False
        for name, value in self._headers:
            if name == b"content-length" and value.isdigit() and int(value) > self.server.max_body_bytes:
                self._too_large = True
            elif name == b"expect" and value.lower() == b"100-continue":
                expects_continue = True
        if self._too_large and self.idle:
            # Nothing is owed to the client before this answer: refuse now, without reading the body.
            self.refuse(413, f"request body is larger than the limit of {self.server.max_body_bytes} bytes")
        elif expects_continue and not self._too_large and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, chunk: bytes) -> None:
        if self._too_large or self._head_refusal is not None or self.closed:
            return
        self._size += len(chunk)
        if self._size > self.server.max_body_bytes:
            self._too_large = True
            self._body = []
            self._release_buffered()
            return
        server = self.server
        if server.buffered_bytes + len(chunk) > server.bounds.max_buffered_bytes:
            server.count("bodies over the memory bound")
            self._body = []
            self._release_buffered()
            self.refuse(503, "the server holds as much of other requests' bodies as it may; try again later")
            return
        self._body.append(chunk)
        self._buffered += len(chunk)
        server.buffered_bytes += len(chunk)
        server.buffered_peak = max(server.buffered_peak, server.buffered_bytes)

    def _release_buffered(self) -> None:
        self.server.buffered_bytes -= self._buffered
        self._buffered = 0

    def on_message_complete(self) -> None:
        if self.closed or self._head_refusal is not None:
            return
        raw_path, _, query = self._url.partition(b"?")
        if not raw_path.startswith(b"/"):  # absolute form, as sent to proxies
            parsed = httptools.parse_url(self._url)
            raw_path, query = parsed.path or b"/", parsed.query or b""
        scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": self.parser.get_http_version(),
            "server": self.local,
            "client": self.client,
            "scheme": "http",
            "method": self.parser.get_method().decode("ascii"),
            "root_path": "",
            "path": unquote_to_bytes(raw_path).decode(errors="replace"),
            "raw_path": raw_path,
            "query_string": query,
            "headers": self._headers,
        }
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        self._release_buffered()  # the request's own now, bounded by max_pipelined per connection
        self.reading = False
        self.served = True
        self.queue.append(_Request(scope, body, self.parser.should_keep_alive(), self._too_large))
        self._update_reading()
        if self.running is None:
            self._next()

    # -- running requests ------------------------------------------------------------------------

    def _next(self) -> None:
        if not self.queue and self._head_refusal is not None:
            self.refuse(*self._head_refusal)
        if not self.queue or self.closed or self._write_blocked:
            return  # blocked: the next request runs once the client has read this answer (resume_writing)
        request = self.queue[0]
        seat = self.server.seat
        if seat is not None and not request.too_large and request.scope["path"] != "/healthz":
            if self.awaiting_slot:
                return
            request.slot = seat.take(self._slot_came)
            if request.slot is None:
                self.awaiting_slot = True  # its environment's neighbours are busy and it has its share running
                return
        self.queue.popleft()
        self._update_reading()
        if request.too_large:
            self.refuse(413, f"request body is larger than the limit of {self.server.max_body_bytes} bytes")
            return
        self.running = asyncio.get_running_loop().create_task(self._run(request))

    def _slot_came(self) -> None:
        self.awaiting_slot = False
        self._next()

    async def _run(self, request: _Request) -> None:
        exchange = _Exchange(self, request)
        try:
            await self.server.app(request.scope, exchange.receive, exchange.send)
        except Exception:
            log.exception("request failed", extra={"method": request.scope["method"], "path": request.scope["path"]})
        finally:
            if request.slot is not None:
                self.server.seat.give_back(request.slot)  # type: ignore[union-attr]
        if not exchange.started:
            exchange.write_whole(500, [(b"content-type", b"text/plain")], b"Internal Server Error")
        elif not exchange.finished:
            self.close()  # the response stopped halfway: only closing tells the client
        self.running = None
        self.last_active = time.monotonic()
        if request.keep_alive:
            self._next()
        else:
            self.close()

    def refuse(self, status: int, message: str) -> None:
        """Answer ``{"error": message}`` with ``status`` and close the connection.

        The client may still be sending a body that will never be read. Closing a socket with
        unread input sends a reset, which can destroy the answer in the client's receive buffer
        before the client reads it, so the connection is half-closed instead, what arrives is
        dropped for up to ``_LINGER_S``, and then it is closed.
        """
        transport = self.transport
        if transport is None or self.closed:
            return
        body = json_bytes({"error": message})
        head = _head(status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], keep_alive=False)
        transport.write(head + body)
        self.closed = True
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._reading = True
        transport.resume_reading()
        asyncio.get_running_loop().call_later(_LINGER_S, transport.close)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.closed = True
            self.transport.close()


class _Exchange:
    """The ASGI receive/send pair of one request."""

    __slots__ = ("connection", "request", "started", "finished", "status", "headers", "streaming", "chunked", "body_given")

    def __init__(self, connection: _Connection, request: _Request) -> None:
        self.connection = connection
        self.request = request
        self.started = False
        self.finished = False
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = []
        self.streaming = False
        self.chunked = False
        self.body_given = False

    async def receive(self) -> Message:
        if not self.body_given:
            self.body_given = True
            return {"type": "http.request", "body": self.request.body, "more_body": False}
        connection = self.connection
        if not connection.closed:
            if connection.disconnected is None:
                connection.disconnected = asyncio.get_running_loop().create_future()
            await connection.disconnected
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = message["status"]
            self.headers = list(message.get("headers") or ())
            return
        if kind != "http.response.body" or not self.started or self.finished:
            raise RuntimeError(f"unexpected ASGI message {kind!r} at this point of the response")
        body: bytes = b"" if self.request.scope["method"] == "HEAD" else message.get("body", b"")
        more: bool = message.get("more_body", False)
        if not more and not self.streaming:
            self.write_whole(self.status, self.headers, body)
            return
        self.finished = not more
        transport = self.connection.transport
        if self.connection.closed or transport is None:
            return
        if not self.streaming:
            self.streaming = True
            self.chunked = not _has_length(self.headers) and self.request.scope["method"] != "HEAD"
            headers = [*self.headers, (b"transfer-encoding", b"chunked")] if self.chunked else self.headers
            transport.write(_head(self.status, headers, self.request.keep_alive))
        if not self.chunked:
            transport.write(body)
            return
        if body:
            transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        if not more:
            transport.write(b"0\r\n\r\n")

    def write_whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole response in one write, with a Content-Length."""
        self.started = self.finished = True
        connection = self.connection
        if connection.closed or connection.transport is None:
            return
        if not _has_length(headers):
            headers = [*headers, (b"content-length", str(len(body)).encode())]
        head = _head(status, headers, self.request.keep_alive)
        if len(body) > _JOIN_LIMIT:
            connection.transport.write(head)  # a large body (a long trajectory) is not copied to join it
            connection.transport.write(body)
        else:
            connection.transport.write(head + body)


def _has_length(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == b"content-length" for name, _ in headers)


def _head(status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Unknown"))]
    lines += [name + b": " + value for name, value in headers]
    if not keep_alive:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _address(value: Any) -> tuple[str, int] | None:
    return (str(value[0]), int(value[1])) if isinstance(value, tuple) and len(value) >= 2 else None


class _Lifespan:
    """Runs the application's lifespan protocol, when it speaks it."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.task: asyncio.Task[None] | None = None
        self._to_app: asyncio.Queue[Message] = asyncio.Queue()
        self._from_app: asyncio.Queue[Message] = asyncio.Queue()

    async def startup(self) -> None:
        """Send ``lifespan.startup``; RuntimeError if the application says it failed."""
        self.task = asyncio.get_running_loop().create_task(self._run())
        await self._to_app.put({"type": "lifespan.startup"})
        answer = await self._answer()
        if answer is not None and answer["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"the application failed to start: {answer.get('message', '')}")

    async def shutdown(self) -> None:
        """Send ``lifespan.shutdown`` and wait for the answer (or for the application to return)."""
        if self.task is None or self.task.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._answer()

    async def _answer(self) -> Message | None:
        assert self.task is not None
        getter = asyncio.ensure_future(self._from_app.get())
        done, _ = await asyncio.wait({getter, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await getter
        return None

    async def _run(self) -> None:
        try:
            await self.app({"type": "lifespan", "asgi": _ASGI}, self._to_app.get, self._from_app.put)
        except Exception:  # noqa: BLE001 - an application without lifespan support may raise anything
            log.debug("the application does not take lifespan events", exc_info=True)
