"""How fast `eagle3 gen-data` regenerates answers locally, against what the hardware allows.

    python benchmarks/regen_throughput.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct \
        --data ~/.cache/eagle3/data/sharegpt_v3.jsonl --conversations 32 --batch-size 32 \
        --max-new-tokens 128 --max-length 512 --threads 2

Runs the same ``regenerate_local`` that gen-data runs on the first N conversations of the
file (all their turns) and prints generated tokens/s (prefill included, as gen-data pays
it). The bound is one batched decode step: ``batch`` rows of one new token each after a
prefix of the batch's mean prompt length, i.e. what generation would cost if every step
were full and prefill were free. The ratio says how close the loop gets to that.
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3cli.chat_mask import end_of_turn_ids
from eagle3cli.regenerate import GenSettings, regenerate_local
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
    settings = GenSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                           max_length=args.max_length)
    stops = end_of_turn_ids(tok) | {tok.eos_token_id}
    t0, c0 = time.perf_counter(), time.process_time()
    _, stats = regenerate_local(model, tok, [c.messages for c in convs], settings, stops)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rate = stats.generated_tokens / wall
    bound = decode_step_bound(model, min(args.batch_size, len(convs)), 256)
    print(f"{len(convs)} conversations, {stats.answers} answers ({stats.cut} cut at --max-new-tokens), "
          f"{stats.generated_tokens} generated tokens in {wall:.1f} s wall, {cpu:.1f} s CPU")
    print(f"generated tokens/s: {rate:.1f}   bound (one batch-{args.batch_size} decode step): {bound:.1f}   "
          f"ratio {rate / bound:.2f}")


if __name__ == "__main__":
    main()
