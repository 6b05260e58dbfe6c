"""benchmarks/gpu_suite.py's DFlash cycle on the CPU with a tiny geometry (the GPU run is the same code)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"


def test_dflash_cycle_accepts_whole_blocks_on_both_paths():
    from eagle3cli.decode.fast_target import FastTarget

    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    dev = torch.device("cpu")
    target = suite.build_target("tiny", "cpu", torch.float32)
    prompt = torch.randint(10, target.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    fast = FastTarget(target, 128)
    r = suite.dflash_cycles(target, fast, prompt, 8, 1 + 3 * 8, dev, torch.float32)
    for path in ("hf", "fast"):
        c = r[path]
        # the replayed continuation is always right: 3 cycles of the block's 7 tokens plus the bonus
        assert c["tau"] == 8.0 and c["lossless"] is True, path
        assert c["draft_ms"] > 0 and c["verify_ms"] > 0 and c["cycle_ms"] >= c["draft_ms"] + c["verify_ms"]
        assert c["tokens_per_s"] > 0 and c["plain_tokens_per_s"] > 0
