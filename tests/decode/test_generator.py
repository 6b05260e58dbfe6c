"""The speculative generator: lossless at T=0 and T>0, exact accounting, exact caches."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from eagle3cli.core.hf_utils import cache_kwargs
from eagle3cli.decode.drafter import EagleDrafter
from eagle3cli.decode.generator import (
    ContextTooLong,
    UnsupportedTarget,
    accept_sampling,
    greedy_generate,
    n_alpha,
    speculative_generate,
)
from eagle3cli.decode.tree import build_greedy_tree, build_sampled_tree, new_tree, target_logq
from eagle3cli.model.draft import KVCache
from tests.helpers.decoding import (
    NO_EOS,
    Oracle,
    accepted_on_fast_path,
    draft_trees,
    fast_path_accepted,
    option_draft,
    prompt,
    random_draft,
    sampled_marginals,
)
from tests.helpers.tiny import tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3"])
def test_greedy_equality_random_draft(arch):
    target = tiny_model(arch)
    draft = random_draft(target)
    for i in range(3):
        ids = prompt(i)
        ref = greedy_generate(target, ids, 24, eos_token_id=NO_EOS)
        tree = speculative_generate(target, draft, ids, mode="tree", total_tokens=12, depth=4, top_k=3,
                                    max_new_tokens=24, eos_token_id=NO_EOS)
        chain = speculative_generate(target, draft, ids, mode="chain", steps=3, max_new_tokens=24,
                                     eos_token_id=NO_EOS)
        assert tree.tokens == ref, f"{arch} tree prompt {i}"
        assert chain.tokens == ref, f"{arch} chain prompt {i}"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_greedy_equality_with_partial_acceptance(arch):
    """A noisy oracle is right often but not always: accepted paths end mid-tree."""
    target = tiny_model(arch)
    oracle = Oracle(target, sharpen=1.0, noise=0.03)
    accepted, partial = 0, 0
    for i in range(3):
        ids = prompt(10 + i)
        ref = greedy_generate(target, ids, 30, eos_token_id=NO_EOS)
        for kw in (dict(mode="tree", total_tokens=10, depth=4, top_k=3), dict(mode="chain", steps=4)):
            out = speculative_generate(target, oracle, ids, max_new_tokens=30, eos_token_id=NO_EOS, **kw)
            assert out.tokens == ref, f"{arch} {kw['mode']} prompt {i}"
            accepted += sum(a - 1 for a in out.accept_lengths)
            partial += sum(1 < a < 5 for a in out.accept_lengths)
    assert accepted > 10 and partial > 0


@pytest.mark.parametrize("mode,depth", [("tree", 4), ("chain", 3)])
def test_oracle_tau_is_depth_plus_one(mode, depth):
    target = tiny_model("llama")
    oracle = Oracle(target, sharpen=1e4)
    cycles = 5
    ids = prompt(3)
    out = speculative_generate(target, oracle, ids, mode=mode, total_tokens=8, depth=depth, top_k=2, steps=depth,
                               max_new_tokens=1 + cycles * (depth + 1), eos_token_id=NO_EOS)
    assert out.tokens == greedy_generate(target, ids, 1 + cycles * (depth + 1), eos_token_id=NO_EOS)
    assert out.accept_lengths == [depth + 1] * cycles
    assert out.forwards == cycles
    assert out.tau == depth + 1
    if mode == "chain":
        assert n_alpha([out]) == [1.0] * depth


def test_cache_after_acceptance_equals_fresh_prefill():
    target = tiny_model("qwen2")
    oracle = Oracle(target, sharpen=1.0, noise=0.03)
    ids = prompt(5)
    out = speculative_generate(target, oracle, ids, mode="tree", total_tokens=10, depth=4, top_k=3,
                               max_new_tokens=40, eos_token_id=NO_EOS)
    assert max(out.accept_lengths) > 1
    # the cache holds the prompt, then root + accepted path of every cycle; no rejected node
    n = ids.shape[1] + sum(out.accept_lengths)
    assert out.cache.layers[0].keys.shape[2] == n
    m = min(n, ids.shape[1] + len(out.tokens))  # the last cycle may be cut by max_new_tokens
    from transformers import DynamicCache

    fresh = DynamicCache(config=target.config)
    seq = torch.cat([ids, torch.tensor([out.tokens])], 1)[:, :m]
    target(input_ids=seq, **cache_kwargs(target, fresh), use_cache=True)
    assert len(out.cache.layers) == len(fresh.layers)
    for a, b in zip(out.cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys[:, :, :m], b.keys, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(a.values[:, :, :m], b.values, atol=2e-5, rtol=1e-4)


def test_draft_tree_matches_sequential_draft():
    """EagleDrafter's tree mask/positions give each node what a plain causal draft run on its path gives."""
    target = tiny_model("llama")
    draft = random_draft(target, keep_every=1)
    drafter = EagleDrafter(draft)
    ids = prompt(7, n=9)
    out = target(input_ids=ids, output_hidden_states=True)
    root = int(out.logits[0, -1].argmax())
    drafter.begin(ids)
    nxt = torch.cat([ids[0, 1:], torch.tensor([root])])
    logq = drafter.observe(nxt, out.hidden_states)
    tree = build_greedy_tree(drafter, root, logq, total_tokens=30, depth=4, top_k=3)  # keeps all
    assert max(tree.depths) == 4
    # redo every node's prediction sequentially: verified pairs, then its path, causal
    aux = torch.cat([out.hidden_states[j] for j in draft.config.aux_layer_ids], -1)
    for node in range(1, len(tree)):
        if not tree.children[node]:
            continue
        path = []
        i = node
        while i > 0:
            path.append(i)
            i = tree.parents[i]
        path = path[::-1]
        cache = KVCache()
        a = draft.step(nxt[None], draft.fuse(aux), torch.arange(9)[None], cache)[:, -1:]
        for i in path:
            a = draft.step(torch.tensor([[tree.tokens[i]]]), a, torch.tensor([[8 + tree.depths[i]]]), cache)
        expected = torch.log_softmax(draft.logits(a[0, -1]), -1)
        child = tree.children[node][0]
        got_token = tree.tokens[child]
        assert draft.draft_to_target(expected.argmax()).item() == got_token
        assert tree.scores[child] == pytest.approx(tree.scores[node] + expected.max().item(), abs=1e-4)


