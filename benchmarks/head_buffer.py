"""The fused LM heads with one logits buffer for every chunk against a fresh output per chunk.

    python benchmarks/head_buffer.py                  # EAGLE-3's soft-target head and DFlash's, SmolLM2 shapes
    python benchmarks/head_buffer.py --reps 9 --rows 7168

``ttt.HeadSoftCrossEntropy`` (EAGLE-3: the draft's head against the target's distributions, the
rows of every TTT step at once) and ``dflash_loss.HeadCrossEntropy`` (DFlash: the target's frozen
head against its argmax) compute their logits a chunk of rows at a time, in fp32 where training
runs in fp32 (a CPU without native bf16, or ``--mixed-precision no``). ``ttt.logits_buffer`` gives
every chunk one buffer; without it each chunk's GEMM writes a fresh [chunk x vocab] tensor, whose
pages the allocator returns to the system and faults in again. Forward + backward of each head,
the two settings interleaved, one thread, the median CPU-seconds over --reps, and whether the two
give bitwise equal losses and gradients. The CPU class is printed first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagle3cli.core.hardware import cpu_class
from eagle3cli.train import dflash_loss, ttt


def soft_head(h, w, probs, prow):
    out = ttt.head_soft_cross_entropy(h, w, probs, prow)
    return out.loss, torch.autograd.grad(out.loss, (h, w))


def argmax_head(h, w, labels):
    ce, _ = dflash_loss.HeadCrossEntropy.apply(h, w, labels, True, dflash_loss.head_chunk(w.shape[0]))
    loss = ce.sum()
    return loss, torch.autograd.grad(loss, (h,))


def timed(fn, reuse: bool):
    """CPU-seconds of ``fn`` with the buffer on or off, and its outputs."""
    saved = ttt.logits_buffer
    if not reuse:
        ttt.logits_buffer = dflash_loss.logits_buffer = lambda *a: None
    try:
        t0 = time.process_time()
        out = fn()
        return time.process_time() - t0, out
    finally:
        ttt.logits_buffer = dflash_loss.logits_buffer = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3584, help="drafted rows a step (512 blocks of 8; 7 TTT steps of 512)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--draft-vocab", type=int, default=32000, help="EAGLE-3's draft vocabulary")
    ap.add_argument("--vocab", type=int, default=49152, help="the target's vocabulary (DFlash's head)")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_class()}; one thread; {a.rows} rows, hidden {a.hidden}")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.rows, a.hidden, generator=g, requires_grad=True)
    w_draft = (torch.randn(a.draft_vocab, a.hidden, generator=g) * 0.02).requires_grad_()
    probs = torch.softmax(torch.randn(a.rows, a.draft_vocab, generator=g) * 3, -1)
    prow = torch.randperm(a.rows, generator=g)
    w_target = torch.randn(a.vocab, a.hidden, generator=g) * 0.02
    labels = torch.randint(0, a.vocab, (a.rows,), generator=g)
    cases = {f"EAGLE-3 soft head ({a.draft_vocab:,} tokens)": lambda: soft_head(h, w_draft, probs, prow),
             f"DFlash argmax head ({a.vocab:,} tokens)": lambda: argmax_head(h, w_target, labels)}
    print("\n| head | fresh output CPU-s | one buffer CPU-s | ratio | bitwise equal |")
    print("|---|---|---|---|---|")
    for name, fn in cases.items():
        times = {True: [], False: []}
        outs = {}
        timed(fn, True)  # warm-up: first-touch of the weights, the allocator's pools
        for _ in range(a.reps):
            for reuse in (False, True):
                dt, outs[reuse] = timed(fn, reuse)
                times[reuse].append(dt)
        (l0, g0), (l1, g1) = outs[False], outs[True]
        equal = torch.equal(l0, l1) and all(torch.equal(x, y) for x, y in zip(g0, g1))
        fresh, buf = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {name} | {fresh:.3f} | {buf:.3f} | {fresh / buf:.2f}x | {'yes' if equal else 'no'} |")


if __name__ == "__main__":
    main()
