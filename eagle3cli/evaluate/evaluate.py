"""Evaluation: tau, n-alpha, tokens/s and speedup of a draft on the standard tasks, with a lossless check.

Plain decoding (HF ``generate``) and speculative decoding run on the same prompts, in the
same process, after the same warm-up. Multi-turn conversations are replayed turn by turn
through the tokenizer's chat template, the model's own earlier answer becoming context.
At temperature 0 every speculative answer must equal the greedy one token for token; any
mismatch is reported with its prompt id.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.errors import Eagle3Error
from ..core.hardware import describe
from ..core.hf_utils import synchronize, text_config
from ..core.time_limit import TimeLimit, now
from ..data.turns import Prompt, encode
from ..data.turns import load_turns_file as read_turns

TASKS = ("mt_bench", "gsm8k", "humaneval", "alpaca", "sum")

# Where each task lives on the Hub (users with network), and how a row becomes user turns.
HUB = {
    "mt_bench": ("HuggingFaceH4/mt_bench_prompts", None, "train",
                 lambda r, i: (r.get("prompt_id", i), r.get("category", ""), list(r["prompt"]))),
    "gsm8k": ("openai/gsm8k", "main", "test", lambda r, i: (i, "math", [r["question"]])),
    "humaneval": ("openai/openai_humaneval", None, "test",
                  lambda r, i: (r["task_id"], "code", ["Complete the code I provided.\n\n" + r["prompt"]])),
    "alpaca": ("tatsu-lab/alpaca", None, "train",
               lambda r, i: (i, "", [r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")])),
    "sum": ("abisee/cnn_dailymail", "3.0.0", "test", lambda r, i: (r.get("id", i), "summarization",
                                                                    ["Summarize: " + r["article"]])),
}


class EvalError(Eagle3Error, ValueError):
    """Bad input for eval: one line for the user."""


# --------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------
def load_turns_file(path: str | Path, limit: int | None = None, default_category: str = "") -> list[Prompt]:
    """A JSONL file of ``{"question_id", "category", "turns": [...]}`` records (the EAGLE format)."""
    return read_turns(path, limit, default_category, error=EvalError)


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hub can answer: False in offline mode or when its host does not accept a
    connection within ``timeout`` (datasets would otherwise retry for most of a minute)."""
    import os
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
           for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _bundled(task: str) -> Path | None:
    from importlib.resources import files

    p = Path(str(files("eagle3cli.prompts").joinpath(f"{task}.jsonl")))
    return p if p.is_file() else None


def load_task(task: str, data: str | None = None, limit: int | None = None) -> tuple[str, list[Prompt]]:
    """(task name, prompts) from --prompts FILE, a file path given as TASK, or the Hub."""
    if data:
        return task, load_turns_file(data, limit, task)
    if Path(task).suffix in (".jsonl", ".json") or Path(task).is_file():
        return Path(task).stem, load_turns_file(task, limit, Path(task).stem)
    if task not in HUB:
        raise EvalError(f"unknown task {task!r}: use one of {', '.join(TASKS)} or a .jsonl file of turns")
    repo, config, split, row = HUB[task]
    bundled = _bundled(task)
    if bundled is not None and not hub_reachable():
        return task, load_turns_file(bundled, limit, task)
    try:
        from datasets import load_dataset

        ds = load_dataset(repo, config, split=split)
    except Exception as e:  # offline, gated, renamed ...
        if bundled is not None:  # shipped with the package (licence permitting): works offline
            return task, load_turns_file(bundled, limit, task)
        raise EvalError(f"could not load {task} from the Hub ({repo}: {type(e).__name__}); "
                        f"pass --prompts FILE with a local turns file") from None
    out = []
    for i, r in enumerate(ds):
        pid, cat, turns = row(r, i)
        out.append(Prompt(str(pid), cat or task, turns))
        if limit and len(out) >= limit:
            break
    return task, out


# --------------------------------------------------------------------------------------
# Decoding methods
# --------------------------------------------------------------------------------------
def hf_generate(target, ids, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                prompt_lookup: int = 0, seed: int = 0) -> list[int]:
    kw = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    if temperature > 0:
        torch.manual_seed(seed)
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None)
    if prompt_lookup:
        kw["prompt_lookup_num_tokens"] = prompt_lookup
    gc = target.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else (gc.eos_token_id if isinstance(gc.eos_token_id, int)
                                                              else (gc.eos_token_id or [0])[0])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          pad_token_id=pad, **kw)
    return out[0, ids.shape[1]:].tolist()


