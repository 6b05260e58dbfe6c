"""The drafter's paths in one process: the module step (``EagleDrafter(lean=False)``, the
reference), the lean step (``fast_draft.FastDraft``) in fp32, the lean step in bf16, and the lean
bf16 step with int8 and with int4 weights (``weight_quant``; what ``--draft-weights`` picks).

    PYTHONPATH=. python benchmarks/draft_paths.py --model TARGET --draft DRAFT \
        [--mode tree --tree 16,4,4 | --mode chain --steps 3] [--limit 10] [--threads 2] [--dtype bfloat16]

Runs ``speculative_generate`` on the fast path (the target in ``--dtype``, packed for the run as
``eagle3 eval`` packs it) on the first turns of ``--limit`` mt_bench questions, each drafter in
turn per prompt (the order reversed every other prompt), and asserts that every drafter's output
is the same greedy answer and that the two fp32 drafters accept the same tokens (the bf16 and
integer drafters propose within their rounding: their tau is measured, not asserted). Prints the
median draft / verify / bookkeeping ms per cycle of each, and each one's tau. The lean drafters
are packed as eval packs them (timed at start-up); the module path runs unpacked.
"""

from __future__ import annotations

import argparse
import statistics


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--mode", choices=["chain", "tree"], default="tree")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tree", default="16,4,4", help="tree mode: TOTAL,DEPTH,TOPK")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", help="the target's dtype (eval's --dtype auto: bf16 on AMX CPUs)")
    args = p.parse_args(argv)

    import torch

    from eagle3cli.data.turns import encode
    from eagle3cli.decode.drafter import EagleDrafter
    from eagle3cli.decode.fast_target import FastTarget
    from eagle3cli.decode.generator import SpecSettings, speculative_generate
    from eagle3cli.evaluate.fast_setup import pack_drafter, pack_for_run
    from eagle3cli.evaluate.tasks import load_turns_file
    from eagle3cli.model.target import TargetSpec, load_target, load_tokenizer
    from eagle3cli.publish.formats.readers import read_draft
    from eagle3cli.publish.formats.writers import as_ours
    from eagle3cli.workflows.quickstart import bundled_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = TargetSpec(args.model, device="cpu", dtype=args.dtype)
    target, tok = load_target(spec), load_tokenizer(spec)
    draft, _ = read_draft(as_ours(args.draft, target.config), target=target, dtype=torch.float32)
    draft.eval()
    total, depth, top_k = (int(x) for x in args.tree.split(","))
    s = SpecSettings(mode=args.mode, steps=args.steps, total_tokens=total, depth=depth, top_k=top_k,
                     max_new_tokens=args.max_new_tokens)
    fast = FastTarget(target, 2048)
    pack_for_run(fast, s)
    drafters = {"module": EagleDrafter(draft, lean=False), "lean fp32": EagleDrafter(draft),
                "lean bf16": EagleDrafter(draft, dtype=torch.bfloat16),
                "bf16 int8": EagleDrafter(draft, dtype=torch.bfloat16, weights="int8"),
                "bf16 int4": EagleDrafter(draft, dtype=torch.bfloat16, weights="int4")}
    for name in ("lean fp32", "lean bf16", "bf16 int8", "bf16 int4"):
        pack_drafter(drafters[name], s, log=lambda m, n=name: print(f"{n}: {m}"))
    prompts = load_turns_file(bundled_prompts(), args.limit)
    ids = [encode(tok, [{"role": "user", "content": pr.turns[0]}]) for pr in prompts]
    for d in drafters.values():  # warm-up
        speculative_generate(target, d, ids[0], s, fast=fast)
    per_cycle = {name: [] for name in drafters}
    tau = {name: [0, 0] for name in drafters}
    with torch.no_grad():
        for i, x in enumerate(ids):
            order = list(drafters.items()) if i % 2 == 0 else list(drafters.items())[::-1]
            outs = {name: speculative_generate(target, d, x, s, fast=fast) for name, d in order}
            if len({tuple(o.tokens) for o in outs.values()}) != 1:
                raise SystemExit(f"prompt {i}: the drafters' outputs differ (the generator is not lossless)")
            if outs["module"].accept_lengths != outs["lean fp32"].accept_lengths:
                raise SystemExit(f"prompt {i}: the lean fp32 drafter accepted otherwise than the module path")
            for name, o in outs.items():
                per_cycle[name].append({k: 1000 * v / o.forwards for k, v in o.times.items()})
                tau[name][0] += o.decode_tokens
                tau[name][1] += o.forwards
    shape = f"tree {args.tree}" if args.mode == "tree" else f"chain {args.steps}"
    print(f"{shape}, {len(ids)} first turns, target {args.dtype}, {torch.get_num_threads()} threads; "
          f"median ms per cycle")
    print(f"{'drafter':<10} {'draft':>7} {'verify':>7} {'bookkeeping':>12} {'tau':>7} {'cycles':>7}")
    base = statistics.median(r["draft"] for r in per_cycle["module"])
    for name, rows in per_cycle.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ("draft", "verify", "bookkeeping")}
        print(f"{name:<10} {med['draft']:7.2f} {med['verify']:7.2f} {med['bookkeeping']:12.2f} "
              f"{tau[name][0] / tau[name][1]:7.3f} {tau[name][1]:7d}   draft x module {med['draft'] / base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
