"""Random and oracle drafters, prompts and exact marginals for the speculative generator tests."""

from __future__ import annotations

import torch

from eagle3cli.decode.generator import target_probs
from eagle3cli.decode.tree import build_greedy_tree
from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from eagle3cli.model.layers import default_layer_ids

NO_EOS = [-1]  # random tiny models may emit the config's EOS; tests want fixed lengths


def random_draft(target, seed=0, keep_every=2):
    cfg = DraftConfig.from_target(target.config, target.config.vocab_size // keep_every,
                                  default_layer_ids(target.config.num_hidden_layers))
    d = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight)
    d.init_weights(seed=seed)
    d.set_vocab(torch.arange(0, target.config.vocab_size, keep_every))
    return d.eval()


class Oracle:
    """A drafter that proposes from the target itself: q = softmax(sharpen * logits + noise)."""

    def __init__(self, target, sharpen=1.0, noise=0.0, seed=0):
        self.target, self.sharpen = target, sharpen
        g = torch.Generator().manual_seed(seed)
        self.noise = noise * torch.randn(target.config.vocab_size, generator=g)
        self.memo = {}  # contexts repeat a lot across seeds in the sampling tests

    def _logq(self, seqs):
        rows = []
        for s in seqs:
            key = tuple(s)
            if key not in self.memo:
                logits = self.target(input_ids=torch.tensor([s])).logits[0, -1]
                self.memo[key] = torch.log_softmax(self.sharpen * logits + self.noise, -1)
            rows.append(self.memo[key])
        return torch.stack(rows)

    def begin(self, input_ids):
        self.seq = input_ids[0, :1].tolist()

    def observe(self, next_tokens, hidden_states):
        self.seq += next_tokens.tolist()
        return self._logq([self.seq])[0]

    def expand(self, tree, nodes):
        seqs = []
        for i in nodes:
            path = []
            while i > 0:
                path.append(tree.tokens[i])
                i = tree.parents[i]
            seqs.append(self.seq + path[::-1])
        return self._logq(seqs)

    def rollback(self):
        pass


def prompt(seed, n=12, vocab=256):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def option_draft(target, options, seed=0):
    cfg = DraftConfig.from_target(target.config, target.config.vocab_size // 2,
                                  default_layer_ids(target.config.num_hidden_layers), **options)
    d = Eagle3Draft(cfg, embed_weight=target.get_input_embeddings().weight)
    d.init_weights(seed=seed)
    with torch.no_grad():  # norms away from 1, so a norm applied twice or skipped shows
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    d.set_vocab(torch.arange(0, target.config.vocab_size, 2))
    return d.eval()


def draft_trees(drafter, target, seeds=(0, 1, 2), total=16, depth=4, top_k=4):
    """Greedy trees drafted below three prompts, each after a second observe (a cache with history)."""
    trees = []
    for seed in seeds:
        ids = prompt(seed, n=11)
        out = target(input_ids=ids, output_hidden_states=True)
        root = int(out.logits[0, -1].argmax())
        drafter.begin(ids)
        logq = drafter.observe(torch.cat([ids[0, 1:7], torch.tensor([int(ids[0, 7])])]),
                               [h[:, :7] for h in out.hidden_states])
        build_greedy_tree(drafter, int(ids[0, 7]), logq, total, depth, top_k)  # drafted, then rolled back
        logq = drafter.observe(torch.cat([ids[0, 8:], torch.tensor([root])]), [h[:, 7:] for h in out.hidden_states])
        trees.append(build_greedy_tree(drafter, root, logq, total, depth, top_k))
    return trees


def exact_marginals(target, ids, temperature):
    """Exact distributions of generated tokens 2 and 3 (enumerating tokens 1 and 2)."""
    V = target.config.vocab_size

    def p(seq):
        return target_probs(target(input_ids=torch.tensor([seq])).logits[0, -1], temperature)

    base = ids[0].tolist()
    p1 = p(base)
    p2 = torch.zeros(V)
    p3 = torch.zeros(V)
    for a in range(V):
        pa = p(base + [a])
        p2 += p1[a] * pa
        for b in range(V):
            p3 += p1[a] * pa[b] * p(base + [a, b])
    return p2, p3


