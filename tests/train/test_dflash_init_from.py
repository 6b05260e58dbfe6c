"""train --draft-type dflash --init-from DRAFT: a DFlash draft in our layout, z-lab's or speculators' starts the
run with its own weights, block, depth, streams and MASK id; a draft of the other family, or one whose settings
differ from the flags given, is refused in one line before the target is loaded."""

import json
import shutil

import pytest
import torch

from eagle3cli.config.train_config import TrainError
from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from eagle3cli.model.layers import default_layer_ids, dflash_layer_ids
from eagle3cli.publish.formats.dflash import convert_dflash
from eagle3cli.publish.formats.readers import read_draft
from eagle3cli.publish.formats.writers import write_draft
from eagle3cli.train import trainer as trainer_module
from eagle3cli.train.trainer import Trainer, train
from tests.helpers.trainer import build_store, config, peaky_target  # noqa: F401

torch.set_num_threads(1)

LAYERS = (2, 4, 6)  # a subset of the store's DFlash streams, not the default set: taken from the draft
MASK = 150  # not the default MASK id of this target: taken from the draft


@pytest.fixture(scope="module")
def target_dir(smol_tiny_dir, tmp_path_factory):
    return peaky_target(tmp_path_factory.mktemp("target"), smol_tiny_dir)


@pytest.fixture(scope="module")
def store(tmp_path_factory, target_dir):
    return build_store(tmp_path_factory.mktemp("store"), target_dir, n=12, layers=dflash_layer_ids(8))


