"""Draft trees: building one from a drafter (EAGLE-2 dynamic tree, chain) and its verify mask.

A tree's node 0 is the root: the last accepted token, which the target has not seen yet.
Every other node is a drafted token; nodes are stored in topological order (a parent always
comes before its children), so ``tokens`` can be fed to the target as one sequence.

Two ways to grow a tree from the drafter's log-probabilities log q:

* greedy verification (temperature 0), EAGLE-2: each level, the ``top_k`` frontier nodes
  with the best cumulative log q are expanded (one drafter call per level) into their
  ``top_k`` most likely children; after ``depth`` levels all candidates are reranked by
  cumulative log q and the best ``total_tokens`` are kept. Because a child's cumulative score
  never exceeds its parent's, any prefix of that ranking is a valid (ancestor-closed) tree.
* sampling (temperature > 0): each node's children are drawn from q WITHOUT replacement
  (Gumbel-top-k), and how many children a node gets is fixed *before* they are drawn (from
  its own score and the level's budget). This is what makes multi-candidate rejection
  sampling exact: a candidate may never be kept or dropped because of its own value, so the
  EAGLE-2 rerank (which keeps nodes by their values) is not used here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Tree:
    tokens: list[int]
    parents: list[int]  # -1 for the root
    depths: list[int]
    scores: list[float]  # cumulative draft log q (0 for the root)
    children: list[list[int]] = field(default_factory=list)  # in proposal order
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> q its children were drawn from
    ranks: list[int] = field(default_factory=list)  # EAGLE-2 rank of each node (for --tree auto)
    rank_depths: list[int] = field(default_factory=list)  # depth of every candidate, in rank order

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 0)
        self.scores.append(float(score))
        self.children.append([])
        if parent >= 0:
            self.children[parent].append(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def subtree(self, keep: list[int]) -> "Tree":
        """The tree restricted to ``keep`` (ancestor-closed, root included), in topological order."""
        keep = sorted(keep)  # candidates are created level by level: index order is topological
        new = {old: i for i, old in enumerate(keep)}
        out = new_tree(self.tokens[0])
        for old in keep[1:]:
            out.add(self.tokens[old], new[self.parents[old]], self.scores[old])
        out.q = {new[k]: v for k, v in self.q.items() if k in new}
        out.ranks = [self.ranks[old] for old in keep] if self.ranks else []
        out.rank_depths = self.rank_depths
        return out

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """bool [n, n]: node i may attend to node j iff j is i or one of its ancestors."""
        n = len(self)
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            anc[i] |= anc[self.parents[i]]
        return anc.to(device)


def new_tree(root_token: int) -> Tree:
    return Tree(tokens=[int(root_token)], parents=[-1], depths=[0], scores=[0.0], children=[[]])


def verify_mask(tree: Tree, past: int, device=None) -> torch.Tensor:
    """The 4D bool "may attend" mask [1, 1, n, past + n] for one target forward over the tree."""
    anc = tree.ancestor_mask(device)
    prefix = torch.ones(len(tree), past, dtype=torch.bool, device=device)
    return torch.cat([prefix, anc], dim=1)[None, None]


def token_ids(drafter) -> torch.Tensor | None:
    """The target ids of the drafter's log-q columns (None: its columns are the target vocabulary)."""
    return getattr(drafter, "token_ids", None)


def target_logq(drafter, logq: torch.Tensor) -> torch.Tensor:
    """``logq`` [n, C] over the drafter's columns spread over the target vocabulary (-inf elsewhere):
    rejection sampling compares q with the target's p token by token."""
    ids = token_ids(drafter)
    if ids is None:
        return logq
    out = logq.new_full((logq.shape[0], drafter.vocab), float("-inf"))
    out[:, ids] = logq
    return out


