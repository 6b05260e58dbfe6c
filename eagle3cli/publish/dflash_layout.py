"""How a DFlash draft's config.json says what it is, in either layout (z-lab's, speculators'):
the draft type, the layout, and where each layout keeps the block size, the MASK id, the target
layer ids (and their count: z-lab's count layer outputs, speculators' layer inputs) and the
Qwen3 fields. Read by ``dflash_export`` (the files) and ``dflash_check`` (their problems)."""

from __future__ import annotations

import torch

ARCHITECTURE = "DFlashDraftModel"  # z-lab's name; speculators' save_pretrained writes the same
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"  # speculators 0.9.0's config default
CONFIG, WEIGHTS = "config.json", "model.safetensors"
METADATA_KEY = "eagle3_training"  # the same block export.py writes for EAGLE-3 drafts
SPECULATORS_VERSION = "0.9.0"
LAYOUTS = ("zlab", "speculators")
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def is_dflash(config: dict) -> bool:
    """A DFlash draft's config.json: z-lab's architecture name or ``dflash_config``, or speculators'
    model type (``draft_type`` too, for a folder written by an earlier version of this package)."""
    if not isinstance(config, dict):
        return False
    archs = config.get("architectures")
    archs = archs if isinstance(archs, list) else []
    return (ARCHITECTURE in archs or SPECULATORS_ARCHITECTURE in archs or "dflash_config" in config
            or config.get("speculators_model_type") == "dflash" or config.get("draft_type") == "dflash")


def draft_type_of(config: dict) -> str:
    """"dflash" or "eagle3", from a draft's config.json: the one place every wing asks."""
    return "dflash" if is_dflash(config) else "eagle3"


def layout_of(config: dict) -> str:
    """"speculators" (its own keys) or "zlab" (every other DFlash config.json)."""
    return "speculators" if "speculators_model_type" in config or "transformer_layer_config" in config else "zlab"


def _inner(d: dict) -> dict:
    return d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}


def block_size_of(d: dict):
    """The block size a config records: z-lab's drafts keep it at the top level, newer ones inside
    dflash_config too (llama.cpp's converter reads dflash_config first; both agree or inspect says so)."""
    return _inner(d).get("block_size", d.get("block_size"))


def mask_token_of(d: dict):
    return _inner(d).get("mask_token_id", d.get("mask_token_id"))


def layer_ids_of(d: dict) -> tuple[str, list | None, int]:
    """(the key that holds the target layer ids, the ids as stored, what to add for our input count)."""
    if layout_of(d) == "speculators":
        return "aux_hidden_state_layer_ids", d.get("aux_hidden_state_layer_ids"), 0
    inner = _inner(d)
    if "target_layer_ids" in inner:
        return "dflash_config.target_layer_ids", inner.get("target_layer_ids"), 1
    return "target_layer_ids", d.get("target_layer_ids"), 1


def layer_fields(d: dict) -> dict:
    """The Qwen3 fields of either layout (speculators nests them in transformer_layer_config)."""
    if layout_of(d) == "speculators":
        tl = d.get("transformer_layer_config")
        return dict(tl) if isinstance(tl, dict) else {}
    return d


def rope_of(f: dict) -> dict:
    rp = f.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        out = dict(rp)
    else:
        out = dict(f.get("rope_scaling") or {})
        out.setdefault("rope_type", out.pop("type", "default"))
        out["rope_theta"] = float(f.get("rope_theta", 10000.0))
    out.setdefault("rope_type", "default")
    return out
