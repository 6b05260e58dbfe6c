"""Tiny random causal LMs built from configs (no network), shared by all tests."""

from __future__ import annotations

from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers"


def _tokenizer_fixture(name: str) -> Path:
    """A real tokenizer shipped in tests/fixtures (the suite needs nothing outside the repo).

    A large ``tokenizer.json`` is shipped xz-compressed and unpacked once into the temp dir.
    A missing fixture is an error, never a skip: a clone that lacks it must fail loudly.
    """
    src = FIXTURES / name
    if (src / "tokenizer.json").is_file():
        return src
    packed = src / "tokenizer.json.xz"
    if not packed.is_file():
        raise FileNotFoundError(f"test fixture {src} is missing: restore tests/fixtures/tokenizers from git")
    import lzma
    import os
    import shutil
    import tempfile

    dst = Path(tempfile.gettempdir()) / f"eagle3-test-tokenizers-{os.getuid()}" / f"{name}-{packed.stat().st_size}"
    if not (dst / "tokenizer.json").is_file():
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != packed.name:
                shutil.copyfile(f, dst / f.name)
        tmp = dst / f".tokenizer.json.{os.getpid()}"
        tmp.write_bytes(lzma.decompress(packed.read_bytes()))
        os.replace(tmp, dst / "tokenizer.json")  # concurrent test runs never see half a file
    return dst


SMOLLM2_TOKENIZER = _tokenizer_fixture("smollm2-135m-instruct")
QWEN_TOKENIZER = _tokenizer_fixture("qwen2.5-coder-0.5b-instruct")

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3"]

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    vocab_size=256,
    tie_word_embeddings=False,
)


def tiny_config(arch: str = "llama", **overrides):
    from transformers import AutoConfig

    kw = dict(_COMMON)
    if arch == "gemma3_text":
        kw.update(head_dim=16, sliding_window=16, query_pre_attn_scalar=16)
    if arch == "qwen3":
        kw.update(head_dim=16)
    if arch == "phi3":
        kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "granite":  # Granite-3's multipliers, so a path that ignores one differs
        kw.update(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 16,
                  logits_scaling=0.25)  # < 1: sharper logits, so the tests' noisy oracles still get accepted
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model


def save_tiny(path: Path, arch: str = "llama", tokenizer_dir: Path | None = None, seed: int = 0, **overrides) -> Path:
    """Save a tiny model (and optionally a real tokenizer of the same vocab size) to a folder."""
    from transformers import AutoTokenizer

    if tokenizer_dir is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        overrides.setdefault("vocab_size", len(tok))
    model = tiny_model(arch, seed=seed, **overrides)
    if tokenizer_dir is not None:
        if tok.eos_token_id is not None:
            model.config.eos_token_id = tok.eos_token_id
            model.generation_config.eos_token_id = tok.eos_token_id
        tok.save_pretrained(path)
    model.save_pretrained(path)
    return Path(path)
