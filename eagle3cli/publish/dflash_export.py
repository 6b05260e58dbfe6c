"""DFlash drafts on disk: z-lab's layout (the one vLLM, SGLang and llama.cpp read) and speculators' own.

    z-lab          config.json: architectures ["DFlashDraftModel"], model_type "qwen3", the Qwen3 fields,
                   block_size (top level; newer drafts also inside dflash_config), dflash_config
                   {mask_token_id, target_layer_ids}, num_target_layers, layer_types, and our
                   training record (``eagle3_training``)
    speculators    config.json: speculators_model_type "dflash", the Qwen3 fields in
                   transformer_layer_config, block_size, mask_token_id, aux_hidden_state_layer_ids
                   (speculators 0.9.0 ``models/dflash/config.py``)
    both           model.safetensors: fc, hidden_norm, norm, layers.i.* (no prefix, no embedding,
                   no LM head: the target's are used, frozen)

The layer-id conventions differ, and that is the off-by-one engines users hit: z-lab's
``dflash_config.target_layer_ids`` count layer OUTPUTS (the engines add one and capture layer
inputs), speculators' ``aux_hidden_state_layer_ids`` count layer INPUTS, as this package's
``DFlashConfig.target_layer_ids`` do (``hidden_states[j]``). Writing z-lab subtracts one, reading
it adds one back; speculators' ids are ours as they are. A draft written and read back is bit-equal.

``load_dflash`` runs :func:`dflash_check.check_dflash` before it builds anything, as
``export.load_draft`` does for EAGLE-3 drafts: a damaged draft is one line, never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.errors import Eagle3Error
from ..core.io_utils import ensure_dir, save_safetensors, write_json
from ..model.dflash import DFlashConfig, DFlashDraft
from .dflash_check import check_dflash
from .dflash_layout import (  # noqa: F401 - is_dflash and draft_type_of: the names every wing imports from here
    ARCHITECTURE,
    CONFIG,
    DTYPE_NAMES,
    LAYOUTS,
    METADATA_KEY,
    SPECULATORS_VERSION,
    WEIGHTS,
    block_size_of,
    draft_type_of,
    is_dflash,
    layer_fields,
    layer_ids_of,
    layout_of,
    mask_token_of,
    rope_of,
)
from .draft_check import DIGEST_KEY, CorruptDraft, read_weights, weights_digest

# ---------------------------------------------------------------------------- writing

def _qwen3_fields(cfg: DFlashConfig, dtype: torch.dtype) -> dict:
    """The Qwen3 decoder-layer fields every engine builds the draft's layers from."""
    rp = dict(cfg.rope_parameters)
    d = {
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_hidden_layers, "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        # transformers 5 reads rope_parameters; engines pinned to transformers 4 read rope_theta/rope_scaling
        "rope_theta": float(rp.get("rope_theta", 10000.0)), "rope_parameters": rp,
        "rope_scaling": ({k: v for k, v in rp.items() if k != "rope_theta"}
                         if rp.get("rope_type", "default") != "default" else None),
        "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,  # the block is bidirectional in every layer
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "torch_dtype": DTYPE_NAMES[dtype], "dtype": DTYPE_NAMES[dtype],
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        d["target_hidden_size"] = cfg.target_hidden_size
    return d


def zlab_config(cfg: DFlashConfig, dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None) -> dict:
    """config.json in z-lab's layout; ``dflash_config.target_layer_ids`` in its output count."""
    d = {"architectures": [ARCHITECTURE], "model_type": "qwen3", **_qwen3_fields(cfg, dtype),
         "num_target_layers": cfg.num_target_layers,
         "block_size": cfg.block_size,  # older readers (speculators' converter first) take it here ...
         "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.output_layer_ids),
                           "block_size": cfg.block_size}}  # ... llama.cpp's converter here first
    d[METADATA_KEY] = dict(metadata or {})
    return d


def speculators_config(cfg: DFlashConfig, dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None,
                       target_name: str | None = None) -> dict:
    """config.json in speculators 0.9.0's layout (what its ``save_pretrained`` writes for a full
    vocabulary); ``aux_hidden_state_layer_ids`` count layer inputs, as ours do."""
    layer = {"model_type": "qwen3", **_qwen3_fields(cfg, dtype)}
    for k in ("torch_dtype", "dtype"):
        layer.pop(k)
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name, "architectures": []},
        },
        "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "target_hidden_size": cfg.target_hidden_size if cfg.target_hidden_size != cfg.hidden_size else None,
        "num_target_layers": cfg.num_target_layers,
        # vLLM 0.32.0 (transformers_utils/configs/speculators/algos.py) serves a speculators DFlash
        # draft with dflash_config.causal = not sliding_window_non_causal, which makes EVERY layer
        # causal when false; true keeps the block bidirectional there and changes nothing in
        # speculators (its full-attention layers are bidirectional either way).
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
        "dtype": DTYPE_NAMES[dtype],
        METADATA_KEY: dict(metadata or {}),
    }


