"""`eagle3 merge-data`: one sealed feature store from the folders several gen-data writers filled."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from . import common


def merge_data(
    out: Path = typer.Argument(..., metavar="OUT", help="The merged store (new, empty, or one of the --from folders)."),
    sources: List[Path] = typer.Option(..., "--from", help="A writer's gen-data --out folder; repeat for each "
                                       "(e.g. the --shard 0/2 and --shard 1/2 runs)."),
    move: bool = typer.Option(False, "--move", help="Move the shards (hard links where the filesystem allows, "
                              "sources removed once OUT is sealed) instead of copying them."),
):
    """Check that writers' shards make one store (each planned shard once, intact, same settings), gather and seal it."""  # noqa: E501 (the help line)
    from ..data.merge_data import merge

    merge(out, sources, move=move, say=lambda line: common.console.print(f"[green]{line}[/]", highlight=False))
