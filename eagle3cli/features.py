"""The on-disk feature store written by ``gen-data`` and read by ``train``.

Layout of a store directory::

    manifest.json                     target, layers, dtype, template hash, counts (docs/design.md §9)
    shards/shard-RR-NNNNN.safetensors one file per block of conversations (RR = writer rank)

Each shard concatenates its samples along the token axis (no pickles, one file per block
rather than per sample):

    input_ids  int32 [T]        loss_mask bool [T]       offsets int64 [n+1]
    sample_ids int64 [n]        (index of each sample in the source, for tracing)
    aux        bf16|fp16 [T, 3*Ht]   target streams hidden_states[j] for the 3 layer ids
    final      bf16|fp16 [T, Ht]     hidden_states[N] (final-normed), for teacher logits
    count_ids, count_values int64    token frequencies over loss-masked tokens (sparse)

``aux``/``final`` are absent for ``--features none`` stores (online training). Shards are
written to a temporary name and renamed, so a shard file that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from bisect import bisect_right
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import Eagle3Error
# They lived here; still importable from this module (gen_data and trainer do).
from .io_utils import atomic_write_bytes, default_file_mode, write_json  # noqa: F401

MANIFEST = "manifest.json"
SHARD_DIR = "shards"
FORMAT_VERSION = 1


# Only names gen-data writes: "shard-00-00000 (copy).safetensors" and the like are not shards.
SHARD_FILE = re.compile(r"^shard-(\d{2})-(\d{5})\.safetensors$")
SIDECAR_FILE = re.compile(r"^shard-(\d{2})-(\d{5})\.json$")


class StoreError(Eagle3Error, ValueError):
    """A feature store that cannot be trusted or read; the message names the shard and the fix."""


def shard_name(rank: int, index: int) -> str:
    return f"shard-{rank:02d}-{index:05d}.safetensors"


def sidecars(shard_dir: Path) -> dict[int, Path]:
    """Global shard index -> its stats sidecar, for the sidecars gen-data names alone."""
    found = {}
    for p in Path(shard_dir).glob("shard-*.json") if Path(shard_dir).is_dir() else []:
        m = SIDECAR_FILE.match(p.name)
        if m:
            found[int(m.group(2))] = p
    return found


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def shard_problem(sidecar: Path, hash: bool = True) -> str | None:
    """Why the shard a sidecar describes cannot be trusted (None: it is what was written).

    The sidecar records the file's byte length and sha256: a truncated copy, a file edited or
    replaced after gen-data, or a missing one is caught before anything relies on it.
    """
    try:
        stats = json.loads(Path(sidecar).read_text())
    except (OSError, ValueError):
        return f"{Path(sidecar).name} is unreadable"
    if not stats.get("file"):
        return None  # a shard whose conversations were all skipped: no file to check
    path = Path(sidecar).parent / stats["file"]
    if not path.is_file():
        return f"{stats['file']} is missing"
    size = path.stat().st_size
    if stats.get("bytes") is not None and size != stats["bytes"]:
        return f"{stats['file']} is {size:,} bytes, its sidecar says {stats['bytes']:,} (truncated or replaced)"
    if hash and stats.get("sha256") and file_sha256(path) != stats["sha256"]:
        return f"{stats['file']} differs from the sha256 its sidecar recorded (changed after gen-data)"
    return None


def store_shard_files(root: Path) -> list[Path]:
    """The shard files of a store: those its sidecars name (stray copies are never read); a
    store without sidecars (written by hand) has the files named like gen-data's."""
    shard_dir = Path(root) / SHARD_DIR
    named = []
    for side in sidecars(shard_dir).values():
        try:
            file = json.loads(side.read_text()).get("file")
        except (OSError, ValueError):
            raise StoreError(f"{side} is unreadable: rerun the gen-data command to redo that shard") from None
        if file:
            named.append(shard_dir / file)
    if not named and not sidecars(shard_dir):
        named = [p for p in shard_dir.glob("shard-*.safetensors") if SHARD_FILE.match(p.name)]
    return sorted(named)


