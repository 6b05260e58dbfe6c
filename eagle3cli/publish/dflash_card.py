"""The Hub model card of a DFlash draft (``model_card.render_card`` hands a DFlash config here):
each engine's serve line with its own count of the block, the draft's facts, the eval table and
the training record, through ``templates/model_card_dflash.md``.

The counts (DESIGN §9, the engines' sources): a block of B is the anchor and B-1 drafted tokens;
vLLM counts the drafted ones (``num_speculative_tokens`` = B-1), SGLang the whole block
(``--speculative-num-draft-tokens`` = B), llama.cpp drafts at most B-1 (``--spec-draft-n-max``,
clamped there by ``common/speculative.cpp``). A mismatch still serves, wrongly.
"""

from __future__ import annotations

import json

from .dflash_check import engine_counts
from .dflash_layout import METADATA_KEY, block_size_of, layer_fields, layer_ids_of, mask_token_of

TEMPLATE = "model_card_dflash.md"
TAGS = ["eagle3", "dflash", "speculative-decoding"]


def vllm_command(target: str, draft: str, b: int) -> str:
    spec = json.dumps({"method": "dflash", "model": draft, **{k: v for k, v in engine_counts(b)["vllm"].items()
                                                              if k != "method"}}, separators=(",", ":"))
    return f"vllm serve {target} --speculative-config '{spec}'"


def sglang_command(target: str, draft: str, b: int) -> str:
    return (f"python -m sglang.launch_server --model {target} --speculative-algorithm DFLASH \\\n"
            f"  --speculative-draft-model-path {draft} --speculative-num-draft-tokens {b}")


def llamacpp_command(repo: str, b: int, gguf_files=()) -> str:
    files = sorted(gguf_files)
    name = files[0] if files else "draft-f32.gguf"
    get = (f"hf download {repo} {name} --local-dir .\n" if files else
           f"hf download {repo} --local-dir draft && eagle3 export-gguf draft --model TARGET_DIR "
           "--llama-cpp LLAMA_CPP_DIR -o .\n")
    return get + f"llama-server -m TARGET.gguf -md {name} --spec-type draft-dflash --spec-draft-n-max {b - 1}"


def facts(config: dict, target: str | None) -> list[tuple[str, str]]:
    f = layer_fields(config)
    b = block_size_of(config)
    key, ids, shift = layer_ids_of(config)
    j = [k + shift for k in ids or []]
    return [
        ("Target", f"`{target}`" if target else "not recorded"),
        ("Draft architecture", f"DFlash: {f.get('num_hidden_layers')} Qwen3-style layer(s), the target's embedding "
                               "and LM head (not in this repo)"),
        ("Block size B", f"{b} (the anchor and {b - 1} drafted tokens, in one forward)"),
        ("MASK token id", str(mask_token_of(config))),
        ("Target layers read (j: input of decoder layer j; what the engines capture)", ", ".join(map(str, j))),
        (f"Same layers as k = j − 1 (output of layer k; z-lab's `{key}`)", ", ".join(str(x - 1) for x in j)),
        ("Target depth (`num_target_layers`)", str(config.get("num_target_layers"))),
        ("Hidden size", str(f.get("hidden_size"))),
        ("Weights", f"`model.safetensors`, {config.get('torch_dtype') or config.get('dtype') or '?'}"),
    ]


def training_rows(meta: dict, base_rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """EAGLE-3's rows (``model_card.training_rows``) with DFlash's own: blocks, layers, anchors and the
    loss's position weights (a gamma, or D-PACE's alpha)."""
    dpace = meta.get("position_weights") == "dpace"
    weights = (("Loss position weights: D-PACE, alpha", "dpace_alpha") if dpace else
               ("Loss decay gamma (exp(-(k-1)/gamma))", "loss_gamma"))
    extra = [(label, str(meta[k])) for label, k in (("Draft layers", "draft_layers"), ("Block size", "block_size"),
                                                    ("Anchors per sequence", "num_anchors"), weights)
             if meta.get(k) is not None]
    rows = [r for r in base_rows if not r[0].startswith(("Training-time-test", "Final top-1"))]
    metrics = meta.get("metrics") or {}
    if metrics.get("acc"):
        where = " (held-out)" if metrics.get("split") == "held-out" else ""
        rows.append((f"Final top-1 agreement per block position{where}",
                     ", ".join(f"{a:.3f}" if isinstance(a, (int, float)) else "—" for a in metrics["acc"])))
    return extra + rows


def card_values(config: dict, repo_id: str, target: str | None, gguf_files=()) -> dict:
    """The DFlash template's values that differ from EAGLE-3's."""
    b = block_size_of(config)
    t = target or "TARGET"
    return {"facts": facts(config, target), "block_size": b, "vllm_command": vllm_command(t, repo_id, b),
            "sglang_command": sglang_command(t, repo_id, b),
            "llamacpp_command": llamacpp_command(repo_id, b, gguf_files),
            "draft_layers": layer_fields(config).get("num_hidden_layers"),
            "meta": config.get(METADATA_KEY) or {}}
