"""A tiny random draft for the training-time-test (TTT) unroll."""

import torch

from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from tests.helpers.tiny import tiny_config


def make_draft(vocab=256, draft_vocab=64, seed=0):
    cfg = DraftConfig.from_target(tiny_config("llama", vocab_size=vocab), draft_vocab, (1, 4, 7))
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg, embed_weight=torch.randn(vocab, cfg.hidden_size))
    draft.init_weights(seed=seed, std=0.1)
    draft.set_vocab(torch.randperm(vocab)[:draft_vocab].sort().values)
    return draft
