"""push for a DFlash draft: the card gives each engine's serve line with its own count of the
block (vLLM B-1, SGLang B, llama.cpp at most B-1) and the eval table."""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.model.dflash import DFlashConfig, DFlashDraft
from eagle3cli.publish.export import save_draft

TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
REPO = "someone/smol-dflash"
RESULTS = {
    "eagle3_version": "0.1.0", "target": TARGET, "draft": "runs/smol/dflash", "hardware": "2x Xeon CPU cores",
    "draft_type": "dflash",
    "settings": {"mode": "chain", "temperature": 0.0, "max_new_tokens": 64, "steps": 5},
    "tasks": {"mt_bench": {"num_prompts": 3, "tau": 1.871, "n_alpha": [0.41, 0.33], "speedup": 1.214,
                           "tokens_per_s": {"baseline": 17.1, "speculative": 20.8}, "lossless": True,
                           "mismatches": []}},
}


def test_the_card_gives_each_engines_count_and_the_eval_table(tmp_path):
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, num_hidden_layers=8, vocab_size=101, max_position_embeddings=256)
    d = DFlashDraft(DFlashConfig.from_target(cfg, (2, 4, 6), block_size=6, mask_token_id=100, num_hidden_layers=2))
    d.init_weights(seed=0)
    meta = {"target": TARGET, "layer_ids": [2, 4, 6], "block_size": 6, "draft_layers": 2, "num_anchors": 64,
            "loss_gamma": 4.0, "steps": 300, "draft_type": "dflash",
            "metrics": {"acc": [0.5, 0.4, 0.3, 0.2, 0.1], "split": "held-out"}}
    save_draft(d, tmp_path / "draft", meta, dtype=torch.float32)
    (tmp_path / "results.json").write_text(json.dumps(RESULTS))
    res = CliRunner().invoke(app, ["push", str(tmp_path / "draft"), "--repo", REPO, "--eval-results",
                                   str(tmp_path / "results.json"), "--dry-run", str(tmp_path / "out"),
                                   "--token", "hf_FAKEtokenNEVERwrite0123456789abcdef"])
    assert res.exit_code == 0, res.output
    card = (tmp_path / "out" / "README.md").read_text()
    assert ('vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config '
            '\'{"method":"dflash","model":"someone/smol-dflash","num_speculative_tokens":5}\'') in card
    assert "--speculative-algorithm DFLASH \\\n  --speculative-draft-model-path someone/smol-dflash " \
           "--speculative-num-draft-tokens 6" in card
    assert "--spec-type draft-dflash --spec-draft-n-max 5" in card
    assert "| Block size B | 6 (the anchor and 5 drafted tokens, in one forward) |" in card
    assert "| Target layers read (j: input of decoder layer j; what the engines capture) | 2, 4, 6 |" in card
    assert "| Same layers as k = j − 1 (output of layer k; z-lab's `dflash_config.target_layer_ids`) | 1, 3, 5 |" \
        in card
    assert "| mt_bench | 3 | 1.87 |" in card and "Tokens/s (plain → DFlash)" in card
    assert "| Final top-1 agreement per block position (held-out) | 0.500, 0.400, 0.300, 0.200, 0.100 |" in card
    assert "| Block size | 6 |" in card and "- dflash" in card and "EAGLE-3 speculative-decoding draft head" not in card
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 100
    assert "| Loss decay gamma (exp(-(k-1)/gamma)) | 4.0 |" in card and "D-PACE" not in card


def test_the_card_names_dpace_position_weights_instead_of_a_gamma():
    from eagle3cli.publish.dflash_card import training_rows

    meta = {"block_size": 8, "draft_layers": 1, "num_anchors": 256, "loss_gamma": 4.0,
            "position_weights": "dpace", "dpace_alpha": 0.5}
    rows = dict(training_rows(meta, []))
    assert rows["Loss position weights: D-PACE, alpha"] == "0.5" and "Loss decay gamma (exp(-(k-1)/gamma))" not in rows
    assert rows["Anchors per sequence"] == "256"
