"""The ``eagle3`` command: a thin typer layer; each sub-command lives in ``commands/``.

Command modules import the heavy library (torch, transformers) inside their functions, so
``eagle3 --help`` stays fast.
"""

from __future__ import annotations

import importlib

import typer

from . import __version__
from .core.errors import boundary, debug, message_for, report

app = typer.Typer(
    name="eagle3",
    help="Train, evaluate and ship EAGLE-3 speculative-decoding draft heads for any Hugging Face causal LM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# (command name, module in eagle3cli.commands, function). Order = order in --help.
COMMANDS = [
    ("gen-data", "gen_data", "gen_data"),
    ("merge-data", "merge_data", "merge_data"),
    ("train", "train", "train"),
    ("eval", "evaluate", "evaluate"),
    ("push", "push", "push"),
    ("export-gguf", "export_gguf", "export_gguf"),
    ("layers", "layers", "layers"),
    ("inspect", "inspect_cmd", "inspect"),
    ("convert", "convert", "convert"),
    ("recipes", "train", "recipes"),
    ("quickstart", "quickstart", "quickstart"),
]


def _version(value: bool):
    if value:
        typer.echo(f"eagle3 {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
):
    """Train, evaluate and ship EAGLE-3 draft heads."""


def _register():
    for name, module, func in COMMANDS:
        full = f"{__package__}.commands.{module}"
        try:
            fn = getattr(importlib.import_module(full), func)
        except ModuleNotFoundError as e:
            if e.name != full:  # a real import error inside a built command must surface
                raise
            fn = _not_built(name)
        app.command(name)(boundary(fn))  # the one place where user errors become one line


def _not_built(name: str):
    def cmd():
        typer.echo(f"eagle3 {name}: not built yet in this version", err=True)
        raise typer.Exit(2)

    cmd.__doc__ = f"(not built yet) {name}"
    return cmd


_register()


def main():
    try:
        app()
    except (Exception, KeyboardInterrupt) as e:  # raised outside a command (option parsing, callbacks)
        mapped = message_for(e)
        if mapped is None or debug():
            raise
        report(mapped[0])
        raise SystemExit(mapped[1]) from None


if __name__ == "__main__":
    main()
