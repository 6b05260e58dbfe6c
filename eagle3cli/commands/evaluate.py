"""`eagle3 eval`: tau, n-alpha, tokens/s and speedup of a draft, with a lossless check."""

from __future__ import annotations

from pathlib import Path

from ..config.options import EvalOptions
from .common import console, fail, flags_from, report_console


@flags_from(EvalOptions, required=("model",))
def evaluate(**flags):
    """Speculative vs plain decoding on the same prompts: tau, n-alpha, tokens/s, speedup, lossless check."""
    from ..config.options import from_flags

    opts = from_flags(EvalOptions, flags)
    opts.validate()  # every flag, before the library (torch, transformers) is imported
    from ..model.target import TargetSpec

    server_bin = grid = None
    if opts.engine == "llama.cpp":
        from ..evaluate.eval_config import EngineGrid
        from ..evaluate.llamacpp import check_conversion, find_binary

        server_bin = find_binary(llama_cpp=opts.llama_cpp)  # before any model is loaded
        grid = EngineGrid.from_options(opts)  # types asked for are converted even beside a given file
        check_conversion(opts.model, None if grid.target_types else opts.target_gguf,
                         None if grid.draft_types else opts.draft_gguf, opts.llama_cpp,
                         dflash=draft_type(opts.draft) == "dflash")
    spec = TargetSpec.of(opts)
    if opts.engine == "vllm":  # no vLLM there, or a family vLLM refuses: one line before anything runs
        from ..evaluate.vllm_eval import check_python, check_target
        from ..model.target import load_config

        check_python(opts.vllm_python)
        check_target(load_config(spec))
    engine = {"llama.cpp": lambda: _run_engine(opts, spec, server_bin, grid),
              "vllm": lambda: _run_vllm(opts, spec)}.get(opts.engine)
    if opts.engine_only:  # the engine's numbers alone
        return _finish(_no_tasks(opts), opts, engine())
    results = _run_ours(opts, spec)
    _finish(results, opts, engine() if engine else None)


def _no_tasks(opts: EvalOptions) -> dict:
    """The results of a run without our generator: the settings llama-server ran with."""
    from ..core.hardware import describe

    settings = {"mode": "chain", "steps": opts.steps, "temperature": opts.temperature,
                "max_new_tokens": opts.max_new_tokens}
    return {"hardware": describe(), "settings": settings, "tasks": {}, "per_category": []}


def _run_ours(opts: EvalOptions, spec) -> dict:
    """Our generator on every task: checks the draft against the target before loading either."""
    import torch

    from ..decode.generator import check_supported
    from ..evaluate.eval_config import EvalConfig
    from ..evaluate.evaluate import check_draft, evaluate_spec
    from ..evaluate.tasks import load_task
    from ..model.target import load_config, load_tokenizer
    from ..publish.formats.readers import read_draft
    from ..publish.formats.writers import as_ours

    cfg = EvalConfig.from_options(opts)
    target_config = load_config(spec)
    check_supported(target_config)
    if draft_type(opts.draft) == "dflash":
        return _run_dflash(opts, spec, cfg, target_config)
    loaded = as_ours(opts.draft, target_config, say=lambda m: console.print(m, highlight=False))  # any format
    check_draft(loaded, target_config)
    n_prompts = sum(len(load_task(t, opts.data, opts.limit)[1]) for t in opts.task)  # fail early on bad tasks
    tokenizer = load_tokenizer(spec)

    def draft_for(target):
        d, _ = read_draft(loaded, target=target, dtype=torch.float32, device=next(target.parameters()).device)
        return d.eval()  # read_draft: norm_before_residual too

    return _with_progress(n_prompts, lambda advance: evaluate_spec(spec, tokenizer, draft_for, cfg, progress=advance,
                                                                   log=lambda m: console.print(m, highlight=False)))


def draft_type(draft_dir) -> str:
    """The draft family a draft folder's config.json names (``publish.dflash_layout.draft_type_of``:
    ``dflash`` for z-lab's, speculators' or our DFlash layout, else ``eagle3``); ``eagle3`` where
    there is no readable config.json, so that the EAGLE-3 readers say what is wrong with the folder."""
    import json

    from ..publish.dflash_layout import draft_type_of

    try:
        raw = json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "eagle3"
    return draft_type_of(raw)


