"""The gateway's client to the environment servers: pooled keep-alive HTTP/1.1 connections.

The gateway makes one upstream request per tool call. httpx spends ~0.5 ms of CPU on each (and more
under concurrency), more than the tool call itself costs the server; this client is an asyncio
protocol over ``httptools`` that writes each request in one write and, when a response arrives in
one read (a tool call's answer does), hands it over whole. Bodies that arrive in parts are handed
over as they come, so event streams stay streams.

Connections are reused per upstream base URL, last used first, and dropped when the server closes
them (a restarted server) or after ``keepalive_s`` idle, before the server's own idle limit. When a
reused connection fails before any byte of the answer, the server may still have acted on the
request: only idempotent methods are sent again, on a new connection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

import httptools

Headers = list[tuple[bytes, bytes]]

# RFC 9110 9.2.2: sending one of these twice has the effect of sending it once.
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
# Body bytes held for a slow reader before the connection stops reading from the server.
_HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """The upstream server did not give a whole answer (refused, dropped the connection, malformed)."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made: the server never got the request."""


class UpstreamTimeout(UpstreamError):
    """The server did not answer (or did not go on answering) in time."""


class _Connection(asyncio.Protocol):
    """One connection to a server; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.response: UpstreamResponse | None = None
        self._headers: Headers = []

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self.close()  # bytes nobody asked for: this connection cannot be trusted any more
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            response._fail(UpstreamError(f"malformed HTTP response: {e}"))
            self.close()
            return
        response._wake()

    def eof_received(self) -> bool | None:
        self.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None and not self.response.complete:
            self.response._fail(UpstreamError("the server closed the connection before it finished its answer"))

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        response = self.response
        if response is None or 100 <= status < 200:
            return  # an interim answer (100 Continue): the final one follows
        response.status = status
        response.headers = self._headers
        response.started = True
        if response.method == "HEAD":
            # The parser cannot be told that no body follows: end here and use the connection no more.
            response.complete = True
            response.reusable = False

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None and response.started:
            response._chunks.append(body)
            response._buffered += len(body)
            if response._buffered > _HIGH_WATER and not response._reading_whole and self.transport is not None and not self.closed:
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None and response.started and not response.complete:
            response.complete = True
            response.reusable = self.parser.should_keep_alive()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class UpstreamResponse:
    """A response as it arrives: ``status`` and ``headers`` first, then the body.

    ``complete`` tells that the whole body is already here (``body``); otherwise ``chunks`` yields it
    as it comes. ``release`` must be called once the response is no longer wanted.
    """

    def __init__(self, pool: UpstreamPool, key: str, connection: _Connection, method: str, timeout_s: float) -> None:
        self.pool = pool
        self.key = key
        self.connection = connection
        self.method = method
        self.timeout_s = timeout_s
        self.status = 0
        self.headers: Headers = []
        self.started = False
        self.complete = False
        self.reusable = False
        self.released = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        # Set by ``read``: the whole body is wanted, so the connection keeps reading however much is held.
        self._reading_whole = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def body(self) -> bytes:
        """The body so far (all of it once ``complete``)."""
        return self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's parts as they arrive; UpstreamError when it stops short."""
        while True:
            if self._chunks:
                chunks, self._chunks, self._buffered = self._chunks, [], 0
                connection = self.connection
                if not self.complete and connection.transport is not None and not connection.closed:
                    connection.transport.resume_reading()
                for chunk in chunks:
                    yield chunk
                continue
            if self.complete:
                return
            await self._wait("went silent in the middle of its answer")

    async def read(self) -> bytes:
        """The whole body."""
        self._reading_whole = True
        connection = self.connection
        if connection.transport is not None and not connection.closed:
            connection.transport.resume_reading()
        while not self.complete:
            await self._wait("went silent in the middle of its answer")
        return self.body

    def abort(self) -> None:
        """Stop the answer now: its connection is closed, and ``chunks`` ends with UpstreamError."""
        self.connection.close()

    def release(self) -> None:
        """Give the connection back to the pool when the answer was whole, else close it."""
        if self.released:
            return
        self.released = True
        connection = self.connection
        connection.response = None
        if self.complete and self.reusable and not connection.closed:
            self.pool._put(self.key, connection)
        else:
            connection.close()

    async def _wait(self, silence: str) -> None:
        """Until more arrives, the answer ends, or it fails; UpstreamTimeout after ``timeout_s``."""
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(self.timeout_s, self._time_out, waiter, silence)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _time_out(self, waiter: asyncio.Future[None], silence: str) -> None:
        if not waiter.done():
            self._error = UpstreamTimeout(f"the server {silence} for {self.timeout_s:g} s")
            waiter.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (self.started or self._error is not None):
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Origin:
    __slots__ = ("host", "port", "netloc")

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        if parts.scheme != "http" or not parts.hostname:
            raise UpstreamConnectError(f"unsupported upstream URL {base!r}: only http:// is proxied")
        self.host, self.port, self.netloc = parts.hostname, parts.port or 80, parts.netloc.encode("latin-1")


