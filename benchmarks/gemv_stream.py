"""How fast one-row matmuls read a decoding step's weights on this CPU, against plain reads of them.

    PYTHONPATH=. python benchmarks/gemv_stream.py [--model $SMOL] [--threads 2] [--rounds 9]
    PYTHONPATH=. python benchmarks/gemv_stream.py --model $SMOL --decode [-n 64] [--rounds 5]
    PYTHONPATH=. python benchmarks/gemv_stream.py --model $SMOL --rows 1,2,3,4,8,16 [--rounds 9] \\
        [--march native,haswell] [--dtype bfloat16]

A step of plain decoding is one-row matmuls over every weight matrix, so its speed is the rate
those calls stream weights from memory. Kernel loop (the default): the fast path's matrices of
--model (its fused qkv, o, gate|up, down per layer and the LM head; random fp32 weights of those
shapes), each one-row kernel run over all of them, interleaved with ``sum()`` over the same
tensors (what a pure read costs, one call each) and over one buffer of their total size (the
streaming rate with no call boundaries). Medians of --rounds; GB/s = weight bytes / time.

``--decode``: the fast path decoding -n tokens greedily after a chat prompt, with every matmul
oneDNN-prepacked, under the native packing (each layer one compiled call: ``decode.native``), every
one MKL-packed for one row, and MKL for the matrices under --split MB with oneDNN for the rest,
interleaved --rounds times; medians and ratios to oneDNN. The kernel loop has the native matmul
(``native.Matrix``) as its first row where it is built here.

``--rows``: what a verification of m rows costs against one row, on the native kernels: the
matmul alone over every matrix (random weights of the model's shapes, each pass after reading a
buffer larger than the caches, as a decoding step finds them after the previous step), and the
whole forward of m new tokens behind a 120-token prefix (``FastTarget.forward``: native layers,
the head over the whole vocabulary), all row counts interleaved in each round; medians, and the
median per-round ratio to one row. Per build of the kernels (--march: this CPU's, and haswell, the
AVX2 build, whose tiles fit 16 vector registers: on an AVX-512 CPU both run), interleaved too.
``--dtype bfloat16``: the target loaded in bf16, its matrices (and the random ones) bf16 in the
native bf16-weight kernels, fp32 around them (``fast_target.Decoder.mixed``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.bench_args import add_target_args, apply_target_args  # noqa: E402
from eagle3cli.decode import native  # noqa: E402
from eagle3cli.decode.fast_target import NATIVE, ONEDNN, FastTarget  # noqa: E402


def kernels(weights: list[torch.Tensor]) -> dict:
    """name -> a function that runs that one-row kernel over every weight once."""
    one = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    onednn_b1 = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    mkl1 = [torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in weights]
    transposed = [w.t().contiguous() for w in weights]
    linear = torch.ops.mkldnn._linear_pointwise.default
    big = torch.ones(sum(w.numel() for w in weights))
    fns = {}
    if native.available():
        mats = [native.Matrix(w) for w in weights]
        fns["native (eagle3's kernel)"] = lambda: [m(one[m.cols]) for m in mats]
    return fns | {
        "oneDNN prepacked": lambda: [linear(one[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, onednn)],
        "oneDNN packed for batch 1": lambda: [linear(one[w.shape[1]], p, None, "none", [], "")
                                              for w, p in zip(weights, onednn_b1)],
        "MKL packed, 1 row": lambda: [torch.ops.mkl._mkl_linear(one[w.shape[1]], p, w, None, 1)
                                      for w, p in zip(weights, mkl1)],
        "F.linear": lambda: [F.linear(one[w.shape[1]], w) for w in weights],
        "mm, transposed weight": lambda: [torch.mm(one[t.shape[0]], t) for t in transposed],
        "mv": lambda: [torch.mv(w, one[w.shape[1]][0]) for w in weights],
        "sum() of each weight": lambda: [w.sum() for w in weights],
        "sum() of one buffer": lambda: big.sum(),
    }


def kernel_loop(fast: FastTarget, rounds: int) -> None:
    torch.manual_seed(0)
    weights = [torch.randn(lin.weight.shape) * 0.02 for lin in fast.decoder.linears()]
    nbytes = sum(w.numel() * 4 for w in weights)
    fns = kernels(weights)
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    print(f"{len(weights)} matrices, {nbytes / 1e6:.0f} MB fp32, {torch.get_num_threads()} threads, "
          f"medians of {rounds} interleaved rounds\n")
    print("| one-row kernel over every matrix | ms | GB/s |\n|---|---|---|")
    for k, ts in times.items():
        m = statistics.median(ts)
        print(f"| {k} | {1000 * m:.2f} | {nbytes / m / 1e9:.1f} |")


def decode(fast: FastTarget, prompt: torch.Tensor, n: int, rounds: int, split_mb: float) -> None:
    from plain_vs_llamacpp import ours_tps

    lins = list(fast.decoder.linears())
    packings = {
        "oneDNN": lambda lin: (ONEDNN,),
        **({"native (each layer one call)": lambda lin: (NATIVE, ONEDNN)} if native.available() else {}),
        "MKL packed, 1 row": lambda lin: (1,),
        f"MKL under {split_mb:g} MB, oneDNN above": lambda lin: (1,) if lin.weight.numel() * 4 < split_mb * 1e6
        else (ONEDNN,),
    }
    tps = {k: [] for k in packings}

    def pack(choose):
        for lin in lins:
            lin.pack(choose(lin))

    for choose in packings.values():
        pack(choose)
        ours_tps(fast, prompt, 4)
    for r in range(rounds):
        for k, choose in packings.items():
            pack(choose)
            ours_tps(fast, prompt, 2)  # the first calls after packing page-fault
            tps[k].append(ours_tps(fast, prompt, n))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tps.items()), flush=True)
    base = tps["oneDNN"]
    print(f"\n{n} tokens, {torch.get_num_threads()} threads, {rounds} interleaved rounds, medians\n")
    print("| packing | tok/s | x oneDNN |\n|---|---|---|")
    for k, v in tps.items():
        print(f"| {k} | {statistics.median(v):.1f} | {statistics.median([a / b for a, b in zip(v, base)]):.3f} |")


def rows_loop(model, rows: list[int], rounds: int, marches: list[str]) -> None:
    builds = [m for m in marches if native.use(m)]
    if not builds:
        sys.exit(f"--rows times the native kernels, which are not built here: {native.status()}")
    for m in marches:
        native.use(m)
        print(f"build -march={m}: {native.status()}; tiles {native.tiles()}")
    native.use(builds[0])
    torch.manual_seed(0)
    fast = FastTarget(model, 160)
    fast.decoder.repack((NATIVE, ONEDNN))
    print(f"matrices in {fast.head.weight.dtype}" + (" (bf16 weights, fp32 around them)" if fast.decoder.mixed else ""))
    mats = [native.Matrix((torch.randn(lin.weight.shape) * 0.02).to(lin.weight.dtype))
            for lin in fast.decoder.linears()]
    evict = torch.ones(64 * 2**20)  # 256 MB: more than any last-level cache
    prefix = 120
    with torch.inference_mode():
        fast.forward(torch.randint(0, model.config.vocab_size, (prefix,)), torch.arange(prefix), 0)

    def matmuls(m):
        xs = {c: torch.randn(m, c) for c in {w.cols for w in mats}}
        return lambda: [w(xs[w.cols]) for w in mats]

    def forward(m):
        ids, pos = torch.randint(0, model.config.vocab_size, (m,)), torch.arange(prefix, prefix + m)
        return lambda: fast.forward(ids, pos, prefix)

    # every build's calls bind the kernels at call time: ``native.use`` switches them all
    fns = {(b, kind, m): make(m) for b in builds for kind, make in (("matmuls", matmuls), ("forward", forward))
           for m in rows}
    times = {k: [] for k in fns}
    with torch.inference_mode():
        for (b, _, _), f in fns.items():
            native.use(b)
            f()
        for _ in range(rounds):
            for k, f in fns.items():
                native.use(k[0])
                evict.sum()
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    native.use()
    print(f"\nnative kernels, {torch.get_num_threads()} threads, medians of {rounds} rounds, builds and row counts "
          "interleaved in each\n")
    print("| build | rows | matmuls ms | x 1 row | forward ms | x 1 row |\n|---|---|---|---|---|---|")
    for b in builds:
        for m in rows:
            cells = []
            for kind in ("matmuls", "forward"):
                one, ts = times[b, kind, rows[0]], times[b, kind, m]
                ratio = statistics.median([a / c for a, c in zip(ts, one)])
                cells += [f"{1000 * statistics.median(ts):.2f}", f"{ratio:.2f}"]
            print(f"| -march={b} | {m} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_target_args(ap)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--decode", action="store_true", help="decode with each packing instead of the kernel loop")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--split", type=float, default=2.0, help="--decode: MB under which a matrix is MKL-packed")
    ap.add_argument("--rows", default=None, help="comma-separated row counts (the first is the base, say 1): "
                    "the native matmul and forward at each instead of the kernel loop")
    ap.add_argument("--march", default="native,haswell", help="--rows: comma-separated builds of the native "
                    "kernels to time, interleaved (-march values: native is this CPU's; haswell is AVX2)")
    ap.add_argument("--dtype", default="float32", help="--rows: float32, or bfloat16 (bf16 weights in the native "
                    "bf16-weight kernels)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    apply_target_args(args)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype) if args.rows
                                                 else torch.float32).eval()
    if args.rows:
        rows_loop(model, [int(v) for v in args.rows.split(",")], args.rounds, args.march.split(","))
        return
    if not args.decode:
        kernel_loop(FastTarget(model, 16), args.rounds)
        return
    from plain_vs_llamacpp import prompt_ids

    prompt = torch.tensor(prompt_ids(args.model))
    decode(FastTarget(model, len(prompt) + args.n + 8), prompt, args.n, args.rounds, args.split)


if __name__ == "__main__":
    main()
