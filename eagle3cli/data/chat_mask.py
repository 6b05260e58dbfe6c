"""Loss masks from the tokenizer's own chat template, for any template.

The draft must learn what the target *writes*: the assistant's content and the token that
ends its turn (the target emits it, so the draft should predict it), never the system or
user text nor the role headers the template adds around a turn.

Two routes, no per-family rules:

1. Templates with ``{% generation %}`` markers: transformers returns the assistant mask
   itself (``return_assistant_tokens_mask``).
2. Any other template: render the whole conversation once and tokenise it (with character
   offsets). For each assistant turn k, render ``messages[:k]`` with the generation prompt:
   the full text continues from there with what the assistant writes (if a template renders
   that prefix differently, the header after the previous message is matched instead).
   The turn's content is then found from there (templates may trim it, or drop a think
   block from earlier turns as Qwen-3 does), and the first special token after it is the
   end-of-turn token. Tokens from the start through that token are masked. A turn that calls
   tools ends where the conversation up to it, rendered alone, ends (its calls are written by
   the template, not found in the content); its trailing special tokens are the end of turn.
   Tool results, like user turns, are never learned.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from ..core.errors import Eagle3Error
from .sources import plain_text

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
EOT_WINDOW = 8  # tokens after the content in which the end-of-turn special token must appear


class MaskError(ValueError):
    """A conversation whose assistant turns cannot be located (skipped and counted)."""


class NoChatTemplate(Eagle3Error, ValueError):
    """The tokenizer has no chat template and none was given."""


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[bool]
    end_ids: set[int]  # the end-of-turn tokens that closed the assistant turns

    @property
    def num_masked(self) -> int:
        return sum(self.loss_mask)


def chat_template(tokenizer) -> str:
    """The template string in use; a one-line error that says what to pass when absent."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):  # named templates: "default" is what apply_chat_template uses
        tpl = tpl.get("default")
    if not tpl:
        name = getattr(tokenizer, "name_or_path", "the target")
        raise NoChatTemplate(
            f"{name} has no chat template: pass --chat-template FILE (a Jinja file, e.g. the instruct "
            "variant's chat_template.jinja)"
        )
    return tpl


def template_hash(template: str | None) -> str | None:
    """sha256 of the template string: the store's ``chat_template_hash`` (None for no template)."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest() if template is not None else None


def has_generation_markers(template: str) -> bool:
    return bool(GENERATION_MARKER.search(template))


def special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False))
    return ids


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **template_kwargs) -> str:
    """The template's text for ``messages``; a template's own refusal becomes a MaskError."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError (raise_exception) and friends
        raise MaskError(f"chat template refused the conversation: {str(e).splitlines()[0][:120]}") from None


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first differing character
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _content_end(text: str, start: int, content: str) -> int | None:
    """Where the assistant's content ends in ``text``, searching from ``start``.

    The whole (stripped) content is tried first; if the template dropped a reasoning block
    (``<think>...</think>`` in earlier turns), the answer after it is tried next.
    """
    candidates = [content.strip()]
    if "</think>" in content:
        candidates.append(content.split("</think>")[-1].strip())
    for c in candidates:
        if not c:
            return start
        pos = text.find(c, start)
        if pos >= 0:
            return pos + len(c)
    return None


def _turn_start(text: str, prefix: str, prev: dict, search_from: int) -> int:
    """Where the assistant starts writing in ``text``, given ``prefix`` = the conversation up to
    it rendered with the generation prompt.

    Usually ``text`` starts with ``prefix``. Some templates render a prefix differently when it
    is the whole conversation (Mistral puts the system prompt into the *last* user turn), so
    otherwise the previous message is found in both and the header after it is matched.
    """
    if text.startswith(prefix):
        return len(prefix)
    u = plain_text(prev["content"]).strip()
    pu, pf = prefix.rfind(u), text.find(u, search_from)
    if u and pu >= 0 and pf >= 0:
        after = pf + len(u)
        return after + _common_prefix(prefix[pu + len(u):], text[after:])
    return _common_prefix(prefix, text)