def build_greedy_tree(drafter, root_token: int, root_logq: torch.Tensor, total_tokens: int, depth: int,
                      top_k: int) -> Tree:
    """EAGLE-2: expand the top_k best nodes per level for ``depth`` levels, keep the best total_tokens."""
    cand = new_tree(root_token)
    frontier, logq = [0], root_logq[None]
    ids = token_ids(drafter)
    for level in range(1, depth + 1):
        if level > 1:
            logq = drafter.expand(cand, frontier)
        logq = logq.float()
        # a chain's one child: the row maximum (6 us for 8,192 columns against top-k's 15)
        vals, toks = logq.max(-1, keepdim=True) if top_k == 1 else logq.topk(min(top_k, logq.shape[-1]), dim=-1)
        if ids is not None:
            toks = ids.take(toks)
        new = []
        for parent, row_vals, row_toks in zip(frontier, vals.tolist(), toks.tolist()):  # two host copies a level
            for v, t in zip(row_vals, row_toks):
                if v > -math.inf:
                    new.append(cand.add(t, parent, cand.scores[parent] + v))
        if not new or level == depth:
            break
        new.sort(key=lambda i: -cand.scores[i])
        frontier = new[:top_k]
    # Rerank; ties go to the shallower node so every prefix of the ranking is ancestor-closed.
    order = sorted(range(1, len(cand)), key=lambda i: (-cand.scores[i], cand.depths[i]))
    cand.ranks = [0] * len(cand)
    cand.rank_depths = [cand.depths[i] for i in order]
    for r, i in enumerate(order):
        cand.ranks[i] = r + 1
    if total_tokens >= len(order):  # every candidate kept (a chain): the tree is already topological
        return cand
    return cand.subtree([0] + order[:total_tokens])


def gumbel_top(logits: torch.Tensor, m: int, gen: torch.Generator) -> list[int]:
    """m draws without replacement from softmax(logits), in draw order (Gumbel-top-k)."""
    u = torch.rand(logits.shape, generator=gen, device=logits.device).clamp_(1e-20, 1.0)
    keys = logits - torch.log(-torch.log(u))
    m = min(m, int(torch.isfinite(logits).sum()))
    return keys.topk(m).indices.tolist() if m > 0 else []


def level_allocation(scores: list[float], budget: int, top_k: int) -> list[int]:
    """Children per frontier node: proportional to path probability, at most top_k each."""
    if budget <= 0 or not scores:
        return [0] * len(scores)
    w = torch.tensor(scores, dtype=torch.float64).softmax(0)
    n = [min(top_k, int(x)) for x in (w * budget).floor().tolist()]
    left = budget - sum(n)
    for i in range(len(n)):  # hand out the rest in rank order
        add = min(top_k - n[i], left)
        n[i] += add
        left -= add
    return n


def build_sampled_tree(drafter, root_token: int, root_logq: torch.Tensor, total_tokens: int, depth: int,
                       top_k: int, temperature: float, gen: torch.Generator) -> Tree:
    """A tree for rejection sampling: children drawn from q without replacement, counts fixed first."""
    tree = new_tree(root_token)
    frontier, logq = [0], target_logq(drafter, root_logq[None])
    used = 0
    for level in range(1, depth + 1):
        if level > 1:
            logq = target_logq(drafter, drafter.expand(tree, frontier))
        budget = math.ceil((total_tokens - used) / (depth - level + 1))
        counts = level_allocation([tree.scores[f] for f in frontier], budget, top_k)
        new = []
        for row, (parent, m) in enumerate(zip(frontier, counts)):
            if m == 0:
                continue
            lq = torch.log_softmax(logq[row].float() / temperature, dim=-1)
            tree.q[parent] = lq.exp()
            for t in gumbel_top(lq, m, gen):
                new.append(tree.add(t, parent, tree.scores[parent] + float(lq[t])))
        used += len(new)
        if not new or used >= total_tokens:
            break
        new.sort(key=lambda i: -tree.scores[i])
        frontier = new[:top_k]
    return tree
