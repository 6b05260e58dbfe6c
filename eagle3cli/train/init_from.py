"""``train --init-from DRAFT``: start training from an existing draft (any format the publish wing
reads) instead of random weights: an EAGLE-3 draft's vocabulary kept or remapped onto this store's,
a DFlash draft's (z-lab's layout or speculators') block, depth, streams and MASK id checked against
the run's."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..model.dflash import DFlashConfig, DFlashDraft
from ..model.draft import OPTION_KEYS, Eagle3Draft
from ..model.vocab import DraftVocab
from ..publish.formats.common import FormatError
from ..publish.formats.readers import read_draft


def init_from(draft: Eagle3Draft, vocab, counts: torch.Tensor, cfg, target_config, say=None):
    """``train --init-from DRAFT``: start from an existing draft (any format) instead of random weights.

    ``draft`` and ``vocab`` are what the trainer just built (fresh weights, the vocabulary of
    this store). ``--init-vocab keep`` keeps the source's vocabulary: its d2t, t2d and lm_head
    rows travel together. ``--init-vocab new`` keeps the store's vocabulary and remaps the
    lm_head rows: a token in both vocabularies gets the source's row, a new one keeps the
    fresh initialisation. Returns (draft, vocab) for the trainer.
    """
    mode = getattr(cfg, "init_vocab", "keep") or "keep"  # keep or new: TrainConfig.validate checked it
    src, note = read_draft(cfg.init_from, target_config=target_config, dtype=torch.float32)
    for line in note.lines():
        say and say(f"init-from: {line}")
    a, b = src.config, draft.config
    for key in ("hidden_size", "target_hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size"):
        if getattr(a, key) != getattr(b, key):
            raise FormatError(f"{cfg.init_from}: {key} {getattr(a, key)}, this target needs {getattr(b, key)}")
    if tuple(a.aux_layer_ids) != tuple(b.aux_layer_ids):
        raise FormatError(f"{cfg.init_from} reads layers {list(a.aux_layer_ids)}, the store holds "
                          f"{list(b.aux_layer_ids)}: its fc would mix the wrong streams")
    # Architecture options (docs/design.md §3): the source's are kept (its weights were trained with
    # them), the ones this run asks for are added (their norms start at ones).
    opts = {k: getattr(a, k) or getattr(b, k) for k in OPTION_KEYS}
    if opts["fc_norm"] and opts["norm_before_fc"]:
        raise FormatError(f"{cfg.init_from} uses {'fc_norm' if a.fc_norm else 'norm_before_fc'}; this run asks for "
                          f"{'fc_norm' if b.fc_norm else 'norm_before_fc'}: the two are mutually exclusive")
    if a.options():
        say and say(f"init-from: its options {', '.join(a.options())} are kept")
    state = {k: v for k, v in src.state_dict().items() if k not in ("embed_tokens.weight",)}
    if mode == "keep":
        ids = src.draft_to_target(torch.arange(a.draft_vocab_size))
        out = Eagle3Draft(replace(b, draft_vocab_size=a.draft_vocab_size, **opts),
                          embed_weight=draft.embed_tokens.weight)
        out.load_state_dict(state, strict=False)
        total = int(counts.sum())
        vocab = DraftVocab(ids=ids, coverage=int(counts.long()[ids].sum()) / total if total else 0.0)
        say and say(f"init-from: kept its vocabulary ({a.draft_vocab_size} tokens; d2t, t2d, lm_head unchanged)")
    else:
        out = draft
        if any(opts[k] != getattr(b, k) for k in OPTION_KEYS):
            out = Eagle3Draft(replace(b, **opts), embed_weight=draft.embed_tokens.weight)
            out.load_state_dict(draft.state_dict(), strict=False)  # the fresh weights and this store's vocabulary
        new_ids = vocab.ids.long()
        row_of = torch.full((a.vocab_size,), -1, dtype=torch.long)
        row_of[src.draft_to_target(torch.arange(a.draft_vocab_size))] = torch.arange(a.draft_vocab_size)
        src_rows = row_of[new_ids]
        shared = src_rows >= 0
        head = out.lm_head.weight.detach().clone()
        head[shared] = state["lm_head.weight"][src_rows[shared]].to(head.dtype)
        state = {k: v for k, v in state.items() if k not in ("lm_head.weight", "d2t", "t2d")}
        out.load_state_dict(state, strict=False)
        with torch.no_grad():
            out.lm_head.weight.copy_(head)
        say and say(f"init-from: new vocabulary of {vocab.size} tokens: {int(shared.sum())} lm_head rows copied "
                    f"from the draft, {int((~shared).sum())} new tokens initialised fresh")
    return out, vocab


# ---- DFlash drafts -------------------------------------------------------------------------------
# A DFlash draft fixes what its weights were trained for: the block size, the draft's depth, the
# target streams its fc reads and the MASK row that fills the block. The run's flags must agree
# (refused in one line naming the flags to pass), and the two a run leaves open by default (no
# --layers, --mask-token-id -1) are taken from the draft, as an EAGLE-3 draft's options are kept.

def family_problem(cfg, src) -> str | None:
    """Why ``src`` (a read draft) cannot continue this run's family, None when it can."""
    theirs = getattr(src.config, "draft_type", "eagle3")
    if theirs == cfg.draft_type:
        return None
    names = {"eagle3": "an EAGLE-3", "dflash": "a DFlash"}
    return (f"{cfg.init_from} is {names[theirs]} draft and this run trains {names[cfg.draft_type]} one: "
            f"pass --draft-type {theirs} to continue it")


