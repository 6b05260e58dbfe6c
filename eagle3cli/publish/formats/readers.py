"""``read_draft``: any known format into our ``Eagle3Draft``, through one reader per format that
maps its config and tensors onto ours (normalise.py then checks and infers what every format needs)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...model.draft import Eagle3Draft
from ..draft_check import CorruptDraft, config_problems
from ..export import CONFIG, METADATA_KEY, check_draft, draft_config_from_json, draft_from_tensors
from .common import FormatError, ReadNote, load_tensors, read_json
from .detect import detect_format
from .dflash import is_dflash_dir, read_dflash
from .normalise import check_shapes, check_supported, fit_positions, read_layer_ids, rename, rope, vocab_maps


def read_draft(path: str | Path, target_config=None, target=None, dtype: torch.dtype | None = None,
               layer_ids=None, device: str | torch.device = "cpu") -> tuple[Eagle3Draft, ReadNote]:
    """Read a draft in any known format into our ``Eagle3Draft`` (a DFlash folder, either layout,
    into a ``DFlashDraft``: formats/dflash.py).

    ``target_config`` lets the reader infer what the files do not record (layer ids, max
    positions); ``target`` (a loaded HF model) supplies the embedding a draft does not ship.
    ``dtype=None`` keeps the stored dtype (bit-exact conversions); ``layer_ids`` overrides
    the layer ids (required when neither the files nor a target config give them).
    """
    d = Path(path)
    if is_dflash_dir(d):  # a DFlashDraft, z-lab's or speculators' layout (formats/dflash.py)
        if layer_ids is not None:
            raise FormatError(f"{d}: a DFlash draft records its target layers; --layers is for EAGLE-3 drafts")
        return read_dflash(d, target_config=target_config, target=target, dtype=dtype, device=device)
    fmt = detect_format(d)
    note = ReadNote(format=fmt, path=str(d))
    raw = read_json(d / CONFIG)
    broken = config_problems(raw, required=False)  # the types the format readers below rely on
    if broken:
        raise CorruptDraft(f"{d / broken[0]}")
    tensors = load_tensors(d, note)
    cfg, tensors = READERS[fmt](raw, tensors, note)
    tensors = rename(tensors, note)
    check_supported(cfg, tensors, note)
    # Every key and tensor against the contract, before anything is built from them (draft_check).
    ends = (raw.get(METADATA_KEY) or {}).get("end_token_ids")
    check_draft(cfg, tensors, d, note.weights_file, end_token_ids=ends)
    cfg["eagle_aux_hidden_state_layer_ids"] = read_layer_ids(cfg, note, target_config, layer_ids)
    if target_config is not None:
        fit_positions(cfg, target_config, note)
    cfg["rope_parameters"] = rope(cfg)
    dcfg = draft_config_from_json(cfg)
    vocab_maps(dcfg, tensors, note)
    check_shapes(dcfg, tensors, note)
    draft, embed = draft_from_tensors(dcfg, tensors, target, dtype, strict=True)
    if embed != "draft" or (target is not None and dcfg.hidden_size == dcfg.target_hidden_size):
        note.embed = embed
    note.norm_before_residual = dcfg.norm_before_residual
    note.options = dcfg.options()
    return draft.to(device), note


def _ours(raw: dict, tensors: dict, note: ReadNote):
    note.target = (raw.get(METADATA_KEY) or {}).get("target")
    return dict(raw), tensors


def _eagle(raw: dict, tensors: dict, note: ReadNote):
    return dict(raw), tensors


def _specforge(raw: dict, tensors: dict, note: ReadNote):
    cfg = dict(raw)
    if raw.get("norm_output", True) is False:  # SpecForge: False = logits from the un-normed stream
        raise FormatError(f"{note.path}/{CONFIG}: norm_output is false (lm_head on the un-normed stream): "
                          "this package's draft always applies norm before lm_head")
    if "norm_output" in cfg:
        # SpecForge 0.2.0 (modeling/draft/llama3_eagle.py compute_logits): norm_output true only means
        # lm_head reads norm(a), as every EAGLE-3 draft; its TTT feeds the un-normed a to the next step.
        cfg.pop("norm_output")
        note.inferred.append("norm_output true read as SpecForge 0.2.0 means it (lm_head on norm(a), the un-normed "
                             "a fed to the next step); vLLM and SGLang read the key as EAGLE-3.1's normed feedback, "
                             "so a conversion leaves it out")
    return cfg, tensors


def _modelopt(raw: dict, tensors: dict, note: ReadNote):
    cfg = dict(raw)
    ec = raw.get("eagle_config") or {}
    if ec.get("use_aux_hidden_state") is False:
        raise FormatError(f"{note.path}/{CONFIG}: eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 "
                          "draft, not EAGLE-3")
    if (ec.get("parallel_draft_step") or 1) > 1:
        raise FormatError(f"{note.path}/{CONFIG}: parallel_draft_step > 1 (EagleMedusa heads) is not EAGLE-3")
    rs = raw.get("rope_scaling") or {}
    kind = rs.get("rope_type") or rs.get("type")
    if kind not in (None, "default"):
        note.inferred.append(f"rope_scaling {json.dumps(rs, sort_keys=True)} taken as exported: ModelOpt injects "
                             "eagle_export_rope_scaling at export when training used default RoPE, and the "
                             "engines serve the draft with it")
    cfg["norm_before_residual"] = False
    return cfg, tensors


def _speculators(raw: dict, tensors: dict, note: ReadNote):
    if raw.get("speculators_model_type", "eagle3") != "eagle3":
        raise FormatError(f"{note.path}/{CONFIG}: speculators_model_type {raw.get('speculators_model_type')!r}; "
                          "only eagle3 is an EAGLE-3 draft")
    tl = raw.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise FormatError(f"{note.path}/{CONFIG}: no transformer_layer_config block")
    if tl.get("model_type", "llama") != "llama":
        raise FormatError(f"{note.path}/{CONFIG}: transformer_layer_config.model_type {tl.get('model_type')!r}: "
                          "only the Llama draft layer is supported (a Qwen3 layer adds q/k norms)")
    cfg = dict(tl)
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):  # top-level keys (vLLM 0.32.0 speculators/algos.py)
        cfg.pop(flag, None)
        if raw.get(flag):
            cfg[flag] = True
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    cfg["draft_vocab_size"] = raw.get("draft_vocab_size") or tl.get("vocab_size")
    if raw.get("target_hidden_size"):
        cfg["target_hidden_size"] = raw["target_hidden_size"]
    cfg.pop("eagle_config", None)
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        cfg["eagle_aux_hidden_state_layer_ids"] = list(raw["eagle_aux_hidden_state_layer_ids"])
    else:
        cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    if "norm_before_residual" in raw:
        cfg["norm_before_residual"] = bool(raw["norm_before_residual"])
    else:
        cfg["norm_before_residual"] = True
        note.inferred.append("norm_before_residual = true: the key is missing and vLLM 0.32.0 "
                             "(speculators/algos.py) defaults it to true (speculators 0.9.0's own default is false)")
    cfg.setdefault("torch_dtype", raw.get("torch_dtype") or tl.get("torch_dtype") or tl.get("dtype"))
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    note.target = verifier
    for k in ("verifier_lm_head.weight", "verifier_norm.weight"):
        if k in tensors:
            tensors = {n: t for n, t in tensors.items() if n != k}
            note.ignored.append(f"{k} (the verifier's own copy, not part of the draft)")
    return cfg, tensors


READERS = {  # format -> its reader: (config.json, tensors) in our names
   "ours": _ours, "eagle": _eagle, "speculators": _speculators, "modelopt": _modelopt,
              "specforge": _specforge}
