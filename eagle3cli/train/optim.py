"""The trainer's optimizer (--optimizer adamw|muon).

    adamw   AdamW over every trainable weight, betas (0.9, --adam-beta2: 0.95 by default)
    muon    Muon (torch's, below) over the 2-D weights inside the draft (fc, q/k/v/o, gate/up/down),
            AdamW over the rest: the LM head (Muon's orthogonalised update is meant for hidden
            matrices; its authors keep embeddings and output heads on AdamW), the norms and any
            1-D weight

--weight-decay decays the matrices only: a norm's gain is a scale, not a feature, and decaying it
toward 0 pulls every gain down at lr x wd a step (a tenth of AdamW's own step at wd 0.1), against a
gradient that is weak while a draft is young. nanoGPT and the transformers Trainer leave norms
and biases undecayed alike.

Muon's update is scaled with ``adjust_lr_fn="match_rms_adamw"`` (0.2 sqrt(max(A, B)) x lr, the
Moonshot scaling, which makes the update's RMS match AdamW's), so one --lr serves both halves.
``MuonAdamW`` is one ``torch.optim.Optimizer`` over both, so the LR scheduler, gradient clipping,
accelerate and the checkpoints (--resume) treat it as any optimizer.

torch's Muon runs its Newton-Schulz iteration in bf16, which a GPU and a CPU with AMX or
AVX512-BF16 multiply in hardware; on other CPUs (AVX2 ones) oneDNN emulates bf16 matmuls and the
iteration took 55% of a DFlash training step. ``Muon`` is torch's with the iteration's dtype chosen
per weight's device (``newton_schulz_dtype``): bf16 where it is native, where it is exactly torch's
step, and fp32 elsewhere, which is both faster there and closer to the exact orthogonalisation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..core.hardware import native_bf16

BETAS = (0.9, 0.95)


def muon_weight(name: str, p: torch.Tensor) -> bool:
    """Whether a trainable parameter goes to Muon: 2-D, and not the LM head."""
    return p.ndim == 2 and not name.split(".")[-2:-1] == ["lm_head"]


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16 where matmuls of it run in hardware (a GPU; a CPU with AMX or AVX512-BF16), as torch
    does; fp32 on other CPUs, where bf16 is emulated and slower than fp32."""
    return torch.bfloat16 if device.type != "cpu" or native_bf16() else torch.float32


def orthogonalise(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The Newton-Schulz approximation of U V^T for g = U S V^T, computed in ``dtype`` (torch's
    ``_zeropower_via_newtonschulz`` with its bf16 made a parameter; a new tensor, g untouched)."""
    a, b, c = coefficients
    x = g.to(dtype=dtype, copy=True)
    if g.size(0) > g.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


def adjusted_lr(lr: float, how: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix rate, as torch scales it (``adjust_lr_fn``)."""
    a, b = shape[:2]
    if how is None or how == "original":
        return lr * math.sqrt(max(1, a / b))
    return lr * (0.2 * math.sqrt(max(a, b)) if how == "match_rms_adamw" else 1.0)


class Muon(torch.optim.Muon):
    """torch's Muon, its Newton-Schulz iteration in ``ns_dtype`` (None: ``newton_schulz_dtype`` of
    each weight's device). Same hyperparameters, same state (``momentum_buffer``), so checkpoints
    move between the two; in bf16 each step equals torch's bit for bit."""

    def __init__(self, params, ns_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = float(group["lr"]), group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.ndim != 2 or torch.is_complex(p):
                    raise ValueError("Muon takes real 2-D matrices only")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalise(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       self.ns_dtype or newton_schulz_dtype(p.device))
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: the matrices decayed, the 1-D weights (norms, biases) not. Without
    decay, one group, as optimizers saved before this split had, so their checkpoints resume."""
    if not weight_decay:
        return [{"params": params}]
    groups = ({"params": [p for p in params if p.ndim >= 2]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


class MuonAdamW(torch.optim.Optimizer):
    """Muon for ``muon`` parameters and AdamW for ``adamw`` ones, as one optimizer: param_groups
    are the two optimizers' own group dicts (a scheduler's lr reaches both), state_dict holds both."""

    def __init__(self, muon: list[nn.Parameter], adamw: list[nn.Parameter], lr: float, weight_decay: float,
                 betas: tuple[float, float] = BETAS):
        self.muon = Muon(muon, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(decay_groups(adamw, weight_decay), lr=lr, betas=betas,
                                       weight_decay=weight_decay) if adamw else None
        parts = [self.muon] + ([self.adamw] if self.adamw else [])
        super().__init__([p for opt in parts for g in opt.param_groups for p in g["params"]], {"lr": lr})
        self.parts = parts
        self._link()

    def _link(self):
        """param_groups as the parts' own group dicts, so an LR scheduler's writes reach both. A part's
        load_state_dict replaces its dicts with new ones (accelerate's prepare reloads every optimizer
        to place its state, --resume loads a checkpoint's), so each load links them again: a stale
        link leaves the parts at the initial lr while the scheduler reports its schedule."""
        self.param_groups = [g for opt in self.parts for g in opt.param_groups]

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
        self._link()


def make_optimizer(kind: str, named: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float,
                   betas: tuple[float, float] = BETAS):
    """The optimizer of --optimizer ``kind`` over the (name, parameter) pairs that require grad."""
    if kind == "muon":
        muon = [p for n, p in named if muon_weight(n, p)]
        if muon:
            return MuonAdamW(muon, [p for n, p in named if not muon_weight(n, p)], lr, weight_decay, betas)
    return torch.optim.AdamW(decay_groups([p for _, p in named], weight_decay), lr=lr, betas=betas,
                             weight_decay=weight_decay)


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
