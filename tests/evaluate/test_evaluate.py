"""`eagle3 eval` end to end on a tiny model, and the evaluation helpers."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.decode.generator import SpecOutput
from eagle3cli.evaluate.eval_config import EvalError
from eagle3cli.evaluate.tasks import load_task, load_turns_file
from eagle3cli.evaluate.tree_auto import choose_tree
from tests.helpers.evaluate import make_draft

runner = CliRunner()


@pytest.fixture(scope="module")
def turns_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "mini.jsonl"
    rows = [
        {"question_id": 7, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it rhyme."]},
        {"question_id": 8, "category": "math", "turns": ["What is 12 times 7?"]},
        {"question_id": 9, "category": "math", "turns": ["Name three prime numbers."]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_eval_writes_lossless_results(smol_tiny_dir, turns_file, tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    draft = make_draft(smol_tiny_dir, tmp_path / "draft")
    out = tmp_path / "out"
    r = runner.invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", "mini",
                            "--data", str(turns_file), "--out", str(out), "--max-new-tokens", "12",
                            "--tree", "6,3,2", "--baseline", "prompt-lookup"])
    assert r.exit_code == 0, r.output
    assert [ln.split(",")[0] for ln in r.output.splitlines() if ln.startswith("eval: ")] == \
        ["eval: 1/3 prompts (33%)", "eval: 2/3 prompts (67%)", "eval: 3/3 prompts (100%)"]  # one line a prompt in a log
    header = next(ln for ln in r.output.splitlines() if "task" in ln and "tau" in ln)
    assert "lookup tok/s" in header and "lossless" in header  # a log keeps the table's full width
    res = json.loads((out / "results.json").read_text())
    t = res["tasks"]["mini"]
    assert t["num_prompts"] == 3 and t["lossless"] is True and t["mismatches"] == []
    assert t["tau"] >= 1.0 and t["n_alpha"] is None
    tps = t["tokens_per_s"]
    assert set(tps) == {"baseline", "baseline_hf", "baseline_fast", "speculative", "prompt_lookup"}
    assert all(v > 0 for v in tps.values())
    # the tiny Llama takes the fast path; speedup is against the faster of the two plain decodings
    assert t["path"] == "fast" and tps["baseline"] == max(tps["baseline_hf"], tps["baseline_fast"])
    assert t["speedup"] == pytest.approx(tps["speculative"] / tps["baseline"])
    assert t["cycle_ratio"] > 0
    assert "verification path: fast" in r.output
    assert res["settings"]["mode"] == "tree" and res["settings"]["total_tokens"] == 6
    assert res["settings"]["depth"] == 3 and res["settings"]["top_k"] == 2
    assert res["target"] == str(smol_tiny_dir) and res["draft"] == str(draft)
    assert {c["category"] for c in res["per_category"]} == {"writing", "math"}
    assert (out / "results.png").stat().st_size > 1000


def test_eval_fast_off_runs_the_hf_path(smol_tiny_dir, turns_file, tmp_path):
    draft = make_draft(smol_tiny_dir, tmp_path / "draft")
    r = runner.invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", "mini",
                            "--data", str(turns_file), "--out", str(tmp_path / "o"), "--max-new-tokens", "8",
                            "--mode", "chain", "--steps", "2", "--fast", "off"])
    assert r.exit_code == 0, r.output
    t = json.loads((tmp_path / "o" / "results.json").read_text())["tasks"]["mini"]
    assert t["path"] == "hf" and t["lossless"] is True and t["tokens_per_s"]["baseline_fast"] is None
    assert t["tokens_per_s"]["baseline"] == t["tokens_per_s"]["baseline_hf"]


def test_eval_chain_reports_n_alpha(smol_tiny_dir, turns_file, tmp_path):
    draft = make_draft(smol_tiny_dir, tmp_path / "draft")
    out = tmp_path / "out"
    r = runner.invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", str(turns_file),
                            "--out", str(out), "--max-new-tokens", "8", "--mode", "chain", "--steps", "2",
                            "--limit", "2"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    t = res["tasks"]["mini"]
    assert t["num_prompts"] == 2 and t["lossless"] is True
    assert len(t["n_alpha"]) == 2
    packing = res["draft_packing"]  # a chain's steps are one row: timed as they run, or nothing packs here
    assert packing is None or (packing["rows"] == 1 and packing["ms"][packing["uses"]] == min(packing["ms"].values()))
    # the draft steps in bf16 where oneDNN packs bf16, beside a bf16 target or on a CPU that
    # multiplies bf16 in hardware (fast_draft.compute_dtype)
    from eagle3cli.core.hardware import has_bf16_matmul
    from eagle3cli.decode.fast_target import ONEDNN, Linear

    packs_bf16 = Linear.can_pack(torch.zeros(2, 2, dtype=torch.bfloat16), ONEDNN)
    bf16_draft = packs_bf16 and (res["target_dtype"] == "bfloat16" or has_bf16_matmul())
    assert res["draft_dtype"] == ("bfloat16" if bf16_draft else "float32")
    # and with int4 weights there (fast_draft.weights_for), the draft's every matmul fitting the kernel
    assert res["draft_weights"] == ("int4" if bf16_draft else "full")


def test_eval_draft_weights_int8_is_lossless_and_recorded(smol_tiny_dir, turns_file, tmp_path, monkeypatch):
    from eagle3cli.core import hardware

    monkeypatch.setattr(hardware, "has_bf16_matmul", lambda: False)  # the draft steps in fp32, as on AVX2
    draft = make_draft(smol_tiny_dir, tmp_path / "draft")
    out = tmp_path / "out"
    r = runner.invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", str(turns_file),
                            "--out", str(out), "--max-new-tokens", "8", "--mode", "chain", "--steps", "2",
                            "--limit", "2", "--draft-weights", "int8", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["draft_weights"] == "int8" and res["tasks"]["mini"]["lossless"] is True
    assert res["draft_dtype"] == "float32" and res["draft_packing"] is None  # all integer: nothing to pack
    # with fp32 inputs the integer kernels are slower than full weights: eval says so
    assert "integer kernels are slower than full weights" in " ".join(r.output.split())


def test_eval_tree_packs_the_drafts_levels_where_faster(smol_tiny_dir, turns_file, tmp_path):
    """A tree of 4-node levels: the draft's 4-row steps are timed unpacked and packed, the faster
    kept and recorded; the output stays the target's greedy one."""
    draft = make_draft(smol_tiny_dir, tmp_path / "draft")
    out = tmp_path / "out"
    r = runner.invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", "mini",
                            "--data", str(turns_file), "--out", str(out), "--max-new-tokens", "8", "--limit", "2",
                            "--tree", "10,3,4", "--dtype", "float32", "--draft-weights", "full"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    packed = res["draft_packing"]  # full weights: integer ones (auto on bf16 hardware) leave nothing to pack
    assert packed["rows"] == 4 and packed["uses"] in packed["ms"] and "none" in packed["ms"]
    assert packed["ms"][packed["uses"]] == min(packed["ms"].values())
    assert res["tasks"]["mini"]["lossless"] is True


