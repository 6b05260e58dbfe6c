"""What eval reports: per-task and per-category summaries of the timed methods (tau, n-alpha,
tokens/s, speedup over the fastest plain decoding, the lossless verdict), results.json with its
plot, and numbers formatted for the result tables every evaluation prints (ours, vLLM's and
llama.cpp's), so that the engines below ``evaluate`` need not import it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..core.hardware import describe
from .eval_config import EvalConfig

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


def per_category(categories: dict, cfg: EvalConfig) -> list[dict]:
    """One row per (task, category) of ``categories`` ({(task, category): TaskStats})."""
    return [{"task": t, "category": c, **{k: v for k, v in summarize(st, cfg).items()
                                          if k in ("num_prompts", "tau", "tokens_per_s", "speedup")}}
            for (t, c), st in categories.items()]


def results_record(target, cfg: EvalConfig, settings, run, auto, plain_engine, tasks: dict, categories: dict,
                   cut: dict) -> dict:
    """The results dict (docs/design.md §10): settings, hardware, the fast path's choices, every task's
    summary (``tasks``) and the per-category rows."""
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
        "fast_packing": run.packing,
        "draft_packing": run.draft_packing,
        "draft_dtype": None if run.draft_dtype is None else str(run.draft_dtype).removeprefix("torch."),
        "draft_weights": run.draft_weights,
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "plain_engine": plain_engine.describe() if plain_engine is not None else None,
        # what greedy speculative output is compared with: HF generate, or (low precision, where only
        # the fast path's forward is row-invariant) plain decoding on the fast path
        "lossless_reference": "fast plain decoding" if run.exact else "hf generate",
        "tasks": tasks,
        "per_category": per_category(categories, cfg),
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


def fmt(x, spec=".2f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
