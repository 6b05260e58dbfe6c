"""Options shared by several commands, and the one-line error convention."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

console = Console(stderr=True, soft_wrap=True)  # one-line errors stay on one line in logs


def report_console(**kw) -> Console:
    """Stdout console for result tables: a terminal's own width, else wide enough that a log
    file (nohup, CI) keeps every column readable instead of rich's 80-column default."""
    import os
    import sys

    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=160 if wide else None, **kw)

Model = typer.Option(..., "--model", "-m", help="Target model: a Hub id or a local folder.")
Revision = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of the target.")
Dtype = typer.Option("auto", "--dtype", help="auto|bfloat16|float16|float32 (auto: bf16 on GPU, fp32 on CPU).")
Device = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ... (default: cuda if available).")
Load8 = typer.Option(False, "--load-in-8bit", help="Load the target 8-bit with bitsandbytes.")
Load4 = typer.Option(False, "--load-in-4bit", help="Load the target 4-bit with bitsandbytes.")
Adapter = typer.Option(None, "--adapter", help="A PEFT adapter (folder or Hub id) applied on top of the target.")
TrustRemoteCode = typer.Option(False, "--trust-remote-code", help="Run the model repo's own code (off by default).")


def target_spec(model: str, revision: Optional[str], dtype: str, device: Optional[str], load_in_8bit: bool,
                load_in_4bit: bool, adapter: Optional[str], trust_remote_code: bool):
    from ..target import TargetSpec

    return TargetSpec(model=model, revision=revision, dtype=dtype, device=device, load_in_8bit=load_in_8bit,
                      load_in_4bit=load_in_4bit, adapter=adapter, trust_remote_code=trust_remote_code)


def fail(message: str, code: int = 1):
    """Print one clear line and exit: the convention for every user-facing error."""
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # "[...]" is text here
    raise typer.Exit(code)
