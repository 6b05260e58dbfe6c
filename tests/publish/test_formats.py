"""Readers and writers of the draft formats in the field (eagle3cli/publish/formats/, docs/formats.md).

Each fixture writes a tiny random draft the way the producing project writes it; the file and
version whose code was read is named in the fixture's docstring.
"""

import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3cli.model.draft import DraftConfig, Eagle3Draft, MidLayer
from eagle3cli.publish.export import engine_config, save_draft
from eagle3cli.publish.formats.common import FormatError
from eagle3cli.publish.formats.detect import detect_format
from eagle3cli.publish.formats.readers import read_draft
from eagle3cli.publish.formats.writers import convert, write_draft
from eagle3cli.publish.inspector import inspect_any
from tests.helpers.tiny import tiny_model

torch.set_num_threads(1)
LAYERS = (2, 4, 5)  # tiny 8-layer target: input of decoder layer j
V, N = 256, 100


@pytest.fixture(scope="module")
def target():
    """A tiny target whose embedding is exact in fp16 and bf16, so a draft that ships a rounded
    copy of it (EAGLE, speculators) computes what the target's own embedding gives."""
    t = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        t.get_input_embeddings().weight.copy_(torch.randint(-8, 9, (V, 64), generator=g) / 64)
    return t


def base_draft(target, draft_vocab=N, dtype=torch.bfloat16, layers=LAYERS):
    cfg = DraftConfig.from_target(target.config, draft_vocab, layers)
    d = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight)
    d.init_weights(seed=1)
    with torch.no_grad():  # norms away from 1 so a wrong norm shows in the logits
        for n in (d.norm, d.midlayer.input_layernorm, d.midlayer.hidden_norm, d.midlayer.post_attention_layernorm):
            n.weight.uniform_(0.5, 1.5)
    d.set_vocab(torch.arange(0, 2 * draft_vocab, 2) if draft_vocab < V else torch.arange(V))
    with torch.no_grad():  # weights rounded to the stored dtype, computed in fp32 (rotary buffers untouched)
        for p in d.parameters():
            p.copy_(p.to(dtype).float())
    return d


def _tensors(d, dtype, names="midlayer", embed=False, vocab_maps=("d2t", "t2d")):
    sd = d.state_dict()
    out = {}
    for k, v in sd.items():
        if k in ("d2t", "t2d"):
            if k in vocab_maps:
                out[k] = v.clone()
            continue
        if k == "embed_tokens.weight" and not embed:
            continue
        name = "layers.0." + k[len("midlayer."):] if names == "layers" and k.startswith("midlayer.") else k
        out[name] = v.to(dtype).contiguous()
    return out


def write_eagle_reference(path, d, full_vocab=False):
    """SafeAILab/EAGLE eagle/traineagle3/config.json and cnets.py (commit 9666a81): the config
    keys as the reference writes them (architectures LlamaForCausalLM, torch_dtype float16,
    max_position_embeddings 2048 there, no layer ids), a pytorch_model.bin pickle of the Model's
    state dict with our names, embed_tokens included, d2t = torch.tensor(list of ints) (int64),
    t2d = torch.tensor(list of bools); for a full vocabulary no d2t/t2d."""
    c = d.config
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": c.hidden_size, "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
        "max_position_embeddings": 128, "model_type": "llama", "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "pad_token_id": 0,
        "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.28.1", "use_cache": True, "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size}))
    t = _tensors(d, torch.float16, embed=True, vocab_maps=() if full_vocab else ("d2t", "t2d"))
    torch.save(t, path / "pytorch_model.bin")
    return path


