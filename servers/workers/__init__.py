"""The processes that run an environment's code and its checks for a server, never in it.

- :mod:`.store`: :class:`WorkerEpisodeStore`, episodes whose state lives in an environment worker:
  rebuilt by replay when it is replaced, checked in a check worker;
- :mod:`.process`: :class:`WorkerProcess`, one child asked requests with deadlines, killed and
  replaced when it must be, and who is to blame;
- :mod:`.wire`: what the server and its workers say to each other;
- :mod:`.env_worker`, :mod:`.check_worker`: the two children (``python -m ...``), started by :mod:`.child`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servers.workers.process import WorkerGone, WorkerProcess
    from servers.workers.store import WorkerEpisodeStore

__all__ = ["WorkerEpisodeStore", "WorkerGone", "WorkerProcess"]

# Loaded when first named: the workers, which import this package, never need the server's side of it.
_HOMES = {"WorkerEpisodeStore": "store", "WorkerGone": "process", "WorkerProcess": "process"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
