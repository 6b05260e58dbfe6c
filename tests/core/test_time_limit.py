"""--max-minutes: gen-data, train and eval end within their time, judged by the work they timed,
and keep what they finished. A fake clock that only the work itself advances makes the stopping
points exact."""

import json
import types

import pytest
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.config.options import GenDataOptions
from eagle3cli.core import time_limit
from eagle3cli.core.time_limit import TimeLimit
from eagle3cli.data.gen_data import run
from eagle3cli.model.target import TargetSpec
from tests.helpers.trainer import store, target_dir  # noqa: F401  (module fixtures: a tiny target and its store)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(time_limit, "time", types.SimpleNamespace(perf_counter=c))
    return c


def test_a_limit_passes_work_that_ends_in_time_at_the_rate_so_far(clock):
    lim = TimeLimit(1.0)  # 60 s from now
    assert lim.fits(100)  # nothing timed yet: the first unit always runs
    clock.now += 20
    lim.record(20, work=4)  # 5 s a unit
    assert lim.left() == 40 and lim.rate() == 5
    assert lim.fits(8) and not lim.fits(9)
    assert lim.fits(6, reserve=10) and not lim.fits(7, reserve=10)
    assert TimeLimit(None).fits(10 ** 9) and TimeLimit(0).left() == float("inf")


# ---- gen-data ---------------------------------------------------------------------------------

def _chats(path, n):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"What is {i} plus {i}?"},
                                             {"from": "gpt", "value": f"It is {2 * i}."}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gen_data_stops_between_shards_and_a_rerun_finishes_the_same_store(smol_tiny_dir, tmp_path, clock,
                                                                          monkeypatch):
    """12 conversations in shards of 3, each conversation taking 10 s on the fake clock: with one
    minute, two shards fit (the third would end at 90 s); the store keeps them and is incomplete.
    The same command without the limit then finishes it, byte for byte the store an uninterrupted
    run writes."""
    from rich.console import Console

    from eagle3cli.data import regenerate

    real = regenerate.regenerate_local

    def slow(model, tokenizer, conversations, settings, stop_ids, **kw):
        clock.now += 10 * len(conversations)
        return real(model, tokenizer, conversations, settings, stop_ids, **kw)

    monkeypatch.setattr(regenerate, "regenerate_local", slow)
    data = _chats(tmp_path / "chats.jsonl", 12)
    spec = TargetSpec(str(smol_tiny_dir), device="cpu")

    def opts(out, **kw):
        return GenDataOptions(out=out, data=str(data), max_new_tokens=4, max_length=96, shard_size=3, batch_size=4,
                              **kw)

    log = tmp_path / "log.txt"
    with log.open("w") as f:
        man = run(opts(tmp_path / "cut", max_minutes=1), spec, Console(file=f, soft_wrap=True))
    assert (man["shards_done"], man["shards_planned"], man["complete"], man["num_samples"]) == (2, 4, False, 6)
    said = [ln for ln in log.read_text().splitlines() if ln.startswith("time limit")]
    assert said == ["time limit (--max-minutes 1): stopped after 2 of the 4 shards this run had to do (the next would "
                    "need ~0.5 min at 10.0 s a conversation, 0.0 min are left); the finished shards are kept and the "
                    "store is incomplete: run the same command again to finish it, or train on it with "
                    "--allow-incomplete"]
    quiet = Console(file=open("/dev/null", "w"))
    man = run(opts(tmp_path / "cut"), spec, quiet)
    whole = run(opts(tmp_path / "whole"), spec, quiet)
    assert man["complete"] and man["num_samples"] == whole["num_samples"] == 12
    shards = sorted((tmp_path / "whole" / "shards").glob("*.json"))
    assert len(shards) == 4
    for s in shards:
        assert json.loads(s.read_text())["sha256"] == \
            json.loads((tmp_path / "cut" / "shards" / s.name).read_text())["sha256"]


# ---- train ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seconds_per_step, steps", [(10, 10), (20, 4)])
def test_train_fits_its_steps_and_schedule_to_the_time(store, target_dir, tmp_path, clock, monkeypatch,
                                                       seconds_per_step, steps):
    """Two minutes, a step taking 10 (or 20) s on the fake clock, and a reserve of 10 s for the
    export plus half a step per held-out batch (two): from the first timed step the run refits to
    10 (4) steps, its schedule ends at 0 there, and it exports as a finished run would.
    Without the limit the same flags run their 40 steps."""
    from eagle3cli.train.optim import lr_lambda
    from eagle3cli.train.trainer import Trainer, train
    from tests.helpers.trainer import config

    real = Trainer._optimizer_step

    def timed_step(self, group):
        clock.now += seconds_per_step
        return real(self, group)

    monkeypatch.setattr(Trainer, "_optimizer_step", timed_step)
    cfg = config(store, target_dir, tmp_path / "d", epochs=20, max_steps=40, max_minutes=2.0)
    res = train(cfg, quiet=True)
    assert res.step == steps and res.stopped is None
    lrs = [h["lr"] for h in res.history if "lr" in h]
    fitted = lr_lambda(steps, cfg.warmup_ratio, cfg.min_lr_ratio, cfg.lr_schedule)
    assert fitted(steps) == 0.0 and lrs[-1] == pytest.approx(cfg.lr * fitted(steps - 1))  # fitted to the steps run
    assert (tmp_path / "d" / "model.safetensors").exists() and res.metrics
    assert clock.now - 1000.0 == steps * seconds_per_step  # every step it started fitted the limit
    unlimited = train(config(store, target_dir, tmp_path / "u", epochs=20, max_steps=40), quiet=True)
    assert unlimited.step == 40


