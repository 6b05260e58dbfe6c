"""Evaluation: tau, n-alpha, tokens/s and speedup of a draft on the standard tasks, with a lossless check.

Plain decoding (HF ``generate``) and speculative decoding run on the same prompts, in the
same process, after the same warm-up. Multi-turn conversations are replayed turn by turn
through the tokenizer's chat template, the model's own earlier answer becoming context.
At temperature 0 every speculative answer must equal the greedy one token for token; any
mismatch is reported with its prompt id. The pieces: the prompts (``tasks``), the fast path
(``fast_setup``), ``--tree auto`` (``tree_auto``), the timed decodings (``measure``) and the
results (``report``); this module runs them in order.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..core.hf_utils import text_config
from ..core.time_limit import TimeLimit, now
from ..data.turns import encode
from .eval_config import EvalConfig, EvalError
from .fast_setup import NotRowInvariant, eval_dtype, set_up_run
from .measure import Decoders, first_difference, timed
from .report import TaskStats, results_record, summarize
from .tasks import load_task
from .tree_auto import calibrate, calibrate_block


def check_draft(draft_dir: str, target_config):
    """Draft/target mismatch (hidden size, vocab, layer ids, broken files): one line."""
    from ..publish.inspector import inspect_draft

    rep = inspect_draft(draft_dir, target_config)
    if not rep.ok:
        more = f" (+{len(rep.problems) - 1} more; run `eagle3 inspect {draft_dir}`)" if len(rep.problems) > 1 else ""
        raise EvalError(f"draft {draft_dir} does not fit this target: {rep.problems[0]}{more}")


def evaluate_spec(spec, tokenizer, draft_for, cfg: EvalConfig, progress=None, log=print) -> dict:
    """``evaluate`` with the target loaded from ``spec`` in ``eval_dtype``'s choice (the draft is
    ``draft_for(target)``): under ``--dtype auto``, once more in float32 if bf16 fails its check."""
    import dataclasses

    from ..model.target import load_config, load_target

    dtype = eval_dtype(spec, cfg, load_config(spec))
    if dtype != spec.dtype:
        log(f"--dtype auto: {dtype} (this CPU has AMX: bf16 weights decode faster than fp32 here)")
    while True:
        target = load_target(dataclasses.replace(spec, dtype=dtype))
        try:
            with contextlib.ExitStack() as stack:
                engine = _plain_engine(spec, target, cfg, log)
                if engine is not None:
                    stack.enter_context(engine)
                return evaluate(target, tokenizer, draft_for(target), cfg, progress=progress, log=log,
                                plain_engine=engine)
        except NotRowInvariant as e:
            if dtype == spec.dtype:  # asked for: the user decides
                raise
            log(f"note: {e}; --dtype auto falls back to float32")
            dtype = "float32"


def _plain_engine(spec, target, cfg: EvalConfig, log):
    """llama.cpp's plain decoding of this target in its dtype, on as many threads as ours (CPU, greedy
    runs only; None elsewhere or where llama.cpp is not installed)."""
    from .llamacpp_baseline import plain_baseline

    dev = next(target.parameters()).device
    if not cfg.llama_baseline or dev.type != "cpu" or cfg.temperature != 0:
        return None
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    return plain_baseline(spec.model, dtype, cfg.llama_cpp, cfg.target_gguf, threads=torch.get_num_threads(),
                          log_dir=cfg.log_dir, log=log)


def evaluate(target, tokenizer, draft, cfg: EvalConfig, progress=None, log=print, plain_engine=None) -> dict:
    """Run every task; returns the results dict (docs/design.md §10) plus per-category rows.
    ``plain_engine``: another plain decoder (``llamacpp_baseline.PlainBaseline``: ``decode(ids, n)`` ->
    (tokens, seconds)), timed on every turn beside ours as ``baseline_llamacpp``."""
    from ..decode.generator import SpecSettings, check_supported

    check_supported(target.config)
    clock = TimeLimit(cfg.max_minutes)  # from here: warm-up and tree calibration count too
    settings = SpecSettings(mode=cfg.mode, total_tokens=cfg.total_tokens, depth=cfg.depth, top_k=cfg.top_k,
                            steps=cfg.steps, temperature=cfg.temperature, top_p=cfg.top_p,
                            sampling_top_k=cfg.sampling_top_k, max_new_tokens=cfg.max_new_tokens)
    max_pos = getattr(text_config(target.config), "max_position_embeddings", None)
    loaded = [load_task(t, cfg.data, cfg.limit) for t in cfg.tasks]
    if not any(ps for _, ps in loaded):
        raise EvalError("no prompts to evaluate")
    run = set_up_run(target, draft, cfg, settings, max_pos, log)
    dec = Decoders(target, run.drafter, run.fast, settings, cfg)
    # Warm-up (same for every method) on the first prompt, then optional tree calibration.
    firsts = _first_turns(tokenizer, loaded, cfg, max_pos, next(target.parameters()).device)
    dec.warm_up(firsts[0], plain_engine)
    auto = None
    if run.tree_auto:  # a block drafter (DFlash) may choose a chain: the run's mode follows its choice
        block = hasattr(run.drafter, "fit_depth")
        auto = (calibrate_block(dec, run, firsts, log, cfg.heldout_acc) if block else calibrate(dec, run, firsts, log))
        if settings.mode != cfg.mode:
            cfg = dataclasses.replace(cfg, mode=settings.mode, steps=settings.steps)
    measured = _Measured(dec, tokenizer, run.exact, plain_engine, max_pos, log)
    results, cut = {}, {}
    for task, prompts in loaded:
        stats = TaskStats()
        for n, p in enumerate(prompts):
            if not clock.fits(1):  # the prompts so far say the next would end past --max-minutes
                cut[task] = [n, len(prompts)]
                log(f"time limit ({clock.describe()}): {task}: {n} of {len(prompts)} prompts measured "
                    f"({clock.rate():.0f} s a prompt, {max(0.0, clock.left()):.0f} s left)")
                break
            started = now()
            measured.prompt(task, p, stats)
            clock.record(now() - started)
            if progress:
                progress()
        if run.exact and stats.fast_differs_from_hf:
            log(f"note: {task}: plain decoding on the fast path differs from HF generate on "
                f"{len(stats.fast_differs_from_hf)} turns: in bf16 HF's attention rounds otherwise and is "
                f"not row-invariant; speculative output is held to the fast path's plain decoding")
        results[task] = summarize(stats, cfg)
    record = results_record(target, cfg, settings, run, auto, plain_engine, results, measured.categories, cut)
    record["draft_type"] = getattr(run.drafter, "draft_type", "eagle3")
    return record


def _first_turns(tokenizer, loaded, cfg: EvalConfig, max_pos, dev) -> list:
    """The first turns of up to eight prompts a task that fit the context with the warm-up's tokens:
    the warm-up runs on the first, the ``--tree auto`` calibration on the first three."""
    firsts = [encode(tokenizer, [{"role": "user", "content": p.turns[0]}]) for _, ps in loaded for p in ps[:8]]
    firsts = [f.to(dev) for f in firsts if not max_pos or f.shape[1] + cfg.warmup_tokens + cfg.depth + 2 < max_pos]
    if not firsts:
        raise EvalError(f"no prompt fits the target's context of {max_pos} tokens")
    return firsts


class _Measured:
    """Every method timed on every turn of a prompt, added to its task's and its category's stats,
    with each speculative answer held to the greedy one."""

    def __init__(self, dec: Decoders, tokenizer, exact, plain_engine, max_pos, log):
        self.dec, self.tokenizer, self.exact, self.plain_engine = dec, tokenizer, exact, plain_engine
        self.max_pos, self.log = max_pos, log
        self.dev = next(dec.target.parameters()).device
        self.categories: dict = {}  # (task, category) -> TaskStats

    def prompt(self, task: str, p, stats: TaskStats) -> None:
        """Replay ``p`` turn by turn, the model's own answer becoming the next turn's context; it counts
        as a prompt only if every turn was measured."""
        from ..decode.generator import ContextTooLong, UnsupportedTarget

        cat = self.categories.setdefault((task, p.category or task), TaskStats())
        messages = []
        for turn_no, turn in enumerate(p.turns):
            messages.append({"role": "user", "content": turn})
            ids = encode(self.tokenizer, messages).to(self.dev)
            pid = p.id if len(p.turns) == 1 else f"{p.id}/turn{turn_no + 1}"
            if self.max_pos and ids.shape[1] + 1 >= self.max_pos:
                msg = f"{task} prompt {pid}: {ids.shape[1]} tokens do not fit the context of {self.max_pos}; skipped"
                self.log(f"error: {msg}")
                stats.errors.append(msg)
                return
            try:
                timings = self._time_ours(ids)
            except (ContextTooLong, UnsupportedTarget) as e:
                self.log(f"error: {task} prompt {pid}: {e}")
                stats.errors.append(f"{pid}: {e}")
                return
            b = self._record(ids, timings, [stats, cat], f"{task} prompt {pid}", pid)
            # the model's own answer is the context of the next turn
            messages.append({"role": "assistant", "content": self.tokenizer.decode(b, skip_special_tokens=True)})
        stats.num_prompts += 1
        cat.num_prompts += 1

    def _time_ours(self, ids) -> tuple:
        """(HF answer, s), (fast plain answer or None, s), (SpecOutput, s) on ``ids``."""
        dec, dev = self.dec, ids.device
        b, tb = timed(lambda: dec.hf(ids), dev)
        bf, tbf = timed(lambda: dec.fast_plain(ids), dev) if dec.fast is not None else (None, 0.0)
        s_out, ts = timed(lambda: dec.spec(ids), dev)
        return (b, tb), (bf, tbf), (s_out, ts)

    def _record(self, ids, timings, rows: list[TaskStats], what: str, pid) -> list[int]:
        """Add one turn's timings to ``rows``, time the other engines, check losslessness; the HF answer."""
        (b, tb), (bf, tbf), (s_out, ts) = timings
        for st in rows:
            st.new_tokens["baseline_hf"] += len(b)
            st.seconds["baseline_hf"] += tb
            if bf is not None:
                st.new_tokens["baseline_fast"] += len(bf)
                st.seconds["baseline_fast"] += tbf
            st.new_tokens["speculative"] += len(s_out.tokens)
            st.seconds["speculative"] += ts
            st.outputs.append(s_out)
        cfg = self.dec.cfg
        if self.plain_engine is not None:  # interleaved with ours: a shared machine's load hits both
            n_e, t_e = self.plain_engine.decode(ids[0].tolist(), cfg.max_new_tokens)
            for st in rows:
                st.new_tokens["baseline_llamacpp"] += n_e
                st.seconds["baseline_llamacpp"] += t_e
        if cfg.prompt_lookup:
            pl, tp = timed(lambda: self.dec.prompt_lookup(ids), ids.device)
            for st in rows:
                st.new_tokens["prompt_lookup"] += len(pl)
                st.seconds["prompt_lookup"] += tp
        if bf is not None and bf != b:  # the fast forward must decode what the HF forward decodes
            if not self.exact:  # in fp32 a difference is news; in bf16 two roundings differ (summed per task)
                self.log(f"note: {what}: plain decoding on the fast path differs from HF "
                         f"generate at token {first_difference(bf, b)}")
            for st in rows:
                st.fast_differs_from_hf.append(pid)
        # In low precision HF's own forward is not row-invariant, so greedy speculative output
        # is held to plain decoding on the forward it verifies with (bitwise: check_exact).
        reference = bf if self.exact else b
        if cfg.temperature == 0 and s_out.tokens != reference:
            at = first_difference(s_out.tokens, reference)
            self.log(f"error: LOSSLESS CHECK FAILED: {what} differs from greedy at token {at}")
            for st in rows:
                st.mismatches.append(pid)
        return b
