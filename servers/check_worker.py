"""The check worker: ``python -m servers.check_worker FD``, started by a server (``servers.worker_store``).

It runs an environment's checks where the environment's code never runs: that code can patch, in
its own process, anything a checker there would use, and so decide its own reward. The checks get
the states as data: the server asks the environment worker for what an episode changed, and sends
it here with the checklist; this process keeps each scenario's initial state (by its hash, sent once).

Check code is untrusted too, and can patch its own process as well (``builtins.bool``, the checker's
functions), so this process is a zygote that never runs it: for each request it forks a child that
builds the final state, takes new processes away from itself (the seccomp policy of
``envscaler.seccomp``: the sandbox lets this process fork), runs the checks, each under its time
limit, sends the verdicts back through a pipe and exits. Whatever a check changed dies with its
child, so no validation sees another's. A child that runs past the checks' limit is killed here (the
request gets CallAbandoned), one that ends before it answers costs its validation only
(ChecklistError). The server kills this process when an answer is overdue all the same (it runs one
request at a time, and marks the episode whose checks it runs).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
from collections import OrderedDict
from typing import Any

from envscaler.checks import check_states
from envscaler.errors import ChecklistError
from envscaler.guard import keep_alarm_handler, protect_time_limits
from envscaler.sandbox import die_with_parent
from envscaler.seccomp import seccomp_policy
from envscaler.state import apply_changes
from servers.asgi import json_bytes
from servers.episodes import checks_limit_s
from servers.worker_process import child_main
from servers.worker_wire import (
    FAILED,
    HEADER,
    HELLO_ID,
    MAX_FRAME_BYTES,
    OK,
    CheckerSettings,
    CheckRequest,
    CheckResults,
    FrameReader,
    FrameTooLarge,
    RunningMarks,
    WorkerFailure,
    decode,
    frame,
    read_settings,
    recv_frame,
)

# Initial states kept, most recently used last.
KEPT_INITIALS = 32
# A child's exit status when it could not send its answer (its checks broke its own process).
_EXIT_UNANSWERED = 70


class Checker:
    """The initial states held, and a child forked for the checks of each request."""

    def __init__(self, settings: CheckerSettings, sock: socket.socket) -> None:
        self.settings = settings
        self.sock = sock
        self.mark = RunningMarks(settings.mark_fd) if settings.mark_fd is not None else None
        self.initials: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # Built once here; each child only loads it.
        self.policy = seccomp_policy() if settings.child_seccomp else None

    def check(self, request: CheckRequest) -> tuple[int, bytes]:
        """(status, payload) of the answer: each check's verdict on the request's states, CheckResults with
        ``missing_initial`` when its initial state is not held, or a WorkerFailure."""
        initial = request.initial
        if request.initial_key is not None:
            if initial is not None:
                self.initials[request.initial_key] = initial
                if len(self.initials) > KEPT_INITIALS:
                    self.initials.popitem(last=False)
            else:
                initial = self.initials.get(request.initial_key)
                if initial is None:
                    return OK, json_bytes(CheckResults(missing_initial=True))
                self.initials.move_to_end(request.initial_key)
        if initial is None:
            raise ChecklistError("the request holds no initial state")
        if self.mark is not None:
            self.mark.set(0, request.handle)
        try:
            return self._in_child(request, initial)
        finally:
            if self.mark is not None:
                self.mark.clear(0)

    def _in_child(self, request: CheckRequest, initial: dict[str, Any]) -> tuple[int, bytes]:
        limit_s = checks_limit_s(request.checklist, self.settings.check_timeout_s)
        answers, answer_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            # Nothing the checks do may return here: this is a copy of the zygote's loop.
            exit_now = os._exit
            try:
                os.close(answers)
                self._run_child(request, initial, answer_end)
            finally:
                exit_now(_EXIT_UNANSWERED)
        os.close(answer_end)
        try:
            data, ended = _read_until_closed(answers, time.monotonic() + limit_s)
        finally:
            os.close(answers)
        # Its answer is in (or its time is up): nothing it still does counts.
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if not ended:
            raise _Abandoned(f"the checks did not finish within {limit_s:g} s; their process was killed")
        reader = FrameReader()
        try:
            frames = reader.feed(data)
        except FrameTooLarge as e:
            raise ChecklistError(f"the checks' process answered {e}") from None
        if len(frames) != 1 or reader.buffer:
            raise ChecklistError(f"the checks' process ended without an answer ({_how_it_ended(status)})")
        _, answer_status, payload = frames[0]
        if answer_status != OK:
            # Only ever a checklist error: checks must not pass for the server's other errors (a lost episode).
            try:
                message = decode(WorkerFailure, payload).message
            except (ValueError, RecursionError):
                message = "the checks' process answered with a malformed error"
            raise ChecklistError(message)
        return OK, payload

    def _run_child(self, request: CheckRequest, initial: dict[str, Any], answer_end: int) -> None:
        """The child's whole life: confine itself, run the checks, write the answer to ``answer_end``, exit."""
        die_with_parent(signal.SIGKILL)
        # The server's socket and the marks page are the zygote's: the checks reach neither.
        self.sock.close()
        if self.mark is not None:
            self.mark.close()
        try:
            if self.policy is not None:
                try:
                    self.policy.load()
                except OSError as e:
                    raise ChecklistError(f"the checks' process could not take new processes away from itself: {e}") from None
            answer: Any = CheckResults(checks=self._checks(request, initial))
            status = OK
        except ChecklistError as e:
            answer, status = WorkerFailure(error="ChecklistError", message=str(e)), FAILED
        with open(answer_end, "wb") as out:
            out.write(frame(0, answer, status))
        os._exit(0)

    def _checks(self, request: CheckRequest, initial: dict[str, Any]) -> list[Any]:
        try:
            final = apply_changes(initial, request.changes) if request.changes is not None else request.final
        except ValueError as e:
            raise ChecklistError(f"the episode's changes do not fit its initial state: {e}") from None
        if final is None:
            raise ChecklistError("the request holds no final state")
        return check_states(request.checklist, final, initial, self.settings.check_timeout_s)


