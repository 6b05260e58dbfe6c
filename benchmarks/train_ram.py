"""Peak RSS of `eagle3 train` on a real store, by phase of the optimizer step.

    python benchmarks/train_ram.py STORE OUT [--phases] [train flag=value ...]
    python benchmarks/train_ram.py runs/store-qwen runs/ram max_steps=1 seed=1 --phases
    python benchmarks/train_ram.py runs/store-qwen runs/ram max_steps=4 --stub-matmuls   # minutes, not hours

Runs the trainer exactly as `eagle3 train --recipe auto` does (the flags given as
``name=value`` on top of the recipe) and prints the resident set after setup and after the run,
the process's peak (getrusage: the same number as ``/usr/bin/time -v``'s "Maximum resident set
size"), and tokens/s of the steps. With ``--phases`` it also prints, for every micro-batch, the
peak RSS (sampled every 10 ms) within the teacher, each TTT step's forward, the backward and the
optimizer step: where the memory goes. ``--stub-matmuls`` skips the matrix products (see
``stub_matmuls``): the same allocations in a small share of the CPU time.
"""

from __future__ import annotations

import resource
import sys
import threading
import time

import psutil

PROC = psutil.Process()


def mb(x: float) -> str:
    return f"{x / 2**20:,.0f} MB"


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Sampler:
    """The highest RSS seen since the last ``take()`` (a 10 ms background poll)."""

    def __init__(self):
        self.high = 0
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self):
        while True:
            self.high = max(self.high, PROC.memory_info().rss)
            time.sleep(0.01)

    def take(self) -> int:
        self.high = max(self.high, PROC.memory_info().rss)
        high, self.high = self.high, 0
        return high


def stub_matmuls():
    """A dispatch mode under which matrix products and fused attention return zeros of their
    output's shape, dtype and strides (pages touched) instead of being computed.

    Every other op runs for real and autograd, checkpoints and the allocator see exactly the
    tensors of a real step, so the peak RSS is the real step's (less the kernels' own scratch
    buffers, a few MB) at a small share of the CPU time: an "allocation dry run" for machines
    where a real 0.5B step takes an hour of a shared core. The losses it reports are meaningless.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward"]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def zeros_like_meta(m):
        if not isinstance(m, torch.Tensor):
            return m
        return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype).zero_()

    class Stub(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in ops:
                to_meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
                out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
                return tree_map(zeros_like_meta, out)
            return func(*args, **kwargs)

    return Stub()


def trace_phases(sampler: Sampler):
    """Wrap the teacher, the TTT streams, the backward and the optimizer step to print each
    phase's peak RSS (the phases of one micro-batch, in order)."""
    from eagle3cli.train import trainer as T
    from eagle3cli.train import ttt

    def report(name):
        print(f"    {name:<22} peak {mb(sampler.take())}  now {mb(PROC.memory_info().rss)}", flush=True)

    teacher = T.teacher_from_final

    def traced_teacher(*a, **k):
        sampler.take()
        out = teacher(*a, **k)
        report("teacher")
        return out

    T.teacher_from_final = traced_teacher
    streams = ttt.ttt_streams

    def traced_streams(*a, **k):
        for s, x in enumerate(streams(*a, **k)):
            report(f"ttt step {s} forward")
            yield x

    ttt.ttt_streams = traced_streams
    step = T.Trainer._optimizer_step

    def traced_step(self, group):
        backward = self.acc.backward

        def traced_backward(loss):
            report("head/loss of last step")
            backward(loss)
            report("backward")

        self.acc.backward = traced_backward
        t0 = time.time()
        ok = step(self, group)
        report("optimizer step")
        print(f"  optimizer step done in {time.time() - t0:.0f} s", flush=True)
        return ok

    T.Trainer._optimizer_step = traced_step


def main(argv: list[str]):
    phases, stub = "--phases" in argv, "--stub-matmuls" in argv
    args = [a for a in argv if a not in ("--phases", "--stub-matmuls")]
    store, out = args[0], args[1]
    import yaml  # values as a recipe would give them: True, 2048, 0.0

    extra = {k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in args[2:])}
    sampler = Sampler()
    from eagle3cli.config.train_config import resolve
    from eagle3cli.data.features import read_manifest
    from eagle3cli.train import trainer as T

    if phases:
        trace_phases(sampler)
    flags = {"data": store, "out": out, "log_every": 1, **extra}
    cfg, used = resolve("auto", flags, read_manifest(store).model_type)
    print(f"eagle3cli from {T.__file__}, recipe {used}, max_tokens {cfg.max_tokens}, ttt {cfg.ttt_steps}", flush=True)
    t0 = time.time()
    tr = T.Trainer(cfg, used, None, quiet=True)
    tr.setup()
    print(f"after setup: rss {mb(PROC.memory_info().rss)}  peak {mb(maxrss())}  ({time.time() - t0:.0f} s)",
          flush=True)
    sampler.take()
    if stub:
        print("matrix products stubbed (zeros): RSS as in a real step, losses meaningless", flush=True)
        with stub_matmuls():
            res = tr.run()
    else:
        res = tr.run()
    print(f"after run: rss {mb(PROC.memory_info().rss)}  peak {mb(maxrss())}  steps {res.step}  "
          f"({time.time() - t0:.0f} s)", flush=True)
    for h in res.history:
        if "loss" in h:
            print(f"  step {h['step']} loss {h['loss']:.4f} acc0 {h['acc'][0]:.3f} tokens {h['tokens']} "
                  f"tokens/s {h['tokens_per_s']:.1f} cpu_s {h['cpu_s']:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
