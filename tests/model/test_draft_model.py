import pytest
import torch

from eagle3cli.model.draft import DecodeCache, DraftConfig, Eagle3Draft, KVCache
from tests.helpers.tiny import ARCHS, tiny_config, tiny_model


def make_draft(arch="llama", draft_vocab=100, seed=0):
    model = tiny_model(arch)
    cfg = DraftConfig.from_target(model.config, draft_vocab, (2, 4, 5))
    d = Eagle3Draft(cfg, embed_weight=model.get_input_embeddings().weight)
    d.init_weights(seed=seed)
    d.set_vocab(torch.arange(0, 2 * draft_vocab, 2))
    return model, d


@pytest.mark.parametrize("arch", ARCHS)
def test_config_from_target(arch):
    cfg = DraftConfig.from_target(tiny_config(arch), 100, (2, 4, 5))
    t = tiny_config(arch)
    assert cfg.hidden_size == t.hidden_size and cfg.target_hidden_size == t.hidden_size
    assert cfg.num_key_value_heads == t.num_key_value_heads
    assert cfg.head_dim == (getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads)
    assert cfg.max_position_embeddings == t.max_position_embeddings
    assert cfg.vocab_size == t.vocab_size and cfg.draft_vocab_size == 100
    assert "rope_theta" in cfg.rope_parameters


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_shapes(arch):
    model, d = make_draft(arch)
    ids = torch.randint(0, 256, (2, 9))
    a, logits = d(ids, torch.randn(2, 9, 3 * 64))
    assert a.shape == (2, 9, 64) and logits.shape == (2, 9, 100)
    # the embedding is a frozen copy of the target's
    assert torch.equal(d.embed_tokens.weight, model.get_input_embeddings().weight)
    assert not d.embed_tokens.weight.requires_grad


def test_d2t_offsets():
    _, d = make_draft()
    for i in [0, 1, 37, 99]:
        assert int(i + d.d2t[i]) == 2 * i
    assert torch.equal(d.draft_to_target(torch.tensor([5, 6])), torch.tensor([10, 12]))
    assert int(d.t2d.sum()) == 100 and bool(d.t2d[10]) and not bool(d.t2d[11])


def test_cached_steps_equal_full_forward():
    """Feeding tokens one at a time through the KV cache equals one causal forward."""
    _, d = make_draft()
    ids = torch.randint(0, 256, (1, 8))
    g = d.fuse(torch.randn(1, 8, 192))
    pos = torch.arange(8)[None]
    full = d.step(ids, g, pos, KVCache())
    cache, outs = KVCache(), []
    for t in range(8):
        outs.append(d.step(ids[:, t:t + 1], g[:, t:t + 1], pos[:, t:t + 1], cache))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert len(cache) == 8
    cache.crop(5)
    assert len(cache) == 5


def test_decode_cache_equals_concatenating_cache():
    """The drafter's preallocated cache holds exactly what KVCache's concatenations hold, through
    growth past its capacity, crops (a rejected tree) and selects, and steps read it bitwise alike."""
    _, d = make_draft()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 12), generator=gen)
    g = d.fuse(torch.randn(1, 12, 192, generator=gen))
    pos = torch.arange(12)[None]
    plain, fixed = KVCache(), DecodeCache(capacity=3)
    for lo, hi in ((0, 5), (5, 6), (6, 9)):  # 5 rows already overflow 3: the buffer grows
        a = d.step(ids[:, lo:hi], g[:, lo:hi], pos[:, lo:hi], plain)
        b = d.step(ids[:, lo:hi], g[:, lo:hi], pos[:, lo:hi], fixed)
        assert torch.equal(a, b) and len(plain) == len(fixed) == hi
    for c in (plain, fixed):
        c.crop(7)
    assert torch.equal(plain.k, fixed.k) and torch.equal(plain.v, fixed.v) and len(fixed) == 7
    keep = torch.tensor([0, 1, 2, 4, 6])
    for c in (plain, fixed):
        c.select(keep)
    assert torch.equal(plain.k, fixed.k) and torch.equal(plain.v, fixed.v) and len(fixed) == 5
    a = d.step(ids[:, 9:], g[:, 9:], pos[:, 5:8], plain)
    b = d.step(ids[:, 9:], g[:, 9:], pos[:, 5:8], fixed)
    assert torch.equal(a, b) and fixed.capacity >= 8
    # the cache stores KV heads repeated to the query heads, once per row
    assert fixed.k.shape[1] == d.config.num_attention_heads