def test_eval_tree_auto_picks_a_measured_tree(smol_tiny_dir, turns_file, tmp_path, monkeypatch):
    from eagle3cli.decode import fast_target

    built, packed = [], []
    init, repack = fast_target.Decoder.__init__, fast_target.Decoder.repack
    monkeypatch.setattr(fast_target.Decoder, "__init__",
                        lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1])
    monkeypatch.setattr(fast_target.Decoder, "repack", lambda self, rows: (packed.append(rows), repack(self, rows))[1])
    draft = make_draft(smol_tiny_dir, tmp_path / "draft")
    out = tmp_path / "out"
    r = runner.invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", "mini",
                            "--data", str(turns_file), "--out", str(out), "--max-new-tokens", "6", "--limit", "1",
                            "--tree", "auto", "--dtype", "float32"])  # fp32: what packs (auto: bf16 on AMX)
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    auto = res["settings"]["tree_auto"]
    assert 1 <= auto["total_tokens"] <= 64 and 1 <= auto["depth"] <= 8
    assert (res["settings"]["total_tokens"], res["settings"]["depth"]) == (auto["total_tokens"], auto["depth"])
    assert set(auto["latency_ms"]) == {"1", "2", "4", "8", "12", "16", "24", "32", "48", "64"}
    assert auto["latency_path"] == res["tasks"]["mini"]["path"] == "fast"  # the curve of the path that runs
    assert res["tasks"]["mini"]["lossless"] is True
    # One fused copy of the target's weights: timed size by size, then packed the fastest measured
    # way for the chosen tree (fast_tuning.tune_packing).
    tuned = res["fast_packing"]
    assert tuned["rows"] == auto["total_tokens"] + 1 and len(built) == 1
    assert packed[-1] == tuple(tuned["packing"])
    assert tuned["packed_for"] is None or tuned["packed_for"] in tuned["ms"]
    assert tuned["one_row"]["uses"] in tuned["one_row"]["ms"]
    assert set(tuned["ms"]) <= {"none", str(tuned["rows"]), str(-(-tuned["rows"] // 4) * 4), "onednn", "native"}
    # one row: as the verification's packing serves it, and each one-row kernel it lacks beside it
    from eagle3cli.decode import native

    kernels = {"1", "onednn"} | ({"native"} if native.available() else set())
    kept = {tuned["packed_for"], *map(str, tuned["packing"])}  # what the verification's packing already holds
    assert "onednn" in tuned["ms"] and set(tuned["one_row"]["ms"]) >= kernels - kept


def test_eval_dtype_auto_takes_bf16_on_amx_cpus_for_greedy_fast_verification(monkeypatch):
    from eagle3cli.core import hardware
    from eagle3cli.evaluate.eval_config import EvalConfig
    from eagle3cli.evaluate.fast_setup import eval_dtype
    from eagle3cli.model.target import TargetSpec

    greedy = EvalConfig(tasks=["mt_bench"])
    monkeypatch.setattr(hardware, "has_amx_bf16", lambda: True)
    assert eval_dtype(TargetSpec(model="m", device="cpu"), greedy) == "bfloat16"
    assert eval_dtype(TargetSpec(model="m", device="cpu", dtype="float32"), greedy) == "float32"  # asked for
    assert eval_dtype(TargetSpec(model="m", device="cpu"), EvalConfig(tasks=[], fast="off")) == "auto"
    assert eval_dtype(TargetSpec(model="m", device="cpu"), EvalConfig(tasks=[], temperature=0.7)) == "auto"
    assert eval_dtype(TargetSpec(model="m", device="cpu", load_in_8bit=True), greedy) == "auto"
    # a target the fast path does not take verifies on the HF forward, not row-invariant in bf16
    from transformers import LlamaConfig, MistralConfig

    assert eval_dtype(TargetSpec(model="m", device="cpu"), greedy, LlamaConfig()) == "bfloat16"
    windowed = MistralConfig(sliding_window=8, use_sliding_window=True)
    windowed.use_sliding_window = True
    assert eval_dtype(TargetSpec(model="m", device="cpu"), greedy, windowed) == "auto"
    monkeypatch.setattr(hardware, "has_amx_bf16", lambda: False)
    assert eval_dtype(TargetSpec(model="m", device="cpu"), greedy) == "auto"


def test_eval_bf16_is_checked_then_held_to_plain_decoding_on_its_forward(smol_tiny_dir, turns_file, tmp_path):
    """--dtype bfloat16: where the check shows a verification decodes bitwise as one token does,
    speculative output is compared with plain decoding on that forward (HF's own bf16 forward is
    not row-invariant); where it does not, eval refuses in one line before any prompt runs."""
    from eagle3cli.decode.fast_target import FastTarget
    from eagle3cli.decode.fast_tuning import row_invariant
    from eagle3cli.model.target import TargetSpec, load_target

    exact = row_invariant(FastTarget(load_target(TargetSpec(model=str(smol_tiny_dir), dtype="bfloat16")), 64), 7)
    draft = make_draft(smol_tiny_dir, tmp_path / "draft")
    out = tmp_path / "out"
    r = runner.invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", "mini",
                            "--data", str(turns_file), "--out", str(out), "--max-new-tokens", "12",
                            "--tree", "6,3,2", "--dtype", "bfloat16"])
    if not exact:
        assert r.exit_code != 0 and "use --dtype float32" in r.output and not (out / "results.json").exists()
        return
    assert r.exit_code == 0, r.output
    assert "7-row verification is bitwise one-token decoding here (checked)" in r.output
    res = json.loads((out / "results.json").read_text())
    assert res["target_dtype"] == "bfloat16" and res["lossless_reference"] == "fast plain decoding"
    t = res["tasks"]["mini"]
    assert t["path"] == "fast" and t["lossless"] is True and t["mismatches"] == [] and t["num_prompts"] == 3
    assert set(t["fast_differs_from_hf"]) <= {"7/turn1", "7/turn2", "8", "9"}


def test_eval_dtype_auto_falls_back_to_fp32_when_bf16_is_not_exact(smol_tiny_dir, turns_file, tmp_path, monkeypatch):
    from eagle3cli.core import hardware
    from eagle3cli.decode import fast_tuning

    monkeypatch.setattr(hardware, "has_amx_bf16", lambda: True)
    monkeypatch.setattr(fast_tuning, "row_invariant", lambda fast, rows, **kw: False)
    draft = make_draft(smol_tiny_dir, tmp_path / "draft")
    out = tmp_path / "out"
    r = runner.invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", "mini",
                            "--data", str(turns_file), "--out", str(out), "--max-new-tokens", "8",
                            "--mode", "chain", "--steps", "2", "--limit", "1"])
    assert r.exit_code == 0, r.output
    assert "--dtype auto: bfloat16" in r.output and "--dtype auto falls back to float32" in r.output
    res = json.loads((out / "results.json").read_text())
    assert res["target_dtype"] == "float32" and res["lossless_reference"] == "hf generate"
    assert res["tasks"]["mini"]["lossless"] is True and res["tasks"]["mini"]["fast_differs_from_hf"] == []


