"""`eagle3 eval` with a DFlash draft: lossless, tau with the bonus token, the draft type recorded,
and ``--tree auto`` choosing how many of the block's tokens to verify (chain or top-k tree) from the
latency table and a calibration run."""

from __future__ import annotations

import json

import pytest

from eagle3cli.decode.generator import SpecOutput
from eagle3cli.evaluate.eval_config import EvalConfig
from eagle3cli.evaluate.evaluate import evaluate
from eagle3cli.evaluate.tree_auto import choose_chain, choose_tree, heldout_chain_tau
from eagle3cli.train.ttt import acceptance_length
from tests.helpers.dflash import BlockOracle, dflash_draft


@pytest.fixture(scope="module")
def turns_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "mini.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it rhyme."]},
            {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


@pytest.fixture(scope="module")
def smol(smol_tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(smol_tiny_dir).eval().requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(smol_tiny_dir)


def quiet(_msg):
    pass


def test_eval_random_dflash_chain_is_lossless_through_the_hf_path(smol, turns_file):
    target, tok = smol
    cfg = EvalConfig(tasks=["mini"], data=str(turns_file), max_new_tokens=10, mode="chain", steps=3, fast="off",
                     llama_baseline=False, warmup_tokens=4)
    res = evaluate(target, tok, dflash_draft(target, block=4), cfg, log=quiet)
    t = res["tasks"]["mini"]
    assert res["draft_type"] == "dflash" and t["path"] == "hf"
    assert t["num_prompts"] == 2 and t["lossless"] is True and t["mismatches"] == []
    assert t["tau"] >= 1.0 and len(t["n_alpha"]) == 3
    assert res["settings"]["mode"] == "chain" and res["settings"]["steps"] == 3


def test_eval_tree_auto_chooses_the_blocks_verified_tokens(smol, turns_file):
    """A block oracle (accepted) on the fast path: --tree auto measures chain and tree, picks one,
    and the run decodes with it losslessly; the held-out tau of the chosen chain length is beside."""
    target, tok = smol
    logs = []
    heldout = (0.9, 0.8, 0.7, 0.6, 0.5)
    cfg = EvalConfig(tasks=["mini"], data=str(turns_file), max_new_tokens=12, mode="tree", total_tokens=60, depth=8,
                     top_k=2, tree_auto=True, llama_baseline=False, warmup_tokens=4, heldout_acc=heldout)
    oracle = BlockOracle(dflash_draft(target, block=6), target, wrong_every=4)
    res = evaluate(target, tok, oracle, cfg, log=logs.append)
    t, s, auto = res["tasks"]["mini"], res["settings"], res["settings"]["tree_auto"]
    assert res["draft_type"] == "dflash" and t["path"] == "fast"
    assert t["lossless"] is True and t["tau"] > 1.5
    assert auto["draft"] == "block" and auto["block_size"] == 6 and auto["latency_path"] == "fast"
    assert s["mode"] == auto["mode"]
    if auto["mode"] == "chain":
        assert s["steps"] == auto["steps"] == auto["chain"]["steps"] and 1 <= s["steps"] <= 5
        assert len(t["n_alpha"]) == s["steps"]
    else:
        assert (s["total_tokens"], s["depth"]) == (auto["total_tokens"], auto["depth"]) and auto["depth"] <= 5
    assert set(auto["chain"]["chain_tau"]) == {"1", "2", "3", "4", "5"}
    assert auto["heldout_tau"] == pytest.approx(acceptance_length(list(heldout[:auto["chain"]["steps"]])))
    assert any(m.startswith("tree auto (block of 6): ") and "held-out acceptance" in m for m in logs)


def _calibration(accepted: list[int], draft_s: float = 0.0) -> SpecOutput:
    o = SpecOutput(tokens=[], prompt_len=1, accept_lengths=[a + 1 for a in accepted], drafted=[5] * len(accepted),
                   forwards=len(accepted))
    o.times = {"prefill": 0.0, "draft": draft_s, "verify": 0.0, "bookkeeping": 0.0}
    return o


def test_choose_chain_weighs_acceptance_against_the_rows_verified():
    o = _calibration([5, 5, 1, 0])  # chains of 5: two whole blocks accepted, one token, none
    flat = {1: 1.0, 64: 1.0}
    best = choose_chain([o], flat, 5)
    assert best["steps"] == 5 and best["tau"] == pytest.approx(1 + 11 / 4)
    assert best["chain_tau"] == {"1": 1.75, "2": 2.25, "3": 2.75, "4": 3.25, "5": 3.75}
    steep = {1: 1.0, 2: 1.2, 3: 3.0, 64: 100.0}  # a third row costs as much as two cycles
    best = choose_chain([o], steep, 5)
    assert best["steps"] == 1 and best["tokens_per_s"] == pytest.approx(1.75 / 1.2)


def test_block_tree_costs_one_draft_forward_whatever_its_depth():
    """With the draft a fixed cost a cycle (a block), a deep tree is not charged a step per level."""
    depths = [1, 1, 2, 1, 2, 3, 2, 3, 4, 4]
    o = SpecOutput(tokens=[], prompt_len=1, accept_lengths=[4] * 4, drafted=[4] * 4, forwards=4)
    o.accepted_ranks, o.rank_depths = [[1, 3, 6]] * 4, [depths] * 4
    o.times = {"prefill": 0.0, "draft": 40.0, "verify": 0.0, "bookkeeping": 0.0}  # 10 s a cycle
    flat = {1: 1.0, 64: 1.0}
    per_level = choose_tree([o], flat, max_total=10, max_depth=4)
    per_cycle = choose_tree([o], flat, max_total=10, max_depth=4, draft_per_cycle=True)
    assert (per_level["depth"], per_level["tau"]) == (1, 2)  # 2.5 s a level: shallow wins
    assert (per_cycle["total_tokens"], per_cycle["depth"], per_cycle["tau"]) == (6, 3, 4)
    assert per_cycle["tokens_per_s"] == pytest.approx(4 / 11)


def test_heldout_chain_tau():
    assert heldout_chain_tau((0.5, 0.5, 0.5), 2) == pytest.approx(1.75)
    assert heldout_chain_tau(None, 2) is None and heldout_chain_tau((0.5,), 2) is None


def test_eval_reads_the_draft_type_from_config_json(tmp_path):
    from eagle3cli.commands.evaluate import draft_type

    cases = {"zlab": {"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 5}},
             "speculators": {"speculators_model_type": "dflash"}, "ours": {"draft_type": "dflash"},
             "eagle": {"architectures": ["LlamaForCausalLMEagle3"]}, "broken": "[1, 2"}
    for name, raw in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(raw if isinstance(raw, str) else json.dumps(raw))
    assert {n: draft_type(tmp_path / n) for n in cases} == {"zlab": "dflash", "speculators": "dflash",
                                                           "ours": "dflash", "eagle": "eagle3", "broken": "eagle3"}
    assert draft_type(tmp_path / "absent") == "eagle3"
