"""DFlash drafts through the format package's entry points: ``read_draft``, ``convert`` and
``as_ours`` hand a DFlash folder (z-lab's layout or speculators', ``dflash_layout.is_dflash``)
here, so every wing reads and converts both families through the same calls.

``--to``: ``ours``, ``vllm``, ``sglang`` and ``zlab`` write z-lab's layout (what vLLM 0.32.0,
SGLang 0.5.23 and llama.cpp's converter read); ``speculators`` writes speculators 0.9.0's. The
speculators layout records no target depth (``num_target_layers``): a conversion to z-lab's
takes it from ``--model``, or refuses in one line.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...model.dflash import DFlashDraft
from ..dflash_export import CONFIG, METADATA_KEY, attach_target, layout_of, load_dflash, save_dflash
from .common import FormatError, ReadNote, read_json

TO_LAYOUT = {"ours": "zlab", "vllm": "zlab", "sglang": "zlab", "zlab": "zlab", "speculators": "speculators"}


def is_dflash_dir(path: str | Path) -> bool:
    """A folder whose config.json names a DFlash draft (unreadable JSON: not ours to say)."""
    from ..dflash_layout import is_dflash

    p = Path(path) / CONFIG
    try:
        return p.is_file() and is_dflash(read_json(p))
    except FormatError:
        return False


def read_dflash(path: str | Path, target_config=None, target=None, dtype: torch.dtype | None = None,
                device: str | torch.device = "cpu") -> tuple[DFlashDraft, ReadNote]:
    """A DFlash folder (either layout) as a DFlashDraft, checked, with a note of what was inferred."""
    d = Path(path)
    raw = read_json(d / CONFIG)
    layout = layout_of(raw)
    note = ReadNote(format=f"dflash-{layout}", path=str(d), weights_file=str(d / "model.safetensors"))
    if layout == "speculators":
        note.target = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if raw.get("num_target_layers") is None and target_config is not None:
            note.inferred.append("num_target_layers from --model (speculators' layout does not record it)")
    note.target = note.target or (raw.get(METADATA_KEY) or {}).get("target")
    draft, _ = load_dflash(d, raw, dtype=dtype, target_config=target_config)
    if target is not None:
        attach_target(draft, target, d)
        note.embed = "target"
    else:
        note.embed = "placeholder"
    return draft.to(device), note


def convert_dflash(path: str | Path, out_dir: str | Path, to: str, target_config=None, target=None,
                   dtype: torch.dtype | None = None, target_name: str | None = None) -> tuple[Path, ReadNote]:
    """Read a DFlash folder and write it in the layout ``to`` names (bit-equal weights unless ``dtype``)."""
    if to not in TO_LAYOUT:
        raise FormatError(f"--to must be one of {', '.join(TO_LAYOUT)} for a DFlash draft, got {to!r}")
    draft, note = read_dflash(path, target_config=target_config, target=target)
    layout = TO_LAYOUT[to]
    if layout == "zlab" and not draft.config.num_target_layers:
        raise FormatError(f"{Path(path) / CONFIG}: records no num_target_layers (speculators' layout does not), "
                          "which SGLang reads: give the target with --model")
    raw = read_json(Path(path) / CONFIG)
    meta = dict(raw.get(METADATA_KEY) or {})
    name = target_name or note.target or meta.get("target")
    if name and not meta.get("target"):
        meta["target"] = name
    if note.format != "dflash-zlab" or note.inferred:
        meta["converted_from"] = {"format": note.format, "path": str(path), "inferred": list(note.inferred)}
    out = save_dflash(draft, out_dir, meta, dtype=dtype or draft.fc.weight.dtype, layout=layout, target_name=name)
    return Path(out), note

