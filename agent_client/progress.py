"""``envscaler run``'s live progress on stderr: done, rate, ETA and the rewards so far.

On a terminal one line is redrawn after every episode; in a log (a pipe, a file, CI) a plain line
is written every 25 episodes, every 30 seconds of a slow run, and at the end, so a log stays short
but never goes quiet for long.
"""

from __future__ import annotations

import time
from typing import TextIO

from agent_client.models import Record, RecordScore

_LOG_EVERY = 25
_LOG_PERIOD_S = 30.0


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """Counts episodes as they end and shows where the run stands."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.done = 0
        self.rewards: list[float] = []
        self.successes = 0
        self.infra = 0
        self.started = time.monotonic()
        self.last_line = self.started
        self.interactive = stream.isatty()

    def add(self, record: Record | RecordScore) -> None:
        """Count ``record``'s episode and show the new totals when it is time to."""
        self.done += 1
        if record.infra_failed:
            self.infra += 1
        elif record.reward is not None:
            self.rewards.append(record.reward)
            self.successes += record.reward == 1.0
        if not self.enabled:
            return
        now = time.monotonic()
        due = self.done % _LOG_EVERY == 0 or now - self.last_line >= _LOG_PERIOD_S or self.done == self.total
        if self.interactive or due:
            self.last_line = now
            self._show(self.line(now))

    def line(self, now: float) -> str:
        """The progress line at monotonic time ``now``."""
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        scored = len(self.rewards)
        mean = sum(self.rewards) / scored if scored else 0.0
        filled = self.done * 24 // max(self.total, 1)
        timing = f"{_clock(elapsed)} elapsed" if self.done == self.total else f"ETA {_clock(left)}"
        return (f"[{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total}  {rate:.2f}/s  {timing}  "
                f"mean reward {mean:.3f}, success {self.successes}/{scored}, infra errors {self.infra}")

    def _show(self, line: str) -> None:
        if self.interactive:
            # \x1b[K clears what a longer previous line left at the end.
            print("\r" + line + "\x1b[K", end="", file=self.stream, flush=True)
            if self.done == self.total:
                print(file=self.stream)
        else:
            print(line, file=self.stream, flush=True)
