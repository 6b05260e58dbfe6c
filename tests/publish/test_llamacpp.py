"""llama.cpp: the EAGLE-3 GGUF export and `eagle3 eval --engine llama.cpp` (against a fake llama-server).

Nothing here builds llama.cpp. The converter comparison runs only where $EAGLE3_LLAMA_CPP names
a llama.cpp source tree (benchmarks/build_llamacpp.sh prints one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from eagle3cli.cli import app

gguf = pytest.importorskip("gguf")

from tests.helpers.evaluate import engine_case as eval_engine_case  # noqa: E402
from tests.helpers.evaluate import engine_eval_args, fake_llama_bin, python_wrapper  # noqa: E402
from tests.helpers.evaluate import make_draft as make_eval_draft  # noqa: E402
from tests.helpers.gguf import CHAT, write_tiny_gguf  # noqa: E402

runner = CliRunner()
FAKE = Path(__file__).resolve().parents[1] / "helpers" / "fake_llama_server.py"

# the tiny target of write_tiny_gguf: 2 layers, hidden 32, 4 heads (2 KV), 262 tokens
H, NH, NKV, HD, V, DV = 32, 4, 2, 8, 262, 64


def tiny_draft(path: Path, seed=0) -> Path:
    from eagle3cli.model.draft import DraftConfig, Eagle3Draft
    from eagle3cli.publish.export import save_draft

    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=NH, num_key_value_heads=NKV,
                      head_dim=HD, rms_norm_eps=1e-5, vocab_size=V, draft_vocab_size=DV, target_hidden_size=H,
                      max_position_embeddings=256, aux_layer_ids=(0, 1, 2),
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    d = Eagle3Draft(cfg)
    d.init_weights(seed=seed)
    d.set_vocab(torch.arange(0, V, 4)[:DV])
    return save_draft(d, path, dtype=torch.float32)


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tgt") / "target.gguf")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return tiny_draft(tmp_path_factory.mktemp("draft") / "draft")


EXPECTED_TENSORS = {
    "fc.weight": (3 * H, H), "blk.0.attn_norm.weight": (H,), "blk.0.attn_norm_2.weight": (H,),
    "blk.0.ffn_norm.weight": (H,), "blk.0.attn_q.weight": (2 * H, NH * HD), "blk.0.attn_k.weight": (2 * H, NKV * HD),
    "blk.0.attn_v.weight": (2 * H, NKV * HD), "blk.0.attn_output.weight": (NH * HD, H),
    "blk.0.ffn_gate.weight": (H, 64), "blk.0.ffn_up.weight": (H, 64), "blk.0.ffn_down.weight": (64, H),
    "output_norm.weight": (H,), "output.weight": (H, DV), "d2t": (DV,),
}  # shapes as ggml's ne (reversed from torch)


@pytest.mark.parametrize("outtype,matrix_type", [("f32", "F32"), ("f16", "F16"), ("q8_0", "Q8_0")])
def test_draft_gguf_keys_and_tensors(draft_dir, target_gguf, tmp_path, outtype, matrix_type):
    from eagle3cli.publish.export import read_tensors
    from eagle3cli.publish.gguf_export import _permute, read_gguf_summary, write_draft_gguf

    out = write_draft_gguf(draft_dir, target_gguf, tmp_path / f"d-{outtype}.gguf", outtype)
    got = read_gguf_summary(out)
    k = got["keys"]
    assert k["general.architecture"] == "eagle3"
    assert k["eagle3.target_layers"] == [0, 1, 2]  # "input of decoder layer j": our ids unchanged
    assert k["eagle3.target_hidden_size"] == H and k["eagle3.block_count"] == 1
    assert (k["eagle3.embedding_length"], k["eagle3.feed_forward_length"]) == (H, 64)
    assert (k["eagle3.attention.head_count"], k["eagle3.attention.head_count_kv"]) == (NH, NKV)
    assert (k["eagle3.attention.key_length"], k["eagle3.rope.dimension_count"]) == (HD, HD)
    assert k["eagle3.rope.freq_base"] == 100000.0 and k["eagle3.vocab_size"] == V
    assert k["eagle3.norm_before_residual"] is False and k["eagle3.norm_before_fc"] is False
    assert k["general.file_type"] == {"f32": 0, "f16": 1, "q8_0": 7}[outtype]
    assert not any(name.startswith("rope") or "scaling" in name for name in k)  # plain RoPE: no scaling keys
    tgt = read_gguf_summary(target_gguf)["keys"]
    tok_keys = sorted(n for n in tgt if n.startswith("tokenizer."))
    assert sorted(n for n in k if n.startswith("tokenizer.")) == tok_keys and len(tok_keys) >= 8
    assert all(k[n] == tgt[n] for n in tok_keys) and k["tokenizer.chat_template"] == CHAT

    assert {n: shape for n, (_, shape) in got["tensors"].items()} == EXPECTED_TENSORS
    types = {n: t for n, (t, _) in got["tensors"].items()}
    assert types["d2t"] == "I64"
    assert {types[n] for n in EXPECTED_TENSORS if n.endswith("norm.weight") or "_norm" in n} == {"F32"}
    assert {types[n] for n in ("fc.weight", "blk.0.attn_q.weight", "output.weight", "blk.0.ffn_down.weight")} \
        == {matrix_type}

    ours = read_tensors(draft_dir)
    r = gguf.GGUFReader(str(out))
    t = {x.name: np.array(x.data) for x in r.tensors}
    ids = torch.arange(0, V, 4)[:DV].numpy()
    assert np.array_equal(t["d2t"], ids)  # absolute target ids, not our offsets
    if outtype == "f32":
        assert np.array_equal(t["blk.0.attn_q.weight"], _permute(ours["midlayer.self_attn.q_proj.weight"], NH).numpy())
        assert np.array_equal(t["blk.0.attn_k.weight"], _permute(ours["midlayer.self_attn.k_proj.weight"], NKV).numpy())
        assert np.array_equal(t["blk.0.attn_v.weight"], ours["midlayer.self_attn.v_proj.weight"].numpy())
        assert np.array_equal(t["output.weight"], ours["lm_head.weight"].numpy())


def test_permute_matches_rotate_half_to_interleaved():
    from eagle3cli.publish.gguf_export import _permute

    # one head of dim 4: HF rows (x0, x1 | y0, y1) pair x_i with y_i; llama.cpp wants x0 y0 x1 y1
    w = torch.tensor([[0.0], [1.0], [10.0], [11.0]])
    assert _permute(w, 1).flatten().tolist() == [0.0, 10.0, 1.0, 11.0]


def test_export_gguf_cli(draft_dir, target_gguf, tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE3_LLAMA_CPP", raising=False)
    r = runner.invoke(app, ["export-gguf", str(draft_dir), "--target-gguf", str(target_gguf), "-o", str(tmp_path),
                            "--outtype", "f32", "--outtype", "q8_0"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft-f32.gguf", "draft-q8_0.gguf"]
    assert f"llama-server -m {target_gguf} -md {tmp_path / 'draft-f32.gguf'} --spec-type draft-eagle3" in r.output
    # no converter and no target GGUF: one line that says what to pass
    r = runner.invoke(app, ["export-gguf", str(draft_dir), "--target", str(tmp_path), "-o", str(tmp_path / "x"),
                            "--llama-cpp", str(tmp_path)])
    assert r.exit_code == 1
    assert "convert_hf_to_gguf.py not found" in r.output and "build_llamacpp.sh" in r.output


def test_target_gguf_of_another_model_is_refused(draft_dir, tmp_path):
    from eagle3cli.publish.gguf_export import GGUFExportError, write_draft_gguf

    cfg = json.loads((draft_dir / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    for f in draft_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    with pytest.raises(GGUFExportError, match="has 262 tokens, the draft's target 300"):
        write_draft_gguf(other, write_tiny_gguf(tmp_path / "t.gguf"), tmp_path / "o.gguf")


@pytest.mark.skipif(not os.environ.get("EAGLE3_LLAMA_CPP"), reason="needs llama.cpp sources ($EAGLE3_LLAMA_CPP)")
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_converter_writes_what_we_write(smol_tiny_dir, tmp_path, outtype):
    """llama.cpp's own converter (through our shim) and write_draft_gguf give the same file content."""
    from eagle3cli.publish.gguf_export import (
        convert_target,
        find_converter,
        read_gguf_summary,
        run_converter,
        write_draft_gguf,
    )

    if find_converter() is None:
        pytest.skip("no convert_hf_to_gguf.py under $EAGLE3_LLAMA_CPP")
    draft = make_eval_draft(smol_tiny_dir, tmp_path / "draft")
    target_gguf, warnings = convert_target(smol_tiny_dir, tmp_path / "t.gguf", "f32")
    assert warnings == []  # in particular no "Unknown RoPE type: default"
    conv, warnings = run_converter(draft, tmp_path / "c.gguf", outtype, target_dir=smol_tiny_dir)
    assert warnings == []
    ours = write_draft_gguf(draft, target_gguf, tmp_path / "n.gguf", outtype)
    a, b = read_gguf_summary(conv), read_gguf_summary(ours)
    assert a["tensors"] == b["tensors"]
    skip = {"general.name", "general.size_label"}
    assert ({k: v for k, v in a["keys"].items() if k not in skip}
            == {k: v for k, v in b["keys"].items() if k not in skip})
    ra, rb = gguf.GGUFReader(str(conv)), gguf.GGUFReader(str(ours))
    for x, y in zip(sorted(ra.tensors, key=lambda t: t.name), sorted(rb.tensors, key=lambda t: t.name)):
        assert np.array_equal(np.array(x.data), np.array(y.data)), x.name


