"""The trainer on tiny feature stores built here with store_build.write_shard + target.capture."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3cli.config.train_config import TrainConfig, TrainError
from eagle3cli.model.vocab import build_vocab, size_for_coverage
from eagle3cli.publish.export import METADATA_KEY, read_config
from eagle3cli.publish.inspector import inspect_draft
from eagle3cli.train.batching import make_batches, planned_steps, rank_groups
from eagle3cli.train.checkpoints import checkpoint_dirs
from eagle3cli.train.setup import limit_note
from eagle3cli.train.trainer import Trainer, train
from tests.helpers.trainer import END_IDS, build_store, config, peaky_target, store, target_dir, weights  # noqa: F401  (module fixtures: a tiny target and its store)

REPO = Path(__file__).resolve().parents[2]
# Tiny matmuls on a shared 2-core machine: one thread avoids thread-pool contention (20x here).
torch.set_num_threads(1)


# ---- draft vocabulary ------------------------------------------------------------------------

def test_vocab_fixed_size_keeps_end_tokens_and_frequency_order():
    counts = torch.zeros(20, dtype=torch.long)
    counts[[3, 5, 9, 11, 12]] = torch.tensor([50, 40, 30, 20, 10])
    v = build_vocab(counts, 4, end_token_ids=[17])
    assert v.ids.tolist() == [3, 5, 9, 17]  # the least frequent pick makes room for the end token
    assert abs(v.coverage - 120 / 150) < 1e-12
    assert build_vocab(counts, 100, end_token_ids=[]).size == 20  # capped at the target vocab


def test_vocab_auto_is_smallest_size_reaching_coverage():
    counts = torch.tensor([0, 60, 0, 30, 9, 1])
    assert size_for_coverage(counts, 0.9) == 2
    assert size_for_coverage(counts, 0.99) == 3
    assert size_for_coverage(counts, 1.0) == 4
    v = build_vocab(counts, "auto", 0.9, end_token_ids=[5])
    assert v.ids.tolist() == [1, 3, 5]


def test_batches_respect_budget_and_split_ranks():
    lengths = [5, 30, 12, 7, 30, 3, 18, 9]
    batches = make_batches(list(range(8)), lengths, 40, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert all(len(b) * max(lengths[i] for i in b) <= 40 or len(b) == 1 for b in batches)
    assert batches == make_batches(list(range(8)), lengths, 40, seed=1, epoch=0)
    g0, g1 = rank_groups(batches, 2, 0, 2), rank_groups(batches, 2, 1, 2)
    assert len(g0) == len(g1) and not {i for g in g0 for b in g for i in b} & {i for g in g1 for b in g for i in b}


def test_regrouped_batches_change_each_epoch_and_keep_padding_small():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 512, (300,), generator=g).tolist()
    idx = list(range(300))

    def groups(epoch, regroup):
        return make_batches(idx, lengths, 1024, seed=3, epoch=epoch, regroup=regroup)

    for epoch in range(3):
        b = groups(epoch, True)
        assert sorted(i for x in b for i in x) == idx  # every conversation once an epoch
        assert all(len(x) * max(lengths[i] for i in x) <= 1024 or len(x) == 1 for x in b)
        assert b == groups(epoch, True)  # a function of (seed, epoch): a resumed run rebuilds it
        padded = sum(len(x) * max(lengths[i] for i in x) for x in b)
        assert sum(lengths) / padded > 0.9  # still length-sorted within each mega-batch
    fixed = [{frozenset(x) for x in groups(e, False)} for e in (0, 1)]
    new = [{frozenset(x) for x in groups(e, True)} for e in (0, 1)]
    assert fixed[0] == fixed[1]  # the default keeps its grouping and shuffles only the order
    assert len(new[0] & new[1]) < len(new[0]) / 4  # regrouped: few steps meet again
    assert groups(1, False) != groups(0, False)
    per_epoch = [len(groups(e, True)) for e in range(3)]
    assert planned_steps(lambda e: groups(e, True), 3, 0) == sum(per_epoch)
    assert planned_steps(lambda e: groups(e, True), 10**6, per_epoch[0] + 1) == per_epoch[0] + per_epoch[1]


def test_limit_note_names_what_ends_the_run():
    cfg = TrainConfig(data="x", epochs=3, max_steps=100)
    assert limit_note(40, 120, cfg) == "--max-steps 100 ends the run before 3 epochs of 40 steps"
    cfg = TrainConfig(data="x", epochs=3, max_steps=130, regroup_batches=True)  # epochs cut 40, 41, 39
    assert limit_note(40, 120, cfg).startswith("the 3 epochs of about 40 steps end the run before --max-steps 130")
    assert limit_note(40, 120, TrainConfig(data="x", epochs=3, max_steps=120)) == "3 epochs of 40 steps"


# ---- training -------------------------------------------------------------------------------

def test_loss_decreases_and_export_passes_inspect(store, target_dir, tmp_path):
    res = train(config(store, target_dir, tmp_path / "run", epochs=4), quiet=True)
    losses = [h["loss"] for h in res.history if "acc" in h]
    assert len(losses) == res.step >= 8
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    val = [h["val"] for h in res.history if "val" in h]
    assert len(val) == 4 and val[-1]["loss"][0] < val[0]["loss"][0]
    out = tmp_path / "run"
    assert inspect_draft(out).ok
    cfg = read_config(out)
    meta = cfg[METADATA_KEY]
    for key in ("target", "target_revision", "chat_template_hash", "layer_ids", "data", "num_samples",
                "num_tokens", "steps", "epochs", "ttt_steps", "step_decay", "lr", "draft_vocab_size",
                "vocab_coverage", "recipe", "eagle3_version", "metrics", "datasets", "created"):
        assert key in meta, key
    assert meta["steps"] == res.step and meta["ttt_steps"] == 3 and len(meta["metrics"]["acc"]) == 3
    assert cfg["draft_vocab_size"] == 256 and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    t = load_file(str(out / "model.safetensors"))
    vocab = (torch.arange(256) + t["d2t"]).tolist()
    assert vocab == sorted(vocab) and set(END_IDS) <= set(vocab) and t["t2d"][vocab].all()


def test_one_step_draft_is_evaluated_on_the_longer_scale(store, target_dir, tmp_path):
    res = train(config(store, target_dir, tmp_path / "one", ttt_steps=1, eval_ttt_steps=4, epochs=1), quiet=True)
    assert all(len(h["acc"]) == 1 for h in res.history if "acc" in h)  # training unrolls one step
    val = [h["val"] for h in res.history if "val" in h][-1]
    assert len(val["acc"]) == len(val["loss"]) == 4
    assert read_config(tmp_path / "one")[METADATA_KEY]["metrics"]["acc"] == [round(a, 4) for a in val["acc"]]


def test_log_file_gets_one_line_per_log_point(store, target_dir, tmp_path):
    """Under nohup/CI the rich bar cannot redraw: each log point prints a plain line instead."""
    import io
    import re

    from rich.console import Console

    buf = io.StringIO()
    res = train(config(store, target_dir, tmp_path / "log", epochs=1, val_fraction=0.0, log_every=2),
                console=Console(file=buf, width=200, force_terminal=False))
    logged = [h for h in res.history if "loss" in h and "step" in h]
    lines = re.findall(r"^step (\d+)/(\d+)  loss ([0-9.]+)", buf.getvalue(), flags=re.M)
    assert logged and [int(a) for a, _, _ in lines] == [h["step"] for h in logged]
    assert {int(b) for _, b, _ in lines} == {res.step}
    assert [float(c) for _, _, c in lines] == [round(h["loss"], 3) for h in logged]


@pytest.mark.parametrize("extra", [{}, {"feature_noise": 0.3, "ttt_warmup": 4, "accept_loss": 0.5},
                                   {"regroup_batches": True}],
                         ids=["plain", "noise-curriculum-acceptance", "regrouped"])
def test_resume_is_bit_identical(store, target_dir, tmp_path, extra):
    """Also with the settings that draw noise (the generator state must travel in the checkpoint)
    and that change the unroll by step (the curriculum crosses the interruption at step 4)."""
    full = train(config(store, target_dir, tmp_path / "full", save_every=3, val_fraction=0.0, **extra), quiet=True)
    cut = config(store, target_dir, tmp_path / "cut", save_every=3, val_fraction=0.0, **extra)
    part = train(cut, quiet=True, stop_after=5)  # the work of steps 4-5 is lost, like a crash
    assert part.stopped and [p.name for p in checkpoint_dirs(tmp_path / "cut")] == ["step-00000003"]
    resumed = train(replace(cut, resume=True), quiet=True)
    assert resumed.step == full.step > 5
    a, b = weights(full.draft), weights(resumed.draft)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], weights(part.draft)["fc.weight"])


def test_resume_refuses_changed_settings_and_existing_checkpoints(store, target_dir, tmp_path):
    cfg = config(store, target_dir, tmp_path / "r", save_every=2, val_fraction=0.0)
    train(cfg, quiet=True, stop_after=2)
    with pytest.raises(TrainError, match="already holds checkpoints"):
        train(cfg, quiet=True)
    with pytest.raises(TrainError, match="lr was 0.003"):
        train(replace(cfg, resume=True, lr=1e-3), quiet=True)


def test_online_equals_offline_on_identical_features(tmp_path, target_dir):
    """An fp32 offline store and the online target capture feed the trainer the same numbers."""
    offline = build_store(tmp_path / "f32", target_dir, n=12, dtype=torch.float32)
    tokens = build_store(tmp_path / "tok", target_dir, n=12, features=False)
    a = train(config(offline, target_dir, tmp_path / "a", epochs=1, val_fraction=0.0), quiet=True)
    b = train(config(tokens, target_dir, tmp_path / "b", epochs=1, val_fraction=0.0, online=True), quiet=True)
    assert a.step == b.step >= 2
    for k, v in weights(a.draft).items():
        torch.testing.assert_close(v, weights(b.draft)[k], atol=1e-5, rtol=1e-4)
    with pytest.raises(TrainError, match="--online"):
        train(config(tokens, target_dir, tmp_path / "c"), quiet=True)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, target_dir):
    bad = build_store(tmp_path / "nan", target_dir, n=24, nan_samples=range(12, 24))
    res = train(config(bad, target_dir, tmp_path / "run", save_every=1, val_fraction=0.0, max_tokens=40),
                quiet=True)
    assert res.stopped and "NaN" in res.stopped
    ckpts = checkpoint_dirs(tmp_path / "run")
    assert ckpts and int(ckpts[-1].name.split("-")[1]) == res.step
    assert all(torch.isfinite(v).all() for v in load_file(str(ckpts[-1] / "model.safetensors")).values()
               if v.is_floating_point())
    assert not (tmp_path / "run" / "model.safetensors").exists()  # no draft exported from a failed run


# ---- refusing a store made for something else --------------------------------------------------

def test_mismatched_store_is_refused(store, target_dir, tmp_path):
    other = peaky_target(tmp_path / "other", target_dir, seed=1)
    with pytest.raises(TrainError, match="another target or revision"):
        train(config(store, other, tmp_path / "a"), quiet=True)
    wider = peaky_target(tmp_path / "wider", target_dir, hidden_size=96)
    with pytest.raises(TrainError, match="hidden_size 64, this target has 96"):
        train(config(store, wider, tmp_path / "b"), quiet=True)
    with pytest.raises(TrainError, match=r"holds layers \(2, 4, 5\), --layers asks for \(1, 4, 5\)"):
        train(config(store, target_dir, tmp_path / "c", layers="1,4,5"), quiet=True)
    longer = peaky_target(tmp_path / "longer", target_dir, max_position_embeddings=1024)
    tokens = build_store(tmp_path / "tok", target_dir, n=4, features=False)
    with pytest.raises(TrainError, match="weights fingerprint differs"):
        train(config(tokens, longer, tmp_path / "e", online=True), quiet=True)
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(TrainError, match="another chat template"):
        train(config(store, target_dir, tmp_path / "d", chat_template=str(tpl)), quiet=True)


def test_cli_refuses_mismatch_with_one_line(store, tmp_path, target_dir):
    from typer.testing import CliRunner

    from eagle3cli.cli import app

    r = CliRunner().invoke(app, ["train", "--data", str(store), "--model", str(target_dir), "--out",
                                 str(tmp_path / "o"), "--layers", "1,4,5"], env={"COLUMNS": "300"})
    assert r.exit_code == 1
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "holds layers (2, 4, 5)" in lines[0]


# ---- two processes ---------------------------------------------------------------------------

DDP_SCRIPT = """
import sys, torch
from safetensors.torch import save_file
from eagle3cli.config.train_config import TrainConfig
from eagle3cli.train.trainer import train
from accelerate import PartialState
data, model, out = sys.argv[1:4]
res = train(TrainConfig(data=data, model=model, out=out, draft_vocab_size="256", ttt_steps=2, lr=3e-3,
                        max_tokens=160, epochs=1, val_fraction=0.2, log_every=1, warmup_ratio=0.0), quiet=True)