def test_eval_rejects_mismatched_draft(smol_tiny_dir, turns_file, tmp_path):
    draft = make_draft(smol_tiny_dir, tmp_path / "draft", hidden=32)  # target hidden is 64
    r = runner.invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", "mini",
                            "--data", str(turns_file), "--out", str(tmp_path / "out")])
    assert r.exit_code == 1
    assert "does not fit this target" in r.output and "hidden" in r.output
    assert not (tmp_path / "out" / "results.json").exists()


def test_eval_reports_prompts_longer_than_context(tmp_path, turns_file):
    from tests.helpers.tiny import SMOLLM2_TOKENIZER, save_tiny

    target = save_tiny(tmp_path / "t", "llama", tokenizer_dir=SMOLLM2_TOKENIZER, max_position_embeddings=96)
    draft = make_draft(target, tmp_path / "draft")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"question_id": "big", "turns": ["word " * 200]}) + "\n"
                    + turns_file.read_text().splitlines()[1] + "\n")
    out = tmp_path / "out"
    r = runner.invoke(app, ["eval", "--model", str(target), "--draft", str(draft), "--task", str(long),
                            "--out", str(out), "--max-new-tokens", "4", "--tree", "4,2,2"])
    assert r.exit_code == 0, r.output
    t = json.loads((out / "results.json").read_text())["tasks"]["long"]
    assert t["num_prompts"] == 1
    assert len(t["errors"]) == 1 and "big" in t["errors"][0] and "context of 96" in t["errors"][0]


