"""--warm-start: the draft's pieces taken from the target compute what the target computes."""

from __future__ import annotations

import pytest
import torch

from eagle3cli.model import warm_start
from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from eagle3cli.model.layers import default_layer_ids
from tests.helpers.tiny import tiny_model


def fresh_draft(target, vocab_ids):
    cfg = DraftConfig.from_target(target.config, vocab_ids.numel(), default_layer_ids(target.config.num_hidden_layers))
    d = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight)
    d.init_weights(seed=0)
    d.set_vocab(vocab_ids)
    return d


def test_head_and_fc_reproduce_the_target_head_on_the_high_stream():
    target = tiny_model("llama")
    vocab = torch.arange(0, target.config.vocab_size, 2)
    d = fresh_draft(target, vocab)
    warm_start.apply(d, ("head", "fc"), warm_start.target_parts(target, ("head", "fc")), vocab)
    ids = torch.randint(0, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[j] for j in d.config.aux_layer_ids], -1)
        g = d.fuse(aux)
        torch.testing.assert_close(g, hs[d.config.aux_layer_ids[2]])  # fc passes the high stream
        # norm + lm_head are the target's: on the last layer's input they give the target's logits
        last = hs[target.config.num_hidden_layers]  # already final-normed: undo nothing, compare via the head
        ref = target.lm_head(target.model.norm(hs[target.config.num_hidden_layers - 1]))[..., vocab]
        got = d.logits(hs[target.config.num_hidden_layers - 1])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert last.shape == g.shape


def test_layer_warm_start_is_the_target_last_layer_on_the_hidden_half():
    target = tiny_model("llama")
    vocab = torch.arange(target.config.vocab_size)
    d = fresh_draft(target, vocab)
    warm_start.apply(d, ("layer",), warm_start.target_parts(target, ("layer",)), vocab)
    layer = target.model.layers[-1]
    torch.testing.assert_close(d.midlayer.self_attn.q_proj.weight[:, target.config.hidden_size:],
                               layer.self_attn.q_proj.weight)
    assert d.midlayer.self_attn.q_proj.weight[:, :target.config.hidden_size].abs().sum() == 0
    torch.testing.assert_close(d.midlayer.mlp.down_proj.weight, layer.mlp.down_proj.weight)
    torch.testing.assert_close(d.midlayer.hidden_norm.weight, layer.input_layernorm.weight)


def test_gemma_style_norm_is_read_as_its_effective_scale():
    class OnePlus(torch.nn.Module):  # Gemma's RMSNorm scales by 1 + w
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.0]))
            self.eps = 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)

    torch.testing.assert_close(warm_start.effective_norm_weight(OnePlus(), 3), torch.tensor([1.5, 0.75, 2.0]))


def test_unknown_part_is_refused():
    with pytest.raises(warm_start.WarmStartError, match="unknown part"):
        warm_start.parse_parts("head,lm")
    assert warm_start.parse_parts("none") == () and warm_start.parse_parts("head, fc") == ("head", "fc")


# ---- every layer shape (tests/helpers/families.py) ---------------------------------------------------

from tests.helpers.families import available, family_model  # noqa: E402

LAYER_NOTES = {  # family -> the parts that do not apply as is, each named in its own line
    "qwen2": ["attention copied without its q_proj.bias, k_proj.bias, v_proj.bias"],
    "qwen3": ["attention copied without its q_norm, k_norm"],
    "mixtral": ["MLP from the mean of its 4 routed experts"],
    "qwen2_moe": ["attention copied without its q_proj.bias", "MLP from the mean of its 4 routed experts"],
    "qwen3_moe": ["attention copied without its q_norm", "MLP from the mean of its 4 routed experts"],
    "gemma2": ["post_attention_layernorm, post_feedforward_layernorm of Gemma2DecoderLayer follow a sublayer"],
    "olmo2": ["no norm before the attention in Olmo2DecoderLayer", "no norm before the MLP in Olmo2DecoderLayer",
              "post_attention_layernorm, post_feedforward_layernorm of Olmo2DecoderLayer follow a sublayer"],
    "glm4": ["post_self_attn_layernorm, post_mlp_layernorm of Glm4DecoderLayer follow a sublayer",
             "the target rotates 0.5 of each head's dimensions, the draft all of them"],
    "gpt_oss": ["attention copied without its sinks", "MLP not copied: its experts add biases"],
    "deepseek_v3": ["attention not copied: DeepseekV3Attention has no q/k/v projections",
                    "MLP from the mean of its 4 routed experts"],
    "llama4_text": ["MLP from the mean of its 4 routed experts"],
}


