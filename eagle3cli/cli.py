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
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
):
    """Train, evaluate and ship EAGLE-3 draft heads."""


def _register():
    for name, module, func in COMMANDS:
        fn = getattr(importlib.import_module(f"{__package__}.commands.{module}"), func)
        app.command(name)(boundary(fn))  # the one place where user errors become one line


_register()


def main():
    """Run the CLI. A flag the parser refuses (an unknown choice, a number that is not one) is one
    ``error:`` line naming the command's --help, exit 2, before the command runs."""
    try:
        from typer._click import exceptions as cx  # typer's own click
    except ImportError:  # typer before it carried one
        from click import exceptions as cx

    try:
        code = app(standalone_mode=False)
    except cx.NoArgsIsHelpError as e:
        typer.echo(e.ctx.get_help())
        raise SystemExit(0) from None
    except cx.UsageError as e:
        where = f"eagle3 {e.ctx.command_path.split(' ', 1)[1]}" if e.ctx and " " in e.ctx.command_path else "eagle3"
        message = " ".join(e.format_message().replace("Value error, ", "").split())
        report(f"{message} (see `{where} --help`)")
        raise SystemExit(e.exit_code) from None
    except typer.Abort:
        report("aborted")
        raise SystemExit(1) from None
    except (Exception, KeyboardInterrupt) as e:  # raised outside a command (option parsing, callbacks)
        mapped = message_for(e)
        if mapped is None or debug():
            raise
        report(mapped[0])
        raise SystemExit(mapped[1]) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
