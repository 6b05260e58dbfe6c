"""What every draft format's reader and writer share: the format names, the error, the note a
read returns, and reading a folder's JSON and weight files (a pickle with ``weights_only=True`` only)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...core.errors import Eagle3Error
from ..draft_check import read_weights
from ..export import WEIGHTS

FORMATS = {
    "ours": "eagle3 (this package)",
    "eagle": "EAGLE reference (SafeAILab/EAGLE, pytorch_model.bin)",
    "speculators": "speculators (vLLM's Eagle3Speculator format)",
    "modelopt": "NVIDIA ModelOpt export",
    "specforge": "SpecForge / SGLang export",
    "dflash-zlab": "DFlash, z-lab's layout (vLLM, SGLang, llama.cpp)",
    "dflash-speculators": "DFlash, speculators' layout",
}
# --to targets: ours serves both engines (docs/formats.md); speculators is vLLM's own format.
TARGETS = ("ours", "vllm", "sglang", "speculators", "zlab")  # zlab: DFlash drafts only (formats/dflash.py)
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


def read_json(p: Path) -> dict:
    """A config file as a dict, or one line naming the file."""
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise FormatError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise FormatError(f"{p}: not a JSON object")
    return d


def safetensors_names(p: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # noqa: BLE001 - any corrupt header is one line
        raise FormatError(f"{p}: not a readable safetensors file ({str(e).splitlines()[0] if str(e) else e})") from None


def load_tensors(d: Path, note: ReadNote) -> dict[str, torch.Tensor]:
    """The folder's weights (safetensors, else the pickle); ``note`` records which file."""
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
