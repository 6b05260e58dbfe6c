"""The target answers the prompts itself: its own distribution is what the draft must predict.

Each conversation keeps its system prompt (or the one given with ``--system``) and its user
turns; the dataset's answers are dropped. The target answers the user turns in order, and
each answer becomes context for the next turn, exactly as in a real chat. A conversation's
tool calls and tool results are kept as context (the target cannot run the tools): the target
answers after the results, and the calls, which it did not write, are not learned. The row's
``tools`` and the template options (``enable_thinking`` for ``--reasoning``) go to the chat
template, or to the endpoint as ``tools`` and ``chat_template_kwargs``.

Two engines:

- local: continuous batching on the fast path's decoder (``batch_decode``) for the targets it
  supports, else batched Hugging Face generation (left padding; conversations answer turn 1
  together, then turn 2, ...), greedy or sampled with temperature/top-p. On a CPU with native
  bf16 matmuls (AVX512-BF16, AMX), continuous batching computes in bfloat16 by default (``regen_dtype``).
- ``--endpoint URL``: any OpenAI-compatible server (vLLM, SGLang, ...) serving the target,
  many conversations in flight at once (``endpoint.py``: outages waited out, every answer
  journaled as it arrives).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..core.hardware import has_bf16_matmul
from ..core.hf_utils import cache_kwargs
from .chat_mask import render


@dataclass
class GenSettings:
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 16
    max_length: int | None = None  # stop answering once the prompt alone reaches this many tokens
    dtype: str | None = None  # what local generation computes in (regen_dtype); None: the model's own


def regen_dtype(name: str, config, device: str, target_dtype, quantized: bool = False) -> str:
    """The dtype local regeneration computes in, from ``--regen-dtype`` (a dtype name or auto).

    auto: bfloat16 for an fp32 target on a CPU with native bf16 matmuls when continuous batching
    applies. There a batch of 32 regenerates 1.3x faster in bf16 on Intel's AMX tiles and 1.8x on
    AMD EPYC's AVX512-BF16 (and the KV cache read each step is half the bytes; docs/benchmarks.md);
    the answers are still the target's own, as a bf16 serving engine would write them (98% of
    tokens agree teacher-forced). Else the target's own dtype.
    Features are captured at the target's dtype either way.
    """
    from ..decode.fast_target import config_unsupported_reason
    from ..model.target import DTYPES

    own = next(k for k, v in DTYPES.items() if v == target_dtype)
    why_not = "quantized weights" if quantized else config_unsupported_reason(config)
    if name == "auto":
        cpu_bf16 = device.startswith("cpu") and own == "float32" and has_bf16_matmul()
        return "bfloat16" if cpu_bf16 and why_not is None else own
    if name not in DTYPES:
        raise ValueError(f"--regen-dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    if name != own and why_not is not None:
        raise ValueError(f"--regen-dtype {name} needs continuous batching, which this target cannot take "
                         f"({why_not}); leave --regen-dtype auto to generate in {own}")
    return name


@dataclass
class RegenStats:
    answers: int = 0
    cut: int = 0  # answers that hit --max-new-tokens before ending their turn
    dropped_turns: int = 0  # user turns not answered because the prompt reached --max-length
    generated_tokens: int = 0
    rejected: dict = field(default_factory=dict)  # conversation index -> server's reason (endpoint 4xx)

    def add(self, other: "RegenStats"):
        self.answers += other.answers
        self.cut += other.cut
        self.dropped_turns += other.dropped_turns
        self.generated_tokens += other.generated_tokens
        self.rejected.update(other.rejected)


def prompt_turns(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(system messages, steps): what regeneration keeps of a conversation. Each step is what
    the conversation adds before the target answers: a user turn, or a tool call of the dataset
    (marked ``learn: False``) with the results that follow it. A call left without results is
    dropped."""
    system = [m for m in messages if m["role"] == "system"][:1]
    steps, cur = [], []
    for m in messages:
        if m["role"] == "user":  # every user turn is answered on its own (unanswered prompts too)
            if cur:
                steps.append(cur)
            cur = [m]
        elif m["role"] == "tool":
            cur.append(m)
        elif m["role"] == "assistant" and m.get("tool_calls") and cur:
            cur.append({**m, "learn": False})
        elif m["role"] == "assistant" and cur:
            steps.append(cur)
            cur = []
    while cur and cur[-1]["role"] == "assistant":
        cur.pop()
    if cur:
        steps.append(cur)
    return system, steps


# ---------------------------------------------------------------- local HF generation


