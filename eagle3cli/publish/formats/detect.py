"""Which format a draft folder holds, from its config.json and weight file names."""

from __future__ import annotations

from pathlib import Path

from ..dflash_layout import is_dflash, layout_of
from ..export import CONFIG, METADATA_KEY, WEIGHTS
from .common import PICKLE, FormatError, read_json, safetensors_names


def detect_format(path: str | Path) -> str:
    """The format of a draft directory, from its config.json and weight file names."""
    d = Path(path)
    if not d.is_dir():
        raise FormatError(f"{d} is not a directory")
    if not (d / CONFIG).exists():
        raise FormatError(f"{d} has no {CONFIG}: not a draft directory")
    cfg = read_json(d / CONFIG)
    if is_dflash(cfg):  # a DFlash draft: read by formats/dflash.py
        return f"dflash-{layout_of(cfg)}"
    if "speculators_model_type" in cfg or "speculators_config" in cfg:
        return "speculators"
    if not (d / WEIGHTS).exists():
        if (d / PICKLE).exists():
            return "eagle"
        _refuse_other_weights(d)
    names = set(safetensors_names(d / WEIGHTS))
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