# ---------------------------------------------------------------- eval --engine llama.cpp (fake server)

@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    return fake_llama_bin(tmp_path, monkeypatch)


@pytest.fixture
def engine_case(smol_tiny_dir, tmp_path):
    (tmp_path / "t.gguf").write_bytes(b"GGUF")
    (tmp_path / "d.gguf").write_bytes(b"GGUF")
    return eval_engine_case(smol_tiny_dir, tmp_path)


def _engine_args(target, draft, turns, out, fake_bin, *more):
    return engine_eval_args(target, draft, turns, out, "llama.cpp", "--llama-cpp", str(fake_bin),
                            "--target-gguf", str(out.parent / "t.gguf"), "--draft-gguf", str(out.parent / "d.gguf"),
                            "--engine-threads", "2", *more)


def test_eval_engine_llamacpp_reads_the_servers_counts(engine_case, fake_bin, tmp_path):
    target, draft, turns = engine_case
    out = tmp_path / "out"
    r = runner.invoke(app, _engine_args(target, draft, turns, out, fake_bin))
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["tasks"]["mini"]["num_prompts"] == 2  # our own generator ran too
    e = res["engine"]
    assert e["name"] == "llama.cpp" and e["settings"]["spec_draft_n_max"] == 3
    t = e["tasks"]["mini"]
    # 3 answers (2 + 1 turns) of 10 tokens; each: 4 accepted, 5 target steps of 3 drafts
    assert (t["answers"], t["accepted"], t["drafted"], t["decode_steps"]) == (3, 12, 45, 15)
    assert t["verify_steps"] == 15  # /metrics deltas: the warm-up answer is not counted
    assert t["tau"] == pytest.approx(27 / 15) and t["tau_metrics"] == pytest.approx(1 + 12 / 15)
    assert t["acceptance_rate"] == pytest.approx(12 / 45)
    assert t["tokens_per_s"] == {"baseline": pytest.approx(50.0), "speculative": pytest.approx(100.0)}
    assert t["speedup"] == pytest.approx(2.0) and t["lossless"] is True and t["mismatches"] == []
    assert e["metrics"]["spec_decode_num_accepted_tokens_total"] == 12
    starts = [json.loads(ln) for ln in (tmp_path / "args.jsonl").read_text().splitlines()]
    # llama.cpp's plain decoding as eval's baseline, then the engine's plain and speculative servers
    assert len(starts) == 3 and "-md" not in starts[0] and "-md" not in starts[1]
    spec = starts[2]
    assert spec[spec.index("-md") + 1] == str(tmp_path / "d.gguf")
    assert spec[spec.index("--spec-type") + 1] == "draft-eagle3" and spec[spec.index("--spec-draft-n-max") + 1] == "3"
    assert spec[spec.index("-t") + 1] == "2" and spec[spec.index("--spec-draft-p-min") + 1] == "0.0"
    assert "llama.cpp: draft-eagle3, chain 3" in r.output and "12/45" in r.output


