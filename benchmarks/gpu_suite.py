"""The generator and trainer on one GPU, at a real model's geometry, with nothing downloaded.

    python benchmarks/gpu_suite.py                      # Llama-3.1-8B geometry, bf16, on cuda
    python benchmarks/gpu_suite.py --geometry tiny --device cpu --dtype float32   # what the tests run

Random weights with real geometry (acceptance does not matter here: the drafter is an
oracle that replays the target's own greedy continuation, so tau = depth + 1 is known and
the cycle's cost is measured at its best). Prints, each with its own time budget:

1. verify cost: one target forward of n new tokens after a prefix, n = 1..64, on the HF
   forward and on the fast path (fast_target), and each as a ratio to n = 1;
2. per-cycle overhead: chain cycles with the oracle, draft + bookkeeping as a share of the
   cycle, and the cycle's cost in plain decoding steps of the same path;
3. the EAGLE-3 draft's own step time at this geometry (one chain cycle of k drafted tokens);
4. online TTT-7 training: target capture + teacher + 7-step unroll + backward, tokens/s, and the
   FLOP/s it achieves against the torch.matmul peak measured at the step's own GEMM shapes in
   fp32 and bf16 (step_flops.py);
5. the DFlash cycle (docs/design.md §13): a 5-layer DFlash draft at this geometry drafts a block of
   16 in one forward and the target verifies its 15 tokens in one, on both paths; the drafter's
   block rows are replaced by the target's own continuation after the draft has run, so every
   block is accepted whole (tau = 16) and the cycle's cost is measured at its best.

The whole run takes about 2.5 minutes on one H200 (136 s at Llama-3.1-8B geometry in bf16).

"lossless" compares each chain run with the plain greedy run of the same path. It is bitwise only
in float32: on a GPU the GEMMs for one row and for k rows are different kernels, and random weights
give bf16 logits with exact top-2 ties, where the two runs may pick different tokens (and the
oracle's tau falls with them). ``--dtype float32`` is the losslessness check there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_flops, also when loaded by path (tests)
from step_flops import count_step, gemm_flops, matmul_peak  # noqa: E402

GEOMETRIES = {
    # meta-llama/Llama-3.1-8B-Instruct's config.json (geometry only)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                      rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5),
}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, repeats=5):
    fn()
    ts = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def build_target(geometry: str, device: str, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**GEOMETRIES[geometry])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval().requires_grad_(False)


class Replay:
    """A drafter that proposes the target's own greedy continuation (known in advance)."""

    def __init__(self, reference: list[int], vocab: int, device):
        self.ref, self.vocab, self.dev = reference, vocab, device

    def _onehot(self, k: int):
        out = torch.full((self.vocab,), float("-inf"), device=self.dev)
        out[self.ref[k] if k < len(self.ref) else 0] = 0.0
        return out

    def begin(self, input_ids):
        self.prompt, self.done = input_ids.shape[1], 0

    def observe(self, next_tokens, hidden_states):
        self.done += next_tokens.numel()
        return self._onehot(self.done - self.prompt + 1)

    def expand(self, tree, nodes):
        base = self.done - self.prompt + 1
        return torch.stack([self._onehot(base + tree.depths[i]) for i in nodes])

    def rollback(self):
        pass


def verify_curve(target, fast, prefix, sizes, dev):
    from eagle3cli.evaluate.tree_auto import verify_latency

    hf = verify_latency(target, prefix, sizes=sizes, repeats=5)
    out = {}
    past = prefix.shape[1]
    fast.forward(prefix[0], torch.arange(past, device=dev), 0)
    for n in sizes:
        ids = prefix[0, -n:] if n <= past else prefix[0, -1:].repeat(n)
        pos = torch.arange(past, past + n, device=dev)
        out[n] = timed(lambda: fast.forward(ids, pos, past), dev)
    return hf, out


def cycle_overhead(target, fast, prompt, steps, new_tokens, dev):
    from eagle3cli.decode.generator import greedy_generate, speculative_generate

    res = {}
    for name, f in (("hf", None), ("fast", fast)):
        ref = greedy_generate(target, prompt, new_tokens + steps + 2, eos_token_id=[-1], fast=f)
        plain = timed(lambda: greedy_generate(target, prompt, new_tokens, eos_token_id=[-1], fast=f), dev, 3)
        drafter = Replay(ref, target.config.vocab_size, dev)
        out = speculative_generate(target, drafter, prompt, mode="chain", steps=steps, max_new_tokens=new_tokens,
                                   eos_token_id=[-1], fast=f)
        t = out.times
        cycle = (t["draft"] + t["verify"] + t["bookkeeping"]) / out.forwards
        step = plain / new_tokens
        res[name] = {"tau": out.tau, "cycle_ms": 1000 * cycle, "plain_step_ms": 1000 * step,
                     "cycle_in_plain_steps": cycle / step,
                     "overhead_share": (t["draft"] + t["bookkeeping"]) / (t["draft"] + t["verify"] + t["bookkeeping"]),
                     "lossless": out.tokens == ref[:len(out.tokens)]}
    return res


