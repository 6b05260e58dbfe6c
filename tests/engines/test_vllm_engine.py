"""gen-data --engine vllm without vLLM: the eagle3 side (worker protocol, store, manifest, resume,
refusals) against a fake worker, and the vLLM side's pure helpers (final norm, stream split).

The live check against vLLM itself is benchmarks/vllm_capture_equivalence.py (docs/data.md, "Capture with vLLM")."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3cli.config.options import GenDataOptions
from eagle3cli.data.features import FeatureStore
from eagle3cli.data.gen_data import run
from eagle3cli.data.gen_errors import GenDataError
from eagle3cli.engines.vllm_capture import features_from_capture, rms_norm
from eagle3cli.engines.vllm_engine import VllmEngineError, fill_samples, find_vllm_python, worker_env
from eagle3cli.model.target import TargetSpec

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
REPO = Path(__file__).resolve().parents[2]


def chats(n):
    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": f"Question {i}: what is {i} times {i}?"},
                 {"from": "gpt", "value": f"It is {i * i}, since {i} times {i} is {i * i}."}]
        if i % 2:
            turns += [{"from": "human", "value": "And plus one?"}, {"from": "gpt", "value": f"{i * i + 1}."}]
        rows.append({"id": str(i), "conversations": turns})
    return rows


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("vdata") / "chats.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in chats(5)) + "\n")
    return p


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory):
    """An executable that stands for the Python of a vLLM environment."""
    p = tmp_path_factory.mktemp("fakevllm") / "python"
    p.write_text(f"#!/bin/sh\nexec {sys.executable} {HELPERS / 'fake_vllm_worker.py'} \"$@\"\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


def opts(out, data, **kw):
    base = dict(out=Path(out), data=str(data), regenerate=False, max_length=96, shard_size=2)
    base.update(kw)
    return GenDataOptions(**base)


def shard_tensors(out):
    got = {}
    for p in sorted((Path(out) / "shards").glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            got[p.name] = {k: f.get_tensor(k) for k in f.keys()}
    return got


@pytest.fixture(scope="module")
def both_stores(smol_tiny_dir, data_file, fake_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    spec = lambda: TargetSpec(str(smol_tiny_dir), device="cpu", dtype="float32")  # noqa: E731
    hf = run(opts(root / "hf", data_file, capture_dtype="float32"), spec())  # as the fake engine computes
    log = root / "requests.jsonl"
    os.environ["FAKE_VLLM_LOG"] = str(log)
    try:
        vl = run(opts(root / "vllm", data_file, engine="vllm", vllm_python=fake_python, tensor_parallel_size=1,
                      vllm_kv_cache_gib=0.5), spec())
    finally:
        del os.environ["FAKE_VLLM_LOG"]
    return root, hf, vl, log


def test_vllm_store_has_the_hf_store_layout_and_tokens(both_stores):
    root, hf, vl, log = both_stores
    a, b = shard_tensors(root / "hf"), shard_tensors(root / "vllm")
    assert list(a) == list(b) == ["shard-00-00000.safetensors", "shard-00-00001.safetensors",
                                  "shard-00-00002.safetensors"]
    for name in a:
        assert set(a[name]) == set(b[name])
        for k in ("input_ids", "loss_mask", "offsets", "sample_ids", "count_ids", "count_values"):
            assert torch.equal(a[name][k], b[name][k]), (name, k)
        for k in ("aux", "final"):  # one forward per sample (the fake) vs padded micro-batches (HF engine)
            assert a[name][k].dtype == b[name][k].dtype == torch.bfloat16 and a[name][k].shape == b[name][k].shape
            assert torch.allclose(a[name][k].float(), b[name][k].float(), rtol=2 ** -7, atol=2 ** -10), (name, k)
    store = FeatureStore(root / "vllm")
    assert len(store) == 5 and store.has_features and not store.problems()
    # One request per shard, with the layer ids, the layer count and the settings passed through.
    reqs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["n"] for r in reqs] == [2, 2, 1]
    cfg = reqs[0]["cfg"]
    assert cfg["layer_ids"] == [2, 4, 5] and cfg["num_layers"] == 8 and cfg["max_length"] == 96
    assert cfg["feature_dtype"] == "bfloat16" and cfg["kv_cache_gib"] == 0.5 and cfg["tensor_parallel_size"] == 1


def test_vllm_manifest_records_the_engine(both_stores):
    _, hf, vl, _ = both_stores
    assert vl["complete"] and vl["num_samples"] == hf["num_samples"] and vl["num_tokens"] == hf["num_tokens"]
    assert vl["capture"] == {"engine": "vllm", "vllm_version": "fake", "dtype": "float32",
                             "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    assert vl["run"]["capture_engine"] == "vllm" and "capture_engine" not in hf["run"]
    assert "capture" not in hf
    drop = {"capture", "run", "bytes"}
    assert {k: v for k, v in vl.items() if k not in drop} == {k: v for k, v in hf.items() if k not in drop}


def test_vllm_rerun_resumes_and_other_engine_is_refused(both_stores, smol_tiny_dir, data_file, fake_python):
    root, _, _, _ = both_stores
    before = {p.name: p.read_bytes() for p in (root / "vllm" / "shards").iterdir()}
    # Nothing left to do: the worker is not even started (a broken python would fail otherwise).
    man = run(opts(root / "vllm", data_file, engine="vllm", vllm_python=fake_python, vllm_kv_cache_gib=0.5),
              TargetSpec(str(smol_tiny_dir), device="cpu", dtype="float32"))
    assert man["complete"]
    assert before == {p.name: p.read_bytes() for p in (root / "vllm" / "shards").iterdir()}
    with pytest.raises(GenDataError, match="different settings.*capture_engine"):
        run(opts(root / "vllm", data_file), TargetSpec(str(smol_tiny_dir), device="cpu", dtype="float32"))


def test_vllm_resume_after_a_lost_shard(both_stores, smol_tiny_dir, data_file, fake_python, tmp_path):
    root, _, _, _ = both_stores
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(root / "vllm", out)
    (out / "shards" / "shard-00-00001.json").unlink()  # unfinished: redone
    man = run(opts(out, data_file, engine="vllm", vllm_python=fake_python, vllm_kv_cache_gib=0.5),
              TargetSpec(str(smol_tiny_dir), device="cpu", dtype="float32"))
    assert man["complete"]
    for name in ("shard-00-00001.safetensors", "shard-00-00001.json"):
        assert (out / "shards" / name).read_bytes() == (root / "vllm" / "shards" / name).read_bytes()


@pytest.mark.parametrize("kw, msg", [
    (dict(engine="sglang"), "--engine must be one of hf, vllm"),
    (dict(engine="vllm", features="none"), "--online stores tokens only"),
    (dict(engine="vllm", regenerate=True), "regenerate through --endpoint"),
    (dict(tensor_parallel_size=2), "options of --engine vllm"),
    (dict(engine="vllm", pipeline_parallel_size=0), "at least 1"),
])
def test_engine_option_refusals(smol_tiny_dir, data_file, tmp_path, kw, msg):
    with pytest.raises(GenDataError, match=msg):
        run(opts(tmp_path / "o", data_file, **kw), TargetSpec(str(smol_tiny_dir), device="cpu"))


def test_vllm_needs_a_local_plain_target(data_file, tmp_path):
    with pytest.raises(GenDataError, match="local folder"):
        run(opts(tmp_path / "o", data_file, engine="vllm"), TargetSpec("HuggingFaceTB/SmolLM2-135M-Instruct"))


@pytest.mark.parametrize("mode, msg", [("start", "vLLM did not start: RuntimeError: no engine"),
                                       ("capture", "vLLM worker: RuntimeError: worker died")])
def test_worker_failures_are_one_line(smol_tiny_dir, data_file, fake_python, tmp_path, monkeypatch, mode, msg):
    monkeypatch.setenv("FAKE_VLLM_FAIL", mode)
    with pytest.raises(GenDataError, match=msg):
        run(opts(tmp_path / "o", data_file, engine="vllm", vllm_python=fake_python),
            TargetSpec(str(smol_tiny_dir), device="cpu", dtype="float32"))
    assert not list((tmp_path / "o" / "shards").glob("*.json")) if (tmp_path / "o" / "shards").exists() else True


def test_missing_vllm_python_and_dead_worker(smol_tiny_dir, data_file, tmp_path):
    with pytest.raises(VllmEngineError, match="no such interpreter"):
        find_vllm_python(str(tmp_path / "nope" / "python"))
    dead = tmp_path / "python"
    dead.write_text("#!/bin/sh\nexit 3\n")
    dead.chmod(0o755)
    with pytest.raises(GenDataError, match=r"exited \(code 3\) while starting vLLM"):
        run(opts(tmp_path / "o", data_file, engine="vllm", vllm_python=str(dead)),
            TargetSpec(str(smol_tiny_dir), device="cpu", dtype="float32"))


def test_worker_env_keeps_cores_free_and_finds_the_package():
    env = worker_env(threads=2)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def test_fill_samples_checks_counts_and_lengths():
    samples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    aux, final = torch.arange(5 * 6).reshape(5, 6), torch.arange(5 * 2).reshape(5, 2)
    fill_samples(samples, aux, final, torch.tensor([0, 3, 5]))
    assert torch.equal(samples[1]["aux"], aux[3:5]) and torch.equal(samples[0]["final"], final[:3])
    with pytest.raises(VllmEngineError, match="1 samples for 2 sent"):
        fill_samples(samples, aux, final, torch.tensor([0, 5]))
    with pytest.raises(VllmEngineError, match="4 rows for a sample of 3 tokens"):
        fill_samples(samples, aux, final, torch.tensor([0, 4, 5]))


def test_final_norm_is_hf_llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(16, eps=1e-5)
    norm.weight.data = torch.randn(16)
    raw = torch.randn(7, 4, 16) * 30
    aux, final = features_from_capture(raw, 3, norm.weight.data, 1e-5)
    assert torch.equal(aux, raw[:, :3].reshape(7, 48))
    assert torch.allclose(final, norm(raw[:, 3]), atol=1e-6, rtol=1e-6)
    norm16 = norm.to(torch.bfloat16)  # a bf16 target: weight and stream in bf16, statistics in fp32
    assert torch.equal(rms_norm(raw[:, 3].bfloat16(), norm16.weight.data, 1e-5), norm16(raw[:, 3].bfloat16()))
    with pytest.raises(ValueError, match="expected 4 captured streams, got 3"):
        features_from_capture(raw[:, :3], 3, norm.weight.data, 1e-5)
