"""What one verification forward costs as the drafted tree grows, on this hardware.

    python benchmarks/verify_cost.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct --threads 2

Speculative decoding pays when tau (tokens per target forward) exceeds the cost of verifying
n drafted tokens relative to decoding one: on a GPU that ratio stays near 1 up to dozens of
tokens; on a CPU it does not. This prints the median latency of one target forward of n new
tokens after a prefix, on the HF forward (DynamicCache, what `eagle3 eval --fast off` runs)
and on the fast path (fast_target: static cache, fused and packed matmuls, what `eagle3 eval`
runs by default), each as a ratio to its own n = 1 and the fast path against HF. The two
paths are timed in the same process, interleaved, on the same weights.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from eagle3cli.evaluate import hardware
from eagle3cli.fast_target import FastTarget
from eagle3cli.target import TargetSpec, load_target


def median_ms(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1000 * sorted(ts)[len(ts) // 2]


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
    from transformers import DynamicCache

    from eagle3cli.generator import forward

    target = load_target(TargetSpec(args.model))
    sizes = tuple(int(x) for x in args.sizes.split(","))
    # Every size packed for itself, one row included: the one-token reference is the fastest
    # one-row forward (packed for one, or plain F.linear, whichever is faster here).
    fast = FastTarget(target, args.prefix + max(sizes) + 1, packed_rows=sizes)
    ids = torch.randint(100, target.config.vocab_size - 1, (1, args.prefix),
                        generator=torch.Generator().manual_seed(0))
    layers = (2, target.config.num_hidden_layers // 2, target.config.num_hidden_layers - 3)
    cache = DynamicCache(config=target.config)
    lat = {}
    with torch.no_grad():
        forward(target, ids, cache, logits_to_keep=1)
        fast.forward(ids[0], torch.arange(args.prefix), 0, logits="last")
        for n in sizes:
            new = ids[:, -n:]
            pos = torch.arange(args.prefix, args.prefix + n)

            def hf():
                forward(target, new, cache, position_ids=pos[None])
                cache.crop(-n)

            lat[n] = (median_ms(hf, args.repeats),
                      median_ms(lambda: fast.forward(new[0], pos, args.prefix, hidden_layers=layers), args.repeats))
        one = ids[0, -1:], torch.arange(args.prefix, args.prefix + 1)
        packed_one = median_ms(lambda: fast.forward(*one, args.prefix, hidden_layers=layers), args.repeats)
        fast.decoder.repack(tuple(n for n in sizes if n > 1))
        unpacked_one = median_ms(lambda: fast.forward(*one, args.prefix, hidden_layers=layers), args.repeats)
    print(f"model {args.model}  prefix {args.prefix}  {hardware()}  ({platform.node()})")
    print(f"fast path, one row: packed for one {packed_one:.1f} ms, unpacked (F.linear) {unpacked_one:.1f} ms; "
          f"'x one' uses the faster")
    if 1 in lat:
        lat[1] = (lat[1][0], min(lat[1][1], unpacked_one))
    print(f"{'new tokens':>10} {'hf ms':>8} {'x one':>6} {'fast ms':>8} {'x one':>6} {'fast/hf':>8}")
    h1, f1 = lat[sizes[0]]
    for n in sizes:
        h, f = lat[n]
        print(f"{n:>10} {h:8.1f} {h / h1:6.2f} {f:8.1f} {f / f1:6.2f} {f / h:8.2f}")


if __name__ == "__main__":
    main()
