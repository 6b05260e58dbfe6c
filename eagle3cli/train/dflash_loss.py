"""DFlash's training step (docs/design.md §13): random anchors, all their blocks in one forward.

    anchors = up to --num-anchors positions per sequence whose next token is scored (random)
    labels  = the target's argmax at anchor + k - 1, i.e. the token greedy decoding puts at anchor + k
    logits  = draft(aux, ids, anchors)              # block-sparse mask: each block sees the context
                                                    # before its anchor and itself, nothing else
    loss    = sum_k w_k CE_k / sum_k w_k,  w_k = exp(-(k-1)/gamma), k = 1..B-1   (--position-weights decay)
              or w_k from the block's own confidences                          (--position-weights dpace)
    CE_k    = (1 - s) CE(argmax) + s CE(target's distribution)                 (--soft-labels s)

The labels are the target's own choices, as in EAGLE-3's teacher (``ttt.teacher_from_final``):
greedy decoding accepts exactly those. The statistics have EAGLE-3's shape (``ttt.TTTOutput``,
one entry per drafted position) so the trainer's meter, log and report serve both families:
position k counts the blocks whose positions 1..k-1 were all right, ``correct`` those whose
position k is right too. acc_k is then the chance that drafted token k is accepted once the
tokens before it were, and ``ttt.acceptance_length`` turns it into a simulated tau.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model.target import finish_logits, output_head
from .ttt import TTTOutput, chunk_logits, logits_buffer, soft_cross_entropy

IGNORE = -100


def default_gamma(block_size: int) -> float:
    """The loss decay of the DFlash recipes: 7 for blocks of 16, 4 for 8 (z-lab, SpecForge); between
    and beyond, half the block less one, at least 1."""
    return {16: 7.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2 - 1))


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for the drafted positions k = 1..B-1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32, device=device) / gamma)


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [..., B-1] from a block's cross-entropies (0 where not ``valid``).

    Drafted token j is accepted only if 1..j all are, so the expected accepted length is
    sum_j prod_{i<=j} q_i, with q_i the draft's probability of the label at i. Its gradient in
    log q_k is w_k = sum_{j>=k} prod_{i<=j} q_i: the weight D-PACE puts on CE_k. The q are smoothed
    to (1 - alpha) q + alpha so a block the draft does not know yet still teaches its later
    positions (alpha 0.5 is speculators' default). Early in training this halves each position's
    weight (a gamma of about 1.4); as the first positions are learned, the later ones gain weight.
    No gradient flows through the weights.
    """
    with torch.no_grad():
        q = torch.exp(-ce.float())
        s = torch.where(valid, (1.0 - alpha) * q + alpha, torch.ones_like(q))
        prefix = torch.cumprod(s, dim=-1) * valid
        return prefix.flip(-1).cumsum(-1).flip(-1) * valid


