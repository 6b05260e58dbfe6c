"""What every format's draft goes through once its reader mapped it onto our names: tensor names,
the supported architecture, the layer ids, RoPE, max positions, the vocabulary maps and shapes,
each value a file does not record inferred and said in the ``ReadNote``."""

from __future__ import annotations

import torch

from ...model.layers import default_layer_ids, num_layers
from ..export import (
    CONFIG,
    FC_NORM_WEIGHTS,
    INPUT_NORM_WEIGHT,
    LEGACY_FC_NORM,
    OPTION_WEIGHTS,
    OPTIONAL_WEIGHTS,
    REQUIRED_WEIGHTS,
    expected_shapes,
    options_from_json,
)
from .common import FormatError, ReadNote


def rename(tensors: dict, note: ReadNote) -> dict:
    out = {}
    dropped = 0
    legacy = []
    for k, v in tensors.items():
        n = k[len("model."):] if k.startswith("model.") else k
        if n.startswith("layers.0."):
            n = "midlayer." + n[len("layers.0."):]
        head = n.split(".", 1)[0]
        if head in LEGACY_FC_NORM:  # SGLang 0.5.23's legacy names (llama_eagle3.py load_weights)
            legacy.append(head)
            n = LEGACY_FC_NORM[head] + n[len(head):]
        if n.startswith("target_model."):  # a training dump that carries the target too
            dropped += 1
            continue
        out[n] = v
    if any(k.startswith("model.") for k in tensors):
        note.inferred.append("tensor names read without their 'model.' prefix")
    if dropped:
        note.ignored.append(f"{dropped} target_model.* tensors (the target's own weights)")
    if legacy:
        note.inferred.append(f"{', '.join(sorted(legacy))} read as fc_norm.0/1/2 (SGLang 0.5.23's legacy names)")
    return out


def check_supported(cfg: dict, tensors: dict, note: ReadNote):
    where = note.weights_file or note.path
    if (cfg.get("num_hidden_layers") or 1) != 1 or any(k.startswith(("layers.1.", "midlayer.1")) for k in tensors):
        raise FormatError(f"{note.path}/{CONFIG}: num_hidden_layers {cfg.get('num_hidden_layers')}: "
                          "an EAGLE-3 draft here has one decoder layer")
    _check_options(cfg, tensors, note)
    if cfg.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
        raise FormatError(f"{note.path}/{CONFIG}: tie_word_embeddings is true and there is no lm_head.weight")
    if cfg.get("attention_bias") or cfg.get("mlp_bias") or any(k.endswith(".bias") for k in tensors):
        raise FormatError(f"{where}: has bias terms (attention_bias/mlp_bias/*.bias): this package's draft has none")
    known = set(REQUIRED_WEIGHTS) | set(OPTIONAL_WEIGHTS) | set(OPTION_WEIGHTS)
    unknown = sorted(k for k in tensors if k not in known)
    if unknown:
        raise FormatError(f"{where}: tensors this package's draft does not have: {unknown[:4]}"
                          f"{' ...' if len(unknown) > 4 else ''}")
    for k in ("fc.weight", "lm_head.weight"):
        if k not in tensors:
            raise FormatError(f"{where}: {k} is missing")
    missing = [k for k in REQUIRED_WEIGHTS if k not in tensors and k not in ("d2t", "t2d")]
    if missing:
        raise FormatError(f"{where}: missing tensors {missing}")
    if "auto_map" in cfg:
        note.ignored.append("auto_map in config.json (no code from a draft repository is run)")


def _check_options(cfg: dict, tensors: dict, note: ReadNote):
    """The norms before fc: tensors and config flags must agree. Norms without their flag are
    ignored by the engines (the draft is served wrongly): read them with the flag and say so."""
    where = note.weights_file or note.path
    opts = options_from_json(cfg)
    if opts["fc_norm"] and opts["norm_before_fc"]:
        raise FormatError(f"{note.path}/{CONFIG}: both fc_norm and norm_before_fc are set: speculators 0.9.0 "
                          "refuses the pair and this package's draft has one or the other")
    for flag, names in (("fc_norm", FC_NORM_WEIGHTS), ("norm_before_fc", [INPUT_NORM_WEIGHT])):
        present = [k for k in names if k in tensors]
        if opts[flag] and len(present) != len(names):
            missing = [k for k in names if k not in tensors]
            raise FormatError(f"{where}: config.json sets {flag} but {missing} are missing (the engines would "
                              "leave those norms at ones)")
        if present and not opts[flag]:
            if len(present) != len(names):
                raise FormatError(f"{where}: holds {present} but not {[k for k in names if k not in present]}")
            cfg[flag] = True
            note.inferred.append(f"{flag} = true: the files hold {', '.join(present)} but config.json does not set "
                                 f"{flag}, so vLLM and SGLang would not apply them")


