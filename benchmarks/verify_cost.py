"""What one verification forward costs as the drafted tree grows, on this hardware.

    python benchmarks/verify_cost.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct --threads 2

Speculative decoding pays when tau (tokens per target forward) exceeds the cost of verifying
n drafted tokens relative to decoding one: on a GPU that ratio stays near 1 up to dozens of
tokens; on a CPU it does not. This prints the median latency of one target forward of n new
tokens after a prefix, on the HF forward (the generator's HFVerifier: a DynamicCache that keeps
every position and a mask per layer kind, what `eagle3 eval --fast off` runs)
and on the fast path (fast_target: static cache, fused and packed matmuls, what `eagle3 eval`
runs by default; its matmuls MKL-packed for each size, and oneDNN-prepacked where oneDNN is
available), HF as a ratio to its own n = 1, the fast path to its fastest n = 1. The two
paths are timed in the same process, interleaved, on the same weights. Where the CPU multiplies
bf16 natively, a bf16 column follows: the fast path with bf16 weights and float64 attention
(what `eagle3 eval --dtype auto` runs on AMX CPUs), unpacked and oneDNN-prepacked, as a ratio to
its own one token and to fp32's.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from eagle3cli.core.hardware import describe, has_bf16_matmul
from eagle3cli.data.regen_rate import median_seconds
from eagle3cli.decode.fast_target import ONEDNN, Decoder, FastTarget, Linear
from eagle3cli.model.target import TargetSpec, load_target


def median_ms(fn, repeats: int) -> float:
    return 1000 * median_seconds(fn, repeats)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefix", type=int, default=300, help="tokens already in the KV cache")
    ap.add_argument("--sizes", default="1,2,4,8,16,17,32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from eagle3cli.decode.verifiers import HFVerifier

    target = load_target(TargetSpec(args.model))
    sizes = tuple(int(x) for x in args.sizes.split(","))
    # Every size packed for itself, one row included: the one-token reference is the fastest
    # one-row forward (MKL packed for one, plain F.linear or oneDNN, whichever is fastest here).
    fast = FastTarget(target, args.prefix + max(sizes) + 1, packed_rows=sizes)
    ids = torch.randint(100, target.config.vocab_size - 1, (1, args.prefix),
                        generator=torch.Generator().manual_seed(0))
    layers = (2, target.config.num_hidden_layers // 2, target.config.num_hidden_layers - 3)
    verifier = HFVerifier(target)
    onednn = Linear.can_pack(fast.head.weight, ONEDNN)
    lat = {}
    with torch.no_grad():
        verifier.prefill(ids)
        fast.forward(ids[0], torch.arange(args.prefix), 0, logits="last")

        def fast_ms(n):
            new, pos = ids[0, -n:], torch.arange(args.prefix, args.prefix + n)
            return median_ms(lambda: fast.forward(new, pos, args.prefix, hidden_layers=layers), args.repeats)

        for n in sizes:
            new = ids[:, -n:]
            pos = torch.arange(args.prefix, args.prefix + n)

            mask = torch.ones(n, args.prefix + n, dtype=torch.bool).tril(args.prefix)[None, None]

            def hf():  # the verification alone; dropping its entries again is not timed
                t0 = time.perf_counter()
                verifier.verify(new, pos[None], mask, args.prefix)
                t = time.perf_counter() - t0
                verifier.keep(args.prefix, [])
                return t

            hf()
            lat[n] = [1000 * sorted(hf() for _ in range(args.repeats))[args.repeats // 2], fast_ms(n)]
        packed_one = fast_ms(1)
        fast.decoder.repack(tuple(n for n in sizes if n > 1))
        unpacked_one = fast_ms(1)
        if onednn:
            fast.decoder.repack((ONEDNN,))
            for n in sizes:
                lat[n].append(fast_ms(n))
        # bf16 (eval's --dtype auto on AMX CPUs): bf16 matmuls, attention in float64 (exact)
        # and with its matmuls oneDNN-prepacked (what eval's tune_packing usually picks there)
        bf16 = None
        if has_bf16_matmul():
            fast = FastTarget(target, args.prefix + max(sizes) + 1, decoder=Decoder(target, dtype=torch.bfloat16))
            fast.forward(ids[0], torch.arange(args.prefix), 0, logits="last")
            bf16 = {n: [] for n in sizes}
            prepacked = Linear.can_pack(fast.head.weight, ONEDNN)  # oneDNN has bf16 kernels here
            for packing in ((), (ONEDNN,))[:1 + prepacked]:
                fast.decoder.repack(packing)
                for n in sizes:
                    bf16[n].append(fast_ms(n))
    print(f"model {args.model}  prefix {args.prefix}  {describe()}  ({platform.node()})")
    print(f"fast path, one row: MKL packed for one {packed_one:.1f} ms, unpacked (F.linear) {unpacked_one:.1f} ms"
          + (f", oneDNN {lat[1][2]:.1f} ms" if onednn and 1 in lat else "")
          + "; every 'x one' divides by the fastest one-row forward")
    if 1 in lat:
        lat[1][1] = min(lat[1][1], unpacked_one)
    one = min(lat[sizes[0]][1:])
    cols = f"{'new tokens':>10} {'hf ms':>8} {'x one':>6} {'mkl ms':>8} {'x one':>6}"
    print(cols + (f" {'onednn ms':>9} {'x one':>6}" if onednn else "") + f" {'best/hf':>8}"
          + (f" {'bf16 ms':>8} {'x own one':>9} {'x fp32 one':>10}" if bf16 else "")
          + (f" {'bf16 onednn ms':>14} {'x own one':>9} {'x fp32 one':>10}"
             if bf16 and len(bf16[sizes[0]]) > 1 else ""))
    h1 = lat[sizes[0]][0]
    for n in sizes:
        h, *f = lat[n]
        row = f"{n:>10} {h:8.1f} {h / h1:6.2f} {f[0]:8.1f} {f[0] / one:6.2f}"
        if onednn:
            row += f" {f[1]:9.1f} {f[1] / one:6.2f}"
        row += f" {min(f) / h:8.2f}"
        if bf16:
            b = bf16[n]
            row += f" {b[0]:8.1f} {b[0] / bf16[sizes[0]][0]:9.2f} {b[0] / one:10.2f}"
            if len(b) > 1:
                row += f" {b[1]:14.1f} {b[1] / bf16[sizes[0]][1]:9.2f} {b[1] / one:10.2f}"
        print(row)

if __name__ == "__main__":
    main()
