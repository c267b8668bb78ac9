"""Time limits for untrusted environment code.

Python cannot kill a thread, so the limit is enforced by raising an exception inside it:

- on the main thread, a ``SIGALRM`` interval timer raises :class:`TimeLimitExceeded` from a signal
  handler, which also interrupts blocking calls such as ``time.sleep``;
- on any other thread, one watchdog thread injects the exception with
  ``PyThreadState_SetAsyncExc``. That stops pure-Python loops; a blocking C call is only interrupted
  when it returns, so callers that must answer on time (the server) also wait with their own timeout.

Both mechanisms repeat the exception until the call ends, because environment code may swallow it
with a bare ``except:``. :class:`TimeLimitExceeded` derives from BaseException so that the usual
``except Exception`` in environment code does not catch it.
"""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_REPEAT_S = 0.05


class TimeLimitExceeded(BaseException):
    """Raised inside code that ran past its time limit."""


def call_with_limit(fn: Callable[..., T], limit_s: float, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)``; raise TimeLimitExceeded if it runs longer than ``limit_s``."""
    if threading.current_thread() is threading.main_thread():
        return _call_with_alarm(fn, limit_s, args, kwargs)
    return _WATCHDOG.call(fn, limit_s, args, kwargs)


def _on_alarm(signum: int, frame: Any) -> None:
    raise TimeLimitExceeded()


def _call_with_alarm(fn: Callable[..., T], limit_s: float, args: tuple, kwargs: dict) -> T:
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s, _REPEAT_S)
    try:
        return fn(*args, **kwargs)
    finally:
        # The alarm may fire once more while we disarm; absorb it so it never escapes the guard.
        while True:
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                break
            except TimeLimitExceeded:
                continue


class _Entry:
    __slots__ = ("thread_id", "deadline", "fired")

    def __init__(self, thread_id: int, deadline: float) -> None:
        self.thread_id = thread_id
        self.deadline = deadline
        self.fired = False


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)


class _Watchdog:
    """One daemon thread that raises TimeLimitExceeded in worker threads past their deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[..., T], limit_s: float, args: tuple, kwargs: dict) -> T:
        entry = _Entry(threading.get_ident(), time.monotonic() + limit_s)
        key = id(entry)
        try:
            with self._lock:
                self._entries[key] = entry
                self._ensure_thread()
            self._wake.set()
            try:
                return fn(*args, **kwargs)
            finally:
                self._forget(key)
                if entry.fired:
                    # Drop an injected exception that has not been raised yet.
                    _set_async_exc(entry.thread_id, ctypes.py_object())
        except TimeLimitExceeded:
            if entry.fired:
                _set_async_exc(entry.thread_id, ctypes.py_object())
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
        while True:
            with self._lock:
                entries = list(self._entries.values())
            if not entries:
                self._wake.wait()
                self._wake.clear()
                continue
            now = time.monotonic()
            next_deadline = now + _REPEAT_S
            with self._lock:
                for entry in entries:
                    if id(entry) not in self._entries:
                        continue
                    if entry.deadline <= now:
                        entry.fired = True
                        entry.deadline = now + _REPEAT_S
                        _set_async_exc(entry.thread_id, ctypes.py_object(TimeLimitExceeded))
                    next_deadline = min(next_deadline, entry.deadline)
            self._wake.wait(max(0.0, next_deadline - time.monotonic()))
            self._wake.clear()


_WATCHDOG = _Watchdog()
