"""Training-time test: the fast unroll against a naive full-mask reference and the inference path."""

import torch
import torch.nn.functional as F

from eagle3cli.model.draft import Eagle3Draft, KVCache
from eagle3cli.train.ttt import (
    TTTModel,
    acceptance_length,
    repeat_kv,
    shift_left,
    soft_cross_entropy,
    teacher_from_final,
    teacher_rows,
    ttt_attention,
    ttt_streams,
)
from tests.helpers.tiny import tiny_model
from tests.helpers.ttt import make_draft


def naive_attention(q, keys, values):
    """Reference: every step's keys laid out as one long sequence with an explicit bool mask.

    Query (s, t) may see step-0 keys at t' <= t and the key at (s', t) for 1 <= s' <= s. Keys and
    values come at the KV head count (grouped-query) and are repeated to the query heads first.
    """
    t, h = q.shape[-2], q.shape[1]
    keys, values = [repeat_kv(k, h) for k in keys], [repeat_kv(v, h) for v in values]
    blocks = [torch.ones(t, t, dtype=torch.bool).tril()] + [torch.eye(t, dtype=torch.bool)] * (len(keys) - 1)
    mask = torch.cat(blocks, dim=1)
    return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)


def test_ttt_attention_matches_full_mask_reference_values_and_grads():
    torch.manual_seed(0)
    b, h, t, d = 2, 4, 9, 16
    for s, kv in [(s, kv) for s in range(0, 5) for kv in (4, 2, 1)]:  # kv < h: grouped-query keys
        leaves = [torch.randn(b, h if i == 0 else kv, t, d, requires_grad=True) for i in range(1 + 2 * (s + 1))]
        q, keys, values = leaves[0], leaves[1:s + 2], leaves[s + 2:]
        fast = ttt_attention(q, keys, values)
        ref = naive_attention(q, keys, values)
        torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-5)
        w = torch.randn_like(ref)
        g_fast = torch.autograd.grad((fast * w).sum(), leaves)
        g_ref = torch.autograd.grad((ref * w).sum(), leaves)
        for a, r in zip(g_fast, g_ref):
            torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_ttt_attention_in_query_blocks_matches_the_reference():
    """Row blocks of every size (1 row, uneven, all rows), checkpointed under autograd, give the
    whole-matrix values and gradients: the blocking only bounds memory."""
    torch.manual_seed(1)
    b, h, t, d, s = 2, 6, 11, 8, 3
    leaves = [torch.randn(b, h if i == 0 else 3, t, d, requires_grad=True) for i in range(1 + 2 * (s + 1))]
    q, keys, values = leaves[0], leaves[1:s + 2], leaves[s + 2:]
    ref = naive_attention(q, keys, values)
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    for rows in (1, 4, 5, t):
        out = ttt_attention(q, keys, values, max_elements=rows * b * h * t)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
        for a, r in zip(torch.autograd.grad((out * w).sum(), leaves), g_ref):
            torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # evaluation: blocks without checkpoints, same values
        torch.testing.assert_close(ttt_attention(q, keys, values, max_elements=4 * b * h * t), ref.detach(),
                                   atol=1e-6, rtol=1e-5)


def random_batch(vocab=256, draft_vocab_ids=None, b=2, t=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * 64, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[-1, 8:] = False  # a padded tail
    probs = torch.softmax(torch.randn(b, t, draft_vocab_ids.numel(), generator=g) * 3, -1)
    index = torch.randint(-1, draft_vocab_ids.numel(), (b, t), generator=g)
    return ids, aux, mask, probs, index


def test_unroll_matches_naive_reference_loss_and_grads():
    draft = make_draft()
    batch = random_batch(draft_vocab_ids=draft.d2t)
    fast = TTTModel(draft, steps=5, decay=0.8)
    ref = TTTModel(draft, steps=5, decay=0.8, attention=naive_attention)
    loss_f, sl_f, c_f, n_f = fast(*batch)
    params = [p for p in draft.parameters() if p.requires_grad]
    g_f = torch.autograd.grad(loss_f, params)
    loss_r, sl_r, c_r, n_r = ref(*batch)
    g_r = torch.autograd.grad(loss_r, params)
    torch.testing.assert_close(loss_f, loss_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sl_f, sl_r, atol=1e-5, rtol=1e-5)
    assert torch.equal(c_f, c_r) and torch.equal(n_f, n_r)
    for a, r in zip(g_f, g_r):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)
    # The weighted sum is what it claims to be.
    torch.testing.assert_close(loss_f, sum(0.8 ** s * sl_f[s] for s in range(5)))
    # Counted positions: mask shifted by 2 + s.
    mask = batch[2]
    assert n_f.tolist() == [int(mask[:, 2 + s:].sum()) for s in range(5)]


