"""Atomic file writes shared by the feature store, the exporter, the trainer and eval.

A file written here either holds its complete new content or is left as it was: the bytes go
to a temporary name in the same folder, are flushed to disk, then renamed over the target.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes):
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj: dict):
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def default_file_mode() -> int:
    """The mode a plain ``open()`` would give a new file under the current umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask
