"""Atomic file writes shared by every writer of the product (feature store, merge, trainer,
exporter, converters, eval, push, quickstart).

A file written here either holds its complete new content or is left as it was: the bytes go
to a temporary name in the same folder, are flushed to disk, then renamed over the target. A
folder is built the same way (a temporary folder renamed into place once complete). When the
disk fills or refuses the write (no space, read-only, permission, quota, a path component that
is a file), the temporary file or folder is removed and a :class:`WriteError` names the target,
the OS error and what to do: one line at the CLI boundary, and nothing written before is lost.

Every commit goes through :func:`_commit`: the one place a fault is injected in the tests.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from .errors import DISK_ERRNOS, WriteError, os_error_of


def temp_name(path: Path) -> Path:
    """The temporary name a file is written under: hidden, in the same folder (so the rename
    stays on one file system), and matched by gen-data's resume clean-up (``.*.tmp-*``)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_error(e: BaseException, path, tmp: Path | None = None) -> WriteError | None:
    """The WriteError for ``e`` raised while writing ``path`` (through ``tmp``); None when ``e`` is
    no OS error, or one about another file (a source that could not be read stays as it is)."""
    if isinstance(e, WriteError):
        return e
    os_error = os_error_of(e)
    if os_error is None:
        return None
    if os_error.filename and os_error.errno not in DISK_ERRNOS:
        named = Path(os.path.abspath(os_error.filename))
        ours = [Path(os.path.abspath(p)) for p in (path, tmp) if p is not None]
        if not any(named == p or named in p.parents or p in named.parents for p in ours):
            return None
    return WriteError(path, os_error)


def discard(path: Path):
    """Remove a temporary file or folder, quietly: it is cleaned up on the way to an error."""
    path = Path(path)
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


@contextmanager
def writing(path, cleanup: Path | None = None):
    """Turn an OS error inside the block into a WriteError naming ``path``, after removing
    ``cleanup`` (the temporary file or folder the block was filling)."""
    try:
        yield
    except BaseException as e:
        if cleanup is not None:
            discard(cleanup)
        err = write_error(e, path, cleanup)
        if err is None or err is e:
            raise
        raise err from e


def ensure_dir(path) -> Path:
    """``mkdir -p``; a read-only disk, a missing permission or a file in the way is a WriteError."""
    path = Path(path)
    with writing(path):
        path.mkdir(parents=True, exist_ok=True)
    return path


def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, path: Path):
    """Flush a finished temporary file to disk and rename it over ``path`` (a folder: rename only,
    after removing the one it replaces)."""
    if tmp.is_dir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
        return
    _fsync(tmp)
    os.replace(tmp, path)


def replace_dir(tmp: Path, path: Path):
    """Rename a finished temporary folder over ``path`` (for folders filled by several processes,
    which :func:`atomic_dir` cannot wrap)."""
    _commit(Path(tmp), Path(path))


@contextmanager
def atomic_path(path, mode: int | None = None):
    """Yield a temporary path for a writer that produces a file itself (safetensors, a GGUF
    writer, savefig, a copy); once the block ends, the file is synced and renamed to ``path``.
    ``mode``: the file's permissions (safetensors writes 0600)."""
    path = Path(path)
    ensure_dir(path.parent)
    tmp = temp_name(path)
    with writing(path, cleanup=tmp):
        discard(tmp)
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        _commit(tmp, path)


@contextmanager
def atomic_dir(path, tmp: Path | None = None):
    """Yield a temporary folder beside ``path``, renamed over it once the block ends (a folder
    that was there is replaced). A fault leaves ``path`` as it was and no temporary folder."""
    path = Path(path)
    ensure_dir(path.parent)
    tmp = Path(tmp) if tmp is not None else temp_name(path)
    with writing(path, cleanup=tmp):
        discard(tmp)
        tmp.mkdir()
        yield tmp
        _commit(tmp, path)


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None):
    with atomic_path(path, mode) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def write_text(path: Path, text: str):
    atomic_write_bytes(Path(path), text.encode("utf-8"))


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj: dict, indent: int = 2):
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=indent, sort_keys=False) + "\n").encode())


def canonical_header(path: Path):
    """Rewrite a safetensors header with sorted keys, in place and at the same length.

    safetensors serialises ``__metadata__`` from a hash map, so its key order changes from one
    call to the next; sorting it makes a file's bytes a function of its content alone (a resumed
    or repeated run then writes files bit-identical to an uninterrupted one).
    """
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
        canon = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
        if len(canon) <= n:
            f.seek(8)
            f.write(canon + b" " * (n - len(canon)))


def save_safetensors(tensors: dict, path: Path, metadata: dict | None = None, mode: int | None = None):
    """``safetensors.torch.save_file`` to a temporary name, its header made canonical, renamed into
    place once complete. ``mode`` defaults to what ``open()`` would give (safetensors itself
    writes 0600)."""
    from safetensors.torch import save_file

    with atomic_path(path, default_file_mode() if mode is None else mode) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        canonical_header(tmp)


class _RecordingFile(io.FileIO):
    """A file that remembers the OS error of a failed write: torch.save reports it as a
    RuntimeError without its errno."""

    error: OSError | None = None

    def write(self, b):
        try:
            return super().write(b)
        except OSError as e:
            self.error = e
            raise


def save_torch(obj, path: Path):
    """``torch.save`` (optimizer state, RNG state) to a temporary name, renamed into place."""
    import torch

    with atomic_path(path) as tmp:
        with _RecordingFile(tmp, "wb") as f:
            try:
                torch.save(obj, f)
            except RuntimeError:
                if f.error is not None:
                    raise f.error from None
                raise


def append_line(path: Path, line: str):
    """Append one line to a log (the training log): not atomic, but a failure is a WriteError."""
    path = Path(path)
    ensure_dir(path.parent)
    with writing(path):
        with open(path, "a") as f:
            f.write(line + "\n")


def default_file_mode() -> int:
    """The mode a plain ``open()`` would give a new file under the current umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask
