"""Acceptance measured during training (--eval-every, --keep best) and --optimizer muon."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from eagle3cli.config.train_config import TrainError
from eagle3cli.data.features import FeatureStore, shard_name
from eagle3cli.data.store_build import write_shard
from eagle3cli.decode.generator import speculative_generate
from eagle3cli.model.target import capture
from eagle3cli.train import train_eval
from eagle3cli.train.batching import split_indices
from eagle3cli.train.checkpoints import checkpoint_dirs
from eagle3cli.train.optim import MuonAdamW
from eagle3cli.train.trainer import train
from tests.helpers.trainer import build_store, config, store, target_dir, weights  # noqa: F401  (module fixtures)


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory, target_dir):
    """A store whose answers are the target's own greedy continuations (as gen-data --regenerate
    makes them): a draft trained on it gets drafts accepted, so a measured tau above 1 is reachable."""
    from transformers import AutoModelForCausalLM

    root = build_store(tmp_path_factory.mktemp("regen"), target_dir, n=32)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    store = FeatureStore(root)
    samples = []
    for i in range(len(store)):
        prompt = store[i]["input_ids"][:8][None]
        ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                             eos_token_id=None)[0]
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[8:] = True
        aux, final = capture(model, ids[None], store.meta.layer_ids)
        samples.append({"input_ids": ids, "loss_mask": mask, "sample_id": i, "aux": aux[0], "final": final[0]})
    for f in (root / "shards").iterdir():
        f.unlink()
    for k in range(0, len(samples), 10):
        write_shard(root / "shards" / shard_name(0, k // 10), samples[k:k + 10])
    return root


def held_out_prompts(store_dir, n: int) -> list[torch.Tensor]:
    """The first n held-out conversations of the regenerated store cut before their answers (its
    first 8 tokens), found here without train_eval."""
    store = FeatureStore(store_dir)
    _, val = split_indices(len(store), 0.2, 0)
    return [store[i]["input_ids"][:8][None] for i in val[:n]]


def test_measured_tau_is_what_speculative_generate_gives_for_the_draft_and_prompts(regenerated, target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    store = regenerated
    res = train(config(store, target_dir, tmp_path / "m", epochs=6, eval_every=8, eval_samples=3, eval_new_tokens=24),
                quiet=True)
    recs = [h for h in res.history if "measured" in h]
    assert [h["step"] for h in recs] == [s for s in range(8, res.step, 8)] + [res.step]
    assert all(h["measured"]["prompts"] == 3 and h["measured"]["tau_sim"] > 0 for h in recs)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    outs = [speculative_generate(target, res.draft, ids, mode="chain", steps=3, temperature=0.0, max_new_tokens=24)
            for ids in held_out_prompts(store, 3)]
    tokens, forwards = sum(o.decode_tokens for o in outs), sum(o.forwards for o in outs)
    last = recs[-1]["measured"]
    assert (last["tokens"], last["forwards"]) == (tokens, forwards)
    assert last["tau"] == tokens / forwards > 1.0  # the trained draft gets drafts accepted
    assert res.metrics["tau_measured"] == round(tokens / forwards, 3) and res.metrics["exported_step"] == res.step


def test_keep_best_exports_the_best_measured_steps_weights(store, target_dir, tmp_path, monkeypatch):
    """Scores forced so that a middle checkpoint (step 4) beats the later ones: the exported
    weights are that checkpoint's, not the final ones."""
    scores = iter([1.2, 1.9, 1.4, 1.1])

    def scored(target, draft, prompts, new_tokens, eos_token_id=None):
        return train_eval.Measured(next(scores), len(prompts), 10, 5)

    monkeypatch.setattr(train_eval, "measured_tau", scored)
    out = tmp_path / "best"
    res = train(config(store, target_dir, out, epochs=2, eval_every=2, keep="best", save_every=2,
                       keep_checkpoints=10, val_fraction=0.2), quiet=True)
    assert res.step == 8 and [h["step"] for h in res.history if "measured" in h] == [2, 4, 6, 8]
    assert res.metrics["exported_step"] == 4 and res.metrics["tau_measured"] == 1.9
    step4 = load_file(str(out / "checkpoints" / "step-00000004" / "model.safetensors"))
    final = load_file(str(out / "checkpoints" / "step-00000008" / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert not torch.equal(step4["fc.weight"], final["fc.weight"])
    for name, w in step4.items():
        assert torch.equal(exported[name], w.to(exported[name].dtype)), name
    assert torch.equal(res.draft.fc.weight.detach().cpu(), step4["fc.weight"])


def test_keep_best_breaks_a_tie_of_measured_taus_by_the_simulated_one(store, target_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train_eval, "measured_tau", lambda *a, **k: train_eval.Measured(1.5, 4, 6, 4))
    # Loss on the answers: on this tiny random target that run's simulated taus move between
    # evaluations, which the tie-break needs (with --loss-on all they all stay at 1.0).
    res = train(config(store, target_dir, tmp_path / "tie", epochs=2, eval_every=2, keep="best", loss_on="answers"),
                quiet=True)
    recs = [h for h in res.history if "measured" in h]
    sims = [h["measured"]["tau_sim"] for h in recs]
    assert len(set(sims)) > 1  # the simulated taus differ, so the tie-break decides
    assert res.metrics["exported_step"] == recs[sims.index(max(sims))]["step"]


def test_eval_every_refuses_a_run_without_prompts_and_keep_best_without_eval_every(store, target_dir, tmp_path):
    with pytest.raises(TrainError, match="--val-fraction above 0 or pass --prompts"):
        train(config(store, target_dir, tmp_path / "a", eval_every=2, val_fraction=0.0), quiet=True)
    with pytest.raises(TrainError, match="--keep best needs --eval-every"):
        train(config(store, target_dir, tmp_path / "b", keep="best"), quiet=True)
    with pytest.raises(TrainError, match="--optimizer must be one of adamw, muon"):
        train(config(store, target_dir, tmp_path / "c", optimizer="lion"), quiet=True)


def test_eval_prompts_file_is_encoded_under_the_chat_template(target_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "turns": ["What is 2+2?", "And 3+3?"]}\n\n{"turns": ["Name a colour."]}\n'
                    '{"turns": ["unused"]}\n')
    got = train_eval.file_prompts(str(path), tok, 2)
    want = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"]
            for t in ("What is 2+2?", "Name a colour.")]
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    path.write_text('{"prompt": "no turns"}\n')
    with pytest.raises(TrainError, match=r"q.jsonl:1: expected a record with a non-empty 'turns'"):
        train_eval.file_prompts(str(path), tok, 2)


