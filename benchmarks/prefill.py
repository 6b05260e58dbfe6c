"""A bf16 target's prompt on the fast path: one bf16 GEMM per matrix against the native kernel's chunks.

    PYTHONPATH=. python benchmarks/prefill.py --model $SMOL [--lengths 16,64,160] [--rounds 7] [--threads 2]

A bf16 Llama-shaped target on the native kernels (``fast_target.Decoder.mixed``) multiplies a
prompt of more rows than the kernel serves either through one oneDNN bf16 GEMM per matrix (its rows
rounded to bf16; ``packing.Linear._prompt``, taken where the CPU multiplies bf16 in hardware) or
through the native kernel 16 rows at a time (each row computed as one row is, compute-bound on many
rows). This times a prefill of each length both ways and HF's own bf16 forward (``logits_to_keep=1``),
interleaved in each round, random token ids; medians of the rounds in ms, and the GEMM's last-row
logits against the chunks' (max |diff|, same argmax).
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
    ap.add_argument("--lengths", default="16,64,160", help="comma-separated prompt lengths")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from eagle3cli.core.hardware import cpu_class
    from eagle3cli.decode import packing
    from eagle3cli.decode.fast_target import FastTarget

    apply_target_args(args)
    lengths = [int(v) for v in args.lengths.split(",")]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    fast = FastTarget(model, max(lengths) + 1)
    if not fast.decoder.mixed:
        sys.exit("the fast path does not hold this target's matrices in bf16 here (no native bf16 kernels?)")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def prefill(ids, gemm: bool):
        packing._prompt_gemm = gemm
        return fast.forward(ids, torch.arange(ids.shape[0]), 0, logits="last")[0][-1]

    print(f"{args.model}: bf16 prefill, {args.threads} threads, {cpu_class()}, medians of {args.rounds} rounds, ms\n")
    print("| tokens | one bf16 GEMM | native chunks | HF bf16 forward | chunks / GEMM | max abs diff | same argmax |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(0, vocab, (n,), generator=gen)
            runs = {"gemm": lambda: prefill(ids, True), "chunks": lambda: prefill(ids, False),
                    "hf": lambda: model(ids[None], logits_to_keep=1)}
            times = {k: [] for k in runs}
            for r in range(args.rounds + 1):  # the first round warms each
                for k, fn in runs.items():
                    t0 = time.perf_counter()
                    fn()
                    if r:
                        times[k].append(time.perf_counter() - t0)
            a, b = prefill(ids, True), prefill(ids, False)
            med = {k: 1000 * statistics.median(v) for k, v in times.items()}
            print(f"| {n} | {med['gemm']:.1f} | {med['chunks']:.1f} | {med['hf']:.1f} | "
                  f"{med['chunks'] / med['gemm']:.2f} | {float((a - b).abs().max()):.3f} | "
                  f"{int(a.argmax()) == int(b.argmax())} |")
    packing._prompt_gemm = None


if __name__ == "__main__":
    main()
