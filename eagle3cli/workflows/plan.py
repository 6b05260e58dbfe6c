"""The quickstart's time budget: measure this machine, then size the run to fit it.

``measure`` (half a minute on 2 CPU cores) loads the target and times what the run will do:
one full decode step of gen-data's continuous batcher at the dtype regeneration computes in here
(bf16 only where the CPU multiplies bf16 natively), a target forward (feature capture, and the
teacher of online training), one training step with the full TTT unroll and one with a single
step (--ttt-warmup), one plain decoding step (eval), and the token lengths of a sample of the
data. ``make_plan`` is a pure function of those :class:`Measurements` and the flags: it picks the
data route (regenerate where the target generates fast enough for regenerated data to pay for its
time, else train online on the dataset's text: docs/benchmarks.md, "Which data and settings
pay"), then the eval size, then the conversations and steps that fill the rest of the budget,
and says why in one line each. The arithmetic is ``core.estimate``'s, which gen-data and train
use for their own estimates.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace

from ..core import hardware
from ..core.errors import Eagle3Error
from ..core.estimate import mean_regenerated, minutes_text, regen_rate, regen_seconds, train_seconds
from ..core.threads import choose_threads
from ..data.regen_rate import hf_step_seconds, median_seconds


class BudgetError(Eagle3Error, ValueError):
    """The budget cannot hold even the smallest run (the message gives the minimum)."""


# Regenerated data pays for its time where the target generates at least this many tokens/s in a
# whole gen-data run. Measured on 2 cores (docs/benchmarks.md, "Which data and settings pay"):
# at 60 tokens/s (fp32) the dataset's text trained online reached a higher mt_bench tau for the
# same CPU time; at 155 (bf16) regenerating was as cheap in wall time and at least as good. On
# AVX2-only cores fp32 regeneration ran at 84-92: online there too.
REGEN_PAYS_TOKENS_PER_S = 100.0
EPOCHS_REGENERATED = 3  # the draft is data-bound: each regenerated conversation is read 3 times
PACKING = 0.88  # real tokens per --max-tokens of a token-budget batch (the rest: a last sample that did not fit)
MIN_STEPS = 20  # fewer optimizer steps train no draft worth measuring
EVAL_PROMPTS_PER_20_MIN = 4  # mt_bench prompts (2 turns each); at least 2, at most 16
EVAL_TURNS = 2
# Fixed costs the measurements do not cover, per stage: reading and checking the data, building the
# vocabulary, the eval's tree calibration (--tree auto), writing the Hub folder.
SETUP_S = {"gen-data": 10.0, "train": 15.0, "eval": 45.0, "export": 5.0}
USE_OF_BUDGET = 0.92  # the plan fills this share: the rest absorbs a machine that gets busier


@dataclass(frozen=True)
class Measurements:
    """What ``measure`` found on this machine (seconds, tokens/s)."""

    cpu: str  # its class: "AMX", "AVX512-BF16", "AVX-512", "AVX2", ...
    threads: int  # torch threads the run uses (choose_threads)
    regen_dtype: str  # what gen-data's regeneration computes in here
    regen_bound: float  # generated tokens/s of one full decode step of the batcher's slots
    forward_tokens_per_s: float  # target forward (feature capture; online training's teacher)
    step_s: float  # one training step of max_tokens tokens, full TTT unroll, features given
    warmup_step_s: float  # the same with one TTT step (--ttt-warmup)
    decode_token_s: float  # one plain decoding step of one row (eval)
    load_s: float  # loading the target
    spent_s: float  # already spent when planning (model preparation, data, these measurements)
    answer_tokens: float  # tokens the target will generate per conversation (sampled data)
    regenerated_tokens: float  # tokens a regenerated conversation stores (prompts + answers)
    text_tokens: float  # tokens of a conversation of the dataset's own text, cut at max_length
    threads_note: str = ""  # why fewer threads than cores (choose_threads)
    step_ttt: int = 3  # the TTT steps step_s was timed with
    # rows -> seconds of one target forward verifying that many rows after a prefix (eval's path)
    verify_s: dict = field(default_factory=dict)
    # gen-data's feature capture at the dtype and batch it takes (--capture-dtype auto,
    # samples.capture_budget); 0: not measured (a plan.json from before), forward_tokens_per_s stands in
    capture_tokens_per_s: float = 0.0

    def __post_init__(self):  # plan.json keeps the rows as strings
        object.__setattr__(self, "verify_s", {int(k): float(v) for k, v in self.verify_s.items()})


@dataclass
class PlanFlags:
    """What the user fixed; None: the planner chooses."""

    budget_min: float = 20.0
    regenerate: bool | None = None
    samples: int | None = None
    steps: int | None = None
    eval_prompts: int | None = None
    max_tokens: int = 1024
    ttt_warmup_share: float = 0.25
    eval_tokens: int = 64
    val_fraction: float = 0.05  # of the conversations, at most val_max
    val_max: int = 40
    ttt_steps: int | None = None  # None: the depth the verification costs here make pay (choose_depth)
    draft_type: str | None = None  # None: the family ahead at this training time (choose_draft_type)


@dataclass
class Plan:
    regenerate: bool
    conversations: int
    steps: int
    warmup_steps: int
    eval_prompts: int
    seconds: dict = field(default_factory=dict)  # stage -> planned seconds
    ttt_steps: int = 3
    draft_type: str = "eagle3"
    reasons: list[str] = field(default_factory=list)  # one line each: data, size, eval, total

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


# ---------------------------------------------------------------------------------- the plan


def regen_pays(m: Measurements) -> bool:
    return regen_rate(m.regen_bound, m.regen_dtype) >= REGEN_PAYS_TOKENS_PER_S


def eval_seconds(m: Measurements, f: PlanFlags, prompts: int) -> float:
    """Plain decoding twice (HF generate and the fast path) and speculative decoding, per token: the
    HF step as timed, the fast path's one-row step and a cycle of the planned depth from the measured
    verification (a cycle yields the tokens a quickstart draft's chain accepts), else the HF step."""
    per_token = 3 * m.decode_token_s
    depth = f.ttt_steps or m.step_ttt
    if m.verify_s.get(1) and m.verify_s.get(depth + 1):
        cycle = m.verify_s[depth + 1] + depth * DRAFT_STEP_SHARE * m.verify_s[1]
        per_token = m.decode_token_s + m.verify_s[1] + cycle / sum(QUICKSTART_ACC ** k for k in range(depth + 1))
    return SETUP_S["eval"] + prompts * EVAL_TURNS * f.eval_tokens * per_token


def _val(f: PlanFlags, conversations: int) -> int:
    return min(f.val_max, math.floor(conversations * f.val_fraction))


def per_step_seconds(m: Measurements, f: PlanFlags, online: bool) -> tuple[float, float]:
    """(full, warm-up) step seconds at ``f.ttt_steps`` (None: as timed), each TTT step after the first
    costing the same share of the timed full step; online adds the target's forward over the step's tokens."""
    extra = f.max_tokens / m.forward_tokens_per_s if online else 0.0
    full = m.step_s
    if f.ttt_steps is not None and m.step_ttt > 1:
        full = m.warmup_step_s + (m.step_s - m.warmup_step_s) * (f.ttt_steps - 1) / (m.step_ttt - 1)
    return full + extra, m.warmup_step_s + extra


def warmup_steps(f: PlanFlags, steps: int) -> int:
    """--ttt-warmup's steps: a share of them, none when the whole unroll is one step."""
    return 0 if f.ttt_steps == 1 else int(steps * f.ttt_warmup_share)


# A one-layer draft's drafting step costs about this share of a one-row target step on SmolLM2 (the
# draft chain of 3 was 16.4 ms against a 76 ms verification on Zen 1 cores): the depth's price besides
# the verification's extra rows.
DRAFT_STEP_SHARE = 0.07
# Held-out per-position acceptance of a quickstart draft (0.17-0.30 at its budgets, docs/benchmarks.md):
# only the ranking of the depths depends on it, and it barely changes between these values.
QUICKSTART_ACC = 0.25
MAX_DEPTH = 3


# Eval tau (--tree auto, 10 mt_bench prompts) of each family's draft after (core-minutes of its training
# loop, tau) on SmolLM2 and one store, at each family's CPU settings (EAGLE-3 as the quickstart trains it,
# DFlash with blocks of 4): docs/benchmarks.md, "DFlash against EAGLE-3". The planner trains the family
# ahead at the run's training time; DFlash was behind at every budget measured on a CPU.
FAMILY_TAU = {"eagle3": ((1.55, 1.436), (17.4, 1.592)), "dflash": ((1.5, 1.305), (17.4, 1.250))}


def _tau_at(points, minutes: float) -> float:
    """Linear in log-minutes between the measured points, flat past either end."""
    (m0, t0), (m1, t1) = points[0], points[-1]
    if minutes <= m0:
        return t0
    if minutes >= m1:
        return t1
    w = math.log(minutes / m0) / math.log(m1 / m0)
    return t0 + w * (t1 - t0)


def choose_draft_type(train_core_minutes: float, f: PlanFlags) -> tuple[str, str]:
    """The draft family whose measured tau is higher at this much training (core-minutes)."""
    if f.draft_type is not None:
        return f.draft_type, f"{f.draft_type} (as asked)"
    tau = {k: _tau_at(v, train_core_minutes) for k, v in FAMILY_TAU.items()}
    best = max(tau, key=tau.get)
    other = min(tau, key=tau.get)
    return best, (f"{best}: at ~{train_core_minutes:.0f} core-minutes of training its drafts reached tau "
                  f"~{tau[best]:.2f} against {other}'s ~{tau[other]:.2f} (SmolLM2, docs/benchmarks.md)")


def depth_gain(verify_s: dict, depth: int, acc: float = QUICKSTART_ACC) -> float:
    """Expected speedup of a chain of ``depth`` drafted tokens: tokens a cycle (bonus included) over
    its cost in one-row target steps (verifying depth + 1 rows, and the drafting)."""
    tokens = sum(acc ** k for k in range(depth + 1))
    return tokens / (verify_s[depth + 1] / verify_s[1] + depth * DRAFT_STEP_SHARE)


def choose_depth(m: Measurements, f: PlanFlags, acc: float = QUICKSTART_ACC) -> tuple[int, str]:
    """TTT steps = the draft depth the measured verification costs make pay: a tree of depth 1 uses
    only the first drafted position, so its draft is trained for that alone (cheaper steps, more of
    them) and a deeper unroll would be paid for and never used."""
    if f.ttt_steps is not None:
        return f.ttt_steps, f"{f.ttt_steps} TTT steps (as asked)"
    if not all(n in m.verify_s for n in range(1, MAX_DEPTH + 2)):
        return m.step_ttt, f"{m.step_ttt} TTT steps (verification not timed here)"
    gains = {d: depth_gain(m.verify_s, d, acc) for d in range(1, MAX_DEPTH + 1)}
    depth = max(gains, key=gains.get)
    rows = ", ".join(f"{n} rows {m.verify_s[n] / m.verify_s[1]:.2f}x" for n in range(2, MAX_DEPTH + 2))
    return depth, (f"{depth} TTT step{'s' if depth > 1 else ''}: verifying {rows} one row here, so a chain of "
                   f"{depth} pays most ({gains[depth]:.2f}x expected at acc {acc}, against "
                   + ", ".join(f"{g:.2f}x at {d}" for d, g in gains.items() if d != depth) + ")")


def stage_seconds(m: Measurements, f: PlanFlags, regenerate: bool, conversations: int, steps: int) -> dict:
    """Planned seconds of gen-data and train for this size (core.estimate's cost model)."""
    warm = warmup_steps(f, steps)
    full_s, warm_s = per_step_seconds(m, f, online=not regenerate)
    train = SETUP_S["train"] + m.load_s + train_seconds(steps, warm, full_s, warm_s)
    # held-out evaluation at each epoch's end: a forward-only unroll (about a third of a step's cost)
    tokens = m.regenerated_tokens if regenerate else m.text_tokens
    epochs = EPOCHS_REGENERATED if regenerate else 1
    val_tokens = _val(f, conversations) * tokens * epochs
    train += val_tokens / f.max_tokens * (full_s / 3 + (0 if regenerate else f.max_tokens / m.forward_tokens_per_s))
    data = SETUP_S["gen-data"]
    if regenerate:
        data += m.load_s + regen_seconds(conversations * m.answer_tokens, m.regen_bound, m.regen_dtype)
        data += conversations * m.regenerated_tokens / (m.capture_tokens_per_s or m.forward_tokens_per_s)  # capture
    return {"gen-data": data, "train": train}


def steps_for(m: Measurements, f: PlanFlags, regenerate: bool, conversations: int) -> int:
    tokens = m.regenerated_tokens if regenerate else m.text_tokens
    epochs = EPOCHS_REGENERATED if regenerate else 1
    return max(1, round(conversations * tokens * epochs / (f.max_tokens * PACKING)))


def conversations_for(m: Measurements, f: PlanFlags, regenerate: bool, steps: int) -> int:
    tokens = m.regenerated_tokens if regenerate else m.text_tokens
    epochs = EPOCHS_REGENERATED if regenerate else 1
    return max(1, math.ceil(steps * f.max_tokens * PACKING / (tokens * epochs)))


def _sized(m: Measurements, f: PlanFlags, regenerate: bool, conversations: int) -> tuple[int, int]:
    """(conversations, steps) from a conversation count, --max-samples / --max-steps winning."""
    if f.samples is not None and f.steps is not None:
        return f.samples, f.steps
    if f.steps is not None:
        return conversations_for(m, f, regenerate, f.steps), f.steps
    n = f.samples if f.samples is not None else conversations
    return n, steps_for(m, f, regenerate, n)


def _fit(m: Measurements, f: PlanFlags, regenerate: bool, room: float) -> int:
    """The most conversations whose gen-data + train fit ``room`` seconds (0 if none)."""
    lo, hi = 0, 1
    while sum(stage_seconds(m, f, regenerate, *_sized(m, f, regenerate, hi)).values()) <= room and hi < 1 << 22:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sum(stage_seconds(m, f, regenerate, *_sized(m, f, regenerate, mid)).values()) <= room:
            lo = mid
        else:
            hi = mid
    return lo


def minimum_seconds(m: Measurements, f: PlanFlags, regenerate: bool) -> float:
    """The smallest run: MIN_STEPS steps on the data they need, one eval prompt, every fixed cost."""
    n = conversations_for(m, f, regenerate, MIN_STEPS)
    fixed = m.spent_s + m.load_s + SETUP_S["export"]
    return (fixed + sum(stage_seconds(m, f, regenerate, n, MIN_STEPS).values()) + eval_seconds(m, f, 1)) / USE_OF_BUDGET


def make_plan(m: Measurements, f: PlanFlags) -> Plan:
    """Size the quickstart to end within ``f.budget_min`` (a pure function: the tests call it)."""
    depth, depth_why = choose_depth(m, f)
    f = replace(f, ttt_steps=depth)
    rate = regen_rate(m.regen_bound, m.regen_dtype)
    if f.regenerate is None:
        regenerate = regen_pays(m)
        why = (f"regenerate: the target generates ~{rate:.0f} tokens/s here ({m.regen_dtype}), at or above the "
               f"~{REGEN_PAYS_TOKENS_PER_S:.0f} where regenerated data pays for its time" if regenerate else
               f"the dataset's text, trained online: regeneration would run at ~{rate:.0f} tokens/s here "
               f"({m.regen_dtype}), below the ~{REGEN_PAYS_TOKENS_PER_S:.0f} where it pays for its time")
    else:
        regenerate = f.regenerate
        why = ("regenerate" if regenerate else "the dataset's text, trained online") + " (as asked)"
    budget = f.budget_min * 60
    minimum = minimum_seconds(m, f, regenerate)
    if budget < minimum:
        raise BudgetError(f"--budget {f.budget_min:g} is below the {math.ceil(minimum / 60)} minutes this machine "
                          f"needs for the smallest run ({MIN_STEPS} training steps, 1 eval prompt): give "
                          f"--budget {math.ceil(minimum / 60)} or more")
    prompts = f.eval_prompts or min(16, max(2, round(EVAL_PROMPTS_PER_20_MIN * f.budget_min / 20)))
    eval_why = " (as asked)" if f.eval_prompts else f" ({EVAL_PROMPTS_PER_20_MIN} per 20 minutes of budget, 2 to 16)"
    if not f.eval_prompts and budget < minimum + (eval_seconds(m, f, prompts) - eval_seconds(m, f, 1)) / USE_OF_BUDGET:
        prompts, eval_why = 1, " (the budget is near this machine's minimum)"
    fixed = {"measure": m.spent_s, "eval": m.load_s + eval_seconds(m, f, prompts), "export": SETUP_S["export"]}
    room = budget * USE_OF_BUDGET - sum(fixed.values())
    n, steps = _sized(m, f, regenerate, max(1, _fit(m, f, regenerate, room)))
    seconds = {"measure": fixed.pop("measure"), **stage_seconds(m, f, regenerate, n, steps), **fixed}
    train_core_min = seconds["train"] * m.threads / 60
    family, family_why = choose_draft_type(train_core_min, f)
    plan = Plan(regenerate, n, steps, warmup_steps(f, steps), prompts, seconds, ttt_steps=f.ttt_steps,
                draft_type=family)
    given = [x for x, v in (("--max-samples", f.samples), ("--max-steps", f.steps)) if v is not None]
    epochs = f"{EPOCHS_REGENERATED} epochs" if regenerate else "each read once"
    plan.reasons = [
        f"data: {why}",
        f"size: {n} conversations, {steps} steps of {f.max_tokens} tokens ({epochs}; "
        + (f"{' and '.join(given)} as given" if given else "the most that fit the budget") + ")",
        f"eval: {prompts} mt_bench prompt{'s' if prompts != 1 else ''}, both turns{eval_why}",
        f"draft: {family_why}" + (f"; {depth_why}" if family == "eagle3" else ""),
        "time: " + " + ".join(f"{k} {minutes_text(v)}" for k, v in seconds.items())
        + f" = {minutes_text(plan.total_s)} of the {f.budget_min:g}-minute budget",
    ]
    if plan.total_s > budget:
        plan.reasons.append(f"note: {' and '.join(given) or '--num-prompts'} make the run longer than --budget "
                            f"{f.budget_min:g}")
    return plan


# The stages run against the clock (core.time_limit): gen-data may take this much longer than its
# plan before it stops starting shards, training then fits its steps to the time left, and eval its
# prompts; together they aim to end at this share of the budget (the last prompt may run past it).
GEN_DATA_SLACK = 1.25
END_SHARE = 0.96


def stage_minutes(m: Measurements, f: PlanFlags, plan: Plan, stage: str, elapsed_s: float) -> float:
    """The time limit (minutes) of ``stage`` starting ``elapsed_s`` into the run: gen-data gets its
    planned time with slack; train the time left before the eval and export the plan holds, but
    never less than MIN_STEPS steps need; eval what is left before the export, half a minute at
    least (its first prompt always runs). A pure function, as make_plan."""
    if stage == "gen-data":
        return plan.seconds["gen-data"] * GEN_DATA_SLACK / 60
    f = replace(f, ttt_steps=plan.ttt_steps)
    end = f.budget_min * 60 * END_SHARE - elapsed_s - plan.seconds["export"]
    if stage == "eval":
        return max(0.5, end / 60)
    full_s, warm_s = per_step_seconds(m, f, online=not plan.regenerate)
    train_fixed = plan.seconds["train"] - train_seconds(plan.steps, plan.warmup_steps, full_s, warm_s)
    least = train_fixed + train_seconds(MIN_STEPS, warmup_steps(f, MIN_STEPS), full_s, warm_s)
    return max(least, end - plan.seconds["eval"]) / 60


def measurement_lines(m: Measurements) -> list[str]:
    return [
        f"cpu: {m.cpu}, {m.threads} thread{'s' if m.threads != 1 else ''}"
        + (f" ({m.threads_note})" if m.threads_note else ""),
        f"regeneration: {m.regen_bound:,.0f} tokens/s for a full batch step in {m.regen_dtype} "
        f"(~{regen_rate(m.regen_bound, m.regen_dtype):,.0f} over a whole run)",
        f"target forward: {m.forward_tokens_per_s:,.0f} tokens/s"
        + (f" (feature capture {m.capture_tokens_per_s:,.0f})" if m.capture_tokens_per_s else "") + "; "
        f"plain decoding {1000 * m.decode_token_s:.0f} ms/token",
        f"training step: {m.step_s:.2f} s (full TTT unroll), {m.warmup_step_s:.2f} s (one TTT step)",
        f"data: ~{m.answer_tokens:.0f} generated tokens and ~{m.regenerated_tokens:.0f} stored per regenerated "
        f"conversation, ~{m.text_tokens:.0f} of the dataset's own text",
        f"load {m.load_s:.1f} s; {m.spent_s:.0f} s spent before planning",
    ]


def as_dict(m: Measurements, p: Plan) -> dict:
    return {"measurements": asdict(m), "plan": {**asdict(p), "total_s": p.total_s}}


# ---------------------------------------------------------------------------------- measuring


def train_step_seconds(model, layer_ids, max_tokens: int, ttt_steps: int, accept_loss: float,
                       draft_vocab: int = 8192) -> tuple[float, float]:
    """(full unroll, one TTT step) seconds of one offline training step of ``max_tokens`` tokens:
    the teacher from the target's final states, the draft's unroll forward and backward (in the
    precision train's auto resolves to), AdamW.
    The trainer's own pieces on random token ids (the cost does not depend on the text)."""
    import torch

    from ..model.draft import DraftConfig, Eagle3Draft
    from ..model.target import capture, input_embeddings, model_device, output_head
    from ..train.memory import RECOMPUTE_ABOVE, kept_activation_bytes
    from ..train.precision import mixed_precision
    from ..train.ttt import TTTModel, teacher_from_final, teacher_rows

    vocab = output_head(model).weight.shape[0]
    dv = min(draft_vocab, vocab)
    dcfg = DraftConfig.from_target(model.config, dv, layer_ids)
    draft = Eagle3Draft(dcfg)
    draft.set_embedding(input_embeddings(model).weight.detach().cpu())
    draft.init_weights(seed=0)
    vocab_ids = torch.arange(dv)
    draft.set_vocab(vocab_ids)
    recompute = kept_activation_bytes(max_tokens, ttt_steps, dcfg) > RECOMPUTE_ABOVE
    ttt = TTTModel(draft, ttt_steps, 0.8, recompute=recompute, accept_weight=accept_loss)
    opt = torch.optim.AdamW([p for p in ttt.parameters() if p.requires_grad], lr=1e-4)
    rows = 2
    ids = torch.randint(3, vocab, (rows, max_tokens // rows))
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        aux, final = capture(model, ids, layer_ids)

    # the precision `train --mixed-precision auto` trains in here (bf16 where the CPU has it)
    bf16 = mixed_precision("auto", cpu=str(model_device(model)) == "cpu") == "bf16"

    def step(active):
        ttt.active = active
        teacher = teacher_from_final(model, final, vocab_ids, teacher_rows(mask), full_argmax=False)
        with torch.autocast(str(model_device(model)).split(":")[0], dtype=torch.bfloat16, enabled=bf16):
            out = ttt(ids, aux, mask, teacher.probs, teacher.index, teacher.slot)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(None)  # untimed: allocation
    t0 = time.perf_counter()
    step(None)
    t1 = time.perf_counter()
    step(1)
    return t1 - t0, time.perf_counter() - t1


def forward_tokens_per_s(model, layer_ids, tokens: int) -> float:
    import torch

    from ..model.target import capture

    ids = torch.randint(3, 100, (2, tokens // 2))
    with torch.no_grad():
        return tokens / median_seconds(lambda: capture(model, ids, layer_ids), 1)


def verify_row_seconds(model, max_len: int, prefix: int = 128) -> dict[int, float]:
    """Seconds of one verification of 1 .. MAX_DEPTH + 1 rows after ``prefix`` tokens, as eval's
    fast path will verify them (each packing tried, the fastest kept), or through the HF forward
    where the fast path does not take the target; {} where neither runs."""
    import torch

    from ..decode.fast_target import config_unsupported_reason
    from ..evaluate.tree_auto import verify_latency, verify_latency_fast

    sizes = tuple(range(1, MAX_DEPTH + 2))
    ids = torch.randint(3, 100, (1, prefix))
    try:
        if config_unsupported_reason(model.config) is None:
            return verify_latency_fast(model, ids, max_len, sizes=sizes)
        return verify_latency(model, ids, sizes=sizes)
    except (RuntimeError, ValueError, NotImplementedError):  # eval cannot verify it: the timed TTT depth stays
        return {}


def decode_token_seconds(model, prefix: int = 128) -> float:
    """One plain decoding step of one row after ``prefix`` tokens (HF forward with a cache)."""
    return hf_step_seconds(model, prefix)


def data_lengths(tokenizer, conversations, max_new_tokens: int, max_length: int) -> tuple[float, float, float]:
    """(generated tokens, stored tokens per regenerated conversation, tokens of the dataset's own
    text cut at max_length) per conversation, from a sample."""
    from ..data.regen_rate import turn_lengths

    turns = [turn_lengths(tokenizer, c.messages, max_new_tokens) for c in conversations]
    answer, stored = mean_regenerated(turns, max_new_tokens, max_length)
    texts = [min(max_length, sum(u + a for u, a in t)) for t in turns]
    return answer, stored, sum(texts) / max(1, len(texts))


def measure(model_id: str, sample, max_new_tokens: int, max_length: int, max_tokens: int, ttt_steps: int,
            accept_loss: float, started: float, slots: int = 32) -> Measurements:
    """Time this machine on ``model_id`` (see the module docstring); ``sample``: conversations of
    the data the run will use; ``started``: perf_counter() when the run began."""
    import torch

    from ..data.regen_rate import capture_tokens_per_s, regen_bound
    from ..data.regenerate import regen_dtype
    from ..model.layers import choose_layers
    from ..model.target import TargetSpec, load_target, load_tokenizer, model_device

    t0 = time.perf_counter()
    spec = TargetSpec(model=model_id)
    model = load_target(spec)
    load_s = time.perf_counter() - t0
    threads, why = choose_threads() if str(model_device(model)) == "cpu" else (torch.get_num_threads(), "")
    device = str(model_device(model))
    dtype = regen_dtype("auto", model.config, device, model.dtype)
    layers = choose_layers(model.config, warn=False).ids
    prefix = min(max_length, 256)
    bound = regen_bound(model, dtype, slots, prefix)
    forward = forward_tokens_per_s(model, layers, min(max_tokens, 512))
    capture_rate = capture_tokens_per_s(model, layers, dtype)  # at --capture-dtype auto's dtype
    step_s, warm_s = train_step_seconds(model, layers, max_tokens, ttt_steps, accept_loss)
    decode_s = decode_token_seconds(model)
    verify = verify_row_seconds(model, max_length)
    answer, stored, text = data_lengths(load_tokenizer(spec), sample, max_new_tokens, max_length)
    return Measurements(cpu=hardware.cpu_class() if device == "cpu" else device, threads=threads, threads_note=why,
                        regen_dtype=dtype, regen_bound=bound, forward_tokens_per_s=forward,
                        capture_tokens_per_s=capture_rate, step_s=step_s,
                        warmup_step_s=warm_s, decode_token_s=decode_s, load_s=load_s,
                        spent_s=time.perf_counter() - started, answer_tokens=answer, regenerated_tokens=stored,
                        text_tokens=text, step_ttt=ttt_steps, verify_s=verify)
