"""Progress a log file can show (core/progress.py): its lines, its cadence, and gen-data writing them
when its output is not a terminal and the target is slow."""

import io
import json
import re
import time

from rich.console import Console

from eagle3cli.config.options import GenDataOptions
from eagle3cli.core.progress import LogProgress, clock_text, progress_interval
from eagle3cli.data.gen_data import run
from eagle3cli.model.target import TargetSpec


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def log_console():
    buf = io.StringIO()
    return buf, Console(file=buf, soft_wrap=True, width=80)


def test_lines_come_once_the_interval_has_passed_with_done_total_rate_eta():
    buf, console = log_console()
    clock = Clock()
    p = LogProgress("train", 100, "steps", console, done0=20, interval=30, clock=clock, heartbeat=False,
                    extra=lambda: "loss 2.5")
    assert p.enabled  # a StringIO is not a terminal
    clock.now += 10
    p.update(30)
    assert buf.getvalue() == ""  # not due yet
    clock.now += 20
    p.update(40)  # 20 steps in 30 s since the start (the 20 done before it do not count)
    assert buf.getvalue().splitlines() == [
        "train: 40/100 steps (40%), 0.67 steps/s, loss 2.5, elapsed 0:30, eta 1:30"]
    clock.now += 29
    p.update(advance=5)
    assert len(buf.getvalue().splitlines()) == 1
    clock.now += 31
    p.close()  # the final line comes whether due or not
    assert buf.getvalue().splitlines()[-1] == ("train: 45/100 steps (45%), 0.28 steps/s, loss 2.5, "
                                               "elapsed 1:30, eta 3:18")


def test_nothing_on_a_terminal_and_the_interval_from_the_environment(monkeypatch):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True)
    clock = Clock()
    p = LogProgress("eval", 4, "prompts", console, interval=1, clock=clock)
    assert not p.enabled and p._thread is None
    clock.now += 5
    p.update(2)
    p.close()
    assert buf.getvalue() == ""
    monkeypatch.setenv("EAGLE3_PROGRESS_INTERVAL", "2.5")
    assert progress_interval() == 2.5
    monkeypatch.setenv("EAGLE3_PROGRESS_INTERVAL", "soon")
    assert progress_interval() == 30.0
    assert (clock_text(59), clock_text(61), clock_text(3725)) == ("0:59", "1:01", "1:02:05")


class StampedLog(io.TextIOBase):
    """A log file that notes when each line was written."""

    def __init__(self):
        self.lines, self._part = [], ""

    def write(self, text):
        self._part += text
        *done, self._part = self._part.split("\n")
        self.lines += [(time.monotonic(), line) for line in done]
        return len(text)

    def isatty(self):
        return False


LINE = re.compile(r"^gen-data: (\d+)/9 conversations \((\d+)%\), ([\d.]+) conversations/s(?:, ([\d,]+) stored tok/s)?, "
                  r"elapsed (\d+:\d\d), eta (\S+)$")


def test_gen_data_to_a_log_writes_a_progress_line_every_interval_with_a_slow_target(
        smol_tiny_dir, tmp_path, monkeypatch):
    """9 conversations in shards of 3, the target taking 0.7 s a conversation and reporting nothing
    until its shard is done: the log still gets a line at least every interval (1 s here, 30 by
    default), each with done/total, rate and ETA, and a last one at 9/9."""
    from eagle3cli.data import regenerate

    real = regenerate.regenerate_local

    def slow(model, tokenizer, conversations, settings, stop_ids, **kw):
        time.sleep(0.7 * len(conversations))
        return real(model, tokenizer, conversations, settings, stop_ids, **kw)

    monkeypatch.setattr(regenerate, "regenerate_local", slow)
    monkeypatch.setenv("EAGLE3_PROGRESS_INTERVAL", "1")
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"What is {i} plus {i}?"},
                                             {"from": "gpt", "value": f"It is {2 * i}."}]} for i in range(9)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = StampedLog()
    opts = GenDataOptions(out=tmp_path / "store", data=str(data), max_new_tokens=4, max_length=96, shard_size=3,
                          batch_size=4)
    man = run(opts, TargetSpec(str(smol_tiny_dir), device="cpu"), Console(file=log, soft_wrap=True))
    assert man["num_samples"] == 9
    # before regenerating: the estimate from one timed decode step of the slots
    said = [text for _, text in log.lines if text.startswith("gen-data: ~")]
    assert len(said) == 1 and re.match(r"gen-data: ~\d+ (s|min) for [\d,]+ generated tokens at the measured [\d,]+ "
                                       r"generated tokens/s \(regeneration", said[0]), said
    progress = [(t, LINE.match(text)) for t, text in log.lines
                if text.startswith("gen-data: ") and not text.startswith("gen-data: ~")]
    assert all(m is not None for _, m in progress), [text for _, text in log.lines]
    assert len(progress) >= 5  # ~6.3 s of regeneration at one line a second
    gaps = [b[0] - a[0] for a, b in zip(progress, progress[1:])]
    assert max(gaps) <= 1.5, gaps
    done = [int(m.group(1)) for _, m in progress]
    assert done == sorted(done) and done[-1] == 9 and {3, 6} <= set(done)
    mid = next(m for _, m in progress if int(m.group(1)) == 3)
    assert float(mid.group(3)) > 0 and re.fullmatch(r"\d+:\d\d", mid.group(6))  # a rate, so an ETA
    last = progress[-1][1]
    assert (last.group(2), last.group(6)) == ("100", "0:00") and int(last.group(4).replace(",", "")) > 0
    assert progress[0][1].group(4) is None  # no stored tokens/s before the first shard is stored


def test_train_view_says_each_phase_estimate_once_from_its_measured_steps(monkeypatch):
    """The first step of a phase allocates and is not timed; two timed steps give the rate; the
    --ttt-warmup phase and the full unroll each get their own estimate, once."""
    from eagle3cli.train.train_report import LiveView

    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    buf, console = log_console()
    with LiveView(10, console, True, warmup=4) as view:
        view.update(0, None, 0.0)
        for step, (seconds, tokens) in enumerate([(5, 1000), (1, 1000), (1, 1000), (1, 1000),
                                                  (9, 3000), (3, 3000), (3, 3000), (3, 3000)], start=1):
            clock.now += seconds
            view.tick(step, tokens)
    said = [line for line in buf.getvalue().splitlines() if line.startswith("train: ~")]
    assert said == [
        "train: ~1 s for 1,000 tokens at the measured 1,000 tokens/s (the 1 --ttt-warmup steps left, one TTT step "
        "each; the full steps after them are timed when they start)",
        "train: ~9 s for 9,000 tokens at the measured 1,000 tokens/s (the 3 steps left)"]
