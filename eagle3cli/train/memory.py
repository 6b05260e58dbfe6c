"""Memory policy of a training step: whether the TTT unroll recomputes its activations in the
backward instead of keeping them (--recompute auto), and when glibc is asked to give freed
tensors back to the system (``core.host_memory``).
"""

from __future__ import annotations

from ..config.train_config import TrainConfig
from ..core import host_memory
from ..model.draft import DraftConfig

# (--recompute auto). Recomputing costs a few percent of CPU time, keeping them their bytes: several
# GB for a 0.5B target at the defaults (docs/benchmarks.md, "Memory").
RECOMPUTE_ABOVE = 1 << 30


def kept_activation_bytes(tokens: int, steps: int, dcfg: DraftConfig) -> int:
    """What an S-step unroll keeps for the backward without recompute, per micro-batch: per token
    and step the MLP's gate, up and product ([3 x intermediate]) and about a dozen hidden-sized
    tensors (norms, q/k/v/o, the residuals), in fp32."""
    return tokens * steps * (3 * dcfg.intermediate_size + 12 * dcfg.hidden_size) * 4


def large_step(cfg: TrainConfig, dcfg: DraftConfig) -> bool:
    """Whether a micro-batch's unroll would keep more than RECOMPUTE_ABOVE of activations: the
    runs where memory, not compute, is what to save (a 0.5B target at the defaults, not SmolLM2
    at the quickstart's 1,024 tokens x 3 steps)."""
    return kept_activation_bytes(cfg.max_tokens, cfg.ttt_steps, dcfg) > RECOMPUTE_ABOVE


def fix_host_memory(cfg: TrainConfig, dcfg: DraftConfig, device, say) -> None:
    """On a large CPU step, have glibc give freed tensors back (host_memory): a large part of such a
    step's peak is freed tensors it keeps. It costs some CPU time (docs/benchmarks.md, "Memory"),
    so small runs keep glibc's default."""
    if device.type == "cpu" and large_step(cfg, dcfg):
        note = host_memory.return_freed_tensors()
        if note:
            say(f"host memory: {note}")


def use_recompute(cfg: TrainConfig, dcfg: DraftConfig) -> bool:
    """--recompute/--no-recompute as given; auto: on for a large step (large_step)."""
    if cfg.recompute is not None:
        return cfg.recompute
    return large_step(cfg, dcfg)