class _Abandoned(Exception):
    """The checks ran past their limit (the server's CallAbandoned)."""


def _read_until_closed(fd: int, deadline: float) -> tuple[bytes, bool]:
    """What was written to ``fd`` until its writer closed it or wrote more than a frame may hold (True),
    or until ``deadline`` (False)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(int(left * 1000) + 1):
            return b"".join(chunks), False
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
        if size > HEADER.size + MAX_FRAME_BYTES:
            return b"".join(chunks), True


def _how_it_ended(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def run_checker(sock: socket.socket) -> None:
    """Answer check requests, one at a time, until the server closes the socket."""
    settings = read_settings(sock, CheckerSettings)
    protect_time_limits()
    keep_alarm_handler()
    checker = Checker(settings, sock)
    sock.sendall(frame(HELLO_ID, {}))
    while True:
        try:
            request_id, _, payload = recv_frame(sock)
        except EOFError:
            return
        try:
            status, answer = checker.check(decode(CheckRequest, payload))
        except ChecklistError as e:
            status, answer = FAILED, json_bytes(WorkerFailure(error="ChecklistError", message=str(e)))
        except _Abandoned as e:
            status, answer = FAILED, json_bytes(WorkerFailure(error="CallAbandoned", message=str(e)))
        except (ValueError, RecursionError) as e:
            status, answer = FAILED, json_bytes(WorkerFailure(error="ChecklistError", message=f"unreadable check request: {e}"))
        sock.sendall(HEADER.pack(len(answer), request_id, status) + answer)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m servers.check_worker FD`` (FD: the server's end of a socket pair)."""
    return child_main("servers.check_worker", run_checker, argv)


if __name__ == "__main__":
    sys.exit(main())
