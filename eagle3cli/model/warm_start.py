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
  reading the hidden half of the layer input (``hidden_norm`` = that layer's norm before its
  attention); the embedding half starts at zero. ``a`` then starts as one more target layer
  over ``g``. Every layer shape gives what it can: fused projections are split (Phi-3's
  ``qkv_proj``, ``gate_up_proj``), a mixture of experts gives its routed experts averaged (or its
  shared expert), norms that follow a sublayer (OLMo 2, Gemma's sandwich) are left out.
  A part that cannot apply (multi-head latent attention, gpt-oss's biased experts) is named in
  one line and the rest still applies.

``head`` needs nothing but the output head; ``fc`` needs H == Ht (always true for drafts
made by eagle3).
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
    """The decoder's final norm (``norm`` of the decoder stack, found inside a multimodal model's
    language model too: target.base_model)."""
    from .target import base_model

    norm = getattr(base_model(model), "norm", None)
    if norm is None:
        raise WarmStartError(f"{type(model).__name__} has no final norm at model.norm: use --warm-start fc or none")
    return norm


def decoder_layers(model):
    from .target import base_model

    layers = getattr(base_model(model), "layers", None)
    if layers is None:
        raise WarmStartError(f"{type(model).__name__} has no decoder layers at model.layers: use --warm-start "
                             "head,fc")
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


# ---- the target's layer, read whatever its shape -------------------------------------------------
#
# Each reader returns the weights in the draft's layout or raises Skip with the reason; a part
# that cannot apply is named in one line and the others still apply.

class Skip(Exception):
    """One part of the layer warm start does not fit this target (the message says why)."""


def attention_weights(attn, cfg) -> dict[str, torch.Tensor]:
    """q/k/v/o as [out, H] / [H, nh*hd]: separate projections (Llama and most), or Phi-3's fused
    ``qkv_proj`` split in the order it is read (q, then k, then v)."""
    if attn is None:
        raise Skip("the layer has no self_attn")
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    linear = lambda n: isinstance(getattr(attn, n, None), torch.nn.Linear)  # noqa: E731
    if all(linear(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        w = {n: getattr(attn, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    elif linear("qkv_proj") and linear("o_proj"):
        qkv = attn.qkv_proj.weight
        if qkv.shape[0] != q_out + 2 * kv_out:
            raise Skip(f"its fused qkv_proj has {qkv.shape[0]} rows, not q + k + v = {q_out + 2 * kv_out}")
        q, k, v = qkv.split([q_out, kv_out, kv_out], dim=0)
        w = {"q_proj": q, "k_proj": k, "v_proj": v, "o_proj": attn.o_proj.weight}
    else:
        names = ", ".join(n for n, _ in attn.named_children()) or "none"
        raise Skip(f"{type(attn).__name__} has no q/k/v projections of the draft's kind (it has {names}; "
                   "multi-head latent attention, for one, has no per-head keys to copy)")
    want = {"q_proj": (q_out, cfg.hidden_size), "k_proj": (kv_out, cfg.hidden_size),
            "v_proj": (kv_out, cfg.hidden_size), "o_proj": (cfg.hidden_size, q_out)}
    for n, shape in want.items():
        if tuple(w[n].shape) != shape:
            raise Skip(f"the target's {n} is {tuple(w[n].shape)}, the draft's needs {shape}")
    return w


def _dense_mlp(mlp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(gate, up, down) of a gated MLP: separate projections, or a fused ``gate_up_proj``
    (Phi-3, GLM-4: gate rows first, as their forward chunks it)."""
    if all(isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    if isinstance(getattr(mlp, "gate_up_proj", None), torch.nn.Linear) and \
            isinstance(getattr(mlp, "down_proj", None), torch.nn.Linear):
        gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)
        return gate, up, mlp.down_proj.weight
    return None


def _experts_mean(experts, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed experts' weights averaged: 3-D ``gate_up_proj`` / ``down_proj`` (transformers 5;
    [E, 2I, H] read with F.linear, or [E, H, 2I] read with a matmul as Llama 4 stores them), or a
    ModuleList of gated MLPs."""
    if isinstance(experts, torch.nn.ModuleList):
        mats = [_dense_mlp(e) for e in experts]
        if not mats or any(m is None for m in mats):
            raise Skip("its experts are not gated MLPs")
        return tuple(torch.stack([m[i].float() for m in mats]).mean(0) for i in range(3))
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or gu.dim() != 3 or not isinstance(down, torch.Tensor):
        raise Skip(f"its experts ({type(experts).__name__}) hold no gate_up_proj/down_proj of a known layout")
    if getattr(experts, "gate_up_proj_bias", None) is not None:
        raise Skip("its experts add biases and a clamped SwiGLU (gpt-oss) that the draft's SiLU MLP cannot hold")
    transposed = getattr(experts, "is_transposed", None)
    if transposed is None:
        transposed = gu.shape[1] == h and gu.shape[2] != h
    if transposed:
        gu, down = gu.transpose(1, 2), down.transpose(1, 2)
    gu, down = gu.float().mean(0), down.float().mean(0)
    gate, up = gu.chunk(2, dim=0)
    return gate, up, down


def mlp_weights(layer, h: int, moe: str = "mean") -> tuple[tuple[torch.Tensor, ...], str]:
    """((gate, up, down), where they came from). A mixture of experts gives its routed experts
    averaged (``moe="mean"``, the default), or its shared expert (``moe="shared"``, and whenever
    the routed ones cannot be read); the router and the shared expert's gate have no place in
    the draft's dense MLP.

    The default is measured (benchmarks/warm_start_moe.py, docs/design.md §3): on tiny random
    Qwen2-MoE, DeepSeek-V3 and Llama 4 targets the mean gave the lower initial loss in 9 of 9
    runs, by 0.03-0.18 nats of the 3-step TTT loss, while the shared expert's was above the
    attention-only warm start's; the mean's equals the attention-only one to 0.01."""
    mlp = _first(layer, "mlp", "feed_forward")  # Llama 4 names it feed_forward
    if mlp is None:
        raise Skip("the layer has no mlp")
    dense = _dense_mlp(mlp)
    if dense is not None:
        return dense, "its MLP"
    shared = _first(mlp, "shared_expert", "shared_experts")
    shared = _dense_mlp(shared) if shared is not None else None
    experts = getattr(mlp, "experts", None)
    if shared is not None and (moe == "shared" or experts is None):
        return shared, "the shared expert of its mixture of experts"
    if experts is None:
        raise Skip(f"{type(mlp).__name__} is neither a gated MLP nor a mixture of experts")
    try:
        return _experts_mean(experts, h), f"the mean of its {_n_experts(experts)} routed experts"
    except Skip as e:
        if shared is None:
            raise
        return shared, f"the shared expert of its mixture of experts (the routed ones do not fit: {e})"


def _partial_rotary(attn) -> float | None:
    """The share of each head the target's RoPE rotates, when it is not all (GLM-4: 0.5)."""
    cfg = getattr(attn, "config", None)
    rp = getattr(cfg, "rope_parameters", None) or {}
    f = rp.get("partial_rotary_factor") if isinstance(rp, dict) else None
    f = f if f is not None else getattr(cfg, "partial_rotary_factor", None)
    return float(f) if f is not None and float(f) < 1.0 else None


def _first(module, *names):
    """The first of ``names`` that ``module`` has (a container module is falsy when empty: no ``or``)."""
    for n in names:
        m = getattr(module, n, None)
        if m is not None:
            return m
    return None


def _n_experts(experts) -> int:
    return len(experts) if isinstance(experts, torch.nn.ModuleList) else int(experts.gate_up_proj.shape[0])


def fit_mlp(gate, up, down, intermediate: int):
    """The MLP in the draft's intermediate size: a narrower one is zero-padded (the extra units
    give act(0) * 0 = 0, the same function exactly); a wider one does not fit."""
    i = gate.shape[0]
    if i > intermediate:
        raise Skip(f"its intermediate size is {i}, wider than the draft's {intermediate}")
    if i < intermediate:
        pad = intermediate - i
        gate = torch.cat([gate, gate.new_zeros(pad, gate.shape[1])])
        up = torch.cat([up, up.new_zeros(pad, up.shape[1])])
        down = torch.cat([down, down.new_zeros(down.shape[0], pad)], dim=1)
    return gate, up, down


def layer_norms(layer) -> tuple[torch.nn.Module | None, torch.nn.Module | None, list[str]]:
    """(the norm before attention, the norm before the MLP, the norms after a sublayer).

    Pre-norm layers (Llama and most): ``input_layernorm`` and ``post_attention_layernorm``.
    Sandwich layers (Gemma 2/3) read the MLP input through ``pre_feedforward_layernorm``, their
    ``post_attention_layernorm`` normalises the attention's output. Post-norm layers (OLMo 2)
    have no ``input_layernorm``: both their norms follow a sublayer. The draft's layer normalises
    only before its sublayers, so norms after one have no place in it."""
    children = dict(layer.named_children())
    pre_attn = children.get("input_layernorm")
    if "pre_feedforward_layernorm" in children:
        pre_mlp = children["pre_feedforward_layernorm"]
    elif pre_attn is not None:
        pre_mlp = children.get("post_attention_layernorm")
    else:
        pre_mlp = None
    after = [n for n, m in children.items() if "norm" in n and m is not pre_attn and m is not pre_mlp]
    return pre_attn, pre_mlp, after


@torch.no_grad()
def warm_start_layer(draft, layer, moe: str = "mean") -> list[str]:
    """The target's decoder layer as the draft's, on the hidden half of its 2H input: the
    attention, the MLP and the pre-sublayer norms, each where it fits. Returns one line per part
    that did not apply (and why) or that was taken from a mixture of experts."""
    cfg, mine, notes = draft.config, draft.midlayer, []
    h = cfg.hidden_size
    kind = type(layer).__name__
    try:
        w = attention_weights(getattr(layer, "self_attn", None), cfg)
        for n in ("q_proj", "k_proj", "v_proj"):
            dst = getattr(mine.self_attn, n).weight
            dst.zero_()
            dst[:, h:] = w[n].to(dst)  # the embedding half starts at zero
        mine.self_attn.o_proj.weight.copy_(w["o_proj"].to(mine.self_attn.o_proj.weight))
        extra = [n for n, _ in layer.self_attn.named_children() if n in ("q_norm", "k_norm")]
        extra += [n for n, _ in layer.self_attn.named_parameters() if n.endswith("bias") or n == "sinks"]
        if extra:
            notes.append(f"warm start layer: attention copied without its {', '.join(extra)} (the draft's "
                         "attention has none)")
        partial = _partial_rotary(layer.self_attn)
        if partial:
            notes.append(f"warm start layer: the target rotates {partial:g} of each head's dimensions, the "
                         "draft all of them: its copied attention starts near the target's, not equal to it")
    except Skip as e:
        notes.append(f"warm start layer: attention not copied: {e}")
    try:
        (gate, up, down), origin = mlp_weights(layer, h, moe)
        gate, up, down = fit_mlp(gate, up, down, cfg.intermediate_size)
        for n, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            getattr(mine.mlp, n).weight.copy_(t.to(getattr(mine.mlp, n).weight))
        if origin != "its MLP":
            notes.append(f"warm start layer: MLP from {origin}")
    except Skip as e:
        notes.append(f"warm start layer: MLP not copied: {e}")
    pre_attn, pre_mlp, after = layer_norms(layer)
    for norm, dst, what in ((pre_attn, mine.hidden_norm, "attention"), (pre_mlp, mine.post_attention_layernorm,
                                                                        "MLP")):
        if norm is None:
            notes.append(f"warm start layer: no norm before the {what} in {kind} (it normalises after its "
                         "sublayers): the draft's keeps its initial ones")
        else:
            dst.weight.copy_(effective_norm_weight(norm, h).to(dst.weight))
    if after:
        notes.append(f"warm start layer: {', '.join(after)} of {kind} follow a sublayer and have no place in "
                     "the draft's layer: not copied")
    return notes


def target_parts(model, parts: tuple[str, ...]) -> dict:
    """What the warm start needs of the full target, taken before the decoder is dropped. The
    head carries the target's logit scale (Granite's logits_scaling): the draft's logits are then
    on the target's scale, the teacher's (target.finish_logits)."""
    from .target import logit_scale, logit_softcap, output_head

    need = {"notes": []}
    if "head" in parts:
        need["head"] = output_head(model).weight.detach().float().cpu() * logit_scale(model)
        need["norm"] = effective_norm_weight(final_norm(model), need["head"].shape[1])
        if logit_softcap(model):
            need["notes"].append(f"warm start head: the target caps its logits (tanh at {logit_softcap(model)}); "
                                 "the draft's head starts uncapped")
    if "layer" in parts:
        need["layer"] = decoder_layers(model)[-1]
    return need


def apply(draft, parts: tuple[str, ...], need: dict, vocab_ids: torch.Tensor, moe: str = "mean") -> list[str]:
    """Apply the warm start; returns the lines that say which parts did not apply, and why."""
    notes = list(need.get("notes", []))
    if "head" in parts:
        warm_start_head(draft, need["head"], need["norm"], vocab_ids)
    if "fc" in parts:
        warm_start_fc(draft)
    if "layer" in parts:
        notes += warm_start_layer(draft, need["layer"], moe)
    return notes
