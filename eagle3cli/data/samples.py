"""gen-data's samples: a conversation -> token ids and assistant mask (one per learned turn with
``--reasoning keep``), the chat template's checks and options, and the capture forward that fills
each sample's features (micro-batched by token budget)."""

from __future__ import annotations

from collections import Counter

from ..config.options import GenDataOptions
from .chat_mask import MaskError, exact_answer_labels, tokenize_conversation
from .chat_mask import last_turn_only as last_turn_only_mask
from .gen_errors import GenDataError
from .sources import Conversation, images_of


def build_sample(tokenizer, conv: Conversation, max_length: int, template_kwargs: dict | None = None,
                 last_turn_only: bool = False, processor=None) -> tuple[dict, bool]:
    """(sample with input_ids/loss_mask lists, truncated?) or MaskError.

    ``template_kwargs`` go to the chat template (``enable_thinking``), with the row's ``tools``;
    ``last_turn_only`` learns only the last assistant turn; ``processor`` (a vision-language
    target's) expands the images of a conversation that has some, and the sample then carries
    its ``media`` tensors for the capture forward (data/media.py)."""
    from .regenerate import strip_meta

    kw = {**(template_kwargs or {}), **({"tools": conv.tools} if conv.tools else {})}
    tok = tokenize_conversation(tokenizer, strip_meta(conv.messages), **kw)
    ids, mask, unlearned = exact_answer_labels(tok, conv.messages)
    if last_turn_only:
        mask = last_turn_only_mask(mask)
    images = images_of(conv.messages)
    media = None
    if images:
        if processor is None:
            raise MaskError("conversation with images, and the target is not a vision-language model")
        from .chat_mask import render
        from .media import with_images

        ids, mask, media = with_images(processor, render(tokenizer, strip_meta(conv.messages), **kw), images,
                                       ids, mask)
    truncated = len(ids) > max_length
    if truncated:
        if media is not None:
            from .media import cut_media

            token = getattr(processor, "image_token_id", None)
            media = cut_media(media, max_length, token, ids, sum(t == token for t in ids))
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise MaskError("no assistant tokens within --max-length" if truncated else "no assistant tokens")
    sample = {"sample_id": conv.id, "input_ids": ids, "loss_mask": mask, "end_ids": tok.end_ids,
              "unlearned_answers": unlearned}
    if media is not None:
        sample["media"] = media
    return sample, truncated


def turn_prefixes(conv: Conversation) -> list[Conversation]:
    """``--reasoning keep``: one conversation per learned assistant turn, ending with it.

    Reasoning templates drop the thinking of earlier turns from the history they render, so in
    one rendering only the last turn's thinking is there to learn; each prefix is the context
    the target had when it wrote that turn, with the turn's thinking in it."""
    return [Conversation(conv.id, conv.messages[:k + 1], conv.tools) for k, m in enumerate(conv.messages)
            if m["role"] == "assistant" and m.get("learn") is not False]


def conversation_samples(tokenizer, conv: Conversation, max_length: int, reasoning: str | None = None,
                         **kw) -> list[tuple[dict, bool]]:
    """The samples of one conversation (build_sample's): one, or one per turn for ``--reasoning keep``."""
    if reasoning != "keep":
        return [build_sample(tokenizer, conv, max_length, **kw)]
    kw["last_turn_only"] = True
    prefixes = turn_prefixes(conv)
    if not prefixes:
        raise MaskError("no assistant tokens")
    return [build_sample(tokenizer, c, max_length, **kw) for c in prefixes]


def shard_samples(tokenizer, convs: list[Conversation], o: GenDataOptions, sample_kw: dict, skipped: Counter):
    """The samples of one shard's conversations and what they add up to: (samples, truncated,
    unlearned answers, end-of-turn ids seen); each conversation that gives none is counted in
    ``skipped`` under its reason."""
    samples, truncated, unlearned, ends = [], 0, 0, set()
    for c in convs:
        if o.regenerate and not any(m["role"] == "assistant" for m in c.messages):
            skipped["first prompt reaches --max-length"] += 1
            continue
        try:
            built = conversation_samples(tokenizer, c, o.max_length, **sample_kw)
        except MaskError as e:
            skipped[str(e)] += 1
            continue
        for s, cut in built:
            truncated += cut
            unlearned += s.pop("unlearned_answers")
            ends |= s.pop("end_ids")
            samples.append(s)
    return samples, truncated, unlearned, ends


def capture_dtype(requested: str, device: str, own: str, quantized: bool, regen: str | None) -> str:
    """What the target is loaded and captures features in, from ``--capture-dtype`` (a dtype name
    or auto); ``own``: the target's dtype, ``regen``: what local regeneration computes in (None: none).

    auto: bfloat16 for an fp32 target on a CPU that multiplies bf16 natively, where local
    regeneration (if any) computes in bf16 too: one set of weights serves both, and capture runs
    3.3x faster (SmolLM2 on 2 AMX Xeon cores: 2,889 against 882 tokens/s at 2,048 tokens a forward,
    ``benchmarks/capture_rate.py``). The features are then a bf16
    forward's, as the serving engines compute them. Else the target's own. ValueError for a dtype
    that cannot hold: a quantized target's weights, or regeneration in another dtype than the
    capture's (the answers would come from weights rounded to it).
    """
    from ..core.hardware import has_bf16_matmul

    if requested == "auto":
        fits = device.startswith("cpu") and own == "float32" and not quantized and has_bf16_matmul()
        return "bfloat16" if fits and regen in (None, "bfloat16") else own
    if requested != own and quantized:
        raise ValueError("--capture-dtype casts the target's weights; a --load-in-8bit/4bit target keeps its own: "
                         "leave --capture-dtype auto")
    if requested != own and regen not in (None, requested):
        raise ValueError(f"--capture-dtype {requested} loads the target in {requested}, and regeneration in {regen} "
                         f"would read its rounded weights: give --regen-dtype {requested} too, or leave "
                         "--capture-dtype auto")
    return requested


