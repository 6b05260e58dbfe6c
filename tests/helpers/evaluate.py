"""Drafts and engine cases for `eagle3 eval` tests (its own generator, vLLM, llama.cpp)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from eagle3cli.model.layers import default_layer_ids
from eagle3cli.publish.export import save_draft


def make_draft(target_dir, out_dir, hidden=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    over = {} if hidden is None else {"hidden_size": hidden, "target_hidden_size": hidden}
    dc = DraftConfig.from_target(cfg, 2048, default_layer_ids(cfg.num_hidden_layers), **over)
    d = Eagle3Draft(dc, embed_weight=None if hidden else target.get_input_embeddings().weight)
    d.init_weights(seed=0)
    d.set_vocab(torch.arange(2048))
    return save_draft(d, out_dir)


FAKE_LLAMA_SERVER = Path(__file__).resolve().parent / "fake_llama_server.py"


def engine_turns(tmp_path) -> Path:
    """The engine tests' two questions, one of two turns and one of one (3 answers), as ``--data``."""
    turns = tmp_path / "mini.jsonl"
    turns.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it rhyme."]},
        {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
    ]) + "\n")
    return turns


def engine_case(target_dir, tmp_path):
    """What the engine tests (eval --engine vllm, llama.cpp) run: the target, a draft for it and
    ``engine_turns``."""
    return target_dir, make_draft(target_dir, tmp_path / "draft"), engine_turns(tmp_path)


def fake_llama_bin(tmp_path, monkeypatch) -> Path:
    """A folder holding a fake ``llama-server`` (fake_llama_server.py) that logs its arguments to
    tmp_path/args.jsonl, with $EAGLE3_LLAMA_CPP unset so that the folder given is the one found."""
    d = tmp_path / "llama-bin"
    python_wrapper(d / "llama-server", FAKE_LLAMA_SERVER)
    monkeypatch.setenv("FAKE_LLAMA_ARGS", str(tmp_path / "args.jsonl"))
    monkeypatch.delenv("EAGLE3_LLAMA_CPP", raising=False)
    return d


def engine_eval_args(target, draft, turns, out, engine: str, *flags) -> list[str]:
    """``eagle3 eval`` on an engine_case: 16 tokens, chain 3, ``--engine ENGINE`` and its flags."""
    return ["eval", "--model", str(target), "--draft", str(draft), "--task", "mini", "--data", str(turns),
            "--out", str(out), "--max-new-tokens", "16", "--mode", "chain", "--steps", "3", "--engine", engine,
            *flags]


def python_wrapper(path, script) -> str:
    """An executable at ``path`` that runs ``script`` with this Python: a stand-in for an
    engine's binary or interpreter."""
    import stat
    import sys

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)
