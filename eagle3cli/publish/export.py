"""Writing and reading draft directories that SGLang and vLLM load unchanged (docs/design.md §3-§5).

A draft directory holds ``config.json`` and ``model.safetensors``. The config is a Llama
config with one layer plus the EAGLE-3 keys; the safetensors names carry no ``model.`` prefix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..core.errors import Eagle3Error
from ..core.io_utils import ensure_dir, save_safetensors, write_json
from ..model.draft import DraftConfig, Eagle3Draft
from .draft_check import DIGEST_KEY, CorruptDraft, config_problems, read_weights, tensor_problems, weights_digest

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
METADATA_KEY = "eagle3_training"  # block in config.json recording how the draft was trained

# Exact tensor names of an EAGLE-3 draft (docs/design.md §3). embed_tokens only when H != Ht.
LAYER_WEIGHTS = [
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
]
REQUIRED_WEIGHTS = ["fc.weight", *LAYER_WEIGHTS, "norm.weight", "lm_head.weight", "d2t", "t2d"]
OPTIONAL_WEIGHTS = ["embed_tokens.weight"]
# The norms the architecture options add (docs/design.md §3): vLLM 0.32.0 and SGLang 0.5.23
# (models/llama_eagle3.py) load these file names as model.fc_norm.{i}.weight / model.input_norm.weight.
FC_NORM_WEIGHTS = ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]
INPUT_NORM_WEIGHT = "input_norm.weight"
OPTION_WEIGHTS = [*FC_NORM_WEIGHTS, INPUT_NORM_WEIGHT]
# SGLang 0.5.23's legacy names for the per-stream norms (its load_weights maps them to fc_norm.{i}).
LEGACY_FC_NORM = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}


def required_weights(cfg: DraftConfig) -> list[str]:
    """The tensors a draft with ``cfg``'s options must hold (embed_tokens aside)."""
    extra = (FC_NORM_WEIGHTS if cfg.fc_norm else []) + ([INPUT_NORM_WEIGHT] if cfg.norm_before_fc else [])
    return [*REQUIRED_WEIGHTS, *extra]

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, nh * hd),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
        "embed_tokens.weight": (cfg.vocab_size, h),
        **{n: (cfg.target_hidden_size,) for n in FC_NORM_WEIGHTS},
        INPUT_NORM_WEIGHT: (3 * cfg.target_hidden_size,),
    }


