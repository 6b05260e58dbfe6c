"""A wall-clock limit that long work checks between its units of work.

gen-data (``--max-minutes``) checks it between shards, train between optimizer steps, eval
between prompts; the quickstart gives each stage the share of its budget that is left. A unit
is never cut in the middle: the work stops *before* a unit that would not end in time, judged
from the rate of the units done so far, so what is done is kept whole (a finished shard, a
checkpointed step, a measured prompt) and the run ends within its limit. Judging by the measured
rate rather than a plan is what keeps the limit on a machine that is slower or busier than the
one the plan measured.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


def now() -> float:
    """The clock every limit reads (one place, so tests can drive it)."""
    return time.perf_counter()


@dataclass
class TimeLimit:
    """``minutes`` from ``start`` (a :func:`now` reading; default: now). ``minutes``
    None or 0: no limit (every check passes)."""

    minutes: float | None = None
    start: float = field(default_factory=now)
    seconds_done: float = 0.0  # measured seconds of the units done
    work_done: float = 0.0  # their work (shards' conversations, steps, prompts)

    @property
    def active(self) -> bool:
        return bool(self.minutes)

    def elapsed(self) -> float:
        return now() - self.start

    def left(self) -> float:
        """Seconds left (inf without a limit)."""
        return self.minutes * 60 - self.elapsed() if self.active else math.inf

    def record(self, seconds: float, work: float = 1.0):
        """One unit finished: it took ``seconds`` for ``work``."""
        self.seconds_done += seconds
        self.work_done += work

    def rate(self) -> float | None:
        """Seconds per unit of work so far (None before the first unit)."""
        return self.seconds_done / self.work_done if self.work_done > 0 else None

    def fits(self, work: float = 1.0, reserve: float = 0.0) -> bool:
        """Whether ``work`` more, at the rate so far, ends ``reserve`` seconds before the limit.
        Always True before the first unit: something must be measured (and kept) at all."""
        rate = self.rate()
        return not self.active or rate is None or work * rate + reserve <= self.left()

    def describe(self) -> str:
        return f"--max-minutes {self.minutes:g}" if self.active else "no time limit"
