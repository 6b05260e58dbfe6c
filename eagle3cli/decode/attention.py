"""How a target's layers attend, and the masks that verify a draft tree through them.

A target decoding one token at a time applies each layer's pattern to that token by its position:
full attention sees every earlier position, a sliding-window layer the last ``sliding_window``
(``key > query - window``, the query itself included), a chunked layer (Llama 4) the earlier
positions of the query's own ``attention_chunk_size`` block. A tree verification puts many queries
at once behind one cache, at positions prefix + depth, so each layer kind gets its own mask: the
tree's "may attend" (prefix and ancestors) narrowed by that kind's rule at every query's own
position. The verifier's cache keeps every position (no layer drops old entries), so that the
entries of rejected branches can be dropped and the window still finds the keys it needs; the
window lives in the mask only.

The kinds and sizes are read as transformers reads them to build its own masks and caches:
``layer_types`` when the config has it, else every layer sliding when ``sliding_window`` is set,
chunked when ``attention_chunk_size`` is, full otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..core.hf_utils import text_config

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
KINDS = (FULL, SLIDING, CHUNKED)
# attention implementations that read a 4-D mask tensor: sdpa takes "may attend" as bool, eager and
# flex add the mask to the scores (a bool there would add 1 to the allowed scores, not mask the rest)
BOOL_MASK, ADDITIVE_MASK = ("sdpa",), ("eager", "flex_attention")


def without_cudnn_attention(fn):
    """Run ``fn`` with SDPA's cuDNN kernel ruled out (flash, memory-efficient and math stay).

    Decoding calls SDPA with a new key length at every step, and cuDNN builds an execution graph
    per shape: on an H200 that set-up took 1.2 ms of CPU per call, 38 ms a token over a
    32-layer target, while the whole bf16 step's GPU work took 5.5 ms. No effect on a CPU.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.cuda.is_available():
            return fn(*args, **kwargs)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return fn(*args, **kwargs)

    return run


@dataclass(frozen=True)
class Layout:
    kinds: tuple[str, ...]  # per layer
    window: int | None = None  # sliding layers: keys at positions > query - window
    chunk: int | None = None  # chunked layers: keys in the query's block of this many positions

    @property
    def windowed(self) -> bool:
        return any(k != FULL for k in self.kinds)


def layout(config) -> Layout:
    """The per-layer attention kinds of a target config (unknown kinds are kept, for the caller to refuse)."""
    cfg = text_config(config)
    window = getattr(cfg, "sliding_window", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    kinds = getattr(cfg, "layer_types", None)
    if not kinds:
        n = cfg.num_hidden_layers
        kinds = [SLIDING] * n if window is not None else [CHUNKED] * n if chunk is not None else [FULL] * n
    return Layout(tuple(kinds), window, chunk)


def attn_implementation(config) -> str | None:
    cfg = text_config(config)
    return getattr(cfg, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)


def kind_masks(allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, lay: Layout) -> dict[str, torch.Tensor]:
    """bool [n, K] "may attend" per layer kind present: ``allowed`` [n, K] (the tree's prefix and
    ancestors) narrowed, for each query at position ``q_pos`` [n], to the keys at ``k_pos`` [K] its
    kind lets it see."""
    out = {}
    for kind in dict.fromkeys(lay.kinds):
        if kind == SLIDING:
            out[kind] = allowed & (k_pos[None, :] > q_pos[:, None] - lay.window)
        elif kind == CHUNKED:
            out[kind] = allowed & (k_pos[None, :] // lay.chunk == q_pos[:, None] // lay.chunk)
        else:
            out[kind] = allowed
    return out


def hf_mask(allowed: torch.Tensor, q_pos: torch.Tensor, past: int, lay: Layout, implementation: str | None,
            dtype: torch.dtype):
    """The ``attention_mask`` of one HF forward over a tree behind ``past`` cached positions 0..past-1:
    one 4-D mask [1, 1, n, past + n] when every layer attends alike (models read a 4-D tensor as is),
    else {layer kind: mask}, the per-kind mapping the hybrid models' forwards accept. Bool for sdpa,
    additive (0 / the dtype's minimum, as transformers' own eager masks) for eager and flex."""
    k_pos = torch.cat([torch.arange(past, device=q_pos.device), q_pos])
    masks = kind_masks(allowed, q_pos, k_pos, lay)
    if implementation not in BOOL_MASK:
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        masks = {k: torch.where(m, zero, torch.finfo(dtype).min) for k, m in masks.items()}
    masks = {k: m[None, None] for k, m in masks.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks


def keep_all_cache():
    """A DynamicCache that keeps every position in every layer: windows are applied by the masks, so
    the entries a rejected branch leaves are dropped by position and none a window needs is lost."""
    from transformers import DynamicCache

    return DynamicCache()