def exported_state_dict(draft: Eagle3Draft, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors that go into model.safetensors, under their exact engine names."""
    sd = draft.state_dict()
    names = required_weights(draft.config)
    if draft.config.hidden_size != draft.config.target_hidden_size:
        names.append("embed_tokens.weight")
    out = {}
    for n in names:
        t = sd[n].detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[n] = t.contiguous()
    out["d2t"] = out["d2t"].to(torch.int64)
    out["t2d"] = out["t2d"].to(torch.bool)
    return out


def engine_config(cfg: DraftConfig, dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None) -> dict:
    """config.json per docs/design.md §5: what vLLM's and SGLang's Eagle-3 Llama loaders read."""
    rp = dict(cfg.rope_parameters)
    rope_theta = float(rp.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    rope_scaling = None if scaling.get("rope_type", "default") == "default" else scaling
    d = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_theta": rope_theta, **(scaling or {"rope_type": "default"})},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": cfg.norm_before_residual,
        "torch_dtype": DTYPE_NAMES[dtype],
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        # vLLM reads the "input to decoder layer j" ids ...
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        # ... SGLang reads the "output of layer k" ids (k = j - 1) and adds one.
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [j - 1 for j in cfg.aux_layer_ids],
            "use_aux_hidden_state": True,
        },
    }
    if cfg.hidden_size != cfg.target_hidden_size:
        d["target_hidden_size"] = cfg.target_hidden_size
    # The options vLLM 0.32.0 and SGLang 0.5.23 read (top-level keys; both also take norm_before_fc
    # from eagle_config), written only when on so that an EAGLE-3 draft's config is as before.
    for key in ("fc_norm", "norm_output", "norm_before_fc"):
        if getattr(cfg, key):
            d[key] = True
    d[METADATA_KEY] = dict(metadata or {})
    return d


def save_draft(draft: Eagle3Draft, out_dir: str | Path, metadata: dict | None = None,
               dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors (atomically, file by file: a failed write leaves
    each file as it was). The weights get open()'s mode: a published draft is world-readable.
    A DFlash draft (``draft.config.draft_type``) is written in z-lab's layout, the one engines read."""
    if getattr(draft.config, "draft_type", "eagle3") == "dflash":  # z-lab's layout (publish/dflash_export.py)
        from .dflash_export import save_dflash

        return save_dflash(draft, out_dir, metadata, dtype)
    out = ensure_dir(out_dir)
    tensors = exported_state_dict(draft, dtype)
    save_safetensors(tensors, out / WEIGHTS, metadata=weights_metadata(tensors))
    config = engine_config(draft.config, dtype, metadata)
    write_json(out / CONFIG, config)
    return out


def weights_metadata(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The safetensors header metadata of a draft: the format tag loaders read, and the digest of
    the tensors that every reader compares (``draft_check.read_weights``): a file damaged after
    export is refused, not served."""
    return {"format": "pt", DIGEST_KEY: weights_digest(tensors)}


def draft_config_from_json(d: dict) -> DraftConfig:
    """Rebuild a DraftConfig from an exported config.json (ours or a third party's)."""
    rp = d.get("rope_parameters")
    if not isinstance(rp, dict) or not rp:
        rp = dict(d.get("rope_scaling") or {})
        rp.setdefault("rope_type", rp.pop("type", "default"))
        rp["rope_theta"] = float(d.get("rope_theta", 10000.0))
    ids = d.get("eagle_aux_hidden_state_layer_ids")
    if (ids is None and isinstance(d.get("eagle_config"), dict)
            and d["eagle_config"].get("eagle_aux_hidden_state_layer_ids")):
        ids = [k + 1 for k in d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    heads = d["num_attention_heads"]
    return DraftConfig(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        vocab_size=d["vocab_size"],
        draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
        target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        aux_layer_ids=tuple(ids) if ids else (),
        rope_parameters=rp,
        hidden_act=d.get("hidden_act", "silu"),
        pad_token_id=d.get("pad_token_id"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        **options_from_json(d),
    )


def options_from_json(d: dict) -> dict[str, bool]:
    """The architecture options of a config.json as vLLM 0.32.0 and SGLang 0.5.23 read them
    (models/llama_eagle3.py): ``fc_norm`` (SGLang also takes its legacy ``use_aux_norm``),
    ``norm_output``, ``norm_before_fc`` from ``eagle_config`` first and then top-level, and
    ``norm_before_residual`` (vLLM; SGLang does not implement it)."""
    ec = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    return {
        "fc_norm": bool(d.get("fc_norm") or d.get("use_aux_norm")),
        "norm_output": bool(d.get("norm_output", False)),
        "norm_before_fc": bool(ec.get("norm_before_fc", d.get("norm_before_fc", False))),
        "norm_before_residual": bool(d.get("norm_before_residual", False)),
    }


class MissingDraftFile(Eagle3Error, FileNotFoundError):
    """A draft folder without its config.json or weights."""


class IncompleteDraft(Eagle3Error, ValueError):
    """A draft whose weights lack tensors its config needs."""


def read_config(draft_dir: str | Path) -> dict:
    """config.json as a JSON object (anything else is one line, ``draft_check.CorruptDraft``)."""
    p = Path(draft_dir) / CONFIG
    if not p.exists():
        raise MissingDraftFile(f"{draft_dir} has no {CONFIG}: not a draft directory")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSON or UTF-8
        raise CorruptDraft(f"{p}: not valid JSON ({e}): export or download it again") from None
    if not isinstance(d, dict):
        raise CorruptDraft(f"{p} holds a JSON {type(d).__name__}, not an object: export or download it again")
    return d


def read_tensors(draft_dir: str | Path) -> dict[str, torch.Tensor]:
    """model.safetensors, any damage one line (``draft_check.read_weights``)."""
    p = Path(draft_dir) / WEIGHTS
    if not p.exists():
        raise MissingDraftFile(f"{draft_dir} has no {WEIGHTS}")
    return read_weights(p)


def load_draft(draft_dir: str | Path, target=None, dtype: torch.dtype | None = torch.float32,
               device: str | torch.device = "cpu") -> tuple[Eagle3Draft, dict]:
    """Load a draft directory into an Eagle3Draft (a DFlashDraft for a DFlash folder, by its
    config.json); returns (draft, config dict).

    ``target`` (a loaded HF model) supplies the frozen embedding when the draft does not
    ship one (and a DFlash draft's LM head). ``dtype=None`` keeps the stored dtype (bit-exact
    round trips).
    """
    d = read_config(draft_dir)
    from .dflash_export import is_dflash, load_dflash

    if is_dflash(d):  # z-lab's or speculators' layout: a DFlashDraft (publish/dflash_export.py)
        return load_dflash(draft_dir, d, target, dtype, device)
    check_draft(d, None, draft_dir)  # before the config is used for anything
    cfg = draft_config_from_json(d)
    tensors = read_tensors(draft_dir)
    missing = [n for n in required_weights(cfg) if n not in tensors]
    if missing:
        raise IncompleteDraft(f"{draft_dir}: missing tensors {missing}; run `eagle3 inspect {draft_dir}`")
    check_draft(d, tensors, draft_dir, end_token_ids=(d.get(METADATA_KEY) or {}).get("end_token_ids"))
    draft, _ = draft_from_tensors(cfg, tensors, target, dtype, strict=False)
    return draft.to(device), d


def geometry(cfg: dict) -> DraftConfig:
    """The DraftConfig of a config that passed ``draft_check.config_problems`` (layer ids left
    out: the tensors do not depend on them)."""
    opts = {"norm_before_fc": bool(cfg.get("norm_before_fc")) and not cfg.get("fc_norm")}
    return draft_config_from_json({**cfg, "eagle_aux_hidden_state_layer_ids": [0, 1, 2], **opts})


def check_draft(config: dict, tensors: dict | None, directory, weights=None, *, end_token_ids=None):
    """The one check every reader makes before it trusts a draft (``draft_check``): raise
    :class:`CorruptDraft` with the first problem of ``config`` (our key layout; its problems are
    named under ``directory``) and ``tensors`` (our names, read from ``weights``, by default
    ``directory/model.safetensors``; None: the config alone)."""
    problems = [f"{Path(directory) / p}" for p in config_problems(config)]
    if not problems and tensors is not None:
        dcfg = geometry(config)
        found = tensor_problems(dcfg, tensors, expected_shapes(dcfg), end_token_ids=end_token_ids)
        problems = [f"{weights or Path(directory) / WEIGHTS}: {p}" for p in found]
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptDraft(f"{problems[0]}{more}")


def draft_from_tensors(cfg: DraftConfig, tensors: dict, target=None, dtype: torch.dtype | None = torch.float32,
                       strict: bool = True) -> tuple[Eagle3Draft, str]:
    """An Eagle3Draft holding ``tensors`` (exported names) in ``dtype`` (None: the stored one).

    Returns (draft, where its frozen embedding came from): "draft" when the file ships one,
    else "target" (``target``'s input embedding) or "placeholder" (no target given).
    """
    draft = Eagle3Draft(cfg)
    if dtype is None:
        dtype = tensors["fc.weight"].dtype
    draft.to(dtype)
    known = set(required_weights(cfg)) | set(OPTIONAL_WEIGHTS)
    state = {k: v for k, v in tensors.items() if k in known}
    embed = "draft"
    if "embed_tokens.weight" not in state:
        embed = "target" if target is not None else "placeholder"
        source = target.get_input_embeddings() if target is not None else draft.embed_tokens
        state["embed_tokens.weight"] = source.weight.detach()
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    if "d2t" in state:
        state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    draft.load_state_dict(state, strict=strict)
    draft.embed_tokens.weight.requires_grad_(False)
    return draft, embed
