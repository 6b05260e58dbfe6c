"""One base class for every user-facing error, and the one place that turns them into a line.

Library code raises a subclass of :class:`Eagle3Error` (GenDataError, TrainError, EvalError,
PushError, SourceError, ...) whose message says what is wrong and what to do. The CLI boundary
(:func:`boundary`, wrapped around every command once, in ``cli.py``) prints it as one line
``error: ...`` and exits non-zero. A disk that fills or refuses a write (``OSError`` ENOSPC,
EDQUOT, EROFS, EFBIG, and safetensors' wrapping of them) and Ctrl-C are mapped there too. Anything else is
a bug and keeps its traceback; ``EAGLE3_DEBUG=1`` shows the traceback of the mapped errors as well.

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


# What went wrong and what to do, for the OS errors a write meets. Every line ends the same way:
# writers replace files only once complete, so what was finished before the fault is kept.
_WRITE_FAULTS = {
    errno.ENOSPC: ("no space left on the device", "free some space (or choose another --out)"),
    errno.EROFS: ("read-only file system", "choose another --out on a writable disk (or remount it read-write)"),
    errno.EACCES: ("permission denied", "allow writing to that folder (or choose another --out)"),
    errno.EPERM: ("operation not permitted", "allow writing to that folder (or choose another --out)"),
    errno.ENOTDIR: ("not a directory", "a part of that path is a file: move it away (or choose another --out)"),
    errno.EEXIST: ("file exists", "a file is where a folder should be: move it away (or choose another --out)"),
    errno.EISDIR: ("is a directory", "a folder is where a file should be: move it away (or choose another --out)"),
    errno.EFBIG: ("file too large for the file system (or this process's file-size limit)",
                  "choose another --out on a file system that takes larger files"),
}
if hasattr(errno, "EDQUOT"):
    _WRITE_FAULTS[errno.EDQUOT] = ("disk quota exceeded",
                                   "free some space or raise the quota (or choose another --out)")
# Errors only a write can meet: mapped at the boundary wherever they surface.
DISK_ERRNOS = frozenset(n for n in (errno.ENOSPC, errno.EROFS, errno.EFBIG, getattr(errno, "EDQUOT", None)) if n)


def write_failure_message(e: OSError, path=None) -> str:
    """One line for an OS error while writing ``path`` (default: the error's own file name)."""
    what, todo = _WRITE_FAULTS.get(e.errno, None) or (
        f"{(e.strerror or os.strerror(e.errno or 0)).lower()} (errno {e.errno})",
        "check the disk (or choose another --out)")
    where = path if path is not None else getattr(e, "filename", None)
    where = f" writing {where}" if where else ""
    return f"{what}{where}: {todo} and run the same command again; finished shards and checkpoints are kept"


def disk_full_message(e: OSError) -> str:
    return write_failure_message(e)


class WriteError(Eagle3Error):
    """An output could not be written (full disk, read-only file system, permission, quota, a path
    component that is a file). The half-written file was removed or never renamed into place."""

    def __init__(self, path, error: OSError):
        self.path, self.error = path, error
        super().__init__(write_failure_message(error, path))


def os_error_of(e: BaseException) -> OSError | None:
    """The OSError behind ``e``: itself, or the one safetensors reports as text ("... (os error 28)")."""
    if isinstance(e, OSError):
        return e
    if type(e).__name__ == "SafetensorError":
        import re

        m = re.search(r"os error (\d+)", str(e))
        if m:
            n = int(m.group(1))
            return OSError(n, os.strerror(n))
    return None


def message_for(e: BaseException) -> tuple[str, int] | None:
    """(line, exit code) for an error the boundary maps, None for anything else (a bug)."""
    if isinstance(e, Eagle3Error):
        return one_line(str(e)) or type(e).__name__, e.exit_code
    os_error = os_error_of(e)
    if os_error is not None and os_error.errno in DISK_ERRNOS:
        return write_failure_message(os_error), 1
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
        except (Exception, KeyboardInterrupt) as e:
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
