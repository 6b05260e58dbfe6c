"""Weight-only integer matmuls for the lean draft step (``fast_draft``).

A drafting level reads every weight of the draft once for a handful of rows, right after the
target's forward has evicted them from the caches, so on a CPU its time is mostly the bytes of
its weights. Storing them as int8 (one scale per output row) or int4 (a scale and an offset per
group of 32 or 64 inputs) halves or quarters those bytes; torch's own weight-only kernels
(``torch._weight_int8pack_mm``, ``torch._weight_int4pack_mm_for_cpu``, what gpt-fast and torchao
run on CPUs) dequantise in registers. On SmolLM2's quickstart draft beside the bf16 target (2 AMX
Xeon cores), a 16-node tree drafts in 4.6 ms a cycle with int4 weights against 6.5 in bf16, a
chain of 3 in 2.6 against 4.4, at the same acceptance (``benchmarks/draft_paths.py``;
docs/benchmarks.md, "The speculative cycle and its overhead"). With fp32 inputs the same kernels
cost more than full weights: they are for bf16 draft steps.

Only the draft's proposals change (each weight moves by at most half a quantisation step); what
is accepted is still decided by the target, so decoding stays lossless. Training never sees
these: they are built from the draft's weights when a drafter is made.
"""

from __future__ import annotations

import torch

KINDS = ("int8", "int4")  # what --draft-weights accepts besides "full" and "auto"
INT4_GROUPS = (64, 32)  # the group sizes tried, larger first (fewer scales to read)


class QuantLinear:
    """y = x Ŵ^T for Ŵ the integer weight dequantised; no bias (the draft's matmuls have none).
    Built from ``source`` (the weight in the draft's own precision) for inputs in ``dtype`` (the
    step's compute dtype; default ``source``'s), which the scales and outputs are in. Only the
    integer weight is kept: no full-precision copy stays resident. Quacks like
    ``packing.Linear`` where ``FastDraft`` needs it: ``pack`` (nothing to pack: the integer
    layout is already the kernel's)."""

    kind = ""
    op = ""  # torch's kernel (an attribute of ``torch``)
    packed: dict = {}

    @classmethod
    def _kernel_takes(cls, source: torch.Tensor, dtype: torch.dtype | None) -> bool:
        """What both kernels need: a 2-D CPU weight, fp32/bf16 inputs, and a torch that has the kernel."""
        return (source.device.type == "cpu" and (dtype or source.dtype) in (torch.float32, torch.bfloat16)
                and source.dim() == 2 and hasattr(torch, cls.op))

    def pack(self, rows: tuple):
        pass

    def packed_for(self, m: int):
        return None

    def dequantized(self) -> torch.Tensor:
        """Ŵ [N, K] in ``dtype``: what the kernel multiplies by (for tests and reference paths)."""
        raise NotImplementedError


class Int8Linear(QuantLinear):
    """Symmetric int8 with one scale per output row: Ŵ = q * s, q in [-127, 127]."""

    kind, op = "int8", "_weight_int8pack_mm"

    @classmethod
    def fits(cls, source: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        # torch 2.13's CPU kernel crashes (not raises) when K is not a multiple of 16
        return cls._kernel_takes(source, dtype) and source.shape[1] % 16 == 0

    def __init__(self, source: torch.Tensor, dtype: torch.dtype | None = None):
        self.dtype = dtype or source.dtype
        w = source.detach().float()
        scale = w.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scale.to(self.dtype)

    def dequantized(self) -> torch.Tensor:
        return (self.q.float() * self.scales.float()[:, None]).to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.contiguous(), self.q, self.scales)


class Int4Linear(QuantLinear):
    """Asymmetric int4 in groups of ``group`` inputs: Ŵ = (q - 8) * s + z per group, q in [0, 15],
    stored in the packed layout of torch's CPU int4 kernel (N a multiple of 16)."""

    kind, op = "int4", "_weight_int4pack_mm_for_cpu"

    @classmethod
    def group_for(cls, source: torch.Tensor, dtype: torch.dtype | None = None) -> int | None:
        """The group size this weight takes (None: it does not fit the kernel here)."""
        if not cls._kernel_takes(source, dtype) or source.shape[0] % 16:
            return None
        return next((g for g in INT4_GROUPS if source.shape[1] % g == 0), None)

    @classmethod
    def fits(cls, source: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        return cls.group_for(source, dtype) is not None

    def __init__(self, source: torch.Tensor, dtype: torch.dtype | None = None):
        self.dtype = dtype or source.dtype
        self.group = self.group_for(source, dtype)
        w = source.detach().float()
        n, k = w.shape
        groups = w.reshape(n, k // self.group, self.group)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round((groups - lo) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
        # the kernel's convention: Ŵ = (q - 8) * scale + zero, so zero = lo + 8 * scale
        zero = lo + 8 * scale
        self.scale_zero = torch.stack([scale[..., 0], zero[..., 0]], -1).transpose(0, 1).contiguous().to(self.dtype)
        self.packed_q = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
        self._q = q.to(torch.uint8)  # kept for dequantized() only: a quarter of the bf16 bytes, never read per step

    def dequantized(self) -> torch.Tensor:
        n, k = self._q.shape
        sz = self.scale_zero.float()  # [k / group, n, 2]
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
        q = self._q.float().reshape(n, k // self.group, self.group)
        return ((q - 8) * scale + zero).reshape(n, k).to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed_q, self.group, self.scale_zero)


CLASSES = {"int8": Int8Linear, "int4": Int4Linear}


def quantize(source: torch.Tensor, kind: str, dtype: torch.dtype | None = None) -> QuantLinear | None:
    """``source`` as a ``kind`` linear for inputs in ``dtype``, or None where it does not fit that
    kernel here (it then stays full: a few odd shapes of a tiny model, or a torch without the kernel)."""
    cls = CLASSES[kind]
    return cls(source, dtype) if cls.fits(source, dtype) else None


def available(kind: str) -> bool:
    """Whether this torch has the CPU kernel for ``kind`` at all."""
    return hasattr(torch, CLASSES[kind].op)