# ---- eval -------------------------------------------------------------------------------------

def test_eval_measures_the_prompts_the_time_holds(smol_tiny_dir, tmp_path, clock, monkeypatch):
    """Four one-turn prompts, each 30 s on the fake clock (three timed decodings of 10 s): 90 s
    hold three; the results cover them, lossless, and say where the task stopped."""
    from eagle3cli.evaluate import evaluate
    from tests.helpers.evaluate import make_draft

    real = evaluate.timed

    def slow(fn, device):
        clock.now += 10
        return real(fn, device)

    monkeypatch.setattr(evaluate, "timed", slow)
    turns = tmp_path / "four.jsonl"
    turns.write_text("".join(json.dumps({"question_id": i, "turns": [f"Name {i} colours."]}) + "\n" for i in range(4)))
    draft = make_draft(smol_tiny_dir, tmp_path / "draft")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", "four",
                                 "--data", str(turns), "--out", str(out), "--max-new-tokens", "8", "--mode", "chain",
                                 "--max-minutes", "1.5"])
    assert r.exit_code == 0, r.output
    assert "time limit (--max-minutes 1.5): four: 3 of 4 prompts measured (30 s a prompt, 0 s left)" in r.output
    res = json.loads((out / "results.json").read_text())
    assert res["time_limit"] == {"minutes": 1.5, "prompts": {"four": [3, 4]}}
    t = res["tasks"]["four"]
    assert t["num_prompts"] == 3 and t["lossless"] is True
    r = CliRunner().invoke(app, ["eval", "--model", str(smol_tiny_dir), "--draft", str(draft), "--task", "four",
                                 "--data", str(turns), "--out", str(out), "--max-minutes", "0"])
    assert r.exit_code == 1 and "--max-minutes must be a positive number of minutes, got 0.0" in r.output


def test_every_process_takes_the_most_cautious_decision(clock):
    """Several processes time their own steps; a step count or a stop that one of them took alone
    would leave the others in a collective. ``agree`` (the minimum over the processes) makes both
    decisions common. Two minutes, 10 s a step, 10 s reserved for the export: alone this process
    refits to 11 steps after its first timed step (90 s of room left at step 2)."""
    from eagle3cli.train.step_budget import StepBudget

    def run(other_count=10 ** 6, other_stops_before=10 ** 6):
        """The other process votes ``other_count`` on every refit and 'no' before its step
        ``other_stops_before``; this one runs steps until its budget ends them."""
        said, at = [], {"step": 0}

        def agree(n):  # 0/1: "the next step fits"; larger: a refitted step count
            other = (at["step"] < other_stops_before) if n <= 1 else other_count
            return min(n, int(other))

        b = StepBudget(2.0, clock.now, total=40, warmup_steps=0, validate_cost_steps=0,
                       apply=lambda steps, why: said.append(steps), agree=agree)
        while at["step"] < b.total and b.before_step(at["step"]):
            clock.now += 10
            b.after_step(at["step"])
            at["step"] += 1
        return at["step"], said[-1]

    assert run() == (11, 11)  # the other process agrees: this one's own fit
    assert run(other_count=5) == (5, 5)  # the other fits only 5: so does this one
    assert run(other_stops_before=4) == (4, 4)  # the other is out of time before step 4: both stop there


TWO_PROCESSES = """
import json, os, sys, types
from eagle3cli.core import time_limit
from eagle3cli.config.train_config import TrainConfig
from eagle3cli.train.trainer import Trainer, train
rank = int(os.environ["RANK"])  # (torch.distributed.run's; the trainer's Accelerator joins the group)
clock = types.SimpleNamespace(now=1000.0)
time_limit.time = types.SimpleNamespace(perf_counter=lambda: clock.now)
real = Trainer._optimizer_step
def timed_step(self, group):  # rank 1 is the slower one: 20 s a step against 10
    clock.now += 20 if rank == 1 else 10
    return real(self, group)
Trainer._optimizer_step = timed_step
cfg = TrainConfig(**json.loads(sys.argv[1]))
res = train(cfg, quiet=True)
json.dump({"step": res.step}, open(f"{cfg.out}/rank{rank}.json", "w"))
"""


def test_two_processes_end_on_the_same_step(store, target_dir, tmp_path):
    """Data-parallel training on two CPU processes (gloo), one timing its steps at 10 s and the
    other at 20: both end on the step the slower one fits (4, as a lone 20-s run in the test
    above), where either alone would leave the other waiting in a gradient all-reduce."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers.trainer import config

    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESSES)
    out = tmp_path / "d"
    cfg = config(store, target_dir, out, epochs=20, max_steps=40, max_minutes=2.0)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        "29527", str(script), json.dumps(cfg.to_dict())],
                       capture_output=True, text=True, cwd=repo, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    steps = [json.loads((out / f"rank{k}.json").read_text())["step"] for k in (0, 1)]
    assert steps == [4, 4]
