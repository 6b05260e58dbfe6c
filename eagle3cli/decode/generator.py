"""Lossless speculative decoding with an EAGLE-3 draft, for any Hugging Face causal LM.

One cycle (gpt-fast style, everything below is the whole algorithm):

    root  = the last accepted token (the target has not seen it yet)
    tree  = draft a tree (EAGLE-2 dynamic tree) or a chain below root         -> tree.py
    out   = ONE target forward over [root, tree nodes] with a tree attention mask
            and position ids = prefix length + node depth, on the target's DynamicCache
    path  = accepted nodes: greedy (temperature 0) or multi-candidate rejection sampling
    bonus = the target's own token after the last accepted node
    keep only [root, path] in the target cache (gather, no re-prefill; on the fast path nothing
    moves when they are the tree's first entries, as a chain's always are); feed the target's
    hidden states of [root, path] to the drafter; bonus becomes the next root.

Drafter protocol (the EAGLE-3 draft implements it here; tests plug in an oracle):

    begin(input_ids)                     start a new sequence from the prompt [1, L]
    observe(next_tokens, hidden_states)  verified positions just processed by the target:
                                         hidden_states[j] [1,n,Ht] and the token that follows
                                         each of them; returns log q [V] for the token after
                                         the last one (the root's children)
    expand(tree, nodes) -> log q [m, V]  children distributions of the given tree nodes
    rollback()                           forget everything drafted since the last observe

log q is always over the TARGET vocabulary (-inf outside the draft vocab).

Losslessness. Temperature 0: a node is accepted iff it is the target's argmax, so the output
is greedy decoding token for token. Temperature > 0: at each accepted node the children, drawn
from q without replacement, are tried in order: accept child x with probability
min(1, p(x)/q(x)); on rejection p <- norm(max(p - q, 0)) and x is removed from q; if all are
rejected the bonus is drawn from the final p. By induction each step outputs exactly p.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from ..core.errors import Eagle3Error
from ..core.hf_utils import eos_token_ids, text_config
from ..core.hf_utils import synchronize as _sync
from . import attention
from .tree import Tree, build_greedy_tree, build_sampled_tree, verify_mask


class Drafter(Protocol):
    """Proposes tokens. ``observe`` and ``expand`` return log-probabilities [C] / [n, C] over the
    drafter's C columns; an optional ``token_ids`` attribute ([C] target ids) names the token of
    each column, absent or None when the columns are the target's vocabulary."""

    def begin(self, input_ids: torch.Tensor) -> None: ...
    def observe(self, next_tokens: torch.Tensor, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor: ...
    def expand(self, tree: Tree, nodes: list[int]) -> torch.Tensor: ...
    def rollback(self) -> None: ...


class UnsupportedTarget(Eagle3Error, ValueError):
    """The target cannot be verified with a tree mask through its HF forward."""


class ContextTooLong(Eagle3Error, ValueError):
    """The prompt does not fit the target's context."""


# --------------------------------------------------------------------------------------
# The EAGLE-3 draft as a drafter
# --------------------------------------------------------------------------------------
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
        the choice is timed, as ``fast_target.tune_packing`` times the target's. MKL's copy serves
        exactly ``rows`` rows, other counts stay on ``F.linear``; oneDNN's serves every count.
        Returns what was measured (None: nothing to choose here, or the module path)."""
        from .fast_target import ONEDNN

        kinds = self.lean.packable(rows) if self.lean is not None else []
        if not kinds:
            return None
        keys = {"none": (), **{k: ((ONEDNN,) if k == ONEDNN else (rows,)) for k in kinds}}
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
    """``draft`` itself if it is a drafter, else an ``EagleDrafter`` computing in ``dtype`` (None: the
    draft's) with its matmul weights stored as ``weights`` (full, int8, int4)."""
    return draft if hasattr(draft, "observe") else EagleDrafter(draft, dtype=dtype, weights=weights)


# --------------------------------------------------------------------------------------
# Settings, results, checks
# --------------------------------------------------------------------------------------
@dataclass
class SpecSettings:
    mode: str = "tree"  # tree | chain
    total_tokens: int = 60  # tree: drafted nodes verified per cycle
    depth: int = 8  # tree: drafting levels
    top_k: int = 10  # tree: branching per expanded node
    steps: int = 3  # chain: drafted tokens per cycle
    temperature: float = 0.0
    top_p: float = 1.0
    sampling_top_k: int = 0  # 0 = off
    max_new_tokens: int = 512

    def shape(self) -> tuple[int, int, int]:
        """(total_tokens, depth, top_k) of the tree actually drafted."""
        if self.mode == "chain":
            return self.steps, self.steps, 1
        if self.mode != "tree":
            raise ValueError(f"mode must be 'tree' or 'chain', got {self.mode!r}")
        return self.total_tokens, self.depth, self.top_k


@dataclass
class SpecOutput:
    tokens: list[int]  # generated tokens (prompt excluded)
    prompt_len: int
    accept_lengths: list[int] = field(default_factory=list)  # per cycle: accepted drafts + bonus
    drafted: list[int] = field(default_factory=list)  # per cycle: depth of the drafted tree
    decode_tokens: int = 0  # tokens emitted by verification forwards (the first comes from prefill)
    forwards: int = 0  # target forwards in decoding (verifications)
    times: dict = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "bookkeeping": 0.0})
    stop_reason: str = "length"
    accepted_ranks: list[list[int]] = field(default_factory=list)  # per cycle: EAGLE-2 ranks of the path
    rank_depths: list[list[int]] = field(default_factory=list, repr=False)  # per cycle, for --tree auto
    cache: object = field(default=None, repr=False)  # the target's cache at the end (tests)
    path: str = "hf"  # which verifier ran: hf (the target's HF forward) or fast (fast_target)

    @property
    def tau(self) -> float:
        return self.decode_tokens / self.forwards if self.forwards else float("nan")


