"""The prompts eval measures: the standard tasks (from the Hub, or bundled with the package where
the Hub cannot answer) and turns files of the EAGLE format."""

from __future__ import annotations

from pathlib import Path

from ..data.turns import Prompt
from ..data.turns import load_turns_file as read_turns
from .eval_config import EvalError

TASKS = ("mt_bench", "gsm8k", "humaneval", "alpaca", "sum")


# Where each task lives on the Hub (users with network), and how a row becomes user turns.
HUB = {
    "mt_bench": ("HuggingFaceH4/mt_bench_prompts", None, "train",
                 lambda r, i: (r.get("prompt_id", i), r.get("category", ""), list(r["prompt"]))),
    "gsm8k": ("openai/gsm8k", "main", "test", lambda r, i: (i, "math", [r["question"]])),
    "humaneval": ("openai/openai_humaneval", None, "test",
                  lambda r, i: (r["task_id"], "code", ["Complete the code I provided.\n\n" + r["prompt"]])),
    "alpaca": ("tatsu-lab/alpaca", None, "train",
               lambda r, i: (i, "", [r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")])),
    "sum": ("abisee/cnn_dailymail", "3.0.0", "test", lambda r, i: (r.get("id", i), "summarization",
                                                                    ["Summarize: " + r["article"]])),
}


def load_turns_file(path: str | Path, limit: int | None = None, default_category: str = "") -> list[Prompt]:
    """A JSONL file of ``{"question_id", "category", "turns": [...]}`` records (the EAGLE format)."""
    return read_turns(path, limit, default_category, error=EvalError)


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hub can answer: False in offline mode or when its host does not accept a
    connection within ``timeout`` (datasets would otherwise retry for most of a minute)."""
    import os
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
           for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _bundled(task: str) -> Path | None:
    from importlib.resources import files

    p = Path(str(files("eagle3cli.prompts").joinpath(f"{task}.jsonl")))
    return p if p.is_file() else None


def load_task(task: str, data: str | None = None, limit: int | None = None) -> tuple[str, list[Prompt]]:
    """(task name, prompts) from --prompts FILE, a file path given as TASK, or the Hub."""
    if data:
        return task, load_turns_file(data, limit, task)
    if Path(task).suffix in (".jsonl", ".json") or Path(task).is_file():
        return Path(task).stem, load_turns_file(task, limit, Path(task).stem)
    if task not in HUB:
        raise EvalError(f"unknown task {task!r}: use one of {', '.join(TASKS)} or a .jsonl file of turns")
    repo, config, split, row = HUB[task]
    bundled = _bundled(task)
    if bundled is not None and not hub_reachable():
        return task, load_turns_file(bundled, limit, task)
    try:
        from datasets import load_dataset

        ds = load_dataset(repo, config, split=split)
    except Exception as e:  # offline, gated, renamed ...
        if bundled is not None:  # shipped with the package (licence permitting): works offline
            return task, load_turns_file(bundled, limit, task)
        raise EvalError(f"could not load {task} from the Hub ({repo}: {type(e).__name__}); "
                        f"pass --prompts FILE with a local turns file") from None
    out = []
    for i, r in enumerate(ds):
        pid, cat, turns = row(r, i)
        out.append(Prompt(str(pid), cat or task, turns))
        if limit and len(out) >= limit:
            break
    return task, out

