"""`eagle3 export-gguf`: a draft as a llama.cpp EAGLE-3 GGUF (library: eagle3cli/publish/gguf_export.py)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..config.options import Alias, GGUFType
from .common import aliased, console, fail


@aliased(("model", Alias("--target")))
def export_gguf(
    draft_dir: Path = typer.Argument(..., metavar="DRAFT_DIR",
                                     help="The draft directory (config.json + model.safetensors)."),
    out: Path = typer.Option(Path("gguf"), "--out", "-o", help="Folder for draft-TYPE.gguf (and target-TYPE.gguf)."),
    outtype: List[GGUFType] = typer.Option(["f32"], "--outtype", help="The GGUF's weight type; "
                                                      "repeatable."),
    model: Optional[str] = typer.Option(None, "--model", "-m", metavar="DIR",
                                        help="The target's HF folder (default: the one training recorded, if "
                                             "local)."),
    target_gguf: Optional[Path] = typer.Option(None, "--target-gguf", metavar="FILE",
                                               help="The target's GGUF: its tokenizer goes into the draft GGUF "
                                                    "(no llama.cpp sources needed)."),
    with_target: bool = typer.Option(False, "--with-target", help="Also convert the target (needs --model and "
                                     "--llama-cpp)."),
    llama_cpp: Optional[Path] = typer.Option(None, "--llama-cpp", metavar="DIR",
                                             help="llama.cpp source tree with convert_hf_to_gguf.py "
                                                  "(default: $EAGLE3_LLAMA_CPP)."),
):
    """Write the draft as a llama.cpp GGUF (EAGLE-3: --spec-type draft-eagle3; DFlash: draft-dflash)."""
    from ..publish.export import METADATA_KEY, read_config
    from ..publish.gguf_export import export_gguf as run
    from ..publish.gguf_export import serve_line
    from ..publish.inspector import inspect_draft

    rep = inspect_draft(draft_dir)
    if not rep.ok:
        for p in rep.problems:
            console.print(f"  - {p}", highlight=False)
        fail(f"{draft_dir}: {len(rep.problems)} problem(s) found by `eagle3 inspect`; not exporting")
    target = model
    if target is None:
        recorded = (read_config(draft_dir).get(METADATA_KEY) or {}).get("target")
        if recorded and Path(recorded).is_dir():
            target = recorded
    if target is None and target_gguf is None:
        fail("pass --model DIR (the target's HF folder, with --llama-cpp DIR) or --target-gguf FILE")
    written = {}
    outtype = [GGUFType(t).value for t in outtype]
    for t in outtype:  # a GGUFExportError is one line at the CLI boundary
        files, warnings = run(draft_dir, out, t, target_dir=target, target_gguf=target_gguf,
                              with_target=with_target, llama_cpp=llama_cpp,
                              log=lambda m: console.print(m, highlight=False))
        for w in warnings:
            console.print(f"[yellow]converter warning:[/] {w}", highlight=False)
        written[t] = files
    for t, files in written.items():
        for kind, path in files.items():
            typer.echo(f"{kind}\t{t}\t{path}")
    t = outtype[0]
    tg = written[t].get("target") or target_gguf or f"TARGET-{t}.gguf"
    typer.echo(f"serve: {serve_line(draft_dir, tg, written[t]['draft'])}")
