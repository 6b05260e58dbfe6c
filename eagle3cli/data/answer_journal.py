"""Every answer an endpoint sends, on disk the moment it arrives: no answer is bought twice.

A shard's regenerated conversations are saved whole (``regenerated/part-SSSSS.jsonl``) only when
all of them are answered. Until then each answer (and each refusal, a 4xx for good) is appended
to ``regenerated/part-SSSSS.journal``, one JSON line, flushed and fsynced before the next request
of that conversation goes out. A rerun after any stop (kill -9, an outage past the patience, a
full disk) reads the journal and asks the server only for what it does not hold; the shard then
comes out byte-identical to an uninterrupted run's. Once the shard's ``part-SSSSS.jsonl`` is
written the journal is deleted: that file holds every answer.

An entry is found by the hash of the exact request (model, messages so far, sampling settings,
tools, template options, :func:`request_key`): an answer is reused only for the request it
answered. The last line of a killed run may be torn; it is cut off when the journal is opened.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from ..core.io_utils import ensure_dir, writing

JOURNAL_SUFFIX = ".journal"


def journal_path(part: Path) -> Path:
    """``regenerated/part-SSSSS.journal`` beside ``part-SSSSS.jsonl``."""
    return Path(part).with_suffix(JOURNAL_SUFFIX)


def request_key(payload: dict) -> str:
    """What identifies a request: the sha256 of its canonical JSON."""
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class AnswerJournal:
    """The answers of one shard received so far (``entries``: request key -> entry), appended to
    ``path`` as they come, from many threads."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock = threading.Lock()
        self.entries: dict[str, dict] = {}
        self.file = None
        self.failed: BaseException | None = None  # a write that failed: no line is appended after it
        if self.path.is_file():
            self._load()
        self.kept = len(self.entries)  # from earlier runs

    def _load(self):
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1
        for line in data[:whole].splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("key"), str):
                self.entries[entry.pop("key")] = entry
        if whole < len(data):  # the torn last line of a killed run: later lines must not join it
            with writing(self.path):
                with open(self.path, "r+b") as f:
                    f.truncate(whole)
                    os.fsync(f.fileno())

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> dict | None:
        with self.lock:
            return self.entries.get(key)

    def add(self, key: str, entry: dict):
        """Append one entry and fsync it; a write that fails raises a WriteError (and every later add too)."""
        line = (json.dumps({"key": key, **entry}, ensure_ascii=False) + "\n").encode("utf-8")
        with self.lock:
            if self.failed is not None:
                raise self.failed
            try:
                with writing(self.path):
                    if self.file is None:
                        self._open()
                    self.file.write(line)
                    self.file.flush()
                    os.fsync(self.file.fileno())
            except BaseException as e:
                self.failed = e
                raise
            self.entries[key] = entry

    def _open(self):
        new = not self.path.exists()
        ensure_dir(self.path.parent)
        self.file = open(self.path, "ab")
        if new:  # the file's name must survive a crash too, not only its bytes
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self):
        with self.lock:
            if self.file is not None:
                try:
                    self.file.close()
                except OSError:
                    pass
                self.file = None

    def remove(self):
        """The shard's answers are saved in its part file: the journal is no longer needed."""
        self.close()
        self.path.unlink(missing_ok=True)
