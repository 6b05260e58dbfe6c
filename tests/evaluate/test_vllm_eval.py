"""`eagle3 eval --engine vllm` without vLLM: the eagle3 side (worker protocol, counters, the results'
engine section, conversion, one-line refusals) against tests/helpers/fake_vllm_worker.py.

The live runs against vLLM CPU 0.32 are in docs/benchmarks.md ("Engines' agreement")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.evaluate.vllm_eval import delta, max_model_len, summarize
from tests.helpers.evaluate import engine_case, engine_eval_args, python_wrapper  # noqa: E402

runner = CliRunner()
HELPERS = Path(__file__).resolve().parents[1] / "helpers"


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """An executable that stands for the Python of a vLLM environment."""
    p = python_wrapper(tmp_path / "vllm-env" / "python", HELPERS / "fake_vllm_worker.py")
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "starts.jsonl"))
    monkeypatch.delenv("EAGLE3_VLLM_PYTHON", raising=False)
    for k in ("FAKE_VLLM_FAIL", "FAKE_VLLM_DIFFER", "FAKE_VLLM_VERSION"):
        monkeypatch.delenv(k, raising=False)
    return p


@pytest.fixture
def case(smol_tiny_dir, tmp_path):
    return engine_case(smol_tiny_dir, tmp_path)


def _args(target, draft, turns, out, python, *more):
    return engine_eval_args(target, draft, turns, out, "vllm", "--vllm-python", python, "--engine-threads", "1", *more)


def _starts(tmp_path):
    return [json.loads(ln)["cfg"] for ln in (tmp_path / "starts.jsonl").read_text().splitlines()]


def test_eval_engine_vllm_reads_vllms_counters(case, fake_python, tmp_path):
    target, draft, turns = case
    out = tmp_path / "out"
    r = runner.invoke(app, _args(target, draft, turns, out, fake_python))
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["tasks"]["mini"]["num_prompts"] == 2  # our own generator ran too
    e = res["engine"]
    assert e["name"] == "vLLM" and e["version"] == "0.32.0-fake" and e["python"] == fake_python
    assert e["settings"]["spec_type"] == "eagle3" and e["settings"]["spec_draft_n_max"] == 3
    assert e["settings"]["dtype"] == "float32" and e["settings"]["threads"] == 1
    assert e["draft"] == str(Path(draft).resolve()) and e["converted_from"] is None  # ours: served as-is
    t = e["tasks"]["mini"]
    # 3 answers (2 + 1 turns) of 10 tokens; each: 5 drafts of 3 tokens, 4 accepted (3 at position 1, 1 at 2).
    # The warm-up answer is not counted (counter differences from after it).
    assert (t["answers"], t["drafts"], t["drafted"], t["accepted"]) == (3, 15, 45, 12)
    assert t["tau"] == t["mean_acceptance_length"] == pytest.approx(1 + 12 / 15)
    assert t["accepted_per_pos"] == [9, 3, 0]
    assert t["acceptance_per_pos"] == pytest.approx([0.6, 0.2, 0.0])
    assert t["acceptance_rate"] == pytest.approx(12 / 45)
    assert t["tokens"] == {"baseline": 30, "speculative": 30}
    assert t["tokens_per_s"] == {"baseline": pytest.approx(50.0), "speculative": pytest.approx(100.0)}
    assert t["speedup"] == pytest.approx(2.0) and t["lossless"] is True and t["mismatches"] == []
    assert e["metrics"]["accepted"] == 12 and e["startup_s"] == {"plain_s": 1.5, "speculative_s": 1.5}
    # Two engines, one after the other: plain first, then the draft with k = --steps.
    plain, spec = _starts(tmp_path)
    assert plain["draft"] is None and spec["draft"] == str(Path(draft).resolve()) and spec["k"] == 3
    assert plain["model"] == spec["model"] == str(target) and spec["max_model_len"] == plain["max_model_len"] >= 1024
    assert spec["threads"] == 1 and spec["dtype"] is None and spec["kv_cache_gib"] == 1.0
    assert (out / "vllm-plain.log").exists() and (out / "vllm-spec.log").exists()
    assert "vLLM 0.32.0-fake: EAGLE-3, chain 3" in r.output and "12/45" in r.output and "0.600 0.200" in r.output


def test_eval_engine_vllm_only_mismatch_and_conversion(case, fake_python, tmp_path, monkeypatch):
    from eagle3cli.publish.formats.writers import convert

    target, draft, turns = case
    spec_dir, _ = convert(draft, tmp_path / "draft-speculators", to="speculators")
    monkeypatch.setenv("FAKE_VLLM_DIFFER", "1")
    out = tmp_path / "out"
    r = runner.invoke(app, _args(target, spec_dir, turns, out, fake_python, "--engine-only"))
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["tasks"] == {}  # our generator skipped
    e = res["engine"]
    assert e["tasks"]["mini"]["lossless"] is False and e["tasks"]["mini"]["mismatches"] == ["1", "2"]
    # A speculators-format draft is converted to ours (which vLLM's EAGLE-3 loader reads) under OUT.
    assert e["converted_from"]["format"] == "speculators" and e["draft"] == str((out / "vllm-draft").resolve())
    assert (out / "vllm-draft" / "config.json").exists()
    assert _starts(tmp_path)[1]["draft"] == e["draft"]


def test_eval_engine_vllm_errors_are_one_line(case, fake_python, tmp_path, monkeypatch):
    target, draft, turns = case
    out = tmp_path / "out"

    def run(*more, python=fake_python, tgt=target):
        r = runner.invoke(app, _args(tgt, draft, turns, out, python, *more))
        assert r.exit_code == 1, r.output
        errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and r.output.rstrip().endswith(errors[0].rstrip()), r.output  # one line, last
        return errors[0]

    assert "--vllm-python /nonexistent/python: no such interpreter" in run(python="/nonexistent/python")
    monkeypatch.setenv("FAKE_VLLM_VERSION", "")
    assert "vllm is not installed there" in run()
    monkeypatch.delenv("FAKE_VLLM_VERSION")
    assert "greedy decoding: drop --temperature" in run("--temperature", "0.7")
    # A target family vLLM 0.32 refuses for EAGLE-3 (engine_support): refused before anything runs.
    gemma = tmp_path / "gemma3"
    shutil.copytree(target, gemma)
    cfg = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**cfg, "architectures": ["Gemma3ForCausalLM"]}))
    msg = run(tgt=gemma)
    assert "vLLM 0.32.0 refuses EAGLE-3 for Gemma3ForCausalLM" in msg and "SupportsEagle3" in msg
    assert not (tmp_path / "starts.jsonl").exists()
    monkeypatch.setenv("FAKE_VLLM_FAIL", "start")
    assert "vLLM worker: vLLM did not start: ValueError: no draft" in run("--engine-only")
    r = runner.invoke(app, ["eval", "--model", str(target), "--draft", str(draft), "--engine-only"])
    assert r.exit_code == 1 and "--engine-only needs --engine llama.cpp or vllm" in r.output


def test_counter_arithmetic():
    before = {"drafts": 5.0, "draft_tokens": 15.0, "accepted_tokens": 4.0, "accepted_tokens_per_pos": [3.0, 1.0, 0.0]}
    after = {"drafts": 105.0, "draft_tokens": 315.0, "accepted_tokens": 54.0,
             "accepted_tokens_per_pos": [33.0, 16.0, 8.0]}
    s = summarize(delta(after, before))
    assert (s["drafts"], s["drafted"], s["accepted"]) == (100, 300, 50)
    assert s["mean_acceptance_length"] == pytest.approx(1.5) and s["accepted_per_pos"] == [30, 15, 8]
    assert s["acceptance_per_pos"] == pytest.approx([0.30, 0.15, 0.08])
    assert summarize({})["mean_acceptance_length"] is None  # nothing drafted: no rate, no division by zero
    assert delta({"drafts": 3.0}, {})["drafts"] == 3.0
    assert max_model_len(100, 64, 3) == 1024 and max_model_len(1500, 64, 3) == 1792
