"""What one verification forward costs as the drafted tree grows, on this hardware.

    python benchmarks/verify_cost.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct

Speculative decoding pays when tau (tokens per target forward) exceeds the cost of verifying
n drafted tokens relative to decoding one: on a GPU that ratio stays near 1 up to dozens of
tokens; on a CPU it does not. This prints the median latency of one target forward of n new
tokens after a prefix (the measurement `eagle3 eval --tree auto` makes), its ratio to n = 1,
and so the break-even tau of a chain of n - 1 drafted tokens (drafting cost not included).
"""

from __future__ import annotations

import argparse
import platform

import torch

from eagle3cli.evaluate import hardware, verify_latency
from eagle3cli.target import TargetSpec, load_target


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefix", type=int, default=300, help="tokens already in the KV cache")
    ap.add_argument("--sizes", default="1,2,4,8,12,16,24,32,48,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(TargetSpec(args.model, device=args.device))
    dev = next(target.parameters()).device
    vocab = target.config.vocab_size
    ids = torch.randint(100, vocab - 1, (1, args.prefix), generator=torch.Generator().manual_seed(0)).to(dev)
    sizes = tuple(int(x) for x in args.sizes.split(","))
    lat = verify_latency(target, ids, sizes=sizes, repeats=args.repeats)
    print(f"model {args.model}  prefix {args.prefix}  {hardware()}  ({platform.node()})")
    print(f"{'new tokens':>10} {'ms':>9} {'x one token':>12}")
    for n in sizes:
        print(f"{n:>10} {lat[n] * 1000:9.1f} {lat[n] / lat[sizes[0]]:12.2f}")


if __name__ == "__main__":
    main()
