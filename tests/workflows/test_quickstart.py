"""`eagle3 quickstart` end to end on a tiny random model: every stage runs, eval picks the tree by
measurement, a rerun resumes from what is on disk."""

import json

import pytest
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.workflows.quickstart import QuickstartOptions, run
from tests.helpers.quickstart import write_prompts

runner = CliRunner()


@pytest.fixture(autouse=True)
def keep_threads():
    """The quickstart sets the process's thread count (core.threads): not for the other tests."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_quickstart_tiny_model_picks_its_tree_by_measurement(smol_tiny_dir, tmp_path):
    out = tmp_path / "qs"
    write_prompts(out / "prompts.jsonl")  # what step 2 would fetch from ShareGPT
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
    write_prompts(out / "prompts.jsonl")
    opts = QuickstartOptions(out=out, model=str(smol_tiny_dir), samples=8, steps=8, regenerate=False,
                             max_length=128, max_tokens=256, eval_prompts=1, eval_tokens=8, tree="1,1",
                             base_model="someone/tiny-llama")
    res = run(opts, log=lambda m: None)
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["features"] == "none" and manifest["num_samples"] == 8
    trained = json.loads((res.draft / "config.json").read_text())["eagle3_training"]
    assert (trained["mode"], trained["ttt_warmup"], trained["steps"]) == ("online", 2, 8)
    assert res.results["tasks"]["mt_bench"]["lossless"] is True


def test_plan_only_measures_and_plans_without_running(smol_tiny_dir, tmp_path):
    """--plan-only: the measurements and the plan, one line each, plan.json written, no stage run;
    the real run then reuses that plan (same flags) instead of measuring again."""
    import torch

    out = tmp_path / "qs"
    write_prompts(out / "prompts.jsonl", n=12)
    threads = torch.get_num_threads()
    try:  # the measurement may choose one thread for the process (busy cores): not for the other tests
        r = runner.invoke(app, ["quickstart", "--model", str(smol_tiny_dir), "--base-model", "someone/tiny-llama",
                                "--out", str(out), "--plan-only", "--budget", "30"])
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    plan = json.loads((out / "plan.json").read_text())
    m, p = plan["measurements"], plan["plan"]
    assert m["regen_bound"] > 0 and m["step_s"] > 0 and m["warmup_step_s"] > 0 and m["forward_tokens_per_s"] > 0
    assert m["capture_tokens_per_s"] > 0
    assert m["answer_tokens"] > 0 and m["text_tokens"] > m["answer_tokens"] / 2
    from eagle3cli.core.threads import cores

    assert 1 <= m["threads"] <= cores() and (m["threads"] == cores()) == (m["threads_note"] == "")
    assert plan["flags"]["budget_min"] == 30 and p["total_s"] <= 30 * 60
    for word in ("cpu:", "regeneration:", "training step:", "plan: data:", "plan: size:", "plan: eval:", "plan: time:"):
        assert sum(line.strip().startswith(word) for line in lines) == 1, word
    size = next(line for line in lines if line.startswith("plan: size:"))
    assert f"{p['conversations']} conversations, {p['steps']} steps" in size
    assert not (out / "data").exists() and not (out / "draft").exists()
    # the same flags again: the saved plan, not a new measurement
    log = []
    from eagle3cli.workflows.quickstart import plan_run

    opts = QuickstartOptions(out=out, model=str(smol_tiny_dir), budget=30)
    assert plan_run(opts, str(smol_tiny_dir), 0.0, log.append)["plan"] == p
    assert log == [f"plan: reusing {out / 'plan.json'} ({p['conversations']} conversations, {p['steps']} steps)"]


def test_a_budget_below_the_minimum_is_refused_in_one_line(smol_tiny_dir, tmp_path):
    out = tmp_path / "qs"
    write_prompts(out / "prompts.jsonl")
    r = runner.invoke(app, ["quickstart", "--model", str(smol_tiny_dir), "--base-model", "someone/tiny-llama",
                            "--out", str(out), "--budget", "0.01"])
    assert r.exit_code == 1
    last = r.output.strip().splitlines()[-1]
    import re

    found = re.search(r"--budget 0.01 is below the (\d+) minutes this machine needs .*: give --budget (\d+) or more$",
                      last)
    assert found and found.group(1) == found.group(2) and int(found.group(1)) >= 1
    assert not (out / "data").exists()


def test_a_planned_run_gives_each_stage_its_time_limit(smol_tiny_dir, tmp_path):
    """With the steps and eval planned (only --samples given), training and eval run against the
    clock: each is started with the minutes plan.stage_minutes leaves it, training may run up to
    STEP_CAP times the planned steps, eval up to STEP_CAP times the planned prompts, and the whole
    run ends within the budget."""
    from eagle3cli.workflows.quickstart import STEP_CAP

    out = tmp_path / "qs"
    write_prompts(out / "prompts.jsonl", n=8)
    log = []
    opts = QuickstartOptions(out=out, model=str(smol_tiny_dir), samples=8, budget=5, max_new_tokens=8,
                             max_length=128, max_tokens=256, eval_tokens=8, tree="1,1",
                             base_model="someone/tiny-llama")
    res = run(opts, log=log.append)
    p = res.plan["plan"]
    train_line = next(m for m in log if m.startswith("[4/6] train"))
    eval_line = next(m for m in log if m.startswith("[5/6] eval"))
    assert " within " in train_line and train_line.endswith("min (the steps are fitted to it once timed)")
    assert eval_line.startswith(f"[5/6] eval: up to {p['eval_prompts'] * STEP_CAP} mt_bench prompts")
    meta = json.loads((res.draft / "config.json").read_text())
    steps = meta["eagle3_training"]["steps"]
    done = res.results["tasks"]["mt_bench"]["num_prompts"]
    assert 1 <= done <= p["eval_prompts"] * STEP_CAP
    assert sum(res.seconds.values()) < 5 * 60
    # a tiny model trains far faster than its 5 minutes need: the time gives it the cap
    assert steps == p["steps"] * STEP_CAP
