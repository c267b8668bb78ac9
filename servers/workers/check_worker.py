"""The check worker: ``python -m servers.workers.check_worker FD``, started by a server (``servers.workers.checks``).

It runs environments' checks where the environments' code never runs: that code can patch, in its
own process, anything a checker there would use, and so decide its own reward. One check worker
serves every environment of a server process. The checks get the states as data: the server asks an
environment worker for what an episode changed, and sends it here with the checklist; this process
keeps each scenario's initial state (by its hash, sent once), and loads the data files they name once,
for all of them (``envscaler.data_files``).

Check code is untrusted too, and can patch its own process as well (``builtins.bool``, the checker's
functions), so this process is a zygote that never runs it: each request's checks run in a child
forked for that request alone, which takes away from itself new processes and every way to act on
another process (the seccomp policy of ``envscaler.seccomp``: the sandbox lets this process fork),
builds the final state, runs the checks, each under its time limit, sends the verdicts back through a
pipe and exits. Whatever a check changed dies with its child, so no validation sees another's; this
process is undumpable, so no child can reach its memory either. Several children run at once (the
server sends one request per environment at a time), each answered as it ends: one that runs past
the checks' limit is killed here (its request gets CallAbandoned), one that ends before it answers
costs its validation only (ChecklistError). The server kills this process only when an answer is
overdue all the same. Limits count the checks' own time (``envscaler.own_time``): what a child waited
for a CPU on a busy machine does not count.

A child is forked when its request comes, with the request in memory, not ahead of it: a child kept
ready holds the pages its start copied (about 2 MB), and a check worker runs the whole
time a trainer validates, so two kept ready cost 4.4 MB per environment for 4-10 ms less per validation
(on 2 cores, benchmarks/state_size.py: 5.4 -> 9.9 ms p50 for a 10 KB state, 8.9 -> 19.2 ms for 1.3 MB).

What a child costs is mostly the pages it copies (a few microseconds each), so it is made to copy few:
the checklist's functions are compiled here before the fork, the fork is the C library's (Python's
hooks after a fork would run code in the child), the seccomp program is laid out here, so the
child loads it with two system calls, this process runs a validation of its own before the first fork
(``_warm_up``), and the child writes its answer with ``os.write``.
"""

from __future__ import annotations

import functools
import gc
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

from envscaler.checks import check_states, compile_checks_ahead
from envscaler.data_files import DataFiles
from envscaler.errors import BundleError, ChecklistError
from envscaler.guard import keep_alarm_handler, protect_time_limits
from envscaler.models import CallResult, CheckContext, CheckItem, StateChange
from envscaler.own_time import GONE, OwnTimeLimit, process_reading
from envscaler.sandbox import check_libc, die_with_parent, libc, make_undumpable
from envscaler.seccomp import LoadableProgram, seccomp_bpf
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
    CheckedEnv,
    CheckerSettings,
    CheckRequest,
    CheckResults,
    FrameReader,
    FrameTooLarge,
    WorkerFailure,
    decode,
    frame,
    read_settings,
    recv_frame,
)

# Initial states kept per environment, most recently used last.
KEPT_INITIALS = 32
# How often killed children are looked for while nothing else happens.
_REAP_EVERY_MS = 50
# A child's exit status when it could not send its answer (its checks broke its own process).
_EXIT_UNANSWERED = 70
# The validation of our own that _warm_up runs, and how many times: the interpreter specialises a function's
# bytecode after it has run a few times (8 in 3.11).
_WARM_UP_CHECKS = [CheckItem(check_item="warm-up", check_func=(
    "def check_func(final_state):\n"
    "    return final_state['a'][0] == initial_state['a'][0] + 1 and len(turn_results) == 1"))]
_WARM_UP_ROUNDS = 16


