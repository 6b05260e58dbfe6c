"""The EAGLE-3 trainer: feature store -> TTT training -> exported draft directory.

    store  = FeatureStore(data)                      # gen-data output (features or tokens only)
    vocab  = build_vocab(store.token_counts(V))      # docs/design.md §4
    draft  = Eagle3Draft(...)                        # frozen target embedding, random layer
    for each optimizer step:                         # token-budget batches, grad accumulation
        aux, final = stored or target.capture(...)   # offline / --online
        teacher    = softmax(target head(final))     # restricted to the draft vocab, in chunks
        loss       = TTTModel(batch)                 # sum_s decay^s * loss_s  (ttt.py)
    save_draft(out) + training metadata              # passes inspect_draft

Distribution goes through accelerate (one CPU, one GPU, or `accelerate launch` DDP/FSDP).
Each process takes every world-th batch of the same deterministic batch list, so resume
needs only (epoch, step-in-epoch) besides model, optimizer, scheduler and RNG.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import resource
import shutil
import time
import warnings
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import torch
from torch import nn

from . import __version__
from .errors import Eagle3Error, check_out_dir, one_line
from .draft import DraftConfig, Eagle3Draft
from .export import METADATA_KEY, save_draft
from .features import FeatureStore, StoreError, check_complete, check_store, write_json
from .hf_utils import eos_token_ids
from .layers import num_layers, parse_layer_ids, text_config
from .target import TargetSpec, capture, input_embeddings, load_config, load_target, load_tokenizer, output_head
from .train_config import TrainConfig
from . import warm_start
from .ttt import TTTModel, acceptance_length, teacher_from_final
from .vocab import build_vocab

CHECKPOINTS = "checkpoints"
LOG = "train_log.jsonl"
# Settings that may change between an interrupted run and its resumption (they do not change
# the trajectory of the weights).
RESUME_FREE = {"resume", "save_every", "keep_checkpoints", "log_every", "report_to", "out", "device",
               "eval_ttt_steps", "allow_incomplete"}
FLOAT_SETTINGS = ("lr", "step_decay", "grad_clip", "warmup_ratio", "min_lr_ratio", "weight_decay", "vocab_coverage",
                  "val_fraction")


class TrainError(Eagle3Error):
    """A user-facing problem, reported as one line."""


# ---- the store must match the target ---------------------------------------------------------

def check_settings(cfg: TrainConfig):
    """Numbers that would only show up as a NaN loss (or an overflow) many steps later."""
    for name in FLOAT_SETTINGS:
        if not math.isfinite(getattr(cfg, name)):
            raise TrainError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(cfg, name)}")
    if not 0 < cfg.lr <= 1:
        raise TrainError(f"--lr must lie in (0, 1] (EAGLE-3 drafts train at 1e-4 to 1e-3), got {cfg.lr:g}")


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


# ---- batching ---------------------------------------------------------------------------------

def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) sample indices: a seeded random held-out share."""
    n_val = int(round(n * val_fraction)) if n > 1 else 0
    if val_fraction > 0 and n_val == 0 and n >= 10:
        n_val = 1
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def make_batches(indices: list[int], lengths: list[int], max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches of at most ``max_tokens`` padded tokens, in a seeded order.

    Sorting by length keeps padding small; the batch order (not the contents) is shuffled
    per epoch, so it is reproducible from (seed, epoch) alone.
    """
    order = sorted(indices, key=lambda i: (lengths[i], i))
    batches, cur, longest = [], [], 0
    for i in order:
        longest_if = max(longest, lengths[i])
        if cur and longest_if * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest_if = [], lengths[i]
        cur.append(i)
        longest = longest_if
    if cur:
        batches.append(cur)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def rank_groups(batches: list, world: int, rank: int, accum: int) -> list[list]:
    """This process's micro-batches grouped per optimizer step (equal counts on every rank)."""
    usable = len(batches) // world * world
    mine = batches[rank:usable:world]
    return [mine[i:i + accum] for i in range(0, len(mine), accum)]


def collate(store: FeatureStore, idx: list[int], crop: int, features: bool) -> dict:
    """Right-padded batch; padding has loss_mask False, so it never counts."""
    items = [store[i] for i in idx]
    lens = [min(crop, it["input_ids"].numel()) for it in items]
    b, t = len(items), max(lens)
    out = {"input_ids": torch.zeros(b, t, dtype=torch.long), "loss_mask": torch.zeros(b, t, dtype=torch.bool),
           "attention_mask": torch.zeros(b, t, dtype=torch.long), "tokens": sum(lens)}
    if features:
        out["aux"] = torch.zeros(b, t, items[0]["aux"].shape[-1], dtype=items[0]["aux"].dtype)
        out["final"] = torch.zeros(b, t, items[0]["final"].shape[-1], dtype=items[0]["final"].dtype)
    for r, (it, n) in enumerate(zip(items, lens)):
        out["input_ids"][r, :n] = it["input_ids"][:n]
        out["loss_mask"][r, :n] = it["loss_mask"][:n]
        out["attention_mask"][r, :n] = 1
        if features:
            out["aux"][r, :n] = it["aux"][:n]
            out["final"][r, :n] = it["final"][:n]
    return out


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
    on it like on the full model, without keeping the decoder in memory."""

    def __init__(self, model):
        super().__init__()
        self.config = model.config
        self.head = output_head(model)

    def get_output_embeddings(self):
        return self.head


# ---- checkpoints -------------------------------------------------------------------------------

def checkpoint_dirs(out: Path) -> list[Path]:
    root = out / CHECKPOINTS
    done = [p for p in root.glob("step-*") if (p / "trainer_state.json").exists()] if root.exists() else []
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def trainable_state(draft: Eagle3Draft) -> dict:
    # The embedding is the target's frozen copy: rebuilt from the target, not checkpointed.
    return {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}


def save_checkpoint(acc, out: Path, draft, optimizer, scheduler, state: dict, keep: int):
    """Write step-N atomically: a temp folder renamed into place once complete."""
    from safetensors.torch import save_file

    root = out / CHECKPOINTS
    final = root / f"step-{state['step']:08d}"
    tmp = root / f".tmp-step-{state['step']:08d}"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
               tmp / f"rng-{acc.process_index}.pt")
    if acc.is_main_process:
        save_file(trainable_state(draft), str(tmp / "model.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optim.pt")
    acc.wait_for_everyone()
    if acc.is_main_process:
        write_json(tmp / "trainer_state.json", state)  # written last: marks the folder complete
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoint_dirs(out)[:-max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def load_checkpoint(acc, path: Path, draft, optimizer, scheduler) -> dict:
    from safetensors.torch import load_file

    state = _read_checkpoint_file(path, "trainer_state.json", lambda p: json.loads(p.read_text()))
    weights = _read_checkpoint_file(path, "model.safetensors", lambda p: load_file(str(p)))
    missing = set(trainable_state(draft)) - set(weights)
    if missing:
        raise TrainError(f"checkpoint {path} lacks {sorted(missing)}")
    draft.load_state_dict(weights, strict=False)
    opt = _read_checkpoint_file(path, "optim.pt", lambda p: torch.load(p, weights_only=True))
    try:
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
    except (KeyError, TypeError, ValueError) as e:
        raise TrainError(_unreadable(path, "optim.pt", e)) from None
    rng_file = path / f"rng-{acc.process_index}.pt"
    if rng_file.exists():
        rng = _read_checkpoint_file(path, rng_file.name, lambda p: torch.load(p, weights_only=True))
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def _unreadable(path: Path, name: str, e: BaseException) -> str:
    earlier = [p for p in checkpoint_dirs(path.parent.parent) if p != path]
    fix = f"delete {path} to resume from {earlier[-1].name}" if earlier else f"delete {path} and train without --resume"
    return f"checkpoint {path} is unreadable ({name}: {one_line(str(e)) or type(e).__name__}): {fix}"


def _read_checkpoint_file(path: Path, name: str, read):
    """read(path / name), a damaged file (truncated, garbled, not what we wrote) as one TrainError."""
    import pickle

    from safetensors import SafetensorError

    try:
        return read(path / name)
    except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError, SafetensorError) as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise
        raise TrainError(_unreadable(path, name, e)) from None


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


class Meter:
    """Sums of per-step loss, correct and counted positions (reduced across processes)."""

    def __init__(self, steps: int, device):
        self.loss = torch.zeros(steps, dtype=torch.float64, device=device)
        self.correct = torch.zeros(steps, dtype=torch.float64, device=device)
        self.counted = torch.zeros(steps, dtype=torch.float64, device=device)
        self.batches = 0
        self.tokens = 0

    def add(self, step_loss, correct, counted, tokens):
        self.loss += step_loss.double() * counted.double()
        self.correct += correct.double()
        self.counted += counted.double()
        self.tokens += tokens

    def result(self, acc) -> dict:
        loss, correct, counted = (acc.reduce(x, "sum") for x in (self.loss, self.correct, self.counted))
        n = counted.clamp_min(1)
        accs = (correct / n).tolist()
        return {"loss": (loss / n).tolist(), "acc": accs, "tau_sim": acceptance_length(accs),
                "positions": int(counted[0].item())}


def _decayed_loss(per_step: list[float], decay: float) -> float:
    return float(sum(decay ** s * v for s, v in enumerate(per_step)))


class Trainer:
    def __init__(self, cfg: TrainConfig, recipe: str | None = None, console=None, quiet: bool = False):
        self.cfg = cfg
        self.recipe = recipe
        self.console = console
        self.quiet = quiet

    # -- setup --
    def _say(self, msg: str):
        if self.acc.is_main_process and not self.quiet and self.console is not None:
            self.console.print(msg, highlight=False)

    def setup(self):
        from accelerate import Accelerator

        cfg = self.cfg
        if cfg.data is None:
            raise TrainError("--data is required (a folder written by `eagle3 gen-data`)")
        check_out_dir(cfg.out, "--out")
        check_settings(cfg)
        for name in ("ttt_steps", "max_tokens", "grad_accum", "epochs", "max_length", "keep_checkpoints"):
            if getattr(cfg, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
        if not 0 <= cfg.val_fraction < 1:
            raise TrainError(f"--val-fraction must lie in [0, 1), got {cfg.val_fraction}")
        trackers = check_trackers(cfg.report_to)
        cpu = (cfg.device or "").startswith("cpu") or not torch.cuda.is_available()
        if not cpu and (cfg.device or "").startswith("cuda:") and "LOCAL_RANK" not in os.environ:
            torch.cuda.set_device(cfg.device)  # a single-process run on the GPU asked for
        self.acc = Accelerator(cpu=cpu, mixed_precision="no" if cpu else "bf16",
                               log_with=trackers or None, project_dir=cfg.out)
        if self.acc.distributed_type.name == "FSDP":
            # Checkpoints read the draft's own parameters, which FSDP shards; the draft (one layer)
            # fits on any GPU that can run the target, so data parallelism is all it needs.
            raise TrainError("FSDP is not supported by eagle3 train: choose DDP (multi-GPU) in the accelerate config")
        self.out = Path(cfg.out)
        try:
            self.store = FeatureStore(cfg.data)
            check_complete(self.store, cfg.allow_incomplete, self._say)
        except (FileNotFoundError, StoreError) as e:
            raise TrainError(str(e)) from None
        m = self.store.meta
        self.model_id = cfg.model or m.target_id
        if not self.model_id:
            raise TrainError("--model is required (the store's manifest names no target)")
        spec = TargetSpec(model=self.model_id, revision=cfg.revision, dtype=cfg.dtype,
                          device=str(self.acc.device), load_in_8bit=cfg.load_in_8bit,
                          load_in_4bit=cfg.load_in_4bit, adapter=cfg.adapter,
                          trust_remote_code=cfg.trust_remote_code)
        try:
            self.target_config = load_config(spec)
        except (OSError, ValueError) as e:
            raise TrainError(f"cannot load target {self.model_id}: {e}") from None
        try:
            check_store(self.store, self.target_config, online=cfg.online, layers=cfg.layers,
                        chat_template=self._chat_template(spec), model=self.model_id, revision=cfg.revision)
        except StoreError as e:
            raise TrainError(str(e)) from None
        self.layer_ids = m.layer_ids
        try:
            self.warm_parts = warm_start.parse_parts(cfg.warm_start)
        except warm_start.WarmStartError as e:
            raise TrainError(str(e)) from None
        self._load_target(spec)
        try:
            self._build_draft(m)
        except warm_start.WarmStartError as e:
            raise TrainError(str(e)) from None
        self._plan()

    def _chat_template(self, spec: TargetSpec) -> str | None:
        """The template to compare with the store's: --chat-template, else the tokenizer's."""
        if self.cfg.chat_template:
            try:
                return Path(self.cfg.chat_template).read_text()
            except OSError as e:
                raise TrainError(f"cannot read --chat-template: {e}") from None
        try:
            template = load_tokenizer(spec).chat_template
        except (OSError, ValueError):
            template = None
        if isinstance(template, dict):  # named templates: apply_chat_template uses "default"
            template = template.get("default")
        if not template and self.store.meta.chat_template_hash:
            self._say("[yellow]warning:[/] the target has no chat template of its own: pass gen-data's "
                      "--chat-template to check the store against it")
        return template or None

    def _load_target(self, spec: TargetSpec):
        cfg = self.cfg
        quantized = cfg.load_in_8bit or cfg.load_in_4bit
        if quantized and not cfg.online:
            raise TrainError("--load-in-8bit/--load-in-4bit only apply to --online training "
                             "(offline training uses the stored features)")
        if quantized:
            warnings.warn("the target is loaded quantized: its features differ slightly from the served "
                          "full-precision model's, so acceptance may be a little lower", stacklevel=2)
        if cfg.online:
            self.target = load_target(spec)
            self.head = self.target
        else:
            # Offline: the decoder is only needed for one consistency probe, on the CPU.
            # auto: fp32 when training on the CPU, bf16 (half the host memory) for a GPU run.
            dtype = spec.dtype if spec.dtype != "auto" else ("float32" if self.acc.device.type == "cpu" else "bfloat16")
            cpu_spec = TargetSpec(**{**spec.__dict__, "device": "cpu", "dtype": dtype})
            model = load_target(cpu_spec)
            check_features_match(self.store, model, self.layer_ids)
            self.target = None
            self.head = TargetHead(model).to(self.acc.device)
            self._embed = input_embeddings(model).weight.detach()
            self._warm = warm_start.target_parts(model, self.warm_parts)
            del model
            return
        self._embed = input_embeddings(self.target).weight.detach()
        self._warm = warm_start.target_parts(self.target, self.warm_parts)

    def _build_draft(self, m):
        cfg = self.cfg
        vocab_size = output_head(self.head if self.target is None else self.target).weight.shape[0]
        counts = self.store.token_counts(vocab_size)
        end_ids = list(m.end_token_ids) or _as_list(getattr(text_config(self.target_config), "eos_token_id", None))
        try:
            self.vocab = build_vocab(counts, cfg.draft_vocab_size, cfg.vocab_coverage, end_ids)
        except ValueError as e:
            raise TrainError(str(e)) from None
        dcfg = DraftConfig.from_target(self.target_config, self.vocab.size, self.layer_ids)
        draft = Eagle3Draft(dcfg, embed_weight=self._embed.float().cpu())
        draft.init_weights(seed=cfg.seed)
        draft.set_vocab(self.vocab.ids)
        # The warm start first: with --init-from, rows of tokens new to its vocabulary keep it.
        warm_start.apply(draft, self.warm_parts, self._warm, self.vocab.ids)
        if cfg.init_from:  # continue from an existing draft in any format (formats.init_from, docs/formats.md)
            from .formats import FormatError, init_from
            try:
                draft, self.vocab = init_from(draft, self.vocab, counts, cfg, self.target_config, self._say)
            except FormatError as e:
                raise TrainError(f"--init-from: {e}") from None
        elif cfg.freeze_head and "head" in self.warm_parts:
            draft.lm_head.weight.requires_grad_(False)
        self._warm = None  # the target's layer / head copies are not needed past here
        self.draft = draft.to(self.acc.device)
        self.vocab_ids = self.vocab.ids.to(self.acc.device)
        self._say(f"draft vocab: {self.vocab.size} tokens covering {self.vocab.coverage:.2%} of the masked "
                  f"training tokens; layers {self.layer_ids}")

    def _plan(self):
        cfg = self.cfg
        self.lengths = self.store.lengths()
        self.crop = min(cfg.max_length, cfg.max_tokens)
        crop_lengths = [min(n, self.crop) for n in self.lengths]
        self.crop_lengths = crop_lengths
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
    def _inputs(self, idx: list[int]):
        batch = collate(self.store, idx, self.crop, features=not self.cfg.online)
        dev = self.acc.device
        ids, mask = batch["input_ids"].to(dev), batch["loss_mask"].to(dev)
        if self.cfg.online:
            aux, final = capture(self.target, ids, self.layer_ids, batch["attention_mask"].to(dev))
        else:
            aux, final = batch["aux"].to(dev), batch["final"].to(dev)
        teacher = teacher_from_final(self.head, final, self.vocab_ids)
        return (ids, aux, mask, teacher.probs, teacher.index), batch["tokens"]

    @torch.no_grad()
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
        for idx in batches[self.acc.process_index::self.acc.num_processes]:
            args, tokens = self._inputs(idx)
            with self.acc.autocast():
                _, sl, c, n = model(*args)
            meter.add(sl, c, n, tokens)
        return meter.result(self.acc)

    # -- the loop --
    def run(self, stop_after: int | None = None) -> TrainResult:
        cfg, acc = self.cfg, self.acc
        ttt = TTTModel(self.draft, cfg.ttt_steps, cfg.step_decay)
        params = [p for p in ttt.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(self.total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))
        start = self._start(optimizer, scheduler)
        model, optimizer = acc.prepare(ttt, optimizer)
        unwrapped = acc.unwrap_model(model)
        step, epoch0, group0 = start["step"], start["epoch"], start["group"]
        history = list(start.get("history", []))
        if cfg.report_to:
            acc.init_trackers("eagle3", config={k: v for k, v in cfg.to_dict().items() if v is not None})
        view = LiveView(self, enabled=acc.is_main_process and not self.quiet)
        meter, stopped, last_val = Meter(cfg.ttt_steps, acc.device), None, start.get("val")
        t0, c0 = time.time(), time.process_time()
        with view:
            view.update(step, None, 0.0)
            for epoch in range(epoch0, cfg.epochs):
                groups = self.groups(epoch)
                for gi in range(group0 if epoch == epoch0 else 0, len(groups)):
                    if step >= self.total_steps:
                        break
                    finite = self._optimizer_step(model, optimizer, scheduler, params, groups[gi], meter)
                    if not finite:
                        stopped = self._stop_nan(step)
                        break
                    step += 1
                    if step % cfg.log_every == 0 or step == self.total_steps:
                        stats = meter.result(acc)
                        tokens = acc.reduce(torch.tensor(float(meter.tokens), device=acc.device), "sum").item()
                        rate = tokens / max(1e-9, time.time() - t0)
                        rec = {"step": step, "epoch": epoch, "lr": scheduler.get_last_lr()[0],
                               "loss": _decayed_loss(stats["loss"], cfg.step_decay), "acc": stats["acc"],
                               "tokens_per_s": rate, "tokens": int(tokens),
                               # CPU seconds of this process: a speed measure that other jobs on a
                               # shared machine do not distort (benchmarks/train_throughput.py).
                               "cpu_s": time.process_time() - c0}
                        history.append(rec)
                        view.update(step, rec, rate)
                        self._log(rec, step)
                        meter, t0, c0 = Meter(cfg.ttt_steps, acc.device), time.time(), time.process_time()
                    if step % cfg.save_every == 0 and step < self.total_steps:
                        self._save(step, epoch, gi + 1, optimizer, scheduler, history, last_val)
                    if stop_after is not None and step >= stop_after:
                        stopped = "interrupted"
                        break
                if stopped:
                    break
                last_val = self.evaluate(unwrapped.draft)
                if last_val is not None:
                    rec = {"step": step, "epoch": epoch, "val": last_val}
                    history.append(rec)
                    self._log(rec, step)
                    view.note(f"epoch {epoch + 1}: held-out loss "
                              f"{_decayed_loss(last_val['loss'], cfg.step_decay):.3f}, acc "
                              + " ".join(f"{a:.2f}" for a in last_val["acc"])
                              + f", simulated tau {last_val['tau_sim']:.2f}")
                if step >= self.total_steps:
                    break
        if stopped is None:
            self._save(step, cfg.epochs, 0, optimizer, scheduler, history, last_val)
        result = TrainResult(self.out, unwrapped.draft, step, {}, history, stopped)
        if stopped is None:
            result.metrics = self._finish(result, last_val, history)
        if cfg.report_to:
            acc.end_training()
        return result

    def _optimizer_step(self, model, optimizer, scheduler, params, group, meter) -> bool:
        acc = self.acc
        bad = torch.zeros((), device=acc.device)
        for mi, idx in enumerate(group):
            args, tokens = self._inputs(idx)
            sync = contextlib.nullcontext() if mi == len(group) - 1 else acc.no_sync(model)
            with sync, acc.autocast():
                loss, sl, c, n = model(*args)
                if not torch.isfinite(loss):
                    bad += 1
                acc.backward(loss / len(group))
            meter.add(sl, c, n, tokens)
        if acc.reduce(bad, "sum").item() > 0:
            optimizer.zero_grad(set_to_none=True)
            return False
        acc.clip_grad_norm_(params, self.cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return True

    def _stop_nan(self, step: int) -> str:
        last = checkpoint_dirs(self.out)
        where = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was saved yet"
        msg = f"loss became NaN/inf at step {step + 1}: stopped without applying that update; {where}"
        self._say(f"[bold red]{msg}[/]")
        return msg

    def _start(self, optimizer, scheduler) -> dict:
        """Fresh start, or the state of the last checkpoint with --resume."""
        cfg = self.cfg
        existing = checkpoint_dirs(self.out)
        if not cfg.resume:
            if existing:
                raise TrainError(f"{self.out} already holds checkpoints: pass --resume to continue, or choose "
                                 "another --out")
            return {"step": 0, "epoch": 0, "group": 0}
        if not existing:
            raise TrainError(f"--resume: no checkpoint in {self.out / CHECKPOINTS}")
        path = existing[-1]
        saved = json.loads((path / "trainer_state.json").read_text())["config"]
        now = cfg.to_dict()
        for key in sorted(set(saved) | set(now)):
            if key not in RESUME_FREE and saved.get(key) != now.get(key):
                raise TrainError(f"--resume: {key} was {saved.get(key)!r} in {path}, now {now.get(key)!r}; "
                                 "resume with the same settings")
        state = load_checkpoint(self.acc, path, self.draft, optimizer, scheduler)
        if state["epoch"] >= cfg.epochs:
            raise TrainError(f"{path} is the end of a finished run: nothing to resume")
        self._say(f"resumed from {path} (step {state['step']})")
        return state

    def _save(self, step, epoch, group, optimizer, scheduler, history, val):
        state = {"step": step, "epoch": epoch, "group": group, "config": self.cfg.to_dict(),
                 "recipe": self.recipe, "history": history, "val": val}
        save_checkpoint(self.acc, self.out, self.draft, optimizer, scheduler, state, self.cfg.keep_checkpoints)

    def _log(self, rec: dict, step: int):
        if not self.acc.is_main_process:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / LOG, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.cfg.report_to:
            flat = {}
            for k, v in rec.items():
                if isinstance(v, list):
                    flat.update({f"{k}_{i}": x for i, x in enumerate(v)})
                elif isinstance(v, dict):
                    for k2, v2 in v.items():
                        if isinstance(v2, list):
                            flat.update({f"{k}/{k2}_{i}": x for i, x in enumerate(v2)})
                        elif isinstance(v2, (int, float)):
                            flat[f"{k}/{k2}"] = v2
                elif isinstance(v, (int, float)):
                    flat[k] = v
            self.acc.log(flat, step=step)

    # -- output --
    def metadata(self, step: int, metrics: dict) -> dict:
        cfg, m = self.cfg, self.store.meta
        src = m.source
        datasets = src.get("datasets") or ([src["dataset"]] if isinstance(src.get("dataset"), str) else [])
        datasets = datasets or hub_datasets(src.get("data"))
        return {
            "target": self.model_id, "target_revision": cfg.revision or m.target_revision,
            "chat_template_hash": m.chat_template_hash, "layer_ids": list(self.layer_ids),
            "data": data_description(src), "num_samples": len(self.train_idx),
            "num_tokens": int(sum(self.lengths[i] for i in self.train_idx)), "steps": step,
            "epochs": cfg.epochs, "ttt_steps": cfg.ttt_steps, "step_decay": cfg.step_decay, "lr": cfg.lr,
            "draft_vocab_size": self.vocab.size, "vocab_coverage": round(self.vocab.coverage, 6),
            "recipe": self.recipe, "eagle3_version": __version__, "metrics": metrics,
            "datasets": [d for d in datasets if isinstance(d, str)], "created": date.today().isoformat(),
            "mode": "online" if cfg.online else "offline",
        }

    def _finish(self, result: TrainResult, val: dict | None, history: list) -> dict:
        from .inspector import inspect_draft

        train_recs = [h for h in history if "acc" in h]
        if val is not None:
            metrics = {"acc": [round(a, 4) for a in val["acc"]],
                       "loss": round(_decayed_loss(val["loss"], self.cfg.step_decay), 4),
                       "tau_sim": round(val["tau_sim"], 3), "split": "held-out"}
        elif train_recs:
            last = train_recs[-1]
            metrics = {"acc": [round(a, 4) for a in last["acc"]], "loss": round(last["loss"], 4),
                       "tau_sim": round(acceptance_length(last["acc"]), 3), "split": "train"}
        else:
            metrics = {"acc": [], "loss": None, "split": "none"}
        if train_recs:
            metrics["tokens_per_s"] = round(sum(h["tokens_per_s"] for h in train_recs) / len(train_recs), 1)
        metrics["peak_memory_mb"] = round(peak_memory_mb(self.acc.device), 1)
        if self.acc.is_main_process:
            save_draft(result.draft, self.out, self.metadata(result.step, metrics))
            report = inspect_draft(self.out, self.target_config)
            if not report.ok:
                raise TrainError(f"the exported draft in {self.out} fails inspection: {'; '.join(report.problems)}")
            write_json(self.out / "train_summary.json", {"steps": result.step, **metrics})
            if not self.quiet and self.console is not None:
                self.console.print(summary_table(metrics, result.step, self.out))
        self.acc.wait_for_everyone()
        return metrics


def hub_datasets(data: str | None) -> list[str]:
    """The Hub id of gen-data's --data when it was one (or a preset); [] for a local file."""
    from .sources import PRESETS

    if not isinstance(data, str):
        return []
    if data.lower() in PRESETS:
        return [PRESETS[data.lower()][0]]
    from .push import is_hub_id

    return [data] if is_hub_id(data) and not data.endswith((".json", ".jsonl", ".parquet")) else []


def data_description(src: dict) -> str | None:
    """What the draft was trained on, for the card: the dataset's Hub id or file name, never a
    path of this machine (the store's folder and the data file's directories stay private)."""
    data = src.get("data")
    if not isinstance(data, str):
        return None
    name = (hub_datasets(data) or [Path(data).name])[0]
    how = "answers regenerated by the target" if src.get("regenerated") else "the dataset's own answers"
    return f"{name} ({how})"


# accelerate tracker name -> the packages that provide it.
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
                    "comet_ml": ("comet_ml",), "aim": ("aim",), "clearml": ("clearml",), "dvclive": ("dvclive",)}