def expected_layer(layer, cfg):
    """The target layer's parts in the draft's layout, read independently of warm_start."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn, out = layer.self_attn, {}
    if hasattr(attn, "qkv_proj"):  # Phi-3: q, k, v rows in that order
        out["q_proj"], out["k_proj"], out["v_proj"] = attn.qkv_proj.weight.split([q, kv, kv])
    elif isinstance(getattr(attn, "k_proj", None), torch.nn.Linear):  # not latent attention
        out.update({n: getattr(attn, n).weight for n in ("q_proj", "k_proj", "v_proj")})
    if "q_proj" in out:
        out["o_proj"] = attn.o_proj.weight
    mlp = getattr(layer, "mlp", None) or layer.feed_forward
    if hasattr(mlp, "gate_up_proj") and isinstance(mlp.gate_up_proj, torch.nn.Linear):  # Phi-3, GLM-4
        out["gate_proj"], out["up_proj"] = mlp.gate_up_proj.weight.chunk(2)
        out["down_proj"] = mlp.down_proj.weight
    elif hasattr(mlp, "gate_proj"):
        out.update({n: getattr(mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")})
    elif not hasattr(mlp.experts, "gate_up_proj_bias"):  # routed experts, averaged
        gu, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
        if gu.shape[1] == h:  # Llama 4 stores them for x @ W
            gu, down = gu.transpose(1, 2), down.transpose(1, 2)
        out["gate_proj"], out["up_proj"] = gu.mean(0).chunk(2)
        out["down_proj"] = down.mean(0)
    return out


@pytest.mark.parametrize("family", available())
def test_layer_warm_start_of_every_family(family):
    target = family_model(family)
    vocab = torch.arange(target.config.vocab_size)
    d = fresh_draft(target, vocab)
    before = {k: v.clone() for k, v in d.midlayer.state_dict().items()}
    notes = warm_start.apply(d, ("head", "fc", "layer"), warm_start.target_parts(target, ("head", "fc", "layer")),
                             vocab)
    layer = warm_start.decoder_layers(target)[-1]
    h = target.config.hidden_size
    want = expected_layer(layer, d.config)
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        got = getattr(d.midlayer.self_attn, n).weight
        if n not in want:  # not copied: as initialised
            torch.testing.assert_close(got, before[f"self_attn.{n}.weight"])
        elif n == "o_proj":
            torch.testing.assert_close(got, want[n])
        else:
            torch.testing.assert_close(got[:, h:], want[n])
            assert got[:, :h].abs().sum() == 0
    for n in ("gate_proj", "up_proj", "down_proj"):
        got = getattr(d.midlayer.mlp, n).weight
        if n not in want:
            torch.testing.assert_close(got, before[f"mlp.{n}.weight"])
            continue
        w = want[n]
        if n == "down_proj":  # a narrower MLP is zero-padded to the draft's intermediate size
            torch.testing.assert_close(got[:, :w.shape[1]], w)
            assert got[:, w.shape[1]:].abs().sum() == 0
        else:
            torch.testing.assert_close(got[:w.shape[0]], w)
    children = dict(layer.named_children())
    pre_attn = children.get("input_layernorm")
    pre_mlp = children.get("pre_feedforward_layernorm", children.get("post_attention_layernorm") if pre_attn else None)
    for norm, got, key in ((pre_attn, d.midlayer.hidden_norm.weight, "hidden_norm.weight"),
                           (pre_mlp, d.midlayer.post_attention_layernorm.weight, "post_attention_layernorm.weight")):
        ref = warm_start.effective_norm_weight(norm, h) if norm is not None else before[key]
        torch.testing.assert_close(got, ref)
    # the head: the target's rows and final norm (Llama 4's reached through its decoder stack)
    torch.testing.assert_close(d.norm.weight, warm_start.effective_norm_weight(warm_start.final_norm(target), h))
    for expected in LAYER_NOTES.get(family, []):
        assert sum(expected in n for n in notes) == 1, (expected, notes)
    assert all(n.startswith("warm start ") for n in notes)


def test_head_warm_start_carries_the_logit_scale():
    """Granite divides its logits by logits_scaling: the warm-started head gives the target's own logits."""
    target = family_model("granite")
    vocab = torch.arange(target.config.vocab_size)
    d = fresh_draft(target, vocab)
    warm_start.apply(d, ("head",), warm_start.target_parts(target, ("head",)), vocab)
    ids = torch.randint(3, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        x = target(input_ids=ids, output_hidden_states=True).hidden_states[-2]  # any un-normed stream
        ref = target.lm_head(target.model.norm(x)) / target.config.logits_scaling  # GraniteForCausalLM's logits
        got = d.logits(x)
    assert target.config.logits_scaling == 8.0
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_moe_shared_expert_on_request():
    target = family_model("qwen2_moe")
    vocab = torch.arange(target.config.vocab_size)
    d = fresh_draft(target, vocab)
    notes = warm_start.apply(d, ("layer",), warm_start.target_parts(target, ("layer",)), vocab, moe="shared")
    shared = target.model.layers[-1].mlp.shared_expert
    torch.testing.assert_close(d.midlayer.mlp.down_proj.weight, shared.down_proj.weight)
    assert any("MLP from the shared expert" in n for n in notes)
