"""The C source of eagle3's CPU decoding kernels (``native`` compiles and loads it).

One fp32 matmul for up to MAX_ROWS input rows (``eagle3_gemv_f32``), the attention of n query
rows over one layer's KV cache with RoPE and the cache write (``eagle3_attend``), and a whole
Llama-shaped decoder layer (``eagle3_layer``). GCC/Clang vector extensions, no intrinsics: the
compiler targets the building CPU (-march=native, or the one ``native`` is asked for), and the
matmul's tile shapes follow that target's vector registers. Each function's comment says how it keeps its
results independent of the row count and the threads, which is what makes a verification bitwise
one-token decoding.
"""

SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  /* loads at any float's address */
typedef float v4 __attribute__((vector_size(16)));

static inline v16 ld(const float* p) { return *(const v16*)p; }
static inline v8 ld8(const float* p) { return *(const v8u*)p; }

/* The build's vector (vt, VL lanes): a zmm on AVX-512, a ymm below it. Every loop runs on it, and
   a 16-lane sum is NH of them side by side (their lanes the 16 lanes in order, each added in the
   same order, so every width computes alike). GCC splits a 64-byte vector into halves on AVX2 but
   moves its halves through the stack (vector compares, selects and conversions the worst): written
   in v16 the AVX2 build's attention took 1.3 ms of a SmolLM2 step for one row and 4.2 for four,
   against 0.4 and 1.0 on AVX-512. */
#if defined(__AVX512F__)
#define VL 16
typedef v16 vt;
typedef int vti __attribute__((vector_size(64)));
#define LDV ld
#else
#define VL 8
typedef v8 vt;
typedef int vti __attribute__((vector_size(32)));
#define LDV ld8
#endif
#define NH (16 / VL)  /* vectors a 16-lane sum takes */
static inline void stv(float* p, vt a) { memcpy(p, &a, sizeof a); }

/* The matrices' weights (wt): fp32, or bf16 with -DEAGLE3_WBF16 (activations, norms, cache, attention
   stay fp32). LDW loads VL as a vt, WF one as a float: bf16 -> fp32 is exact, so a bf16 build gives
   bitwise the fp32 build's results on the weights rounded to bf16. x86: one widening load and a shift
   (GCC split the vector extension's in two: 11% slower on AVX2). A bf16 row is too short for the
   hardware prefetcher: one row prefetches too (PF_ONE; SmolLM2's matmuls 33% faster, one AMX core). */
#ifdef EAGLE3_WBF16
typedef unsigned short wt;
#if defined(__AVX512F__)
#include <immintrin.h>
#define WIDEN(p) _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p))), 16)
#elif defined(__AVX2__)
#include <immintrin.h>
#define WIDEN(p) _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p))), 16)
#else
typedef unsigned short vwh __attribute__((vector_size(VL * 2), aligned(2)));
typedef unsigned int vwu __attribute__((vector_size(VL * 4)));
#define WIDEN(p) (__builtin_convertvector(*(const vwh*)(p), vwu) << 16)
#endif
static inline vt ldw(const wt* p) { __typeof__(WIDEN(p)) u = WIDEN(p); vt f; memcpy(&f, &u, sizeof f); return f; }
static inline float wf(wt b) { unsigned int u = (unsigned int)b << 16; float f; memcpy(&f, &u, 4); return f; }
#define LDW ldw
#define WF wf
#define PF_ONE 1
#else
typedef float wt;
#define LDW LDV
#define WF(x) (x)
#define PF_ONE 0
#endif