def read_layer_ids(cfg: dict, note: ReadNote, target_config, override) -> list[int]:
    if override is not None:
        ids = [int(j) for j in override]
        note.inferred.append(f"layer ids {ids} from --layers (input of decoder layer j)")
        return ids
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top:
        return [int(j) for j in top]
    if nested:
        ids = [int(k) + 1 for k in nested]
        note.inferred.append(f"layer ids {ids}: eagle_config's {list(nested)} count 'output of layer k' "
                             "(SGLang adds one); the top-level key vLLM reads was missing")
        return ids
    if target_config is None:
        raise FormatError(f"{note.path}/{CONFIG} records no layer ids: pass --model TARGET (the engines' default "
                          "(2, N//2, N-3) is then taken from its layer count) or --layers j,j,j")
    n = num_layers(target_config)
    ids = list(default_layer_ids(n))
    note.inferred.append(f"layer ids {ids}: not recorded in the files; the default (2, N//2, N-3) for this "
                         f"{n}-layer target, which the reference code and the engines capture without the keys")
    return ids


def rope(cfg: dict) -> dict:
    """One rope_parameters dict from either spelling (transformers 5 or the older keys)."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        out = dict(rp)
    else:
        out = dict(cfg.get("rope_scaling") or {})
    out["rope_type"] = out.pop("type", None) or out.get("rope_type") or "default"
    theta = out.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    out["rope_theta"] = float(theta)
    return out


def fit_positions(cfg: dict, target_config, note: ReadNote):
    from ...core.hf_utils import text_config

    tmax = getattr(text_config(target_config), "max_position_embeddings", None)
    have = cfg.get("max_position_embeddings")
    if tmax and (have is None or have < tmax):
        cfg["max_position_embeddings"] = tmax
        note.inferred.append(f"max_position_embeddings {tmax} (the target's; the files say {have}): drafting "
                             "would otherwise stop past it")


def vocab_maps(dcfg, tensors: dict, note: ReadNote):
    where = note.weights_file or note.path
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    n, v = dcfg.draft_vocab_size, dcfg.vocab_size
    if d2t is None and t2d is None:
        if n != v:
            raise FormatError(f"{where}: no d2t/t2d although the draft vocab ({n}) is smaller than the "
                              f"target's ({v}): which tokens it predicts is unknown")
        tensors["d2t"] = torch.zeros(n, dtype=torch.long)
        tensors["t2d"] = torch.ones(v, dtype=torch.bool)
        note.inferred.append("d2t = zeros and t2d = all true: no vocab maps in the files, full vocabulary")
        return
    if d2t is None:
        ids = torch.nonzero(t2d.bool()).flatten()
        tensors["d2t"] = ids - torch.arange(ids.numel())
        note.inferred.append("d2t from t2d (draft id i -> the i-th token t2d marks)")
        return
    d2t = d2t.long()
    if t2d is None:
        t2d = torch.zeros(v, dtype=torch.bool)
        target_ids = torch.arange(d2t.numel()) + d2t
        if bool(((target_ids < 0) | (target_ids >= v)).any()):
            raise FormatError(f"{where}: d2t maps draft ids outside the target vocabulary")
        t2d[target_ids] = True
        tensors["t2d"] = t2d
        note.inferred.append("t2d from d2t (t2d[i + d2t[i]] = true): the files have d2t only")
    if tensors["d2t"].dtype != torch.int64 or tensors["t2d"].dtype != torch.bool:
        note.inferred.append(f"d2t/t2d cast to int64/bool (stored {tensors['d2t'].dtype}/{tensors['t2d'].dtype})")
    tensors["d2t"] = tensors["d2t"].long()
    tensors["t2d"] = tensors["t2d"].bool()
    ids = torch.arange(n) + tensors["d2t"]
    if int(tensors["t2d"].sum()) != n or not bool(tensors["t2d"][ids.clamp(0, v - 1)].all()):
        raise FormatError(f"{where}: d2t and t2d disagree (draft + d2t[draft] is not the set t2d marks)")


def check_shapes(dcfg, tensors: dict, note: ReadNote):
    shapes = expected_shapes(dcfg)
    for k, t in tensors.items():
        if k in shapes and tuple(t.shape) != shapes[k]:
            raise FormatError(f"{note.weights_file or note.path}: {k} has shape {tuple(t.shape)}, "
                              f"its config implies {shapes[k]}")
    if dcfg.hidden_size != dcfg.target_hidden_size and "embed_tokens.weight" not in tensors:
        raise FormatError(f"{note.weights_file or note.path}: no embed_tokens.weight although hidden_size != "
                          "target_hidden_size (the target's embedding cannot be shared)")
