"""The EAGLE-3 trainer: feature store -> TTT training -> exported draft directory.

    store  = FeatureStore(data)                      # gen-data output (features or tokens only)
    vocab  = build_vocab(store.token_counts(V))      # docs/design.md §4
    draft  = Eagle3Draft(...)                        # frozen target embedding, random layer
    for each optimizer step:                         # token-budget batches, grad accumulation
        aux, final = stored or target.capture(...)   # offline / --online
        teacher    = softmax(target head(final))     # restricted to the draft vocab, in chunks
        loss       = TTTModel(batch).loss            # sum_s decay^s * loss_s  (ttt.py)
    save_draft(out) + training metadata              # passes inspect_draft

Distribution goes through accelerate (one CPU, one GPU, or `accelerate launch` DDP; FSDP2
shards the target of an --online run, ``sharded_target``).
Each process takes every world-th batch of the same deterministic batch list, so resume
needs only (epoch, step-in-epoch) besides model, optimizer, scheduler and RNG.

The other concerns live beside it: flags are checked by ``TrainConfig.validate``
(train_config.py), the store by ``features.check_store``; ``batching`` (split, token-budget
batches, collation), ``checkpoints`` (step-N folders, --resume), ``train_report`` (metrics,
train_log.jsonl, trackers, the live view and the summary), ``setup`` (the target's parts, the
draft, the pre-run checks), ``precision`` (--mixed-precision, the Accelerator), ``memory``
(--recompute, host memory) and ``noise`` (--feature-noise). This module is the Trainer: it puts
them together and runs the loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import torch
from torch import nn

from .. import __version__
from ..config.train_config import TrainConfig, TrainError
from ..core.errors import check_out_dir
from ..core.hf_utils import text_config
from ..core.io_utils import write_json
from ..core.time_limit import now
from ..data.features import FeatureStore, StoreError, check_complete, check_store
from ..model import warm_start
from ..model.draft import Eagle3Draft
from ..model.sharded_target import fsdp_requested, no_sync, padded, prepare_draft, shard_target
from ..model.target import TargetSpec, capture, load_config
from ..publish.export import save_draft
from . import train_eval
from .batching import collate, make_batches, planned_steps, rank_groups, split_indices
from .checkpoints import checkpoint_dirs, save_checkpoint, start_state
from .families import family_setup, select_streams
from .memory import fix_host_memory, use_recompute
from .noise import noise_seed, with_noise
from .optim import BETAS, lr_lambda, make_optimizer
from .precision import accelerator
from .setup import (
    as_list,
    chat_template_for,
    check_init_from,
    learned_tokens_error,
    limit_note,
    load_target_parts,
    setup_line,
)
from .step_budget import StepBudget
from .train_report import (
    LiveView,
    Meter,
    RunLog,
    decayed_loss,
    epoch_note,
    final_metrics,
    measured_metrics,
    summary_table,
    trained_on,
)


def scored_positions(batch: dict, loss_on: str, held_out: bool) -> torch.Tensor:
    """The positions a micro-batch's loss scores: the answers (the store's loss mask), or with
    --loss-on all every real token. The held-out split always scores the answers, so that its
    metrics compare between the two."""
    return batch["attention_mask" if loss_on == "all" and not held_out else "loss_mask"].bool()


# ---- the run -----------------------------------------------------------------------------------

@dataclass
class TrainResult:
    out: Path
    draft: Eagle3Draft  # fp32, trained weights (the exported copy is bf16)
    step: int
    metrics: dict
    history: list = field(default_factory=list)
    stopped: str | None = None  # why the run stopped early (NaN loss, interruption)
    limit: str = ""  # which limit ended the run (--max-steps or the epochs)


class Trainer:
    """setup() loads the store, the target's parts and the draft and plans the steps; run()
    trains (epochs -> optimizer steps -> micro-batches) and exports the draft."""

    def __init__(self, cfg: TrainConfig, recipe: str | None = None, console=None, quiet: bool = False):
        self.cfg, self.started = cfg, now()  # --max-minutes counts from here
        self.recipe, self.console, self.quiet = recipe, console, quiet

    # -- setup --
    def _say(self, msg: str):
        if self.acc.is_main_process and not self.quiet and self.console is not None:
            self.console.print(msg, highlight=False)

    def setup(self):
        cfg = self.cfg
        trackers = cfg.validate()  # every flag checked before anything is loaded
        check_out_dir(cfg.out, "--out")
        self.acc = accelerator(cfg, trackers)
        self.sharded = fsdp_requested(self.acc)  # the target, across processes (--online only)
        self.out = Path(cfg.out)
        self.log = RunLog(self.acc, self.out, trackers=bool(trackers))
        try:
            self.store = FeatureStore(cfg.data)
            check_complete(self.store, cfg.allow_incomplete, self._say)
        except (FileNotFoundError, StoreError) as e:
            raise TrainError(str(e)) from None
        m = self.store.meta
        self.model_id = cfg.model or m.target_id
        if not self.model_id:
            raise TrainError("--model is required (the store's manifest names no target)")
        spec = TargetSpec.of(cfg, model=self.model_id, device=str(self.acc.device))
        try:
            self.target_config = load_config(spec)
        except (OSError, ValueError) as e:
            raise TrainError(f"cannot load target {self.model_id}: {e}") from None
        try:
            check_store(self.store, self.target_config, online=cfg.online, layers=cfg.layers,
                        chat_template=chat_template_for(cfg, spec, m, self._say), model=self.model_id,
                        revision=cfg.revision)
        except StoreError as e:
            raise TrainError(str(e)) from None
        self.cfg = cfg = check_init_from(cfg, self.target_config, self.store)  # a DFlash draft's layers, MASK id
        self.family, self.layer_ids, self.columns = family_setup(cfg, self.store, self.target_config)
        try:
            warm_parts = warm_start.parse_parts(cfg.warm_start)
            parts = load_target_parts(cfg, spec, self.store, self.target_config, warm_parts, self.acc.device,
                                      sharded=self.sharded)
            self.target, self.head = parts.target, parts.head
            self.draft, self.vocab = self.family.build(self.store, self.target_config, parts, warm_parts,
                                                       self.layer_ids, self._say)
        except warm_start.WarmStartError as e:
            raise TrainError(str(e)) from None
        if self.sharded:  # after the warm start: it copies target layers that sharding turns into DTensors
            self.target = self.head = shard_target(self.target, self.acc)
            self._say(f"target sharded over {self.acc.num_processes} processes (FSDP2)")
        self.draft = self.draft.to(self.acc.device)
        self.recompute = use_recompute(cfg, self.draft.config)
        fix_host_memory(cfg, self.draft.config, self.acc.device, self._say)
        self.vocab_ids = self.vocab.ids.to(self.acc.device) if self.vocab is not None else None
        self._say(setup_line(self.vocab, self.layer_ids, self.recompute, self.acc.mixed_precision))
        self._plan()
        self.probe = train_eval.AcceptanceProbe.create(cfg, spec, self.store, self.val_idx, self.crop, self.target,
                                                       self.sharded, self.acc.is_main_process, self._say)

    def _plan(self):
        cfg = self.cfg
        self.lengths = self.store.lengths()
        self.crop = min(cfg.max_length, cfg.max_tokens)
        self.crop_lengths = [min(n, self.crop) for n in self.lengths]
        self.train_idx, self.val_idx = split_indices(len(self.store), cfg.val_fraction, cfg.seed)
        if not self.train_idx:
            raise TrainError(f"store {self.store.root} has no training samples")
        problem = learned_tokens_error(self.store, self.train_idx, self.crop, cfg)
        if problem:
            raise TrainError(problem)
        groups = self.groups(0)
        if not groups:
            raise TrainError(f"{len(self.train_idx)} training samples make fewer batches than processes "
                             f"({self.acc.num_processes}): lower --max-tokens or add data")
        self.steps_per_epoch = len(groups)
        total = planned_steps(self.groups, cfg.epochs, cfg.max_steps and cfg.max_steps + 1) \
            if cfg.regroup_batches else self.steps_per_epoch * cfg.epochs  # one past --max-steps: does it bind?
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps > 0 else total
        self.limit = limit_note(self.steps_per_epoch, total, cfg)
        self._say(f"plan: {self.total_steps} optimizer steps ({self.limit})")

    def groups(self, epoch: int) -> list[list[list[int]]]:
        batches = make_batches(self.train_idx, self.crop_lengths, self.cfg.max_tokens, self.cfg.seed, epoch,
                               self.cfg.regroup_batches)
        return rank_groups(batches, self.acc.num_processes, self.acc.process_index, self.cfg.grad_accum)

    # -- one micro-batch --
    def _inputs(self, idx: list[int], held_out: bool = False, noise_seed: int | None = None):
        batch = collate(self.store, idx, self.crop, features=not self.cfg.online)
        dev = self.acc.device
        ids, mask = batch["input_ids"].to(dev), scored_positions(batch, self.cfg.loss_on, held_out).to(dev)
        if self.cfg.online:
            aux, final = capture(self.target, ids, self.layer_ids, batch["attention_mask"].to(dev))
        else:
            aux, final = batch["aux"].to(dev), batch["final"].to(dev)
            aux = select_streams(aux, self.columns, final.shape[-1])
        aux = with_noise(aux, self.cfg.feature_noise, len(self.layer_ids), noise_seed)  # None when held out
        return self.family.inputs(self, ids, aux, final, mask, batch, held_out, noise_seed), batch["tokens"]

    @torch.no_grad()
    def evaluate(self, draft) -> dict | None:
        """Per-step loss and accuracy on the held-out split (shared across processes), unrolled
        for --eval-ttt-steps (so drafts trained with fewer steps are measured on the same scale)."""
        if not self.val_idx:
            return None
        model = self.family.objective(draft, held_out=True)
        meter = Meter(self.family.eval_positions(), self.acc.device)
        batches = make_batches(self.val_idx, self.crop_lengths, self.cfg.max_tokens, self.cfg.seed, 0)
        for idx, counted in padded(batches, self.acc.process_index, self.acc.num_processes, self.sharded):
            args, tokens = self._inputs(idx, held_out=True)  # (a sharded target's forward needs every rank)
            if counted:
                with self.acc.autocast():
                    meter.add(model(*args), tokens)
        return meter.result(self.acc)

    # -- the loop --
    def run(self, stop_after: int | None = None) -> TrainResult:
        """Train to the planned step count (or ``stop_after`` steps: a simulated interruption)."""
        cfg, acc, draft = self.cfg, self.acc, self.draft
        ttt = self.family.objective(draft, recompute=self.recompute)
        self.params, optimizer, self.scheduler = optimizer_and_schedule(cfg, ttt, self.total_steps)
        start = start_state(acc, self.out, cfg, self.draft, optimizer, self.scheduler, self._say)
        self.model, self.optimizer = prepare_draft(acc, ttt, optimizer, self.sharded)
        self.budget = step_budget(self)
        self.step, self.history, self.val = start["step"], list(start.get("history", [])), start.get("val")
        if self.probe:
            self.probe.best = start.get("best")
        self.log.start(cfg.to_dict())
        self._reset_meter()
        with LiveView(self.total_steps, self.console, acc.is_main_process and not self.quiet,
                      warmup=cfg.ttt_warmup) as self.view:
            self.view.update(self.step, None, 0.0)
            stopped = self._epochs(start["epoch"], start["group"], stop_after)
        draft = acc.unwrap_model(self.model).draft
        result = TrainResult(self.out, draft, self.step, {}, self.history, stopped)
        if stopped is None:
            if self.probe and not any("measured" in h and h["step"] == self.step for h in self.history):
                self._measure(self.history[-1].get("epoch", 0) if self.history else 0)  # the last step's
            self._save(cfg.epochs, 0)
            if self.probe and self.probe.restore_best(draft, self.step, acc.device):
                self.val = self.evaluate(draft)  # the held-out metrics of the exported weights
            result.metrics = self._finish(draft)
        self.log.end()
        return result

    def _epochs(self, epoch0: int, group0: int, stop_after: int | None) -> str | None:
        """Every epoch from (epoch0, group0); why the run stopped early, or None."""
        for epoch in range(epoch0, self.cfg.epochs):
            stopped = self._epoch(epoch, group0 if epoch == epoch0 else 0, stop_after)
            if stopped:
                return stopped
            self._validate(epoch)
            if self.step >= self.total_steps:
                break
        return None

    def _epoch(self, epoch: int, first: int, stop_after: int | None) -> str | None:
        """The optimizer steps of one epoch from group ``first``: log, checkpoint, stop."""
        cfg, groups = self.cfg, self.groups(epoch)
        for gi in range(first, len(groups)):
            if self.step >= self.total_steps:
                return None
            tokens = self.meter.tokens
            if not self.budget.before_step(self.step):  # --max-minutes: the next step would end too late
                return None
            if not self._optimizer_step(groups[gi]):
                return stop_nan(self.out, self.step, self._say)
            self.budget.after_step(self.step)
            self.step += 1
            self.view.tick(self.step, self.meter.tokens - tokens)
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                self._report(epoch)
            if self.probe and self.probe.due(self.step, self.total_steps):
                self._measure(epoch)
            if self.step % cfg.save_every == 0 and self.step < self.total_steps:
                self._save(epoch, gi + 1)
            if stop_after is not None and self.step >= stop_after:
                return "interrupted"
        return None

    def _optimizer_step(self, group: list[list[int]]) -> bool:
        """Accumulate the group's micro-batches and step; False (no update) if a loss is not finite."""
        acc, model = self.acc, self.model
        acc.unwrap_model(model).active = 1 if self.step < self.cfg.ttt_warmup else None  # --ttt-warmup
        bad = torch.zeros((), device=acc.device)
        for mi, idx in enumerate(group):
            args, tokens = self._inputs(idx, noise_seed=noise_seed(self.cfg.seed, self.step, mi, acc.process_index))
            with no_sync(acc, model, mi == len(group) - 1, self.sharded), acc.autocast():
                out = model(*args)
                del args  # the teacher [tokens x draft vocab] is only read by the forward (ttt.HeadSoftCrossEntropy)
                if not torch.isfinite(out.loss):
                    bad += 1
                acc.backward(out.loss / len(group))
            self.meter.add(out, tokens)
        if acc.reduce(bad, "sum").item() > 0:
            self.optimizer.zero_grad(set_to_none=True)
            return False
        acc.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.applied_lr = self.scheduler.get_last_lr()[0]  # the log's lr: this step's, not the next one's
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _reset_meter(self):
        self.meter, self.t0, self.c0 = Meter(self.family.positions, self.acc.device), time.time(), time.process_time()

    def _report(self, epoch: int):
        """One log point: the metrics since the last one, to the log, the trackers and the view."""
        acc, stats = self.acc, self.meter.result(self.acc)
        tokens = acc.reduce(torch.tensor(float(self.meter.tokens), device=acc.device), "sum").item()
        rate = tokens / max(1e-9, time.time() - self.t0)
        rec = {"step": self.step, "epoch": epoch, "lr": getattr(self, "applied_lr", None),
               "loss": decayed_loss(stats["loss"], self.family.decay), "acc": stats["acc"],
               "tokens_per_s": rate, "tokens": int(tokens), "positions": stats["positions"],
               # CPU seconds of this process: other jobs on shared cores do not distort it
               "cpu_s": time.process_time() - self.c0}
        self.history.append(rec)
        self.view.update(self.step, rec, rate)
        self.log.write(rec, self.step)
        self._reset_meter()

    def _validate(self, epoch: int):
        """End of an epoch: the held-out metrics (kept for the checkpoint and the card)."""
        self.val = self.evaluate(self.acc.unwrap_model(self.model).draft)
        if self.val is None:
            return
        rec = {"step": self.step, "epoch": epoch, "val": self.val}
        self.history.append(rec)
        self.log.write(rec, self.step)
        self.view.note(epoch_note(epoch, self.val, self.family.decay))

    def _measure(self, epoch: int):
        """--eval-every: the draft's measured tau, logged beside the held-out simulated one."""
        draft = self.acc.unwrap_model(self.model).draft
        measured = self.probe.measure(self.acc, draft, self.step, (self.evaluate(draft) or {}).get("tau_sim"))
        rec = {"step": self.step, "epoch": epoch, "measured": measured}
        self.history.append(rec)
        self.log.write(rec, self.step)
        self.view.note(train_eval.note(self.step, measured))

    def _save(self, epoch: int, group: int):
        state = {"step": self.step, "epoch": epoch, "group": group, "config": self.cfg.to_dict(),
                 "recipe": self.recipe, "history": self.history, "val": self.val,
                 "best": self.probe and self.probe.best}
        save_checkpoint(self.acc, self.out, self.draft, self.optimizer, self.scheduler, state,
                        self.cfg.keep_checkpoints)

    # -- output --
    def _finish(self, draft) -> dict:
        """Export the draft with its metadata, check it with inspect, write the summary."""
        from ..publish.inspector import inspect_draft

        metrics = final_metrics(self.val, self.history, self.family.decay, self.acc.device)
        metrics.update(measured_metrics(self.history, self.probe and self.probe.best, self.step))
        if self.acc.is_main_process:
            save_draft(draft, self.out, metadata(self, self.step, metrics))
            report = inspect_draft(self.out, self.target_config)
            if not report.ok:
                raise TrainError(f"the exported draft in {self.out} fails inspection: {'; '.join(report.problems)}")
            write_json(self.out / "train_summary.json", {"steps": self.step, **metrics})
            if not self.quiet and self.console is not None:
                self.console.print(summary_table(metrics, self.step, self.out))
        self.acc.wait_for_everyone()
        return metrics


