"""What this machine's CPU can do, from torch's own probes (``torch.cpu._is_<feature>_supported``).

Training (bf16 autocast), regeneration (bf16 matmuls), eval (the bf16 fast path) and the
quickstart's plan all choose by these answers, so they are asked in one place; a run restricted
to a smaller CPU class (benchmarks/cpu_class.py) patches the torch probes, and every choice
follows.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_has(feature: str) -> bool:
    """torch's own probe ``torch.cpu._is_<feature>_supported`` (False where this torch lacks it)."""
    probe = getattr(torch.cpu, f"_is_{feature}_supported", None)
    return bool(probe is not None and probe())


def has_amx_bf16() -> bool:
    """Whether this CPU has Intel's AMX tiles, where bf16 matmuls of 1-16 rows cost about one row's."""
    return cpu_has("amx_tile")


def has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16, which every AMX-BF16 CPU also has):
    oneDNN then runs torch's bf16 matmuls in hardware instead of converting to fp32."""
    return cpu_has("avx512_bf16")


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16 dot products), where
    bf16 matmuls and training steps run faster than fp32 (docs/benchmarks.md, "Training throughput");
    elsewhere oneDNN emulates bf16 and it is slower than fp32."""
    return cpu_has("amx_tile") or cpu_has("avx512_bf16")


def cpu_class() -> str:
    """The widest instruction class this CPU has, by name (AMX, AVX512-BF16, AVX-512, AVX2)."""
    for name, feature in (("AMX", "amx_tile"), ("AVX512-BF16", "avx512_bf16"), ("AVX-512", "avx512"),
                          ("AVX2", "avx2")):
        if cpu_has(feature):
            return name
    return "no AVX2"


def describe() -> str:
    """One line naming the device results were measured on: the GPU, or the CPU's model name."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"
