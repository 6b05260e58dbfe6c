"""How fast the target regenerates and captures here, measured in seconds: what gen-data's estimate
and the quickstart's planner (workflows/plan.py) time before the long work.

The bound is one decode step of all of continuous batching's slots (``batch_decode.SlotTarget``,
in the dtype regeneration computes in); a whole run reaches a measured share of it
(``core.estimate.regen_rate``). The tokens a conversation will generate come from its turns'
lengths (``core.estimate.regenerated``).
"""

from __future__ import annotations

import time

from ..core.hf_utils import cache_kwargs


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` after one untimed call (allocation, weight packing)."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def hf_step_seconds(model, prefix: int, rows: int = 1, repeats: int = 3) -> float:
    """Median seconds of one Hugging Face decoding step of ``rows`` rows after ``prefix`` cached
    tokens each: the cache is filled once from one row and copied to the others (a step costs the
    same whatever the keys hold), and every timed step's entry is dropped again."""
    import torch
    from transformers import DynamicCache

    from ..model.target import model_device

    ids = torch.randint(3, 100, (1, prefix), device=model_device(model))
    cache = DynamicCache(config=model.config)
    kw = cache_kwargs(model, cache)
    with torch.no_grad():
        model(input_ids=ids, **kw, use_cache=True, logits_to_keep=1)
        if rows > 1:
            cache.batch_repeat_interleave(rows)
        last = ids[:, -1:].expand(rows, -1)

        def step():
            model(input_ids=last, **kw, use_cache=True, logits_to_keep=1)
            cache.crop(-1)
        return median_seconds(step, repeats)


def regen_bound(model, dtype_name: str | None, slots: int, prefix: int) -> float:
    """Generated tokens/s of one decode step of ``slots`` conversations after ``prefix`` tokens each,
    on the engine gen-data regenerates with: continuous batching where the target takes it, else
    one Hugging Face step of a static batch.

    A step costs the same whatever the cached keys hold, so the slots' caches are left as
    allocated (zeros) rather than prefilled: the prefill of ``slots x prefix`` tokens would cost
    more than the measurement itself (a minute or more on a slow or busy CPU)."""
    import torch

    from ..decode.batch_decode import SlotTarget
    from ..decode.fast_target import unsupported_reason
    from ..model.target import model_device

    dev = model_device(model)
    with torch.no_grad():
        if unsupported_reason(model) is not None:
            return slots / hf_step_seconds(model, prefix, rows=slots)
        target = SlotTarget(model, slots, prefix + 8, dtype=getattr(torch, dtype_name) if dtype_name else None)
        tokens = torch.randint(3, 100, (slots,), device=dev)
        lengths = torch.full((slots,), prefix, device=dev)
        return slots / median_seconds(lambda: target.decode(tokens, lengths), 3)


def turn_lengths(tokenizer, messages: list[dict], max_new_tokens: int) -> list[tuple[int, int]]:
    """(user tokens, answer tokens) per user turn, +8 each for the template's headers; a user turn
    the dataset does not answer counts an answer of ``max_new_tokens``."""
    def n(m):
        return len(tokenizer(m.get("content") or "", add_special_tokens=False)["input_ids"]) + 8

    turns, user = [], None
    for m in messages:
        if m["role"] == "user":
            if user is not None:
                turns.append((user, max_new_tokens))
            user = n(m)
        elif m["role"] == "assistant" and user is not None:
            turns.append((user, n(m)))
            user = None
    if user is not None:
        turns.append((user, max_new_tokens))
    return turns


def capture_tokens_per_s(model, layer_ids, regen: str, lengths: tuple[int, int] = (60, 480)) -> float:
    """gen-data's feature capture: ``capture_samples`` at its batch (``capture_budget``) on 8
    samples of ``lengths`` tokens, in the dtype ``--capture-dtype auto`` loads the target in beside
    regeneration in ``regen`` (a cast copy where that is not the target's own)."""
    import copy

    import torch

    from ..model.target import model_device
    from .samples import capture_budget, capture_dtype, capture_samples

    own = str(model.dtype).removeprefix("torch.")
    dtype = capture_dtype("auto", str(model_device(model)), own, False, regen)
    target = model if dtype == own else copy.deepcopy(model).to(getattr(torch, dtype))
    gen = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(3, 100, (n,), generator=gen).tolist()}
               for n in torch.linspace(*lengths, 8).long().tolist()]
    tokens = sum(len(s["input_ids"]) for s in samples)
    with torch.no_grad():
        return tokens / median_seconds(lambda: capture_samples(target, [dict(s) for s in samples], layer_ids,
                                                               capture_budget(target)), 1)
