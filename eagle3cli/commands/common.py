"""Console, flags built from option dataclasses, the shared target options, and ``fail``."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from pathlib import Path
from typing import List, Literal, Optional, Union, get_args, get_origin

import typer
from rich.console import Console

from ..config.options import Alias, TargetOptions, flag_fields
from ..core.errors import OptionError

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
    (``shown_default`` when the field's own default, None, would not say what happens). A field
    with ``choices`` parses as their ``Literal``: ``--help`` lists them and click refuses others.
    """
    meta = f.metadata
    typ = meta.get("cli_type") or _plain_type(f.type)
    if meta.get("choices") and not meta.get("cli_type"):
        typ = List[Literal[meta["choices"]]] if typ is List[str] else Literal[meta["choices"]]
    name = (meta.get("flag") or f.name).replace("_", "-")
    flag = "--" + name
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if meta.get("cli_default", dataclasses.MISSING) is not dataclasses.MISSING:
        default = meta["cli_default"]
    if typ is bool and (unset or default is True):
        flag = f"{flag}/--no-{name}"
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


# ---- old spellings: hidden, working for one minor version, one deprecation line each ------------

ALIAS_PREFIX = "old__"  # the parameter of an old spelling: old__<new parameter>__<n>
GONE_IN = "0.4.0"


def aliased(*pairs: tuple[str, Alias], params: dict[str, inspect.Parameter] | None = None):
    """Decorator: keep the old spellings of flags working. Each pair is (the new flag's parameter,
    Alias): a hidden option ``Alias.old`` whose value, when given, goes to that parameter after one
    line on stderr naming the new flag. Apply it above a function that has its final signature."""

    def give(fn):
        sig = inspect.signature(fn)
        by_name = {**{p.name: p for p in sig.parameters.values()}, **(params or {})}
        extra, table, required = [], [], {}
        for n, (new, alias) in enumerate(pairs):
            target = by_name[new]
            if target.default.default is ... and new not in required:  # required: checked once aliases are in
                info = copy.copy(target.default)
                info.default, info.help = None, f"{info.help} (required)"
                by_name[new] = target = target.replace(default=info, annotation=Optional[target.annotation])
                required[new] = _long_name(info)
            new_flag = _long_name(target.default)
            typ = alias.cli_type or _strip_optional(target.annotation)
            pname = f"{ALIAS_PREFIX}{new}__{n}"
            extra.append(inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[typ],
                                           default=typer.Option(None, alias.old, hidden=True, show_default=False)))
            table.append((pname, new, alias, new_flag))

        @functools.wraps(fn)
        def run(**kw):
            for pname, new, alias, new_flag in table:
                value = kw.pop(pname)
                if value is None or value == []:
                    continue
                if kw.get(new) not in (None, [], by_name[new].default.default):
                    raise OptionError(f"{alias.old} is the old name of {new_flag}: give {new_flag} only")
                console.print(f"eagle3: {alias.old} is deprecated and goes in {GONE_IN}: use {new_flag}",
                              highlight=False, markup=False)
                kw[new] = alias.value(value) if alias.value else value
            missing = [flag for new, flag in required.items() if kw.get(new) is None]
            if missing:
                raise OptionError(f"missing option {missing[0]}")
            return run.impl(**kw)

        run.impl = fn
        run.aliases = [(new, alias.old, new_flag) for _, new, alias, new_flag in table]
        params_now = [by_name[p] for p in sig.parameters] + extra
        run.__signature__ = inspect.Signature(params_now)
        run.__annotations__ = {p.name: p.annotation for p in params_now}
        return run

    return give


def _long_name(option) -> str:
    """The first long spelling of a typer option (``--store`` of ``--store/--no-store``)."""
    decl = next(d for d in option.param_decls if d.startswith("--"))
    return decl.split("/")[0]


def _strip_optional(annotation):
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if get_origin(annotation) is Union and len(args) == 1 else annotation


def flags_from(cls, required: tuple[str, ...] = (), extra: list[inspect.Parameter] = (), unset: bool = False):
    """Decorator: give a command ``def cmd(**flags)`` one typer flag per option field of ``cls``
    (after the ``extra`` parameters), in field order, and the old spellings the fields name
    (:func:`aliased`). ``cls.SHOWN_DEFAULTS`` may name what a None default means for the
    ``unset`` help."""
    shown = getattr(cls, "SHOWN_DEFAULTS", {})

    def give(fn):
        params = list(extra) + [flag_param(f, f.name in required, unset, shown.get(f.name, dataclasses.MISSING))
                                for f in flag_fields(cls)]
        fn.__signature__ = inspect.Signature(params)
        fn.__annotations__ = {p.name: p.annotation for p in params}
        pairs = [(f.name, a) for f in flag_fields(cls) for a in f.metadata.get("aliases", ())]
        return aliased(*pairs)(fn)

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
