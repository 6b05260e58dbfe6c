"""`eagle3 eval --engine llama.cpp` with a DFlash draft: llama-server gets ``--spec-type draft-dflash``,
the draft's GGUF comes from llama.cpp's own converter (no gguf-package fallback, so without it the
run stops in one line before any model loads), and the engine's table sits beside ours.

The fake llama-server checks the arguments and the table; the real one runs only where
$EAGLE3_LLAMA_CPP names a built llama.cpp tree (benchmarks/build_llamacpp.sh prints one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.model.dflash import DFlashConfig, DFlashDraft, choose_mask_token
from eagle3cli.publish.export import save_draft
from tests.helpers.evaluate import engine_eval_args, engine_turns, fake_llama_bin

runner = CliRunner()
BLOCK = 4


def dflash_case(target_dir, tmp_path):
    """A random DFlash draft (z-lab layout, blocks of 4) of the tiny target and two questions (3 answers)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(target_dir)
    tok = AutoTokenizer.from_pretrained(target_dir)
    n = cfg.num_hidden_layers
    mask = choose_mask_token(cfg.vocab_size, (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id))
    ids = (1, n // 2, n - 1)
    d = DFlashDraft(DFlashConfig.from_target(cfg, ids, block_size=BLOCK, mask_token_id=mask, num_hidden_layers=1))
    d.init_weights(std=0.1, seed=0)
    draft = save_draft(d, tmp_path / "draft", {"layer_ids": list(ids), "block_size": BLOCK}, dtype=torch.float32)
    return target_dir, draft, engine_turns(tmp_path)


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    return fake_llama_bin(tmp_path, monkeypatch)


def test_eval_engine_llamacpp_serves_a_dflash_draft_with_draft_dflash(smol_tiny_dir, tmp_path, fake_bin):
    target, draft, turns = dflash_case(smol_tiny_dir, tmp_path)
    (tmp_path / "t.gguf").write_bytes(b"GGUF")
    (tmp_path / "d.gguf").write_bytes(b"GGUF")
    out = tmp_path / "out"
    r = runner.invoke(app, engine_eval_args(target, draft, turns, out, "llama.cpp", "--llama-cpp", str(fake_bin),
                                            "--target-gguf", str(tmp_path / "t.gguf"), "--draft-gguf",
                                            str(tmp_path / "d.gguf"), "--engine-threads", "2"))
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["draft_type"] == "dflash" and res["tasks"]["mini"]["num_prompts"] == 2  # our DFlash generator ran
    e = res["engine"]
    assert e["settings"]["spec_type"] == "draft-dflash" and e["settings"]["spec_draft_n_max"] == 3
    t = e["tasks"]["mini"]
    assert (t["answers"], t["accepted"], t["drafted"]) == (3, 12, 45) and t["lossless"] is True
    starts = [json.loads(ln) for ln in (tmp_path / "args.jsonl").read_text().splitlines()]
    spec = [s for s in starts if "-md" in s]
    assert len(spec) == 1 and spec[0][spec[0].index("-md") + 1] == str(tmp_path / "d.gguf")
    assert spec[0][spec[0].index("--spec-type") + 1] == "draft-dflash"
    assert spec[0][spec[0].index("--spec-draft-n-max") + 1] == "3"
    assert "llama.cpp: draft-dflash, chain 3" in r.output and "12/45" in r.output


def test_a_dflash_draft_without_the_converter_is_one_line_before_loading(smol_tiny_dir, tmp_path, fake_bin):
    target, draft, turns = dflash_case(smol_tiny_dir, tmp_path)
    (tmp_path / "t.gguf").write_bytes(b"GGUF")
    out = tmp_path / "out"
    r = runner.invoke(app, engine_eval_args(target, draft, turns, out, "llama.cpp", "--llama-cpp", str(fake_bin),
                                            "--target-gguf", str(tmp_path / "t.gguf")))
    assert r.exit_code == 1
    assert "convert_hf_to_gguf.py not found" in r.output and "it writes a DFlash draft's GGUF" in r.output
    assert "--draft-gguf FILE" in r.output and not (out / "results.json").exists()
    assert not (tmp_path / "args.jsonl").exists()  # no llama-server started


def _llama_cpp_tree():
    root = os.environ.get("EAGLE3_LLAMA_CPP")
    if not root:
        return None
    from eagle3cli.evaluate.llamacpp import LlamaCppError, find_binary
    from eagle3cli.publish.gguf_export import find_converter

    try:
        find_binary(llama_cpp=root)
    except LlamaCppError:
        return None
    return root if find_converter(root) is not None else None


@pytest.mark.skipif(not _llama_cpp_tree(), reason="needs a built llama.cpp tree ($EAGLE3_LLAMA_CPP)")
def test_real_llama_server_runs_our_dflash_gguf(smol_tiny_dir, tmp_path):
    """llama.cpp's converter writes the draft's GGUF from the target's folder, llama-server serves it
    with draft-dflash, drafts every cycle, and its output is the plain output token for token."""
    target, draft, turns = dflash_case(smol_tiny_dir, tmp_path)
    out = tmp_path / "out"
    r = runner.invoke(app, engine_eval_args(target, draft, turns, out, "llama.cpp", "--engine-threads", "1"))
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    e, ours = res["engine"], res["tasks"]["mini"]
    assert e["settings"]["spec_type"] == "draft-dflash" and Path(e["draft_gguf"]).name == "draft-f32.gguf"
    t = e["tasks"]["mini"]
    assert t["answers"] == 3 and t["lossless"] is True and t["mismatches"] == []
    assert t["drafted"] > 0 and t["decode_steps"] > 0
    assert ours["lossless"] is True
    log = (out / "llama-server-spec.log").read_text()
    assert "dflash" in log.lower()
