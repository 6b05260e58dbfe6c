"""Starting the draft from the target's own weights instead of random ones.

A draft trained for minutes on a CPU cannot afford to learn from nothing what the target
already knows. Each part below puts a piece of the target where the draft can use it as is
(docs/design.md §3 gives the draft's equations):

* ``head``: ``norm`` and ``lm_head`` are the target's final norm and its output-head rows of
  the draft vocabulary. The draft's output stream ``a`` then lives in the target's residual
  space, read the way the target reads its own last hidden state; frozen (``--freeze-head``),
  nothing of the 576 x Vd matrix has to be learned.
* ``fc``: ``fc`` passes the high stream through (``g = h_high``) and ignores the other two at
  first, so the draft starts from the target's most informed stream, not from noise.
* ``layer``: the decoder layer starts as the target's last layer: its attention and MLP,
  reading the hidden half of the layer input (``hidden_norm`` = that layer's input norm); the
  embedding half starts at zero. ``a`` then starts as one more target layer over ``g``.

``head`` needs nothing but the output head; ``fc`` needs H == Ht (always true for drafts
made by eagle3); ``layer`` needs the target's layer to have the draft's geometry.
"""

from __future__ import annotations

import torch

from ..core.errors import Eagle3Error

PARTS = ("head", "fc", "layer")


class WarmStartError(Eagle3Error, ValueError):
    """The requested warm start does not fit this target."""


def parse_parts(text: str | None) -> tuple[str, ...]:
    """``--warm-start head,fc`` -> ("head", "fc"); "none" or "" -> ()."""
    parts = tuple(p.strip() for p in (text or "").split(",") if p.strip() and p.strip() != "none")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise WarmStartError(f"--warm-start: unknown part(s) {', '.join(bad)}; choose from {', '.join(PARTS)} "
                             "(comma-separated) or none")
    return parts


def effective_norm_weight(norm: torch.nn.Module, size: int) -> torch.Tensor:
    """The per-channel scale an RMSNorm-like module applies (whatever its parametrisation:
    Llama's w, Gemma's 1 + w): its output on a vector of ones, whose RMS is 1."""
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)) or 0.0)
    w = next(norm.parameters())
    with torch.no_grad():
        out = norm(torch.ones(1, size, dtype=torch.float32, device=w.device).to(w.dtype))
    return (out.float()[0] * (1.0 + eps) ** 0.5).cpu()


def final_norm(model) -> torch.nn.Module:
    """The decoder's final norm (``model.model.norm`` in every HF decoder eagle3 supports)."""
    from .target import base_model

    norm = getattr(base_model(model), "norm", None)
    if norm is None:
        raise WarmStartError(f"{type(model).__name__} has no final norm at model.norm: use --warm-start none")
    return norm


def decoder_layers(model):
    from .target import base_model

    layers = getattr(base_model(model), "layers", None)
    if layers is None:
        raise WarmStartError(f"{type(model).__name__} has no decoder layers at model.layers")
    return layers


@torch.no_grad()
def warm_start_head(draft, head_weight: torch.Tensor, norm_weight: torch.Tensor, vocab_ids: torch.Tensor):
    draft.lm_head.weight.copy_(head_weight[vocab_ids.to(head_weight.device)].to(draft.lm_head.weight))
    draft.norm.weight.copy_(norm_weight.to(draft.norm.weight))


@torch.no_grad()
def warm_start_fc(draft):
    h, ht = draft.config.hidden_size, draft.config.target_hidden_size
    if h != ht:
        raise WarmStartError(f"--warm-start fc needs the draft's hidden size ({h}) to equal the target's ({ht})")
    w = torch.zeros_like(draft.fc.weight)
    w[:, 2 * ht:] = torch.eye(h, dtype=w.dtype)
    draft.fc.weight.copy_(w)


@torch.no_grad()
def warm_start_layer(draft, layer):
    """The target's decoder layer as the draft's, on the hidden half of its 2H input."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or mlp is None or not all(hasattr(attn, n) for n in names) or \
            not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        raise WarmStartError(f"--warm-start layer needs a Llama-style layer (q/k/v/o_proj, gate/up/down_proj); "
                             f"{type(layer).__name__} is not one")
    mine = draft.midlayer
    h = draft.config.hidden_size
    for n in names[:3]:
        src, dst = getattr(attn, n).weight, getattr(mine.self_attn, n).weight
        if src.shape != (dst.shape[0], h):
            raise WarmStartError(f"--warm-start layer: the target's {n} is {tuple(src.shape)}, the draft's "
                                 f"{tuple(dst.shape)}")
        dst.zero_()
        dst[:, h:] = src.to(dst)
    mine.self_attn.o_proj.weight.copy_(attn.o_proj.weight.to(mine.self_attn.o_proj.weight))
    for n in ("gate_proj", "up_proj", "down_proj"):
        getattr(mine.mlp, n).weight.copy_(getattr(mlp, n).weight.to(getattr(mine.mlp, n).weight))
    mine.hidden_norm.weight.copy_(effective_norm_weight(layer.input_layernorm, h).to(mine.hidden_norm.weight))
    mine.post_attention_layernorm.weight.copy_(
        effective_norm_weight(layer.post_attention_layernorm, h).to(mine.post_attention_layernorm.weight))


def target_parts(model, parts: tuple[str, ...]) -> dict:
    """What the warm start needs of the full target, taken before the decoder is dropped."""
    from .target import output_head

    need = {}
    if "head" in parts:
        need["head"] = output_head(model).weight.detach().float().cpu()
        need["norm"] = effective_norm_weight(final_norm(model), need["head"].shape[1])
    if "layer" in parts:
        need["layer"] = decoder_layers(model)[-1]
    return need


def apply(draft, parts: tuple[str, ...], need: dict, vocab_ids: torch.Tensor):
    if "head" in parts:
        warm_start_head(draft, need["head"], need["norm"], vocab_ids)
    if "fc" in parts:
        warm_start_fc(draft)
    if "layer" in parts:
        warm_start_layer(draft, need["layer"])
