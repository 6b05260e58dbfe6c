"""core.threads: one thread or all, by the mean of interleaved probes (stalls included)."""

import torch

from eagle3cli.core import threads


def fake_probe(ms_many, ms_one):
    """probe() as if ``threads`` threads took these ms per matmul; a list for ``many`` gives one
    value per round (a stall in one round)."""
    rounds = iter(ms_many) if isinstance(ms_many, list) else None

    def probe(n, reps, a, b):
        torch.set_num_threads(n)
        if n == 1:
            return ms_one * reps / 1000
        return (next(rounds, 0.5) if rounds else ms_many) * reps / 1000
    return probe


def test_one_thread_when_the_mean_says_the_cores_are_busy(monkeypatch):
    start = torch.get_num_threads()
    try:
        # two threads are faster in four rounds of five, but one stall of 40 ms costs more than they save
        monkeypatch.setattr(threads, "probe", fake_probe([0.5, 0.5, 0.5, 0.5, 0.5, 40.0], 0.8))
        n, why = threads.choose_threads(most=2)
        assert (n, torch.get_num_threads()) == (1, 1)
        assert why == "a decode-sized matmul took 0.80 ms on one thread against 8.40 on 2: the cores are busy"
        monkeypatch.setattr(threads, "probe", fake_probe(0.5, 0.8))
        assert threads.choose_threads(most=2) == (2, "") and torch.get_num_threads() == 2
        said = []
        assert threads.adapt("train", said.append) == 2 and said == []  # no change: nothing said
        monkeypatch.setattr(threads, "probe", fake_probe(5.0, 0.8))
        assert threads.adapt("train", said.append) == 1
        assert said == ["train: 1 thread (a decode-sized matmul took 0.80 ms on one thread against 5.00 on 2: the "
                        "cores are busy)"]
        monkeypatch.setattr(threads, "probe", fake_probe(0.5, 0.8))
        threads.adapt("eval", said.append)
        assert said[-1] == "eval: 2 threads (the cores are free again)"
    finally:
        torch.set_num_threads(start)
