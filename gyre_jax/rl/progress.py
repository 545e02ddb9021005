"""What a person watching the loop sees: a bar on a terminal, plain lines in a log file.

Carriage-return frames are for terminals only: written to a file they pile up by
the hundred. Off a TTY the loop prints one line per finished step (and, while a
step takes long, a heartbeat at most every ``every_s`` seconds), each with the
rate and an ETA. Fast loops (the supervised warm start) ask for a line only every
``every_s`` seconds and at the end.
"""
from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm


class Progress:
    def __init__(self, *, total: int, initial: int = 0, desc: str, enabled: bool, every_s: float,
                 line_per_step: bool = True, stream=None, unit: str = "step"):
        self.total, self.done, self.desc, self.every_s, self.unit = total, initial, desc, every_s, unit
        self.line_per_step = line_per_step  # off a TTY: a line per step, or only every every_s (fast steps)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.lines = enabled and not self.tty
        self._start_done, self._t0 = initial, time.monotonic()
        self._last_line = self._t0
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.stream) if self.tty else None
        self.status = ""

    def _eta(self) -> str:
        n = self.done - self._start_done
        el = time.monotonic() - self._t0
        if n <= 0:
            return f"{el:.0f}s elapsed"
        rate = el / n
        eta = f"ETA {rate * (self.total - self.done):.0f}s"
        if rate < 1.0:  # fast units (rollouts a report builds): "0.0s/rollout" says nothing
            return f"{n / max(el, 1e-9):.1f} {self.unit}s/s, {eta}"
        return f"{rate:.1f}s/{self.unit}, {eta}"

    def _line(self, what: str) -> None:
        print(f"{self.desc}: {what} | {self.status} | {self._eta()}", file=self.stream, flush=True)
        self._last_line = time.monotonic()

    def step(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.lines and (self.line_per_step or self.done >= self.total
                             or time.monotonic() - self._last_line >= self.every_s):
            self._line(f"{self.unit} {self.done}/{self.total}")

    def set_status(self, status: str) -> None:
        self.status = status
        if self._bar is not None:
            self._bar.set_postfix_str(status, refresh=False)
        elif self.lines and self.line_per_step and time.monotonic() - self._last_line >= self.every_s:
            self._line(f"{self.unit} {self.done}/{self.total} running")  # a heartbeat while a long step runs

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
