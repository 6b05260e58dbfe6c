"""A compiled fp32 matrix-vector kernel for the fast path's few-row matmuls on a CPU.

A decoding step of a small target reads every weight once for one row of activations, so its
speed is the memory's streaming rate. oneDNN's prepacked linear, the fastest torch kernel for one
row, streams at about 0.8 of a plain ``sum()`` over the same matrices and sets up for 8-17 us
before each call (121 calls a SmolLM2 step); llama.cpp's own loops run at the bound
(docs/benchmarks.md, "Plain decoding against llama.cpp"). This module compiles, once per CPU and
source, a plain loop nest that reads each weight row once and keeps four rows' dot products in
flight, and calls it through ctypes on the tensors' memory.

It is row-invariant by construction: every (weight row, input row) dot product is accumulated in
the same order (two 16-lane partial sums over alternating 16-column blocks, a fixed halving
reduction, then the leftover columns), whatever the number of input rows or threads. So a
verification's rows get bitwise the products one-row decoding gets.

The kernel is built with the system's C compiler (``$CC``, else ``cc``/``gcc``/``clang``) and
OpenMP, linked to the libgomp torch itself loaded where torch ships one (one thread pool, not
two), into ``$EAGLE3_CACHE/native``. Without a compiler, or with ``EAGLE3_NATIVE=0``, nothing is
built and the fast path keeps oneDNN/MKL: ``available()`` says which, ``status()`` why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

MAX_ROWS = 16  # input rows it serves: beyond a verification's size a blocked GEMM computes faster

SOURCE = r"""
#include <string.h>
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 ld(const float* p) { return *(const v16*)p; }

