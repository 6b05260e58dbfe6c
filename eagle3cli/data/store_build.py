"""Building a feature store (the format ``features`` defines and reads): each shard's file, and the
manifest written from gen-data's base and the totals of the shards' sidecars."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from ..core.io_utils import ensure_dir, save_safetensors, write_json
from .features import FORMAT, FORMAT_VERSION, MANIFEST, SHARD_DIR, read_sidecar, sidecars


def write_shard(path: Path, samples: list[dict], dtype: torch.dtype = torch.bfloat16):
    """Write one shard atomically. Each sample: input_ids [T], loss_mask [T], sample_id,
    and optionally aux [T,3Ht] and final [T,Ht]."""
    path = Path(path)
    ensure_dir(path.parent)
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
    # The store is often shared by a team: the file gets open()'s mode, not safetensors' 0600.
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, path,
                     metadata={"format": FORMAT, "version": str(FORMAT_VERSION)})


# ---------------------------------------------------------------- the manifest: writer

def new_manifest(*, target: dict, model_type: str | None, hidden_size: int, vocab_size: int | None,
                 num_layers: int, layer_ids, features: str, dtype: str, chat_template_hash: str | None,
                 max_length: int, skipped: dict, end_token_ids, source: dict, version: str, run: dict) -> dict:
    """The fields of a manifest fixed when gen-data starts (totals are zero until shards finish;
    :func:`aggregate` adds them). ``target`` is {id, revision, content_hash}."""
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "target": dict(target),
        "model_type": model_type, "hidden_size": hidden_size, "vocab_size": vocab_size, "num_layers": num_layers,
        "layer_ids": list(layer_ids), "features": features, "dtype": dtype, "chat_template_hash": chat_template_hash,
        "max_length": max_length, "num_samples": 0, "num_tokens": 0, "num_masked_tokens": 0, "bytes": 0,
        "truncated": 0, "skipped": dict(skipped), "end_token_ids": sorted(end_token_ids),
        # The reader's own skips, kept apart from the shards' (merge-data rebuilds the totals).
        "source": dict(source, skipped=dict(skipped)),
        "eagle3_version": version, "run": run,
    }


def finished_shards(out: Path) -> dict[int, Path]:
    """Global shard index -> its sidecar, for every finished shard (any rank wrote it)."""
    return sidecars(Path(out) / SHARD_DIR)


def aggregate(out: Path, base: dict, n_shards: int) -> dict:
    """The manifest: base fields plus totals over every finished shard's sidecar."""
    man = dict(base)
    totals = Counter()
    skipped = Counter(base.get("skipped") or {})
    ends = set(base.get("end_token_ids") or [])
    regen = Counter()
    done = finished_shards(out)
    for side in done.values():
        s = read_sidecar(side)
        for k in ("num_samples", "num_tokens", "num_masked_tokens", "truncated", "bytes"):
            totals[k] += s[k]
        totals["unlearned_answers"] += s.get("unlearned_answers", 0)
        skipped.update(s.get("skipped") or {})
        ends.update(s.get("end_token_ids") or [])
        regen.update(s.get("regeneration") or {})
    for k in ("num_samples", "num_tokens", "num_masked_tokens", "bytes", "truncated", "unlearned_answers"):
        man[k] = totals[k]
    man["skipped"] = dict(skipped)
    man["end_token_ids"] = sorted(ends)
    man["source"] = dict(man.get("source") or {}, regeneration=dict(regen) if regen else None)
    man["shards_planned"] = n_shards
    man["shards_done"] = len(done)
    man["complete"] = len(done) == n_shards and totals["num_samples"] > 0  # an empty store is no result
    return man


def write_manifest(out: Path, base: dict, n_shards: int) -> dict:
    """Rewrite until stable: several ranks may finish shards at the same moment."""
    out = Path(out)
    while True:
        before = len(finished_shards(out))
        man = aggregate(out, base, n_shards)
        write_json(out / MANIFEST, man)
        if len(finished_shards(out)) == before:
            return man
