"""The feature store readers (train's, merge-data's) against damaged copies of one valid store.

A tiny store of two shards is written with gen-data's own writers (store_build.write_shard, the
sidecar gen-data writes, store_build.write_manifest); each variant damages one thing: the
manifest or a sidecar (unparsable, each key deleted, of a wrong type, zero, negative, huge),
a shard file (truncated, one bit flipped, removed), or a shard's tensors rewritten with a
sidecar that matches them (removed, cast, reshaped, inconsistent offsets or counts). Both
readers must refuse it with one Eagle3Error line naming a file of the store, or read exactly
the samples and token counts of the valid store.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3cli.core.errors import Eagle3Error
from eagle3cli.core.io_utils import file_sha256
from eagle3cli.data.features import FeatureStore, check_complete, check_store, shard_name
from eagle3cli.data.merge_data import merge
from tests.helpers.stores import HT, make_store
from tests.helpers.tiny import tiny_config

TARGET = tiny_config("llama")


def read_train(root: Path, tmp: Path):
    """What `eagle3 train` reads before it loads a model (Trainer.setup), then every sample."""
    store = FeatureStore(root)
    check_complete(store, False, print)
    check_store(store, TARGET, online=False)
    return [store[i] for i in range(len(store))], store.token_counts(256)


def read_merge(root: Path, tmp: Path):
    out = tmp / f"merged-{len(list(tmp.iterdir()))}"
    merge(out, [root], say=lambda m: None)
    return read_train(out, tmp)


READERS = {"train": read_train, "merge-data": read_merge}


def same(a, b) -> bool:
    (sa, ca), (sb, cb) = a, b
    return torch.equal(ca, cb) and len(sa) == len(sb) and all(
        x.keys() == y.keys() and all(torch.equal(x[k].float(), y[k].float()) for k in x) for x, y in zip(sa, sb))


# ---------------------------------------------------------------------------- the variants

def _json_file(rel: str, fn):
    def apply(root: Path):
        p = root / rel
        d = json.loads(p.read_text())
        fn(d)
        p.write_text(json.dumps(d))
    return apply


def _raw(rel: str, data):
    def apply(root: Path):
        p = root / rel
        p.write_bytes(data(p.read_bytes()) if callable(data) else data)
    return apply


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _tensors(fn, shard: int = 0):
    """Rewrite shard ``shard`` and its sidecar's length and sha256 to match: a store edited by hand,
    whose bytes are what the sidecar says, so only the layout checks can catch it."""
    def apply(root: Path):
        p = root / "shards" / shard_name(0, shard)
        save_file(fn(load_file(str(p))), str(p), metadata={"format": "eagle3-features", "version": "1"})
        side = p.with_suffix(".json")
        stats = json.loads(side.read_text())
        stats.update(bytes=p.stat().st_size, sha256=file_sha256(p))
        side.write_text(json.dumps(stats))
    return apply


def _wrong(v):
    return {bool: "yes", int: "7", float: "0.5", str: 7, list: "1,2", dict: [1], type(None): "x"}[type(v)]


def _mutations(d: dict, rel: str, out: dict, label: str):
    for key, value in d.items():
        out[f"{label}-{key}-deleted"] = _json_file(rel, lambda x, k=key: x.pop(k))
        out[f"{label}-{key}-wrong-type"] = _json_file(rel, _set(key, _wrong(value)))
        for name, v in (("zero", 0), ("negative", -1), ("huge", 10 ** 15)):
            out[f"{label}-{key}-{name}"] = _json_file(rel, _set(key, v))
    for name, data in (("truncated", lambda b: b[: len(b) // 2]), ("list", b"[1, 2]"), ("empty", b""),
                       ("latin1", b'{"format": "\xe9"}')):
        out[f"{label}-file-{name}"] = _raw(rel, data)
    out[f"{label}-removed"] = lambda root: (root / rel).unlink()


def variants(valid: Path) -> dict:
    out = {}
    _mutations(json.loads((valid / "manifest.json").read_text()), "manifest.json", out, "manifest")
    side = f"shards/{shard_name(0, 0)[:-len('.safetensors')]}.json"
    _mutations(json.loads((valid / side).read_text()), side, out, "sidecar")
    out["manifest-target-id-int"] = _json_file("manifest.json", lambda d: d["target"].__setitem__("id", 5))
    out["manifest-layer_ids-str"] = _json_file("manifest.json", _set("layer_ids", ["2", 4, 5]))
    out["manifest-source-skipped-list"] = _json_file("manifest.json", lambda d: d["source"].__setitem__("skipped", [1]))
    out["sidecar-file-other-shard"] = _json_file(side, _set("file", shard_name(0, 1)))
    out["sidecar-file-path"] = _json_file(side, _set("file", "../../manifest.json"))

    rel = f"shards/{shard_name(0, 0)}"
    size = (valid / rel).stat().st_size
    header = struct.unpack("<Q", (valid / rel).read_bytes()[:8])[0]
    for cut in (0, 7, 9, header // 2, header + 8, size // 2, size - 1):
        out[f"shard-truncated-{cut}"] = _raw(rel, lambda b, c=cut: b[:c])
    g = torch.Generator().manual_seed(1)
    for pos in torch.randint(0, size, (24,), generator=g).tolist():
        out[f"shard-bitflip-{pos}"] = _raw(rel, lambda b, p=pos: b[:p] + bytes([b[p] ^ (1 << p % 8)]) + b[p + 1:])
    out["shard-removed"] = lambda root: (root / rel).unlink()

    for name in ("input_ids", "loss_mask", "offsets", "sample_ids", "count_ids", "count_values", "aux", "final"):
        out[f"tensor-{name}-removed"] = _tensors(lambda t, n=name: {k: v for k, v in t.items() if k != n})
        out[f"tensor-{name}-shortened"] = _tensors(lambda t, n=name: {**t, n: t[n][:-1].contiguous()})
        out[f"tensor-{name}-2d"] = _tensors(lambda t, n=name: {**t, n: t[n].reshape(1, -1)})
        for dt in (torch.int32, torch.int64, torch.float32, torch.bool):
            out[f"tensor-{name}-as-{dt}"] = _tensors(lambda t, n=name, d=dt: {**t, n: t[n].to(d)})
    out["tensor-offsets-not-increasing"] = _tensors(lambda t: {**t, "offsets": t["offsets"].flip(0)})
    out["tensor-offsets-past-end"] = _tensors(lambda t: {**t, "offsets": t["offsets"] + 1})
    out["tensor-count_ids-outside"] = _tensors(lambda t: {**t, "count_ids": t["count_ids"] + 256})
    out["tensor-count_ids-negative"] = _tensors(lambda t: {**t, "count_ids": t["count_ids"] - 1000})
    out["tensor-count_values-negative"] = _tensors(lambda t: {**t, "count_values": -t["count_values"]})
    out["tensor-aux-wider"] = _tensors(lambda t: {**t, "aux": torch.cat([t["aux"], t["aux"][:, :1]], 1)})
    out["tensor-final-narrower"] = _tensors(lambda t: {**t, "final": t["final"][:, 1:].contiguous()})
    out["tensor-resaved"] = _tensors(lambda t: t)  # the same tensors, the sidecar rewritten: harmless
    return out


# ---------------------------------------------------------------------------- the test

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    valid = make_store(tmp_path_factory.mktemp("store") / "valid")
    tmp = tmp_path_factory.mktemp("reads")
    return valid, {name: fn(valid, tmp) for name, fn in READERS.items()}


def test_valid_store_reads_back(world):
    valid, expected = world
    samples, counts = expected["train"]
    assert len(samples) == 6 and [int(s["input_ids"].numel()) for s in samples] == [5, 8, 11, 6, 9, 12]
    assert samples[0]["aux"].shape == (5, 3 * HT) and int(counts.sum()) == sum(n - 2 for n in [5, 8, 11, 6, 9, 12])
    assert same(expected["merge-data"], expected["train"])


def _names():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return sorted(variants(make_store(Path(tmp) / "s")))


VARIANTS = _names()


def test_there_are_many_variants():
    assert len(VARIANTS) >= 150, len(VARIANTS)


def _damaged_copy(valid: Path, name: str, tmp_path: Path) -> Path:
    """A copy of the valid store with variant ``name`` applied."""
    root = tmp_path / "store"
    shutil.copytree(valid, root)
    variants(valid)[name](root)
    return root


def _readers(tmp_path: Path):
    """(reader, its function, an empty folder of its own) for each reader."""
    for reader, fn in READERS.items():
        reads = tmp_path / f"reads-{reader}"
        reads.mkdir()
        yield reader, fn, reads


@pytest.mark.parametrize("name", VARIANTS)
def test_store_readers_refuse_in_one_line_or_read_the_valid_store(world, name, tmp_path):
    valid, expected = world
    root = _damaged_copy(valid, name, tmp_path)
    for reader, fn, reads in _readers(tmp_path):
        try:
            got = fn(root, reads)
        except (Eagle3Error, FileNotFoundError) as e:  # FileNotFoundError: no manifest (train says so in one line)
            line = str(e)
            assert line.strip() and "\n" not in line.strip(), (reader, line)
            assert str(root) in line, f"{reader}: the refusal names no file of the store: {line}"
            continue
        assert same(got, expected[reader]), f"{reader} read variant {name} as a different store"


MUST_REFUSE = ["shard-truncated-9", "sidecar-bytes-wrong-type", "manifest-run-wrong-type", "tensor-offsets-past-end",
               "tensor-aux-as-torch.float32", "tensor-count_ids-outside"] + [n for n in VARIANTS if "bitflip" in n]


@pytest.mark.parametrize("name", MUST_REFUSE)
def test_damage_is_refused_by_both(world, name, tmp_path):
    valid, _ = world
    root = _damaged_copy(valid, name, tmp_path)
    for reader, fn, reads in _readers(tmp_path):
        with pytest.raises(Eagle3Error):
            fn(root, reads)


# ---------------------------------------------------------------------------- the CLI

CLI_SAMPLE = ["manifest-file-truncated", "manifest-run-wrong-type", "sidecar-bytes-wrong-type", "sidecar-removed",
              "shard-truncated-9", "tensor-offsets-past-end"]


@pytest.mark.parametrize("name", CLI_SAMPLE)
def test_cli_refuses_in_one_line_naming_the_file(world, name, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import eagle3cli.train.trainer as trainer
    from eagle3cli.cli import app
    from tests.helpers.tiny import save_tiny

    monkeypatch.setattr(trainer, "load_target_parts", lambda *a, **k: pytest.fail("the target was loaded first"))
    valid, _ = world
    root = tmp_path / "store"
    shutil.copytree(valid, root)
    variants(valid)[name](root)
    model = save_tiny(tmp_path / "m", "llama")
    for args in (["merge-data", tmp_path / "merged", "--from", root],
                 ["train", "--data", root, "--model", model, "--out", tmp_path / "o"]):
        res = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "500"})
        errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
        assert res.exit_code == 1 and len(errors) == 1 and "Traceback" not in res.output, res.output
        assert str(root) in errors[0], errors[0]
    assert not (tmp_path / "merged" / "manifest.json").exists()
