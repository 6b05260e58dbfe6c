"""optim.Muon: torch's Muon with the Newton-Schulz dtype chosen per device."""

import copy

import pytest
import torch

from eagle3cli.train import optim
from eagle3cli.train.optim import Muon, newton_schulz_dtype, orthogonalise

SHAPES = [(24, 40), (40, 24), (16, 16)]  # wide, tall (the iteration transposes it) and square


def params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.02) for s in SHAPES]


def run(opt_cls, ps, steps: int, seed: int, **kw):
    g = torch.Generator().manual_seed(seed)
    opt = opt_cls(ps, lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", **kw)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt


@pytest.mark.parametrize("nesterov", [True, False])
def test_in_bf16_each_step_equals_torchs_bit_for_bit(nesterov):
    ours, theirs = params(0), params(0)
    run(Muon, ours, 4, seed=1, ns_dtype=torch.bfloat16, nesterov=nesterov)
    run(torch.optim.Muon, theirs, 4, seed=1, nesterov=nesterov)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_a_torch_muon_checkpoint_resumes_in_ours_as_in_torchs():
    first = params(0)
    state = run(torch.optim.Muon, first, 2, seed=1).state_dict()
    ours, theirs = [p.detach().clone().requires_grad_() for p in first], [p.detach().clone().requires_grad_()
                                                                          for p in first]
    for cls, ps, kw in ((Muon, ours, {"ns_dtype": torch.bfloat16}), (torch.optim.Muon, theirs, {})):
        opt = cls(ps, lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", **kw)
        opt.load_state_dict(copy.deepcopy(state))  # loading keeps the buffers' storage: one each
        g = torch.Generator().manual_seed(5)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_fp32_iteration_is_the_exact_one_to_fp32_rounding_and_bf16_is_not():
    g = torch.randn(64, 160, generator=torch.Generator().manual_seed(2))
    coef = torch.optim.Muon([torch.nn.Parameter(g.clone())]).defaults["ns_coefficients"]
    exact = orthogonalise(g.double(), coef, 5, 1e-7, torch.float64)
    err32 = (orthogonalise(g, coef, 5, 1e-7, torch.float32).double() - exact).abs().max().item()
    err16 = (orthogonalise(g, coef, 5, 1e-7, torch.bfloat16).double() - exact).abs().max().item()
    assert err32 < 1e-5 < 1e-3 < err16
    assert torch.equal(g, torch.randn(64, 160, generator=torch.Generator().manual_seed(2)))  # input untouched


def test_fp32_steps_follow_the_bf16_ones_closely():
    a, b = params(0), params(0)
    run(Muon, a, 3, seed=1, ns_dtype=torch.float32)
    run(Muon, b, 3, seed=1, ns_dtype=torch.bfloat16)
    for x, y, x0 in zip(a, b, params(0)):
        moved = (y - x0).norm()
        assert not torch.equal(x, y) and (x - y).norm() < 0.05 * moved


def test_the_iteration_is_bf16_where_it_is_native_and_fp32_on_other_cpus(monkeypatch):
    assert newton_schulz_dtype(torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(optim, "native_bf16", lambda: True)
    assert newton_schulz_dtype(torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(optim, "native_bf16", lambda: False)
    assert newton_schulz_dtype(torch.device("cpu")) == torch.float32
    # and the optimizer asks per step: on such a CPU a step is the fp32 one
    auto, fp32 = params(0), params(0)
    run(Muon, auto, 2, seed=1)
    run(Muon, fp32, 2, seed=1, ns_dtype=torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(auto, fp32))


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_weight_decay_shrinks_the_matrices_and_leaves_the_norms(kind):
    # zero gradients: AdamW's and Muon's own updates are 0, so a step is the decay alone
    fc = torch.nn.Parameter(torch.full((8, 6), 0.5))
    head = torch.nn.Parameter(torch.full((10, 8), 0.5))  # 2-D but on AdamW under muon: decayed too
    gain, bias = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.full((8,), 0.25))
    named = [("layers.0.fc.weight", fc), ("lm_head.weight", head), ("norm.weight", gain), ("fc.bias", bias)]
    opt = optim.make_optimizer(kind, named, 1e-2, 0.1)
    for _, p in named:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(fc.detach(), torch.full((8, 6), 0.5 * (1 - 1e-3)))
    assert torch.equal(head.detach(), torch.full((10, 8), 0.5 * (1 - 1e-3)))
    assert torch.equal(gain.detach(), torch.ones(8)) and torch.equal(bias.detach(), torch.full((8,), 0.25))


def test_without_decay_adamw_keeps_one_group_so_older_checkpoints_resume():
    named = [("fc.weight", torch.nn.Parameter(torch.ones(4, 4))), ("norm.weight", torch.nn.Parameter(torch.ones(4)))]
    assert len(optim.make_optimizer("adamw", named, 1e-3, 0.0).param_groups) == 1
    assert [g["weight_decay"] for g in optim.make_optimizer("adamw", named, 1e-3, 0.1).param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_adam_beta2_reaches_adamw(kind):
    named = [("fc.weight", torch.nn.Parameter(torch.ones(4, 4))), ("norm.weight", torch.nn.Parameter(torch.ones(4)))]
    opt = optim.make_optimizer(kind, named, 1e-3, 0.0, (0.9, 0.999))
    adamw = [g for g in opt.param_groups if "betas" in g]
    assert adamw and all(g["betas"] == (0.9, 0.999) for g in adamw)
    default = optim.make_optimizer(kind, named, 1e-3, 0.0).param_groups
    assert [g["betas"] for g in default if "betas" in g][0] == (0.9, 0.95)


def inner_groups(opt) -> list[dict]:
    """The group dicts the optimizers that step the weights read their lr from."""
    return [g for part in getattr(opt, "parts", [opt]) for g in part.param_groups]


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_the_lr_schedule_reaches_every_weight_through_accelerate_and_a_resume(kind):
    # accelerate's prepare reloads the optimizer's state to place it (a resume loads a checkpoint's),
    # and a load gives each torch optimizer new group dicts: the scheduler must still reach them
    from accelerate import Accelerator

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8))
    opt = optim.make_optimizer(kind, list(model.named_parameters()), 1e-3, 0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, optim.lr_lambda(10, 0.0, 0.0, "linear"))
    model, prepared = Accelerator(cpu=True).prepare(model, opt)
    for step in range(1, 4):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        prepared.step()
        schedule.step()
        assert [g["lr"] for g in inner_groups(opt)] == pytest.approx([1e-3 * (1 - step / 10)] * len(inner_groups(opt)))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    schedule.step()
    assert [g["lr"] for g in inner_groups(opt)] == pytest.approx([6e-4] * len(inner_groups(opt)))
    assert len(inner_groups(opt)) == 2  # muon: Muon's matrix, AdamW's 1-D weights; adamw: decayed, undecayed


def test_a_time_budget_refit_reschedules_every_group():
    # --max-minutes makes a new step count the run's: Muon's and AdamW's groups both follow it
    from types import SimpleNamespace

    from eagle3cli.train.trainer import step_budget

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8))
    opt = optim.make_optimizer("muon", list(model.named_parameters()), 1e-3, 0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, optim.lr_lambda(100, 0.0, 0.0, "linear"))
    cfg = SimpleNamespace(max_minutes=5.0, warmup_ratio=0.0, min_lr_ratio=0.0, lr_schedule="linear", ttt_warmup=0,
                          max_tokens=64, seed=0)
    t = SimpleNamespace(cfg=cfg, val_idx=[], total_steps=100, scheduler=schedule, started=0.0,
                        view=SimpleNamespace(set_total=lambda n: None, note=lambda why: None),
                        acc=SimpleNamespace(num_processes=1))
    step_budget(t).apply(10, "the time allows 10 steps")
    opt.step()  # no gradients: nothing moves, and the scheduler's step follows an optimizer's as torch expects
    schedule.step()
    assert t.total_steps == 10
    assert [g["lr"] for g in inner_groups(opt)] == pytest.approx([9e-4, 9e-4])
