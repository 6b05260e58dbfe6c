"""Compiled fp32 kernels for the fast path on a CPU: its few-row matmuls and whole one-row layers.

A decoding step of a small target reads every weight once for one row of activations, so its
speed is the memory's streaming rate. oneDNN's prepacked linear, the fastest torch kernel for one
row, streams at about 0.8 of a plain ``sum()`` over the same matrices and sets up for 8-17 us
before each call (121 calls a SmolLM2 step); llama.cpp's own loops run at the bound
(docs/benchmarks.md, "Plain decoding against llama.cpp"). This module compiles, once per CPU and
source, a plain loop nest that reads each weight row once, for all of a verification's input rows
(tiles of weight rows against a few inputs, their sums in registers, shaped by the vector
registers the build targets), and calls it through ctypes on the tensors' memory.

The matmul (``Matrix``) is row-invariant by construction: every (weight row, input row) dot
product is accumulated in the same order (one 16-lane sum over the 16-column blocks, a fixed
halving reduction, then the leftover columns with fmaf), whatever the number of input rows or
threads. So a verification's rows get bitwise the products one-row decoding gets.

A one-row decoding step spends about 30 small tensor ops a layer besides its matmuls (norms,
RoPE, the KV-cache write, attention over the cache, the activation, residual adds), each a few
microseconds of dispatch for a few hundred multiply-adds: 2.7 ms of a SmolLM2 step. ``NativeLayer``
runs a whole Llama-shaped layer in one call: HF's RMSNorm formula in fp32, q and k rotated in
place with RoPE's products as torch computes them (no fused multiply-add), k and v written into
the cache, per query head the scaled scores over the cache, their softmax and the weighted sum of
values (one thread: a few hundred keys), silu(gate) * up, and o_proj and down_proj adding into
the residual stream; its matmuls are ``Matrix``'s kernel. Its norms, exponentials and attention
sums round differently from torch's (about 1e-6 relative), as any other kernel would.

The kernel is built with the system's C compiler (``$CC``, else ``cc``/``gcc``/``clang``) for this
CPU (``-march=native``; ``$EAGLE3_NATIVE_MARCH`` or ``use(march)`` build for another, say haswell for
AVX2, whose tiles fit 16 vector registers instead of AVX-512's 32) and OpenMP, linked to the
libgomp torch itself loaded where torch ships one (one thread pool, not two), into
``$EAGLE3_CACHE/native``. Without a compiler, or with ``EAGLE3_NATIVE=0``, nothing is
built and the fast path keeps oneDNN/MKL: ``available()`` says which, ``status()`` why.

bf16 weights: the same source built with ``-DEAGLE3_WBF16`` (its own library) reads the matrices
as bf16 and widens each to fp32 in registers (exact: bf16 is fp32's upper half), then runs the
same tiles in the same order, with fp32 activations, norms, cache and attention. A step streams
half the bytes, and its results are bitwise those of the fp32 build on the weights rounded to
bf16: row-invariant as the fp32 build is. ``Matrix`` and ``NativeLayer`` take bf16 matrices
(``available_bf16()``); the build follows ``use(march)`` as the fp32 one does.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from .native_source import SOURCE

MAX_ROWS = 16  # input rows it serves: beyond a verification's size a blocked GEMM computes faster

# Contraction into fused multiply-adds is the compiler's default for C; pinned so that every build
# of this source accumulates alike. No -ffast-math: it would let the compiler reorder the sums.
FLAGS = ["-O3", "-ffp-contract=fast", "-fPIC", "-shared", "-fopenmp"]
MARCH_ENV = "EAGLE3_NATIVE_MARCH"  # the -march to build for (default: native, this CPU)

_kernel = None  # the matmul
_attend = None  # one-row attention
_layer = None  # a whole one-row layer
_tiles = None  # the matmul's tile shapes (``tiles()``)
_status = "not built yet"
_builds: dict[str, tuple] = {}  # march -> (matmul, attend, layer, tiles, status), each build loaded once
_march: str | None = None  # the march ``use`` chose last (None: default_march())
_bf16: tuple | None = None  # (matmul, layer) of the bf16-weight build for _march, loaded on first use
_bf16_status = "not built yet"
_bf16_builds: dict[str, tuple] = {}  # march -> (matmul, attend, layer, tiles, status) of the bf16-weight build
WBF16 = "-DEAGLE3_WBF16"  # the define that builds the source for bf16 weights


def _compiler() -> str | None:
    for cc in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        if shutil.which(cc):
            return cc
    return None


def _cpu_id() -> str:
    """What a -march=native build depends on: the CPU's model and flags (a cache shared between
    machines must not hand one CPU another's instructions)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))


