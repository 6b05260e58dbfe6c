"""`eagle3 eval`: tau, n-alpha, tokens/s and speedup of a draft, with a lossless check."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import (Adapter, Device, Dtype, Load4, Load8, Model, Revision, TrustRemoteCode, console, fail,
                     report_console, target_spec)


def parse_tree(text: str) -> tuple[bool, int, int, int]:
    """``auto`` or ``TOTAL,DEPTH[,TOPK]`` -> (auto, total_tokens, depth, top_k)."""
    if text.strip().lower() == "auto":
        return True, 60, 8, 10
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (2, 3) or min(parts) < 1:
        raise ValueError(f"--tree must be 'auto' or TOTAL,DEPTH[,TOPK] with positive integers, got {text!r}")
    return False, parts[0], parts[1], parts[2] if len(parts) == 3 else 10


def evaluate(
    model: str = Model,
    draft: str = typer.Option(..., "--draft", "-d", help="Draft directory (config.json + model.safetensors)."),
    task: List[str] = typer.Option(["mt_bench"], "--task", "-t",
                                   help="mt_bench, gsm8k, humaneval, alpaca, sum, or a .jsonl turns file; repeatable."),
    data: Optional[str] = typer.Option(None, "--data", help="Local turns file (JSONL with 'turns') for the task."),
    out: Path = typer.Option(Path("eval_out"), "--out", "-o", help="Folder for results.json and results.png."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Evaluate only the first N prompts of each task."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (checked token for token)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    sampling_top_k: int = typer.Option(0, "--sampling-top-k", help="Top-k filter of the sampling distribution (0 = off)."),
    mode: str = typer.Option("tree", "--mode", help="tree (EAGLE-2 dynamic tree) or chain."),
    tree: Optional[str] = typer.Option(None, "--tree", help="auto (measured on this hardware) or TOTAL,DEPTH[,TOPK]; "
                                       "default 60,8,10 on a GPU, 12,4,4 on a CPU."),
    steps: int = typer.Option(3, "--steps", help="Chain mode: drafted tokens per cycle."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="prompt-lookup: add HF prompt-lookup decoding."),
    seed: int = typer.Option(0, "--seed"),
    fast: str = typer.Option("auto", "--fast", help="auto|on|off: verify through the fast path (static cache, packed "
                             "matmuls; Llama/Mistral/Qwen2/Qwen3, greedy) where it applies, and measure plain "
                             "decoding on it too; speedup is against the faster plain decoding."),
    revision: Optional[str] = Revision,
    dtype: str = Dtype,
    device: Optional[str] = Device,
    load_in_8bit: bool = Load8,
    load_in_4bit: bool = Load4,
    adapter: Optional[str] = Adapter,
    trust_remote_code: bool = TrustRemoteCode,
    engine: str = typer.Option("eagle3", "--engine", help="eagle3 (our generator), llama.cpp or vllm: also measure "
                               "the draft in llama-server or vLLM (chain of --steps, greedy), beside our numbers."),
    engine_only: bool = typer.Option(False, "--engine-only", help="With --engine llama.cpp|vllm: skip our generator."),
    llama_cpp: Optional[Path] = typer.Option(None, "--llama-cpp", metavar="DIR",
                                             help="Where llama-server is (or a llama.cpp tree with build/bin); "
                                                  "default: $EAGLE3_LLAMA_CPP, then PATH."),
    target_gguf: Optional[Path] = typer.Option(None, "--target-gguf", metavar="FILE",
                                               help="The target as GGUF (default: converted from --model into OUT/gguf)."),
    draft_gguf: Optional[Path] = typer.Option(None, "--draft-gguf", metavar="FILE",
                                              help="The draft as GGUF (default: exported into OUT/gguf)."),
    engine_threads: Optional[int] = typer.Option(None, "--engine-threads", help="llama.cpp -t, vLLM's "
                                                  "OMP_NUM_THREADS (default: their own)."),
    engine_p_min: float = typer.Option(0.0, "--engine-p-min",
                                       help="llama.cpp --spec-draft-p-min (0: always draft --steps tokens, as chain mode)."),
    # --engine vllm (eagle3cli/vllm_eval.py): the interpreter of the environment that has vLLM.
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", envvar="EAGLE3_VLLM_PYTHON",
                                              help="--engine vllm: the python of the environment with vLLM "
                                                   "(default: this one)."),
):
    """Speculative vs plain decoding on the same prompts: tau, n-alpha, tokens/s, speedup, lossless check."""
    if engine not in ("eagle3", "llama.cpp", "vllm"):
        fail(f"--engine must be eagle3, llama.cpp or vllm, got {engine!r}")
    if engine_only and engine == "eagle3":
        fail("--engine-only needs --engine llama.cpp or vllm")
    if engine == "vllm":
        if temperature != 0:
            fail("--engine vllm measures greedy decoding: drop --temperature")
        from ..vllm_eval import VllmEngineError, check_python

        try:
            check_python(vllm_python)  # one line now rather than after our generator has run
        except VllmEngineError as e:
            fail(str(e))
    server_bin = None
    if engine == "llama.cpp":
        if temperature != 0:
            fail("--engine llama.cpp measures greedy decoding: drop --temperature")
        from ..llamacpp import LlamaCppError, find_binary

        try:
            server_bin = find_binary(llama_cpp=llama_cpp)
        except LlamaCppError as e:
            fail(str(e))
    if mode not in ("tree", "chain"):
        fail(f"--mode must be tree or chain, got {mode!r}")
    if baseline not in (None, "prompt-lookup"):
        fail(f"--baseline must be prompt-lookup, got {baseline!r}")
    if not temperature >= 0 or not 0 < top_p <= 1:  # "not >=": NaN is refused too
        fail("--temperature must be >= 0 and --top-p in (0, 1]")
    if max_new_tokens < 1 or steps < 1:
        fail("--max-new-tokens and --steps must be at least 1")
    if fast not in ("auto", "on", "off"):
        fail(f"--fast must be auto, on or off, got {fast!r}")
    if data and len(task) != 1:
        fail("--data gives the prompts of one task; pass a single --task with it")
    from ..errors import check_out_dir

    check_out_dir(out, "--out")  # before any prompt is run: results are written last
    if tree is None:
        import torch

        on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        tree = "60,8,10" if on_gpu else "12,4,4"
    try:
        auto, total, depth, top_k = parse_tree(tree)
    except ValueError as e:
        fail(str(e))

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..evaluate import EvalConfig, EvalError, check_draft, fmt, load_task, write_results
    from ..evaluate import evaluate as run_eval
    import torch

    from ..formats import as_ours, read_draft
    from ..generator import UnsupportedTarget, check_supported
    from ..target import load_config, load_target, load_tokenizer

    spec = target_spec(model, revision, dtype, device, load_in_8bit, load_in_4bit, adapter, trust_remote_code)
    if engine == "vllm":  # an engine that refuses the target family: one line before anything runs
        from ..vllm_eval import check_target

        try:
            check_target(load_config(spec))
        except (VllmEngineError, OSError, ValueError) as e:
            fail(str(e))
    run_engine = (lambda: _run_vllm(spec, draft, task, data, limit, out, max_new_tokens, steps, vllm_python, dtype,
                                    engine_threads)) if engine == "vllm" else \
        (lambda: _run_engine(spec, draft, task, data, limit, out, max_new_tokens, steps, server_bin, llama_cpp,
                             target_gguf, draft_gguf, engine_threads, engine_p_min, temperature))
    if engine_only:
        from ..evaluate import hardware

        results = {"hardware": hardware(), "settings": {"mode": "chain", "steps": steps, "temperature": temperature,
                                                        "max_new_tokens": max_new_tokens}, "tasks": {}, "per_category": []}
        return _finish(results, model, draft, out, run_engine())
    cfg = EvalConfig(tasks=list(task), data=data, limit=limit, max_new_tokens=max_new_tokens,
                     temperature=temperature, top_p=top_p, sampling_top_k=sampling_top_k, mode=mode,
                     total_tokens=total, depth=depth, top_k=top_k, steps=steps, tree_auto=auto,
                     prompt_lookup=baseline == "prompt-lookup", seed=seed, fast=fast)
    try:
        target_config = load_config(spec)
        check_supported(target_config)
        loaded = as_ours(draft, target_config, say=lambda m: console.print(m, highlight=False))  # any format
        check_draft(loaded, target_config)
        n_prompts = sum(len(load_task(t, data, limit)[1]) for t in task)  # fail early on bad tasks
        target = load_target(spec)
        tokenizer = load_tokenizer(spec)
        dev = next(target.parameters()).device
        d, _ = read_draft(loaded, target=target, dtype=torch.float32, device=dev)  # norm_before_residual too
        d.eval()
        with Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            job = bar.add_task("prompts", total=n_prompts)

            def advance():
                bar.advance(job)
                if not console.is_terminal:  # a log file gets no live bar: one line per prompt
                    t = bar.tasks[0]
                    console.print(f"eval: {int(t.completed)}/{n_prompts} prompts, {int(t.elapsed or 0)} s",
                                  highlight=False)

            results = run_eval(target, tokenizer, d, cfg, progress=advance,
                               log=lambda m: console.print(m, highlight=False))
    except (EvalError, UnsupportedTarget, FileNotFoundError, ValueError) as e:
        fail(str(e))
    section = run_engine() if engine != "eagle3" else None
    _finish(results, model, draft, out, section)


def _run_engine(spec, draft, tasks, data, limit, out, max_new_tokens, steps, server_bin, llama_cpp, target_gguf,
                draft_gguf, threads, p_min, temperature) -> dict:
    """The draft in llama-server (eagle3cli/llamacpp.py): the results' ``engine`` section."""
    from ..evaluate import EvalError, load_task
    from ..llamacpp import LlamaCppError, engine_files, run
    from ..target import load_tokenizer

    import signal
    import sys

    say = lambda m: console.print(m, highlight=False)  # noqa: E731
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop llama-server too when killed
    try:
        loaded = [load_task(t, data, limit) for t in tasks]
        tg, dg = engine_files(draft, spec.model, Path(out) / "gguf", target_gguf, draft_gguf, llama_cpp, log=say)
        return run(loaded, load_tokenizer(spec), server_bin, tg, dg, n_max=steps, p_min=p_min,
                   max_new_tokens=max_new_tokens, threads=threads, log_dir=Path(out), log=say)
    except (LlamaCppError, EvalError) as e:
        fail(str(e))


