"""The live progress line of a local run.

    step 12/40 [####------]  reward 0.41  val_acc 0.38  stale 0.6  8.1 samples/s  02:13  eta 05:40

On a terminal the line is redrawn in place (carriage return); otherwise
(a log file, CI) one line is printed per new step, so output stays readable.
Values come from the pipeline's latest metrics; missing ones show as "-".
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


def _num(metrics: dict[str, float], key: str, fmt: str) -> str:
    value = metrics.get(key)
    return "-" if value is None else format(value, fmt)


def progress_line(
    step: int, total: int | None, metrics: dict[str, float], val_accuracy: float | None, elapsed: float,
    steps_this_session: int = 0, status: str = "",
) -> str:
    bar = ""
    eta = ""
    if total:
        filled = int(10 * min(step, total) / total)
        bar = f" [{'#' * filled}{'-' * (10 - filled)}]"
        if steps_this_session > 0 and step < total:
            eta = f"  eta {_fmt_time(elapsed / steps_this_session * (total - step))}"
    val = "-" if val_accuracy is None else f"{val_accuracy:.2f}"
    parts = [
        f"step {step}/{total or '?'}{bar}",
        f"reward {_num(metrics, 'rollout/reward_mean', '.2f')}",
        f"acc {_num(metrics, 'rollout/accuracy_mean', '.2f')}",
        f"val_acc {val}",
        f"stale {_num(metrics, 'staleness/mean', '.1f')}",
        f"{_num(metrics, 'throughput/samples_per_second', '.1f')} samples/s",
        _fmt_time(elapsed) + eta,
    ]
    line = "  ".join(parts)
    return f"{line}  {status}" if status else line


class Progress:
    """Draws progress lines; `update` is cheap and may be called often."""

    def __init__(self, total: int | None, stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self.first_step: int | None = None
        self._last_step: int | None = None
        self._last_status = ""
        self._last_draw = 0.0
        self._width = 0

    def update(self, step: int, metrics: dict[str, float], val_accuracy: float | None, status: str = "") -> None:
        if self.first_step is None:
            self.first_step = step
        elapsed = time.monotonic() - self.started
        line = progress_line(step, self.total, metrics, val_accuracy, elapsed, step - self.first_step, status)
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw < 0.2 and step == self._last_step:
                return
            self._last_draw = now
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif (step, status) != (self._last_step, self._last_status):
            self.stream.write(line + "\n")
        self._last_step, self._last_status = step, status
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (the progress line is redrawn after it)."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
