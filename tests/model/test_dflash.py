"""The DFlash draft: the training forward over many blocks equals drafting each block from a
cache, and a block's logits depend on nothing it must not see (docs/design.md §13)."""

import pytest
import torch

from eagle3cli.model.dflash import DFlashCache, DFlashConfig, DFlashDraft, block_mask, choose_mask_token

H, V, NT = 32, 101, 4  # hidden, vocab, target streams


def tiny(block=4, layers=2, seed=0) -> DFlashDraft:
    cfg = DFlashConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, rms_norm_eps=1e-6, vocab_size=V, target_hidden_size=H,
                       max_position_embeddings=256, num_hidden_layers=layers, num_target_layers=8,
                       target_layer_ids=(1, 3, 5, 7)[:NT], block_size=block, mask_token_id=V - 1)
    torch.manual_seed(seed)
    d = DFlashDraft(cfg, embed_weight=torch.randn(V, H), head_weight=torch.randn(V, H))
    d.init_weights(std=0.2, seed=seed)
    for n, p in d.named_parameters():  # norms off one, so the test sees them
        if n.endswith("norm.weight"):
            with torch.no_grad():
                p.add_(0.3 * torch.randn(p.shape))
    return d.double()


def inputs(t=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, t, NT * H, generator=g, dtype=torch.float64), torch.randint(0, V - 1, (1, t), generator=g)


def test_training_forward_equals_drafting_from_the_cache():
    d = tiny()
    aux, ids = inputs()
    anchors = torch.tensor([[3, 9, 10, 15]])
    full = d(aux, ids, anchors)  # [1, 4, B, V]
    for i, a in enumerate(anchors[0].tolist()):
        caches = [DFlashCache() for _ in d.layers]
        # the context arrives in two pieces, as in decoding (prefill, then accepted tokens)
        cut = a // 2
        d.draft_block(aux[:, :cut], torch.arange(cut)[None], ids[0, a], caches) if cut else None
        for c in caches:
            assert len(c) == cut
        got = d.draft_block(aux[:, cut:a], torch.arange(cut, a)[None], ids[0, a], caches)
        torch.testing.assert_close(got[0], full[0, i], rtol=0, atol=1e-10)


def block_logits(d, aux, ids, anchors, i):
    return d(aux, ids, anchors)[0, i]


def test_a_block_sees_nothing_at_or_after_its_anchor_nor_other_blocks():
    """Perturbation: target streams at or after the anchor, later tokens and the other blocks'
    anchors change; the block's logits stay bitwise equal. A stream before the anchor changes them."""
    d = tiny()
    aux, ids = inputs()
    anchors = torch.tensor([[4, 8, 13]])
    ref = block_logits(d, aux, ids, anchors, 1)  # the block anchored at 8
    aux2 = aux.clone()
    aux2[:, 8:] += torch.randn_like(aux2[:, 8:])
    ids2 = ids.clone()
    ids2[0, 9:] = (ids2[0, 9:] + 5) % (V - 1)
    ids2[0, 4] = (ids2[0, 4] + 1) % (V - 1)  # another block's anchor token
    assert torch.equal(block_logits(d, aux2, ids2, anchors, 1), ref)
    # other blocks' anchors moved: still the same logits for this block
    assert torch.equal(block_logits(d, aux, ids, torch.tensor([[2, 8, 16]]), 1), ref)
    aux3 = aux.clone()
    aux3[:, 7] += 1.0  # the last context row it may see
    assert not torch.allclose(block_logits(d, aux3, ids, anchors, 1), ref)
    ids3 = ids.clone()
    ids3[0, 8] = (ids3[0, 8] + 1) % (V - 1)  # its own anchor token
    assert not torch.allclose(block_logits(d, aux, ids3, anchors, 1), ref)


def test_residual_init_std_scales_only_each_layers_residual_writers():
    """residual_std=0: every layer's o_proj and down_proj start at zero, every other weight is the
    default draw for the seed, and each layer starts as the identity (a block's logits are those of
    its embeddings alone, whatever the context)."""
    ref, d = tiny(seed=3).float(), tiny(seed=3).float()
    d.init_weights(std=0.2, seed=3, residual_std=0.0)
    writers = {f"layers.{i}.{w}.weight" for i in range(2) for w in ("self_attn.o_proj", "mlp.down_proj")}
    sd, ref_sd = d.state_dict(), ref.state_dict()
    assert all(not sd[k].any() for k in writers)
    norms = {k for k in sd if k.endswith("norm.weight")}  # tiny() moved them off one after its own init
    assert all(torch.equal(v, ref_sd[k]) for k, v in sd.items() if k not in writers | norms)
    aux, ids = inputs()
    anchors = torch.tensor([[3, 9]])
    got = d(aux.float(), ids, anchors)
    assert torch.equal(got, d.logits(d.block_embeddings(ids.gather(1, anchors)).float()))
    d.init_weights(std=0.2, seed=3, residual_std=0.01)
    g = torch.Generator().manual_seed(3)
    draws = {n: torch.randn(m.weight.shape, generator=g) for n, m in d.named_modules()
             if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert torch.equal(d.layers[1].mlp.down_proj.weight, draws["layers.1.mlp.down_proj"] * 0.01)
    assert torch.equal(d.layers[1].mlp.up_proj.weight, draws["layers.1.mlp.up_proj"] * 0.2)


def test_block_mask_shape_and_values():
    m = block_mask(torch.tensor([[2, 5]]), 6, 3)
    assert m.shape == (1, 1, 6, 12)
    rows = m[0, 0].int().tolist()
    assert rows[0] == [1, 1, 0, 0, 0, 0] + [1, 1, 1, 0, 0, 0]
    assert rows[5] == [1, 1, 1, 1, 1, 0] + [0, 0, 0, 1, 1, 1]


def test_config_refuses_a_mask_outside_the_embedding_and_a_block_of_one():
    base = tiny().config.to_dict()
    with pytest.raises(ValueError, match="not a row of the target's embedding"):
        DFlashConfig.from_dict({**base, "mask_token_id": V})
    with pytest.raises(ValueError, match="block_size 1"):
        DFlashConfig.from_dict({**base, "block_size": 1})
    assert DFlashConfig.from_dict(base) == tiny().config
    assert tiny().config.output_layer_ids == (0, 2, 4, 6)


def test_mask_token_is_a_spare_row_or_the_last_non_special_id():
    assert choose_mask_token(151936, used_vocab_size=151669) == 151669
    assert choose_mask_token(49152, special_ids=(0, 2, 49151)) == 49150
    assert choose_mask_token(49152, special_ids=(0, 2)) == 49151


def test_exported_names_are_the_z_lab_layout():
    names = set(tiny(layers=1).trainable_state_dict())
    assert names == {
        "fc.weight", "hidden_norm.weight", "norm.weight",
        *(f"layers.0.{n}.weight" for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            "input_layernorm", "post_attention_layernorm")),
    }