def check_trackers(report_to: str | None) -> list[str]:
    """--report-to names, each known and installed (accelerate would silently drop the others)."""
    import importlib.util

    names = [t.strip().lower() for t in (report_to or "").split(",") if t.strip()]
    for name in names:
        if name not in TRACKER_PACKAGES:
            raise TrainError(f"--report-to {name}: unknown tracker; choose from {', '.join(TRACKER_PACKAGES)}")
        if not any(importlib.util.find_spec(p) for p in TRACKER_PACKAGES[name]):
            raise TrainError(f"--report-to {name} needs the {TRACKER_PACKAGES[name][0]} package: "
                             f"pip install {TRACKER_PACKAGES[name][0]}")
    return names


def _as_list(x) -> list:
    """EOS ids (None, one id or a list) as a sorted list: ``hf_utils.eos_token_ids``."""
    return sorted(eos_token_ids(x))


def peak_memory_mb(device) -> float:
    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def summary_table(metrics: dict, step: int, out: Path):
    from rich.table import Table

    table = Table(title=f"eagle3 train: {step} steps -> {out}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for s, a in enumerate(metrics.get("acc", [])):
        table.add_row(f"acc_{s} ({metrics.get('split')})", f"{a:.3f}")
    for key in ("loss", "tau_sim", "tokens_per_s", "peak_memory_mb"):
        if metrics.get(key) is not None:
            table.add_row(key, f"{metrics[key]}")
    return table


class LiveView:
    """Rich progress bar with step, loss, per-step accuracies, tokens/s and ETA."""

    def __init__(self, trainer: Trainer, enabled: bool):
        self.enabled = enabled
        self.total = trainer.total_steps
        self.console = trainer.console
        self.progress = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[info]}"), console=self.console, transient=False)
            self.progress.__enter__()
            self.task = self.progress.add_task("train", total=self.total, info="")
        return self

    def update(self, step: int, rec: dict | None, rate: float):
        if self.progress is None:
            return
        info = ""
        if rec is not None:
            info = (f"loss {rec['loss']:.3f}  acc " + " ".join(f"{a:.2f}" for a in rec["acc"])
                    + f"  {rate:,.0f} tok/s")
        self.progress.update(self.task, completed=step, info=info)
        if rec is not None and not self.progress.console.is_terminal:
            # a log file gets no live bar (rich draws it once, at the end): one line per log point
            eta = self.progress.tasks[0].time_remaining
            eta = f"  eta {int(eta) // 60}m{int(eta) % 60:02d}s" if eta is not None else ""
            self.progress.console.print(f"step {step}/{self.total}  {info}{eta}", highlight=False)

    def note(self, text: str):
        if self.progress is not None:
            self.progress.console.print(text, highlight=False)

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)


def train(cfg: TrainConfig, recipe: str | None = None, console=None, quiet: bool = False,
          stop_after: int | None = None) -> TrainResult:
    """Library entry point: set up from ``cfg``, train, export. ``stop_after`` simulates an
    interruption after that many optimizer steps (checkpoints stay as a crash leaves them)."""
    trainer = Trainer(cfg, recipe, console, quiet)
    trainer.setup()
    result = trainer.run(stop_after=stop_after)
    result.limit = trainer.limit
    return result
