"""Batching for the trainer: the held-out split, token-budget batches, per-rank groups, collation.

Everything here is a function of (seed, epoch) and the sample lengths, so every process builds
the same batch list and a resumed run needs only (epoch, step-in-epoch).
"""

from __future__ import annotations

import torch

from ..data.features import FeatureStore


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) sample indices: a seeded random held-out share."""
    n_val = int(round(n * val_fraction)) if n > 1 else 0
    if val_fraction > 0 and n_val == 0 and n >= 10:
        n_val = 1
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def make_batches(indices: list[int], lengths: list[int], max_tokens: int, seed: int, epoch: int,
                 regroup: bool = False) -> list[list[int]]:
    """Length-bucketed batches of at most ``max_tokens`` padded tokens, in a seeded order.

    Sorting by length keeps padding small. By default the grouping is the same every epoch and
    only the batch order is shuffled. With ``regroup`` the conversations are drawn into new
    length-sorted groups each epoch, within random mega-batches (transformers' group_by_length
    order), so no two conversations always share a step. Either way it is a function of
    (seed, epoch) alone, so a resumed run rebuilds it.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    if regroup:
        order = _regrouped(indices, lengths, max_tokens, g)
    else:
        order = sorted(indices, key=lambda i: (lengths[i], i))
    batches = _cut(order, lengths, max_tokens)
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def _regrouped(indices: list[int], lengths: list[int], max_tokens: int, g: torch.Generator) -> list[int]:
    """``indices`` in random mega-batches, each sorted by length (longest first)."""
    from transformers.trainer_pt_utils import get_length_grouped_indices

    sub = [lengths[i] for i in indices]
    per_batch = max(1, max_tokens // max(1, sorted(sub)[len(sub) // 2]))  # conversations of median length
    return [indices[j] for j in get_length_grouped_indices(sub, per_batch, generator=g)]


def _cut(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of ``order`` whose padded size (longest x count) fits ``max_tokens``."""
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
    return batches


def planned_steps(groups_of_epoch, epochs: int, max_steps: int) -> int:
    """The optimizer steps of ``epochs`` regrouped epochs (each may cut a step more or fewer than
    the first, and the LR schedule must span the steps they make), counted no further than
    ``max_steps`` (0: no limit), so a steps-limited run with a huge --epochs costs nothing here."""
    total, cap = 0, max_steps or float("inf")
    for epoch in range(epochs):
        if total >= cap:
            break
        total += len(groups_of_epoch(epoch))
    return total


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
