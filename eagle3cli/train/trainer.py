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
train_log.jsonl, trackers, the live view and the summary). This module is the setup and the loop.
"""

from __future__ import annotations

import gc
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import torch
from torch import nn

from .. import __version__
from ..engines import engine_support
from ..core import host_memory
from ..model import warm_start
from .batching import collate, make_batches, rank_groups, split_indices
from . import gemm_padding, train_eval
from .checkpoints import CHECKPOINTS, checkpoint_dirs, save_checkpoint, start_state
from .optim import make_optimizer
from .step_budget import StepBudget
from ..core.time_limit import now
from ..model.draft import DraftConfig, Eagle3Draft
from ..core.errors import check_out_dir
from ..publish.export import save_draft
from ..data.features import FeatureStore, StoreError, check_complete, check_store, write_json
from ..core.hf_utils import eos_token_ids, text_config
from ..model.target import (TargetSpec, capture, input_embeddings, load_config, load_target, load_tokenizer,
                            output_head)
from ..config.train_config import TrainConfig, TrainError, check_trackers, draft_options
from .train_report import (LOG, LiveView, Meter, RunLog, decayed_loss, epoch_note, final_metrics, measured_metrics,
                           summary_table, trained_on)
from ..model.sharded_target import check_fsdp, fsdp_requested, no_sync, padded, prepare_draft, shard_target
from .ttt import TTTModel, teacher_from_final, teacher_rows
from ..model.vocab import build_vocab

# Still importable from here (tests and benchmarks import them from the trainer).
__all__ = ["CHECKPOINTS", "LOG", "TrainError", "TrainResult", "Trainer", "check_trackers", "checkpoint_dirs",
           "make_batches", "rank_groups", "split_indices", "train"]


# ---- setup checks ------------------------------------------------------------------------------

def limit_note(steps_per_epoch: int, cfg: TrainConfig) -> str:
    """Which limit ends the run: --max-steps or the epochs (said at the start and at the end)."""
    epochs = f"{cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''} of {steps_per_epoch} steps"
    if cfg.max_steps > 0 and cfg.max_steps < steps_per_epoch * cfg.epochs:
        return f"--max-steps {cfg.max_steps} ends the run before {epochs}"
    if cfg.max_steps > steps_per_epoch * cfg.epochs:
        return (f"the {epochs} end the run before --max-steps {cfg.max_steps}: raise --epochs (or add data) "
                "to train longer")
    return epochs


def learned_tokens_error(store: FeatureStore, train_idx: list[int], crop: int, cfg: TrainConfig) -> str | None:
    """None if the training samples keep some learned (assistant) tokens within the crop."""
    learned = store.learned_within(crop)
    if any(learned[i] for i in train_idx):
        return None
    limit = "--max-tokens" if cfg.max_tokens <= cfg.max_length else "--max-length"
    first = store.first_learned()
    where = f" (the first answer token is at position {min(first)})" if first else ""
    return (f"no learned tokens: every training sample's assistant tokens lie beyond the first {crop} tokens "
            f"that {limit} {crop} keeps{where}: raise {limit}")


@torch.no_grad()
def check_features_match(store: FeatureStore, target, layer_ids, tolerance: float = 0.1, tokens: int = 32):
    """Re-run the target on the start of one stored sample and compare with the stored streams.

    Catches a store made with another checkpoint or revision of the same architecture, or with
    other layers, that the manifest's shape fields cannot tell apart.
    """
    sample = store[0]
    n = min(tokens, sample["input_ids"].numel())
    ids = sample["input_ids"][:n][None].to(next(target.parameters()).device)
    aux, final = capture(target, ids, layer_ids)
    for name, got in (("aux", aux), ("final", final)):
        ref = sample[name][:n].float()
        err = float((got[0].float().cpu() - ref).norm() / ref.norm().clamp_min(1e-6))
        if err > tolerance:
            tid = store.meta.target_id
            raise TrainError(f"store {store.root} was made with another target or revision ({tid}): its "
                             f"'{name}' features differ from this target's by {err:.0%}")


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float):
    warmup = int(round(total_steps * warmup_ratio))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


# ---- the teacher's side of the target --------------------------------------------------------

class TargetHead(nn.Module):
    """Just the target's LM head (and config) for offline training: ``target.lm_logits`` works
    on it like on the full model, without keeping the decoder in memory.

    ``compute_dtype``: the dtype ``ttt.teacher_from_final`` computes the teacher's logits in. A
    head stored narrower (bf16) is kept so and widened per teacher call: for a 151,936 x 896
    head that is 272 MB held instead of 545 MB, with the same logits (widening is exact)."""

    def __init__(self, model, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.config = model.config
        self.head = output_head(model)
        self.compute_dtype = compute_dtype

    def get_output_embeddings(self):
        return self.head


# ---- the target's parts and the draft ---------------------------------------------------------

def mixed_precision(name: str, cpu: bool, native_bf16: bool | None = None) -> str:
    """--mixed-precision resolved: auto is bf16 on a GPU and on a CPU that multiplies bf16 in
    hardware (AMX or AVX512-BF16: ``native_bf16``, probed when None), fp32 on other CPUs. There
    fp32 training already runs at 85-100% of the fp32 matmul peak and bf16 autocast gives 1.6x the
    tokens per CPU-second at the same loss (docs/benchmarks.md); the unroll pads its GEMMs to a few
    shapes under it (gemm_padding), else oneDNN's per-shape bf16 kernels grow resident memory
    through a run. Without those instructions bf16 is emulated and slower than fp32."""
    if name != "auto":
        return name
    if not cpu:
        return "bf16"
    return "bf16" if (gemm_padding.native_bf16_cpu() if native_bf16 is None else native_bf16) else "no"


def accelerator(cfg: TrainConfig, trackers: list[str]):
    """The accelerate Accelerator for this run, CPU or GPU, under --mixed-precision; DDP under launch."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    cpu = (cfg.device or "").startswith("cpu") or not torch.cuda.is_available()
    if not cpu and (cfg.device or "").startswith("cuda:") and "LOCAL_RANK" not in os.environ:
        torch.cuda.set_device(cfg.device)  # a single-process run on the GPU asked for
    # accelerate keeps one AcceleratorState per process and refuses a second Accelerator with another
    # precision; a new run here (a library caller's second train()) starts its own. The process
    # state (devices, process group) is kept.
    AcceleratorState._reset_state()
    acc = Accelerator(cpu=cpu, mixed_precision=mixed_precision(cfg.mixed_precision, cpu), log_with=trackers or None,
                      project_dir=cfg.out)
    check_fsdp(acc, cfg.online, cfg.load_in_8bit or cfg.load_in_4bit)  # FSDP shards the target, never the draft
    return acc


