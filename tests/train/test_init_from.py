"""train --init-from DRAFT: the vocabulary kept (d2t, t2d, lm_head rows together) or remapped."""

import pytest
import torch

from eagle3cli.config.train_config import TrainError
from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from eagle3cli.model.layers import default_layer_ids
from eagle3cli.publish.formats.writers import write_draft
from eagle3cli.train.trainer import Trainer, train
from tests.helpers.trainer import build_store, config, peaky_target

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target_dir(smol_tiny_dir, tmp_path_factory):
    return peaky_target(tmp_path_factory.mktemp("target"), smol_tiny_dir)


@pytest.fixture(scope="module")
def store(tmp_path_factory, target_dir):
    return build_store(tmp_path_factory.mktemp("store"), target_dir, n=12)


def source_draft(target_dir, out, layers=None, to="speculators"):
    """A draft from elsewhere: 251 tokens (the even ids below 400, the odd ones 151..249, and 7:
    partly outside what the store uses), saved in the speculators format: any format is taken."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tc = AutoConfig.from_pretrained(target_dir)
    ids = sorted(set(range(0, 400, 2)) | set(range(151, 251, 2)) | {2, 7})
    cfg = DraftConfig.from_target(tc, len(ids), layers or default_layer_ids(tc.num_hidden_layers))
    emb = AutoModelForCausalLM.from_pretrained(target_dir).get_input_embeddings().weight
    d = Eagle3Draft(cfg, embed_weight=emb)
    d.init_weights(seed=7)
    d.set_vocab(torch.tensor(ids))
    write_draft(d, out, to=to, dtype=torch.float32)
    return d


def setup(cfg):
    tr = Trainer(cfg, quiet=True)
    tr.setup()
    return tr


def fwd(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 200, (1, 10), generator=g)
    aux = torch.randn(1, 10, 3 * d.config.target_hidden_size, generator=g)
    with torch.no_grad():
        return d.cpu().float()(ids, aux)[1]


def test_keep_carries_d2t_t2d_and_lm_head_together(store, target_dir, tmp_path):
    src = source_draft(target_dir, tmp_path / "src")
    tr = setup(config(store, target_dir, tmp_path / "run", init_from=str(tmp_path / "src")))
    d = tr.draft
    n = src.config.draft_vocab_size
    assert d.config.draft_vocab_size == n == 251
    assert torch.equal(d.d2t.cpu(), src.d2t) and torch.equal(d.t2d.cpu(), src.t2d)
    assert torch.equal(tr.vocab_ids.cpu(), src.draft_to_target(torch.arange(n)))  # the teacher's rows
    assert torch.equal(fwd(d), fwd(src))
    res = train(config(store, target_dir, tmp_path / "run2", init_from=str(tmp_path / "src"), max_steps=2,
                       epochs=1), quiet=True)
    assert res.step == 2


def test_new_vocab_remaps_lm_head_rows_and_keeps_shared_logits(store, target_dir, tmp_path):
    src = source_draft(target_dir, tmp_path / "src")
    fresh = setup(config(store, target_dir, tmp_path / "fresh")).draft
    tr = setup(config(store, target_dir, tmp_path / "run", init_from=str(tmp_path / "src"), init_vocab="new"))
    d = tr.draft
    new_ids = tr.vocab.ids
    assert d.config.draft_vocab_size == new_ids.numel() == 256
    assert torch.equal(d.draft_to_target(torch.arange(256, device=d.d2t.device)).cpu(), new_ids)
    src_ids = src.draft_to_target(torch.arange(src.config.draft_vocab_size)).tolist()
    row = {t: i for i, t in enumerate(src_ids)}
    shared = [i for i, t in enumerate(new_ids.tolist()) if t in row]
    new = [i for i, t in enumerate(new_ids.tolist()) if t not in row]
    assert shared and new  # the test covers both kinds
    a, b = fwd(d), fwd(src)
    # same logits on the shared tokens (every weight but the new rows comes from the source)
    assert torch.equal(a[..., shared], b[..., [row[new_ids[i].item()] for i in shared]])
    # tokens new to the vocabulary start as the trainer initialises a fresh draft
    assert torch.equal(d.lm_head.weight[new].cpu(), fresh.lm_head.weight[new].cpu())


def test_init_from_with_other_layers_is_refused(store, target_dir, tmp_path):
    source_draft(target_dir, tmp_path / "src", layers=(1, 3, 6), to="ours")
    with pytest.raises(TrainError, match="--init-from: .* reads layers \\[1, 3, 6\\]"):
        setup(config(store, target_dir, tmp_path / "run", init_from=str(tmp_path / "src")))
