"""Every EAGLE-3 draft in the field: read the formats other tools publish, write the ones engines load.

One entry point, ``read_draft(path, target_config=None)``, returns our ``Eagle3Draft`` plus a
``ReadNote`` saying which format it saw and every value it had to infer. ``write_draft`` writes
ours (which vLLM and SGLang both load as-is, docs/design.md §5) or the speculators format.
The formats, what each reader infers and which engine loads what: docs/formats.md.

Each reader follows what the producing project's code writes (file and version named below):

- ``ours``: this package's ``export.save_draft`` (config.json + model.safetensors, both layer-id keys).
- ``eagle``: the EAGLE reference (SafeAILab/EAGLE ``eagle/traineagle3/cnets.py``, ``config.json``):
  ``pytorch_model.bin`` pickle, our tensor names, layer ids not recorded (the reference code
  captures the default (2, N//2, N-3)), sometimes no d2t/t2d for a full vocabulary.
- ``speculators``: vLLM's speculators format (speculators 0.9.0 ``models/eagle3/config.py``,
  ``convert/eagle/eagle3_converter.py``; vLLM 0.32.0 ``transformers_utils/configs/speculators/algos.py``):
  ``Eagle3Speculator`` with ``transformer_layer_config``, ``speculators_config``, top-level
  ``draft_vocab_size`` / ``eagle_aux_hidden_state_layer_ids``, ``layers.0.*`` names, and
  ``norm_before_residual`` that vLLM defaults to True when the key is missing.
- ``modelopt``: NVIDIA ModelOpt 0.47.0 ``torch/export/plugins/hf_spec_export.py``: ``layers.0.*``
  names, ``d2t`` without ``t2d`` (and no d2t at all for a full vocabulary), ids only in
  ``eagle_config`` in the "output of layer k" count, RoPE scaling injected at export
  (``eagle_export_rope_scaling``).
- ``specforge``: SpecForge 0.2.0 ``export/to_sglang.py``: our names, ``embed_tokens`` dropped,
  layer ids only in ``eagle_config`` (SGLang adds one) or, when the run set them, nowhere.

Safety: a ``.bin`` is loaded with ``torch.load(weights_only=True)`` only, and no code from a
draft repository is ever run; a file that needs more is refused with one line naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model.draft import OPTION_KEYS, Eagle3Draft
from ..core.errors import Eagle3Error
from .draft_check import CorruptDraft, config_problems, read_weights
from .export import (
    CONFIG, FC_NORM_WEIGHTS, INPUT_NORM_WEIGHT, LEGACY_FC_NORM, METADATA_KEY, OPTION_WEIGHTS, OPTIONAL_WEIGHTS,
    REQUIRED_WEIGHTS, WEIGHTS, check_draft, draft_config_from_json, draft_from_tensors, expected_shapes,
    exported_state_dict, options_from_json, save_draft)
from ..core.io_utils import ensure_dir, save_safetensors, write_json
from ..model.layers import default_layer_ids, num_layers

FORMATS = {
    "ours": "eagle3 (this package)",
    "eagle": "EAGLE reference (SafeAILab/EAGLE, pytorch_model.bin)",
    "speculators": "speculators (vLLM's Eagle3Speculator format)",
    "modelopt": "NVIDIA ModelOpt export",
    "specforge": "SpecForge / SGLang export",
}
# --to targets: ours serves both engines (docs/formats.md); speculators is vLLM's own format.
TARGETS = ("ours", "vllm", "sglang", "speculators")
PICKLE = "pytorch_model.bin"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config layout the writer follows


class FormatError(Eagle3Error, ValueError):
    """A draft this package cannot read (or write) faithfully: one line naming the file."""


@dataclass
class ReadNote:
    format: str
    path: str
    weights_file: str = ""
    inferred: list[str] = field(default_factory=list)  # every value not read as such from the files
    ignored: list[str] = field(default_factory=list)  # tensors or keys dropped, with why
    norm_before_residual: bool = False
    options: dict = field(default_factory=dict)  # the architecture options that are on (DraftConfig.options)
    target: str | None = None  # the target the files name, if any
    embed: str = "draft"  # where embed_tokens came from: draft | target | placeholder

    @property
    def label(self) -> str:
        return FORMATS.get(self.format, self.format)

    def lines(self) -> list[str]:
        out = [f"format: {self.label} ({self.weights_file or self.path})"]
        out += [f"inferred: {x}" for x in self.inferred]
        out += [f"ignored: {x}" for x in self.ignored]
        return out


# ---------------------------------------------------------------------------- detection

def detect_format(path: str | Path) -> str:
    """The format of a draft directory, from its config.json and weight file names."""
    d = Path(path)
    if not d.is_dir():
        raise FormatError(f"{d} is not a directory")
    if not (d / CONFIG).exists():
        raise FormatError(f"{d} has no {CONFIG}: not a draft directory")
    cfg = _json(d / CONFIG)
    if "speculators_model_type" in cfg or "speculators_config" in cfg:
        return "speculators"
    if not (d / WEIGHTS).exists():
        if (d / PICKLE).exists():
            return "eagle"
        _refuse_other_weights(d)
    names = set(_safetensors_names(d / WEIGHTS))
    if any(n.startswith("layers.") for n in names):
        return "modelopt"
    if METADATA_KEY in cfg or ("eagle_aux_hidden_state_layer_ids" in cfg and "embed_tokens.weight" not in names):
        return "ours"
    return "specforge"


def _refuse_other_weights(d: Path):
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (d / index).exists():
            raise FormatError(f"{d / index}: sharded draft weights are not supported (a draft fits one file)")
    if (d / "training_state.pt").exists():
        raise FormatError(f"{d / 'training_state.pt'}: a SpecForge training checkpoint (a full pickle); "
                          "export it with SpecForge's exporter first")
    other = sorted(p.name for p in d.iterdir() if p.suffix in (".pt", ".pth", ".bin", ".pkl", ".ckpt"))
    if other:
        raise FormatError(f"{d / other[0]}: not a draft weight file this package reads "
                          f"(expected {WEIGHTS} or {PICKLE})")
    raise FormatError(f"{d} has neither {WEIGHTS} nor {PICKLE}")


def _json(p: Path) -> dict:
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise FormatError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise FormatError(f"{p}: not a JSON object")
    return d


def _safetensors_names(p: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # noqa: BLE001 - any corrupt header is one line
        raise FormatError(f"{p}: not a readable safetensors file ({str(e).splitlines()[0] if str(e) else e})") from None


def _load_tensors(d: Path, note: ReadNote) -> dict[str, torch.Tensor]:
    if (d / WEIGHTS).exists():
        note.weights_file = str(d / WEIGHTS)
        return read_weights(d / WEIGHTS)
    p = d / PICKLE
    note.weights_file = str(p)
    return load_pickle_weights(p)


def load_pickle_weights(p: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin``, with ``weights_only=True`` only: plain tensors or it is refused."""
    try:
        obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError...: all one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FormatError(f"{p}: refused: it does not load with torch.load(weights_only=True), so it needs "
                          f"more than plain tensors ({first[:160]})") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise FormatError(f"{p}: refused: not a flat dict of tensors")
    return dict(obj)


