"""A worker's entry point: ``python -m servers.workers.env_worker FD`` (or ``check_worker``), started by a server.

Apart from :mod:`.process`, the server's side: a worker imports only what it runs, and each module it
imports costs every worker its memory.
"""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Callable

from envscaler import logs
from envscaler.sandbox import die_with_parent


def child_main(module: str, serve: Callable[[socket.socket], None], argv: list[str] | None = None) -> int:
    """A child's entry point, ``python -m module FD``: ``serve`` the server's end of the socket pair at FD."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print(f"usage: python -m {module} FD  (started by an environment server, not by hand)", file=sys.stderr)
        return 2
    die_with_parent(signal.SIGKILL)  # even stuck in a C loop that would not notice its socket close
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # sent to the server's group: the server stops us once it has stopped
    logs.configure("warning")
    serve(socket.socket(fileno=int(args[0])))
    return 0
