"""The one check a draft passes before any reader trusts it (docs/formats.md, "What every reader checks").

Every draft reader (``export.load_draft``, ``formats.read_draft`` and through it ``convert``,
``eval``, ``push``, ``train --init-from``; ``inspector.inspect_draft`` lists the same problems)
runs these checks (``export.check_draft``) right after reading the files and before building
anything from them:

- :func:`config_problems`: every key a reader uses has the type and range an engine accepts
  (a positive integer within bounds no real model exceeds, a finite positive epsilon, booleans
  that are JSON booleans, three non-negative layer ids on which both layer-id keys agree), so a
  hand-edited ``config.json`` is one line, never a ``KeyError`` or a 100 GB allocation;
- :func:`tensor_problems`: every tensor against that config: shape, dtype (one floating dtype
  the engines load, integer ``d2t``, boolean ``t2d``), all values finite, and the vocabulary
  maps (every target id inside the target vocabulary, distinct and increasing, ``t2d`` marking
  exactly those ids, the end tokens training recorded present);
- :func:`read_weights`: ``model.safetensors`` read with any damage as one line, and its
  contents compared with the sha256 ``export.save_draft`` records in the file's header
  (:data:`DIGEST_KEY`): a bit flipped in the tensor data after export is refused too.

Each problem is one line naming the key or tensor, what was expected and what was found;
``export.check_draft`` raises the first as :class:`CorruptDraft`. This module needs nothing
of the package but its errors, so that ``export`` (the draft files' home) can use it.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from ..core.errors import Eagle3Error

DIGEST_KEY = "eagle3_sha256"  # safetensors header metadata: sha256 of the tensors (weights_digest)
LOADABLE = (torch.bfloat16, torch.float16, torch.float32)  # the weight dtypes vLLM and SGLang load
# What inspect has always required; the readers need the same (no silent defaults for the geometry).
REQUIRED_KEYS = ["hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps", "vocab_size",
                 "max_position_embeddings"]
# Upper bounds far above any real model (hidden 16k, vocab 262k, 10M positions), far below what
# would make Eagle3Draft allocate more memory than a machine has.
INT_KEYS = {
    "hidden_size": 1 << 16, "intermediate_size": 1 << 20, "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10, "head_dim": 1 << 12, "vocab_size": 1 << 24, "draft_vocab_size": 1 << 24,
    "target_hidden_size": 1 << 16, "max_position_embeddings": 1 << 30, "num_hidden_layers": 1 << 10,
}
BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "fc_norm", "norm_output", "norm_before_fc",
             "norm_before_residual", "use_aux_norm")
DICT_KEYS = ("rope_parameters", "rope_scaling", "eagle_config", "eagle3_training")
STR_KEYS = ("model_type", "hidden_act", "torch_dtype", "dtype")
MAX_LAYER_ID = 1 << 12


class CorruptDraft(Eagle3Error, ValueError):
    """A draft whose files contradict themselves or the engines' contract: one line naming the
    key or tensor, what was expected and what was found."""


class UnreadableWeights(CorruptDraft):
    """model.safetensors that cannot be read at all, or whose contents changed after export."""

    def __init__(self, path, reason: str, fix: str = "export or download it again"):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}: {fix}")


# ---------------------------------------------------------------------------- config.json

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite JSON number (JSON integers may exceed any float: those are finite too)."""
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _show(v) -> str:
    """A value as found, cut to one short line."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def config_problems(cfg: dict, required: bool = True) -> list[str]:
    """Type and range of every key a reader uses (``required``: also the geometry keys that must
    be there; False for a raw third-party config whose geometry sits elsewhere)."""
    out = []
    for k in REQUIRED_KEYS if required else ():
        if cfg.get(k) is None:
            out.append(f"config.json: required key {k!r} is missing")
    for k, top in INT_KEYS.items():
        v = cfg.get(k)
        if v is None:
            continue
        if not _is_int(v) or not 0 < v <= top:
            out.append(f"config.json: {k} is {_show(v)}; expected an integer from 1 to {top:,}")
    eps = cfg.get("rms_norm_eps")
    if eps is not None and (not _is_number(eps) or not 0 < eps < 1):
        out.append(f"config.json: rms_norm_eps is {_show(eps)}; expected a number between 0 and 1 (like 1e-05)")
    for k in BOOL_KEYS:
        if cfg.get(k) is not None and not isinstance(cfg[k], bool):
            out.append(f"config.json: {k} is {_show(cfg[k])}; expected true or false")
    for k in DICT_KEYS:
        if cfg.get(k) is not None and not isinstance(cfg[k], dict):
            out.append(f"config.json: {k} is {_show(cfg[k])}; expected an object")
    for k in STR_KEYS:
        if cfg.get(k) is not None and not isinstance(cfg[k], str):
            out.append(f"config.json: {k} is {_show(cfg[k])}; expected a string")
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        out.append(f"config.json: architectures is {_show(archs)}; expected a list of names")
    out += _token_id_problems(cfg)
    out += _rope_problems(cfg)
    out += _layer_id_problems(cfg)
    if out:
        return out
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv and heads % kv:
        out.append(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    act = cfg.get("hidden_act")
    if act is not None:
        from transformers.activations import ACT2FN

        if act not in ACT2FN:
            out.append(f"config.json: hidden_act {act!r} is not an activation transformers knows (expected silu)")
    return out


def _token_id_problems(cfg: dict) -> list[str]:
    out = []
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = cfg.get(k)
        ids = v if isinstance(v, list) and k == "eos_token_id" else [v]
        if v is not None and not all(_is_int(t) and -1 <= t < (1 << 24) for t in ids):
            what = "a token id (or a list of them)" if k == "eos_token_id" else "a token id"
            out.append(f"config.json: {k} is {_show(v)}; expected {what}")
    return out


def _rope_problems(cfg: dict) -> list[str]:
    out = []
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    thetas = {"rope_theta": cfg.get("rope_theta"), "rope_parameters.rope_theta": rp.get("rope_theta")}
    for k, v in thetas.items():
        if v is not None and (not _is_number(v) or not 0 < v <= 1e12):
            out.append(f"config.json: {k} is {_show(v)}; expected a positive number (like 10000.0)")
    a, b = thetas.values()
    if not out and a is not None and b is not None and float(a) != float(b):
        out.append(f"config.json: rope_theta {a} disagrees with rope_parameters.rope_theta {b}")
    for k, d in (("rope_parameters", rp), ("rope_scaling", cfg.get("rope_scaling"))):
        kind = (d or {}).get("rope_type", (d or {}).get("type")) if isinstance(d, dict) else None
        if kind is not None and not isinstance(kind, str):
            out.append(f"config.json: {k}.rope_type is {_show(kind)}; expected a name like \"default\"")
    return out


def _ids(v, name: str, out: list) -> list[int] | None:
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 3 and all(_is_int(j) for j in v)):
        out.append(f"config.json: {name} is {_show(v)}; expected three layer ids (EAGLE-3 fuses three layers)")
        return None
    return v


def _layer_id_problems(cfg: dict) -> list[str]:
    """Both layer-id keys well formed and agreeing (vLLM reads one, SGLang the other, +1), and
    agreeing with what training recorded: otherwise one engine would feed the wrong layers."""
    out: list[str] = []
    top = _ids(cfg.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids", out)
    ec = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    nested = _ids(ec.get("eagle_aux_hidden_state_layer_ids"), "eagle_config.eagle_aux_hidden_state_layer_ids", out)
    meta = cfg.get("eagle3_training") if isinstance(cfg.get("eagle3_training"), dict) else {}
    recorded = _ids(meta.get("layer_ids"), "eagle3_training.layer_ids", out)
    if ec.get("use_aux_hidden_state") is not None and not isinstance(ec["use_aux_hidden_state"], bool):
        out.append(f"config.json: eagle_config.use_aux_hidden_state is {_show(ec['use_aux_hidden_state'])}; "
                   "expected true or false")
    if not isinstance(meta.get("target"), (str, type(None))):
        out.append(f"config.json: eagle3_training.target is {_show(meta['target'])}; expected a model name")
    ends = meta.get("end_token_ids")
    if ends is not None and not (isinstance(ends, list) and all(_is_int(t) and t >= 0 for t in ends)):
        out.append(f"config.json: eagle3_training.end_token_ids is {_show(ends)}; expected a list of token ids")
    if out:
        return out
    js = {"eagle_aux_hidden_state_layer_ids": top,
          "eagle_config.eagle_aux_hidden_state_layer_ids + 1": [k + 1 for k in nested] if nested else None,
          "eagle3_training.layer_ids": recorded}
    js = {k: v for k, v in js.items() if v is not None}
    for k, v in js.items():
        if not all(0 <= j < MAX_LAYER_ID for j in v):
            return [f"config.json: {k} is {v}; expected layer ids from 0 to {MAX_LAYER_ID - 1}"]
    named = list(js.items())
    for k, v in named[1:]:
        if v != named[0][1]:
            return [f"config.json: {named[0][0]} {named[0][1]} disagrees with {k} {v}: the engines and the "
                    "training record would fuse different layers"]
    return []


# ---------------------------------------------------------------------------- model.safetensors

def tensor_problems(dcfg, tensors: dict, shapes: dict, end_token_ids=None) -> list[str]:
    """Every tensor with a draft name (a key of ``shapes``, ``export.expected_shapes(dcfg)``)
    against ``dcfg``: shape, dtype, finite values; then the vocabulary maps. Names a draft does
    not have are the readers' concern (refused by ``formats``, listed by ``inspect``)."""
    out = []
    floats = {}
    for name, t in tensors.items():
        bare = name[len("model."):] if name.startswith("model.") else name
        if bare not in shapes:
            continue
        if tuple(t.shape) != shapes[bare]:
            out.append(f"shape of {bare}: {tuple(t.shape)}, config implies {shapes[bare]} "
                       f"({', '.join(_shape_keys(bare))})")
        if bare in ("d2t", "t2d"):
            continue
        if t.dtype not in LOADABLE:
            out.append(f"tensor {bare}: dtype {_name(t.dtype)}; the engines load bfloat16, float16 or float32")
            continue
        floats[bare] = t
        if not _all_finite(t):
            bad = ~torch.isfinite(t)
            first = tuple(int(i) for i in torch.nonzero(bad)[0])
            out.append(f"tensor {bare}: {int(bad.sum())} non-finite value(s) (first {t[first].item()} at "
                       f"{list(first)}); a draft's weights are all finite")
    kinds = sorted({_name(t.dtype) for t in floats.values()})
    if len(kinds) > 1:
        first = next(iter(floats.values())).dtype
        odd = next(n for n, t in floats.items() if t.dtype != first)
        out.append(f"tensor {odd}: dtype {_name(floats[odd].dtype)} while {next(iter(floats))} is {_name(first)}; "
                   "a draft's weights share one dtype")
    if not out:
        out += vocab_map_problems(dcfg, tensors.get("d2t"), tensors.get("t2d"), end_token_ids)
    return out


