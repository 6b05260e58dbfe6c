"""``eagle3 train`` and ``eagle3 recipes``.

The train command's flags are generated from the fields of ``TrainConfig`` (one flag per field,
same name with dashes), so a setting can never exist in recipes but not on the command line or
the other way round. Every flag defaults to "not given" so that recipe values are overridden
only by flags the user actually typed.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Optional

import typer

from ..train_config import TrainConfig, field_types
from .common import console, fail, report_console

RECIPE_HELP = "Recipe: a name (see `eagle3 recipes`), a YAML file, 'auto' (by the target's model_type) or 'none'."


def _flag_params() -> list[inspect.Parameter]:
    types = field_types()
    params = [
        inspect.Parameter("recipe", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                          default=typer.Option("auto", "--recipe", help=RECIPE_HELP)),
        inspect.Parameter("print_config", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--print-config",
                                               help="Print the resolved settings as JSON and exit.")),
    ]
    for f in dataclasses.fields(TrainConfig):
        typ = types[f.name]
        flag = "--" + f.name.replace("_", "-")
        decl = f"{flag}/--no-{f.name.replace('_', '-')}" if typ is bool else flag
        params.append(inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[typ],
            default=typer.Option(None, decl, help=f"{f.metadata['help']} (default: {f.default})",
                                 show_default=False)))
    return params


def _model_type(flags: dict) -> str | None:
    """The target family for --recipe auto: from the store's manifest, else the target config."""
    from pathlib import Path

    if flags.get("data"):
        from ..features import MANIFEST, StoreError, read_manifest

        if not (Path(flags["data"]) / MANIFEST).exists():
            fail(f"{flags['data']} is not a feature store (no {MANIFEST}): run `eagle3 gen-data` first")
        try:
            return read_manifest(flags["data"]).model_type
        except StoreError as e:
            fail(str(e))
    if flags.get("model"):
        from ..layers import text_config
        from ..target import TargetSpec, load_config

        try:
            cfg = load_config(TargetSpec(model=flags["model"], revision=flags.get("revision"),
                                         trust_remote_code=bool(flags.get("trust_remote_code"))))
        except (OSError, ValueError) as e:
            fail(f"cannot read the config of {flags['model']}: {e}")
        return getattr(text_config(cfg), "model_type", None)
    return None


def train(**kwargs):
    """Train an EAGLE-3 draft with training-time test on a gen-data feature store."""
    from ..train_config import resolve

    recipe = kwargs.pop("recipe")
    print_config = kwargs.pop("print_config")
    try:
        cfg, used = resolve(recipe, kwargs, _model_type(kwargs) if recipe == "auto" else None)
    except ValueError as e:
        fail(str(e))
    if recipe == "auto":
        console.print(f"recipe: {used or 'none (no recipe for this model family: defaults)'}", highlight=False)
    if print_config:
        typer.echo(json.dumps({"recipe": used, **cfg.to_dict()}, indent=2))
        return
    from ..trainer import TrainError, train as run_training

    try:
        result = run_training(cfg, recipe=used, console=console)
    except TrainError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail(f"interrupted: checkpoints in {cfg.out}/checkpoints are kept; continue with the same command "
             "plus --resume", code=130)
    if result.stopped:
        fail(result.stopped)
    console.print(f"stopped after {result.step} optimizer steps: {result.limit}", highlight=False)
    console.print(f"draft written to {result.out} (checkpoints in {result.out / 'checkpoints'})", highlight=False)


train.__signature__ = inspect.Signature(_flag_params())
train.__annotations__ = {p.name: p.annotation for p in train.__signature__.parameters.values()}


def recipes(name: Optional[str] = typer.Argument(None, help="Show this recipe's YAML.")):
    """List the training recipes (or print one)."""
    from rich.table import Table

    from ..train_config import FAMILIES, read_recipe, recipe_names, recipe_source

    if name:
        try:
            typer.echo(recipe_source(name)[1])
        except ValueError as e:
            fail(str(e))
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