def test_turns_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["hi"]}\n{"question_id": 2}\n')
    with pytest.raises(EvalError, match=r"bad.jsonl:2: expected a record with a non-empty 'turns'"):
        load_turns_file(bad)
    with pytest.raises(EvalError, match="unknown task"):
        load_task("nonsense")
    with pytest.raises(EvalError) as e:  # offline: the Hub is unreachable in tests
        load_task("gsm8k")
    assert "gsm8k" in str(e.value) and "--prompts FILE" in str(e.value)  # the task, and what to pass instead
    assert [p.id for p in load_turns_file(bad.parent / "bad.jsonl", limit=1)] == ["1"]


def test_choose_tree_prefers_small_trees_when_verification_is_expensive():
    # Calibration: 4 cycles; the accepted path's EAGLE-2 ranks, and depths of candidates in rank order.
    depths = [1, 1, 2, 1, 2, 3, 2, 3, 4, 4]
    o = SpecOutput(tokens=[], prompt_len=1, accept_lengths=[4] * 4, drafted=[4] * 4, forwards=4)
    o.accepted_ranks = [[1, 3, 6]] * 4  # path nodes at depth 1, 2, 3 with ranks 1, 3, 6
    o.rank_depths = [depths] * 4
    o.times = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "bookkeeping": 0.0}
    flat = {1: 1.0, 64: 1.0}  # verification costs the same for any size: take the whole path
    best = choose_tree([o], flat, max_total=10, max_depth=4)
    assert best["tau"] == 4 and best["total_tokens"] == 6 and best["depth"] == 3
    steep = {1: 1.0, 2: 1.5, 64: 100.0}  # each extra node is expensive: a chain of 1
    best = choose_tree([o], steep, max_total=10, max_depth=4)
    assert (best["total_tokens"], best["depth"], best["tau"]) == (1, 1, 2)


def test_mt_bench_falls_back_to_the_bundled_questions_offline():
    """No Hub here (HF_HUB_OFFLINE): mt_bench still loads, from the copy shipped in the package."""
    from eagle3cli.evaluate.eval_config import EvalError
    from eagle3cli.evaluate.tasks import load_task

    task, prompts = load_task("mt_bench", limit=3)
    assert task == "mt_bench" and [p.id for p in prompts] == ["81", "82", "83"]
    assert all(len(p.turns) == 2 for p in prompts) and prompts[0].category == "writing"
    with pytest.raises(EvalError, match="pass --prompts FILE"):
        load_task("gsm8k", limit=1)  # not bundled: one clear line
