"""One valid two-shard feature store written with gen-data's own writers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3cli.core.io_utils import file_sha256
from eagle3cli.data.features import shard_name
from eagle3cli.data.store_build import new_manifest, write_manifest, write_shard

HT = 64  # the tiny llama's hidden size


def make_store(root: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    base = new_manifest(target={"id": "org/tiny", "revision": None, "content_hash": None}, model_type="llama",
                        hidden_size=HT, vocab_size=256, num_layers=8, layer_ids=(2, 4, 5), features="offline",
                        dtype="bfloat16", chat_template_hash=None, max_length=64, skipped={}, end_token_ids={2},
                        source={"data": "chats.jsonl"}, version="0", run={"max_length": 64})
    for index in range(2):
        samples = []
        for j in range(3):
            n = 5 + 3 * j + index
            samples.append({"input_ids": torch.randint(0, 256, (n,), generator=g, dtype=torch.int32),
                            "loss_mask": torch.arange(n) >= 2, "sample_id": 3 * index + j,
                            "aux": torch.randn(n, 3 * HT, generator=g), "final": torch.randn(n, HT, generator=g)})
        path = root / "shards" / shard_name(0, index)
        write_shard(path, samples)
        stats = {"shard": index, "rank": 0, "file": path.name, "num_samples": 3,
                 "num_tokens": sum(int(s["input_ids"].numel()) for s in samples),
                 "num_masked_tokens": sum(int(s["loss_mask"].sum()) for s in samples), "truncated": 0,
                 "bytes": path.stat().st_size, "skipped": {}, "sha256": file_sha256(path), "end_token_ids": [2],
                 "unlearned_answers": 0, "regeneration": None}
        path.with_suffix(".json").write_text(json.dumps(stats))
    write_manifest(root, base, 2)
    return root