/* a fixed halving order: 16 -> 8 -> 4 lanes, then (0 + 2) + (1 + 3) */
static inline float reduce8(v8 s8) {
    v4 l4, h4; memcpy(&l4, &s8, 16); memcpy(&h4, (const char*)&s8 + 16, 16);
    v4 s4 = l4 + h4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
static inline float reduce1(v16 s) {
    v8 l, h; memcpy(&l, &s, 32); memcpy(&h, (const char*)&s + 32, 32);
    return reduce8(l + h);
}

/* a 16-lane sum held as NH vectors, reduced as reduce1 reduces it */
static inline float reduce_parts(const vt* a) {
#if NH == 1
    return reduce1(a[0]);
#else
    return reduce8(a[0] + a[1]);
#endif
}

/* a . b over n floats (norms, attention): two 16-lane partial sums over alternating 16-element
   blocks, reduce, then the leftover elements one by one */
static inline float dot(const float* a, const float* b, long n) {
    vt z = {0}, s[NH], t[NH], u[NH];
    for (int h = 0; h < NH; h++) s[h] = t[h] = z;
    long i = 0;
    for (; i + 32 <= n; i += 32)
        for (int h = 0; h < NH; h++) {
            s[h] += LDV(a + i + h * VL) * LDV(b + i + h * VL);
            t[h] += LDV(a + i + 16 + h * VL) * LDV(b + i + 16 + h * VL);
        }
    if (i + 16 <= n) {
        for (int h = 0; h < NH; h++) s[h] += LDV(a + i + h * VL) * LDV(b + i + h * VL);
        i += 16;
    }
    for (int h = 0; h < NH; h++) u[h] = s[h] + t[h];
    float r = reduce_parts(u);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* The matmul's tiles. Every (weight row, input row) product is accumulated in one 16-lane sum over
   the 16-column blocks in order, reduced in reduce1's order, then the leftover columns are added
   one by one with fmaf: the same sequence whichever tile computes it, so a row's result does not
   depend on how many input rows come with it (nor on the tile shapes below, which only decide
   which sums are in registers at once: every build of this source gives the same bits where its
   instructions round alike).

   A tile holds R weight rows against M input rows, all R * M sums in registers: the rows are read
   from memory once and from L1 for the other inputs, and each input's vector is loaded once for R
   rows. The shapes are the register file's. AVX-512 (32 zmm, a 16-lane sum in one): 8 rows
   against up to 3 inputs (24 sums), 4 rows against 4 (16). Narrower vectors (AVX2: 16 ymm, a
   16-lane sum in two halves of 8 lanes, computed one half after the other, which adds the same
   lanes in the same order): R * M * 2 halves + M inputs + 1 weight vector within 16, so 4 rows
   against 1 input, 2 rows against 2 or 3, 1 row against 4; the AVX-512 shapes spilled there (3
   rows cost 3.3x one on an AMD Zen 1). T_OR weight rows (a multiple of every R) are one unit of
   work: a pass of T_M inputs streams them from memory, the later passes find them in L1/L2.
   With several inputs (pf) each step also prefetches the rows T_OR further down at the same
   columns: the memory keeps streaming while the extra inputs are multiplied (a 4-row SmolLM2
   step's matmuls 1.02-1.08x one row's, against 1.20-1.33x without); one row needs no help from
   it. The prefetch goes to L2 and beyond (prefetcht2): the non-temporal hint, as good on an AMD
   EPYC, made 2 rows cost 2.4x one on an Intel Xeon. (The last tile's prefetches point past the
   matrix: a prefetch never faults, and reads nothing it cannot.) Each shape can be overridden at
   build time (-DEAGLE3_R1=.., -DEAGLE3_PF=..), for timing others. */
#if defined(__AVX512F__)
#define T_OR 8
#define T_M 4
#define T_R1 8
#define T_R2 8
#define T_R3 8
#define T_R4 4
#else
#define T_OR 4
#define T_M 4
#define T_R1 4
#define T_R2 2
#define T_R3 2
#define T_R4 1
#endif
#ifndef EAGLE3_PF
#define EAGLE3_PF 1  /* the prefetches' locality: 1 is prefetcht2 on x86 */
#endif
#ifdef EAGLE3_OR
#undef T_OR
#define T_OR EAGLE3_OR
#endif
#ifdef EAGLE3_M
#undef T_M
#define T_M EAGLE3_M
#endif
#ifdef EAGLE3_R1
#undef T_R1
#define T_R1 EAGLE3_R1
#endif
#ifdef EAGLE3_R2
#undef T_R2
#define T_R2 EAGLE3_R2
#endif
#ifdef EAGLE3_R3
#undef T_R3
#define T_R3 EAGLE3_R3
#endif
#ifdef EAGLE3_R4
#undef T_R4
#define T_R4 EAGLE3_R4
#endif
#if T_M < 1 || T_M > 4 || T_OR % T_R1 || T_OR % T_R2 || T_OR % T_R3 || T_OR % T_R4
#error "tiles: 1 to 4 inputs, and OR a multiple of every R"
#endif

/* R weight rows at w (row stride cols) against M inputs at x; out[j * T_OR + r] */
#define TILE(R, M)                                                                                   \
static inline __attribute__((always_inline)) void tile##M(const wt* w, long cols, const float* x,    \
                                                          float* out, int pf) {                      \
    vt z = {0}, acc[R][M][NH];                                                                       \
    for (int r = 0; r < R; r++) for (int j = 0; j < M; j++) for (int h = 0; h < NH; h++) acc[r][j][h] = z; \
    long c = 0;                                                                                      \
    for (; c + 16 <= cols; c += 16) {                                                                \
        if (pf) for (int r = 0; r < R; r++) __builtin_prefetch(w + (T_OR + r) * cols + c, 0, EAGLE3_PF); \
        for (int h = 0; h < NH; h++) {                                                               \
            vt xv[M];                                                                                \
            for (int j = 0; j < M; j++) xv[j] = LDV(x + j * cols + c + h * VL);                      \
            for (int r = 0; r < R; r++) {                                                            \
                vt wv = LDW(w + r * cols + c + h * VL);                                              \
                for (int j = 0; j < M; j++) acc[r][j][h] += wv * xv[j];                              \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    for (int r = 0; r < R; r++)                                                                      \
        for (int j = 0; j < M; j++) {                                                                \
            float s = reduce_parts(acc[r][j]);                                                       \
            for (long t = c; t < cols; t++) s = fmaf(WF(w[r * cols + t]), x[j * cols + t], s);       \
            out[j * T_OR + r] = s;                                                                   \
        }                                                                                            \
}
TILE(T_R1, 1) TILE(T_R2, 2) TILE(T_R3, 3) TILE(T_R4, 4)

/* M inputs against the T_OR rows at w, in tiles of R rows */
#define RUN(R, M) for (int r = 0; r < T_OR; r += R) tile##M(w + r * cols, cols, xi, o + r, pf)
static inline void tiles(const wt* w, long cols, const float* xi, long n, float* o, int pf) {
    if (n >= 4) RUN(T_R4, 4);
    else if (n == 3) RUN(T_R3, 3);
    else if (n == 2) RUN(T_R2, 2);
    else RUN(T_R1, 1);
}

/* the tile shapes built: vector lanes, OR, inputs a pass, then the rows of a tile for 1..4 inputs */
void eagle3_tiles(long* out) {
    long v[] = {VL, T_OR, T_M, T_R1, T_R2, T_R3, T_R4};
    memcpy(out, v, sizeof v);
}

/* one weight row against one input row, in the tiles' order (the rows after the last full tile) */
static inline float dot_row(const wt* w, const float* x, long cols) {
    vt z = {0}, a[NH];
    for (int h = 0; h < NH; h++) a[h] = z;
    long c = 0;
    for (; c + 16 <= cols; c += 16)
        for (int h = 0; h < NH; h++) a[h] += LDW(w + c + h * VL) * LDV(x + c + h * VL);
    float s = reduce_parts(a);
    for (long t = c; t < cols; t++) s = fmaf(WF(w[t]), x[t], s);
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

/* e^x, VL at a time: x = k ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative
   error below 1e-8, under float's rounding), times 2^k through the exponent bits. Below -87 (e^x
   under float's smallest normal) it returns 0; above 88 it returns e^88 (silu's use: g / (1 + e^-g)
   is then 0 to float's precision). expf one element at a time was a third of a head's attention
   and most of silu's time. */
static inline vt vsel(vti m, vt a, vt b) {  /* m ? a : b, lane by lane */
    vti ai, bi;
    memcpy(&ai, &a, sizeof a); memcpy(&bi, &b, sizeof b);
    vti r = (ai & m) | (bi & ~m);
    vt out;
    memcpy(&out, &r, sizeof out);
    return out;
}
static inline vt vexp(vt x) {
    const vt lo = {0}, magic = lo + 12582912.f;  /* 1.5 * 2^23: adding it rounds to an integer */
    vti under = x < -87.f;
    x = vsel(x > 88.f, lo + 88.f, x);
    vt t = x * 1.44269504f + magic;
    vt k = t - magic;
    vt r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f;  /* ln2 in two parts */
    vt e = 1.f / 5040 + lo;
    e = e * r + 1.f / 720; e = e * r + 1.f / 120; e = e * r + 1.f / 24;
    e = e * r + 1.f / 6; e = e * r + 0.5f; e = e * r + 1.f; e = e * r + 1.f;
    vti bits = (__builtin_convertvector(k, vti) + 127) << 23;
    vt scale2;
    memcpy(&scale2, &bits, sizeof bits);
    return vsel(under, lo, e * scale2);
}

#define MAX_HD16 16  /* head dims up to 256 keep their output in registers */

/* one query head over its keys: scores, their softmax, the weighted sum of values (hd a multiple
   of 16): q and the output held in vectors, each score a 16-lane sum, the exponentials VL at a time */
static inline __attribute__((always_inline)) void head_v(const float* q, const float* K, const float* V,
                                                         const unsigned char* may, long last, long hd, float scale,
                                                         float* sc, float* o) {
    long nv = hd / VL;
    vt qv[MAX_HD16 * NH], acc[MAX_HD16 * NH], z = {0};
    for (long k = 0; k < nv; k++) { qv[k] = LDV(q + VL * k); acc[k] = z; }
    float mx = -INFINITY;
    for (long t = 0; t < last; t++) {
        const float* kt = K + t * hd;
        vt s[NH];
        for (int h = 0; h < NH; h++) s[h] = qv[h] * LDV(kt + h * VL);
        for (long k = NH; k < nv; k++) s[k % NH] += qv[k] * LDV(kt + VL * k);
        float v = reduce_parts(s) * scale;
        sc[t] = v;
        if ((!may || may[t]) && v > mx) mx = v;
    }
    long t = 0;
    for (; t + VL <= last; t += VL) stv(sc + t, vexp(LDV(sc + t) - mx));
    if (t < last) {
        float tail[VL];
        for (long j = 0; j < VL; j++) tail[j] = t + j < last ? sc[t + j] - mx : -INFINITY;
        vt e = vexp(LDV(tail));
        memcpy(sc + t, &e, (last - t) * sizeof(float));
    }
    float sum = 0.f;
    for (t = 0; t < last; t++) if (!may || may[t]) sum += sc[t];
    float inv = 1.f / sum;
    for (t = 0; t < last; t++) {
        if (may && !may[t]) continue;
        float pt = sc[t] * inv;
        const float* vrow = V + t * hd;
        for (long k = 0; k < nv; k++) acc[k] += pt * LDV(vrow + VL * k);
    }
    for (long k = 0; k < nv; k++) stv(o + VL * k, acc[k]);
}

/* head_v for the common head dims, their vector count a constant: q and the output stay in
   registers, unrolled (with the count known only at run time they went through memory on every
   key: on AVX2, where each 16-lane vector is two, a 4-row SmolLM2 layer's attention took 145 us
   against 33 on AVX-512). The same operations in the same order as head_v's. */
static void head_v64(const float* q, const float* K, const float* V, const unsigned char* may, long last,
                     float scale, float* sc, float* o) { head_v(q, K, V, may, last, 64, scale, sc, o); }
static void head_v128(const float* q, const float* K, const float* V, const unsigned char* may, long last,
                      float scale, float* sc, float* o) { head_v(q, K, V, may, last, 128, scale, sc, o); }

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

/* n query rows over one layer's cache: rotate q and k of each row of qkv [n, q heads | k heads |
   v heads] in place at its position pos[i] (cos, sin: tables [positions, hd]), write its k and v
   into the cache, and out[i] = softmax(q K^T * scale) V per query head (its KV group's keys) over
   the slots row i may attend. One sequence (stride 0): keys k [nkv, P, hd] and values v alike,
   row i at slot past + i, attending mask[i * (past + n) + t] != 0 or (mask NULL) every slot up to
   past + i. Independent sequences (stride > 0, continuous batching): row i's own cache at
   k + i * stride and v + i * stride, its k and v at slot pos[i], attending slots 0..pos[i] (mask
   NULL). A row computes alike either way, so one sequence decoded alone and beside others gives
   the same bits. scores: scratch of threads * (past + n) floats (stride > 0: threads * (max pos
   + 1)). The (row, head) pairs are split over the threads once there is enough work to pay for
   waking them (a verification's rows over a long cache: one thread took about 2 ms of a SmolLM2
   4-row step); each pair is computed alike on any thread. */
void eagle3_attend(float* qkv, long n, const long* pos, const float* cos, const float* sin, float* k, float* v,
                   long stride, long P, long past, const unsigned char* mask, long nh, long nkv, long hd,
                   float scale, float* out, float* scores, int threads) {
    long nq = (nh + 2 * nkv) * hd, len = past + n, group = nh / nkv;
    if (stride) {
        len = 0;
        for (long i = 0; i < n; i++) len = pos[i] + 1 > len ? pos[i] + 1 : len;
    }
    for (long i = 0; i < n; i++) {
        float* row = qkv + i * nq;
        float *kc = k + i * stride, *vc = v + i * stride;
        long at = stride ? pos[i] : past + i;
        rope(row, cos + pos[i] * hd, sin + pos[i] * hd, nh + nkv, hd);
        for (long g = 0; g < nkv; g++) {
            memcpy(kc + (g * P + at) * hd, row + (nh + g) * hd, hd * sizeof(float));
            memcpy(vc + (g * P + at) * hd, row + (nh + nkv + g) * hd, hd * sizeof(float));
        }
    }
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * nh * len * hd >= 65536)
    for (long ih = 0; ih < n * nh; ih++) {
        long i = ih / nh, h = ih % nh;
        const unsigned char* may = mask ? mask + i * len : 0;
        long last = mask ? len : (stride ? pos[i] : past + i) + 1;
        float* sc = scores + omp_get_thread_num() * len;
        const float* q = qkv + i * nq + h * hd;
        const float *K = k + i * stride + (h / group) * P * hd, *V = v + i * stride + (h / group) * P * hd;
        float* o = out + i * nh * hd + h * hd;
        if (hd == 64) head_v64(q, K, V, may, last, scale, sc, o);
        else if (hd == 128) head_v128(q, K, V, may, last, scale, sc, o);
        else if (hd % 16 == 0 && hd <= 16 * MAX_HD16) head_v(q, K, V, may, last, hd, scale, sc, o);
        else head_scalar(q, K, V, may, last, hd, scale, sc, o);
    }
}

/* (x W^T + bias) then + add, rounded as those two separate operations would round */
static inline float finish(float v, const float* bias, const float* add, long i, long rows, long r) {
    if (bias) v = v + bias[r];
    return add ? add[i * rows + r] + v : v;
}

/* y[m, rows] = add + (x[m, cols] W[rows, cols]^T + bias), bias and add optional: blocks of T_OR weight
   rows split statically over the threads, each read once for all m input rows, T_M inputs at a time */
void eagle3_gemv_f32(const wt* W, const float* x, float* y, long rows, long cols, long m,
                     const float* bias, const float* add, int threads) {
    long blocks = rows / T_OR;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long bi = 0; bi < blocks; bi++) {
        long r = bi * T_OR;
        for (long i = 0; i < m;) {
            long n = m - i < T_M ? m - i : T_M;
            float o[4 * T_OR];
            tiles(W + r * cols, cols, x + i * cols, n, o, m > 1 || PF_ONE);
            for (long j = 0; j < n; j++)
                for (int k = 0; k < T_OR; k++)
                    y[(i + j) * rows + r + k] = finish(o[j * T_OR + k], bias, add, i + j, rows, r + k);
            i += n;
        }
    }
    for (long r = blocks * T_OR; r < rows; r++)
        for (long i = 0; i < m; i++)
            y[i * rows + r] = finish(dot_row(W + r * cols, x + i * cols, cols), bias, add, i, rows, r);
}

/* out = w * (x * rsqrt(mean(x^2) + eps)), HF's LlamaRMSNorm in fp32 */
static void rmsnorm(const float* x, const float* w, float eps, long n, float* out) {
    float r = 1.f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (long i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* Built with -DEAGLE3_STAGES (benchmarks/layer_stages.py), eagle3_layer adds each stage's wall
   seconds to eagle3_stage_s: the norms, q|k|v, attention (RoPE and the cache write included), o,
   gate|up, silu * up, down. */
#ifdef EAGLE3_STAGES
double eagle3_stage_s[7];
#define STAGES_START double stage_t0 = omp_get_wtime(), stage_t
#define STAGE(i) (stage_t = omp_get_wtime(), eagle3_stage_s[i] += stage_t - stage_t0, stage_t0 = stage_t)
#else
#define STAGES_START
#define STAGE(i)
#endif

/* A Llama-shaped decoder layer for n rows, x [n, H] updated in place:
   x += o(attention(rope(qkv(norm1(x))))); x += down(silu(gate) * up of gate_up(norm2(x))).
   The cache (k, v, stride, P, past, mask) as eagle3_attend takes it: one sequence, or (stride > 0)
   one per row. Every step of it computes a row alike whatever rows come with it.
   scratch: n (max(H, inter) + (nh + 2 nkv) hd + nh hd + 2 inter) + threads (past + n) floats. */
void eagle3_layer(float* x, long n, long H, const float* ln1, const float* ln2, float eps,
                  const wt* Wqkv, const float* bqkv, const wt* Wo, const wt* Wgu, const wt* Wd,
                  long inter, const long* pos, const float* cos, const float* sin, float* k, float* v, long stride,
                  long P, long past, const unsigned char* mask, long nh, long nkv, long hd, float scale,
                  float* scratch, int threads) {
    long nq = (nh + 2 * nkv) * hd, wide = H > inter ? H : inter;
    float *h = scratch, *qkv = h + n * wide, *attn = qkv + n * nq, *gu = attn + n * nh * hd;
    float *scores = gu + n * 2 * inter;
    STAGES_START;
    for (long i = 0; i < n; i++) rmsnorm(x + i * H, ln1, eps, H, h + i * H);
    STAGE(0);
    eagle3_gemv_f32(Wqkv, h, qkv, nq, H, n, bqkv, 0, threads);
    STAGE(1);
    eagle3_attend(qkv, n, pos, cos, sin, k, v, stride, P, past, mask, nh, nkv, hd, scale, attn, scores, threads);
    STAGE(2);
    eagle3_gemv_f32(Wo, attn, x, H, nh * hd, n, 0, x, threads);
    STAGE(3);
    for (long i = 0; i < n; i++) rmsnorm(x + i * H, ln2, eps, H, h + i * H);
    STAGE(0);
    eagle3_gemv_f32(Wgu, h, gu, 2 * inter, H, n, 0, 0, threads);
    STAGE(4);
    /* silu(gate) * up, VL elements at a time (vexp), rows split over the threads */
    #pragma omp parallel for schedule(static) num_threads(threads) if (n > 1)
    for (long i = 0; i < n; i++) {
        const float *g = gu + i * 2 * inter, *up = g + inter;
        float* hi = h + i * inter;
        long j = 0;
        for (; j + VL <= inter; j += VL) {
            vt gv = LDV(g + j);
            stv(hi + j, gv / (1.f + vexp(-gv)) * LDV(up + j));
        }
        for (; j < inter; j++) hi[j] = g[j] / (1.f + expf(-g[j])) * up[j];
    }
    STAGE(5);
    eagle3_gemv_f32(Wd, h, x, H, inter, n, 0, x, threads);
    STAGE(6);
}
"""
