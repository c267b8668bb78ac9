"""HTTP for every long-running process here: the servers, the farm's gateway, the swarm's gateway service.

- :mod:`.http_server`: :class:`HttpServer`, a small HTTP/1.1 server for one ASGI application, and the
  :class:`Bounds` on what its clients may hold;
- :mod:`.asgi`: whole request bodies, JSON requests (:func:`parse_json`) and replies (:func:`json_bytes`);
- :mod:`.cors`: CORS for browser-hosted MCP clients;
- :mod:`.event_loop`: uvloop where it is installed.
"""

from servers.transport.asgi import json_bytes, parse_json
from servers.transport.http_server import Bounds, HttpServer

__all__ = ["Bounds", "HttpServer", "json_bytes", "parse_json"]