class _Env:
    """What the check worker holds for one environment: its data files, and the initial states it was sent."""

    def __init__(self, env_id: str, settings: CheckedEnv) -> None:
        self.settings = settings
        # The data files the initial states name, loaded once and shared by all of them.
        self.files = DataFiles(settings.bundle_dir, env_id, list_containers=False)
        self.initials: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def initial(self, request: CheckRequest) -> dict[str, Any] | None:
        """``request``'s initial state: sent with it (and kept), or kept from an earlier request; None when
        it names one not kept."""
        initial = request.initial
        if request.initial_key is None:
            if initial is None:
                raise ChecklistError("the request holds no initial state")
            return initial
        if initial is not None:
            try:
                initial = self.files.resolved(initial, "the initial state")
            except BundleError as e:
                raise ChecklistError(str(e)) from None
            self.initials[request.initial_key] = initial
            if len(self.initials) > KEPT_INITIALS:
                self.initials.popitem(last=False)
            return initial
        initial = self.initials.get(request.initial_key)
        if initial is not None:
            self.initials.move_to_end(request.initial_key)
        return initial


class _Child:
    """A forked process that runs one request's checks: its pid, the request it answers, its limit (its
    own time: what it waited for a CPU does not count), and the pipe it writes its answer to (what came of it so far)."""

    def __init__(self, pid: int, answers: int, request_id: int, limit: OwnTimeLimit) -> None:
        self.pid = pid
        self.answers = answers
        self.request_id = request_id
        self.limit = limit
        self.received: list[bytes] = []
        self.size = 0
        self.status: int | None = None

    def kill(self) -> None:
        """Kill the child (nothing it still does counts) and close this side of its pipe."""
        os.close(self.answers)
        os.kill(self.pid, signal.SIGKILL)

    def reap(self, wait: bool = True) -> int | None:
        """The killed child's wait status, once it has ended (None when not yet and not ``wait``)."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, 0 if wait else os.WNOHANG)
            if pid:
                self.status = status
        return self.status


class Checker:
    """The environments' initial states, and a child forked for the checks of each request: several run at
    once (one per environment at most, as the server asks), each answered when it ends, in any order."""

    def __init__(self, settings: CheckerSettings, sock: socket.socket) -> None:
        self.settings = settings
        self.sock = sock
        self.envs = {env_id: _Env(env_id, env) for env_id, env in settings.envs.items()}
        # Built once here; each child only loads it.
        self.policy = LoadableProgram(seccomp_bpf(others=False), libc().prctl) if settings.child_seccomp else None
        # The children running, by the descriptor of their answers' pipe.
        self.running: dict[int, _Child] = {}
        # Children killed but not reaped yet.
        self.killed: list[_Child] = []
        self.pid = os.getpid()
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)

    def serve(self) -> None:
        """Answer requests until the server closes the socket: each is forked as it comes, and answered
        when its child ends, or once it is overdue (its child killed)."""
        while True:
            self.reap_killed()
            wait_ms = None
            if self.running:
                soonest = min(child.limit.next_check() for child in self.running.values())
                wait_ms = max(0, int((soonest - time.monotonic()) * 1000) + 1)
            if self.killed:
                wait_ms = min(wait_ms if wait_ms is not None else _REAP_EVERY_MS, _REAP_EVERY_MS)  # no killed child waits for a request to be reaped
            for fd, _ in self.poller.poll(wait_ms):
                if fd == self.sock.fileno():
                    if not _start_one(self):
                        return
                elif fd in self.running:
                    self._receive(self.running[fd])
            now = time.monotonic()
            for child in [child for child in self.running.values() if child.limit.reached(now)]:
                self._abandon(child)

    def reap_killed(self) -> None:
        """Reap the children that have ended since they were killed, off any request's path."""
        self.killed = [child for child in self.killed if child.reap(wait=False) is None]

    def start(self, request_id: int, request: CheckRequest) -> bytes | None:
        """Fork the child that runs ``request``'s checks; the answer itself when none is needed (its
        initial state is not held: CheckResults with ``missing_initial``)."""
        env = self.envs.get(request.env_id)
        if env is None:
            raise ChecklistError(f"this check worker holds no environment {request.env_id!r}")
        initial = env.initial(request)
        if initial is None:
            return json_bytes(CheckResults(missing_initial=True))
        limit_s = checks_limit_s(request.checklist, env.settings.check_timeout_s)
        compile_checks_ahead(request.checklist)
        answer_in, answer_out = os.pipe()
        # The heap so far is the garbage collector's no more: a child's collections do not write (and so
        # copy) every page of it, nor do this process's own. Objects freed by reference counting still are.
        gc.freeze()
        # The C library's fork, not os.fork: Python's hooks after a fork (threading's, logging's, random's) run
        # code that touches objects all over the heap, and each page it writes is the child's copy (about 200
        # pages, a millisecond of CPU per validation). This process has one thread, so they have nothing to
        # mend; and every child starts from the same random state, so checks that draw from it repeat.
        if threading.active_count() != 1:
            # Another thread could hold the interpreter's lock at the fork, and the child would wait for it forever.
            raise RuntimeError(f"the check worker runs {threading.active_count()} threads; its fork needs one")
        try:
            pid = libc().fork()
            if pid < 0:
                check_libc(pid, "forking the checks' process")
        except OSError:
            os.close(answer_in)
            os.close(answer_out)
            raise
        if pid == 0:
            # Nothing the checks do may return here: this is a copy of the zygote's loop.
            exit_now = os._exit
            try:
                os.close(answer_in)
                self._run_child(request, env, initial, answer_out)
            finally:
                exit_now(_EXIT_UNANSWERED)
        os.close(answer_out)
        # A forked process starts with no waits counted: its limit needs no mark.
        child = _Child(pid, answer_in, request_id, OwnTimeLimit(limit_s, functools.partial(process_reading, pid), mark=GONE))
        self.running[answer_in] = child
        self.poller.register(answer_in, select.POLLIN)
        return None

    def _receive(self, child: _Child) -> None:
        """What ``child`` wrote since; its answer once it closed its pipe (or wrote more than a frame may hold)."""
        chunk = os.read(child.answers, 1 << 20)
        child.received.append(chunk)
        child.size += len(chunk)
        if chunk and child.size <= HEADER.size + MAX_FRAME_BYTES:
            return
        self._stop(child)
        try:
            status, answer = OK, _answer(child)
        except ChecklistError as e:
            status, answer = FAILED, _failure("ChecklistError", str(e))
        self.reply(child.request_id, status, answer)

    def _abandon(self, child: _Child) -> None:
        """Kill ``child``, past its limit, and answer its request with CallAbandoned."""
        self._stop(child)
        self.reply(child.request_id, FAILED,
                   _failure("CallAbandoned", f"the checks did not finish within {child.limit.limit_s:g} s; their process was killed"))

    def reply(self, request_id: int, status: int, payload: bytes) -> None:
        """Send the server the answer to request ``request_id``: ``payload``, JSON already (a child's, passed on as it is)."""
        self.sock.sendall(HEADER.pack(len(payload), request_id, status) + payload)

    def _stop(self, child: _Child) -> None:
        """Kill ``child``: its answer is in, or its time is up, and nothing it still does counts. It is reaped
        between requests (the kernel takes a while to free its memory)."""
        del self.running[child.answers]
        self.poller.unregister(child.answers)
        child.kill()
        self.killed.append(child)

    def _run_child(self, request: CheckRequest, env: _Env, initial: dict[str, Any], answer_out: int) -> None:
        """The child's whole life: confine itself, run the checks, write the answer to ``answer_out``, exit."""
        if not self.settings.child_seccomp:
            # Unsandboxed, nothing else ends this process if the zygote dies. In the sandbox (where the child
            # loads the policy) the zygote is the first process of bubblewrap's PID namespace, whose end ends
            # every process in it: no need to spend half a millisecond here.
            die_with_parent(signal.SIGKILL)
            if os.getppid() != self.pid:
                os._exit(0)  # the zygote died before the kernel was asked to end this process with it
        # The server's socket, and the other checks' pipes, are the zygote's: the checks reach none of them. Closed
        # as descriptors: the socket object's close would run socket.py's code on pages this child would copy.
        os.close(self.sock.fileno())
        for fd in self.running:
            os.close(fd)
        problem = self._confine()
        try:
            if problem is not None:
                raise ChecklistError(problem)
            answer: Any = CheckResults(checks=_checks(request, env, initial))
            status = OK
        except ChecklistError as e:
            answer, status = WorkerFailure(error="ChecklistError", message=str(e)), FAILED
        # os.write, not a file object: building Python's file layers is code and objects no earlier write touched, on
        # pages this child would copy (about 60 of them).
        unsent = memoryview(frame(0, answer, status))
        while unsent:
            unsent = unsent[os.write(answer_out, unsent):]
        os._exit(0)

    def _confine(self) -> str | None:
        """Load the policy (no new processes, no reach into others), if any; why it could not be, or None."""
        if self.policy is not None:
            try:
                self.policy.load()
            except OSError as e:
                return f"the checks' process could not take new processes away from itself: {e}"
        return None


