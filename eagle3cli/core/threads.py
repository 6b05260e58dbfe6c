"""One thread or all of them: whichever runs faster on these cores right now.

On cores that another job also uses, torch's OpenMP threads wait for each other at every op: a
decode-sized matmul can take many times longer on two threads than on one (docs/benchmarks.md,
"Threads on shared cores"). The stall comes
and goes with the other job's scheduling, so a probe compares the *mean* of interleaved rounds
(a median hides exactly the stalls that cost the time), and long work probes again as it goes
(the quickstart before each stage and between gen-data's shards): a job that starts beside it
later turns a good choice bad.
"""

from __future__ import annotations

import os
import time


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def probe(threads: int, reps: int, a, b) -> float:
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return time.perf_counter() - t0


def choose_threads(most: int | None = None, rounds: int = 5, reps: int = 10) -> tuple[int, str]:
    """Set torch's thread count to 1 or ``most`` (default: every core), whichever ran a
    decode-sized matmul faster over ``rounds`` interleaved rounds; (threads, why: "" when all)."""
    import torch

    most = most or cores()
    if most <= 1:
        torch.set_num_threads(1)
        return 1, ""
    a, b = torch.randn(32, 576), torch.randn(576, 1536)
    probe(most, 2, a, b)  # untimed: the thread pool starts
    many = one = 0.0
    for _ in range(rounds):
        many += probe(most, reps, a, b)
        one += probe(1, reps, a, b)
    n = rounds * reps
    if one < 0.9 * many:
        torch.set_num_threads(1)
        return 1, (f"a decode-sized matmul took {1000 * one / n:.2f} ms on one thread against "
                   f"{1000 * many / n:.2f} on {most}: the cores are busy")
    torch.set_num_threads(most)
    return most, ""


def adapt(label: str, say) -> int:
    """Probe again (choose_threads) and ``say`` a line when the count changes; the count."""
    import torch

    before = torch.get_num_threads()
    n, why = choose_threads()
    if n != before:
        say(f"{label}: {n} thread{'s' if n != 1 else ''}" + (f" ({why})" if why else " (the cores are free again)"))
    return n