def _run_vllm(spec, draft, tasks, data, limit, out, max_new_tokens, steps, python, dtype, threads) -> dict:
    """The draft in vLLM (eagle3cli/vllm_eval.py): the results' ``engine`` section."""
    from ..evaluate import EvalError, load_task
    from ..formats import FormatError
    from ..target import load_config, load_tokenizer
    from ..vllm_eval import VllmEngineError, run

    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the vLLM worker too when killed
    try:
        loaded = [load_task(t, data, limit) for t in tasks]
        return run(loaded, load_tokenizer(spec), python, spec.model, draft, k=steps, max_new_tokens=max_new_tokens,
                   out=Path(out), target_config=load_config(spec), dtype=None if dtype == "auto" else dtype,
                   threads=threads, log=lambda m: console.print(m, highlight=False))
    except (VllmEngineError, EvalError, FormatError, FileNotFoundError) as e:
        fail(str(e))


def _finish(results, model, draft, out, section):
    from ..evaluate import write_results

    results["target"] = model
    results["draft"] = str(draft)
    if section is not None:
        results["engine"] = section
    js, png = write_results(results, out)
    show(results)
    console.print(f"wrote {js}" + (f" and {png}" if png else ""))
    bad = {t: r["mismatches"] for t, r in results["tasks"].items() if r["mismatches"]}
    if bad:
        fail("lossless check failed (speculative output differs from greedy): "
             + "; ".join(f"{t}: {', '.join(map(str, ids))}" for t, ids in bad.items()))


