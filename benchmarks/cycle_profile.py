"""Where a speculative cycle's time goes: draft (by part), verify and bookkeeping, per cycle.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/cycle_profile.py --model TARGET --draft DRAFT \
        [--prompts mt_bench.jsonl] [--limit 6] [--mode chain|tree] [--draft-dtype bfloat16] [--draft-weights int4]

Runs ``speculative_generate`` on the fast path, as ``eagle3 eval`` does, on the first turns of
``--limit`` prompts, with the drafter's parts wrapped in timers: ``observe`` (the accepted
tokens' features in: fc + one layer step + head), ``expand`` (one tree level: a layer step +
head over its nodes), and inside them the layer step and the draft head (``fast_draft.FastDraft``'s,
as eval runs them) and the rest of the log-softmax over the draft vocabulary. Prints ms per cycle
next to the generator's own draft / verify / bookkeeping split. ``--draft-dtype`` is what the
drafter's lean steps compute in and ``--draft-weights`` how their matmul weights are stored (its
proposals only: the output stays the target's greedy one); eval steps in bf16 with int4 weights
beside a bf16 target on AMX CPUs, this script's target is fp32.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", help="a turns JSONL (default: the bundled mt_bench)")
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--mode", choices=["chain", "tree"], default="chain")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tree", default="12,4,4", help="tree mode: TOTAL,DEPTH,TOPK")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", help="the target's (eval picks bfloat16 on AMX CPUs)")
    p.add_argument("--draft-dtype", default="float32")
    p.add_argument("--draft-weights", default="full", choices=["full", "int8", "int4"])
    args = p.parse_args(argv)

    import torch
    from chain_tau import setup

    from eagle3cli.data.turns import encode
    from eagle3cli.decode.drafter import EagleDrafter
    from eagle3cli.decode.fast_draft import FastDraft
    from eagle3cli.decode.generator import speculative_generate
    from eagle3cli.evaluate.fast_setup import pack_drafter
    from eagle3cli.evaluate.tasks import load_turns_file
    from eagle3cli.model.draft import Eagle3Draft
    from eagle3cli.workflows.quickstart import bundled_prompts

    target, tok, draft, s, fast, note = setup(args)
    if fast is None:
        raise SystemExit(f"the fast path does not apply: {note}")
    spent: dict[str, float] = {}

    def timer(name, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return out
        return wrapped

    drafter = EagleDrafter(draft, dtype=getattr(torch, args.draft_dtype), weights=args.draft_weights)
    pack_drafter(drafter, s)  # as eval does; before the timers, so its own timing runs are not counted
    # the lean step runs fc itself (FastDraft.fuse); the module's fuse is the lean=False path's
    for cls, names in ((EagleDrafter, ("observe", "expand", "_logq")), (FastDraft, ("step", "logits", "fuse")),
                       (Eagle3Draft, ("fuse",))):
        for name in names:
            setattr(cls, name, timer(name, getattr(cls, name)))
    prompts = load_turns_file(args.prompts or bundled_prompts(), args.limit)
    split = {"draft": 0.0, "verify": 0.0, "bookkeeping": 0.0}
    cycles = tokens = 0
    wall = prefill = 0.0
    with torch.no_grad():
        for pr in prompts:
            ids = encode(tok, [{"role": "user", "content": pr.turns[0]}])
            t0 = time.perf_counter()
            r = speculative_generate(target, drafter, ids, s, fast=fast)
            wall += time.perf_counter() - t0
            prefill += r.times.get("prefill", 0.0)
            for k in split:
                split[k] += r.times[k]
            cycles, tokens = cycles + r.forwards, tokens + r.decode_tokens
    per = lambda v: 1000 * v / max(1, cycles)  # noqa: E731
    print(f"{len(prompts)} first turns, {args.mode}, draft in {args.draft_dtype} ({args.draft_weights} weights), "
          f"{torch.get_num_threads()} "
          f"threads: {cycles} cycles, tau {tokens / max(1, cycles):.3f}")
    print("per cycle: " + ", ".join(f"{k} {per(v):.2f} ms" for k, v in split.items()))
    outside = wall - prefill - sum(split.values())
    print(f"whole generations {1000 * wall / len(prompts):.1f} ms each: the target's prefill "
          f"{1000 * prefill / len(prompts):.1f} ms, the rest outside the cycles' parts {per(outside):.2f} ms a cycle")
    rest = spent.get("_logq", 0.0) - spent.get("logits", 0.0)
    print(f"  draft parts: observe {per(spent.get('observe', 0)):.2f} ms, expand {per(spent.get('expand', 0)):.2f} ms; "
          f"layer steps {per(spent.get('step', 0)):.2f}, head {per(spent.get('logits', 0)):.2f}, "
          f"log-softmax {per(rest):.2f}, fc {per(spent.get('fuse', 0)):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
