"""Small helpers over Hugging Face objects and devices, shared by every layer of the package.

Kept free of package imports (only torch and transformers, lazily) so any module can use them
without cycles.
"""

from __future__ import annotations

import functools


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


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for a forward call, under the name this model's forward takes.

    transformers renamed the KV-cache argument from ``past_key_values`` to ``cache`` during 5.x.
    Passing the wrong name is not an error: the forward swallows it into ``**kwargs`` and runs
    without the cache, so every cached step would attend to its own tokens only.
    """
    return {_cache_name(type(model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_name(cls) -> str:
    import inspect

    params = inspect.signature(cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    # a wrapper that passes **kwargs on (PEFT, accelerate hooks): the installed version decides
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