def chat_template_for(cfg: TrainConfig, spec: TargetSpec, manifest, say) -> str | None:
    """The template to compare with the store's: --chat-template, else the tokenizer's."""
    if cfg.chat_template:
        try:
            return Path(cfg.chat_template).read_text()
        except OSError as e:
            raise TrainError(f"cannot read --chat-template: {e}") from None
    try:
        template = load_tokenizer(spec).chat_template
    except (OSError, ValueError):
        template = None
    if isinstance(template, dict):  # named templates: apply_chat_template uses "default"
        template = template.get("default")
    if not template and manifest.chat_template_hash:
        say("[yellow]warning:[/] the target has no chat template of its own: pass gen-data's "
            "--chat-template to check the store against it")
    return template or None


@dataclass
class TargetParts:
    """What training needs of the target: the full model only with --online (``target``), else
    its LM head alone (``head``, for the teacher); the input embedding the draft copies, frozen;
    the warm-start copies (``warm``)."""

    target: nn.Module | None
    head: nn.Module
    embed: torch.Tensor
    warm: dict


def load_target_parts(cfg: TrainConfig, spec: TargetSpec, store: FeatureStore, target_config, warm_parts,
                      device, sharded: bool = False) -> TargetParts:
    if cfg.load_in_8bit or cfg.load_in_4bit:  # --online only (TrainConfig.validate)
        warnings.warn("the target is loaded quantized: its features differ slightly from the served "
                      "full-precision model's, so acceptance may be a little lower", stacklevel=2)
    if cfg.online:
        # Under FSDP the whole target never goes to one device: it is loaded on the CPU and each
        # process moves its shard (Trainer.setup, once the warm start has copied what it needs).
        target = load_target(TargetSpec(**{**spec.__dict__, "device": "cpu", "dtype": _train_dtype(spec, device)})
                             if sharded else spec)
        return TargetParts(target, target, input_embeddings(target).weight.detach(),
                           warm_start.target_parts(target, warm_parts))
    # Offline: the decoder is only needed for one consistency probe, on the CPU. The head (the
    # teacher's) is kept in the training dtype, auto: fp32 when training on the CPU, bf16 (half the
    # host memory) for a GPU run. A bf16 checkpoint is loaded as stored and only its head cast up:
    # the same values as loading it all in fp32, without a transient fp32 copy of the decoder
    # (not with a head/layer warm start: those copy norms computed in the loaded dtype).
    dtype = _train_dtype(spec, device)
    as_stored = spec.dtype == "auto" and stored_dtype(target_config) == "bfloat16" and not {"head", "layer"} & set(
        warm_parts)
    load_dtype = "bfloat16" if as_stored else dtype
    model = load_target(TargetSpec(**{**spec.__dict__, "device": "cpu", "dtype": load_dtype}))
    check_features_match(store, model, store.meta.layer_ids)
    train_dtype = getattr(torch, dtype)
    # Frozen weights stay in the stored dtype when it widens exactly to the training dtype (bf16
    # -> fp32): the teacher's head and the draft's embedding copy (build_draft) then hold half the
    # memory for the same values.
    keep = load_dtype if as_stored else dtype
    head = TargetHead(model, compute_dtype=train_dtype).to(device, getattr(torch, keep))
    # A weight loaded as stored can be a view of the memory-mapped checkpoint: a copy of its own
    # lets the file's pages (all those the probe read, the decoder's too) go with the model.
    for p in head.parameters():
        p.data = p.data.clone()
    parts = TargetParts(None, head, input_embeddings(model).weight.detach(), warm_start.target_parts(model, warm_parts))
    del model
    gc.collect()  # HF models hold reference cycles: free the decoder now, not at some later collection
    return parts


