"""merge-data: two gen-data writers (--shard 0/2 and 1/2, each into its own folder) make one store."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.config.options import GenDataOptions
from eagle3cli.config.train_config import TrainConfig
from eagle3cli.data.features import FeatureStore
from eagle3cli.data.gen_data import run
from eagle3cli.data.merge_data import MergeError, merge
from eagle3cli.model.target import TargetSpec
from eagle3cli.train.trainer import train


def conversations(n):
    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": f"Question {i}: what is {i} times three?"},
                 {"from": "gpt", "value": f"It is {3 * i}, since {i} + {i} + {i} = {3 * i}."}]
        rows.append({"id": str(i), "conversations": turns})
    return rows


@pytest.fixture(scope="module")
def writers(smol_tiny_dir, tmp_path_factory):
    """(one single-writer store, [writer 0's folder, writer 1's folder]): 10 conversations, 5 shards."""
    root = tmp_path_factory.mktemp("writers")
    data = root / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in conversations(10)) + "\n")

    def gen(out, shard=None):
        opts = GenDataOptions(out=root / out, data=str(data), regenerate=False, max_length=96, shard_size=2,
                              shard=shard)
        return run(opts, TargetSpec(str(smol_tiny_dir), device="cpu"))

    gen("single")
    m0, m1 = gen("w0", "0/2"), gen("w1", "1/2")
    assert (m0["shards_done"], m1["shards_done"], m0["shards_planned"]) == (3, 2, 5)
    assert not m0["complete"] and not m1["complete"]
    return root / "single", [root / "w0", root / "w1"]


def samples(store):
    st = FeatureStore(store)
    return [{k: v.tolist() if v.dtype != torch.bfloat16 else v.float().tolist() for k, v in st[i].items()}
            for i in range(len(st))]


def copy_writers(writers, tmp_path):
    dirs = []
    for w in writers:
        shutil.copytree(w, tmp_path / w.name)
        dirs.append(tmp_path / w.name)
    return dirs


def test_two_writers_merge_into_the_single_writer_store_and_train(writers, smol_tiny_dir, tmp_path):
    single, (w0, w1) = writers
    man = merge(tmp_path / "merged", [w0, w1], say=lambda _: None)
    ref = json.loads((single / "manifest.json").read_text())
    assert man["complete"] and man["shards_done"] == man["shards_planned"] == 5
    for k in ("num_samples", "num_tokens", "num_masked_tokens", "bytes", "truncated", "skipped", "end_token_ids"):
        assert man[k] == ref[k], k
    assert samples(tmp_path / "merged") == samples(single)  # same samples, same order (by global shard index)
    assert (w0 / "shards" / "shard-00-00004.safetensors").exists()  # copy: the sources stay
    res = train(TrainConfig(data=str(tmp_path / "merged"), model=str(smol_tiny_dir), out=str(tmp_path / "draft"),
                            draft_vocab_size="256", ttt_steps=2, epochs=1, max_tokens=256, val_fraction=0.0,
                            warmup_ratio=0.0), quiet=True)
    assert res.step > 0 and all(torch.isfinite(v).all() for v in res.draft.state_dict().values()
                                if v.is_floating_point())


def test_missing_shard_is_refused_by_name(writers, tmp_path):
    _, (w0, _) = writers
    with pytest.raises(MergeError, match=r"^shard 1 of 5 is missing \(and 1 more: 3\): finish the gen-data run"):
        merge(tmp_path / "m", [w0], say=lambda _: None)
    assert not (tmp_path / "m").exists()  # refused before anything was written
    a, b = copy_writers(writers[1], tmp_path)
    (b / "shards" / "shard-01-00003.json").unlink()  # an unfinished shard: its file, no sidecar
    with pytest.raises(MergeError, match=r"shard 3 of 5 is missing .*w1 holds it unfinished"):
        merge(tmp_path / "m", [a, b], say=lambda _: None)


def test_duplicated_shard_is_refused_by_name(writers, tmp_path):
    a, b = copy_writers(writers[1], tmp_path)
    for ext in (".safetensors", ".json"):  # writer 1 also holds shard 2 (as if split with another n)
        shutil.copy(a / "shards" / f"shard-00-00002{ext}", b / "shards" / f"shard-01-00002{ext}")
    with pytest.raises(MergeError, match=r"^shard 2 is duplicated: .*w0/shards/shard-00-00002.json and "
                                         r".*w1/shards/shard-01-00002.json"):
        merge(tmp_path / "m", [a, b], say=lambda _: None)
    with pytest.raises(MergeError, match="is given twice"):
        merge(tmp_path / "m", [a, a], say=lambda _: None)


def test_foreign_settings_and_a_changed_shard_are_refused(writers, smol_tiny_dir, tmp_path):
    a, b = copy_writers(writers[1], tmp_path)
    man = json.loads((b / "manifest.json").read_text())
    man["run"]["max_length"] = 128
    (b / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(MergeError, match=r"w1 was written with other settings than .*w0 \(max_length\)"):
        merge(tmp_path / "m", [a, b], say=lambda _: None)
    a, b = copy_writers(writers[1], tmp_path / "again")
    shard = b / "shards" / "shard-01-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(MergeError, match=r"^shard 1 in .*w1: shard-01-00001.safetensors differs from the sha256"):
        merge(tmp_path / "m", [a, b], say=lambda _: None)


def test_move_into_a_writer_folder_via_the_cli_and_never_overwrite(writers, tmp_path):
    a, b = copy_writers(writers[1], tmp_path)
    r = CliRunner().invoke(app, ["merge-data", str(a), "--from", str(a), "--from", str(b), "--move"],
                           env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert "merged 5 shards (2 moved) from 2 folder(s)" in r.output
    assert not b.exists()  # moved: the emptied source folder is gone
    assert json.loads((a / "manifest.json").read_text())["complete"]
    assert samples(a) == samples(writers[0])
    # a foreign file where a shard goes is never replaced
    c, d = copy_writers(writers[1], tmp_path / "x")
    (tmp_path / "out" / "shards").mkdir(parents=True)
    shutil.copy(c / "manifest.json", tmp_path / "out" / "manifest.json")
    (tmp_path / "out" / "shards" / "shard-01-00001.safetensors").write_bytes(b"not a shard")
    r = CliRunner().invoke(app, ["merge-data", str(tmp_path / "out"), "--from", str(c), "--from", str(d)],
                           env={"COLUMNS": "300"})
    assert r.exit_code == 1
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "shard-01-00001.safetensors already exists and differs" in lines[0]
    assert (tmp_path / "out" / "shards" / "shard-01-00001.safetensors").read_bytes() == b"not a shard"
    # a non-store OUT is refused
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(MergeError, match="not empty and holds no feature store"):
        merge(tmp_path / "junk", [c, d], say=lambda _: None)


def test_interrupted_merge_finishes_on_rerun(writers, tmp_path):
    a, b = copy_writers(writers[1], tmp_path)
    out = tmp_path / "m"
    merge(out, [a, b], say=lambda _: None)
    (out / "shards" / "shard-01-00003.json").unlink()  # as if killed before shard 3's sidecar landed
    man = json.loads((out / "manifest.json").read_text())
    man["complete"] = False
    (out / "manifest.json").write_text(json.dumps(man))
    again = merge(out, [a, b], say=lambda _: None)  # OUT's identical copies are not duplicates
    assert again["complete"] and samples(out) == samples(writers[0])
