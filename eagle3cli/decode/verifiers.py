"""The target's side of a speculative-decoding cycle: prefill the prompt, verify a tree in one
forward, keep the accepted path in the cache. ``HFVerifier`` runs the target's own HF forward (any
architecture ``generator.check_supported`` admits), ``FastVerifier`` the fast path (``fast_target``)."""

from __future__ import annotations

import torch

from ..core.hf_utils import cache_kwargs
from . import attention


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
    return target(input_ids=input_ids, **cache_kwargs(target, cache), use_cache=True, output_hidden_states=True,
                  return_dict=True, **kw)


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
