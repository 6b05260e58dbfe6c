"""DFlash against EAGLE-3 from the same store and the same CPU time (docs/benchmarks.md, "DFlash against EAGLE-3").

    python benchmarks/dflash_vs_eagle3.py --store runs/sg400b --model $SMOL --work runs/dfe \
        --minutes 4,30 --seeds 0 --num-prompts 10 --jobs 2
    python benchmarks/dflash_vs_eagle3.py ... --runs "ttt1=eagle3:--ttt-steps 1;ttt3=eagle3:--ttt-steps 3"

The store must hold both families' streams (`eagle3 gen-data ... --draft-type eagle3,dflash`).
Every run is `eagle3 train` at the package's defaults for its family plus the flags --runs gives it
(NAME=FAMILY:FLAGS, ';'-separated; default one run of each family at its defaults), one thread,
--max-minutes M: the trainer fits its steps to the time, so both
families get the same wall time on one core each (the table also prints the CPU seconds the
training loop used). Scores: held-out per-position acceptance from the trainer's validation split
(the same conversations for both), its simulated tau, and tau and speedup from `eagle3 eval` on
the first --num-prompts mt_bench prompts (both turns, --new-tokens each): our lossless generator,
the chain length (EAGLE-3) or block prefix (DFlash) chosen by --tree auto, the speedup against
the faster of our plain decoders. Each run's result is kept as JSON in --work, so a rerun only
does what is new.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

EAGLE3 = str(Path(sys.executable).parent / "eagle3")


def run(cmd: list[str], log: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "EAGLE3_THREADS": "1"}
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed (rc {rc}): see {log}")


def parse_runs(text: str) -> dict[str, tuple[str, list[str]]]:
    """"NAME=FAMILY:FLAGS;..." -> {name: (family, flags)}."""
    runs = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, rest = item.split("=", 1)
        family, _, flags = rest.partition(":")
        runs[name.strip()] = (family.strip(), flags.split())
    return runs


def one(args, name: str, minutes: float, seed: int) -> dict:
    family, extra = args.runs[name]
    out = Path(args.work) / f"{name}-{minutes:g}m-s{seed}"
    done = out / "bench.json"
    if done.exists():
        return json.loads(done.read_text())
    if not (out / "train_summary.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        run([EAGLE3, "train", "--store", args.store, "--model", args.model, "--out", str(out / "draft"),
             "--draft-type", family, "--max-minutes", str(minutes), "--epochs", "100", "--seed", str(seed),
             "--val-fraction", "0.1", "--max-tokens", str(args.tokens), *extra], out / "train.log")
        (out / "train_summary.json").write_text((out / "draft" / "train_summary.json").read_text())
    summary = json.loads((out / "train_summary.json").read_text())
    logs = [json.loads(line) for line in (out / "draft" / "train_log.jsonl").read_text().splitlines() if line.strip()]
    cpu = sum(r.get("cpu_s", 0.0) for r in logs if "loss" in r)
    run([EAGLE3, "eval", "--model", args.model, "--draft", str(out / "draft"), "--task", "mt_bench",
         "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.new_tokens), "--tree", "auto",
         "--out", str(out / "eval")], out / "eval.log")
    res = json.loads((out / "eval" / "results.json").read_text())
    row = {"run": name, "family": family, "flags": " ".join(extra), "minutes": minutes, "seed": seed,
           "steps": summary.get("steps"), "cpu_s": cpu,
           "acc": summary.get("val_acc") or summary.get("acc"), "tau_sim": summary.get("tau_sim"),
           "eval": summarise(res)}
    done.write_text(json.dumps(row, indent=1))
    return row


def summarise(res: dict) -> dict:
    """tau, speedup (against the fastest plain decoder eval ran), lossless and the tree from results.json."""
    task = next(iter(res["tasks"].values()))
    st = res["settings"]
    shape = (f"chain {st['steps']}" if st["mode"] == "chain" else
             f"{st['total_tokens']} nodes, depth {st['depth']}, top-{st['top_k']}")
    return {"tau": task["tau"], "speedup": task["speedup"], "lossless": task["lossless"], "tree": shape,
            "baseline_from": task.get("baseline_from"), "tokens_per_s": task["tokens_per_s"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--minutes", default="4,30", help="training budgets (wall minutes on one core each)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--runs", default="eagle3=eagle3:;dflash=dflash:", help="NAME=FAMILY:FLAGS;...")
    p.add_argument("--tokens", type=int, default=1024, help="--max-tokens of every run")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--jobs", type=int, default=1)
    args = p.parse_args(argv)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    args.runs = parse_runs(args.runs)
    grid = [(n, float(m), int(s)) for m in args.minutes.split(",") for s in args.seeds.split(",") for n in args.runs]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda g: one(args, *g), grid))
    print("| run | flags | minutes | seed | steps | train CPU s | held-out acc per position | tau (sim) | tau | "
          "speedup | verified |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = " / ".join(f"{a:.3f}" for a in (r["acc"] or []))
        ev = r["eval"]
        print(f"| {r['run']} ({r['family']}) | {r['flags']} | {r['minutes']:g} | {r['seed']} | {r['steps']} | "
              f"{r['cpu_s']:.0f} | {acc} | {r['tau_sim'] or float('nan'):.3f} | {ev['tau'] or float('nan'):.3f} | "
              f"{ev['speedup'] or float('nan'):.2f} | {ev['tree']} |")
    (Path(args.work) / "table.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