def test_eval_engine_only_and_mismatch(engine_case, fake_bin, tmp_path, monkeypatch):
    target, draft, turns = engine_case
    monkeypatch.setenv("FAKE_LLAMA_DIFFER", "1")
    out = tmp_path / "out"
    r = runner.invoke(app, _engine_args(target, draft, turns, out, fake_bin, "--engine-only"))
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["tasks"] == {}  # our generator skipped
    assert res["engine"]["tasks"]["mini"]["lossless"] is False
    assert res["engine"]["tasks"]["mini"]["mismatches"] == ["1", "2"]


def test_eval_engine_errors_are_one_line(engine_case, tmp_path, monkeypatch, fake_bin):
    target, draft, turns = engine_case
    monkeypatch.setenv("PATH", "/nonexistent")
    r = runner.invoke(app, ["eval", "--model", str(target), "--draft", str(draft), "--engine", "llama.cpp",
                            "--llama-cpp", str(tmp_path / "nowhere")])
    assert r.exit_code == 1
    assert "llama-server not found" in r.output and "benchmarks/build_llamacpp.sh" in r.output
    out = tmp_path / "out"
    (tmp_path / "d.gguf").unlink()
    r = runner.invoke(app, _engine_args(target, draft, turns, out, fake_bin, "--engine-only"))
    assert r.exit_code == 1 and "d.gguf: no such GGUF file" in r.output


