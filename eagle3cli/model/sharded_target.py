"""Online training with the target sharded across processes (accelerate FSDP2).

``accelerate launch`` with ``distributed_type: FSDP`` and ``fsdp_version: 2`` makes
``eagle3 train --online`` shard the *target*, the model that does not fit one device: each
decoder layer is ``torch.distributed.fsdp.fully_shard``-ed over all processes, so a process keeps
1/world of the decoder and all-gathers one layer at a time for the forward. The rest of the target
(embedding, final norm, LM head: a few percent of it) stays whole on every process: the draft copies
the embedding and the teacher reads the head directly, outside any FSDP forward.

The draft (one decoder layer) is replicated with DDP as in a plain multi-process run, so its
checkpoints hold its full parameters and the optimizer state stays whole; only the target's
weights are sharded, and they are frozen (no gradients, nothing sharded in a checkpoint).

Every process must run the same number of target forwards (each is a collective): training steps
already give every rank the same micro-batch count; :func:`padded` evens out the held-out batches.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import nn

from ..config.train_config import TrainError


def fsdp_plugin(acc):
    """accelerate's FSDP plugin for this run, or None when FSDP was not asked for.

    accelerate turns FSDP on only for GPU-like process types (accelerate 1.15, state.py,
    ``AcceleratorState.__init__``: MULTI_CPU is not in the list that becomes ``DistributedType.FSDP``),
    so on CPUs (gloo) a launch with ``--use_fsdp`` runs as plain MULTI_CPU; the request is then read
    from the environment that launch sets, and torch's FSDP2 (which works on gloo) honours it.
    """
    if acc.distributed_type.name == "FSDP":
        return acc.state.fsdp_plugin
    if acc.distributed_type.name == "MULTI_CPU" and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        from accelerate.utils import FullyShardedDataParallelPlugin

        return FullyShardedDataParallelPlugin()  # reads FSDP_VERSION, FSDP_RESHARD_AFTER_FORWARD, ...
    return None


def fsdp_requested(acc) -> bool:
    return fsdp_plugin(acc) is not None


def check_fsdp(acc, online: bool, quantized: bool):
    """What FSDP can do in eagle3 train: shard a plain target for --online training (FSDP2)."""
    plugin = fsdp_plugin(acc)
    if plugin is None:
        return
    if not online:
        raise TrainError("FSDP shards the target, which only --online training runs: train an offline store "
                         "with DDP (multi-GPU in the accelerate config), or pass --online with a store gen-data "
                         "wrote with --online")
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise TrainError("eagle3 train shards the target with FSDP2: set fsdp_version: 2 in the accelerate config "
                         "(accelerate launch --fsdp_version 2)")
    if getattr(plugin, "cpu_ram_efficient_loading", False) is True:
        # transformers then loads real weights on rank 0 only (meta elsewhere) and leaves the
        # broadcast to the FSDP wrapper; the draft copies the embedding and warm-start layers first.
        raise TrainError("eagle3 train loads the target on every process before sharding it: set "
                         "fsdp_cpu_ram_efficient_loading: false in the accelerate config "
                         "(FSDP_CPU_RAM_EFFICIENT_LOADING=false)")
    if quantized:
        raise TrainError("FSDP cannot shard a quantized target (--load-in-8bit/4bit): drop the flag, sharding "
                         "already spreads the full-precision target over the processes")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The target's repeated blocks, by the class names HF marks as never split (``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise TrainError(f"cannot shard {type(model).__name__} with FSDP: it names no decoder layer class "
                         "(_no_split_modules); train it with DDP")
    return layers


def shard_target(model: nn.Module, acc) -> nn.Module:
    """fully_shard each decoder layer over all processes (moving its shard to this process's
    device), then the model itself as the FSDP root, ignoring the parameters outside the layers
    (kept whole and moved to the device here). The root matters: FSDP reshards a layer after its
    forward only when the layer is not itself a root, so the forward must enter through the model
    (``target.capture`` does for a sharded model)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    plugin = fsdp_plugin(acc)
    mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
    reshard = plugin.reshard_after_forward if isinstance(plugin.reshard_after_forward, bool) else True
    offload = CPUOffloadPolicy() if plugin.cpu_offload is True or isinstance(plugin.cpu_offload, CPUOffloadPolicy) \
        else OffloadPolicy()
    layers = decoder_layers(model)
    inside = {id(p) for layer in layers for p in layer.parameters()}
    within = {id(m) for layer in layers for m in layer.modules()}
    outside = [m for m in model.modules() if id(m) not in within]
    for m in outside:  # only their own tensors: the layers' go to the device shard by shard
        for name, p in list(m.named_parameters(recurse=False)):
            if id(p) not in inside:
                p.data = p.data.to(acc.device)
        for name, b in list(m.named_buffers(recurse=False)):
            m._buffers[name] = b.to(acc.device)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload)
    ignored = {p for p in model.parameters() if id(p) not in inside}
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload, ignored_params=ignored)
    return model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def prepare_draft(acc, ttt: nn.Module, optimizer, sharded: bool):
    """(model, optimizer) for the loop: accelerate's prepare, except with a sharded target, where
    the draft is wrapped in plain DDP (accelerate would FSDP it too, sharding what checkpoints save)."""
    if not sharded:
        return acc.prepare(ttt, optimizer)
    ids = [acc.device.index if acc.device.index is not None else acc.local_process_index] \
        if acc.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(ttt, device_ids=ids), optimizer


def no_sync(acc, model, last: bool, sharded: bool):
    """Skip the gradient all-reduce on every micro-batch but a step's last one."""
    if last:
        return contextlib.nullcontext()
    if sharded:  # accelerate's no_sync would treat the DDP draft as an FSDP2 module
        return model.no_sync()
    return acc.no_sync(model)


def padded(batches: list, rank: int, world: int, sharded: bool) -> list[tuple[list[int], bool]]:
    """This rank's share of ``batches`` as (batch, counted) pairs; with a sharded target every rank
    gets the same count, the short ones repeating a batch that is run but not counted."""
    mine = [(b, True) for b in batches[rank::world]]
    if sharded and batches:
        want = math.ceil(len(batches) / world)
        mine += [(batches[0], False)] * (want - len(mine))
    return mine


@torch.no_grad()
def forward_sharded(model, **kwargs):
    """The target's forward entered through its FSDP root, computing the logits of one position
    only (the hidden states are what is wanted)."""
    return model(**kwargs, logits_to_keep=1)