def show(results: dict):
    from rich.table import Table

    from ..evaluate import fmt

    out = report_console()
    if results.get("engine"):
        if results["engine"].get("name") == "vLLM":
            from ..vllm_eval import engine_table
        else:
            from ..llamacpp import engine_table

        out.print(engine_table(results["engine"]))
    if not results["tasks"]:
        return
    s = results["settings"]
    shape = f"steps {s['steps']}" if s["mode"] == "chain" else f"{s['total_tokens']} nodes, depth {s['depth']}, top-k {s['top_k']}"
    t = Table(title=f"eagle3 eval: {s['mode']} ({shape}), T={s['temperature']}, {results['hardware']}")
    has_pl = any("prompt_lookup" in r["tokens_per_s"] for r in results["tasks"].values())
    for col in ["task", "prompts", "path", "tau", "plain HF tok/s", "plain fast tok/s", "spec tok/s", "cycle/step",
                "speedup"] + (["lookup tok/s"] if has_pl else []) + ["n-alpha", "lossless"]:
        t.add_column(col, justify="left" if col in ("task", "n-alpha") else "right")
    for name, r in results["tasks"].items():
        tps = r["tokens_per_s"]
        alpha = " ".join(fmt(a) for a in r["n_alpha"]) if r["n_alpha"] else "-"
        lossless = {True: "[green]yes[/]", False: "[red]NO[/]", None: "n/a (T>0)"}[r["lossless"]]
        row = [name, str(r["num_prompts"]), r.get("path") or "-", fmt(r["tau"]), fmt(tps.get("baseline_hf"), ".1f"),
               fmt(tps.get("baseline_fast"), ".1f"), fmt(tps["speculative"], ".1f"), fmt(r.get("cycle_ratio")),
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
                      f"bookkeeping {ms['bookkeeping']:.1f} ms; speedup is against the faster plain decoding",
                      highlight=False)