def _torch_gomp() -> Path | None:
    """torch's own libgomp, where its wheel ships one: linking to it shares torch's OpenMP threads."""
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*"))
    return found[0] if found else None


def default_march() -> str:
    """The -march the kernels are built for: ``$EAGLE3_NATIVE_MARCH`` (say haswell, or x86-64-v3, to
    run the AVX2 build on an AVX-512 CPU), else native."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def _flags(march: str, bf16: bool = False) -> list[str]:
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", march):
        raise RuntimeError(f"{MARCH_ENV}={march!r} is not a -march value (say native, haswell or x86-64-v3)")
    return [*FLAGS, f"-march={march}", *([WBF16] if bf16 else [])]


def library_path(cc: str, march: str = "native", bf16: bool = False) -> Path:
    from ..core.realmodels import cache_root

    flags = " ".join(_flags(march, bf16))
    key = hashlib.sha256("\0".join([SOURCE, flags, cc, _cpu_id(), torch.__version__]).encode())
    return cache_root() / "native" / f"kernels-{'wbf16-' if bf16 else ''}{key.hexdigest()[:16]}.so"


def _build(cc: str, out: Path, march: str = "native", bf16: bool = False):
    from ..core.io_utils import atomic_path

    src = out.with_name(f"{out.stem}.{os.getpid()}.c")  # one per builder: two processes may build at once
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(SOURCE)
    link = []
    gomp = _torch_gomp()
    if gomp is not None:  # resolve -fopenmp's libgomp to torch's copy (same soname), found at run time by rpath
        link = [f"-L{gomp.parent}", f"-Wl,-rpath,{gomp.parent}"]
    try:
        with atomic_path(out) as tmp:
            proc = subprocess.run([cc, *_flags(march, bf16), "-o", str(tmp), str(src), *link, "-lm"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines()
                raise RuntimeError(f"{cc} failed: {lines[-1] if lines else proc.returncode}")
            _self_test(tmp, bf16)
    finally:
        src.unlink(missing_ok=True)


SELF_TEST = r"""
import ctypes, sys
import torch
fn = ctypes.CDLL(sys.argv[1]).eagle3_gemv_f32
fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
g = torch.Generator().manual_seed(0)
for rows, cols, m in ((37, 70, 3), (64, 576, 1)):
    w, x, b = torch.randn(rows, cols, generator=g), torch.randn(m, cols, generator=g), torch.randn(rows, generator=g)
    if sys.argv[2] == "bf16":
        w = w.bfloat16()
    y = torch.empty(m, rows)
    fn(w.data_ptr(), x.data_ptr(), y.data_ptr(), rows, cols, m, b.data_ptr(), None, 2)
    ref = (x.double() @ w.double().T + b.double()).float()
    if not torch.allclose(y, ref, atol=1e-3, rtol=1e-4):
        sys.exit(f"products off by {(y - ref).abs().max():.3g}")
