"""The quickstart's planner as a pure function of measurements and flags, and the estimate arithmetic
gen-data and train share with it."""

import dataclasses

import pytest

from eagle3cli.core.estimate import eta_line, minutes_text, regen_rate, regenerated, train_seconds
from eagle3cli.workflows.plan import (
    MIN_STEPS,
    REGEN_PAYS_TOKENS_PER_S,
    BudgetError,
    Measurements,
    PlanFlags,
    make_plan,
    stage_seconds,
)

# About what the 2-core AMD EPYC with AVX512-BF16 measures for SmolLM2 (bf16 regeneration)
FAST = Measurements(cpu="AVX512-BF16", threads=2, regen_dtype="bfloat16", regen_bound=210.0,
                    forward_tokens_per_s=2500.0, step_s=2.0, warmup_step_s=0.8, decode_token_s=0.06, load_s=2.0,
                    spent_s=40.0, answer_tokens=120.0, regenerated_tokens=240.0, text_tokens=420.0)
# The same cores without bf16: regeneration in fp32 at about half the rate
SLOW = dataclasses.replace(FAST, cpu="AVX2", regen_dtype="float32", regen_bound=140.0, step_s=2.6, warmup_step_s=1.0)


def test_estimate_arithmetic():
    # a cut answer ends the conversation; a prompt reaching max_length is not answered
    assert regenerated([(20, 50), (30, 40)], max_new_tokens=128, max_length=512) == (90, 140)
    assert regenerated([(20, 500), (30, 40)], max_new_tokens=128, max_length=512) == (128, 148)
    assert regenerated([(20, 50), (500, 40)], max_new_tokens=128, max_length=512) == (50, 70)
    assert regen_rate(100.0, "bfloat16") == pytest.approx(58.0) and regen_rate(100.0, "float32") == pytest.approx(59.0)
    assert train_seconds(100, 25, 2.0, 0.5) == pytest.approx(25 * 0.5 + 75 * 2.0)
    assert minutes_text(40) == "~40 s" and minutes_text(600) == "~10 min" and minutes_text(7200) == "~2.0 h"
    assert eta_line("train", 60000, "tokens", 100.0) == "train: ~10 min for 60,000 tokens at the measured 100 tokens/s"


def test_route_follows_the_measured_generation_rate():
    fast, slow = make_plan(FAST, PlanFlags(budget_min=20)), make_plan(SLOW, PlanFlags(budget_min=20))
    assert regen_rate(FAST.regen_bound, "bfloat16") >= REGEN_PAYS_TOKENS_PER_S > regen_rate(SLOW.regen_bound, "float32")
    assert fast.regenerate is True and slow.regenerate is False
    assert fast.reasons[0].startswith("data: regenerate") and "bfloat16" in fast.reasons[0]
    assert slow.reasons[0].startswith("data: the dataset's text, trained online") and "float32" in slow.reasons[0]
    assert slow.seconds["gen-data"] == pytest.approx(10.0)  # tokens only: no model, no generation
    # asked for, the route is kept and said so
    forced = make_plan(SLOW, PlanFlags(budget_min=20, regenerate=True))
    assert forced.regenerate is True and forced.reasons[0] == "data: regenerate (as asked)"


@pytest.mark.parametrize("m", [FAST, SLOW])
def test_a_bigger_budget_plans_more_and_every_plan_fits(m):
    plans = [make_plan(m, PlanFlags(budget_min=b)) for b in (10, 20, 40)]
    for b, p in zip((10, 20, 40), plans):
        assert p.total_s <= b * 60
        assert p.total_s >= 0.85 * b * 60  # it uses the budget, not a fixed size
        assert p.steps >= MIN_STEPS and p.warmup_steps == int(p.steps * 0.25)
        # the parts add up: the stage costs of this size, and the fixed ones
        assert {k: pytest.approx(v) for k, v in stage_seconds(m, PlanFlags(budget_min=b), p.regenerate,
                                                              p.conversations, p.steps).items()} == \
            {k: p.seconds[k] for k in ("gen-data", "train")}
        assert p.seconds["measure"] == m.spent_s
    assert plans[0].conversations < plans[1].conversations < plans[2].conversations
    assert plans[0].steps < plans[1].steps < plans[2].steps
    assert [p.eval_prompts for p in plans] == [2, 4, 8]
    assert len(plans[1].reasons) == 5 and plans[1].reasons[-1].endswith("of the 20-minute budget")


