"""Small helpers over Hugging Face objects and devices, shared by every layer of the package.

Kept free of package imports (only torch, lazily) so any module can use them without cycles.
"""

from __future__ import annotations


def text_config(config):
    """The language-model config inside ``config`` (Gemma-3 and multimodal wrappers nest it)."""
    get = getattr(config, "get_text_config", None)
    inner = get(decoder=True) if callable(get) else config
    return inner if inner is not None else config


def eos_token_ids(*values) -> set[int]:
    """EOS ids as one set of ints, from any number of ``eos_token_id``-like values.

    Hugging Face configs, generation configs and tokenizers hold ``eos_token_id`` as None, one
    id, or a list of ids; each value here may be any of those (or a tuple/set), and the result
    is their union. ``eos_token_ids(None)`` is the empty set.
    """
    out: set[int] = set()
    for v in values:
        if v is None:
            continue
        if isinstance(v, (list, tuple, set, frozenset)):
            out.update(int(i) for i in v if i is not None)
        else:
            out.add(int(v))
    return out


def synchronize(device) -> None:
    """Wait for queued CUDA work on ``device`` (a no-op elsewhere), so wall-clock timings are real."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
