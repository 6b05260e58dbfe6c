import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from eagle3cli.publish.export import load_draft, save_draft
from eagle3cli.publish.inspector import inspect_draft
from tests.helpers.tiny import ARCHS, tiny_config, tiny_model

EXPECTED_NAMES = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def build(tmp_path, arch="llama", draft_vocab=100, dtype=torch.bfloat16):
    target = tiny_model(arch)
    cfg = DraftConfig.from_target(target.config, draft_vocab, (2, 4, 5))
    d = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight)
    d.init_weights(seed=1)
    d.set_vocab(torch.arange(0, 2 * draft_vocab, 2))
    out = save_draft(d, tmp_path / f"draft_{arch}", metadata={"target": "tiny", "steps": 3}, dtype=dtype)
    return target, d, out


@pytest.mark.parametrize("arch", ARCHS)
def test_export_names_shapes_dtypes(tmp_path, arch):
    target, d, out = build(tmp_path, arch)
    t = tiny_config(arch)
    hd = getattr(t, "head_dim", None) or 16
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in names}
    assert names == EXPECTED_NAMES
    assert tensors["fc.weight"].shape == (64, 192)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * hd, 128)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (2 * hd, 128)
    assert tensors["midlayer.self_attn.o_proj.weight"].shape == (64, 4 * hd)
    assert tensors["lm_head.weight"].shape == (100, 64)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (100,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (256,)
    assert tensors["fc.weight"].dtype == torch.bfloat16
    # target = i + d2t[i]
    assert torch.equal(torch.arange(100) + tensors["d2t"], torch.arange(0, 200, 2))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["max_position_embeddings"] == t.max_position_embeddings
    assert cfg["vocab_size"] == 256 and cfg["draft_vocab_size"] == 100
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is False
    assert cfg["norm_before_residual"] is False and cfg["torch_dtype"] == "bfloat16"
    assert cfg["head_dim"] == hd and "target_hidden_size" not in cfg
    assert cfg["eagle3_training"] == {"target": "tiny", "steps": 3}
    assert inspect_draft(out, t).ok


def test_round_trip_bit_exact(tmp_path):
    target, d, out = build(tmp_path, dtype=torch.float32)
    d2, _ = load_draft(out, target=target, dtype=None)
    sd1, sd2 = d.state_dict(), d2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    # bf16 export reloads to exactly the bf16-rounded weights
    _, _, out16 = build(tmp_path / "b", dtype=torch.bfloat16)
    d3, _ = load_draft(out16, target=target, dtype=None)
    assert d3.fc.weight.dtype == torch.bfloat16
    assert torch.equal(d3.fc.weight, d.fc.weight.to(torch.bfloat16))


def _mutate_tensors(out, fn):
    p = out / "model.safetensors"
    t = load_file(str(p))
    save_file(fn(t), str(p))


def _mutate_config(out, fn):
    p = out / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


BROKEN = {
    "model_prefix": (lambda t: {("model." + k if k.startswith("midlayer") else k): v for k, v in t.items()}, None,
                     "'model.' prefix"),
    "unknown_name": (lambda t: {**t, "layers.0.weight": torch.zeros(2)}, None, "unknown name"),
    "missing_name": (lambda t: {k: v for k, v in t.items() if k != "norm.weight"}, None, "norm.weight: missing"),
    "d2t_indices": (lambda t: {**t, "d2t": torch.arange(0, 200, 2)}, None, "indices, not offsets"),
    "d2t_int32": (lambda t: {**t, "d2t": t["d2t"].to(torch.int32)}, None, "int64"),
    "bad_shape": (lambda t: {**t, "fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}, None, "shape of fc.weight"),
    "no_vllm_key": (None, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"),
                    "eagle_aux_hidden_state_layer_ids is missing"),
    "no_sglang_key": (None, lambda c: c.pop("eagle_config"), "eagle_config.eagle_aux_hidden_state_layer_ids"),
    "keys_disagree": (None, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5]), "disagree"),
    "short_max_pos": (None, lambda c: c.update(max_position_embeddings=128), "smaller than the target's 512"),
    "tied_reduced": (None, lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings"),
    "wrong_arch": (None, lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
    "no_draft_vocab": (None, lambda c: c.pop("draft_vocab_size"), "draft_vocab_size is missing"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_inspect_flags_broken_variants(tmp_path, case):
    target, _, out = build(tmp_path)
    tfn, cfn, needle = BROKEN[case]
    if tfn:
        _mutate_tensors(out, tfn)
    if cfn:
        _mutate_config(out, cfn)
    rep = inspect_draft(out, target.config)
    assert not rep.ok
    assert any(needle in p for p in rep.problems), rep.problems


def test_inspect_against_wrong_target(tmp_path):
    _, _, out = build(tmp_path)
    other = tiny_config("llama", hidden_size=96, vocab_size=300, num_hidden_layers=4)
    rep = inspect_draft(out, other)
    text = "\n".join(rep.problems)
    assert "hidden size 96" in text and "vocab size 300" in text and "out of range for a 4-layer" in text


def test_inspect_missing_and_pickle(tmp_path):
    assert "config.json is missing" in inspect_draft(tmp_path).problems[0]
    _, _, out = build(tmp_path)
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    rep = inspect_draft(out)
    assert any("pickle files are not loaded" in p for p in rep.problems)


def test_inspect_cli_exit_codes(tmp_path):
    from typer.testing import CliRunner

    from eagle3cli.cli import app

    target, _, out = build(tmp_path)
    r = CliRunner().invoke(app, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "[2, 4, 5]" in r.output and "[1, 3, 4]" in r.output
    _mutate_config(out, lambda c: c.pop("eagle_config"))
    r = CliRunner().invoke(app, ["inspect", str(out)])
    assert r.exit_code == 1 and "problem:" in r.output


def test_layers_cli(tmp_path):
    from typer.testing import CliRunner

    from eagle3cli.cli import app
    from tests.helpers.tiny import save_tiny

    d = save_tiny(tmp_path / "m", "llama", num_hidden_layers=30)
    r = CliRunner().invoke(app, ["layers", "--model", str(d)])
    assert r.exit_code == 0, r.output
    assert "N = 30" in r.output and "2, 15, 27" in r.output and "1, 14, 26" in r.output
    assert "hidden_states[j]" in r.output
