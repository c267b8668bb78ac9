"""HTTP for every long-running process here: the servers, the farm's gateway, the swarm's gateway service.

- :mod:`.http_server`: :class:`HttpServer`, a small HTTP/1.1 server for one ASGI application, and the
  :class:`Bounds` on what its clients may hold;
- :mod:`.fair_share`: :class:`FairShare`, a fair share of one event loop for each environment of a server process;
- :mod:`.asgi`: whole request bodies, JSON requests (:func:`parse_json`) and replies (:func:`json_bytes`);
- :mod:`.cors`: CORS for browser-hosted MCP clients;
- :mod:`.event_loop`: uvloop where it is installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servers.transport.asgi import json_bytes, parse_json
    from servers.transport.fair_share import FairShare
    from servers.transport.http_server import Bounds, HttpServer

__all__ = ["Bounds", "FairShare", "HttpServer", "json_bytes", "parse_json"]

# Loaded when first named: the workers use .asgi alone, and the HTTP server (httptools, its parser) would cost each of them memory.
_HOMES = {"Bounds": "http_server", "FairShare": "fair_share", "HttpServer": "http_server", "json_bytes": "asgi", "parse_json": "asgi"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
