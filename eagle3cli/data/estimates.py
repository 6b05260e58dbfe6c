"""gen-data's estimates, said before any work: the store's size on disk (checked against the free
space) and how long local regeneration will take here."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..config.options import GenDataOptions
from .chat_mask import MaskError, tokenize_conversation
from .gen_errors import GenDataError
from .sources import Conversation

BYTES_PER_VALUE = 2  # bf16 / fp16 features


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def bytes_per_token(hidden: int, features: str, streams: int = 3) -> int:
    """(the streams + final) x hidden x 2 bytes, plus 5 bytes of id and mask."""
    return (streams + 1) * hidden * BYTES_PER_VALUE + 5 if features == "offline" else 5


def estimated_tokens(tokenizer, conv: Conversation, o) -> int:
    """The tokens ``conv`` will store, counted as the chat template renders it (its default
    system prompt, turn headers and ends included: counting the messages' own text missed them),
    capped at --max-length. With the dataset's answers that is the stored count; with
    regeneration every answer is rendered empty and counted as --max-new-tokens (+ 8 for a
    re-tokenised answer's drift), the longest it may become: an upper bound."""
    from .regenerate import strip_meta

    msgs = [dict(m) for m in conv.messages]
    answers = 0
    if o.regenerate:
        out = []
        for m in msgs:
            if m["role"] == "assistant":
                continue  # every answer is the target's own, one after each user turn
            out.append(m)
            if m["role"] == "user":
                out.append({**m, "role": "assistant", "content": ""})
                answers += 1
        msgs = out
    try:
        n = len(tokenize_conversation(tokenizer, strip_meta(msgs)).input_ids)
    except MaskError:  # the template refuses the shape (empty answers): each message + 8 for its headers
        n = sum(len(tokenizer(m["content"] or "", add_special_tokens=False)["input_ids"]) + 8 for m in msgs)
    return min(n + answers * (o.max_new_tokens + 8), o.max_length)


def estimate_store(tokenizer, convs: list[Conversation], o: GenDataOptions, hidden: int,
                   streams: int = 3) -> tuple[int, int]:
    """(tokens, bytes) expected, from up to 500 conversations extrapolated (estimated_tokens)."""
    sample = convs[:: max(1, len(convs) // 500)][:500]
    total = sum(estimated_tokens(tokenizer, c, o) for c in sample)
    tokens = int(total * len(convs) / max(1, len(sample)))
    return tokens, tokens * bytes_per_token(hidden, o.features, streams)


def disk_line(tokens: int, nbytes: int, hidden: int, features: str, streams: int = 3) -> str:
    """The estimate as said before the run: tokens x bytes a token (and what makes them up)."""
    per_tok = bytes_per_token(hidden, features, streams)
    return (f"disk estimate: ~{tokens:,} tokens x {per_tok:,} B/token "
            f"({'(%d+1) x %d x 2 + ids/mask' % (streams, hidden) if features == 'offline' else 'ids + mask'})"
            f" = ~{human_bytes(nbytes)}")


def existing_parent(path: Path) -> Path:
    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    return p


def check_disk(out: Path, nbytes: int, todo: int, n_shards: int, skip: bool, console):
    """Refuse when the estimate for the shards still to do clearly exceeds the free space."""
    free = shutil.disk_usage(existing_parent(out)).free
    need = int(nbytes * todo / max(1, n_shards))
    console.print(f"free space: {human_bytes(free)}", highlight=False)
    if need > free and not skip:
        raise GenDataError(f"not enough disk space: the remaining shards need ~{human_bytes(need)}, "
                           f"{human_bytes(free)} is free at {out}: free space, choose another --out or "
                           "lower --max-samples (--skip-disk-check if the estimate is too high)")


def regen_eta(model, tokenizer, convs: list[Conversation], o: GenDataOptions, regen_dtype: str | None) -> str:
    """How long local regeneration of ``convs`` will take here, from one measured decode step of
    all of continuous batching's slots (data/regen_rate.py) and the answers' lengths in a sample
    (core/estimate.py, which the quickstart's planner uses too)."""
    from ..core.estimate import REGEN_SHARE_OF_BOUND, eta_line, mean_regenerated, regen_rate
    from .regen_rate import regen_bound, turn_lengths

    sample = convs[:: max(1, len(convs) // 200)][:200]
    turns = [turn_lengths(tokenizer, c.messages, o.max_new_tokens) for c in sample]
    per_conv, _ = mean_regenerated(turns, o.max_new_tokens, o.max_length)
    bound = regen_bound(model, regen_dtype, o.batch_size, min(o.max_length, 256))
    dtype = regen_dtype or "float32"
    share = REGEN_SHARE_OF_BOUND.get(dtype, REGEN_SHARE_OF_BOUND["float32"])
    return eta_line("gen-data", per_conv * len(convs), "generated tokens", regen_rate(bound, dtype),
                    f"(regeneration, answers as long as the dataset's up to --max-new-tokens; "
                    f"{share:.2f} of one measured {o.batch_size}-slot decode step in {dtype}, "
                    f"{bound:,.0f} tokens/s)")
