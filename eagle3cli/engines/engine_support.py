"""Which serving engine serves which draft for which target (docs/design.md §5, "Engine support").

Two questions, each answered from the engines' own code (versions named):

- the target: does the engine accept EAGLE-3 for the target's model class at all? vLLM 0.32.0
  requires the class to implement ``SupportsEagle3`` and raises "Model does not support EAGLE3
  interface" otherwise (``v1/worker/gpu_model_runner.py``); SGLang 0.5.23 requires the class to
  define ``set_eagle3_layers_to_capture`` and raises "Model ... does not implement
  set_eagle3_layers_to_capture" otherwise (``model_executor/model_runner_components/
  attention_backend_setup.py``).
- the draft: does the engine implement each architecture option the draft uses (``draft.OPTION_KEYS``)?

Classes not listed are "not checked" (None), never guessed. This module imports neither torch
nor transformers.
"""

from __future__ import annotations

VLLM = "vLLM 0.32.0"
SGLANG = "SGLang 0.5.23"
LLAMACPP = "llama.cpp (llama-cpp-python 0.3.36)"

# Target architectures (config.json ``architectures``) -> accepted for EAGLE-3.
# vLLM 0.32.0: Llama, Mistral and Phi-3 subclass LlamaForCausalLM (SupportsEagle3); Qwen2 and
# Qwen3 implement it; Gemma3ForCausalLM does not, Gemma4ForCausalLM does.
TARGETS = {
    VLLM: {
        "LlamaForCausalLM": True, "MistralForCausalLM": True, "Phi3ForCausalLM": True,
        "Qwen2ForCausalLM": True, "Qwen3ForCausalLM": True, "Gemma4ForCausalLM": True,
        "Gemma3ForCausalLM": False,
    },
    # SGLang 0.5.23 models/*.py that define set_eagle3_layers_to_capture (Mistral and Phi-3
    # inherit it from LlamaForCausalLM); gemma.py, gemma2.py, phi.py and mixtral.py do not.
    SGLANG: {
        "LlamaForCausalLM": True, "MistralForCausalLM": True, "Phi3ForCausalLM": True,
        "Qwen2ForCausalLM": True, "Qwen2MoeForCausalLM": True, "Qwen3ForCausalLM": True,
        "Qwen3MoeForCausalLM": True, "Gemma3ForCausalLM": True, "Gemma4ForCausalLM": True,
        "GemmaForCausalLM": False, "Gemma2ForCausalLM": False, "PhiForCausalLM": False,
        "MixtralForCausalLM": False,
    },
}
REFUSAL = {
    VLLM: "its model class does not implement SupportsEagle3 (\"Model does not support EAGLE3 interface\", "
          "v1/worker/gpu_model_runner.py)",
    SGLANG: "its model class does not define set_eagle3_layers_to_capture (the target cannot capture the "
            "three streams)",
}

# Draft architecture options each engine implements (models/llama_eagle3.py of each; llama.cpp's
# src/models/eagle3.cpp reads norm_before_residual and norm_before_fc only).
OPTIONS = {
    VLLM: {"fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"},
    SGLANG: {"fc_norm", "norm_output", "norm_before_fc"},
    LLAMACPP: {"norm_before_fc", "norm_before_residual"},
}


# model_type -> causal-LM class, for a config that does not name its architectures (one built in code).
CLASS_OF_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "gemma4_text": "Gemma4ForCausalLM", "phi3": "Phi3ForCausalLM",
    "phi": "PhiForCausalLM",
}


def architecture(target_config) -> str | None:
    """The target's model class name: ``architectures[0]`` of its config (a dict or a config
    object), else the causal-LM class of its ``model_type``."""
    get = target_config.get if isinstance(target_config, dict) else lambda k: getattr(target_config, k, None)
    archs = get("architectures")
    return archs[0] if archs else CLASS_OF_TYPE.get(get("model_type") or "")


def target_support(target_config) -> dict[str, tuple[bool | None, str]]:
    """engine -> (accepted: True/False/None = not checked, one line saying why)."""
    arch = architecture(target_config)
    out = {}
    for engine, table in TARGETS.items():
        ok = table.get(arch) if arch else None
        if ok is None:
            out[engine] = (None, f"{arch or 'this target'} is not among the classes checked in {engine}'s code")
        elif ok:
            out[engine] = (True, f"{engine} accepts EAGLE-3 for {arch}")
        else:
            out[engine] = (False, f"{engine} refuses EAGLE-3 for {arch}: {REFUSAL[engine]}")
    return out


def unsupported_options(options) -> dict[str, list[str]]:
    """engine -> the options in ``options`` (names, or a {name: on} dict) it does not implement."""
    on = [k for k in options if (options[k] if isinstance(options, dict) else True)]
    return {engine: [k for k in on if k not in have] for engine, have in OPTIONS.items()}


def warnings(target_config, options=(), eval_refusal: str | None = None) -> list[str]:
    """One line per engine that would refuse this target, or this draft's options.

    ``eval_refusal``: why ``eagle3 eval`` would refuse this target (the words of the generator's
    support check, which lives above this module), None when eval runs it. An engine's refusal
    points to eval only when eval does run the draft."""
    tail = "; the draft still runs in `eagle3 eval`" if eval_refusal is None else ""
    lines = [why + tail for ok, why in target_support(target_config).values() if ok is False]
    if eval_refusal is not None:
        lines.append(f"`eagle3 eval` cannot measure this draft yet: {eval_refusal}")
    for engine, missing in unsupported_options(options).items():
        if missing:
            lines.append(f"{engine} does not implement {', '.join(missing)}: it would serve this draft wrongly "
                         "(or refuse it)")
    return lines
