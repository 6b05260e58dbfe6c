"""``train --init-from DRAFT``: start training from an existing draft (any format the publish wing
reads) instead of random weights, its vocabulary kept or remapped onto this store's."""

from __future__ import annotations

from dataclasses import replace

import torch

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
