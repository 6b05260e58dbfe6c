"""DFlash training (docs/design.md §13) through the same trainer, store and checkpoints as EAGLE-3."""

from dataclasses import replace

import pytest
import torch

from eagle3cli.config.train_config import TrainError
from eagle3cli.model.layers import dflash_layer_ids, store_layers
from eagle3cli.train import dflash_loss
from eagle3cli.train.checkpoints import checkpoint_dirs
from eagle3cli.train.trainer import Trainer, train
from tests.helpers.trainer import build_store, config, peaky_target, target_dir, weights  # noqa: F401

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def both_store(tmp_path_factory, target_dir):
    """A store of EAGLE-3's and DFlash's streams together (gen-data --draft-type eagle3,dflash)."""
    from transformers import AutoConfig

    ids = store_layers(AutoConfig.from_pretrained(target_dir), ("eagle3", "dflash")).ids
    return build_store(tmp_path_factory.mktemp("both"), target_dir, layers=ids)


def dconfig(store, target_dir, out, **kw):
    base = dict(draft_type="dflash", block_size=4, draft_layers=1, num_anchors=8, lr=3e-3, epochs=3)
    return config(store, target_dir, out, **{**base, **kw})


# ---- the pieces of a step --------------------------------------------------------------------

def test_anchors_sit_where_the_next_token_is_scored_and_are_reproducible():
    scored = torch.zeros(2, 12, dtype=torch.bool)
    scored[0, 5:10] = True
    scored[1, 2:4] = True
    lengths = torch.tensor([10, 12])
    a, real = dflash_loss.sample_anchors(scored, lengths, 3, seed=7)
    assert a.shape == (2, 3)
    got0 = a[0][real[0]].tolist()
    assert len(got0) == 3 and set(got0) <= {4, 5, 6, 7, 8} and got0 == sorted(got0)
    assert a[1][real[1]].tolist() == [1, 2] and not real[1, 2]
    b, real_b = dflash_loss.sample_anchors(scored, lengths, 3, seed=7)
    assert torch.equal(a, b) and torch.equal(real, real_b)


def test_labels_are_the_targets_argmax_one_position_back_and_stop_at_the_end():
    argmax = torch.arange(100, 110)[None]  # the target's choice after position p is 100 + p
    scored = torch.ones(1, 10, dtype=torch.bool)
    scored[0, 6] = False
    lab = dflash_loss.block_labels(argmax, scored, torch.tensor([9]), torch.tensor([[2, 6]]),
                                   torch.tensor([[True, True]]), block_size=4)
    ig = dflash_loss.IGNORE
    assert lab.tolist() == [[[102, 103, 104], [106, 107, ig]]]  # pos 6 + 3 = 9 is past the length
    lab = dflash_loss.block_labels(argmax, scored, torch.tensor([9]), torch.tensor([[3]]),
                                   torch.tensor([[True]]), block_size=4)
    assert lab.tolist() == [[[103, 104, ig]]]  # position 6 is not scored
    used = dflash_loss.needed_positions(scored, torch.tensor([9]), torch.tensor([[2, 6]]),
                                        torch.tensor([[True, True]]), 4)
    assert used[0].nonzero().flatten().tolist() == [2, 3, 4, 6, 7]


def test_position_weights_decay_from_one():
    w = dflash_loss.position_weights(16, dflash_loss.default_gamma(16))
    assert w[0] == 1 and abs(float(w[7]) - float(torch.exp(torch.tensor(-1.0)))) < 1e-6
    assert dflash_loss.default_gamma(8) == 4


def test_dpace_weights_are_the_expected_accepted_lengths_gradient():
    # alpha 0: w_k = d/d(log q_k) of E[accepted] = sum_j prod_{i<=j} q_i, by autograd.
    q = torch.tensor([[0.9, 0.5, 0.2, 0.7]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, True]])
    logq = q.log().requires_grad_()
    torch.cumprod(logq.exp(), -1).sum().backward()
    w = dflash_loss.dpace_weights(-q.log(), valid, alpha=0.0)
    assert torch.allclose(w.double(), logq.grad, atol=1e-6)
    # alpha 0.5 smooths each q to (q + 1) / 2; an invalid position weighs 0 and breaks no chain.
    w = dflash_loss.dpace_weights(-q.log(), torch.tensor([[True, True, False, True]]), alpha=0.5)
    s = (q + 1) / 2
    p1, p2 = s[0, 0], s[0, 0] * s[0, 1]
    p4 = p2 * s[0, 3]
    assert torch.allclose(w.double(), torch.stack([p1 + p2 + p4, p2 + p4, 0 * p1, p4])[None], atol=1e-6)
    # alpha 1 weighs position k by the number of valid positions from k on.
    assert dflash_loss.dpace_weights(-q.log(), valid, alpha=1.0).tolist() == [[4, 3, 2, 1]]