class FullVocab:
    """EagleDrafter with its log q spread over the whole target vocabulary, as it returned before."""

    def __init__(self, drafter):
        self.inner = drafter

    def __getattr__(self, name):
        return getattr(self.inner, name) if name != "token_ids" else None

    def observe(self, *a):
        return target_logq(self.inner, self.inner.observe(*a)[None])[0]

    def expand(self, *a):
        return target_logq(self.inner, self.inner.expand(*a))


@pytest.mark.parametrize("keep_every", [2, 4])
@torch.no_grad()
def test_tree_from_draft_vocab_equals_tree_from_target_vocab(keep_every):
    """The greedy tree's top-k over the 1/keep_every draft columns picks the same tokens with the same
    scores, in the same order, as over the target vocabulary with -inf outside the draft's."""
    target = tiny_model("llama")
    draft = random_draft(target, keep_every=keep_every)
    ids = prompt(3, n=9)
    out = target(input_ids=ids, output_hidden_states=True)
    root = int(out.logits[0, -1].argmax())
    nxt = torch.cat([ids[0, 1:], torch.tensor([root])])
    trees = []
    for drafter in (EagleDrafter(draft), FullVocab(EagleDrafter(draft))):
        drafter.begin(ids)
        logq = drafter.observe(nxt, out.hidden_states)
        trees.append(build_greedy_tree(drafter, root, logq, total_tokens=20, depth=3, top_k=4))
    compact, full = trees
    assert compact.tokens == full.tokens and compact.parents == full.parents and compact.scores == full.scores
    assert all(t % keep_every == 0 for t in compact.tokens[1:])  # only draft-vocabulary tokens


@torch.no_grad()
def test_sampled_tree_keeps_q_over_the_target_vocabulary():
    """Rejection sampling compares q with p token by token: the tree stores q over all target ids."""
    target = tiny_model("llama")
    draft = random_draft(target)
    drafter = EagleDrafter(draft)
    ids = prompt(4, n=9)
    out = target(input_ids=ids, output_hidden_states=True)
    drafter.begin(ids)
    logq = drafter.observe(torch.cat([ids[0, 1:], torch.tensor([5])]), out.hidden_states)
    assert logq.shape == (draft.config.draft_vocab_size,)
    tree = build_sampled_tree(drafter, 5, logq, 6, 2, 3, 1.0, torch.Generator().manual_seed(0))
    q = tree.q[0]
    assert q.shape == (target.config.vocab_size,)
    torch.testing.assert_close(q[drafter.token_ids], logq.exp())
    assert float(q.sum()) == pytest.approx(1.0, abs=1e-5) and float(q[1::2].sum()) == 0.0


LEAN_OPTIONS = {"eagle3": {}, "eagle3.1": {"fc_norm": True, "norm_output": True},
                "norm_before_residual": {"norm_before_residual": True}, "norm_before_fc": {"norm_before_fc": True}}


@pytest.mark.parametrize("options", list(LEAN_OPTIONS))
@torch.no_grad()
def test_lean_draft_step_drafts_the_module_path_trees(options):
    """fast_draft.FastDraft (fused matmuls, static cache, RoPE tables) drafts the trees the module's
    own step drafts, node for node, scores within fp32 rounding, for every architecture option,
    with grouped-query attention, across a rollback and a second observe."""
    target = tiny_model("llama")
    assert target.config.num_key_value_heads < target.config.num_attention_heads  # GQA exercised
    draft = option_draft(target, LEAN_OPTIONS[options])
    lean, ref = (draft_trees(EagleDrafter(draft, lean=flag), target) for flag in (True, False))
    for a, b in zip(lean, ref):
        assert a.tokens == b.tokens and a.parents == b.parents and len(a) == 17
        assert a.scores == pytest.approx(b.scores, abs=1e-5)


GEOMETRIES = {
    "heads_wider_than_hidden": {"head_dim": 32},  # 4 x 32 = 128 query dims over a 64-wide stream (Qwen3-like)
    "gelu": {"hidden_act": "gelu_pytorch_tanh"},  # Gemma's activation
    "llama3_rope": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8}},
}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@torch.no_grad()
def test_lean_draft_step_drafts_the_module_path_trees_for_other_geometries(geometry):
    """Query heads that do not tile the hidden size, a non-SiLU activation, scaled RoPE: the lean
    step drafts the module's trees node for node."""
    target = tiny_model("llama")
    draft = option_draft(target, GEOMETRIES[geometry])
    lean, ref = (draft_trees(EagleDrafter(draft, lean=flag), target) for flag in (True, False))
    for a, b in zip(lean, ref):
        assert a.tokens == b.tokens and a.parents == b.parents and len(a) == 17
        assert a.scores == pytest.approx(b.scores, abs=1e-5)


class ExplicitMaskDrafter(EagleDrafter):
    """Builds the tree mask for every level, chains included (the reference for the unmasked chain)."""

    _mask = EagleDrafter._tree_mask


@pytest.mark.parametrize("lean", [True, False])
@torch.no_grad()
def test_chain_levels_run_without_a_mask_and_draft_what_the_masked_step_drafts(lean):
    """A chain's node sees every drafted entry, so its level runs unmasked; the chains equal those
    drafted with the explicit mask, token for token, and every level after the first went unmasked."""
    target = tiny_model("llama")
    draft = option_draft(target, {})
    unmasked = EagleDrafter(draft, lean=lean)
    masks = []
    mask_of = unmasked._mask
    unmasked._mask = lambda slots, past: masks.append(mask_of(slots, past)) or masks[-1]
    got = draft_trees(unmasked, target, total=5, depth=5, top_k=1)
    ref = draft_trees(ExplicitMaskDrafter(draft, lean=lean), target, total=5, depth=5, top_k=1)
    assert masks and all(m is None for m in masks) and len(masks) == 2 * 3 * 4  # 3 prompts, 2 chains, 4 levels
    for a, b in zip(got, ref):
        assert a.tokens == b.tokens and a.parents == [-1, 0, 1, 2, 3, 4]
        assert a.scores == pytest.approx(b.scores, abs=1e-5)
    tree = draft_trees(unmasked, target, seeds=(0,), total=8, depth=3, top_k=2)[0]  # levels of 2 nodes: masked
    assert len(tree) == 9 and masks[-1] is not None and masks[-1].shape[0] == 2


