"""Time limits for untrusted environment code.

Python cannot kill a thread, so a limit is enforced by raising an exception inside the code:

- on the main thread, a ``SIGALRM`` interval timer raises it from a signal handler, which also
  interrupts blocking calls such as ``time.sleep``;
- on any other thread, one watchdog thread injects it with ``PyThreadState_SetAsyncExc``. That
  stops pure-Python loops; a blocking C call is only interrupted when it returns, so callers that
  must answer on time (the server) also wait with their own timeout.

Both mechanisms repeat the exception until the call ends, because environment code may swallow it
with a bare ``except:``. On the main thread, code that swallows it a second time gets a line tracer
that raises it again on every line it runs, so not even ``while True: try/except: pass`` survives.
The exceptions derive from BaseException so that the usual ``except Exception`` does not catch them.

A limit counts the call's own time (``envscaler.own_time``): the time its thread waited for a CPU on
a busy machine is added to the wall-clock deadline. :func:`call_preemptibly`'s budget is wall-clock
time: running out of it costs only a run elsewhere.

An exception raised inside Python's import system itself (not in the module it imports) can skip the
clean-up of the failed import and leave a half-made module in ``sys.modules``, which every later import
in the process would then get (``datetime.strptime`` failing for good, say). So once a limit has ended a
call, each module whose import it ended is taken out of ``sys.modules`` should it still be there.

:func:`call_preemptibly` is the main thread's short leash: it gives code a small budget and raises
:class:`Preempted` if the code ran past it, so that a caller can run it again where a long run
harms nobody (the environment server runs tool calls on its event loop this way).

Environment code could defeat these limits from inside: ignore SIGALRM, stop the timer, clear the
tracer, raise the switch interval, or start a thread that runs on after its call. A process that
runs it calls :func:`protect_time_limits` once; from then on code under a limit is refused those
(a ``PermissionError`` it can report), and so are new processes and ``ctypes``. This is a speed
bump, not a wall (Python code can reach the functions it is refused through their wrappers): the
backstop is outside the process, a supervisor that restarts a server that stops answering.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

from envscaler.own_time import OwnTimeLimit, thread_reading

T = TypeVar("T")

_REPEAT_S = 0.05
_SLEEP_AFTER_S = 1.0

# Our own uses of what environment code is refused (protect_time_limits replaces the module attributes).
_setitimer = signal.setitimer
_signal = signal.signal
_settrace = sys.settrace
_gettrace = sys.gettrace
_get_ident = threading.get_ident
_get_native_id = threading.get_native_id
# Threads running environment code under a limit now.
_guarded: set[int] = set()


class GuardSignal(BaseException):
    """Base of the guard's own interruptions: code that reports untrusted code's errors re-raises these."""


class TimeLimitExceeded(GuardSignal):
    """Raised inside code that ran past its time limit."""


class Preempted(GuardSignal):
    """The code ran past its budget under :func:`call_preemptibly`; its run must not be used."""


def can_preempt() -> bool:
    """Whether this thread can use :func:`call_preemptibly`: only the main thread handles SIGALRM."""
    return threading.current_thread() is threading.main_thread()


def call_with_limit(fn: Callable[..., T], limit_s: float, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)``; raise TimeLimitExceeded once it has run ``limit_s`` of its own time
    (time its thread waited for a CPU does not count)."""
    native_id = _get_native_id()
    if can_preempt():
        # Its waits are read now (a few microseconds): a signal to read them later would cost more.
        limit = OwnTimeLimit(limit_s, functools.partial(thread_reading, native_id), mark=thread_reading(native_id))
        return _run_with_alarm(_Alarm(TimeLimitExceeded, limit), fn, limit_s, args, kwargs)
    return _WATCHDOG.call(fn, OwnTimeLimit(limit_s, functools.partial(thread_reading, native_id)), args, kwargs)


def _drop_half_imported(error: BaseException) -> None:
    """Take out of ``sys.modules`` each module whose import ``error`` (or an exception it was raised
    while handling) ended, where the import system left it there (the interruption hit its clean-up):
    every later import would get it half made."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        trace = current.__traceback__
        while trace is not None:
            frame = trace.tb_frame
            if frame.f_code.co_name == "_load_unlocked" and frame.f_code.co_filename.startswith("<frozen importlib"):
                spec, module = frame.f_locals.get("spec"), frame.f_locals.get("module")
                if spec is not None and module is not None and sys.modules.get(spec.name) is module:
                    del sys.modules[spec.name]
            trace = trace.tb_next
        current = current.__context__


def call_preemptibly(fn: Callable[..., T], budget_s: float, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` on the main thread; raise Preempted if it ran past ``budget_s``.

    Preempted is raised whenever the budget ran out during the call, also when the code swallowed
    the interruption and went on to return or raise: that run was disturbed and must be discarded.
    """
    if not can_preempt():
        raise RuntimeError("call_preemptibly needs the main thread (it uses SIGALRM)")
    alarm = _Alarm(Preempted)
    try:
        result = _run_with_alarm(alarm, fn, budget_s, args, kwargs)
    except BaseException:
        if alarm.fired:
            raise Preempted() from None
        raise
    if alarm.fired:
        raise Preempted()
    return result