def draft_step(target, prompt, steps, dev, dtype):
    from eagle3cli.decode.drafter import EagleDrafter
    from eagle3cli.decode.tree import build_greedy_tree
    from eagle3cli.model.draft import DraftConfig, Eagle3Draft
    from eagle3cli.model.layers import default_layer_ids

    cfg = DraftConfig.from_target(target.config, min(32000, target.config.vocab_size),
                                  default_layer_ids(target.config.num_hidden_layers))
    draft = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight.float().cpu())
    draft.init_weights(seed=0)
    draft = draft.to(device=dev, dtype=dtype).eval()
    drafter = EagleDrafter(draft)
    with torch.no_grad():
        out = target(input_ids=prompt, output_hidden_states=True)
        nxt = torch.cat([prompt[0, 1:], prompt[0, -1:]])

        def cycle():
            drafter.begin(prompt)
            logq = drafter.observe(nxt, out.hidden_states)
            build_greedy_tree(drafter, int(prompt[0, -1]), logq, steps, steps, 1)

        return timed(cycle, dev)


def dflash_draft(target, dev, dtype, block: int, layers: int = 5):
    """A DFlash draft of ``target``'s geometry: ``layers`` layers (the public drafts' 5), z-lab's
    streams (as many as the target's depth allows), the target's embedding and head. Default
    initialisation: the block rows are replaced by the replayed continuation anyway."""
    from eagle3cli.model.dflash import DFlashConfig, DFlashDraft
    from eagle3cli.model.layers import dflash_layer_ids

    n = target.config.num_hidden_layers
    cfg = DFlashConfig.from_target(target.config, dflash_layer_ids(n, min(5, n - 3)), block_size=block,
                                   mask_token_id=target.config.vocab_size - 1, num_hidden_layers=layers)
    with torch.device(dev):
        draft = DFlashDraft(cfg)
        inv_freq = draft.rotary.inv_freq
        draft = draft.to(dtype)
    draft.rotary.inv_freq = inv_freq  # RoPE's frequencies stay in float32, as the drafter keeps them
    draft.set_embedding(target.get_input_embeddings().weight)
    draft.set_head(target.get_output_embeddings().weight)
    return draft.eval().requires_grad_(False)


def dflash_cycles(target, fast, prompt, block, new_tokens, dev, dtype):
    """Chain cycles of a whole DFlash block (B - 1 drafted tokens) on the HF and the fast path."""
    from eagle3cli.decode.dflash_drafter import DFlashDrafter
    from eagle3cli.decode.generator import greedy_generate, speculative_generate

    class BlockReplay(DFlashDrafter):
        """Drafts each block for real, then proposes the target's own continuation in its rows."""

        def begin(self, input_ids=None):
            super().begin(input_ids)
            self.prompt = 0 if input_ids is None else input_ids.shape[1]

        def block_logq(self, aux_new, new_pos, anchor):
            real = super().block_logq(aux_new, new_pos, anchor)
            out = torch.full_like(real, float("-inf"))
            for i in range(real.shape[0]):  # row i + 1: the token at the anchor's position + i + 1
                k = self.verified + i + 1 - self.prompt
                out[i, self.ref[k] if k < len(self.ref) else 0] = 0.0
            return out

    draft = dflash_draft(target, dev, dtype, block)
    res = {}
    for name, f in (("hf", None), ("fast", fast)):
        ref = greedy_generate(target, prompt, new_tokens + block + 2, eos_token_id=[-1], fast=f)
        plain = timed(lambda: greedy_generate(target, prompt, new_tokens, eos_token_id=[-1], fast=f), dev, 3)
        drafter = BlockReplay(draft)
        drafter.ref = ref
        out = speculative_generate(target, drafter, prompt, mode="chain", steps=block - 1, max_new_tokens=new_tokens,
                                   eos_token_id=[-1], fast=f)
        t = out.times
        cycle = (t["draft"] + t["verify"] + t["bookkeeping"]) / out.forwards
        step = plain / new_tokens
        res[name] = {"tau": out.tau, "cycle_ms": 1000 * cycle, "draft_ms": 1000 * t["draft"] / out.forwards,
                     "verify_ms": 1000 * t["verify"] / out.forwards, "plain_step_ms": 1000 * step,
                     "cycle_in_plain_steps": cycle / step, "tokens_per_s": len(out.tokens) / (
                         t["prefill"] + t["draft"] + t["verify"] + t["bookkeeping"]),
                     "plain_tokens_per_s": new_tokens / plain, "lossless": out.tokens == ref[:len(out.tokens)]}
    return res


