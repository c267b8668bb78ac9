"""Waiting in tests for what another process does: a condition polled until it holds, or the test fails."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout_s: float = 60.0, what: str = "condition", poll_s: float = 0.1) -> None:
    """Poll ``predicate`` every ``poll_s`` until it is true; fail the test, naming ``what``, after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s:g} s"
        time.sleep(poll_s)