# ---------------------------------------------------------------- push --gguf and the card

@pytest.fixture(autouse=False)
def this_checkouts_template(monkeypatch):
    # An editable install maps eagle3cli.templates to the checkout it was installed from, which
    # may be another worktree: render the card from the template beside these tests.
    from eagle3cli.publish import model_card

    here = Path(__file__).resolve().parents[2] / "templates"
    monkeypatch.setattr(model_card, "template_text", lambda name=model_card.TEMPLATE: (here / name).read_text())

def test_push_dry_run_with_gguf(draft_dir, target_gguf, tmp_path, monkeypatch, this_checkouts_template):
    from huggingface_hub import ModelCard

    from eagle3cli.publish.gguf_export import read_gguf_summary

    monkeypatch.delenv("EAGLE3_LLAMA_CPP", raising=False)
    args = ["push", str(draft_dir), "--repo", "me/tiny-eagle3", "--base-model", "me/tiny", "--dry-run",
            str(tmp_path / "repo"), "--gguf", "q8_0", "--target-gguf", str(target_gguf)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    repo = tmp_path / "repo"
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "config.json", "draft-q8_0.gguf",
                                                      "eagle3_training.json", "model.safetensors"]
    assert read_gguf_summary(repo / "draft-q8_0.gguf")["tensors"]["fc.weight"] == ("Q8_0", (3 * H, H))
    card = ModelCard.load(repo / "README.md").text
    assert "hf download me/tiny-eagle3 draft-q8_0.gguf --local-dir .\n" \
           "llama-server -m TARGET.gguf -md draft-q8_0.gguf --spec-type draft-eagle3 --spec-draft-n-max 3" in card
    r = runner.invoke(app, args)  # an earlier dry run with a GGUF in it is replaced, not refused
    assert r.exit_code == 0 and "replacing the earlier dry run" in r.output, r.output
    r = runner.invoke(app, args[:-4] + ["--gguf", "q4"], env={"COLUMNS": "1000"})
    said = " ".join(r.output.replace("│", " ").split())  # the parser's box, its wrapping undone
    assert r.exit_code == 2 and "--gguf" in said and "'q4'" in said, r.output
    assert all(f"'{t}'" in said for t in ("f32", "f16", "bf16", "q8_0")), r.output  # the choices it names


