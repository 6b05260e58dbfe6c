"""Plain decoding, ours against llama.cpp's: same model, same dtype, interleaved, against the bound.

    PYTHONPATH=. python benchmarks/plain_vs_llamacpp.py --model $SMOL --llama-cpp LLAMA_CPP \
        [--dtype float32,bfloat16] [--threads 2] [-n 64] [--rounds 7] [--ours native,native@haswell,onednn,mkl1,none] \
        [--json out.json]

A CPU user decodes with llama.cpp, so our plain decoding (the fast path's one-row forward, what
a speculative cycle's verification is built from and what eval's ``baseline_fast`` runs) is read
against it. Per dtype: llama-server on the target's GGUF of that dtype (converted once into the
eagle3 cache by llama.cpp's converter, or --target-gguf-DTYPE) decodes -n tokens greedily after a
chat prompt (``ignore_eos``; its own ``timings.predicted_ms``), and our fast path decodes -n tokens
after the same prompt ids (its prompt pass untimed), each of our packings (``--ours``: our compiled
kernels, ``native``: each layer one call; oneDNN's prepacked linear, MKL packed for one row,
unpacked F.linear, each with torch's ops around them; ``native@haswell``: our kernels built for
AVX2, which an AVX-512 CPU runs too) and llama.cpp in turn, --rounds
times: a shared machine's load drifts between rounds and hits every contender alike. Medians
and the ratio to llama.cpp's median, per round too (the firm number on a busy machine).

The bound: a decoding step reads every weight once (the layers' matrices and norms, the LM head
over the whole vocabulary; the embedding table only for the one row looked up) plus the KV cache,
so tokens/s <= memory bandwidth / bytes a step. The bandwidth is measured here, in the same
process, as the best of a few reads (a sum) and copies of a 1 GiB tensor on --threads threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3cli.decode import native  # noqa: E402
from eagle3cli.decode.fast_target import NATIVE, ONEDNN, Decoder, FastTarget  # noqa: E402
from eagle3cli.decode.generator import row_argmax  # noqa: E402
from eagle3cli.evaluate.llamacpp import SERVER, Server, find_binary  # noqa: E402
from eagle3cli.evaluate.llamacpp_baseline import OUTTYPES, cached_target_gguf  # noqa: E402

PACKINGS = {"native": (NATIVE, ONEDNN), "onednn": (ONEDNN,), "mkl1": (1,), "none": ()}


def pack(fast: FastTarget, name: str) -> None:
    """Pack ``fast`` as ``name`` says: a PACKINGS key, "native@MARCH" the native kernels built for
    another -march (native@haswell: the AVX2 build, on an AVX-512 CPU too)."""
    key, _, march = name.partition("@")
    native.use(march or None)
    if not fast.decoder.mixed:  # mixed (bf16 weights in the native kernels): nothing else serves them
        fast.decoder.repack(PACKINGS[key])


def targets(model, max_len: int, ours: list[str]) -> dict:
    """{--ours name: the FastTarget it decodes with}. A bf16 model: ``native`` names the fast path's
    bf16 weights in the native bf16-weight kernels (fp32 around them: ``Decoder.mixed``), the others
    the bf16 path of bf16 matmuls and float64 attention; fp32: one FastTarget, repacked per name."""
    mixed = Decoder.mixed_applies(model)
    plain = FastTarget(model, max_len, decoder=Decoder(model, mixed=False)) if not mixed or any(
        not o.startswith("native") for o in ours) else None
    native_fast = FastTarget(model, max_len) if mixed else plain
    return {o: native_fast if o.startswith("native") else plain for o in ours}


def cpu_line() -> str:
    """The CPU's model name and the instruction class eagle3's docs name machines by."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    cls = ("AMX" if "amx_tile" in flags else "AVX512-BF16" if "avx512_bf16" in flags
           else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    return f"{name} ({cls}), {torch.get_num_threads()} torch threads"


def bandwidth(gib: float = 1.0, repeats: int = 5) -> dict:
    """GB/s of the best read (x.sum()) and copy (y.copy_(x): bytes read + written) of ``gib`` GiB."""
    n = int(gib * 2**30) // 4
    x = torch.ones(n)
    y = torch.empty_like(x)
    y.copy_(x)
    reads, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        reads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        y.copy_(x)
        copies.append(time.perf_counter() - t0)
    b = n * 4
    return {"read_GBps": b / min(reads) / 1e9, "copy_GBps": 2 * b / min(copies) / 1e9}


def step_bytes(model, dtype: torch.dtype, kv_dtype: torch.dtype, position: int) -> int:
    """Bytes one decoding step reads: every weight in ``dtype`` but the embedding table (one row of
    it), the LM head whole (tied or not), and the KV cache up to ``position`` in ``kv_dtype`` (the
    fast path's: float64 under bf16 weights)."""
    esize = torch.tensor([], dtype=dtype).element_size()
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters() if p is not embed and p is not head) * esize
    total += head.numel() * esize + embed.shape[1] * esize
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = torch.tensor([], dtype=kv_dtype).element_size()
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * position * kv_bytes
    return total + kv


