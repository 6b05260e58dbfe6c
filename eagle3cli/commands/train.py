"""``eagle3 train`` and ``eagle3 recipes``.

The train command's flags are generated from the fields of ``TrainConfig`` (one flag per field,
same name with dashes; the target's come from the shared ``TargetOptions``), so a setting can
never exist in recipes but not on the command line or the other way round. Every flag defaults to
"not given" so that recipe values are overridden only by flags the user actually typed.
"""

from __future__ import annotations

import inspect
import json
from typing import Optional

import typer

from ..config.train_config import TrainConfig
from .common import console, fail, flags_from, report_console

RECIPE_HELP = "Recipe: a name (see `eagle3 recipes`), a YAML file, 'auto' (by the target's model_type) or 'none'."


_EXTRA = [
    inspect.Parameter("recipe", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                      default=typer.Option("auto", "--recipe", help=RECIPE_HELP)),
    inspect.Parameter("print_config", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--print-config",
                                           help="Print the resolved settings as JSON and exit.")),
]


def _model_type(flags: dict) -> str | None:
    """The target family for --recipe auto: from the store's manifest, else the target config."""
    from pathlib import Path

    if flags.get("data"):
        from ..data.features import MANIFEST, read_manifest

        if not (Path(flags["data"]) / MANIFEST).exists():
            fail(f"--store {flags['data']} is not a feature store (no {MANIFEST}): run `eagle3 gen-data` first")
        return read_manifest(flags["data"]).model_type  # a garbled manifest: StoreError, one line
    if flags.get("model"):
        from ..core.hf_utils import text_config
        from ..model.target import TargetSpec, load_config

        cfg = load_config(TargetSpec(model=flags["model"], revision=flags.get("revision"),  # TargetError: one line
                                     trust_remote_code=bool(flags.get("trust_remote_code"))))
        return getattr(text_config(cfg), "model_type", None)
    return None


@flags_from(TrainConfig, extra=_EXTRA, unset=True)
def train(**kwargs):
    """Train an EAGLE-3 draft (training-time test) or a DFlash draft (--draft-type dflash) on a gen-data store."""
    from ..config.train_config import check_family_flags, resolve

    recipe = kwargs.pop("recipe")
    print_config = kwargs.pop("print_config")
    resolve("none", kwargs)[0].validate(alone=True)  # each flag by itself, before a store, config or import
    cfg, used = resolve(recipe, kwargs, _model_type(kwargs) if recipe == "auto" else None)  # OptionError: one line
    check_family_flags({k for k, v in kwargs.items() if v is not None}, cfg.draft_type)
    if recipe == "auto":
        console.print(f"recipe: {used or 'none (no recipe for this model family: defaults)'}", highlight=False)
    if print_config:
        typer.echo(json.dumps({"recipe": used, **cfg.to_dict()}, indent=2))
        return
    from ..core.errors import Interrupted
    from ..train.trainer import train as run_training

    try:
        result = run_training(cfg, recipe=used, console=console)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted: checkpoints in {cfg.out}/checkpoints are kept; continue with the same "
                          "command plus --resume") from None
    if result.stopped:
        fail(result.stopped)
    console.print(f"stopped after {result.step} optimizer steps: {result.limit}", highlight=False)
    if cfg.keep == "best" and result.metrics.get("exported_step") is not None:
        console.print(f"exported the weights of step {result.metrics['exported_step']}: the best measured tau, "
                      f"{result.metrics['tau_measured']}", highlight=False)
    console.print(f"draft written to {result.out} (checkpoints in {result.out / 'checkpoints'})", highlight=False)


def recipes(name: Optional[str] = typer.Argument(None, help="Show this recipe's YAML.")):
    """List the training recipes (or print one)."""
    from rich.table import Table

    from ..config.train_config import FAMILIES, read_recipe, recipe_names, recipe_source

    if name:
        typer.echo(recipe_source(name)[1])  # an unknown recipe: OptionError, one line
        return
    table = Table(title="eagle3 recipes (eagle3 train --recipe NAME; flags override recipe values)")
    for col in ("recipe", "model types", "settings", "description"):
        table.add_column(col)
    for n in recipe_names():
        _, raw = read_recipe(n)
        types = ", ".join(sorted(t for t, r in FAMILIES.items() if r == n))
        settings = ", ".join(f"{k}={v}" for k, v in raw.items() if k != "description")
        table.add_row(n, types, settings, str(raw.get("description", "")))

    report_console().print(table)
