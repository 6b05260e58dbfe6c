"""``train --max-minutes``: the optimizer steps that fit the time, measured as the run goes.

The run starts with the step count its data and flags give; once steps have been timed it
refits that count to the time left, so a machine slower (or faster) than expected still ends
within the limit with a finished schedule: the warm-up + decay LR schedule is stretched or
shortened to the fitted count, rather than cut off at a high learning rate. Refits happen at a
few points (the first timed steps, the first full-unroll steps after ``--ttt-warmup``, then
each tenth of the run) so the schedule moves little; before every step a hard check stops the
run when even one more step would end past the limit. What the end of a run still costs (its
last validation and export) is reserved.
"""

from __future__ import annotations

import math
import statistics

from ..core.time_limit import TimeLimit, now

# Before any full-unroll step is timed (while --ttt-warmup runs one TTT step), a full step is
# taken to cost this many warm-up steps (TTT 3: the unroll's three steps, less the shared teacher).
FULL_PER_WARMUP_STEP = 2.5
EXPORT_S = 10.0  # writing the last checkpoint and the exported draft


class StepBudget:
    """Times the steps of one run and refits its step count to ``minutes`` from ``start``;
    ``apply(steps, why)`` makes a new count the run's (its schedule, its progress view).
    ``agree(n)``: the smallest ``n`` over the run's processes. Each process times its own steps,
    and a process that stopped or refitted alone would leave the others waiting in a collective,
    so every decision is the most cautious one of them all (identity for a single process)."""

    def __init__(self, minutes: float | None, start: float, total: int, warmup_steps: int,
                 validate_cost_steps: float, apply=None, agree=lambda n: n):
        self.clock = TimeLimit(minutes, start)
        self.total = self.cap = total  # the flags' count is the most the time may give
        self.warmup, self.apply, self.agree = warmup_steps, apply, agree
        self.validate_cost = validate_cost_steps  # the final validation, in full steps
        self.warm_s: list[float] = []
        self.full_s: list[float] = []
        self._t = None
        self._refits = set()

    @property
    def active(self) -> bool:
        return self.clock.active

    def begin(self):
        self._t = now()

    def end(self, step_before: int):
        """The step that started at ``step_before`` is done. The first step of each kind allocates
        (and compiles) and is not counted."""
        seconds = now() - self._t
        kind = self.warm_s if step_before < self.warmup else self.full_s
        first = step_before == 0 or step_before == self.warmup
        if not first:
            kind.append(seconds)

    def step_seconds(self) -> tuple[float | None, float | None]:
        """(warm-up step, full step) seconds: medians of the last timed steps of each kind."""
        warm = statistics.median(self.warm_s[-8:]) if self.warm_s else None
        full = statistics.median(self.full_s[-8:]) if self.full_s else None
        if full is None and warm is not None:
            full = warm * FULL_PER_WARMUP_STEP
        return warm, full

    def reserve(self, full: float) -> float:
        return EXPORT_S + self.validate_cost * full

    def fitted(self, step: int) -> int | None:
        """The step count that fits the time left, from ``step`` (None before any step is timed)."""
        warm, full = self.step_seconds()
        if full is None:
            return None
        room = self.clock.left() - self.reserve(full)
        warm_left = max(0, self.warmup - step)
        if warm_left and room < warm_left * warm:
            more = max(0, math.floor(room / warm))
        else:
            more = warm_left + max(0, math.floor((room - warm_left * (warm or 0)) / full))
        return max(step, min(self.cap, step + more))

    def refit_due(self, step: int) -> bool:
        """A refit at the first timed steps of each kind and then at each tenth of the run."""
        if not self.active:
            return False
        marks = {2, self.warmup + 2} | {max(1, self.total * k // 10) for k in range(1, 10)}
        due = step in marks and step not in self._refits
        if due:
            self._refits.add(step)
        return due

    def one_more_fits(self, step: int) -> bool:
        """Whether the next step still ends before the reserve (True until steps are timed)."""
        if not self.active:
            return True
        warm, full = self.step_seconds()
        if full is None:
            return True
        cost = warm if step < self.warmup and warm is not None else full
        return cost + self.reserve(full) <= self.clock.left()

    # -- the two calls the training loop makes

    def before_step(self, step: int) -> bool:
        """Start timing the step from ``step``; False (the run ends here, its count set to
        ``step``) when it would end past the limit."""
        if not self.active:
            return True
        if not self.agree(int(self.one_more_fits(step))):
            self._set(step, f"time limit ({self.clock.describe()}): ending at step {step}, "
                            f"{max(0.0, self.clock.left()) / 60:.1f} min left for the last validation and export")
            return False
        self.begin()
        return True

    def after_step(self, step_before: int):
        """The step from ``step_before`` is done: time it, and refit the count where due."""
        if not self.active:
            return
        self.end(step_before)
        step = step_before + 1
        if self.refit_due(step):
            steps = self.fitted(step)  # None on every process alike: timing starts at the same steps
            steps = None if steps is None else self.agree(steps)
            if steps is not None and steps != self.total:
                warm, full = self.step_seconds()
                self._set(steps, f"time limit ({self.clock.describe()}): {steps} optimizer steps fit "
                                 f"({full:.2f} s a step measured, {self.clock.left() / 60:.1f} min left); the "
                                 "LR schedule spans them")

    def _set(self, steps: int, why: str):
        self.total = steps
        if self.apply is not None:
            self.apply(steps, why)
