"""`eagle3 inspect`: validate a draft directory against the engines' contracts."""

from __future__ import annotations

from typing import Optional

import typer

from .common import Revision, TrustRemoteCode, console


def inspect(
    draft: str = typer.Argument(..., help="Draft directory (config.json + model.safetensors)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target to check the draft against."),
    revision: Optional[str] = Revision,
    trust_remote_code: bool = TrustRemoteCode,
):
    """Validate an EAGLE-3 or DFlash draft (ours or a third party's); exit 1 if it has problems."""
    from rich.table import Table

    from ..publish.formats.common import FORMATS
    from ..publish.inspector import inspect_any

    target_config = _target_config(model, revision, trust_remote_code)
    rep, _ = inspect_any(draft, target_config)
    if rep.summary.get("draft_type") == "dflash":
        _show_dflash(draft, model, rep)
    table = Table(title=f"EAGLE-3 draft {draft}", show_header=False)
    s = rep.summary
    rows = [
        ("format", FORMATS.get(s.get("format"), s.get("format"))),
        ("variant / options", f"{s.get('variant', 'eagle3')} / {', '.join(s.get('options') or {}) or 'none'}"),
        ("layers (input of layer j; vLLM)", s.get("layers_j")),
        ("layers (output of layer j-1; SGLang)", s.get("layers_j_minus_1")),
        # what the draft was built for; the --model's own size is its own row (a mismatch is a problem)
        ("hidden / built for target hidden", f"{s.get('hidden_size')} / {s.get('target_hidden_size')}"),
        ("vocab / draft vocab", f"{s.get('vocab_size')} / {s.get('draft_vocab_size')}"),
        ("parameters (exported)", f"{s['parameters']:,}" if "parameters" in s else None),
        ("dtype", f"{s.get('torch_dtype')} (tensors: {', '.join(s.get('weights_dtype', []))})"),
        ("max positions", s.get("max_position_embeddings")),
    ]
    if target_config is not None:
        from ..core.hf_utils import text_config

        rows.append((f"--model {model}: hidden / vocab", f"{text_config(target_config).hidden_size} / "
                     f"{text_config(target_config).vocab_size}"))
    if "target_layers" in s:
        rows.append(("target layers / engines' default j",
                     f"{s['target_layers']} / {s.get('target_default_layers_j')}"))
    for eng, ok in (s.get("engines") or {}).items():
        rows.append((f"{eng} reads it correctly", "yes" if ok and rep.ok else "no"))
    for eng, (ok, _) in (s.get("target_support") or {}).items():
        rows.append((f"{eng} accepts the target", {True: "yes", False: "no", None: "not checked"}[ok]))
    for k, v in rows:
        table.add_row(k, "-" if v is None else str(v))
    out = console.__class__()  # summary to stdout
    out.print(table)
    for line in (s.get("read_note") or [])[1:]:
        out.print(f"[cyan]{line.split(':', 1)[0]}:[/]{line.split(':', 1)[1]}", highlight=False)
    for p in rep.problems:
        out.print(f"[red]problem:[/] {p}", highlight=False)
    from ..engines.engine_support import unsupported_options

    for eng, missing in unsupported_options(s.get("options") or {}).items():
        if missing:
            out.print(f"[yellow]note:[/] {eng} does not implement {', '.join(missing)}", highlight=False)
    for ok, why in (s.get("target_support") or {}).values():
        if ok is False:
            out.print(f"[yellow]warning:[/] {why}", highlight=False)
    if s.get("format") not in (None, "ours"):
        out.print(f"convert: `eagle3 convert {draft} --to vllm --out DIR` writes a draft both engines read",
                  highlight=False)
    if rep.ok:
        out.print("[green]ok:[/] no problems found")
    raise typer.Exit(0 if rep.ok else 1)


def _show_dflash(draft: str, model: str | None, rep):
    """A DFlash draft: its block, each engine's own count of it, its layers in both counts, and one
    line per problem (publish/dflash_check.py); exit 1 if it has any."""
    from rich.table import Table

    from ..publish.formats.common import FORMATS

    s = rep.summary
    out = console.__class__()
    table = Table(title=f"DFlash draft {draft}", show_header=False)
    b = s.get("block_size")
    counts = s.get("engines") or {}
    rows = [
        ("format", FORMATS.get(s.get("format"), s.get("format"))),
        ("block size B (anchor + drafted)", b),
        ("vLLM speculative_config", counts.get("vllm")),
        ("SGLang", f"--speculative-algorithm DFLASH --speculative-num-draft-tokens {b}" if b else None),
        ("llama.cpp", f"--spec-type draft-dflash --spec-draft-n-max {b - 1}" if b else None),
        ("MASK id", s.get("mask_token_id")),
        ("draft layers / hidden / vocab", f"{s.get('num_hidden_layers')} / {s.get('hidden_size')} / "
                                          f"{s.get('vocab_size')}"),
        (f"target layers ({s.get('layer_ids_key')})", None),
        ("  input of layer j (this package, speculators, engines' capture)", s.get("layers_j")),
        ("  output of layer j-1 (z-lab's dflash_config)", s.get("layers_output")),
        ("num_target_layers", s.get("num_target_layers")),
        ("parameters (exported)", f"{s['parameters']:,}" if "parameters" in s else None),
        ("dtype", f"{s.get('torch_dtype')} (tensors: {', '.join(s.get('weights_dtype', []))})"),
    ]
    if model:
        rows.append((f"--model {model}: layers", s.get("target_layers")))
    for eng, ok in (s.get("reads_correctly") or {}).items():
        rows.append((f"{eng} reads it correctly", "yes" if ok else "no"))
    for k, v in rows:
        table.add_row(k, "-" if v is None else str(v))
    out.print(table)
    for p in rep.problems:
        out.print(f"[red]problem:[/] {p}", highlight=False)
    if not model:
        out.print("note: give --model TARGET to check the MASK id, the layer ids and the sizes against the target",
                  highlight=False)
    if rep.ok:
        out.print("[green]ok:[/] no problems found")
    raise typer.Exit(0 if rep.ok else 1)


def _target_config(model: str | None, revision, trust_remote_code: bool):
    """--model's config (None without one)."""
    if not model:
        return None
    from ..model.target import TargetSpec, load_config

    return load_config(TargetSpec(model=model, revision=revision, trust_remote_code=trust_remote_code))
