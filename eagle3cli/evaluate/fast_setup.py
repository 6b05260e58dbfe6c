"""The fast path of one eval run: the target's (``fast_target``) where it applies, the drafter's
compute dtype and weights, their matmuls packed for the run's sizes, the dtype ``--dtype auto``
loads, and the start-up check that keeps a low-precision run lossless."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .eval_config import EvalConfig, EvalError


@dataclass
class FastRun:
    """What the set-up chose, for the decoding and for results.json."""
    fast: object | None  # fast_target.FastTarget, or None: HF verification
    drafter: object
    tree_auto: bool  # --tree auto in tree mode: packings wait for the chosen tree
    packing: dict | None = None
    draft_packing: dict | None = None
    exact: bool | None = None  # check_exact's verdict: greedy output is held to fast plain decoding
    draft_dtype: torch.dtype | None = None
    draft_weights: str | None = None


def set_up_run(target, draft, cfg: EvalConfig, settings, max_pos, log=print) -> FastRun:
    """Build the fast path and the drafter, say which path verifies and in what precision the draft
    steps, pack both for ``settings`` (unless ``--tree auto`` will choose the sizes) and check a
    low-precision path's row invariance."""
    from ..decode.drafter import as_drafter
    from ..decode.fast_draft import compute_dtype, weights_for

    fast, path_note = build_fast_target(target, cfg, max_pos)
    what = (f"static cache, {str(fast.embed.dtype).removeprefix('torch.')} matmuls, float64 attention"
            if fast is not None and fast.low_precision else
            "static cache, bf16 matrices in the native kernels, fp32 around them"
            if fast is not None and fast.decoder.mixed else "static cache, packed matmuls")
    log(f"verification path: {f'fast (fast_target: {what})' if fast else 'hf'}"
        + (f" ({path_note})" if path_note else ""))
    drafter = as_drafter(draft, dtype=compute_dtype(fast), weights=weights_for(fast, cfg.draft_weights))
    lean = getattr(drafter, "lean", None)
    run = FastRun(fast, drafter, tree_auto=cfg.tree_auto and cfg.mode == "tree",
                  draft_dtype=getattr(lean, "dtype", None), draft_weights=getattr(lean, "weights", None))
    _say_draft_precision(run, draft, cfg, log)
    # --tree auto packs once it has chosen the tree: timing packings for the starting tree is waste.
    if not run.tree_auto:
        run.packing = pack_for_run(fast, settings, log)
        run.draft_packing = pack_drafter(drafter, settings, log)
    # tree auto checks 16 rows before its calibration (a failure then costs nothing) and its pick after
    run.exact = check_exact(fast, settings, log, rows=16 if run.tree_auto else None)
    return run


def _say_draft_precision(run: FastRun, draft, cfg: EvalConfig, log) -> None:
    """One line where the draft steps in another dtype or with other weights than it was stored in,
    and one where ``--draft-weights`` could not be honoured or costs time here."""
    draft_dtype, draft_weights, fast = run.draft_dtype, run.draft_weights, run.fast
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
    here (``fast_tuning.tune_packing``); what was measured goes into results.json."""
    from ..decode import native
    from ..decode.fast_tuning import tune_packing

    if fast is None:
        return None
    (rows,) = verification_rows(settings)
    if fast.embed.device.type == "cpu" and fast.embed.dtype == torch.float32 and not native.available():
        log(f"native kernels not used: {native.status()} (docs/troubleshooting.md)")
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


def eval_dtype(spec, cfg: EvalConfig, config=None) -> str:
    """What ``--dtype auto`` loads the target in for our generator: bfloat16 on a CPU with AMX when
    the fast path verifies greedily there (a Llama-shaped target's bf16 matrices in the native
    kernels stream half fp32's bytes: SmolLM2 plain decoding, 78 tok/s against 44 on 2 AMX Xeon
    cores, docs/benchmarks.md "Plain decoding against llama.cpp"; other families verify many rows for
    little more than one in AMX's bf16 matmuls), else what auto means for every command
    (bf16 on a GPU, fp32 on a CPU). A start-up check (``check_exact``) keeps it lossless; if it
    fails, eval reloads the target in fp32. A target the fast path does not take (``config``'s
    family or sliding windows) verifies through the HF forward, whose bf16 rows are not those of
    one-token decoding: fp32 there."""
    from ..core.hardware import has_amx_bf16
    from ..decode.fast_target import FAST_PATH_TYPES, config_unsupported_reason
    from ..model.target import default_device

    if spec.dtype != "auto" or spec.load_in_8bit or spec.load_in_4bit or spec.gguf_file:
        return spec.dtype
    cpu = (spec.device or default_device()).startswith("cpu")
    fast = config is None or config_unsupported_reason(config, FAST_PATH_TYPES) is None
    if cpu and fast and cfg.fast != "off" and cfg.temperature == 0 and has_amx_bf16():
        return "bfloat16"
    return "auto"


class NotRowInvariant(EvalError):
    """The low-precision fast path's verification is not bitwise one-token decoding on this CPU."""


def check_exact(fast, settings, log=print, rows: int | None = None) -> bool | None:
    """For a bf16/fp16 fast path: that verifying this run's row count (or ``rows``) decodes bitwise
    what one-token decoding does (``fast_tuning.row_invariant``), else no lossless claim could hold;
    raises NotRowInvariant. None where nothing is checked (no fast path, or fp32: exact up to ~1e-4).
    A bf16 target in the native bf16-weight kernels (``Decoder.mixed``) is row-invariant by
    construction and checked all the same: its output is held to its own plain decoding, not to HF's
    bf16 forward, whose rows round differently."""
    from ..decode.fast_tuning import row_invariant

    if fast is None or not (fast.low_precision or fast.decoder.mixed):
        return None
    rows = rows or verification_rows(settings)[0]
    if not row_invariant(fast, rows):
        dtype = "bfloat16" if fast.decoder.mixed else str(fast.embed.dtype).removeprefix("torch.")
        raise NotRowInvariant(f"in {dtype} on this CPU a {rows}-row "
                              f"verification does not give bitwise the logits of one-token decoding, so "
                              f"speculative output could differ from plain decoding; use --dtype float32")
    log(f"low-precision fast path: a {rows}-row verification is bitwise one-token decoding here (checked)")
    return True


def verification_rows(settings) -> tuple[int]:
    """The row count one verification forward runs, as the fast path packs its matmuls for it:
    the root plus every drafted node."""
    return (settings.shape()[0] + 1,)

