"""Where a dataset's rows come from: a local ``.json`` (an array, a dict of id -> row, or a truncated
array as the ShareGPT package ships), ``.jsonl`` (streamed) or ``.parquet`` file, a named preset
for a usual corpus, or a Hub id (through ``datasets``). Each row comes with its location for the
report; unreadable ones come as markers (``Malformed``, ``Truncated``) that ``sources`` counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from ..core.errors import Eagle3Error

# Usual corpora -> (Hub id, subset, split). Resolved only when --dataset names the preset.
PRESETS: dict[str, tuple[str, str | None, str]] = {
    "sharegpt": ("Aeala/ShareGPT_Vicuna_unfiltered", None, "train"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", None, "train_sft"),
    "gsm8k": ("openai/gsm8k", "main", "train"),
    "alpaca": ("tatsu-lab/alpaca", None, "train"),
    "openhermes": ("teknium/OpenHermes-2.5", None, "train"),
    "slimorca": ("Open-Orca/SlimOrca", None, "train"),
    "magpie": ("Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered", None, "train"),
    "codealpaca": ("sahil2801/CodeAlpaca-20k", None, "train"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train"),
}


class SourceError(Eagle3Error, ValueError):
    """The source itself is unusable (missing file, unknown format, unreachable Hub id)."""


def _json_rows(path: Path) -> Iterator[tuple[str, object]]:
    """Rows of a JSON array (or a dict of id -> row). A truncated array (as the ShareGPT
    package ships) is decoded object by object; the cut-off tail is reported, not fatal."""
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        data = [dict(v, id=k) if isinstance(v, dict) and "id" not in v else v for k, v in data.items()]
    if isinstance(data, list):
        # Line numbers of objects are not tracked for whole-file JSON; report the array index.
        for i, row in enumerate(data):
            yield f"{path.name}[{i}]", row
        return
    start = text.find("[")
    if start < 0:
        raise SourceError(f"{path}: not a JSON array or object, and not JSON Lines (use a .jsonl name)")
    dec, pos, i = json.JSONDecoder(), start + 1, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        line = text.count("\n", 0, pos) + 1
        try:
            row, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            yield f"{path.name}:{line}", Truncated()
            return
        yield f"{path.name}:{line}", row
        i += 1


class Truncated:
    """Marker for the unreadable tail of a truncated JSON array."""


def _decode(path: Path, data: bytes, first_line: int = 1) -> str:
    """Bytes as text. utf-8-sig: a byte-order mark (Notepad) is not part of the first row."""
    try:
        return data.decode("utf-8-sig" if first_line == 1 else "utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        raise SourceError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}): save it as "
                          "UTF-8, e.g. iconv -f latin1 -t utf-8") from None


def _read_text(path: Path) -> str:
    return _decode(path, path.read_bytes())


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    with open(path, "rb") as f:  # streamed: a JSONL file may be larger than memory
        for n, raw in enumerate(f, 1):
            line = _decode(path, raw, n)
            if not line.strip():
                continue
            try:
                yield f"{path.name}:{n}", json.loads(line)
            except json.JSONDecodeError:
                yield f"{path.name}:{n}", Malformed()


class Malformed:
    """Marker for a line that is not valid JSON."""


def _dataset_rows(ds, name: str) -> Iterator[tuple[str, object]]:
    for i, row in enumerate(ds):
        yield f"{name} row {i}", row


def _load_dataset(*args, **kw):
    import datasets

    try:
        return datasets.load_dataset(*args, **kw)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; one line for the user
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SourceError(f"could not load dataset {args[0] if args else ''}: {msg}") from e


def raw_rows(data: str, split: str | None = None, subset: str | None = None,
             streaming: bool = False) -> tuple[Iterator[tuple[str, object]], str]:
    """(rows with their location, description) for a local file, a preset or a Hub id."""
    path = Path(data).expanduser()
    suffix = "".join(path.suffixes[-1:]).lower()
    if path.exists() and path.is_file():
        if suffix == ".jsonl":
            return _jsonl_rows(path), str(path)
        if suffix == ".json":
            return _json_rows(path), str(path)
        if suffix == ".parquet":
            ds = _load_dataset("parquet", data_files=str(path), split="train", streaming=streaming)
            return _dataset_rows(ds, path.name), str(path)
        raise SourceError(f"{path}: unsupported file type {suffix or '(none)'}; use .json, .jsonl or .parquet")
    if suffix in (".json", ".jsonl", ".parquet") or data.startswith((".", "/", "~")):
        raise SourceError(f"--dataset {data}: no such file")
    hub_id = data
    if data.lower() in PRESETS:
        hub_id, preset_subset, preset_split = PRESETS[data.lower()]
        subset = subset or preset_subset
        split = split or preset_split
    ds = _load_dataset(hub_id, subset, split=split or "train", streaming=streaming)
    return _dataset_rows(ds, hub_id), hub_id
