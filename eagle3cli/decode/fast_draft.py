"""The draft's inference step as plain tensors: what ``fast_target`` is for the target.

A drafting level of a 135M target's draft reads ~20 MB of bf16 weights (5 MB as int4) in 5 small
matmuls, and on a CPU every other tensor op costs about as much to dispatch as it computes (2-3 us
each); the module path (``Eagle3Draft.step``) ran ~270 of them a step: RoPE recomputed from the
positions, RMSNorm in six ops per norm, q, k, v and gate, up as separate matmuls, views and
transposes of a batch dimension of one (torch.profiler on 2 AMX Xeon cores). This module runs the same
layer with the same weights and the same formulas (``_rms_norm`` is ``draft.RMSNorm``; the RoPE
tables are ``draft.Rotary``'s for every position) in about 60 ops a step, on one sequence (no batch
dimension):

    [emb | hidden] side by side -> both input norms at once -> [q|k|v] one matmul -> RoPE on q's and
      k's heads at once, in place -> k, v written into the preallocated cache in one copy -> SDPA
      over the cache (tree mask; grouped KV heads as they are) -> o_proj -> residual -> rmsnorm
      -> [gate|up] one matmul -> act(gate) * up -> down -> residual

``Eagle3Draft.step`` stays the reference: training uses it, and tests hold this step to it
(tests/decode/test_generator.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fast_target import ONEDNN, Linear, _rms_norm, _weights
from .packing import NATIVE, serving_key
from .weight_quant import KINDS, QuantLinear, available, quantize


def compute_dtype(fast_target) -> torch.dtype | None:
    """What the drafter computes in beside ``fast_target``: bfloat16 on a CPU where oneDNN packs
    bf16 matmuls, beside a bf16 fast path, or beside an fp32 one where the CPU multiplies bf16 in
    hardware (AVX512-BF16, AMX); else None (the draft's own dtype). A drafting level is bound by
    reading the draft's weights, which the target's forward has just evicted from the caches: in
    bf16 a 16-node tree drafts in 5.5 ms a cycle against 7.2 in fp32 and a chain of 3 in 3.9
    against 4.4 on 2 AMX Xeon cores (``benchmarks/draft_paths.py``); beside SmolLM2 in fp32 on 2
    AVX512-BF16 cores a 3-node tree's draft costs 1.82 ms a cycle against 2.08 (10 prompts, the
    same tau), and 1.08 with int4 weights (``weights_for``). Only the proposals change, within bf16
    rounding; what is accepted is still the target's own greedy output."""
    from ..core.hardware import has_bf16_matmul

    if fast_target is None or fast_target.embed.dtype not in (torch.bfloat16, torch.float32):
        return None
    if fast_target.embed.dtype == torch.float32 and not has_bf16_matmul():
        return None  # emulated bf16 is slower than fp32
    probe = torch.empty(1, 1, dtype=torch.bfloat16, device=fast_target.embed.device)
    return torch.bfloat16 if Linear.can_pack(probe, ONEDNN) else None


def weights_for(fast_target, requested: str = "auto") -> str:
    """What ``requested`` (``--draft-weights``: auto, full, int8, int4) stores the drafter's matmuls
    as beside ``fast_target``. auto: int4 where the draft steps in bf16 (``compute_dtype``), else
    full. A level then reads a quarter of bf16's bytes with the same acceptance: a 16-node tree
    drafts in 4.6 ms a cycle against 6.5 in bf16 on 2 AMX Xeon cores; a 3-node tree beside SmolLM2
    in fp32 in 1.08 ms against 1.82 (bf16) and 2.08 (fp32) on 2 AVX512-BF16 AMD cores
    (``benchmarks/draft_paths.py``; docs/benchmarks.md, "The speculative cycle and its overhead").
    With fp32 inputs torch's integer kernels are slower than full weights, so fp32 drafts stay full."""
    if requested != "auto":
        return requested
    return "int4" if compute_dtype(fast_target) == torch.bfloat16 and available("int4") else "full"


class ExactRowsLinear(Linear):
    """A ``Linear`` whose MKL copy serves exactly its row count (smaller calls are not padded up:
    2 or 3 rows padded to a 4-row packed GEMM cost more than ``F.linear`` for a draft step on an
    AMX Xeon); the native kernel serves up to its row limit, oneDNN's copy any count."""

    def packed_for(self, m: int) -> int | str | None:
        key = serving_key(tuple(self.packed), m)
        return None if isinstance(key, int) and key != m else key


