"""One command from nothing to a measured draft: model -> data -> train -> eval -> export.

Each stage writes into its own folder under ``out`` and is skipped or resumed when a rerun
finds it done, so an interrupted quickstart picks up where it stopped. Its size is planned for a
time budget (``budget`` minutes, ``workflows.plan``): it measures this machine in its first half
minute, then chooses the data route, the conversations, the training steps and the eval so that
the whole run ends within the budget. The plan is an estimate; the budget is held by the stages
themselves, each run against the clock (``core.time_limit``): gen-data stops starting shards past
its planned time with some slack, training refits its step count to the time left once its steps
are timed, and eval measures as many prompts as the time left holds. The plan is kept in
``out/plan.json``, so a rerun resumes the same run; ``samples``, ``steps``, ``regenerate`` and
``eval_prompts`` override it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from ..core.hf_utils import text_config
from ..core.threads import adapt as adapt_threads


@dataclass
class QuickstartOptions:
    out: Path = Path("eagle3-quickstart")
    model: str | None = None  # default: SmolLM2-135M-Instruct (Hub, else the PyPI GGUF)
    # Minutes the whole run may take: measured and planned (workflows.plan). The fixed size it
    # replaced (300 regenerated conversations, 180 steps) took 14.5 to 18.8 min on quiet 2-core
    # machines and 40+ on a shared one (docs/benchmarks.md).
    budget: float = 20.0
    # The draft is data-bound (docs/scaling.png): regenerated conversations are read 3 times.
    samples: int | None = None  # training conversations (None: planned)
    steps: int | None = None  # optimizer steps of max_tokens tokens each (None: planned)
    # The target answers the prompts itself (in bf16 where the CPU multiplies bf16 natively), or
    # (False) training runs online on the dataset's own text, the target the teacher at every
    # position either way: the better draft for the time where regeneration is slow
    # (docs/benchmarks.md, "Which data and settings pay"). None: the plan chooses by the
    # measured generation rate (True when samples and steps are both given).
    regenerate: bool | None = None
    max_new_tokens: int = 128  # longest regenerated answer (with regenerate)
    max_length: int = 512  # prompt + answers per conversation (a longer first prompt is not answered)
    draft_vocab_size: str = "8192"
    # None: the plan's, the depth the verification costs measured here make pay (plan.choose_depth):
    # at most 3, where TTT 3 reached a higher held-out acceptance than TTT 7 in half the CPU time
    # (docs/benchmarks.md, training ablation); 1 where only a depth-1 tree pays.
    ttt_steps: int | None = None
    # None: the plan's, the family whose drafts measured ahead at the run's training time
    # (plan.choose_draft_type); "eagle3" or "dflash" pins it.
    draft_type: str | None = None
    max_tokens: int = 1024  # training tokens per optimizer step
    # Every position scored (train --loss-on all): the teacher is the target's own distribution at a
    # prompt position too, and a data-bound draft gains from the extra positions (docs/benchmarks.md).
    loss_on: str = "all"
    # train's default since 0.3.0 (with its norm before fc; 3e-3 destabilises that norm's first steps:
    # docs/benchmarks.md, "Defaults study")
    lr: float = 1e-3
    # Half soft cross-entropy, half acceptance loss (train --accept-loss): +0.02 chain-3 tau and
    # held-out acc_0 at the same steps (docs/benchmarks.md, the training ablation).
    accept_loss: float = 0.5
    # The first quarter of the steps unrolls one TTT step (train --ttt-warmup): acc_0 is learned
    # first and those steps cost a third; with the acceptance loss, chain-3 tau as high for 20%
    # less CPU time (docs/benchmarks.md, the training ablation).
    ttt_warmup_share: float = 0.25
    eval_prompts: int | None = None  # mt_bench prompts (both turns); None: planned
    eval_tokens: int = 64
    # "auto": eval measures the verify-cost curve and the draft's acceptance here and takes the tree
    # that decodes fastest (a weak draft on a CPU pays only with a tiny one); or "TOTAL,DEPTH[,TOPK]".
    tree: str = "auto"
    seed: int = 0
    repo_id: str | None = None  # name on the card; default <model>-eagle3
    base_model: str | None = None  # the target's Hub id for the card (needed when --model is a local folder)


@dataclass
class QuickstartResult:
    model: str
    draft: Path | None
    hub_folder: Path | None
    results: dict
    seconds: dict = field(default_factory=dict)
    plan: dict | None = None  # measurements and plan (workflows.plan.as_dict), when planned


def bundled_prompts(name: str = "mt_bench") -> Path:
    return Path(str(files("eagle3cli.prompts").joinpath(f"{name}.jsonl")))


def _model(opts: QuickstartOptions, log) -> str:
    if opts.model:
        return opts.model
    from ..core.realmodels import smollm2_dir

    log("[1/6] target: SmolLM2-135M-Instruct (cached after the first run)")
    return str(smollm2_dir())


def _prompts(opts: QuickstartOptions, log) -> Path:
    from ..core.realmodels import write_sharegpt_subset

    path = opts.out / "prompts.jsonl"
    if path.exists():
        return path
    log(f"[2/6] prompts: {opts.samples} ShareGPT conversations")
    return write_sharegpt_subset(path, opts.samples, seed=opts.seed)


def _gen_data(opts: QuickstartOptions, model: str, prompts: Path, log, minutes: float | None = None) -> Path:
    from ..config.options import GenDataOptions
    from ..data.gen_data import run
    from ..model.target import TargetSpec

    out = opts.out / "data"
    log(f"[3/6] gen-data -> {out}" + (" (target regenerates the answers)" if opts.regenerate else
                                      " (tokens only: the target runs during training, --online)"))
    # Without regeneration each conversation is trained on once, so its features are computed in
    # the training step (online) rather than written to disk and read back once.
    # Six shards at least, so that the time limit can stop between them; 32 conversations at least,
    # so that continuous batching fills its 32 slots.
    shard = min(100, max(32, -(-opts.samples // 6)))
    run(GenDataOptions(out=out, data=str(prompts), regenerate=opts.regenerate, max_new_tokens=opts.max_new_tokens,
                       max_length=opts.max_length, seed=opts.seed, batch_size=32, shard_size=shard,
                       features="offline" if opts.regenerate else "none", max_minutes=minutes,
                       draft_type=opts.draft_type or "eagle3",
                       adapt_threads=True),
        TargetSpec(model=model))
    return out


# With a time limit the planned steps are an estimate: training may run up to this many times as
# many when the machine turns out faster than measured (more passes over the same data).
STEP_CAP = 2


def _train(opts: QuickstartOptions, model: str, data: Path, log, minutes: float | None = None) -> Path:
    from ..config.train_config import resolve
    from ..train.checkpoints import checkpoint_dirs
    from ..train.trainer import train

    out = opts.out / "draft"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        log(f"[4/6] train: {out} already holds the trained draft")
        return out
    resume = bool(out.exists() and checkpoint_dirs(out))
    log(f"[4/6] train -> {out}" + (" (resuming)" if resume else "")
        + (f" within {minutes:.1f} min (the steps are fitted to it once timed)" if minutes else ""))
    # Held out: 5% of the conversations, at most 40 (online, each held-out token costs a target forward).
    val_fraction = min(0.05, 40 / max(1, opts.samples))
    flags = dict(data=str(data), model=model, out=str(out), max_steps=opts.steps, epochs=1000,
                 draft_vocab_size=opts.draft_vocab_size, ttt_steps=opts.ttt_steps, max_length=opts.max_length,
                 draft_type=opts.draft_type or "eagle3",
                 max_tokens=opts.max_tokens, lr=opts.lr, save_every=20, seed=opts.seed, resume=resume,
                 val_fraction=val_fraction,
                 eval_ttt_steps=7, loss_on=opts.loss_on, online=not opts.regenerate,
                 accept_loss=opts.accept_loss,
                 ttt_warmup=0 if opts.ttt_steps == 1 else int(opts.steps * opts.ttt_warmup_share))
    if minutes:  # a store that gen-data's limit stopped early is trained as it is
        flags.update(max_minutes=minutes, max_steps=opts.steps * STEP_CAP, allow_incomplete=True)
    cfg, recipe = resolve("auto", flags, model_type=_model_type(model))
    train(cfg, recipe)
    return out


def _model_type(model: str) -> str | None:
    from ..model.target import TargetSpec, load_config

    return getattr(text_config(load_config(TargetSpec(model=model))), "model_type", None)


def _eval(opts: QuickstartOptions, model: str, draft: Path, log, minutes: float | None = None) -> dict:
    from ..config.options import parse_tree
    from ..evaluate.eval_config import EvalConfig
    from ..evaluate.evaluate import evaluate_spec
    from ..evaluate.report import write_results
    from ..model.target import TargetSpec, load_tokenizer
    from ..publish.export import load_draft

    out = opts.out / "eval"
    if (out / "results.json").exists():
        log(f"[5/6] eval: reusing {out / 'results.json'}")
        return json.loads((out / "results.json").read_text())
    # With a time limit the planned prompts are an estimate too: as many more as the time allows.
    prompts = opts.eval_prompts * (STEP_CAP if minutes else 1)
    log(f"[5/6] eval: {f'up to {prompts}' if minutes else prompts} mt_bench prompts, plain vs speculative "
        f"decoding" + (f", within {minutes:.1f} min" if minutes else ""))
    spec = TargetSpec(model=model)
    tok = load_tokenizer(spec)
    auto, total, depth, top_k = parse_tree(opts.tree)
    cfg = EvalConfig(tasks=["mt_bench"], data=str(bundled_prompts()), limit=prompts,
                     max_new_tokens=opts.eval_tokens, mode="tree", total_tokens=total, depth=depth, top_k=top_k,
                     tree_auto=auto, max_minutes=minutes)
    from rich.progress import Progress

    from ..core.progress import LogProgress

    with Progress(transient=True) as bar, LogProgress("eval", prompts, "prompts", bar.console) as lines:
        job = bar.add_task("eval (plain + speculative)", total=prompts)

        def advance():
            bar.advance(job)
            lines.update(advance=1)

        results = evaluate_spec(spec, tok, lambda target: load_draft(draft, target=target)[0].eval(), cfg,
                                progress=advance, log=lambda m: None)
    results.update(target=model, draft=str(draft))
    write_results(results, out)
    return results


def _base_model(opts: QuickstartOptions, model: str) -> str:
    """The target's Hub id the card will name, settled before any work: a local --model folder of
    unknown origin needs --base-model, and finding that out after training would waste the run."""
    from ..publish.push import hub_id_of

    return hub_id_of(model, opts.base_model, local="--model is the local folder")


def _export(opts: QuickstartOptions, base_model: str, draft: Path, log) -> Path:
    from ..publish.push import dry_run

    out = opts.out / "hub"
    repo = opts.repo_id or f"your-name/{base_model.split('/')[-1]}-eagle3"
    log(f"[6/6] export: the folder `eagle3 push` would upload -> {out}")
    dry_run(draft, out, repo, eval_results=[opts.out / "eval" / "results.json"], base_model=base_model)
    return out


PLAN = "plan.json"


def _plan_flags(opts: QuickstartOptions):
    from .plan import PlanFlags

    return PlanFlags(budget_min=opts.budget, regenerate=opts.regenerate, samples=opts.samples, steps=opts.steps,
                     eval_prompts=opts.eval_prompts, max_tokens=opts.max_tokens,
                     ttt_warmup_share=opts.ttt_warmup_share, eval_tokens=opts.eval_tokens, ttt_steps=opts.ttt_steps,
                     draft_type=opts.draft_type)


def _sample(opts: QuickstartOptions, n: int = 200) -> list:
    """Conversations of the data the run will use, to measure their lengths."""
    from ..core.realmodels import write_sharegpt_subset
    from ..data.sources import load_conversations

    path = opts.out / "prompts.jsonl"
    if not path.exists():
        path = opts.out / "plan-sample.jsonl"
        if not path.exists():
            write_sharegpt_subset(path, n, seed=opts.seed + 1)
    return load_conversations(str(path), max_samples=n)[0]


def plan_run(opts: QuickstartOptions, model: str, started: float, log) -> dict:
    """Measure this machine and plan the run for ``opts.budget`` (or reuse out/plan.json when it was
    planned for the same flags: a rerun resumes the same run). Returns plan.as_dict's dict."""
    from dataclasses import asdict

    from .plan import as_dict, make_plan, measure, measurement_lines

    flags = asdict(_plan_flags(opts))
    saved = opts.out / PLAN
    if saved.exists():
        kept = json.loads(saved.read_text())
        if kept.get("flags") == flags and kept.get("model") == model:
            log(f"plan: reusing {saved} ({kept['plan']['conversations']} conversations, {kept['plan']['steps']} steps)")
            return kept
    log("measuring this machine (half a minute; more on busy cores) ...")
    m = measure(model, _sample(opts), opts.max_new_tokens, opts.max_length, opts.max_tokens, opts.ttt_steps or 3,
                opts.accept_loss, started)
    for line in measurement_lines(m):
        log(f"  {line}")
    plan = make_plan(m, _plan_flags(opts))  # BudgetError: one line, before any work
    for line in plan.reasons:
        log(f"plan: {line}")
    out = {**as_dict(m, plan), "flags": flags, "model": model}
    from ..core.io_utils import write_text

    write_text(saved, json.dumps(out, indent=1) + "\n")
    return out


