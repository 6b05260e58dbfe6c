"""The fast path's matmuls on a CPU: y = x W^T (+ b) through whichever kernel serves a row count
fastest here, chosen by ``fast_tuning.tune_packing``: MKL's packed GEMM (specialised for a row
count), oneDNN's prepacked linear (one copy for every row count), or eagle3's compiled kernel
(``native.Matrix``: up to its MAX_ROWS rows, at the memory's streaming rate, row-invariant)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from . import native
from .native import MAX_ROWS as NATIVE_MAX_ROWS

ONEDNN = "onednn"  # a packing key: oneDNN's prepacked fp32 linear, one copy for every row count
NATIVE = "native"  # a packing key: the compiled fp32 kernel of ``native`` for up to its MAX_ROWS rows, no copy
NATIVE_ONE = "native-1"  # the same kernel for one row only (plain decoding beside another verification kernel)


packings = 0  # how many times any Linear was (re)packed: FastTarget's cue to re-decide its native layers


class Linear:
    """y = x W^T (+ b); on a CPU in fp32, a prepacked GEMM: MKL's for the row counts asked for
    (int keys), and/or oneDNN's (``ONEDNN``), which serves any row count, and/or our compiled
    kernel (``NATIVE``: ``native.Matrix``), which serves up to ``native.MAX_ROWS`` rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed_rows: tuple = (), mixed: bool = False):
        """``mixed``: a bf16 weight against fp32 inputs, which the native bf16-weight kernel multiplies
        (``native.Matrix``) whatever ``pack`` is asked for: up to its MAX_ROWS rows in one call, more in
        chunks of them, each row computed alike, or a prefill's rows in one bf16 GEMM (``_prompt``)."""
        self.weight, self.bias = weight.contiguous(), bias
        self.mixed = mixed
        self.pack(packed_rows)

    @staticmethod
    def can_pack(weight: torch.Tensor, key: int | str = 1) -> bool:
        """Whether ``weight`` packs for ``key`` here, on a CPU: MKL's packed GEMM (an int key; fp32)
        or oneDNN's prepacked linear (``ONEDNN``; what inductor's CPU freezing uses without MKL; fp32,
        or bf16 where oneDNN has bf16 kernels). Unpacked, a bf16 matmul reorders its weight into
        oneDNN's blocked layout on every call, which prepacking saves (docs/benchmarks.md,
        "Verification cost")."""
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return False
        if key in (NATIVE, NATIVE_ONE):  # bf16 weights take it only against fp32 inputs (``mixed``)
            return weight.dtype == torch.float32 and native.supports(weight)
        if key == ONEDNN:
            onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            return onednn and (weight.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return weight.dtype == torch.float32 and hasattr(torch.ops.mkl, "_mkl_linear")

    def pack(self, rows: tuple):
        """Replace the packed copies with ones for ``rows`` (ints: MKL for that many rows; ``ONEDNN``;
        ``NATIVE``, which reads the weight as it is); the weight itself is kept as it is. Keys this
        CPU cannot pack are skipped."""
        global packings
        packings += 1  # any FastTarget over this matmul decides its native layers again
        self.packed = {}
        self.serving = {}  # row count -> the key serving it (``packed_for``), found once per count
        if self.mixed:
            self.packed[NATIVE] = native.Matrix(self.weight, self.bias)
            return
        for m in rows:
            if not self.can_pack(self.weight, m):
                continue
            if m in (NATIVE, NATIVE_ONE):
                self.packed[m] = native.Matrix(self.weight, self.bias)
            elif m == ONEDNN:
                self.packed[m] = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
            else:
                self.packed[m] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, m)

    def packed_for(self, m: int) -> int | str | None:
        return serving_key(tuple(self.packed), m)

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """``add`` (a residual stream): add + x W^T, rounded as that sum is; the native kernel adds it
        as it writes its output (one op and one pass over the row fewer)."""
        m = x.shape[0]
        key = self.serving.get(m, False)
        if key is False:
            key = self.serving[m] = self.packed_for(m)
        if key == NATIVE:
            return (self.packed.get(NATIVE) or self.packed[NATIVE_ONE])(x, add)
        if self.mixed:  # a prompt's many rows
            return self._prompt(x, add)
        y = self._matmul(x, key)
        return y if add is None else add + y

    def _prompt(self, x: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
        """A bf16 weight against more rows than the native kernel serves. In a prefill (``prefill``:
        no row is verified against one-row decoding), where the CPU multiplies bf16 in hardware:
        one oneDNN bf16 GEMM on the rows rounded to bf16, its output in fp32, since the native
        kernel's per-row arithmetic is compute-bound on many rows (a 160-token SmolLM2 prompt: 251
        ms in its chunks, 82 in the GEMM on 2 AMX Xeon cores; benchmarks/prefill.py). Otherwise
        the native kernel, NATIVE_MAX_ROWS at a time, each row computed as one row is: a
        verification of more rows than it serves stays bitwise one-row decoding. Plain and
        speculative decoding prefill alike, so their outputs stay equal."""
        if _in_prefill and prompt_gemm():
            y = F.linear(x.to(torch.bfloat16), self.weight).float()
            if self.bias is not None:
                y += self.bias
            return y if add is None else add + y
        mat, step = self.packed[NATIVE], NATIVE_MAX_ROWS
        return torch.cat([mat(x[i:i + step], None if add is None else add[i:i + step])
                          for i in range(0, x.shape[0], step)])

    def _matmul(self, x: torch.Tensor, key) -> torch.Tensor:
        m = x.shape[0]
        if key is None:
            return F.linear(x, self.weight, self.bias)
        if key == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed[key], self.bias, "none", [], "")
        if key > m:
            x = torch.cat([x, x.new_zeros(key - m, x.shape[1])])
        return torch.ops.mkl._mkl_linear(x, self.packed[key], self.weight, self.bias, key)[:m]