def test_regenerated_data_is_read_three_times_and_online_once():
    p = make_plan(FAST, PlanFlags(budget_min=20))
    tokens = p.conversations * FAST.regenerated_tokens
    assert p.steps == round(3 * tokens / (1024 * 0.88))
    q = make_plan(SLOW, PlanFlags(budget_min=20))
    assert q.steps == round(q.conversations * SLOW.text_tokens / (1024 * 0.88))


def test_given_sizes_win_and_an_overrun_is_said():
    p = make_plan(FAST, PlanFlags(budget_min=20, samples=100))
    assert p.conversations == 100 and p.steps == round(3 * 100 * 240 / (1024 * 0.88))
    assert "--max-samples as given" in p.reasons[1]
    p = make_plan(FAST, PlanFlags(budget_min=20, steps=50, eval_prompts=3))
    assert p.steps == 50 and p.eval_prompts == 3 and "(as asked)" in p.reasons[2]
    big = make_plan(FAST, PlanFlags(budget_min=20, samples=5000, steps=4000))
    assert big.total_s > 20 * 60
    assert big.reasons[-1].startswith("note: --max-samples and --max-steps make the run longer")


def test_a_budget_below_the_minimum_is_refused_with_the_minimum():
    with pytest.raises(BudgetError) as e:
        make_plan(FAST, PlanFlags(budget_min=1))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--budget 1 is below the ")
    minimum = int(msg.split("give --budget ")[1].split()[0])
    assert minimum >= 2
    p = make_plan(FAST, PlanFlags(budget_min=minimum))  # the minimum stated is enough
    assert p.steps >= MIN_STEPS and p.total_s <= minimum * 60
    assert p.eval_prompts == 1 and p.reasons[2].endswith("(the budget is near this machine's minimum)")
    with pytest.raises(BudgetError):
        make_plan(FAST, PlanFlags(budget_min=minimum - 1))