def dconfig(store, target_dir, out, **kw):
    base = dict(draft_type="dflash", block_size=4, draft_layers=1, num_anchors=8, lr=3e-3, epochs=1)
    return config(store, target_dir, out, **{**base, **kw})


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, store, target_dir):
    """One trained DFlash draft in three layouts: as our trainer exports it, as z-lab publishes its own
    (block_size at the top level only, no training record) and as speculators writes it."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("sources")
    res = train(dconfig(store, target_dir, root / "ours", layers=",".join(map(str, LAYERS)), mask_token_id=MASK,
                        max_steps=2, val_fraction=0.0), quiet=True)
    assert res.step == 2
    zlab = root / "zlab"
    shutil.copytree(root / "ours", zlab, ignore=shutil.ignore_patterns("checkpoints", "*.json*"))
    raw = json.loads((root / "ours" / "config.json").read_text())
    del raw["dflash_config"]["block_size"], raw["eagle3_training"]
    (zlab / "config.json").write_text(json.dumps(raw))
    convert_dflash(root / "ours", root / "speculators", "speculators", target_config=AutoConfig.from_pretrained(
        target_dir))
    return {"ours": root / "ours", "zlab": zlab, "speculators": root / "speculators"}


def setup(cfg):
    t = Trainer(cfg, quiet=True)
    t.setup()
    return t


def no_target(monkeypatch):
    """Make loading the target fail: a refusal must come before it."""
    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the refusal")
    monkeypatch.setattr(trainer_module, "load_target_parts", refuse)


def test_each_layout_starts_from_the_same_weights_and_loss(layouts, store, target_dir, tmp_path):
    src, _ = read_draft(layouts["ours"], dtype=torch.float32)
    want = src.trainable_state_dict()
    got, losses = {}, {}
    for name, path in layouts.items():
        t = setup(dconfig(store, target_dir, tmp_path / name, init_from=str(path)))
        d = t.draft
        assert t.layer_ids == LAYERS and t.columns == [0, 2, 4]  # the draft's streams, picked from the store's
        assert (d.config.block_size, d.config.mask_token_id, d.config.num_hidden_layers) == (4, MASK, 1)
        assert t.cfg.layers == "2,4,6" and t.cfg.mask_token_id == MASK
        sd = {k: v.cpu() for k, v in d.trainable_state_dict().items()}
        assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want), name
        assert all(v.dtype == torch.float32 for v in sd.values())
        got[name], losses[name] = sd, t.evaluate(d)
        if name == "ours":  # the source read by itself, on the run's embedding and head, scores the same
            src.set_embedding(d.embed_tokens.weight)
            src.set_head(d.lm_head.weight)
            assert t.evaluate(src.to(d.fc.weight.device)) == losses[name]
    assert losses["ours"] == losses["zlab"] == losses["speculators"]
    fresh = setup(dconfig(store, target_dir, tmp_path / "fresh", layers="2,4,6", mask_token_id=MASK))
    assert fresh.evaluate(fresh.draft)["loss"] != losses["ours"]["loss"]  # the comparison can fail
    res = train(dconfig(store, target_dir, tmp_path / "more", init_from=str(layouts["zlab"]), max_steps=2),
                quiet=True)
    assert res.step == 2 and not torch.equal(res.draft.fc.weight.cpu(), want["fc.weight"])


def test_a_dflash_draft_into_an_eagle3_run_is_refused(layouts, store, target_dir, tmp_path, monkeypatch):
    no_target(monkeypatch)
    p = layouts["speculators"]
    with pytest.raises(TrainError) as e:
        setup(config(store, target_dir, tmp_path / "run", init_from=str(p)))
    assert str(e.value) == (f"--init-from: {p} is a DFlash draft and this run trains an EAGLE-3 one: "
                            "pass --draft-type dflash to continue it")


def test_an_eagle3_draft_into_a_dflash_run_is_refused(store, target_dir, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    tc = AutoConfig.from_pretrained(target_dir)
    d = Eagle3Draft(DraftConfig.from_target(tc, 256, default_layer_ids(tc.num_hidden_layers)),
                    embed_weight=AutoModelForCausalLM.from_pretrained(target_dir).get_input_embeddings().weight)
    d.init_weights(seed=3)
    d.set_vocab(torch.arange(256))
    write_draft(d, tmp_path / "eagle", to="ours", dtype=torch.float32)
    no_target(monkeypatch)
    with pytest.raises(TrainError) as e:
        setup(dconfig(store, target_dir, tmp_path / "run", init_from=str(tmp_path / "eagle")))
    assert str(e.value) == (f"--init-from: {tmp_path / 'eagle'} is an EAGLE-3 draft and this run trains a DFlash "
                            "one: pass --draft-type eagle3 to continue it")


def test_a_block_size_mismatch_is_refused_with_the_flag_to_pass(layouts, store, target_dir, tmp_path, monkeypatch):
    no_target(monkeypatch)
    p = layouts["zlab"]
    with pytest.raises(TrainError) as e:
        setup(dconfig(store, target_dir, tmp_path / "run", init_from=str(p), block_size=8))
    assert str(e.value) == (f"--init-from: {p} was trained with blocks of 4 (this run: 8): pass --block-size 4 "
                            "to continue it")


def test_every_setting_given_otherwise_is_named_in_one_line(layouts, store, target_dir, tmp_path, monkeypatch):
    no_target(monkeypatch)
    p = layouts["ours"]
    with pytest.raises(TrainError) as e:
        setup(dconfig(store, target_dir, tmp_path / "run", init_from=str(p), layers="2,3,4", draft_layers=2,
                      mask_token_id=151))
    assert str(e.value) == (f"--init-from: {p} was trained with layers [2, 4, 6] (this run: [2, 3, 4]), 1 draft "
                            "layer(s) (this run: 2), MASK id 150 (this run: 151): pass --layers 2,4,6 "
                            "--draft-layers 1 --mask-token-id 150 to continue it")


def test_a_store_without_the_drafts_streams_is_refused(layouts, target_dir, tmp_path, monkeypatch):
    eagle_only = build_store(tmp_path / "s", target_dir, n=6)  # EAGLE-3's streams (2, 4, 5)
    no_target(monkeypatch)
    p = layouts["speculators"]
    with pytest.raises(TrainError) as e:
        setup(dconfig(eagle_only, target_dir, tmp_path / "run", init_from=str(p)))
    assert str(e.value) == (f"--init-from: {p} reads layers [2, 4, 6], the store {eagle_only} holds [2, 4, 5] "
                            "(missing [6]): run `eagle3 gen-data --draft-type dflash --layers 2,4,6`, or train "
                            "with --online")