def metadata(t: "Trainer", step: int, metrics: dict) -> dict:
    """The training record exported with the draft (config.json's eagle3_training, the card)."""
    cfg, m = t.cfg, t.store.meta
    data, datasets = trained_on(m.source)
    return {
        "target": t.model_id, "target_revision": cfg.revision or m.target_revision,
        # the class the draft was trained against (a vision-language target's is not a causal LM)
        "target_architectures": list(getattr(t.target_config, "architectures", None) or []),
        "target_model_type": getattr(t.target_config, "model_type", None),
        "chat_template_hash": m.chat_template_hash, "layer_ids": list(t.layer_ids),
        "data": data, "num_samples": len(t.train_idx),
        "num_tokens": int(sum(t.lengths[i] for i in t.train_idx)), "steps": step,
        "epochs": cfg.epochs, "lr": cfg.lr, "draft_type": cfg.draft_type, **t.family.record(t),
        "recipe": t.recipe, "eagle3_version": __version__, "metrics": metrics,
        "end_token_ids": end_token_ids(t), "datasets": datasets, "created": date.today().isoformat(),
        "mode": "online" if cfg.online else "offline", "mixed_precision": t.acc.mixed_precision,
        **{k: getattr(cfg, k) for k in ("loss_on", "accept_loss", "feature_noise", "ttt_warmup")}}