def test_dpace_loss_weighs_its_blocks_and_takes_no_gradient_through_the_weights():
    torch.manual_seed(0)
    ce = torch.rand(3, 2, 5, requires_grad=True)
    valid = torch.rand(3, 2, 5) > 0.2
    w = dflash_loss.dpace_weights(ce, valid, 0.5)
    assert not w.requires_grad and (w[~valid] == 0).all()
    assert (w[..., :-1][valid[..., :-1] & valid[..., 1:]] >= w[..., 1:][valid[..., :-1] & valid[..., 1:]]).all()


def test_block_rows_point_each_label_at_the_distribution_one_position_back():
    slot = torch.full((1, 10), -1)
    slot[0, 2:8] = torch.arange(6) * 10  # position p's distribution is row 10 * (p - 2)
    rows = dflash_loss.block_rows(slot, torch.tensor([[2, 4]]), block_size=4)
    assert rows.tolist() == [[[0, 10, 20], [20, 30, 40]]]  # label k of the block at a reads a + k - 1


# ---- the trainer ------------------------------------------------------------------------------

def test_dflash_trains_from_a_shared_store_and_its_loss_goes_down(both_store, target_dir, tmp_path):
    t = Trainer(dconfig(both_store, target_dir, tmp_path / "run", epochs=6), quiet=True)
    t.setup()
    assert t.layer_ids == dflash_layer_ids(8) and t.columns is None  # the union is DFlash's set on 8 layers
    res = t.run(stop_after=10 ** 6)
    losses = [h["loss"] for h in res.history if "loss" in h]
    assert len(losses) >= 6 and sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2
    acc = [h["acc"] for h in res.history if "acc" in h]
    assert len(acc[-1]) == 3  # one statistic per drafted position (block of 4)


def test_dpace_position_weights_train_and_are_recorded(both_store, target_dir, tmp_path):
    cfg = dconfig(both_store, target_dir, tmp_path / "run", epochs=6, position_weights="dpace", dpace_alpha=0.25)
    t = Trainer(cfg, quiet=True)
    t.setup()
    loss = t.family.objective(t.draft)
    assert loss.dpace_alpha == 0.25
    assert t.family.record(t)["position_weights"] == "dpace" and t.family.record(t)["dpace_alpha"] == 0.25
    res = t.run(stop_after=10 ** 6)
    losses = [h["loss"] for h in res.history if "loss" in h]
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2


def test_residual_init_std_reaches_the_dflash_draft(both_store, target_dir, tmp_path):
    """--residual-init-std sets every DFlash layer's o_proj and down_proj at setup, the rest as
    the run without it draws them."""
    t0 = Trainer(dconfig(both_store, target_dir, tmp_path / "a", draft_layers=2), quiet=True)
    t1 = Trainer(dconfig(both_store, target_dir, tmp_path / "b", draft_layers=2, residual_init_std=0.0), quiet=True)
    t0.setup(), t1.setup()
    sd0, sd1 = t0.draft.state_dict(), t1.draft.state_dict()
    writers = [k for k in sd1 if k.endswith(("o_proj.weight", "down_proj.weight"))]
    assert len(writers) == 4 and all(not sd1[k].any() and sd0[k].any() for k in writers)
    assert all(torch.equal(sd0[k], v) for k, v in sd1.items() if k not in writers)


