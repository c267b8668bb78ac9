"""Publishing a container's port on 127.0.0.1, which Docker will not do for an internal network.

Docker publishes no ports from internal networks, and its own proxy would bind them on every
address unless told otherwise. The farm daemon therefore listens on each environment's loopback
port itself and relays bytes to wherever the container answers now: the catalog's URL stays the same
when a restarted container comes back at another address, and nothing but this host can connect.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
from anyio.abc import SocketListener, SocketStream

log = logging.getLogger("envscaler.farm")

_CHUNK = 65536


async def _pump(source: SocketStream, sink: SocketStream) -> None:
    """Copy ``source`` to ``sink`` until ``source`` ends, then half-close ``sink``."""
    try:
        while True:
            await sink.send(await source.receive(_CHUNK))
    except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        pass
    try:
        await sink.send_eof()
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        pass


class LoopbackPort:
    """Accepts on ``127.0.0.1:port`` and relays each connection to ``upstream()`` (host, port)."""

    def __init__(self, env_id: str, listener: SocketListener, upstream: Callable[[], tuple[str, int] | None]) -> None:
        self.env_id = env_id
        self.listener = listener
        self.upstream = upstream

    async def serve(self) -> None:
        """Relay connections until cancelled, then close the listener."""
        async with self.listener:
            await self.listener.serve(self._relay)

    async def _relay(self, client: SocketStream) -> None:
        async with client:
            target = self.upstream()
            if target is None:
                return  # the container is not running yet: the client sees the connection close, as with no server
            try:
                server = await anyio.connect_tcp(*target)
            except OSError as e:
                log.info("environment not answering on its container address", extra={"env": self.env_id, "error": str(e)})
                return
            async with server, anyio.create_task_group() as tasks:
                tasks.start_soon(_pump, client, server)
                await _pump(server, client)
                # The server is done with this connection: an idle keep-alive client must not hold it open.
                tasks.cancel_scope.cancel()
