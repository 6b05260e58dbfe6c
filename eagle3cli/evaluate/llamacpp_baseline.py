"""llama.cpp's plain decoding of the eval target, prompt by prompt beside ours: the fastest plain
decoder a CPU user has is a baseline too (``eagle3 eval``'s ``baseline_llamacpp``). The target is
served as given (--target-gguf) or converted to GGUF once and kept in the eagle3 cache."""

from __future__ import annotations

import os
from pathlib import Path

from .llamacpp import SERVER, LlamaCppError, Server, check_conversion, find_binary, version, with_extra

OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # torch dtype name -> converter --outtype


class PlainBaseline:
    """llama.cpp's plain decoding of the same target, prompt by prompt beside ours (``eagle3 eval``'s
    ``baseline_llamacpp``). A CPU user decodes with llama.cpp; a speedup against our own plain
    decoding alone would flatter the draft wherever llama.cpp decodes faster."""

    def __init__(self, binary: Path, target_gguf: Path, threads: int | None = None, ctx: int = 4096,
                 log_path: Path | None = None):
        self.binary, self.target_gguf, self.threads = Path(binary), Path(target_gguf), threads
        self.server = Server(self.binary, self.target_gguf, threads=threads, ctx=ctx, log_path=log_path)

    def __enter__(self):
        self.server.__enter__()
        return self

    def __exit__(self, *exc):
        return self.server.__exit__(*exc)

    def decode(self, ids: list[int], max_new_tokens: int) -> tuple[int, float]:
        """(tokens decoded, seconds): the server's own prompt + decoding time, the span our plain
        decoders' timings cover (the prompt pass included), without the HTTP round trip."""
        r = self.server.complete([int(t) for t in ids], max_new_tokens)
        t = r.get("timings") or {}
        n = int(t.get("predicted_n", r.get("tokens_predicted", 0)))
        return n, (float(t.get("prompt_ms", 0.0)) + float(t.get("predicted_ms", 0.0))) / 1000.0

    def describe(self) -> dict:
        return {"name": "llama.cpp", "binary": str(self.binary), "version": version(self.binary),
                "target_gguf": str(self.target_gguf), "threads": self.threads,
                "timing": "server prompt_ms + predicted_ms"}


def cached_target_gguf(target_dir: str | Path, outtype: str, llama_cpp=None, log=print) -> Path:
    """The target converted to GGUF once (llama.cpp's converter) and kept in the eagle3 cache, keyed
    by the folder and its files' sizes and times: a changed folder is converted again."""
    import hashlib

    from ..core.realmodels import cache_root
    from ..publish.gguf_export import GGUFExportError, convert_target

    src = Path(target_dir).resolve()
    stamp = [str(src)] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(src.iterdir())
                          if f.is_file() and f.suffix in (".json", ".safetensors", ".bin")]
    key = hashlib.sha1("\n".join(stamp).encode()).hexdigest()[:12]
    out = cache_root() / "gguf" / f"{src.name}-{key}" / f"target-{outtype}.gguf"
    if out.is_file():
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        convert_target(src, tmp, outtype, llama_cpp, log)
    except GGUFExportError as e:
        tmp.unlink(missing_ok=True)
        raise LlamaCppError(with_extra(str(e))) from None
    tmp.replace(out)
    return out


def plain_baseline(target: str, dtype: str, llama_cpp=None, target_gguf=None, threads: int | None = None,
                   log_dir: Path | None = None, log=print) -> PlainBaseline | None:
    """llama.cpp's plain decoding of ``target`` in ``dtype`` where llama.cpp is installed (--llama-cpp,
    $EAGLE3_LLAMA_CPP or PATH), as ``target_gguf`` or converted once; None, with a note that says
    why, where it is not or the target cannot be converted."""
    try:
        binary = find_binary(SERVER, llama_cpp)
    except LlamaCppError:
        log("llama.cpp not found: speedups are against our own plain decoding (`bash benchmarks/build_llamacpp.sh` "
            "and --llama-cpp DIR add llama.cpp's)")
        return None
    try:
        if target_gguf is None:
            if dtype not in OUTTYPES or not Path(target).is_dir():
                log(f"llama.cpp baseline skipped: --target-gguf FILE is needed ({target} in {dtype} is not a local "
                    "HF folder llama.cpp's converter writes)")
                return None
            check_conversion(target, None, "-", llama_cpp)
            target_gguf = cached_target_gguf(target, OUTTYPES[dtype], llama_cpp, log=lambda m: None)
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        return PlainBaseline(binary, Path(target_gguf), threads,
                             log_path=Path(log_dir) / "llama-server-baseline.log" if log_dir else None)
    except LlamaCppError as e:
        log(f"llama.cpp baseline skipped: {e}")
        return None