def _special_strings(tokenizer) -> list[str]:
    """The special tokens as text, longest first."""
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if getattr(t, "special", False)}
    return sorted((t for t in specials | set(tokenizer.all_special_tokens) if t), key=len, reverse=True)


def _calls_end(tokenizer, upto: list[dict], text: str, start: int, template_kwargs: dict) -> int | None:
    """Where a tool-calling turn's own text ends (its calls are rendered by the template, so
    they cannot be searched for as content).

    The conversation through the turn, rendered alone, is usually a prefix of the whole; that
    prefix minus its trailing whitespace and special tokens (the end of turn, found again by
    the caller) is what the assistant wrote. A template that renders the turn differently when
    it is the last one (Qwen-3 adds an empty think block) ends it instead at the first end-of-turn
    marker after its start: the special token the template writes right after an answer."""
    specials = _special_strings(tokenizer)
    alone = render(tokenizer, upto, add_generation_prompt=False, **template_kwargs)
    if text.startswith(alone) and len(alone) > start:
        end = len(alone)
        while end > start:
            trimmed = len(text[start:end].rstrip()) + start
            trimmed = next((trimmed - len(t) for t in specials if text.endswith(t, start, trimmed)), trimmed)
            if trimmed == end:
                return end
            end = trimmed
    probe = render(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                   add_generation_prompt=False, **{k: v for k, v in template_kwargs.items() if k != "tools"})
    tail = probe[probe.rfind("Hello") + len("Hello"):].lstrip()
    marker = next((t for t in specials if tail.startswith(t)), None)
    pos = text.find(marker, start) if marker else -1
    return pos if pos > start else None


def assistant_char_spans(tokenizer, messages: list[dict], text: str, **template_kwargs) -> list[tuple[int, int]]:
    """(start, content_end) character spans of the assistant turns in ``text``."""
    spans = []
    search_from = 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if k == 0:
            raise MaskError("conversation starts with an assistant turn")
        prefix = render(tokenizer, messages[:k], add_generation_prompt=True, **template_kwargs)
        start = _turn_start(text, prefix, messages[k - 1], search_from)
        if m.get("tool_calls"):
            end = _calls_end(tokenizer, messages[:k + 1], text, start, template_kwargs)
        else:
            end = _content_end(text, start, m["content"])
        if end is None:
            raise MaskError(f"assistant turn {k} not found in the rendered template (template rewrites its content)")
        spans.append((start, end))
        search_from = end
    return spans


def _mask_from_spans(offsets, ids, spans, specials) -> tuple[list[bool], set[int]]:
    mask = [False] * len(ids)
    ends: set[int] = set()
    t = 0
    for start, cend in spans:
        while t < len(ids) and offsets[t][1] <= start:  # tokens entirely before the turn
            t += 1
        first = t
        while t < len(ids) and offsets[t][0] < cend:  # the content (tokens overlapping it)
            t += 1
        # The end-of-turn token: the first special token right after the content. Templates
        # without one (plain-text turn separators) end the turn at the next token.
        eot = next((j for j in range(t, min(t + EOT_WINDOW, len(ids))) if ids[j] in specials), None)
        if eot is None:
            eot = t if t < len(ids) else len(ids) - 1
        for j in range(first, eot + 1):
            mask[j] = True
        ends.add(ids[eot])
        t = eot + 1
    return mask, ends


