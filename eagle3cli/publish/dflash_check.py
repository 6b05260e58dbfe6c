"""Every way a DFlash draft loads in an engine and then serves wrongly, one line each (docs/formats.md).

An engine that misreads a DFlash draft still loads it: its acceptance just collapses. So
``inspect`` (and every reader, through :func:`check_dflash`) names each of these before anything
is served:

- the block size: top level and ``dflash_config`` disagreeing (llama.cpp's converter reads
  ``dflash_config`` first, speculators' converter the top level), the training record or
  speculators' proposal count disagreeing; each engine's own count is printed (vLLM
  ``num_speculative_tokens`` = B-1, SGLang ``--speculative-num-draft-tokens`` = B, llama.cpp
  ``--spec-draft-n-max`` at most B-1, ``common/speculative.cpp`` clamps it there);
- ``fc``'s width against the number of target layers times the target's hidden size;
- a MASK id outside the embedding (the target's, with ``--model``), or equal to eos or pad;
- target layer ids out of range, or in the wrong convention for the key that holds them
  (z-lab's ``dflash_config.target_layer_ids`` count layer outputs, speculators'
  ``aux_hidden_state_layer_ids`` and the training record count layer inputs);
- a causal flag, a sliding window or a RoPE style other than the bidirectional, full-attention,
  rotate-half block this package trains;
- any config key no engine reads (a misspelt key is a default silently taken).

Facts from the engines' sources: llama.cpp (llama-cpp-python 0.3.36's vendored copy,
``conversion/qwen.py`` ``DFlashModel`` and ``common/speculative.cpp``), speculators 0.9.0
(``models/dflash/config.py``, ``convert/dflash/converter.py``), vLLM 0.32.0 and SGLang 0.5.23
(DESIGN §9 of the contract).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from .dflash_layout import (
    ARCHITECTURE,
    CONFIG,
    METADATA_KEY,
    WEIGHTS,
    block_size_of,
    layer_fields,
    layer_ids_of,
    layout_of,
    mask_token_of,
)
from .draft_check import CorruptDraft, config_problems, tensor_problems

ENGINES = "vLLM, SGLang or llama.cpp"


# Keys of z-lab's config.json (and of speculators' top level) that the engines or transformers'
# Qwen3Config read; anything else is read by no engine (a misspelt key is a default taken).
DFLASH_KEYS = {"architectures", "model_type", "block_size", "dflash_config", "num_target_layers", "layer_types",
               "target_hidden_size", "torch_dtype", "dtype", "transformers_version", "auto_map", METADATA_KEY}
SPECULATORS_KEYS = {"speculators_model_type", "speculators_version", "transformer_layer_config", "speculators_config",
                    "draft_vocab_size", "aux_hidden_state_layer_ids", "mask_token_id", "sliding_window_non_causal",
                    "sample_from_anchor", "tie_word_embeddings"}
INNER_KEYS = {"mask_token_id", "target_layer_ids", "block_size", "num_target_layers", "mask_token"}
# dflash_config keys llama.cpp's converter reads that change the architecture it serves (DFlash2,
# scaled logits...): this package's DFlash has none of these parts.
OTHER_ARCH_KEYS = {"attention_value_scale", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                   "output_multiplier", "final_logit_softcapping", "input_embedding_scale", "swa_window_size",
                   "attention_sink_bias", "projector_type", "add_swa_attention_sink_bias"}
# Keys SGLang 0.5.23 reads that change what it serves (speculative/dflash_utils.py parse_dflash_draft_config,
# models/dflash.py): its Domino projector's dflash_config fields, and use_gemma_norm (GemmaRMSNorm: 1 + weight)
SGLANG_INNER_KEYS = {"shift_label", "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim"}
SGLANG_KEYS = {"use_gemma_norm"}


def qwen3_keys() -> set[str]:
    """The keys transformers' Qwen3Config (and every PretrainedConfig) reads."""
    from transformers import Qwen3Config

    return set(Qwen3Config().to_dict()) | {"rope_theta", "rope_scaling", "rope_parameters", "head_dim",
                                           "attention_bias", "use_sliding_window", "sliding_window",
                                           "max_window_layers", "layer_types", "pad_token_id", "bos_token_id",
                                           "eos_token_id", "tie_word_embeddings", "initializer_range", "use_cache"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------- config.json

def config_problems_dflash(d: dict, serving: bool = True) -> list[str]:
    """The config alone: types and ranges (``draft_check.config_problems`` on the Qwen3 fields),
    then the DFlash keys, each silent failure one line (``serving`` False: only what would make this
    package read the draft wrongly, what every reader refuses)."""
    fields = layer_fields(d)
    layout = layout_of(d)
    if layout == "speculators" and not isinstance(d.get("transformer_layer_config"), dict):
        return ["config.json: transformer_layer_config is missing or not an object (speculators keeps the draft "
                "layers' fields there)"]
    meta = d.get(METADATA_KEY) if isinstance(d.get(METADATA_KEY), dict) else {}
    # the training record's layer ids are DFlash's (any count), not EAGLE-3's three: checked below
    generic = {**fields, METADATA_KEY: {k: v for k, v in meta.items() if k != "layer_ids"}}
    if d.get(METADATA_KEY) is not None and not isinstance(d.get(METADATA_KEY), dict):
        generic[METADATA_KEY] = d[METADATA_KEY]
    out = config_problems(generic, required=True)
    if fields.get("num_hidden_layers") is None:
        out.append("config.json: required key 'num_hidden_layers' is missing (the draft's depth)")
    if out:
        return out
    out += _architecture_problems(d, layout)
    out += _block_problems(d, meta, layout)
    out += _mask_problems(d, fields)
    out += _layer_id_problems(d, meta, layout)
    out += _attention_problems(d, fields)
    if serving:
        out += _serving_problems(d)
    return out


def _architecture_problems(d: dict, layout: str) -> list[str]:
    archs = d.get("architectures") or []
    out = []
    if layout == "zlab" and ARCHITECTURE not in archs:
        out.append(f"config.json: architectures is {archs}; vLLM, SGLang and llama.cpp's converter load a DFlash "
                   f"draft as ['{ARCHITECTURE}']")
    mt = layer_fields(d).get("model_type") if layout == "speculators" else d.get("model_type")
    if mt != "qwen3":
        out.append(f"config.json: model_type is {mt!r}; a DFlash draft's layers are Qwen3 layers ('qwen3'), "
                   "the type the engines build them from")
    return out


def _block_problems(d: dict, meta: dict, layout: str) -> list[str]:
    top, inner = d.get("block_size"), (d.get("dflash_config") or {}).get("block_size")
    if top is None and inner is None:
        return ["config.json: block_size is missing (top level or dflash_config): the engines fall back to their "
                "own default (llama.cpp 16, speculators 8), not the block this draft was trained with"]
    for name, v in (("block_size", top), ("dflash_config.block_size", inner)):
        if v is not None and (not _is_int(v) or not 2 <= v <= 1024):
            return [f"config.json: {name} is {v!r}; expected an integer from 2 (the anchor and one drafted token)"]
    if top is not None and inner is not None and top != inner:
        return [f"config.json: block_size {top} disagrees with dflash_config.block_size {inner}: llama.cpp's converter "
                "reads dflash_config's, speculators' converter the top level's; they would draft different blocks"]
    b = block_size_of(d)
    if meta.get("block_size") is not None and meta["block_size"] != b:
        return [f"config.json: block_size {b} but the draft was trained with blocks of {meta['block_size']} "
                f"({METADATA_KEY}.block_size): the engines would draft {b}-token blocks from a {meta['block_size']}"
                "-token draft"]
    if layout == "speculators":
        methods = (d.get("speculators_config") or {}).get("proposal_methods") or []
        for m in methods:
            k = m.get("speculative_tokens") if isinstance(m, dict) else None
            if k is not None and k != b - 1:
                return [f"config.json: speculators_config.proposal_methods speculative_tokens is {k}; a block of {b} "
                        f"drafts {b - 1} (vLLM reads it as num_speculative_tokens)"]
    if d.get("sample_from_anchor") is True:
        return ["config.json: sample_from_anchor is true (a block of B drafted tokens); this package's DFlash "
                "drafts B-1 after the anchor, which is what vLLM and SGLang serve"]
    return []


def _mask_problems(d: dict, fields: dict) -> list[str]:
    m, v = mask_token_of(d), fields.get("vocab_size")
    key = "dflash_config.mask_token_id" if layout_of(d) == "zlab" else "mask_token_id"
    if m is None:
        return [f"config.json: {key} is missing: the engines would fill the block with no MASK token"]
    if not _is_int(m) or not 0 <= m < v:
        return [f"config.json: {key} is {m!r}, not a row of the embedding (0..{v - 1}): the engines would embed "
                "a token the target does not have"]
    return _mask_special(m, fields, key, "the draft's config")


def _mask_special(m: int, cfg, key: str, whose: str) -> list[str]:
    get = cfg.get if isinstance(cfg, dict) else (lambda k, default=None: getattr(cfg, k, default))
    for name in ("eos_token_id", "pad_token_id"):
        ids = get(name)
        ids = ids if isinstance(ids, list) else [ids]
        if m in ids:
            return [f"config.json: {key} {m} is the {name.split('_')[0]} token ({whose}): a block pre-filled "
                    "with it reads as finished text; train with another MASK id (--mask-token-id)"]
    return []


def _layer_id_problems(d: dict, meta: dict, layout: str, n_layers: int | None = None) -> list[str]:
    key, ids, shift = layer_ids_of(d)
    if ids is None:
        return [f"config.json: {key} is missing: the engines would read their default target layers"]
    if not (isinstance(ids, list) and ids and all(_is_int(k) for k in ids)):
        return [f"config.json: {key} is {ids!r}; expected a list of layer ids"]
    count = "output of layer k" if shift else "input of layer j"
    if sorted(set(ids)) != ids:
        return [f"config.json: {key} {ids} is not ascending and distinct (fc reads the layers in this order)"]
    n = n_layers or (d.get("num_target_layers") if _is_int(d.get("num_target_layers")) else None)
    if n:
        lo, hi = (0, n - 2) if shift else (1, n - 1)
        bad = [k for k in ids if not lo <= k <= hi]
        if bad:
            hint = ""
            if shift and n - 1 in bad:
                hint = f"; {n - 1} is the output of the last layer, which no engine captures: counted as inputs?"
            elif not shift and 0 in bad:
                hint = "; 0 is the embedding's output, not a layer's: counted as outputs (z-lab's count)?"
            return [f"config.json: {key} {ids} ({count}) must lie in {lo}..{hi} for a {n}-layer target: {bad} "
                    f"do not{hint}"]
    recorded = meta.get("layer_ids")
    if recorded is not None:
        if not (isinstance(recorded, list) and all(_is_int(j) for j in recorded)):
            return [f"config.json: {METADATA_KEY}.layer_ids is {recorded!r}; expected a list of layer ids"]
        want = [j - shift for j in recorded]
        if ids != want:
            wrong = " (the training record's input count, not shifted)" if shift and ids == recorded else ""
            return [f"config.json: {key} {ids} ({count}) disagrees with the layers the draft was trained on, "
                    f"{METADATA_KEY}.layer_ids {recorded} (input of layer j){wrong}: {key} should be {want}"]
    return []


def _attention_problems(d: dict, fields: dict) -> list[str]:
    inner = d.get("dflash_config") or {}
    out = []
    for name, v in (("is_causal", d.get("is_causal")), ("dflash_config.causal", inner.get("causal"))):
        if v is True:
            out.append(f"config.json: {name} is true: llama.cpp would attend causally inside the block, this draft "
                       "was trained bidirectional")
    types = fields.get("layer_types")
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        out.append(f"config.json: layer_types {types}: sliding-window layers are causal inside the block in "
                   "speculators and llama.cpp; this package's DFlash layers are all full_attention")
    if fields.get("use_sliding_window") is True or inner.get("use_swa") is True:
        out.append("config.json: a sliding window is on (use_sliding_window / dflash_config.use_swa): the engines "
                   "would serve a windowed, causal block; this draft attends the whole block")
    for name in ("rope_is_neox_style", "is_neox_style"):  # llama.cpp and SGLang read the first, vLLM the second
        if fields.get(name) is False or d.get(name) is False:
            out.append(f"config.json: {name} is false (interleaved RoPE); this draft rotates halves (NeoX), so "
                       "the engines would serve it with another RoPE")
    if fields.get("num_hidden_layers") is not None and isinstance(types, list) \
            and len(types) != fields["num_hidden_layers"]:
        out.append(f"config.json: layer_types lists {len(types)} layers, num_hidden_layers is "
                   f"{fields['num_hidden_layers']}")
    return out


def _serving_problems(d: dict) -> list[str]:
    """What an engine would misread in files this package reads faithfully (inspect names them; the
    readers accept them, so a third party's draft can still be evaluated, converted and continued)."""
    out = []
    if layout_of(d) == "speculators" and d.get("sliding_window_non_causal") is False:
        out.append("config.json: sliding_window_non_causal is false: vLLM 0.32.0 then sets dflash_config.causal "
                   "true and attends causally inside the block in every layer; this draft was trained "
                   "bidirectional: set it to true (`eagle3 convert --to speculators` does)")
    ea = d.get("eagle_aux_hidden_state_layer_ids")
    if ea is not None and layout_of(d) == "zlab":
        _, ids, shift = layer_ids_of(d)
        want = [k + shift for k in ids] if isinstance(ids, list) and all(_is_int(k) for k in ids) else None
        if ea != want:
            out.append(f"config.json: eagle_aux_hidden_state_layer_ids {ea} (input of layer j) is what vLLM captures, "
                       f"before dflash_config.target_layer_ids; they disagree (expected {want}): remove it")
    if layout_of(d) == "zlab" and d.get("num_target_layers") is None:
        out.append("config.json: num_target_layers is missing (SGLang reads the target's depth from it, else "
                   "takes the largest layer id + 1)")
    return out + _unknown_keys(d, layout_of(d))


def _unknown_keys(d: dict, layout: str) -> list[str]:
    known = (DFLASH_KEYS | qwen3_keys()) if layout == "zlab" else (DFLASH_KEYS | SPECULATORS_KEYS)
    out = [f"config.json: {k} is read by no engine ({ENGINES}): a misspelt key leaves the engine's default; "
           "remove or rename it" for k in d
           if k not in known | SGLANG_KEYS and k not in ("is_causal", "rope_is_neox_style", "is_neox_style",
                                                         "eagle_aux_hidden_state_layer_ids")]
    out += [f"config.json: {k} makes SGLang build its norms as Gemma's (1 + weight); this draft's are plain "
            "RMSNorm: remove it" for k in d if k in SGLANG_KEYS]
    inner = d.get("dflash_config")
    if isinstance(inner, dict):
        for k in inner:
            if k in OTHER_ARCH_KEYS:
                out.append(f"config.json: dflash_config.{k} makes llama.cpp serve a DFlash variant this package does "
                           "not train; remove it")
            elif k in SGLANG_INNER_KEYS:
                out.append(f"config.json: dflash_config.{k} makes SGLang serve a DFlash variant this package does "
                           "not train (its Domino projector); remove it")
            elif k not in INNER_KEYS | {"causal", "use_swa"}:
                out.append(f"config.json: dflash_config.{k} is read by no engine ({ENGINES}): remove or rename it")
    elif inner is not None:
        out.append(f"config.json: dflash_config is {inner!r}; expected an object")
    if layout == "speculators":
        tl = d.get("transformer_layer_config") or {}
        out += [f"config.json: transformer_layer_config.{k} is read by no engine ({ENGINES}): remove or rename it"
                for k in tl if k not in qwen3_keys() | {"architectures", "model_type", "dtype", "torch_dtype",
                                                        "transformers_version", "target_hidden_size"}]
    return out


# ---------------------------------------------------------------------------- model.safetensors

def expected_shapes(d: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a DFlash draft of config ``d`` (checked) holds, with its shape."""
    f = layer_fields(d)
    h, i = f["hidden_size"], f["intermediate_size"]
    nh = f["num_attention_heads"]
    nkv = f.get("num_key_value_heads") or nh
    hd = f.get("head_dim") or h // nh
    th = d.get("target_hidden_size") or f.get("target_hidden_size") or h
    _, ids, _ = layer_ids_of(d)
    shapes = {"fc.weight": (h, len(ids) * th), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(f["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
                   p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    return shapes


def tensor_problems_dflash(d: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names, fc's width, shapes, dtypes and finite values of a checked config's tensors."""
    shapes = expected_shapes(d)
    f = layer_fields(d)
    key, ids, _ = layer_ids_of(d)
    th = d.get("target_hidden_size") or f.get("target_hidden_size") or f["hidden_size"]
    out = []
    fc = tensors.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] != len(ids) * th:
        layers = f"{fc.shape[1] / th:g}" if fc.shape[1] % th == 0 else f"{fc.shape[1]}/{th}"
        out.append(f"tensor fc.weight: takes {fc.shape[1]} inputs ({layers} x hidden {th}) but {key} lists "
                   f"{len(ids)} target layers ({len(ids)} x {th} = {len(ids) * th}): the engines would feed it "
                   "other layers than it was trained on")
    for name in tensors:
        if name in shapes or (name == "fc.weight"):
            continue
        if name.startswith("model.") and name[len("model."):] in shapes:
            out.append(f"tensor {name}: has a 'model.' prefix; the engines expect {name[len('model.'):]}")
        elif name in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
            out.append(f"tensor {name}: a DFlash draft uses the target's embedding and LM head (full vocabulary); "
                       "the engines would ignore or misuse it")
        else:
            out.append(f"tensor {name}: unknown name (the engines drop it silently)")
    for name in shapes:
        if name not in tensors and f"model.{name}" not in tensors:
            out.append(f"tensor {name}: missing (the engine leaves that weight random)")
    rest = {k: v for k, v in tensors.items() if k != "fc.weight" or not out}
    vocab = SimpleNamespace(draft_vocab_size=f["vocab_size"], vocab_size=f["vocab_size"])
    out += tensor_problems(vocab, rest, shapes)
    return out


# ---------------------------------------------------------------------------- against the target

def target_problems(d: dict, target_config) -> list[str]:
    """The draft against the target it is served with (``--model``)."""
    from ..core.hf_utils import text_config
    from ..model.draft import target_rope_parameters

    t = text_config(target_config)
    f = layer_fields(d)
    out = []
    n = int(t.num_hidden_layers)
    m = mask_token_of(d)
    key = "dflash_config.mask_token_id" if layout_of(d) == "zlab" else "mask_token_id"
    if not 0 <= m < t.vocab_size:
        out.append(f"config.json: {key} {m} is not a row of the target's embedding (0..{t.vocab_size - 1})")
    else:
        out += _mask_special(m, t, key, "the target's")
    th = d.get("target_hidden_size") or f.get("target_hidden_size") or f["hidden_size"]
    if th != t.hidden_size:
        out.append(f"target: hidden size {t.hidden_size}, the draft reads features of hidden size {th}")
    if f["vocab_size"] != t.vocab_size:
        out.append(f"target: vocab size {t.vocab_size}, the draft's vocab_size is {f['vocab_size']}")
    if _is_int(d.get("num_target_layers")) and d["num_target_layers"] != n:
        out.append(f"config.json: num_target_layers {d['num_target_layers']} but the target has {n} layers")
    meta = d.get(METADATA_KEY) if isinstance(d.get(METADATA_KEY), dict) else {}
    out += _layer_id_problems(d, meta, layout_of(d), n_layers=n)
    theta = float(rope_theta(f))
    want = float(target_rope_parameters(t)["rope_theta"])
    if abs(theta - want) > 1e-6 * want:
        out.append(f"config.json: rope_theta {theta} differs from the target's {want}")
    return list(dict.fromkeys(out))


def rope_theta(f: dict) -> float:
    rp = f.get("rope_parameters") if isinstance(f.get("rope_parameters"), dict) else {}
    return rp.get("rope_theta", f.get("rope_theta", 10000.0))


# ---------------------------------------------------------------------------- entry points

def engine_counts(b: int) -> dict:
    """Each engine's own count for a block of ``b`` (the serve lines of docs/serving.md)."""
    return {"vllm": {"method": "dflash", "num_speculative_tokens": b - 1},
            "sglang": {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": b},
            "llama.cpp": {"spec_type": "draft-dflash", "spec_draft_n_max": b - 1}}


def check_dflash(config: dict, tensors: dict | None, directory, target_config=None):
    """Raise :class:`CorruptDraft` with the first problem (config, then ``tensors`` when given, then
    the target when given): what every DFlash reader runs before it builds anything."""
    problems = [f"{Path(directory) / p}" for p in config_problems_dflash(config, serving=False)]
    if not problems and tensors is not None:
        problems = [f"{Path(directory) / WEIGHTS}: {p}" for p in tensor_problems_dflash(config, tensors)]
    if not problems and target_config is not None:
        problems = [f"{Path(directory)}: {p}" for p in target_problems(config, target_config)]
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptDraft(f"{problems[0]}{more}")


def inspect_dflash(draft_dir: str | Path, config: dict, target_config=None) -> tuple[list[str], dict]:
    """(every problem, one line each; a summary) of a DFlash draft folder, for ``eagle3 inspect``."""
    from .draft_check import UnreadableWeights, read_weights

    layout = layout_of(config)
    summary: dict = {"draft_type": "dflash", "format": f"dflash-{layout}"}
    problems = config_problems_dflash(config)
    key, ids, shift = layer_ids_of(config)
    b = block_size_of(config)
    if _is_int(b) and b >= 2:
        summary["block_size"] = b
        summary["engines"] = engine_counts(b)
    if isinstance(ids, list) and all(_is_int(k) for k in ids):
        summary["layer_ids_key"] = key
        summary["layers_j"] = [k + shift for k in ids]
        summary["layers_output"] = [k + shift - 1 for k in ids]
    fields = layer_fields(config)
    summary.update(mask_token_id=mask_token_of(config), num_hidden_layers=fields.get("num_hidden_layers"),
                   hidden_size=fields.get("hidden_size"), vocab_size=fields.get("vocab_size"),
                   num_target_layers=config.get("num_target_layers"),
                   torch_dtype=config.get("torch_dtype") or config.get("dtype"))
    p = Path(draft_dir) / WEIGHTS
    tensors = None
    if not p.exists():
        problems.append(f"weights: {WEIGHTS} is missing")
    else:
        try:
            tensors = read_weights(p)
        except UnreadableWeights as e:
            problems.append(f"weights: {WEIGHTS} {e.reason}: export or download it again")
    config_ok = not problems
    if tensors is not None and config_ok:
        problems += tensor_problems_dflash(config, tensors)
        summary["parameters"] = sum(t.numel() for t in tensors.values())
        summary["weights_dtype"] = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()
                                           if t.is_floating_point()})
    if target_config is not None and config_ok:
        from ..core.hf_utils import text_config

        problems += [p for p in target_problems(config, target_config) if p not in problems]
        summary["target_layers"] = int(text_config(target_config).num_hidden_layers)
    ok = not problems
    # speculators' layout is read by vLLM alone (its speculators config, update_dflash); SGLang would find
    # no target_layer_ids there (and take its default layers), llama.cpp's converter no Qwen3 fields
    only_vllm = layout == "speculators"
    summary["reads_correctly"] = {e: ok and (e == "vllm" or not only_vllm) for e in ("vllm", "sglang", "llama.cpp")}
    return problems, summary


__all__ = ["CONFIG", "check_dflash", "config_problems_dflash", "engine_counts",
           "inspect_dflash", "target_problems", "tensor_problems_dflash"]
