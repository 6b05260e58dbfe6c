"""gen-data's output folder: which shards this process writes, the settings a rerun must match to
resume (or replace, with --overwrite), the regenerated answers saved per shard, and each finished
shard's safetensors file with its stats sidecar (written last: its existence marks the shard done)."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

from ..config.options import GenDataOptions
from ..core.io_utils import atomic_write_bytes, ensure_dir, file_sha256, write_json
from .features import MANIFEST, SHARD_DIR, shard_name, shard_problem
from .gen_errors import GenDataError
from .sources import Conversation
from .store_build import write_shard

REGEN_DIR = "regenerated"


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``--shard i/n`` -> (i, n) with 0 <= i < n."""
    if not text:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise GenDataError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise GenDataError(f"--shard {text}: need 0 <= i < n")
    return i, n


def rank_and_world(shard: str | None):
    """(rank, world size, device or None, accelerate state or None): --shard wins, else the
    ``accelerate launch`` environment, else a single process."""
    parsed = parse_shard(shard)
    if parsed:
        return parsed[0], parsed[1], None, None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        state = PartialState()
        return state.process_index, state.num_processes, str(state.device), state
    return 0, 1, None, None


def run_settings(opts: GenDataOptions, spec, template_sha: str, layer_ids, data_fingerprint,
                 regen: str | None = None, capture: str | None = None) -> dict:
    """The settings that shape the stored data: a rerun must match them to resume. ``regen`` and
    ``capture``: the dtypes local regeneration and capture compute in, when not the target's own."""
    return {
        "model": spec.model, "revision": spec.revision, "dtype": spec.dtype, "adapter": spec.adapter,
        "load_in_8bit": spec.load_in_8bit, "load_in_4bit": spec.load_in_4bit,
        "data": opts.data, "data_fingerprint": data_fingerprint, "format": opts.format, "split": opts.split,
        "subset": opts.subset, "max_samples": opts.max_samples, "shuffle": opts.shuffle, "seed": opts.seed,
        "regenerate": opts.regenerate, "max_new_tokens": opts.max_new_tokens if opts.regenerate else None,
        "temperature": opts.temperature if opts.regenerate else None,
        "top_p": opts.top_p if opts.regenerate else None, "system": opts.system,
        "chat_template_hash": template_sha, "features": opts.features, "layer_ids": list(layer_ids),
        "max_length": opts.max_length, "shard_size": opts.shard_size,
        "feature_dtype": opts.feature_dtype if opts.features == "offline" else None,
        # Only when not the default, so that stores written before the option still resume.
        **({"capture_engine": opts.engine} if opts.engine != "hf" else {}),
        **({"regen_dtype": regen} if regen else {}),
        **({"capture_dtype": capture} if capture else {}),
        **({"reasoning": opts.reasoning} if opts.reasoning else {}),
        **({"last_turn_only": True} if opts.last_turn_only else {}),
    }


def prepare_out(out: Path, settings: dict, overwrite: bool, rank: int, world: int = 1):
    """Start, resume or (with overwrite) replace a store; refuse to mix different runs."""
    mpath = out / MANIFEST
    existing = [p for p in out.iterdir()] if out.is_dir() else []
    if existing and not overwrite:
        if not mpath.exists():
            raise GenDataError(f"--out {out} is not empty and holds no gen-data manifest: choose another --out "
                               "or pass --overwrite")
        old = json.loads(mpath.read_text()).get("run") or {}
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            raise GenDataError(f"--out {out} holds a run with different settings ({', '.join(diff)}): pass "
                               "--overwrite to replace it, or choose another --out")
        if world == 1:  # half-written files of a killed run (never of a live rank: single process only)
            for d in (out, out / SHARD_DIR, out / REGEN_DIR):
                for p in d.glob(".*.tmp-*") if d.is_dir() else []:
                    p.unlink()
        return "resume"
    if existing and overwrite:
        # Only what gen-data writes, and for a multi-rank run only this rank's own shards.
        pattern = "shard-*" if world == 1 else f"shard-{rank:02d}-*"
        for p in (out / SHARD_DIR).glob(pattern) if (out / SHARD_DIR).is_dir() else []:
            p.unlink()
        if rank == 0:
            shutil.rmtree(out / REGEN_DIR, ignore_errors=True)
            if mpath.exists():
                mpath.unlink()
        return "overwrite"
    ensure_dir(out)
    return "new"


def read_regenerated(path: Path) -> tuple[list[Conversation | None], dict]:
    """A shard's regenerated conversations (None where the answer was rejected) and their stats."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    stats = json.loads(path.with_suffix(".stats.json").read_text())
    return [None if "rejected" in r else Conversation(r["id"], r["messages"], r.get("tools")) for r in rows], stats


def write_regenerated(path: Path, convs: list[Conversation], results: list, stats: dict):
    """Save a shard's regenerated answers before anything else, so a crash never pays for them twice."""
    ensure_dir(path.parent)
    write_json(path.with_suffix(".stats.json"), stats)  # first: a .jsonl that exists has its stats
    lines = []
    for c, msgs in zip(convs, results):
        row = {"id": c.id, "messages": msgs, **({"tools": c.tools} if c.tools else {})}
        if msgs is None:
            row["rejected"] = stats.get("rejected", {}).get(str(c.id), "rejected")
        lines.append(json.dumps(row, ensure_ascii=False))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))


def verify_done(done: dict[int, Path], mine: list[int], console) -> dict[int, Path]:
    """Finished shards of this rank that match their sidecar; the others are deleted and redone."""
    for s in [s for s in mine if s in done]:
        problem = shard_problem(done[s])
        if problem:
            console.print(f"[yellow]shard {s}: {problem}: redoing it[/]", highlight=False)
            shard = done[s].with_suffix(".safetensors")
            done.pop(s).unlink()  # the sidecar first: a shard without one is unfinished
            shard.unlink(missing_ok=True)
    return done


def write_shard_files(out: Path, rank: int, index: int, samples: list[dict], feature_dtype: str, skipped: Counter,
                      truncated: int, unlearned: int, ends: set, regen_stats: dict | None) -> dict:
    """Write shard ``index``'s samples (none: no file) and then its sidecar; returns the sidecar's stats."""
    import torch

    name = shard_name(rank, index)
    path = out / SHARD_DIR / name
    if samples:
        for s in samples:
            s.pop("media", None)  # the images' tensors served the capture; the store keeps their tokens
            s["input_ids"] = torch.tensor(s["input_ids"], dtype=torch.int32)
            s["loss_mask"] = torch.tensor(s["loss_mask"], dtype=torch.bool)
        dtype = getattr(torch, feature_dtype)
        write_shard(path, samples, dtype=dtype)
    stats = {
        "shard": index, "rank": rank, "file": name if samples else None,
        "num_samples": len(samples), "num_tokens": sum(int(s["input_ids"].numel()) for s in samples),
        "num_masked_tokens": sum(int(s["loss_mask"].sum()) for s in samples), "truncated": truncated,
        "bytes": path.stat().st_size if samples else 0, "skipped": {k: v for k, v in skipped.items() if v},
        "sha256": file_sha256(path) if samples else None,  # resume and train verify the file against it
        "end_token_ids": sorted(ends), "unlearned_answers": unlearned,
        "regeneration": {k: v for k, v in (regen_stats or {}).items() if k != "rejected"} or None,
    }
    ensure_dir(out / SHARD_DIR)
    write_json(path.with_suffix(".json"), stats)  # last: its existence marks the shard finished
    return stats
