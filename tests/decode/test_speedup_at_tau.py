"""benchmarks/speedup_at_tau.py's steered drafter: the real drafter's proposals, the target's own
continuation put on top with a chosen probability; output still the target's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from eagle3cli.decode.drafter import EagleDrafter
from eagle3cli.decode.generator import greedy_generate, speculative_generate
from tests.helpers.decoding import NO_EOS, prompt, random_draft
from tests.helpers.tiny import tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "speedup_at_tau.py"


def steered_class():
    spec = importlib.util.spec_from_file_location("speedup_at_tau", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Steered


@pytest.mark.parametrize("mode", ["chain", "tree"])
@torch.no_grad()
def test_steering_sets_tau_and_keeps_the_output(mode):
    Steered = steered_class()
    target = tiny_model("llama")
    draft = random_draft(target, keep_every=1)  # every token in the draft vocabulary: a hit always lands
    kw = dict(mode=mode, steps=3, total_tokens=8, depth=3, top_k=2, max_new_tokens=25, eos_token_id=NO_EOS)
    for seed in range(3):
        ids = prompt(seed)
        ref = greedy_generate(target, ids, 25, eos_token_id=NO_EOS)
        plain = speculative_generate(target, EagleDrafter(draft), ids, **kw)
        off = speculative_generate(target, Steered(EagleDrafter(draft), ref, 0.0), ids, **kw)
        always = Steered(EagleDrafter(draft), ref, 1.0)
        on = speculative_generate(target, always, ids, **kw)
        half = speculative_generate(target, Steered(EagleDrafter(draft), ref, 0.5, seed=seed), ids, **kw)
        assert plain.tokens == off.tokens == on.tokens == half.tokens == ref
        assert off.accept_lengths == plain.accept_lengths  # hit 0: the drafter's own proposals
        # hit 1: every cycle accepts the whole depth (the last may stop at the token cap)
        assert on.accept_lengths[:-1] == [4] * (len(on.accept_lengths) - 1)
        assert always.steered == always.rows > 0
        assert plain.tau < half.tau <= on.tau


def test_a_token_outside_the_draft_vocabulary_is_never_steered():
    Steered = steered_class()
    target = tiny_model("llama")
    draft = random_draft(target, keep_every=2)  # even ids only
    ids = prompt(0)
    ref = greedy_generate(target, ids, 20, eos_token_id=NO_EOS)
    d = Steered(EagleDrafter(draft), ref, 1.0)
    out = speculative_generate(target, d, ids, mode="chain", steps=3, max_new_tokens=20, eos_token_id=NO_EOS)
    assert out.tokens == ref
    assert any(t % 2 for t in ref) and any(t % 2 == 0 for t in ref)
    assert 0 < d.steered < d.rows  # odd reference tokens could not be put on top
