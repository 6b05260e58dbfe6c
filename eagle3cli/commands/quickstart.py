"""`eagle3 quickstart`: a real model from nothing to a measured, servable draft."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..config.options import Alias
from ..workflows.quickstart import QuickstartOptions
from .common import aliased, console, report_console


@aliased(("max_samples", Alias("--samples")), ("max_steps", Alias("--steps")),
         ("num_prompts", Alias("--eval-prompts")))
def quickstart(
    out: Path = typer.Option(Path("eagle3-quickstart"), "--out", "-o", help="Working folder (rerun to resume)."),
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Another target (Hub id or folder); default SmolLM2-135M-Instruct."),
    budget: float = typer.Option(QuickstartOptions.budget, "--budget", metavar="MINUTES",
                                 help="Minutes the whole run may take: it measures this machine first (half a minute, "
                                      "more on busy cores), then sizes the data route, conversations, training "
                                      "steps and eval to end within them."),
    plan_only: bool = typer.Option(False, "--plan-only",
                                   help="Measure, print the measurements and the plan, and exit."),
    max_samples: Optional[int] = typer.Option(None, "--max-samples",
                                              help="Training conversations (ShareGPT). (default: planned for "
                                                   "--budget)"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Optimizer steps (1024 tokens each; the TTT "
                                                                      "depth planned). (default: planned)"),
    regenerate: Optional[bool] = typer.Option(None, "--regenerate/--no-regenerate",
                                              help="Have the target answer the prompts, or train online on "
                                                   "ShareGPT's own text with the target as teacher. (default: "
                                                   "planned: regenerate where the target generates fast enough "
                                                   "here for regenerated data to pay for its time)"),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts",
                                              help="mt_bench prompts to evaluate (both turns). (default: planned, "
                                                    "4 per 20 minutes of budget)"),
    repo: Optional[str] = typer.Option(None, "--repo", help="Hub repo id to name in the model card."),
    base_model: Optional[str] = typer.Option(None, "--base-model",
                                             help="The target's Hub id for the card and serving commands "
                                                  "(needed when --model is a local folder)."),
):
    """Take SmolLM2 (or --model) through gen-data, train, eval and export, sized to end within --budget."""
    from rich.table import Table

    from ..workflows.quickstart import run

    opts = QuickstartOptions(out=out, model=model, budget=budget, samples=max_samples, steps=max_steps,
                             regenerate=regenerate, eval_prompts=num_prompts, repo_id=repo, base_model=base_model)
    # user errors (a budget below the minimum too): Eagle3Error, one line
    res = run(opts, log=lambda m: console.print(m, highlight=False, markup=False), plan_only=plan_only)
    if plan_only:
        return
    from ..publish.model_card import sglang_command, vllm_command

    task = res.results["tasks"]["mt_bench"]
    tps = task["tokens_per_s"]
    table = Table(title="eagle3 quickstart", show_header=False)
    table.add_row("target", res.model)
    st = res.results["settings"]
    table.add_row("tree (nodes, depth, top-k)", f"{st['total_tokens']}, {st['depth']}, {st['top_k']}"
                  + (" (auto: the fastest measured here)" if st.get("tree_auto") else ""))
    table.add_row("tau (mean acceptance length)", f"{task['tau']:.2f}" if task["tau"] else "-")
    table.add_row("plain decoding", plain_decoding(tps))
    table.add_row("speculative decoding", f"{tps['speculative']:.1f} tok/s" if tps.get("speculative") else "-")
    table.add_row("speedup", f"{task['speedup']:.2f}x" if task["speedup"] else "-")
    table.add_row("lossless (greedy-identical)", "yes" if task["lossless"] else "NO")
    table.add_row("eval prompts", eval_prompts_cell(res.results, opts.eval_prompts))
    table.add_row("draft folder", str(res.draft))
    table.add_row("Hub-ready folder", str(res.hub_folder))
    table.add_row("wall time", " + ".join(f"{k} {v:.0f}s" for k, v in res.seconds.items()))
    if res.plan is not None:
        table.add_row("budget", f"{opts.budget:g} min: planned {res.plan['plan']['total_s'] / 60:.1f}, "
                                f"took {sum(res.seconds.values()) / 60:.1f}")
    out = report_console()
    out.print(table)
    out.print(f"serve with SGLang:\n  {sglang_command(res.model, str(res.draft))}\n"
              f"serve with vLLM:\n  {vllm_command(res.model, str(res.draft))}", highlight=False, soft_wrap=True)


def eval_prompts_cell(results: dict, planned: int | None) -> str:
    """How many mt_bench prompts the table measured and, when fewer than planned, why."""
    done = results["tasks"]["mt_bench"]["num_prompts"]
    if not planned or done >= planned:
        return str(done)
    limit = results.get("time_limit")
    why = (f": the eval's time limit ({limit['minutes']:.1f} min) came first, the machine ran slower than "
           "measured" if limit else "")
    return f"{done} of {planned} planned{why}"


def plain_decoding(tps: dict) -> str:
    """The table's plain-decoding cell: the fastest plain decoder's tokens/s (what the speedup is
    against), with ours and llama.cpp's beside it where llama.cpp was measured too."""
    if not tps.get("baseline"):
        return "-"
    if not tps.get("baseline_llamacpp"):
        return f"{tps['baseline']:.1f} tok/s"
    ours = max(tps.get("baseline_hf") or 0, tps.get("baseline_fast") or 0)
    return f"{tps['baseline']:.1f} tok/s (llama.cpp {tps['baseline_llamacpp']:.1f}, ours {ours:.1f})"
