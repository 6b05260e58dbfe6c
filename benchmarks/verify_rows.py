"""What a verification of 1..4 rows costs against one row, as the planner measures it, per native build.

    PYTHONPATH=. python benchmarks/verify_rows.py [--model $SMOL] [--march native,haswell] [--rounds 3] [--threads 2]

The quickstart's planner and eval's tree choice read a verification's cost from
``workflows.plan.verify_row_seconds``: the fast path's forward of 1 .. MAX_DEPTH + 1 new tokens
behind a 128-token prefix, each packing tried (oneDNN, the native kernels, MKL packed per size),
the fastest of three rounds kept. This runs it --rounds times for each build of the native kernels
(--march: native is this CPU's, haswell the AVX2 build), builds alternating, and prints the
medians and the median per-round ratio to one row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_args import add_target_args, apply_target_args  # noqa: E402
from eagle3cli.decode import native  # noqa: E402
from eagle3cli.workflows.plan import verify_row_seconds  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_target_args(ap)
    ap.add_argument("--march", default="native,haswell", help="comma-separated -march values, one build each")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=2048)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    apply_target_args(args)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    builds = [m for m in args.march.split(",") if native.use(m)]
    if not builds:
        sys.exit(f"the native kernels are not built here: {native.status()}")
    lat = {m: [] for m in builds}
    for r in range(args.rounds):
        for m in builds:
            native.use(m)
            lat[m].append(verify_row_seconds(model, args.max_len))
            cells = ", ".join(f"{n} rows {1000 * s:.2f} ms" for n, s in lat[m][-1].items())
            print(f"round {r + 1} -march={m}: {cells}", flush=True)
    native.use()
    print(f"\n{args.model}: verify_row_seconds, {args.threads} threads, medians of {args.rounds} rounds\n")
    print("| build | rows | ms | x 1 row |\n|---|---|---|---|")
    for m in builds:
        for n in lat[m][0]:
            ms = 1000 * statistics.median(one[n] for one in lat[m])
            ratio = statistics.median(one[n] / one[1] for one in lat[m])
            print(f"| -march={m} | {n} | {ms:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
