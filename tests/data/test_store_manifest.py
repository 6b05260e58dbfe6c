"""The feature store's manifest reader (features.read_manifest): typed fields, one-line errors."""

import json

import pytest

from eagle3cli.data.features import FORMAT, FORMAT_VERSION, Manifest, StoreError, read_manifest
from eagle3cli.data.store_build import new_manifest


def test_written_manifest_reads_back_typed(tmp_path):
    raw = new_manifest(target={"id": "org/m", "revision": "main", "content_hash": None}, model_type="llama",
                       hidden_size=64, vocab_size=1000, num_layers=8, layer_ids=(1, 3, 6), features="offline",
                       dtype="bfloat16", chat_template_hash="ab" * 32, max_length=128, skipped={},
                       end_token_ids={7, 2}, source={"data": "x.jsonl"}, version="0", run={})
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    m = read_manifest(tmp_path)
    assert (m.format, m.version, m.target_id, m.target_revision) == (FORMAT, FORMAT_VERSION, "org/m", "main")
    assert m.layer_ids == (1, 3, 6) and m.end_token_ids == (2, 7) and m.has_features and m.raw == raw


def test_hand_written_manifest_may_omit_fields():
    m = Manifest.parse({"format": FORMAT, "version": 1}, "manifest.json")
    assert m.target_id is None and m.layer_ids == () and m.features == "offline" and m.complete is None


@pytest.mark.parametrize("raw, field", [([1, 2], "JSON object"), ({"layer_ids": "2,4,5"}, "layer_ids"),
                                        ({"target": "org/m"}, "target"), ({"hidden_size": "64"}, "hidden_size"),
                                        ({"layer_ids": [1, "x", 3]}, "layer_ids"), ({"complete": 1}, "complete")])
def test_wrongly_typed_fields_are_one_store_error(raw, field):
    with pytest.raises(StoreError, match=field):
        Manifest.parse(raw, "manifest.json")


def test_missing_manifest_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a feature store"):
        read_manifest(tmp_path)