def _train_dtype(spec: TargetSpec, device) -> str:
    """--dtype, auto: fp32 when training on the CPU, bf16 on a GPU."""
    return spec.dtype if spec.dtype != "auto" else ("float32" if device.type == "cpu" else "bfloat16")


def stored_dtype(config) -> str | None:
    """The dtype a checkpoint's weights are stored in (config ``dtype``/``torch_dtype``), by name."""
    tc = text_config(config)
    for c in (config, tc):
        value = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None)
        if value is not None:
            return str(value).replace("torch.", "")
    return None


def eval_refusal(target_config) -> str | None:
    """Why ``eagle3 eval`` would refuse this target (the generator's own check), None if it runs it."""
    from ..decode.generator import UnsupportedTarget, check_supported

    try:
        check_supported(target_config)
    except UnsupportedTarget as e:
        return str(e)
    return None


def check_init_from(cfg: TrainConfig, target_config) -> None:
    """A corrupted or unreadable --init-from is one line before the target is loaded."""
    if not cfg.init_from:
        return
    from ..publish.draft_check import CorruptDraft
    from ..publish.formats import FormatError, read_draft

    try:
        read_draft(cfg.init_from, target_config=target_config)
    except (FormatError, CorruptDraft) as e:
        raise TrainError(f"--init-from: {e}") from None