def _next_tokens(logits, settings: GenSettings, gen):
    """Greedy argmax, or a draw from the temperature/top-p distribution (as HF applies them)."""
    import torch

    if settings.temperature <= 0:
        return logits.argmax(-1)
    from ..decode.generator import target_probs

    probs = target_probs(logits, settings.temperature, 0, settings.top_p)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def left_padded(prompts: list[list[int]], pad_id: int):
    """(input_ids, attention_mask) [B, longest]: every prompt ends at the last column."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        attn[r, width - len(p):] = 1
    return ids, attn


def generate_batch(model, prompts: list[list[int]], settings: GenSettings, stop_ids: set[int],
                   pad_id: int, gen=None) -> list[tuple[list[int], bool]]:
    """Continue every prompt; per prompt (generated ids incl. the stop token, ended?).

    One left-padded prefill, then one token per row per step. A row that ends (stop token or
    max_new_tokens) leaves the batch at once: its cache rows are dropped, so the steps after
    it cost only the rows still generating (``generate`` would keep computing it to the end).
    """
    import torch
    from transformers import DynamicCache

    from ..model.target import model_device

    device = model_device(model)
    ids, attn = left_padded(prompts, pad_id)
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp_(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, **cache_kwargs(model, cache), use_cache=True,
                logits_to_keep=1)
    alive = list(range(len(prompts)))
    tokens: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    nxt_pos = pos[:, -1]
    while True:
        new = _next_tokens(out.logits[:, -1].float(), settings, gen)
        keep = []
        for r, (i, t) in enumerate(zip(alive, new.tolist())):
            tokens[i].append(t)
            ended[i] = t in stop_ids
            if not ended[i] and len(tokens[i]) < settings.max_new_tokens:
                keep.append(r)
        if not keep:
            return [(t, e) for t, e in zip(tokens, ended)]
        if len(keep) < len(alive):
            sel = torch.tensor(keep, device=device)
            cache.batch_select_indices(sel)
            attn, new, nxt_pos = attn[sel], new[sel], nxt_pos[sel]
            alive = [alive[r] for r in keep]
        attn = torch.cat([attn, attn.new_ones(len(alive), 1)], dim=1)
        nxt_pos = nxt_pos + 1
        out = model(input_ids=new[:, None], attention_mask=attn, position_ids=nxt_pos[:, None],
                    **cache_kwargs(model, cache), use_cache=True)


def answer_message(tokenizer, ids: list[int], ended: bool) -> dict:
    """The assistant message of one generated answer, with the exact ids the target emitted.

    ``token_ids`` (stop token included when the turn ended) is what the sample learns
    (chat_mask.exact_answer_labels); ``content`` is the text the next turn sees as context,
    decoded without stripping so that it re-encodes to the same ids wherever it can.
    """
    content = ids[:-1] if ended else ids
    msg = {"role": "assistant", "content": tokenizer.decode(content, skip_special_tokens=False),
           "token_ids": list(ids)}
    if not ended:
        msg["finished"] = False
    return msg


def regenerate_local(model, tokenizer, conversations: list[list[dict]], settings: GenSettings,
                     stop_ids: set[int], on_batch: Callable[[str], None] | None = None,
                     template_kwargs: dict | None = None, seed: int | None = None,
                     continuous: bool = True, tools: list | None = None,
                     on_progress: Callable[[int, int], None] | None = None) -> tuple[list[list[dict]], RegenStats]:
    """Answer every user turn of every conversation with the local target.

    Targets the fast path supports (``fast_target``) run with continuous batching
    (``batch_decode``): ``batch_size`` conversations in flight, a finished one replaced at
    once. Others, or ``continuous=False``, run static batches turn by turn (``generate_batch``).
    An answer cut by max_new_tokens ends its conversation: a later user turn would follow a
    reply the target never finished (the turns left are counted as dropped). ``tools``: per
    conversation, the tool schemas its template renders (None: none). ``on_progress(done, total)``:
    conversations finished (as they finish with continuous batching, else at the end).
    """
    import torch

    from ..decode.fast_target import unsupported_reason
    from ..model.target import model_device

    if settings.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {settings.batch_size}")
    template_kwargs = template_kwargs or {}
    tools = tools or [None] * len(conversations)
    gen = torch.Generator(device=model_device(model))
    gen.manual_seed(0 if seed is None else seed)
    if continuous and unsupported_reason(model) is None:
        return _regenerate_continuous(model, tokenizer, conversations, settings, stop_ids, on_batch,
                                      template_kwargs, gen, tools, on_progress)
    if settings.dtype is not None and getattr(torch, settings.dtype) != next(model.parameters()).dtype:
        raise ValueError(f"generating in {settings.dtype} needs continuous batching, which this target "
                         f"cannot take ({unsupported_reason(model) or 'continuous=False'})")
    stats = RegenStats()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)
    state = []  # per conversation: (context so far, remaining user turns, still open?)
    for msgs in conversations:
        system, users = prompt_turns(msgs)
        state.append([list(system), list(users), True])
    turn = 0
    while True:
        active = [i for i, (_, users, open_) in enumerate(state) if open_ and len(users) > turn]
        if not active:
            break
        prompts = {}
        for i in active:
            ctx, users, _ = state[i]
            ctx.extend(users[turn])
            text = render(tokenizer, strip_meta(ctx), add_generation_prompt=True,
                          **_with_tools(template_kwargs, tools[i]))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if settings.max_length and len(ids) >= settings.max_length:
                stats.dropped_turns += len(users) - turn
                state[i][2] = False
                continue
            prompts[i] = ids
        # Similar lengths together: less padding; the order is deterministic, so resumed
        # shards batch exactly as uninterrupted ones.
        order = sorted(prompts, key=lambda i: (len(prompts[i]), i))
        for b in range(0, len(order), settings.batch_size):
            batch = order[b:b + settings.batch_size]
            if on_batch:
                on_batch(f"turn {turn + 1}, batch {b // settings.batch_size + 1}/"
                         f"{-(-len(order) // settings.batch_size)}")
            with torch.no_grad():
                outs = generate_batch(model, [prompts[i] for i in batch], settings, stop_ids, pad_id, gen)
            for i, (new, ended) in zip(batch, outs):
                stats.answers += 1
                stats.generated_tokens += len(new)
                state[i][0].append(answer_message(tokenizer, new, ended))
                if not ended:
                    stats.cut += 1
                    stats.dropped_turns += len(state[i][1]) - turn - 1
                    state[i][2] = False
        turn += 1
    if on_progress:
        on_progress(len(conversations), len(conversations))
    return [answered(ctx) for ctx, _, _ in state], stats


def _with_tools(template_kwargs: dict, tools) -> dict:
    return {**template_kwargs, "tools": tools} if tools else template_kwargs


def _regenerate_continuous(model, tokenizer, conversations, settings: GenSettings, stop_ids, on_batch,
                           template_kwargs, gen, tools, on_progress=None) -> tuple[list[list[dict]], RegenStats]:
    """regenerate_local on ``batch_decode``: each conversation answers its turns in one slot."""
    from ..decode.batch_decode import ContinuousBatcher, SlotTarget

    stats = RegenStats()
    convs = []  # per conversation: [context so far, user turns, next turn, still open?]
    for msgs in conversations:
        system, users = prompt_turns(msgs)
        convs.append([list(system), users, 0, True])

    def prompt_ids(ctx, i):
        text = render(tokenizer, strip_meta(ctx), add_generation_prompt=True, **_with_tools(template_kwargs, tools[i]))
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def next_prompt(i):
        ctx, users, turn, open_ = convs[i]
        if not open_ or turn >= len(users):
            return None
        ctx.extend(users[turn])
        ids = prompt_ids(ctx, i)
        if settings.max_length and len(ids) >= settings.max_length:
            stats.dropped_turns += len(users) - turn
            convs[i][3] = False
            return None
        return ids

    def on_answer(i, ids, ended):
        ctx, users, turn, _ = convs[i]
        stats.answers += 1
        stats.generated_tokens += len(ids)
        ctx.append(answer_message(tokenizer, ids, ended))
        convs[i][2] = turn + 1
        if not ended:
            stats.cut += 1
            stats.dropped_turns += len(users) - turn - 1
            convs[i][3] = False

    # Similar first-prompt lengths in flight together: shorter attention spans per step.
    # The order is deterministic, so resumed shards run exactly as uninterrupted ones.
    first = {}
    for i, (ctx, users, _, _) in enumerate(convs):
        first[i] = len(prompt_ids(ctx + users[0], i)) if users else 0
    order = sorted(first, key=lambda i: (first[i], i))
    span = min(max(first.values(), default=1), settings.max_length or 1 << 30) + settings.max_new_tokens
    import torch

    dtype = getattr(torch, settings.dtype) if settings.dtype else None
    target = SlotTarget(model, max(1, min(settings.batch_size, len(order))), span, dtype=dtype)
    pick = lambda logits: _next_tokens(logits.float(), settings, gen)  # noqa: E731
    def progress(done, total):
        if on_batch:
            on_batch(f"{done}/{total} conversations")
        if on_progress:
            on_progress(done, total)

    ContinuousBatcher(target, settings.max_new_tokens, stop_ids, pick).run(order, next_prompt, on_answer, progress)
    return [answered(ctx) for ctx, _, _, _ in convs], stats


def answered(ctx: list[dict]) -> list[dict]:
    """A regenerated conversation up to its last answer (an unanswered, dropped prompt goes)."""
    while ctx and (ctx[-1]["role"] != "assistant" or ctx[-1].get("learn") is False):
        ctx.pop()
    return ctx


TEMPLATE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def strip_meta(messages: list[dict]) -> list[dict]:
    """Messages as chat templates (and OpenAI servers) read them: role, content, and a tool
    exchange's ``tool_calls`` / ``tool_call_id`` / ``name``; our bookkeeping (``token_ids``,
    ``finished``, ``learn``) stays out."""
    return [{k: m[k] for k in TEMPLATE_KEYS if k in m} for m in messages]
