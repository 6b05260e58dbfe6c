"""Console, flags built from option dataclasses, the shared target options, and ``fail``."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from ..config.options import TargetOptions, flag_fields

console = Console(stderr=True, soft_wrap=True)  # one-line errors stay on one line in logs


def report_console(**kw) -> Console:
    """Stdout console for result tables: a terminal's own width, else wide enough that a log
    file (nohup, CI) keeps every column readable instead of rich's 80-column default."""
    import os
    import sys

    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=160 if wide else None, **kw)

# ---- flags generated from option dataclasses (eagle3cli/config/options.py) ----------------------------


def _plain_type(annotation) -> type:
    """bool, int, float, str, Path or list[str] from a field's annotation (``X | None`` -> X)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    head = text.split("|")[0].strip()
    if head.startswith(("list[", "List[")):
        return List[str]
    return {"bool": bool, "int": int, "float": float, "Path": Path}.get(head, str)


def flag_param(f: dataclasses.Field, required: bool = False, unset: bool = False,
               shown_default: object = dataclasses.MISSING) -> inspect.Parameter:
    """The typer parameter of one option field.

    ``unset`` (train): the flag defaults to None, "not given", so that a recipe's value stands
    unless the user typed the flag; bools then get a --no- form and the help shows the default
    (``shown_default`` when the field's own default, None, would not say what happens).
    """
    meta = f.metadata
    typ = meta.get("cli_type") or _plain_type(f.type)
    flag = "--" + f.name.replace("_", "-")
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if typ is bool and (unset or default is True):
        flag = f"{flag}/--no-{f.name.replace('_', '-')}"
    decls = [flag] + ([meta["short"]] if meta.get("short") else [])
    help_text = meta.get("help") or None
    kw = {k: meta[k] for k in ("envvar", "metavar") if meta.get(k)}
    if unset:
        shown = default if shown_default is dataclasses.MISSING else shown_default
        if "(default:" not in (help_text or ""):  # unless the help already says what the default is
            help_text = f"{help_text} (default: {shown})"
        return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[typ],
                                 default=typer.Option(None, *decls, help=help_text, show_default=False, **kw))
    if required or default is dataclasses.MISSING:
        default = ...
    annotation = typ if typ is bool or default is not None else Optional[typ]
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *decls, help=help_text, **kw))


def flags_from(cls, required: tuple[str, ...] = (), extra: list[inspect.Parameter] = (), unset: bool = False):
    """Decorator: give a command ``def cmd(**flags)`` one typer flag per option field of ``cls``
    (after the ``extra`` parameters), in field order. ``cls.SHOWN_DEFAULTS`` may name what a
    None default means for the ``unset`` help."""
    shown = getattr(cls, "SHOWN_DEFAULTS", {})

    def give(fn):
        params = list(extra) + [flag_param(f, f.name in required, unset, shown.get(f.name, dataclasses.MISSING))
                                for f in flag_fields(cls)]
        fn.__signature__ = inspect.Signature(params)
        fn.__annotations__ = {p.name: p.annotation for p in params}
        return fn

    return give


def target_flag(name: str, required: bool = False):
    """The typer option of one shared target-loading field, for a command that takes only some
    of them (inspect, layers, convert)."""
    field = {f.name: f for f in dataclasses.fields(TargetOptions)}[name]
    return flag_param(field, required).default


Revision = target_flag("revision")
TrustRemoteCode = target_flag("trust_remote_code")


def fail(message: str, code: int = 1):
    """Refuse with one clear line: raised as an Eagle3Error, so the CLI boundary (errors.py)
    prints it like every other user-facing error (with the traceback under EAGLE3_DEBUG=1)."""
    from ..core.errors import Eagle3Error

    error = Eagle3Error(message)
    error.exit_code = code
    raise error
