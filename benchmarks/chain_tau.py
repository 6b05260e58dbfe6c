"""Chain (or tree) acceptance of a draft with our generator alone: no plain baselines.

``eagle3 eval`` decodes every prompt three times (HF generate, plain on the fast path,
speculative) to give speedups and its lossless check. When only acceptance is wanted (an
engine comparison, a long-context slice on a loaded CPU) this decodes each prompt once,
speculatively, through the same ``speculative_generate`` and fast path as ``eagle3 eval``, and
reports both our tau (emitted decode tokens / verification forwards, as eval) and vLLM's mean
acceptance length (1 + accepted drafts / cycles, which also counts drafts accepted past the
token cap), with unconditional per-position acceptance (as vLLM reports it).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/chain_tau.py --model TARGET --draft DRAFT \
        --prompts turns.jsonl [--limit N] [--max-turns 1] --steps 3 --max-new-tokens 64 --json-out r.json

Greedy: at temperature 0 the speculative answer is the greedy one (eval checks this), so later
turns get the same context as eval's (the plain answer) would give them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", required=True, help="a turns JSONL (question_id, category, turns)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-turns", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mode", choices=["chain", "tree"], default="chain")
    p.add_argument("--tree", default="12,4,4", help="tree mode: TOTAL,DEPTH,TOPK")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fast", choices=["auto", "off"], default="auto")
    p.add_argument("--json-out")
    args = p.parse_args(argv)

    from eagle3cli.data.turns import encode
    from eagle3cli.decode.generator import speculative_generate
    from eagle3cli.evaluate.tasks import load_turns_file

    target, tok, draft, s, fast, note = setup(args)
    depth = s.depth
    prompts = load_turns_file(args.prompts, args.limit)
    rows, t_all = [], time.perf_counter()
    for n, pr in enumerate(prompts, 1):
        messages = []
        for turn in pr.turns[: args.max_turns]:
            messages.append({"role": "user", "content": turn})
            ids = encode(tok, messages)
            t0 = time.perf_counter()
            out = speculative_generate(target, draft, ids, s, seed=0, fast=fast)
            rows.append({"id": pr.id, "prompt_tokens": int(ids.shape[1]), "tokens": len(out.tokens),
                         "decode_tokens": out.decode_tokens, "forwards": out.forwards,
                         "accept_lengths": list(out.accept_lengths), "seconds": round(time.perf_counter() - t0, 2)})
            messages.append({"role": "assistant", "content": tok.decode(out.tokens, skip_special_tokens=True)})
        print(f"{n}/{len(prompts)} prompts: {rows[-1]['prompt_tokens']} prompt tokens, tau so far "
              f"{sum(r['decode_tokens'] for r in rows) / max(1, sum(r['forwards'] for r in rows)):.3f}", flush=True)
        if args.json_out:  # after every prompt: a run stopped early still leaves its numbers
            write(summary(args, rows, fast, note, depth, t_all, partial=n < len(prompts)), args.json_out)
    res = summary(args, rows, fast, note, depth, t_all)
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    if args.json_out:
        write(res, args.json_out)
    return 0


def setup(args, draft_dtype: str = "float32"):
    """(target, tokenizer, draft, SpecSettings, FastTarget or None, why not) as ``eagle3 eval`` builds
    them from ``args`` (model, draft, mode, steps, tree, max_new_tokens, fast, and dtype where given):
    an fp32 target on the CPU unless ``args.dtype`` says otherwise, its fast path packed the fastest
    way measured here."""
    import torch

    from eagle3cli.decode.generator import SpecSettings
    from eagle3cli.evaluate.eval_config import EvalConfig
    from eagle3cli.evaluate.fast_setup import build_fast_target, pack_for_run
    from eagle3cli.model.target import TargetSpec, load_config, load_target, load_tokenizer
    from eagle3cli.publish.formats.readers import read_draft
    from eagle3cli.publish.formats.writers import as_ours

    spec = TargetSpec(args.model, device="cpu", dtype=getattr(args, "dtype", None) or "float32")
    target, tok = load_target(spec), load_tokenizer(spec)
    draft, _ = read_draft(as_ours(args.draft, load_config(spec)), target=target, dtype=getattr(torch, draft_dtype))
    draft.eval()
    total, depth, top_k = (int(x) for x in args.tree.split(","))
    s = SpecSettings(mode=args.mode, steps=args.steps, total_tokens=total, depth=depth, top_k=top_k,
                     max_new_tokens=args.max_new_tokens)
    fast, note = build_fast_target(target, EvalConfig(tasks=[], mode=args.mode, fast=getattr(args, "fast", "auto")),
                                   getattr(target.config, "max_position_embeddings", None))
    pack_for_run(fast, s)
    return target, tok, draft, s, fast, note


def write(res: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(path)


def summary(args, rows, fast, note, depth, t_all, partial=False) -> dict:
    fwd = sum(r["forwards"] for r in rows)
    cycles = [a for r in rows for a in r["accept_lengths"]]
    k = args.steps if args.mode == "chain" else depth
    return {
        "partial": partial,
        "model": args.model, "draft": args.draft, "prompts": args.prompts, "mode": args.mode, "steps": args.steps,
        "max_new_tokens": args.max_new_tokens, "answers": len(rows), "path": "fast" if fast else f"hf ({note})",
        "prompt_tokens": {"min": min(r["prompt_tokens"] for r in rows), "max": max(r["prompt_tokens"] for r in rows),
                          "mean": sum(r["prompt_tokens"] for r in rows) / len(rows)},
        "tau": sum(r["decode_tokens"] for r in rows) / fwd if fwd else None,
        "cycles": len(cycles),
        "accepted": sum(a - 1 for a in cycles),
        "mean_acceptance_length": sum(cycles) / len(cycles) if cycles else None,
        "acceptance_per_pos": [sum(1 for a in cycles if a - 1 >= i) / len(cycles) for i in range(1, k + 1)]
        if cycles else None,
        "seconds": round(time.perf_counter() - t_all, 1),
        "rows": rows,
    }


if __name__ == "__main__":
    raise SystemExit(main())
