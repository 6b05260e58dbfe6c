"""Fingerprints that tie a feature store to what made it: the target's weights (``content_hash``),
the data file (``data_fingerprint``) and the run's settings (``settings_fingerprint``). gen-data
records them, a resumed run and merge-data must match them, and train compares a store's with
its target when no stored features could tell."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..core.io_utils import file_sha256


def content_hash(model: str, gguf_file: str | None = None) -> str | None:
    """A cheap fingerprint of a local target: config plus each weight file's name, size and
    safetensors header (shapes and offsets); None for Hub ids (the revision identifies them)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    cfg = path / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    for f in sorted(path.iterdir()):
        if f.suffix not in (".safetensors", ".bin", ".gguf", ".pt") or (gguf_file and f.name != gguf_file
                                                                         and f.suffix == ".gguf"):
            continue
        h.update(f"{f.name}:{f.stat().st_size}".encode())
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(n, 1 << 24)))
    return h.hexdigest()


def settings_fingerprint(manifest: dict) -> str:
    """sha256 of what makes two writers' shards parts of one store: the run settings (gen-data's
    ``run``), the format and the target's identity. Paths give way to the content hashes when
    those are known, since two machines may hold the same model and data under other paths."""
    run = dict(manifest.get("run") or {})
    target = manifest.get("target") or {}
    if target.get("content_hash"):
        run["model"] = "content:" + target["content_hash"]
    if run.get("data_fingerprint"):
        run["data"] = None
    ident = {"format": manifest.get("format"), "version": manifest.get("version"), "run": run,
             "target_revision": target.get("revision"), "shards_planned": manifest.get("shards_planned")}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def data_fingerprint(data: str) -> str | None:
    """sha256 of a local data file's content (a same-size edit must not reuse old shards);
    None for Hub datasets."""
    p = Path(data).expanduser()
    if p.is_file():
        return "sha256:" + file_sha256(p)
    return None
