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

import json
import os
from bisect import bisect_right
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# They lived here; still importable from this module (gen_data and trainer do).
from .io_utils import atomic_write_bytes, default_file_mode, write_json  # noqa: F401

MANIFEST = "manifest.json"
SHARD_DIR = "shards"
FORMAT_VERSION = 1


def shard_name(rank: int, index: int) -> str:
    return f"shard-{rank:02d}-{index:05d}.safetensors"


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
        self.manifest = json.loads(mpath.read_text())
        self.shards = sorted((self.root / SHARD_DIR).glob("shard-*.safetensors"))
        self._handles: dict[int, object] = {}
        self._offsets: list[torch.Tensor] = []
        starts = [0]
        for i, p in enumerate(self.shards):
            off = self._open(i).get_tensor("offsets")
            self._offsets.append(off)
            starts.append(starts[-1] + off.numel() - 1)
        self._starts = starts

    def _open(self, i: int):
        h = self._handles.get(i)
        if h is None:
            h = safe_open(str(self.shards[i]), framework="pt")
            self._handles[i] = h
        return h

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

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Frequencies of loss-masked target tokens, summed over shards: int64 [vocab_size]."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for i in range(len(self.shards)):
            h = self._open(i)
            counts.index_add_(0, h.get_tensor("count_ids"), h.get_tensor("count_values"))
        return counts
