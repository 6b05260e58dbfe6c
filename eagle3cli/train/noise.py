"""--feature-noise: Gaussian noise on the stored target features the draft reads, drawn from a
seed that depends only on (seed, step, micro-batch, process), so a resumed run draws what the
uninterrupted one did.
"""

from __future__ import annotations

import torch


def noise_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """--feature-noise's seed for one micro-batch, from (seed, optimizer step, micro-batch, process):
    a resumed run draws what the uninterrupted one did (self.step is restored), with no generator
    state to checkpoint. The --ttt-warmup curriculum likewise follows self.step."""
    return ((seed * 1_000_003 + step) * 1_009 + micro) * 257 + rank


def with_noise(aux: torch.Tensor, scale: float, streams: int, seed: int | None = 0) -> torch.Tensor:
    """aux [B,T,k*H] plus Gaussian noise of ``scale`` x each stream's RMS at each position: the
    draft learns features that are near the target's rather than exactly them (its own outputs,
    fed back at inference, never are). Drawn on the CPU from ``seed`` (the same on any device);
    aux itself when ``scale`` is 0 or ``seed`` None (held-out batches)."""
    if not scale or seed is None:
        return aux
    parts = aux.float().unflatten(-1, (streams, -1))
    rms = parts.pow(2).mean(-1, keepdim=True).sqrt()
    gen = torch.Generator().manual_seed(seed % (1 << 63))
    noise = torch.randn(parts.shape, generator=gen).to(parts.device)
    return (parts + noise * rms * scale).flatten(-2).to(aux.dtype)