def test_unroll_is_what_the_draft_sees_at_inference():
    """Step s at position t == drafting s tokens past a verified prefix 0..t with a KV cache."""
    draft = make_draft()
    ids, aux, *_ = random_batch(draft_vocab_ids=draft.d2t, b=1, t=10)
    with torch.no_grad():
        streams = list(ttt_streams(draft, ids, aux, steps=4))
        for t in (0, 3, 5):
            cache = KVCache()
            g = draft.fuse(aux[:, :t + 1])
            a = draft.step(ids[:, 1:t + 2], g, torch.arange(t + 1)[None], cache)[:, -1:]
            torch.testing.assert_close(a[0, 0], streams[0][0, t], atol=1e-5, rtol=1e-5)
            for s in range(1, 4):
                a = draft.step(ids[:, t + 1 + s:t + 2 + s], a, torch.tensor([[t + s]]), cache)
                torch.testing.assert_close(a[0, 0], streams[s][0, t], atol=1e-5, rtol=1e-5)


def test_teacher_chunks_restrict_and_mark_misses():
    target = tiny_model("llama")
    vocab_ids = torch.arange(0, 256, 3)
    final = torch.randn(2, 7, 64)
    small = teacher_from_final(target, final, vocab_ids, max_elements=256 * 3)  # 3 tokens per chunk
    full = target.lm_head(final).float()
    torch.testing.assert_close(small.probs.view(2, 7, -1), torch.softmax(full[..., vocab_ids], -1))
    assert small.slot.flatten().tolist() == list(range(14))
    arg = full.argmax(-1)
    expect = torch.where(arg % 3 == 0, arg // 3, torch.full_like(arg, -1))
    assert torch.equal(small.index, expect)
    # Only the used positions: their rows in order, slot -1 (and index -1) elsewhere.
    used = torch.rand(2, 7, generator=torch.Generator().manual_seed(0)) > 0.5
    part = teacher_from_final(target, final, vocab_ids, used, max_elements=256 * 2)
    assert part.probs.shape == (int(used.sum()), vocab_ids.numel())
    assert torch.equal(part.slot[used], torch.arange(int(used.sum()))) and bool((part.slot[~used] == -1).all())
    torch.testing.assert_close(part.probs, small.probs.view(2, 7, -1)[used])
    assert torch.equal(part.index[used], expect[used]) and bool((part.index[~used] == -1).all())


def test_teacher_over_the_draft_vocab_only_has_the_same_probabilities_and_its_own_argmax():
    """full_argmax=False (the trainer's training steps): the draft vocabulary's head rows alone give
    the same probabilities; the argmax is taken among them, so a choice outside is not a miss."""
    target = tiny_model("llama")
    vocab_ids = torch.arange(0, 256, 3)
    final = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1))
    used = torch.rand(2, 7, generator=torch.Generator().manual_seed(0)) > 0.4
    full = teacher_from_final(target, final, vocab_ids, used)
    sub = teacher_from_final(target, final, vocab_ids, used, max_elements=86 * 2, full_argmax=False)
    torch.testing.assert_close(sub.probs, full.probs)
    assert torch.equal(sub.slot, full.slot)
    inside = target.lm_head(final).float()[..., vocab_ids].argmax(-1)
    assert torch.equal(sub.index[used], inside[used]) and bool((sub.index[~used] == -1).all())
    hit = full.index[used] >= 0  # where the target's own choice is in the draft vocab, the two agree
    assert bool(hit.any()) and bool((~hit).any())
    assert torch.equal(sub.index[used][hit], full.index[used][hit])


