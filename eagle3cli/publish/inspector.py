"""Validate any EAGLE-3 draft directory against the engines' contracts (docs/design.md §2-§5).

Each problem is one line a user can act on. Used by ``eagle3 inspect``, and as the gate in
front of ``eval`` (draft/target mismatch) and ``push`` (never publish a broken draft).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.hf_utils import text_config
from ..engines import engine_support
from ..model.layers import default_layer_ids, num_layers
from .dflash_check import inspect_dflash
from .dflash_export import is_dflash
from .draft_check import REQUIRED_KEYS, UnreadableWeights, config_problems, read_weights, tensor_problems
from .export import (
    CONFIG,
    FC_NORM_WEIGHTS,
    INPUT_NORM_WEIGHT,
    LEGACY_FC_NORM,
    METADATA_KEY,
    OPTIONAL_WEIGHTS,
    WEIGHTS,
    expected_shapes,
    geometry,
    options_from_json,
    required_weights,
)
from .formats.common import FormatError, ReadNote, read_json
from .formats.detect import detect_format
from .formats.readers import read_draft
from .formats.writers import convert, damaged_ours

ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}


@dataclass
class InspectReport:
    path: str
    problems: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def inspect_draft(draft_dir: str | Path, target_config=None) -> InspectReport:
    rep = InspectReport(str(draft_dir))
    cfg = _read_config(Path(draft_dir), rep)
    if cfg is None:
        return rep
    if is_dflash(cfg):  # its own contract (publish/dflash_check.py)
        rep.problems, rep.summary = inspect_dflash(draft_dir, cfg, target_config)
        return rep
    broken = config_problems(cfg, required=False)  # wrong types or absurd values: nothing below can use them
    if broken:
        rep.problems += broken
        rep.summary["engines"] = {"vllm": False, "sglang": False}
        return rep
    _check_config(cfg, rep)
    ids = _check_layer_ids(cfg, rep)
    tensors = _read_tensors(Path(draft_dir), rep)
    if tensors is not None and all(k in cfg for k in REQUIRED_KEYS):
        _check_tensors(cfg, tensors, rep)
    if target_config is not None:
        _check_against_target(cfg, ids, target_config, rep)
    missing = engine_support.unsupported_options(rep.summary.get("options") or {})
    rep.summary["engines"] = {
        "vllm": "eagle_aux_hidden_state_layer_ids" in cfg and not _has_weight_problem(rep)
        and not missing[engine_support.VLLM],
        "sglang": bool((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        and not _has_weight_problem(rep) and not missing[engine_support.SGLANG],
    }
    return rep


def _has_weight_problem(rep: InspectReport) -> bool:
    return any(p.startswith(("tensor", "weights", "d2t", "t2d", "shape")) for p in rep.problems)


def _read_config(d: Path, rep: InspectReport) -> dict | None:
    p = d / CONFIG
    if not d.is_dir():
        rep.problems.append(f"{d} is not a directory")
        return None
    if not p.exists():
        rep.problems.append(f"config: {CONFIG} is missing")
        return None
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        rep.problems.append(f"config: {CONFIG} is not valid JSON ({e})")
        return None
    if not isinstance(cfg, dict):
        rep.problems.append(f"config: {CONFIG} holds a JSON {type(cfg).__name__}, engines expect an object")
        return None
    return cfg


def _check_config(cfg: dict, rep: InspectReport):
    archs = cfg.get("architectures") or []
    if not ARCHITECTURES.intersection(archs):
        rep.problems.append(f"config: architectures is {archs}, engines expect ['LlamaForCausalLMEagle3']")
    if cfg.get("model_type") != "llama":
        rep.problems.append(f"config: model_type is {cfg.get('model_type')!r}, engines expect 'llama'")
    if cfg.get("num_hidden_layers") != 1:
        rep.problems.append(f"config: num_hidden_layers is {cfg.get('num_hidden_layers')}, an EAGLE-3 draft has 1")
    for k in REQUIRED_KEYS:
        if k not in cfg:
            rep.problems.append(f"config: required key {k!r} is missing")
    v, dv = cfg.get("vocab_size"), cfg.get("draft_vocab_size") or cfg.get("vocab_size")
    if cfg.get("tie_word_embeddings") and dv != v:
        rep.problems.append(f"config: tie_word_embeddings is true with a reduced draft vocab ({dv} of {v}): "
                            "engines would tie lm_head to the embedding; set it to false")
    if "draft_vocab_size" not in cfg:
        rep.problems.append("config: draft_vocab_size is missing (engines then assume the full vocab)")
    if cfg.get("attention_bias"):
        rep.problems.append("config: attention_bias is true; EAGLE-3 drafts have no attention bias")
    opts = options_from_json(cfg)
    if opts["fc_norm"] and opts["norm_before_fc"]:
        rep.problems.append("config: fc_norm and norm_before_fc are both set: speculators refuses the pair and "
                            "vLLM/SGLang would apply both norms in turn")
    if cfg.get("use_aux_norm") and not cfg.get("fc_norm"):
        rep.problems.append("config: use_aux_norm is SGLang's legacy name of fc_norm; vLLM reads only fc_norm "
                            "(and would skip the norms): set \"fc_norm\": true")
    rep.summary["options"] = {k: v for k, v in opts.items() if v}
    rep.summary["variant"] = "eagle3.1" if opts["fc_norm"] and opts["norm_output"] else "eagle3"
    rep.summary.update(
        hidden_size=cfg.get("hidden_size"),
        target_hidden_size=cfg.get("target_hidden_size", cfg.get("hidden_size")),
        vocab_size=v,
        draft_vocab_size=dv,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


def _check_layer_ids(cfg: dict, rep: InspectReport) -> tuple[int, ...] | None:
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    sgl = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top is None:
        rep.problems.append("config: eagle_aux_hidden_state_layer_ids is missing (vLLM then takes "
                            "eagle_config's ids without adding 1, one layer off, or its defaults)")
    if sgl is None:
        rep.problems.append("config: eagle_config.eagle_aux_hidden_state_layer_ids is missing (SGLang then "
                            "captures its default layers)")
    ids = tuple(top) if top is not None else (tuple(k + 1 for k in sgl) if sgl is not None else None)
    if ids is not None:  # three, agreeing (draft_check.config_problems)
        rep.summary["layers_j"] = list(ids)
        rep.summary["layers_j_minus_1"] = [j - 1 for j in ids]
    return ids


def _read_tensors(d: Path, rep: InspectReport) -> dict[str, tuple] | None:
    p = d / WEIGHTS
    if not p.exists():
        pickles = [x.name for x in d.glob("*.bin")] + [x.name for x in d.glob("*.pt")]
        extra = f" (found {pickles}: pickle files are not loaded; convert to safetensors)" if pickles else ""
        rep.problems.append(f"weights: {WEIGHTS} is missing{extra}")
        return None
    try:
        return read_weights(p)
    except UnreadableWeights as e:  # truncated (an interrupted copy), not safetensors, changed after export
        what = f"is {e.reason}" if e.reason.startswith("unreadable") else f": {e.reason}"
        rep.problems.append(f"weights: {WEIGHTS} {what}: export or download it again".replace(" :", ":"))
        return None


def _check_tensors(cfg: dict, tensors: dict[str, torch.Tensor], rep: InspectReport):
    dcfg = geometry(cfg)
    required = required_weights(dcfg)
    flags = {n: "fc_norm" for n in FC_NORM_WEIGHTS} | {INPUT_NORM_WEIGHT: "norm_before_fc"}
    for name in tensors:
        if name.startswith("model."):
            rep.problems.append(f"tensor {name}: has a 'model.' prefix; engines expect {name[len('model.'):]}")
        elif name in flags and name not in required:
            rep.problems.append(f"tensor {name}: config.json does not set {flags[name]}, so vLLM and SGLang "
                                f"ignore this norm and serve the draft without it; set \"{flags[name]}\": true")
        elif name.split(".", 1)[0] in LEGACY_FC_NORM:
            rep.problems.append(f"tensor {name}: SGLang's legacy name for {LEGACY_FC_NORM[name.split('.', 1)[0]]}; "
                                "vLLM does not know it: `eagle3 convert` renames it")
        elif name not in required and name not in OPTIONAL_WEIGHTS:
            rep.problems.append(f"tensor {name}: unknown name (SGLang silently drops it)")
    for name in required:
        if name not in tensors and f"model.{name}" not in tensors:
            what = (f"the config sets {flags[name]}, the engines then leave that norm at ones" if name in flags
                    else "the engine leaves that weight random")
            rep.problems.append(f"tensor {name}: missing ({what})")
    ends = (cfg.get(METADATA_KEY) or {}).get("end_token_ids")
    # shapes, dtypes, finite values, vocab maps: the readers' own check (draft_check)
    rep.problems += tensor_problems(dcfg, tensors, expected_shapes(dcfg), end_token_ids=ends)
    if dcfg.hidden_size != dcfg.target_hidden_size and "embed_tokens.weight" not in tensors:
        rep.problems.append("tensor embed_tokens.weight: missing although hidden_size != target_hidden_size "
                            "(the target's embedding cannot be shared)")
    _check_vocab_maps(dcfg, tensors, rep)
    floats = {str(t.dtype).replace("torch.", "") for t in tensors.values() if t.is_floating_point()}
    rep.summary["weights_dtype"] = sorted(floats)
    rep.summary["parameters"] = sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d"))


def _check_vocab_maps(dcfg, tensors: dict[str, torch.Tensor], rep: InspectReport):
    """The dtypes the engines' files carry (the readers cast other integer types, and the maps'
    contents are checked by ``draft_check.vocab_map_problems``)."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is not None and d2t.dtype != torch.int64:
        rep.problems.append(f"d2t: dtype {d2t.dtype}, engines expect int64")
    if t2d is not None and t2d.dtype != torch.bool:
        rep.problems.append(f"t2d: dtype {t2d.dtype}, engines expect bool")


