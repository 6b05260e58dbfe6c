"""`eagle3 eval --engine llama.cpp` over a grid of settings (evaluate/llamacpp_sweep.py): target
types x draft types x draft lengths x p-mins, against a fake llama-server and a fake converter.

The fake answers 10 tokens a turn: plain at 20 ms a token, speculative at 10, both divided by
the FAKE_LLAMA_FASTER factors its argv matches, so every setting's tokens/s is known here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3cli.cli import app
from tests.helpers.cli import refuse
from tests.helpers.evaluate import engine_case, engine_eval_args, python_wrapper

runner = CliRunner()
FAKE = Path(__file__).resolve().parents[1] / "helpers" / "fake_llama_server.py"
TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
FAKE_CONVERTER = """import sys
out = sys.argv[sys.argv.index("--outfile") + 1]
open(out, "wb").write(b"GGUF")
"""


@pytest.fixture
def llama_tree(tmp_path, monkeypatch):
    """A llama.cpp tree with a fake converter and llama-server; converted targets go to a fresh cache."""
    from eagle3cli.evaluate.llamacpp import missing_modules

    if missing_modules():
        pytest.skip(f"no {', '.join(missing_modules())}: converting needs the [llamacpp] extra")
    src = tmp_path / "llama.cpp"
    python_wrapper(src / "llama-server", FAKE)
    (src / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    monkeypatch.delenv("EAGLE3_LLAMA_CPP", raising=False)
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_LLAMA_ARGS", str(tmp_path / "args.jsonl"))
    return src


@pytest.fixture
def case(smol_tiny_dir, tmp_path):
    return engine_case(smol_tiny_dir, tmp_path)


@pytest.fixture
def this_checkouts_template(monkeypatch):
    # An editable install maps eagle3cli.templates to the checkout it was installed from: render
    # the card from the template beside these tests.
    from eagle3cli.publish import model_card

    monkeypatch.setattr(model_card, "template_text", lambda name=model_card.TEMPLATE: (TEMPLATES / name).read_text())


def servers(tmp_path) -> list[tuple[str, str | None, int | None, str | None]]:
    """(model file, draft file, --spec-draft-n-max, --spec-draft-p-min) of every llama-server started, in order."""
    out = []
    for line in (tmp_path / "args.jsonl").read_text().splitlines():
        a = json.loads(line)
        get = lambda flag: a[a.index(flag) + 1] if flag in a else None  # noqa: E731
        out.append((Path(get("-m")).name, Path(get("-md")).name if get("-md") else None,
                    int(get("--spec-draft-n-max")) if get("-md") else None, get("--spec-draft-p-min")))
    return out


def sweep_args(case, out, tree, *more):
    target, draft, turns = case
    return engine_eval_args(target, draft, turns, out, "llama.cpp", "--llama-cpp", str(tree), "--engine-only",
                            "--engine-threads", "1", *more)


GRID = ["--engine-target-type", "f32", "--engine-target-type", "q8_0", "--engine-draft-type", "f32",
        "--engine-draft-type", "f16", "--engine-chain-length", "2", "--engine-chain-length", "3"]


def test_sweep_measures_every_setting_and_picks_the_fastest_lossless(case, llama_tree, tmp_path, monkeypatch,
                                                                      this_checkouts_template):
    from eagle3cli.publish.export import read_config
    from eagle3cli.publish.model_card import best_llamacpp, render_card

    # q8_0 targets decode 2x faster, f16 drafts 1.5x, a chain of 2 1.2x; q8_0 accepts 3 drafts an
    # answer (f32: 4); the fastest setting, q8_0 + f16 + chain 2, changes the output
    monkeypatch.setenv("FAKE_LLAMA_FASTER", json.dumps({"target-q8_0": 2, "draft-f16": 1.5,
                                                        "--spec-draft-n-max 2 ": 1.2}))
    monkeypatch.setenv("FAKE_LLAMA_ACCEPT", json.dumps({"target-q8_0": 3}))
    monkeypatch.setenv("FAKE_LLAMA_DIFFER_IF", json.dumps(["target-q8_0", "draft-f16", "--spec-draft-n-max 2 "]))
    out = tmp_path / "out"
    r = runner.invoke(app, sweep_args(case, out, llama_tree, *GRID))
    assert r.exit_code == 0, r.output

    started = servers(tmp_path)
    specs = [(m, d, n) for t in ("f32", "q8_0") for m, d, n in
             [(f"target-{t}.gguf", f"draft-{dt}.gguf", n) for dt in ("f32", "f16") for n in (2, 3)]]
    # one plain server per target type, then its four settings; f32 first
    assert started == ([("target-f32.gguf", None, None, None)] + [(*s, "0.0") for s in specs[:4]]
                       + [("target-q8_0.gguf", None, None, None)] + [(*s, "0.0") for s in specs[4:]])

    e = json.loads((out / "results.json").read_text())["engine"]
    rows = {(s["target_type"], s["draft_type"], s["spec_draft_n_max"]): s for s in e["sweep"]}
    assert list(rows) == [(t, d, n) for t in ("f32", "q8_0") for d in ("f32", "f16") for n in (2, 3)]
    speed = {("f32", "f32", 3): 1, ("f32", "f32", 2): 1.2, ("f32", "f16", 3): 1.5, ("f32", "f16", 2): 1.8}
    speed |= {("q8_0", d, n): 2 * x for (_, d, n), x in list(speed.items())}
    for key, s in rows.items():
        plain = 50.0 * (2 if key[0] == "q8_0" else 1)  # 10 tokens in 200 ms, / the target's factor
        assert s["tokens_per_s"] == {"baseline": pytest.approx(plain), "speculative": pytest.approx(100 * speed[key])}
        assert s["speedup"] == pytest.approx(100 * speed[key] / plain)
        # 3 answers of 10 tokens: 27 after the prompt passes, in 15 target steps (f32) or 18 (q8_0)
        assert s["tau"] == pytest.approx(27 / 15 if key[0] == "f32" else 27 / 18)
        assert s["tau_vs_f32"] == pytest.approx(1.0 if key[0] == "f32" else 15 / 18)
        steps = 15 if key[0] == "f32" else 18
        assert s["accepted"] == (12 if key[0] == "f32" else 9) and s["drafted"] == steps * key[2]
        assert s["lossless"] is (key != ("q8_0", "f16", 2))
        assert s["prompts_differ"] == (0 if s["lossless"] else 2)
    assert rows["q8_0", "f16", 2]["tasks"]["mini"]["mismatches"] == ["1", "2"]
    # the fastest lossless: q8_0 + f16 + chain 3 (300 tok/s); 360 tok/s was not lossless
    assert e["sweep"][e["best"]] is not None and (e["settings"]["target_type"], e["settings"]["draft_type"],
                                                  e["settings"]["spec_draft_n_max"]) == ("q8_0", "f16", 3)
    assert e["best"] == list(rows).index(("q8_0", "f16", 3))
    assert Path(e["target_gguf"]).name == "target-q8_0.gguf" and Path(e["draft_gguf"]).name == "draft-f16.gguf"
    assert e["tasks"]["mini"]["tokens_per_s"]["speculative"] == pytest.approx(300.0)
    assert Path(e["target_gguf"]).is_relative_to(tmp_path / "cache" / "gguf")  # converted once, cached

    lines = [ln for ln in r.output.splitlines() if ln.startswith("llama.cpp setting ")]
    assert len(lines) == 8 and lines[0].startswith("llama.cpp setting 1/8: target f32, draft f32, chain 2, p-min 0: "
                                                   "120.0 tok/s against 50.0 plain (2.40x), tau 1.80, same output")
    assert lines[6].startswith("llama.cpp setting 7/8: target q8_0, draft f16, chain 2, p-min 0: 360.0 tok/s against "
                               "100.0 plain (3.60x), tau 1.50 (0.83 of the f32 target's), NOT lossless (2 prompts "
                               "differ) (about ")
    assert lines[6].endswith(" min left)") and lines[7].endswith("same output as plain")  # the last: none left
    assert ("llama.cpp sweep: 8 settings (2 targets x 2 drafts x 2 chain lengths x 1 p-min): 10 llama-server runs of "
            "3 answers each") in r.output
    assert "llama.cpp sweep: about " in r.output and "best (fastest lossless): setting 8" in r.output
    assert (out / "llama-server-spec-q8_0-f16-n3-p0.log").is_file() and (out / "llama-server-plain-f32.log").is_file()

    res = json.loads((out / "results.json").read_text())
    best = best_llamacpp([res])
    assert (best["target_type"], best["draft_type"], best["draft"]) == ("q8_0", "f16", "draft-f16.gguf")
    card = render_card(read_config(case[1]), "me/x", "me/tiny", [res],
                       gguf_files=["draft-f16.gguf", "draft-f32.gguf"]).text
    assert ("hf download me/x draft-f16.gguf --local-dir .\n"
            "llama-server -m TARGET-q8_0.gguf -md draft-f16.gguf --spec-type draft-eagle3 --spec-draft-n-max 3\n"
            "# the fastest lossless of the 8 settings eagle3 eval --engine llama.cpp measured: target q8_0, "
            f"draft f16, 300.0 tokens/s, 3.00x plain llama-server on the same target, tau 1.50 ({res['hardware']})"
            ) in card


def test_one_setting_is_the_run_eval_always_made(case, llama_tree, tmp_path):
    """No sweep flag: one plain and one speculative server, the section's old layout (new keys
    after), the old log names; p-min still takes one value."""
    out = tmp_path / "out"
    r = runner.invoke(app, sweep_args(case, out, llama_tree, "--engine-p-min", "0.25"))
    assert r.exit_code == 0, r.output
    assert servers(tmp_path) == [("target-f32.gguf", None, None, None),
                                 ("target-f32.gguf", "draft-f32.gguf", 3, "0.25")]
    e = json.loads((out / "results.json").read_text())["engine"]
    assert list(e) == ["name", "binary", "version", "target_gguf", "draft_gguf", "settings", "metrics", "tasks",
                       "sweep", "best"]
    assert list(e["settings"]) == ["spec_type", "spec_draft_n_max", "spec_draft_p_min", "threads", "threads_draft",
                                   "temperature", "max_new_tokens", "target_type", "draft_type"]
    assert e["settings"]["spec_draft_p_min"] == 0.25 and e["settings"]["threads"] == 1
    assert e["best"] == 0 and len(e["sweep"]) == 1 and e["sweep"][0]["tasks"] == e["tasks"]
    assert e["tasks"]["mini"]["speedup"] == pytest.approx(2.0) and e["tasks"]["mini"]["lossless"] is True
    assert (out / "llama-server-plain.log").is_file() and (out / "llama-server-spec.log").is_file()
    assert "llama.cpp: draft-eagle3, chain 3" in r.output and "llama.cpp sweep" not in r.output
    assert "llama.cpp setting 1/1: target f32, draft f32, chain 3, p-min 0.25: 100.0 tok/s" in r.output


def test_a_given_target_gguf_is_one_more_target(case, llama_tree, tmp_path):
    """--target-gguf with --engine-target-type: the converted type and the file, each with its own
    plain run (a quantized file is held to its own plain output)."""
    given = tmp_path / "smol-q4.gguf"
    given.write_bytes(b"GGUF")  # no header the gguf package reads: labelled by its name
    out = tmp_path / "out"
    r = runner.invoke(app, sweep_args(case, out, llama_tree, "--target-gguf", str(given), "--engine-target-type", "f32",
                                      "--engine-p-min", "0", "--engine-p-min", "0.5"))
    assert r.exit_code == 0, r.output
    assert [(m, d, p) for m, d, _, p in servers(tmp_path)] == [
        ("target-f32.gguf", None, None), ("target-f32.gguf", "draft-f32.gguf", "0.0"),
        ("target-f32.gguf", "draft-f32.gguf", "0.5"), ("smol-q4.gguf", None, None),
        ("smol-q4.gguf", "draft-f32.gguf", "0.0"), ("smol-q4.gguf", "draft-f32.gguf", "0.5")]
    e = json.loads((out / "results.json").read_text())["engine"]
    assert [(s["target_type"], s["spec_draft_p_min"]) for s in e["sweep"]] == [
        ("f32", 0.0), ("f32", 0.5), ("smol-q4", 0.0), ("smol-q4", 0.5)]
    assert e["sweep"][2]["target_gguf"] == str(given) and e["sweep"][2]["tau_vs_f32"] == pytest.approx(1.0)


def test_bad_sweep_values_are_one_line_before_anything_loads(tmp_path):
    base = ["eval", "-m", "x", "-d", "y", "-o", str(tmp_path / "o"), "--engine", "llama.cpp"]
    cases = [  # (argv, exit code, words of the one line)
        (base + ["--engine-target-type", "q4"], 2, "'q4' is not one of 'f32', 'f16', 'bf16', 'q8_0'"),
        (base + ["--engine-draft-type", "f32,f16"], 2, "'f32,f16' is not one of"),
        (base + ["--engine-chain-length", "two"], 2, "'--engine-chain-length': Input should be a valid integer"),
        (base + ["--engine-chain-length", "2", "--engine-chain-length", "0"], 1,
         "--engine-chain-length must be at least 1, got 0"),
        (base + ["--engine-p-min", "0", "--engine-p-min", "1.5"], 1, "--engine-p-min must lie in [0, 1]"),
        (base[:-2] + ["--engine-draft-type", "q8_0"], 1,
         "--engine-draft-type set llama-server's runs: add --engine llama.cpp"),
    ]
    res = refuse([c[0] for c in cases])
    assert res["heavy"] == []  # refused before torch or a model is loaded
    for run, (argv, code, words) in zip(res["runs"], cases):
        assert run["code"] == code and len(run["lines"]) == 1 and words in run["lines"][0], (argv, run)


def _result(sweep, best, hardware="CPU Y"):
    return {"hardware": hardware, "settings": {}, "tasks": {},
            "engine": {"name": "llama.cpp", "settings": {"spec_type": "draft-eagle3", "spec_draft_n_max": 3},
                       "tasks": {}, "sweep": sweep, "best": best}}


def _setting(t, d, n, p, tps, speedup, lossless=True):
    return {"target_type": t, "draft_type": d, "target_gguf": f"/c/target-{t}.gguf",
            "draft_gguf": f"/o/draft-{d}.gguf", "spec_draft_n_max": n, "spec_draft_p_min": p,
            "tokens_per_s": {"baseline": tps / speedup, "speculative": tps},
            "speedup": speedup, "tau": 1.4, "lossless": lossless}


def test_the_card_takes_a_sweeps_best_beside_older_results():
    from eagle3cli.publish.model_card import best_llamacpp, llamacpp_command

    older = {"hardware": "CPU X", "settings": {}, "tasks": {},
             "engine": {"name": "llama.cpp", "draft_gguf": "/g/draft-q8_0.gguf",
                        "settings": {"spec_type": "draft-eagle3", "spec_draft_n_max": 1, "spec_draft_p_min": 0.0},
                        "tasks": {"a": {"speedup": 1.1, "lossless": True,
                                        "tokens_per_s": {"baseline": 40.0, "speculative": 44.0}}}}}
    swept = _result([_setting("f32", "f32", 2, 0.0, 40.0, 0.9), _setting("q8_0", "q8_0", 1, 0.5, 61.0, 1.22)], 1)
    none_lossless = _result([_setting("q8_0", "f16", 1, 0.0, 99.0, 2.0, lossless=False)], None)
    best = best_llamacpp([older, swept, none_lossless])
    assert (best["target_type"], best["draft_type"], best["tokens_per_s"], best["settings_measured"]) == \
        ("q8_0", "q8_0", 61.0, 2)
    assert best["settings"]["spec_draft_n_max"] == 1 and best["settings"]["spec_draft_p_min"] == 0.5
    assert best_llamacpp([older])["tokens_per_s"] == 44.0 and best_llamacpp([none_lossless]) is None
    # no GGUF in the repo: the export line writes the measured draft type
    assert llamacpp_command("me/x", (), best) == (
        "hf download me/x --local-dir draft && eagle3 export-gguf draft --model TARGET_DIR --llama-cpp LLAMA_CPP_DIR "
        "--outtype q8_0 -o .\nllama-server -m TARGET-q8_0.gguf -md draft-q8_0.gguf --spec-type draft-eagle3 "
        "--spec-draft-n-max 1 --spec-draft-p-min 0.5\n# the fastest lossless of the 2 settings eagle3 eval --engine "
        "llama.cpp measured: target q8_0, draft q8_0, 61.0 tokens/s, 1.22x plain llama-server on the same target, "
        "tau 1.40 (CPU Y)")
    slow = best_llamacpp([_result([_setting("f32", "f16", 2, 0.0, 40.0, 0.9)], 0)])
    cmd = llamacpp_command("me/x", ["draft-f32.gguf"], slow)
    assert "-m TARGET-f32.gguf -md draft-f32.gguf " in cmd and "\n# the setting eagle3 eval" in cmd
    assert cmd.endswith("\n# slower than the target alone there: serve it without the draft on such a machine"
                        "\n# measured with draft-f16.gguf, which this repo does not hold")