rank = PartialState().process_index
save_file({k: v.contiguous() for k, v in res.draft.state_dict().items()}, f"{out}/rank{rank}.safetensors")
print("WORLD", PartialState().num_processes, "STEPS", res.step)
"""


def test_two_process_ddp_ranks_agree(store, target_dir, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "ddp"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", "29517", str(script), str(store), str(target_dir), str(out)],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "WORLD 2" in r.stdout
    w0, w1 = load_file(str(out / "rank0.safetensors")), load_file(str(out / "rank1.safetensors"))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    single = train(config(store, target_dir, tmp_path / "one", ttt_steps=2, epochs=1), quiet=True)
    assert not torch.equal(single.draft.state_dict()["fc.weight"], w0["fc.weight"])  # ranks saw half the batches each
    assert inspect_draft(out).ok


def test_report_to_names_an_unknown_or_missing_tracker():
    from eagle3cli.config.train_config import check_trackers

    assert check_trackers(None) == [] and check_trackers("") == []
    with pytest.raises(TrainError, match="unknown tracker"):
        check_trackers("tensorbored")
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(TrainError, match="pip install wandb"):
            check_trackers("wandb")


def test_warm_start_head_frozen_keeps_the_target_rows_and_still_learns(store, target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    res = train(config(store, target_dir, tmp_path / "warm", epochs=3, warm_start="head", freeze_head=True),
                quiet=True)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    d = res.draft
    vocab = d.draft_to_target(torch.arange(d.config.draft_vocab_size, device=d.d2t.device)).cpu()
    # frozen: after training the LM head is still exactly the target's rows of the draft vocab
    assert torch.equal(d.lm_head.weight.detach().cpu(), target.get_output_embeddings().weight[vocab].detach())
    assert not torch.equal(d.norm.weight.detach().cpu(), target.model.norm.weight.detach())  # the norm trains
    losses = [h["loss"] for h in res.history if "acc" in h]
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses  # the rest of the draft learns


def test_eagle31_variant_trains_its_norms_and_warns_about_refusing_engines(store, target_dir, tmp_path, monkeypatch):
    """--variant eagle3.1: the exported draft has fc_norm/norm_output, trained norms, passes
    inspect; a target family an engine refuses gets the warning at train time (issue #15)."""
    import io

    from rich.console import Console

    from eagle3cli.engines import engine_support

    monkeypatch.setitem(engine_support.TARGETS[engine_support.VLLM], "LlamaForCausalLM", False)
    buf = io.StringIO()
    res = train(config(store, target_dir, tmp_path / "v31", epochs=1, variant="eagle3.1"),
                console=Console(file=buf, width=200))
    text = buf.getvalue()
    assert "warning: vLLM 0.32.0 refuses EAGLE-3 for LlamaForCausalLM" in text
    assert "llama.cpp (llama-cpp-python 0.3.36) does not implement fc_norm, norm_output" in text
    cfg = read_config(tmp_path / "v31")
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and inspect_draft(tmp_path / "v31").ok
    t = load_file(str(tmp_path / "v31" / "model.safetensors"))
    assert all(not torch.equal(t[f"fc_norm.{i}.weight"].float(), torch.ones(64)) for i in range(3))  # they learned
    assert res.draft.config.variant == "eagle3.1"


# ---- memory ------------------------------------------------------------------------------------

def test_bf16_target_keeps_frozen_weights_in_bf16_and_trains_the_same(tmp_path, smol_tiny_dir):
    """A bf16 checkpoint: the teacher's head and the draft's embedding are kept in bf16 (half the
    memory) and training gives exactly what the fp32 copies give (--dtype float32 loads them so):
    widening bf16 to fp32 is exact, the head is widened before its matmul, the embedding's rows
    after their lookup."""
    from transformers import AutoModelForCausalLM

    src = peaky_target(tmp_path / "t32", smol_tiny_dir)
    bf16 = tmp_path / "t16"
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(bf16)
    for f in src.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            (bf16 / f.name).write_bytes(f.read_bytes())
    data = build_store(tmp_path / "store", bf16, n=12)
    kw = dict(epochs=1, val_fraction=0.0)
    small = train(config(data, bf16, tmp_path / "a", **kw), quiet=True)
    wide = train(config(data, bf16, tmp_path / "b", dtype="float32", **kw), quiet=True)
    assert small.draft.embed_tokens.weight.dtype == torch.bfloat16
    assert wide.draft.embed_tokens.weight.dtype == torch.float32
    a, b = weights(small.draft), weights(wide.draft)
    assert small.step == wide.step >= 2 and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].to(b[k].dtype), b[k]), k
    assert [h["loss"] for h in small.history] == [h["loss"] for h in wide.history]


