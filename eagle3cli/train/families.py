"""The trainer's seam between draft families: what differs between EAGLE-3 and DFlash, and nothing else.

The loop (trainer.py), the store, the time budget, checkpoints, resume, DDP/FSDP, held-out metrics
and the report are the same for both; a family gives the trainer

    layer_ids(...)   the target streams its draft reads (a store may hold more: its columns are picked)
    build(...)       the draft (and, for EAGLE-3, its vocabulary)
    objective(...)   the module whose forward is one micro-batch's loss and statistics (ttt.TTTOutput)
    inputs(...)      that forward's arguments from a batch's tokens and streams
    positions        the statistics' length (EAGLE-3: TTT steps; DFlash: drafted positions B-1)
    record(...)      what the exported config.json records of how the draft was trained
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config.train_config import TrainConfig, TrainError
from ..core.errors import OptionError
from ..core.hf_utils import text_config
from ..model.dflash import DFlashConfig, DFlashDraft, choose_mask_token
from ..model.layers import layers_for, missing_streams, stream_columns
from ..model.target import output_head
from . import dflash_loss
from .setup import as_list, build_draft
from .ttt import TTTModel, teacher_from_final, teacher_rows


def select_streams(aux: torch.Tensor, columns: list[int] | None, hidden: int) -> torch.Tensor:
    """The streams at ``columns`` of a store's concatenated ones [.., n*Ht] (None: all)."""
    if columns is None:
        return aux
    return torch.cat([aux[..., c * hidden:(c + 1) * hidden] for c in columns], dim=-1)


