"""A lean HTTP/1.1 client for the harness's hot path: JSON requests over pooled keep-alive connections.

The harness makes ~10 requests per episode to servers that speak plain HTTP/1.1 with
Content-Length. httpx spends ~0.5 ms of CPU on each (its transport, auth and redirect layers); this
client spends a tenth of that, which is what lets one harness process drive thousands of steps per
second. It uses asyncio streams directly (the harness always runs on asyncio). ``https://`` URLs go
to httpx, which handles TLS properly.

Interim (1xx) responses are skipped, chunked bodies are read through their trailers, and a pooled
connection the server has closed is dropped before use, as is one idle for longer than
``keep_alive_s``: a server closes idle connections too (ours after 75 s), and one it closes just as a
request goes out fails that request. When a reused connection fails as a request goes out, the server
may already have acted on it, so only idempotent methods are sent again: a POST (a tool call, a new
episode) fails with TransportError instead of running twice.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from agent_client.errors import TransportError

if TYPE_CHECKING:
    import httpx

# RFC 9110 9.2.2: sending one of these twice has the effect of sending it once.
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})


class Response:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class _Connection:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0

    def close(self) -> None:
        self.writer.close()


class LeanHttp:
    """Pooled keep-alive connections per host; ``request`` sends JSON and returns the whole response."""

    def __init__(self, timeout_s: float = 120.0, connect_timeout_s: float = 10.0, keep_alive_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        # Well under the idle timeouts of the servers it talks to (ours and the gateway's: 75 s; many others': 5 s or more).
        self.keep_alive_s = keep_alive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._tls: httpx.AsyncClient | None = None

    async def __aenter__(self) -> LeanHttp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()
        if self._tls is not None:
            await self._tls.aclose()

    async def request(self, method: str, url: str, body: Any = None, headers: dict[str, str] | None = None) -> Response:
        """``method url`` with ``body`` as JSON (when not None); TransportError when no response comes back."""
        scheme, host, port, netloc = _origin(url)
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        if scheme == "https":
            return await self._via_httpx(method, url, payload, headers)
        if scheme != "http" or not host:
            raise TransportError(f"unsupported URL {url!r}: use http:// or https://")
        # What follows the origin: the path (``/`` when empty) and the query, as the request line wants them.
        target = url[len(scheme) + 3 + len(netloc):].partition("#")[0] or "/"
        if target.startswith("?"):
            target = "/" + target
        lines = [f"{method} {target} HTTP/1.1", f"Host: {netloc}", f"Content-Length: {len(payload)}"]
        if payload:
            lines.append("Content-Type: application/json")
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        message = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
        try:
            # asyncio.timeout, not wait_for: wait_for runs the exchange as a task of its own, which
            # costs more CPU than the rest of a small request.
            async with asyncio.timeout(self.timeout_s):
                return await self._exchange((host, port), message, method)
        except TimeoutError:
            raise TransportError(f"{method} {url}: no response within {self.timeout_s:g} s") from None
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            raise TransportError(f"{method} {url}: {type(e).__name__}: {e}") from None

    async def _exchange(self, key: tuple[str, int], message: bytes, method: str) -> Response:
        idle = self._idle.setdefault(key, [])
        fresh_since = time.monotonic() - self.keep_alive_s
        while idle:
            connection = idle.pop()
            if connection.reader.at_eof() or connection.reader.exception() is not None or connection.idle_since < fresh_since:
                connection.close()  # the server closed it while it sat in the pool, or may close it any moment
                continue
            try:
                return await self._send(key, connection, message, method)
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                # The server dropped a kept-alive connection as the request went out. It may have
                # acted on the request before that, so only a request that is safe to repeat goes again.
                if method not in _IDEMPOTENT:
                    raise ConnectionError(f"the server closed a kept-alive connection without an answer; "
                                          f"a {method} is not sent twice ({type(e).__name__})") from None
        async with asyncio.timeout(self.connect_timeout_s):
            connection = _Connection(*await asyncio.open_connection(*key))
        return await self._send(key, connection, message, method)

    async def _send(self, key: tuple[str, int], connection: _Connection, message: bytes, method: str) -> Response:
        """One request and its final response on ``connection``; it is closed when anything goes wrong."""
        try:
            connection.writer.write(message)
            status, headers = await _read_head(connection.reader)
            while 100 <= status < 200:  # interim responses (100 Continue, 103 Early Hints) precede the answer
                if status == 101:
                    raise ValueError("the server switched protocols, which was never asked for")
                status, headers = await _read_head(connection.reader)
            reusable = headers.get("connection", "").lower() != "close"
            if method == "HEAD" or status in (204, 304):
                body = b""
            elif headers.get("transfer-encoding", "").lower() == "chunked":
                body = await _read_chunked(connection.reader)
            elif "content-length" in headers:
                body = await connection.reader.readexactly(int(headers["content-length"]))
            else:
                body, reusable = await connection.reader.read(), False
        except BaseException:
            connection.close()
            raise
        if reusable:
            connection.idle_since = time.monotonic()
            self._idle[key].append(connection)
        else:
            connection.close()
        return Response(status, headers, body)

    async def _via_httpx(self, method: str, url: str, payload: bytes, headers: dict[str, str] | None) -> Response:
        # Imported here, by the runs that use it: importing it costs every harness process a tenth of a second at its start.
        import httpx

        if self._tls is None:
            self._tls = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s))
        try:
            response = await self._tls.request(method, url, content=payload or None,
                                               headers={**({"Content-Type": "application/json"} if payload else {}), **(headers or {})})
        except httpx.HTTPError as e:
            raise TransportError(f"{method} {url}: {e!r}") from None
        return Response(response.status_code, {k.lower(): v for k, v in response.headers.items()}, response.content)


@functools.lru_cache(maxsize=1024)
def _origin_of(scheme_and_netloc: str) -> tuple[str, str | None, int, str]:
    parts = urlsplit(scheme_and_netloc)
    return parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), parts.netloc


def _origin(url: str) -> tuple[str, str | None, int, str]:
    """(scheme, host, port, netloc) of ``url``; parsed once per origin, since a run talks to a few servers only."""
    scheme, sep, rest = url.partition("://")
    end = len(rest)
    for stop in "/?#":
        found = rest.find(stop)
        if found != -1 and found < end:
            end = found
    return _origin_of(f"{scheme}{sep}{rest[:end]}")


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            break
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)
    # Trailer fields, if any, up to the empty line: left unread, they would be taken for the next response.
    while await reader.readuntil(b"\r\n") != b"\r\n":
        pass
    return b"".join(chunks)
