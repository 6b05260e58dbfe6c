"""How gen-data paces an OpenAI-compatible server that fails, for hours of regeneration.

A vLLM or SGLang server behind a proxy restarts, sheds load and answers in odd shapes. Three
pieces keep a run going through that without hammering the server:

- :func:`backoff_delay`: the wait before a request's next try, doubling from ``BACKOFF_FIRST``
  up to ``BACKOFF_CAP``, with jitter so that many waiting requests do not come back together;
  a ``Retry-After`` header (:func:`retry_after`) lengthens it. A request keeps trying for the
  run's patience (``--endpoint-patience``), measured in time, not tries: a restart of several
  minutes is waited out.
- :class:`Health`: the server's state seen by all requests. While nothing good comes back it
  prints a line every ``SAY_EVERY`` seconds saying for how long, and one when it answers again.
- :class:`Throttle`: the requests in flight, additive-increase / multiplicative-decrease. A 429
  or 503 halves the limit (once per round of requests sent at that limit, not once per refused
  request); each answer adds 1/limit, so the limit climbs back by one per round of answers, up to
  ``--concurrency``.

The constants are module-level so that tests can shrink them (seconds instead of minutes).
"""

from __future__ import annotations

import random
import threading
import time
from email.utils import parsedate_to_datetime
from typing import Callable

BACKOFF_FIRST = 0.5  # seconds before the second try of a request
BACKOFF_CAP = 15.0  # the longest wait between two tries: a server back up is used within this
SAY_EVERY = 30.0  # seconds between two lines while the server gives no good answer
DEFAULT_PATIENCE = 600.0  # --endpoint-patience: rides through a restart of several minutes


def backoff_delay(attempt: int, rng: random.Random, first: float | None = None, cap: float | None = None) -> float:
    """Seconds to wait after the ``attempt``-th fault (0-based) of one request: half to all of
    min(cap, first * 2**attempt), drawn at random so waiting requests spread out."""
    first = BACKOFF_FIRST if first is None else first
    cap = BACKOFF_CAP if cap is None else cap
    top = min(cap, first * 2.0 ** min(attempt, 60))
    return rng.uniform(top / 2, top)


def retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return max(0.0, seconds) if seconds == seconds else None  # NaN: unreadable


def duration(seconds: float) -> str:
    """``1 h 2 min``, ``3 min 20 s``, ``45 s``, ``0.3 s``: how long, for a person."""
    if seconds < 59.95:
        return f"{round(max(0.0, seconds), 1):g} s"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60} min"
    if s >= 60:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    return f"{s} s"


class Stopped(Exception):
    """Another request gave up (or the journal failed): this one stops without trying again."""


class Health:
    """What all requests see of the server: since when nothing good came back, and the lines
    that say so (``say``; none without it)."""

    def __init__(self, where: str, patience: float, say: Callable[[str], None] | None = None):
        self.where, self.patience, self.say = where, patience, say
        self.lock = threading.Lock()
        self.down_since: float | None = None
        self.last_said = 0.0
        self.said = False  # a line about this outage was printed: say when it ends

    def ok(self):
        with self.lock:
            if self.down_since is None:
                return
            down, said = time.monotonic() - self.down_since, self.said
            self.down_since, self.said = None, False
        if said and self.say:
            self.say(f"{self.where}: answering again after {duration(down)}")

    def fault(self, what: str):
        now = time.monotonic()
        with self.lock:
            if self.down_since is None:
                self.down_since, self.last_said = now, now
                return
            if now - self.last_said < SAY_EVERY:
                return
            self.last_said, self.said = now, True
            down = now - self.down_since
        if self.say:
            self.say(f"{self.where}: no answer for {duration(down)} (last: {what}); still trying, the run "
                     f"stops after {duration(self.patience)} without one (--endpoint-patience)")


class Throttle:
    """At most ``limit`` requests in flight, ``1 <= limit <= ceiling`` (AIMD, see the module)."""

    def __init__(self, ceiling: int, say: Callable[[str], None] | None = None):
        self.ceiling = max(1, int(ceiling))
        self.limit = self.ceiling
        self.credit = 0  # answers since the limit last moved: ``limit`` of them raise it by one
        self.in_flight = 0
        self.round = 0  # bumped at each decrease: the requests of an older round do not decrease again
        self.cond = threading.Condition()
        self.say = say
        self.last_said = float("-inf")

    @property
    def allowed(self) -> int:
        return self.limit

    def acquire(self, stop: threading.Event) -> int:
        """Wait for a slot; returns the round the request is sent in (for :meth:`overloaded`)."""
        with self.cond:
            while self.in_flight >= self.limit:
                if stop.is_set():
                    raise Stopped
                self.cond.wait(0.2)
            if stop.is_set():
                raise Stopped
            self.in_flight += 1
            return self.round

    def release(self):
        with self.cond:
            self.in_flight -= 1
            self.cond.notify_all()

    def overloaded(self, sent_in: int, what: str):
        """The server refused a request of round ``sent_in`` for load (429, 503): halve the limit
        once for that round."""
        with self.cond:
            if sent_in != self.round or self.limit <= 1:
                return
            self.limit, self.credit = max(1, self.limit // 2), 0
            self.round += 1
            now, limit = time.monotonic(), self.limit
            tell = now - self.last_said >= SAY_EVERY
            if tell:
                self.last_said = now
        if tell and self.say:
            self.say(f"server busy ({what}): {limit} request{'s' if limit > 1 else ''} in flight now "
                     f"(--concurrency {self.ceiling} again as it recovers)")

    def answered(self):
        with self.cond:
            if self.limit >= self.ceiling:
                return
            self.credit += 1
            if self.credit >= self.limit:
                self.limit, self.credit = self.limit + 1, 0
                self.cond.notify_all()
