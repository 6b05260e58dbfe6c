"""DFlash drafts on disk: z-lab's layout (both places of block_size) and speculators', written and
read back bit-equal, with the layer ids shifted by one exactly where each layout counts outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3cli.model.dflash import DFlashConfig, DFlashDraft
from eagle3cli.publish.dflash_export import draft_type_of, layout_of, save_dflash
from eagle3cli.publish.draft_check import CorruptDraft
from eagle3cli.publish.export import load_draft, save_draft
from eagle3cli.publish.inspector import inspect_any

FIXTURE = Path(__file__).parents[1] / "fixtures" / "dflash" / "speculators_0.9.0_config.json"
TARGET = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     num_hidden_layers=8, vocab_size=101, max_position_embeddings=256, eos_token_id=2, pad_token_id=2)


def tiny(block: int = 4, ids=(2, 4, 6), mask: int = 100) -> DFlashDraft:
    cfg = DFlashConfig.from_target(TARGET, ids, block_size=block, mask_token_id=mask, num_hidden_layers=2)
    d = DFlashDraft(cfg, embed_weight=torch.randn(101, 32), head_weight=torch.randn(101, 32))
    d.init_weights(std=0.1, seed=0)
    return d


def read(p: Path) -> dict:
    return json.loads((p / "config.json").read_text())


def assert_same_weights(a: DFlashDraft, b: DFlashDraft, dtype=None):
    sa, sb = a.trainable_state_dict(), b.trainable_state_dict()
    assert set(sa) == set(sb)
    for k, v in sa.items():
        assert torch.equal(sb[k], v.to(dtype or v.dtype)), k


def test_zlab_layout_has_the_engines_keys_and_names(tmp_path):
    d = tiny()
    save_draft(d, tmp_path, {"steps": 3, "layer_ids": [2, 4, 6], "block_size": 4}, dtype=torch.float32)
    cfg = read(tmp_path)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 and cfg["dflash_config"] == {"mask_token_id": 100, "target_layer_ids": [1, 3, 5],
                                                                "block_size": 4}
    assert cfg["num_target_layers"] == 8 and cfg["num_hidden_layers"] == 2
    assert cfg["layer_types"] == ["full_attention", "full_attention"] and cfg["attention_bias"] is False
    assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["torch_dtype"]) == (8, 2, "float32")
    assert "target_hidden_size" not in cfg and cfg["eagle3_training"]["steps"] == 3
    assert draft_type_of(cfg) == "dflash" and layout_of(cfg) == "zlab"
    names = set(load_file(tmp_path / "model.safetensors"))
    assert names == set(d.trainable_state_dict())
    assert "layers.1.self_attn.k_norm.weight" in names and "fc.weight" in names
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names)


@pytest.mark.parametrize("where", ["both", "top", "inner"])
def test_zlab_block_size_in_either_place_reads_back_bit_equal(tmp_path, where):
    d = tiny(block=8)
    save_draft(d, tmp_path, dtype=torch.bfloat16)
    cfg = read(tmp_path)
    if where == "top":
        del cfg["dflash_config"]["block_size"]
    if where == "inner":
        del cfg["block_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back, raw = load_draft(tmp_path, dtype=None)
    assert back.config == d.config and back.config.target_layer_ids == (2, 4, 6)
    assert back.fc.weight.dtype == torch.bfloat16 and raw["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert_same_weights(d, back, torch.bfloat16)


def test_target_gives_the_frozen_embedding_and_head(tmp_path):
    target = LlamaForCausalLM(TARGET).eval()
    save_draft(tiny(), tmp_path)
    back, _ = load_draft(tmp_path, target=target)
    assert torch.equal(back.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(back.lm_head.weight, target.get_output_embeddings().weight)
    assert not back.embed_tokens.weight.requires_grad and not back.lm_head.weight.requires_grad


def test_speculators_layout_round_trips_with_input_layer_ids(tmp_path):
    d = tiny(block=6)
    save_dflash(d, tmp_path, {"block_size": 6}, dtype=torch.float32, layout="speculators", target_name="tiny")
    cfg = read(tmp_path)
    assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert cfg["block_size"] == 6 and cfg["mask_token_id"] == 100 and layout_of(cfg) == "speculators"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    back, _ = load_draft(tmp_path, dtype=None)
    assert back.config == d.config
    assert_same_weights(d, back)


def test_a_draft_speculators_0_9_0_wrote_is_read(tmp_path):
    """The config.json speculators 0.9.0's DFlashDraftModel.save_pretrained wrote (full vocabulary,
    aux ids [2, 4, 6] as layer inputs), with tensors of its names."""
    raw = json.loads(FIXTURE.read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    d = tiny()
    save_file({k: v.contiguous() for k, v in d.trainable_state_dict().items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    back, _ = load_draft(tmp_path, dtype=None)
    assert back.config.target_layer_ids == (2, 4, 6) and back.config.block_size == 4
    assert back.config.mask_token_id == 100 and back.config.num_hidden_layers == 2
    assert_same_weights(d, back)
    rep, note = inspect_any(tmp_path, TARGET)
    assert note is None and rep.problems == [] and rep.summary["format"] == "dflash-speculators"


def test_zlab_ids_read_as_inputs_plus_one_and_speculators_as_they_are(tmp_path):
    d = tiny(ids=(1, 5, 7))
    save_draft(d, tmp_path / "z")
    save_dflash(d, tmp_path / "s", layout="speculators")
    assert read(tmp_path / "z")["dflash_config"]["target_layer_ids"] == [0, 4, 6]
    assert read(tmp_path / "s")["aux_hidden_state_layer_ids"] == [1, 5, 7]
    assert load_draft(tmp_path / "z")[0].config.target_layer_ids == (1, 5, 7)
    assert load_draft(tmp_path / "s")[0].config.target_layer_ids == (1, 5, 7)


def test_a_damaged_draft_is_one_line_before_anything_is_built(tmp_path):
    save_draft(tiny(), tmp_path)
    cfg = read(tmp_path)
    cfg["dflash_config"]["block_size"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptDraft) as e:
        load_draft(tmp_path)
    assert "\n" not in str(e.value)
    head = f"{tmp_path / 'config.json'}: block_size 4 disagrees with dflash_config.block_size 8"
    assert str(e.value).startswith(head)