def write_shard(path: Path, samples: list[dict], dtype: torch.dtype = torch.bfloat16):
    """Write one shard atomically. Each sample: input_ids [T], loss_mask [T], sample_id,
    and optionally aux [T,3Ht] and final [T,Ht]."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = [int(s["input_ids"].numel()) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lengths, dtype=torch.long).cumsum(0)
    ids = torch.cat([s["input_ids"].reshape(-1).to(torch.int32) for s in samples])
    mask = torch.cat([s["loss_mask"].reshape(-1).to(torch.bool) for s in samples])
    counted = ids[mask].long()
    uniq, counts = counted.unique(return_counts=True) if counted.numel() else (counted, counted)
    tensors = {
        "input_ids": ids,
        "loss_mask": mask,
        "offsets": offsets,
        "sample_ids": torch.tensor([int(s["sample_id"]) for s in samples], dtype=torch.long),
        "count_ids": uniq.long(),
        "count_values": counts.long(),
    }
    if samples and "aux" in samples[0]:
        tensors["aux"] = torch.cat([s["aux"].reshape(lengths[i], -1) for i, s in enumerate(samples)]).to(dtype)
        tensors["final"] = torch.cat([s["final"].reshape(lengths[i], -1) for i, s in enumerate(samples)]).to(dtype)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "eagle3-features",
                                                                                    "version": str(FORMAT_VERSION)})
    _canonical_header(tmp)
    os.chmod(tmp, default_file_mode())  # safetensors writes 0600; a store is often shared by a team
    os.replace(tmp, path)


def _canonical_header(path: Path):
    """Rewrite a safetensors header with sorted keys, in place and at the same length.

    safetensors serialises ``__metadata__`` from a hash map, so its key order changes from one
    process to the next; sorting it makes a shard's bytes a function of its content alone
    (a resumed run then writes files bit-identical to an uninterrupted one).
    """
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
        canon = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
        if len(canon) <= n:
            f.seek(8)
            f.write(canon + b" " * (n - len(canon)))


class FeatureStore:
    """Random access to the samples of a store (lazy: only the requested rows are read)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        mpath = self.root / MANIFEST
        if not mpath.exists():
            raise FileNotFoundError(f"{self.root} is not a feature store (no {MANIFEST}); run `eagle3 gen-data` first")
        try:
            self.manifest = json.loads(mpath.read_text())
        except ValueError as e:  # JSON or UTF-8: the manifest is rewritten by every gen-data run
            raise StoreError(f"{mpath} is not valid JSON ({e}): run the same gen-data command again") from None
        self.shards = store_shard_files(self.root)
        self.verify(hash=False)  # lengths only (a stat each); problems() also compares the hashes
        self._handles: dict[int, object] = {}
        self._offsets: list[torch.Tensor] = []
        starts = [0]
        for i, p in enumerate(self.shards):
            if not p.is_file():
                raise StoreError(f"store {self.root}: {p.name} is missing: rerun the gen-data command to redo it")
            off = self._open(i).get_tensor("offsets")
            self._offsets.append(off)
            starts.append(starts[-1] + off.numel() - 1)
        self._starts = starts

    def _open(self, i: int):
        h = self._handles.get(i)
        if h is None:
            from safetensors import SafetensorError

            try:
                h = safe_open(str(self.shards[i]), framework="pt")
            except SafetensorError as e:
                raise StoreError(f"store {self.root}: {self.shards[i].name} is unreadable ({e}): rerun the "
                                 "gen-data command to redo it") from None
            self._handles[i] = h
        return h

    def problems(self, hash: bool = True) -> list[str]:
        """Every shard that does not match its sidecar (length, sha256): see shard_problem."""
        found = (shard_problem(p, hash) for p in sidecars(self.root / SHARD_DIR).values())
        return [p for p in found if p]

    def verify(self, hash: bool):
        problems = self.problems(hash)
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            raise StoreError(f"store {self.root}: {problems[0]}{more}: run the same gen-data command again to "
                             "redo it")

    def __getstate__(self):  # handles are not picklable (DataLoader workers reopen them)
        d = dict(self.__dict__)
        d["_handles"] = {}
        return d

    @property
    def has_features(self) -> bool:
        return self.manifest.get("features", "offline") == "offline"

    def __len__(self) -> int:
        return self._starts[-1]

    def locate(self, idx: int) -> tuple[int, int]:
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        s = bisect_right(self._starts, idx) - 1
        return s, idx - self._starts[s]

    def lengths(self) -> list[int]:
        return [int(x) for off in self._offsets for x in (off[1:] - off[:-1])]

    def __getitem__(self, idx: int) -> dict:
        s, j = self.locate(idx)
        h = self._open(s)
        a, b = int(self._offsets[s][j]), int(self._offsets[s][j + 1])
        out = {
            "input_ids": h.get_slice("input_ids")[a:b].long(),
            "loss_mask": h.get_slice("loss_mask")[a:b],
        }
        if "aux" in h.keys():
            out["aux"] = h.get_slice("aux")[a:b]
            out["final"] = h.get_slice("final")[a:b]
        return out

    def _masks(self):
        for i in range(len(self.shards)):
            yield self._offsets[i], self._open(i).get_tensor("loss_mask")

    def learned_within(self, crop: int) -> list[int]:
        """Per sample, the loss-masked (learned) tokens among its first ``crop`` tokens."""
        out = []
        for off, mask in self._masks():
            cs = torch.zeros(mask.numel() + 1, dtype=torch.long)
            cs[1:] = mask.long().cumsum(0)
            ends = torch.minimum(off[1:], off[:-1] + crop)
            out += (cs[ends] - cs[off[:-1]]).tolist()
        return out

    def first_learned(self) -> list[int]:
        """Per sample with any, the position of its first learned token."""
        out = []
        for off, mask in self._masks():
            for a, b in zip(off[:-1].tolist(), off[1:].tolist()):
                hit = torch.nonzero(mask[a:b]).flatten()
                if hit.numel():
                    out.append(int(hit[0]))
        return out

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Frequencies of loss-masked target tokens, summed over shards: int64 [vocab_size]."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for i in range(len(self.shards)):
            h = self._open(i)
            counts.index_add_(0, h.get_tensor("count_ids"), h.get_tensor("count_values"))
        return counts
