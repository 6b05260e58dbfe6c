"""DFlash drafts on disk: z-lab's layout (both places of block_size) and speculators', written and
read back bit-equal, with the layer ids shifted by one exactly where each layout counts outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3cli.model.dflash import DFlashDraft
from eagle3cli.publish.dflash_export import draft_type_of, layout_of, save_dflash
from eagle3cli.publish.draft_check import CorruptDraft
from eagle3cli.publish.export import load_draft, save_draft
from eagle3cli.publish.inspector import inspect_any
from tests.helpers.dflash import TARGET, tiny

FIXTURE = Path(__file__).parents[1] / "fixtures" / "dflash" / "speculators_0.9.0_config.json"


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
    rep, note = inspect_any(tmp_path, TARGET)  # as speculators writes it, vLLM serves the block causally
    assert note is None and rep.summary["format"] == "dflash-speculators"
    assert rep.problems == ["config.json: sliding_window_non_causal is false: vLLM 0.32.0 then sets "
                            "dflash_config.causal true and attends causally inside the block in every layer; this "
                            "draft was trained bidirectional: set it to true (`eagle3 convert --to speculators` does)"]


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


# ---------------------------------------------------------------------------- inspect: each silent failure

def zlab_dir(tmp_path: Path, name: str = "z", **kw) -> Path:
    p = tmp_path / name
    save_draft(tiny(**kw), p, {"layer_ids": [2, 4, 6], "block_size": kw.get("block", 4)}, dtype=torch.float32)
    return p


def spec_dir(tmp_path: Path, name: str = "s", **kw) -> Path:
    p = tmp_path / name
    save_dflash(tiny(**kw), p, {"layer_ids": [2, 4, 6], "block_size": kw.get("block", 4)}, dtype=torch.float32,
                layout="speculators")
    return p


def edit(p: Path, fn) -> Path:
    cfg = read(p)
    fn(cfg)
    (p / "config.json").write_text(json.dumps(cfg))
    return p


def problems(p: Path, target=None) -> list[str]:
    from eagle3cli.publish.inspector import inspect_draft

    return inspect_draft(p, target).problems


def test_undamaged_drafts_pass_in_both_layouts_with_each_engines_count(tmp_path):
    from eagle3cli.publish.inspector import inspect_draft

    for p in (zlab_dir(tmp_path, block=8), spec_dir(tmp_path, block=8)):
        rep = inspect_draft(p, TARGET)
        assert rep.problems == [] and rep.summary["block_size"] == 8
        assert rep.summary["engines"] == {"vllm": {"method": "dflash", "num_speculative_tokens": 7},
                                          "sglang": {"speculative_algorithm": "DFLASH",
                                                     "speculative_num_draft_tokens": 8},
                                          "llama.cpp": {"spec_type": "draft-dflash", "spec_draft_n_max": 7}}
        assert rep.summary["layers_j"] == [2, 4, 6] and rep.summary["layers_output"] == [1, 3, 5]
        spec = rep.summary["format"] == "dflash-speculators"  # vLLM alone reads speculators' layout
        assert rep.summary["reads_correctly"] == {"vllm": True, "sglang": not spec, "llama.cpp": not spec}


def _zlab_block_disagrees(c):
    c["dflash_config"]["block_size"] = 16


def _zlab_block_untrained(c):
    c["block_size"] = c["dflash_config"]["block_size"] = 8


def _spec_proposal_count(c):
    c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 4


def _zlab_ids_as_inputs(c):
    c["dflash_config"]["target_layer_ids"] = [2, 4, 6]


def _spec_ids_as_outputs(c):
    c["aux_hidden_state_layer_ids"] = [1, 3, 5]


def _zlab_unknown_key(c):
    c["blocksize"] = 4


def _zlab_causal(c):
    c["dflash_config"]["causal"] = True


def _zlab_mask_out(c):
    c["dflash_config"]["mask_token_id"] = 101


def _zlab_mask_eos(c):
    c["dflash_config"]["mask_token_id"] = 2
    c["eos_token_id"] = 2


DAMAGE = {  # layout, edit, the one line inspect prints
    "block size: top level and dflash_config disagree": (
        zlab_dir, _zlab_block_disagrees, "config.json: block_size 4 disagrees with dflash_config.block_size 16: "
        "llama.cpp's converter reads dflash_config's, speculators' converter the top level's; they would draft "
        "different blocks"),
    "block size: not the trained one": (
        zlab_dir, _zlab_block_untrained, "config.json: block_size 8 but the draft was trained with blocks of 4 "
        "(eagle3_training.block_size): the engines would draft 8-token blocks from a 4-token draft"),
    "block size: speculators' proposal count is not B-1": (
        spec_dir, _spec_proposal_count, "config.json: speculators_config.proposal_methods speculative_tokens is 4; "
        "a block of 4 drafts 3 (vLLM reads it as num_speculative_tokens)"),
    "layer ids: z-lab's key holding the input count": (
        zlab_dir, _zlab_ids_as_inputs, "config.json: dflash_config.target_layer_ids [2, 4, 6] (output of layer k) "
        "disagrees with the layers the draft was trained on, eagle3_training.layer_ids [2, 4, 6] (input of layer "
        "j) (the training record's input count, not shifted): dflash_config.target_layer_ids should be [1, 3, 5]"),
    "layer ids: speculators' key holding the output count": (
        spec_dir, _spec_ids_as_outputs, "config.json: aux_hidden_state_layer_ids [1, 3, 5] (input of layer j) "
        "disagrees with the layers the draft was trained on, eagle3_training.layer_ids [2, 4, 6] (input of layer "
        "j): aux_hidden_state_layer_ids should be [2, 4, 6]"),
    "a key no engine reads": (
        zlab_dir, _zlab_unknown_key, "config.json: blocksize is read by no engine (vLLM, SGLang or llama.cpp): a "
        "misspelt key leaves the engine's default; remove or rename it"),
    "a causal flag": (
        zlab_dir, _zlab_causal, "config.json: dflash_config.causal is true: llama.cpp would attend causally inside "
        "the block, this draft was trained bidirectional"),
    "MASK outside the draft's embedding": (
        zlab_dir, _zlab_mask_out, "config.json: dflash_config.mask_token_id is 101, not a row of the embedding "
        "(0..100): the engines would embed a token the target does not have"),
    "MASK equal to eos": (
        zlab_dir, _zlab_mask_eos, "config.json: dflash_config.mask_token_id 2 is the eos token (the draft's "
        "config): a block pre-filled with it reads as finished text; train with another MASK id (--mask-token-id)"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_each_damaged_draft_is_refused_in_one_line(tmp_path, case):
    make, damage, line = DAMAGE[case]
    p = edit(make(tmp_path), damage)
    assert problems(p) == [line]
    from typer.testing import CliRunner

    from eagle3cli.cli import app

    res = CliRunner().invoke(app, ["inspect", str(p)])
    assert res.exit_code == 1 and f"problem: {line}" in " ".join(res.output.split())


def test_fc_wider_than_the_target_layers_is_refused(tmp_path):
    p = zlab_dir(tmp_path)
    t = load_file(p / "model.safetensors")
    t["fc.weight"] = torch.zeros(32, 4 * 32)
    save_file(t, p / "model.safetensors", metadata={"format": "pt"})
    assert problems(p) == ["tensor fc.weight: takes 128 inputs (4 x hidden 32) but dflash_config.target_layer_ids "
                           "lists 3 target layers (3 x 32 = 96): the engines would feed it other layers than it "
                           "was trained on"]


def test_a_draft_against_its_target(tmp_path):
    """With --model: a MASK id past the target's embedding, layer ids past its depth."""
    p = zlab_dir(tmp_path)
    small = LlamaConfig(**{**TARGET.to_dict(), "vocab_size": 100})
    assert problems(p, small)[0] == ("config.json: dflash_config.mask_token_id 100 is not a row of the target's "
                                     "embedding (0..99)")
    shallow = LlamaConfig(**{**TARGET.to_dict(), "num_hidden_layers": 6})
    assert problems(p, shallow) == [
        "config.json: num_target_layers 8 but the target has 6 layers",
        "config.json: dflash_config.target_layer_ids [1, 3, 5] (output of layer k) must lie in 0..4 for a 6-layer "
        "target: [5] do not; 5 is the output of the last layer, which no engine captures: counted as inputs?"]
    assert problems(p, TARGET) == []


