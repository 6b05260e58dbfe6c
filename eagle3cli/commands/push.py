"""`eagle3 push`: publish a draft as a Hub repo with a model card (library: eagle3cli/publish/push.py)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..config.options import GGUFType
from .common import console, fail


def push(
    draft_dir: Path = typer.Argument(..., metavar="DRAFT_DIR",
                                     help="The draft directory (config.json + model.safetensors)."),
    repo: str = typer.Option(..., "--repo", metavar="OWNER/NAME",
                             help="Hub repo to publish to, OWNER/NAME (created if missing)."),
    private: bool = typer.Option(False, "--private", help="Create the repo private."),
    branch: Optional[str] = typer.Option(None, "--branch", metavar="BRANCH",
                                         help="Upload to this branch (created if missing)."),
    create_pr: bool = typer.Option(False, "--create-pr",
                                   help="Open a pull request against main instead of committing."),
    token: Optional[str] = typer.Option(None, "--token", help="Hub token (default: HF_TOKEN, else your saved login)."),
    eval_results: List[Path] = typer.Option([], "--eval-results", metavar="FILE",
                                            help="results.json from `eagle3 eval` (repeatable): "
                                                 "the card's evaluation table."),
    dry_run: Optional[Path] = typer.Option(None, "--dry-run", metavar="OUT_DIR",
                                           help="Write the folder that would be uploaded to OUT_DIR; upload nothing."),
    commit_message: Optional[str] = typer.Option(None, "--commit-message",
                                                 help="Commit message (or pull request title)."),
    license: Optional[str] = typer.Option(None, "--license",
                                          help="Licence id for the card (default: the target's, when recorded)."),
    base_model: Optional[str] = typer.Option(None, "--base-model", metavar="OWNER/NAME",
                                             help="The target's Hub id, when training recorded a local folder."),
    dataset_id: List[str] = typer.Option([], "--dataset-id", metavar="OWNER/NAME",
                                         help="Hub dataset the draft was trained on (repeatable), "
                                              "when gen-data read a local file."),
    gguf: List[GGUFType] = typer.Option([], "--gguf",
                                        help="Also upload draft-TYPE.gguf for llama.cpp "
                                             "(repeatable; see `eagle3 export-gguf`)."),
    target_gguf: Optional[Path] = typer.Option(None, "--target-gguf", metavar="FILE",
                                               help="With --gguf: the target's GGUF "
                                                    "(its tokenizer goes into the draft GGUF)."),
    llama_cpp: Optional[Path] = typer.Option(None, "--llama-cpp", metavar="DIR",
                                             help="With --gguf: a llama.cpp tree whose convert_hf_to_gguf.py "
                                                  "writes the GGUF (default: $EAGLE3_LLAMA_CPP)."),
):
    """Publish a draft to the Hugging Face Hub: config, weights, model card, training record."""
    from ..publish import push as lib
    from ..publish.formats.writers import as_ours
    from ..publish.gguf_export import GGUFOptions

    gguf = [GGUFType(t).value for t in gguf]
    opts = None
    if gguf:
        from ..publish.export import METADATA_KEY, read_config

        recorded = ((read_config(draft_dir).get(METADATA_KEY) or {}).get("target")
                    if (draft_dir / "config.json").is_file() else None)
        opts = GGUFOptions(list(gguf), target_dir=recorded if recorded and Path(recorded).is_dir() else None,
                           target_gguf=str(target_gguf) if target_gguf else None,
                           llama_cpp=str(llama_cpp) if llama_cpp else None)
    try:
        draft_dir = Path(as_ours(draft_dir, say=lambda m: console.print(m, highlight=False)))  # any format
        if dry_run is not None:
            res = lib.dry_run(draft_dir, dry_run, repo, eval_results, license=license, base_model=base_model,
                              dataset_ids=dataset_id, gguf=opts)
            console.print(f"dry run: {res.note}; nothing uploaded", highlight=False)
            for name in res.files:
                size = (res.folder / name).stat().st_size
                typer.echo(f"{res.folder / name}\t{size:,} bytes")
            return
        res = lib.push(draft_dir, repo, private=private, branch=branch, create_pr=create_pr, token=token,
                       eval_results=eval_results, commit_message=commit_message, license=license,
                       base_model=base_model, dataset_ids=dataset_id, gguf=opts)
    except lib.DraftRejected as e:
        for p in e.problems if len(e.problems) > 1 else ():  # one problem: the error line says it
            console.print(f"  - {p}", highlight=False)
        fail(str(e))
    typer.echo(f"pushed {', '.join(res.files)} to {res.repo_url}")
    if res.pr_url:
        typer.echo(f"pull request: {res.pr_url}")
    elif res.commit_url:
        typer.echo(f"commit: {res.commit_url}")