def required_layers(cfg: TrainConfig, target_config, store_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The streams the draft reads: --layers, else the family's default; an EAGLE-3 draft on a store of
    exactly three streams keeps the store's (as before several families shared a store)."""
    from ..config.options import parse_layer_ids

    override = parse_layer_ids(cfg.layers)
    try:
        if cfg.draft_type == "eagle3" and override is None and len(store_ids) == 3:
            return tuple(store_ids)
        return layers_for(target_config, cfg.draft_type, override, warn=False).ids
    except OptionError as e:
        raise TrainError(str(e)) from None


def check_streams(store, want: tuple[int, ...], draft_type: str, online: bool) -> None:
    """A store that lacks the draft's streams is refused before any step, with the command that fixes it."""
    lack = missing_streams(store.meta.layer_ids, want)
    if lack and not online:
        raise TrainError(f"store {store.root} holds layers {store.meta.layer_ids}, a {draft_type} draft reads "
                         f"{want} (missing {lack}): run `eagle3 gen-data --draft-type {draft_type}` (or "
                         f"--draft-type eagle3,dflash for a store both families train on), or train with --online")


@dataclass
class Eagle3Family:
    cfg: TrainConfig
    name: str = "eagle3"

    @property
    def positions(self) -> int:
        return self.cfg.ttt_steps

    @property
    def decay(self) -> float:
        """Each position's loss weight over the previous one's (the logged loss sums them so)."""
        return self.cfg.step_decay

    def eval_positions(self) -> int:
        return max(self.cfg.ttt_steps, self.cfg.eval_ttt_steps)

    def build(self, store, target_config, parts, warm_parts, layer_ids, say):
        return build_draft(self.cfg, store, target_config, parts, warm_parts, say, layer_ids)

    def objective(self, draft, recompute: bool = True, held_out: bool = False):
        if held_out:
            return TTTModel(draft, self.eval_positions(), self.cfg.step_decay)
        return TTTModel(draft, self.cfg.ttt_steps, self.cfg.step_decay, recompute=recompute,
                        accept_weight=self.cfg.accept_loss)

    def inputs(self, t, ids, aux, final, mask, batch, held_out: bool, seed: int | None):
        teacher = teacher_from_final(t.head, final, t.vocab_ids, teacher_rows(mask), full_argmax=held_out)
        return ids, aux, mask, teacher.probs, teacher.index, teacher.slot

    def record(self, t) -> dict:
        return {"ttt_steps": self.cfg.ttt_steps, "step_decay": self.cfg.step_decay,
                "draft_vocab_size": t.vocab.size, "vocab_coverage": round(t.vocab.coverage, 6)}

    def end_tokens(self, ends: set[int], t) -> set[int]:
        return ends & set(t.vocab.ids.tolist())


@dataclass
class DFlashFamily:
    cfg: TrainConfig
    name: str = "dflash"

    @property
    def positions(self) -> int:
        return self.cfg.block_size - 1

    @property
    def decay(self) -> float:
        """exp(-1/gamma): drafted position k weighs decay^(k-1) (dflash_loss.position_weights)."""
        return math.exp(-1.0 / (self.cfg.loss_gamma or dflash_loss.default_gamma(self.cfg.block_size)))

    def eval_positions(self) -> int:
        return self.positions

    def build(self, store, target_config, parts, warm_parts, layer_ids, say):
        cfg = self.cfg
        if set(warm_parts) - {"head"}:
            raise TrainError("--warm-start: a DFlash draft takes only head (its final norm from the target's; the "
                             "LM head is the target's already)")
        head = output_head(parts.head).weight.detach()
        mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else default_mask_token(target_config, store)
        tc = text_config(target_config)
        ends = set(as_list(getattr(tc, "eos_token_id", None))) | set(store.meta.end_token_ids)
        ends |= {getattr(tc, "pad_token_id", None)} - {None}
        if mask_id in ends:
            raise TrainError(f"--mask-token-id {mask_id} is an end or pad token of the target: a block filled "
                             "with it ends decoding; choose another id or leave the default")
        try:
            dcfg = DFlashConfig.from_target(target_config, layer_ids, block_size=cfg.block_size,
                                            mask_token_id=mask_id, num_hidden_layers=cfg.draft_layers)
        except ValueError as e:
            raise TrainError(f"--mask-token-id: {e}") from None
        draft = DFlashDraft(dcfg)
        for p, src in ((draft.embed_tokens, parts.embed), (draft.lm_head, head)):
            dtype = torch.bfloat16 if src.dtype == torch.bfloat16 else torch.float32
            p.to(dtype)  # frozen and only read: a bf16 source is kept in bf16
        draft.set_embedding(parts.embed.cpu())
        draft.set_head(head.cpu())
        draft.init_weights(std=cfg.init_std, seed=cfg.seed, residual_std=cfg.residual_init_std)
        if "head" in warm_parts:  # the draft's last norm as the target's: its rows start in the head's space
            with torch.no_grad():
                draft.norm.weight.copy_(parts.warm["norm"].to(draft.norm.weight.dtype))
        parts.warm = None
        if cfg.init_from:  # its settings agreed before the target was loaded (setup.check_init_from)
            from ..core.errors import Eagle3Error
            from .init_from import init_dflash
            try:
                draft = init_dflash(draft, cfg, target_config, say)
            except Eagle3Error as e:
                raise TrainError(f"--init-from: {e}") from None
        say(f"DFlash draft: {cfg.draft_layers} layer(s), blocks of {cfg.block_size} (MASK id {mask_id}), "
            f"{draft.num_parameters() / 1e6:.1f}M trainable parameters")
        return draft, None

    def objective(self, draft, recompute: bool = True, held_out: bool = False):
        alpha = self.cfg.dpace_alpha if self.cfg.position_weights == "dpace" else None
        soft = 0.0 if held_out else self.cfg.soft_labels
        return dflash_loss.DFlashLoss(draft, self.cfg.loss_gamma or None, alpha, soft)

    def draw_anchors(self, t, mask, batch, held_out: bool, seed: int | None):
        """The step's blocks: anchors [B, m], which are real [B, m], and the rows' lengths [B].

        A seam of its own so a benchmark can replay another trainer's anchors (benchmarks/dflash_replay.py).
        Held-out blocks are the same every evaluation (a fixed seed): their metrics compare."""
        lengths = batch["attention_mask"].sum(1).to(mask.device)
        anchors, real = dflash_loss.sample_anchors(mask, lengths, self.cfg.num_anchors,
                                                   self.cfg.seed if held_out or seed is None else seed)
        return anchors, real, lengths

    def inputs(self, t, ids, aux, final, mask, batch, held_out: bool, seed: int | None):
        anchors, real, lengths = self.draw_anchors(t, mask, batch, held_out, seed)
        used = dflash_loss.needed_positions(mask, lengths, anchors, real, self.cfg.block_size)
        if held_out or not self.cfg.soft_labels:
            argmax = dflash_loss.target_argmax(t.head, final, used)
            return ids, aux, anchors, dflash_loss.block_labels(argmax, mask, lengths, anchors, real,
                                                               self.cfg.block_size)
        # One pass over the head gives both: the distribution's argmax over the whole vocabulary.
        vocab = torch.arange(output_head(t.head).weight.shape[0], device=final.device)
        teacher = teacher_from_final(t.head, final, vocab, used, full_argmax=False)
        labels = dflash_loss.block_labels(teacher.index, mask, lengths, anchors, real, self.cfg.block_size)
        rows = dflash_loss.block_rows(teacher.slot, anchors, self.cfg.block_size)
        return ids, aux, anchors, labels, teacher.probs, rows

    def record(self, t) -> dict:
        c = self.cfg
        return {"block_size": c.block_size, "draft_layers": c.draft_layers, "num_anchors": c.num_anchors,
                "loss_gamma": c.loss_gamma or dflash_loss.default_gamma(c.block_size),
                "position_weights": c.position_weights,
                **({"dpace_alpha": c.dpace_alpha} if c.position_weights == "dpace" else {}),
                **({"soft_labels": c.soft_labels} if c.soft_labels else {})}

    def end_tokens(self, ends: set[int], t) -> set[int]:
        return ends  # the draft predicts over the target's whole vocabulary


def default_mask_token(target_config, store) -> int:
    """A spare row of the embedding past the tokenizer's vocabulary when the store records that size,
    else the last id that is not one of the target's special tokens."""
    tc = text_config(target_config)
    specials = [*as_list(getattr(tc, "eos_token_id", None)), getattr(tc, "pad_token_id", None),
                getattr(tc, "bos_token_id", None), *store.meta.end_token_ids]
    used = store.meta.raw.get("tokenizer_vocab_size")
    return choose_mask_token(int(tc.vocab_size), specials, used_vocab_size=used)


def family_of(cfg: TrainConfig):
    return DFlashFamily(cfg) if cfg.draft_type == "dflash" else Eagle3Family(cfg)


def family_setup(cfg: TrainConfig, store, target_config):
    """(family, the streams its draft reads, their columns in the store's features or None)."""
    ids = required_layers(cfg, target_config, store.meta.layer_ids)
    check_streams(store, ids, cfg.draft_type, cfg.online)
    return family_of(cfg), ids, None if cfg.online else stream_columns(store.meta.layer_ids, ids)

