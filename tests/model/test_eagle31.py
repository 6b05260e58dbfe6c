"""EAGLE-3.1 and the draft options the engines read (issue #15, docs/design.md §3 and §5).

fc_norm, norm_output, norm_before_fc and norm_before_residual: in the model, the TTT unroll and
the generator; exported under the names and keys vLLM 0.32.0 and SGLang 0.5.23 read
(tests/fixtures/engines/eagle3_draft_names.json names each loader's file); read back by
formats.read_draft; checked by inspect. Off by default: an EAGLE-3 draft is what it was.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3cli.config.train_config import TrainConfig, draft_options, resolve
from eagle3cli.engines import engine_support
from eagle3cli.model.draft import DraftConfig, Eagle3Draft, KVCache
from eagle3cli.publish.export import engine_config, exported_state_dict, load_draft, save_draft
from eagle3cli.publish.formats.common import FormatError
from eagle3cli.publish.formats.detect import detect_format
from eagle3cli.publish.formats.readers import read_draft
from eagle3cli.publish.formats.writers import convert, write_draft
from eagle3cli.publish.inspector import inspect_any, inspect_draft
from eagle3cli.train.ttt import ttt_streams
from tests.helpers.tiny import tiny_config, tiny_model

torch.set_num_threads(1)
FIXTURE = Path(__file__).parents[1] / "fixtures" / "engines" / "eagle3_draft_names.json"
LAYERS = (2, 4, 5)
V31 = {"fc_norm": True, "norm_output": True}
OPTION_SETS = {
    "eagle3": {},
    "eagle3.1": V31,
    "norm_before_fc": {"norm_before_fc": True},
    "norm_before_residual": {"norm_before_residual": True},
    "eagle3.1+nbr": {**V31, "norm_before_residual": True},
}
# The names an EAGLE-3 draft exported before issue #15 holds (tests/publish/test_export_inspect.py).
EAGLE3_NAMES = [
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
]
# config.json keys of an EAGLE-3 draft before issue #15 (export.engine_config, docs/design.md §5).
EAGLE3_KEYS = {
    "architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "vocab_size", "draft_vocab_size", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "norm_before_residual", "torch_dtype", "pad_token_id", "bos_token_id",
    "eos_token_id", "eagle_aux_hidden_state_layer_ids", "eagle_config", "eagle3_training",
}


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def make_draft(target, seed=1, draft_vocab=100, **options):
    cfg = DraftConfig.from_target(target.config, draft_vocab, LAYERS, **options)
    d = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight)
    d.init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():  # every norm away from ones, so a norm applied wrongly (or not) shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in f".{name}" or name.startswith("fc_norm."):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        for name, p in d.named_parameters():  # exact in bf16, so bf16 exports round-trip bit for bit
            if name != "embed_tokens.weight":  # (not shipped: the target's own is used on reading)
                p.copy_(p.to(torch.bfloat16).float())
    d.set_vocab(torch.arange(0, 2 * draft_vocab, 2))
    return d.eval()


def batch(d, t=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, d.config.vocab_size, (1, t), generator=g)
    aux = torch.randn(1, t, 3 * d.config.target_hidden_size, generator=g) * 3
    return ids, aux


def logits(d, seed=0):
    with torch.no_grad():
        return d(*batch(d, seed=seed))[1]


# ---- defaults: an EAGLE-3 draft is unchanged ------------------------------------------------

def test_default_draft_has_the_old_names_and_config_keys(target, tmp_path):
    d = make_draft(target)
    assert list(exported_state_dict(d)) == EAGLE3_NAMES
    assert sorted(k for k in d.state_dict() if k != "embed_tokens.weight") == sorted(EAGLE3_NAMES)
    assert d.config.options() == {} and d.config.variant == "eagle3"
    cfg = json.loads((save_draft(d, tmp_path / "d") / "config.json").read_text())
    assert set(cfg) == EAGLE3_KEYS and cfg["norm_before_residual"] is False
    assert set(engine_config(d.config)) == EAGLE3_KEYS


def test_options_do_not_change_the_random_init_of_the_other_weights(target):
    """Seeded init is per weight (init_weights), so 3.1 and 3 drafts start from the same fc/layer/head."""
    a = make_draft(target)
    b = make_draft(target, **V31)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in EAGLE3_NAMES if not k.endswith("norm.weight"))


# ---- the forward: what each option computes -------------------------------------------------

def plain_twin(d):
    """The same weights without any option."""
    p = Eagle3Draft(DraftConfig.from_dict({**d.config.to_dict(), "fc_norm": False, "norm_output": False,
                                           "norm_before_fc": False, "norm_before_residual": False}))
    p.load_state_dict(d.state_dict(), strict=False)
    return p.eval()


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_fc_norm_normalises_each_stream_before_fc(target):
    d = make_draft(target, **V31)
    _, aux = batch(d)
    eps, h = d.config.rms_norm_eps, d.config.target_hidden_size
    chunks = [rms(aux[..., i * h:(i + 1) * h], d.fc_norm[i].weight, eps) for i in range(3)]
    with torch.no_grad():
        torch.testing.assert_close(d.fuse(aux), d.fc(torch.cat(chunks, -1)))
        assert not torch.allclose(d.fuse(aux), plain_twin(d).fuse(aux), atol=1e-3)


def test_norm_before_fc_is_one_norm_over_the_concatenation(target):
    d = make_draft(target, norm_before_fc=True)
    _, aux = batch(d)
    with torch.no_grad():
        torch.testing.assert_close(d.fuse(aux), d.fc(rms(aux, d.input_norm.weight, d.config.rms_norm_eps)))
        assert not torch.allclose(d.fuse(aux), plain_twin(d).fuse(aux), atol=1e-3)


def test_norm_output_feeds_the_normed_stream_and_norms_once(target):
    d = make_draft(target, norm_output=True)
    p = plain_twin(d)
    ids, aux = batch(d)
    with torch.no_grad():
        pos = torch.arange(ids.shape[1])[None]
        a_d = d.step(ids, d.fuse(aux), pos, KVCache())
        a_p = p.step(ids, p.fuse(aux), pos, KVCache())
        torch.testing.assert_close(a_d, p.norm(a_p))  # the output stream is norm(a)
        torch.testing.assert_close(d.logits(a_d), p.logits(a_p))  # step 0: the same logits (norm once)
        s1 = list(ttt_streams(d, ids, aux, steps=2))[1]
        s1_plain = list(ttt_streams(p, ids, aux, steps=2))[1]
        assert not torch.allclose(d.logits(s1), p.logits(s1_plain), atol=1e-3)  # step 1 is fed norm(a)


def test_norm_before_residual_norms_the_residual(target):
    d = make_draft(target, norm_before_residual=True)
    o, g = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    with torch.no_grad():
        torch.testing.assert_close(d.midlayer.finish(o, g), plain_twin(d).midlayer.finish(o, d.midlayer.hidden_norm(g)))


@pytest.mark.parametrize("name", [n for n in OPTION_SETS if n != "eagle3"])
def test_every_option_changes_the_logits(target, name):
    d = make_draft(target, **OPTION_SETS[name])
    ids, aux = batch(d)
    with torch.no_grad():
        got = [d.logits(a) for a in ttt_streams(d, ids, aux, steps=3)]
        ref = [plain_twin(d).logits(a) for a in ttt_streams(plain_twin(d), ids, aux, steps=3)]
    assert any(not torch.allclose(x, y, atol=1e-3) for x, y in zip(got, ref))


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_ttt_unroll_is_what_the_generator_drafts(target, name):
    """Step s at position t of the TTT unroll == drafting s tokens with the KV cache (as
    generator.EagleDrafter does): training and inference see the same draft for every option."""
    d = make_draft(target, **OPTION_SETS[name])
    ids, aux = batch(d, t=10)
    with torch.no_grad():
        streams = list(ttt_streams(d, ids, aux, steps=4))
        for t in (0, 4, 7):
            cache = KVCache()
            a = d.step(ids[:, 1:t + 2], d.fuse(aux[:, :t + 1]), torch.arange(t + 1)[None], cache)[:, -1:]
            torch.testing.assert_close(a[0, 0], streams[0][0, t], atol=1e-5, rtol=1e-5)
            for s in range(1, 4):
                if t + 1 + s >= ids.shape[1]:
                    break
                a = d.step(ids[:, t + 1 + s:t + 2 + s], a, torch.tensor([[t + s]]), cache)
                torch.testing.assert_close(a[0, 0], streams[s][0, t], atol=1e-5, rtol=1e-5)


def test_generator_greedy_equality_with_a_31_draft():
    from eagle3cli.decode.generator import greedy_generate, speculative_generate
    from eagle3cli.model.layers import default_layer_ids

    tgt = tiny_model("llama")
    cfg = DraftConfig.from_target(tgt.config, 128, default_layer_ids(8), **V31)
    d = Eagle3Draft(cfg, embed_weight=tgt.get_input_embeddings().weight)
    d.init_weights(seed=0)
    d.set_vocab(torch.arange(0, 256, 2))
    for i in range(2):
        ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(i))
        ref = greedy_generate(tgt, ids, 20, eos_token_id=[-1])
        for kw in (dict(mode="tree", total_tokens=12, depth=4, top_k=3), dict(mode="chain", steps=3)):
            assert speculative_generate(tgt, d.eval(), ids, max_new_tokens=20, eos_token_id=[-1], **kw).tokens == ref


def test_fc_norm_with_norm_before_fc_is_refused(target):
    with pytest.raises(ValueError, match="mutually exclusive"):
        DraftConfig.from_target(target.config, 100, LAYERS, fc_norm=True, norm_before_fc=True)


# ---- export: names, shapes, keys -------------------------------------------------------------

def test_31_export_names_shapes_and_keys(tmp_path):
    tgt = tiny_model("llama")
    d = Eagle3Draft(DraftConfig.from_target(tgt.config, 100, LAYERS, hidden_size=48, **V31))  # H != Ht
    out = save_draft(d, tmp_path / "d31")
    t = load_file(str(out / "model.safetensors"))
    assert set(t) == {*EAGLE3_NAMES, "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight",
                      "embed_tokens.weight"}
    assert all(t[f"fc_norm.{i}.weight"].shape == (64,) for i in range(3))  # the target's hidden size
    assert t["fc.weight"].shape == (48, 192)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and "norm_before_fc" not in cfg
    assert cfg["norm_before_residual"] is False and set(cfg) == EAGLE3_KEYS | {"fc_norm", "norm_output",
                                                                                "target_hidden_size"}
    nbf = save_draft(make_draft(tgt, norm_before_fc=True), tmp_path / "nbf")
    assert load_file(str(nbf / "model.safetensors"))["input_norm.weight"].shape == (192,)
    assert json.loads((nbf / "config.json").read_text())["norm_before_fc"] is True


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_exported_names_are_what_the_engine_loaders_map(target, tmp_path, engine):
    """Every tensor of a 3.1 (and a norm_before_fc) export is a name the engine's loader maps to a
    module (fixture: the loader's file and version); the norms are exactly fc_norm.{0,1,2}.weight."""
    spec = json.loads(FIXTURE.read_text())[engine]
    for opts in (V31, {"norm_before_fc": True}):
        names = set(load_file(str(save_draft(make_draft(target, **opts), tmp_path / str(opts)) / "model.safetensors")))
        assert names <= set(spec["modules"]), sorted(names - set(spec["modules"]))
    assert {k for k in spec["modules"] if "fc_norm" in k} == {f"fc_norm.{i}.weight" for i in range(3)}
    assert set(spec["config_keys"]) <= {"fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"}


def test_31_export_reload_is_bit_exact(target, tmp_path):
    d = make_draft(target, **V31)
    out = save_draft(d, tmp_path / "d", dtype=torch.bfloat16)
    back, _ = load_draft(out, target=target, dtype=None)
    a, b = exported_state_dict(d, torch.bfloat16), exported_state_dict(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert back.config.options() == V31
    r, note = read_draft(out, target=target, dtype=torch.float32)
    assert note.options == V31 and torch.equal(logits(r), logits(d))
    # to speculators and back: the same bytes and the same config
    spec, _ = convert(out, tmp_path / "spec", "speculators", target=target)
    sc = json.loads((spec / "config.json").read_text())
    assert sc["fc_norm"] is True and sc["norm_output"] is True and sc["norm_before_fc"] is False
    assert "fc_norm.0.weight" in load_file(str(spec / "model.safetensors"))
    again, _ = convert(spec, tmp_path / "again", "ours", target=target)
    x, y = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    cx, cy = (json.loads((p / "config.json").read_text()) for p in (out, again))
    cx.pop("eagle3_training"), cy.pop("eagle3_training")
    assert cx == cy


# ---- reading other tools' 3.1 drafts ----------------------------------------------------------

def test_sglang_legacy_aux_norm_names_are_read_as_fc_norm(target, tmp_path):
    d = make_draft(target, **V31)
    out = save_draft(d, tmp_path / "d")
    t = load_file(str(out / "model.safetensors"))
    for i, legacy in enumerate(("aux_norm_low", "aux_norm_mid", "aux_norm_high")):
        t[f"{legacy}.weight"] = t.pop(f"fc_norm.{i}.weight")
    save_file(t, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["use_aux_norm"] = cfg.pop("fc_norm")  # SGLang's legacy flag
    (out / "config.json").write_text(json.dumps(cfg))
    rep = inspect_draft(out)
    assert any("aux_norm_low.weight" in p and "legacy" in p for p in rep.problems)
    assert any(p.startswith("config: use_aux_norm is SGLang's legacy name") for p in rep.problems)
    r, note = read_draft(out, target=target, dtype=torch.float32)
    assert r.config.fc_norm and any("aux_norm_high, aux_norm_low, aux_norm_mid read as fc_norm" in x
                                    for x in note.inferred)
    assert torch.equal(logits(r), logits(d))
    fixed, _ = convert(out, tmp_path / "fixed", "vllm", target=target)
    assert inspect_draft(fixed).ok and json.loads((fixed / "config.json").read_text())["fc_norm"] is True


def test_norms_without_their_flag_are_caught_and_read_with_it(target, tmp_path):
    d = make_draft(target, **V31)
    out = save_draft(d, tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("fc_norm")
    (out / "config.json").write_text(json.dumps(cfg))
    rep = inspect_draft(out)
    assert not rep.ok and any("does not set fc_norm" in p for p in rep.problems)
    assert not rep.summary["engines"]["vllm"] and not rep.summary["engines"]["sglang"]
    r, note = read_draft(out, target=target, dtype=torch.float32)
    assert r.config.fc_norm and any("fc_norm = true" in x for x in note.inferred)
    assert torch.equal(logits(r), logits(d))


@pytest.mark.parametrize("damage", ["missing", "misnamed", "prefixed"])
def test_inspect_catches_missing_or_misnamed_norms(target, tmp_path, damage):
    out = save_draft(make_draft(target, **V31), tmp_path / "d")
    t = load_file(str(out / "model.safetensors"))
    w = t.pop("fc_norm.1.weight")
    if damage == "misnamed":
        t["fc_norms.1.weight"] = w
    elif damage == "prefixed":
        t["model.fc_norm.1.weight"] = w
    save_file(t, str(out / "model.safetensors"))
    rep = inspect_draft(out)
    assert not rep.ok
    text = "\n".join(rep.problems)
    assert "fc_norm.1.weight: missing" in text or damage == "prefixed"
    if damage == "misnamed":
        assert "fc_norms.1.weight: unknown name" in text
    if damage == "prefixed":
        assert "'model.' prefix" in text
    if damage == "missing":
        with pytest.raises(FormatError, match="sets fc_norm but"):
            read_draft(out, target=target)


def test_speculators_31_draft_is_read_and_served_by_vllm_only(target, tmp_path):
    d = make_draft(target, **V31, norm_before_residual=True)
    spec = write_draft(d, tmp_path / "spec", to="speculators", target_name="org/tiny")
    assert detect_format(spec) == "speculators"
    r, note = read_draft(spec, target=target, dtype=torch.float32)
    assert r.config.options() == d.config.options() and torch.equal(logits(r), logits(d))
    rep, _ = inspect_any(spec, target.config)
    assert rep.ok and rep.summary["variant"] == "eagle3.1"
    assert rep.summary["engines"] == {"vllm": True, "sglang": False}
    with pytest.raises(FormatError, match="SGLang"):
        write_draft(d, tmp_path / "sgl", to="sglang")


def test_specforge_norm_output_means_what_specforge_020_means(target, tmp_path):
    """SpecForge 0.2.0 modeling/draft/llama3_eagle.py: norm_output (default true) only says the LM
    head reads norm(a); its TTT (algorithms/eagle3/model.py) feeds the un-normed a forward."""
    d = make_draft(target, fc_norm=True)  # what SpecForge 0.2.0 trains with fc_norm: true
    out = save_draft(d, tmp_path / "sf")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("eagle3_training"), cfg.pop("eagle_aux_hidden_state_layer_ids")  # SpecForge writes neither
    cfg["norm_output"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    assert detect_format(out) == "specforge"
    r, note = read_draft(out, target_config=target.config, target=target, dtype=torch.float32)
    assert r.config.options() == {"fc_norm": True} and torch.equal(logits(r), logits(d))
    assert any("SpecForge 0.2.0" in x for x in note.inferred)
    rep, _ = inspect_any(out, target.config)  # as it is, the engines would feed norm(a) forward
    assert not rep.ok and any("SpecForge 0.2.0" in p for p in rep.problems)
    fixed, _ = convert(out, tmp_path / "fixed", "vllm", target_config=target.config, target=target)
    assert "norm_output" not in json.loads((fixed / "config.json").read_text())
    assert inspect_any(fixed, target.config)[0].ok


# ---- train flags and engine support ---------------------------------------------------------

def test_train_flags_map_to_draft_options():
    assert draft_options(TrainConfig()) == {"fc_norm": False, "norm_output": False, "norm_before_fc": True,
                                            "norm_before_residual": False}  # the default: norm before fc
    assert draft_options(TrainConfig(variant="eagle3.1")) == {**V31, "norm_before_fc": False,
                                                              "norm_before_residual": False}
    assert draft_options(TrainConfig(norm_before_fc=True, norm_before_residual=True))["norm_before_fc"]
    with pytest.raises(ValueError, match="--variant must be one of eagle3, eagle3.1"):
        resolve("none", {"variant": "eagle4"})
    with pytest.raises(ValueError, match="does not combine"):
        resolve("none", {"variant": "eagle3.1", "norm_before_fc": True})


def test_engine_support_names_the_refusals():
    gemma = tiny_config("gemma3_text")
    assert engine_support.architecture(gemma) == "Gemma3ForCausalLM"
    support = engine_support.target_support(gemma)
    assert support[engine_support.VLLM][0] is False and "SupportsEagle3" in support[engine_support.VLLM][1]
    assert support[engine_support.SGLANG][0] is True
    lines = engine_support.warnings(gemma)
    assert len(lines) == 1 and lines[0].startswith("vLLM 0.32.0 refuses EAGLE-3 for Gemma3ForCausalLM")
    assert engine_support.warnings(tiny_config("llama")) == []
    assert engine_support.target_support({"architectures": ["FooForCausalLM"]})[engine_support.VLLM][0] is None
    nbr = engine_support.warnings(tiny_config("qwen3"), {"norm_before_residual": True})
    assert any(line.startswith("SGLang 0.5.23 does not implement norm_before_residual") for line in nbr)
    v31 = engine_support.unsupported_options(V31)
    assert v31[engine_support.VLLM] == [] and v31[engine_support.SGLANG] == []
    assert v31[engine_support.LLAMACPP] == ["fc_norm", "norm_output"]


def test_inspect_shows_variant_and_target_support(target, tmp_path):
    from typer.testing import CliRunner

    from eagle3cli.cli import app

    out = save_draft(make_draft(target, **V31), tmp_path / "d")
    gdir = tmp_path / "gemma"
    tiny_model("gemma3_text").save_pretrained(gdir)
    rep = inspect_draft(out, tiny_config("gemma3_text"))
    assert rep.summary["variant"] == "eagle3.1" and rep.summary["options"] == V31
    assert rep.summary["target_support"][engine_support.VLLM][0] is False
    res = CliRunner().invoke(app, ["inspect", str(out), "--model", str(gdir)])
    assert "eagle3.1 / fc_norm, norm_output" in res.output
    assert "warning: vLLM 0.32.0 refuses EAGLE-3 for Gemma3ForCausalLM" in res.output.replace("\n", " ")


def test_gguf_export_refuses_a_31_draft(target, tmp_path):
    from eagle3cli.publish.gguf_export import GGUFExportError, check_options

    out = save_draft(make_draft(target, **V31), tmp_path / "d")
    with pytest.raises(GGUFExportError, match="fc_norm, norm_output"):
        check_options(out)
    check_options(save_draft(make_draft(target, norm_before_fc=True), tmp_path / "nbf"))  # llama.cpp has it


def test_card_names_the_variant_and_what_each_engine_serves(target):
    from eagle3cli.publish.model_card import facts, serving_notes

    cfg = engine_config(make_draft(target, **V31).config)
    assert ("Draft architecture", "EAGLE-3.1 (`fc_norm`, `norm_output`)") in facts(cfg, "org/t")
    notes = serving_notes(cfg)
    assert any(n.startswith("llama.cpp") and "`fc_norm`, `norm_output`" in n for n in notes)
    assert any("`Gemma3ForCausalLM`" in n for n in notes)
    assert serving_notes(cfg, tiny_config("gemma3_text"))[-1].startswith("vLLM 0.32.0 refuses EAGLE-3")
    assert not any("SGLang" in n for n in serving_notes(engine_config(make_draft(target).config),
                                                         tiny_config("llama")))


def test_init_from_a_31_draft_keeps_its_options(target, tmp_path):
    from eagle3cli.model.vocab import DraftVocab
    from eagle3cli.train.init_from import init_from

    src = make_draft(target, **V31)
    path = save_draft(src, tmp_path / "src", dtype=torch.float32)
    fresh = make_draft(target, seed=5)
    vocab = DraftVocab(ids=torch.arange(0, 200, 2), coverage=1.0)
    for mode in ("keep", "new"):
        cfg = TrainConfig(init_from=str(path), init_vocab=mode)
        out, _ = init_from(fresh, vocab, torch.ones(256), cfg, target.config)
        assert out.config.options() == V31
        torch.testing.assert_close(logits(out), logits(src))