def keep_alarm_handler() -> None:
    """Install the SIGALRM handler for the life of the process (main thread only).

    Otherwise each guarded call installs it and puts the previous one back, which costs a few
    microseconds a call: worth saving in a server that guards every call, and owns its signals.
    """
    global _handler_kept
    _signal(signal.SIGALRM, _on_alarm)
    _handler_kept = True


def block_alarm_in_this_thread() -> None:
    """Keep SIGALRM away from the calling (non-main) thread.

    The kernel may deliver a process-wide signal to any thread that does not block it, and only
    the thread that receives it has its blocking call (``time.sleep``) interrupted.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})


class _Alarm:
    """One armed SIGALRM timer on the main thread: what it raises, how often it fired, and the limit
    that decides when it first does (none: the timer's own deadline)."""

    __slots__ = ("error", "limit", "fired", "frame", "previous_trace", "tracing")

    def __init__(self, error: type[BaseException], limit: OwnTimeLimit | None = None) -> None:
        self.error = error
        self.limit = limit
        self.fired = 0
        self.frame: FrameType | None = None
        self.previous_trace: Any = None
        self.tracing = False


_current: _Alarm | None = None
_handler_kept = False


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    alarm = _current
    if alarm is None:
        return  # a late tick after the call ended
    if not alarm.fired and alarm.limit is not None and not alarm.limit.reached():
        return  # it waited for a CPU: its own time is not up yet (the timer ticks again in _REPEAT_S)
    alarm.fired += 1
    if alarm.fired > 1 and not alarm.tracing:
        _trace_to_stop(alarm, frame)
    raise alarm.error()


def _trace_to_stop(alarm: _Alarm, frame: FrameType | None) -> None:
    """The code swallowed the interruption: make every line it runs from now on raise it again."""
    below: list[FrameType] = []
    while frame is not None and frame is not alarm.frame:
        below.append(frame)
        frame = frame.f_back
    if frame is None:
        return  # not inside the guarded call: nothing of ours to trace

    def stop(frame: FrameType, event: str, arg: Any) -> Any:
        if _current is not alarm:
            return None
        if event == "line":
            raise alarm.error()
        return stop

    alarm.tracing = True
    alarm.previous_trace = _gettrace()
    for guarded in below:
        guarded.f_trace_lines = True
        guarded.f_trace = stop
    _settrace(stop)


def _run_with_alarm(alarm: _Alarm, fn: Callable[..., T], seconds: float, args: tuple, kwargs: dict) -> T:
    global _current
    previous = None if _handler_kept else _signal(signal.SIGALRM, _on_alarm)
    alarm.frame = sys._getframe()
    _current = alarm
    thread = _get_ident()
    marked = thread not in _guarded
    _setitimer(signal.ITIMER_REAL, seconds, _REPEAT_S)
    _guarded.add(thread)
    interrupted: BaseException | None = None
    try:
        return fn(*args, **kwargs)
    except BaseException as error:
        interrupted = error
        raise
    finally:
        # The alarm may fire once more while we disarm; absorb it so it never escapes the guard.
        while True:
            try:
                if marked:
                    _guarded.discard(thread)
                _current = None
                _setitimer(signal.ITIMER_REAL, 0)
                if alarm.tracing:
                    _settrace(alarm.previous_trace)
                if not _handler_kept:
                    _signal(signal.SIGALRM, previous)
                alarm.frame = None  # the frame holds the alarm: a cycle that would keep the call's locals
                break
            except alarm.error:
                continue
        if interrupted is not None and alarm.fired:
            _drop_half_imported(interrupted)  # disarmed: nothing interrupts this
        interrupted = None  # its traceback holds this frame: the same cycle


class _Entry:
    __slots__ = ("thread_id", "limit", "repeat_at", "fired")

    def __init__(self, thread_id: int, limit: OwnTimeLimit) -> None:
        self.thread_id = thread_id
        self.limit = limit
        self.repeat_at = 0.0
        self.fired = False


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)