/* a fixed halving order: 16 -> 8 -> 4 lanes, then (0 + 2) + (1 + 3) */
static inline float reduce(v16 a, v16 b) {
    v16 s = a + b;
    v8 l, h; memcpy(&l, &s, 32); memcpy(&h, (const char*)&s + 32, 32);
    v8 s8 = l + h;
    v4 l4, h4; memcpy(&l4, &s8, 16); memcpy(&h4, (const char*)&s8 + 16, 16);
    v4 s4 = l4 + h4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* dot products of weight rows w[0..3] (stride cols) with x: each row's sequence is dot1's */
static inline void dot4(const float* w, long cols, const float* x, float* out) {
    const float *w0 = w, *w1 = w + cols, *w2 = w + 2 * cols, *w3 = w + 3 * cols;
    v16 z = {0}, a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z;
    long i = 0;
    for (; i + 32 <= cols; i += 32) {
        v16 x0 = ld(x + i), x1 = ld(x + i + 16);
        a0 += ld(w0 + i) * x0; b0 += ld(w0 + i + 16) * x1;
        a1 += ld(w1 + i) * x0; b1 += ld(w1 + i + 16) * x1;
        a2 += ld(w2 + i) * x0; b2 += ld(w2 + i + 16) * x1;
        a3 += ld(w3 + i) * x0; b3 += ld(w3 + i + 16) * x1;
    }
    if (i + 16 <= cols) {
        v16 x0 = ld(x + i);
        a0 += ld(w0 + i) * x0; a1 += ld(w1 + i) * x0; a2 += ld(w2 + i) * x0; a3 += ld(w3 + i) * x0;
        i += 16;
    }
    float s0 = reduce(a0, b0), s1 = reduce(a1, b1), s2 = reduce(a2, b2), s3 = reduce(a3, b3);
    for (; i < cols; i++) { s0 += w0[i] * x[i]; s1 += w1[i] * x[i]; s2 += w2[i] * x[i]; s3 += w3[i] * x[i]; }
    out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3;
}

static inline float dot1(const float* w0, long cols, const float* x) {
    v16 z = {0}, a0 = z, b0 = z;
    long i = 0;
    for (; i + 32 <= cols; i += 32) { a0 += ld(w0 + i) * ld(x + i); b0 += ld(w0 + i + 16) * ld(x + i + 16); }
    if (i + 16 <= cols) { a0 += ld(w0 + i) * ld(x + i); i += 16; }
    float s0 = reduce(a0, b0);
    for (; i < cols; i++) s0 += w0[i] * x[i];
    return s0;
}

/* y[m, rows] = x[m, cols] W[rows, cols]^T (+ bias): blocks of four weight rows split statically
   over the threads, each block read once for all m input rows */
void eagle3_gemv_f32(const float* W, const float* x, float* y, long rows, long cols, long m,
                     const float* bias, int threads) {
    long blocks = rows / 4;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long bi = 0; bi < blocks; bi++) {
        long r = bi * 4;
        for (long i = 0; i < m; i++) {
            float o[4];
            dot4(W + r * cols, cols, x + i * cols, o);
            for (int k = 0; k < 4; k++) y[i * rows + r + k] = bias ? o[k] + bias[r + k] : o[k];
        }
    }
    for (long r = blocks * 4; r < rows; r++)
        for (long i = 0; i < m; i++) {
            float v = dot1(W + r * cols, cols, x + i * cols);
            y[i * rows + r] = bias ? v + bias[r] : v;
        }
}
"""

# Contraction into fused multiply-adds is the compiler's default for C; pinned so that every build
# of this source accumulates alike. No -ffast-math: it would let the compiler reorder the sums.
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-fopenmp"]

_kernel = None
_status = "not built yet"


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


def library_path(cc: str) -> Path:
    from ..core.realmodels import cache_root

    key = hashlib.sha256("\0".join([SOURCE, " ".join(FLAGS), cc, _cpu_id(), torch.__version__]).encode())
    return cache_root() / "native" / f"gemv-{key.hexdigest()[:16]}.so"


def _build(cc: str, out: Path):
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
            proc = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(src), *link], capture_output=True, text=True)
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines()
                raise RuntimeError(f"{cc} failed: {lines[-1] if lines else proc.returncode}")
    finally:
        src.unlink(missing_ok=True)


def reset():
    """Forget the kernel and its status, so that the next call builds or loads it again."""
    global _kernel, _status
    _kernel, _status = None, "not built yet"


def kernel():
    """The compiled kernel (a ctypes function), built on first use; None where it cannot be."""
    global _kernel, _status
    if _kernel is not None or _status != "not built yet":
        return _kernel
    if os.environ.get("EAGLE3_NATIVE", "1") == "0":
        _status = "off (EAGLE3_NATIVE=0)"
        return None
    cc = _compiler()
    if cc is None:
        _status = "no C compiler (set CC)"
        return None
    path = library_path(cc)
    try:
        if not path.exists():
            _build(cc, path)
        fn = ctypes.CDLL(str(path)).eagle3_gemv_f32
    except (OSError, RuntimeError, AttributeError) as e:
        _status = f"not built: {e}"
        return None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    _kernel, _status = fn, f"built with {cc} ({path.name})"
    return _kernel


def available() -> bool:
    return kernel() is not None


def status() -> str:
    """Whether the kernel is in use, and why not where it is not."""
    kernel()
    return _status


def supports(weight: torch.Tensor) -> bool:
    """Whether ``linear`` can run this weight: fp32, contiguous, on a CPU, with the kernel built."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.is_contiguous()
            and available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, cols] W^T (+ b) for m <= MAX_ROWS: [m, rows], fp32, on torch's thread count."""
    m, cols = x.shape
    rows = weight.shape[0]
    if m > MAX_ROWS or cols != weight.shape[1]:
        raise ValueError(f"native linear: {m} rows of {cols} against a weight of {tuple(weight.shape)}")
    x = x.contiguous()
    y = torch.empty(m, rows, dtype=torch.float32)
    if bias is not None:
        bias = bias.contiguous()
    _kernel(weight.data_ptr(), x.data_ptr(), y.data_ptr(), rows, cols, m,
            None if bias is None else bias.data_ptr(), torch.get_num_threads())
    return y