def dflash_settings(cfg, src: DFlashConfig, target_config, store):
    """``cfg`` with the DFlash draft's layers and MASK id where the run left them open; a setting the run
    gave otherwise, a draft of another target, or (offline) a store without its streams is one line."""
    from ..config.options import parse_layer_ids
    from ..core.hf_utils import text_config
    from ..model.layers import missing_streams

    path = cfg.init_from
    tc = text_config(target_config)
    for key, want in (("hidden_size", tc.hidden_size), ("target_hidden_size", tc.hidden_size),
                      ("vocab_size", tc.vocab_size), ("num_target_layers", tc.num_hidden_layers)):
        if getattr(src, key) != want:
            raise FormatError(f"{path}: {key} {getattr(src, key)}, this target needs {want}: a draft of another "
                              f"target")
    ids = tuple(src.target_layer_ids)
    csv = ",".join(str(j) for j in ids)
    given = parse_layer_ids(cfg.layers)
    differ = []  # (what the draft has, what this run has, the flag that makes them agree)
    if given is not None and tuple(given) != ids:
        differ.append((f"layers {list(ids)}", f"{list(given)}", f"--layers {csv}"))
    if cfg.block_size != src.block_size:
        differ.append((f"blocks of {src.block_size}", f"{cfg.block_size}", f"--block-size {src.block_size}"))
    if cfg.draft_layers != src.num_hidden_layers:
        differ.append((f"{src.num_hidden_layers} draft layer(s)", f"{cfg.draft_layers}",
                       f"--draft-layers {src.num_hidden_layers}"))
    if cfg.mask_token_id >= 0 and cfg.mask_token_id != src.mask_token_id:
        differ.append((f"MASK id {src.mask_token_id}", f"{cfg.mask_token_id}", f"--mask-token-id {src.mask_token_id}"))
    if differ:
        raise FormatError(f"{path} was trained with {', '.join(f'{a} (this run: {b})' for a, b, _ in differ)}: "
                          f"pass {' '.join(f for _, _, f in differ)} to continue it")
    lack = () if cfg.online or store is None else missing_streams(store.meta.layer_ids, ids)
    if lack:
        raise FormatError(f"{path} reads layers {list(ids)}, the store {store.root} holds "
                          f"{list(store.meta.layer_ids)} (missing {list(lack)}): run `eagle3 gen-data "
                          f"--draft-type dflash --layers {csv}`, or train with --online")
    return replace(cfg, layers=csv, mask_token_id=src.mask_token_id)


def init_dflash(draft: DFlashDraft, cfg, target_config, say=None) -> DFlashDraft:
    """Load the --init-from DFlash draft's weights (all of them but the target's embedding and head,
    which the run's draft already holds) into ``draft``, built with the settings ``dflash_settings``
    agreed. The source's config is the run's (its RoPE, norms' eps and sizes are what its weights
    were trained with)."""
    src, note = read_draft(cfg.init_from, target_config=target_config, dtype=torch.float32)
    for line in note.lines():
        say and say(f"init-from: {line}")
    out = draft
    if src.config != draft.config:  # geometry of its own (sizes, RoPE) within what dflash_settings checked
        out = DFlashDraft(src.config)
        out.embed_tokens.weight = draft.embed_tokens.weight  # the target's, frozen: shared, not copied
        out.lm_head.weight = draft.lm_head.weight
    mine = out.trainable_state_dict()
    theirs = src.trainable_state_dict()
    if set(mine) != set(theirs):
        raise FormatError(f"{cfg.init_from}: tensors {sorted(set(mine) ^ set(theirs))[:4]} differ from this "
                          "run's draft")
    out.load_state_dict(theirs, strict=False)
    say and say(f"init-from: {len(theirs)} tensors of {cfg.init_from} loaded (blocks of {src.config.block_size}, "
                f"layers {list(src.config.target_layer_ids)}, MASK id {src.config.mask_token_id})")
    return out