def test_card_shows_engine_rows(draft_dir, tmp_path, this_checkouts_template):
    from eagle3cli.publish.export import read_config
    from eagle3cli.publish.model_card import eval_rows, render_card

    res = {"hardware": "CPU", "settings": {"mode": "chain", "steps": 3}, "tasks": {},
           "engine": {"name": "llama.cpp", "settings": {"spec_type": "draft-eagle3", "spec_draft_n_max": 3,
                                                        "threads": 2},
                      "tasks": {"mt_bench": {"num_prompts": 20, "tau": 1.4567, "speedup": 0.81, "lossless": True,
                                             "tokens_per_s": {"baseline": 36.04, "speculative": 29.2}}}}}
    (row,) = eval_rows([res])
    assert (row["task"], row["tau"], row["speedup"], row["tokens_per_s"]) == \
        ("mt_bench (llama.cpp)", "1.46", "0.81×", "36.0 → 29.2")
    assert row["settings"] == "llama.cpp draft-eagle3, chain 3, threads 2"
    card = render_card(read_config(draft_dir), "me/x", "me/tiny", [res]).text
    assert "hf download me/x --local-dir draft && eagle3 export-gguf draft" in card
    assert "| mt_bench (llama.cpp) | 20 | 1.46 |" in card


# ---------------------------------------------------------------- llama.cpp's plain decoding as eval's baseline

def _baseline_args(target, draft, turns, out, fake_bin):
    return ["eval", "--model", str(target), "--draft", str(draft), "--task", "mini", "--prompts", str(turns),
            "--out", str(out), "--max-new-tokens", "16", "--mode", "chain", "--steps", "3",
            "--llama-cpp", str(fake_bin), "--target-gguf", str(out.parent / "t.gguf")]


@pytest.mark.parametrize("speed", [1e6, 1.0])
def test_eval_speedup_is_against_the_faster_of_ours_and_llamacpp(engine_case, fake_bin, tmp_path, monkeypatch, speed):
    """Where llama.cpp is installed, eval times its plain decoding of the target on every turn beside
    ours, and the speedup is against the fastest plain decoding (the fake reports 10 tokens an answer
    in (prompt tokens x 1 ms + 200 ms) / speed)."""
    target, draft, turns = engine_case
    monkeypatch.setenv("FAKE_LLAMA_SPEED", str(speed))
    out = tmp_path / "out"
    r = runner.invoke(app, _baseline_args(target, draft, turns, out, fake_bin))
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    t = res["tasks"]["mini"]
    tps = t["tokens_per_s"]
    starts = [json.loads(ln) for ln in (tmp_path / "args.jsonl").read_text().splitlines()]
    assert len(starts) == 1 and "-md" not in starts[0]  # one plain server, no engine run
    assert starts[0][starts[0].index("-t") + 1] == str(torch.get_num_threads())
    assert res["plain_engine"]["name"] == "llama.cpp" and res["plain_engine"]["target_gguf"] == str(tmp_path / "t.gguf")
    # 3 answers of 10 tokens; prompts of some tens of tokens: 30 tokens over 600 ms and more, / speed
    assert 30 / (0.6 + 0.003 * 3 * 200) * speed < tps["baseline_llamacpp"] < 30 / 0.6 * speed
    ours = max(tps["baseline_hf"], tps["baseline_fast"])
    assert tps["baseline"] == max(ours, tps["baseline_llamacpp"])
    assert t["speedup"] == pytest.approx(tps["speculative"] / tps["baseline"])
    if speed > 1:  # llama.cpp decodes faster than our plain decoding: the speedup is against it
        assert t["baseline_from"] == "llamacpp" and tps["baseline"] == tps["baseline_llamacpp"]
        assert t["speedup"] < tps["speculative"] / ours
    else:  # 50 tokens/s at most: slower than the tiny model on our fast path
        assert t["baseline_from"] in ("fast", "hf") and tps["baseline"] == ours
    assert "plain llama.cpp tok/s" in r.output
    assert ("(llama.cpp)" in r.output) == (speed > 1)