def _run_dflash(opts: EvalOptions, spec, cfg, target_config) -> dict:
    """Our generator with a DFlash draft: checked against the target before either loads, its held-out
    per-position acceptance (the training record) handed to --tree auto's report."""
    import dataclasses

    import torch

    from ..evaluate.evaluate import check_draft, evaluate_spec
    from ..evaluate.tasks import load_task
    from ..model.target import load_tokenizer
    from ..publish.export import METADATA_KEY, load_draft, read_config

    check_draft(opts.draft, target_config)
    metrics = (read_config(opts.draft).get(METADATA_KEY) or {}).get("metrics") or {}
    if metrics.get("split") == "held-out" and metrics.get("acc"):
        cfg = dataclasses.replace(cfg, heldout_acc=tuple(float(a) for a in metrics["acc"]))
    n_prompts = sum(len(load_task(t, opts.data, opts.limit)[1]) for t in opts.task)  # fail early on bad tasks
    tokenizer = load_tokenizer(spec)

    def draft_for(target):
        d, _ = load_draft(opts.draft, target=target, dtype=torch.float32, device=next(target.parameters()).device)
        return d.eval()

    return _with_progress(n_prompts, lambda advance: evaluate_spec(spec, tokenizer, draft_for, cfg, progress=advance,
                                                                   log=lambda m: console.print(m, highlight=False)))


def _with_progress(n_prompts: int, run):
    """``run(advance)`` under a progress bar of ``n_prompts`` (in a log file one line per prompt, and
    one at least every 30 s while a prompt runs: core/progress.py)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..core.progress import LogProgress

    with Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar, LogProgress("eval", n_prompts, "prompts", console) as log:
        job = bar.add_task("prompts", total=n_prompts)

        def advance():
            bar.advance(job)
            log.update(advance=1, force=True)  # a log file gets no live bar: one line per prompt

        return run(advance)


def _run_engine(opts: EvalOptions, spec, server_bin, grid) -> dict:
    """The draft in llama-server, in every setting of the grid (eagle3cli/evaluate/llamacpp_sweep.py):
    the results' ``engine`` section."""
    import signal
    import sys

    from ..evaluate.llamacpp_sweep import grid_files, sweep
    from ..evaluate.tasks import load_task
    from ..model.target import load_tokenizer

    say = lambda m: console.print(m, highlight=False)  # noqa: E731
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop llama-server too when killed
    loaded = [load_task(t, opts.data, opts.limit) for t in opts.task]
    targets, drafts = grid_files(grid, opts.draft, spec.model, Path(opts.out) / "gguf", opts.llama_cpp, log=say)
    spec_type = "draft-dflash" if draft_type(opts.draft) == "dflash" else "draft-eagle3"
    return sweep(loaded, load_tokenizer(spec), server_bin, targets, drafts, grid.n_max, grid.p_min,
                 max_new_tokens=opts.max_new_tokens, threads=opts.engine_threads, log_dir=Path(opts.out), log=say,
                 spec_type=spec_type)


def _run_vllm(opts: EvalOptions, spec) -> dict:
    """The draft in vLLM (eagle3cli/evaluate/vllm_eval.py): the results' ``engine`` section."""
    import signal
    import sys

    from ..evaluate.tasks import load_task
    from ..evaluate.vllm_eval import run
    from ..model.target import load_config, load_tokenizer

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the vLLM worker too when killed
    loaded = [load_task(t, opts.data, opts.limit) for t in opts.task]
    return run(loaded, load_tokenizer(spec), opts.vllm_python, spec.model, opts.draft, k=opts.steps,
               max_new_tokens=opts.max_new_tokens, out=Path(opts.out), target_config=load_config(spec),
               dtype=None if opts.dtype == "auto" else opts.dtype, threads=opts.engine_threads,
               log=lambda m: console.print(m, highlight=False))


