"""Does SGLang read our DFlash draft as we wrote it? SGLang's own DFlash model class, built from the
draft's config.json, loads the draft's safetensors through its own ``load_weights``; every parameter
of its module is then compared bit for bit with our tensors, and each of our keys is traced to the
parameter rows it filled (docs/benchmarks.md, "DFlash in the engines").

    python benchmarks/dflash_sglang_loader.py --model ~/.cache/eagle3/models/SmolLM2-135M-Instruct \
        --sglang-python /work/venvs/vllm/bin/python --sglang-path /work/venvs/sglang [--draft DRAFT]

Without ``--draft`` it writes a 2-layer DFlash draft of the ``--model`` target (z-lab layout, bf16,
every tensor random, norms included, so that no two rows agree by chance) and reads that.

The SGLang side runs in a Python with torch and transformers 5.19.0 (the version SGLang 0.5.23 pins)
and SGLang on ``--sglang-path`` (a ``pip install --target DIR --no-deps sglang==0.5.23 gguf`` plus
its pure-Python imports). It imports no eagle3 module. It builds what SGLang's model runner builds
before it loads a draft, with SGLang's own functions: ``init_distributed_environment`` (gloo, world
size 1), the published ``ServerArgs`` topology (TP=1) and ``initialize_model_parallel``; the config
through ``hf_transformers_utils.get_config`` and the dtype through ``model_config._get_and_verify_dtype``
("auto"); ``srt/models/dflash.py``'s ``DFlashDraftModel`` under ``set_default_torch_dtype``; and the
tensors through ``weight_utils.safetensors_weights_iterator``. Only ``torchvision`` is stubbed (the
multimodal preprocessing that ``sglang.srt.configs`` imports; the PyPI wheel does not import beside
a CPU torch); ``--stub`` adds others for another environment.

Checked: every parameter of SGLang's module equals, bit for bit, our tensor or the slice of its fused
``qkv_proj`` / ``gate_up_proj`` that our q/k/v (gate/up) tensor fills, and none keeps the NaN it was
filled with before loading; no key of ours is skipped (each key is loaded alone into a NaN-filled
module, and a key that fills nothing is SGLang's "Ignore unexpected weights"); and what SGLang reads
from config.json (its block size, the target layer ids and the layers its Llama/Qwen3 targets then
capture, the number of context features fc takes, the MASK id, each layer's attention type, the RoPE
style) against what ``eagle3 inspect`` says SGLang serves. Exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# ---------------------------------------------------------------------------- the SGLang side

def _install_stubs(names: set[str]):
    """Import-time stand-ins for packages SGLang imports but never calls on this path."""
    import importlib.abc
    import importlib.machinery
    import types

    class _Any:
        def __init__(self, *a, **k):
            pass

        def __call__(self, *a, **k):
            return _Any()

        def __getattr__(self, name):
            return _Any()

        def __mro_entries__(self, bases):
            return (object,)

        def __iter__(self):
            return iter(())

    class _Module(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any()

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in names:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            m = _Module(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, module):
            pass

    # transformers probes torchvision's version when its auto classes import: let it see the real absence first
    import transformers.models.auto.image_processing_auto  # noqa: F401
    import transformers.models.auto.processing_auto  # noqa: F401

    sys.meta_path.insert(0, _Finder())


def _init_sglang(port: int):
    """SGLang's parallel state for one CPU process, TP=1: what its model runner sets up before a load."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    return get_parallel().tp_size


