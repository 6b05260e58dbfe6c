"""How fast `eagle3 gen-data` regenerates answers locally, against HF generate and the hardware.

    python benchmarks/regen_throughput.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct \
        --data ~/.cache/eagle3/data/sharegpt_v3.jsonl --conversations 32 --batch-size 32 \
        --max-new-tokens 128 --max-length 512 --threads 2

The first user turn of each of the first N conversations, rendered with the chat template,
sorted by length and batched as gen-data batches them, is answered twice in one process on
the same weights: by ``regenerate.generate_batch`` (what gen-data runs: finished rows leave
the batch) and by HF ``generate`` on the same batches (what gen-data ran before). Both are
greedy, so their answers are compared too. Generated tokens/s include the prefill, as
gen-data pays it. The bound is one batched decode step (``batch`` rows of one new token after
a prefix of the batch's mean prompt length): what generation would cost if every step were
full and prefill were free.
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3cli.chat_mask import end_of_turn_ids, render
from eagle3cli.regenerate import GenSettings, generate_batch, left_padded, prompt_turns
from eagle3cli.sources import load_conversations
from eagle3cli.target import TargetSpec, load_target, load_tokenizer


def decode_step_bound(model, batch: int, prefix: int, repeats: int = 5) -> float:
    """Tokens/s of one decode step of ``batch`` rows after ``prefix`` cached tokens."""
    from transformers import DynamicCache

    ids = torch.randint(100, 1000, (batch, prefix))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True, logits_to_keep=1)
            ts.append(time.perf_counter() - t0)
            cache.crop(-1)
    return batch / sorted(ts)[len(ts) // 2]


def hf_generate_batch(model, prompts, settings, stops, pad_id):
    """The previous gen-data loop: HF generate on the left-padded batch, cut at the stop."""
    ids, attn = left_padded(prompts, pad_id)
    width = ids.shape[1]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=settings.max_new_tokens,
                             eos_token_id=sorted(stops), pad_token_id=pad_id, do_sample=False, temperature=None,
                             top_p=None, top_k=None)
    res = []
    for r in range(len(prompts)):
        new = out[r, width:].tolist()
        cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
        res.append(new[:cut])
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = TargetSpec(args.model)
    model, tok = load_target(spec), load_tokenizer(spec)
    convs, _ = load_conversations(args.data, max_samples=args.conversations, need_answers=False)
    prompts = []
    for c in convs:
        system, users = prompt_turns(c.messages)
        ids = tok(render(tok, system + [{"role": "user", "content": users[0]}], add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        if len(ids) < args.max_length:
            prompts.append(ids)
    prompts.sort(key=len)
    settings = GenSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    stops = end_of_turn_ids(tok) | {tok.eos_token_id}
    batches = [prompts[b:b + args.batch_size] for b in range(0, len(prompts), args.batch_size)]
    rates, answers = {}, {}
    for name in ("generate_batch", "hf_generate"):
        t0, c0, n, outs = time.perf_counter(), time.process_time(), 0, []
        for batch in batches:
            if name == "generate_batch":
                got = [ids for ids, _ in generate_batch(model, batch, settings, stops, tok.pad_token_id)]
            else:
                got = hf_generate_batch(model, batch, settings, stops, tok.pad_token_id)
            n += sum(len(g) for g in got)
            outs += got
        rates[name] = (n, time.perf_counter() - t0, time.process_time() - c0)
        answers[name] = outs
    bound = decode_step_bound(model, min(args.batch_size, len(prompts)),
                              int(sum(map(len, prompts)) / max(1, len(prompts))))
    same = sum(a == b for a, b in zip(answers["generate_batch"], answers["hf_generate"]))
    print(f"{len(prompts)} first-turn prompts (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens), "
          f"batch {args.batch_size}, max_new_tokens {args.max_new_tokens}, {torch.get_num_threads()} threads")
    for name, (n, wall, cpu) in rates.items():
        print(f"{name:>15}: {n} tokens in {wall:.1f} s wall ({cpu:.1f} s CPU): {n / wall:.1f} tokens/s, "
              f"{n / bound / wall:.2f} of the bound")
    g, h = rates["generate_batch"], rates["hf_generate"]
    print(f"bound (one full batch decode step): {bound:.1f} tokens/s; generate_batch / hf_generate: "
          f"{(g[0] / g[1]) / (h[0] / h[1]):.2f}x; identical answers: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
