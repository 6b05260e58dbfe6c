"""`eagle3 convert`: a draft in any format in, the format an engine wants out (library: publish/formats/)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import typer

from ..config.options import CONVERT_TARGETS, Alias
from .common import Revision, TrustRemoteCode, aliased, fail, report_console


@aliased(("draft_dtype", Alias("--dtype")))
def convert(
    draft: str = typer.Argument(..., help="Draft directory in any format `eagle3 inspect` names."),
    to: Literal[CONVERT_TARGETS] = typer.Option(..., "--to", help="vllm and sglang write our files (both engines "
                                                "load them); speculators is vLLM's speculators format. A DFlash "
                                                "draft: zlab (= ours, vllm, sglang; llama.cpp's converter reads "
                                                "it too) or speculators."),
    out: Path = typer.Option(..., "--out", "-o", metavar="DIR", help="Folder to write the converted draft to."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: infers what the files do not "
                                        "record (layer ids, max positions) and supplies the embedding."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Layer ids 'j,j,j' (input of decoder layer j) "
                                         "for a draft that records none."),
    draft_dtype: Literal["keep", "bfloat16", "float16", "float32"] = typer.Option(
        "keep", "--draft-dtype", help="The converted draft's dtype (keep: as stored)."),
    revision: Optional[str] = Revision,
    trust_remote_code: bool = TrustRemoteCode,
):
    """Convert a draft (EAGLE reference, speculators, ModelOpt, SpecForge, ours; DFlash: z-lab, speculators)."""
    import torch

    from ..config.options import parse_layer_ids
    from ..publish.formats.writers import convert as run
    from ..publish.inspector import inspect_any

    dtypes = {"keep": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    target_config = target = None
    try:
        ids = parse_layer_ids(layers)
        if model:
            from ..model.target import TargetSpec, load_config, load_target

            spec = TargetSpec(model=model, revision=revision, dtype="float32", device="cpu",
                              trust_remote_code=trust_remote_code)
            target_config = load_config(spec)
            target = load_target(spec)
        path, note = run(draft, out, to, target_config=target_config, target=target, layer_ids=ids,
                         dtype=dtypes[draft_dtype], target_name=model)
    except OSError as e:  # transformers' words for target files it cannot find (FormatError: one line anyway)
        fail(str(e))
    show = report_console()
    for line in note.lines():
        show.print(line, highlight=False)
    if note.embed == "placeholder" and not note.format.startswith("dflash"):  # DFlash never ships one
        show.print("embedding: not in the files and no --model given: left out; the engines take the target's",
                   highlight=False)
    show.print(f"wrote {to} draft to {path}", highlight=False)
    rep, _ = inspect_any(path, target_config)
    for p in rep.problems:
        show.print(f"[red]problem:[/] {p}", highlight=False)
    if rep.summary.get("draft_type") == "dflash":  # each engine's own count of the block
        engines = ", ".join(f"{k}: {'yes' if v and rep.ok else 'no'}"
                            for k, v in (rep.summary.get("reads_correctly") or {}).items())
    else:
        engines = ", ".join(f"{k}: {'yes' if v and rep.ok else 'no'}"
                            for k, v in (rep.summary.get("engines") or {}).items())
    show.print(f"inspect on the result: {'ok' if rep.ok else 'problems found'} (format {rep.summary.get('format')}; "
               f"reads it correctly: {engines})", highlight=False)
    raise typer.Exit(0 if rep.ok else 1)