def timed(fn, device):
    synchronize(device)
    t0 = time.perf_counter()
    r = fn()
    synchronize(device)
    return r, time.perf_counter() - t0


# --------------------------------------------------------------------------------------
# --tree auto
# --------------------------------------------------------------------------------------
def verify_latency(target, ids, sizes=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64), repeats=3) -> dict[int, float]:
    """Seconds of one target forward of n new tokens (after a prefix) on this hardware, as the
    generator's HF path verifies them (its cache and per-layer masks)."""
    from ..decode.generator import HFVerifier

    dev = ids.device
    verifier = HFVerifier(target)
    with torch.no_grad():
        verifier.prefill(ids)
        past = ids.shape[1]
        lat = {}
        for n in sizes:
            new = ids[:, -1:].repeat(1, n)
            pos = torch.arange(past, past + n, device=dev)[None]
            mask = torch.ones(n, past + n, dtype=torch.bool, device=dev).tril(past)[None, None]
            ts = []
            for _ in range(repeats):
                _, t = timed(lambda: verifier.verify(new, pos, mask, past), dev)
                verifier.keep(past, [])
                ts.append(t)
            lat[n] = sorted(ts)[len(ts) // 2]
    return lat


def verify_latency_fast(target, ids, max_len: int, sizes=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
                        repeats=3, decoder=None) -> dict[int, float]:
    """``verify_latency`` on the fast path: each size timed with every packing ``tune_packing`` would
    try for it (MKL packed for that size, oneDNN), the fastest kept, as the run that follows will
    pack (a packed GEMM's cost depends on the row count it is packed for). ``decoder``: the run's
    own ``fast_target.Decoder`` (left packed for the last size), else one built here."""
    from ..decode.fast_target import ONEDNN, Decoder, FastTarget, Linear

    dev, past = ids.device, ids.shape[1]
    decoder = decoder or Decoder(target)  # fused once; each size only re-packs
    fast = FastTarget(target, min(max_len, past + max(sizes)), decoder=decoder)
    fast.forward(ids[0], torch.arange(past, device=dev), 0, logits="last")

    def once(n):
        new, pos = ids[0, -1:].repeat(n), torch.arange(past, past + n, device=dev)
        return timed(lambda: fast.forward(new, pos, past), dev)[1]

    # The fastest of ``repeats`` rounds over all sizes: other load on the machine only ever adds
    # time, and a burst of it would hit consecutive timings of one size (a median of three taken
    # size by size once made 2 rows look as slow as 32 and picked a 31-node tree).
    lat = dict.fromkeys(sizes, float("inf"))

    def rounds():  # one packing serves every size
        for n in sizes:
            once(n)  # warm: the first call after packing pays page faults
        for _ in range(repeats):
            for n in sizes:
                lat[n] = min(lat[n], once(n))

    if Linear.can_pack(decoder.head.weight, ONEDNN):
        decoder.repack((ONEDNN,))
        rounds()
    if not Linear.can_pack(decoder.head.weight):  # no MKL here (bf16 weights): unpacked too
        decoder.repack(())
        rounds()
        return lat
    for n in sizes:  # MKL: a copy packed for each size
        decoder.repack((n,))
        once(n)
        lat[n] = min(lat[n], *(once(n) for _ in range(repeats)))
    return lat


def _interp(lat: dict[int, float], n: int) -> float:
    xs = sorted(lat)
    if n <= xs[0]:
        return lat[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return lat[a] + (lat[b] - lat[a]) * (n - a) / (b - a)
    return lat[xs[-1]] * n / xs[-1]


def choose_tree(outputs, latency: dict[int, float], max_total: int, max_depth: int) -> dict:
    """Pick (total_tokens, depth) maximising expected tokens/s from a big-tree calibration run.

    A smaller EAGLE-2 tree (N nodes, depth d) is exactly the first N nodes of depth <= d in the
    big tree's ranking, so each calibration cycle tells what every smaller tree would accept.
    """
    cycles = [(ranks, depths) for o in outputs for ranks, depths in zip(o.accepted_ranks, o.rank_depths)]
    n_cycles = sum(o.forwards for o in outputs)
    if not cycles:
        raise EvalError("tree auto: no calibration cycles (empty answers?)")
    draft_level = sum(o.times["draft"] for o in outputs) / max(1, n_cycles) / max_depth
    book = sum(o.times["bookkeeping"] for o in outputs) / max(1, n_cycles)
    best = None
    for d in range(1, max_depth + 1):
        for n in range(d, max_total + 1):
            acc = 0
            for ranks, depths in cycles:
                a = 0
                for i, r in enumerate(ranks):  # the i-th path node sits at depth i+1
                    if i + 1 > d:
                        break
                    # its rank among nodes of depth <= d
                    sub = sum(1 for dd in depths[:r] if dd <= d)
                    if sub > n:
                        break
                    a += 1
                acc += a + 1
            tau = acc / len(cycles)
            speed = tau / (d * draft_level + _interp(latency, n + 1) + book)
            if best is None or speed > best["tokens_per_s"]:
                best = {"total_tokens": n, "depth": d, "tau": tau, "tokens_per_s": speed}
    best["latency_ms"] = {k: round(v * 1000, 3) for k, v in latency.items()}
    return best


# --------------------------------------------------------------------------------------
# The evaluation
# --------------------------------------------------------------------------------------
@dataclass
class EvalConfig:
    tasks: list[str]
    data: str | None = None
    limit: int | None = None
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    sampling_top_k: int = 0
    mode: str = "tree"
    total_tokens: int = 60
    depth: int = 8
    top_k: int = 10
    steps: int = 3
    tree_auto: bool = False
    prompt_lookup: bool = False
    prompt_lookup_tokens: int = 10
    seed: int = 0
    warmup_tokens: int = 32
    fast: str = "auto"  # auto | on | off: verify (and decode the plain baseline) through fast_target
    draft_weights: str = "auto"  # auto | full | int8 | int4: the drafter's matmul weights (fast_draft.weights_for)
    max_minutes: float | None = None  # start no prompt that would end later (core.time_limit)
    # llama.cpp's plain decoding of the same target beside ours where llama.cpp is installed
    # (llamacpp.plain_baseline): the fastest plain decoder a CPU user has is a baseline too
    llama_baseline: bool = True
    llama_cpp: str | None = None  # where llama-server is (else $EAGLE3_LLAMA_CPP, then PATH)
    target_gguf: str | None = None  # the target as GGUF (else converted once into the cache)
    log_dir: str | None = None  # where llama-server's log goes

    @classmethod
    def from_options(cls, opts) -> "EvalConfig":
        """The settings of ``eagle3 eval``'s flags (``options.EvalOptions``, validated)."""
        auto, total, depth, top_k = opts.tree_shape()
        return cls(tasks=list(opts.task), data=opts.data, limit=opts.limit, max_new_tokens=opts.max_new_tokens,
                   temperature=opts.temperature, top_p=opts.top_p, sampling_top_k=opts.sampling_top_k,
                   mode=opts.mode, total_tokens=total, depth=depth, top_k=top_k, steps=opts.steps,
                   tree_auto=auto, prompt_lookup=opts.baseline == "prompt-lookup", seed=opts.seed, fast=opts.fast,
                   draft_weights=opts.draft_weights, max_minutes=opts.max_minutes, llama_cpp=opts.llama_cpp,
                   target_gguf=opts.target_gguf, log_dir=str(opts.out))


# baseline_hf: HF generate; baseline_fast: plain greedy on the fast path (same forward as the
# speculative run); baseline_llamacpp: llama.cpp's plain decoding of the same target, where it is
# installed; "baseline" in results is the fastest of them (docs/design.md §10).
METHODS = ("baseline_hf", "baseline_fast", "baseline_llamacpp", "speculative", "prompt_lookup")


@dataclass
class TaskStats:
    num_prompts: int = 0
    new_tokens: dict = field(default_factory=lambda: dict.fromkeys(METHODS, 0))
    seconds: dict = field(default_factory=lambda: dict.fromkeys(METHODS, 0.0))
    outputs: list = field(default_factory=list)
    mismatches: list = field(default_factory=list)
    fast_differs_from_hf: list = field(default_factory=list)
    errors: list = field(default_factory=list)


def check_draft(draft_dir: str, target_config):
    """Draft/target mismatch (hidden size, vocab, layer ids, broken files): one line."""
    from ..publish.inspector import inspect_draft

    rep = inspect_draft(draft_dir, target_config)
    if not rep.ok:
        more = f" (+{len(rep.problems) - 1} more; run `eagle3 inspect {draft_dir}`)" if len(rep.problems) > 1 else ""
        raise EvalError(f"draft {draft_dir} does not fit this target: {rep.problems[0]}{more}")


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where two outputs differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def build_fast_target(target, cfg: EvalConfig, max_pos) -> tuple[object | None, str | None]:
    """(FastTarget or None, why not) for this run: --fast auto uses it where it applies.

    Greedy only: the fast path's plain baseline is greedy decoding, and sampling compares
    against HF generate's sampler. Built unpacked: ``pack_for_run`` packs it for the run's
    sizes once they are known (with --tree auto, after the tree is chosen).
    """
    from ..decode.fast_target import FastTarget

    if cfg.fast == "off":
        return None, "--fast off"
    reason = FastTarget.supports(target)
    if reason is None and cfg.temperature > 0:
        reason = "temperature > 0"
    if reason:
        if cfg.fast == "on":
            raise EvalError(f"--fast on: the fast path does not apply here: {reason}")
        return None, f"fast path not used: {reason}"
    max_len = min(max_pos or 8192, 8192)
    return FastTarget(target, max_len), None


def pack_for_run(fast, settings, log=print) -> dict | None:
    """Pack the fast path's matmuls for this run's verification size, the fastest way measured
    here (``fast_target.tune_packing``); what was measured goes into results.json."""
    from ..decode.fast_target import tune_packing

    if fast is None:
        return None
    (rows,) = verification_rows(settings)
    tuned = tune_packing(fast, rows)
    if tuned:
        one = tuned["one_row"]
        log(f"packing for {rows}-row verification: {tuned['packed_for'] or 'none'} "
            f"(ms per forward: {', '.join(f'{k} {v}' for k, v in tuned['ms'].items())}); "
            f"one-row decoding: {one['uses']} (ms: {', '.join(f'{k} {v}' for k, v in one['ms'].items())})")
    return tuned


def pack_drafter(drafter, settings, log=print) -> dict | None:
    """Pack the draft's matmuls for the tree's levels (top_k nodes each; a chain's: one) where that
    measures faster (``EagleDrafter.pack``); None where nothing packs here or the drafter cannot."""
    total, depth, top_k = settings.shape()
    rows = min(top_k, total)
    if not hasattr(drafter, "pack"):
        return None
    tuned = drafter.pack(rows)
    if tuned:
        log(f"draft packing for {rows}-node levels: {tuned['uses']} "
            f"(ms per step: {', '.join(f'{k} {v}' for k, v in tuned['ms'].items())})")
    return tuned


def eval_dtype(spec, cfg: EvalConfig) -> str:
    """What ``--dtype auto`` loads the target in for our generator: bfloat16 on a CPU with AMX when
    the fast path verifies greedily there (a 16-row verification costs 1.3x one row in bf16 against
    1.6x in fp32: docs/benchmarks.md, "Verification cost"), else what auto means for every command
    (bf16 on a GPU, fp32 on a CPU). A start-up check (``check_exact``) keeps it lossless; if it
    fails, eval reloads the target in fp32."""
    from ..core.hardware import has_amx_bf16
    from ..model.target import default_device

    if spec.dtype != "auto" or spec.load_in_8bit or spec.load_in_4bit or spec.gguf_file:
        return spec.dtype
    cpu = (spec.device or default_device()).startswith("cpu")
    if cpu and cfg.fast != "off" and cfg.temperature == 0 and has_amx_bf16():
        return "bfloat16"
    return "auto"


def evaluate_spec(spec, tokenizer, draft_for, cfg: EvalConfig, progress=None, log=print) -> dict:
    """``evaluate`` with the target loaded from ``spec`` in ``eval_dtype``'s choice (the draft is
    ``draft_for(target)``): under ``--dtype auto``, once more in float32 if bf16 fails its check."""
    import dataclasses

    from ..model.target import load_target

    dtype = eval_dtype(spec, cfg)
    if dtype != spec.dtype:
        log(f"--dtype auto: {dtype} (this CPU has AMX: verifying several tokens costs little more than one)")
    while True:
        target = load_target(dataclasses.replace(spec, dtype=dtype))
        try:
            with contextlib.ExitStack() as stack:
                engine = _plain_engine(spec, target, cfg, log)
                if engine is not None:
                    stack.enter_context(engine)
                return evaluate(target, tokenizer, draft_for(target), cfg, progress=progress, log=log,
                                plain_engine=engine)
        except NotRowInvariant as e:
            if dtype == spec.dtype:  # asked for: the user decides
                raise
            log(f"note: {e}; --dtype auto falls back to float32")
            dtype = "float32"


def _plain_engine(spec, target, cfg: EvalConfig, log):
    """llama.cpp's plain decoding of this target in its dtype, on as many threads as ours (CPU, greedy
    runs only; None elsewhere or where llama.cpp is not installed)."""
    from .llamacpp import plain_baseline

    dev = next(target.parameters()).device
    if not cfg.llama_baseline or dev.type != "cpu" or cfg.temperature != 0:
        return None
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    return plain_baseline(spec.model, dtype, cfg.llama_cpp, cfg.target_gguf, threads=torch.get_num_threads(),
                          log_dir=cfg.log_dir, log=log)


class NotRowInvariant(EvalError):
    """The low-precision fast path's verification is not bitwise one-token decoding on this CPU."""


def check_exact(fast, settings, log=print, rows: int | None = None) -> bool | None:
    """For a bf16/fp16 fast path: that verifying this run's row count (or ``rows``) decodes bitwise
    what one-token decoding does (``fast_target.row_invariant``), else no lossless claim could hold;
    raises NotRowInvariant. None where nothing is checked (no fast path, or fp32: exact up to ~1e-4)."""
    from ..decode.fast_target import row_invariant

    if fast is None or not fast.low_precision:
        return None
    rows = rows or verification_rows(settings)[0]
    if not row_invariant(fast, rows):
        raise NotRowInvariant(f"in {str(fast.embed.dtype).removeprefix('torch.')} on this CPU a {rows}-row "
                              f"verification does not give bitwise the logits of one-token decoding, so "
                              f"speculative output could differ from plain decoding; use --dtype float32")
    log(f"low-precision fast path: a {rows}-row verification is bitwise one-token decoding here (checked)")
    return True


def verification_rows(settings) -> tuple[int]:
    """The row count one verification forward runs, as the fast path packs its matmuls for it:
    the root plus every drafted node."""
    return (settings.shape()[0] + 1,)


def summarize(stats: TaskStats, cfg: EvalConfig) -> dict:
    from ..decode.generator import n_alpha

    outs = stats.outputs
    fwd = sum(o.forwards for o in outs)
    tau = sum(o.decode_tokens for o in outs) / fwd if fwd else None
    tps = {k: (stats.new_tokens[k] / stats.seconds[k] if stats.seconds[k] else None) for k in METHODS}
    if not cfg.prompt_lookup:
        tps.pop("prompt_lookup")
    if not tps["baseline_llamacpp"]:
        tps.pop("baseline_llamacpp")
    plain = {k: v for k, v in tps.items() if k.startswith("baseline_") and v}
    fastest = max(plain, key=plain.get, default=None)
    tps["baseline"] = plain[fastest] if fastest else None  # the fastest honest plain decoding
    times = {k: sum(o.times[k] for o in outs) for k in ("prefill", "draft", "verify", "bookkeeping")}
    cycle = sum(v for k, v in times.items() if k != "prefill") / fwd if fwd else None
    return {
        "path": outs[0].path if outs else None,
        "baseline_from": fastest.removeprefix("baseline_") if fastest else None,  # hf, fast or llamacpp
        # a whole cycle (draft + verify + bookkeeping) in plain decoding steps of the fastest baseline
        "cycle_ratio": cycle * tps["baseline"] if cycle and tps["baseline"] else None,
        "num_prompts": stats.num_prompts,
        "tau": tau,
        "n_alpha": n_alpha(outs) if cfg.mode == "chain" and outs else None,
        "tokens_per_s": tps,
        "speedup": tps["speculative"] / tps["baseline"] if tps["baseline"] and tps["speculative"] else None,
        "lossless": (not stats.mismatches) if cfg.temperature == 0 else None,
        "mismatches": stats.mismatches,
        "fast_differs_from_hf": stats.fast_differs_from_hf,
        "errors": stats.errors,
        "cycle_ms": {k: 1000 * v / fwd for k, v in times.items() if k != "prefill"} if fwd else None,
        "accept_length_hist": _hist([a for o in outs for a in o.accept_lengths]),
    }


def _hist(xs):
    h: dict[str, int] = {}
    for x in xs:
        h[str(x)] = h.get(str(x), 0) + 1
    return dict(sorted(h.items(), key=lambda kv: int(kv[0])))


def evaluate(target, tokenizer, draft, cfg: EvalConfig, progress=None, log=print, plain_engine=None) -> dict:
    """Run every task; returns the results dict (docs/design.md §10) plus per-category rows.
    ``plain_engine``: another plain decoder (``llamacpp.PlainBaseline``: ``decode(ids, n)`` ->
    (tokens, seconds)), timed on every turn beside ours as ``baseline_llamacpp``."""
    from ..decode.fast_draft import compute_dtype, weights_for
    from ..decode.generator import (
        ContextTooLong,
        SpecSettings,
        UnsupportedTarget,
        as_drafter,
        check_supported,
        greedy_generate,
        speculative_generate,
    )

    check_supported(target.config)
    clock = TimeLimit(cfg.max_minutes)  # from here: warm-up and tree calibration count too
    dev = next(target.parameters()).device
    settings = SpecSettings(mode=cfg.mode, total_tokens=cfg.total_tokens, depth=cfg.depth, top_k=cfg.top_k,
                            steps=cfg.steps, temperature=cfg.temperature, top_p=cfg.top_p,
                            sampling_top_k=cfg.sampling_top_k, max_new_tokens=cfg.max_new_tokens)
    max_pos = getattr(text_config(target.config), "max_position_embeddings", None)
    loaded = [load_task(t, cfg.data, cfg.limit) for t in cfg.tasks]
    if not any(ps for _, ps in loaded):
        raise EvalError("no prompts to evaluate")

    fast, path_note = build_fast_target(target, cfg, max_pos)
    what = (f"static cache, {str(fast.embed.dtype).removeprefix('torch.')} matmuls, float64 attention"
            if fast is not None and fast.low_precision else "static cache, packed matmuls")
    log(f"verification path: {f'fast (fast_target: {what})' if fast else 'hf'}"
        + (f" ({path_note})" if path_note else ""))
    drafter = as_drafter(draft, dtype=compute_dtype(fast), weights=weights_for(fast, cfg.draft_weights))
    lean = getattr(drafter, "lean", None)
    draft_dtype, draft_weights = getattr(lean, "dtype", None), getattr(lean, "weights", None)
    if draft_dtype is not None and (draft_dtype != next(draft.parameters()).dtype or draft_weights != "full"):
        stored = f", {draft_weights} weights" if draft_weights != "full" else ""
        log(f"draft steps in {str(draft_dtype).removeprefix('torch.')}{stored} beside the "
            f"{str(fast.embed.dtype).removeprefix('torch.') if fast else 'hf'} target (reading its weights is most "
            f"of a step)")
    if cfg.draft_weights in ("int8", "int4") and draft_weights != cfg.draft_weights:
        log(f"--draft-weights {cfg.draft_weights}: no matmul of this draft fits torch's {cfg.draft_weights} CPU "
            "kernel here; its weights stay full")
    elif draft_weights in ("int8", "int4") and draft_dtype == torch.float32:
        log(f"note: --draft-weights {draft_weights} with a float32 draft step: torch's integer kernels are slower "
            "than full weights with fp32 inputs (docs/eval.md); they pay beside a bf16 target")
    tree_auto = cfg.tree_auto and cfg.mode == "tree"
    # --tree auto packs once it has chosen the tree: timing packings for the starting tree is waste.
    packing = None if tree_auto else pack_for_run(fast, settings, log)
    draft_packing = None if tree_auto else pack_drafter(drafter, settings, log)
    # tree auto checks 16 rows before its calibration (a failure then costs nothing) and its pick after
    exact = check_exact(fast, settings, log, rows=16 if tree_auto else None)

    def spec(ids, s=settings, seed=cfg.seed):
        return speculative_generate(target, drafter, ids, s, seed=seed, fast=fast)

    def base(ids, seed=cfg.seed):
        return hf_generate(target, ids, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.sampling_top_k, seed=seed)

    def base_fast(ids):
        return greedy_generate(target, ids, cfg.max_new_tokens, fast=fast)

    # Warm-up (same for every method) on the first prompt, then optional tree calibration.
    firsts = [encode(tokenizer, [{"role": "user", "content": p.turns[0]}]) for _, ps in loaded for p in ps[:8]]
    firsts = [f.to(dev) for f in firsts if not max_pos or f.shape[1] + cfg.warmup_tokens + cfg.depth + 2 < max_pos]
    if not firsts:
        raise EvalError(f"no prompt fits the target's context of {max_pos} tokens")
    first = firsts[0]
    warm = SpecSettings(**{**settings.__dict__, "max_new_tokens": cfg.warmup_tokens})
    speculative_generate(target, drafter, first, warm, seed=cfg.seed, fast=fast)
    hf_generate(target, first, cfg.warmup_tokens)
    if fast is not None:
        greedy_generate(target, first, cfg.warmup_tokens, fast=fast)
    if cfg.prompt_lookup:
        hf_generate(target, first, cfg.warmup_tokens, prompt_lookup=cfg.prompt_lookup_tokens)
    if plain_engine is not None:
        plain_engine.decode(first[0].tolist(), cfg.warmup_tokens)
    auto = None
    if tree_auto:
        big = SpecSettings(**{**settings.__dict__, "total_tokens": 64, "depth": 8, "temperature": 0.0,
                              "max_new_tokens": min(64, cfg.max_new_tokens)})
        # the calibration's draft levels run as the chosen tree's will (packed, e.g. bf16 never unpacked),
        # so that its per-level cost, which the choice weighs, is the run's
        pack_drafter(drafter, big, log=lambda _: None)
        calib = [spec(f, big) for f in firsts[:3]]
        # The latency curve of the path the run verifies through: the fast path's is flatter.
        lat = (verify_latency_fast(target, first, fast.max_len, decoder=fast.decoder) if fast is not None
               else verify_latency(target, first))
        auto = choose_tree(calib, lat, 64, 8)
        auto["latency_path"] = "fast" if fast is not None else "hf"
        settings.total_tokens, settings.depth = auto["total_tokens"], auto["depth"]
        packing = pack_for_run(fast, settings, log)  # re-pack for the chosen verification size
        draft_packing = pack_drafter(drafter, settings, log)
        exact = check_exact(fast, settings, log)
        log(f"tree auto: total_tokens={auto['total_tokens']} depth={auto['depth']} "
            f"(expected tau {auto['tau']:.2f})")

    results, categories, cut = {}, {}, {}
    for task, prompts in loaded:
        stats = TaskStats()
        for n, p in enumerate(prompts):
            if not clock.fits(1):  # the prompts so far say the next would end past --max-minutes
                cut[task] = [n, len(prompts)]
                log(f"time limit ({clock.describe()}): {task}: {n} of {len(prompts)} prompts measured "
                    f"({clock.rate():.0f} s a prompt, {max(0.0, clock.left()):.0f} s left)")
                break
            started = now()
            cat = categories.setdefault((task, p.category or task), TaskStats())
            messages, ok = [], True
            for turn_no, turn in enumerate(p.turns):
                messages.append({"role": "user", "content": turn})
                ids = encode(tokenizer, messages).to(dev)
                pid = p.id if len(p.turns) == 1 else f"{p.id}/turn{turn_no + 1}"
                if max_pos and ids.shape[1] + 1 >= max_pos:
                    msg = f"{task} prompt {pid}: {ids.shape[1]} tokens do not fit the context of {max_pos}; skipped"
                    log(f"error: {msg}")
                    stats.errors.append(msg)
                    ok = False
                    break
                try:
                    b, tb = timed(lambda: base(ids), dev)
                    bf, tbf = timed(lambda: base_fast(ids), dev) if fast is not None else (None, 0.0)
                    s_out, ts = timed(lambda: spec(ids), dev)
                except (ContextTooLong, UnsupportedTarget) as e:
                    log(f"error: {task} prompt {pid}: {e}")
                    stats.errors.append(f"{pid}: {e}")
                    ok = False
                    break
                rows = [stats, cat]
                for st in rows:
                    st.new_tokens["baseline_hf"] += len(b)
                    st.seconds["baseline_hf"] += tb
                    if bf is not None:
                        st.new_tokens["baseline_fast"] += len(bf)
                        st.seconds["baseline_fast"] += tbf
                    st.new_tokens["speculative"] += len(s_out.tokens)
                    st.seconds["speculative"] += ts
                    st.outputs.append(s_out)
                if plain_engine is not None:  # interleaved with ours: a shared machine's load hits both
                    n_e, t_e = plain_engine.decode(ids[0].tolist(), cfg.max_new_tokens)
                    for st in rows:
                        st.new_tokens["baseline_llamacpp"] += n_e
                        st.seconds["baseline_llamacpp"] += t_e
                if cfg.prompt_lookup:
                    pl, tp = timed(lambda: hf_generate(target, ids, cfg.max_new_tokens,
                                                       prompt_lookup=cfg.prompt_lookup_tokens), dev)
                    for st in rows:
                        st.new_tokens["prompt_lookup"] += len(pl)
                        st.seconds["prompt_lookup"] += tp
                if bf is not None and bf != b:  # the fast forward must decode what the HF forward decodes
                    if not exact:  # in fp32 a difference is news; in bf16 two roundings differ (summed below)
                        log(f"note: {task} prompt {pid}: plain decoding on the fast path differs from HF "
                            f"generate at token {first_difference(bf, b)}")
                    for st in rows:
                        st.fast_differs_from_hf.append(pid)
                # In low precision HF's own forward is not row-invariant, so greedy speculative output
                # is held to plain decoding on the forward it verifies with (bitwise: check_exact).
                reference = bf if exact else b
                if cfg.temperature == 0 and s_out.tokens != reference:
                    at = first_difference(s_out.tokens, reference)
                    log(f"error: LOSSLESS CHECK FAILED: {task} prompt {pid} differs from greedy at token {at}")
                    for st in rows:
                        st.mismatches.append(pid)
                # the model's own answer is the context of the next turn
                messages.append({"role": "assistant", "content": tokenizer.decode(b, skip_special_tokens=True)})
            if ok:
                stats.num_prompts += 1
                cat.num_prompts += 1
            clock.record(now() - started)
            if progress:
                progress()
        if exact and stats.fast_differs_from_hf:
            log(f"note: {task}: plain decoding on the fast path differs from HF generate on "
                f"{len(stats.fast_differs_from_hf)} turns: in bf16 HF's attention rounds otherwise and is "
                f"not row-invariant; speculative output is held to the fast path's plain decoding")
        results[task] = summarize(stats, cfg)
    per_category = [{"task": t, "category": c, **{k: v for k, v in summarize(st, cfg).items()
                                                  if k in ("num_prompts", "tau", "tokens_per_s", "speedup")}}
                    for (t, c), st in categories.items()]
    total, depth, top_k = settings.shape()
    from .. import __version__

    return {
        "eagle3_version": __version__,
        "hardware": describe(),
        "settings": {"mode": cfg.mode, "temperature": cfg.temperature, "top_p": cfg.top_p,
                     "sampling_top_k": cfg.sampling_top_k, "max_new_tokens": cfg.max_new_tokens,
                     "total_tokens": settings.total_tokens if cfg.mode == "tree" else None,
                     "depth": settings.depth if cfg.mode == "tree" else None,
                     "top_k": settings.top_k if cfg.mode == "tree" else None,
                     "steps": cfg.steps if cfg.mode == "chain" else None,
                     "tree_auto": auto},
        "fast_packing": packing,
        "draft_packing": draft_packing,
        "draft_dtype": None if draft_dtype is None else str(draft_dtype).removeprefix("torch."),
        "draft_weights": draft_weights,
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "plain_engine": plain_engine.describe() if plain_engine is not None else None,
        # what greedy speculative output is compared with: HF generate, or (low precision, where only
        # the fast path's forward is row-invariant) plain decoding on the fast path
        "lossless_reference": "fast plain decoding" if exact else "hf generate",
        "tasks": results,
        "per_category": per_category,
        # --max-minutes ended a task early: task -> [prompts measured, prompts in the task]
        "time_limit": {"minutes": cfg.max_minutes, "prompts": cut} if cut else None,
    }


def plot(results: dict, path: Path) -> Path | None:
    """tau per task and n-alpha bars; skipped quietly if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tasks = results["tasks"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = list(tasks)
    axes[0].bar(names, [tasks[t]["tau"] or 0 for t in names], color="#4C72B0")
    axes[0].set_ylabel("tau (tokens per target forward)")
    axes[0].set_title(f"acceptance length ({results['settings']['mode']})")
    for i, t in enumerate(names):
        sp = tasks[t].get("speedup")
        if sp:
            axes[0].annotate(f"{sp:.2f}x", (i, tasks[t]["tau"]), ha="center", va="bottom")
    width = 0.8 / max(1, len(names))
    any_alpha = False
    for i, t in enumerate(names):
        al = tasks[t].get("n_alpha") or []
        if al:
            any_alpha = True
            axes[1].bar([n + i * width for n in range(len(al))], [a or 0 for a in al], width, label=t)
    axes[1].set_title("n-alpha (chain)" if any_alpha else "n-alpha: run --mode chain")
    axes[1].set_xlabel("n (drafted inputs already accepted)")
    axes[1].set_ylim(0, 1)
    if any_alpha:
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    from ..core.io_utils import atomic_path

    try:
        with atomic_path(path) as tmp:  # a fault part-way leaves the earlier plot, never half a PNG
            fig.savefig(tmp, dpi=120, format="png")
    finally:
        plt.close(fig)
    return path


def write_results(results: dict, out_dir: str | Path) -> tuple[Path, Path | None]:
    from ..core.io_utils import ensure_dir, write_json

    out = ensure_dir(out_dir)
    write_json(out / "results.json", results)
    return out / "results.json", plot(results, out / "results.png")
