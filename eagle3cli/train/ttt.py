"""Training-time test (docs/design.md §6): the draft is trained on its own outputs.

One training sequence of length T is unrolled for S steps. With x the tokens, g = fuse(aux),
and a^s the draft's output stream at step s::

    step 0, position t:  token x[t+1],    feature g[t],        position id t
    step s, position t:  token x[t+1+s],  feature a^{s-1}[t],  position id t+s
    prediction:          the target's distribution at position t+1+s (it predicts x[t+2+s])

Tokens stay teacher-forced; only the feature input is self-fed, exactly what the draft sees
when it drafts s tokens past a verified prefix at inference. The query at (s, t) attends to
the step-0 keys at positions <= t (the verified prefix) plus the keys at its own position t
from steps 1..s (its own drafted tokens). That second part is one key per step per position,
so it is computed as per-position dot products appended to the causal scores before a single
softmax: one T x T score matrix per step, never a (sT) x (sT) mask.

The teacher is the target's softmax restricted to the draft vocabulary, recomputed from the
stored final hidden state with the target's frozen LM head, chunk by chunk, at the positions
the loss reads (teacher_rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model.target import finish_logits, output_head
from .gemm_padding import LENGTH_MULTIPLE, TOKEN_MULTIPLE, cpu_bf16_autocast, pad_unroll_inputs, round_up

# q [B,h,T,d], keys/values: list of [B,kv,T,d] (kv divides h: grouped-query heads, not yet
# repeated); [0] = step-0 (causal), [1:] = diagonal steps.
Attention = Callable[[torch.Tensor, list, list], torch.Tensor]


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B,kv,T,d] -> [B,heads,T,d]: query head i reads kv head i // (heads // kv)."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at position t (dim 1), padded with ``fill`` past the end."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


# Scores of one query block of ttt_attention: [B, h, rows, keys] elements at most (32 MB in fp32).
ATTENTION_BLOCK_ELEMENTS = 1 << 23


def ttt_attention(q: torch.Tensor, keys: list, values: list,
                  max_elements: int = ATTENTION_BLOCK_ELEMENTS, offset: int = 0) -> torch.Tensor:
    """Causal attention over the step-0 keys plus the diagonal keys of steps 1..s.

    ``offset``: q and the diagonal keys/values hold positions offset.. only (a step past the
    first computed where a loss reads it, ttt_streams), the step-0 keys every position.

    Computed one block of query rows at a time, each block checkpointed when gradients are on:
    the [B,h,T,T] scores (and the softmax and gradients over them, three or four such tensors)
    never exist at once. For an 8,192-token micro-batch of 1,024-token rows and 14 heads one
    such tensor is 470 MB, so the whole-matrix form took about 2 GB at the step's peak. A block
    of rows [i, j) needs only the keys before j (the rest are masked), and recomputing its
    scores in the backward costs a small share of the layer's matmuls.

    Keys and values arrive at their own (KV) head count and are repeated to the query heads only
    inside a block: the unroll keeps every step's keys to the end of the backward, and repeated
    they cost heads / kv times as much (Qwen2.5-0.5B: 14 / 2, about 350 MB of an 8,192-token
    micro-batch's seven steps). The repeat is a copy, so the values are those of repeating first.
    """
    if len(keys) == 1:
        h = q.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(keys[0], h), repeat_kv(values[0], h), is_causal=True)
    b, h, t, _ = q.shape
    rows = max(1, max_elements // max(1, b * h * (t + offset)))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, *keys, *values))
    out = []
    for i in range(0, t, rows):
        blk = slice(i, i + rows)
        args = (offset + i, q[..., blk, :], keys[0], values[0], [k[..., blk, :] for k in keys[1:]],
                [v[..., blk, :] for v in values[1:]])
        if grad and t > rows:
            out.append(checkpoint(_attention_rows, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            out.append(_attention_rows(*args))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-2)


def _attention_rows(start: int, q, k0, v0, diag_k: list, diag_v: list) -> torch.Tensor:
    """ttt_attention for the query rows start..start+n-1 (q [B,h,n,d]; diag_k/diag_v sliced to them)."""
    scale = q.shape[-1] ** -0.5
    h, n = q.shape[1], q.shape[-2]
    end = start + n  # keys at or past ``end`` lie in every row's future
    k0, v0 = repeat_kv(k0[..., :end, :], h), repeat_kv(v0[..., :end, :], h)
    diag_k, diag_v = [repeat_kv(k, h) for k in diag_k], [repeat_kv(v, h) for v in diag_v]
    causal = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B,h,n,end]
    future = torch.ones(n, end, dtype=torch.bool, device=q.device).triu(start + 1)
    causal.masked_fill_(future, float("-inf"))  # in place: one such tensor fewer at a time
    # Per-position dot products with the same position's key at each later step: [B,h,n,s].
    diag = torch.stack([(q * k).sum(-1) for k in diag_k], dim=-1) * scale
    probs = torch.softmax(torch.cat([causal, diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :end], v0)
    return out + (probs[..., end:].unsqueeze(-1) * torch.stack(diag_v, dim=-2)).sum(-2)


def ttt_streams(draft, input_ids: torch.Tensor, aux: torch.Tensor, steps: int,
                attention: Attention = ttt_attention, recompute: bool = True,
                window: int = 0) -> Iterator[torch.Tensor]:
    """Yield the draft's output stream a^s [B,T,H] for s = 0..steps-1.

    ``window`` > 0: steps 1.. are computed at positions window.. only (a^s is [B,T-window,H]
    there), the positions before it read by no loss at those steps (TTTModel): a position of a
    later step reads only its own earlier steps and the step-0 keys, so dropping positions
    nothing reads changes no value. ``attention`` then takes ``offset`` (ttt_attention does).

    With ``recompute`` (and gradients on), each step's layer is checkpointed: the backward keeps
    only its inputs and outputs (the token ids, the streams, this step's keys and values) and
    recomputes the [tokens x intermediate] MLP activations, norms and projections of one step at
    a time, instead of holding them for all S steps at once (same values: the recomputation is
    exact). Without it (``--no-recompute``) they are kept: less compute, several GB for a large
    target (memory.use_recompute decides by their size). The attention's score blocks are
    recomputed either way (ttt_attention).
    """
    layer = draft.midlayer
    attn = layer.self_attn
    b, t = input_ids.shape
    hidden = draft.fuse(aux)
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    keys, values = [], []

    def one_step(s: int, tokens, hidden, *past):
        # The frozen embedding is looked up in here: a checkpointed step then keeps the token ids,
        # not a [B,T,H] copy of their embeddings per step.
        lo = window if s else 0
        emb = draft.embed_tokens(tokens).to(hidden.dtype)
        x = layer.attn_input(emb, hidden)
        cos, sin = draft.rotary(positions[:, lo:] + s, x.dtype)
        q, k, v = attn.qkv(x, cos, sin)  # k, v at the KV head count: repeated inside the attention
        n = len(past) // 2
        extra = {"offset": lo} if lo else {}
        out = attention(q, [*past[:n], k], [*past[n:], v], **extra)
        return draft.output(layer.finish(attn.out(out), hidden)), k, v  # norm(a) with norm_output

    for s in range(steps):
        tokens = shift_left(input_ids, 1 + s)[:, window if s else 0:]
        if s == 1 and window:
            hidden = hidden[:, window:]
        if recompute and torch.is_grad_enabled():
            a, k, v = checkpoint(one_step, s, tokens, hidden, *keys, *values, use_reentrant=False,
                                 preserve_rng_state=False)
        else:
            a, k, v = one_step(s, tokens, hidden, *keys, *values)
        keys.append(k)
        values.append(v)
        yield a
        hidden = a  # the next step is fed the draft's own output, not the target's


@dataclass
class Teacher:
    probs: torch.Tensor  # [N,Vd] float32: target softmax over the draft vocab at the N used positions
    slot: torch.Tensor   # [B,T] int64: the row of ``probs`` holding each position, -1 where not computed
    index: torch.Tensor  # [B,T] int64: draft id of the target's argmax, -1 if outside the vocab (or unused)


def teacher_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """The positions whose teacher the TTT loss reads: p such that token p+1 is loss-masked.

    Step s at position t is scored against the teacher at t+1+s when token t+2+s is masked
    (TTTModel.forward), so over all steps the teacher is read exactly where mask[p+1] holds.
    """
    return shift_left(loss_mask, 1, fill=False)


@torch.no_grad()
def teacher_from_final(target, final: torch.Tensor, vocab_ids: torch.Tensor, used: torch.Tensor | None = None,
                       max_elements: int = 1 << 26, full_argmax: bool = True) -> Teacher:
    """Teacher distributions from the target's final hidden states [B,T,Ht], at the ``used`` [B,T]
    positions only (all when None; the trainer passes ``teacher_rows(loss_mask)``).

    Computing only the read rows matters on a large vocab: the [tokens x draft vocab] fp32 result
    is the largest tensor of a training step (1 GB for 8,192 tokens and 32,000 draft tokens), and
    the prompt tokens of a chat (often half of them) are never scored. Full-vocab logits exist for
    only ``max_elements // vocab`` tokens at a time; the argmax is taken over the full vocab so a
    target choice outside the draft vocab is a miss. The logits are computed in
    ``target.compute_dtype`` when it is set (a head kept in its narrower stored dtype,
    ``setup.TargetHead``; it is widened once per call), else in the head's own dtype.

    ``full_argmax=False`` computes only the draft vocabulary's logits (all the probabilities need:
    on SmolLM2 8,192 of 49,152 head rows, a sixth of the teacher's cost, which was a fifth of a CPU
    training step) and takes the argmax among them, so a target choice outside the draft vocab is
    not seen as a miss: the trainer's live accuracy uses it, the held-out metrics do not.
    """
    b, t, _ = final.shape
    used = torch.ones(b, t, dtype=torch.bool, device=final.device) if used is None else used.to(final.device)
    where = used.reshape(-1).nonzero(as_tuple=True)[0]
    slot = torch.full((b * t,), -1, dtype=torch.long, device=final.device)
    slot[where] = torch.arange(where.numel(), device=final.device)
    flat = final.reshape(b * t, -1)
    head = output_head(target)
    dtype = getattr(target, "compute_dtype", None) or head.weight.dtype
    weight, bias = head.weight, getattr(head, "bias", None)
    vocab_ids = vocab_ids.to(final.device)
    to_draft = None  # full vocabulary id -> draft id (-1 outside), when the logits span the full vocabulary
    if full_argmax:
        to_draft = torch.full((weight.shape[0],), -1, dtype=torch.long, device=final.device)
        to_draft[vocab_ids] = torch.arange(vocab_ids.numel(), device=final.device)
    else:  # the draft vocab's rows only (gathered before widening: a sixth of the copy on SmolLM2)
        weight, bias = weight[vocab_ids], (bias[vocab_ids] if bias is not None else None)
    weight, bias = weight.to(dtype), (bias.to(dtype) if bias is not None else None)
    vocab = weight.shape[0]
    chunk = max(1, max_elements // vocab)
    # Filled in place: a list of chunks and its concatenation would hold the [rows x draft
    # vocab] result twice at once.
    probs = torch.empty(where.numel(), vocab_ids.numel(), dtype=torch.float32, device=final.device)
    index = torch.full((b * t,), -1, dtype=torch.long, device=final.device)
    for i in range(0, where.numel(), chunk):
        pos = where[i:i + chunk]
        logits = finish_logits(target, F.linear(flat[pos].to(dtype), weight, bias).float())
        index[pos] = to_draft[logits.argmax(-1)] if to_draft is not None else logits.argmax(-1)
        probs[i:i + chunk] = torch.softmax(logits[:, vocab_ids] if to_draft is not None else logits, dim=-1)
    return Teacher(probs, slot.view(b, t), index.view(b, t))


class SoftCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy against a soft target p (rows of p sum to 1), fused.

    loss = logsumexp(z) - <p, z>;  d loss / dz = softmax(z) - p. Autograd's log_softmax * p
    keeps two more [rows x vocab] tensors alive and makes more passes over them; over the draft
    vocab this is the biggest cost after the LM head's matmuls.
    """

    @staticmethod
    def forward(ctx, logits, p):
        lse = torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(logits, p, lse)
        return lse - torch.linalg.vecdot(p, logits)

    @staticmethod
    def backward(ctx, grad):
        logits, p, lse = ctx.saved_tensors
        out = torch.exp(logits - lse[:, None])
        out.sub_(p).mul_(grad[:, None])
        return out, None


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return SoftCrossEntropy.apply(logits, p)


def logits_buffer(h: torch.Tensor, weight: torch.Tensor, chunk: int, autocast_dtype) -> torch.Tensor | None:
    """One fp32 [chunk x vocab] buffer for every chunk's logits of a fused head, where they are
    computed in fp32 (None under autocast or in a low dtype): a fresh output each chunk costs its
    page faults again (the head's GEMM ran at 45 GFLOP/s into new memory, 66 into a reused buffer,
    AVX2 EPYC). Every use of a chunk's logits ends within its chunk, so one buffer serves all."""
    if autocast_dtype is not None or not h.dtype == weight.dtype == torch.float32:
        return None
    return torch.empty(min(chunk, h.shape[0]), weight.shape[0], dtype=torch.float32, device=h.device)


def chunk_logits(hc: torch.Tensor, weight: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """hc @ W^T in fp32: into ``buf`` (``logits_buffer``) where there is one."""
    return torch.mm(hc, weight.t(), out=buf[:len(hc)]) if buf is not None else F.linear(hc, weight).float()


class HeadSoftCrossEntropy(torch.autograd.Function):
    """sum_r w_r softCE(h_r @ W^T, p_r): the LM head and the loss fused, chunk by chunk.

    ``p`` rows are gathered from the teacher rows per chunk (``probs[prow]``), and the
    gradients w.r.t. ``h`` and ``W`` are computed in the forward (d loss / dz = w (softmax(z) - p)),
    so no [rows x vocab] tensor outlives its chunk. The TTT unroll calls it once for the rows of
    all its steps (``w_r`` = decay^s / n_s): one [V, H] weight gradient is kept until the backward,
    not one per step (7 x 115 MB for a 32,000 x 896 head). Backward only scales the stored
    gradients by the incoming scalar. Returns (loss, per-row softCE, argmax of each row's logits).
    """

    @staticmethod
    def forward(ctx, h, weight, probs, prow, row_weight, want_grad: bool, chunk: int, accept_weight: float = 0.0):
        n = h.shape[0]
        need_h, need_w = want_grad and ctx.needs_input_grad[0], want_grad and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        row_loss = torch.empty(n, dtype=torch.float32, device=h.device)
        pred = torch.empty(n, dtype=torch.long, device=h.device)
        device = h.device.type
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        buf = logits_buffer(h, weight, chunk, low)
        for i in range(0, n, chunk):
            hc = h[i:i + chunk]
            z = chunk_logits(hc, weight, buf)
            p = probs[prow[i:i + chunk]]
            lse = torch.logsumexp(z, dim=-1)
            with torch.autocast(device, enabled=False):  # autocast would take <p, z> in bf16 (errors ~1e-2)
                row_loss[i:i + chunk] = lse - torch.linalg.vecdot(p, z)
            pred[i:i + chunk] = z.argmax(-1)
            if need_h or need_w:
                q = z.sub_(lse[:, None]).exp_()  # softmax(z), in z's storage
                if accept_weight:
                    g = acceptance_mix(q, p, accept_weight)
                else:
                    g = q.sub_(p)  # d softCE / dz
                g.mul_(row_weight[i:i + chunk, None].to(g.dtype))
                # Under autocast g is cast once, not by each GEMM (the same values; g.t()'s was a
                # strided copy); the weight is left to autocast's cast cache.
                g, w = (g.to(low), weight) if low is not None else (g, weight.to(g.dtype))
                if need_h:
                    grad_h[i:i + chunk] = torch.matmul(g, w).to(h.dtype)
                if need_w:
                    grad_w += torch.matmul(g.t(), hc.to(g.dtype)).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(row_loss, pred)
        with torch.autocast(device, enabled=False):
            loss = torch.linalg.vecdot(row_loss, row_weight.float())
        return loss, row_loss, pred

    @staticmethod
    def backward(ctx, grad, _grad_row_loss, _grad_pred):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None, None, None


def acceptance_mix(q: torch.Tensor, p: torch.Tensor, weight: float) -> torch.Tensor:
    """d/dz of (1 - w) softCE(p, z) + w (-log alpha), alpha = sum_v min(p_v, q_v), q = softmax(z).

    alpha is the chance that speculative sampling accepts a token drawn from q when the target
    samples from p (the acceptance-rate objective of LK losses, arXiv 2602.23881); soft
    cross-entropy only reaches it through q -> p. With m_v = [q_v < p_v] (min's subgradient),
    d alpha / dz_j = q_j m_j - q_j <q, m>. The gradient is written into ``q``'s storage.
    """
    qm = torch.where(q < p, q, 0.0)  # q m
    accept = torch.minimum(q, p).sum(-1, keepdim=True).clamp_min(1e-6)  # alpha per row
    d_accept = (qm - q * qm.sum(-1, keepdim=True)).div_(accept).neg_()  # d(-log alpha)/dz
    return q.sub_(p).mul_(1.0 - weight).add_(d_accept, alpha=weight)


class HeadLoss(NamedTuple):
    loss: torch.Tensor      # scalar: sum_r w_r softCE_r (differentiable in h and W)
    row_loss: torch.Tensor  # [rows] softCE_r, detached
    pred: torch.Tensor      # [rows] argmax of the draft logits


def head_soft_cross_entropy(h: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor, prow: torch.Tensor,
                            row_weight: torch.Tensor | None = None, max_elements: int = 1 << 24,
                            accept_weight: float = 0.0, row_multiple: int = 1) -> HeadLoss:
    """sum_r w_r softCE(h[r] @ W^T, probs[prow[r]]) (probs [N,V]; w = 1 if not given): see HeadSoftCrossEntropy.

    ``accept_weight`` w > 0 trains on (1 - w) softCE + w (-log acceptance) instead (acceptance_mix);
    the returned loss and row losses stay the soft cross-entropy, so runs remain comparable.
    Chunks of about ``max_elements`` logits, their row count a multiple of ``row_multiple`` (so
    rows padded to that multiple give GEMMs of few shapes: gemm_padding).
    """
    want_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if row_weight is None:
        row_weight = torch.ones(h.shape[0], dtype=torch.float32, device=h.device)
    chunk = max(1, max_elements // max(1, weight.shape[0]))
    chunk = max(row_multiple, chunk // row_multiple * row_multiple)
    return HeadLoss(*HeadSoftCrossEntropy.apply(h, weight, probs, prow, row_weight, want_grad, chunk, accept_weight))


def unread_prefix(loss_mask: torch.Tensor, steps: int, padded: bool = False) -> int:
    """How many leading positions of every row no loss reads at steps 1..steps-1 (step s at t is
    read where mask[t+2+s]): those steps skip them (ttt_streams' window). Answers follow their
    prompts, so this is about the shortest prompt of the micro-batch (30% of a GSM8K store's
    positions at 1,024-token micro-batches). ``padded``: rounded down to keep the window's grid
    one of gemm_padding's (lengths of LENGTH_MULTIPLE, TOKEN_MULTIPLE tokens)."""
    b, t = loss_mask.shape
    read = torch.zeros(t, dtype=torch.bool, device=loss_mask.device)
    for s in range(1, steps):
        read |= shift_left(loss_mask, 2 + s, fill=False).any(0)
    hit = read.nonzero()
    first = int(hit[0]) if hit.numel() else 0
    while padded and first and ((t - first) % LENGTH_MULTIPLE or b * (t - first) % TOKEN_MULTIPLE):
        first -= 1
    return first


class TTTOutput(NamedTuple):
    """What one unroll returns: the loss to back-propagate and per-step statistics [S] (detached)."""

    loss: torch.Tensor        # scalar: sum_s decay^s * loss_s
    step_loss: torch.Tensor   # [S] loss_s, averaged over the counted positions of step s
    correct: torch.Tensor     # [S] positions whose draft argmax equals the target's
    counted: torch.Tensor     # [S] loss-masked positions predicted at step s


class TTTModel(nn.Module):
    """The draft wrapped for training: forward = the S-step unroll, returning loss and stats.

    A module (rather than a function) so DDP/FSDP wrappers see the unroll as the forward
    and synchronise gradients.
    """

    def __init__(self, draft, steps: int = 7, decay: float = 0.8, attention: Attention = ttt_attention,
                 recompute: bool = True, accept_weight: float = 0.0):
        super().__init__()
        self.draft = draft
        self.steps = steps
        self.decay = decay
        self.attention = attention
        self.recompute = recompute  # checkpoint each step's layer (ttt_streams)
        self.accept_weight = accept_weight  # head_soft_cross_entropy: share of the acceptance loss
        # Steps actually unrolled (a TTT curriculum trains fewer first); the statistics keep
        # ``steps`` entries, the ones not unrolled counted as zero positions.
        self.active: int | None = None
        # Pad to few GEMM shapes (gemm_padding); None: exactly when under bf16 autocast on a CPU.
        self.pad_shapes: bool | None = None

    def forward(self, input_ids, aux, loss_mask, teacher_probs, teacher_index, teacher_slot=None) -> TTTOutput:
        """Returns a TTTOutput (loss, step_loss [S], correct [S], counted [S]); the last three detached.

        The teacher is a Teacher's fields: ``teacher_probs`` [N,Vd] rows with ``teacher_slot``
        [B,T] naming each position's row, or (no slot) a [B,T,Vd] tensor of every position.

        loss = sum_s decay^s * loss_s, loss_s = soft cross-entropy vs the teacher averaged over
        the positions whose predicted token is loss-masked. acc_s = correct_s / counted_s counts
        a position whose target argmax lies outside the draft vocab as a miss.

        Under bf16 autocast on a CPU the positions and the loss rows are padded to a few sizes
        (gemm_padding: oneDNN keeps a kernel per GEMM shape); the results are the unpadded ones.
        """
        if teacher_slot is None:  # a [B,T,Vd] teacher: every position's row, named as a Teacher's slot does
            b, t = loss_mask.shape
            teacher_probs = teacher_probs.reshape(b * t, -1)
            teacher_slot = torch.arange(b * t, device=loss_mask.device).view(b, t)
        pad = cpu_bf16_autocast(input_ids.device) if self.pad_shapes is None else self.pad_shapes
        if pad:
            input_ids, aux, loss_mask, teacher_index, teacher_slot = pad_unroll_inputs(
                input_ids, aux, loss_mask, teacher_index, teacher_slot)
        # Position t at step s predicts token t+2+s from the teacher at position t+1+s.
        steps = min(self.active or self.steps, self.steps)
        where = [shift_left(loss_mask, 2 + s, fill=False).nonzero(as_tuple=True) for s in range(steps)]
        counted = torch.tensor([r.numel() for r, _ in where], device=loss_mask.device)
        step_of = torch.repeat_interleave(torch.arange(steps, device=loss_mask.device), counted)
        rows = torch.cat([r for r, _ in where])
        cols = torch.cat([c + 1 + s for s, (_, c) in enumerate(where)])  # the teacher's position
        prow = teacher_slot[rows, cols]
        if prow.numel() and int(prow.min()) < 0:
            raise ValueError("the teacher was not computed at a position the loss reads (see ttt.teacher_rows)")
        # Padded loss rows: zero inputs, teacher row 0, weight 0 (no loss, no gradient).
        n = rows.numel()
        n_rows = round_up(n, TOKEN_MULTIPLE) if pad else n
        # The head's input for the rows of every step, filled step by step in place (no list and
        # concatenation holding it twice); one fused head + loss call then covers all steps.
        h, start = None, 0
        window = unread_prefix(loss_mask, steps, pad) if self.attention is ttt_attention else 0
        streams = ttt_streams(self.draft, input_ids, aux, steps, self.attention, self.recompute, window)
        for s, a in enumerate(streams):
            r, c = where[s]
            hs = self.draft.head_input(a[r, c - window if s else c])
            if h is None:
                h = (hs.new_zeros if n_rows > n else hs.new_empty)(n_rows, hs.shape[-1])
            h[start:start + r.numel()] = hs
            start += r.numel()
        decay = torch.tensor([self.decay ** s for s in range(steps)], device=loss_mask.device)
        row_weight = F.pad((decay / counted.clamp_min(1))[step_of], (0, n_rows - n))
        loss, row_loss, pred = head_soft_cross_entropy(h, self.draft.lm_head.weight, teacher_probs,
                                                       F.pad(prow, (0, n_rows - n)), row_weight,
                                                       accept_weight=self.accept_weight,
                                                       row_multiple=TOKEN_MULTIPLE if pad else 1)
        row_loss, pred = row_loss[:n], pred[:n]
        step_loss = torch.zeros(self.steps, device=row_loss.device).index_add_(0, step_of, row_loss)
        hits = (pred == teacher_index[rows, cols]).long()
        correct = torch.zeros(self.steps, dtype=torch.long, device=pred.device).index_add_(0, step_of, hits)
        counted = torch.cat([counted, counted.new_zeros(self.steps - steps)])
        return TTTOutput(loss, step_loss / counted.clamp_min(1), correct, counted)


def acceptance_length(acc: list[float]) -> float:
    """Simulated mean acceptance length of a chain of len(acc) drafted tokens.

    Treats acc_s as the chance that drafted token s is accepted given tokens 0..s-1 were (the
    TTT metrics are measured exactly in that conditioning); the bonus token counts one.
    """
    tau, alive = 1.0, 1.0
    for a in acc:
        alive *= a
        tau += alive
    return tau