def _bytes_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def sglang_side(draft: str, target_layers: int | None, dtype: str, stubs: list[str], port: int) -> dict:
    """Run by the SGLang Python (``--sglang-side``): no eagle3 import."""
    import torch

    _install_stubs(set(stubs))
    import sglang
    from safetensors import safe_open

    tp = _init_sglang(port)
    from sglang.srt.configs.model_config import _get_and_verify_dtype
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    files = [str(Path(draft) / "model.safetensors")]
    cfg = get_config(draft, trust_remote_code=False)
    torch_dtype = _get_and_verify_dtype(cfg, dtype)
    with set_default_torch_dtype(torch_dtype):
        model, probe = DFlashDraftModel(cfg), DFlashDraftModel(cfg)
    params, probe_params = dict(model.named_parameters()), dict(probe.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    model.load_weights(safetensors_weights_iterator(files))  # the whole checkpoint in one call, as its loader does

    with safe_open(files[0], "pt") as f:
        ours = {k: f.get_tensor(k) for k in f.keys()}
    # where each of our keys lands: loaded alone into a NaN-filled module
    where, skipped = {}, []
    for name, tensor in safetensors_weights_iterator(files):
        with torch.no_grad():
            for p in probe_params.values():
                p.fill_(float("nan"))
        probe.load_weights([(name, tensor)])
        hit = []
        for pn, p in probe_params.items():
            rows = (~torch.isnan(p.float())).reshape(p.shape[0], -1).any(dim=1).nonzero().flatten()
            if len(rows):
                hit.append((pn, int(rows[0]), int(rows[-1]) + 1))
        if hit:
            where[name] = hit
        else:
            skipped.append(name)

    compared, mismatched = [], []
    for name, hits in where.items():
        for pn, lo, hi in hits:
            got = params[pn].detach()[lo:hi]
            want = ours[name]
            cast = want.dtype != got.dtype
            ok = _bytes_equal(got, want.to(got.dtype)) and (hi - lo) == want.shape[0]
            compared.append({"key": name, "param": pn, "rows": [lo, hi], "equal": ok, "cast": cast})
            if not ok:
                mismatched.append(f"{name} -> {pn}[{lo}:{hi}]")
    left_nan = [pn for pn, p in params.items() if torch.isnan(p.float()).any()]
    covered = {pn for hits in where.values() for pn, _, _ in hits}

    dc = parse_dflash_draft_config(draft_hf_config=cfg)
    n_target = int(target_layers or dc.num_target_layers or model.num_context_features)
    ids = dc.resolve_target_layer_ids(target_num_layers=n_target, draft_num_layers=int(cfg.num_hidden_layers))
    shell = type("Target", (), {})()  # the target's capture hook, run on a bare object (pp rank last)
    shell.pp_group, shell.model = type("PP", (), {"is_last_rank": True})(), type("M", (), {})()
    LlamaForCausalLM.set_dflash_layers_to_capture(shell, list(ids))
    layers = []
    for layer in model.layers:
        attn = layer.self_attn
        layers.append({"attn_type": "non-causal" if attn.attn_type == AttentionType.ENCODER_ONLY else "causal",
                       "sliding_window": attn.sliding_window_size,
                       "neox_rope": bool(getattr(attn.rotary_emb, "is_neox_style", None))})
    return {
        "sglang": {"version": sglang.__version__, "file": sglang.srt.models.dflash.__file__, "tp_size": tp,
                   "dtype": str(torch_dtype).replace("torch.", "")},
        "params": {pn: [list(p.shape), str(p.dtype).replace("torch.", "")] for pn, p in params.items()},
        "our_keys": sorted(ours), "skipped": skipped, "compared": compared, "mismatched": mismatched,
        "left_unloaded": left_nan, "params_not_covered": sorted(set(params) - covered),
        "reads": {"block_size": dc.block_size, "resolved_block_size": model.block_size,
                  "target_layer_ids": list(ids), "captures": list(shell.model.layers_to_capture),
                  "num_target_layers": dc.num_target_layers, "num_context_features": model.num_context_features,
                  "mask_token_id": dc.mask_token_id, "layers": layers},
    }


# ---------------------------------------------------------------------------- our side

def make_draft(model: str, out: Path, layers: int, block_size: int, seed: int = 0) -> Path:
    """A random DFlash draft of ``model``'s shape in z-lab's layout: every tensor random (the norms too)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from eagle3cli.model.dflash import DFlashConfig, DFlashDraft, choose_mask_token
    from eagle3cli.model.layers import dflash_layer_ids
    from eagle3cli.publish.dflash_export import save_dflash

    tcfg = AutoConfig.from_pretrained(model)
    tok = AutoTokenizer.from_pretrained(model)
    mask = choose_mask_token(tcfg.vocab_size, (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id))
    cfg = DFlashConfig.from_target(tcfg, dflash_layer_ids(tcfg.num_hidden_layers), block_size=block_size,
                                   mask_token_id=mask, num_hidden_layers=layers)
    draft = DFlashDraft(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in draft.trainable_state_dict().items():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02 + (1.0 if p.dim() == 1 else 0.0))
    return save_dflash(draft, out, dtype=torch.bfloat16)


def compare(report: dict, summary: dict) -> list[str]:
    """What SGLang read against what ``eagle3 inspect`` says it serves; empty when all agree."""
    r, out = report["reads"], []
    want_b = summary.get("engines", {}).get("sglang", {}).get("speculative_num_draft_tokens")
    if r["resolved_block_size"] != want_b:
        out.append(f"block size: SGLang {r['resolved_block_size']}, inspect's --speculative-num-draft-tokens {want_b}")
    if r["target_layer_ids"] != summary.get("layers_output"):
        out.append(f"target layer ids: SGLang {r['target_layer_ids']}, inspect {summary.get('layers_output')}")
    if r["captures"] != summary.get("layers_j"):
        out.append(f"captured layer inputs: SGLang {r['captures']}, inspect {summary.get('layers_j')}")
    if r["mask_token_id"] != summary.get("mask_token_id"):
        out.append(f"MASK id: SGLang {r['mask_token_id']}, inspect {summary.get('mask_token_id')}")
    if r["num_context_features"] != len(summary.get("layers_j") or []):
        out.append(f"fc inputs: SGLang {r['num_context_features']} target layers, inspect {summary.get('layers_j')}")
    for i, layer in enumerate(r["layers"]):
        if layer["attn_type"] != "non-causal" or layer["sliding_window"] not in (-1, None) or not layer["neox_rope"]:
            out.append(f"layer {i}: SGLang serves {layer}, this package trains a non-causal, full, NeoX-RoPE block")
    if not summary.get("reads_correctly", {}).get("sglang"):
        out.append("inspect says SGLang would not read this draft correctly")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target folder (its config and tokenizer)")
    ap.add_argument("--draft", default=None, help="a DFlash draft folder (default: write a random one of --model)")
    ap.add_argument("--sglang-python", default=sys.executable)
    ap.add_argument("--sglang-path", default=None, help="a folder SGLang was pip-installed into with --target")
    ap.add_argument("--dtype", default="auto", help="SGLang's --dtype (auto: the draft's own)")
    ap.add_argument("--stub", action="append", default=["torchvision"], help="a package to stub at import")
    ap.add_argument("--layers", type=int, default=2, help="layers of the written draft")
    ap.add_argument("--block-size", type=int, default=8, help="block size of the written draft")
    ap.add_argument("--port", type=int, default=29731)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sglang-side", nargs=2, metavar=("TARGET_LAYERS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sglang_side:
        n, out = args.sglang_side
        rep = sglang_side(args.draft, int(n) or None, args.dtype, args.stub, args.port)
        Path(out).write_text(json.dumps(rep, indent=1))
        return 0

    from transformers import AutoConfig

    from eagle3cli.publish.dflash_check import inspect_dflash

    n_target = AutoConfig.from_pretrained(args.model).num_hidden_layers
    with tempfile.TemporaryDirectory() as tmp:
        draft = Path(args.draft) if args.draft else make_draft(args.model, Path(tmp) / "draft", args.layers,
                                                               args.block_size)
        config = json.loads((draft / "config.json").read_text())
        problems, summary = inspect_dflash(draft, config, AutoConfig.from_pretrained(args.model))
        env = dict(os.environ)
        if args.sglang_path:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (args.sglang_path, env.get("PYTHONPATH")) if p)
        cmd = [args.sglang_python, __file__, "--model", args.model, "--draft", str(draft), "--dtype", args.dtype,
               "--port", str(args.port), "--sglang-side", str(n_target), str(Path(tmp) / "out.json")]
        cmd += [a for s in args.stub for a in ("--stub", s)]
        subprocess.run(cmd, check=True, env=env)
        rep = json.loads((Path(tmp) / "out.json").read_text())
    disagree = compare(rep, summary)
    s = rep["sglang"]
    print(f"SGLang {s['version']} ({s['file']}), TP {s['tp_size']}, dtype {s['dtype']}: DFlashDraftModel with "
          f"{len(rep['params'])} parameters; our draft {len(rep['our_keys'])} tensors")
    for c in rep["compared"]:
        print(f"  {c['key']:<42} -> {c['param']}[{c['rows'][0]}:{c['rows'][1]}]  "
              f"{'bit-equal' if c['equal'] else 'DIFFERENT'}{' (cast)' if c['cast'] else ''}")
    print(f"skipped keys: {rep['skipped'] or 'none'}; parameters left unloaded: {rep['left_unloaded'] or 'none'}; "
          f"parameters no key fills: {rep['params_not_covered'] or 'none'}")
    r = rep["reads"]
    print(f"SGLang reads: block size {r['resolved_block_size']} (--speculative-num-draft-tokens), target layer ids "
          f"{r['target_layer_ids']} (captures layer inputs {r['captures']}), fc over {r['num_context_features']} "
          f"layers, MASK {r['mask_token_id']}, layers {r['layers']}")
    print(f"inspect: {problems or 'no problem'}; SGLang count {summary.get('engines', {}).get('sglang')}, layers "
          f"(output) {summary.get('layers_output')}, (input) {summary.get('layers_j')}")
    print(f"agreement with inspect: {disagree or 'all equal'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"report": rep, "inspect": summary, "disagree": disagree}, indent=1))
    bad = rep["skipped"] or rep["mismatched"] or rep["left_unloaded"] or rep["params_not_covered"] or disagree
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
