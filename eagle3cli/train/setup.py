"""Training set-up before the first step: the target's parts (the full model with --online, else
its LM head alone), the draft built on the target's frozen embedding, and the checks that refuse a
run in one line before any step (a store made with another target, no learned tokens within the
crop, an unreadable --init-from).
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config.train_config import TrainConfig, TrainError, draft_options
from ..core.hf_utils import eos_token_ids, text_config
from ..data.features import FeatureStore
from ..engines import engine_support
from ..model import warm_start
from ..model.draft import DraftConfig, Eagle3Draft
from ..model.target import TargetSpec, capture, input_embeddings, load_target, load_tokenizer, output_head
from ..model.vocab import build_vocab
from .precision import stored_dtype, train_dtype_name

# ---- setup checks ------------------------------------------------------------------------------

def limit_note(steps_per_epoch: int, epoch_steps: int, cfg: TrainConfig) -> str:
    """Which limit ends the run: --max-steps or the epochs (said at the start and at the end).
    ``epoch_steps`` is what the epochs make in all; regrouped epochs may each cut a step more or
    fewer than the first, whose count is quoted as "about"."""
    about = "about " if cfg.regroup_batches else ""
    epochs = f"{cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''} of {about}{steps_per_epoch} steps"
    if cfg.max_steps > 0 and cfg.max_steps < epoch_steps:
        return f"--max-steps {cfg.max_steps} ends the run before {epochs}"
    if cfg.max_steps > epoch_steps:
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
        target = load_target(TargetSpec(**{**spec.__dict__, "device": "cpu", "dtype": train_dtype_name(spec, device)})
                             if sharded else spec)
        return TargetParts(target, target, input_embeddings(target).weight.detach(),
                           warm_start.target_parts(target, warm_parts))
    # Offline: the decoder is only needed for one consistency probe, on the CPU. The head (the
    # teacher's) is kept in the training dtype, auto: fp32 when training on the CPU, bf16 (half the
    # host memory) for a GPU run. A bf16 checkpoint is loaded as stored and only its head cast up:
    # the same values as loading it all in fp32, without a transient fp32 copy of the decoder
    # (not with a head/layer warm start: those copy norms computed in the loaded dtype).
    dtype = train_dtype_name(spec, device)
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


def eval_refusal(target_config) -> str | None:
    """Why ``eagle3 eval`` would refuse this target (the generator's own check), None if it runs it."""
    from ..decode.generator import UnsupportedTarget, check_supported

    try:
        check_supported(target_config)
    except UnsupportedTarget as e:
        return str(e)
    return None


def check_init_from(cfg: TrainConfig, target_config, store: FeatureStore | None = None) -> TrainConfig:
    """A corrupted or unreadable --init-from, a draft of the other family, or a DFlash draft whose block,
    depth, streams or MASK id differ from the run's, is one line before the target is loaded. Returns
    ``cfg``, for a DFlash draft with its layers and MASK id where the run left them open
    (init_from.dflash_settings)."""
    if not cfg.init_from:
        return cfg
    from ..core.errors import Eagle3Error
    from ..publish.formats.readers import read_draft
    from .init_from import dflash_settings, family_problem

    try:
        src, _ = read_draft(cfg.init_from, target_config=target_config)
        problem = family_problem(cfg, src)
        if problem:
            raise TrainError(f"--init-from: {problem}")
        if cfg.draft_type == "dflash":
            return dflash_settings(cfg, src.config, target_config, store)
    except TrainError:
        raise
    except Eagle3Error as e:  # FormatError, CorruptDraft, a DFlash folder without its weights
        raise TrainError(f"--init-from: {e}") from None
    return cfg


def build_draft(cfg: TrainConfig, store: FeatureStore, target_config, parts: TargetParts, warm_parts, say,
                layer_ids=None):
    """(draft, vocab): the draft vocabulary from the store's token counts (docs/design.md §4), a
    draft on the target's frozen embedding, warm-started and/or continued from --init-from."""
    vocab_size = output_head(parts.head).weight.shape[0]
    counts = store.token_counts(vocab_size)
    end_ids = list(store.meta.end_token_ids) or as_list(getattr(text_config(target_config), "eos_token_id", None))
    try:
        vocab = build_vocab(counts, cfg.draft_vocab_size, cfg.vocab_coverage, end_ids)
    except ValueError as e:
        raise TrainError(str(e)) from None
    try:
        options = draft_options(cfg)  # --variant, --norm-before-fc, --norm-before-residual
    except ValueError as e:
        raise TrainError(str(e)) from None
    if cfg.init_from and cfg.norm_before_fc is None:
        # The default norm is not added to a draft trained without it (it would change what the draft
        # computes); the source's options are kept, and only those asked for by a flag are added.
        options["norm_before_fc"] = False
    for line in engine_support.warnings(target_config, options, eval_refusal(target_config)):
        say(f"[yellow]warning:[/] {line}")
    dcfg = DraftConfig.from_target(target_config, vocab.size, layer_ids or store.meta.layer_ids, **options)
    draft = Eagle3Draft(dcfg)
    # The frozen embedding is only looked up (rows cast to the stream's dtype, ttt_streams and
    # Eagle3Draft.step), so a bf16 source is kept in bf16: 151,936 x 896 is 272 MB, not 545 MB.
    embed_dtype = torch.bfloat16 if parts.embed.dtype == torch.bfloat16 else torch.float32
    draft.embed_tokens.to(embed_dtype)
    draft.set_embedding(parts.embed.cpu())
    draft.init_weights(std=cfg.init_std, seed=cfg.seed, residual_std=cfg.residual_init_std)
    draft.set_vocab(vocab.ids)
    # The warm start first: with --init-from, rows of tokens new to its vocabulary keep it.
    for line in warm_start.apply(draft, warm_parts, parts.warm, vocab.ids):
        say(line)
    parts.warm = None  # the target's layer / head copies are not needed past here
    if cfg.init_from:  # continue from an existing draft in any format (train/init_from.py, docs/formats.md)
        from ..publish.draft_check import CorruptDraft
        from ..publish.formats.common import FormatError
        from .init_from import init_from
        try:
            draft, vocab = init_from(draft, vocab, counts, cfg, target_config, say)
        except (FormatError, CorruptDraft) as e:
            raise TrainError(f"--init-from: {e}") from None
    elif cfg.freeze_head and "head" in warm_parts:
        draft.lm_head.weight.requires_grad_(False)
    return draft, vocab


# Above this, the activations the TTT unroll would keep for the backward are recomputed instead
def setup_line(vocab, layer_ids, recompute: bool, precision: str) -> str:
    compute = f"{'bf16 autocast' if precision == 'bf16' else 'fp32'} compute"
    if vocab is None:  # a DFlash draft predicts over the target's vocabulary through its head
        return f"draft vocab: the target's; layers {layer_ids}; {compute}"
    return (f"draft vocab: {vocab.size} tokens covering {vocab.coverage:.2%} of the masked training tokens; layers "
            f"{layer_ids}; TTT steps {'recomputed in the backward' if recompute else 'kept for the backward'}; "
            f"{compute}")




def as_list(x) -> list:
    """EOS ids (None, one id or a list) as a sorted list: ``hf_utils.eos_token_ids``."""
    return sorted(eos_token_ids(x))
