"""The ablation table from the runs of benchmarks/ablation.sh: one markdown row per run.

    python benchmarks/ablation_table.py OUT [NAME ...]

Columns: CPU-minutes of training (user + system, /usr/bin/time), held-out acc_0..acc_6 and the
simulated 7-chain tau (train_summary.json), and the measured chain-3 tau with its per-position
acceptance (chain_tau.py's JSON).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(root: Path, name: str) -> str:
    summary = root / name / "train_summary.json"
    if not summary.exists():
        return f"| {name} | (not finished) |"
    s = json.loads(summary.read_text())
    t = (root / f"{name}.time").read_text().split()
    cpu_min = (float(t[0]) + float(t[1])) / 60
    chain_file = root / f"{name}.chain.json"
    c = json.loads(chain_file.read_text()) if chain_file.exists() else {}
    tau = f"{c['tau']:.3f}" if c.get("tau") else "-"
    if c.get("partial"):
        tau += f" (partial: {c['answers']} answers)"
    per_pos = " ".join(f"{a:.3f}" for a in c.get("acceptance_per_pos", []))
    return (f"| {name} | {cpu_min:.1f} | {' '.join(f'{a:.3f}' for a in s['acc'])} | {s['tau_sim']:.3f} | "
            f"{tau} ({per_pos}) |")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    root = Path(argv[0])
    names = argv[1:] or sorted(p.name for p in root.iterdir() if p.is_dir())
    print("| run | train CPU-min | held-out acc_0..acc_6 | simulated tau | chain-3 tau (per position) |")
    print("|---|---|---|---|---|")
    for name in names:
        print(row(root, name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
