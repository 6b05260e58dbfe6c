"""Does llama.cpp serve our DFlash draft as we do? Accepted-token counts of llama.cpp's DFlash
decoding against our generator's on the same prompts, greedy, the same draft (docs/benchmarks.md).

    python benchmarks/dflash_llamacpp_agreement.py --draft runs/dfe/dflash-b8-4m-s0/draft \
        --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct --llama-cpp DIR \
        --target-gguf target-f32.gguf --draft-gguf draft-f32.gguf [--n-max 7] [-n 64] [--limit 3]

The GGUFs come from `eagle3 export-gguf DRAFT --model TARGET --llama-cpp DIR --with-target --outtype f32`
(llama.cpp's own convert_hf_to_gguf.py). llama.cpp: ``llama-speculative-simple -m T -md D
--spec-type draft-dflash --spec-draft-n-max K -n N --temp 0 -t 1`` per prompt (the chat-formatted
text, tokenized by llama.cpp itself); it prints n_drafted and n_accept. Ours: the same text
tokenized by the HF tokenizer, ``speculative_generate`` with a chain of K block tokens, fp32, the
target's HF forward. A prompt agrees when both generate the same text (llama.cpp decodes one token
more than -n: ours must be inside its output) and accept the same number of drafted tokens. One
thread each; run it under the heavy-job lock.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llamacpp_bench import parse_spec  # noqa: E402
from eagle3cli.evaluate.llamacpp import find_binary  # noqa: E402


def chat_texts(path: Path, limit: int, tokenizer) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:limit]
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=False,
                                          add_generation_prompt=True) for r in rows]


def run_llamacpp(binary: Path, target: Path, draft: Path, text: str, n: int, n_max: int) -> dict:
    cmd = [str(binary), "-m", str(target), "-md", str(draft), "--spec-type", "draft-dflash",
           "--spec-draft-n-max", str(n_max), "-p", text, "-n", str(n), "-t", "1", "-td", "1", "--temp", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"llama-speculative-simple failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    r = parse_spec(proc.stderr + proc.stdout)
    r["text"] = proc.stdout
    return r


def run_ours(target, draft, tokenizer, text: str, n: int, n_max: int) -> dict:
    import torch

    from eagle3cli.decode.generator import speculative_generate

    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    out = speculative_generate(target, draft, ids, mode="chain", steps=n_max, max_new_tokens=n,
                               eos_token_id=tokenizer.eos_token_id)
    accepted = sum(a - 1 for a in out.accept_lengths)
    return {"tokens": out.tokens, "n_accept": accepted, "n_drafted": sum(out.drafted), "cycles": out.forwards,
            "text": tokenizer.decode(out.tokens, skip_special_tokens=False), "tau": out.tau}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-cpp", required=True)
    ap.add_argument("--target-gguf", required=True)
    ap.add_argument("--draft-gguf", required=True)
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1] / "eagle3cli/prompts/mt_bench.jsonl"))
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--n-max", type=int, default=None, help="default: the draft's block size - 1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3cli.publish.export import load_draft

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    target = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    draft, _ = load_draft(args.draft, target=target, dtype=torch.float32)
    n_max = args.n_max or draft.config.block_size - 1
    binary = find_binary("llama-speculative-simple", llama_cpp=args.llama_cpp)
    rows = []
    for i, text in enumerate(chat_texts(Path(args.prompts), args.limit, tok)):
        ll = run_llamacpp(binary, Path(args.target_gguf), Path(args.draft_gguf), text, args.n, n_max)
        ours = run_ours(target, draft.eval(), tok, text, args.n, n_max)
        # llama.cpp prints the prompt, then n+1 tokens: ours (n tokens) must be inside that text
        same_text = ours["text"].replace("<|im_end|>", "").strip() in ll["text"]
        row = {"prompt": i, "llamacpp_accept": ll["n_accept"], "llamacpp_drafted": ll["n_drafted"],
               "llamacpp_decoded": ll["decoded"], "llamacpp_tok_s": ll["speed"], "ours_accept": ours["n_accept"],
               "ours_drafted": ours["n_drafted"], "ours_cycles": ours["cycles"], "ours_tokens": len(ours["tokens"]),
               "ours_tau": ours["tau"], "same_text": same_text}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"llama.cpp command: {binary} -m T -md D --spec-type draft-dflash "
          f"--spec-draft-n-max {n_max} -n {args.n} -t 1 --temp 0")
    agree = sum(r["llamacpp_accept"] == r["ours_accept"] for r in rows)
    print(f"accepted counts equal on {agree}/{len(rows)} prompts")
    if args.json:
        Path(args.json).write_text(json.dumps({"n_max": n_max, "n": args.n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