def _check_against_target(cfg: dict, ids, target_config, rep: InspectReport):
    t = text_config(target_config)
    n = num_layers(target_config)
    th = cfg.get("target_hidden_size", cfg.get("hidden_size"))
    if th != t.hidden_size:
        rep.problems.append(f"target: hidden size {t.hidden_size}, the draft was built for {th}")
    if cfg.get("vocab_size") != t.vocab_size:
        rep.problems.append(f"target: vocab size {t.vocab_size}, the draft's vocab_size is {cfg.get('vocab_size')}")
    tmax = getattr(t, "max_position_embeddings", None)
    if tmax and (cfg.get("max_position_embeddings") or 0) < tmax:
        rep.problems.append(f"config: max_position_embeddings {cfg.get('max_position_embeddings')} is smaller than "
                            f"the target's {tmax} (drafting stops past it)")
    if ids is not None:
        if any(j < 0 or j >= n for j in ids):
            rep.problems.append(f"target: layer ids {list(ids)} out of range for a {n}-layer target (0..{n - 1})")
        rep.summary["target_default_layers_j"] = list(default_layer_ids(n)) if n >= 3 else None
    from ..model.draft import target_rope_parameters

    trope = target_rope_parameters(t)
    dtheta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    if dtheta is not None and abs(float(dtheta) - float(trope["rope_theta"])) > 1e-6 * float(trope["rope_theta"]):
        rep.problems.append(f"config: rope_theta {dtheta} differs from the target's {trope['rope_theta']}")
    rep.summary["target_layers"] = n
    # Whether each engine takes EAGLE-3 for this target at all (not a problem of the draft: eval runs it).
    rep.summary["target_support"] = {e: list(v) for e, v in engine_support.target_support(target_config).items()}


def inspect_any(path: str | Path, target_config=None):
    """``inspect`` for any format: the engine contracts checked on the directory as it is (what
    an engine would load), the format named, and what a conversion would infer. A DFlash draft
    (either layout) is inspected as it is: (report, None)."""
    if dflash_folder(path):
        return inspect_draft(path, target_config), None
    try:
        fmt = detect_format(path)
    except FormatError as e:
        if damaged_ours(path):  # our layout with a garbled file: the detailed checks say which and why
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
        if fmt == "specforge" and (read_json(Path(path) / CONFIG)).get("norm_output") is True:
            rep.problems.append("config: norm_output is true, which SpecForge 0.2.0 writes for a draft whose lm_head "
                                "reads norm(a) and whose next step is fed a; vLLM and SGLang feed norm(a) "
                                "(EAGLE-3.1) instead: `eagle3 convert` writes the config they serve as trained")
    rep.summary["format"] = fmt
    rep.summary["read_note"] = note.lines()
    return rep, note


def dflash_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a DFlash draft (by its config.json: ``dflash_export.is_dflash``)."""
    p = Path(path) / CONFIG
    try:
        return p.is_file() and is_dflash(json.loads(p.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False
