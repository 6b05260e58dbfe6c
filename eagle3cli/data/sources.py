"""Chat datasets in, normalised conversations out.

A source is a Hub dataset id (loaded, or streamed, with ``datasets``), a named preset for a
usual corpus, or a local ``.json`` / ``.jsonl`` / ``.parquet`` file. Every row becomes a list of
``{"role": "system"|"user"|"assistant"|"tool", "content": str}`` messages, whatever its shape:

    sharegpt  {"conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}
    messages  {"messages": [{"role": ..., "content": ...}, ...]}          (OpenAI / HF chat)
    alpaca    {"instruction": str, "input": str?, "output": str?}
    turns     {"turns": [str, ...], "reference": [str, ...]?}             (eval sets, MT-bench)
    prompt    {"question"|"prompt": str, "answer"|"response"|"output"|"completion": str?}

Conversations of tool-using and reasoning targets keep what the chat template reads: a row's
``tools`` (OpenAI function schemas, a list or its JSON text), an assistant's ``tool_calls``, the
``tool`` messages that answer them (with ``tool_call_id`` / ``name``), and ``reasoning_content``
(put back into the content as a ``<think>`` block, where Qwen-3-style templates find it).
A user message may hold OpenAI-style content parts with images: ``{"type": "image", "path":
"img.png"}`` (``image`` or ``url`` also name the file; a relative path is read from the data
file's folder); such a message keeps its parts, the image parts with their absolute ``path``.

A row that cannot be used (malformed JSON, unknown shape, empty or role-less conversation,
non-string content, no user turn, no assistant turn when answers are kept) is skipped and
counted by reason; the first few locations are kept so the user can look at them. ``strict``
turns the first bad row into an error instead. Reading the rows (files, presets, the Hub) is
``raw_rows``' job.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .raw_rows import Malformed, SourceError, Truncated, raw_rows

FORMATS = ("sharegpt", "messages", "alpaca", "turns", "prompt")

ROLE_ALIASES = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant", "bot": "assistant",
    "system": "system", "tool": "tool", "function": "tool",
}
PROMPT_KEYS = ("question", "prompt")
ANSWER_KEYS = ("answer", "response", "output", "completion")
MAX_REPORTED = 5


class BadRow(ValueError):
    """A row that cannot become a conversation; the message is the reason (counted as such)."""


@dataclass
class Conversation:
    id: int  # row index in the source (0-based), kept through shuffling for tracing
    messages: list[dict]
    tools: list | None = None  # the row's tool schemas, passed to the chat template


@dataclass
class LoadReport:
    rows: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: list[tuple[str, str]] = field(default_factory=list)  # (location, reason), first few
    format: str | None = None
    notes: list[str] = field(default_factory=list)

    def bad(self, where: str, reason: str):
        self.skipped[reason] += 1
        if len(self.examples) < MAX_REPORTED:
            self.examples.append((where, reason))

    def summary(self) -> str:
        line = f"{self.kept} conversations kept of {self.rows} rows read (format: {self.format})"
        if self.skipped:
            reasons = ", ".join(f"{r}: {n}" for r, n in self.skipped.most_common())
            where = "; ".join(f"{w} ({r})" for w, r in self.examples)
            # parentheses, not brackets: rich would read "[reason: n]" as markup and drop it
            line += f"; skipped {sum(self.skipped.values())} ({reasons}); first: {where}"
        return line


# ---------------------------------------------------------------- normalisation


def _text(value, what: str) -> str:
    if isinstance(value, list):
        return _text_parts(value, what)
    if not isinstance(value, str):
        raise BadRow(f"non-string content in {what}")
    return value


IMAGE_KEYS = ("path", "image", "url")


def _text_parts(parts: list, what: str):
    """OpenAI-style content parts ``[{"type": "text", "text": ...}, ...]``: their texts, joined.

    Many chat datasets store every message this way. Image parts (``{"type": "image", "path":
    ...}``) are kept only in a user turn, and then the parts stay a list (text parts and image
    parts with their ``path``): the target's processor puts the image into the context. Any
    other part (audio, an image elsewhere) is not something a draft can be trained on here.
    """
    texts, out, images = [], [], 0
    for part in parts:
        if not isinstance(part, dict):
            raise BadRow(f"non-string content in {what}")
        kind = part.get("type", "text")
        if kind in ("image", "image_url") and what == "a user turn":
            ref = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else None
            ref = ref or next((part[k] for k in IMAGE_KEYS if isinstance(part.get(k), str)), None)
            if not ref:
                raise BadRow(f"image part without a path in {what}")
            out.append({"type": "image", "path": ref})
            images += 1
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadRow(f"non-text content part ({str(kind)[:20]}) in {what}")
        texts.append(part["text"])
        out.append({"type": "text", "text": part["text"]})
    return out if images else "\n".join(texts)


def plain_text(content) -> str:
    """A message's text: the content itself, or its text parts joined (images left out)."""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if p.get("type") == "text")
    return content or ""