def build_draft(cfg: TrainConfig, store: FeatureStore, target_config, parts: TargetParts, warm_parts, say):
    """(draft, vocab): the draft vocabulary from the store's token counts (docs/design.md §4), a
    draft on the target's frozen embedding, warm-started and/or continued from --init-from."""
    vocab_size = output_head(parts.head).weight.shape[0]
    counts = store.token_counts(vocab_size)
    end_ids = list(store.meta.end_token_ids) or _as_list(getattr(text_config(target_config), "eos_token_id", None))
    try:
        vocab = build_vocab(counts, cfg.draft_vocab_size, cfg.vocab_coverage, end_ids)
    except ValueError as e:
        raise TrainError(str(e)) from None
    try:
        options = draft_options(cfg)  # --variant, --norm-before-fc, --norm-before-residual
    except ValueError as e:
        raise TrainError(str(e)) from None
    for line in engine_support.warnings(target_config, options, eval_refusal(target_config)):
        say(f"[yellow]warning:[/] {line}")
    dcfg = DraftConfig.from_target(target_config, vocab.size, store.meta.layer_ids, **options)
    draft = Eagle3Draft(dcfg)
    # The frozen embedding is only looked up (rows cast to the stream's dtype, ttt_streams and
    # Eagle3Draft.step), so a bf16 source is kept in bf16: 151,936 x 896 is 272 MB, not 545 MB.
    embed_dtype = torch.bfloat16 if parts.embed.dtype == torch.bfloat16 else torch.float32
    draft.embed_tokens.to(embed_dtype)
    draft.set_embedding(parts.embed.cpu())
    draft.init_weights(seed=cfg.seed)
    draft.set_vocab(vocab.ids)
    # The warm start first: with --init-from, rows of tokens new to its vocabulary keep it.
    for line in warm_start.apply(draft, warm_parts, parts.warm, vocab.ids):
        say(line)
    parts.warm = None  # the target's layer / head copies are not needed past here
    if cfg.init_from:  # continue from an existing draft in any format (formats.init_from, docs/formats.md)
        from ..publish.draft_check import CorruptDraft
        from ..publish.formats import FormatError, init_from
        try:
            draft, vocab = init_from(draft, vocab, counts, cfg, target_config, say)
        except (FormatError, CorruptDraft) as e:
            raise TrainError(f"--init-from: {e}") from None
    elif cfg.freeze_head and "head" in warm_parts:
        draft.lm_head.weight.requires_grad_(False)
    return draft, vocab


# Above this, the activations the TTT unroll would keep for the backward are recomputed instead
# (--recompute auto). Recomputing costs a few percent of CPU time (1.01-1.02x per token), keeping
# them their bytes: 5.8 GB for a 0.5B target at the defaults (docs/benchmarks.md, "Memory").
RECOMPUTE_ABOVE = 1 << 30


def kept_activation_bytes(tokens: int, steps: int, dcfg: DraftConfig) -> int:
    """What an S-step unroll keeps for the backward without recompute, per micro-batch: per token
    and step the MLP's gate, up and product ([3 x intermediate]) and about a dozen hidden-sized
    tensors (norms, q/k/v/o, the residuals), in fp32."""
    return tokens * steps * (3 * dcfg.intermediate_size + 12 * dcfg.hidden_size) * 4


def large_step(cfg: TrainConfig, dcfg: DraftConfig) -> bool:
    """Whether a micro-batch's unroll would keep more than RECOMPUTE_ABOVE of activations: the
    runs where memory, not compute, is what to save (a 0.5B target at the defaults, not SmolLM2
    at the quickstart's 1,024 tokens x 3 steps)."""
    return kept_activation_bytes(cfg.max_tokens, cfg.ttt_steps, dcfg) > RECOMPUTE_ABOVE


def fix_host_memory(cfg: TrainConfig, dcfg: DraftConfig, device, say) -> None:
    """On a large CPU step, have glibc give freed tensors back (host_memory): about 1 GB of such a
    step's peak is freed tensors it keeps. It costs about 8% more CPU time, so small runs keep
    glibc's default."""
    if device.type == "cpu" and large_step(cfg, dcfg):
        note = host_memory.return_freed_tensors()
        if note:
            say(f"host memory: {note}")


def use_recompute(cfg: TrainConfig, dcfg: DraftConfig) -> bool:
    """--recompute/--no-recompute as given; auto: on for a large step (large_step)."""
    if cfg.recompute is not None:
        return cfg.recompute
    return large_step(cfg, dcfg)


