"""gen-data's progress loop: shard after shard within --max-minutes, a live bar on a terminal and
a plain line at least every 30 s in a log (core/progress.py), the manifest rewritten after each."""

from __future__ import annotations

import time
from contextlib import ExitStack

from ..core.progress import LogProgress
from ..core.threads import adapt as adapt_threads
from ..core.time_limit import now
from .gen_errors import GenDataError
from .store_build import write_manifest


class GenProgress:
    """The bar and the log line of one run, counted in conversations: ``already`` were done by an
    earlier run; ``within_shard`` moves the log line during a shard, ``shard_done`` after it."""

    def __init__(self, console, total: int, already: int):
        self.console, self.total, self.already = console, total, already
        self.conv, self.tok, self.t0 = 0, 0, time.perf_counter()
        self.shard_base = already  # conversations done before the shard in progress

    def rates(self) -> str:
        dt = max(1e-9, time.perf_counter() - self.t0)
        return f"{self.conv / dt:.2f} conv/s  {self.tok / dt:,.0f} tok/s"

    def _stored_rate(self) -> str:  # the log line's extra, once a shard is stored
        if not self.tok:
            return ""
        return f"{self.tok / max(1e-9, time.perf_counter() - self.t0):,.0f} stored tok/s"

    def __enter__(self):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._stack = ExitStack()
        self.log = self._stack.enter_context(LogProgress("gen-data", self.total, "conversations", self.console,
                                                         done0=self.already, extra=self._stored_rate))
        self.bar = self._stack.enter_context(Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rates]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False))
        self.task = self.bar.add_task("gen-data", total=self.total, completed=self.already, rates="")
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def status(self, text: str):
        self.bar.update(self.task, description=text, rates=self.rates())

    def within_shard(self, done: int):
        """``done`` conversations of the shard in progress are finished."""
        self.log.update(self.shard_base + done)

    def shard_done(self, s: int, n_convs: int, stats: dict):
        self.conv += n_convs
        self.tok += stats["num_tokens"]
        self.shard_base += n_convs
        self.log.update(self.shard_base)
        self.bar.update(self.task, advance=n_convs, description=f"shard {s} done", rates=self.rates())
        if not self.console.is_terminal:  # logs get a line per shard (no live bar there)
            self.console.print(f"shard {s}: {stats['num_samples']} samples, {stats['num_tokens']:,} tokens"
                               f"; {self.rates()}", highlight=False)


def say_stopped(console, clock, finished: int, todo: int, next_convs: int):
    """--max-minutes reached before the next shard: say what is kept and how to go on."""
    rate = clock.rate() or 0.0
    console.print(f"time limit ({clock.describe()}): stopped after {finished} of the {todo} shards "
                  f"this run had to do (the next would need ~{rate * next_convs / 60:.1f} min "
                  f"at {rate:.1f} s a conversation, {max(0.0, clock.left()) / 60:.1f} min are left); "
                  "the finished shards are kept and the store is incomplete: run the same command again "
                  "to finish it, or train on it with --allow-incomplete", highlight=False, markup=False)


def run_shards(pipe, todo: list[int], base: dict, n_shards: int):
    """Process this rank's unfinished shards ``todo`` through ``pipe.process_shard``, stopping
    before a shard that would not fit in the time left; ``pipe.progress`` is this run's GenProgress."""
    from ..engines.vllm_engine import VllmEngineError
    from .endpoint import EndpointError

    o, console, size = pipe.opts, pipe.console, pipe.opts.shard_size
    total = sum(len(pipe.convs[s * size:(s + 1) * size]) for s in range(n_shards) if s % pipe.world == pipe.rank)
    already = total - sum(len(pipe.convs[s * size:(s + 1) * size]) for s in todo)
    pipe.progress = GenProgress(console, total, already)
    pipe.say_estimate([c for s in todo for c in pipe.convs[s * size:(s + 1) * size]])
    with pipe.progress as progress:
        for finished, s in enumerate(todo):
            convs = pipe.convs[s * size:(s + 1) * size]
            if not pipe.clock.fits(len(convs)):
                say_stopped(console, pipe.clock, finished, len(todo), len(convs))
                break
            if o.adapt_threads:
                adapt_threads("gen-data", lambda m: console.print(m, highlight=False))
            shard_t0 = now()
            try:
                stats = pipe.process_shard(s, convs)
            except (EndpointError, VllmEngineError) as e:
                raise GenDataError(f"{e} (finished shards are kept; rerun the same command to resume)") from None
            pipe.clock.record(now() - shard_t0, len(convs))
            progress.shard_done(s, len(convs), stats)
            write_manifest(pipe.out, base, n_shards)
