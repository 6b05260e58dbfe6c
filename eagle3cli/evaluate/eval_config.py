"""What one ``eagle3 eval`` run is asked to do (``EvalConfig``), and the error its bad input raises:
the one piece every part of the evaluation reads, so that it sits below them all."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import Eagle3Error


class EvalError(Eagle3Error, ValueError):
    """Bad input for eval: one line for the user."""


@dataclass
class EvalConfig:
    tasks: list[str]
    data: str | None = None
    limit: int | None = None
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    sampling_top_k: int = 0
    mode: str = "tree"
    total_tokens: int = 60
    depth: int = 8
    top_k: int = 10
    steps: int = 3
    tree_auto: bool = False
    prompt_lookup: bool = False
    prompt_lookup_tokens: int = 10
    seed: int = 0
    warmup_tokens: int = 32
    fast: str = "auto"  # auto | on | off: verify (and decode the plain baseline) through fast_target
    draft_weights: str = "auto"  # auto | full | int8 | int4: the drafter's matmul weights (fast_draft.weights_for)
    max_minutes: float | None = None  # start no prompt that would end later (core.time_limit)
    # llama.cpp's plain decoding of the same target beside ours where llama.cpp is installed
    # (llamacpp_baseline.plain_baseline): the fastest plain decoder a CPU user has is a baseline too
    llama_baseline: bool = True
    llama_cpp: str | None = None  # where llama-server is (else $EAGLE3_LLAMA_CPP, then PATH)
    target_gguf: str | None = None  # the target as GGUF (else converted once into the cache)
    log_dir: str | None = None  # where llama-server's log goes
    # a DFlash draft's held-out per-position acceptance (its training record), reported by --tree auto
    heldout_acc: tuple[float, ...] | None = None

    @classmethod
    def from_options(cls, opts) -> "EvalConfig":
        """The settings of ``eagle3 eval``'s flags (``options.EvalOptions``, validated)."""
        auto, total, depth, top_k = opts.tree_shape()
        return cls(tasks=list(opts.task), data=opts.data, limit=opts.limit, max_new_tokens=opts.max_new_tokens,
                   temperature=opts.temperature, top_p=opts.top_p, sampling_top_k=opts.sampling_top_k,
                   mode=opts.mode, total_tokens=total, depth=depth, top_k=top_k, steps=opts.steps,
                   tree_auto=auto, prompt_lookup=opts.baseline == "prompt-lookup", seed=opts.seed, fast=opts.fast,
                   draft_weights=opts.draft_weights, max_minutes=opts.max_minutes, llama_cpp=opts.llama_cpp,
                   target_gguf=opts.target_gguf, log_dir=str(opts.out))


@dataclass(frozen=True)
class EngineGrid:
    """The llama.cpp settings ``eval --engine llama.cpp`` measures: every combination of a target
    type, a draft type, a draft length and a p-min (evaluate/llamacpp_sweep.py). ``target_types`` /
    ``draft_types`` are converted from --model / exported from --draft; a --target-gguf /
    --draft-gguf file is one more, and alone unless types are asked for: the default grid is
    the single setting eval has always measured."""

    target_types: tuple[str, ...] = ("f32",)
    draft_types: tuple[str, ...] = ("f32",)
    n_max: tuple[int, ...] = (3,)
    p_min: tuple[float, ...] = (0.0,)
    target_gguf: str | None = None
    draft_gguf: str | None = None

    @classmethod
    def from_options(cls, opts) -> "EngineGrid":
        """The grid of ``eagle3 eval``'s flags (``options.EvalOptions``, validated); repeats dropped."""
        def once(xs):
            return tuple(dict.fromkeys(xs))

        tg = str(opts.target_gguf) if opts.target_gguf else None
        dg = str(opts.draft_gguf) if opts.draft_gguf else None
        return cls(target_types=once(opts.engine_target_types) or (() if tg else ("f32",)),
                   draft_types=once(opts.engine_draft_types) or (() if dg else ("f32",)),
                   n_max=once(opts.engine_chain_length) or (opts.steps,),
                   p_min=once(float(p) for p in opts.engine_p_min) or (0.0,),
                   target_gguf=tg, draft_gguf=dg)