class _Watchdog:
    """One daemon thread that raises TimeLimitExceeded in worker threads past their deadline.

    Registering a call happens on every tool call, so it never wakes the watchdog (a thread wake-up
    costs more than the call): while calls come and go the watchdog polls every ``_REPEAT_S``, and
    only after ``_SLEEP_AFTER_S`` without any does it sleep until the next registration wakes it.
    A limit is therefore enforced up to ``_REPEAT_S`` late.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._wake = threading.Event()
        self._asleep = True
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[..., T], limit: OwnTimeLimit, args: tuple, kwargs: dict) -> T:
        entry = _Entry(threading.get_ident(), limit)
        key = id(entry)
        try:
            with self._lock:
                self._entries[key] = entry
                if self._asleep:
                    self._asleep = False
                    self._ensure_thread()
                    self._wake.set()
            marked = entry.thread_id not in _guarded
            _guarded.add(entry.thread_id)
            try:
                return fn(*args, **kwargs)
            finally:
                if marked:
                    _guarded.discard(entry.thread_id)
                self._forget(key)
                if entry.fired:
                    # Drop an injected exception that has not been raised yet.
                    _set_async_exc(entry.thread_id, ctypes.py_object())
        except BaseException as e:
            if entry.fired:
                _set_async_exc(entry.thread_id, ctypes.py_object())
                _drop_half_imported(e)
            raise

    def _forget(self, key: int) -> None:
        # An injection can land while we deregister; retry so the entry is always removed.
        while True:
            try:
                with self._lock:
                    self._entries.pop(key, None)
                return
            except TimeLimitExceeded:
                continue

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="envscaler-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        block_alarm_in_this_thread()
        quiet_since: float | None = None
        while True:
            now = time.monotonic()
            with self._lock:
                for entry in self._entries.values():
                    if entry.repeat_at <= now if entry.fired else entry.limit.reached(now):
                        entry.fired = True
                        entry.repeat_at = now + _REPEAT_S
                        _set_async_exc(entry.thread_id, ctypes.py_object(TimeLimitExceeded))
                if self._entries:
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = now
                elif now - quiet_since >= _SLEEP_AFTER_S:
                    self._asleep = True
                    self._wake.clear()
            if self._asleep:
                self._wake.wait()
                quiet_since = None
            else:
                time.sleep(_REPEAT_S)


_WATCHDOG = _Watchdog()


def guard_thread_ids() -> set[int]:
    """The operating system's ids of the threads the guard runs (its watchdog, once started)."""
    thread = _WATCHDOG._thread
    return {thread.native_id} if thread is not None and thread.native_id is not None and thread.is_alive() else set()


# (module, attribute, what environment code is told it may not do)
_REFUSED: tuple[tuple[str, str, str], ...] = (
    *((module, name, "change signal handling: it enforces time limits")
      for module in ("signal", "_signal")
      for name in ("signal", "setitimer", "alarm", "pthread_sigmask", "siginterrupt", "set_wakeup_fd")),
    *(("sys", name, "change the interpreter's tracing, switching or recursion limits: they keep its time limits and its stack safe")
      for name in ("settrace", "setprofile", "setswitchinterval", "setrecursionlimit")),
    *(("threading", name, "change how threads are traced") for name in ("settrace", "setprofile")),
    # threading.Thread.start calls _start_new_thread up to Python 3.12, _start_joinable_thread from 3.13 on.
    *(("_thread", name, "start threads: one would run on after its call")
      for name in ("start_new_thread", "start_new", "start_joinable_thread")),
    *(("threading", name, "start threads: one would run on after its call") for name in ("_start_new_thread", "_start_joinable_thread")),
    *(("os", name, "start processes") for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")),
    ("_posixsubprocess", "fork_exec", "start processes"),
)
_REFUSED_EVENTS = {"ctypes.dlopen": "load C libraries", "ctypes.dlsym": "call C functions",
                   "ctypes.call_function": "call C functions", "ctypes.cdata": "reach raw memory"}
_protected = False


@contextlib.contextmanager
def running_env_code() -> Iterator[None]:
    """Mark the calling thread as running environment code (without a time limit: a module's load),
    so that what :func:`protect_time_limits` refuses is refused to it."""
    thread = _get_ident()
    marked = thread not in _guarded
    _guarded.add(thread)
    try:
        yield
    finally:
        if marked:
            _guarded.discard(thread)


def protect_time_limits() -> None:
    """Refuse environment code under a limit what would defeat the limits (see the module's doc).

    Call it once, in a process that runs environment code, before the code is loaded. The process's
    own code (outside a limit) keeps every function.
    """
    global _protected
    if _protected:
        return
    _protected = True
    import importlib

    for module_name, attribute, what in _REFUSED:
        module = importlib.import_module(module_name)
        original = getattr(module, attribute, None)
        if original is not None:
            setattr(module, attribute, _refused_to_env_code(original, what))
    sys.addaudithook(_audit)


def _refused_to_env_code(original: Callable[..., T], what: str) -> Callable[..., T]:
    def guarded(*args: Any, **kwargs: Any) -> T:
        if _get_ident() in _guarded:
            raise PermissionError(f"environment code may not {what}")
        return original(*args, **kwargs)

    guarded.__name__ = getattr(original, "__name__", "guarded")
    guarded.__doc__ = original.__doc__
    return guarded


def _audit(event: str, args: tuple[Any, ...]) -> None:
    what = _REFUSED_EVENTS.get(event)
    if what is not None and _get_ident() in _guarded:
        raise PermissionError(f"environment code may not {what}")
