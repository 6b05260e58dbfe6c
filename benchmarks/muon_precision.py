"""Muon's Newton-Schulz iteration in bf16 (torch's) against fp32 (eagle3's on a CPU without native
bf16): the iteration alone, then whole DFlash training steps.

    python benchmarks/muon_precision.py --store runs/sg400b          # a store with DFlash's streams
    python benchmarks/muon_precision.py --store runs/sg400b --steps 0   # the iteration only

1. The iteration over the Muon matrices of a DFlash draft of the store's target (block 8, one
   layer by default), bf16 and fp32 interleaved, median over --reps: seconds per optimizer step.
2. ``eagle3 train --draft-type dflash --optimizer muon`` for --steps steps on the store (the peer's
   recipe: 256 anchors, weight decay 0.1, clip 1.0), once with each dtype (the same batches and
   anchors): the median CPU-seconds of a step after the first, and each step's loss, which differ
   only by the iteration's rounding (the first step's is equal: no update has happened yet).

One thread; the CPU class is printed first. fp32 is the default where bf16 is emulated
(``optim.newton_schulz_dtype``); the bf16 arm forces torch's dtype.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from train_throughput import SMOLLM2

from eagle3cli.config.train_config import TrainConfig
from eagle3cli.core.hardware import cpu_class
from eagle3cli.train import optim
from eagle3cli.train.trainer import Trainer, train

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def config(store: str, model: str, out: Path, steps: int, draft_layers: int = 1) -> TrainConfig:
    """A DFlash run of blocks of 8 on the peer's recipe at 256 anchors, as benchmarks/peer_dflash.py trains it."""
    return TrainConfig(data=store, model=model, out=str(out), draft_type="dflash", block_size=8,
                       draft_layers=draft_layers, num_anchors=256, optimizer="muon", weight_decay=0.1,
                       grad_clip=1.0, warmup_ratio=0.01, max_tokens=1024, max_length=512, max_steps=steps,
                       epochs=1000, val_fraction=0.1, log_every=1, save_every=10 ** 9, eval_every=0, seed=2)


def dflash_steps(store: str, model: str, steps: int, draft_layers: int = 1, swap=None) -> list[dict]:
    """The step records of a short ``config`` run; ``swap`` = (module, name, value) replaces that
    attribute for the run (the other arm of a comparison)."""
    if swap is not None:
        module, name, value = swap
        default = getattr(module, name)
        setattr(module, name, value)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return [h for h in train(config(store, model, Path(tmp), steps, draft_layers), quiet=True).history
                    if "cpu_s" in h]
    finally:
        if swap is not None:
            setattr(module, name, default)


def draft_matrices(args) -> list[torch.Size]:
    """The shapes Muon orthogonalises each step, read off the very draft the trainer sets up."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer(config(args.store, args.model, Path(tmp), 1, args.draft_layers), quiet=True)
        t.setup()
    return [p.shape for n, p in t.draft.named_parameters() if p.requires_grad and optim.muon_weight(n, p)]


def time_iteration(shapes, reps: int) -> dict[str, float]:
    coef = torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))]).defaults["ns_coefficients"]
    grads = [torch.randn(s) for s in shapes]
    times = {k: [] for k in DTYPES}
    for _ in range(reps):
        for name, dtype in DTYPES.items():
            t0 = time.process_time()
            for g in grads:
                optim.orthogonalise(g, coef, 5, 1e-7, dtype)
            times[name].append(time.process_time() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="gen-data store with DFlash's streams")
    ap.add_argument("--model", default=str(SMOLLM2))
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="training steps per dtype (0: the iteration only)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_class()}; torch {torch.__version__}; one thread")
    shapes = draft_matrices(args)
    it = time_iteration(shapes, args.reps)
    print(f"\nNewton-Schulz over the draft's {len(shapes)} Muon matrices ({', '.join(map(str, map(tuple, shapes)))}), "
          f"CPU-s per optimizer step, median of {args.reps}:")
    print(f"  bf16 {it['bf16']:.3f}   fp32 {it['fp32']:.3f}   bf16 / fp32 {it['bf16'] / it['fp32']:.2f}x")
    if not args.steps:
        return
    runs = {name: dflash_steps(args.store, args.model, args.steps, args.draft_layers,
                               (optim, "newton_schulz_dtype", lambda device, d=dtype: d))
            for name, dtype in DTYPES.items()}
    print("\nDFlash training steps (peer recipe, 256 anchors, 1,024 tokens a step), CPU-s per step:")
    print("| step | bf16 CPU-s | fp32 CPU-s | bf16 loss | fp32 loss |")
    print("|---|---|---|---|---|")
    for a, b in zip(runs["bf16"], runs["fp32"]):
        print(f"| {a['step']} | {a['cpu_s']:.1f} | {b['cpu_s']:.1f} | {a['loss']:.4f} | {b['loss']:.4f} |")
    med = {k: statistics.median(h["cpu_s"] for h in v[1:]) for k, v in runs.items()}
    print(f"\nmedian CPU-s per step after the first: bf16 {med['bf16']:.1f}, fp32 {med['fp32']:.1f}, "
          f"bf16 / fp32 {med['bf16'] / med['fp32']:.2f}x")


if __name__ == "__main__":
    main()
