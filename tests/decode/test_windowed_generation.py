"""Speculative decoding of targets whose layers do not all attend to the whole prefix: sliding windows
(Gemma 2/3, gpt-oss with sinks, Mistral, Ministral) and chunks (Llama 4), and of any target under eager
attention. Lossless means what it means for the others: greedy output token for token the target's
one-token-at-a-time decoding, sampled outputs distributed as the target's, with generations that
run well past the window so that rejected branches and the window meet."""

from __future__ import annotations

import pytest
import torch

from eagle3cli.core.hf_utils import cache_kwargs
from eagle3cli.decode import attention
from eagle3cli.decode.generator import UnsupportedTarget, check_supported, greedy_generate, speculative_generate
from eagle3cli.decode.tree import new_tree, verify_mask
from eagle3cli.decode.verifiers import HFVerifier
from tests.helpers.decoding import (
    NO_EOS,
    Oracle,
    fast_path_accepted,
    prompt,
    random_draft,
    sampled_marginals,
)
from tests.helpers.tiny import tiny_config, tiny_model

SLIDING, FULL = attention.SLIDING, attention.FULL
# family -> (model_type, config overrides); windows of 8 positions, 4 layers
WINDOWED = {
    "gemma3": ("gemma3_text", dict(num_hidden_layers=4, sliding_window=8,
                                   layer_types=[SLIDING, FULL, SLIDING, SLIDING])),
    "gemma2": ("gemma2", dict(num_hidden_layers=4, head_dim=16, sliding_window=8)),  # eager, soft-capping
    "gpt_oss": ("gpt_oss", dict(num_hidden_layers=4, head_dim=16, sliding_window=8, num_local_experts=4,
                                num_experts_per_tok=2)),  # eager, sinks, alternating layers
    "mistral": ("mistral", dict(num_hidden_layers=4, sliding_window=8)),  # every layer windowed
    "ministral": ("ministral", dict(num_hidden_layers=4, head_dim=16, sliding_window=8)),
    "llama4": ("llama4_text", dict(num_hidden_layers=4, head_dim=16, attention_chunk_size=8,
                                   num_local_experts=2)),  # 3 chunked layers, 1 full (NoPE)
}


def windowed_model(family: str, **overrides):
    arch, kw = WINDOWED[family]
    return tiny_model(arch, **{**kw, **overrides})


def test_layouts_read_each_family_as_transformers_builds_its_masks():
    lay = {f: attention.layout(tiny_config(WINDOWED[f][0], **WINDOWED[f][1])) for f in WINDOWED}
    assert lay["gemma3"].kinds == (SLIDING, FULL, SLIDING, SLIDING) and lay["gemma3"].window == 8
    assert lay["gpt_oss"].kinds == (SLIDING, FULL) * 2 and lay["gemma2"].kinds == (SLIDING, FULL) * 2
    assert lay["mistral"].kinds == (SLIDING,) * 4 and lay["mistral"].window == 8  # no layer_types key
    assert lay["llama4"].kinds == (attention.CHUNKED,) * 3 + (FULL,) and lay["llama4"].chunk == 8
    assert not attention.layout(tiny_config("llama")).windowed
    assert not attention.layout(tiny_config("qwen2")).windowed


def test_kind_masks_apply_each_rule_at_each_querys_own_position():
    lay = attention.Layout((SLIDING, FULL, attention.CHUNKED), window=3, chunk=4)
    q = torch.tensor([5, 6, 6])  # a root at 5 and two siblings at 6
    k = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])
    allowed = torch.ones(3, 8, dtype=torch.bool)
    allowed[0, 6:] = False
    allowed[1, 7] = allowed[2, 6] = False
    m = attention.kind_masks(allowed, q, k, lay)
    assert torch.equal(m[FULL], allowed)
    assert m[SLIDING].int().tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 0, 1]]
    assert m[attention.CHUNKED].int().tolist() == [[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0],
                                                   [0, 0, 0, 0, 1, 1, 0, 1]]


