"""Loading the target model and capturing its feature streams.

Works for any Hugging Face causal LM: capture uses ``output_hidden_states`` on the model's
own forward, so no architecture needs a patched modeling file. A vision-language target
(Qwen2.5-VL, Gemma 3, Mistral 3, Llama 4 with a vision tower) loads through
``AutoModelForImageTextToText``: the draft learns its language model's streams, which a text
forward reaches through the decoder and an image conversation through the whole model (its
vision tower fills the image tokens' embeddings).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..config.options import TargetOptions, target_options
from ..core.errors import Eagle3Error, one_line
from ..core.hf_utils import text_config

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class TargetSpec(TargetOptions):
    """Everything needed to load a target: the shared target options (options.py) and what only
    library callers set."""

    gguf_file: str | None = None
    extra: dict = field(default_factory=dict)  # more from_pretrained keyword arguments

    @classmethod
    def of(cls, opts: TargetOptions, **changes) -> "TargetSpec":
        """The spec of a command's options (TrainConfig, GenDataOptions, EvalOptions ...)."""
        return cls(**{**target_options(opts), **changes})


class TargetError(Eagle3Error, ValueError):
    """The target cannot be found or read: one line that names the path or the Hub id."""


def looks_local(model: str) -> bool:
    """A path, not a Hub id (OWNER/NAME): starts with . / ~ or has more than one slash."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1


def check_local(spec: "TargetSpec"):
    """A local --model must be a model folder with a JSON-object config.json, checked before
    transformers mistakes a mistyped path for a Hub id and blames the network."""
    path = Path(spec.model).expanduser()
    if not path.exists():
        if looks_local(spec.model):
            raise TargetError(f"--model {spec.model}: no such folder (check the path; a Hub id is OWNER/NAME)")
        return
    if not path.is_dir():
        raise TargetError(f"--model {spec.model} is a file: give the model's folder (or its Hub id)")
    cfg = path / "config.json"
    if spec.gguf_file and not cfg.exists():
        return  # a GGUF folder: the config comes from the GGUF file
    if not cfg.is_file():
        raise TargetError(f"--model {spec.model} has no config.json: not a Hugging Face model folder")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TargetError(f"{cfg} is not valid JSON ({one_line(e)}): restore the model's config.json") from None
    if not isinstance(data, dict):
        raise TargetError(f"{cfg} holds a JSON {type(data).__name__}, not an object: restore the model's config.json")


def _safetensors_error() -> tuple[type[BaseException], ...]:
    try:
        from safetensors import SafetensorError
    except ImportError:
        return ()
    return (SafetensorError,)


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto``: bf16 on GPU, fp32 on CPU (CPU bf16 matmuls are slow and lossy here)."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise TargetError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def load_config(spec: TargetSpec):
    from transformers import AutoConfig

    check_local(spec)
    kw = {}
    if spec.gguf_file:
        kw["gguf_file"] = spec.gguf_file
    try:
        return AutoConfig.from_pretrained(
            spec.model, revision=spec.revision, trust_remote_code=spec.trust_remote_code, **kw
        )
    except (OSError, ValueError) as e:  # not found / unreachable / unrecognised: from_pretrained's words
        raise TargetError(f"cannot read the config of {spec.model}: {one_line(e)}") from None


def load_tokenizer(spec: TargetSpec, chat_template: str | None = None):
    from transformers import AutoTokenizer

    kw = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(
        spec.model, revision=spec.revision, trust_remote_code=spec.trust_remote_code, **kw
    )
    if chat_template:
        tok.chat_template = chat_template
    if tok.pad_token is None:
        # Batched generation needs a pad id; EOS is never attended to thanks to the mask.
        tok.pad_token = tok.eos_token
    return tok


def is_vision_language(config) -> bool:
    """A config with a vision tower that transformers maps to an image-text-to-text model.

    Such a model is loaded whole (``AutoModelForCausalLM`` refuses Qwen2.5-VL and Mistral 3, and
    would load only Llama 4's text part), so that image conversations can run through it.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(config, "vision_config", None) is not None
            and getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def auto_class(config):
    """The transformers Auto class that loads this target: image-text-to-text for a
    vision-language model, causal LM for everything else."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def load_processor(spec: TargetSpec):
    """The target's own processor (tokenizer + image processor): what puts a conversation's
    images into the token stream the way the model expects them (one or many image tokens each)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(spec.model, revision=spec.revision,
                                             trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise TargetError(f"conversations with images need the processor of {spec.model} "
                          f"({one_line(e)}): use a model folder with its preprocessor_config.json, and "
                          "install what the message names") from None


def load_target(spec: TargetSpec):
    """Load the target (frozen, eval mode), honouring quantisation and a PEFT adapter."""

    if spec.load_in_8bit and spec.load_in_4bit:
        raise TargetError("choose one of --load-in-8bit and --load-in-4bit")
    device = spec.device or default_device()
    dtype = resolve_dtype(spec.dtype, device)
    kw: dict = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code, "dtype": dtype}
    if spec.gguf_file:
        kw["gguf_file"] = spec.gguf_file
    if spec.load_in_8bit or spec.load_in_4bit:
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_8bit=spec.load_in_8bit,
            load_in_4bit=spec.load_in_4bit,
            bnb_4bit_compute_dtype=dtype,
        )
        kw["device_map"] = {"": device}
    kw.update(spec.extra)
    cls = auto_class(load_config(spec)) if not spec.gguf_file else None
    if cls is None:
        from transformers import AutoModelForCausalLM as cls
    try:
        model = cls.from_pretrained(spec.model, **kw)
    except _safetensors_error() as e:  # a truncated or garbled weight file
        raise TargetError(f"the weights of {spec.model} are unreadable ({one_line(e)}): download or copy "
                          "them again") from None
    if not (spec.load_in_8bit or spec.load_in_4bit):
        model.to(device)
    if spec.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, spec.adapter, is_trainable=False)
        # Merge so every later forward (capture, verification) is the plain adapted model.
        if not (spec.load_in_8bit or spec.load_in_4bit):
            model = model.merge_and_unload()
    model.eval()
    model.requires_grad_(False)
    return model


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def input_embeddings(model) -> torch.nn.Embedding:
    return model.get_input_embeddings()