def test_unroll_on_the_used_teacher_rows_equals_the_full_teacher():
    """The trainer computes the teacher only where the loss reads it (teacher_rows): the same loss,
    statistics and gradients as a teacher of every position; a missing row is an error."""
    target = tiny_model("llama")
    draft = make_draft()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    aux = torch.randn(2, 12, 3 * 64, generator=g)
    mask = torch.rand(2, 12, generator=g) > 0.4
    final = torch.randn(2, 12, 64, generator=g)
    full = teacher_from_final(target, final, draft.d2t)
    part = teacher_from_final(target, final, draft.d2t, teacher_rows(mask))
    assert part.probs.shape[0] == int(mask[:, 1:].sum()) < full.probs.shape[0]
    model = TTTModel(draft, steps=4)
    params = [p for p in draft.parameters() if p.requires_grad]
    out_full = model(ids, aux, mask, full.probs.view(2, 12, -1), full.index)
    out_part = model(ids, aux, mask, part.probs, part.index, part.slot)
    torch.testing.assert_close(out_part.loss, out_full.loss)
    assert torch.equal(out_part.correct, out_full.correct) and torch.equal(out_part.counted, out_full.counted)
    for a, b in zip(torch.autograd.grad(out_part.loss, params), torch.autograd.grad(out_full.loss, params)):
        torch.testing.assert_close(a, b)
    fewer = teacher_from_final(target, final, draft.d2t, teacher_rows(mask) & (torch.arange(12) < 6))
    import pytest
    with pytest.raises(ValueError, match="teacher was not computed"):
        model(ids, aux, mask, fewer.probs, fewer.index, fewer.slot)


def test_shift_left_and_acceptance_length():
    x = torch.arange(6).view(1, 6)
    assert shift_left(x, 2).tolist() == [[2, 3, 4, 5, 0, 0]]
    assert shift_left(x, 9).tolist() == [[0] * 6]
    assert acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert abs(acceptance_length([0.5, 0.5]) - 1.75) < 1e-12


def test_fused_soft_cross_entropy_matches_autograd():
    torch.manual_seed(0)
    z = (torch.randn(13, 50) * 4).requires_grad_()
    p = torch.softmax(torch.randn(13, 50) * 2, -1)
    w = torch.rand(13)
    fused = soft_cross_entropy(z, p)
    ref = -(p * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(fused, ref)
    g1, = torch.autograd.grad((fused * w).sum(), z)
    g2, = torch.autograd.grad((ref * w).sum(), z)
    torch.testing.assert_close(g1, g2)
    q = torch.softmax(torch.randn(3, 6, dtype=torch.float64), -1)
    assert torch.autograd.gradcheck(lambda x: soft_cross_entropy(x, q),
                                    (torch.randn(3, 6, dtype=torch.float64, requires_grad=True),))


def test_fused_head_loss_matches_logits_then_loss():
    """head_soft_cross_entropy == soft CE of F.linear(h, W) against probs[rows, cols]: the loss,
    the argmax and the gradients w.r.t. h and W, with chunks smaller than the rows."""
    import torch.nn.functional as F

    from eagle3cli.train.ttt import head_soft_cross_entropy

    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    probs = torch.softmax(torch.randn(2, 30, 50, generator=g) * 2, -1)
    rows, cols = torch.randint(0, 2, (37,), generator=g), torch.randint(0, 30, (37,), generator=g)
    ref_logits = F.linear(h, w)
    ref = soft_cross_entropy(ref_logits, probs[rows, cols]).sum()
    ref_gh, ref_gw = torch.autograd.grad(3.0 * ref, (h, w))
    flat, prow = probs.view(-1, 50), rows * 30 + cols  # the teacher's rows, as the unroll passes them
    loss, row_loss, pred = head_soft_cross_entropy(h, w, flat, prow, max_elements=50 * 8)
    gh, gw = torch.autograd.grad(3.0 * loss, (h, w))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(row_loss, soft_cross_entropy(ref_logits, probs[rows, cols]).detach())
    assert torch.equal(pred, ref_logits.argmax(-1))
    torch.testing.assert_close(gh, ref_gh)
    torch.testing.assert_close(gw, ref_gw)
    with torch.no_grad():  # evaluation: no gradients computed, same loss
        torch.testing.assert_close(head_soft_cross_entropy(h, w, flat, prow)[0], ref.detach())
    # Row weights (the unroll's decay^s / n_s): the loss and both gradients are weighted per row.
    rw = torch.rand(37, generator=g)
    ref_w = (soft_cross_entropy(F.linear(h, w), probs[rows, cols]) * rw).sum()
    ref_gh, ref_gw = torch.autograd.grad(ref_w, (h, w))
    loss_w = head_soft_cross_entropy(h, w, flat, prow, rw, max_elements=50 * 8).loss
    gh, gw = torch.autograd.grad(loss_w, (h, w))
    torch.testing.assert_close(loss_w, ref_w)
    torch.testing.assert_close(gh, ref_gh)
    torch.testing.assert_close(gw, ref_gw)


def reference_unroll(draft, ids, aux, mask, probs, index, steps, decay):
    """The TTT loss by its definition: per step, the draft's logits (Eagle3Draft.logits) of the
    counted positions, soft cross-entropy against the teacher one position on, decayed sum."""
    total, step_loss, correct = 0.0, [], []
    for s, a in enumerate(ttt_streams(draft, ids, aux, steps, recompute=False)):
        rows, cols = shift_left(mask, 2 + s, fill=False).nonzero(as_tuple=True)
        logits = draft.logits(a[rows, cols]).float()
        loss_s = soft_cross_entropy(logits, probs[rows, cols + 1 + s]).mean()
        total = total + decay ** s * loss_s
        step_loss.append(loss_s.detach())
        correct.append(int((logits.argmax(-1) == index[rows, cols + 1 + s]).sum()))
    return total, torch.stack(step_loss), correct


def test_unroll_loss_and_grads_equal_the_per_step_definition():
    """One fused head + loss call over the rows of all steps (one [V, H] gradient kept, not one
    per step) == the per-step logits and losses, for EAGLE-3 and for EAGLE-3.1, whose output
    stream is already normed (lm_head must not norm it again)."""
    from dataclasses import replace

    for variant in ({}, {"fc_norm": True, "norm_output": True}):
        draft = make_draft()
        if variant:
            twin = Eagle3Draft(replace(draft.config, **variant))
            twin.load_state_dict(draft.state_dict(), strict=False)
            with torch.no_grad():  # norms away from ones, so a second norm would show
                for name, p in twin.named_parameters():
                    if "norm" in name:
                        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.3)
            draft = twin
        batch = random_batch(draft_vocab_ids=draft.d2t)
        params = [p for p in draft.parameters() if p.requires_grad]
        out = TTTModel(draft, steps=5, decay=0.8)(*batch)
        got = torch.autograd.grad(out.loss, params)
        ref_loss, ref_steps, ref_correct = reference_unroll(draft, *batch, steps=5, decay=0.8)
        want = torch.autograd.grad(ref_loss, params)
        torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.step_loss, ref_steps, atol=1e-5, rtol=1e-5)
        assert out.correct.tolist() == ref_correct
        for a, r in zip(got, want):
            torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-4)


