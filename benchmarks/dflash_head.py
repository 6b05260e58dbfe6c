"""The LM head and loss of a DFlash training step: plain (logits, cross-entropy, autograd) against
``dflash_loss.HeadCrossEntropy`` (chunked, each row's gradient computed in the forward).

    python benchmarks/dflash_head.py                         # SmolLM2's shapes: 3,584 rows, 49,152 x 576
    python benchmarks/dflash_head.py --rows 3584 --vocab 151936 --hidden 896 --chunks 128,256,512
    python benchmarks/dflash_head.py --store runs/sg400b           # and whole training steps

A step of 512 blocks of 8 drafts 3,584 rows; each goes through the target's frozen head and a
cross-entropy against the target's argmax, then back to the draft. Forward + backward of that part
alone, on random weights of the target's shapes, the settings interleaved, one thread, median
CPU-seconds over --reps, and the largest gradient difference against the plain path (float
rounding only). With --store, then whole ``eagle3 train --draft-type dflash`` steps on that store
(the peer's recipe at 256 anchors, as benchmarks/peer_dflash.py runs it), plain and fused in
alternating runs of --steps steps on the same batches: the median CPU-seconds of a step after each
run's first, and the loss of each step (equal to float rounding). The CPU class is printed first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from muon_precision import dflash_steps
from train_throughput import SMOLLM2

from eagle3cli.core.hardware import cpu_class
from eagle3cli.train import dflash_loss
from eagle3cli.train.dflash_loss import HeadCrossEntropy


def plain_head(head, h, labels):
    return dflash_loss.plain_head_cross_entropy(head, h, labels)[1:]


def whole_steps(args) -> None:
    runs = {True: [], False: []}
    for _ in range(args.runs):
        for fused in (False, True):
            swap = None if fused else (dflash_loss, "head_cross_entropy", plain_head)
            runs[fused].append(dflash_steps(args.store, args.model, args.steps, swap=swap))
    cpu = {f: statistics.median(h["cpu_s"] for r in rs for h in r[1:]) for f, rs in runs.items()}
    print(f"\nWhole DFlash training steps ({args.runs} runs of {args.steps} steps each way, alternating; "
          f"median CPU-s of a step after each run's first):\n")
    print(f"plain {cpu[False]:.1f}   fused {cpu[True]:.1f}   plain / fused {cpu[False] / cpu[True]:.2f}x")
    print("losses, plain:", [round(h["loss"], 4) for h in runs[False][0]])
    print("losses, fused:", [round(h["loss"], 4) for h in runs[True][0]])


def step(kind, chunk, head_w, h0, labels, w):
    h = h0.clone().requires_grad_()
    t0 = time.process_time()
    if kind == "plain":
        logits = F.linear(h, head_w).float()
        ce = F.cross_entropy(logits, labels, reduction="none")
    else:
        ce, _ = HeadCrossEntropy.apply(h, head_w, labels, True, chunk)
    (w * ce).sum().backward()
    return time.process_time() - t0, h.grad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=3584)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--chunks", default="128,256,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--store", help="also time whole training steps on this store (DFlash's streams)")
    ap.add_argument("--model", default=str(SMOLLM2))
    ap.add_argument("--steps", type=int, default=5, help="steps per run with --store")
    ap.add_argument("--runs", type=int, default=2, help="runs each way with --store")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    head_w = torch.randn(args.vocab, args.hidden, generator=g) * 0.02
    h0 = torch.randn(args.rows, args.hidden, generator=g)
    labels = torch.randint(0, args.vocab, (args.rows,), generator=g)
    w = torch.rand(args.rows, generator=g)
    kinds = [("plain", 0)] + [("fused", int(c)) for c in args.chunks.split(",")]
    times = {k: [] for k in kinds}
    diff = {}
    for _ in range(args.reps):
        ref = None
        for k in kinds:
            dt, grad = step(*k, head_w, h0, labels, w)
            times[k].append(dt)
            ref = grad if ref is None else ref
            diff[k] = float((grad - ref).abs().max() / ref.abs().max())
    print(f"CPU: {cpu_class()}; torch {torch.__version__}; one thread; {args.rows} rows x head "
          f"{args.vocab} x {args.hidden}; forward + backward, median of {args.reps} (CPU-s)\n")
    print("| path | CPU-s | vs plain | max grad diff / max grad |")
    print("|---|---|---|---|")
    base = statistics.median(times[kinds[0]])
    for k in kinds:
        med = statistics.median(times[k])
        name = "plain" if k[0] == "plain" else f"fused, chunks of {k[1]}"
        print(f"| {name} | {med:.2f} | {base / med:.2f}x | {diff[k]:.1e} |")
    if args.store:
        whole_steps(args)


if __name__ == "__main__":
    main()
