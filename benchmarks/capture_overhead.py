"""What capturing the draft's features costs over a bare forward of the same target.

    python benchmarks/capture_overhead.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct

Times, on the same batch, interleaved and repeated (median):
  bare     the decoder forward as gen-data would run it without capture (no LM head, no cache)
  capture  eagle3cli.model.target.capture: the same forward with output_hidden_states, the three
           streams concatenated, plus the cast to the stored dtype (bf16) as gen-data does
  full     the whole model with its LM head (logits), for reference
and prints the ratio capture / bare (goal: <= 1.10).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagle3cli.model.layers import choose_layers
from eagle3cli.model.target import TargetSpec, base_model, capture, load_target


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): on a shared CPU the second is the one to
    trust, since other processes stretch wall time at random."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    model = load_target(TargetSpec(args.model, device=args.device, dtype=args.dtype))
    layers = choose_layers(model.config).ids
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.length), generator=g).to(device)
    attn = torch.ones_like(ids)
    decoder = base_model(model)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @torch.no_grad()
    def bare():
        decoder(input_ids=ids, attention_mask=attn, use_cache=False, return_dict=True)
        sync()

    @torch.no_grad()
    def cap():
        aux, final = capture(model, ids, layers, attn)
        aux.to(torch.bfloat16), final.to(torch.bfloat16)
        sync()

    @torch.no_grad()
    def full():
        model(input_ids=ids, attention_mask=attn, use_cache=False)
        sync()

    runs = {"bare": bare, "capture": cap, "full": full}
    for fn in runs.values():  # warm-up
        fn()
    times = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved, so load changes hit all three alike
        for k, fn in runs.items():
            times[k].append(timed(fn))
    tokens = args.batch * args.length
    print(f"model {args.model}  layers {list(layers)}  batch {args.batch} x {args.length} tokens  "
          f"device {device}  dtype {next(model.parameters()).dtype}  threads {torch.get_num_threads()}")
    clocks = ["wall"] + (["cpu"] if device.type == "cpu" else [])
    for c, clock in enumerate(clocks):
        med = {k: statistics.median(t[c] for t in v) for k, v in times.items()}
        for k in runs:
            print(f"{clock:4s} {k:8s} median {med[k] * 1000:8.1f} ms  ({tokens / med[k]:,.0f} tok/s)  "
                  f"runs: {', '.join(f'{t[c] * 1000:.0f}' for t in times[k])}")
        print(f"{clock:4s} capture / bare = {med['capture'] / med['bare']:.3f}   "
              f"capture / full = {med['capture'] / med['full']:.3f}")


if __name__ == "__main__":
    main()
