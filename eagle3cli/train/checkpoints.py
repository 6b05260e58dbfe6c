"""Trainer checkpoints: ``OUT/checkpoints/step-N/`` written atomically, read back on --resume.

    step-N/model.safetensors     the draft's trainable weights (not the frozen embedding)
    step-N/optim.pt              optimizer and scheduler state (torch.load, weights_only)
    step-N/rng-R.pt              the RNG state of process R
    step-N/trainer_state.json    step, epoch, group, config, recipe, history, val; written last

A folder is complete once trainer_state.json exists; a damaged file is one TrainError that says
which earlier checkpoint to resume from.

    best/model.safetensors       with --keep best: the trainable weights of the step whose
    best/best.json               measured tau was highest so far, and that step and tau
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import torch

from ..config.train_config import TrainConfig, TrainError
from ..core.errors import one_line
from ..core.io_utils import discard, ensure_dir, replace_dir, save_safetensors, save_torch, write_json, writing
from ..model.draft import Eagle3Draft

CHECKPOINTS = "checkpoints"
BEST = "best"
# Settings that may change between an interrupted run and its resumption (they do not change
# the trajectory of the weights).
RESUME_FREE = {"resume", "save_every", "keep_checkpoints", "log_every", "report_to", "out", "device",
               "eval_ttt_steps", "allow_incomplete"}


def checkpoint_dirs(out: Path) -> list[Path]:
    root = out / CHECKPOINTS
    done = [p for p in root.glob("step-*") if (p / "trainer_state.json").exists()] if root.exists() else []
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def trainable_state(draft: Eagle3Draft) -> dict:
    # The embedding is the target's frozen copy: rebuilt from the target, not checkpointed.
    return {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}


def save_checkpoint(acc, out: Path, draft, optimizer, scheduler, state: dict, keep: int):
    """Write step-N atomically: a temp folder renamed into place once complete. A write that
    fails (full disk, read-only) removes the temp folder: the last complete step-N stays the one
    --resume picks."""
    root = out / CHECKPOINTS
    final = root / f"step-{state['step']:08d}"
    tmp = root / f".tmp-step-{state['step']:08d}"
    with writing(final, cleanup=tmp if acc.is_main_process else None):
        if acc.is_main_process:
            discard(tmp)
            ensure_dir(tmp)
        acc.wait_for_everyone()
        save_torch({"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                   tmp / f"rng-{acc.process_index}.pt")
        if acc.is_main_process:
            save_safetensors(trainable_state(draft), tmp / "model.safetensors")
            save_torch({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optim.pt")
        acc.wait_for_everyone()
        if acc.is_main_process:
            write_json(tmp / "trainer_state.json", state)  # written last: marks the folder complete
            replace_dir(tmp, final)
    if acc.is_main_process:
        for old in checkpoint_dirs(out)[:-max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def save_best(out: Path, draft, best: dict) -> Path:
    """checkpoints/best/: the draft's trainable weights and {step, tau}, replaced atomically (main
    process only). Kept apart from the step-N folders: --keep-checkpoints never prunes it."""
    from ..core.io_utils import atomic_dir

    root = out / CHECKPOINTS
    final = root / BEST
    with atomic_dir(final, tmp=root / f".tmp-{BEST}") as tmp:
        save_safetensors(trainable_state(draft), tmp / "model.safetensors")
        write_json(tmp / "best.json", best)
    return final


def load_best(out: Path, device) -> dict:
    """The trainable weights save_best wrote, on ``device``."""
    from safetensors.torch import load_file

    path = out / CHECKPOINTS / BEST
    weights = _read_checkpoint_file(path, "model.safetensors", lambda p: load_file(str(p)))
    return {k: v.to(device) for k, v in weights.items()}


def load_checkpoint(acc, path: Path, draft, optimizer, scheduler) -> dict:
    from safetensors.torch import load_file

    state = _read_checkpoint_file(path, "trainer_state.json", lambda p: json.loads(p.read_text()))
    weights = _read_checkpoint_file(path, "model.safetensors", lambda p: load_file(str(p)))
    missing = set(trainable_state(draft)) - set(weights)
    if missing:
        raise TrainError(f"checkpoint {path} lacks {sorted(missing)}")
    draft.load_state_dict(weights, strict=False)
    opt = _read_checkpoint_file(path, "optim.pt", lambda p: torch.load(p, weights_only=True))
    try:
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
    except (KeyError, TypeError, ValueError) as e:
        raise TrainError(_unreadable(path, "optim.pt", e)) from None
    rng_file = path / f"rng-{acc.process_index}.pt"
    if rng_file.exists():
        rng = _read_checkpoint_file(path, rng_file.name, lambda p: torch.load(p, weights_only=True))
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def _unreadable(path: Path, name: str, e: BaseException) -> str:
    earlier = [p for p in checkpoint_dirs(path.parent.parent) if p != path]
    fix = f"delete {path} to resume from {earlier[-1].name}" if earlier else f"delete {path} and train without --resume"
    return f"checkpoint {path} is unreadable ({name}: {one_line(str(e)) or type(e).__name__}): {fix}"


def _read_checkpoint_file(path: Path, name: str, read):
    """read(path / name), a damaged file (truncated, garbled, not what we wrote) as one TrainError."""
    import pickle

    from safetensors import SafetensorError

    try:
        return read(path / name)
    except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError, SafetensorError) as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise
        raise TrainError(_unreadable(path, name, e)) from None


def start_state(acc, out: Path, cfg: TrainConfig, draft, optimizer, scheduler, say) -> dict:
    """Fresh start, or the state of the last checkpoint with --resume (same settings required)."""
    existing = checkpoint_dirs(out)
    if not cfg.resume:
        if existing:
            raise TrainError(f"{out} already holds checkpoints: pass --resume to continue, or choose "
                             "another --out")
        return {"step": 0, "epoch": 0, "group": 0}
    if not existing:
        raise TrainError(f"--resume: no checkpoint in {out / CHECKPOINTS}")
    path = existing[-1]
    saved = json.loads((path / "trainer_state.json").read_text())["config"]
    now = cfg.to_dict()
    for key in sorted(set(saved) | set(now)):
        if key not in RESUME_FREE and saved.get(key) != now.get(key):
            raise TrainError(f"--resume: {key} was {saved.get(key)!r} in {path}, now {now.get(key)!r}; "
                             "resume with the same settings")
    state = load_checkpoint(acc, path, draft, optimizer, scheduler)
    if state["epoch"] >= cfg.epochs:
        # train_summary.json is written last, after the exported draft: without it the export was
        # cut short (a full disk), and resuming writes it again from the last checkpoint.
        if (out / "train_summary.json").is_file():
            raise TrainError(f"{path} is the end of a finished run: nothing to resume")
        say(f"resumed from {path} (step {state['step']}): training had finished; exporting the draft again")
        return state
    say(f"resumed from {path} (step {state['step']})")
    return state