def check_supported(config, total_len: int | None = None):
    """Refuse, in one line, targets a tree verification through the HF forward cannot reproduce
    (docs/design.md §11): layers other than full, sliding-window or chunked attention (their state
    cannot be rolled back to the accepted path), attention implementations that ignore a 4-D mask, and
    Llama 4's query temperature past the positions where it still is 1 (it is taken from the row
    index, which is a tree node's position only along a chain). Windows and chunks are applied per
    layer by the verification masks (``attention``)."""
    cfg = text_config(config)
    name = getattr(cfg, "model_type", type(cfg).__name__)
    other = sorted({k for k in attention.layout(config).kinds if k not in attention.KINDS})
    if other:
        raise UnsupportedTarget(f"{name} has {', '.join(map(str, other))} layers: speculative decoding verifies "
                                "full, sliding-window and chunked attention only")
    impl = attention.attn_implementation(config)
    if impl is not None and impl not in attention.BOOL_MASK + attention.ADDITIVE_MASK:
        raise UnsupportedTarget(f"attention implementation {impl!r} ignores a tree mask: load the target with "
                                "attn_implementation='sdpa' or 'eager'")
    floor = getattr(cfg, "floor_scale", None)
    if getattr(cfg, "attn_temperature_tuning", False) and floor and total_len is not None and total_len >= floor:
        raise UnsupportedTarget(
            f"{name} scales its NoPE layers' queries by the row index from position {floor - 1} on and this "
            f"generation needs {total_len} positions: use shorter prompts or --max-new-tokens")


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target's sampling distribution: temperature, then top-k, then top-p (as HF applies them)."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = logits.sort(dim=-1)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False  # keep at least one
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits.softmax(-1)


def eos_ids(model, eos_token_id=None) -> set[int]:
    """The ids that stop generation: ``eos_token_id`` if given, else the generation config's, else the config's."""
    ids = eos_token_id
    if ids is None:
        gc = getattr(model, "generation_config", None)
        ids = getattr(gc, "eos_token_id", None) if gc is not None else None
        if ids is None:
            ids = getattr(text_config(model.config), "eos_token_id", None)
    return eos_token_ids(ids)


