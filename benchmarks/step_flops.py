"""A training step's FLOPs and the machine's matmul peak at that step's own GEMM shapes.

    flops, gemms = count_step(fn)        # fn runs one step (forward, backward, optimizer)
    peak = matmul_peak(gemms, device)    # {dtype: {"flop_s", "seconds", "flops"}}, fp32 and bf16

``count_step`` counts with torch.utils.flop_counter.FlopCounterMode (matmuls and attention; the
CPU flash-attention kernels, which torch 2.13 does not count, are given torch's own SDPA formulas
here), and records every GEMM the step dispatches (mm, addmm, bmm, baddbmm) by shape and dtype.
``matmul_peak`` times torch.matmul at each distinct shape (median of ``repeats``) and adds the
times up, each shape as often as the step runs it: the time the step's GEMMs alone would take at
the rate this machine reaches on those shapes, so achieved / peak says how much of the step is
not matmul throughput. On a CPU the times are CPU-seconds of this process (time.process_time):
other jobs on shared cores stretch wall time but not that, and the trainer logs cpu_s for the
same reason. Used by train_throughput.py and gpu_suite.py.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

aten = torch.ops.aten
GEMMS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm", aten.baddbmm.default: "baddbmm"}

def _gqa_tolerant(count):
    """torch's SDPA formulas (2.11 at least) assert that key and value have the query's head count;
    a grouped-query model's attention costs what it would with k and v repeated to that count."""

    @functools.wraps(count)
    def wrapped(*shapes):
        *lead, q, k, v = shapes
        heads = q[1]
        return count(*lead, q, (k[0], heads, *k[2:]), (v[0], heads, *v[2:]))

    return wrapped


# the registered formulas look these names up at call time
flop_counter.sdpa_flop_count = _gqa_tolerant(sdpa_flop_count)
flop_counter.sdpa_backward_flop_count = _gqa_tolerant(sdpa_backward_flop_count)

if aten._scaled_dot_product_flash_attention_for_cpu not in flop_registry:
    @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
    def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _cpu_sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                           **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


class GemmRecorder(TorchDispatchMode):
    """Counts each GEMM as (batch, m, k, n, dtype)."""

    def __init__(self):
        super().__init__()
        self.shapes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = GEMMS.get(func)
        if kind is not None:
            a, b = (args[1], args[2]) if kind in ("addmm", "baddbmm") else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            self.shapes[(batch, a.shape[-2], a.shape[-1], b.shape[-1], a.dtype)] += 1
        return func(*args, **(kwargs or {}))


def gemm_flops(gemms: Counter) -> int:
    return sum(2 * bt * m * k * n * c for (bt, m, k, n, _), c in gemms.items())


def count_step(fn) -> tuple[int, Counter]:
    """(total FLOPs, GEMM shape counts) of one call of ``fn``."""
    rec = GemmRecorder()
    with FlopCounterMode(display=False) as fc, rec:
        fn()
    return fc.get_total_flops(), rec.shapes


def _clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


@functools.lru_cache(maxsize=None)
def matmul_seconds(batch: int, m: int, k: int, n: int, dtype, device, repeats: int = 5) -> float:
    """Median seconds of one torch.matmul of this shape in ``dtype`` (CPU-seconds on a CPU);
    remembered, so settings that share shapes time each once."""
    g = torch.Generator().manual_seed(0)
    shape_a, shape_b = ((batch, m, k), (batch, k, n)) if batch > 1 else ((m, k), (k, n))
    a = torch.randn(shape_a, generator=g).to(device, dtype)
    b = torch.randn(shape_b, generator=g).to(device, dtype)
    for _ in range(2):  # warm-up: kernel selection, packing buffers
        torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        t0 = _clock(device)
        torch.matmul(a, b)
        times.append(_clock(device) - t0)
    return statistics.median(times)


def matmul_peak(gemms: Counter, device, dtypes=(torch.float32, torch.bfloat16), repeats: int = 5) -> dict:
    """Per dtype: the step's GEMM FLOPs, the seconds torch.matmul takes for all of them at their
    shapes in that dtype, and the rate that makes (FLOP/s)."""
    shapes = Counter()
    for (bt, m, k, n, _), c in gemms.items():
        shapes[(bt, m, k, n)] += c
    flops = sum(2 * bt * m * k * n * c for (bt, m, k, n), c in shapes.items())
    out = {}
    for dt in dtypes:
        seconds = sum(c * matmul_seconds(bt, m, k, n, dt, device, repeats) for (bt, m, k, n), c in shapes.items())
        out[str(dt).removeprefix("torch.")] = {"flops": flops, "seconds": seconds,
                                               "flop_s": flops / seconds if seconds else float("nan")}
    return out


def describe(flops_per_token: float, gemm_share: float, peak: dict, achieved: dict[str, float]) -> list[str]:
    """Lines for a report: the step's FLOPs, the peak per dtype, and each setting's achieved share."""
    lines = [f"step: {flops_per_token / 1e6:,.1f} MFLOP per token ({100 * gemm_share:.0f}% of it in GEMMs)"]
    lines.append("matmul peak at the step's GEMM shapes: " + ", ".join(
        f"{dt} {p['flop_s'] / 1e9:,.1f} GFLOP/s" for dt, p in peak.items()))
    for name, rate in achieved.items():
        shares = ", ".join(f"{100 * rate / p['flop_s']:.0f}% of the {dt} peak" for dt, p in peak.items())
        lines.append(f"{name}: achieved {rate / 1e9:,.1f} GFLOP/s ({shares})")
    return lines
