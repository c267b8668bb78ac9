"""The check worker: ``python -m servers.workers.check_worker FD``, started by a server (``servers.workers.store``).

It runs an environment's checks where the environment's code never runs: that code can patch, in
its own process, anything a checker there would use, and so decide its own reward. The checks get
the states as data: the server asks the environment worker for what an episode changed, and sends
it here with the checklist; this process keeps each scenario's initial state (by its hash, sent once), and
loads the data files they name once, for all of them (``envscaler.data_files``).

Check code is untrusted too, and can patch its own process as well (``builtins.bool``, the checker's
functions), so this process is a zygote that never runs it: each request's checks run in a child
forked for that request alone, which takes new processes away from itself (the seccomp policy of
``envscaler.seccomp``: the sandbox lets this process fork), builds the final state, runs the checks,
each under its time limit, sends the verdicts back through a pipe and exits. Whatever a check changed
dies with its child, so no validation sees another's. A child that runs past the checks' limit is
killed here (the request gets CallAbandoned), one that ends before it answers costs its validation
only (ChecklistError). The server kills this process when an answer is overdue all the same (it runs
one request at a time, and marks the episode whose checks it runs).

A child is forked when its request comes, with the request in memory, not ahead of it: a child kept
ready holds the pages its start copied (about 2 MB), and an environment's check worker runs the whole
time a trainer validates, so two kept ready cost 4.4 MB per environment for 4-10 ms less per validation
(on 2 cores, benchmarks/state_size.py: 5.4 -> 9.9 ms p50 for a 10 KB state, 8.9 -> 19.2 ms for 1.3 MB).
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import sys
import time
from collections import OrderedDict
from typing import Any

from envscaler.checks import check_states
from envscaler.data_files import DataFiles
from envscaler.errors import BundleError, ChecklistError
from envscaler.guard import keep_alarm_handler, protect_time_limits
from envscaler.sandbox import die_with_parent, make_undumpable
from envscaler.seccomp import seccomp_policy
from envscaler.state import apply_changes
from servers.transport.asgi import json_bytes
from servers.episodes.store import checks_limit_s
from servers.memory import release_free_memory
from servers.workers.child import child_main
from servers.workers.wire import (
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


class _Child:
    """A forked process that runs one request's checks: its pid, and where it writes its answer."""

    def __init__(self, pid: int, answers: int) -> None:
        self.pid = pid
        self.answers: int | None = answers
        self.status: int | None = None

    def close(self) -> None:
        """Close this side of its pipe (once)."""
        if self.answers is not None:
            os.close(self.answers)
            self.answers = None

    def kill(self) -> None:
        """Kill the child (nothing it still does counts) and close its pipe."""
        self.close()
        os.kill(self.pid, signal.SIGKILL)

    def reap(self, wait: bool = True) -> int | None:
        """The killed child's wait status, once it has ended (None when not yet and not ``wait``)."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, 0 if wait else os.WNOHANG)
            if pid:
                self.status = status
        return self.status


class Checker:
    """The initial states held, and a child forked for the checks of each request."""

    def __init__(self, settings: CheckerSettings, sock: socket.socket) -> None:
        self.settings = settings
        self.sock = sock
        self.mark = RunningMarks(settings.mark_fd) if settings.mark_fd is not None else None
        self.initials: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # The data files the initial states name, loaded once and shared by all of them.
        self.files = DataFiles(settings.bundle_dir, "the check worker", list_containers=False)
        # Built once here; each child only loads it.
        self.policy = seccomp_policy() if settings.child_seccomp else None
        # Children killed but not reaped yet.
        self.killed: list[_Child] = []
        self.pid = os.getpid()

    def reap_killed(self) -> None:
        """Reap the children that have ended since they were killed: between requests, off their path."""
        self.killed = [child for child in self.killed if child.reap(wait=False) is None]

    def check(self, request: CheckRequest) -> tuple[int, bytes]:
        """(status, payload) of the answer to ``request``: each check's verdict on its states, CheckResults
        with ``missing_initial`` when its initial state is not held, or a WorkerFailure."""
        initial = request.initial
        if request.initial_key is not None:
            if initial is not None:
                try:
                    initial = self.files.resolved(initial, "the initial state")
                except BundleError as e:
                    raise ChecklistError(str(e)) from None
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
            child = self._fork(request, initial)
            return self._answer(child, checks_limit_s(request.checklist, self.settings.check_timeout_s))
        finally:
            if self.mark is not None:
                self.mark.clear(0)

    def _discard(self, child: _Child) -> None:
        """Kill ``child``; it is reaped between requests (the kernel takes a while to free its memory)."""
        child.kill()
        self.killed.append(child)

    def _fork(self, request: CheckRequest, initial: dict[str, Any]) -> _Child:
        """A child that runs ``request``'s checks on its states (``initial``: its initial state)."""
        answer_in, answer_out = os.pipe()
        # The heap so far is the garbage collector's no more: a child's collections do not write (and so
        # copy) every page of it, nor do this process's own. Objects freed by reference counting still are.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            # Nothing the checks do may return here: this is a copy of the zygote's loop.
            exit_now = os._exit
            try:
                os.close(answer_in)
                self._run_child(request, initial, answer_out)
            finally:
                exit_now(_EXIT_UNANSWERED)
        os.close(answer_out)
        return _Child(pid, answer_in)

    def _answer(self, child: _Child, limit_s: float) -> tuple[int, bytes]:
        """The answer ``child`` writes within ``limit_s``; CallAbandoned past it, ChecklistError when it
        ends without one."""
        try:
            data, ended = _read_until_closed(child.answers, time.monotonic() + limit_s)
        finally:
            # Its answer is in (or its time is up): nothing it still does counts.
            self._discard(child)
        if not ended:
            raise _Abandoned(f"the checks did not finish within {limit_s:g} s; their process was killed")
        reader = FrameReader()
        try:
            frames = reader.feed(data)
        except FrameTooLarge as e:
            raise ChecklistError(f"the checks' process answered {e}") from None
        if len(frames) != 1 or reader.buffer:
            raise ChecklistError(f"the checks' process ended without an answer ({_how_it_ended(child.reap())})")
        _, answer_status, answer = frames[0]
        if answer_status != OK:
            # Only ever a checklist error: checks must not pass for the server's other errors (a lost episode).
            try:
                message = decode(WorkerFailure, answer).message
            except (ValueError, RecursionError):
                message = "the checks' process answered with a malformed error"
            raise ChecklistError(message)
        return OK, answer

    def _run_child(self, request: CheckRequest, initial: dict[str, Any], answer_out: int) -> None:
        """The child's whole life: confine itself, run the checks, write the answer to ``answer_out``, exit."""
        if not self.settings.child_seccomp:
            # Unsandboxed, nothing else ends this process if the zygote dies. In the sandbox (where the child
            # loads the policy) the zygote is the first process of bubblewrap's PID namespace, whose end ends
            # every process in it: no need to spend half a millisecond here.
            die_with_parent(signal.SIGKILL)
            if os.getppid() != self.pid:
                os._exit(0)  # the zygote died before the kernel was asked to end this process with it
        # The server's socket and the marks page are the zygote's: the checks reach neither.
        self.sock.close()
        if self.mark is not None:
            self.mark.close()
        problem = self._confine()
        try:
            if problem is not None:
                raise ChecklistError(problem)
            answer: Any = CheckResults(checks=self._checks(request, initial))
            status = OK
        except ChecklistError as e:
            answer, status = WorkerFailure(error="ChecklistError", message=str(e)), FAILED
        with open(answer_out, "wb") as out:
            out.write(frame(0, answer, status))
        os._exit(0)

    def _confine(self) -> str | None:
        """Load the no-new-processes policy, if any; why it could not be, or None."""
        if self.policy is not None:
            try:
                self.policy.load()
            except OSError as e:
                return f"the checks' process could not take new processes away from itself: {e}"
        return None

    def _checks(self, request: CheckRequest, initial: dict[str, Any]) -> list[Any]:
        try:
            final = apply_changes(initial, request.changes) if request.changes is not None else request.final
        except ValueError as e:
            raise ChecklistError(f"the episode's changes do not fit its initial state: {e}") from None
        if final is None:
            raise ChecklistError("the request holds no final state")
        return check_states(request.checklist, final, initial, self.settings.check_timeout_s, request.context)


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
    try:
        for name in settings.data_files:
            checker.files.load(name, "a scenario's init_config")
    except BundleError as e:
        sock.sendall(frame(HELLO_ID, WorkerFailure(error="BundleError", message=str(e)), FAILED))
        raise SystemExit(1) from None
    release_free_memory()  # the start's garbage, before the children it forks inherit the pages that hold it (see env_worker)
    # Its children run as its user, with no capability: undumpable, this process is beyond their ptrace and
    # its /proc/PID/mem beyond their reach, or check code could rewrite the zygote that forks every later validation.
    make_undumpable()
    sock.sendall(frame(HELLO_ID, {}))
    while True:
        checker.reap_killed()
        if not _answer_one(checker, sock):
            return


def _answer_one(checker: Checker, sock: socket.socket) -> bool:
    """Read one request and answer it; False when the server closed the socket instead. A function of its
    own so that nothing of the request outlives it: the child forked for the next holds no other episode's data."""
    try:
        request_id, _, payload = recv_frame(sock)
    except EOFError:
        return False
    try:
        status, answer = checker.check(decode(CheckRequest, payload))
    except ChecklistError as e:
        status, answer = FAILED, json_bytes(WorkerFailure(error="ChecklistError", message=str(e)))
    except _Abandoned as e:
        status, answer = FAILED, json_bytes(WorkerFailure(error="CallAbandoned", message=str(e)))
    except (ValueError, RecursionError) as e:
        status, answer = FAILED, json_bytes(WorkerFailure(error="ChecklistError", message=f"unreadable check request: {e}"))
    sock.sendall(HEADER.pack(len(answer), request_id, status) + answer)
    return True


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m servers.workers.check_worker FD`` (FD: the server's end of a socket pair)."""
    return child_main("servers.workers.check_worker", run_checker, argv)


if __name__ == "__main__":
    sys.exit(main())
