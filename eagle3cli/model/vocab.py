"""The draft vocabulary (docs/design.md §4): the most frequent target tokens of the training data.

The draft predicts over a subset of the target vocabulary: the ``N`` tokens that occur most
often among the loss-masked (assistant) tokens, sorted by target id, plus the tokens that end
a turn (EOS, end-of-turn), which must always be draftable or drafts could never stop.
``Eagle3Draft.set_vocab`` turns the sorted ids into the engines' ``d2t`` offsets and ``t2d``
mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

DEFAULT_SIZE = 32000
DEFAULT_COVERAGE = 0.99


@dataclass
class DraftVocab:
    ids: torch.Tensor  # int64 [N], sorted target ids
    coverage: float  # share of the masked training tokens that fall inside the vocab

    @property
    def size(self) -> int:
        return int(self.ids.numel())


def parse_size(value) -> int | str:
    """``--draft-vocab-size``: a positive integer or ``auto``."""
    if value is None:
        return DEFAULT_SIZE
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"--draft-vocab-size must be a positive integer or 'auto', got {value!r}") from None
    if int(value) <= 0:
        raise ValueError(f"--draft-vocab-size must be positive, got {value}")
    return int(value)


def frequency_order(counts: torch.Tensor) -> torch.Tensor:
    """Target ids by descending count; ties broken by ascending id (deterministic)."""
    # A stable sort of the negated counts keeps equal counts in id order.
    return torch.sort(-counts.long(), stable=True).indices


def size_for_coverage(counts: torch.Tensor, coverage: float) -> int:
    """The smallest N whose top-N tokens cover ``coverage`` of all counted tokens."""
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"--vocab-coverage must lie in (0, 1], got {coverage}")
    total = int(counts.sum())
    if total == 0:
        raise ValueError("the feature store counts no loss-masked tokens: cannot size the draft vocab")
    cum = counts.long()[frequency_order(counts)].cumsum(0)
    # First index whose cumulative count reaches the share; +1 turns it into a size.
    need = torch.tensor([round(coverage * total, 6)], dtype=torch.float64)
    return int(torch.searchsorted(cum.double(), need).item()) + 1


def build_vocab(counts: torch.Tensor, size: int | str = DEFAULT_SIZE, coverage: float = DEFAULT_COVERAGE,
                end_token_ids: Iterable[int] = ()) -> DraftVocab:
    """Pick the draft vocabulary from token counts (int64 [target_vocab]).

    ``size``: an integer (capped at the target vocab; the end tokens take the place of the
    least frequent picks, so the size is exact) or ``"auto"`` (the smallest size covering
    ``coverage`` of the masked tokens, plus any end token not already in it).
    """
    vocab_size = counts.numel()
    end = sorted({int(t) for t in end_token_ids if t is not None})
    bad = [t for t in end if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"end token ids {bad} lie outside the target vocab (size {vocab_size})")
    size = parse_size(size)
    order = frequency_order(counts)
    if size == "auto":
        n = size_for_coverage(counts, coverage)
        chosen = set(order[:n].tolist()) | set(end)
    else:
        n = min(size, vocab_size)
        if n < len(end):
            raise ValueError(f"--draft-vocab-size {n} cannot hold the {len(end)} end-of-turn tokens {end}")
        chosen = set(end)
        for t in order.tolist():  # most frequent first until the vocab is full
            if len(chosen) >= n:
                break
            chosen.add(t)
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    total = int(counts.sum())
    covered = int(counts.long()[ids].sum())
    return DraftVocab(ids=ids, coverage=covered / total if total else 0.0)
