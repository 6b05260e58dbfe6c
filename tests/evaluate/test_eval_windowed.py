"""`eagle3 eval` end to end on tiny targets with sliding windows (Gemma 3, gpt-oss, Ministral) and
chunked attention (Llama 4): chain and tree, lossless against the target's own generate, with answers
and conversations longer than the window. Gemma 3 verifies on the fast path, the others on the HF
forward."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.decode.attention import FULL, SLIDING
from tests.helpers.evaluate import make_draft
from tests.helpers.tiny import SMOLLM2_TOKENIZER, save_tiny

runner = CliRunner()

FAMILIES = {
    "gemma3": ("gemma3_text", dict(sliding_window=8, num_hidden_layers=4, layer_types=[SLIDING, FULL] * 2)),
    "gpt_oss": ("gpt_oss", dict(head_dim=16, sliding_window=8, num_hidden_layers=4, num_local_experts=4,
                                num_experts_per_tok=2)),
    "ministral": ("ministral", dict(head_dim=16, sliding_window=8, num_hidden_layers=4)),
    "llama4": ("llama4_text", dict(head_dim=16, attention_chunk_size=8, num_hidden_layers=4, num_local_experts=2)),
}


@pytest.fixture(scope="module")
def two_turns(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "mini.jsonl"
    p.write_text(json.dumps({"question_id": 1, "category": "writing",
                             "turns": ["Write a haiku about rain.", "Now make it rhyme."]}) + "\n")
    return p


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eval_chain_and_tree_are_lossless_past_the_window(family, two_turns, tmp_path):
    arch, kw = FAMILIES[family]
    target = save_tiny(tmp_path / "target", arch, tokenizer_dir=SMOLLM2_TOKENIZER, hidden_size=64,
                       intermediate_size=128, **kw)
    draft = make_draft(target, tmp_path / "draft")
    for mode in (["--mode", "chain", "--steps", "3"], ["--tree", "6,3,2"]):
        out = tmp_path / f"out-{mode[1]}"
        r = runner.invoke(app, ["eval", "--model", str(target), "--draft", str(draft), "--task", "mini",
                                "--data", str(two_turns), "--out", str(out), "--max-new-tokens", "24", *mode])
        assert r.exit_code == 0, r.output
        t = json.loads((out / "results.json").read_text())["tasks"]["mini"]
        assert t["path"] == ("fast" if family == "gemma3" else "hf") and t["errors"] == [], r.output
        assert t["lossless"] is True and t["mismatches"] == []
        assert t["num_prompts"] == 1 and t["tau"] >= 1.0
        assert t["tokens_per_s"]["speculative"] > 0