class FastDraft:
    """An ``Eagle3Draft``'s step over its own static KV cache (grown by doubling)."""

    INITIAL_LEN = 512  # cache positions at first (a few MB for SmolLM2's draft)

    def __init__(self, draft, packed_rows: tuple = (), dtype: torch.dtype | None = None, weights: str = "full"):
        """``dtype``: compute in it (weights cast once, as ``draft.to(dtype)`` would); None keeps the draft's.
        ``weights``: "full", or "int8" / "int4" to store the matmuls' weights as integers
        (``weight_quant``; a matmul whose shape the kernel cannot take stays full)."""
        cfg, layer = draft.config, draft.midlayer
        a, m = layer.self_attn, layer.mlp
        self.draft = draft  # fc's optional norms (fuse_input) and the vocab maps stay the module's
        self.nh, self.nkv, self.hd = a.num_heads, a.num_kv, a.head_dim
        self.embed = draft.embed_tokens.weight.detach()
        if weights not in ("full", *KINDS):
            raise ValueError(f"draft weights must be full, {' or '.join(KINDS)}; got {weights!r}")
        kind = weights

        def weights(*tensors):
            return _weights(*tensors, dtype=dtype)

        def linear(*tensors):
            # quantised from the draft's own precision, scales in the compute dtype; no cast copy kept
            q = quantize(_weights(*tensors), kind, dtype) if kind != "full" else None
            return q if q is not None else ExactRowsLinear(weights(*tensors), None, packed_rows)

        self.fc = linear(draft.fc.weight)
        self.fuse_norms = cfg.norm_before_fc or cfg.fc_norm  # those stay the module's (EAGLE-3.1 options)
        self.qkv = linear(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
        self.o, self.down = linear(a.o_proj.weight), linear(m.down_proj.weight)
        self.gate_up = linear(m.gate_proj.weight, m.up_proj.weight)
        self.head = linear(draft.lm_head.weight)
        # the two input norms as one [2, H] weight: embedding and hidden stream are normed side by side
        self.ln_in = weights(torch.stack([layer.input_layernorm.weight, layer.hidden_norm.weight]))
        self.ln_post, self.norm = weights(layer.post_attention_layernorm.weight), weights(draft.norm.weight)
        self.eps = layer.input_layernorm.eps
        self.act, self.inter = m.act_fn, m.gate_proj.weight.shape[0]
        self.norm_before_residual = cfg.norm_before_residual
        self.norm_output = cfg.norm_output
        self.rotary = draft.rotary
        self.dtype = dtype or a.q_proj.weight.dtype
        # what ran: "full" where no matmul took the integer kernel (shapes, or a torch without it)
        self.weights = kind if any(isinstance(lin, QuantLinear) for lin in self.linears()) else "full"
        self.rope = self.kv = None
        self.n = 0  # filled cache positions
        self._grow(self.INITIAL_LEN)

    def linears(self) -> tuple[Linear, ...]:
        return self.fc, self.qkv, self.o, self.gate_up, self.down, self.head

    def repack(self, rows: tuple):
        """Pack every matmul for ``rows`` (MKL row counts and/or ``ONEDNN``); () unpacks."""
        for lin in self.linears():
            lin.pack(rows)

    def packable(self, rows: int) -> list[str]:
        """The packings that apply here for ``rows``-row steps: "mkl" (for exactly that many), ``ONEDNN``,
        ``NATIVE`` (fp32: the compiled kernel, oneDNN beyond its row limit, as for the prompt);
        none when every matmul is integer (nothing left to pack)."""
        full = [lin.weight for lin in self.linears() if not isinstance(lin, QuantLinear)]
        if not full:
            return []
        return [k for k in ("mkl", ONEDNN, NATIVE) if Linear.can_pack(full[0], rows if k == "mkl" else k)]

    # ---- cache ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n

    def _grow(self, length: int):
        """Room for ``length`` positions: the cache (kept) and the RoPE tables of every position."""
        w, hd = self.embed, self.hd
        pos = torch.arange(length, device=w.device)[None]
        cos, sin = self.rotary(pos, self.dtype)  # [1, 1, length, hd], as Rotary computes per step
        cos, sin = cos[0, 0], sin[0, 0]
        # rotate_half(x) * sin is x's two halves swapped times sin with its first half negated, bitwise
        # (x * -s == -(x * s)); the swap is a flip of a [2, hd / 2] view, one op instead of four
        signed = torch.cat([-sin[:, : hd // 2], sin[:, hd // 2:]], -1)
        self.rope = torch.stack([cos, signed], 1)[:, :, None]  # [length, 2, 1, hd]: one index a step
        kv = torch.zeros(2, self.nkv, length, hd, dtype=self.dtype, device=w.device)  # keys, values
        if self.kv is not None:
            kv[:, :, : self.n] = self.kv[:, :, : self.n]
        self.kv = kv
        self.keys, self.values = kv[:1], kv[1:]  # [1, nkv, length, hd]: SDPA's layout, no copy

    def reset(self):
        self.n = 0

    def crop(self, n: int):
        self.n = min(self.n, n)

    # ---- one step ---------------------------------------------------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """g [T, H] of the target's three streams ``aux`` [T, 3*Ht] (``Eagle3Draft.fuse``): fc here,
        in this step's dtype and weights (in fp32 it read 4 MB of SmolLM2's draft a cycle)."""
        if self.fuse_norms:
            aux = self.draft.fuse_input(aux.to(self.draft.fc.weight.dtype))
        return self.fc(aux.to(self.dtype))

    @torch.inference_mode()  # its cache is written in place: always in inference mode, whoever calls
    def step(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
             mask: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """The layer on T new tokens ``ids`` [T] with ``hidden`` [T, H] (g, or a parent's output
        stream) at positions ``pos`` [T], appended to the cache; ``mask`` [T, len + T] bool "may
        attend" (None: causal, the whole cache visible). Returns the output stream [T, H]
        (``Eagle3Draft.output``), as ``Eagle3Draft.step`` does. Positions must be below len + T, as
        the drafter's always are (a node at depth d sits at position verified - 1 + d).

        ``last_only`` (causal steps): every row's keys and values are cached, but only the last row
        goes through attention and the MLP, and only its output stream [1, H] is returned. The
        verified rows a cycle appends need nothing else: their own outputs are never read, and the
        last one sees the whole cache, so no mask is built either."""
        if last_only and mask is not None:  # refused before the cache is touched
            raise ValueError("last_only steps are causal: no mask")
        t, past = ids.shape[0], self.n
        need = past + t
        if need > self.kv.shape[2]:  # positions stay below len + T (the drafter's never pass it): tables fit
            self._grow(2 * need)
        nh, nkv, hd = self.nh, self.nkv, self.hd
        hidden = hidden.to(self.dtype)
        x = torch.stack([F.embedding(ids, self.embed).to(self.dtype), hidden], 1)  # [T, 2, H], embedding first
        x = _rms_norm(x, self.ln_in, self.eps)
        qkv = self.qkv(x.view(t, -1)).view(t, nh + 2 * nkv, hd)
        cos, sin = self.rope[pos].unbind(1)  # [T, 1, hd]
        qk = qkv.narrow(1, 0, nh + nkv)
        swapped = qk.view(t, nh + nkv, 2, hd // 2).flip(2).view(t, nh + nkv, hd)
        torch.add(qk * cos, swapped * sin, out=qk)  # RoPE on q's and k's heads, written back into qkv
        self.kv.narrow(2, past, t).copy_(qkv[:, nh:].view(t, 2, nkv, hd).permute(1, 2, 0, 3))
        self.n = need
        if last_only and t > 1:
            qkv, x, hidden, t = qkv[-1:], x[-1:], hidden[-1:], 1
        if mask is None and t > 1:
            mask = torch.ones(t, need, dtype=torch.bool, device=x.device).tril(past)
        o = F.scaled_dot_product_attention(qkv[:, :nh].transpose(0, 1)[None], self.keys.narrow(2, 0, need),
                                           self.values.narrow(2, 0, need),
                                           attn_mask=None if mask is None else mask[None, None], enable_gqa=nkv != nh)
        residual = x[:, 1] if self.norm_before_residual else hidden
        h = residual + self.o(o.transpose(1, 2).reshape(t, nh * hd))
        gu = self.gate_up(_rms_norm(h, self.ln_post, self.eps))
        a = h + self.down(self.act(gu[:, : self.inter]) * gu[:, self.inter:])
        return _rms_norm(a, self.norm, self.eps) if self.norm_output else a

    def logits(self, a: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of output streams ``a`` [T, H] (``Eagle3Draft.logits``)."""
        return self.head(a if self.norm_output else _rms_norm(a, self.norm, self.eps))
