"""A lean forward of Llama-family and Gemma 3 targets over a static KV cache: the generator's fast path.

On a CPU the plain HF forward of a 135M model spends as long in Python and small ops (mask
building, a growing ``DynamicCache`` concatenated every call, three separate q/k/v and two
gate/up matmuls) as in its matrix products, and verifying n tokens through it costs 2-3x
one token although the weights are read once either way (docs/benchmarks.md). This module
runs the same model with the same weights and the same formulas (HF's own RoPE tables and
``apply_rotary_pos_emb``'s products, RMSNorm in fp32 as HF computes it), and per layer only

    x -> rmsnorm -> [q|k|v] one matmul -> (q/k norm) -> rope, in place -> k, v into the static
      cache at their slots in one copy -> SDPA over the cache prefix (tree mask; one row: two
      batched matmuls, on one thread) -> o_proj -> residual -> rmsnorm -> [gate|up] one matmul
      -> silu(gate) * up -> down -> residual

in about 32 tensor ops a layer: every op costs a few microseconds to dispatch whatever its size,
as much as a decoding step's small ones compute (tests/decode/test_fast_step_ops.py holds the
step bitwise to the plainer formulas it replaced).

Gemma 3 takes the same steps with its own pieces: embeddings times sqrt(hidden), (1 + w) norms
that also follow each sublayer, gelu-tanh, query_pre_attn_scalar, a RoPE table per layer kind,
each sliding layer's window in its mask (by the row's position), final soft-capping if set.

The cache is preallocated ([layers, kv heads, positions, head_dim], 1,024 positions, doubled when
a sequence outgrows it, up to max_len); keeping the accepted tree path moves those few entries
into place (``keep``) instead of rebuilding every layer. On a CPU with fp32 weights, the matmuls
use a prepacked GEMM (what inductor's CPU freezing uses): MKL's, specialised for the verification's
row count (smaller inputs padded), or oneDNN's, one copy for every row count, or our compiled
kernel (``native.Matrix``: a verification's few rows, at the memory's streaming rate,
row-invariant); ``fast_tuning.tune_packing`` measures which is faster on this CPU. With bf16
weights the matmuls are unpacked or oneDNN-prepacked, again as measured, and attention runs in
float64 so that verifying is bitwise one-token decoding (``attention_dtype``,
``fast_tuning.row_invariant``). With the native kernels built, a bf16 target's matrices stay bf16
there, fp32 around them: ``Decoder.mixed``.

``FastTarget.supports(model)`` says whether a model can take this path; the generator falls
back to the HF forward otherwise and reports which path ran.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.hf_utils import text_config
from . import native, packing
from .attention import kind_masks, layout
from .native import MAX_ROWS as NATIVE_MAX_ROWS  # noqa: F401  (re-exported)
from .packing import NATIVE, ONEDNN, Linear, serving_key  # noqa: F401  (re-exported: callers import them here)

SUPPORTED_TYPES = {"llama", "mistral", "qwen2", "qwen3"}  # Llama-shaped layers: the fast path and continuous batching
# Gemma 3: scaled embeddings, (1 + w) norms around both sublayers, q/k norms, per-layer-kind RoPE and
# sliding windows; the fast path (FastTarget) runs it, continuous batching (batch_decode) does not
FAST_PATH_TYPES = SUPPORTED_TYPES | {"gemma3_text", "granite"}
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # tables that do not depend on the sequence length
GEMMA_ACT = "gelu_pytorch_tanh"


def _rope_types(cfg) -> list[str]:
    """The RoPE type of each RoPE table (Gemma 3 keeps one per layer kind)."""
    rope = (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    tables = [r for r in rope.values() if isinstance(r, dict)] if isinstance(rope, dict) else []
    if not tables:
        tables = [rope if isinstance(rope, dict) else {}]
    return [r.get("rope_type", r.get("type", "default")) for r in tables]


def config_unsupported_reason(config, families=SUPPORTED_TYPES) -> str | None:
    """Why a target of this config cannot take the fast path (None: it can); no weights needed.
    ``families``: the model types the caller's forward implements (``FAST_PATH_TYPES`` for FastTarget)."""
    cfg = text_config(config)
    kind = getattr(cfg, "model_type", None)
    if kind not in families:
        return f"model_type {kind!r} (fast path: {', '.join(sorted(families))})"
    if kind == "gemma3_text":
        if getattr(cfg, "hidden_activation", GEMMA_ACT) != GEMMA_ACT:
            return f"hidden_activation {cfg.hidden_activation!r}"
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            return "attention soft-capping"
        if getattr(cfg, "use_bidirectional_attention", False):
            return "bidirectional attention"
    elif getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    rope_type = next((t for t in _rope_types(cfg) if t not in STATIC_ROPE), None)
    if rope_type is not None:
        return f"rope_type {rope_type!r}"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    # Qwen2's q/k/v biases are fused
    if getattr(cfg, "mlp_bias", False) or (getattr(cfg, "attention_bias", False) and kind != "qwen2"):
        return "biases in the MLP or attention"
    return None