# --------------------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------------------
def accept_greedy(tree: Tree, logits: torch.Tensor, per_row: bool | None = None) -> tuple[list[int], int]:
    """Follow the target's argmax down the tree: (accepted nodes, bonus token). ``per_row``: reduce
    only the rows along the path, one at a time (None: on a CPU)."""
    # max(-1).indices is argmax (both documented to return the first maximal index; ties, NaN and
    # all -inf rows tested equal) at a fraction of its cost on a CPU: 17 bf16 rows of 49k logits
    # 0.34 ms against 1.6 on 2 AMX Xeon cores). On a CPU only the rows along the path are reduced
    # (a 16-node tree's acceptance: 0.21 ms a cycle against 0.68 for all 17 rows);
    # on an accelerator all rows at once, one host synchronisation instead of one per row.
    if per_row is None:
        per_row = logits.device.type == "cpu"
    if per_row:
        row = lambda i: row_argmax(logits[i])  # noqa: E731
    else:
        choice = logits.max(-1).indices.tolist()
        row = choice.__getitem__
    path, cur = [], 0
    while True:
        token = row(cur)
        nxt = next((c for c in tree.children[cur] if tree.tokens[c] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        cur = nxt


def row_argmax(row: torch.Tensor) -> int:
    """``int(row.argmax())`` of a 1-D row, the first maximal index (ties, NaN and -inf as argmax; tested),
    on a CPU found in two passes: the maximum of each block of the row, then the first block holding the
    largest. There one reduction of a 49k-token row tracks its index element by element (39 us for
    bf16; ``argmax`` itself 157), blocks of it take 24 (2 AMX Xeon cores). Plain
    decoding takes its tokens the same way, so the baseline is as fast as the speculative loop."""
    if row.device.type != "cpu":  # one reduction, one host synchronisation
        return int(row.argmax())
    n = row.shape[0]
    width = next((w for w in (1024, 512, 256, 128) if n % w == 0 and n >= 4 * w), None)
    if width is None:  # a small or odd vocabulary: one pass
        return int(row.max(-1).indices)
    values, at = row.view(-1, width).max(-1)
    block = int(values.max(-1).indices)
    return block * width + int(at[block])


def accept_sampling(tree: Tree, probs: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """Recursive multi-candidate rejection sampling; probs [n, V] is the target's p per node."""
    path, cur = [], 0
    while True:
        p = probs[cur]
        kids = tree.children[cur]
        q = tree.q[cur].clone() if kids else None
        nxt = None
        for c in kids:
            x = tree.tokens[c]
            # accept with probability min(1, p(x) / q(x)); q(x) > 0 because x was drawn from q
            if torch.rand((), generator=gen, device=p.device) * q[x] < p[x]:
                nxt = c
                break
            residual = (p - q).clamp_(min=0)
            s = residual.sum()
            p = residual / s if s > 0 else p  # s == 0 only if p == q, where rejection cannot happen
            q[x] = 0
            qs = q.sum()
            if qs <= 0:
                break
            q = q / qs
        if nxt is None:
            return path, int(torch.multinomial(p, 1, generator=gen))
        path.append(nxt)
        cur = nxt


def in_place(keep: list[int]) -> bool:
    """Whether the kept tree entries ``keep`` ([0] + accepted path) are the tree's first ones, so that
    they already sit where they belong: always for a chain, for a tree when the first branch won."""
    return keep == list(range(len(keep)))


def keep_cache(cache, past: int, keep: torch.Tensor):
    """Keep the prefix and the tree entries ``keep`` (indices into the tree) in every layer."""
    idx = torch.cat([torch.arange(past, device=keep.device), past + keep])
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        i = idx.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, i)
        layer.values = layer.values.index_select(-2, i)


def forward(target, input_ids, cache, **kw):
    return target(input_ids=input_ids, cache=cache, use_cache=True, output_hidden_states=True, return_dict=True, **kw)


# --------------------------------------------------------------------------------------
# Verifiers: the target's side of a cycle (prefill, verify a tree, keep the accepted path)
# --------------------------------------------------------------------------------------
class HFVerifier:
    """The target's own HF forward: any architecture whose layers attend fully, in a sliding window
    or in chunks, the reference path. Its DynamicCache keeps every position of every layer and each
    layer kind gets its own mask (``attention``): a layer that dropped entries past its window could
    not give back those a rejected branch displaced."""

    name = "hf"

    def __init__(self, target, layers=None):
        self.target, self.layers = target, layers
        self.cache = attention.keep_all_cache()
        self.layout = attention.layout(target.config)
        self.implementation = attention.attn_implementation(target.config)
        self.dtype = target.get_input_embeddings().weight.dtype

    def _hidden(self, out) -> dict:
        hs = out.hidden_states
        return {j: hs[j] for j in (range(len(hs)) if self.layers is None else self.layers)}

    def prefill(self, input_ids):
        """logits [V] after the prompt [1, L], and its hidden states {j: [1, L, H]}."""
        out = forward(self.target, input_ids, self.cache, logits_to_keep=1)
        return out.logits[0, -1], self._hidden(out)

    def verify(self, ids, positions, mask, past: int):
        """logits [n, V] and hidden states of n tree tokens [1, n] at ``positions`` [1, n], which may
        attend where ``mask`` [1, 1, n, past + n] allows and each layer's window or chunk lets them."""
        masks = attention.hf_mask(mask[0, 0], positions[0], past, self.layout, self.implementation, self.dtype)
        out = forward(self.target, ids, self.cache, attention_mask=masks, position_ids=positions)
        return out.logits[0], self._hidden(out)

    def keep(self, past: int, keep: list[int]):
        # gathered even when in place: the cache must drop the rest of the tree, and DynamicCache's
        # crop has changed its meaning across transformers releases
        keep_cache(self.cache, past, torch.tensor(keep, dtype=torch.long, device=self.target.device))


class FastVerifier:
    """fast_target.FastTarget: same model, static cache, packed matmuls (Llama-family and Gemma 3 targets)."""

    name = "fast"

    def __init__(self, fast, layers=None):
        self.fast = fast
        self.layers = tuple(range(len(fast.layers) + 1)) if layers is None else tuple(layers)
        self.cache = fast

    def prefill(self, input_ids):
        n = input_ids.shape[1]
        logits, hidden = self.fast.forward(input_ids[0], torch.arange(n, device=input_ids.device), 0,
                                           hidden_layers=self.layers, logits="last")
        return logits[-1], hidden

    def verify(self, ids, positions, mask, past: int):
        return self.fast.forward(ids[0], positions[0], past, mask=mask[0, 0], hidden_layers=self.layers)

    def keep(self, past: int, keep: list[int]):
        if not in_place(keep):  # entries past the kept ones are simply overwritten by the next forward
            self.fast.keep(past, torch.tensor(keep, device=self.fast.embed.device))


def make_verifier(target, layers=None, fast=None):
    return FastVerifier(fast, layers) if fast is not None else HFVerifier(target, layers)


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
@torch.inference_mode()
def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    settings: SpecSettings | None = None,
    *,
    eos_token_id=None,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    seed: int | None = None,
    fast=None,
    **overrides,
) -> SpecOutput:
    """Generate from ``input_ids`` [1, L] with draft-and-verify; lossless w.r.t. the target.

    ``draft`` is an ``Eagle3Draft`` or any object implementing the Drafter protocol. ``fast``
    (a ``fast_target.FastTarget`` of this target) verifies through the fast path; None uses
    the target's HF forward.
    Keyword ``overrides`` set SpecSettings fields (mode=, total_tokens=, temperature=, ...).
    """
    s = settings or SpecSettings()
    if overrides:
        s = SpecSettings(**{**s.__dict__, **overrides})
    total, depth, top_k = s.shape()
    sampling = s.temperature > 0
    drafter = as_drafter(draft)
    dev = input_ids.device
    gen = torch.Generator(device=dev)
    if seed is None:
        gen.seed()  # fresh entropy for this generator only; the global RNG is left alone
    else:
        gen.manual_seed(seed)
    L = input_ids.shape[1]
    max_pos = getattr(text_config(target.config), "max_position_embeddings", None) or 10**9
    if L >= max_pos:
        raise ContextTooLong(f"prompt of {L} tokens does not fit the target's context of {max_pos}")
    check_supported(target.config, min(L + s.max_new_tokens + max(total, depth) + 1, max_pos))
    stops = eos_ids(target, eos_token_id)
    res = SpecOutput(tokens=[], prompt_len=L)
    times = res.times

    def pick(logits):
        if not sampling:
            return int(logits.argmax(-1))
        return int(torch.multinomial(target_probs(logits, s.temperature, s.sampling_top_k, s.top_p), 1, generator=gen))

    def finished() -> bool:
        """Apply max_new_tokens / EOS / stop strings to res.tokens (truncating); True if done."""
        # The cap first: one cycle can accept tokens past it, and an EOS there must not count.
        capped = len(res.tokens) >= s.max_new_tokens
        del res.tokens[s.max_new_tokens:]
        for i, t in enumerate(res.tokens):
            if t in stops:
                del res.tokens[i + 1:]
                res.stop_reason = "eos"
                return True
        if stop_strings and tokenizer is not None and _cut_at_stop_string(res, tokenizer, stop_strings):
            return True
        if capped:
            res.stop_reason = "length"
        return capped

    # Prefill: the prompt through the target; its hidden states seed the drafter.
    t0 = time.perf_counter()
    verifier = make_verifier(target, getattr(drafter, "layer_ids", None), fast)
    res.cache, res.path = verifier.cache, verifier.name
    last_logits, hidden = verifier.prefill(input_ids)
    root = pick(last_logits)
    res.tokens.append(root)
    _sync(dev)
    times["prefill"] += time.perf_counter() - t0
    if finished():
        return res
    t0 = time.perf_counter()
    drafter.begin(input_ids)
    logq = drafter.observe(torch.cat([input_ids[0, 1:], input_ids.new_tensor([root])]), hidden)
    past = L
    _sync(dev)
    times["draft"] += time.perf_counter() - t0

    while True:
        # 1. Draft a tree below the root (never past the context).
        t0 = time.perf_counter()
        d = min(depth, max_pos - past - 1)
        if d < 1:
            res.stop_reason = "context"
            break
        if sampling:
            tree = build_sampled_tree(drafter, root, logq, min(total, d * top_k), d, top_k, s.temperature, gen)
        else:
            tree = build_greedy_tree(drafter, root, logq, total, d, top_k)
        _sync(dev)
        t1 = time.perf_counter()
        # 2. Verify the whole tree in one target forward.
        ids = torch.tensor(tree.tokens, device=dev)[None]
        pos = (past + torch.tensor(tree.depths, device=dev))[None]
        logits, hidden = verifier.verify(ids, pos, verify_mask(tree, past, dev), past)
        _sync(dev)
        t2 = time.perf_counter()
        # 3. Accept, keep the accepted path in the target cache.
        if sampling:
            path, bonus = accept_sampling(tree, target_probs(logits, s.temperature, s.sampling_top_k, s.top_p), gen)
        else:
            path, bonus = accept_greedy(tree, logits)
        keep = [0] + path
        verifier.keep(past, keep)
        new = [tree.tokens[i] for i in path] + [bonus]
        res.forwards += 1
        res.accept_lengths.append(len(new))
        res.drafted.append(max(tree.depths))
        if tree.ranks:
            res.accepted_ranks.append([tree.ranks[i] for i in path])
            res.rank_depths.append(tree.rank_depths)
        before = len(res.tokens)
        res.tokens.extend(new)
        done = finished()
        res.decode_tokens += len(res.tokens) - before
        past += len(keep)
        root = bonus
        t3 = time.perf_counter()
        times["draft"] += t1 - t0
        times["verify"] += t2 - t1
        times["bookkeeping"] += t3 - t2
        if done:
            break
        # 4. The drafter sees the target's features of the accepted positions.
        t0 = time.perf_counter()
        rows = slice(0, len(keep)) if in_place(keep) else torch.tensor(keep, device=dev)
        logq = drafter.observe(torch.tensor(new, device=dev), {j: h[:, rows] for j, h in hidden.items()})
        _sync(dev)
        times["draft"] += time.perf_counter() - t0
    drafter.rollback()
    return res


def _cut_at_stop_string(res: SpecOutput, tokenizer, stop_strings) -> bool:
    """Truncate right after the first token that completes a stop string (as HF generate does)."""
    text = tokenizer.decode(res.tokens)
    if not any(st in text for st in stop_strings):
        return False
    for k in range(1, len(res.tokens) + 1):
        if any(st in tokenizer.decode(res.tokens[:k]) for st in stop_strings):
            del res.tokens[k:]
            res.stop_reason = "stop_string"
            return True
    return False


@torch.inference_mode()
def greedy_generate(target, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None, fast=None) -> list[int]:
    """Plain greedy decoding, one token per forward (the reference for the lossless tests).

    With ``fast`` (a FastTarget of this target) the same loop runs on the fast path: the
    honest plain baseline for a speculative run that verifies through it.
    """
    from transformers import DynamicCache

    stops = eos_ids(target, eos_token_id)
    if fast is not None:
        return _fast_greedy(fast, input_ids, max_new_tokens, stops)
    cache = DynamicCache(config=target.config)
    out = target(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    toks = []
    while True:
        t = int(out.logits[0, -1].argmax())
        toks.append(t)
        if t in stops or len(toks) >= max_new_tokens:
            return toks
        out = target(input_ids=input_ids.new_tensor([[t]]), cache=cache, use_cache=True)


def _fast_greedy(fast, input_ids, max_new_tokens: int, stops: set[int]) -> list[int]:
    n = input_ids.shape[1]
    logits, _ = fast.forward(input_ids[0], torch.arange(n, device=input_ids.device), 0, logits="last")
    toks = []
    while True:
        t = row_argmax(logits[-1])
        toks.append(t)
        if t in stops or len(toks) >= max_new_tokens:
            return toks
        pos = n + len(toks) - 1
        logits, _ = fast.forward(input_ids.new_tensor([t]), input_ids.new_tensor([pos]), pos)


def n_alpha(outputs: Sequence[SpecOutput], max_n: int | None = None) -> list[float | None]:
    """docs/design.md §8: alpha_n = P(drafted token n+1 accepted | the first n were accepted), chain runs."""
    cycles = [(a - 1, k) for o in outputs for a, k in zip(o.accept_lengths, o.drafted)]
    if not cycles:
        return []
    top = max(k for _, k in cycles) if max_n is None else max_n
    out = []
    for n in range(top):
        tried = [acc for acc, k in cycles if k > n and acc >= n]
        out.append(sum(acc > n for acc in tried) / len(tried) if tried else None)
    return out