def fast_path_accepted(target, fast, seeds, new_tokens: int, label: str = "") -> int:
    """Speculative decoding on the fast path ``fast`` of ``target``, tree and chain, with a random
    draft and a near-exact oracle, from a prompt per seed: asserts every output (and plain greedy on
    the fast path) is HF greedy's token for token; returns the draft tokens accepted (so a caller can
    require that the kept cache was exercised)."""
    from eagle3cli.decode.generator import greedy_generate, speculative_generate

    draft, oracle = random_draft(target), Oracle(target, sharpen=1.0, noise=0.03)
    accepted = 0
    for seed in seeds:
        ids = prompt(seed)
        ref = greedy_generate(target, ids, new_tokens, eos_token_id=NO_EOS)
        assert greedy_generate(target, ids, new_tokens, eos_token_id=NO_EOS, fast=fast) == ref
        for d in (draft, oracle):
            for kw in (dict(mode="tree", total_tokens=12, depth=4, top_k=3), dict(mode="chain", steps=3)):
                out = speculative_generate(target, d, ids, max_new_tokens=new_tokens, eos_token_id=NO_EOS,
                                           fast=fast, **kw)
                assert out.path == "fast" and out.tokens == ref, f"{label} {kw['mode']} prompt seed {seed}"
                accepted += sum(a - 1 for a in out.accept_lengths)
    return accepted


FAST_SHAPES = (dict(mode="tree", total_tokens=15, depth=4, top_k=3), dict(mode="chain", steps=3))


def accepted_on_fast_path(target, fast, ids, max_new_tokens: int, what: str = "") -> int:
    """``fast_path_accepted`` held to the fast path's own plain decoding instead of HF's (a bf16 or
    low-precision path, whose rows round unlike HF's forward): greedy speculative decoding of ``ids``
    with an ``Oracle``, as a tree and as a chain (``FAST_SHAPES``), each asserted to be plain fast
    decoding token for token; the drafted tokens accepted over both (the caller asserts enough were,
    so the check had drafts to check)."""
    from eagle3cli.decode.generator import greedy_generate, speculative_generate

    oracle = Oracle(target, sharpen=1.0, noise=0.03)
    ref = greedy_generate(target, ids, max_new_tokens, eos_token_id=NO_EOS, fast=fast)
    accepted = 0
    for kw in FAST_SHAPES:
        out = speculative_generate(target, oracle, ids, max_new_tokens=max_new_tokens, eos_token_id=NO_EOS,
                                   fast=fast, **kw)
        assert out.path == "fast" and out.tokens == ref, f"{kw['mode']} {what}"
        accepted += sum(a - 1 for a in out.accept_lengths)
    return accepted


def sampled_marginals(target, drafter, mode: str, fast=None, n: int = 300, temperature: float = 0.8) -> int:
    """Speculative sampling at ``temperature`` from the prompt [1, 5, 3, 2] with ``n`` seeds (a tree
    of 6 tokens, depth 3, top-k 3, or a chain of 3; 3 new tokens each): asserts the 2nd and 3rd
    tokens follow the target's exact marginals (chi-square p > 1e-3; vocabulary 8); returns the
    draft tokens accepted at the first cycle, summed."""
    from scipy.stats import chisquare

    from eagle3cli.decode.generator import speculative_generate

    ids = torch.tensor([[1, 5, 3, 2]])
    p2, p3 = exact_marginals(target, ids, temperature)
    c2, c3 = torch.zeros(8), torch.zeros(8)
    accepted = 0
    for seed in range(n):
        out = speculative_generate(target, drafter, ids, mode=mode, total_tokens=6, depth=3, top_k=3, steps=3,
                                   temperature=temperature, max_new_tokens=3, eos_token_id=NO_EOS, seed=seed,
                                   fast=fast)
        c2[out.tokens[1]] += 1
        c3[out.tokens[2]] += 1
        accepted += out.accept_lengths[0] - 1
    assert chisquare(c2.numpy(), (p2 * n).numpy()).pvalue > 1e-3
    assert chisquare(c3.numpy(), (p3 * n).numpy()).pvalue > 1e-3
    return accepted
