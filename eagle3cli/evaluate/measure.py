"""The decodings eval times: HF ``generate`` (greedy, sampled or with prompt lookup), plain greedy
decoding on the fast path and speculative decoding, each behind one call taking the prompt's ids."""

from __future__ import annotations

import time

import torch

from ..core.hf_utils import synchronize


def hf_generate(target, ids, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                prompt_lookup: int = 0, seed: int = 0) -> list[int]:
    kw = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    if temperature > 0:
        torch.manual_seed(seed)
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None)
    if prompt_lookup:
        kw["prompt_lookup_num_tokens"] = prompt_lookup
    gc = target.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else (gc.eos_token_id if isinstance(gc.eos_token_id, int)
                                                              else (gc.eos_token_id or [0])[0])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          pad_token_id=pad, **kw)
    return out[0, ids.shape[1]:].tolist()


def timed(fn, device):
    synchronize(device)
    t0 = time.perf_counter()
    r = fn()
    synchronize(device)
    return r, time.perf_counter() - t0


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where two outputs differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Decoders:
    """Every method of one run on one prompt's ids, untimed: the same target, drafter, fast path and
    settings for the warm-up, the ``--tree auto`` calibration and the measured turns. ``settings``
    is shared, so a tree chosen by the calibration is the tree the turns decode with."""

    def __init__(self, target, drafter, fast, settings, cfg):
        self.target, self.drafter, self.fast, self.settings, self.cfg = target, drafter, fast, settings, cfg

    def spec(self, ids, settings=None):
        from ..decode.generator import speculative_generate

        return speculative_generate(self.target, self.drafter, ids, settings or self.settings, seed=self.cfg.seed,
                                    fast=self.fast)

    def hf(self, ids):
        c = self.cfg
        return hf_generate(self.target, ids, c.max_new_tokens, c.temperature, c.top_p, c.sampling_top_k, seed=c.seed)

    def fast_plain(self, ids):
        from ..decode.generator import greedy_generate

        return greedy_generate(self.target, ids, self.cfg.max_new_tokens, fast=self.fast)

    def prompt_lookup(self, ids):
        return hf_generate(self.target, ids, self.cfg.max_new_tokens, prompt_lookup=self.cfg.prompt_lookup_tokens)

    def warm_up(self, first, plain_engine=None):
        """Each method once on ``first`` for ``cfg.warmup_tokens``, in the order the turns run them."""
        from ..decode.generator import SpecSettings, greedy_generate, speculative_generate

        n = self.cfg.warmup_tokens
        warm = SpecSettings(**{**self.settings.__dict__, "max_new_tokens": n})
        speculative_generate(self.target, self.drafter, first, warm, seed=self.cfg.seed, fast=self.fast)
        hf_generate(self.target, first, n)
        if self.fast is not None:
            greedy_generate(self.target, first, n, fast=self.fast)
        if self.cfg.prompt_lookup:
            hf_generate(self.target, first, n, prompt_lookup=self.cfg.prompt_lookup_tokens)
        if plain_engine is not None:
            plain_engine.decode(first[0].tolist(), n)