# ---------------------------------------------------------------------------- reading

def read_draft(path: str | Path, target_config=None, target=None, dtype: torch.dtype | None = None,
               layer_ids=None, device: str | torch.device = "cpu") -> tuple[Eagle3Draft, ReadNote]:
    """Read a draft in any known format into our ``Eagle3Draft``.

    ``target_config`` lets the reader infer what the files do not record (layer ids, max
    positions); ``target`` (a loaded HF model) supplies the embedding a draft does not ship.
    ``dtype=None`` keeps the stored dtype (bit-exact conversions); ``layer_ids`` overrides
    the layer ids (required when neither the files nor a target config give them).
    """
    d = Path(path)
    fmt = detect_format(d)
    note = ReadNote(format=fmt, path=str(d))
    raw = _json(d / CONFIG)
    broken = config_problems(raw, required=False)  # the types the format readers below rely on
    if broken:
        raise CorruptDraft(f"{d / broken[0]}")
    tensors = _load_tensors(d, note)
    cfg, tensors = _NORMALISE[fmt](raw, tensors, note)
    tensors = _rename(tensors, note)
    _check_supported(cfg, tensors, note)
    # Every key and tensor against the contract, before anything is built from them (draft_check).
    ends = (raw.get(METADATA_KEY) or {}).get("end_token_ids")
    check_draft(cfg, tensors, d, note.weights_file, end_token_ids=ends)
    cfg["eagle_aux_hidden_state_layer_ids"] = _layer_ids(cfg, note, target_config, layer_ids)
    if target_config is not None:
        _fit_positions(cfg, target_config, note)
    cfg["rope_parameters"] = _rope(cfg)
    dcfg = draft_config_from_json(cfg)
    _vocab_maps(dcfg, tensors, note)
    _check_shapes(dcfg, tensors, note)
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


