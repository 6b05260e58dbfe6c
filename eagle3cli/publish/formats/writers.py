"""Writing a draft for the engines: ours (which vLLM and SGLang both load as-is) or the
speculators format, ``convert`` from any readable format, and ``as_ours`` for eval and push."""

from __future__ import annotations

from pathlib import Path

import torch

from ...core.io_utils import ensure_dir, save_safetensors, write_json
from ...model.draft import Eagle3Draft
from ..export import CONFIG, METADATA_KEY, WEIGHTS, exported_state_dict, save_draft
from .common import SPECULATORS_VERSION, TARGETS, FormatError, ReadNote, read_json
from .detect import detect_format
from .dflash import TO_LAYOUT, convert_dflash, is_dflash_dir
from .readers import read_draft


def norm_before_residual(draft: Eagle3Draft) -> bool:
    """speculators'/vLLM's ``norm_before_residual`` (now a ``DraftConfig`` option, docs/design.md §3)."""
    return draft.config.norm_before_residual


def write_draft(draft: Eagle3Draft, out_dir: str | Path, to: str = "ours", metadata: dict | None = None,
                dtype: torch.dtype | None = None, target_name: str | None = None,
                embed_known: bool = True) -> Path:
    """Write ``draft`` in the format ``to`` (ours, vllm, sglang: the same files; or speculators).
    A DFlashDraft goes to z-lab's layout (ours, vllm, sglang, zlab) or speculators' (formats/dflash.py).

    ``dtype=None`` keeps the draft's dtype. ``embed_known`` False: the draft's embedding is a
    placeholder (no target was given), so the speculators writer leaves it out (vLLM then
    shares the target's, as for ours).
    """
    if getattr(draft.config, "draft_type", "eagle3") == "dflash":
        from ..dflash_export import save_dflash

        if to not in TO_LAYOUT:
            raise FormatError(f"--to must be one of {', '.join(TO_LAYOUT)} for a DFlash draft, got {to!r}")
        return save_dflash(draft, out_dir, metadata, dtype=dtype, layout=TO_LAYOUT[to], target_name=target_name)
    eagle3_targets = [t for t in TARGETS if t != "zlab"]
    if to == "zlab":
        raise FormatError("--to zlab is DFlash's layout; an EAGLE-3 draft is written --to "
                          f"{', '.join(eagle3_targets)}")
    if to not in TARGETS:
        raise FormatError(f"--to must be one of {', '.join(eagle3_targets)}, got {to!r}")
    dtype = dtype or draft.fc.weight.dtype
    if to == "sglang" and norm_before_residual(draft):
        raise FormatError("this draft uses norm_before_residual, which SGLang (0.5.23, models/llama_eagle3.py) "
                          "does not implement: it would be served wrongly; convert --to vllm instead")
    if to == "speculators":
        return _write_speculators(draft, Path(out_dir), dtype, metadata, target_name, embed_known)
    return save_draft(draft, out_dir, metadata=metadata, dtype=dtype)


def _write_speculators(draft: Eagle3Draft, out: Path, dtype, metadata, target_name, embed_known) -> Path:

    from ..export import DTYPE_NAMES, engine_config, weights_metadata

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
    if is_dflash_dir(path):  # z-lab's or speculators' layout, either way (formats/dflash.py)
        if layer_ids is not None:
            raise FormatError(f"{path}: a DFlash draft records its target layers; --layers is for EAGLE-3 drafts")
        return convert_dflash(path, out_dir, to, target_config=target_config, target=target, dtype=dtype,
                              target_name=target_name)
    draft, note = read_draft(path, target_config=target_config, target=target, layer_ids=layer_ids)
    raw = read_json(Path(path) / CONFIG)
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


def damaged_ours(path: str | Path) -> bool:
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

    if is_dflash_dir(path):
        from ..dflash_export import layout_of

        if layout_of(read_json(Path(path) / CONFIG)) == "zlab":
            return str(path)  # the engines' layout, checked by every reader
        fmt = "dflash-speculators"
    else:
        fmt = None
    try:
        fmt = fmt or detect_format(path)
    except FormatError:
        if not damaged_ours(path):
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
