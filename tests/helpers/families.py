"""Tiny random targets of every family eagle3 is used with, built from transformers' own config
classes (no network): hidden 64, 4 layers, each family's own layer shape (mixtures of experts,
fused projections, post-norms, sliding windows, latent attention, logit scaling)."""

from __future__ import annotations

from pathlib import Path

import torch

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, vocab_size=256,
               tie_word_embeddings=False)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # defaults of some configs lie outside a tiny vocab

# model_type -> what its config needs beyond _COMMON to be a small, valid, representative target.
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "ministral": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "ministral3": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,  # its own scaled queries
                                       "original_max_position_embeddings": 32, "llama_4_scaling_beta": 0.1}},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen2": {},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 128},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    "gemma2": {"sliding_window": 16, "query_pre_attn_scalar": 16, "final_logit_softcapping": 0.5},
    "gemma3_text": {"sliding_window": 16, "query_pre_attn_scalar": 16, "final_logit_softcapping": 0.5},
    "phi3": {**_IDS},
    "olmo2": {**_IDS},
    "granite": {"logits_scaling": 8.0},
    "glm4": {**_IDS},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 32,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8, "n_group": 1,
                    "topk_group": 1, "num_key_value_heads": 4},  # latent attention: as many KV heads as heads
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128,
                    "interleave_moe_layer_step": 1, "attention_chunk_size": 512},
}


def available() -> list[str]:
    """The families whose config class the installed transformers has."""
    from transformers import CONFIG_MAPPING

    return [f for f in FAMILIES if f in CONFIG_MAPPING]


def family_config(family: str, **overrides):
    from transformers import AutoConfig

    kw = {**_COMMON, **FAMILIES[family], **overrides}
    return AutoConfig.for_model(family, **kw)


def family_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **overrides), dtype=torch.float32)
    return model.eval().requires_grad_(False)


def save_family(path: Path, family: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny target of ``family`` with a real tokenizer (the vocabulary sized to it) in a folder."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = family_model(family, seed=seed, vocab_size=len(tok), pad_token_id=tok.pad_token_id or 0,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id or 0
    tok.save_pretrained(path)
    model.save_pretrained(path)
    return Path(path)
