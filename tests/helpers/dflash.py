"""A random DFlash draft of a tiny target and a drafter whose blocks follow the target's greedy
continuation (the decode, eval, format and inspect tests share them)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from eagle3cli.decode.dflash_drafter import DFlashDrafter
from eagle3cli.decode.generator import greedy_generate
from eagle3cli.model.dflash import DFlashConfig, DFlashDraft, choose_mask_token
from tests.helpers.decoding import NO_EOS

# the target config of the format and inspect tests' drafts: 8 layers, a 101-token vocabulary
TARGET = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     num_hidden_layers=8, vocab_size=101, max_position_embeddings=256, eos_token_id=2, pad_token_id=2)


def tiny(block: int = 4, ids=(2, 4, 6), mask: int = 100) -> DFlashDraft:
    """A random two-layer DFlash draft of ``TARGET`` with its own random embedding and head."""
    cfg = DFlashConfig.from_target(TARGET, ids, block_size=block, mask_token_id=mask, num_hidden_layers=2)
    d = DFlashDraft(cfg, embed_weight=torch.randn(101, 32), head_weight=torch.randn(101, 32))
    d.init_weights(std=0.1, seed=0)
    return d


def dflash_draft(target, block: int = 4, layers: int = 1, seed: int = 0) -> DFlashDraft:
    """A random DFlash draft of ``target``: its embedding and head, three streams, MASK off the specials."""
    cfg = target.config.get_text_config()
    n = cfg.num_hidden_layers
    ids = sorted({1, n // 2, n - 1})
    specials = [getattr(cfg, k, None) for k in ("eos_token_id", "pad_token_id", "bos_token_id")]
    specials = [s for x in specials for s in (x if isinstance(x, list) else [x])]
    mask = choose_mask_token(cfg.vocab_size, special_ids=specials)
    dc = DFlashConfig.from_target(target.config, ids, block_size=block, mask_token_id=mask, num_hidden_layers=layers)
    d = DFlashDraft(dc, embed_weight=target.get_input_embeddings().weight,
                    head_weight=target.get_output_embeddings().weight)
    d.init_weights(std=0.1, seed=seed)
    return d.eval()


class BlockOracle(DFlashDrafter):
    """A DFlash drafter whose block rows are forced to the target's greedy continuation of the
    committed tokens, except at some rows where the right token is only second best (a chain then
    stops there, a top-k tree finds it on a side branch). The draft still runs every cycle, so its
    caches are exercised as in a real run."""

    def __init__(self, draft, target, wrong_every: int = 3):
        super().__init__(draft)
        self.target, self.wrong_every = target, wrong_every

    def begin(self, input_ids=None):
        super().begin(input_ids)
        self.seq = [] if input_ids is None else input_ids[0, :1].tolist()

    def observe(self, next_tokens, hidden_states):
        self.seq += next_tokens.tolist()
        return super().observe(next_tokens, hidden_states)

    def block_logq(self, aux_new, new_pos, anchor):
        drafted = super().block_logq(aux_new, new_pos, anchor)
        rows, vocab = drafted.shape
        assert int(anchor) == self.seq[-1] and new_pos[0, -1] + 1 == len(self.seq) - 1
        cont = greedy_generate(self.target, torch.tensor([self.seq]), rows, eos_token_id=NO_EOS)
        forced = torch.full((rows, vocab), -30.0)
        for i, t in enumerate(cont):
            if self.wrong_every and (len(self.seq) + i) % self.wrong_every == 0:
                forced[i, (t + 1) % vocab] = -0.1  # the argmax wrong, the right token second
                forced[i, t] = -2.5
            else:
                forced[i, t] = 0.0
        return torch.log_softmax(forced, -1)
