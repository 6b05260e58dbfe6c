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


@pytest.mark.skipif(not native.available(), reason="no native kernel here")
@pytest.mark.parametrize("arch", ARCHS)
def test_native_one_row_layers_equal_the_torch_ops(arch, monkeypatch):
    """Under the native packing a one-row step runs each Llama-shaped layer as one kernel call
    (norms, RoPE, the cache write, attention, activation, residual adds); its logits, hidden states
    and cache equal the torch ops' (same matmul kernel) and SDPA's. None where q/k norms (Qwen3),
    sliding windows (tiny Mistral's) or Granite's multipliers need the torch ops."""
    target = tiny_model(arch)
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(4))
    calls = []
    real = native.OneRowLayer.__call__
    monkeypatch.setattr(native.OneRowLayer, "__call__", lambda self, x, *a: calls.append(a[3]) or real(self, x, *a))
    fast = FastTarget(target, 64, packed_rows=("native", "onednn"))
    got = _decode_logits(fast, ids, 12)
    plain = target.config.model_type in ("llama", "qwen2")
    assert calls == ([9 + i for i in range(12) for _ in range(target.config.num_hidden_layers)] if plain else [])
    for reference in ("torch ops", "sdpa"):
        monkeypatch.setattr(FastTarget, "NATIVE_LAYERS", False)
        monkeypatch.setattr(FastTarget, "ONE_ROW_ATTENTION", reference == "torch ops")
        ref = FastTarget(target, 64, packed_rows=("native", "onednn"))
        want = _decode_logits(ref, ids, 12)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(fast.kv[:, :, :, :21], ref.kv[:, :, :, :21], atol=1e-6, rtol=1e-5)
    monkeypatch.setattr(FastTarget, "NATIVE_LAYERS", True)
    layers = (0, 1, target.config.num_hidden_layers)
    one = torch.tensor([int(ids[0])])
    with torch.inference_mode():
        a_logits, a = fast.forward(one, torch.tensor([21]), 21, hidden_layers=layers)
        b_logits, b = ref.forward(one, torch.tensor([21]), 21, hidden_layers=layers)
    for j in layers:  # hidden states captured before the kernel wrote the stream in place
        torch.testing.assert_close(a[j], b[j], atol=1e-5, rtol=1e-5)
    assert not torch.equal(a[0], a[1])


def test_native_attention_refuses_what_it_cannot_read():
    if not native.available():
        pytest.skip("no native kernel here")
    kv = torch.zeros(2, 1, 8, 4)
    qkv, rope = torch.zeros(1, 12), torch.ones(4)
    with pytest.raises(ValueError, match="slot 8"):
        native.attend_one(qkv, rope, rope, kv, 8, 1, 1.0)
    with pytest.raises(ValueError, match="fp32"):
        native.attend_one(qkv.double(), rope, rope, kv, 0, 1, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        native.attend_one(qkv, rope, rope, kv.transpose(2, 3), 0, 1, 1.0)


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
    and a masked row never take the one-row attention."""
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
    """The native layers run exactly while every matmul is packed for the native kernel: repacking
    the decoder, or one matmul alone, switches a FastTarget to the torch ops and back."""
    from eagle3cli.decode.fast_target import NATIVE, ONEDNN

    fast = FastTarget(tiny_model("llama"), 32, packed_rows=(NATIVE, ONEDNN))
    assert fast._native_layers()
    fast.decoder.repack((ONEDNN,))
    assert not fast._native_layers()
    fast.decoder.repack((NATIVE, ONEDNN))
    assert fast._native_layers()
    fast.layers[1].down.pack((ONEDNN,))
    assert not fast._native_layers()