def test_each_stage_is_limited_to_the_time_left_for_it():
    """gen-data gets its planned time with slack; training the time left before the planned eval
    and export, however late gen-data ended (but never less than MIN_STEPS need); eval what is left
    before the export. On time, the three end at END_SHARE of the budget."""
    from eagle3cli.workflows.plan import END_SHARE, GEN_DATA_SLACK, per_step_seconds, stage_minutes

    f = PlanFlags(budget_min=20)
    p = make_plan(FAST, f)
    assert stage_minutes(FAST, f, p, "gen-data", 0) == pytest.approx(p.seconds["gen-data"] * GEN_DATA_SLACK / 60)
    on_time = p.seconds["measure"] + p.seconds["gen-data"]
    train = stage_minutes(FAST, f, p, "train", on_time)
    end = 20 * 60 * END_SHARE
    assert on_time + train * 60 + p.seconds["eval"] + p.seconds["export"] == pytest.approx(end)
    assert train * 60 >= p.seconds["train"]  # the plan's steps fit (the plan fills less than END_SHARE)
    late = stage_minutes(FAST, f, p, "train", on_time + 120)
    assert late == pytest.approx(train - 2)  # two minutes late: two minutes less training
    full_s, warm_s = per_step_seconds(FAST, f, online=not p.regenerate)
    least = stage_minutes(FAST, f, p, "train", 20 * 60)  # no time left: still MIN_STEPS steps
    fixed = p.seconds["train"] - train_seconds(p.steps, p.warmup_steps, full_s, warm_s)
    assert least * 60 == pytest.approx(fixed + train_seconds(MIN_STEPS, MIN_STEPS // 4, full_s, warm_s))
    after_train = on_time + train * 60
    assert stage_minutes(FAST, f, p, "eval", after_train) * 60 == pytest.approx(p.seconds["eval"])
    assert stage_minutes(FAST, f, p, "eval", 20 * 60) == 0.5  # the first prompt runs regardless


# Verification of 1..4 rows after a prefix, in seconds: AVX-512's tiles (rows nearly free) and
# AVX2 Zen 1's (3 rows 3.3x one, as its quickstart measured)
FLAT_ROWS = {1: 0.030, 2: 0.031, 3: 0.032, 4: 0.033}
STEEP_ROWS = {1: 0.067, 2: 0.090, 3: 0.221, 4: 0.290}


def test_the_ttt_depth_is_the_draft_depth_the_verification_costs_make_pay():
    from eagle3cli.workflows.plan import choose_depth

    flat, steep = dataclasses.replace(FAST, verify_s=FLAT_ROWS), dataclasses.replace(FAST, verify_s=STEEP_ROWS)
    # a strong draft on rows that are nearly free: the deepest chain; on AVX2's rows only depth 1
    assert choose_depth(flat, PlanFlags(), acc=0.7)[0] == 3 and choose_depth(steep, PlanFlags(), acc=0.7)[0] == 1
    # a quickstart's draft (acc ~0.25): depth 1 even where rows are nearly free, the drafting steps cost more
    assert choose_depth(flat, PlanFlags())[0] == 1
    planned = make_plan(steep, PlanFlags(budget_min=20))
    deep = make_plan(steep, PlanFlags(budget_min=20, ttt_steps=3))  # asked for: kept
    assert planned.ttt_steps == 1 and planned.warmup_steps == 0  # one step unrolled: no warm-up to do
    assert deep.ttt_steps == 3 and deep.warmup_steps == int(deep.steps * 0.25)
    assert planned.steps > deep.steps  # TTT 1 steps are cheaper: more of them in the same time
    line = next(r for r in planned.reasons if r.startswith("draft: "))
    assert "1 TTT step:" in line and "2 rows 1.34x" in line
    assert make_plan(FAST, PlanFlags(budget_min=20)).ttt_steps == FAST.step_ttt  # not timed: the timed depth


def test_step_seconds_scale_with_the_unrolled_steps():
    from eagle3cli.workflows.plan import per_step_seconds

    full3, warm = per_step_seconds(FAST, PlanFlags(ttt_steps=3), online=False)
    full1, _ = per_step_seconds(FAST, PlanFlags(ttt_steps=1), online=False)
    full2, _ = per_step_seconds(FAST, PlanFlags(ttt_steps=2), online=False)
    assert full3 == pytest.approx(FAST.step_s) and full1 == pytest.approx(warm) == pytest.approx(FAST.warmup_step_s)
    assert full2 == pytest.approx((FAST.step_s + FAST.warmup_step_s) / 2)


def test_measurements_survive_plan_json():
    import json

    m = dataclasses.replace(FAST, verify_s=FLAT_ROWS)
    back = Measurements(**json.loads(json.dumps(dataclasses.asdict(m))))
    assert back == m and back.verify_s[2] == 0.031


def test_eval_is_planned_from_the_measured_fast_path():
    from eagle3cli.workflows.plan import eval_seconds

    hf_only = eval_seconds(FAST, PlanFlags(), 4)
    fast = dataclasses.replace(FAST, verify_s={1: 0.02, 2: 0.03, 3: 0.032, 4: 0.033})
    timed = eval_seconds(fast, PlanFlags(ttt_steps=1), 4)
    tokens = 4 * 2 * 64
    per_token = 0.06 + 0.02 + (0.03 + 0.07 * 0.02) / 1.25  # HF step, fast step, a depth-1 cycle over its tokens
    assert timed == pytest.approx(45 + tokens * per_token) and timed < hf_only


def test_the_quickstart_table_says_when_eval_measured_fewer_prompts_than_planned():
    from eagle3cli.commands.quickstart import eval_prompts_cell

    res = {"tasks": {"mt_bench": {"num_prompts": 2}}, "time_limit": {"minutes": 1.5, "prompts": {"mt_bench": [2, 8]}}}
    assert eval_prompts_cell(res, 4).startswith("2 of 4 planned: the eval's time limit (1.5 min) came first")
    assert eval_prompts_cell({"tasks": {"mt_bench": {"num_prompts": 6}}}, 4) == "6"


def test_the_draft_family_is_the_one_measured_ahead_at_the_training_time():
    from eagle3cli.workflows.plan import FAMILY_TAU, choose_draft_type

    family, why = choose_draft_type(10.0, PlanFlags())
    ahead = max(FAMILY_TAU, key=lambda k: FAMILY_TAU[k][-1][1])
    assert family == ahead and why.startswith(f"{ahead}: at ~10 core-minutes")
    assert choose_draft_type(10.0, PlanFlags(draft_type="dflash")) == ("dflash", "dflash (as asked)")
    plan = make_plan(FAST, PlanFlags(budget_min=20))
    assert plan.draft_type == ahead and any(r.startswith(f"draft: {ahead}: ") for r in plan.reasons)


def test_capture_is_planned_at_its_own_measured_rate():
    # gen-data's capture runs at the rate measured at its own dtype and batch; a plan.json from
    # before that measurement (0) plans it at the forward's rate
    f, n, steps = PlanFlags(budget_min=20), 100, 50
    old = stage_seconds(FAST, f, True, n, steps)["gen-data"]
    fast_capture = dataclasses.replace(FAST, capture_tokens_per_s=5000.0)
    new = stage_seconds(fast_capture, f, True, n, steps)["gen-data"]
    assert old - new == pytest.approx(n * FAST.regenerated_tokens * (1 / 2500.0 - 1 / 5000.0))
    assert make_plan(fast_capture, f).conversations > make_plan(FAST, f).conversations
