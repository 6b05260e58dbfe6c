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
    fit_depth(depth) -> depth            optional: the depth a drafter with a fixed block can draft

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
from typing import Sequence

import torch

from ..core.errors import Eagle3Error
from ..core.hf_utils import cache_kwargs, eos_token_ids, text_config
from ..core.hf_utils import synchronize as _sync
from . import attention
from .drafter import as_drafter
from .tree import Tree, build_greedy_tree, build_sampled_tree, verify_mask
from .verifiers import in_place, make_verifier


class UnsupportedTarget(Eagle3Error, ValueError):
    """The target cannot be verified with a tree mask through its HF forward."""


class ContextTooLong(Eagle3Error, ValueError):
    """The prompt does not fit the target's context."""


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


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------
@torch.inference_mode()
@attention.without_cudnn_attention
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
    run = _Generation(target, draft, input_ids, s, seed, eos_token_id, stop_strings, tokenizer)
    if run.prefill(input_ids, fast):
        return run.res
    while run.cycle():
        pass
    run.drafter.rollback()
    return run.res


class _Generation:
    """One ``speculative_generate`` call: its settings and random generator, the output so far, and
    where the target and the drafter stand (``past`` positions kept in the target's cache, ``root``
    the last accepted token, which the target has not seen yet, ``logq`` the root's children)."""

    def __init__(self, target, draft, input_ids, s: SpecSettings, seed, eos_token_id, stop_strings, tokenizer):
        self.target, self.s = target, s
        self.total, self.depth, self.top_k = s.shape()
        self.sampling = s.temperature > 0
        self.drafter = as_drafter(draft)
        fit = getattr(self.drafter, "fit_depth", None)
        if fit is not None:  # a block drafter (DFlash) drafts at most its block's tokens
            self.depth = fit(self.depth)
        self.dev = dev = input_ids.device
        self.gen = torch.Generator(device=dev)
        if seed is None:
            self.gen.seed()  # fresh entropy for this generator only; the global RNG is left alone
        else:
            self.gen.manual_seed(seed)
        L = input_ids.shape[1]
        self.max_pos = max_pos = getattr(text_config(target.config), "max_position_embeddings", None) or 10**9
        if L >= max_pos:
            raise ContextTooLong(f"prompt of {L} tokens does not fit the target's context of {max_pos}")
        check_supported(target.config, min(L + s.max_new_tokens + max(self.total, self.depth) + 1, max_pos))
        self.stops = eos_ids(target, eos_token_id)
        self.stop_strings, self.tokenizer = stop_strings, tokenizer
        self.res = SpecOutput(tokens=[], prompt_len=L)

    def pick(self, logits) -> int:
        s = self.s
        if not self.sampling:
            return int(logits.argmax(-1))
        return int(torch.multinomial(target_probs(logits, s.temperature, s.sampling_top_k, s.top_p), 1,
                                     generator=self.gen))

    def finished(self) -> bool:
        """Apply max_new_tokens / EOS / stop strings to res.tokens (truncating); True if done."""
        res, cap = self.res, self.s.max_new_tokens
        # The cap first: one cycle can accept tokens past it, and an EOS there must not count.
        capped = len(res.tokens) >= cap
        del res.tokens[cap:]
        for i, t in enumerate(res.tokens):
            if t in self.stops:
                del res.tokens[i + 1:]
                res.stop_reason = "eos"
                return True
        if self.stop_strings and self.tokenizer is not None and _cut_at_stop_string(res, self.tokenizer,
                                                                                     self.stop_strings):
            return True
        if capped:
            res.stop_reason = "length"
        return capped

    def prefill(self, input_ids, fast) -> bool:
        """The prompt through the target; its hidden states seed the drafter. True if the first token
        already ends the generation."""
        res, times, dev = self.res, self.res.times, self.dev
        t0 = time.perf_counter()
        self.verifier = make_verifier(self.target, getattr(self.drafter, "layer_ids", None), fast)
        res.cache, res.path = self.verifier.cache, self.verifier.name
        last_logits, hidden = self.verifier.prefill(input_ids)
        self.root = self.pick(last_logits)
        res.tokens.append(self.root)
        _sync(dev)
        times["prefill"] += time.perf_counter() - t0
        if self.finished():
            return True
        t0 = time.perf_counter()
        self.drafter.begin(input_ids)
        self.logq = self.drafter.observe(torch.cat([input_ids[0, 1:], input_ids.new_tensor([self.root])]), hidden)
        self.past = input_ids.shape[1]
        _sync(dev)
        times["draft"] += time.perf_counter() - t0
        return False

    def cycle(self) -> bool:
        """Draft, verify, accept, and let the drafter observe; False once the generation is done."""
        t0 = time.perf_counter()
        tree = self.draft()
        if tree is None:
            self.res.stop_reason = "context"
            return False
        _sync(self.dev)
        t1 = time.perf_counter()
        logits, hidden = self.verify(tree)
        _sync(self.dev)
        t2 = time.perf_counter()
        keep, new, done = self.accept(tree, logits)
        t3 = time.perf_counter()
        times = self.res.times
        times["draft"] += t1 - t0
        times["verify"] += t2 - t1
        times["bookkeeping"] += t3 - t2
        if done:
            return False
        self.observe(keep, new, hidden)
        return True

    def draft(self) -> Tree | None:
        """1. A tree below the root, never past the context (None: no room for one more level)."""
        d = min(self.depth, self.max_pos - self.past - 1)
        if d < 1:
            return None
        if self.sampling:
            return build_sampled_tree(self.drafter, self.root, self.logq, min(self.total, d * self.top_k), d,
                                      self.top_k, self.s.temperature, self.gen)
        return build_greedy_tree(self.drafter, self.root, self.logq, self.total, d, self.top_k)

    def verify(self, tree: Tree):
        """2. The whole tree in one target forward: (logits [n, V], hidden states)."""
        dev, past = self.dev, self.past
        ids = torch.tensor(tree.tokens, device=dev)[None]
        pos = (past + torch.tensor(tree.depths, device=dev))[None]
        return self.verifier.verify(ids, pos, verify_mask(tree, past, dev), past)

    def accept(self, tree: Tree, logits) -> tuple[list[int], list[int], bool]:
        """3. The accepted path and the bonus token; the path kept in the target's cache, the tokens in
        the output: (kept tree entries, new tokens, whether the generation is done)."""
        res, s = self.res, self.s
        if self.sampling:
            path, bonus = accept_sampling(tree, target_probs(logits, s.temperature, s.sampling_top_k, s.top_p),
                                          self.gen)
        else:
            path, bonus = accept_greedy(tree, logits)
        keep = [0] + path
        self.verifier.keep(self.past, keep)
        new = [tree.tokens[i] for i in path] + [bonus]
        res.forwards += 1
        res.accept_lengths.append(len(new))
        res.drafted.append(max(tree.depths))
        if tree.ranks:
            res.accepted_ranks.append([tree.ranks[i] for i in path])
            res.rank_depths.append(tree.rank_depths)
        before = len(res.tokens)
        res.tokens.extend(new)
        done = self.finished()
        res.decode_tokens += len(res.tokens) - before
        self.past += len(keep)
        self.root = bonus
        return keep, new, done

    def observe(self, keep: list[int], new: list[int], hidden: dict) -> None:
        """4. The drafter sees the target's features of the accepted positions."""
        t0 = time.perf_counter()
        rows = slice(0, len(keep)) if in_place(keep) else torch.tensor(keep, device=self.dev)
        self.logq = self.drafter.observe(torch.tensor(new, device=self.dev), {j: h[:, rows] for j, h in hidden.items()})
        _sync(self.dev)
        self.res.times["draft"] += time.perf_counter() - t0


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
@attention.without_cudnn_attention
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
    out = target(input_ids=input_ids, **cache_kwargs(target, cache), use_cache=True, logits_to_keep=1)
    toks = []
    while True:
        t = int(out.logits[0, -1].argmax())
        toks.append(t)
        if t in stops or len(toks) >= max_new_tokens:
            return toks
        out = target(input_ids=input_ids.new_tensor([[t]]), **cache_kwargs(target, cache), use_cache=True)


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