def test_eval_without_llamacpp_says_so_and_records_none(engine_case, tmp_path, monkeypatch):
    target, draft, turns = engine_case
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("EAGLE3_LLAMA_CPP", raising=False)
    out = tmp_path / "out"
    args = _baseline_args(target, draft, turns, out, tmp_path / "nowhere")
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["plain_engine"] is None and "baseline_llamacpp" not in res["tasks"]["mini"]["tokens_per_s"]
    assert res["tasks"]["mini"]["baseline_from"] in ("fast", "hf")
    assert "llama.cpp not found" in r.output and "plain llama.cpp tok/s" not in r.output


# ---------------------------------------------------------------- the [llamacpp] extra

def test_missing_converter_module_names_the_extra(engine_case, fake_bin, tmp_path, monkeypatch):
    """No sentencepiece (a fresh install without the extra): one line naming the extra, before any
    model is loaded; a converter that fails on an import names it too."""
    import importlib.util

    import tomllib

    from eagle3cli.evaluate import llamacpp
    from eagle3cli.publish import gguf_export

    target, draft, turns = engine_case
    src = tmp_path / "llama.cpp"
    src.mkdir()
    (src / "convert_hf_to_gguf.py").write_text("raise SystemExit('not run in this test')\n")
    (src / "llama-server").symlink_to(fake_bin / "llama-server")
    real = importlib.util.find_spec
    present = {mod for mod, _ in llamacpp.CONVERTER_MODULES} - {"sentencepiece"}  # whatever this venv has

    def find_spec(name, *a):
        return None if name == "sentencepiece" else (object() if name in present else real(name, *a))

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    loads = []
    monkeypatch.setattr("eagle3cli.model.target.load_target", lambda *a, **k: loads.append(a))
    r = runner.invoke(app, ["eval", "--model", str(target), "--draft", str(draft), "--engine", "llama.cpp",
                            "--llama-cpp", str(src), "--out", str(tmp_path / "out")])
    assert r.exit_code == 1 and loads == []
    line = r.output.strip().splitlines()[-1]
    assert "sentencepiece" in line and 'pip install "eagle3[llamacpp]"' in line
    assert llamacpp.missing_modules() == ["sentencepiece"]
    monkeypatch.setattr(importlib.util, "find_spec", real)

    def no_module(*a, **k):
        raise gguf_export.GGUFExportError("convert_hf_to_gguf.py failed on T (exit 1): "
                                          "ModuleNotFoundError: No module named 'sentencepiece'")

    monkeypatch.setattr(gguf_export, "convert_target", no_module)
    with pytest.raises(llamacpp.LlamaCppError,
                       match=r"No module named 'sentencepiece': pip install \"eagle3\[llamacpp\]\""):
        llamacpp.engine_files(draft, str(target), tmp_path / "g", llama_cpp=src)
    # the extra brings every module the converter imports
    extra = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    names = {req.split(">")[0].split("=")[0] for req in extra["project"]["optional-dependencies"]["llamacpp"]}
    assert {pip for _, pip in llamacpp.CONVERTER_MODULES + llamacpp.GGUF_MODULES} <= names


def test_card_takes_the_fastest_lossless_llamacpp_setting(draft_dir, this_checkouts_template):
    """Several eval --engine llama.cpp runs (one per setting): the card's llama-server command gets
    the fastest lossless one's chain length, p-min and draft file, and says what it measured."""
    from eagle3cli.publish.export import read_config
    from eagle3cli.publish.model_card import best_llamacpp, render_card

    def run(n_max, p_min, draft, speedups, lossless=True):
        tasks = {f"t{i}": {"num_prompts": 5, "tau": 1.5, "speedup": sp, "lossless": lossless,
                           "tokens_per_s": {"baseline": 40.0, "speculative": 40.0 * sp}}
                 for i, sp in enumerate(speedups)}
        return {"hardware": "CPU X", "settings": {}, "tasks": {},
                "engine": {"name": "llama.cpp", "draft_gguf": f"/tmp/g/{draft}", "tasks": tasks,
                           "settings": {"spec_type": "draft-eagle3", "spec_draft_n_max": n_max,
                                        "spec_draft_p_min": p_min, "threads": 2}}}

    results = [run(1, 0.0, "draft-f32.gguf", [1.05, 1.07]), run(3, 0.0, "draft-q8_0.gguf", [1.5, 1.4], lossless=False),
               run(2, 0.5, "draft-q8_0.gguf", [1.10, 1.16]), {"tasks": {}}]
    best = best_llamacpp(results)
    assert best["settings"]["spec_draft_n_max"] == 2 and best["speedup"] == pytest.approx(1.13)
    card = render_card(read_config(draft_dir), "me/x", "me/tiny", results,
                       gguf_files=["draft-f32.gguf", "draft-q8_0.gguf"]).text
    assert ("llama-server -m TARGET.gguf -md draft-q8_0.gguf --spec-type draft-eagle3 --spec-draft-n-max 2 "
            "--spec-draft-p-min 0.5\n# the fastest lossless setting eagle3 eval --engine llama.cpp measured: "
            "1.13x plain llama-server (CPU X)") in card
    assert best_llamacpp([results[1]]) is None  # not lossless: nothing to recommend
    plain = render_card(read_config(draft_dir), "me/x", "me/tiny", [results[1]], gguf_files=["draft-f32.gguf"]).text
    assert "-md draft-f32.gguf --spec-type draft-eagle3 --spec-draft-n-max 3\n```" in plain