def test_recomputed_steps_give_the_same_loss_and_grads():
    """Checkpointing each TTT step (the default, for memory) changes no value."""
    draft = make_draft()
    batch = random_batch(draft_vocab_ids=draft.d2t)
    params = [p for p in draft.parameters() if p.requires_grad]
    outs, grads = [], []
    for recompute in (True, False):
        out = TTTModel(draft, steps=5, decay=0.8, recompute=recompute)(*batch)
        outs.append(out)
        grads.append(torch.autograd.grad(out.loss, params))
    torch.testing.assert_close(outs[0].loss, outs[1].loss, atol=0, rtol=0)
    assert torch.equal(outs[0].correct, outs[1].correct) and torch.equal(outs[0].counted, outs[1].counted)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_acceptance_loss_gradients_match_autograd_of_its_definition():
    """--accept-loss w: the fused head's gradients are those of (1 - w) softCE + w (-log alpha),
    alpha = sum_v min(p_v, softmax(z)_v), by autograd of that formula; the returned loss stays the
    soft cross-entropy (comparable across runs)."""
    import torch.nn.functional as F

    from eagle3cli.train.ttt import head_soft_cross_entropy

    g = torch.Generator().manual_seed(5)
    h = torch.randn(23, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    probs = torch.softmax(torch.randn(23, 40, generator=g) * 2, -1)
    prow, rw = torch.arange(23), torch.rand(23, generator=g)
    for weight in (0.0, 0.5, 1.0):
        z = F.linear(h, w)
        alpha = torch.minimum(torch.softmax(z, -1), probs).sum(-1)
        ce = soft_cross_entropy(z, probs)
        ref = ((1 - weight) * ce - weight * alpha.log()) @ rw
        ref_gh, ref_gw = torch.autograd.grad(ref, (h, w))
        out = head_soft_cross_entropy(h, w, probs, prow, rw, max_elements=40 * 5, accept_weight=weight)
        gh, gw = torch.autograd.grad(out.loss, (h, w))
        torch.testing.assert_close(out.loss, (ce @ rw).detach())
        torch.testing.assert_close(gh, ref_gh, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(gw, ref_gw, atol=1e-5, rtol=1e-4)
    # The pure acceptance loss moves the draft towards higher acceptance: a few steps raise alpha.
    z = torch.zeros(23, 40, requires_grad=True)
    eye = torch.eye(40)
    before = torch.minimum(torch.softmax(z, -1), probs).sum(-1).mean()
    opt = torch.optim.SGD([z], lr=5.0)
    for _ in range(20):
        opt.zero_grad()
        head_soft_cross_entropy(z, eye, probs, prow, accept_weight=1.0).loss.backward()
        opt.step()
    after = torch.minimum(torch.softmax(z, -1), probs).sum(-1).mean()
    assert after > before + 0.1


def test_curriculum_unrolls_fewer_steps_with_full_size_statistics():
    """TTTModel.active = 1 (the --ttt-warmup curriculum) trains exactly as a one-step model (same
    loss and gradients) while its statistics keep every step's slot, the later ones empty."""
    draft = make_draft()
    batch = random_batch(draft_vocab_ids=draft.d2t)
    params = [p for p in draft.parameters() if p.requires_grad]
    full = TTTModel(draft, steps=4, decay=0.8)
    full.active = 1
    out = full(*batch)
    one = TTTModel(draft, steps=1, decay=0.8)(*batch)
    torch.testing.assert_close(out.loss, one.loss, atol=0, rtol=0)
    for a, b in zip(torch.autograd.grad(out.loss, params), torch.autograd.grad(one.loss, params)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert out.counted.shape == (4,) and out.counted[0] == one.counted[0] and out.counted[1:].sum() == 0
    assert out.correct[0] == one.correct[0] and out.correct[1:].sum() == 0
    full.active = None
    assert (full(*batch).counted[1:] > 0).all()


def test_feature_noise_is_relative_to_each_stream():
    """with_noise: scale x each stream's RMS per position (a quiet stream gets quiet noise); 0 adds none."""
    from eagle3cli.train.noise import with_noise

    torch.manual_seed(0)
    aux = torch.cat([torch.randn(2, 500, 8) * 0.01, torch.randn(2, 500, 8) * 100.0], dim=-1)
    noisy = with_noise(aux, 0.5, streams=2)
    noise = (noisy - aux).unflatten(-1, (2, 8))
    ratio = noise.pow(2).mean((0, 1, 3)).sqrt() / aux.unflatten(-1, (2, 8)).pow(2).mean((0, 1, 3)).sqrt()
    torch.testing.assert_close(ratio, torch.tensor([0.5, 0.5]), atol=0.03, rtol=0)
    assert torch.equal(with_noise(aux, 0.0, streams=2), aux)


def test_later_steps_skip_the_positions_no_loss_reads_with_the_same_loss_and_gradients():
    """Answers after prompts: steps 1.. are computed from the first position a loss reads there
    (unread_prefix), with the values and gradients of the whole unroll, recomputed or not."""
    from eagle3cli.train.ttt import unread_prefix

    draft = make_draft()
    ids, aux, mask, probs, index = random_batch(draft_vocab_ids=draft.d2t, b=4, t=48)
    mask[:, :25] = False  # prompts
    mask[1, :30] = False
    assert unread_prefix(mask, 3) == 25 - 2 - 2 and unread_prefix(mask, 1) == 0
    assert unread_prefix(mask, 3, padded=True) == 16  # 4 x 32 positions: a grid of gemm_padding's
    params = [p for p in draft.parameters() if p.requires_grad]
    for recompute in (False, True):
        whole = TTTModel(draft, steps=3, recompute=recompute, attention=lambda q, k, v: ttt_attention(q, k, v))
        windowed = TTTModel(draft, steps=3, recompute=recompute)
        ref, out = whole(ids, aux, mask, probs, index), windowed(ids, aux, mask, probs, index)
        torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out.step_loss, ref.step_loss, atol=1e-6, rtol=1e-6)
        assert torch.equal(out.correct, ref.correct) and torch.equal(out.counted, ref.counted)
        for a, r in zip(torch.autograd.grad(out.loss, params), torch.autograd.grad(ref.loss, params)):
            torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5)