def capture_budget(model) -> int:
    """Padded tokens per capture forward. On a GPU big batches fill the device. On a CPU the
    matmuls are as fast at a few hundred rows, and a batch's attention scores and padding mask
    ([B, heads, T, T]) outgrow the caches: SmolLM2 captures 1.6x faster at 2,048 tokens a forward
    than at 16,384, in fp32 and in bf16, on 2 AMX Xeon cores (``benchmarks/capture_rate.py``)."""
    from ..model.target import model_device

    return 2048 if model_device(model).type == "cpu" else 16384


def capture_samples(model, samples: list[dict], layer_ids, token_budget: int, on_progress=None):
    """Fill ``aux``/``final`` of each sample: forwards over length-sorted micro-batches.
    ``on_progress(n)``: called with the number of samples captured so far after each micro-batch.

    Right padding: real tokens never attend to the pads that follow them (causal mask), so
    each sample's features are those of its own forward.
    """
    import torch

    from ..model.target import capture, model_device

    device = model_device(model)
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i]["input_ids"]), i))
    batches, cur = [], []
    for i in order:
        width = len(samples[i]["input_ids"])  # sorted: the newest sample is the widest
        if samples[i].get("media"):  # its images go with it alone
            batches.append([i])
            continue
        if cur and (len(cur) + 1) * width > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    done = 0
    for batch in batches:
        width = max(len(samples[i]["input_ids"]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            n = len(samples[i]["input_ids"])
            ids[r, :n] = torch.tensor(samples[i]["input_ids"])
            attn[r, :n] = 1
        if len(batch) == 1 and samples[batch[0]].get("media"):  # an image conversation: the whole model
            media = {k: v.to(device) for k, v in samples[batch[0]]["media"].items()}
            aux, final = capture(model, ids.to(device), layer_ids, None, media=media)
        else:
            aux, final = capture(model, ids.to(device), layer_ids, attn.to(device) if len(batch) > 1 else None)
        for r, i in enumerate(batch):
            n = len(samples[i]["input_ids"])
            samples[i]["aux"] = aux[r, :n].cpu()
            samples[i]["final"] = final[r, :n].cpu()
        if on_progress is not None:
            done += len(batch)
            on_progress(done)


def check_template_syntax(tokenizer, name: str):
    """A chat template with a Jinja syntax error would refuse every conversation: one line now."""
    from jinja2 import TemplateSyntaxError

    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        tokenizer.apply_chat_template(probe, tokenize=False)
    except TemplateSyntaxError as e:
        raise GenDataError(f"{name}: Jinja syntax error on line {e.lineno}: {e.message}") from None
    except Exception:  # noqa: BLE001 - a template may refuse this probe on purpose; rows report it
        pass


def reasoning_kwargs(reasoning: str | None, template: str) -> dict:
    """The chat template options of ``--reasoning``: thinking on (``enable_thinking=True``, for
    templates that take it; others think by default). A template with no thinking at all cannot
    give reasoning data: one line, before any work."""
    if reasoning is None:
        return {}
    if reasoning not in ("keep", "drop"):
        raise GenDataError(f"--reasoning must be keep or drop, got {reasoning!r}")
    if "think" not in template:
        raise GenDataError("--reasoning: the chat template has no thinking (no <think> block, no enable_thinking): "
                           "use the reasoning model's own template (--chat-template)")
    return {"enable_thinking": True} if "enable_thinking" in template else {}


def why_unusable(tokenizer, conv: Conversation, o: GenDataOptions, sample_kw: dict | None = None) -> str | None:
    """Why a conversation cannot give a sample (None when it can), as the pipeline counts it (shard_samples)."""
    from .chat_mask import render

    try:
        if o.regenerate:  # the answers are generated: the first prompt must leave room for one
            first = conv.messages[:2] if conv.messages[0]["role"] == "system" else conv.messages[:1]
            kw = {**(sample_kw or {}).get("template_kwargs", {}), **({"tools": conv.tools} if conv.tools else {})}
            text = render(tokenizer, first, add_generation_prompt=True, **kw)
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            return "first prompt reaches --max-length" if n >= o.max_length else None
        conversation_samples(tokenizer, conv, o.max_length, **(sample_kw or {}))
    except MaskError as e:
        return str(e)
    return None


def fix_for(reasons: Counter, o: GenDataOptions) -> str:
    top = reasons.most_common(1)[0][0] if reasons else ""
    if "--max-length" in (top or ""):
        return f"raise --max-length (now {o.max_length})"
    if "template" in (top or ""):
        return "fix the chat template (or pass a working --chat-template)"
    return "check the data with --dry-run --show-mask 3"