def setup_line(vocab, layer_ids, recompute: bool, precision: str) -> str:
    return (f"draft vocab: {vocab.size} tokens covering {vocab.coverage:.2%} of the masked training tokens; layers "
            f"{layer_ids}; TTT steps {'recomputed in the backward' if recompute else 'kept for the backward'}; "
            f"{'bf16 autocast' if precision == 'bf16' else 'fp32'} compute")


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


def _as_list(x) -> list:
    """EOS ids (None, one id or a list) as a sorted list: ``hf_utils.eos_token_ids``."""
    return sorted(eos_token_ids(x))


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
        check_init_from(cfg, self.target_config)
        self.layer_ids = m.layer_ids
        try:
            warm_parts = warm_start.parse_parts(cfg.warm_start)
            parts = load_target_parts(cfg, spec, self.store, self.target_config, warm_parts, self.acc.device,
                                      sharded=self.sharded)
            self.target, self.head = parts.target, parts.head
            self.draft, self.vocab = build_draft(cfg, self.store, self.target_config, parts, warm_parts, self._say)
        except warm_start.WarmStartError as e:
            raise TrainError(str(e)) from None
        if self.sharded:  # after the warm start: it copies target layers that sharding turns into DTensors
            self.target = self.head = shard_target(self.target, self.acc)
            self._say(f"target sharded over {self.acc.num_processes} processes (FSDP2)")
        self.draft = self.draft.to(self.acc.device)
        self.recompute = use_recompute(cfg, self.draft.config)
        fix_host_memory(cfg, self.draft.config, self.acc.device, self._say)
        self.vocab_ids = self.vocab.ids.to(self.acc.device)
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
        total = self.steps_per_epoch * cfg.epochs
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps > 0 else total
        self.limit = limit_note(self.steps_per_epoch, cfg)
        self._say(f"plan: {self.total_steps} optimizer steps ({self.limit})")

    def groups(self, epoch: int) -> list[list[list[int]]]:
        batches = make_batches(self.train_idx, self.crop_lengths, self.cfg.max_tokens, self.cfg.seed, epoch)
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
        aux = with_noise(aux, self.cfg.feature_noise, len(self.layer_ids), noise_seed)  # None when held out
        teacher = teacher_from_final(self.head, final, self.vocab_ids, teacher_rows(mask), full_argmax=held_out)
        return (ids, aux, mask, teacher.probs, teacher.index, teacher.slot), batch["tokens"]

    def eval_steps(self) -> int:
        return max(self.cfg.ttt_steps, self.cfg.eval_ttt_steps)

    @torch.no_grad()
    def evaluate(self, draft) -> dict | None:
        """Per-step loss and accuracy on the held-out split (shared across processes), unrolled
        for --eval-ttt-steps (so drafts trained with fewer steps are measured on the same scale)."""
        if not self.val_idx:
            return None
        model = TTTModel(draft, self.eval_steps(), self.cfg.step_decay)
        meter = Meter(self.eval_steps(), self.acc.device)
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
        cfg, acc = self.cfg, self.acc
        ttt = TTTModel(self.draft, cfg.ttt_steps, cfg.step_decay, recompute=self.recompute, accept_weight=cfg.accept_loss)
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
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _reset_meter(self):
        self.meter, self.t0, self.c0 = Meter(self.cfg.ttt_steps, self.acc.device), time.time(), time.process_time()

    def _report(self, epoch: int):
        """One log point: the metrics since the last one, to the log, the trackers and the view."""
        acc, stats = self.acc, self.meter.result(self.acc)
        tokens = acc.reduce(torch.tensor(float(self.meter.tokens), device=acc.device), "sum").item()
        rate = tokens / max(1e-9, time.time() - self.t0)
        rec = {"step": self.step, "epoch": epoch, "lr": self.scheduler.get_last_lr()[0],
               "loss": decayed_loss(stats["loss"], self.cfg.step_decay), "acc": stats["acc"],
               "tokens_per_s": rate, "tokens": int(tokens), "positions": stats["positions"],
               # CPU seconds of this process: a speed measure that other jobs on a
               # shared machine do not distort (benchmarks/train_throughput.py).
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
        self.view.note(epoch_note(epoch, self.val, self.cfg.step_decay))

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

        metrics = final_metrics(self.val, self.history, self.cfg.step_decay, self.acc.device)
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
        "epochs": cfg.epochs, "ttt_steps": cfg.ttt_steps, "step_decay": cfg.step_decay, "lr": cfg.lr,
        "draft_vocab_size": t.vocab.size, "vocab_coverage": round(t.vocab.coverage, 6),
        "recipe": t.recipe, "eagle3_version": __version__, "metrics": metrics,
        "end_token_ids": end_token_ids(t), "datasets": datasets, "created": date.today().isoformat(),
        "mode": "online" if cfg.online else "offline", "mixed_precision": t.acc.mixed_precision,
        **{k: getattr(cfg, k) for k in ("loss_on", "accept_loss", "feature_noise", "ttt_warmup")}}


