"""A process that forks children on request and reports how each ended: the farm's zygote (servers)
and a server's spawner (its workers) are both one.

The requests come on a control socket (SOCK_SEQPACKET: one message per send, descriptors passed with
SCM_RIGHTS); each brings its own *channel*, a socket on which the forking process answers a
:class:`SpawnReply` (the pid, and a pidfd of the child), later an :class:`ExitReport` once it has
reaped the child, then EOF. EOF with no report means the forking process died, and the child with it
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from pydantic import BaseModel

MESSAGE_BYTES = 65536
"""The largest request or report."""


class SpawnReply(BaseModel):
    """The forked child's pid (its pidfd travels with this message), or why there is none."""

    pid: int | None = None
    error: str | None = None


class ExitReport(BaseModel):
    """The child's exit status in Popen.returncode's convention (negative: killed by that signal)."""

    status: int


@dataclass
class Forked:
    """A child the forking process has started and will reap: its pid, a pidfd, and its channel; and
    ``handed_by``, the child that handed it over (``envscaler.confine``), a zombie reaped after it."""

    pid: int
    pidfd: int
    channel: socket.socket
    handed_by: int | None = None


def fork_available() -> bool:
    """Whether this platform can run a forking process: fork, SCM_RIGHTS, PR_SET_PDEATHSIG and pidfds (Linux 5.3+)."""
    if not (sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False  # an older kernel
    return True


def serve_forks(control: socket.socket, fork: Callable[[bytes, list[int]], Forked | None], max_fds: int) -> None:
    """Run ``fork`` on each request (its data and up to ``max_fds`` descriptors, which ``fork`` owns) and
    report each child's exit on its channel, until the control socket closes.

    Single-threaded and without an event loop, as fork() needs: one selector over the control socket
    and the children's pidfds.
    """
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.data is None:
                try:
                    data, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, max_fds)
                except ConnectionResetError:
                    return
                if not data and not fds:
                    return  # our owner is done with us
                child = fork(data, fds)
                if child is not None:
                    selector.register(child.pidfd, selectors.EVENT_READ, child)
            else:
                selector.unregister(key.data.pidfd)
                report_exit(key.data)


def reply(channel: socket.socket, pid: int, handed_by: int | None = None) -> Forked:
    """Tell the child's owner its pid (with a pidfd), on its channel; the child, to watch (``handed_by``: see Forked)."""
    pidfd = os.pidfd_open(pid)
    send_quietly(channel, SpawnReply(pid=pid).model_dump_json().encode(), [pidfd])
    return Forked(pid, pidfd, channel, handed_by)


def refuse(channel: socket.socket, error: Exception) -> None:
    """Tell the owner why no child was forked, and close the channel."""
    send_quietly(channel, SpawnReply(error=f"{type(error).__name__}: {error}").model_dump_json().encode(), [])
    channel.close()


def report_exit(child: Forked) -> None:
    """Reap ``child`` (its pidfd said it ended) and report its status on its channel, then close that."""
    _, status = os.waitpid(child.pid, 0)
    if child.handed_by is not None:
        os.waitpid(child.handed_by, 0)
    os.close(child.pidfd)
    send_quietly(child.channel, ExitReport(status=os.waitstatus_to_exitcode(status)).model_dump_json().encode(), [])
    child.channel.close()


def exit_with(body: Callable[[], int]) -> NoReturn:
    """In a forked child: run ``body`` and end the process with its status (a SystemExit's as the
    interpreter would give it; 1, with the traceback on stderr, after any other exception), never
    returning to the code that forked it."""
    status = 1
    try:
        status = body()
    except SystemExit as e:
        status = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(status)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def send_quietly(channel: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send one message; an owner that stopped listening is no error here."""
    try:
        socket.send_fds(channel, [data], fds)
    except OSError:
        pass