_NORMALISE = {"ours": _ours, "eagle": _eagle, "speculators": _speculators, "modelopt": _modelopt,
              "specforge": _specforge}


def _rename(tensors: dict, note: ReadNote) -> dict:
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


def _check_supported(cfg: dict, tensors: dict, note: ReadNote):
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


def _layer_ids(cfg: dict, note: ReadNote, target_config, override) -> list[int]:
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


def _rope(cfg: dict) -> dict:
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


def _fit_positions(cfg: dict, target_config, note: ReadNote):
    from ..core.hf_utils import text_config

    tmax = getattr(text_config(target_config), "max_position_embeddings", None)
    have = cfg.get("max_position_embeddings")
    if tmax and (have is None or have < tmax):
        cfg["max_position_embeddings"] = tmax
        note.inferred.append(f"max_position_embeddings {tmax} (the target's; the files say {have}): drafting "
                             "would otherwise stop past it")


def _vocab_maps(dcfg, tensors: dict, note: ReadNote):
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


def _check_shapes(dcfg, tensors: dict, note: ReadNote):
    shapes = expected_shapes(dcfg)
    for k, t in tensors.items():
        if k in shapes and tuple(t.shape) != shapes[k]:
            raise FormatError(f"{note.weights_file or note.path}: {k} has shape {tuple(t.shape)}, "
                              f"its config implies {shapes[k]}")
    if dcfg.hidden_size != dcfg.target_hidden_size and "embed_tokens.weight" not in tensors:
        raise FormatError(f"{note.weights_file or note.path}: no embed_tokens.weight although hidden_size != "
                          "target_hidden_size (the target's embedding cannot be shared)")


# ---------------------------------------------------------------------------- norm_before_residual

def norm_before_residual(draft: Eagle3Draft) -> bool:
    """speculators'/vLLM's ``norm_before_residual`` (now a ``DraftConfig`` option, docs/design.md §3)."""
    return draft.config.norm_before_residual


# ---------------------------------------------------------------------------- writing

def write_draft(draft: Eagle3Draft, out_dir: str | Path, to: str = "ours", metadata: dict | None = None,
                dtype: torch.dtype | None = None, target_name: str | None = None,
                embed_known: bool = True) -> Path:
    """Write ``draft`` in the format ``to`` (ours, vllm, sglang: the same files; or speculators).

    ``dtype=None`` keeps the draft's dtype. ``embed_known`` False: the draft's embedding is a
    placeholder (no target was given), so the speculators writer leaves it out (vLLM then
    shares the target's, as for ours).
    """
    if to not in TARGETS:
        raise FormatError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    dtype = dtype or draft.fc.weight.dtype
    if to == "sglang" and norm_before_residual(draft):
        raise FormatError("this draft uses norm_before_residual, which SGLang (0.5.23, models/llama_eagle3.py) "
                          "does not implement: it would be served wrongly; convert --to vllm instead")
    if to == "speculators":
        return _write_speculators(draft, Path(out_dir), dtype, metadata, target_name, embed_known)
    return save_draft(draft, out_dir, metadata=metadata, dtype=dtype)


def _write_speculators(draft: Eagle3Draft, out: Path, dtype, metadata, target_name, embed_known) -> Path:

    from .export import DTYPE_NAMES, engine_config, weights_metadata

    cfg = draft.config
    ours = engine_config(cfg, dtype)
    layer = {k: ours[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
                                  "rope_parameters", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                                  "attention_bias", "mlp_bias", "pad_token_id", "bos_token_id", "eos_token_id")}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                 torch_dtype=DTYPE_NAMES[dtype])
    reduced = cfg.draft_vocab_size != cfg.vocab_size
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name, "architectures": []},
        },
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,  # always explicit: vLLM defaults a missing key to true
        "target_hidden_size": cfg.target_hidden_size if cfg.target_hidden_size != cfg.hidden_size else None,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "torch_dtype": DTYPE_NAMES[dtype],
        METADATA_KEY: dict(metadata or {}),
    }
    tensors = exported_state_dict(draft, dtype)
    if embed_known and "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = draft.embed_tokens.weight.detach().cpu().to(dtype).contiguous()
    if not reduced:  # speculators keeps d2t/t2d only for a reduced vocabulary (DraftVocabMixin)
        tensors.pop("d2t")
        tensors.pop("t2d")
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    ensure_dir(out)
    save_safetensors(tensors, out / WEIGHTS, metadata=weights_metadata(tensors))
    write_json(out / CONFIG, config)
    return out