def output_head(model) -> torch.nn.Module:
    return model.get_output_embeddings()


# model_type -> how the family reads ``logits_scaling``: Granite (and its MoE/hybrid kin) and
# MiniCPM3 divide the head's output by it, HyperCLOVA X multiplies (its modeling file says so).
MULTIPLIES_LOGITS_SCALING = ("hyperclovax",)


def logit_scale(model) -> float:
    """The factor the target multiplies its output head's result by before anything else.

    Granite's ``logits_scaling`` (logits / s) and Cohere's ``logit_scale`` (logits * s) are part of
    the target's distribution: a teacher or a warm-started head without them would be s times
    too sharp or too flat (Granite 3 ships s = 8, 16)."""
    cfg = text_config(model.config)
    scale = float(getattr(cfg, "logit_scale", None) or 1.0)
    s = getattr(cfg, "logits_scaling", None)
    if s:
        scale *= float(s) if getattr(cfg, "model_type", "") in MULTIPLIES_LOGITS_SCALING else 1.0 / float(s)
    return scale


def logit_softcap(model) -> float | None:
    """Gemma-2/3 cap final logits with tanh; the teacher must apply it too."""
    return getattr(text_config(model.config), "final_logit_softcapping", None)


def finish_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """The target's logits from its output head's raw result: the family's scaling, then its
    soft cap, in the order the modeling files apply them. The one home of this contract: the
    teacher (train.ttt.teacher_from_final) and lm_logits both end here."""
    scale = logit_scale(model)
    if scale != 1.0:
        logits = logits * scale
    cap = logit_softcap(model)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def base_model(model):
    """The decoder stack without the LM head (so capture never pays for [T x vocab] logits).

    ``get_decoder`` is the way in, but some wrappers return themselves (Llama 4's
    ``Llama4ForCausalLM``) or a language model that is itself a causal LM (a multimodal model's
    ``language_model``): the stack is the first module down ``model`` / ``language_model`` that
    holds the decoder ``layers``."""
    getter = getattr(model, "get_decoder", None)
    dec = getter() if callable(getter) else None
    dec = dec if dec is not None else model
    probe = dec
    for _ in range(3):
        if isinstance(getattr(probe, "layers", None), torch.nn.ModuleList):
            return probe
        inner = getattr(probe, "model", None)
        inner = inner if isinstance(inner, torch.nn.Module) else getattr(probe, "language_model", None)
        if not isinstance(inner, torch.nn.Module):
            break
        probe = inner
    return dec


@torch.no_grad()
def capture(
    model,
    input_ids: torch.Tensor,
    layer_ids: Sequence[int],
    attention_mask: torch.Tensor | None = None,
    media: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the decoder: returns (aux [B,T,3*Ht], final [B,T,Ht]).

    ``aux`` concatenates ``hidden_states[j]`` for the layer ids in ascending order (docs/design.md §2);
    ``final`` is ``hidden_states[N]``, the final-normed state the LM head reads, from which the
    teacher's logits are recomputed later. ``media``: the processor's image tensors
    (``pixel_values``, ``image_grid_thw`` ...) of a vision-language target; the forward then runs
    through the multimodal model, whose hidden states are its language model's.
    """
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False,
                  return_dict=True)
    from .sharded_target import forward_sharded, is_sharded

    if media:
        out = model.base_model(**kwargs, **media)
    # A target sharded with FSDP (train --online under FSDP2) is entered through its root.
    elif is_sharded(model):
        out = forward_sharded(model, **kwargs)
    else:
        out = base_model(model)(**kwargs)
    hs = out.hidden_states
    aux = torch.cat([hs[j] for j in layer_ids], dim=-1)
    return aux, hs[-1]


def lm_logits(model, final_hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final (normed) hidden state, scaling and soft cap included."""
    head = output_head(model)
    return finish_logits(model, head(final_hidden.to(head.weight.dtype)))
