"""Run an eagle3 command as if on a smaller CPU class: AVX2 only (no AVX-512, no bf16 instructions).

    python benchmarks/cpu_class.py avx2 -- quickstart --budget 20 --out runs/qs-avx2
    python benchmarks/cpu_class.py avx2 -- train --data STORE ...
    python benchmarks/cpu_class.py avx2 -- benchmarks/regen_throughput.py --model $SMOL ...   # a script

What it restricts, before torch is imported: ATen's vectorised kernels (ATEN_CPU_CAPABILITY),
oneDNN's ISA (ONEDNN_MAX_CPU_ISA) and MKL's (MKL_ENABLE_INSTRUCTIONS) to AVX2, and torch's CPU
feature probes (``torch.cpu._is_*_supported``, which eagle3 reads to choose bf16 regeneration,
bf16 training and the eval's bf16 fast path) to answer False for AVX-512, AVX512-BF16 and AMX.
So every choice eagle3 makes and every kernel it runs is the one an AVX2-only CPU gets; the clock,
caches and core count stay this machine's, so absolute times are an approximation of a real
AVX2-only machine (docs/benchmarks.md says which rows come from this emulation).
"""

from __future__ import annotations

import os
import sys

CLASSES = {
    "avx2": {"env": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
             "hidden": ("avx512", "vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
                        "avx512_fp16")},
}


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in CLASSES or "--" not in sys.argv:
        sys.exit(f"usage: python benchmarks/cpu_class.py {{{','.join(CLASSES)}}} -- EAGLE3_ARGS...")
    cls = CLASSES[sys.argv[1]]
    os.environ.update(cls["env"])
    import torch

    for feature in cls["hidden"]:
        if hasattr(torch.cpu, f"_is_{feature}_supported"):
            setattr(torch.cpu, f"_is_{feature}_supported", lambda: False)
    print(f"cpu class {sys.argv[1]}: {', '.join(f'{k}={v}' for k, v in cls['env'].items())}; torch reports "
          f"avx512_bf16={torch.cpu._is_avx512_bf16_supported()}, amx={torch.cpu._is_amx_tile_supported()}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    args = sys.argv[sys.argv.index("--") + 1:]
    if args and args[0].endswith(".py"):  # a benchmark script, run as its own __main__
        import runpy

        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")
        return
    from eagle3cli.cli import app

    app(args=args, prog_name="eagle3")


if __name__ == "__main__":
    main()
