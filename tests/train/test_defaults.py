"""The training options the defaults study compares: an independent --norm-output (speculators'
three norms trainable and exported), --lr-schedule and --init-std."""

import json

import pytest
import torch

from eagle3cli.config.train_config import TrainConfig, TrainError, draft_options, resolve
from eagle3cli.engines.engine_support import LLAMACPP, SGLANG, VLLM, unsupported_options
from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from eagle3cli.publish.export import load_draft, save_draft
from eagle3cli.publish.formats.writers import convert
from eagle3cli.train.optim import lr_lambda
from tests.helpers.tiny import tiny_model

LAYERS = (2, 4, 5)
SPECULATORS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def test_norm_output_is_its_own_flag():
    cfg, _ = resolve("none", {"data": "x", "norm_output": True})
    assert draft_options(cfg) == {"fc_norm": False, "norm_output": True, "norm_before_fc": True,
                                  "norm_before_residual": False}
    cfg, _ = resolve("none", {"data": "x", "norm_before_fc": True, "norm_before_residual": True, "norm_output": True})
    assert draft_options(cfg) == {"fc_norm": False, **SPECULATORS}
    cfg, _ = resolve("none", {"data": "x", "variant": "eagle3.1", "norm_before_fc": False})
    assert draft_options(cfg)["norm_output"] and draft_options(cfg)["fc_norm"]


def test_speculators_three_norms_export_convert_and_engine_support(target, tmp_path):
    cfg = DraftConfig.from_target(target.config, 64, LAYERS, **SPECULATORS)
    d = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight)
    d.init_weights(seed=3)
    d.set_vocab(torch.arange(0, 128, 2))
    out = save_draft(d, tmp_path / "d")
    written = json.loads((out / "config.json").read_text())
    assert written["norm_output"] is True and written["norm_before_fc"] is True and not written.get("fc_norm")
    back, _ = load_draft(out, target=target)
    assert back.config.options() == SPECULATORS
    spec, _ = convert(out, tmp_path / "spec", "speculators", target=target)
    sc = json.loads((spec / "config.json").read_text())
    assert (sc["norm_before_fc"], sc["norm_output"], sc["fc_norm"]) == (True, True, False)
    again, _ = convert(spec, tmp_path / "again", "ours", target=target)
    r, _ = load_draft(again, target=target)
    ids = torch.randint(0, cfg.vocab_size, (1, 7))
    aux = torch.randn(1, 7, 3 * cfg.target_hidden_size)
    with torch.no_grad():
        assert torch.equal(r(ids, aux)[1], back(ids, aux)[1])
    missing = unsupported_options(SPECULATORS)
    assert missing[VLLM] == [] and missing[SGLANG] == ["norm_before_residual"]
    assert missing[LLAMACPP] == ["norm_output"]


@pytest.mark.parametrize("shape", ["cosine", "linear"])
def test_schedules_warm_up_then_reach_the_floor_at_the_last_step(shape):
    f = lr_lambda(100, 0.1, 0.2, shape)
    assert [f(i) for i in range(10)] == pytest.approx([(i + 1) / 10 for i in range(10)])
    values = [f(i) for i in range(10, 101)]
    assert values[0] == pytest.approx(1.0) and values[-1] == pytest.approx(0.2)
    assert all(a >= b for a, b in zip(values, values[1:]))
    mid = f(55)  # halfway through the decay
    assert mid == pytest.approx(0.2 + 0.8 * 0.5)
    quarter = f(32)  # a quarter through (22.5 of 90 steps): cosine stays higher than linear there
    assert quarter == pytest.approx(0.2 + 0.8 * (0.5 * (1 + torch.cos(torch.tensor(torch.pi * 22 / 90)).item())
                                                if shape == "cosine" else 1 - 22 / 90))


def test_constant_schedule_keeps_the_peak():
    f = lr_lambda(50, 0.02, 0.0, "constant")
    assert f(0) == 1.0 and all(f(i) == 1.0 for i in range(1, 60))


def test_bad_schedule_and_init_std_are_refused_before_anything_loads():
    with pytest.raises(TrainError, match="lr-schedule"):
        TrainConfig(data="x", lr_schedule="step").validate()
    with pytest.raises(TrainError, match="--init-std"):
        TrainConfig(data="x", init_std=0.0).validate()
    with pytest.raises(TrainError, match="--residual-init-std"):
        TrainConfig(data="x", residual_init_std=-0.01).validate()


def test_init_std_scales_the_random_weights(target):
    cfg = DraftConfig.from_target(target.config, 64, LAYERS)
    stds = []
    for std in (0.01, 0.05):
        d = Eagle3Draft(cfg)
        d.init_weights(std=std, seed=0)
        stds.append(float(d.fc.weight.detach().std()))
    assert stds[0] == pytest.approx(0.01, rel=0.1) and stds[1] == pytest.approx(0.05, rel=0.1)


def test_default_architecture_is_norm_before_fc_and_eagle31_takes_fc_norm_instead():
    cfg, _ = resolve("none", {"data": "x"})
    assert draft_options(cfg) == {"fc_norm": False, "norm_output": False, "norm_before_fc": True,
                                  "norm_before_residual": False}
    cfg, _ = resolve("none", {"data": "x", "variant": "eagle3.1"})
    assert draft_options(cfg) == {"fc_norm": True, "norm_output": True, "norm_before_fc": False,
                                  "norm_before_residual": False}
    with pytest.raises(Exception, match="does not combine"):
        resolve("none", {"data": "x", "variant": "eagle3.1", "norm_before_fc": True})


def test_paper_preset_sits_below_recipe_and_flags(tmp_path):
    cfg, _ = resolve("none", {"data": "x", "preset": "paper"})
    assert cfg.lr == 1e-4 and not draft_options(cfg)["norm_before_fc"] and cfg.lr_schedule == "cosine"
    assert cfg.loss_on == "answers"
    eagle3, _ = resolve("none", {"data": "x"})
    assert eagle3.lr == 1e-3 and eagle3.lr_schedule == "linear" and draft_options(eagle3)["norm_before_fc"]
    assert eagle3.loss_on == "all"
    cfg, _ = resolve("none", {"data": "x", "preset": "paper", "lr": 5e-4})
    assert cfg.lr == 5e-4 and not draft_options(cfg)["norm_before_fc"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("preset: paper\nnorm_before_fc: true\n")
    cfg, _ = resolve(str(recipe), {"data": "x"})
    assert cfg.lr == 1e-4 and draft_options(cfg)["norm_before_fc"]


def test_recipes_do_not_pin_the_learning_rate():
    """A recipe that sets lr would hide the default lr (and --preset) for its whole family."""
    from eagle3cli.config.train_config import load_recipe, recipe_names

    assert all("lr" not in load_recipe(name)[1] for name in recipe_names())
