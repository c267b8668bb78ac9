"""agent_client.http.LeanHttp against scripted HTTP/1.1 servers on real sockets.

Each server reads whole requests (head and Content-Length body) and answers each with the next
scripted reply: bytes to send, or ``(bytes, "then close")`` to close the connection once they are
sent. ``None`` as a reply closes the connection without an answer, as a server does that dies or
drops a kept-alive connection just as a request arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from agent_client.errors import TransportError
from agent_client.http import LeanHttp

pytestmark = pytest.mark.anyio


Reply = bytes | tuple[bytes, str] | None


class Scripted:
    """A TCP server answering requests, across connections, with ``replies`` in order."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = list(replies)
        self.requests: list[bytes] = []  # request lines, in the order they arrived
        self.connections = 0
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.requests.append(head.split(b"\r\n")[0])
                reply = self.replies.pop(0)
                if reply is None:
                    return
                writer.write(reply if isinstance(reply, bytes) else reply[0])
                await writer.drain()
                if isinstance(reply, tuple):
                    return
        finally:
            writer.close()


@asynccontextmanager
async def scripted(replies: list[Reply]) -> AsyncIterator[Scripted]:
    script = Scripted(replies)
    server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
    script.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield script


def ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in extra) + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def test_interim_responses_are_not_taken_for_the_answer():
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"
    async with scripted([interim + ok(b'{"n": 1}'), ok(b'{"n": 2}')]) as server, LeanHttp() as http:
        first = await http.request("POST", server.url + "/x", {"a": 1})
        assert (first.status, first.json()) == (200, {"n": 1})
        second = await http.request("GET", server.url + "/y")
        assert second.json() == {"n": 2}, "the connection stays in step after interim responses"
        assert server.connections == 1


async def test_chunked_bodies_are_read_with_their_trailers():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"4;ext=1\r\n{\"n\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\nX-Checksum: abc\r\nX-Other: d\r\n\r\n")
    async with scripted([chunked, ok(b'{"n": 2}')]) as server, LeanHttp() as http:
        assert (await http.request("GET", server.url + "/a")).json() == {"n": 1}
        assert (await http.request("GET", server.url + "/b")).json() == {"n": 2}, "trailers are not read as the next response"
        assert server.connections == 1


async def test_a_post_is_not_sent_again_when_a_reused_connection_fails():
    async with scripted([ok(b"{}"), None, ok(b'{"again": true}')]) as server, LeanHttp() as http:
        await http.request("GET", server.url + "/warm")
        with pytest.raises(TransportError, match="POST is not sent twice"):
            await http.request("POST", server.url + "/tool", {"call": 1})
        assert server.requests == [b"GET /warm HTTP/1.1", b"POST /tool HTTP/1.1"], "the server saw the POST once"
        # The failed connection left the pool: the next request opens a new one.
        assert (await http.request("POST", server.url + "/tool", {"call": 2})).json() == {"again": True}
        assert server.connections == 2


async def test_a_get_is_sent_again_on_a_new_connection_when_a_reused_one_fails():
    async with scripted([ok(b"{}"), None, ok(b'{"n": 2}')]) as server, LeanHttp() as http:
        await http.request("GET", server.url + "/warm")
        assert (await http.request("GET", server.url + "/state")).json() == {"n": 2}
        assert server.requests == [b"GET /warm HTTP/1.1", b"GET /state HTTP/1.1", b"GET /state HTTP/1.1"]
        assert server.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_not_used():
    async with scripted([(ok(b"{}"), "then close"), ok(b'{"n": 2}')]) as server, LeanHttp() as http:
        await http.request("GET", server.url + "/warm")
        await asyncio.sleep(0.05)  # the server's FIN arrives while the connection sits in the pool
        assert (await http.request("POST", server.url + "/tool", {})).json() == {"n": 2}
        assert server.requests == [b"GET /warm HTTP/1.1", b"POST /tool HTTP/1.1"]
        assert server.connections == 2


async def test_a_connection_idle_past_keep_alive_is_not_used_for_the_next_request():
    # The server would close it at any moment; a POST sent just then would fail, and is never sent twice.
    async with scripted([ok(b"{}"), ok(b"{}"), ok(b'{"n": 3}')]) as server, LeanHttp(keep_alive_s=0.2) as http:
        await http.request("POST", server.url + "/episodes", {})
        await http.request("POST", server.url + "/episodes", {})
        assert server.connections == 1  # reused while fresh
        await asyncio.sleep(0.3)
        assert (await http.request("POST", server.url + "/episodes", {})).json() == {"n": 3}
        assert server.connections == 2