def _all_finite(t: torch.Tensor) -> bool:
    """Any NaN or inf makes the sum non-finite, so a finite sum proves there is none, at the cost
    of one reduction; only a sum that overflowed is tested element by element."""
    return bool(torch.isfinite(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


def _shape_keys(name: str) -> tuple[str, ...]:
    """The config.json keys behind each dimension of a draft tensor (export.expected_shapes)."""
    h, th, i = "hidden_size", "target_hidden_size", "intermediate_size"
    q, kv = "num_attention_heads x head_dim", "num_key_value_heads x head_dim"
    keys = {"fc.weight": (h, f"3 x {th}"), "midlayer.self_attn.q_proj.weight": (q, f"2 x {h}"),
            "midlayer.self_attn.k_proj.weight": (kv, f"2 x {h}"), "midlayer.self_attn.v_proj.weight": (kv, f"2 x {h}"),
            "midlayer.self_attn.o_proj.weight": (h, q), "midlayer.mlp.gate_proj.weight": (i, h),
            "midlayer.mlp.up_proj.weight": (i, h), "midlayer.mlp.down_proj.weight": (h, i),
            "lm_head.weight": ("draft_vocab_size", h), "d2t": ("draft_vocab_size",), "t2d": ("vocab_size",),
            "embed_tokens.weight": ("vocab_size", h), "input_norm.weight": (f"3 x {th}",)}
    return keys.get(name) or ((th,) if name.startswith("fc_norm.") else (h,))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def vocab_map_problems(dcfg, d2t, t2d, end_token_ids=None) -> list[str]:
    """d2t (offsets: target = draft + d2t[draft], docs/design.md §4) and t2d, as far as present:
    integer / boolean, every target id inside the target vocabulary, distinct and increasing,
    t2d marking exactly them, and the end tokens training recorded among them."""
    n, v = dcfg.draft_vocab_size, dcfg.vocab_size
    out = []
    if d2t is not None and (d2t.dtype.is_floating_point or d2t.dtype.is_complex or d2t.dtype == torch.bool):
        out.append(f"d2t: dtype {_name(d2t.dtype)}; expected integer offsets (int64)")
    if t2d is not None and t2d.dtype != torch.bool:
        if t2d.dtype.is_floating_point or t2d.dtype.is_complex or bool(((t2d != 0) & (t2d != 1)).any()):
            out.append(f"t2d: dtype {_name(t2d.dtype)} with values other than 0 and 1; expected a bool mask")
    if out or (d2t is not None and d2t.shape != (n,)) or (t2d is not None and t2d.shape != (v,)):
        return out  # a shape problem is reported with the shapes
    marked = torch.nonzero(t2d.bool()).flatten() if t2d is not None else None
    if d2t is None:
        if marked is not None and marked.numel() != n:
            out.append(f"t2d: marks {marked.numel()} target ids; draft_vocab_size is {n}")
        ids = marked
    else:
        ids = torch.arange(n) + d2t.long()
        if (marked is not None and not torch.equal(marked, ids) and marked.numel() == n
                and torch.equal(d2t.long().sort().values, marked)):
            return ["d2t: holds target indices, not offsets; engines compute target = draft + d2t[draft] "
                    "(store d2t[i] = target_id - i)"]
        outside = torch.nonzero((ids < 0) | (ids >= v)).flatten()
        if outside.numel():
            i = int(outside[0])
            return [f"d2t: draft id {i} maps to target id {int(ids[i])}, outside the target vocabulary (0..{v - 1})"]
        step = torch.nonzero(ids[1:] <= ids[:-1]).flatten()
        if step.numel():
            i = int(step[0])
            what = "both map to" if ids[i] == ids[i + 1] else "map to decreasing"
            return [f"d2t: draft ids {i} and {i + 1} {what} target ids {int(ids[i])} and {int(ids[i + 1])}; "
                    "expected distinct, increasing target ids"]
        if marked is not None and not torch.equal(marked, ids):
            missing = ids[~t2d.bool()[ids]]
            detail = (f"target id {int(missing[0])} (from d2t) is not marked in t2d" if missing.numel()
                      else f"t2d marks {marked.numel()} ids, d2t maps {n}")
            return [f"d2t/t2d: inconsistent: {detail}; expected t2d to mark exactly draft + d2t[draft]"]
    for t in end_token_ids or ():
        if ids is not None and not (0 <= t < v and bool((ids == t).any())):
            out.append(f"t2d: end token {t} (eagle3_training.end_token_ids) is not in the draft vocabulary; "
                       "a draft without it could never end a turn")
            break
    return out


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, by name: the same for the same
    tensors however the file lays them out."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{_name(t.dtype)}|{list(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def read_weights(path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; any damage is :class:`UnreadableWeights` (one line),
    including contents that differ from the digest export recorded in the header."""
    from safetensors import safe_open

    p = Path(path)
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - a garbled header or data of any kind is one line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UnreadableWeights(p, f"unreadable ({reason})") from None
    recorded = meta.get(DIGEST_KEY)
    if recorded and weights_digest(tensors) != recorded:
        raise UnreadableWeights(p, f"its tensors differ from the sha256 recorded at export ({DIGEST_KEY}): "
                                   "the file was damaged after it was written")
    return tensors
