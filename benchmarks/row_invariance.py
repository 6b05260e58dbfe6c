"""How far a verification forward's logits are from one-token decoding's, per dtype and attention.

    python benchmarks/row_invariance.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct --threads 2 \
        [--march native,haswell] [--native-only]

Greedy speculative decoding emits exactly what plain decoding emits only if a forward of n new
tokens gives each row the logits that decoding those tokens one at a time gives; where they
differ, near-ties flip. This prints, for the fast path in fp32 (eagle3's native kernels, each
build of --march: each layer one compiled call; MKL-packed and oneDNN matmuls),
bf16 with attention in bf16, and bf16 with attention in float64 (what eval runs in bf16), unpacked
and oneDNN-prepacked, the largest |difference| of the logits and how many argmaxes flip, over
chains of 2-16 tokens after several prefixes (random tokens, so near-ties are rarer than in text).
"""

from __future__ import annotations

import argparse

import torch

from eagle3cli.decode import native
from eagle3cli.decode.fast_target import NATIVE, ONEDNN, Decoder, FastTarget, Linear
from eagle3cli.model.target import TargetSpec, load_target


def compare(fast: FastTarget, prefixes=(37, 64, 129, 300, 511), sizes=(2, 4, 8, 16)) -> tuple[float, int, int]:
    worst, flips, rows = 0.0, 0, 0
    with torch.no_grad():
        for seed, p in enumerate(prefixes):
            ids = torch.randint(100, fast.embed.shape[0] - 1, (p + max(sizes),),
                                generator=torch.Generator().manual_seed(seed))
            fast.forward(ids[:p], torch.arange(p), 0, logits="last")
            one = torch.cat([fast.forward(ids[p + i:p + i + 1], torch.arange(p + i, p + i + 1), p + i)[0]
                             for i in range(max(sizes))]).float()
            for n in sizes:
                many = fast.forward(ids[p:p + n], torch.arange(p, p + n), p)[0].float()
                worst = max(worst, (many - one[:n]).abs().max().item())
                flips += int((many.argmax(-1) != one[:n].argmax(-1)).sum())
                rows += n
    return worst, flips, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--march", default="native,haswell", help="builds of the native kernels to check (-march values; "
                    "native is this CPU's, haswell the AVX2 build); empty: none")
    ap.add_argument("--native-only", action="store_true", help="only the native kernels' builds")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(TargetSpec(args.model))
    # (name, decoder, attention dtype override, native build): the native cases' steps of up to 16
    # rows run each layer as one call of that build (the 300- and 511-token prompts on oneDNN)
    cases = [(f"fp32, native -march={m}", Decoder(target, (NATIVE, ONEDNN)), None, m)
             for m in filter(None, args.march.split(",")) if native.use(m)]
    if not args.native_only:
        cases.append(("fp32, MKL packed per size", Decoder(target, (1, 2, 4, 8, 16)), None, None))
        if Linear.can_pack(cases[-1][1].head.weight, ONEDNN):
            cases.append(("fp32, oneDNN", Decoder(target, (ONEDNN,)), None, None))
        bf16 = Decoder(target, dtype=torch.bfloat16)
        cases += [("bf16, attention in bf16", bf16, torch.bfloat16, None),
                  ("bf16, attention in float64", bf16, None, None)]
        if Linear.can_pack(bf16.head.weight, ONEDNN):
            cases.append(("bf16 oneDNN, attention in float64", Decoder(target, (ONEDNN,), dtype=torch.bfloat16), None,
                          None))
    print(f"{'forward':<36} {'max |logit diff|':>16} {'argmax flips':>13}")
    for name, decoder, attn, march in cases:
        native.use(march)
        fast = FastTarget(target, 600, decoder=decoder)
        if attn is not None:  # override the float64 attention eval uses, to show why it does
            fast.attn_dtype = attn
            fast.k, fast.v = fast.k.to(attn), fast.v.to(attn)
        worst, flips, rows = compare(fast)
        print(f"{name:<36} {worst:16.2e} {flips:>6} of {rows}")


if __name__ == "__main__":
    main()
