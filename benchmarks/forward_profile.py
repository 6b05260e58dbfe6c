"""Where one fast-path forward's time goes: matmuls, attention, everything else, by new-token count.

    PYTHONPATH=. python benchmarks/forward_profile.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct \
        --threads 2 --packing onednn --sizes 1,8,16 [--hints none,4,8,16]

Runs ``fast_target.FastTarget.forward`` of n new tokens after a prefix under torch.profiler and
splits its self CPU time into the prepacked matmuls (MKL or oneDNN), scaled-dot-product attention,
and the rest (norms, RoPE, cache writes, Python-level ops). ``--hints`` instead times whole
forwards (no profiler) with oneDNN's weights reordered for each batch-size hint, interleaved over
3 rounds, every ratio against the fastest one-token forward of any hint.
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3cli.decode.fast_target import ONEDNN, FastTarget
from eagle3cli.model.target import TargetSpec, load_target

MATMUL_OPS = ("mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::mm", "aten::addmm")


def profile_split(fast, ids, prefix: int, n: int, repeats: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    new, pos = ids[-n:], torch.arange(prefix, prefix + n)
    for _ in range(3):
        fast.forward(new, pos, prefix)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fast.forward(new, pos, prefix)
    split = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for ev in prof.key_averages():
        kind = "matmul" if ev.key in MATMUL_OPS else "attention" if "scaled_dot_product" in ev.key else "other"
        split[kind] += ev.self_cpu_time_total / 1000 / repeats
    return split


def hint_table(fast, ids, prefix: int, sizes, hints, repeats: int) -> dict:
    def ms(n):
        new, pos = ids[-n:], torch.arange(prefix, prefix + n)
        fast.forward(new, pos, prefix)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fast.forward(new, pos, prefix)
            ts.append(time.perf_counter() - t0)
        return 1000 * sorted(ts)[len(ts) // 2]

    runs: dict = {}
    for _ in range(3):
        for hint in hints:
            for lin in fast.decoder.linears():
                lin.packed = {ONEDNN: torch.ops.mkldnn._reorder_linear_weight(lin.weight, hint)}
            for n in sizes:
                runs.setdefault((hint, n), []).append(ms(n))
    return {k: sorted(v)[len(v) // 2] for k, v in runs.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--sizes", default="1,8,16")
    ap.add_argument("--packing", default="onednn", help="onednn, mkl (packed for each size) or none")
    ap.add_argument("--hints", default="", help="oneDNN batch-size hints to compare, e.g. none,4,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = tuple(int(x) for x in args.sizes.split(","))
    target = load_target(TargetSpec(args.model))
    fast = FastTarget(target, args.prefix + max(sizes) + 1)
    ids = torch.randint(100, target.config.vocab_size - 1, (args.prefix,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast.forward(ids, torch.arange(args.prefix), 0, logits="last")
        if args.hints:
            hints = [None if h == "none" else int(h) for h in args.hints.split(",")]
            med = hint_table(fast, ids, args.prefix, sizes, hints, 11)
            one = min(med[(h, 1)] for h in hints) if 1 in sizes else None
            for h in hints:
                cells = [f"{n}: {med[(h, n)]:.1f} ms" + (f" ({med[(h, n)] / one:.2f}x)" if one else "") for n in sizes]
                print(f"hint {h}: " + "  ".join(cells))
            return
        print(f"{'tokens':>6} {'total ms':>9} {'matmul':>8} {'attention':>10} {'other':>7}  (packing {args.packing})")
        for n in sizes:
            fast.decoder.repack({"onednn": (ONEDNN,), "mkl": (n,), "none": ()}[args.packing])
            s = profile_split(fast, ids, args.prefix, n, args.repeats)
            print(f"{n:>6} {sum(s.values()):9.1f} {s['matmul']:8.1f} {s['attention']:10.1f} {s['other']:7.1f}")


if __name__ == "__main__":
    main()
