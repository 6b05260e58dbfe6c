"""--optimizer adamw against muon on the same store, batches and steps: speed and held-out accuracy.

    python benchmarks/optimizer_compare.py                      # builds a SmolLM2 GSM8K store first
    python benchmarks/optimizer_compare.py --data STORE --model TARGET --steps 60 --eval-every 30

Each optimizer trains the same optimizer steps over the same batches (same seed), so both have
seen the same tokens when they are compared. Prints per optimizer: tokens/s (median over the
counted steps), tokens per CPU-second (the fair speed measure on shared cores), CPU-minutes, the
mean loss of the last 5 steps, held-out acc_0..acc_2 and simulated tau after the run, and with
--eval-every the measured chain-3 tau (the draft decoding held-out prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from train_throughput import SMOLLM2, build_store

from eagle3cli.config.train_config import TrainConfig
from eagle3cli.train.trainer import train


def run(optimizer: str, args, data: str, out: Path) -> dict:
    cfg = TrainConfig(data=data, model=args.model, out=str(out), optimizer=optimizer, ttt_steps=args.ttt_steps,
                      max_steps=args.steps, epochs=1000, max_tokens=args.max_tokens, lr=args.lr,
                      draft_vocab_size=args.draft_vocab_size, val_fraction=args.val_fraction, log_every=1,
                      save_every=10**9, eval_every=args.eval_every, allow_incomplete=True, warmup_ratio=0.05)
    res = train(cfg, quiet=True)
    recs = [h for h in res.history if "acc" in h]
    counted = recs[args.skip:]
    measured = [h["measured"]["tau"] for h in res.history if "measured" in h]
    return {"optimizer": optimizer, "steps": res.step, "tokens": sum(h["tokens"] for h in recs),
            "tokens_per_s": statistics.median(h["tokens_per_s"] for h in counted),
            "tokens_per_cpu_s": sum(h["tokens"] for h in counted) / sum(h["cpu_s"] for h in counted),
            "cpu_min": sum(h["cpu_s"] for h in recs) / 60,
            "last5_loss": statistics.fmean(h["loss"] for h in recs[-5:]),
            "held_out_acc": res.metrics["acc"], "tau_sim": res.metrics.get("tau_sim"),
            "tau_measured": measured}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="feature store (default: build one from --model and GSM8K)")
    ap.add_argument("--model", default=str(SMOLLM2), help="target model folder")
    ap.add_argument("--conversations", type=int, default=300, help="size of the store built without --data")
    ap.add_argument("--optimizers", default="adamw,muon")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps not counted in the speed")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-vocab-size", default="8192")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=0, help="also measure chain-3 tau every N steps and at the end")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(build_store(Path(args.model), Path(tmp) / "store", args.conversations))
        rows = [run(o, args, data, Path(tmp) / f"run-{o}") for o in args.optimizers.split(",")]
    print(f"{'optimizer':>9} {'steps':>5} {'tokens':>7} {'tok/s':>7} {'tok/cpu-s':>9} {'cpu-min':>7} "
          f"{'loss(last5)':>11}  held-out acc_0..2   tau_sim  tau_measured")
    for r in rows:
        acc = " ".join(f"{a:.3f}" for a in r["held_out_acc"])
        meas = " ".join(f"{t:.3f}" for t in r["tau_measured"]) or "-"
        print(f"{r['optimizer']:>9} {r['steps']:>5} {r['tokens']:>7} {r['tokens_per_s']:>7.1f} "
              f"{r['tokens_per_cpu_s']:>9.1f} {r['cpu_min']:>7.2f} {r['last5_loss']:>11.4f}  {acc:<18} "
              f"{r['tau_sim'] or 0:>7.3f}  {meas}")
    print(json.dumps({"rows": rows, "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