def end_token_ids(t: "Trainer") -> list[int]:
    """The end tokens the draft vocabulary holds (docs/design.md §4): recorded so that every
    reader can check that the exported maps still hold them (publish/draft_check.py)."""
    ends = list(t.store.meta.end_token_ids) or _as_list(getattr(text_config(t.target_config), "eos_token_id", None))
    kept = set(t.vocab.ids.tolist())
    return sorted(int(e) for e in set(ends) if int(e) in kept)


def optimizer_and_schedule(cfg: TrainConfig, ttt: nn.Module, total_steps: int):
    """(trainable parameters, --optimizer over them, the warm-up + cosine LR schedule)."""
    named = [(n, p) for n, p in ttt.named_parameters() if p.requires_grad]
    optimizer = make_optimizer(cfg.optimizer, named, cfg.lr, cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))
    return [p for _, p in named], optimizer, schedule


def step_budget(t: Trainer) -> StepBudget:
    """--max-minutes for this run: a refitted step count becomes the run's and its schedule's."""
    limited = bool(t.cfg.max_minutes and t.val_idx)
    val_batches = len(make_batches(t.val_idx, t.crop_lengths, t.cfg.max_tokens, t.cfg.seed, 0)) if limited else 0

    def apply(steps: int, why: str):
        t.total_steps = steps
        t.scheduler.lr_lambdas[0] = lr_lambda(steps, t.cfg.warmup_ratio, t.cfg.min_lr_ratio)
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


def noise_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """--feature-noise's seed for one micro-batch, from (seed, optimizer step, micro-batch, process):
    a resumed run draws what the uninterrupted one did (self.step is restored), with no generator
    state to checkpoint. The --ttt-warmup curriculum likewise follows self.step."""
    return ((seed * 1_000_003 + step) * 1_009 + micro) * 257 + rank


def with_noise(aux: torch.Tensor, scale: float, streams: int, seed: int | None = 0) -> torch.Tensor:
    """aux [B,T,k*H] plus Gaussian noise of ``scale`` x each stream's RMS at each position: the
    draft learns features that are near the target's rather than exactly them (its own outputs,
    fed back at inference, never are). Drawn on the CPU from ``seed`` (the same on any device);
    aux itself when ``scale`` is 0 or ``seed`` None (held-out batches)."""
    if not scale or seed is None:
        return aux
    parts = aux.float().unflatten(-1, (streams, -1))
    rms = parts.pow(2).mean(-1, keepdim=True).sqrt()
    gen = torch.Generator().manual_seed(seed % (1 << 63))
    noise = torch.randn(parts.shape, generator=gen).to(parts.device)
    return (parts + noise * rms * scale).flatten(-2).to(aux.dtype)


def train(cfg: TrainConfig, recipe: str | None = None, console=None, quiet: bool = False,
          stop_after: int | None = None) -> TrainResult:
    """Library entry point: set up from ``cfg``, train, export. ``stop_after`` simulates an
    interruption after that many optimizer steps (checkpoints stay as a crash leaves them)."""
    trainer = Trainer(cfg, recipe, console, quiet)
    trainer.setup()
    result = trainer.run(stop_after=stop_after)
    result.limit = trainer.limit
    return result
