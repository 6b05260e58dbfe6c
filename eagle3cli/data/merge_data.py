"""merge-data: seal one feature store from the shards that several gen-data writers wrote.

Writers (``--shard i/n`` runs on several machines, ``accelerate launch`` ranks, vLLM engine
instances) need no coordination beyond the shard naming: writer i of n writes the shards s with
s % n == i, each folder's manifest says how many shards the run plans (``shards_planned``) and
under which settings. The merge trusts nothing it has not checked, and checks everything before
it writes a byte:

1. every ``--from`` folder is a store whose settings fingerprint
   (:func:`fingerprints.settings_fingerprint`) equals the first one's;
2. every planned shard index is present exactly once over all folders (a second copy, even
   under another rank's name, is refused), and none lies beyond the plan;
3. every shard matches its sidecar (byte length and sha256, :func:`features.shard_problem`).

Then the shards (with their sidecars and regenerated parts) are copied into OUT, or linked and
the sources removed with ``move``; an existing file in OUT is kept only when it holds the same
bytes, never replaced. OUT's manifest is written first (incomplete) and sealed last
(``complete``), so an interrupted merge is finished by running it again: OUT's own copies of a
source's shard (same name, same bytes) count as that shard, not as a duplicate.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import Eagle3Error
from .features import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SHARD_DIR,
    SIDECAR_FILE,
    Manifest,
    StoreError,
    check_shard,
    read_sidecar,
    shard_problem,
)
from .fingerprints import settings_fingerprint
from .store_build import aggregate, write_manifest
from .store_writer import REGEN_DIR

TOTALS = ("num_samples", "num_tokens", "num_masked_tokens", "bytes", "truncated", "unlearned_answers",
          "shards_done", "complete")


class MergeError(Eagle3Error, ValueError):
    """Shards that do not make one store; the message names the shard (or folder) and the fix."""


@dataclass
class Shard:
    """One finished shard in one folder: its sidecar, and the file it names (None: no sample survived)."""

    index: int
    rank: int
    root: Path
    sidecar: Path
    stats: dict

    @property
    def file(self) -> Path | None:
        return self.sidecar.parent / self.stats["file"] if self.stats.get("file") else None

    def same_as(self, other: Shard) -> bool:
        """The same shard copied: same names, same recorded bytes."""
        return self.sidecar.name == other.sidecar.name and self.stats.get("sha256") == other.stats.get("sha256")


def read_source(root: Path, flag: str = "--from") -> tuple[dict, list[Shard]]:
    """A writer's folder: (its manifest, its finished shards). Shard files without a sidecar are
    unfinished and not listed."""
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise MergeError(f"{flag} {root} is not a feature store (no {MANIFEST}): name the folder gen-data wrote "
                         "(its --out)")
    try:
        man = json.loads(mpath.read_text())
    except ValueError as e:
        raise MergeError(f"{mpath} is not valid JSON ({e}): rerun that folder's gen-data command") from None
    if not isinstance(man, dict) or not isinstance(man.get("shards_planned"), int) or isinstance(
            man["shards_planned"], bool) or man["shards_planned"] < 1:
        raise MergeError(f"{mpath} records no shards_planned: rerun that folder's gen-data command")
    try:
        meta = Manifest.parse(man, str(mpath))  # the fields the fingerprint and the totals read, type-checked
    except StoreError as e:
        raise MergeError(str(e).replace("run the same gen-data command again", "rerun that folder's gen-data "
                                        "command")) from None
    if (meta.format, meta.version) != (FORMAT, FORMAT_VERSION):
        raise MergeError(f"{mpath}: format {meta.format!r} version {meta.version!r}, expected {FORMAT!r} version "
                         f"{FORMAT_VERSION}: not a store this version writes; rerun that folder's gen-data command")
    shards = []
    for p in sorted((root / SHARD_DIR).glob("shard-*.json")) if (root / SHARD_DIR).is_dir() else []:
        m = SIDECAR_FILE.match(p.name)
        if not m:
            continue
        try:
            stats = read_sidecar(p)
        except StoreError as e:
            raise MergeError(str(e).replace("rerun the gen-data command", "rerun that folder's gen-data command")) \
                from None
        shards.append(Shard(int(m.group(2)), int(m.group(1)), root, p, stats))
    return man, shards


def _differing(a: dict, b: dict) -> list[str]:
    ra, rb = a.get("run") or {}, b.get("run") or {}
    keys = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k) and k not in ("model", "data"))
    for k in ("shards_planned", "format", "version"):
        if a.get(k) != b.get(k):
            keys.append(k)
    if (a.get("target") or {}).get("content_hash") != (b.get("target") or {}).get("content_hash"):
        keys.append("target weights")
    return keys or ["model or data path"]


def plan(out: Path, sources: list[Path]) -> tuple[dict, dict[int, Shard], list[Path]]:
    """Check that the sources make one store: (the first manifest, index -> the shard to keep,
    the folders read). OUT counts as a source when it already holds shards of the same run (an
    earlier, interrupted merge, or OUT named with --from)."""
    seen = set()
    for s in sources:
        if s.resolve() in seen:
            raise MergeError(f"--from {s} is given twice: name each writer's folder once")
        seen.add(s.resolve())
    read = [(s, *read_source(s)) for s in sources]
    first_root, first, _ = read[0]
    fingerprint = settings_fingerprint(first)
    for root, man, _ in read[1:]:
        if settings_fingerprint(man) != fingerprint:
            raise MergeError(f"--from {root} was written with other settings than {first_root} "
                             f"({', '.join(_differing(first, man))}): its shards belong to another store; "
                             "merge only the folders of one gen-data run")
    if out.resolve() not in seen and (out / MANIFEST).is_file():
        man, shards = read_source(out, "OUT")
        if settings_fingerprint(man) != fingerprint:
            raise MergeError(f"OUT {out} holds another store ({', '.join(_differing(first, man))} differ): "
                             "choose an empty OUT")
        read.append((out, man, shards))
    elif out.resolve() not in seen and out.exists() and any(out.iterdir()):
        raise MergeError(f"OUT {out} is not empty and holds no feature store: choose an empty or new folder")
    planned = first["shards_planned"]
    chosen: dict[int, Shard] = {}
    for root, _, shards in read:
        for sh in shards:
            if not 0 <= sh.index < planned:
                raise MergeError(f"{sh.sidecar}: shard {sh.index} lies beyond the {planned} shards the run plans "
                                 "(another run's file): remove it")
            had = chosen.get(sh.index)
            if had is None:
                chosen[sh.index] = sh
            elif (out.resolve() in (had.root.resolve(), sh.root.resolve())) and had.same_as(sh):
                if sh.root.resolve() != out.resolve():
                    chosen[sh.index] = sh  # copy from the source; OUT's identical copy stays as it is
            else:
                raise MergeError(f"shard {sh.index} is duplicated: {had.sidecar} and {sh.sidecar} (two writers "
                                 "wrote it: were the --shard i/n splits planned with the same n?): remove one")
    missing = [i for i in range(planned) if i not in chosen]
    if missing:
        i = missing[0]
        listed = f"{', '.join(map(str, missing[1:6]))}{' ...' if len(missing) > 6 else ''}"
        more = f" (and {len(missing) - 1} more: {listed})" if len(missing) > 1 else ""
        unfinished = [r for r, _, _ in read if any((r / SHARD_DIR).glob(f"shard-??-{i:05d}.safetensors"))]
        where = f" ({unfinished[0]} holds it unfinished)" if unfinished else ""
        raise MergeError(f"shard {i} of {planned} is missing{more}{where}: finish the gen-data run that writes it "
                         "(run it again to resume) or add its folder with --from")
    meta = Manifest.parse(first, str(sources[0] / MANIFEST))
    for i, sh in sorted(chosen.items()):
        problem = shard_problem(sh.sidecar, hash=True)
        if problem:
            raise MergeError(f"shard {i} in {sh.root}: {problem}: rerun that folder's gen-data command to redo it")
        if sh.file:
            _check_layout(sh, meta)
    return first, chosen, [r for r, _, _ in read]


def _check_layout(sh: Shard, meta: Manifest):
    """The shard's tensors against the store contract (features.check_shard) and the counts its
    sidecar gives the manifest: a shard whose sidecar was rewritten to match a damaged file, or
    a sidecar edited after the fact, is not sealed into a store."""
    from safetensors import safe_open

    path = sh.file
    try:
        with safe_open(str(path), framework="pt") as h:
            off = check_shard(h, path, meta)
        held = {"num_samples": off.numel() - 1, "num_tokens": int(off[-1])}
        for k, n in held.items():
            if sh.stats[k] != n:
                raise MergeError(f"{sh.sidecar}: {k} {sh.stats[k]}, its shard holds {n}: rerun that folder's "
                                 "gen-data command to redo that shard")
    except MergeError:
        raise
    except StoreError as e:
        raise MergeError(str(e).replace("rerun the gen-data command", "rerun that folder's gen-data command")) \
            from None
    except Exception as e:  # noqa: BLE001 - an unreadable header of any kind is one line
        raise MergeError(f"{path} is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__}): rerun "
                         "that folder's gen-data command to redo that shard") from None


def _place(src: Path, dst: Path, link: bool):
    """Put a copy of src at dst (a hard link when ``link`` and the filesystem allows); a file
    already at dst is kept only when it holds the same bytes."""
    if dst.exists():
        if dst.resolve() == src.resolve() or filecmp.cmp(src, dst, shallow=False):
            return
        raise MergeError(f"{dst} already exists and differs from {src}: it is never replaced; remove it or "
                         "choose an empty OUT")
    from ..core.io_utils import atomic_path

    with atomic_path(dst) as tmp:
        try:
            if not link:
                raise OSError
            os.link(src, tmp)
        except OSError:  # other filesystem, or a copy was asked for
            shutil.copyfile(src, tmp)
            shutil.copymode(src, tmp)
        if tmp.stat().st_size != src.stat().st_size:
            raise MergeError(f"copying {src} to {dst} wrote {tmp.stat().st_size} bytes: check the disk and run the "
                             "same merge-data command again")


def _files_of(sh: Shard) -> list[Path]:
    """What travels with a shard, sidecar last (its presence marks the shard finished)."""
    regen = sh.root / REGEN_DIR / f"part-{sh.index:05d}.jsonl"
    extra = [regen.with_suffix(".stats.json"), regen] if regen.is_file() else []
    return ([sh.file] if sh.file else []) + extra + [sh.sidecar]


def reading_skips(man: dict, shards: list[Shard]) -> dict:
    """The rows the source reader skipped (the same for every writer: each reads all the data).
    Recorded as source.skipped; older manifests folded them into ``skipped``: take the shards' back out."""
    if isinstance((man.get("source") or {}).get("skipped"), dict):
        return dict(man["source"]["skipped"])
    left = Counter(man.get("skipped") or {})
    for sh in shards:
        left.subtract(sh.stats.get("skipped") or {})
    return {k: v for k, v in left.items() if v > 0}


