"""What a training run reports: metrics, train_log.jsonl and trackers, the live view, the summary.

    Meter           sums per-step loss / correct / counted positions between log points (all ranks)
    RunLog          train_log.jsonl on the main process, plus the --report-to trackers
    LiveView        rich progress bar (a log file gets one line per log point instead)
    final_metrics   held-out metrics if there are any, else the last training record's
    measured_metrics  the measured tau of the exported draft and its step (--eval-every)
    trained_on      what the card says the draft was trained on (Hub ids, never local paths)
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch

from .ttt import TTTOutput, acceptance_length

LOG = "train_log.jsonl"


class Meter:
    """Sums of per-step loss, correct and counted positions (reduced across processes)."""

    def __init__(self, steps: int, device):
        self.loss = torch.zeros(steps, dtype=torch.float64, device=device)
        self.correct = torch.zeros(steps, dtype=torch.float64, device=device)
        self.counted = torch.zeros(steps, dtype=torch.float64, device=device)
        self.batches = 0
        self.tokens = 0

    def add(self, out: TTTOutput, tokens: int):
        self.loss += out.step_loss.double() * out.counted.double()
        self.correct += out.correct.double()
        self.counted += out.counted.double()
        self.tokens += tokens

    def result(self, acc) -> dict:
        loss, correct, counted = (acc.reduce(x, "sum") for x in (self.loss, self.correct, self.counted))
        n = counted.clamp_min(1)
        accs = (correct / n).tolist()
        return {"loss": (loss / n).tolist(), "acc": accs, "tau_sim": acceptance_length(accs),
                "positions": int(counted[0].item())}


def decayed_loss(per_step: list[float], decay: float) -> float:
    return float(sum(decay ** s * v for s, v in enumerate(per_step)))


def flat_record(rec: dict) -> dict:
    """A log record as tracker scalars: lists -> key_i, nested dicts -> key/sub."""
    flat = {}
    for k, v in rec.items():
        if isinstance(v, list):
            flat.update({f"{k}_{i}": x for i, x in enumerate(v)})
        elif isinstance(v, dict):
            for k2, v2 in v.items():
                if isinstance(v2, list):
                    flat.update({f"{k}/{k2}_{i}": x for i, x in enumerate(v2)})
                elif isinstance(v2, (int, float)):
                    flat[f"{k}/{k2}"] = v2
        elif isinstance(v, (int, float)):
            flat[k] = v
    return flat


class RunLog:
    """train_log.jsonl (main process only) and the accelerate trackers of --report-to."""

    def __init__(self, acc, out: Path, trackers: bool):
        self.acc, self.out, self.trackers = acc, Path(out), trackers

    def start(self, config: dict):
        if self.trackers:
            self.acc.init_trackers("eagle3", config={k: v for k, v in config.items() if v is not None})

    def write(self, rec: dict, step: int):
        if not self.acc.is_main_process:
            return
        from ..core.io_utils import append_line

        append_line(self.out / LOG, json.dumps(rec))
        if self.trackers:
            self.acc.log(flat_record(rec), step=step)

    def end(self):
        if self.trackers:
            self.acc.end_training()


def final_metrics(val: dict | None, history: list, step_decay: float, device) -> dict:
    """The run's metrics for the card and train_summary.json: held-out if measured, else train."""
    train_recs = [h for h in history if "acc" in h]
    if val is not None:
        metrics = {"acc": [round(a, 4) for a in val["acc"]],
                   "loss": round(decayed_loss(val["loss"], step_decay), 4),
                   "tau_sim": round(val["tau_sim"], 3), "split": "held-out"}
    elif train_recs:
        last = train_recs[-1]
        metrics = {"acc": [round(a, 4) for a in last["acc"]], "loss": round(last["loss"], 4),
                   "tau_sim": round(acceptance_length(last["acc"]), 3), "split": "train"}
    else:
        metrics = {"acc": [], "loss": None, "split": "none"}
    if train_recs:
        metrics["tokens_per_s"] = round(sum(h["tokens_per_s"] for h in train_recs) / len(train_recs), 1)
    metrics["peak_memory_mb"] = round(peak_memory_mb(device), 1)
    return metrics


def epoch_note(epoch: int, val: dict, step_decay: float) -> str:
    """The live view's line for an epoch's held-out metrics."""
    return (f"epoch {epoch + 1}: held-out loss {decayed_loss(val['loss'], step_decay):.3f}, acc "
            + " ".join(f"{a:.2f}" for a in val["acc"]) + f", simulated tau {val['tau_sim']:.2f}")


def measured_metrics(history: list, best: dict | None, step: int) -> dict:
    """--eval-every: the exported draft's measured tau and the step its weights are from (the best
    measured step with --keep best, else the final step); {} without measurements."""
    recs = [h for h in history if "measured" in h]
    if not recs:
        return {}
    if best is not None:
        return {"tau_measured": round(best["tau"], 3), "exported_step": best["step"]}
    return {"tau_measured": round(recs[-1]["measured"]["tau"], 3), "exported_step": step}


def trained_on(src: dict) -> tuple[str | None, list[str]]:
    """(data description, dataset Hub ids) of a store's ``source`` for the exported metadata."""
    datasets = src.get("datasets") or ([src["dataset"]] if isinstance(src.get("dataset"), str) else [])
    datasets = datasets or hub_datasets(src.get("data"))
    return data_description(src), [d for d in datasets if isinstance(d, str)]