def test_recompute_and_no_recompute_train_the_same_draft(store, target_dir, tmp_path):
    """--recompute (checkpointed TTT steps) and --no-recompute give the same losses and weights."""
    on = train(config(store, target_dir, tmp_path / "on", epochs=1, recompute=True), quiet=True)
    off = train(config(store, target_dir, tmp_path / "off", epochs=1, recompute=False), quiet=True)
    assert on.step == off.step >= 2
    for x, y in zip(on.history, off.history):
        if "loss" in x:
            assert abs(x["loss"] - y["loss"]) <= 1e-6 * abs(y["loss"]) and x["acc"] == y["acc"]
    a, b = weights(on.draft), weights(off.draft)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_recompute_auto_is_on_for_a_large_target_and_off_for_a_small_one():
    """--recompute auto decides by what the unroll would keep: a 0.5B Qwen's layer at the default
    8,192 tokens x 7 steps (about 5 GB) is recomputed, SmolLM2's at the quickstart's 1,024 x 3 is not."""
    from types import SimpleNamespace

    from eagle3cli.train.memory import RECOMPUTE_ABOVE, kept_activation_bytes, use_recompute

    qwen = SimpleNamespace(hidden_size=896, intermediate_size=4864)
    smol = SimpleNamespace(hidden_size=576, intermediate_size=1536)
    cfg = TrainConfig(data="x")
    assert cfg.recompute is None and cfg.max_tokens == 8192 and cfg.ttt_steps == 7
    assert kept_activation_bytes(8192, 7, qwen) > 4 * RECOMPUTE_ABOVE and use_recompute(cfg, qwen)
    assert not use_recompute(replace(cfg, max_tokens=1024, ttt_steps=3), smol)
    assert not use_recompute(replace(cfg, recompute=False), qwen)
    assert use_recompute(replace(cfg, recompute=True, max_tokens=16), smol)


