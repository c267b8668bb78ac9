"""The check worker: ``python -m servers.check_worker FD``, started by a server (``servers.worker_store``).

It runs an environment's checks where the environment's code never runs: that code can patch, in
its own process, anything a checker there would use, and so decide its own reward. The checks get
the states as data: the server asks the environment worker for what an episode changed, and sends
it here with the checklist; this process keeps each scenario's initial state (by its hash, sent once)
and builds the final state from it. Check code is untrusted too: each check runs under its time
limit, and the server kills this process when an answer is overdue (it runs one request at a time,
and marks the episode whose checks it runs).
"""

from __future__ import annotations

import socket
import sys
from collections import OrderedDict
from typing import Any

from envscaler.checks import check_states
from envscaler.errors import ChecklistError
from envscaler.guard import keep_alarm_handler, protect_time_limits
from envscaler.state import apply_changes
from servers.worker_process import child_main
from servers.worker_wire import (
    FAILED,
    HELLO_ID,
    OK,
    CheckerSettings,
    CheckRequest,
    CheckResults,
    RunningMarks,
    WorkerFailure,
    decode,
    frame,
    read_settings,
    recv_frame,
)

# Initial states kept, most recently used last.
KEPT_INITIALS = 32


class Checker:
    """The initial states held, and the checks of one request at a time."""

    def __init__(self, settings: CheckerSettings) -> None:
        self.settings = settings
        self.mark = RunningMarks(settings.mark_fd) if settings.mark_fd is not None else None
        self.initials: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def check(self, request: CheckRequest) -> CheckResults:
        """Each check's verdict on the request's states (``missing_initial`` when its initial state is not held)."""
        initial = request.initial
        if request.initial_key is not None:
            if initial is not None:
                self.initials[request.initial_key] = initial
                if len(self.initials) > KEPT_INITIALS:
                    self.initials.popitem(last=False)
            else:
                initial = self.initials.get(request.initial_key)
                if initial is None:
                    return CheckResults(missing_initial=True)
                self.initials.move_to_end(request.initial_key)
        if initial is None:
            raise ChecklistError("the request holds no initial state")
        try:
            final = apply_changes(initial, request.changes) if request.changes is not None else request.final
        except ValueError as e:
            raise ChecklistError(f"the episode's changes do not fit its initial state: {e}") from None
        if final is None:
            raise ChecklistError("the request holds no final state")
        if self.mark is not None:
            self.mark.set(0, request.episode_id)
        try:
            return CheckResults(checks=check_states(request.checklist, final, initial, self.settings.check_timeout_s))
        finally:
            if self.mark is not None:
                self.mark.clear(0)


def run_checker(sock: socket.socket) -> None:
    """Answer check requests, one at a time, until the server closes the socket."""
    settings = read_settings(sock, CheckerSettings)
    protect_time_limits()
    keep_alarm_handler()
    checker = Checker(settings)
    sock.sendall(frame(HELLO_ID, {}))
    while True:
        try:
            request_id, _, payload = recv_frame(sock)
        except EOFError:
            return
        try:
            answer: Any = checker.check(decode(CheckRequest, payload))
            status = OK
        except ChecklistError as e:
            answer, status = WorkerFailure(error="ChecklistError", message=str(e)), FAILED
        except (ValueError, RecursionError) as e:
            answer, status = WorkerFailure(error="ChecklistError", message=f"unreadable check request: {e}"), FAILED
        sock.sendall(frame(request_id, answer, status))


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m servers.check_worker FD`` (FD: the server's end of a socket pair)."""
    return child_main("servers.check_worker", run_checker, argv)


if __name__ == "__main__":
    sys.exit(main())