def test_soft_labels_score_the_targets_distribution_and_mix_linearly(both_store, target_dir, tmp_path):
    """--soft-labels s: each label's CE is (1 - s) against the argmax plus s against the target's
    distribution at the same position; the labels and the held-out objective stay the argmax's."""
    hard = Trainer(dconfig(both_store, target_dir, tmp_path / "h"), quiet=True)
    soft = Trainer(dconfig(both_store, target_dir, tmp_path / "s", soft_labels=1.0), quiet=True)
    hard.setup(), soft.setup()
    idx = soft.groups(0)[0][0]
    (ids, aux, anchors, labels), _ = hard._inputs(idx, noise_seed=5)
    (ids_s, aux_s, anchors_s, labels_s, probs, rows), _ = soft._inputs(idx, noise_seed=5)
    assert torch.equal(anchors, anchors_s) and torch.equal(labels, labels_s)  # one argmax, either way
    valid = labels != dflash_loss.IGNORE
    assert valid.sum() > 10 and (rows[valid] >= 0).all()
    p = probs[rows[valid]]
    assert torch.equal(p.argmax(-1), labels[valid]) and torch.allclose(p.sum(-1), torch.ones(len(p)), atol=1e-3)
    assert len(soft._inputs(idx, held_out=True)[0]) == 4  # held-out metrics score the argmax only
    assert soft.family.objective(soft.draft, held_out=True).soft == 0
    draft = soft.draft

    def loss(s, q=probs):
        return dflash_loss.DFlashLoss(draft, None, None, s)(ids, aux, anchors, labels, q, rows).loss

    with torch.no_grad():
        l0, l1, half = loss(0.0), loss(1.0), loss(0.5)
        assert torch.equal(l0, dflash_loss.DFlashLoss(draft)(ids, aux, anchors, labels).loss)
        assert abs(float(l1 - l0)) > 1e-3 and torch.allclose(half, (l0 + l1) / 2, atol=1e-5)
        one_hot = torch.zeros_like(probs)
        one_hot[rows[valid], labels[valid]] = 1.0  # a distribution that is its argmax: the hard loss again
        assert torch.allclose(loss(1.0, one_hot), l0, atol=1e-5)
    assert soft.family.record(soft)["soft_labels"] == 1.0 and "soft_labels" not in hard.family.record(hard)
    res = soft.run(stop_after=10 ** 6)
    losses = [h["loss"] for h in res.history if "loss" in h]
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2


def test_soft_labels_outside_zero_to_one_are_refused(both_store, target_dir, tmp_path):
    with pytest.raises(TrainError, match=r"--soft-labels must lie in \[0, 1\], got 1.5"):
        Trainer(dconfig(both_store, target_dir, tmp_path / "run", soft_labels=1.5), quiet=True).setup()


def test_eagle3_picks_its_own_streams_from_the_shared_store(both_store, target_dir, tmp_path):
    t = Trainer(config(both_store, target_dir, tmp_path / "e"), quiet=True)
    t.setup()
    assert t.layer_ids == (2, 4, 5) and t.columns == [0, 2, 3]


def test_a_store_without_dflash_streams_is_refused_in_one_line(tmp_path, target_dir):
    eagle_only = build_store(tmp_path / "s", target_dir, n=6)
    with pytest.raises(TrainError, match=r"missing \(3, 6\)\): run `eagle3 gen-data --draft-type dflash`"):
        train(dconfig(eagle_only, target_dir, tmp_path / "run"), quiet=True)


def test_mask_token_may_not_be_an_end_token(both_store, target_dir, tmp_path):
    with pytest.raises(TrainError, match="--mask-token-id 2 is an end or pad token"):
        train(dconfig(both_store, target_dir, tmp_path / "run", mask_token_id=2), quiet=True)


def test_dflash_resume_is_bit_identical(both_store, target_dir, tmp_path):
    kw = dict(save_every=3, val_fraction=0.0)
    full = Trainer(dconfig(both_store, target_dir, tmp_path / "full", **kw), quiet=True)
    full.setup()
    full_res = full.run(stop_after=8)
    cut = dconfig(both_store, target_dir, tmp_path / "cut", **kw)
    part = train(cut, quiet=True, stop_after=5)
    assert part.stopped and [p.name for p in checkpoint_dirs(tmp_path / "cut")] == ["step-00000003"]
    resumed = Trainer(replace(cut, resume=True), quiet=True)
    resumed.setup()
    res = resumed.run(stop_after=8)
    assert res.step == full_res.step == 8
    a, b = weights(full_res.draft), weights(res.draft)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dflash_online_equals_offline_on_identical_features(tmp_path, target_dir):
    """An fp32 store of DFlash's streams and the online capture feed the DFlash step the same numbers."""
    offline = build_store(tmp_path / "f32", target_dir, n=12, dtype=torch.float32, layers=dflash_layer_ids(8))
    tokens = build_store(tmp_path / "tok", target_dir, n=12, features=False, layers=dflash_layer_ids(8))
    kw = dict(epochs=1, val_fraction=0.0)
    a = train(dconfig(offline, target_dir, tmp_path / "a", **kw), quiet=True)
    b = train(dconfig(tokens, target_dir, tmp_path / "b", online=True, **kw), quiet=True)
    assert a.step == b.step >= 2
    # A padded batch's forward differs from one sample's in the last bits, and Adam's first steps turn
    # such noise in near-zero gradients into updates of ~1e-4; other streams or labels move weights ~1e-2.
    for k, v in weights(a.draft).items():
        torch.testing.assert_close(v, weights(b.draft)[k], atol=5e-4, rtol=1e-3)


