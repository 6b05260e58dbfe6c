"""The fast path's one-row decoding step: its attention (the native kernel's, or two batched
matmuls, not SDPA) gives what the SDPA path gives, greedy decoding stays HF's, and low precision
never takes it."""

from __future__ import annotations

import pytest
import torch

from eagle3cli.decode import native
from eagle3cli.decode.fast_target import FastTarget
from eagle3cli.decode.generator import greedy_generate
from tests.helpers.tiny import tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "granite"]
NO_EOS = [-1]


def _decode_logits(fast: FastTarget, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Prefill ``ids`` and decode ``steps`` tokens one at a time (greedy); the stacked step logits."""
    n = ids.numel()
    logits, _ = fast.forward(ids, torch.arange(n), 0, logits="last")
    out = []
    for i in range(steps):
        t = logits[-1].argmax().view(1)
        logits, _ = fast.forward(t, torch.tensor([n + i]), n + i)
        out.append(logits)
    return torch.cat(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_row_attention_equals_sdpa(arch, monkeypatch):
    target = tiny_model(arch)
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    calls = []
    real = FastTarget._attend_one
    monkeypatch.setattr(FastTarget, "_attend_one", lambda self, *a: calls.append(a[1]) or real(self, *a))
    fast = FastTarget(target, 64)
    lean = _decode_logits(fast, ids, 12)
    # every layer of every step took it, but where sliding windows mask the keys (tiny Mistral's)
    expected = 0 if fast.layout.windowed else 12 * target.config.num_hidden_layers
    assert len(calls) == expected
    monkeypatch.setattr(FastTarget, "ONE_ROW_ATTENTION", False)
    sdpa = _decode_logits(FastTarget(target, 64), ids, 12)
    assert len(calls) == expected  # and the reference did not
    torch.testing.assert_close(lean, sdpa, atol=1e-5, rtol=1e-5)
    assert torch.equal(lean.argmax(-1), sdpa.argmax(-1))


def _verify_steps(fast: FastTarget, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a prefill, 6 one-row steps, a causal 3-row chain and a masked 4-node tree (depths
    0, 1, 1, 2) whose path 0-1-3 is kept, then 3 more one-row steps."""
    out = []
    with torch.inference_mode():
        out.append(fast.forward(ids[:9], torch.arange(9), 0)[0])
        for p in range(9, 15):
            out.append(fast.forward(ids[p:p + 1], torch.tensor([p]), p)[0])
        out.append(fast.forward(ids[15:18], torch.arange(15, 18), 15)[0])
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        mask = torch.cat([torch.ones(4, 18, dtype=torch.bool), tree], 1)
        out.append(fast.forward(ids[18:22], torch.tensor([18, 19, 19, 20]), 18, mask=mask)[0])
        fast.keep(18, torch.tensor([0, 1, 3]))
        for p in range(21, 24):
            out.append(fast.forward(ids[p:p + 1], torch.tensor([p]), p)[0])
    return out


@pytest.mark.skipif(not native.available(), reason="no native kernel here")
@pytest.mark.parametrize("arch", ARCHS)
def test_native_layers_equal_the_torch_ops(arch, monkeypatch):
    """Under the native packing one-row steps and verifications (a causal chain, a masked tree)
    run each Llama-shaped layer as one kernel call (norms, RoPE, the cache write, attention,
    activation, residual adds); logits, hidden states and cache equal the torch ops' (same matmul
    kernel) and SDPA's. None where q/k norms (Qwen3), sliding windows (tiny Mistral's) or
    Granite's multipliers need the torch ops."""
    target = tiny_model(arch)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(4))
    calls = []
    real = native.NativeLayer.__call__
    monkeypatch.setattr(native.NativeLayer, "__call__",
                        lambda self, x, *a: calls.append(x.shape[0]) or real(self, x, *a))
    fast = FastTarget(target, 64, packed_rows=("native", "onednn"))
    got = _verify_steps(fast, ids)
    plain = target.config.model_type in ("llama", "qwen2")
    rows = [1] * 6 + [3, 4] + [1] * 3  # the 9-row prefill is within the kernel's rows too
    assert calls == ([r for r in [9] + rows for _ in range(target.config.num_hidden_layers)] if plain else [])
    for reference in ("torch ops", "sdpa"):
        monkeypatch.setattr(FastTarget, "NATIVE_LAYERS", False)
        monkeypatch.setattr(FastTarget, "ONE_ROW_ATTENTION", reference == "torch ops")
        ref = FastTarget(target, 64, packed_rows=("native", "onednn"))
        want = _verify_steps(ref, ids)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(fast.kv[:, :, :, :24], ref.kv[:, :, :, :24], atol=1e-6, rtol=1e-5)
    monkeypatch.setattr(FastTarget, "NATIVE_LAYERS", True)
    layers = (0, 1, target.config.num_hidden_layers)
    with torch.inference_mode():
        _, a = fast.forward(ids[:2], torch.tensor([24, 25]), 24, hidden_layers=layers)
        _, b = ref.forward(ids[:2], torch.tensor([24, 25]), 24, hidden_layers=layers)
    for j in layers:  # hidden states captured before the kernel wrote the stream in place
        torch.testing.assert_close(a[j], b[j], atol=1e-5, rtol=1e-5)
    assert not torch.equal(a[0], a[1])


