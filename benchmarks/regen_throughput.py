"""How fast `eagle3 gen-data` regenerates answers locally, against the static-batch loop and the hardware.

    python benchmarks/regen_throughput.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct \
        --data ~/.cache/eagle3/data/sharegpt_v3.jsonl --conversations 128 --batch-size 32 \
        --max-new-tokens 128 --max-length 512 --threads 2 [--regen-dtype float32] [--agreement 64]

The first N conversations are regenerated whole (every user turn, as gen-data does) twice in
one process on the same weights: by continuous batching (``batch_decode``, what gen-data runs
for Llama/Mistral/Qwen targets: ``batch-size`` conversations in flight, a finished one
replaced at once, a conversation's next turn prefilled onto what its slot holds) and by the
static-batch loop (``regenerate.generate_batch``: turn by turn, left-padded batches, finished
rows leave the batch). Both are greedy, so their answers are compared too. Generated tokens/s
include every prefill, as gen-data pays it. The bound is one full decode step (``batch`` rows
of one new token after a prefix of the mean first-prompt length) on the same slotted cache:
what generation would cost if every step were full and prefills were free. ``--static-only``
and ``--skip-static`` run one side.

``--one-at-a-time R``: instead, continuous batching with ``batch-size`` slots against the same
regeneration one conversation at a time (one slot: greedy decoding of each conversation alone),
alternated R rounds in one process; medians, the per-round ratio, and whether every conversation
came out token for token the same (fp32 on the native kernels: it must).

``--regen-dtype`` is gen-data's: auto computes an fp32 target's regeneration in bfloat16 on a CPU
with native bf16 matmuls (AVX512-BF16 or AMX). ``--agreement N`` measures how faithful such answers are to the
target at its own dtype: teacher-forced on the first N first-turn answers, how often its greedy token is the
regenerated one (answers regenerated at the target's own dtype give about 1.0).
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3cli.data.chat_mask import end_of_turn_ids, render
from eagle3cli.data.regen_rate import hf_step_seconds
from eagle3cli.data.regenerate import GenSettings, prompt_turns, regen_dtype, regenerate_local
from eagle3cli.data.sources import load_conversations
from eagle3cli.decode.batch_decode import SlotTarget
from eagle3cli.model.target import TargetSpec, load_target, load_tokenizer, model_device


def slot_step_bound(model, batch: int, prefix: int, dtype=None, repeats: int = 5) -> float:
    """Tokens/s of one decode step of ``batch`` slots after ``prefix`` cached tokens each."""
    target = SlotTarget(model, batch, prefix + 1, dtype=dtype)
    for s in range(batch):
        target.prefill(s, torch.randint(100, 1000, (prefix,)).tolist(), 0)
    tokens, lengths = torch.randint(100, 1000, (batch,)), torch.full((batch,), prefix)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        target.decode(tokens, lengths)
        ts.append(time.perf_counter() - t0)
    return batch / sorted(ts)[len(ts) // 2]


def decode_step_bound(model, batch: int, prefix: int, repeats: int = 5) -> float:
    """Tokens/s of one decode step of ``batch`` rows after ``prefix`` cached tokens."""
    return batch / hf_step_seconds(model, prefix, rows=batch, repeats=repeats)


def agreement(model, tok, conversations) -> tuple[float, int]:
    """How often the target's greedy next token (teacher-forced) is the regenerated first answer's token."""
    hits = total = 0
    for msgs in conversations:
        turn = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if turn is None or not msgs[turn].get("token_ids"):
            continue
        prompt = tok(render(tok, [{"role": m["role"], "content": m["content"]} for m in msgs[:turn]],
                            add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        answer = msgs[turn]["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
        hits += int((logits.argmax(-1) == torch.tensor(answer)).sum())
        total += len(answer)
    return hits / max(1, total), total


def one_at_a_time(model, tok, msgs, settings: GenSettings, stops, rounds: int) -> None:
    """Generated tokens/s of continuous batching against one slot, alternated ``rounds`` times."""
    import dataclasses
    import statistics

    from eagle3cli.decode import native

    sides = {f"{settings.batch_size} slots": settings, "one at a time": dataclasses.replace(settings, batch_size=1)}
    rates = {k: [] for k in sides}
    answers = {}
    for r in range(rounds):
        for name, st in sides.items():
            t0 = time.perf_counter()
            answers[name], stats = regenerate_local(model, tok, msgs, st, stops, continuous=True)
            rates[name].append(stats.generated_tokens / (time.perf_counter() - t0))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tokens/s" for k, v in rates.items()), flush=True)
    (a, ra), (b, rb) = rates.items()
    same = sum(x == y for x, y in zip(answers[a], answers[b]))
    print(f"\n{len(msgs)} conversations, {stats.answers} answers, {stats.generated_tokens} tokens a run, "
          f"max_new_tokens {settings.max_new_tokens}, {torch.get_num_threads()} threads, regeneration in "
          f"{settings.dtype}, native kernels: {native.status()}; medians of {rounds} alternated rounds\n")
    print("| decoding | generated tokens/s | x one at a time |\n|---|---|---|")
    for name, ts in rates.items():
        print(f"| {name} | {statistics.median(ts):.1f} | {statistics.median([x / y for x, y in zip(ts, rb)]):.2f} |")
    print(f"\nconversations token for token the same: {same}/{len(msgs)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--conversations", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="the target's dtype, as gen-data's --dtype")
    ap.add_argument("--regen-dtype", default="auto", help="what regeneration computes in, as gen-data's --regen-dtype")
    ap.add_argument("--agreement", type=int, default=0, metavar="N",
                    help="teacher-force the target at --dtype on the first N first-turn answers and print how "
                         "often its greedy token is the regenerated one")
    ap.add_argument("--skip-static", action="store_true", help="only continuous batching")
    ap.add_argument("--one-at-a-time", type=int, default=0, metavar="R",
                    help="continuous batching against one slot, alternated R rounds (no static loop)")
    ap.add_argument("--static-only", action="store_true", help="only the static-batch loop")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = TargetSpec(args.model, dtype=args.dtype)
    model, tok = load_target(spec), load_tokenizer(spec)
    convs, _ = load_conversations(args.data, max_samples=args.conversations, need_answers=False)
    msgs = [c.messages for c in convs]
    firsts = []
    for m in msgs:
        system, users = prompt_turns(m)
        if users:
            firsts.append(len(tok(render(tok, system + list(users[0]),  # a turn: its user (and tool) messages
                                         add_generation_prompt=True), add_special_tokens=False)["input_ids"]))
    own = next(model.parameters()).dtype
    dtype = regen_dtype(args.regen_dtype, model.config, model_device(model).type, own)
    settings = GenSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, max_length=args.max_length,
                           dtype=dtype)
    stops = end_of_turn_ids(tok) | {tok.eos_token_id}
    if args.one_at_a_time:
        return one_at_a_time(model, tok, msgs, settings, stops, args.one_at_a_time)
    sides = [("continuous", True), ("static", False)]
    if args.skip_static:
        sides = sides[:1]
    if args.static_only:
        sides = sides[1:]
    if getattr(torch, dtype) != own and ("static", False) in sides:
        print(f"(the static-batch loop computes in the model's {own} only: run it with --regen-dtype "
              f"{str(own).removeprefix('torch.')}; skipped)")
        sides = [x for x in sides if x[0] != "static"]
    rates, answers = {}, {}
    for name, continuous in sides:
        t0, c0 = time.perf_counter(), time.process_time()
        answers[name], stats = regenerate_local(model, tok, msgs, settings, stops, continuous=continuous)
        rates[name] = (stats.generated_tokens, time.perf_counter() - t0, time.process_time() - c0, stats)
    mean_prompt = int(sum(firsts) / max(1, len(firsts)))
    with torch.no_grad():
        bound = slot_step_bound(model, args.batch_size, mean_prompt, getattr(torch, dtype))
        hf_bound = decode_step_bound(model, args.batch_size, mean_prompt)
    print(f"{len(msgs)} conversations (first prompts: mean {mean_prompt} tokens), batch {args.batch_size}, "
          f"max_new_tokens {args.max_new_tokens}, max_length {args.max_length}, {torch.get_num_threads()} threads, "
          f"target {own}, regeneration in {dtype}")
    for name, (n, wall, cpu, st) in rates.items():
        print(f"{name:>11}: {st.answers} answers ({st.cut} cut), {n} tokens in {wall:.1f} s wall ({cpu:.1f} s CPU): "
              f"{n / wall:.1f} tokens/s, {n / wall / bound:.2f} of the bound")
    print(f"bound: one full decode step of {args.batch_size} slots after {mean_prompt} tokens: {bound:.1f} tokens/s "
          f"(HF forward with DynamicCache: {hf_bound:.1f})")
    for name in answers if args.agreement else ():
        agree, n = agreement(model, tok, answers[name][:args.agreement])
        print(f"{name:>11}: the target in {own}, teacher-forced on {n} first-turn answer tokens, picks the "
              f"regenerated token at {agree:.4f} of them")
    if len(rates) == 2:
        (n1, w1, *_), (n2, w2, *_) = rates["continuous"], rates["static"]
        same = sum(a == b for a, b in zip(answers["continuous"], answers["static"]))
        print(f"continuous / static: {(n1 / w1) / (n2 / w2):.2f}x; identical conversations: {same}/{len(msgs)}")


if __name__ == "__main__":
    main()
