"""Acceptance measured during training: the draft decodes a few held-out prompts with the lossless
generator (``decode.generator.speculative_generate``: chain of 3, greedy), and the measured tau
(tokens per target forward) is logged beside the simulated one.

Loss and the simulated tau (acc_s multiplied out, ``ttt.acceptance_length``) assume the draft
sees the target's own features at every step; at decode time it sees its own outputs, so they
rank checkpoints less well than a decode does. ``--eval-every N`` measures every N optimizer steps
and at the end; ``--keep best`` exports the weights of the step whose measured tau was highest.

    prompts   the first --num-prompts held-out conversations of the store, each cut before its
              first answer token (the chat template's generation prompt included), or the first
              turns of a --prompts file (the EAGLE JSONL format `eagle3 eval --prompts` reads)
    tau       sum of decoded tokens / sum of verification forwards over the prompts, as
              `eagle3 eval` computes it (evaluate.summarize)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.train_config import TrainError
from ..data.turns import encode, load_turns_file

CHAIN_STEPS = 3  # the chain docs/benchmarks.md's chain tau figures are measured with


@dataclass
class Measured:
    tau: float
    prompts: int
    tokens: int  # decoded tokens over all prompts
    forwards: int  # verification forwards over all prompts


def store_prompts(store, indices: list[int], count: int, max_length: int) -> list[torch.Tensor]:
    """Prompt ids [1, L] of the first ``count`` of ``indices`` that have an answer: each
    conversation up to (not including) its first learned token, at most ``max_length`` tokens."""
    out = []
    for i in indices:
        sample = store[i]
        hit = torch.nonzero(sample["loss_mask"]).flatten()
        if not hit.numel() or int(hit[0]) == 0:
            continue
        out.append(sample["input_ids"][:min(int(hit[0]), max_length)][None].long())
        if len(out) >= count:
            break
    return out


def file_prompts(path: str, tokenizer, count: int) -> list[torch.Tensor]:
    """Prompt ids [1, L] of the first turns of the first ``count`` records of a JSONL file of
    ``{"turns": [...]}`` records, under the tokenizer's chat template (as `eagle3 eval` encodes)."""
    records = load_turns_file(path, count, error=lambda msg: TrainError(f"--prompts {msg}"))
    return [encode(tokenizer, [{"role": "user", "content": r.turns[0]}]) for r in records]


def measured_tau(target, draft, prompts: list[torch.Tensor], new_tokens: int, eos_token_id=None) -> Measured:
    """Chain-3 greedy speculative decoding of each prompt (lossless: the target's own greedy
    tokens); tau = decoded tokens / verification forwards over all prompts. The draft is used as it
    is (the trained fp32 weights), in eval mode for the decode and restored after."""
    from ..decode.generator import SpecSettings, speculative_generate

    settings = SpecSettings(mode="chain", steps=CHAIN_STEPS, temperature=0.0, max_new_tokens=new_tokens)
    dev = next(target.parameters()).device
    was_training = draft.training
    draft.eval()
    try:
        outs = [speculative_generate(target, draft, ids.to(dev), settings, eos_token_id=eos_token_id, seed=0)
                for ids in prompts]
    finally:
        draft.train(was_training)
    tokens, forwards = sum(o.decode_tokens for o in outs), sum(o.forwards for o in outs)
    return Measured(tokens / forwards if forwards else float("nan"), len(outs), tokens, forwards)


class AcceptanceProbe:
    """--eval-every through a run: the target it decodes with (on the main process only: it alone
    decodes), the prompt ids, and with --keep best the best measured step so far ({step, tau},
    carried by the checkpoints; its weights wait in checkpoints/best)."""

    def __init__(self, cfg, target, prompts: list[torch.Tensor]):
        self.cfg, self.target, self.prompts, self.out = cfg, target, prompts, Path(cfg.out)
        self.best: dict | None = None

    @classmethod
    def create(cls, cfg, spec, store, val_idx: list[int], crop: int, online_target, sharded: bool, main: bool,
               say) -> AcceptanceProbe | None:
        """None without --eval-every; else the prompts and the target, before any step is spent."""
        from ..model.target import load_target, load_tokenizer

        if not cfg.eval_every:
            return None
        if sharded:
            raise TrainError("--eval-every cannot decode with a target sharded by FSDP: drop it and run "
                             "`eagle3 eval` on the exported draft")
        if cfg.eval_prompts:
            prompts = file_prompts(cfg.eval_prompts, load_tokenizer(spec), cfg.eval_samples)
        else:
            prompts = store_prompts(store, val_idx, cfg.eval_samples, crop)
            if not prompts:
                raise TrainError("--eval-every decodes held-out prompts, and this run holds none out: set "
                                 "--val-fraction above 0 or pass --prompts FILE")
        target = (online_target if cfg.online else load_target(spec)) if main else None
        say(f"measured acceptance: {len(prompts)} prompts x {cfg.eval_new_tokens} new tokens, chain {CHAIN_STEPS}, "
            f"every {cfg.eval_every} steps and at the end"
            + ("; the best measured step is exported" if cfg.keep == "best" else ""))
        return cls(cfg, target, prompts)

    def due(self, step: int, total: int) -> bool:
        """A measurement after this step (the end's is taken apart, once the loop is done)."""
        return step % self.cfg.eval_every == 0 and step < total

    def measure(self, acc, draft, step: int, tau_sim: float | None = None) -> dict:
        """The draft's measured tau now, decoded on the main process and shared with the others;
        with --keep best, a new best step's weights are written to checkpoints/best. Equal measured
        taus (a few short prompts often tie) go to the higher simulated tau, then the earlier step."""
        from .checkpoints import save_best

        sums = torch.zeros(3, dtype=torch.float64, device=acc.device)
        if acc.is_main_process:
            m = measured_tau(self.target, draft, self.prompts, self.cfg.eval_new_tokens)
            sums += torch.tensor([m.tau, m.tokens, m.forwards], dtype=torch.float64, device=acc.device)
        tau, tokens, forwards = acc.reduce(sums, "sum").tolist()  # the other processes add zeros
        if self.cfg.keep == "best" and (self.best is None or rank(tau, tau_sim) > rank(**self.best)):
            self.best = {"step": step, "tau": tau, "tau_sim": tau_sim}
            if acc.is_main_process:
                save_best(self.out, draft, self.best)
            acc.wait_for_everyone()
        return {"tau": tau, "prompts": len(self.prompts), "tokens": int(tokens), "forwards": int(forwards),
                "tau_sim": tau_sim}

    def restore_best(self, draft, step: int, device) -> bool:
        """--keep best: the best measured step's weights into ``draft`` (then exported); False when
        there is nothing to restore (no best, or it is the final step ``step``)."""
        from .checkpoints import load_best

        if self.cfg.keep != "best" or self.best is None or self.best["step"] == step:
            return False
        draft.load_state_dict(load_best(self.out, device), strict=False)
        return True


def rank(tau: float, tau_sim: float | None, step: int = 0) -> tuple[float, float]:
    """How --keep best orders measurements: measured tau, then simulated tau."""
    return tau, -math.inf if tau_sim is None else tau_sim


def note(step: int, measured: dict) -> str:
    """The live view's line for one measurement."""
    sim = measured.get("tau_sim")
    return (f"step {step}: measured tau {measured['tau']:.3f} (chain {CHAIN_STEPS}, {measured['prompts']} prompts)"
            + (f", simulated {sim:.3f}" if sim is not None else ""))
