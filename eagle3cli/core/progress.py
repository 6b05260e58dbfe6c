"""Progress a log file can show: a plain line at least every ``interval`` seconds.

A terminal gets rich's live bars (gen-data, train, eval draw their own). Redirected to a file (CI,
nohup, a notebook) a live bar is drawn once, at the end, so a long step would print nothing for
many minutes. :class:`LogProgress` prints ``label: done/total unit (pct), rate, elapsed, eta``
lines there instead, as pip and huggingface_hub do: on an update once the interval has passed,
and from a heartbeat thread when no update comes (a shard or a prompt can take longer than the
interval). On a terminal it prints nothing.

The interval is 30 s, or ``$EAGLE3_PROGRESS_INTERVAL`` seconds (the tests run with 1).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

DEFAULT_INTERVAL = 30.0
INTERVAL_ENV = "EAGLE3_PROGRESS_INTERVAL"


def progress_interval() -> float:
    """Seconds between log lines: $EAGLE3_PROGRESS_INTERVAL, else 30."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL))
    except ValueError:
        return DEFAULT_INTERVAL
    return value if value > 0 else DEFAULT_INTERVAL


def clock_text(seconds: float) -> str:
    """12:05, or 1:02:09 past an hour."""
    s = max(0, int(round(seconds)))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class LogProgress:
    """Plain progress lines for a console that is not a terminal (see the module docstring).

    ``done0``: what was already done before this run (a resumed store): it counts in done/total
    but not in the rate. ``extra()``: more text for the line (tokens/s, loss). ``enabled``:
    default, when ``console`` is not a terminal. ``clock`` is for tests.
    """

    def __init__(self, label: str, total: int, unit: str, console, done0: int = 0, interval: float | None = None,
                 enabled: bool | None = None, extra: Callable[[], str] | None = None,
                 clock: Callable[[], float] = time.monotonic, heartbeat: bool = True):
        self.label, self.total, self.unit, self.console = label, total, unit, console
        self.interval = progress_interval() if interval is None else interval
        self.enabled = (not getattr(console, "is_terminal", False)) if enabled is None else enabled
        self.extra, self.clock = extra, clock
        self.done0 = self.done = done0
        self.printed = None  # the done count of the last line printed
        self.t0 = self.last = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self.enabled and heartbeat:
            self._thread = threading.Thread(target=self._beat, name=f"progress-{label}", daemon=True)
            self._thread.start()

    def rate(self, now: float | None = None) -> float:
        """Units per second since the start (what was done before it excluded)."""
        dt = (self.clock() if now is None else now) - self.t0
        return (self.done - self.done0) / dt if dt > 0 else 0.0

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        rate = self.rate(now)
        left = max(0, self.total - self.done)
        eta = clock_text(left / rate) if rate > 0 else "?"
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        extra = self.extra() if self.extra else ""
        return (f"{self.label}: {self.done:,}/{self.total:,} {self.unit}{pct}, {rate:.2f} {self.unit}/s"
                f"{', ' + extra if extra else ''}, elapsed {clock_text(now - self.t0)}, eta {eta}")

    def update(self, done: int | None = None, advance: int = 0, force: bool = False):
        """Record progress (``done`` absolute, or ``advance`` more); print when a line is due, or now
        with ``force`` (units that take long each, such as eval's prompts, get a line apiece)."""
        with self._lock:
            self.done = (self.done if done is None else done) + advance
        self._print_if_due(force)

    def _print_if_due(self, force: bool = False):
        if not self.enabled:
            return
        with self._lock:
            now = self.clock()
            if not force and now - self.last < self.interval:
                return
            self.last, self.printed = now, self.done
            text = self.line(now)
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def _beat(self):
        while not self._stop.wait(max(0.05, self.last + self.interval - self.clock())):
            self._print_if_due()

    def close(self, final: bool = True):
        """Stop the heartbeat; ``final``: print the last line (done/total, rate, elapsed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if final and self.printed != self.done:  # the last state, unless its line is out already
            self._print_if_due(force=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(final=exc[0] is None)
