"""A fair share of one server process's event loop for each of its environments (servers.transport.fair_share), over real sockets.

Two HTTP servers share one event loop and one :class:`FairShare`, as ``farm up --envs-per-server`` has them.
Requests to ``/hold`` stay in the application until the test lets them go, so what runs at once can be counted.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from servers.serve import bind
from servers.transport.http_server import HttpServer
from servers.transport.fair_share import FairShare
from tests.support.http_responses import read_response
from tests.support.waiting import wait_until

WHILE_SHARED = 2


@dataclass
class Environment:
    """One server's application: how many of its requests are in it now, and the most at once."""

    release: asyncio.Event
    inside: int = 0
    most: int = 0
    port: int = 0
    answered: list[str] = field(default_factory=list)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        self.inside += 1
        self.most = max(self.most, self.inside)
        try:
            if scope["path"] == "/hold":
                await self.release.wait()
        finally:
            self.inside -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["path"].encode()})


@dataclass
class Shared:
    a: Environment
    b: Environment
    loop: asyncio.AbstractEventLoop

    def let_go(self) -> None:
        self.loop.call_soon_threadsafe(self.a.release.set)
        self.loop.call_soon_threadsafe(self.b.release.set)


@contextmanager
def two_environments(fair_share: FairShare) -> Iterator[Shared]:
    loop = asyncio.new_event_loop()
    environments = [Environment(asyncio.Event()) for _ in range(2)]
    servers = [HttpServer(env, max_body_bytes=1000, fair_share=fair_share) for env in environments]
    sockets = [bind("127.0.0.1", 0) for _ in environments]
    for env, sock in zip(environments, sockets):
        env.port = sock.getsockname()[1]
    listening: list[int] = []
    ready = threading.Event()

    def on_ready() -> None:
        listening.append(1)
        if len(listening) == len(servers):
            ready.set()

    async def serve_both() -> None:
        await asyncio.gather(*(server.serve(sock, on_ready=on_ready, handle_signals=False) for server, sock in zip(servers, sockets)))

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve_both()), daemon=True)
    thread.start()
    assert ready.wait(5)
    shared = Shared(environments[0], environments[1], loop)
    try:
        yield shared
    finally:
        shared.let_go()
        for server in servers:
            loop.call_soon_threadsafe(server.stop)
        thread.join(10)


def send(env: Environment, path: str) -> socket.socket:
    client = socket.create_connection(("127.0.0.1", env.port), timeout=10)
    client.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return client


def answer(client: socket.socket) -> tuple[bytes, bytes]:
    """The status line and body answering the request sent on ``client``; closes it."""
    status, _, body = read_response(client, bytearray())
    client.close()
    return status, body


def wait_for(condition) -> None:
    wait_until(condition, timeout_s=10.0, poll_s=0.01)


def test_alone_an_environment_runs_all_its_requests_at_once() -> None:
    with two_environments(FairShare(while_shared=WHILE_SHARED, slot_s=60)) as shared:
        clients = [send(shared.a, "/hold") for _ in range(8)]
        wait_for(lambda: shared.a.inside == 8)
        shared.let_go()
        assert all(answer(client)[0] == b"HTTP/1.1 200 OK" for client in clients)


def test_while_a_neighbour_is_busy_a_flood_runs_its_share_and_the_rest_wait_unlost() -> None:
    with two_environments(FairShare(while_shared=WHILE_SHARED, slot_s=60)) as shared:
        neighbour = send(shared.b, "/hold")
        wait_for(lambda: shared.b.inside == 1)
        flood = [send(shared.a, "/hold") for _ in range(8)]
        wait_for(lambda: shared.a.inside == WHILE_SHARED)
        time.sleep(0.5)  # time enough for all 8 to be in, were they let in
        assert shared.a.most == WHILE_SHARED
        # Health probes never wait for a slot, nor does a neighbour's next call.
        assert answer(send(shared.a, "/healthz"))[0] == b"HTTP/1.1 200 OK"
        assert answer(send(shared.b, "/quick"))[1] == b"/quick"
        assert shared.a.inside == WHILE_SHARED
        shared.let_go()
        assert answer(neighbour)[0] == b"HTTP/1.1 200 OK"
        assert all(answer(client)[0] == b"HTTP/1.1 200 OK" for client in flood)


def test_a_neighbour_between_two_calls_still_counts_as_busy() -> None:
    # An agent that calls one step at a time has nothing running between its calls: the flood stays held back.
    with two_environments(FairShare(while_shared=WHILE_SHARED, slot_s=60, recent_s=60)) as shared:
        assert answer(send(shared.b, "/quick"))[1] == b"/quick"
        flood = [send(shared.a, "/hold") for _ in range(8)]
        wait_for(lambda: shared.a.inside == WHILE_SHARED)
        time.sleep(0.5)
        assert shared.a.most == WHILE_SHARED
        shared.let_go()
        assert all(answer(client)[0] == b"HTTP/1.1 200 OK" for client in flood)


def test_a_waiting_request_whose_client_leaves_is_forgotten() -> None:
    fair_share = FairShare(while_shared=WHILE_SHARED, slot_s=60)
    with two_environments(fair_share) as shared:
        neighbour = send(shared.b, "/hold")
        wait_for(lambda: shared.b.inside == 1)
        flood = [send(shared.a, "/hold") for _ in range(8)]
        waiting = fair_share.seats[0].waiting  # the first server's: shared.a's
        wait_for(lambda: shared.a.inside == WHILE_SHARED and len(waiting) == 8 - WHILE_SHARED)
        for client in flood[WHILE_SHARED:]:
            client.close()
        wait_for(lambda: not waiting)
        shared.let_go()
        assert answer(neighbour)[0] == b"HTTP/1.1 200 OK"
        assert all(answer(client)[0] == b"HTTP/1.1 200 OK" for client in flood[:WHILE_SHARED])
        assert shared.a.most == WHILE_SHARED


def test_a_request_that_runs_past_its_slot_holds_up_none_of_its_environments_others() -> None:
    # Requests that wait (on their worker, their checks) past slot_s are not running on the loop: the others start,
    # a share at a time, though nothing ends and nothing new arrives. The neighbour stays busy throughout (recent_s).
    with two_environments(FairShare(while_shared=WHILE_SHARED, slot_s=0.05, recent_s=60)) as shared:
        assert answer(send(shared.b, "/quick"))[1] == b"/quick"
        flood = [send(shared.a, "/hold") for _ in range(8)]
        wait_for(lambda: shared.a.inside == 8)
        shared.let_go()
        assert all(answer(client)[0] == b"HTTP/1.1 200 OK" for client in flood)


def test_a_fair_share_refuses_a_share_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FairShare(while_shared=0)
