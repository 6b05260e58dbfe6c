"""Precision set-up of a run: --mixed-precision resolved for this device, the accelerate
Accelerator under it, and the dtype the target's frozen parts are kept in.
"""

from __future__ import annotations

import os

import torch

from ..config.train_config import TrainConfig
from ..core.hardware import native_bf16 as native_bf16_cpu
from ..core.hf_utils import text_config
from ..model.sharded_target import check_fsdp
from ..model.target import TargetSpec


def mixed_precision(name: str, cpu: bool, native_bf16: bool | None = None, optimizer: str = "adamw") -> str:
    """--mixed-precision resolved: auto is bf16 on a GPU and on a CPU that multiplies bf16 in
    hardware (AMX or AVX512-BF16: ``native_bf16``, probed when None), fp32 on other CPUs. There
    fp32 training already runs near the fp32 matmul peak and bf16 autocast gives more tokens per
    CPU-second at the same loss (docs/benchmarks.md, "Training throughput"); the unroll pads its GEMMs to a few
    shapes under it (gemm_padding), else oneDNN's per-shape bf16 kernels grow resident memory
    through a run. Without those instructions bf16 is emulated and slower than fp32.

    With ``--optimizer muon`` auto is fp32 on a CPU: Muon orthogonalises each gradient, which lifts
    its smallest directions, rounding included, to the size of the largest. Under CPU bf16 autocast
    a DFlash draft reached held-out position-1 accuracy 0.085 against 0.197 in fp32 at 240 steps,
    but those runs predate the fix of Muon's schedule and stepped at constant rates of 2e-4 and
    5e-4; after the fix, at 240 steps, seed 2 gave the same draft in both and seed 3 a bf16 draft a
    little behind at six of seven positions (docs/benchmarks.md, "DFlash against a peer's
    trainer"), so fp32 stays: bf16 saves about 30% of the CPU time at a small, uncertain cost."""
    if name != "auto":
        return name
    if not cpu:
        return "bf16"
    if optimizer == "muon":
        return "no"
    return "bf16" if (native_bf16_cpu() if native_bf16 is None else native_bf16) else "no"


def accelerator(cfg: TrainConfig, trackers: list[str]):
    """The accelerate Accelerator for this run, CPU or GPU, under --mixed-precision; DDP under launch."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    cpu = (cfg.device or "").startswith("cpu") or not torch.cuda.is_available()
    if not cpu and (cfg.device or "").startswith("cuda:") and "LOCAL_RANK" not in os.environ:
        torch.cuda.set_device(cfg.device)  # a single-process run on the GPU asked for
    # accelerate keeps one AcceleratorState per process and refuses a second Accelerator with another
    # precision; a new run here (a library caller's second train()) starts its own. The process
    # state (devices, process group) is kept.
    AcceleratorState._reset_state()
    precision = mixed_precision(cfg.mixed_precision, cpu, optimizer=cfg.optimizer)
    acc = Accelerator(cpu=cpu, mixed_precision=precision, log_with=trackers or None, project_dir=cfg.out)
    check_fsdp(acc, cfg.online, cfg.load_in_8bit or cfg.load_in_4bit)  # FSDP shards the target, never the draft
    return acc


def train_dtype_name(spec: TargetSpec, device) -> str:
    """--dtype, auto: fp32 when training on the CPU, bf16 on a GPU."""
    return spec.dtype if spec.dtype != "auto" else ("float32" if device.type == "cpu" else "bfloat16")


def stored_dtype(config) -> str | None:
    """The dtype a checkpoint's weights are stored in (config ``dtype``/``torch_dtype``), by name."""
    tc = text_config(config)
    for c in (config, tc):
        value = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None)
        if value is not None:
            return str(value).replace("torch.", "")
    return None
