"""Small-M fp32 GEMM on SmolLM2's layer shapes: F.linear vs MKL packed vs oneDNN prepacked.

    python benchmarks/gemm_small_m.py

The 30 layers' matmuls (q, k, v, o, gate, up, down; the LM head left out) for 1, 2, 4, 8 and 16
rows, random fp32 weights, two threads, median of 7; each backend's ratio to its own one row.
What verification of n tokens could cost on this CPU (docs/benchmarks.md, "Verification cost").
"""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # (out, in): q/o, k/v, gate/up, down
mult = {(576, 576): 2, (192, 576): 2, (1536, 576): 2, (576, 1536): 1}
W = {s: [torch.randn(*s) * 0.02 for _ in range(30)] for s in shapes}
def bench(fn, rows, reps=7):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(rows)
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts)//2] * 1e3
def run_flinear(rows):
    for s in shapes:
        x = torch.randn(rows, s[1])
        for w in W[s]:
            for _ in range(mult[s]):
                F.linear(x, w)
packed_mkl = {}
def run_mkl(rows):
    for s in shapes:
        x = torch.randn(rows, s[1])
        for i, w in enumerate(W[s]):
            key = (s, i, rows)
            if key not in packed_mkl:
                packed_mkl[key] = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
            for _ in range(mult[s]):
                torch.ops.mkl._mkl_linear(x, packed_mkl[key], w, None, rows)
packed_dnn = {}
def run_dnn(rows):
    for s in shapes:
        x = torch.randn(rows, s[1])
        for i, w in enumerate(W[s]):
            key = (s, i)
            if key not in packed_dnn:
                packed_dnn[key] = torch.ops.mkldnn._reorder_linear_weight(w, None)
            for _ in range(mult[s]):
                torch.ops.mkldnn._linear_pointwise(x, packed_dnn[key], None, "none", [], "")
with torch.no_grad():
    for name, fn in [("F.linear", run_flinear), ("mkl packed", run_mkl), ("onednn packed", run_dnn)]:
        try:
            res = {r: bench(fn, r) for r in (1, 2, 4, 8, 16)}
            base = res[1]
            print(name, " ".join(f"{r}:{v:.1f}ms({v/base:.2f}x)" for r, v in res.items()), flush=True)
        except Exception as e:
            print(name, "failed:", repr(e)[:200])