def _checks(request: CheckRequest, env: _Env, initial: dict[str, Any]) -> list[Any]:
    try:
        final = apply_changes(initial, request.changes) if request.changes is not None else request.final
    except ValueError as e:
        raise ChecklistError(f"the episode's changes do not fit its initial state: {e}") from None
    if final is None:
        raise ChecklistError("the request holds no final state")
    return check_states(request.checklist, final, initial, env.settings.check_timeout_s, request.context)


def _answer(child: _Child) -> bytes:
    """The answer ``child`` (killed) wrote before it closed its pipe; ChecklistError when it ended without one."""
    reader = FrameReader()
    try:
        frames = reader.feed(b"".join(child.received))
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
    return answer


def _failure(error: str, message: str) -> bytes:
    """The JSON of a failed request's answer: the server raises ``error`` (an error class's name) with ``message``."""
    return json_bytes(WorkerFailure(error=error, message=message))


def _how_it_ended(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def run_checker(sock: socket.socket) -> None:
    """Answer check requests until the server closes the socket."""
    settings = read_settings(sock, CheckerSettings)
    protect_time_limits()
    keep_alarm_handler()
    checker = Checker(settings, sock)
    try:
        for env in checker.envs.values():
            for name in env.settings.data_files:
                env.files.load(name, "a scenario's init_config")
    except BundleError as e:
        sock.sendall(frame(HELLO_ID, WorkerFailure(error="BundleError", message=str(e)), FAILED))
        raise SystemExit(1) from None
    _warm_up()
    release_free_memory()  # the start's garbage, before the children it forks inherit the pages that hold it (see env_worker)
    # Its children run as its user, with no capability: undumpable, this process is beyond their ptrace and
    # its /proc/PID/mem beyond their reach, or check code could rewrite the zygote that forks every later validation.
    make_undumpable()
    sock.sendall(frame(HELLO_ID, {}))
    checker.serve()


def _warm_up() -> None:
    """Run what each child runs (the final state built from changes, checks over it, the answer framed) on a
    tiny validation of our own, before the first fork. The first runs of a function write to memory that
    later runs only read: the interpreter specialises its bytecode in place, libraries fill their caches.
    Done here once, every child inherits that work done instead of doing it again, on pages it would have
    to copy (2 cores: about 60 fewer page copies per validation, of 600)."""
    initial = {"a": [1]}
    changes = [StateChange(path=["a", 0], before=1, after=2)]
    context = CheckContext(turn_results=[CallResult(name="warm_up", arguments={}, result={"success": True})])
    for _ in range(_WARM_UP_ROUNDS):
        results = check_states(_WARM_UP_CHECKS, apply_changes(initial, changes), initial, 1.0, context)
        frame(0, CheckResults(checks=results), OK)


def _start_one(checker: Checker) -> bool:
    """Read one request and fork its child (or answer it at once); False when the server closed the socket
    instead. A function of its own so that nothing of the request outlives it: the children forked for the
    next ones hold no other episode's data."""
    try:
        request_id, _, payload = recv_frame(checker.sock)
    except EOFError:
        return False
    try:
        answer = checker.start(request_id, decode(CheckRequest, payload))
        if answer is None:
            return True
        status = OK
    except ChecklistError as e:
        status, answer = FAILED, _failure("ChecklistError", str(e))
    except (ValueError, RecursionError) as e:
        status, answer = FAILED, _failure("ChecklistError", f"unreadable check request: {e}")
    except OSError as e:
        # No process for these checks (the group's task or memory limit, reached by the other validations running):
        # this request is refused, and nothing else is lost.
        why = os.strerror(e.errno) if e.errno else str(e)
        status, answer = FAILED, _failure("Overloaded", f"the checks' process could not be started ({why}): too many validations at "
                                                        "once for the check worker's limits (farm up --pids, --memory-mb); ask again")
    checker.reply(request_id, status, answer)
    return True


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m servers.workers.check_worker FD`` (FD: the server's end of a socket pair)."""
    return child_main("servers.workers.check_worker", run_checker, argv)


if __name__ == "__main__":
    sys.exit(main())
