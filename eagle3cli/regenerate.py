"""The target answers the prompts itself: its own distribution is what the draft must predict.

Each conversation keeps its system prompt (or the one given with ``--system``) and its user
turns; the dataset's answers are dropped. The target answers the user turns in order, and
each answer becomes context for the next turn, exactly as in a real chat.

Two engines:

- local: batched Hugging Face generation (left padding; conversations answer turn 1 together,
  then turn 2, ...), greedy or sampled with temperature/top-p.
- ``--endpoint URL``: any OpenAI-compatible server (vLLM, SGLang, ...) serving the target,
  many conversations in flight at once, with retries. Only the standard library is used.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .chat_mask import render


@dataclass
class GenSettings:
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 16
    max_length: int | None = None  # stop answering once the prompt alone reaches this many tokens


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


def prompt_turns(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """(system messages, user turns in order): what regeneration keeps of a conversation."""
    system = [m for m in messages if m["role"] == "system"][:1]
    users = [m["content"] for m in messages if m["role"] == "user"]
    return system, users


# ---------------------------------------------------------------- local HF generation


def _cut_at_stop_token(tokens: list[int], stop_ids: set[int], pad_id: int | None) -> tuple[list[int], bool]:
    """Generated ids up to (excluding) the first stop token; True if the turn ended there."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i], True
    while tokens and pad_id is not None and tokens[-1] == pad_id:
        tokens = tokens[:-1]
    return tokens, False


def regenerate_local(model, tokenizer, conversations: list[list[dict]], settings: GenSettings,
                     stop_ids: set[int], on_batch: Callable[[str], None] | None = None,
                     template_kwargs: dict | None = None) -> tuple[list[list[dict]], RegenStats]:
    """Answer every user turn of every conversation with the local target, batched by turn."""
    import torch

    from .target import model_device

    template_kwargs = template_kwargs or {}
    stats = RegenStats()
    device = model_device(model)
    pad_id = tokenizer.pad_token_id
    state = []  # per conversation: (context so far, remaining user turns)
    for msgs in conversations:
        system, users = prompt_turns(msgs)
        state.append((list(system), list(users)))
    turn = 0
    while True:
        active = [i for i, (_, users) in enumerate(state) if len(users) > turn]
        if not active:
            break
        prompts = {}
        for i in active:
            ctx, users = state[i]
            if ctx and ctx[-1]["role"] == "user":  # an earlier turn was dropped: stop this one
                continue
            ctx.append({"role": "user", "content": users[turn]})
            text = render(tokenizer, ctx, add_generation_prompt=True, **template_kwargs)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if settings.max_length and len(ids) >= settings.max_length:
                stats.dropped_turns += len(users) - turn
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
            width = max(len(prompts[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):  # left padding: every prompt ends at the last column
                ids = prompts[i]
                input_ids[r, width - len(ids):] = torch.tensor(ids)
                attn[r, width - len(ids):] = 1
            kw = dict(max_new_tokens=settings.max_new_tokens, eos_token_id=sorted(stop_ids), pad_token_id=pad_id)
            if settings.temperature > 0:
                kw.update(do_sample=True, temperature=settings.temperature, top_p=settings.top_p)
            else:
                kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            with torch.no_grad():
                out = model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device), **kw)
            for r, i in enumerate(batch):
                new, ended = _cut_at_stop_token(out[r, width:].tolist(), stop_ids, pad_id)
                stats.answers += 1
                stats.cut += not ended
                stats.generated_tokens += len(new) + ended
                answer = tokenizer.decode(new, skip_special_tokens=False).strip()
                state[i][0].append({"role": "assistant", "content": answer})
        turn += 1
    results = []
    for ctx, _ in state:
        while ctx and ctx[-1]["role"] != "assistant":  # an unanswered (dropped) prompt
            ctx.pop()
        results.append(ctx)
    return results, stats


