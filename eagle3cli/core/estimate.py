"""How long a long step will take here: work over a measured rate, and the line that says so.

One cost model for the quickstart's planner (``workflows.plan``) and for the estimates gen-data
and train print before their long work: regeneration costs the answer tokens it will generate
over the measured generation rate, training its steps over the measured seconds per step. The
measurements themselves need a model and live with the code that runs it; this module is pure
arithmetic, so every wing can use it.
"""

from __future__ import annotations

from typing import Iterable, Sequence

# Continuous batching generates at this share of its bound, one full decode step of all its slots:
# prefills (each turn's prompt, one slot at a time) and a batch that thins out at the end of a
# shard cost the rest. bf16: what the default quickstart's gen-data reached on 2 AMX Xeon cores,
# 0.57 and 0.60 of the bound its planner measured in two runs (multi-turn ShareGPT, 100
# conversations a shard; benchmarks/regen_throughput.py's 64 conversations reached 0.64-0.76);
# fp32: regen_throughput.py's (docs/benchmarks.md, "Regeneration and capture").
REGEN_SHARE_OF_BOUND = {"bfloat16": 0.58, "float32": 0.59}


def minutes_text(seconds: float) -> str:
    """~40 s, ~12 min, ~1.5 h."""
    if seconds < 90:
        return f"~{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"~{round(seconds / 60)} min"
    return f"~{seconds / 3600:.1f} h"


def eta_line(what: str, work: float, unit: str, rate: float, how: str = "") -> str:
    """``what: ~N min for W unit at the measured R unit/s`` (``how``: where the rate comes from)."""
    seconds = work / rate if rate > 0 else float("inf")
    when = minutes_text(seconds) if seconds != float("inf") else "unknown time"
    return f"{what}: {when} for {work:,.0f} {unit} at the measured {rate:,.0f} {unit}/s{' ' + how if how else ''}"


def regenerated(conversation: Sequence[tuple[int, int]], max_new_tokens: int, max_length: int) -> tuple[int, int]:
    """(tokens the target will generate, tokens the stored conversation holds) for one conversation
    of (user tokens, answer tokens) turns.

    As regeneration runs it: a turn is answered while its prompt stays under ``max_length``; each
    answer is as long as the dataset's (the best guess of the target's length there is before it
    runs), cut at ``max_new_tokens``, and a cut answer ends the conversation (regenerate.py).
    """
    context, total = 0, 0
    for user, answer in conversation:
        if context + user >= max_length:
            break
        context += user
        n = min(answer, max_new_tokens)
        total += n
        context += n
        if answer >= max_new_tokens:
            break
    return total, min(context, max_length)


def mean_regenerated(conversations: Iterable[Sequence[tuple[int, int]]], max_new_tokens: int,
                     max_length: int) -> tuple[float, float]:
    """regenerated() averaged over a sample of conversations ((0, 0) for none)."""
    pairs = [regenerated(c, max_new_tokens, max_length) for c in conversations]
    if not pairs:
        return 0.0, 0.0
    return sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs)


def regen_rate(bound_tokens_per_s: float, dtype: str) -> float:
    """Generated tokens/s a whole gen-data run reaches, from its measured bound in ``dtype``."""
    return bound_tokens_per_s * REGEN_SHARE_OF_BOUND.get(dtype, REGEN_SHARE_OF_BOUND["float32"])


def regen_seconds(generated_tokens: float, bound_tokens_per_s: float, dtype: str) -> float:
    return generated_tokens / max(1e-9, regen_rate(bound_tokens_per_s, dtype))


def train_seconds(steps: int, warmup_steps: int, step_s: float, warmup_step_s: float) -> float:
    """Optimizer steps at their measured cost: the --ttt-warmup ones unroll one step, the rest all."""
    warm = min(steps, max(0, warmup_steps))
    return warm * warmup_step_s + (steps - warm) * step_s