def merge(out: Path, sources: list[Path], move: bool = False, say=print) -> dict:
    """Validate the writers' folders, gather their shards into OUT, seal its manifest."""
    out, sources = Path(out), [Path(s) for s in sources]
    if not sources:
        raise MergeError("name at least one writer's folder with --from")
    first, chosen, folders = plan(out, sources)
    first_shards = [sh for sh in chosen.values() if sh.root.resolve() == sources[0].resolve()]
    base = {k: v for k, v in first.items() if k not in TOTALS}
    base["skipped"] = reading_skips(first, first_shards or [])
    base["merged_from"] = [str(s) for s in sources]
    planned = first["shards_planned"]
    from ..core.io_utils import ensure_dir

    ensure_dir(out)
    write_manifest(out, dict(base), planned)  # incomplete until every shard is in: a rerun finishes it
    copied = 0
    for i, sh in sorted(chosen.items()):
        if sh.root.resolve() == out.resolve():
            continue
        for f in _files_of(sh):
            sub = SHARD_DIR if f.parent.name == SHARD_DIR else REGEN_DIR
            _place(f, out / sub / f.name, link=move)
        copied += 1
    man = aggregate(out, dict(base), planned)
    if not man["complete"]:  # every shard was checked: only a store without any sample lands here
        raise MergeError(f"the merged store {out} holds no samples: check the gen-data runs' skipped counts")
    from ..core.io_utils import write_json

    write_json(out / MANIFEST, man)
    say(f"merged {planned} shards ({copied} {'moved' if move else 'copied'}) from {len(sources)} folder(s) "
        f"into {out}: {man['num_samples']} samples, {man['num_tokens']:,} tokens; sealed")
    if move:
        for root in folders:
            if root.resolve() != out.resolve():
                _remove_moved(root, [sh for sh in chosen.values() if sh.root.resolve() == root.resolve()])
    return man


def _remove_moved(root: Path, shards: list[Shard]):
    """After sealing: the sources' copies of the moved shards, then the folder if nothing else is left."""
    for sh in shards:
        for f in _files_of(sh):
            f.unlink(missing_ok=True)
    for d in (root / SHARD_DIR, root / REGEN_DIR):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    if [p.name for p in root.iterdir()] == [MANIFEST]:
        (root / MANIFEST).unlink()
        root.rmdir()
