"""`eagle3 quickstart` end to end on a tiny random model: every stage runs, eval picks the tree by
measurement, a rerun resumes from what is on disk."""

import json

from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.workflows.quickstart import QuickstartOptions, run

runner = CliRunner()


def _prompts(path, n=8):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                                             {"from": "gpt", "value": f"It is {2 * i}."}]} for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_quickstart_tiny_model_picks_its_tree_by_measurement(smol_tiny_dir, tmp_path):
    out = tmp_path / "qs"
    _prompts(out / "prompts.jsonl")  # what step 2 would fetch from ShareGPT
    opts = QuickstartOptions(out=out, model=str(smol_tiny_dir), samples=8, steps=3, max_new_tokens=8,
                             max_length=128, max_tokens=256, eval_prompts=1, eval_tokens=8,
                             base_model="someone/tiny-llama")
    res = run(opts, log=lambda m: None)
    st = res.results["settings"]
    auto = st["tree_auto"]
    assert auto is not None and (st["total_tokens"], st["depth"]) == (auto["total_tokens"], auto["depth"])
    task = res.results["tasks"]["mt_bench"]
    assert task["lossless"] is True and task["num_prompts"] == 1
    assert (res.draft / "model.safetensors").exists() and (res.hub_folder / "README.md").exists()
    assert set(res.seconds) == {"model", "gen-data", "train", "eval", "export"}
    # The default data path: regenerated answers, features on disk; the ablation's training settings.
    assert json.loads((out / "data" / "manifest.json").read_text())["features"] == "offline"
    trained = json.loads((res.draft / "config.json").read_text())["eagle3_training"]
    assert (trained["mode"], trained["loss_on"], trained["accept_loss"]) == ("offline", "all", 0.5)
    assert trained["ttt_warmup"] == 0  # a quarter of 3 steps
    # A rerun finds every stage done: the same eval results, nothing retrained.
    mtime = (res.draft / "model.safetensors").stat().st_mtime_ns
    again = run(opts, log=lambda m: None)
    assert again.results == json.loads((out / "eval" / "results.json").read_text())
    assert again.results["tasks"] == res.results["tasks"]
    assert (res.draft / "model.safetensors").stat().st_mtime_ns == mtime


def test_quickstart_local_model_without_hub_id_fails_before_any_work(smol_tiny_dir, tmp_path):
    """The card must name the target's Hub id: a local --model without --base-model is refused at
    once, in one line, not after gen-data and training."""
    out = tmp_path / "qs"
    r = runner.invoke(app, ["quickstart", "--model", str(smol_tiny_dir), "--out", str(out)])
    assert r.exit_code == 1
    line = r.output.strip().splitlines()[-1]
    assert "--model is the local folder" in line and "--base-model OWNER/NAME" in r.output
    assert not (out / "data").exists() and not (out / "prompts.jsonl").exists()
    r = runner.invoke(app, ["quickstart", "--model", str(smol_tiny_dir), "--out", str(out), "--base-model", "nohub"])
    assert r.exit_code == 1 and "not a Hub id" in r.output and not (out / "data").exists()


def test_quickstart_without_regeneration_trains_online_on_the_datasets_text(smol_tiny_dir, tmp_path):
    """--no-regenerate: a tokens-only store (no features written) and online training, each
    conversation's target features computed in its training step."""
    out = tmp_path / "qs"
    _prompts(out / "prompts.jsonl")
    opts = QuickstartOptions(out=out, model=str(smol_tiny_dir), samples=8, steps=8, regenerate=False,
                             max_length=128, max_tokens=256, eval_prompts=1, eval_tokens=8, tree="1,1",
                             base_model="someone/tiny-llama")
    res = run(opts, log=lambda m: None)
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["features"] == "none" and manifest["num_samples"] == 8
    trained = json.loads((res.draft / "config.json").read_text())["eagle3_training"]
    assert (trained["mode"], trained["ttt_warmup"], trained["steps"]) == ("online", 2, 8)
    assert res.results["tasks"]["mt_bench"]["lossless"] is True


def test_quickstart_size_doubles_on_amx_for_smollm2_only(monkeypatch):
    """300 regenerated conversations and 180 steps by default; twice both where the CPU has AMX
    and the target is the default SmolLM2 (regeneration ~2x faster there); 600 read once without
    regeneration; --samples / --steps always win (run() keeps them)."""
    from eagle3cli.decode import fast_target
    from eagle3cli.workflows.quickstart import default_size

    monkeypatch.setattr(fast_target, "has_amx_bf16", lambda: False)
    assert default_size(QuickstartOptions())[:2] == (300, 180)
    assert default_size(QuickstartOptions(regenerate=False))[:2] == (600, 180)
    monkeypatch.setattr(fast_target, "has_amx_bf16", lambda: True)
    assert default_size(QuickstartOptions())[:2] == (600, 360)
    assert default_size(QuickstartOptions(model="other/model"))[:2] == (300, 180)
    assert default_size(QuickstartOptions(regenerate=False))[:2] == (600, 180)
