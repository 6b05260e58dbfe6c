"""gen-data's feature capture on a CPU: tokens/s by the padded tokens a forward takes and the dtype.

    PYTHONPATH=. python benchmarks/capture_rate.py --model $SMOL [--budgets 1024,2048,4096,16384]
        [--dtypes float32,bfloat16] [--samples 100] [--rounds 3] [--threads 2]

Runs ``data.samples.capture_samples`` (length-sorted micro-batches of at most BUDGET padded tokens,
right padding, the three streams concatenated) over the same random samples, their lengths drawn
like a regenerated ShareGPT shard's (60 to 480 tokens), for each dtype the target is loaded in and
each budget, interleaved in each round; prints the median tokens/s and each cell's ratio to the
old default (fp32, 16,384 tokens a forward). The default capture takes ``capture_budget`` (2,048 on
a CPU) and ``--capture-dtype auto`` (bf16 for an fp32 target where the CPU multiplies bf16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_args import add_target_args, apply_target_args  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_target_args(ap)
    ap.add_argument("--budgets", default="1024,2048,4096,16384")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from eagle3cli.core.hardware import cpu_class
    from eagle3cli.data.samples import capture_samples
    from eagle3cli.model.layers import choose_layers

    apply_target_args(args)
    budgets = [int(b) for b in args.budgets.split(",")]
    dtypes = args.dtypes.split(",")
    models = {d: AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, d)).eval() for d in dtypes}
    layers = choose_layers(next(iter(models.values())).config, warn=False).ids
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(60, 481, (args.samples,), generator=gen).tolist()
    vocab = next(iter(models.values())).config.vocab_size
    samples = [{"input_ids": torch.randint(3, vocab, (n,), generator=gen).tolist()} for n in lengths]
    tokens = sum(lengths)
    cells = [(d, b) for d in dtypes for b in budgets]
    times = {c: [] for c in cells}
    with torch.inference_mode():
        capture_samples(models[dtypes[0]], samples[:4], layers, budgets[0])  # warm-up
        for _ in range(args.rounds):
            for d, b in cells:
                t0 = time.perf_counter()
                capture_samples(models[d], [dict(s) for s in samples], layers, b)
                times[(d, b)].append(time.perf_counter() - t0)
    rate = {c: tokens / statistics.median(v) for c, v in times.items()}
    base = rate.get(("float32", 16384))
    print(f"{args.model}: capture_samples over {args.samples} samples ({tokens:,} tokens), {args.threads} threads, "
          f"{cpu_class()}, medians of {args.rounds} rounds\n")
    print("| dtype | tokens a forward | tokens/s | vs fp32 at 16,384 |")
    print("|---|---|---|---|")
    for d, b in cells:
        ratio = f"{rate[(d, b)] / base:.2f}x" if base else "-"
        print(f"| {d} | {b:,} | {rate[(d, b)]:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
