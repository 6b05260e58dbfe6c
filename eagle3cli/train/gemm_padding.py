"""Few GEMM shapes for bf16 training on a CPU: the TTT unroll's inputs padded to a grid of sizes.

oneDNN builds a bf16 matmul kernel for each new shape it meets and keeps it (with what it
allocated) for the life of the process, so a run whose micro-batches bring a new token count each
step grows its resident memory step after step (``benchmarks/bf16_rss.py``: 231 MB -> 1,026 MB
over 400 row counts; rounded up to multiples of 64 they stay near 450 MB); fp32 GEMMs barely
grow (378 MB). Under bf16 autocast on a CPU the unroll therefore pads:

- the micro-batch [B, T] to [B', T']: T' a multiple of LENGTH_MULTIPLE (the attention's per-row
  matmuls see T') and B' x T' a multiple of TOKEN_MULTIPLE (the rows of the fc, attention
  projection and MLP GEMMs), the smallest such grid;
- the loss rows (every TTT step's scored positions, read by the fused head + loss) to a multiple
  of TOKEN_MULTIPLE, and the head's chunks to one as well.

Padded positions lie right of every real position of a row (causal attention never reads them)
or in rows of their own; they carry no loss mask and their loss rows weigh zero, so losses,
gradients and metrics are those of the unpadded batch (tests/train/test_gemm_padding.py). The teacher
is computed outside autocast, in fp32, so its rows need no padding. 64 rather than 256: on
1,024-token micro-batches of a GSM8K store 256 pads about 31% more tokens, 64 about 10% (3% more
FLOPs), and a training run's resident memory stays flat either way (docs/benchmarks.md, "Memory").
"""

from __future__ import annotations

import math

import torch

TOKEN_MULTIPLE = 64
LENGTH_MULTIPLE = 16


def cpu_bf16_autocast(device: torch.device) -> bool:
    """Whether GEMMs on ``device`` run now under CPU bf16 autocast: when shapes must be few."""
    return (device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def grid_shape(rows: int, length: int, tokens: int = TOKEN_MULTIPLE, lengths: int = LENGTH_MULTIPLE) -> tuple[int, int]:
    """The smallest [rows', length'] grid holding [rows, length] with length' a multiple of
    ``lengths`` and rows' x length' one of ``tokens`` (ties: the shorter rows, as attention
    costs length squared)."""
    best = None
    t = round_up(length, lengths)
    while best is None or t < best[0]:  # past best's token count no longer length can win
        b = round_up(rows, tokens // math.gcd(t, tokens))
        if best is None or b * t < best[0]:
            best = (b * t, b, t)
        if t % tokens == 0:
            break  # every longer length needs as many rows
        t += lengths
    return best[1], best[2]


def pad_grid(x: torch.Tensor, rows: int, length: int, fill) -> torch.Tensor:
    """x [B, T, ...] right-padded with ``fill`` to [rows, length, ...] (x itself if it fits)."""
    b, t = x.shape[:2]
    if (b, t) == (rows, length):
        return x
    out = x.new_full((rows, length, *x.shape[2:]), fill)
    out[:b, :t] = x
    return out


def pad_unroll_inputs(input_ids, aux, loss_mask, teacher_index, teacher_slot):
    """The TTT unroll's per-position inputs padded to grid_shape: token 0, zero features, no loss
    mask, no teacher (-1)."""
    rows, length = grid_shape(*input_ids.shape)
    return (pad_grid(input_ids, rows, length, 0), pad_grid(aux, rows, length, 0),
            pad_grid(loss_mask, rows, length, False), pad_grid(teacher_index, rows, length, -1),
            pad_grid(teacher_slot, rows, length, -1))