@torch.no_grad()
def test_kept_entries_move_only_when_not_already_in_place():
    """The fast path gathers the kept tree entries only when they are not the tree's first ones: a
    chain never moves its cache, a tree moves when a later branch wins; both stay lossless."""
    from eagle3cli.decode.fast_target import FastTarget
    from eagle3cli.decode.verifiers import in_place

    assert in_place([0]) and in_place([0, 1, 2])
    assert not in_place([0, 2]) and not in_place([0, 1, 3])
    target = tiny_model("llama")
    fast = FastTarget(target, 128)
    moved = []
    keep = fast.keep
    fast.keep = lambda past, idx: moved.append(idx.tolist()) or keep(past, idx)
    oracle = Oracle(target, sharpen=1.0, noise=0.03)  # right often, not always: paths end mid-tree
    for mode in ("chain", "tree"):
        moved.clear()
        ids = prompt(3)
        ref = greedy_generate(target, ids, 30, eos_token_id=NO_EOS)
        out = speculative_generate(target, oracle, ids, mode=mode, steps=3, total_tokens=8, depth=3, top_k=2,
                                   max_new_tokens=30, eos_token_id=NO_EOS, fast=fast)
        assert out.tokens == ref
        if mode == "chain":
            assert moved == [] and max(out.accept_lengths) > 1
        else:
            assert moved and all(not in_place(m) for m in moved)


