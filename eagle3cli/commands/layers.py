"""`eagle3 layers`: which target streams the draft reads, in both counts."""

from __future__ import annotations

import warnings
from typing import Optional

import typer

from .common import Revision, TrustRemoteCode, console, target_flag


def layers(
    model: str = target_flag("model", required=True),
    override: Optional[str] = typer.Option(None, "--layers", help="Override, e.g. 2,16,29 (input-of-layer-j count)."),
    revision: Optional[str] = Revision,
    trust_remote_code: bool = TrustRemoteCode,
):
    """Print the target's layer count, the three streams EAGLE-3 captures and DFlash's spaced ones."""
    from rich.console import Console

    from ..config.options import parse_layer_ids
    from ..core.hf_utils import text_config
    from ..model.layers import choose_layers, default_layer_ids, dflash_output_layer_ids
    from ..model.target import TargetSpec, load_config

    # A bad target (TargetError) or --layers (OptionError) is one line at the CLI boundary.
    cfg = load_config(TargetSpec(model=model, revision=revision, trust_remote_code=trust_remote_code))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = choose_layers(cfg, parse_layer_ids(override))
    t = text_config(cfg)
    out = Console(markup=False, highlight=False)  # 'hidden_states[j]' is not rich markup
    out.print(f"model            {model} ({getattr(t, 'model_type', '?')})")
    out.print(f"decoder layers   N = {choice.n_layers}")
    out.print(f"hidden size      {t.hidden_size}")
    out.print(f"vocab size       {t.vocab_size}")
    out.print(f"layers j         {', '.join(map(str, choice.ids))}   "
              "(input of decoder layer j = hidden_states[j]; vLLM)")
    out.print(f"layers j-1       {', '.join(map(str, choice.output_ids))}   "
              "(output of layer j-1; SGLang, reference EAGLE)")
    out.print(f"engines' default {', '.join(map(str, default_layer_ids(choice.n_layers)))}")
    try:
        dflash = dflash_output_layer_ids(choice.n_layers)
    except ValueError:  # too few layers for z-lab's five streams
        dflash = None
    if dflash:
        out.print(f"dflash k         {', '.join(map(str, dflash))}   (output of layer k; dflash_config)")
        out.print(f"dflash j         {', '.join(str(k + 1) for k in dflash)}   (hidden_states[j]; gen-data)")
    for w in caught:
        console.print(f"[yellow]warning:[/] {w.message}", highlight=False)