def test_a_large_cpu_step_fixes_glibcs_mmap_threshold_and_a_small_one_does_not(store, target_dir, tmp_path,
                                                                                monkeypatch):
    """host_memory.return_freed_tensors (freed tensors leave the resident set, about 8% more CPU
    time) is called for a large step on CPU only: large_step decides, as for --recompute auto."""
    from eagle3cli.core import host_memory
    from eagle3cli.train import memory

    calls = []
    monkeypatch.setattr(host_memory, "return_freed_tensors", lambda *a: calls.append(a) or "fixed")
    Trainer(config(store, target_dir, tmp_path / "small"), quiet=True).setup()
    assert calls == []
    monkeypatch.setattr(memory, "kept_activation_bytes", lambda *a: 2 * memory.RECOMPUTE_ABOVE)
    t = Trainer(config(store, target_dir, tmp_path / "large"), quiet=True)
    t.setup()
    assert calls == [()] and t.recompute is True


# ---- mixed precision -------------------------------------------------------------------------

def test_mixed_precision_auto_is_fp32_for_muon_on_a_cpu(tmp_path):
    from eagle3cli.train.precision import accelerator, mixed_precision

    assert mixed_precision("auto", cpu=True, native_bf16=True, optimizer="muon") == "no"
    assert mixed_precision("auto", cpu=True, native_bf16=True, optimizer="adamw") == "bf16"
    assert mixed_precision("auto", cpu=False, optimizer="muon") == "bf16"  # measured on CPUs only
    assert mixed_precision("bf16", cpu=True, native_bf16=True, optimizer="muon") == "bf16"  # asked for
    cfg = TrainConfig(data="x", out=str(tmp_path), optimizer="muon", device="cpu")
    assert accelerator(cfg, []).mixed_precision == "no"