def test_native_attention_refuses_what_it_cannot_read():
    if not native.available():
        pytest.skip("no native kernel here")
    kv, rope = torch.zeros(2, 1, 8, 4), torch.ones(16, 4)
    qkv, pos = torch.zeros(2, 12), torch.tensor([3, 4])
    with pytest.raises(ValueError, match="slots up to 9"):
        native.attend(qkv, pos, rope, rope, kv, 7, 1, 1.0)
    with pytest.raises(ValueError, match="fp32"):
        native.attend(qkv.double(), pos, rope, rope, kv, 0, 1, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        native.attend(qkv, pos, rope, rope, kv.transpose(2, 3), 0, 1, 1.0)
    with pytest.raises(ValueError, match="positions"):
        native.attend(qkv, torch.tensor([3, 16]), rope, rope, kv, 0, 1, 1.0)
    with pytest.raises(ValueError, match="bool mask"):
        native.attend(qkv, pos, rope, rope, kv, 0, 1, 1.0, mask=torch.ones(2, 3))
    out = native.attend(qkv, pos, rope, rope, kv, 0, 1, 1.0, mask=torch.tensor([[1, 0], [1, 1]], dtype=torch.bool))
    assert out.shape == (2, 4)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_row_decoding_is_hf_greedy(arch):
    target = tiny_model(arch)
    fast = FastTarget(target, 128, packed_rows=("onednn",))
    for seed in range(3):
        ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(seed))
        assert greedy_generate(target, ids, 40, eos_token_id=NO_EOS, fast=fast) == \
            greedy_generate(target, ids, 40, eos_token_id=NO_EOS)


def test_low_precision_and_masked_rows_keep_sdpa(monkeypatch):
    """bf16 weights (float64 attention, where a verification must be bitwise one-token decoding)
    and a masked row never take the one-row attention. (The bf16 path of bf16 matmuls: with the native
    bf16-weight kernels a bf16 target computes in fp32, test_native_bf16.)"""
    from eagle3cli.decode.fast_target import Decoder

    monkeypatch.setattr(Decoder, "BF16_NATIVE", False)
    target = tiny_model("llama").to(torch.bfloat16)
    monkeypatch.setattr(FastTarget, "_attend_one", lambda *a: pytest.fail("one-row attention under bf16"))
    fast = FastTarget(target, 64)
    assert fast.low_precision
    _decode_logits(fast, torch.arange(5), 3)
    fp32 = FastTarget(tiny_model("llama"), 64)
    fp32.forward(torch.arange(5), torch.arange(5), 0)
    fp32.forward(torch.tensor([7]), torch.tensor([5]), 5, mask=torch.ones(1, 6, dtype=torch.bool))


@pytest.mark.skipif(not native.available(), reason="no native kernel here")
def test_native_layers_follow_the_matmuls_packing():
    """The native layers run for exactly the row counts whose every matmul the native kernel
    serves: repacking the decoder, or one matmul alone, switches a FastTarget to the torch ops
    and back; packed for one row only (beside oneDNN for verifications), only one-row steps."""
    from eagle3cli.decode.fast_target import NATIVE, ONEDNN
    from eagle3cli.decode.packing import NATIVE_ONE

    fast = FastTarget(tiny_model("llama"), 32, packed_rows=(NATIVE, ONEDNN))
    assert [fast._native_layers(n) for n in (1, 4, native.MAX_ROWS, native.MAX_ROWS + 1)] == [True, True, True, False]
    fast.decoder.repack((ONEDNN,))
    assert not fast._native_layers(1)
    fast.decoder.repack((NATIVE_ONE, ONEDNN))
    assert fast._native_layers(1) and not fast._native_layers(4)
    fast.decoder.repack((NATIVE, ONEDNN))
    assert fast._native_layers(4)
    fast.layers[1].down.pack((ONEDNN,))
    assert not fast._native_layers(1)


@pytest.mark.skipif(not native.available(), reason="no native kernel here")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_verification_is_bitwise_one_token_decoding(arch):
    """Under the native packing a verification of up to 16 rows (a chain, and every node of a
    binary tree against its own path) gives bitwise the logits of decoding one token at a time:
    the kernel's products, norms and attention per row do not depend on the row count. (oneDNN's
    fp32 GEMMs do: there the fast path is exact only up to rounding.)"""
    from eagle3cli.decode.fast_target import NATIVE, ONEDNN
    from eagle3cli.decode.fast_tuning import row_invariant

    fast = FastTarget(tiny_model(arch), 64, packed_rows=(NATIVE, ONEDNN))
    assert all(row_invariant(fast, rows) for rows in (2, 3, 4, 8, native.MAX_ROWS))
