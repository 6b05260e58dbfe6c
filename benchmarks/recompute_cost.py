"""CPU cost of TTT recompute: the draft's forward + backward with and without it.

    python benchmarks/recompute_cost.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct \
        --tokens 1024 --rows 512 --repeats 3

Builds the draft of the target's config.json (random weights: the cost does not depend on the
values) and times the TTT unroll's forward and backward (no teacher, no optimizer: those cost the
same either way) with ``recompute`` on and off, interleaved in one process. Prints tokens per CPU
second (process time, which other jobs on a shared machine do not distort) and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(model: str, draft_vocab: int, rows: int, tokens: int, steps: int):
    from transformers import AutoConfig

    from eagle3cli.model.draft import DraftConfig, Eagle3Draft
    from eagle3cli.model.layers import choose_layers
    from eagle3cli.train.ttt import TTTModel

    tcfg = AutoConfig.from_pretrained(model)
    dcfg = DraftConfig.from_target(tcfg, draft_vocab, choose_layers(tcfg, warn=False).ids)
    draft = Eagle3Draft(dcfg)
    draft.init_weights(seed=0)
    draft.set_vocab(torch.arange(draft_vocab))
    g = torch.Generator().manual_seed(0)
    b = max(1, tokens // rows)
    batch = (torch.randint(0, draft_vocab, (b, rows), generator=g),
             torch.randn(b, rows, 3 * dcfg.target_hidden_size, generator=g),
             torch.ones(b, rows, dtype=torch.bool),
             torch.softmax(torch.randn(b, rows, draft_vocab, generator=g), -1),
             torch.randint(0, draft_vocab, (b, rows), generator=g))
    models = {on: TTTModel(draft, steps, 0.8, recompute=on) for on in (True, False)}
    return models, batch, b * rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="target folder (only its config.json is read)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch")
    ap.add_argument("--rows", type=int, default=512, help="sequence length (tokens // rows sequences)")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab-size", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    models, batch, tokens = build(args.model, args.draft_vocab_size, args.rows, args.tokens, args.ttt_steps)
    cpu = {True: [], False: []}
    for _ in range(args.repeats + 1):  # the first round warms the allocator up and is not counted
        for on, model in models.items():
            model.zero_grad(set_to_none=True)
            t = time.process_time()
            model(*batch).loss.backward()
            cpu[on].append(time.process_time() - t)
    for on in (True, False):
        med = statistics.median(cpu[on][1:])
        print(f"recompute {'on ' if on else 'off'}: {med:.2f} CPU-s per micro-batch, {tokens / med:.1f} tokens/CPU-s",
              flush=True)
    print(f"recompute costs {statistics.median(cpu[True][1:]) / statistics.median(cpu[False][1:]):.2f}x "
          f"({tokens} tokens, {args.ttt_steps} steps, draft vocab {args.draft_vocab_size})")


if __name__ == "__main__":
    main()
