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


# ---- DFlash (docs/design.md §13) --------------------------------------------------------------

DFLASH_STREAMS = 5  # the public z-lab drafts' count: one target stream per layer of a 5-layer draft


def dflash_output_layer_ids(n_layers: int, n_streams: int = DFLASH_STREAMS) -> tuple[int, ...]:
    """z-lab's choice in its own count (output of layer k): ``n_streams`` ids spaced from 1 to N-3,
    ``round(1 + i*(N-4)/(n-1))`` with Python's rounding, as z-lab and SpecForge compute it
    (N=36, n=5: 1, 9, 17, 25, 33; N=30: 1, 8, 14, 20, 27). One stream: the middle layer."""
    if n_streams < 1:
        raise OptionError(f"a DFlash draft reads at least one target stream, got {n_streams}")
    if n_streams == 1:
        return (n_layers // 2,)
    if n_layers - 3 < n_streams:
        raise OptionError(f"a target of {n_layers} layers has too few for {n_streams} DFlash streams spaced "
                          f"from 1 to {n_layers - 3}: choose fewer with --layers")
    span = n_layers - 4
    return tuple(int(round(1 + i * span / (n_streams - 1))) for i in range(n_streams))


def dflash_layer_ids(n_layers: int, n_streams: int = DFLASH_STREAMS) -> tuple[int, ...]:
    """The same streams in this package's count (``hidden_states[j]``, input of layer j = k + 1)."""
    return tuple(k + 1 for k in dflash_output_layer_ids(n_layers, n_streams))


def choose_dflash_layers(config, override: Sequence[int] | None = None) -> LayerChoice:
    """DFlash's streams: z-lab's spacing, or ``override`` (any count of distinct ascending ids in
    1..N, this package's count: N is the last layer's output, before the final norm)."""
    n = num_layers(config)
    if override is None:
        return LayerChoice(n, dflash_layer_ids(n))
    ids = tuple(int(j) for j in override)
    if not ids or list(ids) != sorted(set(ids)):
        raise OptionError(f"DFlash layer ids must be distinct and ascending, got {ids}")
    if ids[0] < 1 or ids[-1] > n - 1:
        raise OptionError(f"DFlash layer ids must lie in 1..{n - 1} (input of decoder layer j; the output of "
                          f"layer j-1), got {ids}")
    return LayerChoice(n, ids)


DRAFT_TYPES = ("eagle3", "dflash")


def parse_draft_types(text: str | Sequence[str]) -> tuple[str, ...]:
    """``eagle3``, ``dflash`` or both (``eagle3,dflash``): the draft families a store serves."""
    names = [t.strip().lower() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    bad = [n for n in names if n not in DRAFT_TYPES]
    if bad or not names:
        raise OptionError(f"--draft-type {','.join(names) or text!r}: choose eagle3, dflash or eagle3,dflash")
    return tuple(t for t in DRAFT_TYPES if t in names)


def layers_for(config, draft_type: str, override: Sequence[int] | None = None, warn: bool = True) -> LayerChoice:
    """The target streams one draft family reads: EAGLE-3's three or DFlash's spaced set."""
    if draft_type == "dflash":
        return choose_dflash_layers(config, override)
    return choose_layers(config, override, warn=warn)


def store_layers(config, draft_types: Sequence[str], override: Sequence[int] | None = None) -> LayerChoice:
    """What a store captures for ``draft_types``: each family's streams, their union for several
    (one store then trains either family; each trainer reads its own columns)."""
    if len(draft_types) == 1:
        return layers_for(config, draft_types[0], override)
    if override is not None:
        raise OptionError("--layers names one family's streams: give it with a single --draft-type")
    ids = sorted({j for t in draft_types for j in layers_for(config, t).ids})
    return LayerChoice(num_layers(config), tuple(ids))


def missing_streams(store_ids: Sequence[int], want: Sequence[int]) -> tuple[int, ...]:
    """The streams of ``want`` a store of ``store_ids`` lacks."""
    return tuple(j for j in want if j not in set(store_ids))


def stream_columns(store_ids: Sequence[int], want: Sequence[int]) -> list[int] | None:
    """Positions in a store's concatenated streams of the ``want`` ones (None: all, in order)."""
    store_ids, want = list(store_ids), list(want)
    return None if store_ids == want else [store_ids.index(j) for j in want]