def write_speculators(path, d, nbr="absent"):
    """speculators 0.9.0 models/eagle3/config.py (Eagle3SpeculatorConfig fields),
    convert/eagle/eagle3_converter.py (LlamaConfig transformer_layer_config, greedy proposal,
    midlayer.* remapped to layers.0.*), speculators/model.py (embed_tokens saved; d2t/t2d only for
    a reduced vocabulary); bf16 weights, d2t int64, t2d bool."""
    c = d.config
    path.mkdir(parents=True)
    cfg = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "transformer_layer_config": {
            "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings, "initializer_range": 0.02,
            "rms_norm_eps": c.rms_norm_eps, "use_cache": True, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "head_dim": c.head_dim,
            "rope_parameters": {"rope_theta": c.rope_parameters["rope_theta"], "rope_type": "default"},
            "dtype": "bfloat16"},
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]}},
        "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids), "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "embed_requires_grad": False, "transformers_version": "5.0.0",
    }
    if nbr != "absent":
        cfg["norm_before_residual"] = nbr
    (path / "config.json").write_text(json.dumps(cfg))
    full = c.draft_vocab_size == c.vocab_size
    save_file(_tensors(d, torch.bfloat16, names="layers", embed=True, vocab_maps=() if full else ("d2t", "t2d")),
              str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_modelopt(path, d, rope_injected=False):
    """NVIDIA ModelOpt 0.47.0 torch/export/plugins/hf_spec_configs.py (llama_eagle_template_config)
    and hf_spec_export.py (EagleExporter): layers.0.* names, d2t without t2d (none for a full
    vocab), no embed_tokens, ids only in eagle_config counting the hooked layer's OUTPUT
    (hf_eagle.py), eagle_export_rope_scaling (default yarn, factor 32, original 2048) injected."""
    c = d.config
    path.mkdir(parents=True)
    rope = ({"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048} if rope_injected
            else {"rope_type": "default", "rope_theta": c.rope_parameters["rope_theta"]})
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": c.hidden_size, "initializer_range": 0.01, "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings, "model_type": "llama",
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1, "pad_token_id": None, "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "5.0.0", "use_cache": True, "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size, "rope_scaling": rope, "attention_bias": False,
        "attention_dropout": 0.0, "head_dim": c.head_dim, "mlp_bias": False, "pretraining_tp": None,
        "rope_theta": c.rope_parameters["rope_theta"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [j - 1 for j in c.aux_layer_ids],
                         "use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                         "use_last_layernorm": True, "use_mtp_layernorm": False, "next_layer_regular": True,
                         "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1}}))
    maps = ("d2t",) if c.draft_vocab_size < c.vocab_size else ()
    save_file(_tensors(d, torch.bfloat16, names="layers", vocab_maps=maps), str(path / "model.safetensors"))
    return path


def write_specforge(path, d, eagle_config=True):
    """SpecForge 0.2.0 export/to_sglang.py (identity weight map, every 'embed' key dropped,
    t2d/d2t kept), export/checkpoint_io.py (bf16 model; apply_legacy_rope_scaling mirrors
    rope_theta top-level), training/model_loading.py (config = the target's architecture fields +
    architectures/model_type/num_hidden_layers/draft_vocab_size), algorithms/model_providers.py
    (layer ids from eagle_config, 'output of layer k', else a run flag that is not saved)."""
    c = d.config
    path.mkdir(parents=True)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu",
        "initializer_range": 0.02, "attention_bias": False, "attention_dropout": 0.0, "head_dim": c.head_dim,
        "rope_parameters": {"rope_theta": c.rope_parameters["rope_theta"], "rope_type": "default"},
        "rope_theta": c.rope_parameters["rope_theta"], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "tie_word_embeddings": False, "use_cache": True, "draft_vocab_size": c.draft_vocab_size,
        "dtype": "bfloat16", "transformers_version": "5.0.0",
    }
    if eagle_config:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [j - 1 for j in c.aux_layer_ids]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    save_file(_tensors(d, torch.bfloat16), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def logits(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, 12), generator=g)
    aux = torch.randn(1, 12, 3 * d.config.target_hidden_size, generator=g)
    with torch.no_grad():
        return d(ids, aux)[1]


WRITERS = {
    "eagle": write_eagle_reference, "speculators": lambda p, d: write_speculators(p, d, nbr=False),
    "modelopt": write_modelopt, "specforge": write_specforge,
}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_each_format_is_detected_and_gives_the_same_logits(tmp_path, target, fmt):
    d = base_draft(target, dtype=torch.float16 if fmt == "eagle" else torch.bfloat16)
    path = WRITERS[fmt](tmp_path / fmt, d)
    assert detect_format(path) == fmt
    r, note = read_draft(path, target_config=target.config, target=target, dtype=torch.float32)
    assert note.format == fmt and r.config.aux_layer_ids == LAYERS
    assert torch.equal(r.d2t, d.d2t) and torch.equal(r.t2d, d.t2d)
    assert torch.equal(logits(r), logits(d))
    # the engines' format out: same logits again, and inspect passes it
    out, _ = convert(path, tmp_path / "ours", "vllm", target_config=target.config, target=target)
    rep, _ = inspect_any(out, target.config)
    assert rep.ok, rep.problems
    back, _ = read_draft(out, target=target, dtype=torch.float32)
    assert torch.equal(logits(back), logits(d))


def test_eagle_reference_infers_layers_vocab_maps_and_positions(tmp_path, target):
    d = base_draft(target, draft_vocab=V, dtype=torch.float16, layers=(2, 4, 5))
    path = write_eagle_reference(tmp_path / "eagle", d, full_vocab=True)
    with pytest.raises(FormatError, match="records no layer ids: pass --model"):
        read_draft(path)
    r, note = read_draft(path, target_config=target.config, target=target)
    text = "\n".join(note.lines())
    assert "layer ids [2, 4, 5]" in text and "d2t = zeros and t2d = all true" in text
    assert "max_position_embeddings 512" in text and r.config.max_position_embeddings == 512
    assert r.fc.weight.dtype == torch.float16  # kept as stored: conversion to safetensors is exact
    out, _ = convert(path, tmp_path / "st", "ours", target_config=target.config)
    t = load_file(str(out / "model.safetensors"))
    ref = torch.load(path / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(t[k], ref[k]) for k in t if k in ref)
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


class Payload:  # anything beyond plain tensors needs full unpickling
    pass


def test_a_pickle_that_needs_more_than_tensors_is_refused_in_one_line(tmp_path, target):
    d = base_draft(target, dtype=torch.float16)
    path = write_eagle_reference(tmp_path / "eagle", d)
    t = torch.load(path / "pytorch_model.bin", weights_only=True)
    t["extra"] = Payload()
    torch.save(t, path / "pytorch_model.bin", pickle_module=pickle)
    with pytest.raises(FormatError) as e:
        read_draft(path, target_config=target.config)
    msg = str(e.value)
    assert str(path / "pytorch_model.bin") in msg and "weights_only=True" in msg and "\n" not in msg


def test_modelopt_t2d_from_d2t_ids_plus_one_and_injected_rope_stated(tmp_path, target):
    d = base_draft(target)
    path = write_modelopt(tmp_path / "mo", d, rope_injected=True)
    r, note = read_draft(path, target_config=target.config)
    text = "\n".join(note.lines())
    assert "t2d from d2t" in text and "eagle_config's [1, 3, 4]" in text and "eagle_export_rope_scaling" in text
    assert torch.equal(r.t2d, d.t2d) and r.config.rope_parameters["rope_type"] == "yarn"
    rep, _ = inspect_any(path)  # as-is, vLLM would read eagle_config's ids one layer off
    assert not rep.ok and any("eagle_aux_hidden_state_layer_ids is missing" in p for p in rep.problems)


def test_specforge_without_layer_ids_takes_the_default_and_says_so(tmp_path, target):
    d = base_draft(target)  # LAYERS = (2, 4, 5) = default_layer_ids(8)
    path = write_specforge(tmp_path / "sf", d, eagle_config=False)
    r, note = read_draft(path, target_config=target.config, target=target, dtype=torch.float32)
    assert r.config.aux_layer_ids == LAYERS and any("not recorded" in x for x in note.inferred)
    assert note.embed == "target" and torch.equal(logits(r), logits(d))


def test_speculators_norm_before_residual_defaults_true_as_vllm_reads_it(tmp_path, target):
    d = base_draft(target)
    path = write_speculators(tmp_path / "spec", d)  # no norm_before_residual key
    r, note = read_draft(path, target=target, dtype=torch.float32)
    assert note.norm_before_residual and r.config.norm_before_residual and r.midlayer.norm_before_residual
    assert any("vLLM 0.32.0" in x for x in note.inferred)
    assert not torch.equal(logits(r), logits(d))  # the residual differs, as vLLM computes it
    o = torch.randn(1, 3, 64)
    g = torch.randn(1, 3, 64)
    plain = MidLayer(r.config)
    plain.load_state_dict(r.midlayer.state_dict())
    plain.norm_before_residual = False
    assert torch.equal(r.midlayer.finish(o, g), plain.finish(o, r.midlayer.hidden_norm(g)))
    # the flag survives conversion, explicitly, and SGLang (which has no such flag) is refused
    out, _ = convert(path, tmp_path / "ours", "vllm", target=target)
    assert json.loads((out / "config.json").read_text())["norm_before_residual"] is True
    again, _ = read_draft(out, target=target, dtype=torch.float32)
    assert torch.equal(logits(again), logits(r))
    spec, _ = convert(out, tmp_path / "spec2", "speculators", target=target)
    assert json.loads((spec / "config.json").read_text())["norm_before_residual"] is True
    with pytest.raises(FormatError, match="SGLang"):
        convert(path, tmp_path / "sgl", "sglang", target=target)


@pytest.mark.parametrize("to", ["speculators", "sglang", "vllm", "ours"])
def test_round_trip_ours_x_ours_is_bit_exact(tmp_path, target, to):
    d = base_draft(target)
    ours = save_draft(d, tmp_path / "ours", metadata={"target": "org/tiny"}, dtype=torch.bfloat16)
    x, _ = convert(ours, tmp_path / f"x_{to}", to, target=target)
    assert detect_format(x) == ("speculators" if to == "speculators" else "ours")
    back, _ = convert(x, tmp_path / "back", "ours", target=target)
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (ours, back))
    ca.pop("eagle3_training"), cb.pop("eagle3_training")
    assert ca == cb


def test_speculators_output_has_the_keys_vllm_reads(tmp_path, target):
    d = base_draft(target)
    ours = save_draft(d, tmp_path / "ours", dtype=torch.bfloat16)
    out, _ = convert(ours, tmp_path / "spec", "speculators", target=target, target_name="org/tiny")
    cfg = json.loads((out / "config.json").read_text())
    # vllm/transformers_utils/configs/speculators/base.py validate_speculators_config + algos.py update_eagle3
    assert cfg["speculators_model_type"] == "eagle3" and cfg["transformer_layer_config"]["model_type"] == "llama"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert cfg["draft_vocab_size"] == N and cfg["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    assert cfg["norm_before_residual"] is False
    names = set(load_file(str(out / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and "embed_tokens.weight" in names and "d2t" in names


def test_refusals_name_the_file(tmp_path, target):
    d = base_draft(target)
    path = write_speculators(tmp_path / "spec", d, nbr=False)
    t = load_file(str(path / "model.safetensors"))
    t["layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a Qwen3 draft layer
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(FormatError, match="q_norm"):
        read_draft(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(engine_config(d.config)))
    (empty / "training_state.pt").write_bytes(b"x")
    with pytest.raises(FormatError, match="training_state.pt"):
        read_draft(empty)
    with pytest.raises(FormatError, match="sglang"):
        write_draft(d, tmp_path / "x", to="trtllm")


def test_cli_convert_and_inspect_name_the_format(tmp_path, target):
    from typer.testing import CliRunner

    from eagle3cli.cli import app

    tdir = tmp_path / "target"
    target.save_pretrained(tdir)
    path = write_modelopt(tmp_path / "mo", base_draft(target))
    runner = CliRunner()
    res = runner.invoke(app, ["inspect", str(path)])
    assert "ModelOpt" in res.output and "eagle3 convert" in res.output and res.exit_code == 1
    res = runner.invoke(app, ["convert", str(path), "--to", "sglang", "--out", str(tmp_path / "out"),
                              "--model", str(tdir)])
    assert res.exit_code == 0, res.output
    assert "inferred: layer ids [2, 4, 5]" in res.output and "inspect on the result: ok" in res.output
    res = runner.invoke(app, ["inspect", str(tmp_path / "out")])
    assert res.exit_code == 0 and "eagle3 (this package)" in res.output
    res = runner.invoke(app, ["convert", str(tmp_path / "nothing"), "--to", "vllm", "--out", str(tmp_path / "o2")])
    assert res.exit_code == 1 and "not a directory" in res.output


def test_push_dry_run_takes_a_speculators_draft(tmp_path, target):
    from typer.testing import CliRunner

    from eagle3cli.cli import app

    path = write_speculators(tmp_path / "spec", base_draft(target), nbr=False)
    res = CliRunner().invoke(app, ["push", str(path), "--repo", "me/tiny-eagle3", "--dry-run", str(tmp_path / "dry")])
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "dry" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["eagle3_training"]["target"] == "org/tiny-target"


def test_eval_gate_takes_any_readable_draft(tmp_path, target):
    """commands/evaluate.py: formats.as_ours, then evaluate.check_draft, then formats.read_draft."""
    from eagle3cli.evaluate.evaluate import check_draft
    from eagle3cli.publish.formats.writers import as_ours

    d = base_draft(target)
    path = write_specforge(tmp_path / "sf", d)
    said = []
    ours = as_ours(path, target.config, say=said.append)
    assert ours != str(path) and detect_format(ours) == "ours" and any("layer ids" in s for s in said)
    check_draft(ours, target.config)
    r, _ = read_draft(ours, target=target, dtype=torch.float32)
    assert torch.equal(logits(r), logits(d))
    mine = save_draft(d, tmp_path / "mine")
    assert as_ours(mine, target.config) == str(mine)  # ours is used in place