def images_of(messages: list[dict]) -> list[str]:
    """The image paths of a conversation, in the order they appear."""
    return [p["path"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "image"]


def _tool_calls(value, what: str) -> list[dict]:
    """OpenAI ``tool_calls``: each ``{"type": "function", "function": {"name", "arguments"}}``;
    ``arguments`` given as JSON text becomes an object, as chat templates render it."""
    if not isinstance(value, list) or not value:
        raise BadRow(f"tool_calls of {what} is not a list of calls")
    calls = []
    for c in value:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRow(f"tool call without a function name in {what}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise BadRow(f"tool call arguments are not JSON in {what}") from None
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        calls.append(call)
    return calls


def row_tools(row) -> list | None:
    """The row's ``tools`` (a list of schemas, or its JSON text), None when absent."""
    tools = row.get("tools") if isinstance(row, dict) else None
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise BadRow("tools is not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRow("tools is not a list of schemas")
    return tools


def _a(role: str) -> str:
    return f"an {role}" if role == "assistant" else f"a {role}"  # roles: system, user, assistant, tool


def _turn_list(turns, role_key: str, content_key: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise BadRow("empty conversation")
    out = []
    for t in turns:
        if not isinstance(t, dict):
            raise BadRow("turn is not an object")
        role = t.get(role_key, t.get("role", t.get("from")))
        if role is None:
            raise BadRow("turn without a role")
        mapped = ROLE_ALIASES.get(str(role).lower())
        if mapped is None:
            raise BadRow(f"unknown role {str(role)[:20]!r}")
        content = t.get(content_key, t.get("content", t.get("value")))
        what = f"{_a(mapped)} turn"
        msg = {"role": mapped, "content": "" if content is None and t.get("tool_calls") else _text(content, what)}
        if mapped == "assistant" and t.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(t["tool_calls"], what)
        if mapped == "assistant" and isinstance(t.get("reasoning_content"), str) and t["reasoning_content"].strip():
            think = f"<think>\n{t['reasoning_content'].strip()}\n</think>\n\n"
            msg["content"] = think + plain_text(msg["content"]).lstrip()
        if mapped == "tool":
            msg.update({k: t[k] for k in ("tool_call_id", "name") if isinstance(t.get(k), str)})
        out.append(msg)
    return out


def _alternating(turns: list[dict]) -> list[dict]:
    """system? then user/assistant alternating: leading answers dropped, repeats merged.

    Many templates (Gemma, Mistral) refuse anything else, and a leading answer (common in
    scraped ShareGPT) has no prompt to answer.
    """
    system = [t for t in turns[:1] if t["role"] == "system"]
    rest = turns[len(system):]
    while rest and rest[0]["role"] != "user":
        rest = rest[1:]
    merged: list[dict] = []
    for t in rest:
        if t["role"] == "system":
            raise BadRow("system turn in the middle of a conversation")
        if t["role"] == "tool" and not (merged and (merged[-1]["role"] == "tool" or merged[-1].get("tool_calls"))):
            raise BadRow("tool result without a tool call before it")
        # Tool exchanges keep every message: a call, its results, the answer after them.
        plain = t["role"] != "tool" and not t.get("tool_calls") and isinstance(t["content"], str)
        if merged and merged[-1]["role"] == t["role"] and plain and set(merged[-1]) == {"role", "content"} \
                and isinstance(merged[-1]["content"], str):
            merged[-1] = {"role": t["role"], "content": merged[-1]["content"] + "\n\n" + t["content"]}
        else:
            merged.append(dict(t))
    return system + merged


def normalise(row, fmt: str) -> list[dict]:
    """One raw row -> messages (not yet checked for usability; see :func:`check`)."""
    if not isinstance(row, dict):
        raise BadRow("row is not an object")
    if fmt == "sharegpt":
        if "conversations" not in row:
            raise BadRow("no 'conversations' field")
        turns = _turn_list(row["conversations"], "from", "value")
    elif fmt == "messages":
        if "messages" not in row:
            raise BadRow("no 'messages' field")
        turns = _turn_list(row["messages"], "role", "content")
    elif fmt == "alpaca":
        if "instruction" not in row:
            raise BadRow("no 'instruction' field")
        prompt = _text(row["instruction"], "instruction")
        extra = row.get("input") or ""
        prompt = prompt + "\n\n" + _text(extra, "input") if extra else prompt
        turns = [{"role": "user", "content": prompt}]
        if row.get("output"):
            turns.append({"role": "assistant", "content": _text(row["output"], "output")})
        if row.get("system"):
            turns.insert(0, {"role": "system", "content": _text(row["system"], "system")})
    elif fmt == "turns":
        prompts, refs = row.get("turns"), row.get("reference") or []
        if not isinstance(prompts, list) or not prompts:
            raise BadRow("empty conversation")
        if not isinstance(refs, list):
            refs = []
        turns = []
        for i, p in enumerate(prompts):
            turns.append({"role": "user", "content": _text(p, "a user turn")})
            if i < len(refs) and refs[i] is not None:
                turns.append({"role": "assistant", "content": _text(refs[i], "a reference answer")})
    elif fmt == "prompt":
        key = next((k for k in PROMPT_KEYS if k in row), None)
        if key is None:
            raise BadRow("no 'question' or 'prompt' field")
        turns = [{"role": "user", "content": _text(row[key], key)}]
        ans = next((k for k in ANSWER_KEYS if row.get(k) is not None), None)
        if ans:
            turns.append({"role": "assistant", "content": _text(row[ans], ans)})
    else:
        raise SourceError(f"unknown --format {fmt!r}; choose from {', '.join(FORMATS)}")
    if fmt == "turns" and not any(t["role"] == "assistant" for t in turns):
        return turns  # separate prompts, answered one after another: never merged
    return _alternating(turns)


def check(messages: list[dict], need_answers: bool) -> list[dict]:
    """Reject conversations nothing can be learned from; trailing unanswered prompts are kept
    only when the target will answer them."""
    if not messages:
        raise BadRow("empty conversation")
    if not any(m["role"] == "user" for m in messages):
        raise BadRow("no user turn")
    for m in messages:
        if m["role"] == "user" and not plain_text(m["content"]).strip() and not images_of([m]):
            raise BadRow("empty user turn")
    if need_answers:
        while messages and (messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls")):
            messages = messages[:-1]  # an unanswered prompt, or a call whose result never came
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRow("no assistant turn")
        if any(m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls") for m in messages):
            raise BadRow("empty assistant turn")
    return messages


def _local_images(messages: list[dict], base: Path | None) -> list[dict]:
    """Image paths made absolute (relative ones are read from ``base``, the data file's folder);
    a missing file makes the row unusable."""
    for m in messages:
        if not isinstance(m.get("content"), list):
            continue
        for p in m["content"]:
            if p.get("type") != "image":
                continue
            path = Path(p["path"]).expanduser()
            if not path.is_absolute() and base is not None:
                path = base / path
            if not path.is_file():
                raise BadRow("image file not found")
            p["path"] = str(path.resolve())
    return messages


def detect_format(row) -> str | None:
    if not isinstance(row, dict):
        return None
    for key, fmt in (("conversations", "sharegpt"), ("messages", "messages"), ("instruction", "alpaca"),
                     ("turns", "turns")):
        if key in row:
            return fmt
    if any(k in row for k in PROMPT_KEYS):
        return "prompt"
    return None


# ---------------------------------------------------------------- loading


def load_conversations(
    data: str,
    fmt: str | None = None,
    split: str | None = None,
    subset: str | None = None,
    streaming: bool = False,
    max_samples: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    need_answers: bool = False,
    strict: bool = False,
) -> tuple[list[Conversation], LoadReport]:
    """Read, normalise and check every row; return the usable conversations and a report.

    Without ``shuffle`` reading stops once ``max_samples`` conversations are kept. With it,
    all rows are read and the sample is drawn with ``seed``, so the same command always
    selects the same conversations.
    """
    if fmt is not None and fmt not in FORMATS:
        raise SourceError(f"unknown --format {fmt!r}; choose from {', '.join(FORMATS)}")
    rows, _ = raw_rows(data, split=split, subset=subset, streaming=streaming)
    base = Path(data).expanduser().parent if Path(data).expanduser().is_file() else None
    report = LoadReport(format=fmt)
    convs: list[Conversation] = []
    stop_early = max_samples is not None and not shuffle
    for index, (where, row) in enumerate(rows):
        report.rows += 1
        try:
            if isinstance(row, Malformed):
                raise BadRow("malformed JSON")
            if isinstance(row, Truncated):
                raise BadRow("truncated JSON (end of file)")
            if report.format is None:
                report.format = detect_format(row)
                if report.format is None:
                    raise BadRow("unknown row shape (pass --format)")
            msgs = _local_images(check(normalise(row, report.format), need_answers), base)
            tools = row_tools(row)
        except BadRow as e:
            if strict:
                raise SourceError(f"{where}: {e} (--strict)") from None
            report.bad(where, str(e))
            continue
        convs.append(Conversation(index, msgs, tools))
        if stop_early and len(convs) >= max_samples:
            break
    if shuffle:
        random.Random(seed).shuffle(convs)
    if max_samples is not None:
        convs = convs[:max_samples]
    report.kept = len(convs)
    if not convs:
        raise SourceError(f"no usable conversations in {data}: {report.summary()}")
    return convs, report


def with_system(convs: Iterable[Conversation], system: str | None) -> list[Conversation]:
    """``--system``: replace (or add) the system prompt of every conversation."""
    out = []
    for c in convs:
        msgs = [m for m in c.messages if m["role"] != "system"]
        if system:
            msgs = [{"role": "system", "content": system}] + msgs
        out.append(Conversation(c.id, msgs if system is not None else c.messages, c.tools))
    return out