FAKE_CONVERTER = """import sys
out = sys.argv[sys.argv.index("--outfile") + 1]
open(out, "wb").write(b"GGUF")
"""


def test_quickstart_measures_llamacpp_beside_ours(smol_tiny_dir, tmp_path, monkeypatch):
    """With llama.cpp installed ($EAGLE3_LLAMA_CPP: a fake llama-server and converter), the
    quickstart's eval converts the target once into the cache, times llama.cpp's plain decoding
    beside ours, takes the speedup against the faster, and its table names both."""
    from eagle3cli.commands.quickstart import plain_decoding
    from eagle3cli.evaluate.llamacpp import missing_modules
    from eagle3cli.workflows.quickstart import QuickstartOptions, run
    from tests.helpers.quickstart import write_prompts

    if missing_modules():
        pytest.skip(f"no {', '.join(missing_modules())}: the baseline is skipped without the [llamacpp] extra")
    src = tmp_path / "llama.cpp"
    python_wrapper(src / "llama-server", FAKE)
    (src / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    monkeypatch.setenv("EAGLE3_LLAMA_CPP", str(src))
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_LLAMA_SPEED", "1e6")  # llama.cpp reports far faster decoding than ours
    monkeypatch.setenv("FAKE_LLAMA_ARGS", str(tmp_path / "args.jsonl"))
    threads = torch.get_num_threads()
    out = tmp_path / "qs"
    write_prompts(out / "prompts.jsonl")
    opts = QuickstartOptions(out=out, model=str(smol_tiny_dir), samples=8, steps=2, max_new_tokens=8,
                             max_length=128, max_tokens=256, eval_prompts=1, eval_tokens=8, tree="2,1",
                             base_model="someone/tiny-llama")
    try:
        res = run(opts, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    task = res.results["tasks"]["mt_bench"]
    tps = task["tokens_per_s"]
    assert task["baseline_from"] == "llamacpp" and tps["baseline"] == tps["baseline_llamacpp"]
    assert task["speedup"] == pytest.approx(tps["speculative"] / tps["baseline_llamacpp"])
    gguf = Path(res.results["plain_engine"]["target_gguf"])
    # the baseline runs the target in the dtype eval computes in (bf16 on AMX cores, f32 elsewhere)
    from eagle3cli.evaluate.llamacpp_baseline import OUTTYPES

    assert gguf.name == f"target-{OUTTYPES[res.results['target_dtype']]}.gguf" and gguf.is_file()
    assert gguf.is_relative_to(tmp_path / "cache" / "gguf")
    (start,) = [json.loads(ln) for ln in (tmp_path / "args.jsonl").read_text().splitlines()]
    assert start[start.index("-m") + 1] == str(gguf)
    ours = max(tps["baseline_hf"], tps["baseline_fast"])
    assert plain_decoding(tps) == (f"{tps['baseline']:.1f} tok/s (llama.cpp {tps['baseline_llamacpp']:.1f}, "
                                   f"ours {ours:.1f})")
    assert plain_decoding({"baseline": 12.34, "baseline_fast": 12.34}) == "12.3 tok/s"