def convert(path: str | Path, out_dir: str | Path, to: str = "ours", target_config=None, target=None,
            layer_ids=None, dtype: torch.dtype | None = None, target_name: str | None = None) -> tuple[Path, ReadNote]:
    """Read ``path`` (any format) and write it to ``out_dir`` in the format ``to``."""
    if Path(out_dir).resolve() == Path(path).resolve():
        raise FormatError(f"--out {out_dir} is the input draft itself: choose another folder")
    draft, note = read_draft(path, target_config=target_config, target=target, layer_ids=layer_ids)
    raw = _json(Path(path) / CONFIG)
    meta = dict(raw.get(METADATA_KEY) or {}) if note.format == "ours" else {}
    name = target_name or note.target or meta.get("target")
    if name and not meta.get("target"):
        meta["target"] = name
        meta.setdefault("layer_ids", list(draft.config.aux_layer_ids))
    if note.format != "ours" or note.inferred:
        meta["converted_from"] = {"format": note.format, "path": str(path), "inferred": list(note.inferred)}
    out = write_draft(draft, out_dir, to=to, metadata=meta, dtype=dtype, target_name=name,
                      embed_known=note.embed != "placeholder")
    return out, note


def _damaged_ours(path: str | Path) -> bool:
    """Our file layout (config.json and model.safetensors) whose format cannot be read: a
    truncated or garbled file, reported by ``inspect_draft`` with what to do about it."""
    d = Path(path)
    return (d / CONFIG).is_file() and (d / WEIGHTS).is_file()


def as_ours(path: str | Path, target_config=None, say=None) -> str:
    """``path`` itself when it is our format, else a converted copy in a temporary folder
    (removed at exit): how eval and push accept any readable draft."""
    import atexit
    import shutil
    import tempfile

    try:
        fmt = detect_format(path)
    except FormatError:
        if not _damaged_ours(path):
            raise
        return str(path)  # our file names, broken contents: inspect_draft names what is wrong
    if fmt == "ours":
        return str(path)
    tmp = tempfile.mkdtemp(prefix="eagle3-converted-")
    atexit.register(shutil.rmtree, tmp, True)
    _, note = convert(path, Path(tmp) / "draft", "ours", target_config=target_config)
    if say is not None:
        for line in note.lines():
            say(line)
        say(f"converted to this package's format in {tmp}/draft")
    return str(Path(tmp) / "draft")


def inspect_any(path: str | Path, target_config=None):
    """``inspect`` for any format: the engine contracts checked on the directory as it is (what
    an engine would load), the format named, and what a conversion would infer."""
    from .inspector import InspectReport, inspect_draft

    try:
        fmt = detect_format(path)
    except FormatError as e:
        if _damaged_ours(path):  # our layout with a garbled file: the detailed checks say which and why
            return inspect_draft(path, target_config), None
        rep = InspectReport(str(path))
        rep.problems.append(str(e))
        return rep, None
    try:
        _, note = read_draft(path, target_config=target_config)
    except FormatError as e:
        note = ReadNote(format=fmt, path=str(path))
        note.ignored.append(f"not convertible: {e}")
    if fmt == "speculators":
        # vLLM reads it through its speculators config; check the equivalent config of ours.
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            try:
                convert(path, Path(tmp) / "d", "ours", target_config=target_config)
                rep = inspect_draft(Path(tmp) / "d", target_config)
            except FormatError as e:
                rep = InspectReport(str(path))
                rep.problems.append(str(e))
        rep.path = str(path)
        rep.summary["engines"] = {"vllm": rep.ok, "sglang": False}
    else:
        rep = inspect_draft(path, target_config)
        if note.norm_before_residual:
            rep.summary.setdefault("engines", {})["sglang"] = False
        if fmt == "specforge" and (_json(Path(path) / CONFIG)).get("norm_output") is True:
            rep.problems.append("config: norm_output is true, which SpecForge 0.2.0 writes for a draft whose lm_head "
                                "reads norm(a) and whose next step is fed a; vLLM and SGLang feed norm(a) "
                                "(EAGLE-3.1) instead: `eagle3 convert` writes the config they serve as trained")
    rep.summary["format"] = fmt
    rep.summary["read_note"] = note.lines()
    return rep, note