def end_token_ids(t: "Trainer") -> list[int]:
    """The end tokens the draft vocabulary holds (docs/design.md §4): recorded so that every
    reader can check that the exported maps still hold them (publish/draft_check.py)."""
    ends = list(t.store.meta.end_token_ids) or as_list(getattr(text_config(t.target_config), "eos_token_id", None))
    return sorted(int(e) for e in t.family.end_tokens({int(e) for e in ends}, t))


def optimizer_and_schedule(cfg: TrainConfig, ttt: nn.Module, total_steps: int):
    """(trainable parameters, --optimizer over them, the warm-up + --lr-schedule LR schedule)."""
    named = [(n, p) for n, p in ttt.named_parameters() if p.requires_grad]
    optimizer = make_optimizer(cfg.optimizer, named, cfg.lr, cfg.weight_decay, (BETAS[0], cfg.adam_beta2))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio, cfg.lr_schedule))
    return [p for _, p in named], optimizer, schedule


def step_budget(t: Trainer) -> StepBudget:
    """--max-minutes for this run: a refitted step count becomes the run's and its schedule's."""
    limited = bool(t.cfg.max_minutes and t.val_idx)
    val_batches = len(make_batches(t.val_idx, t.crop_lengths, t.cfg.max_tokens, t.cfg.seed, 0)) if limited else 0

    def apply(steps: int, why: str):
        t.total_steps = steps
        f = lr_lambda(steps, t.cfg.warmup_ratio, t.cfg.min_lr_ratio, t.cfg.lr_schedule)
        t.scheduler.lr_lambdas = [f] * len(t.scheduler.lr_lambdas)  # one per group: Muon's, AdamW's decayed and not
        t.view.set_total(steps)
        t.view.note(why)  # (the view prints only on the main process, and not when quiet)

    def agree(n: int) -> int:  # the smallest over the processes (each times its own steps)
        return int(t.acc.gather(torch.tensor([n], device=t.acc.device)).min()) if t.acc.num_processes > 1 else n

    # a held-out batch is a forward without the backward: about half a step
    return StepBudget(t.cfg.max_minutes, t.started, t.total_steps, t.cfg.ttt_warmup, 0.5 * val_batches, apply,
                      agree)


def stop_nan(out: Path, step: int, say) -> str:
    """Why the run stops at a NaN/inf loss, and which checkpoint to go back to (said and returned)."""
    last = checkpoint_dirs(out)
    where = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was saved yet"
    msg = f"loss became NaN/inf at step {step + 1}: stopped without applying that update; {where}"
    say(f"[bold red]{msg}[/]")
    return msg




def train(cfg: TrainConfig, recipe: str | None = None, console=None, quiet: bool = False,
          stop_after: int | None = None) -> TrainResult:
    """Library entry point: set up from ``cfg``, train, export. ``stop_after`` simulates an
    interruption after that many optimizer steps (checkpoints stay as a crash leaves them)."""
    trainer = Trainer(cfg, recipe, console, quiet)
    trainer.setup()
    result = trainer.run(stop_after=stop_after)
    result.limit = trainer.limit
    return result
