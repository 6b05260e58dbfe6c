"""Verification cost on the fast path by row count and by the row count its matmuls are packed for.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/pack_sizes.py [MODEL_DIR]

MKL's packed GEMM is specialised for one row count (fast_target.Linear); a verification of n
tokens packed for p >= n pads to p rows. Prints, per (n rows @ p packed, or "none": plain
F.linear), the median forward time over 5 interleaved rounds and its ratio to one token, after a
200-token prefix. SmolLM2-135M-Instruct by default.
"""
import sys
import statistics
import time

import torch
from transformers import AutoModelForCausalLM
from eagle3cli.fast_target import Decoder, FastTarget
torch.set_num_threads(1)
m = AutoModelForCausalLM.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else str(__import__("pathlib").Path.home() / ".cache/eagle3/models/SmolLM2-135M-Instruct"), dtype=torch.float32).eval()
ids = torch.randint(0, 40000, (200,))
dec = Decoder(m)
def lat(n, packs, reps=9):
    dec.repack(packs)
    ft = FastTarget(m, 256, decoder=dec)
    ft.forward(ids, torch.arange(200), 0, logits="last")
    new, pos = ids[-n:].clone(), torch.arange(200, 200 + n)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); ft.forward(new, pos, 200); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1000
CASES = [(1, ()), (3, (3,)), (3, (4,)), (3, ()), (4, (4,)), (4, (8,)), (13, (13,)), (13, (16,)), (16, (16,))]
res = {f"{n}@{p[0] if p else 'none'}": [] for n, p in CASES}
for rnd in range(5):  # interleaved: the machine's load drifts between rounds, not within one
    for n, p in CASES:
        res[f"{n}@{p[0] if p else 'none'}"].append(lat(n, p))
res["1"] = res.pop("1@none")
b = statistics.median(res["1"])
for k, v in res.items():
    print(k, f"{statistics.median(v):.1f} ms", f"{statistics.median(v)/b:.2f}x", [round(x/b, 2) for x in v])