# ---- the fused head and loss -------------------------------------------------------------------

def plain_head_ce(head, h, labels):
    return dflash_loss.plain_head_cross_entropy(head, h, labels)[1:]


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_head_cross_entropy_equals_the_plain_head_and_loss(autocast):
    """Per-row CE, argmax and the gradient reaching h under any row weighting, across chunk edges
    (23 rows in chunks of 7), in fp32 and under CPU bf16 autocast."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False).requires_grad_(False)
    head.weight.copy_(torch.randn(300, 16, generator=g))
    h0 = torch.randn(23, 16, generator=g)
    labels = torch.randint(0, 300, (23,), generator=g)
    w = torch.rand(23, generator=g)
    out = {}
    for name in ("plain", "fused"):
        h = h0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if name == "plain":
                ce, pred = plain_head_ce(head, h, labels)
            else:
                ce, pred = dflash_loss.HeadCrossEntropy.apply(h, head.weight, labels, True, 7)
            (w * ce).sum().backward()
        out[name] = (ce.detach(), pred, h.grad)
    (ce_p, pred_p, g_p), (ce_f, pred_f, g_f) = out["plain"], out["fused"]
    tol = 1e-2 if autocast else 1e-5
    assert torch.allclose(ce_f, ce_p, rtol=tol, atol=tol) and torch.equal(pred_f, pred_p)
    assert torch.allclose(g_f, g_p, rtol=tol, atol=tol * g_p.abs().max().item())
    assert g_p.abs().max() > 0.1  # the gradient is not vanishing, so the comparison means something
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # held-out scoring
        ce_n, pred_n = dflash_loss.head_cross_entropy(head, h0, labels)
    assert torch.equal(pred_n, pred_p) and not ce_n.requires_grad


@pytest.mark.parametrize("weights", ["decay", "dpace"])
def test_dflash_loss_through_the_fused_head_equals_the_plain_one(both_store, target_dir, tmp_path, weights,
                                                                 monkeypatch):
    """The step's loss, statistics and every draft weight's gradient, fused head or not."""
    t = Trainer(dconfig(both_store, target_dir, tmp_path / weights, position_weights=weights), quiet=True)
    t.setup()
    (ids, aux, anchors, labels), _ = t._inputs(t.groups(0)[0][0], noise_seed=5)
    alpha = 0.5 if weights == "dpace" else None
    res = {}
    for name in ("fused", "plain"):
        if name == "plain":
            monkeypatch.setattr(dflash_loss, "head_cross_entropy", plain_head_ce)
        t.draft.zero_grad(set_to_none=True)
        out = dflash_loss.DFlashLoss(t.draft, None, alpha)(ids, aux, anchors, labels)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in t.draft.named_parameters() if p.grad is not None}
        res[name] = (out, grads)
    (f, gf), (p, gp) = res["fused"], res["plain"]
    assert torch.allclose(f.loss, p.loss, rtol=1e-5) and torch.equal(f.correct, p.correct)
    assert torch.equal(f.counted, p.counted) and torch.allclose(f.step_loss, p.step_loss, rtol=1e-5)
    assert set(gf) == set(gp) and "fc.weight" in gf and "lm_head.weight" not in gf
    for n in gp:
        # fp32 sums over a step's rows in another order: about 3e-5 of the largest entry
        assert torch.allclose(gf[n], gp[n], rtol=1e-3, atol=2e-4 * gp[n].abs().max().item()), n


def test_head_chunks_hold_about_100_mb_of_logits():
    assert dflash_loss.head_chunk(49152) == 512  # SmolLM2: 96 MB
    assert dflash_loss.head_chunk(151936) == 128  # Qwen2.5: 74 MB
    assert dflash_loss.head_chunk(300) == 1024 and dflash_loss.head_chunk(10 ** 7) == 64
