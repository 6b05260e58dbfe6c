"""Verification cost on the fast path by row count and by the row count its matmuls are packed for.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/pack_sizes.py [--model DIR] [--rounds 5]

MKL's packed GEMM is specialised for one row count (``fast_target.Linear``); a verification of n
tokens packed for p >= n pads to p rows, and one with no packing runs plain ``F.linear``. For
each case ``n@p`` (``n@none``: unpacked) this prints the median forward time over ``--rounds``
interleaved rounds (the load of a shared machine drifts between rounds, not within one) and its
ratio to one token, after a 200-token prefix. SmolLM2-135M-Instruct by default.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from verify_cost import median_ms

from eagle3cli.decode.fast_target import FastTarget
from eagle3cli.model.target import TargetSpec, load_target

PREFIX = 200
# (rows verified, rows packed for): chain 2 and 3 (3 and 4 rows), tree 12/4/4 (13), a 15-node tree (16).
CASES = [(1, None), (3, 3), (3, 4), (3, None), (4, 4), (4, 8), (13, 13), (13, 16), (16, 16)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target folder (default: the cached SmolLM2-135M-Instruct)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=9, help="forwards per case and round (the median is kept)")
    args = ap.parse_args()
    if args.model is None:
        from eagle3cli.core.realmodels import smollm2_dir

        args.model = str(smollm2_dir())
    target = load_target(TargetSpec(args.model))  # fp32 on a CPU (dtype auto)
    fast = FastTarget(target, PREFIX + max(n for n, _ in CASES))
    ids = torch.randint(100, target.config.vocab_size - 1, (PREFIX,), generator=torch.Generator().manual_seed(0))
    fast.forward(ids, torch.arange(PREFIX), 0, logits="last")  # the prefix, once: packing leaves the cache valid
    res = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for n, packed in CASES:
            fast.decoder.repack((packed,) if packed else ())
            new, pos = ids[-n:].clone(), torch.arange(PREFIX, PREFIX + n)
            res[(n, packed)].append(median_ms(lambda: fast.forward(new, pos, PREFIX), args.repeats))
    one = statistics.median(res[(1, None)])
    print(f"one token: {one:.1f} ms")
    for (n, packed), ts in res.items():
        if n > 1:
            m = statistics.median(ts)
            print(f"{n}@{packed or 'none'}: {m:.1f} ms, {m / one:.2f}x one token "
                  f"(rounds: {' '.join(f'{t / one:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
