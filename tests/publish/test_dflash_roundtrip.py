"""A DFlash draft written in z-lab's layout and read back (docs/design.md §13)."""

import json

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from eagle3cli.model.dflash import DFlashConfig, DFlashDraft
from eagle3cli.publish.dflash_export import draft_type_of
from eagle3cli.publish.export import load_draft, save_draft
from eagle3cli.publish.inspector import inspect_draft

TARGET = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     num_hidden_layers=8, vocab_size=101, max_position_embeddings=256)


def tiny(block=4) -> DFlashDraft:
    cfg = DFlashConfig.from_target(TARGET, (2, 4, 6), block_size=block, mask_token_id=100, num_hidden_layers=2)
    d = DFlashDraft(cfg, embed_weight=torch.randn(101, 32), head_weight=torch.randn(101, 32))
    d.init_weights(std=0.1, seed=0)
    return d


def test_zlab_layout_round_trips_bit_equal(tmp_path):
    d = tiny()
    save_draft(d, tmp_path, {"steps": 3})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 == cfg["dflash_config"]["block_size"]
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5]  # layer outputs: our (2, 4, 6) less one
    assert cfg["dflash_config"]["mask_token_id"] == 100 and cfg["num_target_layers"] == 8
    assert cfg["layer_types"] == ["full_attention"] * 2 and draft_type_of(cfg) == "dflash"
    names = set(load_file(tmp_path / "model.safetensors"))
    assert names == set(d.trainable_state_dict())
    assert not any(n.startswith(("embed", "lm_head", "model.")) for n in names)
    back, _ = load_draft(tmp_path, dtype=None)
    assert back.config == d.config
    for k, v in d.trainable_state_dict().items():
        assert torch.equal(back.trainable_state_dict()[k], v.to(torch.bfloat16))


def test_block_size_inside_dflash_config_only_is_read(tmp_path):
    save_draft(tiny(block=8), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["block_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_draft(tmp_path)[0].config.block_size == 8


def test_inspect_names_each_engines_count_and_a_mask_outside_the_embedding(tmp_path):
    save_draft(tiny(block=8), tmp_path)
    rep = inspect_draft(tmp_path, TARGET)
    assert rep.ok and rep.summary["engines"]["vllm"]["num_speculative_tokens"] == 7
    assert rep.summary["engines"]["sglang"]["speculative_num_draft_tokens"] == 8
    small = LlamaConfig(**{**TARGET.to_dict(), "vocab_size": 100})
    rep = inspect_draft(tmp_path, small)
    assert rep.problems == ["config.json: dflash_config.mask_token_id 100 is not a row of the target's embedding "
                            "(0..99)", "target: vocab size 100, the draft's vocab_size is 101"]