def ttt_training(target, seq_len, dev, dtype, repeats=3):
    from eagle3cli.model.draft import DraftConfig, Eagle3Draft
    from eagle3cli.model.layers import default_layer_ids
    from eagle3cli.model.target import capture
    from eagle3cli.train.ttt import TTTModel, teacher_from_final

    layers = default_layer_ids(target.config.num_hidden_layers)
    vocab = min(32000, target.config.vocab_size)
    cfg = DraftConfig.from_target(target.config, vocab, layers)
    draft = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight.float().cpu())
    draft.init_weights(seed=0)
    draft.set_vocab(torch.arange(vocab))
    draft = draft.to(dev)
    ttt = TTTModel(draft, 7)
    opt = torch.optim.AdamW([p for p in ttt.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, target.config.vocab_size, (1, seq_len), device=dev)
    mask = torch.ones(1, seq_len, dtype=torch.bool, device=dev)
    vocab_ids = torch.arange(vocab, device=dev)

    def step():
        with torch.no_grad():
            aux, final = capture(target, ids, layers)
            teacher = teacher_from_final(target, final, vocab_ids)
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            loss, *_ = ttt(ids, aux, mask, teacher.probs, teacher.index)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = timed(step, dev, repeats)
    flops, gemms = count_step(step)
    peak = matmul_peak(gemms, dev)
    return seq_len / seconds, {"flops_per_token": flops / seq_len, "gemm_share": gemm_flops(gemms) / flops,
                               "achieved_flop_s": flops / seconds,
                               "matmul_peak_flop_s": {dt: p["flop_s"] for dt, p in peak.items()}}


def run(geometry="llama3-8b", device="cuda", dtype="bfloat16", prefix=512, new_tokens=65, seq_len=2048,
        sizes=(1, 2, 4, 8, 16, 32, 64), steps=3, block=16) -> dict:
    from eagle3cli.decode.fast_target import FastTarget

    dt = getattr(torch, dtype)
    dev = torch.device(device)
    t0 = time.perf_counter()
    target = build_target(geometry, device, dt)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, vocab, (1, prefix), generator=g).to(dev)
    fast = FastTarget(target, prefix + new_tokens + max(*sizes, block) + 16, packed_rows=(1, steps + 1))
    result = {"geometry": geometry, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "dtype": dtype, "torch": torch.__version__}
    hf, fp = verify_curve(target, fast, prompt, sizes, dev)
    result["verify_ms"] = {"hf": {n: 1000 * v for n, v in hf.items()}, "fast": {n: 1000 * v for n, v in fp.items()}}
    result["cycles"] = cycle_overhead(target, fast, prompt, steps, new_tokens, dev)
    result["draft_cycle_ms"] = 1000 * draft_step(target, prompt, steps, dev, dt)
    result["ttt7_tokens_per_s"], result["ttt7_flops"] = ttt_training(target, seq_len, dev, dt)
    result["dflash_block"] = block
    result["dflash_cycles"] = dflash_cycles(target, fast, prompt, block, new_tokens, dev, dt)
    result["seconds"] = time.perf_counter() - t0
    return result


def show(r: dict):
    print(f"geometry {r['geometry']} on {r['device']}, {r['dtype']}, torch {r['torch']}")
    print(f"{'new tokens':>10} {'hf ms':>9} {'x1':>6} {'fast ms':>9} {'x1':>6}")
    hf, fp = r["verify_ms"]["hf"], r["verify_ms"]["fast"]
    for n in hf:
        print(f"{n:>10} {hf[n]:9.2f} {hf[n] / hf[1]:6.2f} {fp[n]:9.2f} {fp[n] / fp[1]:6.2f}")
    for path, c in r["cycles"].items():
        print(f"chain cycles ({path}): tau {c['tau']:.2f}, cycle {c['cycle_ms']:.2f} ms = "
              f"{c['cycle_in_plain_steps']:.2f} plain steps ({c['plain_step_ms']:.2f} ms), draft+bookkeeping "
              f"{100 * c['overhead_share']:.1f}% of the cycle, lossless {c['lossless']}"
              + ("" if r["dtype"] == "float32" else " (bitwise only in float32)"))
    print(f"EAGLE-3 draft, one chain cycle: {r['draft_cycle_ms']:.2f} ms")
    print(f"online TTT-7 training: {r['ttt7_tokens_per_s']:,.0f} tokens/s")
    f = r["ttt7_flops"]
    peaks = ", ".join(f"{100 * f['achieved_flop_s'] / v:.0f}% of the {dt} matmul peak ({v / 1e12:.1f} TFLOP/s)"
                      for dt, v in f["matmul_peak_flop_s"].items())
    print(f"  {f['flops_per_token'] / 1e9:.2f} GFLOP per token ({100 * f['gemm_share']:.0f}% in GEMMs), achieved "
          f"{f['achieved_flop_s'] / 1e12:.2f} TFLOP/s: {peaks} at the step's GEMM shapes")
    for path, c in r["dflash_cycles"].items():
        print(f"DFlash cycles, block of {r['dflash_block']} ({path}): tau {c['tau']:.2f}, cycle {c['cycle_ms']:.2f} ms "
              f"(draft {c['draft_ms']:.2f}, verify {c['verify_ms']:.2f}) = {c['cycle_in_plain_steps']:.2f} plain "
              f"steps, {c['tokens_per_s']:.0f} tokens/s against {c['plain_tokens_per_s']:.0f} plain, "
              f"lossless {c['lossless']}")
    print(f"total {r['seconds']:.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="llama3-8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--json", default=None, help="also write the numbers here")
    a = ap.parse_args()
    r = run(a.geometry, a.device, a.dtype, prefix=a.prefix, seq_len=a.seq_len)
    show(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