def ours_tps(fast: FastTarget, prompt: torch.Tensor, n: int) -> float:
    """Tokens/s of decoding ``n`` tokens greedily after ``prompt`` (its prompt pass untimed)."""
    p = prompt.shape[0]
    logits, _ = fast.forward(prompt, torch.arange(p), 0, logits="last")
    t = row_argmax(logits[-1])
    t0 = time.perf_counter()
    for i in range(n):
        logits, _ = fast.forward(torch.tensor([t]), torch.tensor([p + i]), p + i)
        t = row_argmax(logits[-1])
    return n / (time.perf_counter() - t0)


def llama_tps(server: Server, prompt: list[int], n: int) -> float:
    r = server.complete(prompt, n, ignore_eos=True)
    t = r["timings"]
    return 1000.0 * t["predicted_n"] / t["predicted_ms"]


def prompt_ids(model_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": "Compose an engaging travel blog post about a recent trip to Hawaii, "
                                        "highlighting cultural experiences and must-see attractions."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-cpp", default=None)
    ap.add_argument("--dtype", default="float32", help="comma list of float32, bfloat16, float16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ours", default="native,onednn,mkl1,none", help=f"comma list of {', '.join(PACKINGS)}, "
                    "and native@MARCH (the native kernels built for -march=MARCH, say native@haswell)")
    for dt in OUTTYPES:
        ap.add_argument(f"--target-gguf-{dt}", default=None, help=f"the target's {dt} GGUF (default: converted)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    binary = find_binary(SERVER, args.llama_cpp)
    prompt = prompt_ids(args.model)
    bw = bandwidth()
    print(f"CPU: {cpu_line()}; memory bandwidth, best of 5 over 1 GiB: read {bw['read_GBps']:.1f} GB/s, "
          f"copy {bw['copy_GBps']:.1f} GB/s", flush=True)
    report = {"cpu": cpu_line(), "bandwidth": bw, "n": args.n, "prompt_tokens": len(prompt), "rows": []}
    for dt in args.dtype.split(","):
        dtype = getattr(torch, dt)
        gguf = getattr(args, f"target_gguf_{dt}") or cached_target_gguf(args.model, OUTTYPES[dt], args.llama_cpp)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
        ours = [o for o in args.ours.split(",") if o]
        fasts = targets(model, len(prompt) + args.n + 8, ours)
        kv_dtype = min((f.attn_dtype for f in fasts.values()), key=lambda t: torch.tensor([], dtype=t).element_size(),
                       default=dtype)
        bytes_step = step_bytes(model, dtype, kv_dtype, len(prompt) + args.n // 2)
        bound = bw["read_GBps"] * 1e9 / bytes_step
        times = {name: [] for name in ["llama.cpp"] + [f"ours/{o}" for o in ours]}
        with Server(binary, gguf, threads=args.threads, ctx=len(prompt) + args.n + 64) as server:
            llama_tps(server, prompt, 8)  # warm
            for o in ours:
                pack(fasts[o], o)
                ours_tps(fasts[o], torch.tensor(prompt), 4)
            for r in range(args.rounds):
                times["llama.cpp"].append(llama_tps(server, prompt, args.n))
                for o in ours:
                    pack(fasts[o], o)
                    ours_tps(fasts[o], torch.tensor(prompt), 2)  # the first calls after packing page-fault
                    times[f"ours/{o}"].append(ours_tps(fasts[o], torch.tensor(prompt), args.n))
                print(f"{dt} round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in times.items()), flush=True)
        ref = times["llama.cpp"]
        for name, ts in times.items():
            ratios = [a / b for a, b in zip(ts, ref)]
            row = {"dtype": dt, "decoder": name, "tokens_per_s": statistics.median(ts),
                   "ms_per_token": 1000 / statistics.median(ts), "x_llamacpp": statistics.median(ratios),
                   "of_bound": statistics.median(ts) / bound, "bound_tokens_per_s": bound,
                   "bytes_per_step": bytes_step, "all": ts}
            report["rows"].append(row)
        del fasts, model
    print(f"\n{args.n} tokens after a {len(prompt)}-token prompt, {args.rounds} interleaved rounds, medians; "
          f"x llama.cpp = median of per-round ratios; bound = read bandwidth / bytes a step\n")
    print("| dtype | decoder | tok/s | ms/token | x llama.cpp | of bound (tok/s) |")
    print("|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(f"| {r['dtype']} | {r['decoder']} | {r['tokens_per_s']:.1f} | {r['ms_per_token']:.1f} | "
              f"{r['x_llamacpp']:.2f} | {r['of_bound']:.2f} ({r['bound_tokens_per_s']:.1f}) |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