def _size(opts: QuickstartOptions, model: str, started: float, log, plan_only: bool) -> dict | None:
    """Fill the options the plan sizes; the plan's dict, None when every size was given."""
    if not plan_only and opts.samples is not None and opts.steps is not None:
        opts.regenerate = True if opts.regenerate is None else opts.regenerate
        opts.eval_prompts = opts.eval_prompts or 4
        opts.ttt_steps = opts.ttt_steps or 3
        return None
    planned = plan_run(opts, model, started, log)
    p = planned["plan"]
    opts.regenerate, opts.samples, opts.steps = p["regenerate"], p["conversations"], p["steps"]
    opts.eval_prompts = p["eval_prompts"]
    opts.ttt_steps = p.get("ttt_steps") or opts.ttt_steps or 3
    opts.draft_type = p.get("draft_type") or opts.draft_type or "eagle3"
    return planned


def _minutes(planned: dict | None, stage: str, started: float) -> float | None:
    """The stage's time limit (plan.stage_minutes); None where the user fixed its size (--max-samples
    and --max-steps both, --max-steps for training, --num-prompts for eval)."""
    from .plan import Measurements, Plan, PlanFlags, stage_minutes

    given = {"train": "steps", "eval": "eval_prompts"}
    if planned is None or (stage in given and planned["flags"].get(given[stage]) is not None):
        return None
    p = planned["plan"]
    plan = Plan(p["regenerate"], p["conversations"], p["steps"], p["warmup_steps"], p["eval_prompts"], p["seconds"],
                ttt_steps=p.get("ttt_steps", 3), draft_type=p.get("draft_type", "eagle3"))
    return stage_minutes(Measurements(**planned["measurements"]), PlanFlags(**planned["flags"]), plan, stage,
                         time.perf_counter() - started)


