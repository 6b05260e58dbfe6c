"""benchmarks/gpu_suite.py runs end to end on the CPU with a tiny geometry (the GPU run is the same code)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"


def test_gpu_suite_runs_on_cpu_with_tiny_geometry():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    r = suite.run("tiny", "cpu", "float32", prefix=32, new_tokens=17, seq_len=64, sizes=(1, 4, 8), steps=3)
    assert set(r["verify_ms"]["hf"]) == set(r["verify_ms"]["fast"]) == {1, 4, 8}
    assert all(v > 0 for p in r["verify_ms"].values() for v in p.values())
    for path in ("hf", "fast"):
        c = r["cycles"][path]
        # the replaying oracle is always right: every chain cycle accepts all 3 drafts plus the bonus
        # (17 = the prefill token + 4 full cycles of 4)
        assert c["tau"] == 4.0 and c["lossless"] is True
        assert 0 < c["overhead_share"] < 1 and c["cycle_in_plain_steps"] > 0
    assert r["draft_cycle_ms"] > 0 and r["ttt7_tokens_per_s"] > 0
    f = r["ttt7_flops"]
    peaks = f["matmul_peak_flop_s"]
    assert set(peaks) == {"float32", "bfloat16"} and all(v > 0 for v in peaks.values())
    assert f["flops_per_token"] > 0 and 0 < f["gemm_share"] <= 1 and f["achieved_flop_s"] > 0
