"""Keys SGLang 0.5.23 reads that change the DFlash draft it serves (its Domino projector's
``dflash_config`` fields, ``use_gemma_norm``): inspect names them as SGLang's, not as keys no engine
reads (benchmarks/dflash_sglang_loader.py runs SGLang's loader on our drafts)."""

from __future__ import annotations

import json

import torch

from eagle3cli.publish.dflash_check import inspect_dflash
from eagle3cli.publish.export import save_draft
from tests.helpers.dflash import tiny


def _problems(tmp_path, edit) -> list[str]:
    p = save_draft(tiny(), tmp_path / "d", {"layer_ids": [2, 4, 6], "block_size": 4}, dtype=torch.float32)
    cfg = json.loads((p / "config.json").read_text())
    edit(cfg)
    (p / "config.json").write_text(json.dumps(cfg))
    return inspect_dflash(p, cfg)[0]


def test_sglangs_domino_keys_and_gemma_norm_are_named_as_sglangs(tmp_path):
    assert _problems(tmp_path / "clean", lambda c: None) == []

    def edit(c):
        c["dflash_config"]["shift_label"] = True
        c["use_gemma_norm"] = True

    assert _problems(tmp_path / "edited", edit) == [
        "config.json: use_gemma_norm makes SGLang build its norms as Gemma's (1 + weight); this draft's are plain "
        "RMSNorm: remove it",
        "config.json: dflash_config.shift_label makes SGLang serve a DFlash variant this package does not train (its "
        "Domino projector); remove it"]