# ---------------------------------------------------------------- OpenAI-compatible server


class EndpointError(RuntimeError):
    """The server kept failing after all retries (the run stops; rerun resumes)."""


class EndpointRejected(ValueError):
    """The server refused one request (4xx): that conversation is skipped and counted."""


@dataclass
class Endpoint:
    url: str
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 16
    retries: int = 5
    timeout: float = 600.0

    @property
    def base(self) -> str:
        u = self.url.rstrip("/")
        for tail in ("/chat/completions", "/completions"):
            if u.endswith(tail):
                u = u[: -len(tail)]
        return u if u.endswith("/v1") else u + "/v1"

    def _request(self, path: str, payload: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(payload).encode() if payload is not None else None
        last = ""
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.base + path, data=data, headers=headers,
                                         method="POST" if data is not None else "GET")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read().decode("utf-8"))
            except urllib.error.HTTPError as e:
                body = e.read().decode("utf-8", "replace")[:200]
                if e.code != 429 and 400 <= e.code < 500:
                    raise EndpointRejected(f"HTTP {e.code}: {body}") from None
                last = f"HTTP {e.code}: {body}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt < self.retries:
                time.sleep(min(0.5 * 2 ** attempt, 8.0))
        raise EndpointError(f"{self.base}{path} failed after {self.retries + 1} tries: {last}")

    def resolve_model(self) -> str:
        """The served model's name: given, or the first one the server lists."""
        if self.model:
            return self.model
        models = self._request("/models").get("data") or []
        if not models:
            raise EndpointError(f"{self.base}/models lists no model; pass --endpoint-model")
        self.model = models[0]["id"]
        return self.model

    def answer(self, messages: list[dict], settings: GenSettings) -> tuple[str, bool, int]:
        """(answer, turn ended normally, completion tokens) for one chat request."""
        payload = {"model": self.resolve_model(), "messages": messages, "max_tokens": settings.max_new_tokens,
                   "temperature": settings.temperature, "top_p": settings.top_p, "n": 1}
        out = self._request("/chat/completions", payload)
        choice = out["choices"][0]
        msg = choice.get("message") or {}
        content = msg.get("content") or ""
        # Reasoning servers return the think block separately; put it back where the template expects it.
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning:
            content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
        tokens = int((out.get("usage") or {}).get("completion_tokens") or 0)
        return content.strip(), choice.get("finish_reason") != "length", tokens


def regenerate_endpoint(endpoint: Endpoint, conversations: list[list[dict]], settings: GenSettings,
                        on_done: Callable[[int], None] | None = None) -> tuple[list[list[dict] | None], RegenStats]:
    """Answer every user turn through the server, ``endpoint.concurrency`` conversations at once.

    A conversation the server refuses (HTTP 4xx, e.g. too long) comes back as None and is
    counted; persistent server failures raise EndpointError.
    """
    endpoint.resolve_model()

    def one(i: int):
        stats = RegenStats()
        system, users = prompt_turns(conversations[i])
        ctx = list(system)
        try:
            for u in users:
                ctx.append({"role": "user", "content": u})
                answer, ended, ntok = endpoint.answer(ctx, settings)
                ctx.append({"role": "assistant", "content": answer})
                stats.answers += 1
                stats.cut += not ended
                stats.generated_tokens += ntok
        except EndpointRejected as e:
            if not any(m["role"] == "assistant" for m in ctx):
                stats.rejected[i] = str(e)
                return None, stats
            ctx.pop()  # keep the answered turns, drop the refused prompt (usually too long)
            stats.dropped_turns += len(users) - stats.answers
        if on_done:
            on_done(i)
        return ctx, stats

    total = RegenStats()
    with ThreadPoolExecutor(max_workers=max(1, endpoint.concurrency)) as pool:
        results = list(pool.map(one, range(len(conversations))))
    for _, s in results:
        total.add(s)
    return [r for r, _ in results], total