def test_readers_refuse_what_they_would_misread_but_read_what_only_an_engine_misreads(tmp_path):
    p = edit(zlab_dir(tmp_path), _zlab_unknown_key)
    assert load_draft(p)[0].config.block_size == 4  # an unknown key: inspect names it, the reader goes on
    p = edit(zlab_dir(tmp_path, "c"), _zlab_causal)
    with pytest.raises(CorruptDraft, match="dflash_config.causal is true"):
        load_draft(p)


# ---------------------------------------------------------------------------- convert

def test_convert_between_layouts_is_bit_equal_both_ways(tmp_path):
    from typer.testing import CliRunner

    from eagle3cli.cli import app

    z = zlab_dir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["convert", str(z), "--to", "speculators", "--out", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    s = read(tmp_path / "s")
    assert s["aux_hidden_state_layer_ids"] == [2, 4, 6] and s["sliding_window_non_causal"] is True
    assert "converted_from" not in s["eagle3_training"] and s["eagle3_training"]["layer_ids"] == [2, 4, 6]
    res = runner.invoke(app, ["convert", str(tmp_path / "s"), "--to", "zlab", "--out", str(tmp_path / "z2")])
    assert res.exit_code == 0, res.output
    assert "inspect on the result: ok" in res.output
    z2 = read(tmp_path / "z2")
    assert z2["dflash_config"]["target_layer_ids"] == [1, 3, 5] and z2["num_target_layers"] == 8
    assert z2["eagle3_training"]["converted_from"]["format"] == "dflash-speculators"
    a, b = load_file(z / "model.safetensors"), load_file(tmp_path / "z2" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_speculators_to_zlab_needs_the_targets_depth(tmp_path):
    from eagle3cli.publish.formats.common import FormatError
    from eagle3cli.publish.formats.writers import convert

    raw = json.loads(FIXTURE.read_text())  # speculators' own: no num_target_layers
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in tiny().trainable_state_dict().items()},
              tmp_path / "s" / "model.safetensors")
    with pytest.raises(FormatError, match="records no num_target_layers .* give the target with --model"):
        convert(tmp_path / "s", tmp_path / "z", "zlab")
    out, note = convert(tmp_path / "s", tmp_path / "z", "vllm", target_config=TARGET)
    assert read(out)["num_target_layers"] == 8 and note.format == "dflash-speculators"
    assert note.inferred == ["num_target_layers from --model (speculators' layout does not record it)"]


def test_an_eagle3_draft_is_not_written_in_zlabs_layout(tmp_path):
    from eagle3cli.model.draft import DraftConfig, Eagle3Draft
    from eagle3cli.publish.formats.common import FormatError
    from eagle3cli.publish.formats.writers import write_draft

    d = Eagle3Draft(DraftConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, rms_norm_eps=1e-6, vocab_size=101, draft_vocab_size=101,
                                target_hidden_size=32, max_position_embeddings=256, aux_layer_ids=(2, 4, 6)))
    with pytest.raises(FormatError, match="--to zlab is DFlash's layout"):
        write_draft(d, tmp_path / "x", to="zlab")
