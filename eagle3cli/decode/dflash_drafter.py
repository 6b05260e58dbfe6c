"""The DFlash draft as a drafter of the generator's protocol (``drafter.Drafter``; docs/design.md §13).

A DFlash draft proposes a whole block in one forward: ``observe`` receives the target's features of
the positions just committed, appends them to the draft's context caches and drafts the block
[anchor, MASK x (B-1)] after the root (the last committed token, the anchor, whose own features the
target has not computed yet). Block row k predicts the token at anchor + k, and no row depends on
the tokens drafted at the others, so every node at depth d of a tree below the root has the same
children distribution: block row d + 1. A chain takes each row's argmax; a top-k tree (EAGLE-2's,
``tree.build_greedy_tree``) takes each row's top-k and keeps the best products. Nothing drafted is
cached (block rows never enter the context), so ``rollback`` has nothing to undo, and the target
verifies the drafted tokens exactly as it verifies EAGLE-3's: the output is the target's own.
"""

from __future__ import annotations

import copy

import torch


class DFlashDrafter:
    """Wraps ``model.dflash.DFlashDraft``: per-layer caches of the committed context's keys and values
    and the log-probabilities of the last drafted block."""

    draft_type = "dflash"

    def __init__(self, draft, dtype: torch.dtype | None = None):
        """``dtype``: draft in it (a cast copy; the caller's draft is left as it is); None: the draft's."""
        if dtype is not None and next(draft.parameters()).dtype != dtype:
            inv_freq = draft.rotary.inv_freq
            draft = copy.deepcopy(draft).to(dtype)
            # RoPE's frequencies stay as they were: in bf16 (8 mantissa bits) a position past a few
            # hundred rotates by a visibly wrong angle, and the block would read the context misplaced
            draft.rotary.inv_freq = inv_freq.clone()
        self.draft = draft
        cfg = draft.config
        self.layer_ids = tuple(cfg.target_layer_ids)  # the hidden_states[j] streams the verifier hands over
        self.block_size = int(cfg.block_size)
        self.max_depth = self.block_size - 1  # drafted tokens a block holds
        self.rows = self.max_depth  # block rows whose logits a cycle computes (``fit_depth``)
        self.vocab = cfg.vocab_size
        self.token_ids = None  # log q columns are the target's vocabulary (the draft shares its head)
        self.begin(None)

    def fit_depth(self, depth: int) -> int:
        """The drafting depth a run of ``depth`` gets (at most the block's B - 1 tokens); only those
        rows' logits are computed: the head over the target's vocabulary is most of a block's cost."""
        self.rows = max(1, min(int(depth), self.max_depth))
        return self.rows

    def begin(self, input_ids=None):
        from ..model.dflash import DFlashCache

        self.caches = [DFlashCache() for _ in self.draft.layers]
        self.verified = 0  # positions whose features are in the caches
        self.logq = None  # [rows, V]: row i is block row i + 1

    def observe(self, next_tokens, hidden_states):
        """Append the committed positions' features (``hidden_states[j]`` [1, n, Ht]) and draft the
        block after the last of ``next_tokens`` (the token following each position; the last one is
        the root): log q [V] of the root's children (block row 1)."""
        aux = torch.cat([hidden_states[j] for j in self.layer_ids], dim=-1)
        n = next_tokens.shape[-1]
        dev = aux.device
        new_pos = torch.arange(self.verified, self.verified + n, device=dev)[None]
        self.verified += n
        self.logq = self.block_logq(aux, new_pos, next_tokens.view(n)[-1:].to(dev))
        return self.logq[0]

    @torch.no_grad()
    def block_logq(self, aux_new: torch.Tensor, new_pos: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """log q [rows, V] of block rows 1..rows after ``anchor`` [1], the new context rows appended
        first: ``DFlashDraft.draft_block``'s rows, with the head applied to the rows drafted only."""
        d = self.draft
        x = d.block_embeddings(anchor.view(1)).to(d.fc.weight.dtype)  # [1, B, H]
        pos = torch.arange(self.verified, self.verified + self.block_size, device=x.device)[None]
        x = d.run_layers(x, d.context(aux_new), new_pos, pos, None, self.caches)
        logits = d.logits(x[0, 1:1 + self.rows])
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32)

    def expand(self, tree, nodes):
        """log q [m, V] of the children of ``nodes``: block row d + 1 for a node at depth d."""
        depths = [tree.depths[i] for i in nodes]
        if max(depths) >= self.logq.shape[0]:
            raise ValueError(f"a DFlash block drafts {self.logq.shape[0]} tokens; the tree asks for depth "
                             f"{max(depths) + 1} (fit_depth sets the depth a run may ask for)")
        return self.logq[depths]

    def rollback(self):
        pass  # block rows never enter the caches: nothing drafted to forget


def is_dflash(draft) -> bool:
    """Whether ``draft`` is a DFlash draft (its config says so)."""
    return getattr(getattr(draft, "config", None), "draft_type", None) == "dflash"