# ---------------------------------------------------------------------------- train --init-from

def init_from(draft: Eagle3Draft, vocab, counts: torch.Tensor, cfg, target_config, say=None):
    """``train --init-from DRAFT``: start from an existing draft (any format) instead of random weights.

    ``draft`` and ``vocab`` are what the trainer just built (fresh weights, the vocabulary of
    this store). ``--init-vocab keep`` keeps the source's vocabulary: its d2t, t2d and lm_head
    rows travel together. ``--init-vocab new`` keeps the store's vocabulary and remaps the
    lm_head rows: a token in both vocabularies gets the source's row, a new one keeps the
    fresh initialisation. Returns (draft, vocab) for the trainer.
    """
    from dataclasses import replace

    from ..model.vocab import DraftVocab

    mode = getattr(cfg, "init_vocab", "keep") or "keep"  # keep or new: TrainConfig.validate checked it
    src, note = read_draft(cfg.init_from, target_config=target_config, dtype=torch.float32)
    for line in note.lines():
        say and say(f"init-from: {line}")
    a, b = src.config, draft.config
    for key in ("hidden_size", "target_hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size"):
        if getattr(a, key) != getattr(b, key):
            raise FormatError(f"{cfg.init_from}: {key} {getattr(a, key)}, this target needs {getattr(b, key)}")
    if tuple(a.aux_layer_ids) != tuple(b.aux_layer_ids):
        raise FormatError(f"{cfg.init_from} reads layers {list(a.aux_layer_ids)}, the store holds "
                          f"{list(b.aux_layer_ids)}: its fc would mix the wrong streams")
    # Architecture options (docs/design.md §3): the source's are kept (its weights were trained with
    # them), the ones this run asks for are added (their norms start at ones).
    opts = {k: getattr(a, k) or getattr(b, k) for k in OPTION_KEYS}
    if opts["fc_norm"] and opts["norm_before_fc"]:
        raise FormatError(f"{cfg.init_from} uses {'fc_norm' if a.fc_norm else 'norm_before_fc'}; this run asks for "
                          f"{'fc_norm' if b.fc_norm else 'norm_before_fc'}: the two are mutually exclusive")
    if a.options():
        say and say(f"init-from: its options {', '.join(a.options())} are kept")
    state = {k: v for k, v in src.state_dict().items() if k not in ("embed_tokens.weight",)}
    if mode == "keep":
        ids = src.draft_to_target(torch.arange(a.draft_vocab_size))
        out = Eagle3Draft(replace(b, draft_vocab_size=a.draft_vocab_size, **opts), embed_weight=draft.embed_tokens.weight)
        out.load_state_dict(state, strict=False)
        total = int(counts.sum())
        vocab = DraftVocab(ids=ids, coverage=int(counts.long()[ids].sum()) / total if total else 0.0)
        say and say(f"init-from: kept its vocabulary ({a.draft_vocab_size} tokens; d2t, t2d, lm_head unchanged)")
    else:
        out = draft
        if any(opts[k] != getattr(b, k) for k in OPTION_KEYS):
            out = Eagle3Draft(replace(b, **opts), embed_weight=draft.embed_tokens.weight)
            out.load_state_dict(draft.state_dict(), strict=False)  # the fresh weights and this store's vocabulary
        new_ids = vocab.ids.long()
        row_of = torch.full((a.vocab_size,), -1, dtype=torch.long)
        row_of[src.draft_to_target(torch.arange(a.draft_vocab_size))] = torch.arange(a.draft_vocab_size)
        src_rows = row_of[new_ids]
        shared = src_rows >= 0
        head = out.lm_head.weight.detach().clone()
        head[shared] = state["lm_head.weight"][src_rows[shared]].to(head.dtype)
        state = {k: v for k, v in state.items() if k not in ("lm_head.weight", "d2t", "t2d")}
        out.load_state_dict(state, strict=False)
        with torch.no_grad():
            out.lm_head.weight.copy_(head)
        say and say(f"init-from: new vocabulary of {vocab.size} tokens: {int(shared.sum())} lm_head rows copied "
                    f"from the draft, {int((~shared).sum())} new tokens initialised fresh")
    return out, vocab