def hub_datasets(data: str | None) -> list[str]:
    """The Hub id of gen-data's --dataset when it was one (or a preset); [] for a local file."""
    from ..data.raw_rows import PRESETS

    if not isinstance(data, str):
        return []
    if data.lower() in PRESETS:
        return [PRESETS[data.lower()][0]]
    from ..publish.push import is_hub_id

    return [data] if is_hub_id(data) and not data.endswith((".json", ".jsonl", ".parquet")) else []


def data_description(src: dict) -> str | None:
    """What the draft was trained on, for the card: the dataset's Hub id or file name, never a
    path of this machine (the store's folder and the data file's directories stay private)."""
    data = src.get("data")
    if not isinstance(data, str):
        return None
    name = (hub_datasets(data) or [Path(data).name])[0]
    how = "answers regenerated by the target" if src.get("regenerated") else "the dataset's own answers"
    return f"{name} ({how})"


def peak_memory_mb(device) -> float:
    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def summary_table(metrics: dict, step: int, out: Path):
    from rich.table import Table

    table = Table(title=f"eagle3 train: {step} steps -> {out}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for s, a in enumerate(metrics.get("acc", [])):
        table.add_row(f"acc_{s} ({metrics.get('split')})", f"{a:.3f}")
    for key in ("loss", "tau_sim", "tau_measured", "exported_step", "tokens_per_s", "peak_memory_mb"):
        if metrics.get(key) is not None:
            table.add_row(key, f"{metrics[key]}")
    return table


class LiveView:
    """Rich progress bar with step, loss, per-step accuracies, tokens/s and ETA; in a log file a
    plain line at least every 30 s besides (core/progress.py); and, a few steps into each phase
    (the --ttt-warmup steps, then the full unroll), how long the phase's remaining steps will take
    at the rate just measured (core/estimate.py)."""

    MEASURED_STEPS = 2  # steps timed before the estimate (after each phase's first, which allocates)

    def __init__(self, total: int, console, enabled: bool, warmup: int = 0):
        self.enabled = enabled
        self.total = total
        self.console = console
        self.progress = None
        self.warmup = warmup
        self.log = None  # LogProgress, from the first update (it knows the step a resumed run starts at)
        self.info = ""
        self.phase = None  # (warm-up?, time, steps timed, tokens timed, estimate said?)

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[info]}"), console=self.console, transient=False)
            self.progress.__enter__()
            self.task = self.progress.add_task("train", total=self.total, info="")
        return self

    def update(self, step: int, rec: dict | None, rate: float):
        if self.progress is None:
            return
        info = ""
        if rec is not None:
            info = (f"loss {rec['loss']:.3f}  acc " + " ".join(f"{a:.2f}" for a in rec["acc"])
                    + f"  {rate:,.0f} tok/s")
            self.info = info.replace("  ", ", ")
        if self.log is None:
            from ..core.progress import LogProgress

            self.log = LogProgress("train", self.total, "steps", self.progress.console, done0=step,
                                   extra=lambda: self.info)
        self.log.update(step)
        self.progress.update(self.task, completed=step, info=info)
        if rec is not None and not self.progress.console.is_terminal:
            # a log file gets no live bar (rich draws it once, at the end): one line per log point
            eta = self.progress.tasks[0].time_remaining
            eta = f"  eta {int(eta) // 60}m{int(eta) % 60:02d}s" if eta is not None else ""
            self.progress.console.print(f"step {step}/{self.total}  {info}{eta}", highlight=False)

    def set_total(self, total: int):
        """The run's step count changed (train --max-minutes refits it to the time left)."""
        self.total = total
        if self.progress is not None:
            self.progress.update(self.task, total=total)
        if self.log is not None:
            self.log.total = total

    def tick(self, step: int, tokens: int):
        """One optimizer step done (``tokens``: its training tokens): time the phase it belongs to
        and, once MEASURED_STEPS are timed, say once how long the phase's remaining steps take."""
        import time

        if self.progress is None:
            return
        if self.log is not None:
            self.log.update(step)
        warm = step <= self.warmup
        now = time.perf_counter()
        if self.phase is None or self.phase[0] != warm:
            self.phase = [warm, now, 0, 0, False]  # this first step of the phase is not timed
            return
        ph = self.phase
        ph[2] += 1
        ph[3] += tokens
        if ph[4] or ph[2] < self.MEASURED_STEPS:
            return
        ph[4] = True
        end = self.warmup if warm else self.total
        left = end - step
        if left > 0:
            from ..core.estimate import eta_line

            rate = ph[3] / max(1e-9, now - ph[1])
            how = (f"(the {left} --ttt-warmup steps left, one TTT step each; the full steps after them are timed "
                   "when they start)" if warm else f"(the {left} steps left)")
            self.note(eta_line("train", left * ph[3] / ph[2], "tokens", rate, how))

    def note(self, text: str):
        if self.progress is not None:
            self.progress.console.print(text, highlight=False, soft_wrap=True)  # one line in a log

    def __exit__(self, *exc):
        if self.log is not None:
            self.log.close(final=exc[0] is None)
        if self.progress is not None:
            self.progress.__exit__(*exc)
