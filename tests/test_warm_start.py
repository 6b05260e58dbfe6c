"""--warm-start: the draft's pieces taken from the target compute what the target computes."""

from __future__ import annotations

import pytest
import torch

from eagle3cli.model import warm_start
from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from eagle3cli.model.layers import default_layer_ids
from tiny import tiny_model


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
