"""Integer draft weights (eagle3cli/decode/weight_quant.py): what the kernels multiply by, the lean step
they make, and that speculative decoding stays lossless with them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from eagle3cli.decode import weight_quant
from eagle3cli.decode.drafter import EagleDrafter
from eagle3cli.decode.generator import greedy_generate, speculative_generate
from eagle3cli.decode.weight_quant import Int4Linear, Int8Linear, QuantLinear, quantize
from tests.helpers.decoding import NO_EOS, draft_trees, option_draft, prompt
from tests.helpers.tiny import tiny_model

KINDS = [k for k in weight_quant.KINDS if weight_quant.available(k)]
pytestmark = pytest.mark.skipif(not KINDS, reason="this torch has no weight-only integer CPU kernels")


def weight(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_integer_linear_multiplies_by_its_dequantized_weight(kind, dtype):
    w = weight(64, 128)
    lin = quantize(w, kind, dtype)
    deq = lin.dequantized().float()
    # each weight moves by at most half a quantisation step (scale / 2), and by some of them
    if kind == "int8":
        step = (w.abs().amax(1) / 127)[:, None]
    else:
        groups = w.reshape(64, -1, lin.group)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(lin.group, 1)
    err = (deq - w).abs()
    assert (err <= step / 2 + 1e-2 * step + (1e-2 if dtype == torch.bfloat16 else 0) * w.abs()).all()
    assert err.max() > 0
    for rows in (1, 4, 17):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
        got = lin(x)
        assert got.dtype == dtype and got.shape == (rows, 64)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), F.linear(x.float(), deq), atol=tol, rtol=tol)


def test_shapes_the_kernels_cannot_take_stay_full():
    # int8: the inputs a multiple of 16 (torch 2.13's kernel crashes otherwise); int4: outputs a
    # multiple of 16 and inputs a multiple of 32 (groups of 64 where they divide, else 32)
    assert quantize(weight(64, 24), "int8") is None and quantize(weight(13, 48), "int8") is not None
    assert quantize(weight(24, 64), "int4") is None and quantize(weight(32, 48), "int4") is None
    assert Int4Linear(weight(32, 96)).group == 32 and Int4Linear(weight(32, 128)).group == 64
    assert not Int8Linear.fits(weight(16, 64).to(torch.float64))


def with_weights(draft, lean):
    """``draft`` with its matmul weights replaced by what ``lean``'s kernels multiply by (the
    dequantised weight of an integer matmul; a full one's own)."""
    ref = copy.deepcopy(draft)
    a, m = ref.midlayer.self_attn, ref.midlayer.mlp

    def w(lin):
        return (lin.dequantized() if isinstance(lin, QuantLinear) else lin.weight).float()

    with torch.no_grad():
        q, k, v = w(lean.qkv).split([p.weight.shape[0] for p in (a.q_proj, a.k_proj, a.v_proj)])
        a.q_proj.weight.copy_(q), a.k_proj.weight.copy_(k), a.v_proj.weight.copy_(v)
        gate, up = w(lean.gate_up).split(m.gate_proj.weight.shape[0])
        m.gate_proj.weight.copy_(gate), m.up_proj.weight.copy_(up)
        a.o_proj.weight.copy_(w(lean.o))
        m.down_proj.weight.copy_(w(lean.down))
        ref.lm_head.weight.copy_(w(lean.head))
        ref.fc.weight.copy_(w(lean.fc))
    return ref


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_integer_lean_step_is_the_draft_with_dequantized_weights(kind):
    """The lean step with integer weights drafts the trees the module path drafts from a copy of
    the draft holding the dequantised weights: every matmul quantised, nothing else changed."""
    target = tiny_model("llama")
    draft = option_draft(target, {})
    drafter = EagleDrafter(draft, weights=kind)
    assert drafter.lean.weights == kind
    assert all(lin.kind == kind for lin in drafter.lean.linears())
    assert drafter.lean.packable(4) == [] and drafter.pack(4) is None  # nothing left to pack
    ref = EagleDrafter(with_weights(draft, drafter.lean), lean=False)
    for a, b in zip(draft_trees(ref, target), draft_trees(drafter, target)):
        assert a.tokens == b.tokens and a.parents == b.parents
        assert b.scores == pytest.approx(a.scores, abs=1e-3)
    # and they are not the full-precision draft's weights
    assert not torch.equal(drafter.lean.head.dequantized(), draft.lm_head.weight)


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_matmuls_the_kernel_cannot_take_stay_full_in_the_lean_step(kind):
    """An MLP of 100 (gate|up 200 rows, down 100 inputs: neither kernel takes them) stays full
    while the rest is integer; the trees are still the module path's for those weights."""
    target = tiny_model("llama", intermediate_size=100)
    draft = option_draft(target, {})
    drafter = EagleDrafter(draft, weights=kind)
    lean = drafter.lean
    assert lean.weights == kind
    assert not isinstance(lean.down, QuantLinear) and isinstance(lean.head, QuantLinear)
    assert isinstance(lean.gate_up, QuantLinear) == (kind == "int8")  # 200 rows: int8 takes them, int4 not
    # the full matmuls can still be packed, as far as this CPU packs at all
    from eagle3cli.decode.packing import NATIVE, ONEDNN, Linear

    assert lean.packable(4) == [k for k in ("mkl", ONEDNN, NATIVE) if Linear.can_pack(lean.down.weight,
                                                                                      4 if k == "mkl" else k)]
    ref = EagleDrafter(with_weights(draft, lean), lean=False)
    for a, b in zip(draft_trees(ref, target), draft_trees(drafter, target)):
        assert a.tokens == b.tokens and a.parents == b.parents
        assert b.scores == pytest.approx(a.scores, abs=1e-3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["tree", "chain"])
@torch.no_grad()
def test_integer_draft_weights_keep_decoding_lossless(kind, mode):
    target = tiny_model("llama")
    draft = option_draft(target, {})
    for seed in range(3):
        ids = prompt(seed)
        want = greedy_generate(target, ids, 24, eos_token_id=NO_EOS)
        got = speculative_generate(target, EagleDrafter(draft, weights=kind), ids, mode=mode, total_tokens=12,
                                   depth=4, top_k=3, steps=3, max_new_tokens=24, eos_token_id=NO_EOS)
        assert got.tokens == want


def test_draft_weights_rule():
    from eagle3cli.decode.fast_draft import FastDraft, compute_dtype, weights_for
    from eagle3cli.decode.fast_target import FastTarget

    target = tiny_model("llama")
    fast32 = FastTarget(target, 64)
    assert weights_for(None) == "full" and weights_for(fast32, "int8") == "int8" and weights_for(None, "full") == "full"
    bf16 = FastTarget(tiny_model("llama").to(torch.bfloat16), 64)
    for fast in (fast32, bf16):  # int4 wherever the draft steps in bf16 (an fp32 target on bf16 hardware too)
        assert weights_for(fast) == ("int4" if compute_dtype(fast) == torch.bfloat16 and "int4" in KINDS else "full")
    with pytest.raises(ValueError, match="lean step"):
        EagleDrafter(option_draft(target, {}), lean=False, weights="int4")
    with pytest.raises(ValueError, match="full, int8 or int4"):
        FastDraft(option_draft(target, {}), weights="int2")
