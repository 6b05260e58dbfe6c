"""The trainer's optimizer (--optimizer adamw|muon).

    adamw   AdamW over every trainable weight, betas (0.9, 0.95)
    muon    torch.optim.Muon over the 2-D weights inside the draft (fc, q/k/v/o, gate/up/down),
            AdamW over the rest: the LM head (Muon's orthogonalised update is meant for hidden
            matrices; its authors keep embeddings and output heads on AdamW), the norms and any
            1-D weight

Muon's update is scaled with ``adjust_lr_fn="match_rms_adamw"`` (0.2 sqrt(max(A, B)) x lr, the
Moonshot scaling, which makes the update's RMS match AdamW's), so one --lr serves both halves.
``MuonAdamW`` is one ``torch.optim.Optimizer`` over both, so the LR scheduler, gradient clipping,
accelerate and the checkpoints (--resume) treat it as any optimizer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

BETAS = (0.9, 0.95)


def muon_weight(name: str, p: torch.Tensor) -> bool:
    """Whether a trainable parameter goes to Muon: 2-D, and not the LM head."""
    return p.ndim == 2 and not name.split(".")[-2:-1] == ["lm_head"]


class MuonAdamW(torch.optim.Optimizer):
    """Muon for ``muon`` parameters and AdamW for ``adamw`` ones, as one optimizer: param_groups
    are the two optimizers' own group dicts (a scheduler's lr reaches both), state_dict holds both."""

    def __init__(self, muon: list[nn.Parameter], adamw: list[nn.Parameter], lr: float, weight_decay: float):
        self.muon = torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw, lr=lr, betas=BETAS, weight_decay=weight_decay) if adamw else None
        parts = [self.muon] + ([self.adamw] if self.adamw else [])
        super().__init__([p for opt in parts for g in opt.param_groups for p in g["params"]], {"lr": lr})
        self.param_groups = [g for opt in parts for g in opt.param_groups]
        self.parts = parts

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for opt in self.parts:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {f"part{i}": opt.state_dict() for i, opt in enumerate(self.parts)}

    def load_state_dict(self, state: dict):
        if set(state) != {f"part{i}" for i in range(len(self.parts))}:
            raise ValueError(f"not a Muon+AdamW optimizer state (keys {sorted(state)})")
        for i, opt in enumerate(self.parts):
            opt.load_state_dict(state[f"part{i}"])


def make_optimizer(kind: str, named: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float):
    """The optimizer of --optimizer ``kind`` over the (name, parameter) pairs that require grad."""
    if kind == "muon":
        muon = [p for n, p in named if muon_weight(n, p)]
        if muon:
            return MuonAdamW(muon, [p for n, p in named if not muon_weight(n, p)], lr, weight_decay)
    return torch.optim.AdamW([p for _, p in named], lr=lr, betas=BETAS, weight_decay=weight_decay)


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float, shape: str = "linear"):
    """The LR multiplier at each step: a linear warm-up over ``warmup_ratio`` of the steps, then
    ``shape`` (cosine, linear or constant) from 1 down to ``min_ratio`` at the last step."""
    warmup = int(round(total_steps * warmup_ratio))
    decay = {"cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)), "linear": lambda p: 1 - p,
             "constant": lambda p: 1.0}[shape]

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_ratio + (1 - min_ratio) * decay(min(1.0, progress))

    return f
