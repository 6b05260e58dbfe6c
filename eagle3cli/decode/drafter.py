"""The drafter's side of speculative decoding: the protocol a drafter implements (tests plug in an
oracle) and ``EagleDrafter``, the EAGLE-3 draft with its own KV cache of the verified prefix and
the drafted nodes, on the draft's fast CPU path where one applies (``fast_draft``)."""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import torch

from .tree import Tree


class Drafter(Protocol):
    """Proposes tokens. ``observe`` and ``expand`` return log-probabilities [C] / [n, C] over the
    drafter's C columns; an optional ``token_ids`` attribute ([C] target ids) names the token of
    each column, absent or None when the columns are the target's vocabulary."""

    def begin(self, input_ids: torch.Tensor) -> None: ...
    def observe(self, next_tokens: torch.Tensor, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor: ...
    def expand(self, tree: Tree, nodes: list[int]) -> torch.Tensor: ...
    def rollback(self) -> None: ...


class EagleDrafter:
    """Wraps ``Eagle3Draft``: its own KV cache of the verified prefix plus drafted nodes.

    Cache entry t pairs the target's fused features g_t with token t+1, at position t
    (docs/design.md §7). A drafted node at depth d pairs its token with its parent's output stream
    a, at position (prefix - 1) + d, and attends to the verified prefix and its ancestors.

    Steps run through ``fast_draft.FastDraft`` (fused matmuls over a static cache: about 60 tensor
    ops a step against the module path's ~270), in ``dtype`` if given; ``lean=False`` runs the
    module's own ``step`` over a ``DecodeCache``, the reference the lean path is tested against.
    ``weights`` "int8" / "int4" stores the lean step's matmul weights as integers (``weight_quant``).
    """

    def __init__(self, draft, lean: bool = True, dtype: torch.dtype | None = None, weights: str = "full"):
        from ..model.draft import DecodeCache
        from .fast_draft import FastDraft

        if not lean and weights != "full":
            raise ValueError("integer draft weights need the lean step (lean=True)")
        self.draft = draft
        self.lean = FastDraft(draft, dtype=dtype, weights=weights) if lean else None
        self.layer_ids = tuple(draft.config.aux_layer_ids)
        self.vocab = draft.config.vocab_size
        # log q stays over the draft vocabulary (8k columns, not the target's 49k): the tree's top-k
        # reads it there and maps the winners through token_ids
        self.token_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))
        self._kvcache = DecodeCache
        self.begin(None)

    def pack(self, rows: int, prefix: int = 64, repeats: int = 5, rounds: int = 2) -> dict | None:
        """Run the draft's ``rows``-row steps (a tree level of top_k nodes) through a prepacked GEMM
        when that measures faster here than ``F.linear``: MKL's packed GEMM is specialised per row
        count and pays at some counts only (4 rows: 5.2 against 6.6 ms a step; 2 or 3: slower), so
        the choice is timed, as ``fast_tuning.tune_packing`` times the target's. MKL's copy serves
        exactly ``rows`` rows, other counts stay on ``F.linear``; oneDNN's serves every count; the
        native kernel (fp32) up to its row limit, oneDNN's copy beyond it. Returns what was
        measured (None: nothing to choose here, or the module path)."""
        from .packing import NATIVE, ONEDNN

        kinds = self.lean.packable(rows) if self.lean is not None else []
        if not kinds:
            return None
        keys = {"none": (), **{k: {ONEDNN: (ONEDNN,), NATIVE: (NATIVE, ONEDNN)}.get(k, (rows,)) for k in kinds}}
        best = {name: float("inf") for name in keys}
        for _ in range(rounds):  # interleaved, fastest median kept: other load only ever adds time
            for name, key in keys.items():
                self.lean.repack(key)
                best[name] = min(best[name], self._time_step(rows, prefix, repeats))
        choice = min(best, key=lambda name: (best[name], name != "none"))
        self.lean.repack(keys[choice])
        self.begin(None)
        return {"rows": rows, "uses": choice, "ms": {k: round(1000 * v, 3) for k, v in best.items()}}

    @torch.inference_mode()
    def _time_step(self, rows: int, prefix: int, repeats: int) -> float:
        """Median seconds of one ``rows``-row lean step plus head behind ``prefix`` cached rows."""
        f, dev = self.lean, self.lean.embed.device
        gen = torch.Generator().manual_seed(0)
        g = torch.randn(prefix + rows, f.embed.shape[1], generator=gen).to(dev, f.dtype)
        ids = torch.randint(0, f.embed.shape[0], (prefix + rows,), generator=gen).to(dev)
        pos = torch.arange(prefix + rows, device=dev)
        f.reset()
        f.step(ids[:prefix], g[:prefix], pos[:prefix])
        runs = []
        for _ in range(repeats + 1):  # the first call pays page faults
            f.crop(prefix)
            t0 = time.perf_counter()
            f.logits(f.step(ids[prefix:], g[prefix:], pos[prefix:]))
            runs.append(time.perf_counter() - t0)
        f.reset()
        return sorted(runs[1:])[repeats // 2]

    def begin(self, input_ids=None):
        if self.lean is not None:
            self.lean.reset()
            self.cache = self.lean
        else:
            self.cache = self._kvcache()
        self.verified = 0  # cache entries of verified pairs
        self.root_a = None
        self.node_a: dict[int, torch.Tensor] = {}
        self.node_slot: dict[int, int] = {}

    def _logq(self, a: torch.Tensor) -> torch.Tensor:
        """log q [T, C] of output streams ``a`` [T, H]."""
        logits = self.lean.logits(a) if self.lean is not None else self.draft.logits(a)
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # cast inside: one op, the same values

    def _step(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, mask=None,
              last_only: bool = False) -> torch.Tensor:
        """ids [T], hidden [T, H], pos [T], mask [T, len + T] or None (causal) -> output streams [T, H]
        (``last_only``: the last row's [1, H]; the lean step computes only that one)."""
        if self.lean is not None:
            return self.lean.step(ids, hidden, pos, mask, last_only=last_only)
        a = self.draft.step(ids[None], hidden[None], pos[None], self.cache,
                            attn_mask=None if mask is None else mask[None, None])[0]
        return a[-1:] if last_only else a

    def observe(self, next_tokens, hidden_states):
        self.rollback()
        aux = torch.cat([hidden_states[j] for j in self.layer_ids], dim=-1)[0]
        g = self.lean.fuse(aux) if self.lean is not None else self.draft.fuse(aux)
        n = next_tokens.shape[-1]
        pos = torch.arange(self.verified, self.verified + n, device=g.device)
        # only the last verified row's output is read (the root's children); the others are cached
        a = self._step(next_tokens.view(n).to(g.device), g, pos, last_only=True)
        self.verified += n
        self.root_a = a[-1]
        return self._logq(a)[0]

    def expand(self, tree, nodes):
        dev = self.root_a.device
        past = len(self.cache)
        # besides the verified prefix, each node sees itself and its drafted ancestors' cache slots
        slots = [self._ancestor_slots(tree, i) for i in nodes]
        tokens = torch.tensor([tree.tokens[i] for i in nodes], device=dev)
        pos = torch.tensor([self.verified - 1 + tree.depths[i] for i in nodes], device=dev)
        hidden = torch.stack([self.root_a if tree.parents[i] == 0 else self.node_a[tree.parents[i]] for i in nodes])
        a = self._step(tokens, hidden, pos, self._mask(slots, past))
        for row, i in enumerate(nodes):
            self.node_a[i] = a[row]
            self.node_slot[i] = past + row
        return self._logq(a)

    def _ancestor_slots(self, tree, i) -> list[int]:
        """Cache slots of node ``i``'s drafted ancestors (the root's own entry is the last verified pair)."""
        out, p = [], tree.parents[i]
        while p > 0:
            out.append(self.node_slot[p])
            p = tree.parents[p]
        return out

    def _mask(self, slots: list[list[int]], past: int) -> torch.Tensor | None:
        """The attention mask of nodes whose drafted ancestors sit in ``slots``; None (no mask to build,
        a few small ops less per level) where one node's ancestors are every drafted entry, as in a
        chain: it sees the whole cache."""
        if len(slots) == 1 and len(slots[0]) == past - self.verified:
            return None
        return self._tree_mask(slots, past)

    def _tree_mask(self, slots: list[list[int]], past: int) -> torch.Tensor:
        """bool [m, past + m] "may attend": the verified prefix, each node itself and its ``slots``."""
        m, drafted = len(slots), past - self.verified
        own = [[False] * (drafted + m) for _ in slots]  # the drafted entries' columns, this level's included
        for r, s in enumerate(slots):
            for c in (past + r, *s):
                own[r][c - self.verified] = True
        dev = self.root_a.device
        return torch.cat((torch.ones(m, self.verified, dtype=torch.bool, device=dev),
                          torch.tensor(own, dtype=torch.bool, device=dev)), 1)

    def rollback(self):
        self.cache.crop(self.verified)
        self.node_a.clear()
        self.node_slot.clear()


def as_drafter(draft, dtype: torch.dtype | None = None, weights: str = "full") -> Drafter:
    """``draft`` itself if it is a drafter, else the drafter of its type: a ``DFlashDrafter`` for a
    DFlash draft (its config's ``draft_type``), an ``EagleDrafter`` for an EAGLE-3 one; computing in
    ``dtype`` (None: the draft's), an EAGLE-3 draft's matmul weights stored as ``weights`` (full,
    int8, int4; a DFlash draft's stay full)."""
    from .dflash_drafter import DFlashDrafter, is_dflash

    if hasattr(draft, "observe"):
        return draft
    if is_dflash(draft):
        return DFlashDrafter(draft, dtype=dtype)
    return EagleDrafter(draft, dtype=dtype, weights=weights)