class UpstreamPool:
    """Keep-alive connections to any number of upstream servers."""

    def __init__(self, *, read_timeout_s: float = 300.0, connect_timeout_s: float = 5.0, keepalive_s: float = 30.0,
                 max_idle_per_server: int = 256) -> None:
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.max_idle_per_server = max_idle_per_server
        self._idle: dict[str, list[_Connection]] = {}
        self._origins: dict[str, _Origin] = {}

    async def request(self, base: str, method: str, target: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> UpstreamResponse:
        """Send ``method base+target`` and wait for the answer's head; the caller releases the response.

        ``headers`` must hold neither Host nor framing headers (Content-Length, Transfer-Encoding): this
        client sets them.
        """
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = _Origin(base)
        lines = [method.encode("ascii"), b" ", target.encode("latin-1"), b" HTTP/1.1\r\nhost: ", origin.netloc,
                 b"\r\ncontent-length: ", str(len(body)).encode()]
        for name, value in headers:
            lines += (b"\r\n", name, b": ", value)
        lines.append(b"\r\n\r\n")
        head = b"".join(lines)
        message = head + body if len(body) < 65536 else None
        while True:
            connection = self._take(base)
            reused = connection is not None
            if connection is None:
                connection = await self._connect(origin)
            response = UpstreamResponse(self, base, connection, method, self.read_timeout_s)
            connection.response = response
            transport = connection.transport
            assert transport is not None
            try:
                if message is not None:
                    transport.write(message)
                else:
                    transport.write(head)
                    transport.write(body)  # a large body is not copied to join it
                await response._wait("did not answer")
            except UpstreamError as e:
                response.release()
                if reused and method in _IDEMPOTENT and not isinstance(e, UpstreamTimeout):
                    continue  # a kept-alive connection the server had just closed: safe to send again
                raise
            except BaseException:
                response.release()  # cancelled while the request was out: the connection is unusable
                raise
            return response

    def _take(self, base: str) -> _Connection | None:
        idle = self._idle.get(base)
        if not idle:
            return None
        expired = time.monotonic() - self.keepalive_s
        while idle:
            connection = idle.pop()
            if not connection.closed and connection.idle_since >= expired:
                return connection
            connection.close()
        return None

    def _put(self, base: str, connection: _Connection) -> None:
        idle = self._idle.setdefault(base, [])
        if len(idle) >= self.max_idle_per_server:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(loop.create_connection(_Connection, origin.host, origin.port), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamConnectError(f"no connection within {self.connect_timeout_s:g} s") from None
        except OSError as e:
            raise UpstreamConnectError(f"cannot connect: {e.strerror or e}") from None
        return connection

    def close(self) -> None:
        """Close every idle connection (the ones in use close as their responses are released)."""
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