def exported_tensors(draft: DFlashDraft, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """model.safetensors' tensors: the draft's own (no embedding, no LM head), in ``dtype``."""
    out = {}
    for k, v in draft.trainable_state_dict().items():
        t = v.detach().cpu()
        out[k] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    return out


def save_dflash(draft: DFlashDraft, out_dir: str | Path, metadata: dict | None = None,
                dtype: torch.dtype | None = torch.bfloat16, layout: str = "zlab",
                target_name: str | None = None) -> Path:
    """config.json + model.safetensors in ``layout`` (z-lab's unless told), each written atomically,
    the weights with the digest every reader checks (``draft_check.read_weights``)."""
    if layout not in LAYOUTS:
        raise CorruptDraft(f"a DFlash draft is written in one of {', '.join(LAYOUTS)}, not {layout!r}")
    dtype = dtype or draft.fc.weight.dtype
    out = ensure_dir(out_dir)
    tensors = exported_tensors(draft, dtype)
    save_safetensors(tensors, out / WEIGHTS, metadata={"format": "pt", DIGEST_KEY: weights_digest(tensors)})
    config = (zlab_config(draft.config, dtype, metadata) if layout == "zlab"
              else speculators_config(draft.config, dtype, metadata, target_name))
    write_json(out / CONFIG, config)
    return out


# ---------------------------------------------------------------------------- reading

def dflash_config_from_json(d: dict, num_target_layers: int | None = None) -> DFlashConfig:
    """The DFlashConfig of a config.json in either layout (either place of block_size). Call it
    on a config that passed ``dflash_check.config_problems``: a missing key here is a KeyError."""
    f = layer_fields(d)
    heads = f["num_attention_heads"]
    _, ids, shift = layer_ids_of(d)
    n_target = d.get("num_target_layers") or num_target_layers or 0
    return DFlashConfig(
        hidden_size=f["hidden_size"], intermediate_size=f["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=f.get("num_key_value_heads") or heads,
        head_dim=f.get("head_dim") or f["hidden_size"] // heads,
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)), vocab_size=f["vocab_size"],
        target_hidden_size=d.get("target_hidden_size") or f.get("target_hidden_size") or f["hidden_size"],
        max_position_embeddings=f.get("max_position_embeddings", 2048), num_hidden_layers=f["num_hidden_layers"],
        num_target_layers=int(n_target), target_layer_ids=tuple(int(k) + shift for k in ids),
        block_size=int(block_size_of(d)), mask_token_id=int(mask_token_of(d)),
        rope_parameters=rope_of(f), hidden_act=f.get("hidden_act", "silu"), pad_token_id=f.get("pad_token_id"),
        bos_token_id=f.get("bos_token_id"), eos_token_id=f.get("eos_token_id"),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)))


class MissingWeights(Eagle3Error, FileNotFoundError):
    """A DFlash draft folder without its model.safetensors."""


class DraftTargetMismatch(Eagle3Error, ValueError):
    """A DFlash draft built for another target than the one given."""


def read_tensors(draft_dir: str | Path) -> dict[str, torch.Tensor]:
    p = Path(draft_dir) / WEIGHTS
    if not p.exists():
        raise MissingWeights(f"{draft_dir} has no {WEIGHTS}: export or download the draft again")
    return read_weights(p)


def load_dflash(draft_dir: str | Path, config: dict, target=None, dtype: torch.dtype | None = torch.float32,
                device: str | torch.device = "cpu", target_config=None) -> tuple[DFlashDraft, dict]:
    """A DFlashDraft from a folder in either layout, checked first (``dflash_check.check_dflash``);
    returns (draft, config dict). ``target`` (a loaded HF model) gives the frozen embedding and LM
    head; without one they are placeholders: the draft can be inspected or converted, not decoded.
    ``dtype=None`` keeps the stored dtype (bit-exact round trips)."""
    check_dflash(config, None, draft_dir)
    tensors = read_tensors(draft_dir)
    check_dflash(config, tensors, draft_dir)
    if target_config is None and target is not None:
        target_config = getattr(target, "config", None)
    n_target = _target_layers(target_config)
    cfg = dflash_config_from_json(config, n_target)
    if dtype is None:
        dtype = tensors["fc.weight"].dtype
    draft = DFlashDraft(cfg).to(dtype)
    own = draft.trainable_state_dict()
    draft.load_state_dict({k: tensors[k].to(dtype) for k in own}, strict=False)
    if target is not None:
        attach_target(draft, target, draft_dir)
    return draft.to(device), config


def _target_layers(target_config) -> int | None:
    if target_config is None:
        return None
    from ..core.hf_utils import text_config

    return int(getattr(text_config(target_config), "num_hidden_layers", 0) or 0) or None


def attach_target(draft: DFlashDraft, target, where="the draft"):
    """Copy the target's embedding and LM head (a tied head is the embedding) into ``draft``;
    a shape that differs is one line naming both (a draft built for another target)."""
    emb = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings()
    head = emb if head is None else head.weight.detach()
    try:
        draft.set_embedding(emb)
        draft.set_head(head)
    except ValueError as e:
        raise DraftTargetMismatch(f"{where}: {e}: a draft of another target (check with `eagle3 inspect "
                                  f"{where} --model TARGET`)") from None
