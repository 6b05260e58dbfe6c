"""A DFlash draft on disk in z-lab's layout, the one vLLM, SGLang and llama.cpp read (docs/design.md §13).

    config.json        architectures ["DFlashDraftModel"], model_type "qwen3", the Qwen3 fields,
                       block_size (top level and in dflash_config), dflash_config {mask_token_id,
                       target_layer_ids}, num_target_layers, layer_types, and our training record
    model.safetensors  fc, hidden_norm, norm, layers.i.* (no prefix, no embedding, no LM head)

``dflash_config.target_layer_ids`` count layer outputs (z-lab's convention: the engines add one and
capture layer inputs); the package's DFlashConfig counts inputs (``hidden_states[j]``), so the ids
are shifted by one on the way out and back. A draft written here and read back is bit-equal.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.io_utils import ensure_dir, save_safetensors, write_json
from ..model.dflash import DFlashConfig, DFlashDraft
from .draft_check import DIGEST_KEY, CorruptDraft, read_weights, weights_digest

ARCHITECTURE = "DFlashDraftModel"
CONFIG, WEIGHTS = "config.json", "model.safetensors"
METADATA_KEY = "eagle3_training"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def is_dflash(config: dict) -> bool:
    """A DFlash draft's config.json: z-lab's architecture name, or speculators' model type."""
    arch = config.get("architectures")
    return (isinstance(arch, list) and ARCHITECTURE in arch) or config.get("speculators_model_type") == "dflash"


def draft_type_of(config: dict) -> str:
    """"dflash" or "eagle3", from a draft's config.json: the one place every wing asks."""
    return "dflash" if is_dflash(config) else "eagle3"


def zlab_config(cfg: DFlashConfig, dtype: torch.dtype = torch.bfloat16, metadata: dict | None = None) -> dict:
    rp = dict(cfg.rope_parameters)
    d = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_hidden_layers, "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": DTYPE_NAMES[dtype],
        # transformers 5 reads rope_parameters, earlier releases (and engines pinned to them) rope_theta
        "rope_theta": float(rp.get("rope_theta", 10000.0)), "rope_parameters": rp,
        "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "num_target_layers": cfg.num_target_layers,
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.output_layer_ids),
                          "block_size": cfg.block_size},
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "target_hidden_size": cfg.target_hidden_size,
    }
    if rp.get("rope_type", "default") != "default":
        d["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    d[METADATA_KEY] = dict(metadata or {})
    return d


def save_dflash(draft: DFlashDraft, out_dir: str | Path, metadata: dict | None = None,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json + model.safetensors, each written atomically (the weights with their digest)."""
    out = ensure_dir(out_dir)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in draft.trainable_state_dict().items()}
    save_safetensors(tensors, out / WEIGHTS, metadata={"format": "pt", DIGEST_KEY: weights_digest(tensors)})
    write_json(out / CONFIG, zlab_config(draft.config, dtype, metadata))
    return out


def block_size_of(d: dict) -> int | None:
    """z-lab's drafts keep it at the top level; newer ones inside dflash_config too."""
    inner = d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}
    return inner.get("block_size", d.get("block_size"))


def dflash_config_from_json(d: dict) -> DFlashConfig:
    """The DFlashConfig of a z-lab config.json (either place of block_size)."""
    inner = d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}
    rp = d.get("rope_parameters")
    if not isinstance(rp, dict) or not rp:
        rp = dict(d.get("rope_scaling") or {})
        rp.setdefault("rope_type", rp.pop("type", "default"))
        rp["rope_theta"] = float(d.get("rope_theta", 10000.0))
    heads = d["num_attention_heads"]
    ids = inner.get("target_layer_ids", d.get("target_layer_ids"))
    if ids is None or block_size_of(d) is None or inner.get("mask_token_id", d.get("mask_token_id")) is None:
        raise CorruptDraft("config.json of a DFlash draft needs dflash_config.target_layer_ids, "
                           "dflash_config.mask_token_id and block_size: export or download it again")
    return DFlashConfig(
        hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), vocab_size=d["vocab_size"],
        target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
        max_position_embeddings=d.get("max_position_embeddings", 2048), num_hidden_layers=d["num_hidden_layers"],
        num_target_layers=d.get("num_target_layers") or 0, target_layer_ids=tuple(int(k) + 1 for k in ids),
        block_size=int(block_size_of(d)), mask_token_id=int(inner.get("mask_token_id", d.get("mask_token_id"))),
        rope_parameters=rp, hidden_act=d.get("hidden_act", "silu"), pad_token_id=d.get("pad_token_id"),
        bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))


