"""The acceptance an EAGLE-3 draft needs to pay inside llama.cpp, per target and draft type, measured.

    python benchmarks/llamacpp_tau_needed.py --llama-cpp LLAMA_CPP --model $SMOL --draft DRAFT_DIR \
        [--targets f32,bf16,f16,q8_0] [--drafts f32,f16,q8_0] [--n-max 1,3] [-n 64] [--threads 2] \
        [--rounds 2] [--json out.json]

A speculative cycle in llama.cpp costs one verification of K+1 tokens plus K draft steps and its
bookkeeping; it emits tau tokens where a plain step emits one, so the draft pays exactly when
tau > cycle ms / plain step ms. Both costs are measured here with llama.cpp's own tools
(``llama-bench -p 0 -n N`` for the plain step, ``llama-speculative-simple --spec-type
draft-eagle3 --ignore-eos`` on a chat prompt for the cycle: benchmarks/llamacpp_bench.py parses it), for
each target type the converter writes (the target converted once into the eagle3 cache) and each draft type
(``eagle3 export-gguf`` of DRAFT_DIR). A cycle's cost does not depend on what the draft proposes,
so any draft of the right shape measures it (an untrained one accepts nothing: every cycle then
runs its full K drafts and K+1 verified tokens). Plain and speculative runs alternate, --rounds
times, and the medians are kept: a shared machine's load drifts between them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llamacpp_bench import plain_tps, prompts, run_spec, summarize  # noqa: E402

from eagle3cli.evaluate.llamacpp import find_binary  # noqa: E402
from eagle3cli.evaluate.llamacpp_baseline import cached_target_gguf  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", required=True)
    ap.add_argument("--model", required=True, help="the target's HF folder")
    ap.add_argument("--draft", required=True, help="an eagle3 draft folder for that target")
    ap.add_argument("--targets", default="f32,bf16,f16,q8_0")
    ap.add_argument("--drafts", default="f32,f16,q8_0")
    ap.add_argument("--n-max", default="1,3")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="llamacpp-gguf", help="where the draft GGUFs go")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from eagle3cli.publish.gguf_export import export_gguf

    bench, spec = find_binary("llama-bench", a.llama_cpp), find_binary("llama-speculative-simple", a.llama_cpp)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(a.model).apply_chat_template(
        [{"role": "user", "content": prompts(None, 1, None)[0]}], tokenize=False, add_generation_prompt=True)
    drafts = {d: export_gguf(a.draft, a.out, d, target_dir=a.model, llama_cpp=a.llama_cpp)[0]["draft"]
              for d in a.drafts.split(",")}
    rows = []
    for t in a.targets.split(","):
        target = cached_target_gguf(a.model, t, a.llama_cpp, log=lambda m: None)
        for d, draft in drafts.items():
            for k in [int(x) for x in a.n_max.split(",")]:
                plains, runs = [], []
                for _ in range(a.rounds):
                    plains.append(plain_tps(bench, target, a.n, a.threads, 1))
                    runs.append(run_spec(spec, target, draft, prompt, a.n, a.threads, k, 0.0, ["--ignore-eos"]))
                plain = statistics.median(plains)
                s = summarize(runs, plain, k)
                row = {"target": t, "draft": d, "n_max": k, "plain_tps": plain, "plain_step_ms": s["plain_step_ms"],
                       "cycle_ms": s["cycle_ms"], "verify_ms": s["verify_ms"], "draft_other_ms": s["draft_other_ms"],
                       "tau_needed": s["cycle_over_step"], "cmd": runs[0]["cmd"]}
                rows.append(row)
                print(f"target {t}, draft {d}, K {k}: plain {plain:.1f} tok/s ({row['plain_step_ms']:.1f} ms); cycle "
                      f"{row['cycle_ms']:.1f} ms = verify {row['verify_ms'] or float('nan'):.1f} + draft/other "
                      f"{row['draft_other_ms'] or float('nan'):.1f}: pays above tau {row['tau_needed']:.2f}",
                      flush=True)
    print(f"\n{a.n} tokens, {a.threads} threads, medians of {a.rounds} alternating rounds\n")
    print("| target | draft | K | plain tok/s | cycle ms (verify + draft/other) | pays above tau |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['draft']} | {r['n_max']} | {r['plain_tps']:.1f} | {r['cycle_ms']:.1f} "
              f"({r['verify_ms'] or float('nan'):.1f} + {r['draft_other_ms'] or float('nan'):.1f}) | "
              f"**{r['tau_needed']:.2f}** |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
