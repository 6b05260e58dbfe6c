"""Images in a conversation, through the target's own processor.

A vision-language target reads an image as image tokens whose embeddings its vision tower
fills in; how many tokens, and which markers surround them, only the model's processor knows
(Qwen2.5-VL: one per 2x2 patch block; Gemma 3: 256 between its own markers). So the
conversation is rendered by the chat template (one placeholder per image), its loss mask built
on those tokens as for text, and then the processor expands the same text with the images. The
two token lists are aligned: tokens the processor added or replaced are image tokens, never
learned; a learned token it changed makes the conversation unusable. The processor's tensors
(``pixel_values``, ``image_grid_thw`` ...) go to the capture forward and are not stored.
"""

from __future__ import annotations

from difflib import SequenceMatcher

from .chat_mask import MaskError

PER_TOKEN = ("token_type_ids", "mm_token_type_ids")  # processor outputs with one entry per token


def expand_mask(ids: list[int], mask: list[bool], expanded: list[int]) -> list[bool]:
    """The mask of ``expanded`` (the processor's ids) from that of ``ids`` (the template's)."""
    out = [False] * len(expanded)
    for op, i1, i2, j1, j2 in SequenceMatcher(None, ids, expanded, autojunk=False).get_opcodes():
        if op == "equal":
            out[j1:j2] = mask[i1:i2]
        elif any(mask[i1:i2]):
            raise MaskError("the processor changed learned tokens (the image placeholder is not where the "
                            "template put it)")
    return out


def with_images(processor, text: str, images: list[str], ids: list[int], mask: list[bool]):
    """(ids, mask, media) of a rendered conversation with its images expanded by ``processor``."""
    from PIL import Image

    pics = []
    for path in images:
        with Image.open(path) as im:
            pics.append(im.convert("RGB"))
    try:
        out = processor(text=[text], images=pics, return_tensors="pt", add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 - processors raise many kinds; the row is skipped with the reason
        raise MaskError(f"the processor refused the images: {str(e).splitlines()[0][:120]}") from None
    expanded = out["input_ids"][0].tolist()
    media = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
    return expanded, expand_mask(ids, mask, expanded), media


def cut_media(media: dict, length: int, image_token_id, ids: list[int], total: int) -> dict:
    """``media`` for the first ``length`` tokens; an image cut by --max-length makes the row unusable
    (its tokens would no longer match its features)."""
    if image_token_id is not None and sum(t == image_token_id for t in ids[:length]) != total:
        raise MaskError("an image lies past --max-length")
    return {k: (v[:, :length] if k in PER_TOKEN else v) for k, v in media.items()}