"""


def _self_test(library: Path, bf16: bool = False):
    """Run the freshly built kernel on small products in a child process, against float64 torch:
    a build whose instructions this CPU (or VM) does not run kills the child, not the caller."""
    import sys

    proc = subprocess.run([sys.executable, "-c", SELF_TEST, str(library), "bf16" if bf16 else "fp32"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"self-test failed ({proc.returncode}): {lines[-1] if lines else 'no output'}")


def reset():
    """Forget the kernels and their status, so that the next call builds or loads them again."""
    global _kernel, _attend, _layer, _tiles, _status, _march, _bf16, _bf16_status
    _kernel, _attend, _layer, _tiles, _status = None, None, None, None, "not built yet"
    _march, _bf16, _bf16_status = None, None, "not built yet"
    _builds.clear()
    _bf16_builds.clear()


def _load(march: str, bf16: bool = False) -> tuple:
    """(matmul, attend, layer, tiles, status) of the build for ``march`` (``bf16``: for bf16 weights),
    built on first use; the functions None where it cannot be."""
    if os.environ.get("EAGLE3_NATIVE", "1") == "0":
        return None, None, None, None, "off (EAGLE3_NATIVE=0)"
    try:
        _flags(march)
    except RuntimeError as e:
        return None, None, None, None, f"not built: {e}"
    cc = _compiler()
    if cc is None:
        return None, None, None, None, "no C compiler (set CC)"
    try:
        path = library_path(cc, march, bf16)
        if not path.exists():
            _build(cc, path, march, bf16)
        fn, attend, layer, tiles = bind(ctypes.CDLL(str(path)), march)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        return None, None, None, None, f"not built: {e}"
    where = "" if march == "native" else f", -march={march}"
    return fn, attend, layer, tiles, f"built with {cc} ({path.name}{where})"


def bind(lib: ctypes.CDLL, march: str) -> tuple:
    """(matmul, attend, layer, tiles) of a loaded build of the source, their argument types set
    (benchmarks/layer_stages.py binds a build of its own with it)."""
    fn, attend, layer, shapes = lib.eagle3_gemv_f32, lib.eagle3_attend, lib.eagle3_layer, lib.eagle3_tiles
    ptr, long = ctypes.c_void_p, ctypes.c_long
    fn.argtypes = [ptr] * 3 + [long] * 3 + [ptr, ptr, ctypes.c_int]
    attend.argtypes = ([ptr, long] + [ptr] * 5 + [long, long, long, ptr, long, long, long, ctypes.c_float, ptr,
                                                  ptr, ctypes.c_int])
    flt = ctypes.c_float
    layer.argtypes = ([ptr, long, long, ptr, ptr, flt] + [ptr] * 5 + [long] + [ptr] * 5 + [long, long, long, ptr]
                      + [long] * 3 + [flt, ptr, ctypes.c_int])
    fn.restype = attend.restype = layer.restype = shapes.restype = None
    out = (ctypes.c_long * 7)()
    shapes(out)
    lanes, block, inputs, *rows = list(out)
    tiles = {"march": march, "lanes": lanes, "block_rows": block, "inputs": inputs,
             "tile_rows": dict(zip(range(1, inputs + 1), rows))}
    return fn, attend, layer, tiles


def use(march: str | None = None) -> bool:
    """Make the build for ``march`` (None: ``default_march()``) the one every ``Matrix``, ``attend``
    and ``NativeLayer`` calls, built or loaded once; whether it is available. Benchmarks and tests
    switch between builds with it in one process (the builds' results differ only where the
    compilers' instructions round differently)."""
    global _kernel, _attend, _layer, _tiles, _status, _march, _bf16, _bf16_status
    march = march or default_march()
    if march not in _builds:
        _builds[march] = _load(march)
    _kernel, _attend, _layer, _tiles, _status = _builds[march]
    if march != _march:  # the bf16-weight build follows, loaded when first asked for
        _march, _bf16, _bf16_status = march, None, "not built yet"
    return _kernel is not None


def kernel():
    """The compiled matmul (a ctypes function), built on first use with the attention kernel beside
    it; None where they cannot be."""
    if _kernel is not None or _status != "not built yet":
        return _kernel
    use()
    return _kernel


def tiles() -> dict | None:
    """The matmul's tile shapes in the build in use: its vector lanes, the weight rows of one unit
    of work, the inputs of one pass over them, and the weight rows of a tile per input count."""
    kernel()
    return _tiles


def available() -> bool:
    return kernel() is not None


def status() -> str:
    """Whether the kernel is in use, and why not where it is not."""
    kernel()
    return _status


def kernel_bf16():
    """(matmul, layer) of the bf16-weight build for the march in use (``use``), built on first use;
    None where it cannot be (no fp32 build either, or its own build failed)."""
    global _bf16, _bf16_status
    if _bf16 is not None or _bf16_status != "not built yet":
        return _bf16
    if kernel() is None:
        _bf16_status = f"not built: {_status}"
        return None
    march = _march or default_march()
    if march not in _bf16_builds:
        _bf16_builds[march] = _load(march, bf16=True)
    fn, _, layer, _, _bf16_status = _bf16_builds[march]
    _bf16 = None if fn is None else (fn, layer)
    return _bf16


def available_bf16() -> bool:
    """Whether the bf16-weight kernels are built (``Matrix`` and ``NativeLayer`` take bf16 matrices)."""
    return kernel_bf16() is not None


def status_bf16() -> str:
    kernel_bf16()
    return _bf16_status


def supports(weight: torch.Tensor) -> bool:
    """Whether ``linear`` can run this weight: fp32 or bf16, contiguous, on a CPU, with the kernel
    for its dtype built."""
    if weight.device.type != "cpu" or not weight.is_contiguous():
        return False
    if weight.dtype == torch.bfloat16:
        return available_bf16()
    return weight.dtype == torch.float32 and available()


class Matrix:
    """A weight (and bias) bound to the kernel, its pointers and shape read once: a decoding step
    calls it 121 times (SmolLM2), where a few microseconds of Python per call add up. A bf16 weight
    runs in the bf16-weight build (fp32 inputs and outputs)."""

    __slots__ = ("weight", "bias", "rows", "cols", "_w", "_b", "bf16")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if not supports(weight):
            raise ValueError(f"the native kernel cannot run a {weight.dtype} weight on {weight.device}: {status()}")
        self.weight, self.bias = weight, None if bias is None else bias.detach().float().contiguous()
        self.rows, self.cols = weight.shape
        self.bf16 = weight.dtype == torch.bfloat16
        self._w = weight.data_ptr()
        self._b = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """add + (x [m, cols] W^T + b) for m <= MAX_ROWS: [m, rows], fp32, on torch's thread count.
        ``add`` [m, rows] (a residual stream) is added as ``add + linear(x)`` would add it."""
        m = x.shape[0]
        if m > MAX_ROWS or x.dim() != 2 or x.shape[1] != self.cols or x.dtype != torch.float32:
            raise ValueError(f"native linear: {tuple(x.shape)} {x.dtype} rows against a weight of "
                             f"{(self.rows, self.cols)} (at most {MAX_ROWS} fp32 rows)")
        if not x.is_contiguous():
            x = x.contiguous()
        if add is not None:
            if add.shape != (m, self.rows) or add.dtype != torch.float32:
                raise ValueError(f"native linear: add {tuple(add.shape)} {add.dtype}, not fp32 {(m, self.rows)}")
            add = add.contiguous()
        y = torch.empty(m, self.rows, dtype=torch.float32)
        fn = (_bf16 or kernel_bf16())[0] if self.bf16 else (_kernel or kernel())
        fn(self._w, x.data_ptr(), y.data_ptr(), self.rows, self.cols, m, self._b,
                None if add is None else add.data_ptr(), torch.get_num_threads())
        return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, cols] W^T (+ b) for m <= MAX_ROWS: [m, rows] (``Matrix`` binds a weight once)."""
    return Matrix(weight, bias)(x)


def _mask_ptr(mask: torch.Tensor | None, n: int, length: int):
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.shape != (n, length) or not mask.is_contiguous():
        raise ValueError(f"native attention: a contiguous bool mask [{n}, {length}], not {tuple(mask.shape)}")
    return mask.data_ptr()


def attend(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
           past: int, n_heads: int, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """n query rows' attention over one layer's cache, RoPE and the cache write included.

    ``qkv`` [n, (nh + 2 nkv) hd] fp32 (q and k are rotated in place, as the torch path does),
    ``positions`` [n] int64, ``cos``/``sin`` [positions, hd] the fast path's tables (sin with its
    first half negated), ``kv`` [2, nkv, P, hd] the layer's cache (row i's k and v written at slot
    past + i), ``mask`` bool [n, past + n] "may attend" (None: causal). Returns [n, nh * hd]:
    softmax(q K^T * scale) V over the slots each row may attend, each query head with its group's."""
    n = qkv.shape[0]
    _, nkv, slots, hd = kv.shape
    tensors = (qkv, kv, cos, sin, positions)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("native attention: qkv, the cache, the RoPE tables and the positions must be contiguous")
    if qkv.dtype != torch.float32 or kv.dtype != torch.float32 or past + n > slots:
        raise ValueError(f"native attention: fp32 only, and slots up to {past + n} within the cache's {slots}")
    if positions.dtype != torch.int64 or positions.shape != (n,) or int(positions.max()) >= cos.shape[0]:
        raise ValueError(f"native attention: {n} int64 positions within the RoPE tables' {cos.shape[0]}")
    out = torch.empty(n, n_heads * hd, dtype=torch.float32)
    threads = torch.get_num_threads()
    scores = torch.empty(threads * (past + n), dtype=torch.float32)
    if _attend is None:
        kernel()  # after a reset(): load it again
    _attend(qkv.data_ptr(), n, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv.data_ptr(),
            kv.data_ptr() + 4 * kv.stride(0), 0, slots, past, _mask_ptr(mask, n, past + n), n_heads, nkv, hd, scale,
            out.data_ptr(), scores.data_ptr(), threads)
    return out