def tokenize_conversation(tokenizer, messages: list[dict], **template_kwargs) -> Tokenized:
    """Token ids of the full conversation and its assistant loss mask."""
    template = chat_template(tokenizer)
    if not getattr(tokenizer, "is_fast", False):
        raise MaskError("loss masks need a fast tokenizer (character offsets); this one is a slow tokenizer")
    if has_generation_markers(template):
        try:
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True, **template_kwargs)
        except Exception as e:  # noqa: BLE001
            raise MaskError(f"chat template refused the conversation: {str(e).splitlines()[0][:120]}") from None
        ids = list(out["input_ids"])
        mask = [bool(x) for x in out["assistant_masks"]]
        ends = {ids[i] for i in range(len(ids)) if mask[i] and (i + 1 == len(ids) or not mask[i + 1])}
        return Tokenized(ids, mask, ends)
    text = render(tokenizer, messages, add_generation_prompt=False, **template_kwargs)
    spans = assistant_char_spans(tokenizer, messages, text, **template_kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask, ends = _mask_from_spans(enc["offset_mapping"], ids, spans, special_ids(tokenizer))
    return Tokenized(ids, mask, ends)


def end_of_turn_ids(tokenizer) -> set[int]:
    """The token(s) the target ends an assistant turn with, read off the template itself,
    plus EOS: generation stops on them and the draft vocabulary must contain them."""
    ids = set()
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        ids |= tokenize_conversation(tokenizer, probe).end_ids
    except MaskError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def masked_segments(ids: list[int], mask: list[bool]) -> list[list[int]]:
    """The runs of consecutive masked tokens (one per assistant turn, normally)."""
    segs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            segs.append(cur)
            cur = []
    if cur:
        segs.append(cur)
    return segs


def highlight(tokenizer, ids: list[int], mask: list[bool]):
    """A rich Text of the conversation with the loss-masked (learned) tokens highlighted."""
    from rich.text import Text

    out = Text()
    # Decode runs, not single tokens, so multi-byte characters split across tokens survive.
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            piece = tokenizer.decode(ids[start:i], skip_special_tokens=False)
            out.append(piece, style="bold black on green" if mask[start] else "dim")
            start = i
    return out


def exact_answer_labels(tok: Tokenized, messages: list[dict]) -> tuple[list[int], list[bool], int]:
    """The learned tokens of regenerated answers, made equal to what the target emitted.

    Regeneration records, per answer, the ids the target generated (``token_ids``, its stop
    token included when the turn ended) and ``finished: False`` for an answer cut by
    max_new_tokens (always the conversation's last). The template's tokens stay for everything
    the target read; then

    * the last answer is replaced by its ``token_ids``: exactly the emitted ids, and a cut
      answer learns no end-of-turn token; without ids (endpoint), a cut answer loses the
      template's end-of-turn token instead;
    * an earlier answer whose re-encoded text differs from its ``token_ids`` is not learned
      (its context is what the target saw, but those tokens are not what it wrote); where the
      template dropped the answer's thinking from history, the rest must equal the ids the
      target wrote after its thinking;
    * a turn marked ``learn: False`` (a dataset's tool call kept as context of regenerated
      answers: the target did not write it) is not learned.

    Returns (ids, mask, number of earlier answers left unlearned).
    """
    ids, mask = list(tok.input_ids), list(tok.loss_mask)
    answers = [m for m in messages if m["role"] == "assistant"]
    runs, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    if not answers or len(runs) != len(answers):
        return ids, mask, 0  # no regenerated answers, or a template this cannot align
    unlearned = 0
    for k, (msg, (s, e)) in enumerate(zip(answers, runs)):
        emitted = msg.get("token_ids")
        if msg.get("learn") is False:
            mask[s:e] = [False] * (e - s)
        elif k < len(answers) - 1:
            if emitted is not None and ids[s:e] != list(emitted) and list(emitted)[-(e - s):] != ids[s:e]:
                mask[s:e] = [False] * (e - s)
                unlearned += 1
        elif emitted is not None:
            ids, mask = ids[:s] + list(emitted), mask[:s] + [True] * len(emitted)
        elif msg.get("finished") is False:
            ids, mask = ids[:e - 1], mask[:e - 1]
    return ids, mask, unlearned


def last_turn_only(mask: list[bool]) -> list[bool]:
    """``--last-turn-only``: the mask keeps only its last run of learned tokens (the last
    assistant turn); everything before it is context."""
    last = max((i for i, m in enumerate(mask) if m), default=-1)
    first = last
    while first > 0 and mask[first - 1]:
        first -= 1
    return [first <= i <= last and last >= 0 for i in range(len(mask))]