def unsupported_reason(model, families=SUPPORTED_TYPES) -> str | None:
    """Why ``model`` cannot take the fast path (None: it can)."""
    if getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False):
        return "quantized weights"
    return config_unsupported_reason(model.config, families)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm over the last dim: normalise in fp32, scale in the weight's dtype. fp32
    input: torch's own ``rms_norm``, on a CPU that very formula's aten ops (pow, mean, + eps, rsqrt,
    x * r, * weight) issued from C++ rather than one Python call each (a decoding step runs 61
    norms); a weight per row of a [.., rows, dim] input (the draft's two input norms) takes them
    from Python."""
    if x.dtype == torch.float32:
        if weight.dim() == 1:
            return torch.rms_norm(x, weight.shape, weight, eps)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Gemma3RMSNorm: normalise and scale by (1 + w) in fp32, then cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)


def _eps(norm) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _weights(*tensors, dtype=None) -> torch.Tensor:
    """The tensors concatenated along rows (one tensor: itself), detached, in ``dtype`` if given."""
    w = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
    return w.detach().to(dtype) if dtype is not None else w.detach()


class Layer:
    def __init__(self, layer, packed_rows, dtype=None, mixed: bool = False):
        a, m = layer.self_attn, layer.mlp  # mixed: the four matrices bf16 (native kernels), the rest in dtype
        wdtype = torch.bfloat16 if mixed else dtype
        # Gemma 3: norms after each sublayer too, the MLP's before it is pre_feedforward_layernorm
        self.gemma = hasattr(layer, "pre_feedforward_layernorm")
        self.rms = _gemma_norm if self.gemma else _rms_norm
        self.act = (lambda g: F.gelu(g, approximate="tanh")) if self.gemma else F.silu
        self.post = None if not self.gemma else (_weights(layer.post_attention_layernorm.weight, dtype=dtype),
                                                 _weights(layer.post_feedforward_layernorm.weight, dtype=dtype))
        bias = None
        if a.q_proj.bias is not None:
            bias = _weights(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, dtype=dtype)
        qkv = _weights(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, dtype=wdtype)
        self.qkv = Linear(qkv, bias, packed_rows, mixed)
        self.o = Linear(_weights(a.o_proj.weight, dtype=wdtype), None, packed_rows, mixed)
        self.gate_up = Linear(_weights(m.gate_proj.weight, m.up_proj.weight, dtype=wdtype), None, packed_rows, mixed)
        self.down = Linear(_weights(m.down_proj.weight, dtype=wdtype), None, packed_rows, mixed)
        self.ln1 = _weights(layer.input_layernorm.weight, dtype=dtype)
        pre_mlp = layer.pre_feedforward_layernorm if self.gemma else layer.post_attention_layernorm
        self.ln2 = _weights(pre_mlp.weight, dtype=dtype)
        self.eps = _eps(layer.input_layernorm)
        # Qwen3, Gemma 3: RMSNorm over head_dim before RoPE (HF's formula, as self.rms computes it).
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.qk_norms = None if qn is None else (_weights(qn.weight, dtype=dtype), _weights(kn.weight, dtype=dtype),
                                                 _eps(qn))
        self.kind = getattr(a, "layer_type", None)  # Gemma 3: which RoPE table and mask the layer takes
        self.res_mult = getattr(layer, "residual_multiplier", None)  # Granite: sublayer outputs scaled
        self.scaling = a.scaling
        self.inter = m.gate_proj.weight.shape[0]

    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.qk_norms is None:
            return q, k
        wq, wk, eps = self.qk_norms
        return self.rms(q, wq, eps), self.rms(k, wk, eps)

    def attn_out(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention output ``attn`` (o_proj applied here)."""
        if self.res_mult is not None:  # Granite: residual + out * residual_multiplier, as HF writes it
            return x + self.o(attn) * self.res_mult
        if self.post is None:
            return self.o(attn, add=x)
        return x + _gemma_norm(self.o(attn), self.post[0], self.eps)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the MLP."""
        gu = self.gate_up(self.rms(x, self.ln2, self.eps))
        h = self.act(gu[:, :self.inter]) * gu[:, self.inter:]
        if self.res_mult is not None:
            return x + self.down(h) * self.res_mult
        if self.post is None:
            return self.down(h, add=x)
        return x + _gemma_norm(self.down(h), self.post[1], self.eps)


class Decoder:
    """The target's decoder as plain tensors (fused q|k|v and gate|up, packed matmuls), with no
    cache: what ``FastTarget`` (one sequence) and ``batch_decode.SlotTarget`` (many) share."""

    BF16_NATIVE = True  # bf16 targets ``mixed`` where it applies; off: bf16 matmuls and float64 attention

    def __init__(self, model, packed_rows: tuple[int, ...] = (), purpose: str = "the fast path", dtype=None,
                 families=FAST_PATH_TYPES, mixed: bool | None = None):
        """``dtype``: compute in it (the weights are cast once); None keeps the model's. ``families``:
        the model types the caller's forward runs. ``mixed`` (None: ``mixed_applies``): bf16 matrices in
        the native bf16-weight kernels, fp32 around them."""
        from ..model.target import base_model

        reason = unsupported_reason(model, families)
        if reason:
            raise ValueError(f"{purpose} does not support this target: {reason}")
        cfg = text_config(model.config)
        self.base = base_model(model)
        self.mixed = self.mixed_applies(model, dtype) if mixed is None else mixed
        dtype, wdtype = (torch.float32, torch.bfloat16) if self.mixed else (dtype, dtype)
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden = cfg.hidden_size
        self.embed = _weights(self.base.embed_tokens.weight, dtype=dtype)
        # Gemma 3 scales its embeddings by sqrt(hidden) in their dtype (HF: embed * scale.to(dtype))
        scale = getattr(self.base.embed_tokens, "embed_scale", None)
        self.embed_scale = None if scale is None else scale.to(self.embed.dtype)
        self.layers = [Layer(layer, packed_rows, dtype, self.mixed) for layer in self.base.layers]
        self.norm, self.norm_eps = _weights(self.base.norm.weight, dtype=dtype), _eps(self.base.norm)
        self.final_norm = _gemma_norm if self.layers[0].gemma else _rms_norm
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        # Granite: embeddings times embedding_multiplier, logits divided by logits_scaling (HF's
        # own operations, so greedy choices stay bitwise those of the HF forward)
        self.embed_mult = getattr(self.base, "embedding_multiplier", None)
        self.logits_div = getattr(cfg, "logits_scaling", None) if cfg.model_type == "granite" else None
        # The LM head too: a verification needs logits at every row, and F.linear over a few rows
        # of a vocab-sized matrix is as slow as the layers' (docs/benchmarks.md, "Verification cost").
        self.head = Linear(_weights(model.get_output_embeddings().weight, dtype=wdtype), None, packed_rows, self.mixed)

    @classmethod
    def mixed_applies(cls, model, dtype=None) -> bool:
        """Whether a decoder of ``model`` in its own dtype runs mixed (``packing.mixed_applies``)."""
        return cls.BF16_NATIVE and dtype is None and packing.mixed_applies(model, layout(model.config).windowed)

    def linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in layer.linears()] + [self.head]

    def repack(self, rows: tuple[int, ...]):
        """Pack every matmul (layers and head) for ``rows`` instead (a packed GEMM is specialised for
        its row count); the fused weights are not copied again."""
        for lin in self.linears():
            lin.pack(rows)

    def packable(self) -> bool:
        """Whether ``repack`` packs anything here (a CPU; fp32 weights with MKL or oneDNN, bf16 with oneDNN;
        not mixed, whose matrices only the native kernel serves)."""
        return not self.mixed and any(Linear.can_pack(self.head.weight, key) for key in (1, ONEDNN))

    def rope(self, max_len: int) -> dict:
        """HF's own RoPE tables (any static rope type) for positions 0..max_len-1: {layer kind: (cos, sin)
        [max_len, hd]}, one table under None unless the layers' kinds have their own (Gemma 3)."""
        pos = torch.arange(max_len, device=self.embed.device)[None]
        tables = {}
        for kind in dict.fromkeys(layer.kind if layer.gemma else None for layer in self.layers):
            args = (kind,) if kind is not None else ()
            cos, sin = self.base.rotary_emb(self.embed[:1][None], pos, *args)
            tables[kind] = (cos[0].to(self.embed.dtype), sin[0].to(self.embed.dtype))
        return tables

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed[ids]
        if self.embed_mult is not None:
            x = x * self.embed_mult
        return x if self.embed_scale is None else x * self.embed_scale


