"""Measurements on a built ``FastTarget``, made once before a run: which packing of its matmuls
serves a row count fastest on this CPU (``tune_packing``), and whether a low-precision
verification is bitwise one-token decoding here (``row_invariant``), without which no lossless
claim could hold."""

from __future__ import annotations

import torch

from .fast_target import NATIVE, NATIVE_MAX_ROWS, ONEDNN, FastTarget, Linear, serving_key
from .packing import NATIVE_ONE
from .tree import new_tree, verify_mask


@torch.inference_mode()
def row_invariant(fast: FastTarget, rows: int, prefix: int = 24, seed: int = 0) -> bool:
    """Whether verifying ``rows`` tokens here gives bitwise the logits that decoding them one at a
    time gives: for a chain, and for every node of a binary tree against its own path. Only then
    does greedy speculative decoding emit exactly what plain decoding emits, near-ties included.
    A start-up check for the low-precision fast path (its matmuls' row-invariance is the CPU
    library's, not ours to promise); it overwrites the cache.
    """
    if rows < 2:
        return True  # one row is one-token decoding
    if rows >= fast.max_len:
        raise ValueError(f"a {rows}-row check needs more than the cache's {fast.max_len} positions")
    prefix = min(prefix, fast.max_len - rows)  # a short cache is checked behind a shorter prefix
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, fast.embed.shape[0], (prefix + rows,), generator=g).to(fast.embed.device)
    fast.forward(ids[:prefix], torch.arange(prefix, device=ids.device), 0, logits="last")

    def one_by_one(path: list[int]) -> torch.Tensor:
        """Logits of decoding ``new[path]`` one token at a time behind the prefix."""
        at = lambda d: torch.tensor([prefix + d], device=ids.device)  # noqa: E731
        return torch.cat([fast.forward(new[i:i + 1], at(d), prefix + d)[0] for d, i in enumerate(path)])

    new = ids[prefix:]
    chain, _ = fast.forward(new, torch.arange(prefix, prefix + rows, device=ids.device), prefix)
    if not torch.equal(chain, one_by_one(list(range(rows)))):
        return False
    # A binary tree, masked as the generator masks a verification (tree.verify_mask); each leaf's
    # path decoded one token at a time covers every node on it.
    tree = new_tree(int(new[0]))
    for i in range(1, rows):
        tree.add(int(new[i]), (i - 1) // 2, 0.0)
    depth = torch.tensor(tree.depths, device=ids.device)
    logits, _ = fast.forward(new, prefix + depth, prefix, mask=verify_mask(tree, prefix, ids.device)[0, 0])
    for leaf in (i for i in range(rows) if not tree.children[i]):
        path = [leaf]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        path.reverse()
        if not torch.equal(logits[path], one_by_one(path)):
            return False
    return True


def packing_options(rows: int, weight: torch.Tensor) -> list[tuple]:
    """The packings ``tune_packing`` times for ``rows``-row verifications on this CPU: unpacked, MKL
    packed for ``rows`` and padded up to a multiple of 4 (fp32 with MKL), oneDNN prepacked (fp32
    with oneDNN), the native kernel (fp32, built here, ``rows`` within its limit; oneDNN beside it
    for the prompt's many rows)."""
    options = [()]
    if Linear.can_pack(weight):
        options += [(rows,)] + ([(-(-rows // 4) * 4,)] if rows % 4 else [])
    onednn = Linear.can_pack(weight, ONEDNN)
    if onednn:
        options.append((ONEDNN,))
    if rows <= NATIVE_MAX_ROWS and Linear.can_pack(weight, NATIVE):
        options.append((NATIVE, ONEDNN) if onednn else (NATIVE,))
    return options


def _label(option: tuple, rows: int) -> str:
    """What serves a ``rows``-row call under ``option``: an MKL row count, "onednn" or "none"."""
    return str(serving_key(option, rows) or "none")


def tune_packing(fast: FastTarget, rows: int, prefix: int = 64, repeats: int = 3, rounds: int = 2,
                 clock=None) -> dict | None:
    """Pack ``fast``'s matmuls the fastest of a few ways, timed here, for the two forward sizes a
    speculative run and its plain baseline use: ``rows``-row verifications and one-row decoding.
    Returns what was measured (None: nothing to choose: one row, or nothing packs here).

    Which prepacked GEMM wins is the CPU's, so it is measured at start-up. MKL's packed GEMM is
    specialised for its row count and its speed is not monotonic in it: on one Xeon 3 rows packed
    for 3 cost more than 3 rows unpacked or packed for 4, and oneDNN's prepacked linear lost to
    MKL's, while on an AMD EPYC oneDNN's wins (docs/benchmarks.md, "Verification cost"). So: unpacked, MKL
    packed for ``rows`` or padded up to a multiple of 4, oneDNN; then one row, served as that
    choice serves it, by MKL packed for one, by oneDNN or by the native kernel (the plain baseline must get the
    fastest too, or speedups are overstated). Interleaved rounds (a shared machine's load drifts
    between rounds), the best median kept. Every option computes the same products up to fp32
    rounding; the cache is left holding garbage past position 0, which the next prefill overwrites.
    """
    options = packing_options(rows, fast.head.weight)
    prefix = min(prefix, fast.max_len - rows)  # a short context is timed behind a shorter prefix
    if rows < 2 or len(options) < 2 or prefix < 1 or fast.decoder.mixed:  # mixed: only the native kernel serves
        return None
    dev = fast.embed.device
    ids = torch.randint(0, fast.embed.shape[0], (prefix + rows,), generator=torch.Generator().manual_seed(0)).to(dev)
    fast.forward(ids[:prefix], torch.arange(prefix, device=dev), 0, logits="last")
    new, pos = ids[prefix:], torch.arange(prefix, prefix + rows, device=dev)
    timing = dict(repeats=repeats, rounds=rounds, clock=clock)
    verify = _median_times(fast, options, new, pos, prefix, **timing)
    best = min(options, key=lambda o: (verify[o], str(o)))
    # one row: as ``best`` serves it, or an extra copy (MKL for one row, oneDNN, the native kernel for
    # one row only) next to it, which leaves the verification's rows to ``best``
    extra = [k for k in (1, ONEDNN, NATIVE_ONE) if k not in best and Linear.can_pack(fast.head.weight, k)
             and not (k == NATIVE_ONE and NATIVE in best)]
    single_options = [best] + [(k,) + best for k in extra]
    single = _median_times(fast, single_options, new[:1], pos[:1], prefix, **timing)
    keep = min(single_options, key=lambda o: (single[o], len(o)))  # a tie keeps one copy fewer
    fast.decoder.repack(keep)
    return {"rows": rows, "packed_for": _label(best, rows) if best else None, "packing": list(keep),
            "ms": {_label(o, rows): round(1000 * t, 2) for o, t in verify.items()},
            "one_row": {"uses": _label(keep, 1), "ms": {_label(o, 1): round(1000 * t, 2) for o, t in single.items()}}}


def _median_times(fast: FastTarget, options, new, pos, past: int, repeats: int, rounds: int, clock=None) -> dict:
    """{packing: median seconds of one forward of ``new`` at ``pos`` after ``past`` cached positions}."""
    import time

    clock = clock or time.perf_counter
    times: dict[tuple, list[float]] = {o: [] for o in options}
    for _ in range(rounds):
        for option in options:
            fast.decoder.repack(option)
            fast.forward(new, pos, past)  # warm: the first call after packing pays page faults
            runs = []
            for _ in range(repeats):
                t0 = clock()
                fast.forward(new, pos, past)
                runs.append(clock() - t0)
            times[option].append(sorted(runs)[len(runs) // 2])
    return {o: sorted(ts)[len(ts) // 2] for o, ts in times.items()}
