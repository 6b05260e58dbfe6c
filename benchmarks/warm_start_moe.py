"""Which MLP a mixture-of-experts target should give a `--warm-start layer` draft: its shared
expert, or its routed experts averaged. Prints the draft's initial TTT loss (no training step)
on the target's own features, for tiny random MoE targets that have both (tests/helpers/families.py),
over several seeds, with the layer not warm-started and the layer's attention alone (the MLP
as initialised) as references.

    python benchmarks/warm_start_moe.py [--seeds 3] [--tokens 64] [--rows 8] [--init-range 0.2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3cli.model import warm_start  # noqa: E402
from eagle3cli.model.draft import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3cli.model.layers import default_layer_ids  # noqa: E402
from eagle3cli.model.target import capture  # noqa: E402
from eagle3cli.train.setup import TargetHead  # noqa: E402
from eagle3cli.train.ttt import TTTModel, teacher_from_final  # noqa: E402
from tests.helpers.families import family_model  # noqa: E402

FAMILIES = ("qwen2_moe", "deepseek_v3", "llama4_text")


@torch.no_grad()
def initial_loss(target, ids, layer: str | None) -> float:
    """The 3-step TTT loss of a draft warm-started with head,fc (+ layer from ``layer``)."""
    n = target.config.num_hidden_layers
    layer_ids = default_layer_ids(n)
    aux, final = capture(target, ids, layer_ids)
    vocab = torch.arange(target.config.vocab_size)
    cfg = DraftConfig.from_target(target.config, vocab.numel(), layer_ids)
    draft = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight)
    draft.init_weights(seed=0)
    draft.set_vocab(vocab)
    parts = ("head", "fc") + (("layer",) if layer else ())
    fresh_mlp = {k: v.clone() for k, v in draft.midlayer.mlp.state_dict().items()}
    warm_start.apply(draft, parts, warm_start.target_parts(target, parts), vocab,
                     moe="shared" if layer in (None, "attention only") else layer)
    if layer == "attention only":  # the layer's attention and norms, the MLP as initialised
        draft.midlayer.mlp.load_state_dict(fresh_mlp)
    mask = torch.ones_like(ids, dtype=torch.bool)
    teacher = teacher_from_final(TargetHead(target), final, vocab)
    out = TTTModel(draft, steps=3, recompute=False)(ids, aux, mask, teacher.probs, teacher.index, teacher.slot)
    return float(out.loss)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--init-range", type=float, default=0.2)
    a = ap.parse_args()
    torch.set_num_threads(2)
    print(f"{'family':<12} {'seed':>4} {'no layer':>9} {'attn only':>9} {'shared':>9} {'mean':>9}")
    for fam in FAMILIES:
        for seed in range(a.seeds):
            # initializer_range 0.2, not 0.02: a target that far from uniform has a teacher to match
            target = family_model(fam, seed=seed, initializer_range=a.init_range)
            ids = torch.randint(3, target.config.vocab_size, (a.rows, a.tokens),
                                generator=torch.Generator().manual_seed(100 + seed))
            row = [initial_loss(target, ids, m) for m in (None, "attention only", "shared", "mean")]
            print(f"{fam:<12} {seed:>4} " + " ".join(f"{x:9.4f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
