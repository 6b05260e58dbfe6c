"""The fast path's step with its op count cut (RoPE in place, k and v cached in one copy, torch's
rms_norm, one-row attention on one thread) computes bit for bit what the step computed before:
a reference written here with the former formulas, over the same packed matmuls and an own
cache, at every step of a decode with a prefill, one-row steps, a tree verification and its
``keep``, past a sliding window, with each packing and on two threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle3cli.decode.fast_target import ONEDNN, FastTarget
from tests.helpers.tiny import tiny_model

CASES = [("llama", torch.float32), ("qwen2", torch.float32), ("qwen3", torch.float32),
         ("gemma3_text", torch.float32), ("granite", torch.float32), ("llama", torch.bfloat16)]
PACKINGS = [(), (ONEDNN,), (1,)]


def _rms(x, w, eps):
    if x.dtype == torch.float32:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _gemma(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)


class Reference:
    """The former step over ``fast``'s weights, with its own k and v caches [layers, kv, L, hd]."""

    def __init__(self, fast: FastTarget, length: int):
        shape = (len(fast.layers), fast.n_kv, length, fast.head_dim)
        self.fast = fast
        self.k, self.v = torch.zeros(shape, dtype=fast.attn_dtype), torch.zeros(shape, dtype=fast.attn_dtype)
        half = fast.head_dim // 2
        self.rope = {kind: (cos, torch.cat([-sin[:, :half], sin[:, half:]], -1))
                     for kind, (cos, sin) in fast.rope_tables.items()}

    def keep(self, past, keep):
        n = keep.numel()
        self.k[:, :, past:past + n], self.v[:, :, past:past + n] = self.k[:, :, past + keep], self.v[:, :, past + keep]

    def _attention(self, j, layer, qk, n, past, attn_mask, masks):
        f, nh, nkv, hd = self.fast, self.fast.n_heads, self.fast.n_kv, self.fast.head_dim
        if n == 1 and attn_mask is None and masks is None and f.attn_dtype == torch.float32:
            qg = qk[:, :nh].reshape(nkv, nh // nkv, hd)
            scores = torch.bmm(qg, self.k[j, :, :past + 1].transpose(1, 2)).mul_(layer.scaling)
            return torch.bmm(scores.softmax(-1), self.v[j, :, :past + 1]).view(1, nh * hd)
        q = qk[:, :nh].transpose(0, 1)[None]
        mask = attn_mask if masks is None else masks[f.layout.kinds[j]]
        o = F.scaled_dot_product_attention(q.to(f.attn_dtype), self.k[j:j + 1, :, :past + n],
                                           self.v[j:j + 1, :, :past + n], attn_mask=mask,
                                           scale=layer.scaling, enable_gqa=nkv != nh).to(qk.dtype)
        return o[0].transpose(0, 1).reshape(n, nh * hd)

    def _layer(self, j, layer, x, rope, n, past, attn_mask, masks):
        nh, nkv, hd = self.fast.n_heads, self.fast.n_kv, self.fast.head_dim
        rms = _gemma if layer.gemma else _rms
        qkv = layer.qkv(rms(x, layer.ln1, layer.eps))
        qk = qkv[:, :(nh + nkv) * hd].view(n, nh + nkv, hd)
        if layer.qk_norms is not None:
            wq, wk, eps = layer.qk_norms
            qk = torch.cat([rms(qk[:, :nh], wq, eps), rms(qk[:, nh:], wk, eps)], 1)
        cos, sin = rope[layer.kind if layer.gemma else None]
        qk = qk * cos + qk.roll(hd // 2, -1) * sin
        self.k[j, :, past:past + n] = qk[:, nh:].transpose(0, 1)
        self.v[j, :, past:past + n] = qkv[:, (nh + nkv) * hd:].view(n, nkv, hd).transpose(0, 1)
        o = layer.o(self._attention(j, layer, qk, n, past, attn_mask, masks))
        x = x + (o * layer.res_mult if layer.res_mult is not None else o if layer.post is None
                 else _gemma(o, layer.post[0], layer.eps))
        gu = layer.gate_up(rms(x, layer.ln2, layer.eps))
        y = layer.down(layer.act(gu[:, :layer.inter]) * gu[:, layer.inter:])
        return x + (y * layer.res_mult if layer.res_mult is not None else y if layer.post is None
                    else _gemma(y, layer.post[1], layer.eps))

    def forward(self, ids, positions, past, mask=None, hidden_layers=()):
        f, d, n = self.fast, self.fast.decoder, ids.shape[0]
        x = d.embed_ids(ids)
        rope = {kind: (cos[positions][:, None], sin[positions][:, None]) for kind, (cos, sin) in self.rope.items()}
        if mask is None and n > 1:
            mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
        attn_mask = None if mask is None else f._additive(mask)
        masks = f._window_masks(mask, positions, past, n) if f.layout.windowed else None
        hidden = {}
        for j, layer in enumerate(f.layers):
            if j in hidden_layers:
                hidden[j] = x[None]
            x = self._layer(j, layer, x, rope, n, past, attn_mask, masks)
        x = (_gemma if f.layers[0].gemma else _rms)(x, f.norm, f.norm_eps)
        out = f.head(x)
        if d.logits_div is not None:
            out = out / d.logits_div
        if d.softcap is not None:
            out = torch.tanh(out / d.softcap) * d.softcap
        return out, hidden


def _steps(seed: int = 0):
    """(ids, positions, past, mask, keep) of a decode: a 9-token prefill, one-row steps, a 4-node
    tree (depths 0, 1, 1, 2) whose path 0-1-3 is kept, then one-row steps past position 16 (tiny
    Gemma 3's window) and a masked single row."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda k: torch.randint(0, 256, (k,), generator=g)  # noqa: E731
    yield tok(9), torch.arange(9), 0, None, None
    for p in range(9, 14):
        yield tok(1), torch.tensor([p]), p, None, None
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 14, dtype=torch.bool), tree], 1)
    yield tok(4), torch.tensor([14, 15, 15, 16]), 14, mask, torch.tensor([0, 1, 3])
    for p in range(17, 30):
        yield tok(1), torch.tensor([p]), p, None, None
    yield tok(1), torch.tensor([30]), 30, torch.ones(1, 31, dtype=torch.bool), None


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("packing", PACKINGS, ids=["unpacked", "onednn", "mkl1"])
@pytest.mark.parametrize("arch,dtype", CASES)
def test_step_is_bitwise_the_former_formula(arch, dtype, packing, two_threads, monkeypatch):
    from eagle3cli.decode.fast_target import Decoder

    monkeypatch.setattr(Decoder, "BF16_NATIVE", False)  # bf16: the path of bf16 matmuls, which Reference computes
    model = tiny_model(arch).to(dtype)
    fast = FastTarget(model, 40, packed_rows=packing)
    ref = Reference(fast, 40)
    assert fast.layout.windowed == (arch == "gemma3_text")
    with torch.inference_mode():
        for i, (ids, pos, past, mask, keep) in enumerate(_steps()):
            got, hid = fast.forward(ids, pos, past, mask=mask, hidden_layers=(0, 3))
            want, want_hid = ref.forward(ids, pos, past, mask=mask, hidden_layers=(0, 3))
            assert torch.equal(got, want), f"step {i}: logits differ by {(got - want).abs().max()}"
            assert hid.keys() == want_hid.keys() and all(torch.equal(hid[j], want_hid[j]) for j in hid)
            if keep is not None:
                fast.keep(past, keep)
                ref.keep(past, keep)
    n = 30 + 1
    assert torch.equal(fast.k[:, :, :n], ref.k[:, :, :n]) and torch.equal(fast.v[:, :, :n], ref.v[:, :, :n])


def test_one_row_attention_runs_on_one_thread_and_restores_the_count(two_threads, monkeypatch):
    fast = FastTarget(tiny_model("llama"), 32)
    fast.forward(torch.arange(5), torch.arange(5), 0)
    seen = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: seen.append(torch.get_num_threads()) or real_bmm(*a))
    fast.forward(torch.tensor([7]), torch.tensor([5]), 5)
    assert seen == [1] * (2 * len(fast.layers)) and torch.get_num_threads() == 2
    monkeypatch.setattr(torch, "bmm", lambda *a: (_ for _ in ()).throw(RuntimeError("bmm failed")))
    with pytest.raises(RuntimeError, match="bmm failed"):
        fast.forward(torch.tensor([7]), torch.tensor([6]), 6)
    assert torch.get_num_threads() == 2


def _ops_per_step(fast: FastTarget, forward) -> int:
    """Operators a one-row step issues from Python (top-level profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        forward(torch.arange(6), torch.arange(6), 0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            forward(torch.tensor([3]), torch.tensor([6]), 6)
    return sum(e.cpu_parent is None for e in prof.events())


def test_one_row_step_issues_a_third_fewer_ops_per_layer():
    per_layer = {}
    for name in ("fast", "reference"):
        counts = []
        for layers in (2, 4):
            fast = FastTarget(tiny_model("llama", num_hidden_layers=layers), 16, packed_rows=(ONEDNN,))
            counts.append(_ops_per_step(fast, fast.forward if name == "fast" else Reference(fast, 16).forward))
        per_layer[name] = (counts[1] - counts[0]) / 2
    # 32 a layer: norm, qkv; RoPE: slice, view, flip, mul_, mul, add_; the k|v copy: 2 slices, view,
    # permute, copy_; attention: slice, view, slice, bmm, mul_, softmax, slice, bmm, view; o, add;
    # norm, gate_up, 2 slices, silu, mul, down, add (the former step: 51)
    assert per_layer["fast"] <= 32 and 1.4 * per_layer["fast"] <= per_layer["reference"], per_layer


def test_native_one_row_step_issues_no_ops_per_layer():
    """With the native packing a layer of a one-row step is one kernel call, which issues no
    tensor op: a step's ops do not grow with its layers (the torch path: 32 a layer)."""
    from eagle3cli.decode import native

    if not native.available():
        pytest.skip("no native kernel here")
    counts = []
    for layers in (2, 4):
        fast = FastTarget(tiny_model("llama", num_hidden_layers=layers), 16, packed_rows=("native", ONEDNN))
        counts.append(_ops_per_step(fast, fast.forward))
    per_layer = (counts[1] - counts[0]) / 2
    assert per_layer == 0 and counts[0] < 20, counts