@torch.no_grad()
def test_generation_runs_in_inference_mode_and_its_caches_serve_outside_it(monkeypatch):
    """Generation runs under torch.inference_mode (every op a little cheaper to dispatch on a CPU), so
    the caches that grow inside it are inference tensors; the lean draft step and the fast target
    write theirs in place, and still do when called outside it (a drafter drafted with directly, a
    fast target timed), drafting what a fresh drafter drafts."""
    from eagle3cli.decode.fast_draft import FastDraft

    monkeypatch.setattr(FastDraft, "INITIAL_LEN", 4)
    monkeypatch.setattr(FastTarget, "INITIAL_LEN", 8)
    target = tiny_model("llama")
    draft = option_draft(target, {})
    drafter, fast, seen = EagleDrafter(draft), FastTarget(target, 128), []
    observe = drafter.observe
    drafter.observe = lambda *a: seen.append(torch.is_inference_mode_enabled()) or observe(*a)
    ids = prompt(3)
    out = speculative_generate(target, drafter, ids, mode="chain", steps=3, max_new_tokens=20,
                               eos_token_id=NO_EOS, fast=fast)
    assert out.tokens == greedy_generate(target, ids, 20, eos_token_id=NO_EOS)
    assert seen and all(seen) and not torch.is_inference_mode_enabled()
    assert drafter.lean.kv.is_inference() and fast.k.is_inference()  # both grew inside
    got = draft_trees(drafter, target)  # writes the grown draft cache outside inference mode
    for a, b in zip(got, draft_trees(EagleDrafter(draft), target)):
        assert a.tokens == b.tokens and a.parents == b.parents
    logits, _ = fast.forward(ids[0], torch.arange(ids.shape[1]), 0)
    torch.testing.assert_close(logits, target(ids).logits[0], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_lean_draft_step_equals_module_step_and_grows_its_cache(monkeypatch):
    """Output streams of the lean step == Eagle3Draft.step's (fp32 rounding) for a causal block,
    a masked block and one row, across the cache's growth (capacity 4 here) and a crop."""
    from eagle3cli.decode.fast_draft import FastDraft

    target = tiny_model("llama")
    draft = option_draft(target, {})
    monkeypatch.setattr(FastDraft, "INITIAL_LEN", 4)  # the first step below outgrows it
    fast = FastDraft(draft)
    cache = KVCache()
    gen = torch.Generator().manual_seed(0)
    H = draft.config.hidden_size
    ids, g = torch.randint(0, 256, (20,), generator=gen), torch.randn(20, H, generator=gen)
    a_ref = draft.step(ids[None, :6], g[None, :6], torch.arange(6)[None], cache)[0]
    torch.testing.assert_close(fast.step(ids[:6], g[:6], torch.arange(6)), a_ref, atol=1e-5, rtol=1e-5)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0, 1]],
                        dtype=torch.bool)
    pos = torch.tensor([5, 6, 4])
    a_ref = draft.step(ids[None, 6:9], g[None, 6:9], pos[None], cache, attn_mask=mask[None, None])[0]
    torch.testing.assert_close(fast.step(ids[6:9], g[6:9], pos, mask), a_ref, atol=1e-5, rtol=1e-5)
    assert len(fast) == 9 and fast.kv.shape[2] >= 9
    fast.crop(6)
    cache.crop(6)
    a_ref = draft.step(ids[None, 6:7], g[None, 6:7], torch.tensor([[6]]), cache)[0]
    torch.testing.assert_close(fast.step(ids[6:7], g[6:7], torch.tensor([6])), a_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.logits(a_ref), draft.logits(a_ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", ["eagle3", "norm_before_residual", "eagle3.1"])
@torch.no_grad()
def test_lean_step_of_the_last_row_only_caches_every_row(options):
    """``last_only``: a causal block's keys and values are all cached (bitwise those of the full
    step), the output is the full step's last row, and the next step sees the same cache; a mask
    is refused (the last row of a causal block sees everything)."""
    from eagle3cli.decode.fast_draft import FastDraft

    target = tiny_model("llama")
    draft = option_draft(target, LEAN_OPTIONS[options])
    full, last = FastDraft(draft), FastDraft(draft)
    gen = torch.Generator().manual_seed(1)
    ids, g = torch.randint(0, 256, (12,), generator=gen), torch.randn(12, draft.config.hidden_size, generator=gen)
    for lo, hi in ((0, 5), (5, 9), (9, 10)):  # a prefill-sized block, a cycle's accepted rows, one row
        pos = torch.arange(lo, hi)
        a_full = full.step(ids[lo:hi], g[lo:hi], pos)
        a_last = last.step(ids[lo:hi], g[lo:hi], pos, last_only=True)
        assert a_last.shape == (1, draft.config.hidden_size) and len(last) == len(full) == hi
        torch.testing.assert_close(a_last, a_full[-1:], atol=1e-5, rtol=1e-5)
        assert torch.equal(last.kv[:, :, :hi], full.kv[:, :, :hi])
    torch.testing.assert_close(last.step(ids[10:12], g[10:12], torch.arange(10, 12)),
                               full.step(ids[10:12], g[10:12], torch.arange(10, 12)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="causal"):
        last.step(ids[:2], g[:2], torch.arange(12, 14), torch.ones(2, 14, dtype=torch.bool), last_only=True)
    assert len(last) == 12  # refused before anything was cached


@torch.no_grad()
def test_lean_draft_in_bf16_is_the_module_draft_in_bf16():
    """``dtype=bfloat16`` computes what ``draft.to(bfloat16)`` computes through the module path (within
    bf16 rounding: the fused matmuls may round differently), the fp32 draft left untouched."""
    from eagle3cli.decode.fast_draft import FastDraft

    target = tiny_model("llama")
    draft = option_draft(target, {})
    fast = FastDraft(draft, dtype=torch.bfloat16)
    assert fast.head.weight.dtype == torch.bfloat16 and draft.lm_head.weight.dtype == torch.float32
    ref = option_draft(target, {}).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    ids, g = torch.randint(0, 256, (7,), generator=gen), torch.randn(7, draft.config.hidden_size, generator=gen)
    got = fast.step(ids, g, torch.arange(7))
    want = ref.step(ids[None], g[None].to(torch.bfloat16), torch.arange(7)[None], KVCache())[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(fast.logits(got).float(), ref.logits(got).float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("bf16_hardware", [True, False])
def test_draft_computes_in_bf16_where_the_cpu_multiplies_it(bf16_hardware, monkeypatch):
    """bf16 beside a bf16 fast path that packs it; beside an fp32 one only where the CPU multiplies
    bf16 in hardware (emulated, it is slower than fp32). int4 weights wherever the draft steps in
    bf16 (with fp32 inputs the integer kernels are slower than full weights)."""
    from eagle3cli.core import hardware
    from eagle3cli.decode import weight_quant
    from eagle3cli.decode.fast_draft import compute_dtype, weights_for
    from eagle3cli.decode.fast_target import ONEDNN, FastTarget, Linear

    monkeypatch.setattr(hardware, "has_bf16_matmul", lambda: bf16_hardware)
    packs = Linear.can_pack(torch.empty(1, 1, dtype=torch.bfloat16), ONEDNN)
    int4 = weight_quant.available("int4")
    assert compute_dtype(None) is None
    fp32 = FastTarget(tiny_model("llama"), 64)
    assert compute_dtype(fp32) is (torch.bfloat16 if bf16_hardware and packs else None)
    assert weights_for(fp32) == ("int4" if bf16_hardware and packs and int4 else "full")
    assert weights_for(fp32, "int8") == "int8" and weights_for(fp32, "full") == "full"
    # a bf16 target with its matrices in the native bf16-weight kernels computes in fp32: as beside fp32
    mixed = FastTarget(tiny_model("llama").to(torch.bfloat16), 64)
    if mixed.decoder.mixed:
        assert compute_dtype(mixed) is compute_dtype(fp32)
    from eagle3cli.decode.fast_target import Decoder

    monkeypatch.setattr(Decoder, "BF16_NATIVE", False)
    bf16 = FastTarget(tiny_model("llama").to(torch.bfloat16), 64)
    assert compute_dtype(bf16) is (torch.bfloat16 if packs else None)
    assert weights_for(bf16) == ("int4" if packs and int4 else "full")


@pytest.mark.parametrize("kind", ["mkl", "onednn", "native"])
@torch.no_grad()
def test_packed_lean_levels_give_the_same_tree(kind):
    """The lean draft's matmuls packed for 4-row levels: MKL's copy serves exactly 4 rows (other
    counts bitwise F.linear), oneDNN's every count, the native kernel up to its row limit; the same
    trees drafted as unpacked."""
    from eagle3cli.decode.fast_draft import ExactRowsLinear
    from eagle3cli.decode.packing import NATIVE, NATIVE_MAX_ROWS, ONEDNN, Linear

    target = tiny_model("llama")
    draft = random_draft(target)
    key = {"mkl": 4, "onednn": ONEDNN, "native": NATIVE}[kind]
    if not Linear.can_pack(draft.lm_head.weight, key):
        pytest.skip(f"{kind} packing is not available here")
    lin = ExactRowsLinear(draft.lm_head.weight.detach(), None, (key,))
    x = torch.randn(4, draft.config.hidden_size)
    torch.testing.assert_close(lin(x), draft.lm_head(x), atol=1e-5, rtol=1e-5)
    assert lin.packed_for(3) == {"mkl": None, "onednn": ONEDNN, "native": NATIVE}[kind]
    assert lin.packed_for(NATIVE_MAX_ROWS + 1) == (ONEDNN if kind == "onednn" else None)
    if kind == "mkl":
        assert torch.equal(lin(x[:3]), draft.lm_head(x[:3]))
    plain, packed = EagleDrafter(draft), EagleDrafter(draft)
    packed.lean.repack((key,))
    for a, b in zip(draft_trees(plain, target), draft_trees(packed, target)):
        assert a.tokens == b.tokens and a.parents == b.parents
        assert b.scores == pytest.approx(a.scores, abs=1e-4)


@torch.no_grad()
def test_drafter_pack_keeps_the_fastest_measured():
    from eagle3cli.decode.packing import Linear

    target = tiny_model("llama")
    draft = random_draft(target)
    drafter = EagleDrafter(draft)
    assert EagleDrafter(draft, lean=False).pack(4) is None  # the reference path is never packed
    for rows in (4, 1):  # a tree's levels; a chain's one-row steps
        tuned = drafter.pack(rows)
        if tuned is None:
            pytest.skip("nothing packs on this machine")
        assert tuned["rows"] == rows and tuned["ms"][tuned["uses"]] == min(tuned["ms"].values())
        keys = {"none": (), "mkl": (rows,), "onednn": ("onednn",), "native": ("native", "onednn")}[tuned["uses"]]
        for lin in drafter.lean.linears():  # what the choice packs, as far as this CPU packs it
            assert set(lin.packed) == {k for k in keys if Linear.can_pack(lin.weight, k)}
        assert len(drafter.cache) == 0  # the timing steps leave nothing behind


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_accept_greedy_breaks_ties_as_argmax(dtype, per_row):
    """Plain decoding takes argmax (the first maximal index); acceptance must pick the same token
    where logits tie, which bf16 logits often do: at every level the row's maximum sits at two
    tokens, and the tree offers the later one first. Row by row (a CPU's way) and all rows at once
    (an accelerator's) alike."""
    from eagle3cli.decode.generator import accept_greedy

    gen = torch.Generator().manual_seed(0)
    depth, vocab = 5, 300
    pairs = [sorted(torch.randperm(vocab, generator=gen)[:2].tolist()) for _ in range(depth + 1)]
    tree, node, on_path = new_tree(0), 0, [0]
    for first, later in pairs[:depth]:
        tree.add(later, node, 0.0)
        node = tree.add(first, node, 0.0)
        on_path.append(node)
    logits = torch.randint(-4, 4, (len(tree), vocab), generator=gen).to(dtype)  # row i: after node i
    for node, (first, later) in zip(on_path, pairs):
        logits[node, first] = logits[node, later] = 9
    path, bonus = accept_greedy(tree, logits, per_row=per_row)
    assert path == on_path[1:] and [tree.tokens[i] for i in path] == [f for f, _ in pairs[:depth]]
    assert bonus == pairs[-1][0] == int(logits[on_path[-1]].argmax())


@pytest.mark.parametrize("vocab", [49152, 151936, 128256, 300])
def test_row_argmax_is_argmax(vocab):
    """The blockwise argmax acceptance uses on a CPU is ``argmax`` (the first maximal index) on rows
    full of ties, with NaN, all -inf, +inf twice, in bf16 and fp32, for vocabularies that split into
    1,024- or 128-wide blocks and ones that do not."""
    from eagle3cli.decode.generator import row_argmax

    gen = torch.Generator().manual_seed(vocab)
    for trial in range(60):
        row = torch.randint(-3, 3, (vocab,), generator=gen).to(torch.bfloat16 if trial % 2 else torch.float32)
        kind = trial % 6
        if kind == 1:
            row[torch.randint(0, vocab, (3,), generator=gen)] = float("nan")
        elif kind == 2:
            row[:] = float("-inf")
        elif kind == 3:
            row[torch.randint(0, vocab, (2,), generator=gen)] = float("inf")
        elif kind == 4:  # the maximum only in the last block, tied with nothing
            row[-1] = 7
        assert row_argmax(row) == int(row.argmax()), (trial, kind)


def test_accept_sampling_exact_on_synthetic_tree():
    """Many children drawn without replacement from q; the output must be distributed as p."""
    from eagle3cli.decode.tree import gumbel_top

    V = 6
    p = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    q = torch.tensor([0.05, 0.4, 0.3, 0.05, 0.15, 0.05])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    n = 8000
    for _ in range(n):
        tree = new_tree(0)
        tree.q[0] = q
        for t in gumbel_top(q.log(), 3, gen):
            tree.add(t, 0, 0.0)
        probs = torch.stack([p] * len(tree))
        path, bonus = accept_sampling(tree, probs, gen)
        counts[tree.tokens[path[0]] if path else bonus] += 1
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("mode,drafter_kind", [("tree", "good"), ("chain", "good"), ("tree", "eagle"),
                                               ("chain", "noisy")])
def test_sampling_matches_target_distribution(mode, drafter_kind):
    target = tiny_model("llama", vocab_size=8, num_hidden_layers=3, hidden_size=32, intermediate_size=64)
    drafter = {
        "good": lambda: Oracle(target),  # q == p (the generator applies T to both): nothing is rejected
        "noisy": lambda: Oracle(target, noise=1.0),
        "eagle": lambda: random_draft(target, keep_every=2),
    }[drafter_kind]()
    n = 300
    accepted = sampled_marginals(target, drafter, mode, n=n)
    if drafter_kind == "good":  # q == p never rejects; a chain always has a child to try
        assert accepted == n * 3 if mode == "chain" else accepted >= n
    elif drafter_kind == "noisy":
        assert 0 < accepted < n * 3


def test_eos_and_max_new_tokens():
    target = tiny_model("llama")
    oracle = Oracle(target, sharpen=1e4)
    ids = prompt(3)
    ref = greedy_generate(target, ids, 30, eos_token_id=NO_EOS)
    eos = ref[7]
    first = ref.index(eos)
    out = speculative_generate(target, oracle, ids, depth=4, total_tokens=8, top_k=2, max_new_tokens=30,
                               eos_token_id=eos)
    assert out.tokens == ref[: first + 1] and out.stop_reason == "eos"
    out = speculative_generate(target, oracle, ids, depth=4, total_tokens=8, top_k=2, max_new_tokens=9,
                               eos_token_id=NO_EOS)
    assert out.tokens == ref[:9]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_eos_just_past_max_new_tokens_is_cut(mode):
    """One cycle accepts several tokens: an EOS right after the cap must not extend the output
    (greedy decoding stops at the cap; found on SmolLM2, mt_bench 94, 64 new tokens)."""
    target = tiny_model("llama")
    oracle = Oracle(target, sharpen=1e4)  # accepts every drafted token: blocks of depth + 1
    cases = []
    for k in range(8):
        ids = prompt(k)
        ref = greedy_generate(target, ids, 24, eos_token_id=NO_EOS)
        # EOS := the token right after the cap (one that has not appeared before it)
        cases += [(ids, ref, n) for n in range(2, 24) if ref[n] not in ref[:n]]
    assert len({n % 5 for _, _, n in cases}) == 5  # the EOS lands at every offset of an accepted block
    for ids, ref, cap in cases:
        assert greedy_generate(target, ids, cap, eos_token_id=ref[cap]) == ref[:cap]
        out = speculative_generate(target, oracle, ids, mode=mode, steps=4, depth=4, total_tokens=8, top_k=2,
                                   max_new_tokens=cap, eos_token_id=ref[cap])
        assert out.tokens == ref[:cap] and out.stop_reason == "length", cap


def test_refuses_long_prompts_and_unverifiable_attention():
    """Sliding windows are verified (tests/decode/test_windowed_generation.py); flash attention ignores a mask."""
    flash = tiny_model("llama")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedTarget, match="flash_attention_2"):
        speculative_generate(flash, Oracle(flash), prompt(0), max_new_tokens=4)
    target = tiny_model("llama", max_position_embeddings=16)
    with pytest.raises(ContextTooLong, match="16"):
        speculative_generate(target, Oracle(target), prompt(0, n=20), max_new_tokens=4)


def test_n_alpha_counts_conditional_acceptance():
    from eagle3cli.decode.generator import SpecOutput

    o = SpecOutput(tokens=[], prompt_len=1, accept_lengths=[1, 2, 4, 3], drafted=[3, 3, 3, 3])
    # accepted drafts per cycle: 0, 1, 3, 2 -> a0 = 3/4, a1 = 2/3, a2 = 1/2
    assert n_alpha([o]) == [0.75, pytest.approx(2 / 3), 0.5]


# ---- the fast path (fast_target.FastTarget): same model, static cache, packed matmuls ----
from eagle3cli.decode import native  # noqa: E402
from eagle3cli.decode.fast_target import FastTarget  # noqa: E402
from eagle3cli.decode.tree import verify_mask  # noqa: E402

FAST_ARCHS = ["llama", "qwen2", "qwen3", "mistral", "granite"]


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
def test_tune_packing_keeps_the_fastest_option_for_every_matmul(monkeypatch):
    """tune_packing times unpacked, MKL packed for the row count or padded to a multiple of 4, and
    oneDNN; then one row as that choice serves it, MKL packed for one, or oneDNN; and packs every
    matmul (the LM head included) the fastest way for both; the logits stay the model's. (The
    native kernel's place among them: the next test.)"""
    from eagle3cli.decode import native
    from eagle3cli.decode.fast_target import ONEDNN, Linear
    from eagle3cli.decode.fast_tuning import tune_packing

    monkeypatch.setattr(native, "supports", lambda weight: False)
    target = tiny_model("llama")
    fast = FastTarget(target, 128)
    # a fake clock: each forward costs what its packing costs
    cost = {(): 5.0, (3,): 9.0, (4,): 2.0, (ONEDNN,): 3.0, (1, 4): 1.5, (ONEDNN, 4): 1.8, (1,): 6.0}
    now = [0.0]

    def clock():
        now[0] += cost[tuple(fast.head.packed)]  # end - start of a forward: its packing's cost
        return now[0]

    got = tune_packing(fast, 3, clock=clock)
    assert got == {"rows": 3, "packed_for": "4", "packing": [1, 4],
                   "ms": {"none": 5000.0, "3": 9000.0, "4": 2000.0, "onednn": 3000.0},
                   "one_row": {"uses": "1", "ms": {"none": 2000.0, "1": 1500.0, "onednn": 1800.0}}}
    assert {tuple(lin.packed) for lin in fast.decoder.linears()} == {(1, 4)}
    assert len(fast.decoder.linears()) == 4 * target.config.num_hidden_layers + 1
    cost.update({(ONEDNN,): 0.5, (1, ONEDNN): 0.7})  # oneDNN wins both: one copy serves both sizes
    got = tune_packing(fast, 4, clock=clock)
    assert got["packed_for"] == "onednn" and got["one_row"] == {"uses": "onednn", "ms": {"onednn": 500.0, "1": 700.0}}
    assert {tuple(lin.packed) for lin in fast.decoder.linears()} == {(ONEDNN,)}
    cost[()] = 0.1  # unpacked wins both: nothing packed (oneDNN second at one row, not kept)
    got = tune_packing(fast, 4, clock=clock)
    assert got["packed_for"] is None and got["one_row"] == {"uses": "none",
                                                            "ms": {"none": 100.0, "1": 6000.0, "onednn": 500.0}}
    assert {tuple(lin.packed) for lin in fast.decoder.linears()} == {()}
    assert tune_packing(fast, 1) is None  # nothing to verify
    ids = prompt(9, n=9)
    for packing in ((1, 4), (ONEDNN,)):
        fast.decoder.repack(packing)
        with torch.no_grad():
            fast.forward(ids[0, :6], torch.arange(6), 0)
            logits, _ = fast.forward(ids[0, 6:], torch.arange(6, 9), 6)  # 3 rows (MKL: padded to 4)
            one, _ = fast.forward(ids[0, 6:7], torch.arange(6, 7), 6)  # one row (MKL: packed for one)
            ref = target(input_ids=ids).logits[0]
            torch.testing.assert_close(logits, ref[6:], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(one, ref[6:7], atol=1e-5, rtol=1e-5)
    bf16 = FastTarget(tiny_model("llama").to(torch.bfloat16), 128)
    cost.update({(): 1.0, (ONEDNN,): 0.5})
    if not Linear.can_pack(bf16.head.weight, ONEDNN):  # oneDNN has no bf16 kernels here
        assert not bf16.decoder.packable() and tune_packing(bf16, 3) is None
        return
    fast = bf16  # bf16 weights: unpacked or oneDNN-prepacked (MKL's packed GEMM is fp32 only)
    got = tune_packing(fast, 3, clock=clock)
    assert got["ms"] == {"none": 1000.0, "onednn": 500.0} and got["packing"] == [ONEDNN]
    assert {tuple(lin.packed) for lin in fast.decoder.linears()} == {(ONEDNN,)}


@needs_onednn
@pytest.mark.skipif(not native.available(), reason="no native kernel here")
def test_tune_packing_offers_the_native_kernel_for_few_rows_and_keeps_it_where_fastest():
    """The native kernel (oneDNN beside it for the prompt's rows) is one more option for a
    verification within its row limit and for one row; where it measures fastest, every matmul
    serves those sizes with it, and the logits stay the model's."""
    from eagle3cli.decode.fast_target import NATIVE, ONEDNN
    from eagle3cli.decode.fast_tuning import packing_options, tune_packing

    target = tiny_model("llama")
    fast = FastTarget(target, 128)
    assert packing_options(3, fast.head.weight)[-1] == (NATIVE, ONEDNN)
    assert (NATIVE, ONEDNN) not in packing_options(native.MAX_ROWS + 1, fast.head.weight)
    cost = {(): 5.0, (3,): 9.0, (4,): 2.0, (ONEDNN,): 3.0, (NATIVE, ONEDNN): 1.0, (1, NATIVE, ONEDNN): 1.2}
    now = [0.0]

    def clock():
        now[0] += cost[tuple(fast.head.packed)]
        return now[0]

    got = tune_packing(fast, 3, clock=clock)
    assert got["packed_for"] == "native" and got["packing"] == [NATIVE, ONEDNN]
    assert got["one_row"] == {"uses": "native", "ms": {"native": 1000.0, "1": 1200.0}}
    assert {tuple(lin.packed) for lin in fast.decoder.linears()} == {(NATIVE, ONEDNN)}
    assert [fast.head.packed_for(m) for m in (1, 3, native.MAX_ROWS, native.MAX_ROWS + 1)] == \
        [NATIVE, NATIVE, NATIVE, ONEDNN]
    # oneDNN verifies fastest, the native kernel decodes one row fastest: it serves one row only
    from eagle3cli.decode.packing import NATIVE_ONE

    cost.update({(4,): 9.0, (NATIVE, ONEDNN): 4.0, (NATIVE_ONE, ONEDNN): 0.9, (1, ONEDNN): 2.5})
    got = tune_packing(fast, 3, clock=clock)
    assert got["packed_for"] == "onednn" and got["packing"] == [NATIVE_ONE, ONEDNN]
    assert got["one_row"] == {"uses": "native", "ms": {"onednn": 3000.0, "1": 2500.0, "native": 900.0}}
    assert [fast.head.packed_for(m) for m in (1, 3)] == [NATIVE, ONEDNN]
    fast.decoder.repack((NATIVE, ONEDNN))
    ids = prompt(9, n=9)
    with torch.no_grad():
        fast.forward(ids[0, :6], torch.arange(6), 0)  # 6 rows: native
        logits, _ = fast.forward(ids[0, 6:], torch.arange(6, 9), 6)
        one, _ = fast.forward(ids[0, 6:7], torch.arange(6, 7), 6)
        ref = target(input_ids=ids).logits[0]
    torch.testing.assert_close(logits, ref[6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one, ref[6:7], atol=1e-5, rtol=1e-5)


def test_linear_packing_rule():
    """One row uses only a copy packed for one (padding it up to a block costs the block); more rows
    use their own, else the smallest larger one; else F.linear. A oneDNN copy serves every row count
    that has no MKL copy of its own, and computes the same products."""
    from eagle3cli.decode.fast_target import NATIVE, ONEDNN, Linear

    w = torch.randn(8, 4)
    assert Linear(w, None, (4,)).packed_for(1) is None
    assert Linear(w, None, (1, 4)).packed_for(1) == 1
    lin = Linear(w, None, (1, 4, 16))
    assert [lin.packed_for(m) for m in (2, 4, 5, 16, 17)] == [4, 4, 16, 16, None]
    x = torch.randn(5, 4)
    torch.testing.assert_close(torch.cat([lin(x[i:i + 1]) for i in range(5)]), x @ w.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lin(x), x @ w.T, atol=1e-5, rtol=1e-5)
    if torch.backends.mkldnn.is_available():
        b = torch.randn(8)
        lin = Linear(w, b, (1, ONEDNN))
        assert [lin.packed_for(m) for m in (1, 2, 5, 17)] == [1, ONEDNN, ONEDNN, ONEDNN]
        torch.testing.assert_close(lin(x), x @ w.T + b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat([lin(x[i:i + 1]) for i in range(5)]), x @ w.T + b, atol=1e-5, rtol=1e-5)
    if native.available():  # the native kernel: up to its row limit, oneDNN or F.linear past it
        b = torch.randn(8)
        lin = Linear(w, b, (NATIVE, 4))
        big = native.MAX_ROWS + 1
        assert [lin.packed_for(m) for m in (1, 4, 5, big)] == [NATIVE, 4, NATIVE, None]
        assert lin.packed[NATIVE].weight is lin.weight  # read as it is: no copy
        xs = torch.randn(big, 4)
        torch.testing.assert_close(lin(xs[:5]), xs[:5] @ w.T + b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lin(xs), xs @ w.T + b, atol=1e-5, rtol=1e-5)
    assert Linear(w.bfloat16(), None, (NATIVE,)).packed == {}  # the kernel is fp32 only
    assert Linear(w.double(), None, (ONEDNN, 4)).packed == {}  # fp64: unpacked, not an error
    wb, xb = w.bfloat16(), x.bfloat16()
    lin = Linear(wb, None, (ONEDNN, 4))  # bf16: oneDNN only (MKL's packed GEMM is fp32)
    if Linear.can_pack(wb, ONEDNN):
        assert set(lin.packed) == {ONEDNN} and lin(xb).dtype == torch.bfloat16
        torch.testing.assert_close(lin(xb), xb @ wb.T, atol=1e-2, rtol=1e-2)
    else:
        assert lin.packed == {}


@pytest.mark.parametrize("arch", FAST_ARCHS)
def test_fast_target_matches_hf_forward(arch):
    """Prefill, a tree verification with its mask, and the kept cache equal the HF forward's."""
    target = tiny_model(arch)
    fast = FastTarget(target, 64, packed_rows=(5,))
    ids = prompt(7)
    n = ids.shape[1]
    layers = (0, 2, target.config.num_hidden_layers)
    with torch.no_grad():
        ref = target(input_ids=ids, output_hidden_states=True)
        logits, hidden = fast.forward(ids[0], torch.arange(n), 0, hidden_layers=layers)
        torch.testing.assert_close(logits, ref.logits[0], atol=1e-5, rtol=1e-5)
        for j in layers:
            torch.testing.assert_close(hidden[j], ref.hidden_states[j], atol=1e-5, rtol=1e-5)
        # a 4-node tree (root, two children, one grandchild) after the prompt, padded to 5 packed rows
        tree = new_tree(int(ids[0, -1]))
        a = tree.add(11, 0, -0.1)
        tree.add(12, 0, -0.2)
        tree.add(13, a, -0.3)
        mask = verify_mask(tree, n, None)
        from transformers import DynamicCache

        cache = DynamicCache(config=target.config)
        target(input_ids=ids, **cache_kwargs(target, cache), use_cache=True)
        pos = (n + torch.tensor(tree.depths))[None]
        ref = target(input_ids=torch.tensor([tree.tokens]), **cache_kwargs(target, cache), use_cache=True,
                     attention_mask=mask, position_ids=pos)
        got, _ = fast.forward(torch.tensor(tree.tokens), pos[0], n, mask=mask[0, 0])
        torch.testing.assert_close(got, ref.logits[0], atol=1e-4, rtol=1e-4)
        # keep root and grandchild path (0, a, 3): the cache equals a fresh prefill of that sequence
        keep = torch.tensor([0, a, 3])
        fast.keep(n, keep)
        seq = torch.cat([ids[0], torch.tensor([tree.tokens[i] for i in keep.tolist()])])
        fresh = FastTarget(target, 64)
        fresh.forward(seq, torch.arange(seq.numel()), 0)
        m = seq.numel()
        torch.testing.assert_close(fast.k[:, :, :m], fresh.k[:, :, :m], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fast.v[:, :, :m], fresh.v[:, :, :m], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("packing", [(4, 13), ("onednn",), ("native", "onednn")], ids=["mkl", "onednn", "native"])
@pytest.mark.parametrize("arch", FAST_ARCHS)
def test_fast_path_greedy_equality(arch, packing):
    """Speculative decoding on the fast path is token for token the HF target's greedy output,
    with MKL's packed matmuls (4 rows padded, 13 exact), oneDNN's, or the native kernel's."""
    target = tiny_model(arch)
    fast = FastTarget(target, 128, packed_rows=packing)
    if "native" in packing and "native" not in fast.head.packed:
        pytest.skip(f"native kernel: {native.status()}")
    accepted = fast_path_accepted(target, fast, seeds=(20, 21, 22), new_tokens=30, label=arch)
    assert accepted > 10  # the oracle's paths were accepted, so the kept cache was exercised


@pytest.mark.parametrize("mode,drafter_kind", [("tree", "eagle"), ("chain", "noisy")])
def test_fast_path_sampling_matches_target_distribution(mode, drafter_kind):
    target = tiny_model("llama", vocab_size=8, num_hidden_layers=3, hidden_size=32, intermediate_size=64)
    fast = FastTarget(target, 16, packed_rows=(4, 7, "onednn"))  # 4 and 7 rows MKL, the rest oneDNN
    drafter = Oracle(target, noise=1.0) if drafter_kind == "noisy" else random_draft(target, keep_every=2)
    sampled_marginals(target, drafter, mode, fast=fast)


def test_fast_path_refuses_what_it_cannot_run():
    assert "phi3" in FastTarget.supports(tiny_model("phi3"))
    assert FastTarget.supports(tiny_model("llama")) is None
    with pytest.raises(ValueError, match="fast path does not support"):
        FastTarget(tiny_model("phi3"), 16)


@pytest.mark.parametrize("packing", [(), ("onednn",)], ids=["unpacked", "onednn"])
@pytest.mark.parametrize("arch", FAST_ARCHS)
def test_bf16_fast_path_verifies_bitwise_as_one_token_decoding(arch, packing, monkeypatch):
    """With bf16 weights the fast path's attention runs in float64 (its cache too), so that a chain
    or tree verification gives bitwise the logits of one-token decoding; greedy speculative output
    then equals plain decoding on the same forward token for token, near-ties included. Unpacked
    and with oneDNN's prepacked bf16 matmuls alike. (The bf16 path of bf16 matmuls; a bf16 target
    in the native bf16-weight kernels: test_native_bf16.)"""
    from eagle3cli.decode.fast_target import Decoder
    from eagle3cli.decode.fast_tuning import row_invariant

    monkeypatch.setattr(Decoder, "BF16_NATIVE", False)

    target = tiny_model(arch).to(torch.bfloat16)
    fast = FastTarget(target, 128, packed_rows=packing)
    if packing and not fast.head.packed:
        pytest.skip("oneDNN has no bf16 kernels here")
    assert fast.low_precision and fast.k.dtype == torch.float64 and fast.head.weight.dtype == torch.bfloat16
    if not row_invariant(fast, 16):
        # tiny qwen2 here: oneDNN's bf16 64x64 matmul differs between 1 and 16 rows in ~3e-5 of elements
        pytest.skip("a bf16 matmul of this model's shapes depends on the row count on this CPU (eval then "
                    "refuses bf16: test_evaluate)")
    assert all(row_invariant(fast, n, prefix=p) for n, p in ((2, 5), (7, 40), (13, 3)))
    assert row_invariant(FastTarget(target, 20), 16)  # a short cache: checked behind a shorter prefix
    with pytest.raises(ValueError, match="more than the cache's 16 positions"):
        row_invariant(FastTarget(target, 16), 16)
    assert sum(accepted_on_fast_path(target, fast, prompt(30 + i), 30, f"prompt {i}") for i in range(3)) > 10


def test_float64_attention_is_for_low_precision_on_a_cpu_only():
    from eagle3cli.decode.fast_target import attention_dtype

    assert attention_dtype(torch.bfloat16) == attention_dtype(torch.float16, "cpu") == torch.float64
    assert attention_dtype(torch.float32) == torch.float32
    assert attention_dtype(torch.bfloat16, "cuda:0") == torch.bfloat16  # GPU: as before, HF generate the reference


def test_row_invariant_catches_a_forward_that_depends_on_the_row_count():
    """The start-up check fails when an n-row forward's logits differ from one-row decoding's in
    the last bit (a chain) or only for tree nodes (a mask that leaks a sibling)."""
    from eagle3cli.decode.fast_tuning import row_invariant

    target = tiny_model("llama").to(torch.bfloat16)
    fast = FastTarget(target, 64)
    head = fast.head
    fast.head = lambda x: head(x) + (x.shape[0] > 1) * 2 ** -6  # one bf16 step near 1: more rows, other logits
    assert not row_invariant(fast, 4)
    fast.head = head
    forward = fast.forward

    def leaky(ids, positions, past, mask=None, **kw):  # tree masks lose their first sibling exclusion
        if mask is not None and mask.shape[0] > 2:
            mask = mask.clone()
            mask[2, past + 1] = True
        return forward(ids, positions, past, mask=mask, **kw)

    fast.forward = leaky
    assert not row_invariant(fast, 4)


def test_fast_target_cache_grows_keeping_what_it_holds(monkeypatch):
    """The cache starts small and doubles when a sequence outgrows it, up to max_len: the logits
    are bitwise those of a cache allocated whole, and past max_len it refuses."""
    target = tiny_model("llama")
    whole = FastTarget(target, 64)
    monkeypatch.setattr(FastTarget, "INITIAL_LEN", 8)
    grown = FastTarget(target, 40, decoder=whole.decoder)
    assert grown.k.shape[2] == 8 and whole.k.shape[2] == 64
    ids = prompt(5, n=40)[0]
    with torch.no_grad():
        for f in (whole, grown):
            f.forward(ids[:6], torch.arange(6), 0)
        for past in range(6, 38, 3):  # 3 new tokens at a time: grows at 9 (to 16), 18 (to 32) and 33 (to 40)
            a, _ = whole.forward(ids[past:past + 3], torch.arange(past, past + 3), past)
            b, _ = grown.forward(ids[past:past + 3], torch.arange(past, past + 3), past)
            assert torch.equal(a, b), past
        assert grown.k.shape[2] == 40 and torch.equal(grown.k, whole.k[:, :, :40])
        with pytest.raises(ValueError, match="holds 40 positions"):
            grown.forward(ids[:3], torch.arange(38, 41), 38)


def test_decoding_on_cuda_rules_out_cudnn_attention_only(monkeypatch):
    """cuDNN's SDPA builds a graph for every new key length (1.2 ms of CPU a call on an H200);
    the decode loops run with flash, memory-efficient and math attention, and restore the rest."""
    from eagle3cli.decode import attention

    seen = []

    def probe():
        b = torch.backends.cuda
        seen.append((b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()))
        return "result"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert attention.without_cudnn_attention(probe)() == "result"
    assert seen == [(False, True, True, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    attention.without_cudnn_attention(probe)()
    assert seen[1][0] is True
    from eagle3cli.decode import generator
    from eagle3cli.evaluate import tree_auto

    for fn in (generator.speculative_generate, generator.greedy_generate, tree_auto.verify_latency,
               tree_auto.verify_latency_fast):
        assert fn.__wrapped__.__name__ == fn.__name__