def run(opts: QuickstartOptions, log=print, plan_only: bool = False) -> QuickstartResult:
    """The whole quickstart; ``plan_only``: measure and plan, print, write nothing else."""
    opts.out = Path(opts.out)
    t, seconds = time.perf_counter(), {}
    started = t

    def lap(name):
        nonlocal t
        now = time.perf_counter()
        seconds[name] = round(now - t, 1)
        t = now

    model = _model(opts, log)
    base_model = _base_model(opts, model)
    lap("model")
    from ..core.io_utils import ensure_dir

    ensure_dir(opts.out)
    planned = _size(opts, model, started, log, plan_only)
    if planned is not None:
        lap("measure")
    if plan_only:
        return QuickstartResult(model=model, draft=None, hub_folder=None, results={}, seconds=seconds, plan=planned)
    prompts = _prompts(opts, log)
    data = _gen_data(opts, model, prompts, log, _minutes(planned, "gen-data", started))
    lap("gen-data")
    adapt_threads("train", log)  # probed again: a job that started beside the run changes the choice
    draft = _train(opts, model, data, log, _minutes(planned, "train", started))
    lap("train")
    adapt_threads("eval", log)
    results = _eval(opts, model, draft, log, _minutes(planned, "eval", started))
    lap("eval")
    hub = _export(opts, base_model, draft, log)
    lap("export")
    return QuickstartResult(model=model, draft=draft, hub_folder=hub, results=results, seconds=seconds, plan=planned)