# ---- Muon -----------------------------------------------------------------------------------

def test_muon_takes_the_hidden_matrices_and_adamw_the_head_and_norms(store, target_dir, tmp_path):
    res = train(config(store, target_dir, tmp_path / "mu", optimizer="muon", max_steps=1, val_fraction=0.0),
                quiet=True)
    assert res.step == 1
    from eagle3cli.train.optim import make_optimizer

    named = [(n, p) for n, p in res.draft.named_parameters() if p.requires_grad]
    opt = make_optimizer("muon", named, 1e-3, 0.0)
    assert isinstance(opt, MuonAdamW)
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    on_muon = sorted(n for n, p in named if id(p) in muon)
    assert on_muon == sorted(n for n, p in named if p.ndim == 2 and n != "lm_head.weight")
    assert "fc.weight" in on_muon and not any("norm" in n for n in on_muon)


def test_one_muon_step_changes_every_hidden_matrix_and_losses_fall(store, target_dir, tmp_path):
    cfg = config(store, target_dir, tmp_path / "m0", optimizer="muon", max_steps=1, val_fraction=0.0, epochs=4)
    from eagle3cli.train.trainer import Trainer

    t = Trainer(cfg, quiet=True)
    t.setup()
    before = weights(t.draft)
    t.run()
    after = weights(t.draft)
    for name, w in before.items():
        if w.ndim == 2 and w.is_floating_point() and name != "embed_tokens.weight":
            assert not torch.equal(w, after[name]), name
    res = train(replace(cfg, out=str(tmp_path / "m1"), max_steps=0), quiet=True)
    losses = [h["loss"] for h in res.history if "acc" in h]
    assert len(losses) >= 8 and sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses


def test_muon_resume_is_bit_identical(store, target_dir, tmp_path):
    base = dict(save_every=3, val_fraction=0.0, optimizer="muon")
    full = train(config(store, target_dir, tmp_path / "full", **base), quiet=True)
    cut = config(store, target_dir, tmp_path / "cut", **base)
    train(cut, quiet=True, stop_after=5)
    assert [p.name for p in checkpoint_dirs(tmp_path / "cut")] == ["step-00000003"]
    resumed = train(replace(cut, resume=True), quiet=True)
    assert resumed.step == full.step > 5
    a, b = weights(full.draft), weights(resumed.draft)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
