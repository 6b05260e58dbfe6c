"""Where a native decoding step's time goes, stage by stage, as the row count grows.

    PYTHONPATH=. python benchmarks/layer_stages.py --model $SMOL [--rows 1,2,3,4] [--march native,haswell] \\
        [--rounds 7] [--threads 2] [--prefix 120] [--dtype bfloat16]

A verification of n rows should cost about what one row's step costs (the weights are read once
for all of them); what grows with the rows is the arithmetic and the per-row work (norms,
attention, silu). This builds the native kernels (``decode.native``'s source) once per --march with
-DEAGLE3_STAGES, where ``eagle3_layer`` adds each stage's wall time to a counter, and runs the fast
path's whole forward of n new tokens behind a --prefix-token prefix on it (``FastTarget.forward``:
native layers, the LM head over the whole vocabulary), every build and row count interleaved in
each round, one step after another as decoding runs them (no cache eviction in between).
Medians over the rounds, in ms a step, summed over the layers: the norms, the q|k|v, o, gate|up and
down matmuls, attention (RoPE and the cache write included), silu * up; the LM head (timed around
its call); the rest of the forward (the embedding, the final norm, Python and ctypes around 31
calls). x 1 row: the median per-round ratio of the step to the same build's first row count.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_args import add_target_args, apply_target_args  # noqa: E402
from eagle3cli.decode import native  # noqa: E402
from eagle3cli.decode.fast_target import NATIVE, ONEDNN, FastTarget  # noqa: E402
from eagle3cli.decode.native_source import SOURCE  # noqa: E402

STAGES = ("norms", "qkv", "attention", "o", "gate_up", "silu", "down")


def build(march: str, out: Path, bf16: bool = False) -> ctypes.CDLL:
    """The kernels for ``march`` (``bf16``: the bf16-weight build) with the stage counters, compiled as
    ``native`` compiles them."""
    cc = native._compiler()
    if cc is None:
        sys.exit("no C compiler (set CC)")
    name = f"stages-{march}{'-bf16' if bf16 else ''}"
    src = out / f"{name}.c"
    src.write_text(SOURCE)
    lib = out / f"{name}.so"
    gomp = native._torch_gomp()
    link = [f"-L{gomp.parent}", f"-Wl,-rpath,{gomp.parent}"] if gomp is not None else []
    subprocess.run([cc, *native._flags(march, bf16), "-DEAGLE3_STAGES", "-o", str(lib), str(src), *link, "-lm"],
                   check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(lib))


class Timed:
    """A callable timed around each call (the LM head's matmul)."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_target_args(ap)
    ap.add_argument("--rows", default="1,2,3,4", help="comma-separated row counts (the first is the base)")
    ap.add_argument("--march", default="native,haswell", help="comma-separated -march values, one build each")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefix", type=int, default=120)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: the target in bf16, its matrices in the bf16-weight build (eval's on AMX)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    apply_target_args(args)
    rows = [int(v) for v in args.rows.split(",")]
    marches = args.march.split(",")
    bf16 = args.dtype == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    tmp = tempfile.TemporaryDirectory()
    counters = {}
    for m in marches:  # each build under its own key, so that native.use switches every call to it
        lib = build(m, Path(tmp.name))
        native._builds[f"{m}+stages"] = (*native.bind(lib, m), f"-march={m}, -DEAGLE3_STAGES")
        if bf16:  # the layers run the bf16-weight build: its counters are the ones to read
            lib = build(m, Path(tmp.name), bf16=True)
            native._bf16_builds[f"{m}+stages"] = (*native.bind(lib, m), f"-march={m}, -DEAGLE3_STAGES, bf16")
        counters[m] = (ctypes.c_double * len(STAGES)).in_dll(lib, "eagle3_stage_s")
    native.use(f"{marches[0]}+stages")
    fast = FastTarget(model, args.prefix + max(rows) + 1)
    fast.decoder.repack((NATIVE, ONEDNN))
    head = fast.head = Timed(fast.head)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        fast.forward(torch.randint(0, vocab, (args.prefix,), generator=gen), torch.arange(args.prefix), 0)
        steps = {n: (torch.randint(0, vocab, (n,), generator=gen), torch.arange(args.prefix, args.prefix + n))
                 for n in rows}
        times = {(m, n): [] for m in marches for n in rows}
        for r in range(args.rounds + 1):  # the first round warms each build
            for m in marches:
                native.use(f"{m}+stages")
                for n in rows:
                    ids, pos = steps[n]
                    for i in range(len(STAGES)):
                        counters[m][i] = 0.0
                    head.seconds = 0.0
                    t0 = time.perf_counter()
                    fast.forward(ids, pos, args.prefix)
                    total = time.perf_counter() - t0
                    stages = list(counters[m])
                    if r:
                        times[m, n].append(stages + [head.seconds, total - sum(stages) - head.seconds, total])
    native.use()
    print(f"{args.model}: native step of n rows behind {args.prefix} tokens, {args.threads} threads, "
          f"medians of {args.rounds} rounds (builds and row counts interleaved), ms a step\n")
    cols = [*STAGES, "LM head", "rest", "step"]
    print("| build | rows | " + " | ".join(cols) + " | x 1 row |\n|" + "---|" * (len(cols) + 3))
    for m in marches:
        for n in rows:
            ts, base = times[m, n], times[m, rows[0]]
            med = [1000 * statistics.median(c) for c in zip(*ts)]
            ratio = statistics.median(a[-1] / b[-1] for a, b in zip(ts, base))
            print(f"| -march={m} | {n} | " + " | ".join(f"{v:.2f}" for v in med) + f" | {ratio:.3f} |")


if __name__ == "__main__":
    main()
