"""Speculative (tree and chain) vs plain greedy decoding on a real model: tokens/s, tau, cycle breakdown.

    python benchmarks/spec_vs_plain.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct \
        --draft runs/smol/draft --prompts eagle3cli/prompts/mt_bench.jsonl --limit 10 --max-new-tokens 128

Every method decodes the same first-turn prompts after the same warm-up, in this process.
The per-cycle breakdown splits a speculative cycle into drafting (the draft's forwards and
tree building), verification (the one target forward) and bookkeeping (acceptance, cache
gather). Greedy outputs are checked token for token against plain decoding.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eagle3cli.data.turns import encode
from eagle3cli.decode.generator import SpecSettings, n_alpha, speculative_generate
from eagle3cli.evaluate.measure import hf_generate
from eagle3cli.evaluate.tasks import load_turns_file
from eagle3cli.model.target import TargetSpec, load_target, load_tokenizer
from eagle3cli.publish.export import load_draft


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True, help="turns JSONL (first turns are used)")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--tree", default="8,4,4", help="TOTAL,DEPTH,TOPK for the tree run")
    ap.add_argument("--steps", type=int, default=3, help="chain length")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    spec = TargetSpec(model=a.model)
    target, tok = load_target(spec), load_tokenizer(spec)
    draft, _ = load_draft(a.draft, target=target)
    prompts = [encode(tok, [{"role": "user", "content": p.turns[0]}]) for p in load_turns_file(a.prompts, a.limit)]
    total, depth, top_k = (int(x) for x in a.tree.split(","))
    methods = {
        "plain": None,
        f"tree {total},{depth},{top_k}": SpecSettings(mode="tree", total_tokens=total, depth=depth, top_k=top_k,
                                                      max_new_tokens=a.max_new_tokens),
        f"chain {a.steps}": SpecSettings(mode="chain", steps=a.steps, max_new_tokens=a.max_new_tokens),
    }
    # same warm-up for every method
    for s in methods.values():
        if s is None:
            hf_generate(target, prompts[0], 16)
        else:
            speculative_generate(target, draft, prompts[0], SpecSettings(**{**s.__dict__, "max_new_tokens": 16}))
    report, reference = {}, []
    for name, s in methods.items():
        toks, secs, outs, mism = 0, 0.0, [], []
        for i, ids in enumerate(prompts):
            t0 = time.perf_counter()
            if s is None:
                out = hf_generate(target, ids, a.max_new_tokens)
                reference.append(out)
            else:
                o = speculative_generate(target, draft, ids, s)
                outs.append(o)
                out = o.tokens
                if out != reference[i]:
                    mism.append(i)
            secs += time.perf_counter() - t0
            toks += len(out)
        r = {"tokens_per_s": toks / secs, "tokens": toks}
        if outs:
            fwd = sum(o.forwards for o in outs)
            r["tau"] = sum(o.decode_tokens for o in outs) / fwd
            r["cycle_ms"] = {k: 1000 * sum(o.times[k] for o in outs) / fwd for k in ("draft", "verify", "bookkeeping")}
            r["mismatches"] = mism
            if s.mode == "chain":
                r["n_alpha"] = n_alpha(outs)
        report[name] = r
        print(name, json.dumps(r), flush=True)
    base = report["plain"]["tokens_per_s"]
    print(f"\n{'method':<16}{'tok/s':>8}{'speedup':>9}{'tau':>6}  cycle ms (draft / verify / bookkeeping)")
    for name, r in report.items():
        cyc = " / ".join(f"{v:.1f}" for v in r["cycle_ms"].values()) if "cycle_ms" in r else "-"
        print(f"{name:<16}{r['tokens_per_s']:>8.2f}{r['tokens_per_s'] / base:>8.2f}x{r.get('tau', 1.0):>6.2f}  {cyc}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"model": a.model, "draft": a.draft, "threads": torch.get_num_threads(),
                       "max_new_tokens": a.max_new_tokens, "prompts": len(prompts), "methods": report}, f, indent=2)


if __name__ == "__main__":
    main()