def sample_anchors(scored: torch.Tensor, lengths: torch.Tensor, count: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` anchors per row [B, m] (ascending) and which are real [B, m].

    An anchor a is a position whose next token a + 1 exists and is scored (``scored`` [B, T]):
    its block has at least one label. Drawn without replacement from a generator of ``seed``
    alone, so a resumed run draws what the uninterrupted one did.
    """
    gen = torch.Generator().manual_seed(int(seed) & 0x7FFFFFFFFFFFFFFF)
    b, t = scored.shape
    nxt = F.pad(scored[:, 1:].cpu(), (0, 1), value=False)
    nxt &= torch.arange(t)[None] < (lengths.cpu()[:, None] - 1)
    picks = []
    for row in nxt:
        cand = row.nonzero(as_tuple=True)[0]
        if cand.numel() > count:
            cand = cand[torch.randperm(cand.numel(), generator=gen)[:count]].sort().values
        picks.append(cand)
    m = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros(b, m, dtype=torch.long)
    real = torch.zeros(b, m, dtype=torch.bool)
    for i, p in enumerate(picks):
        anchors[i, :p.numel()], real[i, :p.numel()] = p, True
    return anchors.to(scored.device), real.to(scored.device)


@torch.no_grad()
def target_argmax(target, final: torch.Tensor, used: torch.Tensor, max_elements: int = 1 << 26) -> torch.Tensor:
    """The target's argmax [B, T] from its final hidden states at the ``used`` positions (-1 elsewhere),
    full-vocabulary logits computed a chunk of rows at a time."""
    b, t, _ = final.shape
    head = output_head(target)
    dtype = getattr(target, "compute_dtype", None) or head.weight.dtype
    weight = head.weight.to(dtype)
    bias = getattr(head, "bias", None)
    bias = bias.to(dtype) if bias is not None else None
    flat, where = final.reshape(b * t, -1), used.reshape(-1).nonzero(as_tuple=True)[0]
    out = torch.full((b * t,), -1, dtype=torch.long, device=final.device)
    chunk = max(1, max_elements // weight.shape[0])
    for i in range(0, where.numel(), chunk):
        pos = where[i:i + chunk]
        out[pos] = finish_logits(target, F.linear(flat[pos].to(dtype), weight, bias).float()).argmax(-1)
    return out.view(b, t)


def block_labels(argmax: torch.Tensor, scored: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                 real: torch.Tensor, block_size: int) -> torch.Tensor:
    """Labels [B, m, B-1]: at drafted position k of the block at a, the target's argmax at a + k - 1
    (its prediction of the token at a + k), where a + k exists and is scored; IGNORE elsewhere."""
    t = argmax.shape[1]
    k = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[..., None] + k  # the predicted token's position
    ok = real[..., None] & (pos < lengths[:, None, None])
    at = pos.clamp(max=t - 1)
    ok &= scored.gather(1, at.flatten(1)).view_as(at)
    lab = argmax.gather(1, (at - 1).flatten(1)).view_as(at)
    ok &= lab >= 0
    return torch.where(ok, lab, torch.full_like(lab, IGNORE))


def label_sources(anchors: torch.Tensor, block_size: int, t: int) -> torch.Tensor:
    """The position a + k - 1 [B, m, B-1] whose target output predicts label k of the block at a
    (the token at a + k), clamped into a sequence of ``t``: where that token is past the end, the
    label is IGNORE and the clamped position is never read for it."""
    return (anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)).clamp(max=t - 1)


def block_rows(slot: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The teacher row [B, m, B-1] of each label: ``slot`` (``ttt.Teacher.slot``) at its
    ``label_sources`` position (-1 where not computed)."""
    pos = label_sources(anchors, block_size, slot.shape[1])
    return slot.gather(1, pos.flatten(1)).view_as(pos)


def needed_positions(scored: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, real: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """The positions [B, T] whose target argmax the labels read (a + k - 1 for every block row)."""
    b, t = scored.shape
    used = torch.zeros(b, t, dtype=torch.bool, device=scored.device)
    pos = label_sources(anchors, block_size, t)
    ok = real[..., None] & (pos + 1 < lengths[:, None, None])
    used.view(-1)[(pos + torch.arange(b, device=pos.device)[:, None, None] * t)[ok]] = True
    return used


class HeadCrossEntropy(torch.autograd.Function):
    """CE(h_r W^T, label_r) for each row r, the frozen LM head fused in, a chunk of rows at a time.

    A step's drafted rows times the target's vocabulary is the largest tensor of a DFlash step (3,584
    x 49,152 fp32 logits, 700 MB, at 512 blocks of 8 on SmolLM2), written and read again by the
    softmax, the loss and their backward. Each row's gradient d CE_r / d h_r = (softmax(z_r) -
    onehot(label_r)) W is computed in the forward instead (``ttt.HeadSoftCrossEntropy`` does the same
    for EAGLE-3's soft targets), so no logits outlive their chunk; the backward scales each row's by
    the incoming d loss / d CE_r, so any weighting of the rows (D-PACE's comes from these very CEs)
    is autograd's. Returns (per-row CE, each row's argmax); no gradient reaches the head.
    """

    @staticmethod
    def forward(ctx, h, weight, labels, want_grad: bool, chunk: int):
        n = h.shape[0]
        grad_h = torch.empty_like(h) if want_grad and ctx.needs_input_grad[0] else None
        ce = torch.empty(n, dtype=torch.float32, device=h.device)
        pred = torch.empty(n, dtype=torch.long, device=h.device)
        device = h.device.type
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        buf = logits_buffer(h, weight, chunk, low)
        for i in range(0, n, chunk):
            hc, lab = h[i:i + chunk], labels[i:i + chunk]
            z = chunk_logits(hc, weight, buf)
            top, pred[i:i + chunk] = z.max(-1)  # the row's largest logit and its argmax, in one pass
            picked = z.gather(1, lab[:, None]).squeeze(1)
            total = z.sub_(top[:, None]).exp_().sum(-1)  # exp(z - max), in z's storage
            ce[i:i + chunk] = top + total.log() - picked  # logsumexp(z) - z[label]
            if grad_h is not None:
                g = z.div_(total[:, None])  # softmax(z)
                g[torch.arange(len(lab), device=g.device), lab] -= 1.0  # d CE / dz
                # as autograd's backward of the plain head: the GEMM in the autocast dtype under autocast
                g, w = (g.to(low), weight) if low is not None else (g, weight.to(g.dtype))
                grad_h[i:i + chunk] = torch.matmul(g, w).to(h.dtype)
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(pred)
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce, _grad_pred):
        (grad_h,) = ctx.saved_tensors
        gh = grad_h * grad_ce[:, None].to(grad_h.dtype) if grad_h is not None else None
        return gh, None, None, None, None


HEAD_CHUNK_BYTES = 100 << 20  # fp32 logits per chunk of HeadCrossEntropy


def head_chunk(vocab_size: int) -> int:
    """Rows per chunk: the power of two (64 to 1,024) whose fp32 logits fit HEAD_CHUNK_BYTES. 512
    on SmolLM2's 49,152 tokens, where 512 and 1,024 rows ran 1.7x the plain head and 128-256
    1.55-1.6x (AVX2 EPYC, benchmarks/dflash_head.py)."""
    rows = max(1, HEAD_CHUNK_BYTES // (4 * vocab_size))
    return min(1024, max(64, 1 << (rows.bit_length() - 1)))


def plain_head_cross_entropy(head: nn.Linear, h: torch.Tensor, labels: torch.Tensor):
    """(the whole logits, per-row CE against ``labels``, each row's argmax): the path soft labels
    need, and the one ``HeadCrossEntropy`` is held equal to."""
    logits = head(h.to(head.weight.dtype)).float()
    return logits, F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


def head_cross_entropy(head: nn.Linear, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row CE of ``head``'s logits against ``labels``, each row's argmax), through
    ``HeadCrossEntropy`` where the head is frozen and has no bias (a DFlash draft's always is)."""
    if head.weight.requires_grad or head.bias is not None:
        return plain_head_cross_entropy(head, h, labels)[1:]
    return HeadCrossEntropy.apply(h.to(head.weight.dtype), head.weight, labels, torch.is_grad_enabled(),
                                  head_chunk(head.weight.shape[0]))


class DFlashLoss(nn.Module):
    """The draft wrapped for training, as ``ttt.TTTModel`` wraps EAGLE-3's: forward = one step's
    loss and statistics (a module so DDP/FSDP see the forward and synchronise gradients)."""

    def __init__(self, draft, gamma: float | None = None, dpace_alpha: float | None = None, soft: float = 0.0):
        super().__init__()
        self.soft = soft  # the share of CE_k taken against the target's distribution (``probs``)
        self.draft = draft
        self.block = draft.config.block_size
        self.gamma = gamma or default_gamma(self.block)
        self.dpace_alpha = dpace_alpha  # None: the fixed exp(-(k-1)/gamma) weights
        self.steps = self.block - 1  # the statistics' length: one entry per drafted position
        self.active = None  # the trainer's --ttt-warmup hook; a block is drafted whole, so unused

    def forward(self, input_ids, aux, anchors, labels, probs=None, rows=None) -> TTTOutput:
        """``probs`` [N, V] and ``rows`` [B, m, B-1]: the target's distributions and each label's row
        among them, given when --soft-labels is above 0 (training only: held-out metrics score argmax)."""
        valid = labels != IGNORE  # [B, m, B-1]
        states = self.draft.block_states(aux, input_ids, anchors)[:, :, 1:]  # rows 1..B-1 draft the tokens
        h = self.draft.norm(states[valid])
        if probs is not None and self.soft > 0:  # the target's whole distributions: the logits are needed
            logits, ce, pred = plain_head_cross_entropy(self.draft.lm_head, h, labels[valid])
            soft = soft_cross_entropy(logits, probs[rows[valid]])
            ce_loss = soft if self.soft == 1 else (1 - self.soft) * ce + self.soft * soft
        else:
            ce, pred = head_cross_entropy(self.draft.lm_head, h, labels[valid])
            ce_loss = ce
        if self.dpace_alpha is None:
            w = position_weights(self.block, self.gamma, labels.device).expand_as(labels)[valid]
        else:
            full = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
            full[valid] = ce.detach()
            w = dpace_weights(full, valid, self.dpace_alpha)[valid]
        loss = (w * ce_loss).sum() / w.sum().clamp_min(1e-9)
        if not valid.any():
            loss = states.sum() * 0.0  # no label in this micro-batch: a zero that still reaches every weight
        with torch.no_grad():
            hit = torch.zeros_like(valid)
            hit[valid] = pred == labels[valid]
            ahead = torch.cumprod(F.pad(hit, (1, 0), value=True)[..., :-1].long(), dim=-1).bool()
            counted_at = valid & ahead  # position k counts when 1..k-1 were all right
            counted = counted_at.sum((0, 1))
            correct = (counted_at & hit).sum((0, 1))
            k_of = torch.arange(self.steps, device=labels.device).expand_as(labels)[valid]
            step_loss = torch.zeros(self.steps, device=labels.device).index_add_(0, k_of, ce.detach())
            step_loss = step_loss / valid.sum((0, 1)).clamp_min(1)
        return TTTOutput(loss, step_loss, correct, counted)

