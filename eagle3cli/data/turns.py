"""The prompt files ``eagle3 eval --prompts`` and ``train --prompts`` read: JSONL records of
``{"question_id", "category", "turns": [...]}`` (the EAGLE reference's format). One parser, so
both commands read a file alike and refuse a bad one with the same line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..core.errors import Eagle3Error

if TYPE_CHECKING:  # the type only: importing this module loads no torch
    import torch


class TurnsFileError(Eagle3Error, ValueError):
    """A prompt file that cannot be read: one line naming the file (and the line)."""


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]


def load_turns_file(path: str | Path, limit: int | None = None, default_category: str = "",
                    error: Callable[[str], Exception] = TurnsFileError) -> list[Prompt]:
    """The first ``limit`` records of a prompt file; ``error(message)`` is what a bad file raises
    (each command's own error class, so the user sees its usual one line)."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{path}: no such file")
    out = []
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{path}:{n}: not valid JSON ({e.msg})") from None
        turns = r.get("turns") if isinstance(r, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise error(f"{path}:{n}: expected a record with a non-empty 'turns' list of strings")
        out.append(Prompt(str(r.get("question_id", n - 1)), r.get("category") or default_category, turns))
        if limit and len(out) >= limit:
            break
    if not out:
        raise error(f"{path}: no prompts")
    return out


def encode(tokenizer, messages: list[dict]) -> "torch.Tensor":
    """Token ids of a conversation ready for the assistant's answer (chat template if there is one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    return tokenizer(text, return_tensors="pt").input_ids