def test_rope_matches_transformers_llama3_scaling():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rp = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = tiny_config("llama", rope_parameters=rp, max_position_embeddings=512)
    dcfg = DraftConfig.from_target(cfg, 50, (2, 4, 5))
    assert dcfg.rope_parameters["rope_type"] == "llama3"
    d = Eagle3Draft(dcfg)
    pos = torch.arange(300)[None]
    cos, sin = d.rotary(pos, torch.float32)
    ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1), pos)
    torch.testing.assert_close(cos[:, 0], ref_cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], ref_sin, rtol=1e-6, atol=1e-6)


def test_hidden_act_is_honoured(tmp_path):
    """The MLP applies cfg.hidden_act (transformers' ACT2FN); silu stays the SwiGLU it always was."""
    from dataclasses import replace

    import torch.nn.functional as F

    from eagle3cli.publish.export import load_draft, save_draft

    _, d = make_draft()
    mlp = d.midlayer.mlp
    x = torch.randn(2, 5, d.config.hidden_size)
    assert torch.equal(mlp(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    gelu = Eagle3Draft(replace(d.config, hidden_act="gelu_pytorch_tanh"))
    gelu.load_state_dict(d.state_dict())
    ids, aux = torch.randint(0, 256, (1, 6)), torch.randn(1, 6, 192)
    a_silu, _ = d(ids, aux)
    a_gelu, _ = gelu(ids, aux)
    assert not torch.allclose(a_silu, a_gelu)
    # the exported config.json carries it and a reload applies it
    save_draft(gelu, tmp_path / "gelu", dtype=torch.float32)
    back, cfg = load_draft(tmp_path / "gelu")
    assert cfg["hidden_act"] == "gelu_pytorch_tanh" and back.config.hidden_act == "gelu_pytorch_tanh"
    back.embed_tokens.weight.data.copy_(gelu.embed_tokens.weight)
    assert torch.equal(back(ids, aux)[0], a_gelu)
    with pytest.raises(ValueError, match="hidden_act"):
        Eagle3Draft(replace(d.config, hidden_act="no_such_activation"))


def test_init_weights_order_unchanged():
    """Seeded init draws fc, lm_head, q/k/v/o, gate/up/down in that order (activations skipped)."""
    _, d = make_draft(seed=3)
    gen = torch.Generator().manual_seed(3)
    at, mlp = d.midlayer.self_attn, d.midlayer.mlp
    for mod in [d.fc, d.lm_head, at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj,
                mlp.down_proj]:
        assert torch.equal(mod.weight, torch.randn(mod.weight.shape, generator=gen) * 0.02)


def test_residual_init_std_scales_only_the_residual_writers():
    """residual_std=0: o_proj and down_proj start at zero, every other weight is the default draw
    for the seed, and the layer starts as the identity (the output stream is fc(streams))."""
    _, ref = make_draft(seed=3)
    _, d = make_draft(seed=3)
    d.init_weights(seed=3, residual_std=0.0)
    at, mlp = d.midlayer.self_attn, d.midlayer.mlp
    assert not at.o_proj.weight.any() and not mlp.down_proj.weight.any()
    written = {"midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"}
    ref_sd = ref.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in d.state_dict().items() if k not in written)
    ids = torch.randint(0, 100, (1, 6))
    aux = torch.randn(1, 6, 3 * d.config.target_hidden_size)
    a, _ = d(ids, aux)
    assert torch.equal(a, d.fuse(aux))
    d.init_weights(seed=3, residual_std=0.005)
    g = torch.Generator().manual_seed(3)
    draws = [torch.randn(m.weight.shape, generator=g) for m in
             (d.fc, d.lm_head, at.q_proj, at.k_proj, at.v_proj, at.o_proj)]
    assert torch.equal(at.o_proj.weight, draws[-1] * 0.005) and torch.equal(at.q_proj.weight, draws[2] * 0.02)


@pytest.mark.parametrize("hidden", [None, 32])
def test_num_parameters_counts_the_export(hidden):
    from eagle3cli.publish.export import exported_state_dict

    overrides = {} if hidden is None else {"hidden_size": hidden}
    d = Eagle3Draft(DraftConfig.from_target(tiny_config("llama"), 100, (2, 4, 5), **overrides))
    exported = sum(v.numel() for k, v in exported_state_dict(d).items() if k not in ("d2t", "t2d"))
    assert d.num_parameters() == exported
    assert d.num_parameters(exported_only=False) == exported + (d.embed_tokens.weight.numel() if hidden is None else 0)
