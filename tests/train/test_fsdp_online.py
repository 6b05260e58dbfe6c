"""--online training with the target sharded by FSDP2 over two CPU processes (gloo).

Two processes with --grad-accum 1 average the gradients of the same two micro-batches that one
process with --grad-accum 2 accumulates (rank r takes batch r of each pair), so the loss curves
must agree up to float summation order; an interrupted and resumed sharded run must end on the
same weights, bit for bit.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3cli.config.train_config import TrainConfig, TrainError
from eagle3cli.train.trainer import train
from tests.helpers.trainer import build_store, peaky_target

REPO = Path(__file__).resolve().parents[2]
SETTINGS = dict(online=True, draft_vocab_size="256", ttt_steps=2, lr=3e-3, max_tokens=80, epochs=1, max_steps=3,
                val_fraction=0.2, log_every=1, warmup_ratio=0.0, save_every=1, seed=0)

SCRIPT = """
import json, sys
from dataclasses import replace
from safetensors.torch import save_file
from accelerate import PartialState
from eagle3cli.config.train_config import TrainConfig
from eagle3cli.train.trainer import Trainer, train
data, model, out, settings = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
cfg = TrainConfig(data=data, model=model, out=out + "/full", **settings)
t = Trainer(cfg, quiet=True)
t.setup()
w = t.target.model.layers[0].self_attn.q_proj.weight
print("SHARDED", type(t.target).__name__, type(w).__name__, tuple(w.to_local().shape), tuple(w.shape))
full = t.run()
train(replace(cfg, out=out + "/cut"), quiet=True, stop_after=2)
resumed = train(replace(cfg, out=out + "/cut", resume=True), quiet=True)
rank = PartialState().process_index
for name, res in (("full", full), ("resumed", resumed)):
    save_file({k: v.contiguous() for k, v in res.draft.state_dict().items()}, f"{out}/{name}-rank{rank}.safetensors")
if rank == 0:
    json.dump({"history": full.history, "steps": full.step}, open(out + "/history.json", "w"))
"""


@pytest.fixture(scope="module")
def target_dir(smol_tiny_dir, tmp_path_factory):
    return peaky_target(tmp_path_factory.mktemp("target"), smol_tiny_dir)


@pytest.fixture(scope="module")
def tokens_store(tmp_path_factory, target_dir):
    return build_store(tmp_path_factory.mktemp("tokens"), target_dir, n=30, features=False)


def test_fsdp2_two_processes_match_one_and_resume_exactly(tokens_store, target_dir, tmp_path):
    script = tmp_path / "fsdp.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           # what `accelerate launch --use_fsdp --fsdp_version 2` sets
           "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        "29523", str(script), str(tokens_store), str(target_dir), str(tmp_path),
                        json.dumps({**SETTINGS, "grad_accum": 1})],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    # the target's decoder weights are DTensors of which each process holds half the rows
    assert "SHARDED FSDPLlamaForCausalLM DTensor (32, 64) (64, 64)" in r.stdout, r.stdout
    two = json.loads((tmp_path / "history.json").read_text())
    assert two["steps"] == 3
    one = train(TrainConfig(data=str(tokens_store), model=str(target_dir), out=str(tmp_path / "one"),
                            grad_accum=2, **SETTINGS), quiet=True)
    losses = lambda h: [x["loss"] for x in h if "loss" in x]  # noqa: E731
    assert len(losses(two["history"])) == len(losses(one.history)) == 3
    for a, b in zip(losses(two["history"]), losses(one.history)):
        assert abs(a - b) <= 1e-4 * abs(b), (losses(two["history"]), losses(one.history))
    val = lambda h: [x["val"]["acc"] for x in h if "val" in x][-1]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(val(two["history"]), val(one.history))) <= 1e-4
    w = {n: load_file(str(tmp_path / f"{n}.safetensors")) for n in
         ("full-rank0", "full-rank1", "resumed-rank0", "resumed-rank1")}
    # ranks agree, resume exact
    assert all(torch.equal(w["full-rank0"][k], w[n][k]) for n in w for k in w["full-rank0"])
    ref = one.draft.state_dict()
    assert max(float((w["full-rank0"][k] - ref[k]).abs().max()) for k in ref if ref[k].is_floating_point()) <= 1e-4
    ckpt = sorted((tmp_path / "full" / "checkpoints").glob("step-*"))[-1] / "model.safetensors"
    saved = load_file(str(ckpt))  # checkpoints hold the draft's full parameters (not shards)
    assert saved["fc.weight"].shape == ref["fc.weight"].shape


def test_fsdp_refuses_offline_fsdp1_and_quantized():
    from eagle3cli.model.sharded_target import check_fsdp

    class Acc:
        class distributed_type:
            name = "FSDP"

        class state:
            class fsdp_plugin:
                fsdp_version = 1

    with pytest.raises(TrainError, match="only --online training runs"):
        check_fsdp(Acc, online=False, quantized=False)
    with pytest.raises(TrainError, match="set fsdp_version: 2"):
        check_fsdp(Acc, online=True, quantized=False)
    Acc.state.fsdp_plugin.fsdp_version = 2
    with pytest.raises(TrainError, match="cannot shard a quantized target"):
        check_fsdp(Acc, online=True, quantized=True)
    Acc.state.fsdp_plugin.cpu_ram_efficient_loading = True
    with pytest.raises(TrainError, match="set fsdp_cpu_ram_efficient_loading: false"):
        check_fsdp(Acc, online=True, quantized=False)
    Acc.state.fsdp_plugin.cpu_ram_efficient_loading = False
    check_fsdp(Acc, online=True, quantized=False)


def test_held_out_batches_are_padded_only_for_a_sharded_target():
    from eagle3cli.model.sharded_target import padded

    batches = [[0], [1], [2]]
    assert padded(batches, 0, 2, sharded=True) == [([0], True), ([2], True)]
    assert padded(batches, 1, 2, sharded=True) == [([1], True), ([0], False)]  # run (a collective), not counted
    assert padded(batches, 1, 2, sharded=False) == [([1], True)]