def test_mixed_precision_auto_is_bf16_on_a_gpu_and_on_a_cpu_with_native_bf16():
    from eagle3cli.core.hardware import cpu_has
    from eagle3cli.train.precision import mixed_precision

    assert mixed_precision("auto", cpu=True, native_bf16=False) == "no"
    assert mixed_precision("auto", cpu=True, native_bf16=True) == "bf16"
    assert mixed_precision("auto", cpu=False) == mixed_precision("auto", cpu=False, native_bf16=False) == "bf16"
    here = "bf16" if cpu_has("amx_tile") or cpu_has("avx512_bf16") else "no"  # this machine's probe
    assert mixed_precision("auto", cpu=True) == here
    assert mixed_precision("no", cpu=False) == "no" and mixed_precision("bf16", cpu=True, native_bf16=False) == "bf16"
    assert mixed_precision("no", cpu=True, native_bf16=True) == "no"
    with pytest.raises(TrainError, match="--mixed-precision must be one of auto, bf16, no, got 'fp16'"):
        TrainConfig(data="x", mixed_precision="fp16").validate()


def test_bf16_autocast_on_the_cpu_learns_as_fp32_does_and_is_recorded(store, target_dir, tmp_path):
    """--mixed-precision bf16 on a CPU: the matmuls run in bf16 (the weights end up different from
    the fp32 run's), the master weights stay fp32, the loss falls as fast, the draft says how it
    was trained."""
    runs = {mp: train(config(store, target_dir, tmp_path / mp, epochs=4, mixed_precision=mp), quiet=True)
            for mp in ("bf16", "no")}
    bf, fp = runs["bf16"], runs["no"]
    lb, lf = ([h["loss"] for h in r.history if "acc" in h] for r in (bf, fp))
    assert len(lb) == len(lf) == bf.step >= 8
    assert sum(lb[-3:]) / 3 < 0.9 * sum(lb[:3]) / 3, lb
    assert all(abs(a - b) <= 0.05 * b for a, b in zip(lb, lf)), (lb, lf)
    assert all(p.dtype == torch.float32 for p in bf.draft.parameters() if p.requires_grad)
    a, b = weights(bf.draft), weights(fp.draft)
    assert any(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point())
    assert read_config(tmp_path / "bf16")[METADATA_KEY]["mixed_precision"] == "bf16"
    assert read_config(tmp_path / "no")[METADATA_KEY]["mixed_precision"] == "no"


def test_loss_on_all_scores_prompt_positions_and_keeps_held_out_on_answers(store, target_dir, tmp_path):
    """--loss-on all: the training loss reads every real position (more than the answers), the
    held-out metrics still read the answers only (the same positions as an answers run), and the
    draft records it."""
    runs = {on: train(config(store, target_dir, tmp_path / on, epochs=2, loss_on=on), quiet=True)
            for on in ("answers", "all")}
    logged = {on: [h for h in r.history if "acc" in h] for on, r in runs.items()}
    assert len(logged["all"]) == len(logged["answers"]) >= 2
    for a, b in zip(logged["all"], logged["answers"]):
        assert a["tokens"] == b["tokens"] and a["positions"] > b["positions"]
    val = {on: [h["val"] for h in r.history if "val" in h][-1] for on, r in runs.items()}
    assert val["all"]["positions"] == val["answers"]["positions"] > 0
    assert val["all"]["acc"] != val["answers"]["acc"]  # a different draft, measured on the same positions
    assert read_config(tmp_path / "all")[METADATA_KEY]["loss_on"] == "all"
    with pytest.raises(TrainError, match="--loss-on must be one of answers, all, got 'prompts'"):
        TrainConfig(data="x", loss_on="prompts").validate()
