"""Tiny feature stores built with store_build.write_shard + target.capture, a target whose teacher
has structure (module fixtures ``target_dir`` and ``store``: import them where they are used), and
the TrainConfig the trainer tests start from."""

import hashlib
from pathlib import Path

import pytest
import torch

from eagle3cli.config.train_config import TrainConfig
from eagle3cli.core.io_utils import write_json
from eagle3cli.data.features import shard_name
from eagle3cli.data.fingerprints import content_hash
from eagle3cli.data.store_build import write_shard
from eagle3cli.model.layers import default_layer_ids
from eagle3cli.model.target import capture
from tests.helpers.tiny import save_tiny

END_IDS = [2, 7]


def build_store(root: Path, model_dir: Path, n: int = 24, seed: int = 0, features: bool = True,
                dtype=torch.bfloat16, per_shard: int = 10, nan_samples=(), layers=None) -> Path:
    """A gen-data-format store: random conversations, the last two thirds loss-masked."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    layers = tuple(layers or default_layer_ids(cfg.num_hidden_layers))
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = int(torch.randint(10, 40, (1,), generator=g))
        ids = torch.randint(0, 200, (length,), generator=g)
        ids[-1] = END_IDS[i % 2]
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 3:] = True
        s = {"input_ids": ids, "loss_mask": mask, "sample_id": i}
        if features:
            aux, final = capture(model, ids[None], layers)
            s["aux"], s["final"] = aux[0], final[0]
            if i in nan_samples:
                s["final"] = torch.full_like(s["final"], float("nan"))
        samples.append(s)
    for k in range(0, n, per_shard):
        write_shard(root / "shards" / shard_name(0, k // per_shard), samples[k:k + per_shard], dtype=dtype)
    try:
        template = AutoTokenizer.from_pretrained(model_dir).chat_template
    except Exception:
        template = None
    masked = sum(int(s["loss_mask"].sum()) for s in samples)
    write_json(root / "manifest.json", {
        "format": "eagle3-features", "version": 1,
        "target": {"id": str(model_dir), "revision": None, "content_hash": content_hash(str(model_dir))},
        "model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "num_layers": cfg.num_hidden_layers, "layer_ids": list(layers),
        "features": "offline" if features else "none",
        "dtype": {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
        "chat_template_hash": hashlib.sha256(template.encode()).hexdigest() if template else None,
        "max_length": 64, "num_samples": n, "num_tokens": sum(s["input_ids"].numel() for s in samples),
        "num_masked_tokens": masked, "bytes": 0, "truncated": 0, "skipped": {},
        "end_token_ids": END_IDS, "source": {"dataset": "test/random"},
    })
    return root


def peaky_target(path: Path, tokenizer_dir: Path, seed: int = 0, **kw) -> Path:
    """A tiny Llama whose LM head only favours ids < 200 (the ids the data uses), sharply, so the
    teacher has structure and its argmax lies inside the draft vocab."""
    from transformers import AutoModelForCausalLM

    save_tiny(path, "llama", tokenizer_dir=tokenizer_dir, seed=seed, **{"hidden_size": 64, "intermediate_size": 128,
                                                                        **kw})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[200:] = 0
        model.lm_head.weight[:200] *= 30
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_dir(smol_tiny_dir, tmp_path_factory):
    return peaky_target(tmp_path_factory.mktemp("target"), smol_tiny_dir)


@pytest.fixture(scope="module")
def store(tmp_path_factory, target_dir):
    return build_store(tmp_path_factory.mktemp("store"), target_dir)


def config(store, target_dir, out, **kw) -> TrainConfig:
    base = dict(data=str(store), model=str(target_dir), out=str(out), draft_vocab_size="256", ttt_steps=3,
                lr=3e-3, max_tokens=160, epochs=2, val_fraction=0.2, save_every=1000, log_every=1, seed=0,
                warmup_ratio=0.0)
    base.update(kw)
    return TrainConfig(**base)


def weights(draft) -> dict:
    return {k: v.detach().clone() for k, v in draft.state_dict().items()}
