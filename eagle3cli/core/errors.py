"""One base class for every user-facing error, and the one place that turns them into a line.

Library code raises a subclass of :class:`Eagle3Error` (GenDataError, TrainError, EvalError,
PushError, SourceError, ...) whose message says what is wrong and what to do. The CLI boundary
(:func:`boundary`, wrapped around every command once, in ``cli.py``) prints it as one line
``error: ...`` and exits non-zero. A full disk (``OSError`` ENOSPC) and Ctrl-C are mapped there
too. Anything else is a bug and keeps its traceback; ``EAGLE3_DEBUG=1`` shows the traceback of
the mapped errors as well.

This module imports nothing heavy: the CLI loads it before any command runs.
"""

from __future__ import annotations

import errno
import functools
import os

INTERRUPTED = 130  # the shell's code for SIGINT


class Eagle3Error(Exception):
    """A problem the user can fix; ``str(e)`` is one line that says what to do."""

    exit_code = 1


class OptionError(Eagle3Error, ValueError):
    """A flag (or setting) whose value cannot work. A ValueError too, so library callers that
    catch ValueError around parsing keep catching it."""


class Interrupted(Eagle3Error):
    """Ctrl-C, with a hint of what was kept and how to continue."""

    exit_code = INTERRUPTED


def debug() -> bool:
    return os.environ.get("EAGLE3_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def one_line(text: str) -> str:
    """The first non-empty line of a message (library messages may carry details below)."""
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def disk_full_message(e: OSError) -> str:
    where = f" writing {e.filename}" if getattr(e, "filename", None) else ""
    return (f"no space left on the device{where}: free some space (or choose another --out) and run the same "
            "command again; finished shards and checkpoints are kept")


def message_for(e: BaseException) -> tuple[str, int] | None:
    """(line, exit code) for an error the boundary maps, None for anything else (a bug)."""
    if isinstance(e, Eagle3Error):
        return one_line(str(e)) or type(e).__name__, e.exit_code
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return disk_full_message(e), 1
    if isinstance(e, KeyboardInterrupt):
        return "interrupted (Ctrl-C)", INTERRUPTED  # gen-data and train say what is kept themselves
    return None


def report(line: str):
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(line)}", highlight=False)


def boundary(fn):
    """Wrap a CLI command: mapped errors become one ``error:`` line and an exit code."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (Eagle3Error, OSError, KeyboardInterrupt) as e:
            mapped = message_for(e)
            if mapped is None or debug():
                raise
            import typer

            report(mapped[0])
            raise typer.Exit(mapped[1]) from None

    return run


def check_out_dir(path, flag: str = "--out"):
    """Fail now, before a model is loaded, if ``path`` cannot be (or become) a folder we write to."""
    from pathlib import Path

    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise Eagle3Error(f"{flag} {path} is an existing file, not a folder: choose another {flag}")
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise Eagle3Error(f"{flag} {path}: {parent} is a file, not a folder: choose another {flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise Eagle3Error(f"{flag} {path}: no permission to write in {parent}: choose another {flag}")