def one_token_logits(target, seq: list[int], start: int) -> torch.Tensor:
    """The target's logits after each token of ``seq[start:]``, decoding them one at a time on its own
    cache (its sliding layers keep only their window), as plain generation does."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    target(input_ids=torch.tensor([seq[:start]]), **cache_kwargs(target, cache), use_cache=True)
    kw = cache_kwargs(target, cache)
    return torch.stack([target(input_ids=torch.tensor([[t]]), **kw, use_cache=True).logits[0, -1] for t in seq[start:]])


VERIFY_CASES = [("llama", "eager"), ("llama", "sdpa"), ("qwen2", "eager"), ("qwen2", "sdpa"),
                ("gemma3", "eager"), ("gemma3", "sdpa"), ("gemma2", "eager"), ("gpt_oss", "eager"),
                ("gpt_oss", "sdpa"), ("mistral", "eager"), ("mistral", "sdpa"), ("llama4", "eager"),
                ("llama4", "sdpa")]


@pytest.mark.parametrize("family,implementation", VERIFY_CASES)
@torch.no_grad()
def test_tree_verification_equals_one_token_decoding(family, implementation):
    """Every node's verification logits are those of decoding its path one token at a time, 12 positions
    past the window (a bool mask under eager attention added 1 to the allowed scores instead: 2-5 of 6
    top tokens agreed)."""
    target = windowed_model(family) if family in WINDOWED else tiny_model(family, num_hidden_layers=4)
    target.config._attn_implementation = implementation
    ids = prompt(3, n=20)[0].tolist()
    past = len(ids) - 1
    tree = new_tree(ids[-1])
    a, b = tree.add(5, 0, 0.0), tree.add(6, 0, 0.0)
    c = tree.add(7, a, 0.0)
    tree.add(8, b, 0.0)
    tree.add(9, c, 0.0)
    verifier = HFVerifier(target)
    verifier.prefill(torch.tensor([ids[:past]]))
    pos = (past + torch.tensor(tree.depths))[None]
    logits, _ = verifier.verify(torch.tensor([tree.tokens]), pos, verify_mask(tree, past), past)
    for node in range(len(tree)):
        path, i = [], node
        while i >= 0:
            path.append(tree.tokens[i])
            i = tree.parents[i]
        ref = one_token_logits(target, ids[:past] + path[::-1], past)[-1]
        torch.testing.assert_close(logits[node], ref, atol=2e-5, rtol=1e-4)
        assert int(logits[node].argmax()) == int(ref.argmax())


@pytest.mark.parametrize("family", list(WINDOWED))
def test_windowed_greedy_equality(family):
    """Tree and chain, a random EAGLE-3 draft and a noisy oracle (accepted paths end mid-tree, so
    rejected branches leave the cache): 48 new tokens behind a 12-token prompt, 7 windows of 8."""
    target = windowed_model(family)
    draft = random_draft(target)
    oracle = Oracle(target, sharpen=1.0, noise=0.03)
    accepted = partial = 0
    for i in range(2):
        ids = prompt(30 + i)
        ref = greedy_generate(target, ids, 48, eos_token_id=NO_EOS)
        for d in (draft, oracle):
            for kw in (dict(mode="tree", total_tokens=12, depth=4, top_k=3), dict(mode="chain", steps=3)):
                out = speculative_generate(target, d, ids, max_new_tokens=48, eos_token_id=NO_EOS, **kw)
                assert out.tokens == ref, f"{family} {kw['mode']} prompt {i}"
                accepted += sum(a - 1 for a in out.accept_lengths)
                partial += sum(1 < a < 4 for a in out.accept_lengths)
    assert accepted > 40 and partial > 0


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "llama4"])
@torch.no_grad()
def test_windowed_cache_keeps_every_position_of_the_accepted_path(family):
    """Every layer, windowed or not, holds the prompt and each cycle's root and accepted path, as a
    fresh prefill of that sequence into a cache that drops nothing."""
    target = windowed_model(family)
    ids = prompt(5)
    out = speculative_generate(target, Oracle(target, noise=0.03), ids, mode="tree", total_tokens=10, depth=4,
                               top_k=3, max_new_tokens=40, eos_token_id=NO_EOS)
    assert max(out.accept_lengths) > 1
    n = ids.shape[1] + sum(out.accept_lengths)
    m = min(n, ids.shape[1] + len(out.tokens))
    fresh = attention.keep_all_cache()
    seq = torch.cat([ids, torch.tensor([out.tokens])], 1)[:, :m]
    target(input_ids=seq, **cache_kwargs(target, fresh), use_cache=True)
    assert len(out.cache.layers) == len(fresh.layers) == target.config.num_hidden_layers
    for a, b in zip(out.cache.layers, fresh.layers):
        assert a.keys.shape[2] == n
        torch.testing.assert_close(a.keys[:, :, :m], b.keys, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(a.values[:, :, :m], b.values, atol=2e-5, rtol=1e-4)


SAMPLING = [("gemma3", "tree"), ("gpt_oss", "chain"), ("mistral", "tree"), ("llama4", "tree")]


@pytest.mark.parametrize("family,mode", SAMPLING)
def test_windowed_sampling_matches_target_distribution(family, mode):
    """At T > 0 the 2nd and 3rd tokens are distributed as the target's exact marginals, with a window of
    2 (a chunk of 2) so that 4 prompt tokens and 3 new ones cross it."""
    size = dict(vocab_size=8, hidden_size=32, intermediate_size=64)
    size.update(attention_chunk_size=2) if family == "llama4" else size.update(sliding_window=2)
    target = windowed_model(family, **size)
    drafter = random_draft(target, keep_every=2) if mode == "tree" else Oracle(target, noise=1.0)
    sampled_marginals(target, drafter, mode)


def test_refuses_in_one_line_what_a_tree_mask_cannot_verify():
    for family in WINDOWED:  # windows and chunks are verified now, at any length
        check_supported(windowed_model(family).config, 4_000)
    cfg = tiny_model("llama").config
    cfg._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedTarget, match="flash_attention_2.*sdpa"):
        check_supported(cfg)
    cfg = tiny_model("llama").config
    cfg.layer_types = ["linear_attention", "full_attention"] * 4
    with pytest.raises(UnsupportedTarget, match="linear_attention layers"):
        check_supported(cfg)
    cfg = windowed_model("llama4", attn_temperature_tuning=True, floor_scale=64).config
    check_supported(cfg, 63)
    with pytest.raises(UnsupportedTarget, match="from position 63 on.*64 positions"):
        check_supported(cfg, 64)


def test_fast_path_applies_a_mistral_window():
    """The fast path attends through its static cache by position: a Mistral window (every layer, no
    use_sliding_window key) narrows each row's keys there too, token for token the HF target's output
    48 tokens past a window of 8."""
    from eagle3cli.decode.fast_target import FastTarget

    target = windowed_model("mistral")
    assert FastTarget.supports(target) is None
    fast = FastTarget(target, 128)
    oracle = Oracle(target, sharpen=1.0, noise=0.03)
    accepted = 0
    for i in range(2):
        ids = prompt(40 + i)
        ref = greedy_generate(target, ids, 48, eos_token_id=NO_EOS)
        assert greedy_generate(target, ids, 48, eos_token_id=NO_EOS, fast=fast) == ref
        for kw in (dict(mode="tree", total_tokens=12, depth=4, top_k=3), dict(mode="chain", steps=3)):
            out = speculative_generate(target, oracle, ids, max_new_tokens=48, eos_token_id=NO_EOS, fast=fast, **kw)
            assert out.path == "fast" and out.tokens == ref, f"{kw['mode']} prompt {i}"
            accepted += sum(a - 1 for a in out.accept_lengths)
    assert accepted > 20


@torch.no_grad()
def test_gemma3_fast_path_equals_the_hf_forward():
    """Scaled embeddings, (1 + w) norms around both sublayers, q/k norms, a RoPE table per layer kind,
    query_pre_attn_scalar, final soft-capping and the sliding layers' windows: prefill logits and hidden
    states, and a tree verification 12 positions past the window, as the HF path computes them."""
    from eagle3cli.decode.fast_target import FastTarget

    target = windowed_model("gemma3", final_logit_softcapping=30.0, query_pre_attn_scalar=24)
    fast = FastTarget(target, 64)
    ids = prompt(7, n=20)
    layers = (0, 2, 4)
    ref = target(input_ids=ids, output_hidden_states=True)
    logits, hidden = fast.forward(ids[0], torch.arange(20), 0, hidden_layers=layers)
    torch.testing.assert_close(logits, ref.logits[0], atol=1e-5, rtol=1e-5)
    for j in layers:
        torch.testing.assert_close(hidden[j], ref.hidden_states[j], atol=1e-5, rtol=1e-5)
    past = 19
    tree = new_tree(int(ids[0, -1]))
    a = tree.add(11, 0, 0.0)
    tree.add(12, 0, 0.0)
    tree.add(13, a, 0.0)
    pos = (past + torch.tensor(tree.depths))[None]
    mask = verify_mask(tree, past)
    hf = HFVerifier(target)
    hf.prefill(ids[:, :past])
    want, _ = hf.verify(torch.tensor([tree.tokens]), pos, mask, past)
    fast.forward(ids[0, :past], torch.arange(past), 0)
    got, _ = fast.forward(torch.tensor(tree.tokens), pos[0], past, mask=mask[0, 0])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gemma3_fast_path_greedy_equality_past_the_window():
    from eagle3cli.decode.fast_target import FastTarget

    target = windowed_model("gemma3")
    fast = FastTarget(target, 128)
    assert fast_path_accepted(target, fast, seeds=(50, 51), new_tokens=48, label="gemma3") > 20


def test_continuous_batching_still_refuses_gemma3():
    """batch_decode's slots run Llama-shaped layers only: Gemma 3 is the fast path's alone."""
    from eagle3cli.decode.batch_decode import SlotTarget
    from eagle3cli.decode.fast_target import FastTarget, config_unsupported_reason

    target = windowed_model("gemma3")
    assert FastTarget.supports(target) is None
    assert "gemma3_text" in config_unsupported_reason(target.config)
    with pytest.raises(ValueError, match="continuous batching does not support"):
        SlotTarget(target, 2, 32)
