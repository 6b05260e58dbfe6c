"""Resident memory of CPU matmuls whose row count changes every call, as a training step's do.

    python benchmarks/bf16_rss.py                      # bf16, a new row count each iteration
    python benchmarks/bf16_rss.py --round 256          # row counts rounded up to a multiple of 256
    python benchmarks/bf16_rss.py --dtype float32

Each iteration runs the three GEMMs of a draft head's forward and backward ([m, 576] x [576,
8192] and the two gradients) with m drawn from 200..1199, and prints the process's resident
memory every 100 iterations. Why: bf16 training on the CPU grew resident memory through a run
(docs/benchmarks.md, "Memory") while fp32 did not; this separates the matmuls' own share of that
from the trainer's. ONEDNN_PRIMITIVE_CACHE_CAPACITY and MALLOC_MMAP_THRESHOLD_ in the
environment change what it shows.
"""

from __future__ import annotations

import argparse

import torch


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--round", type=int, default=1, help="round each row count up to a multiple of this")
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    w = torch.randn(8192, 576, generator=g).to(dtype)
    start = rss_mb()
    for i in range(args.iterations):
        m = int(torch.randint(200, 1200, (1,), generator=g))
        m = -(-m // args.round) * args.round
        x = torch.randn(m, 576, generator=g).to(dtype)
        y = x @ w.t()
        gy = torch.randn(y.shape, generator=g).to(dtype)
        gy @ w, gy.t() @ x  # noqa: B018 (the gradients' GEMMs; their values are not needed)
        if (i + 1) % 100 == 0:
            print(f"{i + 1:>5} iterations: {rss_mb():,.0f} MB resident (start {start:,.0f} MB)", flush=True)


if __name__ == "__main__":
    main()
