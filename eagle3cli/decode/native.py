"""Compiled fp32 kernels for the fast path on a CPU: its few-row matmuls and whole one-row layers.

A decoding step of a small target reads every weight once for one row of activations, so its
speed is the memory's streaming rate. oneDNN's prepacked linear, the fastest torch kernel for one
row, streams at about 0.8 of a plain ``sum()`` over the same matrices and sets up for 8-17 us
before each call (121 calls a SmolLM2 step); llama.cpp's own loops run at the bound
(docs/benchmarks.md, "Plain decoding against llama.cpp"). This module compiles, once per CPU and
source, a plain loop nest that reads each weight row once, for all of a verification's input rows
(tiles of 8 weight rows against up to 3 inputs, their sums in registers), and calls it through
ctypes on the tensors' memory.

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
#include <math.h>
#include <omp.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 ld(const float* p) { return *(const v16*)p; }

/* a fixed halving order: 16 -> 8 -> 4 lanes, then (0 + 2) + (1 + 3) */
static inline float reduce1(v16 s) {
    v8 l, h; memcpy(&l, &s, 32); memcpy(&h, (const char*)&s + 32, 32);
    v8 s8 = l + h;
    v4 l4, h4; memcpy(&l4, &s8, 16); memcpy(&h4, (const char*)&s8 + 16, 16);
    v4 s4 = l4 + h4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* a . b over n floats (norms, attention): two 16-lane partial sums over alternating 16-element
   blocks, reduce, then the leftover elements one by one */
static inline float dot(const float* a, const float* b, long n) {
    v16 z = {0}, s = z, t = z;
    long i = 0;
    for (; i + 32 <= n; i += 32) { s += ld(a + i) * ld(b + i); t += ld(a + i + 16) * ld(b + i + 16); }
    if (i + 16 <= n) { s += ld(a + i) * ld(b + i); i += 16; }
    float r = reduce1(s + t);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* The matmul's tiles. Every (weight row, input row) product is accumulated in one 16-lane sum over
   the 16-column blocks in order, reduced in reduce1's order, then the leftover columns are added
   one by one with fmaf: the same sequence whichever tile computes it, so a row's result does not
   depend on how many input rows come with it. A tile holds TR weight rows against up to TM input
   rows (24 accumulators, within the 32 vector registers): the rows are read from memory once and
   from L1 for the other inputs, and each input's vector is loaded once for TR rows. Fewer weight
   rows a tile made extra inputs cost more than the memory stream they overlap; more inputs spill.
   With several inputs (pf) each step also prefetches the next tile's rows at the same columns: the
   memory keeps streaming while the extra inputs are multiplied (a 4-row SmolLM2 step's matmuls
   1.05x one row's, against 1.20-1.28x without); one row needs no help from it. (The last tile's
   prefetches point past the matrix: a prefetch never faults, and reads nothing it cannot.) */
#define TR 8
#define TM 3
#define TILE(M)                                                                                      \
static inline __attribute__((always_inline)) void tile##M(const float* w, long cols, const float* x, \
                                                          float* out, int pf) {                      \
    v16 z = {0}, acc[TR][M];                                                                         \
    for (int r = 0; r < TR; r++) for (int j = 0; j < M; j++) acc[r][j] = z;                          \
    long c = 0;                                                                                      \
    for (; c + 16 <= cols; c += 16) {                                                                \
        v16 xv[M];                                                                                   \
        for (int j = 0; j < M; j++) xv[j] = ld(x + j * cols + c);                                    \
        if (pf) for (int r = 0; r < TR; r++) __builtin_prefetch(w + (TR + r) * cols + c, 0, 0);     \
        for (int r = 0; r < TR; r++) {                                                               \
            v16 wv = ld(w + r * cols + c);                                                           \
            for (int j = 0; j < M; j++) acc[r][j] += wv * xv[j];                                     \
        }                                                                                            \
    }                                                                                                \
    for (int r = 0; r < TR; r++)                                                                     \
        for (int j = 0; j < M; j++) {                                                                \
            float s = reduce1(acc[r][j]);                                                            \
            for (long t = c; t < cols; t++) s = fmaf(w[r * cols + t], x[j * cols + t], s);           \
            out[j * TR + r] = s;                                                                     \
        }                                                                                            \
}
TILE(1) TILE(2) TILE(3)

/* one weight row against one input row, in the tiles' order (the rows after the last full tile) */
static inline float dot_row(const float* w, const float* x, long cols) {
    v16 a = {0};
    long c = 0;
    for (; c + 16 <= cols; c += 16) a += ld(w + c) * ld(x + c);
    float s = reduce1(a);
    for (long t = c; t < cols; t++) s = fmaf(w[t], x[t], s);
    return s;
}

#if defined(__clang__)
#define NO_FMA
#else
#define NO_FMA __attribute__((optimize("fp-contract=off")))
#endif

/* RoPE on heads [heads, hd] in place: x * cos + swap(x) * sin_signed, each product rounded before
   the sum, as torch's separate mul and add round them */
NO_FMA static void rope(float* x, const float* cos, const float* sin, long heads, long hd) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    long half = hd / 2;
    for (long h = 0; h < heads; h++) {
        float* v = x + h * hd;
        for (long d = 0; d < half; d++) {
            float a = v[d], b = v[d + half];
            float sa = b * sin[d], sb = a * sin[d + half];
            float ca = a * cos[d], cb = b * cos[d + half];
            v[d] = ca + sa;
            v[d + half] = cb + sb;
        }
    }
}

/* e^x, 16 at a time: x = k ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative
   error below 1e-8, under float's rounding), times 2^k through the exponent bits. Below -87 (e^x
   under float's smallest normal) it returns 0; above 88 it returns e^88 (silu's use: g / (1 + e^-g)
   is then 0 to float's precision). expf one element at a time was a third of a head's attention
   and most of silu's time. */
typedef int vi16 __attribute__((vector_size(64)));
static inline v16 vsel(vi16 m, v16 a, v16 b) {  /* m ? a : b, lane by lane */
    vi16 ai, bi;
    memcpy(&ai, &a, 64); memcpy(&bi, &b, 64);
    vi16 r = (ai & m) | (bi & ~m);
    v16 out;
    memcpy(&out, &r, 64);
    return out;
}
static inline v16 vexp(v16 x) {
    const v16 lo = {0}, magic = lo + 12582912.f;  /* 1.5 * 2^23: adding it rounds to an integer */
    vi16 under = x < -87.f;
    x = vsel(x > 88.f, lo + 88.f, x);
    v16 t = x * 1.44269504f + magic;
    v16 k = t - magic;
    v16 r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f;  /* ln2 in two parts */
    v16 e = 1.f / 5040 + lo;
    e = e * r + 1.f / 720; e = e * r + 1.f / 120; e = e * r + 1.f / 24;
    e = e * r + 1.f / 6; e = e * r + 0.5f; e = e * r + 1.f; e = e * r + 1.f;
    vi16 bits = (__builtin_convertvector(k, vi16) + 127) << 23;
    v16 scale2;
    memcpy(&scale2, &bits, 64);
    return vsel(under, lo, e * scale2);
}

#define MAX_HD16 16  /* head dims up to 256 keep their output in registers */

/* one query head over its keys: scores, their softmax, the weighted sum of values (hd a multiple
   of 16): q and the output held in vectors, the exponentials 16 at a time */
static inline void head_v(const float* q, const float* K, const float* V, const unsigned char* may, long last,
                          long hd, float scale, float* sc, float* o) {
    long nv = hd / 16;
    v16 qv[MAX_HD16], acc[MAX_HD16], z = {0};
    for (long k = 0; k < nv; k++) { qv[k] = ld(q + 16 * k); acc[k] = z; }
    float mx = -INFINITY;
    for (long t = 0; t < last; t++) {
        const float* kt = K + t * hd;
        v16 s = qv[0] * ld(kt);
        for (long k = 1; k < nv; k++) s += qv[k] * ld(kt + 16 * k);
        float v = reduce1(s) * scale;
        sc[t] = v;
        if ((!may || may[t]) && v > mx) mx = v;
    }
    long t = 0;
    for (; t + 16 <= last; t += 16) *(v16*)(sc + t) = vexp(ld(sc + t) - mx);
    if (t < last) {
        float tail[16];
        for (long j = 0; j < 16; j++) tail[j] = t + j < last ? sc[t + j] - mx : -INFINITY;
        v16 e = vexp(ld(tail));
        memcpy(sc + t, &e, (last - t) * sizeof(float));
    }
    float sum = 0.f;
    for (t = 0; t < last; t++) if (!may || may[t]) sum += sc[t];
    float inv = 1.f / sum;
    for (t = 0; t < last; t++) {
        if (may && !may[t]) continue;
        float pt = sc[t] * inv;
        const float* vt = V + t * hd;
        for (long k = 0; k < nv; k++) acc[k] += pt * ld(vt + 16 * k);
    }
    for (long k = 0; k < nv; k++) memcpy(o + 16 * k, &acc[k], 64);
}

/* the same for any head dim, one key and one element at a time */
static inline void head_scalar(const float* q, const float* K, const float* V, const unsigned char* may,
                               long last, long hd, float scale, float* sc, float* o) {
    float mx = -INFINITY, sum = 0.f;
    for (long t = 0; t < last; t++) {
        if (may && !may[t]) continue;
        float s = dot(q, K + t * hd, hd) * scale;
        sc[t] = s;
        mx = s > mx ? s : mx;
    }
    for (long t = 0; t < last; t++) {
        if (may && !may[t]) continue;
        sc[t] = expf(sc[t] - mx);
        sum += sc[t];
    }
    for (long d = 0; d < hd; d++) o[d] = 0.f;
    for (long t = 0; t < last; t++) {
        if (may && !may[t]) continue;
        float p = sc[t] / sum;
        const float* v = V + t * hd;
        for (long d = 0; d < hd; d++) o[d] += p * v[d];
    }
}

/* n query rows over one layer's cache kv [2, nkv, P, hd] (keys, then values), the rows at slots
   past..past+n-1: rotate q and k of each row of qkv [n, q heads | k heads | v heads] in place at
   its position pos[i] (cos, sin: tables [positions, hd]), write its k and v at slot past + i, and
   out[i] = softmax(q K^T * scale) V per query head (its KV group's keys) over the slots row i may
   attend: mask[i * (past + n) + t] != 0, or (mask NULL) every slot up to past + i.
   scores: scratch of threads * (past + n) floats. The (row, head) pairs are split over the threads
   once there is enough work to pay for waking them (a verification's rows over a long cache: one
   thread took about 2 ms of a SmolLM2 4-row step); each pair is computed alike on any thread. */
void eagle3_attend(float* qkv, long n, const long* pos, const float* cos, const float* sin, float* kv, long P,
                   long past, const unsigned char* mask, long nh, long nkv, long hd, float scale, float* out,
                   float* scores, int threads) {
    long nq = (nh + 2 * nkv) * hd, len = past + n, group = nh / nkv;
    float *kc = kv, *vc = kv + nkv * P * hd;
    for (long i = 0; i < n; i++) {
        float* row = qkv + i * nq;
        rope(row, cos + pos[i] * hd, sin + pos[i] * hd, nh + nkv, hd);
        for (long g = 0; g < nkv; g++) {
            memcpy(kc + (g * P + past + i) * hd, row + (nh + g) * hd, hd * sizeof(float));
            memcpy(vc + (g * P + past + i) * hd, row + (nh + nkv + g) * hd, hd * sizeof(float));
        }
    }
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * nh * len * hd >= 65536)
    for (long ih = 0; ih < n * nh; ih++) {
        long i = ih / nh, h = ih % nh;
        const unsigned char* may = mask ? mask + i * len : 0;
        long last = mask ? len : past + i + 1;
        float* sc = scores + omp_get_thread_num() * len;
        const float* q = qkv + i * nq + h * hd;
        const float *K = kc + (h / group) * P * hd, *V = vc + (h / group) * P * hd;
        float* o = out + i * nh * hd + h * hd;
        if (hd % 16 == 0 && hd <= 16 * MAX_HD16) head_v(q, K, V, may, last, hd, scale, sc, o);
        else head_scalar(q, K, V, may, last, hd, scale, sc, o);
    }
}

/* (x W^T + bias) then + add, rounded as those two separate operations would round */
static inline float finish(float v, const float* bias, const float* add, long i, long rows, long r) {
    if (bias) v = v + bias[r];
    return add ? add[i * rows + r] + v : v;
}

/* y[m, rows] = add + (x[m, cols] W[rows, cols]^T + bias), bias and add optional: tiles of TR weight
   rows split statically over the threads, each read once for all m input rows, TM inputs at a time */
void eagle3_gemv_f32(const float* W, const float* x, float* y, long rows, long cols, long m,
                     const float* bias, const float* add, int threads) {
    long tiles = rows / TR;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long ti = 0; ti < tiles; ti++) {
        long r = ti * TR;
        for (long i = 0; i < m;) {
            long n = m - i < TM ? m - i : TM;
            float o[TM * TR];
            const float *w = W + r * cols, *xi = x + i * cols;
            if (n == 3) tile3(w, cols, xi, o, m > 1);
            else if (n == 2) tile2(w, cols, xi, o, m > 1);
            else tile1(w, cols, xi, o, m > 1);
            for (long j = 0; j < n; j++)
                for (int k = 0; k < TR; k++)
                    y[(i + j) * rows + r + k] = finish(o[j * TR + k], bias, add, i + j, rows, r + k);
            i += n;
        }
    }
    for (long r = tiles * TR; r < rows; r++)
        for (long i = 0; i < m; i++)
            y[i * rows + r] = finish(dot_row(W + r * cols, x + i * cols, cols), bias, add, i, rows, r);
}

/* out = w * (x * rsqrt(mean(x^2) + eps)), HF's LlamaRMSNorm in fp32 */
static void rmsnorm(const float* x, const float* w, float eps, long n, float* out) {
    float r = 1.f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (long i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* A Llama-shaped decoder layer for n rows, x [n, H] updated in place:
   x += o(attention(rope(qkv(norm1(x))))); x += down(silu(gate) * up of gate_up(norm2(x))).
   scratch: n (max(H, inter) + (nh + 2 nkv) hd + nh hd + 2 inter) + threads (past + n) floats. */
void eagle3_layer(float* x, long n, long H, const float* ln1, const float* ln2, float eps,
                  const float* Wqkv, const float* bqkv, const float* Wo, const float* Wgu, const float* Wd,
                  long inter, const long* pos, const float* cos, const float* sin, float* kv, long P, long past,
                  const unsigned char* mask, long nh, long nkv, long hd, float scale, float* scratch, int threads) {
    long nq = (nh + 2 * nkv) * hd, wide = H > inter ? H : inter;
    float *h = scratch, *qkv = h + n * wide, *attn = qkv + n * nq, *gu = attn + n * nh * hd;
    float *scores = gu + n * 2 * inter;
    for (long i = 0; i < n; i++) rmsnorm(x + i * H, ln1, eps, H, h + i * H);
    eagle3_gemv_f32(Wqkv, h, qkv, nq, H, n, bqkv, 0, threads);
    eagle3_attend(qkv, n, pos, cos, sin, kv, P, past, mask, nh, nkv, hd, scale, attn, scores, threads);
    eagle3_gemv_f32(Wo, attn, x, H, nh * hd, n, 0, x, threads);
    for (long i = 0; i < n; i++) rmsnorm(x + i * H, ln2, eps, H, h + i * H);
    eagle3_gemv_f32(Wgu, h, gu, 2 * inter, H, n, 0, 0, threads);
    /* silu(gate) * up, 16 elements at a time (vexp), rows split over the threads */
    #pragma omp parallel for schedule(static) num_threads(threads) if (n > 1)
    for (long i = 0; i < n; i++) {
        const float *g = gu + i * 2 * inter, *up = g + inter;
        float* hi = h + i * inter;
        long j = 0;
        for (; j + 16 <= inter; j += 16) {
            v16 gv = ld(g + j);
            v16 a = gv / (1.f + vexp(-gv)) * ld(up + j);
            memcpy(hi + j, &a, 64);
        }
        for (; j < inter; j++) hi[j] = g[j] / (1.f + expf(-g[j])) * up[j];
    }
    eagle3_gemv_f32(Wd, h, x, H, inter, n, 0, x, threads);
}
"""

