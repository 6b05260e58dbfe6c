"""The on-disk feature store written by ``gen-data`` and read by ``train``.

Layout of a store directory::

    manifest.json                     target, layers, dtype, template hash, counts (docs/design.md §9)
    shards/shard-RR-NNNNN.safetensors one file per block of conversations (RR = writer rank)

Each shard concatenates its samples along the token axis (no pickles, one file per block
rather than per sample):

    input_ids  int32 [T]        loss_mask bool [T]       offsets int64 [n+1]
    sample_ids int64 [n]        (index of each sample in the source, for tracing)
    aux        bf16|fp16 [T, n*Ht]   target streams hidden_states[j] for the n layer ids (3 for EAGLE-3)
    final      bf16|fp16 [T, Ht]     hidden_states[N] (final-normed), for teacher logits
    count_ids, count_values int64    token frequencies over loss-masked tokens (sparse)

``aux``/``final`` are absent for ``--online`` stores (gen-data's) (online training). Shards are
written to a temporary name and renamed, so a shard file that exists is complete.

This module owns the store's contract (docs/design.md §9): the format constant, the shards and
their sidecars, the manifest as read and type-checked (:func:`read_manifest`), random access to
the samples (:class:`FeatureStore`) and the checks a reader makes before trusting a store
(:func:`check_store`, :func:`check_complete`). ``store_build`` writes shards and the manifest,
``fingerprints`` ties a store to its target and data, ``gen_data`` runs the pipeline that fills
it; ``trainer`` reads it.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..core.errors import Eagle3Error
from ..core.io_utils import file_sha256
from .fingerprints import content_hash

FORMAT = "eagle3-features"  # manifest "format" and every shard's safetensors metadata
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
FORMAT_VERSION = 1


# Only names gen-data writes: "shard-00-00000 (copy).safetensors" and the like are not shards.
SHARD_FILE = re.compile(r"^shard-(\d{2})-(\d{5})\.safetensors$")
SIDECAR_FILE = re.compile(r"^shard-(\d{2})-(\d{5})\.json$")
MAX_SHARDS = 100_000  # what the 5-digit shard index can name


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


# A sidecar's fields (store_writer.write_shard_files) and their JSON types; every reader goes through read_sidecar.
SIDECAR_INTS = ("num_samples", "num_tokens", "num_masked_tokens", "truncated", "bytes")


def read_sidecar(path: Path) -> dict:
    """A shard's stats sidecar, type-checked: StoreError naming the file and the field otherwise
    (a hand-edited or damaged sidecar is one line, never a KeyError in a sum)."""
    path = Path(path)
    try:
        stats = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StoreError(f"{path} is unreadable ({e}): rerun the gen-data command to redo that shard") from None

    def bad(name, want):
        value = stats.get(name) if isinstance(stats, dict) else stats
        return StoreError(f"{path}: {name} must be {want}, got {value!r}: rerun the gen-data command to redo that "
                          "shard")

    if not isinstance(stats, dict):
        raise bad("the sidecar", "a JSON object")
    file = stats.get("file")
    if not isinstance(file, (str, type(None))) or (file and not SHARD_FILE.match(file)):
        raise bad("file", "the shard's file name")
    for k in SIDECAR_INTS:
        v = stats.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise bad(k, "a non-negative integer")
    if not stats.get("file") and stats["num_samples"]:
        raise bad("file", f"the file of its {stats['num_samples']} samples")
    if stats.get("file") and not isinstance(stats.get("sha256"), (str, type(None))):
        raise bad("sha256", "a hex digest")
    for k in ("skipped", "regeneration"):
        if not isinstance(stats.get(k) or {}, dict):
            raise bad(k, "an object")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (stats.get("skipped") or {}).values()):
        raise bad("skipped", "counts")
    ends = stats.get("end_token_ids", [])
    if not isinstance(ends, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ends):
        raise bad("end_token_ids", "a list of token ids")
    if not isinstance(stats.get("unlearned_answers", 0), int):
        raise bad("unlearned_answers", "an integer")
    return stats


def shard_problem(sidecar: Path, hash: bool = True) -> str | None:
    """Why the shard a sidecar describes cannot be trusted (None: it is what was written).

    The sidecar records the file's byte length and sha256: a truncated copy, a file edited or
    replaced after gen-data, or a missing one is caught before anything relies on it.
    """
    try:
        stats = read_sidecar(sidecar)
    except StoreError as e:
        return str(e).rsplit(": rerun", 1)[0]
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
        file = read_sidecar(side).get("file")
        if file:
            named.append(shard_dir / file)
    if not named and not sidecars(shard_dir):
        named = [p for p in shard_dir.glob("shard-*.safetensors") if SHARD_FILE.match(p.name)]
    return sorted(named, key=shard_order)


def shard_order(path: Path):
    """Sort key of a shard file: its global index first, so that a store written by several
    ranks (or merged from several writers) lists its samples in the order one writer would."""
    m = SHARD_FILE.match(Path(path).name)
    return (int(m.group(2)), int(m.group(1))) if m else (float("inf"), 0)


# ---------------------------------------------------------------- the manifest: reader

@dataclass(frozen=True)
class Manifest:
    """The manifest fields readers rely on, type-checked (docs/design.md §9); ``raw`` is the
    whole JSON object (metadata and the model card read the rest). Absent fields are None
    (a store written by hand may omit what it does not need)."""

    raw: dict = field(repr=False)
    format: str | None = None
    version: int | None = None
    target_id: str | None = None
    target_revision: str | None = None
    content_hash: str | None = None
    model_type: str | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_layers: int | None = None
    layer_ids: tuple[int, ...] = ()
    features: str = "offline"
    chat_template_hash: str | None = None
    end_token_ids: tuple[int, ...] = ()
    complete: bool | None = None
    shards_planned: int = 0
    source: dict = field(default_factory=dict, repr=False)

    @property
    def has_features(self) -> bool:
        return self.features == "offline"

    @classmethod
    def parse(cls, raw, where: str) -> Manifest:
        def bad(name: str, want: str, got) -> StoreError:
            return StoreError(f"{where}: {name} must be {want}, got {got!r}: run the same gen-data command again")

        if not isinstance(raw, dict):
            raise StoreError(f"{where} is not a JSON object: run the same gen-data command again")

        def get(name: str, *types, src=raw):
            v = src.get(name)
            if v is not None and (not isinstance(v, types) or (bool not in types and isinstance(v, bool))):
                raise bad(name, " or ".join(t.__name__ for t in types), v)
            return v

        target = get("target", dict) or {}
        for name in ("run", "skipped"):  # what merge-data fingerprints and sums
            get(name, dict)
        if not isinstance((get("source", dict) or {}).get("skipped") or {}, dict):
            raise bad("source.skipped", "an object", raw["source"]["skipped"])
        for name in ("num_samples", "num_tokens", "shards_done"):
            if get(name, int) is not None and raw[name] < 0:
                raise bad(name, "a non-negative integer", raw[name])
        for name, top in (("hidden_size", 1 << 16), ("vocab_size", 1 << 24), ("num_layers", 1 << 12)):
            if get(name, int) is not None and not 0 < raw[name] <= top:
                raise bad(name, f"an integer from 1 to {top:,}", raw[name])
        if not 0 <= (get("shards_planned", int) or 0) <= MAX_SHARDS:  # shard files number at most 5 digits
            raise bad("shards_planned", f"an integer from 1 to {MAX_SHARDS}", raw["shards_planned"])
        version = get("version", int, str)
        try:
            version = int(version) if version is not None else None
        except ValueError:
            raise bad("version", "an integer", version) from None
        layer_ids = get("layer_ids", list) or []
        end_ids = get("end_token_ids", list) or []
        for name, ids in (("layer_ids", layer_ids), ("end_token_ids", end_ids)):
            if not all(isinstance(j, int) and not isinstance(j, bool) for j in ids):
                raise bad(name, "a list of integers", ids)
        return cls(raw=raw, format=get("format", str), version=version,
                   target_id=get("id", str, src=target), target_revision=get("revision", str, src=target),
                   content_hash=get("content_hash", str, src=target), model_type=get("model_type", str),
                   hidden_size=get("hidden_size", int), vocab_size=get("vocab_size", int),
                   num_layers=get("num_layers", int), layer_ids=tuple(layer_ids),
                   features=get("features", str) or "offline", chat_template_hash=get("chat_template_hash", str),
                   end_token_ids=tuple(end_ids), complete=get("complete", bool),
                   shards_planned=get("shards_planned", int) or 0, source=get("source", dict) or {})


def read_manifest(root: str | Path) -> Manifest:
    """The manifest of a store folder, type-checked; FileNotFoundError when there is none."""
    mpath = Path(root) / MANIFEST
    if not mpath.exists():
        raise FileNotFoundError(f"{root} is not a feature store (no {MANIFEST}); run `eagle3 gen-data` first")
    try:
        raw = json.loads(mpath.read_text())
    except ValueError as e:  # JSON or UTF-8: the manifest is rewritten by every gen-data run
        raise StoreError(f"{mpath} is not valid JSON ({e}): run the same gen-data command again") from None
    return Manifest.parse(raw, str(mpath))


class FeatureStore:
    """Random access to the samples of a store (lazy: only the requested rows are read)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.meta = read_manifest(self.root)  # typed fields; ``manifest`` is the JSON object itself
        self.manifest = self.meta.raw
        self.shards = store_shard_files(self.root)
        self.verify(hash=False)  # lengths only (a stat each); problems() also compares the hashes
        self._handles: dict[int, object] = {}
        self._offsets: list[torch.Tensor] = []
        starts = [0]
        for i, p in enumerate(self.shards):
            if not p.is_file():
                raise StoreError(f"store {self.root}: {p.name} is missing: rerun the gen-data command to redo it")
            off = check_shard(self._open(i), p, self.meta)
            self._offsets.append(off)
            starts.append(starts[-1] + off.numel() - 1)
        self._starts = starts

    def _open(self, i: int):
        h = self._handles.get(i)
        if h is None:
            from safetensors import SafetensorError

            try:
                h = safe_open(str(self.shards[i]), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
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
        return self.meta.has_features

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


# ---------------------------------------------------------------- checks before a store is trusted

INT_DTYPES = ("I32", "I64")
FEATURE_DTYPES = ("BF16", "F16", "F32")


def check_shard(handle, path: Path, meta: Manifest) -> torch.Tensor:
    """A shard's layout against the store contract (module docstring) and its manifest, from the
    header and the small index tensors only: every tensor present with its dtype and shape,
    offsets running from 0 to the token count, token counts inside the vocabulary. Returns the
    offsets. (The bytes themselves are checked against the sidecar's sha256: check_complete.)"""
    def bad(what: str) -> StoreError:
        return StoreError(f"{path}: {what}: rerun the gen-data command to redo that shard")

    names = set(handle.keys())
    need = ["input_ids", "loss_mask", "offsets", "sample_ids", "count_ids", "count_values"]
    need += ["aux", "final"] if meta.has_features else []
    missing = [k for k in need if k not in names]
    if missing:
        raise bad(f"tensors {missing} are missing")
    shape = {k: tuple(handle.get_slice(k).get_shape()) for k in need}
    dtype = {k: handle.get_slice(k).get_dtype() for k in need}
    want = {"input_ids": INT_DTYPES, "loss_mask": ("BOOL",), "offsets": ("I64",), "sample_ids": ("I64",),
            "count_ids": ("I64",), "count_values": ("I64",), "aux": FEATURE_DTYPES, "final": FEATURE_DTYPES}
    recorded = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(meta.raw.get("dtype"))
    if recorded:  # the manifest's feature dtype (gen-data --feature-dtype)
        want.update(aux=(recorded,), final=(recorded,))
    for k in need:
        if dtype[k] not in want[k]:
            raise bad(f"{k} has dtype {dtype[k]}, expected {' or '.join(want[k])}")
    tokens = shape["input_ids"][0] if len(shape["input_ids"]) == 1 else -1
    off = handle.get_tensor("offsets")
    n = off.numel() - 1
    ht = meta.hidden_size
    expect = {"input_ids": (tokens,), "loss_mask": (tokens,), "offsets": (n + 1,), "sample_ids": (n,),
              "count_values": shape["count_ids"][:1]}
    if meta.has_features:
        streams = len(meta.layer_ids) or 3
        expect.update(aux=(tokens, streams * ht if ht else shape["aux"][-1]), final=(tokens, ht or shape["final"][-1]))
    for k, s in expect.items():
        if tokens < 0 or n < 0 or shape[k] != s or len(shape["count_ids"]) != 1:
            raise bad(f"{k} has shape {list(shape[k])}, the shard's input_ids and the manifest imply {list(s)}")
    if int(off[0]) != 0 or int(off[-1]) != tokens or bool((off[1:] < off[:-1]).any()):
        raise bad(f"offsets do not run from 0 to the {tokens} tokens in increasing steps")
    ids, counts = handle.get_tensor("count_ids"), handle.get_tensor("count_values")
    v = meta.vocab_size
    if bool((ids < 0).any()) or (v and bool((ids >= v).any())) or bool((counts < 0).any()):
        raise bad(f"count_ids/count_values hold token ids outside the vocabulary (0..{(v or 0) - 1}) or negative "
                  "counts")
    return off


def check_store(store: FeatureStore, target_config, *, online: bool, layers: str | None = None,
                chat_template: str | None = None, model: str | None = None, revision: str | None = None):
    """Refuse a store made for another target, other layers or another chat template."""
    from ..config.options import parse_layer_ids
    from ..core.hf_utils import text_config
    from ..model.layers import num_layers
    from .chat_mask import template_hash

    m, root = store.meta, store.root
    if m.format != FORMAT or m.version != FORMAT_VERSION:
        raise StoreError(f"{root} is not an eagle3 feature store of version {FORMAT_VERSION} "
                         f"(format {m.format!r}, version {m.raw.get('version')!r})")
    tc = text_config(target_config)
    tid = m.target_id
    # Multimodal wrappers (Gemma-3) report the outer or the text model_type: either matches.
    types = {getattr(target_config, "model_type", None), getattr(tc, "model_type", None)}
    if m.model_type is not None and m.model_type not in types:
        raise StoreError(f"store {root} was made with another target ({tid}: model_type "
                         f"{m.model_type}, this target has {getattr(tc, 'model_type', None)})")
    want = {"hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size, "num_layers": num_layers(target_config)}
    for key, value in want.items():
        stored = getattr(m, key)
        if stored is not None and stored != value:
            raise StoreError(f"store {root} was made with another target ({tid}: {key} {stored}, "
                             f"this target has {value})")
    if m.target_revision and revision and m.target_revision != revision:
        raise StoreError(f"store {root} was made with revision {m.target_revision} of {tid}, --revision is {revision}")
    if online and model:
        # No stored features to compare against: the weight fingerprint is the identity.
        here = content_hash(model)
        if m.content_hash and here and m.content_hash != here:
            raise StoreError(f"store {root} was made with another target: {model}'s weights fingerprint "
                             f"differs from the one recorded for {tid}")
    expect = parse_layer_ids(layers)
    if expect is not None and not set(expect) <= set(m.layer_ids):
        raise StoreError(f"store {root} holds layers {m.layer_ids}, "
                         f"--layers asks for {tuple(expect)}: regenerate the store with those layers")
    stored = m.chat_template_hash
    if stored and chat_template is not None and template_hash(chat_template) != stored:
        raise StoreError(f"store {root} was made with another chat template (sha256 {stored[:12]}..., "
                         f"this one {template_hash(chat_template)[:12]}...): pass --chat-template with gen-data's")
    if not online and not m.has_features:
        raise StoreError(f"store {root} holds tokens only (features 'none'): train it with --online")


def check_complete(store: FeatureStore, allow_incomplete: bool, say) -> None:
    """Refuse a store whose gen-data run has not finished (unless allowed: then say what is
    missing) and one whose shards no longer match their sidecars."""
    m = store.meta
    if m.complete is False:
        planned = m.shards_planned
        missing = sorted(set(range(planned)) - set(sidecars(store.root / SHARD_DIR)))
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        what = (f"{planned - len(missing)} of {planned} shards are done (missing: {shown})" if missing
                else "it holds no samples")
        if not allow_incomplete:
            raise StoreError(f"store {store.root} is incomplete: {what}: finish it by running the same gen-data "
                             "command again (every --shard rank), or pass --allow-incomplete to train on what is there")
        say(f"[yellow]warning:[/] store {store.root} is incomplete ({what}); training on it (--allow-incomplete)")
    else:
        check_counts(store)
    store.verify(hash=True)  # every shard against the sha256 its sidecar recorded


def check_counts(store: FeatureStore):
    """A sealed store holds what its manifest counts: every planned shard's sidecar, and as many
    samples in the shards as the manifest says (a sidecar lost or edited is caught here)."""
    m = store.meta
    missing = sorted(set(range(m.shards_planned)) - set(sidecars(store.root / SHARD_DIR)))
    if missing:
        raise StoreError(f"store {store.root}: {MANIFEST} plans {m.shards_planned} shards but the sidecar of shard "
                         f"{missing[0]} is missing: run the same gen-data command again to redo it")
    counted = m.raw.get("num_samples")
    if counted is not None and counted != len(store):
        raise StoreError(f"store {store.root}: {MANIFEST} counts {counted} samples, its shards hold {len(store)}: "
                         "run the same gen-data command again")
