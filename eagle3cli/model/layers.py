"""Which target layers feed the draft (docs/design.md §2).

Convention used everywhere in this package: ``j`` is the index of the residual stream
*entering* decoder layer j, i.e. ``hidden_states[j]`` of a Hugging Face forward with
``output_hidden_states=True`` (j = 0 is the embedding output). vLLM stores the same ids in
``eagle_aux_hidden_state_layer_ids``; SGLang and the reference EAGLE code count "output of
layer k" with k = j - 1 and add one when they load.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

from ..core.errors import OptionError
from ..core.hf_utils import text_config


def num_layers(config) -> int:
    cfg = text_config(config)
    n = getattr(cfg, "num_hidden_layers", None)
    if not n:
        raise OptionError(f"config of type {type(cfg).__name__} has no num_hidden_layers")
    return int(n)


def default_layer_ids(n_layers: int) -> tuple[int, int, int]:
    """(2, N//2, N-3): the streams vLLM, SGLang and the reference code capture by default."""
    ids = (2, n_layers // 2, n_layers - 3)
    if ids[0] < ids[1] < ids[2]:
        return ids
    # Toy models (N < 8) cannot use the engines' formula; spread over the stack instead.
    # Export always writes both layer-id keys, so engines still read these correctly.
    if n_layers < 3:
        raise OptionError(f"a target needs at least 3 decoder layers for EAGLE-3, this one has {n_layers}")
    return (1, max(2, n_layers // 2), n_layers - 1) if n_layers > 3 else (0, 1, 2)


@dataclass(frozen=True)
class LayerChoice:
    n_layers: int
    ids: tuple[int, ...]  # "input to decoder layer j" count (hidden_states[j])

    @property
    def output_ids(self) -> tuple[int, ...]:
        """The same streams in the "output of layer k" count (SGLang, reference EAGLE)."""
        return tuple(j - 1 for j in self.ids)

    @property
    def is_default(self) -> bool:
        return self.ids == default_layer_ids(self.n_layers)


def choose_layers(config, override: Sequence[int] | None = None, warn: bool = True) -> LayerChoice:
    n = num_layers(config)
    if override is None:
        return LayerChoice(n, default_layer_ids(n))
    ids = tuple(int(j) for j in override)
    if len(ids) != 3:
        raise OptionError(f"EAGLE-3 reads exactly three streams, got {len(ids)} layer ids: {ids}")
    if list(ids) != sorted(set(ids)):
        raise OptionError(f"layer ids must be distinct and ascending, got {ids}")
    if ids[0] < 0 or ids[-1] >= n:
        raise OptionError(f"layer ids must lie in 0..{n - 1} (input of decoder layer j), got {ids}")
    choice = LayerChoice(n, ids)
    if warn and not choice.is_default:
        warnings.warn(
            f"layers {ids} differ from the engines' default {default_layer_ids(n)}: the export "
            "records both layer-id keys so vLLM and SGLang capture these, but older engine "
            "versions that ignore the keys would serve the draft wrongly",
            stacklevel=2,
        )
    return choice