# Contraction into fused multiply-adds is the compiler's default for C; pinned so that every build
# of this source accumulates alike. No -ffast-math: it would let the compiler reorder the sums.
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-fopenmp"]

_kernel = None  # the matmul
_attend = None  # one-row attention
_layer = None  # a whole one-row layer
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
    return cache_root() / "native" / f"kernels-{key.hexdigest()[:16]}.so"


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
            proc = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(src), *link, "-lm"], capture_output=True, text=True)
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines()
                raise RuntimeError(f"{cc} failed: {lines[-1] if lines else proc.returncode}")
            _self_test(tmp)
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
    y = torch.empty(m, rows)
    fn(w.data_ptr(), x.data_ptr(), y.data_ptr(), rows, cols, m, b.data_ptr(), None, 2)
    ref = (x.double() @ w.double().T + b.double()).float()
    if not torch.allclose(y, ref, atol=1e-3, rtol=1e-4):
        sys.exit(f"products off by {(y - ref).abs().max():.3g}")
"""


def _self_test(library: Path):
    """Run the freshly built kernel on small products in a child process, against float64 torch:
    a build whose instructions this CPU (or VM) does not run kills the child, not the caller."""
    import sys

    proc = subprocess.run([sys.executable, "-c", SELF_TEST, str(library)], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"self-test failed ({proc.returncode}): {lines[-1] if lines else 'no output'}")


def reset():
    """Forget the kernel and its status, so that the next call builds or loads it again."""
    global _kernel, _attend, _layer, _status
    _kernel, _attend, _layer, _status = None, None, None, "not built yet"


def kernel():
    """The compiled matmul (a ctypes function), built on first use with the attention kernel beside
    it; None where they cannot be."""
    global _kernel, _attend, _layer, _status
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
        lib = ctypes.CDLL(str(path))
        fn, attend, layer = lib.eagle3_gemv_f32, lib.eagle3_attend, lib.eagle3_layer
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        _status = f"not built: {e}"
        return None
    ptr, long = ctypes.c_void_p, ctypes.c_long
    fn.argtypes = [ptr] * 3 + [long] * 3 + [ptr, ptr, ctypes.c_int]
    attend.argtypes = ([ptr, long] + [ptr] * 4 + [long, long, ptr, long, long, long, ctypes.c_float, ptr, ptr]
                       + [ctypes.c_int])
    flt = ctypes.c_float
    layer.argtypes = ([ptr, long, long, ptr, ptr, flt] + [ptr] * 5 + [long] + [ptr] * 4 + [long, long, ptr]
                      + [long] * 3 + [flt, ptr, ctypes.c_int])
    fn.restype = attend.restype = layer.restype = None
    _kernel, _attend, _layer, _status = fn, attend, layer, f"built with {cc} ({path.name})"
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


class Matrix:
    """A weight (and bias) bound to the kernel, its pointers and shape read once: a decoding step
    calls it 121 times (SmolLM2), where a few microseconds of Python per call add up."""

    __slots__ = ("weight", "bias", "rows", "cols", "_w", "_b")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if not supports(weight):
            raise ValueError(f"the native kernel cannot run a {weight.dtype} weight on {weight.device}: {status()}")
        self.weight, self.bias = weight, None if bias is None else bias.detach().float().contiguous()
        self.rows, self.cols = weight.shape
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
        (_kernel or kernel())(self._w, x.data_ptr(), y.data_ptr(), self.rows, self.cols, m, self._b,
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
    _attend(qkv.data_ptr(), n, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), slots, past,
            _mask_ptr(mask, n, past + n), n_heads, nkv, hd, scale, out.data_ptr(), scores.data_ptr(), threads)
    return out


class NativeLayer:
    """A Llama-shaped decoder layer (``fast_target.Layer``: RMSNorms, fused q|k|v with optional bias,
    o, fused gate|up with silu, down) bound to ``eagle3_layer`` for steps of up to MAX_ROWS rows."""

    __slots__ = ("ptrs", "hidden", "inter", "eps", "scale", "keep", "shape")

    def __init__(self, layer, n_heads: int, n_kv: int, head_dim: int):
        tensors = [layer.ln1, layer.ln2, layer.qkv.weight, layer.qkv.bias, layer.o.weight,
                   layer.gate_up.weight, layer.down.weight]
        if any(t is not None and (t.dtype != torch.float32 or not t.is_contiguous()) for t in tensors):
            raise ValueError("native layer: fp32 contiguous weights only")
        self.keep = tensors  # the pointers below are into these
        self.ptrs = [None if t is None else t.data_ptr() for t in tensors]
        self.hidden, self.inter = layer.ln1.shape[0], layer.inter
        self.eps, self.scale = float(layer.eps), float(layer.scaling)
        self.shape = (n_heads, n_kv, head_dim)

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
        if _layer is None:
            kernel()  # after a reset(): load it again
        _layer(x.data_ptr(), n, self.hidden, ln1, ln2, self.eps, wqkv, bqkv, wo, wgu, wd, self.inter,
               positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), kv.shape[2], past,
               _mask_ptr(mask, n, past + n), nh, nkv, hd, self.scale, scratch.data_ptr(), torch.get_num_threads())
