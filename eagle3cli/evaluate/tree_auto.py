"""``--tree auto``: the verification latency of each row count on this machine, and the tree
(total tokens, depth) that a big-tree calibration run says decodes the most tokens a second.

A DFlash draft (a block drafter: one forward a cycle, whatever the depth) gets its own choice
(``calibrate_block``): how many of the block's B - 1 tokens a chain verifies, or a top-k tree over
the block's positions where that decodes more tokens a second, from the same latency table.
"""

from __future__ import annotations

import torch

from ..decode.attention import without_cudnn_attention
from .eval_config import EvalError
from .fast_setup import check_exact, pack_drafter, pack_for_run
from .measure import timed


@without_cudnn_attention
def verify_latency(target, ids, sizes=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64), repeats=3) -> dict[int, float]:
    """Seconds of one target forward of n new tokens (after a prefix) on this hardware, as the
    generator's HF path verifies them (its cache and per-layer masks)."""
    from ..decode.verifiers import HFVerifier

    dev = ids.device
    verifier = HFVerifier(target)
    with torch.no_grad():
        verifier.prefill(ids)
        past = ids.shape[1]
        lat = {}
        for n in sizes:
            new = ids[:, -1:].repeat(1, n)
            pos = torch.arange(past, past + n, device=dev)[None]
            mask = torch.ones(n, past + n, dtype=torch.bool, device=dev).tril(past)[None, None]
            ts = []
            for _ in range(repeats):
                _, t = timed(lambda: verifier.verify(new, pos, mask, past), dev)
                verifier.keep(past, [])
                ts.append(t)
            lat[n] = sorted(ts)[len(ts) // 2]
    return lat


@without_cudnn_attention
def verify_latency_fast(target, ids, max_len: int, sizes=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
                        repeats=3, decoder=None) -> dict[int, float]:
    """``verify_latency`` on the fast path: each size timed with every packing ``tune_packing`` would
    try for it (MKL packed for that size, oneDNN, the native kernel up to its row limit), the fastest
    kept, as the run that follows will
    pack (a packed GEMM's cost depends on the row count it is packed for). ``decoder``: the run's
    own ``fast_target.Decoder`` (left packed for the last size), else one built here."""
    from ..decode.fast_target import NATIVE, NATIVE_MAX_ROWS, ONEDNN, Decoder, FastTarget, Linear

    dev, past = ids.device, ids.shape[1]
    decoder = decoder or Decoder(target)  # fused once; each size only re-packs
    fast = FastTarget(target, min(max_len, past + max(sizes)), decoder=decoder)
    fast.forward(ids[0], torch.arange(past, device=dev), 0, logits="last")

    def once(n):
        new, pos = ids[0, -1:].repeat(n), torch.arange(past, past + n, device=dev)
        return timed(lambda: fast.forward(new, pos, past), dev)[1]

    # The fastest of ``repeats`` rounds over all sizes: other load on the machine only ever adds
    # time, and a burst of it would hit consecutive timings of one size (a median of three taken
    # size by size once made 2 rows look as slow as 32 and picked a 31-node tree).
    lat = dict.fromkeys(sizes, float("inf"))

    def rounds(sizes=sizes):  # one packing serves every size
        for n in sizes:
            once(n)  # warm: the first call after packing pays page faults
        for _ in range(repeats):
            for n in sizes:
                lat[n] = min(lat[n], once(n))

    if Linear.can_pack(decoder.head.weight, ONEDNN):
        decoder.repack((ONEDNN,))
        rounds()
    if Linear.can_pack(decoder.head.weight, NATIVE):  # the native kernel serves the small sizes
        decoder.repack((NATIVE,))
        rounds([n for n in sizes if n <= NATIVE_MAX_ROWS])
    if not Linear.can_pack(decoder.head.weight):  # no MKL here (bf16 weights): unpacked too
        decoder.repack(())
        rounds()
        return lat
    for n in sizes:  # MKL: a copy packed for each size
        decoder.repack((n,))
        once(n)
        lat[n] = min(lat[n], *(once(n) for _ in range(repeats)))
    return lat


def _interp(lat: dict[int, float], n: int) -> float:
    xs = sorted(lat)
    if n <= xs[0]:
        return lat[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return lat[a] + (lat[b] - lat[a]) * (n - a) / (b - a)
    return lat[xs[-1]] * n / xs[-1]


def choose_tree(outputs, latency: dict[int, float], max_total: int, max_depth: int,
                draft_per_cycle: bool = False) -> dict:
    """Pick (total_tokens, depth) maximising expected tokens/s from a big-tree calibration run.

    A smaller EAGLE-2 tree (N nodes, depth d) is exactly the first N nodes of depth <= d in the
    big tree's ranking, so each calibration cycle tells what every smaller tree would accept.
    The draft costs a step per level, or with ``draft_per_cycle`` (a block drafter) the same
    forward whatever the depth.
    """
    cycles = [(ranks, depths) for o in outputs for ranks, depths in zip(o.accepted_ranks, o.rank_depths)]
    n_cycles = sum(o.forwards for o in outputs)
    if not cycles:
        raise EvalError("tree auto: no calibration cycles (empty answers?)")
    draft_level = sum(o.times["draft"] for o in outputs) / max(1, n_cycles) / max_depth
    book = sum(o.times["bookkeeping"] for o in outputs) / max(1, n_cycles)
    best = None
    for d in range(1, max_depth + 1):
        for n in range(d, max_total + 1):
            acc = 0
            for ranks, depths in cycles:
                a = 0
                for i, r in enumerate(ranks):  # the i-th path node sits at depth i+1
                    if i + 1 > d:
                        break
                    # its rank among nodes of depth <= d
                    sub = sum(1 for dd in depths[:r] if dd <= d)
                    if sub > n:
                        break
                    a += 1
                acc += a + 1
            tau = acc / len(cycles)
            speed = tau / ((max_depth if draft_per_cycle else d) * draft_level + _interp(latency, n + 1) + book)
            if best is None or speed > best["tokens_per_s"]:
                best = {"total_tokens": n, "depth": d, "tau": tau, "tokens_per_s": speed}
    best["latency_ms"] = {k: round(v * 1000, 3) for k, v in latency.items()}
    return best


def choose_chain(outputs, latency: dict[int, float], max_steps: int) -> dict:
    """The chain length k <= ``max_steps`` maximising expected tokens/s, from a calibration run of
    ``max_steps``-token chains of a block drafter: a chain of k verifies the same block's first k
    tokens and accepts min(accepted, k) of them, plus the bonus; the block costs one forward at any k."""
    accepted = [a - 1 for o in outputs for a in o.accept_lengths]
    n_cycles = sum(o.forwards for o in outputs)
    if not accepted:
        raise EvalError("tree auto: no calibration cycles (empty answers?)")
    draft = sum(o.times["draft"] for o in outputs) / max(1, n_cycles)
    book = sum(o.times["bookkeeping"] for o in outputs) / max(1, n_cycles)
    taus = {k: 1 + sum(min(a, k) for a in accepted) / len(accepted) for k in range(1, max_steps + 1)}
    speed = {k: tau / (draft + _interp(latency, k + 1) + book) for k, tau in taus.items()}
    k = max(speed, key=lambda k: (speed[k], -k))
    return {"steps": k, "tau": taus[k], "tokens_per_s": speed[k], "chain_tau": {str(i): round(t, 3)
                                                                               for i, t in taus.items()}}


def heldout_chain_tau(acc, steps: int) -> float | None:
    """The tau a chain of ``steps`` tokens gets from the draft's held-out per-position acceptance
    (acc_k: token k accepted once tokens 1..k-1 were, as training records it), or None without it."""
    from ..train.ttt import acceptance_length

    if not acc or len(acc) < steps:
        return None
    return acceptance_length([float(a) for a in acc[:steps]])


def calibrate_block(dec, run, firsts, log=print, heldout_acc=None) -> dict:
    """``calibrate`` for a block drafter (DFlash): a chain of the block's B - 1 tokens and a 64-node
    top-k tree over its positions, each on up to three of ``firsts``; the chain length, or the tree
    where it decodes more tokens a second, goes into ``dec.settings``. The held-out tau of the chosen
    chain length (``heldout_acc``, from the draft's training record) is reported beside the measured
    one: a draft that agreed with the target in training and is rarely accepted here shows there."""
    from ..decode.generator import SpecSettings

    settings, fast, top = dec.settings, dec.fast, dec.drafter.max_depth
    common = {**settings.__dict__, "temperature": 0.0, "max_new_tokens": min(64, dec.cfg.max_new_tokens)}
    chain_runs = [dec.spec(f, SpecSettings(**{**common, "mode": "chain", "steps": top})) for f in firsts[:3]]
    tree_runs = [dec.spec(f, SpecSettings(**{**common, "mode": "tree", "total_tokens": 64, "depth": top}))
                 for f in firsts[:3]]
    first = firsts[0]
    lat = (verify_latency_fast(dec.target, first, fast.max_len, decoder=fast.decoder) if fast is not None
           else verify_latency(dec.target, first))
    chain = choose_chain(chain_runs, lat, top)
    tree = choose_tree(tree_runs, lat, 64, top, draft_per_cycle=True)
    use_tree = tree["tokens_per_s"] > chain["tokens_per_s"]
    auto = {"draft": "block", "block_size": top + 1, "mode": "tree" if use_tree else "chain",
            "chain": chain, "tree": {k: v for k, v in tree.items() if k != "latency_ms"},
            "latency_ms": tree["latency_ms"], "latency_path": "fast" if fast is not None else "hf"}
    settings.mode = auto["mode"]
    if use_tree:
        settings.total_tokens, settings.depth = tree["total_tokens"], tree["depth"]
        auto.update(total_tokens=tree["total_tokens"], depth=tree["depth"], tau=tree["tau"])
        what = f"a {tree['total_tokens']}-node tree of depth {tree['depth']}"
    else:
        settings.steps = chain["steps"]
        auto.update(steps=chain["steps"], tau=chain["tau"])
        what = f"a chain of {chain['steps']}"
    auto["heldout_tau"] = heldout_chain_tau(heldout_acc, chain["steps"])
    run.packing = pack_for_run(fast, settings, log)
    run.exact = check_exact(fast, settings, log)
    held = (f"; held-out acceptance gives a chain of {chain['steps']} tau {auto['heldout_tau']:.2f}"
            if auto["heldout_tau"] is not None else "")
    log(f"tree auto (block of {top + 1}): {what} (expected tau {auto['tau']:.2f}; chain of {chain['steps']} "
        f"{chain['tau']:.2f} at {chain['tokens_per_s']:.1f} tok/s, {tree['total_tokens']}-node tree "
        f"{tree['tau']:.2f} at {tree['tokens_per_s']:.1f}){held}")
    return auto


def calibrate(dec, run, firsts, log=print) -> dict:
    """Choose the tree from a 64-node, depth-8 calibration on up to three of ``firsts``, set it in
    ``dec.settings``, and pack and check the fast path for it (``run`` takes the new packings)."""
    from ..decode.generator import SpecSettings

    settings, fast = dec.settings, dec.fast
    big = SpecSettings(**{**settings.__dict__, "total_tokens": 64, "depth": 8, "temperature": 0.0,
                          "max_new_tokens": min(64, dec.cfg.max_new_tokens)})
    # the calibration's draft levels run as the chosen tree's will (packed, e.g. bf16 never unpacked),
    # so that its per-level cost, which the choice weighs, is the run's
    pack_drafter(dec.drafter, big, log=lambda _: None)
    calib = [dec.spec(f, big) for f in firsts[:3]]
    # The latency curve of the path the run verifies through: the fast path's is flatter.
    first = firsts[0]
    lat = (verify_latency_fast(dec.target, first, fast.max_len, decoder=fast.decoder) if fast is not None
           else verify_latency(dec.target, first))
    auto = choose_tree(calib, lat, 64, 8)
    auto["latency_path"] = "fast" if fast is not None else "hf"
    settings.total_tokens, settings.depth = auto["total_tokens"], auto["depth"]
    run.packing = pack_for_run(fast, settings, log)  # re-pack for the chosen verification size
    run.draft_packing = pack_drafter(dec.drafter, settings, log)
    run.exact = check_exact(fast, settings, log)
    log(f"tree auto: total_tokens={auto['total_tokens']} depth={auto['depth']} "
        f"(expected tau {auto['tau']:.2f})")
    return auto