class NativeLayer:
    """A Llama-shaped decoder layer (``fast_target.Layer``: RMSNorms, fused q|k|v with optional bias,
    o, fused gate|up with silu, down) bound to ``eagle3_layer`` for steps of up to MAX_ROWS rows.
    Its four matrices fp32, or all bf16 (the bf16-weight build); norms and bias fp32."""

    __slots__ = ("ptrs", "hidden", "inter", "eps", "scale", "keep", "shape", "bf16")

    def __init__(self, layer, n_heads: int, n_kv: int, head_dim: int):
        mats = [layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight]
        self.bf16 = all(t.dtype == torch.bfloat16 for t in mats)
        if self.bf16 and not available_bf16():
            raise ValueError(f"native layer: bf16 matrices, but the bf16-weight kernels are {status_bf16()}")
        vecs = [layer.ln1, layer.ln2, layer.qkv.bias]
        if (any(t is not None and (t.dtype != torch.float32 or not t.is_contiguous()) for t in vecs)
                or any(t.dtype != (torch.bfloat16 if self.bf16 else torch.float32) or not t.is_contiguous()
                       for t in mats)):
            raise ValueError("native layer: contiguous fp32 norms and bias, and fp32 or all-bf16 matrices")
        tensors = [layer.ln1, layer.ln2, layer.qkv.weight, layer.qkv.bias, layer.o.weight,
                   layer.gate_up.weight, layer.down.weight]
        self.keep = tensors  # the pointers below are into these
        self.ptrs = [None if t is None else t.data_ptr() for t in tensors]
        self.hidden, self.inter = layer.ln1.shape[0], layer.inter
        self.eps, self.scale = float(layer.eps), float(layer.scaling)
        self.shape = (n_heads, n_kv, head_dim)

    def _fn(self):
        """The layer function of the build in use for this layer's weights (loaded again after a reset)."""
        if self.bf16:
            return (_bf16 or kernel_bf16())[1]
        if _layer is None:
            kernel()
        return _layer

    def scratch(self, n: int, past: int) -> int:
        """Floats of scratch an n-row step at slots past.. needs (on torch's thread count)."""
        nh, nkv, hd = self.shape
        per_row = max(self.hidden, self.inter) + (nh + 2 * nkv) * hd + nh * hd + 2 * self.inter
        return n * per_row + torch.get_num_threads() * (past + n)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv: torch.Tensor, past: int, mask: torch.Tensor | None, scratch: torch.Tensor):
        """x [n, H] fp32 contiguous, updated in place; ``positions`` [n] int64 contiguous; ``cos``/
        ``sin`` [positions, hd] (sin with its first half negated); kv [2, nkv, P, hd] the layer's
        cache, written at slots past..past+n-1; ``mask`` bool [n, past + n] or None (causal)."""
        ln1, ln2, wqkv, bqkv, wo, wgu, wd = self.ptrs
        nh, nkv, hd = self.shape
        n = x.shape[0]
        fn = self._fn()
        fn(x.data_ptr(), n, self.hidden, ln1, ln2, self.eps, wqkv, bqkv, wo, wgu, wd, self.inter,
               positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), kv.data_ptr() + 4 * kv.stride(0),
               0, kv.shape[2], past, _mask_ptr(mask, n, past + n), nh, nkv, hd, self.scale, scratch.data_ptr(),
               torch.get_num_threads())

    def slots(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, scratch: torch.Tensor):
        """n independent sequences, one row each (continuous batching): x [n, H] fp32 contiguous,
        updated in place; row i at position ``positions[i]`` (int64 contiguous) of its own cache,
        ``k[i]`` and ``v[i]`` ([slots >= n, nkv, P, hd] contiguous, this layer's), written there and
        attending its slots 0..positions[i]. Row i gets bitwise what a one-row step of that sequence
        alone gets (``__call__`` with past = positions[i]); scratch: ``scratch(n, max position)``."""
        ln1, ln2, wqkv, bqkv, wo, wgu, wd = self.ptrs
        nh, nkv, hd = self.shape
        n = x.shape[0]
        if k.shape != v.shape or k.shape[0] < n or not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError(f"native layer: caches {tuple(k.shape)} and {tuple(v.shape)} for {n} rows")
        fn = self._fn()
        fn(x.data_ptr(), n, self.hidden, ln1, ln2, self.eps, wqkv, bqkv, wo, wgu, wd, self.inter,
               positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0),
               k.shape[2], 0, None, nh, nkv, hd, self.scale, scratch.data_ptr(), torch.get_num_threads())
