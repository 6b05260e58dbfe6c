"""EAGLE-3's scaling law at small scale: the same trainer on 1x, 2x, 4x, 8x regenerated data.

    eagle3 gen-data -m ~/.cache/eagle3/models/SmolLM2-135M-Instruct \\
        --dataset ~/.cache/eagle3/data/sharegpt_v3.jsonl -o runs/scale/store --max-samples 800 \\
        --shuffle --seed 3 --max-new-tokens 128 --max-length 512 --batch-size 32 --shard-size 100
    python benchmarks/scaling_curve.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct \\
        --store runs/scale/store --shards 1,2,4,8 --epochs 2 --out runs/scale \\
        --questions eagle3cli/prompts/mt_bench.jsonl --every 5 --max-new-tokens 64

For each size k the first k shards of one store (the same regenerated conversations, so the
smaller sets are prefixes of the larger) are linked into a sub-store, a draft is trained
for the same number of epochs with the same settings, and ``eagle3 eval`` measures chain-3
tau (and, with ``--tree-for``, EAGLE-2 tree tau) on a fixed subset of mt_bench first turns
(every ``--every``-th question, so every category is in). Prints a markdown table and writes
``scaling.png`` and ``scaling.json`` into ``--out``. Runs are sequential: one heavy job at a time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

TRAIN = ["--lr", "3e-3", "--ttt-steps", "3", "--eval-ttt-steps", "7", "--max-tokens", "1024",
         "--draft-vocab-size", "8192"]


def sub_store(store: Path, k: int, dst: Path) -> Path:
    """A store of the first k shards of ``store`` (links, manifest copied; trained with --allow-incomplete)."""
    if dst.exists():
        shutil.rmtree(dst)
    (dst / "shards").mkdir(parents=True)
    shutil.copy(store / "manifest.json", dst / "manifest.json")
    sidecars = sorted((store / "shards").glob("shard-*.json"))[:k]
    if len(sidecars) < k:
        sys.exit(f"{store} has {len(sidecars)} finished shards; {k} asked")
    for side in sidecars:
        for f in (side, side.with_suffix(".safetensors")):
            (dst / "shards" / f.name).symlink_to(f.resolve())
    return dst


def questions_file(src: Path, every: int, dst: Path) -> int:
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()][::every]
    dst.write_text("".join(json.dumps({**r, "turns": r["turns"][:1]}) + "\n" for r in rows))
    return len(rows)


def run(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"failed ({rc}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - t0


def evaluate(model: str, draft: Path, questions: Path, mode: list[str], out: Path, max_new: int, log: Path) -> dict:
    run(["eagle3", "eval", "-m", model, "-d", str(draft), "--task", "mt_bench", "--prompts", str(questions),
         "--max-new-tokens", str(max_new), "-o", str(out), *mode], log)
    return json.loads((out / "results.json").read_text())["tasks"]["mt_bench"]


def held_out(log: Path) -> list[float]:
    """The last held-out acc_0.. line the trainer printed."""
    lines = [ln for ln in log.read_text().splitlines() if "held-out loss" in ln]
    return [float(x) for x in lines[-1].split("acc")[1].split(",")[0].split()] if lines else []


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--store", type=Path)
    ap.add_argument("--report-from", type=Path, help="print the table and draw the PNG of a scaling.json")
    ap.add_argument("--shards", default="1,2,4,8")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--questions", type=Path)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree-for", default="", help="sizes (shard counts) that also get a tree eval, e.g. 8")
    args = ap.parse_args()
    if args.report_from:
        return report_from(args.report_from, args.out / "scaling.png")
    if not (args.model and args.store and args.questions):
        ap.error("--model, --store and --questions are required (or --report-from)")
    args.out.mkdir(parents=True, exist_ok=True)
    qfile = args.out / "questions.jsonl"
    nq = questions_file(args.questions, args.every, qfile)
    tree_for = {int(x) for x in args.tree_for.split(",") if x}
    rows = []
    for k in (int(x) for x in args.shards.split(",")):
        sub = sub_store(args.store, k, args.out / f"store-{k}")
        samples = sum(json.loads(p.read_text()).get("num_samples", 0) for p in (sub / "shards").glob("*.json"))
        draft = args.out / f"draft-{k}"
        train_log = args.out / f"train-{k}.log"
        secs = run(["eagle3", "train", "--store", str(sub), "--out", str(draft), "--allow-incomplete",
                    "--epochs", str(args.epochs), *TRAIN], train_log)
        row = {"shards": k, "samples": samples, "train_s": round(secs), "held_out_acc": held_out(train_log)}
        chain = evaluate(args.model, draft, qfile, ["--mode", "chain", "--chain-length", "3"],
                         args.out / f"eval-chain-{k}", args.max_new_tokens, args.out / f"eval-chain-{k}.log")
        row.update(chain_tau=chain["tau"], chain_speedup=chain["speedup"], lossless=chain["lossless"])
        if k in tree_for:
            tree = evaluate(args.model, draft, qfile, ["--mode", "tree"], args.out / f"eval-tree-{k}",
                            args.max_new_tokens, args.out / f"eval-tree-{k}.log")
            row.update(tree_tau=tree["tau"], tree_speedup=tree["speedup"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "scaling.json").write_text(json.dumps({"questions": nq, "epochs": args.epochs, "train": TRAIN,
                                                           "max_new_tokens": args.max_new_tokens,
                                                           "rows": rows}, indent=1))
    report(rows, nq, args.epochs, args.max_new_tokens, args.out / "scaling.png")


def report(rows: list[dict], nq: int, epochs: int, max_new: int, png: Path):
    """The markdown table, and the PNG of tau against data (if matplotlib is installed)."""
    print(f"\n{nq} mt_bench first turns, {max_new} new tokens, greedy; {epochs} epochs each\n")
    print("| data | samples | train s | held-out acc_0 | chain-3 tau | speedup | tree tau | lossless |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc0 = r["held_out_acc"][0] if r["held_out_acc"] else float("nan")
        tree = f"{r['tree_tau']:.2f}" if "tree_tau" in r else "-"
        speed = f"{r['chain_speedup']:.2f}x" if r.get("chain_speedup") is not None else "-"  # acceptance-only rows
        print(f"| {r['shards']}x | {r['samples']} | {r['train_s']} | {acc0:.3f} | {r['chain_tau']:.2f} | "
              f"{speed} | {tree} | {r['lossless']} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["samples"] for r in rows], [r["chain_tau"] for r in rows], "o-", label="chain-3 tau (mt_bench)")
    trees = [r for r in rows if "tree_tau" in r]
    if trees:
        ax.plot([r["samples"] for r in trees], [r["tree_tau"] for r in trees], "s", label="tree tau")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("regenerated training samples")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title(f"SmolLM2-135M draft, {epochs} epochs each")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def report_from(path: Path, png: Path):
    """``--report-from scaling.json``: table and PNG of a finished (or stopped) run."""
    d = json.loads(path.read_text())
    report(d["rows"], d["questions"], d["epochs"], d.get("max_new_tokens", 64), png)


if __name__ == "__main__":
    main()