def attention_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """What the fast path's attention (and its KV cache) computes in for a decoder in ``dtype``.

    ``dtype`` itself on a GPU (float64 is slow there, and its bf16 GEMMs change with the row count
    anyway: eval then compares with HF generate as in fp32). On a CPU, float64 under bf16/fp16
    weights, so that a verification decodes exactly what one-token
    decoding decodes. oneDNN's bf16 matmuls of SmolLM2's shapes are row-invariant on an AMX Xeon (a
    row's result does not depend on how many rows share the call),
    but attention in low precision is not: its reductions over the keys round differently with the
    key count and the tree mask, which moves bf16 logits enough to flip near-ties
    (docs/benchmarks.md, "Verification cost"). In float64 the differences (~1e-16) vanish when the output is rounded
    back to bf16. Row-invariance of the matmuls is the CPU library's, shape by shape (a 64x64 one
    is not there), so ``fast_tuning.row_invariant`` checks the whole forward at start-up.
    """
    low = dtype in (torch.bfloat16, torch.float16)
    return torch.float64 if low and torch.device(device).type == "cpu" else dtype


class FastTarget:
    """The target's decoder as plain tensors, with its own static KV cache."""

    @staticmethod
    def supports(model) -> str | None:
        return unsupported_reason(model, FAST_PATH_TYPES)

    def __init__(self, model, max_len: int, packed_rows: tuple[int, ...] = (), decoder: Decoder | None = None):
        """A static cache of ``max_len`` positions over ``decoder`` (built from ``model`` when not given:
        pass one to reuse its fused weights, e.g. to time several packed sizes)."""
        d = decoder or Decoder(model, packed_rows)
        self.decoder = d
        self.n_heads, self.n_kv, self.head_dim, self.hidden = d.n_heads, d.n_kv, d.head_dim, d.hidden
        self.embed, self.layers, self.norm, self.norm_eps, self.head = d.embed, d.layers, d.norm, d.norm_eps, d.head
        self.max_len = max_len  # the most positions it may hold; the cache grows to it as needed
        # RoPE tables once for every position (small), so a row's tables never change as the cache grows
        self.rope_tables = d.rope(max_len)  # {layer kind (None: every layer): (cos, sin)}
        # HF's rotate_half(x) * sin as x with its halves swapped times sin with its first half negated:
        # the same products (a negation is exact), so q and k of a layer rotate together in place
        half = self.head_dim // 2
        self.rope_signed = {kind: (cos.view(-1, 2, half),
                                   torch.cat([-sin[:, :half], sin[:, half:]], -1).view(-1, 2, half))
                            for kind, (cos, sin) in self.rope_tables.items()}  # [positions, 2, hd / 2]
        self.attn_dtype = attention_dtype(self.embed.dtype, self.embed.device)
        # sliding windows (Mistral's every layer, Gemma 3's per layer): in the masks, by each row's position
        self.layout = layout(d.base.config)
        # native.NativeLayers, the packing count they were decided at, and which row counts take them
        self._native, self._native_for, self._native_rows = None, -1, {}
        self._rope_flat = tuple(t.reshape(-1, self.head_dim) for t in self.rope_signed.get(None, ()))
        self.kv = None
        self._allocate(min(max_len, self.INITIAL_LEN))

    INITIAL_LEN = 1024  # positions allocated at first: an 8,192-position float64 cache of SmolLM2 is 755 MB

    def _allocate(self, length: int):
        """(Re)allocate the KV cache for ``length`` positions, keeping what is cached. One tensor
        [layers, 2 (k, v), kv heads, positions, head_dim], so that a layer's new keys and values,
        adjacent in its q|k|v output, go into the cache in one copy; ``k`` and ``v`` are its views."""
        shape = (len(self.layers), 2, self.n_kv, length, self.head_dim)
        kv = torch.zeros(shape, device=self.embed.device, dtype=self.attn_dtype)
        if self.kv is not None:
            kv[:, :, :, :self.kv.shape[3]] = self.kv
        self.kv, self.k, self.v = kv, kv[:, 0], kv[:, 1]
        self.kv_layers = kv.unbind(0)  # per layer [2, kv heads, positions, head_dim]
        self.kt_layers = kv[:, 0].transpose(2, 3).unbind(0)  # per layer k^T [kv heads, head_dim, positions]
        self.v_layers = kv[:, 1].unbind(0)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, past: int, mask: torch.Tensor | None = None,
                hidden_layers=(), logits: str = "all"):
        """Run n new tokens ``ids`` [n] at ``positions`` [n], writing cache slots past..past+n-1.

        ``mask``: bool [n, past + n] "may attend" (None: causal over the new tokens, all of the
        prefix visible). Returns (logits [n or 1, V], {j: hidden_states[j] [1, n, H]}). ``logits``
        "last": a prefill, whose rows no verification compares (``packing.prefill``)."""
        n = ids.shape[0]
        if past + n > self.max_len:
            raise ValueError(f"the fast path's cache holds {self.max_len} positions; {past + n} asked")
        if past + n > self.kv.shape[3]:  # grow by doubling: a copy per doubling, not per token
            self._allocate(min(self.max_len, max(2 * self.kv.shape[3], past + n)))
        x = self.decoder.embed_ids(ids)  # [n, H]
        hidden, want = {}, set(hidden_layers)
        if self._native_layers(n):
            x = self._native_step(x, positions, past, mask, want, hidden)
        else:
            with packing.prefill(logits == "last"):
                x = self._torch_layers(x, positions, past, mask, want, hidden)
        x = self.decoder.final_norm(x, self.norm, self.norm_eps)
        if len(self.layers) in want:
            hidden[len(self.layers)] = x[None]
        out = self.head(x if logits == "all" else x[-1:])
        if self.decoder.logits_div is not None:
            out = out / self.decoder.logits_div
        if self.decoder.softcap is not None:  # Gemma's final_logit_softcapping, as HF applies it
            out = torch.tanh(out / self.decoder.softcap) * self.decoder.softcap
        return out, hidden

    # One-row decoding (fp32): attention as two small batched matmuls instead of SDPA, whose
    # flash kernel is built for blocks of query rows and costs more than the products for one
    # (docs/benchmarks.md, "Plain decoding against llama.cpp"). Not under bf16/fp16 weights: there
    # a verification must be bitwise one-token decoding (``attention_dtype``), so every row count
    # takes the same kernel.
    ONE_ROW_ATTENTION = True

    def _torch_layers(self, x: torch.Tensor, positions: torch.Tensor, past: int, mask: torch.Tensor | None,
                      want: set, hidden: dict) -> torch.Tensor:
        """The layers as tensor ops around the matmuls (any family, row count and dtype)."""
        n = x.shape[0]
        if mask is None and n > 1:
            mask = torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(past)
        # the additive form once, not SDPA's bool -> float conversion in every layer (bitwise the same
        # attention, and less time per verification)
        attn_mask = None if mask is None else self._additive(mask)
        masks = self._window_masks(mask, positions, past, n) if self.layout.windowed else None
        nh, hd = self.n_heads, self.head_dim
        one_row = n == 1 and attn_mask is None and masks is None and self.attn_dtype == torch.float32 \
            and self.ONE_ROW_ATTENTION
        rope = {kind: (cos[positions][:, None], sin[positions][:, None])  # [n, 1, 2, hd / 2]
                for kind, (cos, sin) in self.rope_signed.items()}
        for j, layer in enumerate(self.layers):
            if j in want:
                hidden[j] = x[None]
            qkv = layer.qkv(layer.rms(x, layer.ln1, layer.eps))
            self._rope_and_cache(layer, qkv, rope[layer.kind if layer.gemma else None], j, past)
            if one_row:
                o = self._attend_one(qkv[:, :nh * hd], j, past + 1, layer.scaling)
            else:
                layer_mask = attn_mask if masks is None else masks[self.layout.kinds[j]]
                o = self._attend(qkv[:, :nh * hd], j, past + n, layer_mask, layer.scaling)
            x = layer.mlp(layer.attn_out(x, o))
        return x

    # Steps whose every matmul the native kernel serves (up to its MAX_ROWS rows: one-row decoding,
    # a verification) over Llama-shaped layers (fp32, no q/k norms, no sliding windows, no Gemma 3
    # or Granite extras): each layer is one call of ``native.NativeLayer`` instead of about 30
    # tensor ops. Off: the torch ops, around the same matmul kernel (the two are compared in
    # tests/decode/test_fast_decode.py).
    NATIVE_LAYERS = True

    def _native_layers(self, n: int) -> bool:
        """Whether n-row steps run ``native.NativeLayer``s under the matmuls' current packing."""
        if self._native_for != packing.packings:
            self._native_for, self._native, self._native_rows = packing.packings, None, {}
            plain = packing.native_runs_whole(self.decoder.base)
            if (self.NATIVE_LAYERS and plain and not self.layout.windowed
                    and self.attn_dtype == torch.float32 and native.available()):
                self._native = [native.NativeLayer(lay, self.n_heads, self.n_kv, self.head_dim) for lay in self.layers]
        use = self._native_rows.get(n)
        if use is None:
            use = self._native_rows[n] = self._native is not None and all(
                lin.packed_for(n) == NATIVE for lin in self.decoder.linears())
        return use

    def _native_step(self, x: torch.Tensor, positions: torch.Tensor, past: int, mask: torch.Tensor | None,
                     want: set, hidden: dict) -> torch.Tensor:
        """The layers through the native kernel; x [n, H] is updated in place."""
        cos, sin = self._rope_flat
        x, n = x.contiguous(), x.shape[0]
        positions = positions.to(torch.int64).contiguous()
        mask = None if mask is None else mask.contiguous()
        scratch = torch.empty(self._native[0].scratch(n, past), dtype=torch.float32)
        for j, layer in enumerate(self._native):
            if j in want:
                hidden[j] = x[None].clone()  # the kernel writes the stream in place
            layer(x, positions, cos, sin, self.kv_layers[j], past, mask, scratch)
        return x

    def _rope_and_cache(self, layer: Layer, qkv: torch.Tensor, rope: tuple, j: int, past: int):
        """Rotate q and k of ``qkv`` [n, q|k|v] in place (after Qwen3's and Gemma 3's q/k norms) and
        copy k and v into layer j's cache at slots past..past+n-1, in one copy.

        HF's apply_rotary_pos_emb, q * cos + rotate_half(q) * sin, as the same three products and
        sum, over each head as [2, hd / 2]: cos and the signed sin ``rope`` [n, 1, 2, hd / 2]
        (``rope_signed``), the halves swapped by a flip (what ``roll(hd / 2)`` does, without its
        narrows and cat)."""
        n, nh, nkv, hd = qkv.shape[0], self.n_heads, self.n_kv, self.head_dim
        heads = nh + nkv
        qk = qkv[:, :heads * hd].view(n, heads, 2, hd // 2)
        src = qk
        if layer.qk_norms is not None:  # Qwen3, Gemma 3: q and k normalised apart (over head_dim) first
            heads_q, heads_k = qkv[:, :heads * hd].view(n, heads, hd).split((nh, nkv), 1)
            src = torch.cat(layer.qk_norm(heads_q, heads_k), 1).view(n, heads, 2, hd // 2)
        cos, sin = rope
        swapped = src.flip(2).mul_(sin)
        torch.mul(src, cos, out=qk).add_(swapped)
        self.kv_layers[j][:, :, past:past + n] = qkv[:, nh * hd:].view(n, 2, nkv, hd).permute(1, 2, 0, 3)

    def _attend(self, q: torch.Tensor, j: int, length: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """SDPA of query rows q [n, nh * hd] over layer j's cache positions 0..length-1: [n, nh * hd]."""
        n, nh, hd = q.shape[0], self.n_heads, self.head_dim
        kv = self.kv_layers[j][:, None, :, :length]  # [2, 1, kv heads, length, hd]
        q = q.view(n, nh, hd).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q.to(self.attn_dtype), kv[0], kv[1], attn_mask=mask, scale=scale,
                                           enable_gqa=self.n_kv != nh).to(q.dtype)
        return o[0].transpose(0, 1).reshape(n, nh * hd)

    def _attend_one(self, q: torch.Tensor, j: int, length: int, scale: float) -> torch.Tensor:
        """Attention of one query row q [1, nh * hd] over cache positions 0..length-1 of layer j,
        each query head reading its KV group's keys: [1, nh * hd].

        On one thread: at these sizes (a few heads by a few hundred keys) the batched matmuls and
        the softmax would each open an OpenMP parallel region (the softmax for any two rows), whose
        fork and join cost more than the work; the results do not depend on the thread count."""
        qg = q.view(self.n_kv, self.n_heads // self.n_kv, self.head_dim)
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(1)
        try:
            scores = torch.bmm(qg, self.kt_layers[j][:, :, :length]).mul_(scale)  # [kv, g, length]
            return torch.bmm(scores.softmax(-1), self.v_layers[j][:, :length]).view(1, self.n_heads * self.head_dim)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)

    def _additive(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(mask.shape, dtype=self.attn_dtype, device=mask.device).masked_fill_(
            ~mask, float("-inf"))[None, None]

    def _window_masks(self, mask, positions, past: int, n: int) -> dict:
        """{layer kind: additive mask}: ``mask`` (None: causal) narrowed to each kind's window at each
        row's position. Slot i of the cache holds position i (``keep`` moves the accepted path there)."""
        if mask is None:
            mask = torch.ones(n, past + n, dtype=torch.bool, device=positions.device).tril(past)
        k_pos = torch.cat([torch.arange(past, device=positions.device), positions])
        return {k: self._additive(m) for k, m in kind_masks(mask, positions, k_pos, self.layout).items()}

    @property
    def low_precision(self) -> bool:
        """Whether the weights are bf16/fp16 and attention runs in float64 (on a CPU: ``attention_dtype``)."""
        return self.attn_dtype != self.embed.dtype

    @torch.inference_mode()
    def keep(self, past: int, keep: torch.Tensor):
        """Move tree entries ``past + keep`` to slots past, past+1, ... (only those few entries)."""
        src = past + keep
        self.kv[:, :, :, past:past + keep.numel()] = self.kv[:, :, :, src]
