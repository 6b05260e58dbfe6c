"""Prompts replayed through a serving engine the way ``eagle3 eval --engine`` runs them.

A multi-turn prompt is replayed turn by turn in plain decoding, each answer becoming context for
the next turn (the chat template applied by eagle3's tokenizer, so every engine sees the same
token ids). The speculative run then decodes the very same contexts, and an answer that differs
from the plain one marks its prompt as a mismatch: greedy speculative decoding must not change
the output. Shared by ``vllm_eval`` and ``llamacpp``, which differ only in how they talk to
their engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class PlainReplay:
    contexts: dict = field(default_factory=dict)  # (task, prompt id) -> [token ids of each turn's context]
    outputs: dict = field(default_factory=dict)   # (task, prompt id, turn) -> the plain answer's token ids
    first: list[int] | None = None                # the first context (the warm-up prompt of both runs)

    def mismatch(self, task: str, pid: str, turn: int, tokens) -> bool:
        """Whether a speculative answer differs from the plain answer of the same context."""
        return list(tokens) != self.outputs[(task, pid, turn)]


def prompt_counter(log, what: str, progress=None) -> Callable[[int, int], None]:
    """An ``after_prompt`` that logs "WHAT: done/total prompts" and ticks ``progress`` (if any)."""
    def after(done: int, total: int) -> None:
        log(f"{what}: {done}/{total} prompts")
        if progress:
            progress()
    return after


def replay_plain(loaded, tokenizer, decode: Callable[[str, list[int]], tuple[list[int], str | None]],
                 warmup: Callable[[list[int]], object], after_prompt: Callable[[int, int], object]) -> PlainReplay:
    """Decode every turn of every prompt of ``loaded`` ([(task, [Prompt])]) with ``decode(task, ids)
    -> (answer token ids, answer text or None)``; ``warmup(ids)`` runs once before the first
    answer, ``after_prompt(done, total)`` after each prompt."""
    from ..data.turns import encode

    run = PlainReplay()
    total, done = sum(len(ps) for _, ps in loaded), 0
    for task, prompts in loaded:
        for p in prompts:
            messages, ctxs = [], []
            for i, turn in enumerate(p.turns):
                messages.append({"role": "user", "content": turn})
                ids = encode(tokenizer, messages)[0].tolist()
                if run.first is None:
                    run.first = ids
                    warmup(ids)
                tokens, text = decode(task, ids)
                run.outputs[(task, p.id, i)] = list(tokens)
                ctxs.append(ids)
                messages.append({"role": "assistant",
                                 "content": text if text is not None else tokenizer.decode(tokens)})
            run.contexts[(task, p.id)] = ctxs
            done += 1
            after_prompt(done, total)
    return run