def load_dflash(draft_dir: str | Path, config: dict, target=None, dtype: torch.dtype | None = torch.float32,
                device: str | torch.device = "cpu") -> tuple[DFlashDraft, dict]:
    """A DFlashDraft from a z-lab folder; ``target`` gives the frozen embedding and LM head (without
    one they are zeros: the draft can be inspected or converted, not decoded)."""
    try:
        cfg = dflash_config_from_json(config)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptDraft(f"{Path(draft_dir) / CONFIG}: not a DFlash draft's config ({e})") from None
    tensors = read_weights(Path(draft_dir) / WEIGHTS)
    draft = DFlashDraft(cfg)
    want = draft.trainable_state_dict()
    missing = sorted(set(want) - set(tensors))
    wrong = [k for k in want if k in tensors and tuple(tensors[k].shape) != tuple(want[k].shape)]
    if missing or wrong:
        what = f"missing {missing[:4]}" if missing else f"{wrong[0]} has shape {tuple(tensors[wrong[0]].shape)}, " \
                                                          f"the config implies {tuple(want[wrong[0]].shape)}"
        raise CorruptDraft(f"{Path(draft_dir) / WEIGHTS}: {what}; run `eagle3 inspect {draft_dir}`")
    if dtype is None:
        dtype = tensors["fc.weight"].dtype
    draft.to(dtype)
    draft.load_state_dict({k: tensors[k].to(dtype) for k in want}, strict=False)
    if target is not None:
        draft.set_embedding(target.get_input_embeddings().weight.detach())
        head = target.get_output_embeddings()
        draft.set_head(head.weight.detach())
    return draft.to(device), config


def dflash_problems(draft_dir: str | Path, config: dict, target_config=None) -> tuple[list[str], dict]:
    """(one line per problem an engine would not report, a summary) of a z-lab DFlash folder."""
    from ..core.hf_utils import text_config

    problems: list[str] = []
    try:
        draft, _ = load_dflash(draft_dir, config)
    except CorruptDraft as e:
        return [str(e)], {"draft_type": "dflash"}
    cfg = draft.config
    b = cfg.block_size
    summary = {"draft_type": "dflash", "block_size": b, "num_hidden_layers": cfg.num_hidden_layers,
               "target_layer_ids": list(cfg.output_layer_ids), "mask_token_id": cfg.mask_token_id,
               "engines": {"vllm": {"method": "dflash", "num_speculative_tokens": b - 1},
                           "sglang": {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": b},
                           "llama.cpp": {"spec_type": "draft-dflash", "spec_draft_n_max": b - 1}}}
    if target_config is not None:
        tc = text_config(target_config)
        n = int(tc.num_hidden_layers)
        if not 0 <= cfg.mask_token_id < tc.vocab_size:
            problems.append(f"dflash_config.mask_token_id {cfg.mask_token_id} is not a row of the target's "
                            f"embedding (0..{tc.vocab_size - 1})")
        bad = [k for k in cfg.output_layer_ids if not 0 <= k < n - 1]
        if bad:
            problems.append(f"dflash_config.target_layer_ids {list(cfg.output_layer_ids)} count layer outputs: "
                            f"{bad} lie outside 0..{n - 2} for a target of {n} layers")
        if cfg.num_target_layers and cfg.num_target_layers != n:
            problems.append(f"num_target_layers {cfg.num_target_layers} differs from the target's {n} layers")
        if cfg.hidden_size != tc.hidden_size:
            problems.append(f"hidden_size {cfg.hidden_size} differs from the target's {tc.hidden_size}")
    return problems, summary