def _finish(results, opts: EvalOptions, section):
    from ..evaluate.report import write_results

    results["target"] = opts.model
    results["draft"] = str(opts.draft)
    if section is not None:
        results["engine"] = section
    js, png = write_results(results, opts.out)
    show(results)
    console.print(f"wrote {js}" + (f" and {png}" if png else ""))
    bad = {t: r["mismatches"] for t, r in results["tasks"].items() if r["mismatches"]}
    if bad:
        fail("lossless check failed (speculative output differs from greedy): "
             + "; ".join(f"{t}: {', '.join(map(str, ids))}" for t, ids in bad.items()))


def show(results: dict):
    from rich.table import Table

    from ..evaluate.report import fmt

    out = report_console()
    if results.get("engine"):
        if results["engine"].get("name") == "vLLM":
            from ..evaluate.vllm_eval import engine_table
        else:
            from ..evaluate.llamacpp_sweep import engine_table
        out.print(engine_table(results["engine"]))
    if not results["tasks"]:
        return
    s = results["settings"]
    shape = (f"steps {s['steps']}" if s["mode"] == "chain"
             else f"{s['total_tokens']} nodes, depth {s['depth']}, top-k {s['top_k']}")
    t = Table(title=f"eagle3 eval: {s['mode']} ({shape}), T={s['temperature']}, {results['hardware']}")
    has_pl = any("prompt_lookup" in r["tokens_per_s"] for r in results["tasks"].values())
    has_llama = any("baseline_llamacpp" in r["tokens_per_s"] for r in results["tasks"].values())
    for col in (["task", "prompts", "path", "tau", "plain HF tok/s", "plain fast tok/s"]
                + (["plain llama.cpp tok/s"] if has_llama else []) + ["spec tok/s", "cycle/step", "speedup"]
                + (["lookup tok/s"] if has_pl else []) + ["n-alpha", "lossless"]):
        t.add_column(col, justify="left" if col in ("task", "n-alpha") else "right")
    for name, r in results["tasks"].items():
        tps = r["tokens_per_s"]
        alpha = " ".join(fmt(a) for a in r["n_alpha"]) if r["n_alpha"] else "-"
        lossless = {True: "[green]yes[/]", False: "[red]NO[/]", None: "n/a (T>0)"}[r["lossless"]]
        row = [name, str(r["num_prompts"]), r.get("path") or "-", fmt(r["tau"]), fmt(tps.get("baseline_hf"), ".1f"),
               fmt(tps.get("baseline_fast"), ".1f")] + ([fmt(tps.get("baseline_llamacpp"), ".1f")] if has_llama else [])
        row += [fmt(tps["speculative"], ".1f"), fmt(r.get("cycle_ratio")),
                fmt(r["speedup"]) + "x" if r["speedup"] else "-"]
        if has_pl:
            row.append(fmt(tps.get("prompt_lookup"), ".1f"))
        t.add_row(*row, alpha, lossless)
    out.print(t)
    cats = Table(title="per category")
    for col in ["task", "category", "prompts", "tau", "plain tok/s", "spec tok/s", "speedup"]:
        cats.add_column(col, justify="left" if col in ("task", "category") else "right")
    for c in results["per_category"]:
        cats.add_row(c["task"], c["category"], str(c["num_prompts"]), fmt(c["tau"]),
                     fmt(c["tokens_per_s"]["baseline"], ".1f"), fmt(c["tokens_per_s"]["speculative"], ".1f"),
                     fmt(c["speedup"]) + "x" if c["speedup"] else "-")
    out.print(cats)
    for name, r in results["tasks"].items():
        if r.get("cycle_ms"):
            ms = r["cycle_ms"]
            out.print(f"{name}: per cycle draft {ms['draft']:.1f} ms, verify {ms['verify']:.1f} ms, "
                      f"bookkeeping {ms['bookkeeping']:.1f} ms; speedup is against the fastest plain decoding"
                      + (f" ({BASELINE_NAMES.get(r.get('baseline_from'), r.get('baseline_from'))})"
                         if r.get("baseline_from") else ""), highlight=False)


BASELINE_NAMES = {"hf": "HF generate", "fast": "our fast path", "llamacpp": "llama.cpp"}