def prompt_gemm() -> bool:
    """Whether a mixed ``Linear`` multiplies a prompt's rows in one bf16 GEMM (``Linear._prompt``):
    where the CPU has bf16 matmul instructions (AVX512-BF16, AMX) and oneDNN runs them."""
    from ..core.hardware import has_bf16_matmul

    global _prompt_gemm
    if _prompt_gemm is None:
        _prompt_gemm = (has_bf16_matmul() and torch.backends.mkldnn.is_available()
                        and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return _prompt_gemm


_prompt_gemm: bool | None = None  # found once per process (tests set it to take either route)
_in_prefill = False


@contextmanager
def prefill(on: bool = True):
    """Inside it (``on``), mixed ``Linear``s may take many rows in one bf16 GEMM (``Linear._prompt``):
    for a prompt's forward, whose rows are never held to one-row decoding."""
    global _in_prefill
    was, _in_prefill = _in_prefill, on or _in_prefill
    try:
        yield
    finally:
        _in_prefill = was


def mixed_applies(model, windowed: bool) -> bool:
    """Whether ``model``'s fast path can hold its matrices in bf16 for the native bf16-weight kernel,
    fp32 around them (``fast_target.Decoder.mixed``): bf16 weights on a CPU where that kernel is
    built, and layers the native layer runs whole (Llama-shaped: no q/k norms, Gemma 3 or Granite
    extras, sliding windows), whose verification is then bitwise one-token decoding by construction.
    Other families keep the bf16 path, made exact by float64 attention and eval's start-up check."""
    from ..model.target import base_model

    w = model.get_output_embeddings().weight
    if windowed or w.dtype != torch.bfloat16 or not native.supports(w):
        return False
    return native_runs_whole(base_model(model))


def native_runs_whole(base) -> bool:
    """Whether ``native.NativeLayer`` runs every layer of ``base`` (an HF base model) whole: no q/k
    norms (Qwen3), no norms after the sublayers (Gemma 3), no residual or embedding multipliers
    (Granite). The fast path's native layers and its mixed mode both ask this."""
    return getattr(base, "embedding_multiplier", None) is None and all(
        getattr(lay.self_attn, "q_norm", None) is None and not hasattr(lay, "pre_feedforward_layernorm")
        and getattr(lay, "residual_multiplier", None) is None for lay in base.layers)


def serving_key(keys: tuple, m: int) -> int | str | None:
    """The packed copy an m-row call uses among ``keys``: MKL's for exactly m rows; else the native
    kernel up to its row limit (``NATIVE_ONE``: one row); else oneDNN's; else (m > 1) the smallest MKL
    one for more rows, the input padded; None: plain F.linear. One row is never padded up to a
    block: that costs what the block costs."""
    if m in keys:
        return m
    if (NATIVE in keys and m <= NATIVE_MAX_ROWS) or (NATIVE_ONE in keys and m == 1):
        return NATIVE
    if ONEDNN in keys:
        return ONEDNN
    return min((k for k in keys if isinstance(k, int) and k > m), default=None) if m > 1 else None
