"""`eagle3 train --draft-type dflash` fed the very steps a speculators run took: its packs and anchors.

    python benchmarks/dflash_replay.py --packs runs/peer_dflash/packs_s2/packs.json -- \\
        train --store runs/sg400b --draft-type dflash ...        # any `eagle3 train` flags

``peer_dflash.py`` records the steps (``Tape``: each step's conversations of the exported split,
the last one cut where the pack was full, and the anchors speculators drew in the pack) and runs
this with a run's flags when they hold ``--replay peer``. Everything else is eagle3's own: its
draft, loss, optimizer and schedule. Each pack becomes one padded batch, one conversation a row
(speculators' document mask keeps each block inside its conversation and its position ids
restart there, so the two layouts are the same computation), and each anchor the same position of
its conversation. So a draft trained this way differs from the peer's only by what the two tools
do with one step's data; from the peer's initial draw (``--init-from peer``) the two must follow
one trajectory. Held-out scoring is untouched.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

import torch


def replay_groups(steps: list[dict]):
    """Trainer.groups: every recorded step in the first epoch, each one micro-batch of the pack's
    conversations (the split's j-th is the trainer's train_idx[j], as peer_dflash exports it)."""

    def groups(self, epoch: int) -> list[list[list[int]]]:
        if epoch:
            return []
        return [[[self.train_idx[j] for j in st["docs"]]] for st in steps]

    return groups


def pack_anchors(st: dict, rows: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's pack positions as (anchors [rows, m], real [rows, m], lengths [rows]): each anchor
    the same position of its own conversation, each length the part of it the pack held."""
    starts = [0]
    for n in st["lens"][:-1]:
        starts.append(starts[-1] + n)
    per = [[] for _ in range(rows)]
    for p in st["anchors"]:
        d = bisect.bisect_right(starts, p) - 1
        per[d].append(p - starts[d])
    m = max(1, max(map(len, per)))
    anchors = torch.zeros(rows, m, dtype=torch.long)
    real = torch.zeros(rows, m, dtype=torch.bool)
    for r, xs in enumerate(per):
        anchors[r, :len(xs)] = torch.tensor(xs, dtype=torch.long)
        real[r, :len(xs)] = True
    return anchors.to(device), real.to(device), torch.tensor(st["lens"], device=device)


def replay_anchors(steps: list[dict], original):
    """DFlashFamily.draw_anchors: in training steps the recorded anchors and lengths; held out, its own."""

    def draw_anchors(self, t, mask, batch, held_out: bool, seed: int | None):
        if held_out:
            return original(self, t, mask, batch, held_out, seed)
        st = steps[t.step]
        if len(st["lens"]) != mask.shape[0]:
            raise SystemExit(f"step {t.step}: a batch of {mask.shape[0]} rows for a pack of {len(st['lens'])}")
        return pack_anchors(st, mask.shape[0], mask.device)

    return draw_anchors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packs", required=True, help="the steps peer_dflash.py recorded (packs.json)")
    ap.add_argument("cli", nargs=argparse.REMAINDER, help="-- then the eagle3 command line (train ...)")
    a = ap.parse_args()
    steps = json.loads(Path(a.packs).read_text())
    cli = a.cli[1:] if a.cli[:1] == ["--"] else a.cli

    from eagle3cli import cli as eagle3
    from eagle3cli.train.families import DFlashFamily
    from eagle3cli.train.trainer import Trainer

    Trainer.groups = replay_groups(steps)
    DFlashFamily.draw_anchors = replay_anchors(steps, DFlashFamily.draw_anchors)
    sys.argv = ["eagle3", *cli]
    eagle3.main()


if __name__ == "__main__":
    main()
