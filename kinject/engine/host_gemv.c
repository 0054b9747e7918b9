/* Grouped matrix-vector products over experts' weights, for kinject's host expert compute
 * (docs/architecture.md, "Host compute"; loaded by kinject/engine/host_gemv.py).
 *
 * One call computes every routed expert of a layer step: expert e's weight W_e [rows_out, cols]
 * (row-major, its own pointer: the store's tensor, never copied) times each of its counts[e]
 * activation rows, written to y [sum(counts), rows_out] in the experts' order. A decode step's
 * host experts are products over weights read once, so the bound is their bytes over the memory
 * bandwidth: one parallel region over all the experts' rows (not one per expert) keeps every core
 * streaming, and a weight row is read once from memory for all of its expert's activation rows.
 *
 * Arithmetic: bfloat16 products summed in float32 and rounded once to bfloat16 (round to nearest
 * even), the sum in the order of torch's dot_with_fp32_arith. torch's CPU GEMM (oneDNN) sums in an
 * order of its own, so about 1 output in 10^4 lands on the other side of a rounding midpoint and
 * differs by one bfloat16 ulp: not transformers' bits, which is why kinject computes bfloat16 with
 * it only when asked (KINJECT_HOST_GEMV=fast). INT8: sum(x * q) times the row's scale, rounded once
 * (torch's _weight_int8pack_mm arithmetic); on AMX-INT8 the sum is exact, rounded once to float32,
 * elsewhere summed in float32 in the kernel's own order.
 *
 * Also transformers' RMSNorm of a few rows with torch's bits (kinject_rms_norm_bf16, used by
 * kinject/engine/host_norm.py): at batch 1 its eight torch operations cost more than its arithmetic.
 *
 * Compiled for the machine it runs on (-march=native); AVX512-BF16 and AVX512F paths where the
 * compiler targets them, plain loops otherwise. Threads: OpenMP, the runtime torch itself loaded.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_BLOCK 64  /* weight rows per work item: 64 x 2 KB streams, few enough items to balance */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One call's work: items of up to ROW_BLOCK weight rows of one expert (the parallel loop runs over
 * items); starts[e]: expert e's first activation row; total: the activation rows of the call. */
typedef struct {
    int64_t *starts, total, blocks, items, rows_out;
} group_plan;

static group_plan plan_group(int64_t k, const int64_t *counts, int64_t rows_out) {
    group_plan p;
    p.starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(k ? k : 1));
    p.total = 0;
    for (int64_t e = 0; e < k; e++) {
        p.starts[e] = p.total;
        p.total += counts[e];
    }
    p.rows_out = rows_out;
    p.blocks = (rows_out + ROW_BLOCK - 1) / ROW_BLOCK;
    p.items = k * p.blocks;
    return p;
}

/* item it: expert *e, weight rows [*r0, *r1) */
static inline void item_rows(const group_plan *p, int64_t it, int64_t *e, int64_t *r0, int64_t *r1) {
    *e = it / p->blocks;
    *r0 = (it % p->blocks) * ROW_BLOCK;
    *r1 = *r0 + ROW_BLOCK < p->rows_out ? *r0 + ROW_BLOCK : p->rows_out;
}

/* ------------------------------------------------------------------ bfloat16 weights
 *
 * The order of torch's dot_with_fp32_arith (its portable GEMV and GEMM): torch's own bits where it
 * computes bfloat16 with it (a CPU where oneDNN has no bfloat16 GEMM: AVX2); where torch.mv and
 * F.linear go through oneDNN (AVX-512) it agrees in all but about 1 output in 10^4 (one ulp). At CPU capability AVX512 (AVX2): 8 float32 accumulators of 16 (8) lanes,
 * element j + i of each block of 128 (64) into accumulator i / lanes, lane i % lanes, by fused
 * multiply-add; the accumulators summed as a halving tree (a[i] += a[i + 4], += a[i + 2], += a[i + 1]),
 * then the lanes by torch's shuffle tree; the rest of the row: blocks of 32 (16) elements into one
 * more accumulator, low half then high half, reduced the same way and added; the last elements one
 * by one, fused. ``x`` is the activation row converted to float32 once (exact).
 */

#if defined(__AVX512F__)
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* f32_to_bf16 on 16 lanes: each result in the low half of its 32-bit lane */
static inline __m512i bf16x16_round(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}

static inline float lanes_sum512(__m512 v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
    return _mm512_cvtss_f32(v);
}

static inline float tree_sum512(__m512 *a) {
    for (int i = 0; i < 4; i++) a[i] = _mm512_add_ps(a[i], a[i + 4]);
    for (int i = 0; i < 2; i++) a[i] = _mm512_add_ps(a[i], a[i + 2]);
    return lanes_sum512(_mm512_add_ps(a[0], a[1]));
}

/* out[q] = dot(w[q], x) for two weight rows: one pass over x for both */
static void dot2_avx512(const uint16_t *w0, const uint16_t *w1, const float *x, int64_t n, float *out) {
    __m512 a[8], b[8];
    for (int i = 0; i < 8; i++) a[i] = b[i] = _mm512_setzero_ps();
    const int64_t blocks = n & ~(int64_t)127, halves = n & ~(int64_t)31;
    const uint16_t *ahead = w1 + n;  /* the next pair's first row, a cache line per line read: measured
                                        17-19 -> 22-25 GB/s on 2 cores; the prefetchers alone lag */
    for (int64_t j = 0; j < blocks; j += 128)
        for (int i = 0; i < 8; i++) {
            if (!(i & 1)) _mm_prefetch((const char *)(ahead + j + 16 * i), _MM_HINT_T0);
            const __m512 xv = _mm512_loadu_ps(x + j + 16 * i);
            a[i] = _mm512_fmadd_ps(xv, bf16x16(w0 + j + 16 * i), a[i]);
            b[i] = _mm512_fmadd_ps(xv, bf16x16(w1 + j + 16 * i), b[i]);
        }
    float sa = tree_sum512(a), sb = tree_sum512(b);
    __m512 ta = _mm512_setzero_ps(), tb = _mm512_setzero_ps();
    for (int64_t j = blocks; j < halves; j += 32)
        for (int h = 0; h < 32; h += 16) {
            const __m512 xv = _mm512_loadu_ps(x + j + h);
            ta = _mm512_fmadd_ps(xv, bf16x16(w0 + j + h), ta);
            tb = _mm512_fmadd_ps(xv, bf16x16(w1 + j + h), tb);
        }
    sa += lanes_sum512(ta);
    sb += lanes_sum512(tb);
    for (int64_t j = halves; j < n; j++) {
        sa = __builtin_fmaf(x[j], bf16_to_f32(w0[j]), sa);
        sb = __builtin_fmaf(x[j], bf16_to_f32(w1[j]), sb);
    }
    out[0] = sa, out[1] = sb;
}
#endif

/* the gate's end, after the vector silu: h[i] = bf16(bf16(silu[i]) * u[i]) (and hf[i], its float32 value,
 * where hf is not NULL) for the n columns of one vector */
static inline __attribute__((unused)) void gate_finish(const float *silu, const uint16_t *u, uint16_t *h, float *hf,
                                                       int n) {
    for (int i = 0; i < n; i++) {
        h[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu[i])) * bf16_to_f32(u[i]));
        if (hf != NULL) hf[i] = bf16_to_f32(h[i]);
    }
}

/* the gate of one vector of columns (``width`` of them), exp being the vector exp it is given */
typedef void (*gate_vector_fn)(const uint16_t *g, const uint16_t *u, uint16_t *h, float *hf, void *exp);

/* h[r, :] = the gate of gu[r, :] ([n, 2 inter] -> [n, inter], inter a multiple of ``width``; hf: its float32
 * values, where not NULL), its vectors shared out among the threads of the enclosing parallel region
 * (serially outside one) */
static __attribute__((unused)) void gate_rows_of(int64_t n, int64_t inter, int width, gate_vector_fn vector,
                                                 const uint16_t *gu, uint16_t *h, float *hf, void *exp) {
    const int64_t chunks = inter / width;
#pragma omp for schedule(static)
    for (int64_t a = 0; a < n * chunks; a++) {
        const int64_t r = a / chunks, j = (a % chunks) * width;
        vector(gu + r * 2 * inter + j, gu + r * 2 * inter + inter + j, h + r * inter + j,
               hf != NULL ? hf + r * inter + j : NULL, exp);
    }
}

#if defined(__AVX512F__)
/* transformers' default gate in bfloat16 on 16 columns: h = bf16(bf16(silu(g)) * u), silu(g) =
 * g / (1 + exp(-g)) in float32, exp being torch's own vector exp (``expf16``: the Sleef function
 * torch's CPU kernels call, found in torch's library by the caller), each result rounded to
 * nearest even as torch's bfloat16 conversion does */
typedef __m512 (*expf16_fn)(__m512);

static void swiglu16(const uint16_t *g, const uint16_t *u, uint16_t *h, float *hf, void *expf16) {
    const __m512 gv = bf16x16(g);
    const __m512 e = ((expf16_fn)expf16)(_mm512_xor_ps(gv, _mm512_set1_ps(-0.0f)));
    float s[16];
    _mm512_storeu_ps(s, _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    gate_finish(s, u, h, hf, 16);
}

/* gate_rows_of, 16 columns a vector (inter a multiple of 16) */
static void gate_rows(int64_t n, int64_t inter, const uint16_t *gu, uint16_t *h, float *hf, expf16_fn expf16) {
    gate_rows_of(n, inter, 16, swiglu16, gu, h, hf, (void *)expf16);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float lanes_sum256(__m256 v) {
    v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x1));
    v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
    v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
    return _mm256_cvtss_f32(v);
}

static void dot1_avx2(const uint16_t *w, const float *x, int64_t n, float *out) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    const int64_t blocks = n & ~(int64_t)63, halves = n & ~(int64_t)15;
    for (int64_t j = 0; j < blocks; j += 64)
        for (int i = 0; i < 8; i++) {
            if (!(i & 3)) _mm_prefetch((const char *)(w + n + j + 8 * i), _MM_HINT_T0);
            a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8 * i), bf16x8(w + j + 8 * i), a[i]);
        }
    for (int i = 0; i < 4; i++) a[i] = _mm256_add_ps(a[i], a[i + 4]);
    for (int i = 0; i < 2; i++) a[i] = _mm256_add_ps(a[i], a[i + 2]);
    float s = lanes_sum256(_mm256_add_ps(a[0], a[1]));
    __m256 t = _mm256_setzero_ps();
    for (int64_t j = blocks; j < halves; j += 16)
        for (int h = 0; h < 16; h += 8) t = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + h), bf16x8(w + j + h), t);
    s += lanes_sum256(t);
    for (int64_t j = halves; j < n; j++) s = __builtin_fmaf(x[j], bf16_to_f32(w[j]), s);
    *out = s;
}

/* dot1_avx2 of one weight row with two activation rows: each sum by the same operations in the same
 * order as dot1_avx2 gives it (the same bits), each weight widened once for both rows (an expert with
 * several rows, a prefill: 25-35 % more products a second, the widening being part of each product's
 * cost; 16 accumulators, every vector register, the compiler spills the odd one) */
static void dot2rows_avx2(const uint16_t *w, const float *x0, const float *x1, int64_t n, float *out) {
    __m256 a[8], b[8];
    for (int i = 0; i < 8; i++) a[i] = b[i] = _mm256_setzero_ps();
    const int64_t blocks = n & ~(int64_t)63, halves = n & ~(int64_t)15;
    for (int64_t j = 0; j < blocks; j += 64)
        for (int i = 0; i < 8; i++) {
            if (!(i & 3)) _mm_prefetch((const char *)(w + n + j + 8 * i), _MM_HINT_T0);
            const __m256 wv = bf16x8(w + j + 8 * i);
            a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + j + 8 * i), wv, a[i]);
            b[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + j + 8 * i), wv, b[i]);
        }
    for (int i = 0; i < 4; i++) a[i] = _mm256_add_ps(a[i], a[i + 4]), b[i] = _mm256_add_ps(b[i], b[i + 4]);
    for (int i = 0; i < 2; i++) a[i] = _mm256_add_ps(a[i], a[i + 2]), b[i] = _mm256_add_ps(b[i], b[i + 2]);
    float s = lanes_sum256(_mm256_add_ps(a[0], a[1])), u = lanes_sum256(_mm256_add_ps(b[0], b[1]));
    __m256 t = _mm256_setzero_ps(), v = _mm256_setzero_ps();
    for (int64_t j = blocks; j < halves; j += 16)
        for (int h = 0; h < 16; h += 8) {
            const __m256 wv = bf16x8(w + j + h);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + j + h), wv, t);
            v = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + j + h), wv, v);
        }
    s += lanes_sum256(t), u += lanes_sum256(v);
    for (int64_t j = halves; j < n; j++) {
        const float wf = bf16_to_f32(w[j]);
        s = __builtin_fmaf(x0[j], wf, s), u = __builtin_fmaf(x1[j], wf, u);
    }
    out[0] = s, out[1] = u;
}
#endif

/* any other machine: float32 sums in a plain order (not torch's bits) */
static void dot1_plain(const uint16_t *w, const float *x, int64_t n, float *out) {
    float s = 0.f;
    for (int64_t j = 0; j < n; j++) s += x[j] * bf16_to_f32(w[j]);
    out[0] = s;
}

/* torch's CPU capability as kinject_host_gemv_order() reports what this build reproduces */
enum { ORDER_PLAIN = 0, ORDER_AVX2 = 1, ORDER_AVX512 = 2 };

int kinject_host_gemv_orders(void) {
    int mask = 1 << ORDER_PLAIN;
#if defined(__AVX2__) && defined(__FMA__)
    mask |= 1 << ORDER_AVX2;
#endif
#if defined(__AVX512F__)
    mask |= 1 << ORDER_AVX512;
#endif
    return mask;
}

static float *as_float(const uint16_t *x, int64_t n) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) xf[i] = bf16_to_f32(x[i]);
    return xf;
}

/* item it of a bfloat16 group: y[starts[e] + j, r] for its weight rows r, in the sum order ``order`` */
static void bf16_item(const group_plan *p, int64_t it, const uint16_t *const *w, const int64_t *counts, int64_t cols,
                      const float *xf, uint16_t *y, int order) {
    int64_t e, r0, r1;
    item_rows(p, it, &e, &r0, &r1);
    const uint16_t *we = w[e];
    const int64_t rows_out = p->rows_out;
    for (int64_t r = r0; r < r1;) {
        const int two = order == ORDER_AVX512 && r + 2 <= r1;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        if (order == ORDER_AVX2)                         /* two activation rows a pass: the same bits */
            for (; j + 2 <= counts[e]; j += 2) {
                const int64_t row = p->starts[e] + j;
                float s[2];
                dot2rows_avx2(we + r * cols, xf + row * cols, xf + (row + 1) * cols, cols, s);
                y[row * rows_out + r] = f32_to_bf16(s[0]);
                y[(row + 1) * rows_out + r] = f32_to_bf16(s[1]);
            }
#endif
        for (; j < counts[e]; j++) {
            const int64_t row = p->starts[e] + j;
            const float *xr = xf + row * cols;
            float s[2] = {0.f, 0.f};
#if defined(__AVX512F__)
            if (order == ORDER_AVX512) {
                if (two) dot2_avx512(we + r * cols, we + (r + 1) * cols, xr, cols, s);
                else dot2_avx512(we + r * cols, we + r * cols, xr, cols, s);
            } else
#endif
#if defined(__AVX2__) && defined(__FMA__)
            if (order == ORDER_AVX2) dot1_avx2(we + r * cols, xr, cols, s); else
#endif
            dot1_plain(we + r * cols, xr, cols, s);
            y[row * rows_out + r] = f32_to_bf16(s[0]);
            if (two) y[row * rows_out + r + 1] = f32_to_bf16(s[1]);
        }
        r += two ? 2 : 1;
    }
}

/* y[starts[e] + j, r] = bf16(sum_c W_e[r, c] * x[starts[e] + j, c]) in the sum order ``order`` */
void kinject_grouped_gemv_bf16(int64_t k, const uint16_t *const *w, const int64_t *counts, int64_t rows_out,
                               int64_t cols, const uint16_t *x, uint16_t *y, int threads, int order) {
    group_plan p = plan_group(k, counts, rows_out);
    float *xf = as_float(x, p.total * cols);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t it = 0; it < p.items; it++) bf16_item(&p, it, w, counts, cols, xf, y, order);
    free(xf);
    free(p.starts);
}

/* ------------------------------------------------------------------ bfloat16 on AMX: torch's bits
 *
 * On a CPU with AMX, torch's bfloat16 GEMV and GEMM (oneDNN's brgemm) run TDPBF16PS over the inner
 * dimension in blocks of 32, in order, into one float32 accumulator per output. The same
 * instructions in the same order give the same bits (checked against torch.mv when the kernel
 * loads, and in tests/engine/test_host_gemv.py): the one bfloat16 path that is both memory speed
 * and transformers' own arithmetic. A (16 weight rows x 32 columns, the rows' own stride) times
 * B (the activation's 16 column pairs) into C (16 x 1 float32), per 16 weight rows.
 */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* tiles 0-2: a 16-row block (C, A, B); 5-6: the next 16 rows (C, A); 3-4: the last rows_out % 16 (C, A) */
static void configure_tiles(int64_t tail) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = 4;
    cfg.rows[1] = 16, cfg.colsb[1] = 64;
    cfg.rows[2] = 16, cfg.colsb[2] = 4;
    cfg.rows[5] = 16, cfg.colsb[5] = 4;   /* a second 16-row block beside the first: C, A */
    cfg.rows[6] = 16, cfg.colsb[6] = 64;
    if (tail) {
        cfg.rows[3] = (uint8_t)tail, cfg.colsb[3] = 4;
        cfg.rows[4] = (uint8_t)tail, cfg.colsb[4] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* y[0 .. 31] for one activation row x (bf16): 32 weight rows from w (row stride cols), two tiles of 16
 * against one load of x per block of 32 columns (measured 22.5 -> 24.7 GB/s over one 16-row tile) */
static inline void block32_amx(const uint16_t *w, int64_t cols, const uint16_t *x, uint16_t *y) {
    float c[16], d[16];
    _tile_zero(0);
    _tile_zero(5);
    for (int64_t k = 0; k < cols; k += 32) {
        _tile_loadd(2, x + k, 4);
        _tile_loadd(1, w + k, cols * 2);
        _tile_loadd(6, w + 16 * cols + k, cols * 2);
        _tile_dpbf16ps(0, 1, 2);
        _tile_dpbf16ps(5, 6, 2);
    }
    _tile_stored(0, c, 4);
    _tile_stored(5, d, 4);
    for (int i = 0; i < 16; i++) y[i] = f32_to_bf16(c[i]), y[16 + i] = f32_to_bf16(d[i]);
}

/* y[0 .. 15] (or the first tail_rows) for one activation row x: 16 weight rows from w */
static inline void block16_amx(const uint16_t *w, int64_t cols, const uint16_t *x, uint16_t *y, int tail_rows) {
    float c[16];
    if (!tail_rows) {
        _tile_zero(0);
        for (int64_t k = 0; k < cols; k += 32) {
            _tile_loadd(1, w + k, cols * 2);
            _tile_loadd(2, x + k, 4);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, c, 4);
        for (int i = 0; i < 16; i++) y[i] = f32_to_bf16(c[i]);
    } else {
        _tile_zero(3);
        for (int64_t k = 0; k < cols; k += 32) {
            _tile_loadd(4, w + k, cols * 2);
            _tile_loadd(2, x + k, 4);
            _tile_dpbf16ps(3, 4, 2);
        }
        _tile_stored(3, c, 4);
        for (int i = 0; i < tail_rows; i++) y[i] = f32_to_bf16(c[i]);
    }
}
#endif

/* 1: this process may use AMX (asked of the kernel once), 0: not built for it or refused */
int kinject_host_gemv_amx(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return 0;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* One work item of the AMX group (64 weight rows of one expert, every row of its activation, 16 rows
 * per tile pass); the tiles are configured for rows_out % 16. */
static void amx_item(const group_plan *p, int64_t it, const uint16_t *const *w, const int64_t *counts,
                     int64_t cols, const uint16_t *x, uint16_t *y) {
    const int64_t rows_out = p->rows_out;
    int64_t e, r0, r1;
    item_rows(p, it, &e, &r0, &r1);
    const uint16_t *we = w[e];
    uint16_t out[16];
    int64_t r = r0;
    for (; r + 32 <= r1; r += 32)
        for (int64_t j = 0; j < counts[e]; j++) {
            const int64_t row = p->starts[e] + j;
            block32_amx(we + r * cols, cols, x + row * cols, y + row * rows_out + r);
        }
    for (; r < r1; r += 16) {
        const int part = r + 16 <= r1 ? 0 : (int)(r1 - r);
        for (int64_t j = 0; j < counts[e]; j++) {
            const int64_t row = p->starts[e] + j;
            block16_amx(we + r * cols, cols, x + row * cols, out, part);
            memcpy(y + row * rows_out + r, out, sizeof(uint16_t) * (size_t)(part ? part : 16));
        }
    }
}

#endif

/* The bfloat16 group on AMX (cols a multiple of 32): y[starts[e] + j, r] as torch computes it. */
void kinject_grouped_gemv_bf16_amx(int64_t k, const uint16_t *const *w, const int64_t *counts, int64_t rows_out,
                                   int64_t cols, const uint16_t *x, uint16_t *y, int threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    group_plan p = plan_group(k, counts, rows_out);
#pragma omp parallel num_threads(threads)
    {
        configure_tiles(rows_out % 16);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < p.items; it++) amx_item(&p, it, w, counts, cols, x, y);
        _tile_release();
    }
    free(p.starts);
#else
    (void)k, (void)w, (void)counts, (void)rows_out, (void)cols, (void)x, (void)y, (void)threads;
#endif
}

/* h[r, j] = bf16(bf16(silu(gu[r, j])) * gu[r, inter + j]) for rows r < n (inter a multiple of 16):
 * the gate alone, for the check against torch's */
void kinject_swiglu_bf16(int64_t n, int64_t inter, const uint16_t *gu, uint16_t *h, void *expf16) {
#if defined(__AVX512F__)
    gate_rows(n, inter, gu, h, NULL, (expf16_fn)expf16);
#else
    (void)n, (void)inter, (void)gu, (void)h, (void)expf16;
#endif
}

/* A layer step's experts whole on AMX, in one parallel region: gu = x W_up^T ([total, 2 inter]),
 * h = the default gate of gu ([total, inter]), y = h W_down^T ([total, hidden]), each as torch
 * computes it. No Python between the projections: after the up projection's weights have streamed
 * through the caches, the first torch operation pays tens of microseconds to bring its own code and
 * data back (measured: 15 -> 85 us for the gate's three operations). */
static void swiglu_bf16_amx(int64_t k, const uint16_t *const *w_up, const uint16_t *const *w_down,
                                     const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                                     uint16_t *gu, uint16_t *h, uint16_t *y, int threads, void *expf16) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    group_plan up = plan_group(k, counts, 2 * inter), down = plan_group(k, counts, hidden);
#pragma omp parallel num_threads(threads)
    {
        configure_tiles((2 * inter) % 16);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < up.items; it++) amx_item(&up, it, w_up, counts, hidden, x, gu);
        gate_rows(up.total, inter, gu, h, NULL, (expf16_fn)expf16);
        if (hidden % 16 != (2 * inter) % 16) configure_tiles(hidden % 16);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < down.items; it++) amx_item(&down, it, w_down, counts, inter, h, y);
        _tile_release();
    }
    free(up.starts);
    free(down.starts);
#else
    (void)k, (void)w_up, (void)w_down, (void)counts, (void)inter, (void)hidden, (void)x, (void)gu, (void)h, (void)y;
    (void)threads, (void)expf16;
#endif
}

/* ------------------------------------------------------------------ int8 weights, bfloat16 activations */

static inline void dot4_int8(const int8_t *w, int64_t ld, const float *x, int64_t n, float *out) {
    int64_t i = 0;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m512 xv = _mm512_loadu_ps(x + i);
#define KJ_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
        a0 = _mm512_fmadd_ps(KJ_I8(w + i), xv, a0);
        a1 = _mm512_fmadd_ps(KJ_I8(w + ld + i), xv, a1);
        a2 = _mm512_fmadd_ps(KJ_I8(w + 2 * ld + i), xv, a2);
        a3 = _mm512_fmadd_ps(KJ_I8(w + 3 * ld + i), xv, a3);
#undef KJ_I8
    }
    s0 = _mm512_reduce_add_ps(a0);
    s1 = _mm512_reduce_add_ps(a1);
    s2 = _mm512_reduce_add_ps(a2);
    s3 = _mm512_reduce_add_ps(a3);
#elif defined(__AVX2__) && defined(__FMA__)
    /* two accumulators a row (8 in all, beside the two x vectors): the FMA chains of four rows hide
     * their latency; scalar, this loop ran at ~5 GB/s on 2 cores of a Zen 3 */
    __m256 a[4][2];
    for (int q = 0; q < 4; q++) a[q][0] = a[q][1] = _mm256_setzero_ps();
#define KJ_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
    for (; i + 16 <= n; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        if (!(i & 63)) for (int q = 0; q < 4; q++) _mm_prefetch((const char *)(w + (8 + q) * ld + i), _MM_HINT_T0);
        for (int q = 0; q < 4; q++) {
            a[q][0] = _mm256_fmadd_ps(KJ_I8(w + q * ld + i), x0, a[q][0]);
            a[q][1] = _mm256_fmadd_ps(KJ_I8(w + q * ld + i + 8), x1, a[q][1]);
        }
    }
#undef KJ_I8
    s0 = lanes_sum256(_mm256_add_ps(a[0][0], a[0][1]));
    s1 = lanes_sum256(_mm256_add_ps(a[1][0], a[1][1]));
    s2 = lanes_sum256(_mm256_add_ps(a[2][0], a[2][1]));
    s3 = lanes_sum256(_mm256_add_ps(a[3][0], a[3][1]));
#endif
    for (; i < n; i++) {
        s0 += (float)w[i] * x[i];
        s1 += (float)w[ld + i] * x[i];
        s2 += (float)w[2 * ld + i] * x[i];
        s3 += (float)w[3 * ld + i] * x[i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

static inline float dot_int8(const int8_t *w, const float *x, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += (float)w[i] * x[i];
    return s;
}

/* item it of an int8 group: y[starts[e] + j, r] = bf16(sum_c q_e[r, c] * x[starts[e] + j, c] * scale_e[r]) */
static void int8_item(const group_plan *p, int64_t it, const int8_t *const *w, const uint16_t *const *scales,
                      const int64_t *counts, int64_t cols, const float *xf, uint16_t *y) {
    int64_t e, r0, r1;
    item_rows(p, it, &e, &r0, &r1);
    const int8_t *we = w[e];
    const uint16_t *se = scales[e];
    const int64_t rows_out = p->rows_out;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4)
        for (int64_t j = 0; j < counts[e]; j++) {
            const int64_t row = p->starts[e] + j;
            float s[4];
            dot4_int8(we + r * cols, cols, xf + row * cols, cols, s);
            for (int q = 0; q < 4; q++) y[row * rows_out + r + q] = f32_to_bf16(s[q] * bf16_to_f32(se[r + q]));
        }
    for (; r < r1; r++)
        for (int64_t j = 0; j < counts[e]; j++) {
            const int64_t row = p->starts[e] + j;
            y[row * rows_out + r] = f32_to_bf16(dot_int8(we + r * cols, xf + row * cols, cols) * bf16_to_f32(se[r]));
        }
}

/* y[starts[e] + j, r] = bf16(sum_c q_e[r, c] * x[starts[e] + j, c] * scale_e[r]) */
void kinject_grouped_gemv_int8(int64_t k, const int8_t *const *w, const uint16_t *const *scales, const int64_t *counts,
                               int64_t rows_out, int64_t cols, const uint16_t *x, uint16_t *y, int threads) {
    group_plan p = plan_group(k, counts, rows_out);
    float *xf = as_float(x, p.total * cols);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t it = 0; it < p.items; it++) int8_item(&p, it, w, scales, counts, cols, xf, y);
    free(xf);
    free(p.starts);
}

/* ------------------------------------------------------------------ the fused SwiGLU on AVX2
 *
 * kinject_grouped_swiglu_bf16_amx's one parallel region where torch computes bfloat16 in its own
 * vectorized order (AVX2): the up projection, transformers' default gate with torch's AVX2 exp
 * (``Sleef_expf8_u10``, found in torch's library by the caller, as torch's silu kernel computes it:
 * g / (1 + exp(-g)) in float32, rounded, times u, rounded), the down projection; bfloat16 experts in
 * torch's order (torch's bits), int8 experts in int8_item's arithmetic. The gate's output is kept in
 * bfloat16 (what the down projection reads) and widened once (exact) for the dot products.
 */
#if defined(__AVX2__) && defined(__FMA__)
typedef __m256 (*expf8_fn)(__m256);

static void swiglu8(const uint16_t *g, const uint16_t *u, uint16_t *h, float *hf, void *expf8) {
    const __m256 gv = bf16x8(g);
    const __m256 e = ((expf8_fn)expf8)(_mm256_xor_ps(gv, _mm256_set1_ps(-0.0f)));
    float s[8];
    _mm256_storeu_ps(s, _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    gate_finish(s, u, h, hf, 8);
}

/* gate_rows_of, 8 columns a vector (inter a multiple of 8) */
static void gate_rows8(int64_t n, int64_t inter, const uint16_t *gu, uint16_t *h, float *hf, expf8_fn expf8) {
    gate_rows_of(n, inter, 8, swiglu8, gu, h, hf, (void *)expf8);
}
#endif

/* the gate alone (inter a multiple of 8), for the check against torch's */
void kinject_swiglu_bf16_avx2(int64_t n, int64_t inter, const uint16_t *gu, uint16_t *h, void *expf8) {
#if defined(__AVX2__) && defined(__FMA__)
    gate_rows8(n, inter, gu, h, NULL, (expf8_fn)expf8);
#else
    (void)n, (void)inter, (void)gu, (void)h, (void)expf8;
#endif
}

/* A layer step's bfloat16 (``w_down_scales`` NULL) or int8 experts whole: up, gate, down in one region */
static void swiglu_avx2(int64_t k, const void *const *w_up, const uint16_t *const *s_up, const void *const *w_down,
                        const uint16_t *const *s_down, const int64_t *counts, int64_t inter, int64_t hidden,
                        const uint16_t *x, uint16_t *gu, uint16_t *h, uint16_t *y, int threads, void *expf8) {
#if defined(__AVX2__) && defined(__FMA__)
    group_plan up = plan_group(k, counts, 2 * inter), down = plan_group(k, counts, hidden);
    float *xf = as_float(x, up.total * hidden);
    float *hf = (float *)malloc(sizeof(float) * (size_t)((up.total * inter) > 0 ? up.total * inter : 1));
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < up.items; it++) {
            if (s_up == NULL) bf16_item(&up, it, (const uint16_t *const *)w_up, counts, hidden, xf, gu, ORDER_AVX2);
            else int8_item(&up, it, (const int8_t *const *)w_up, s_up, counts, hidden, xf, gu);
        }
        gate_rows8(up.total, inter, gu, h, hf, (expf8_fn)expf8);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < down.items; it++) {
            if (s_down == NULL) bf16_item(&down, it, (const uint16_t *const *)w_down, counts, inter, hf, y, ORDER_AVX2);
            else int8_item(&down, it, (const int8_t *const *)w_down, s_down, counts, inter, hf, y);
        }
    }
    free(xf);
    free(hf);
    free(up.starts);
    free(down.starts);
#else
    (void)k, (void)w_up, (void)s_up, (void)w_down, (void)s_down, (void)counts, (void)inter, (void)hidden, (void)x;
    (void)gu, (void)h, (void)y, (void)threads, (void)expf8;
#endif
}



/* ------------------------------------------------------------------ int4 weights, bfloat16 activations
 *
 * kinject's int4 host layouts (``pack_int4`` in kinject/engine/host_kernels.py; which one a build reads:
 * kinject_host_gemv_int4): a weight row of ``cols`` signed 4-bit codes q in [-8, 7] (cols a multiple of
 * 128) in blocks of 128 codes (64 bytes), nibbles two's complement; one bfloat16 scale per group of 32
 * codes along the row ([rows, cols / 32]), the weight q * s. Layout 1 (AVX2, AVX-512 without BF16): block
 * b is 16 32-bit little-endian words, nibble k of word j holding code 128 b + 16 k + j, so nibble k of a
 * block's words is 16 consecutive codes and a shift (pair) reaches them in every lane at once. Layout 3
 * (AVX512-BF16): panels of 16 rows whose lanes are the rows (int4_panel): a group's 16 x 32 codes are 4
 * vectors of 32 16-bit words, one shift and one VPERMW from a column pair of the 16 rows as bfloat16, and
 * the group's 16 scales one load; the rows padded to a multiple of 16, the scales by panel and group.
 * (Layout 2, a row's block of 128 as 32 16-bit words, paid per row what a panel pays per 16: its scales
 * converted one by one, 4 FMAs a block and a horizontal sum: compute-bound at 26-27 GB/s on 2 Zen 4 cores
 * with the weights in L3.) Half the bytes of INT8 from memory. torch's own int4 kernel (``_weight_int4pack_mm_for_cpu``)
 * reached 9.5 GB/s on the bench's experts on 2 cores, its calls one expert projection at a time.
 *
 * The arithmetic, the same whatever the other rows of the call. AVX-512: each weight q * s (exact in
 * float32: a 16-entry table of q * s per group, looked up by vpermps on the nibble) multiplied by x
 * and added by a fused multiply-add into one of four 16-lane accumulators (nibble k into accumulator
 * k mod 4), the accumulators added in pairs, their lanes summed by _mm512_reduce_add_ps. AVX2 (8
 * lanes): each group's 32 products q * x summed in float32, four a lane, that sum times the group's
 * scale added into one of two accumulators (even and odd groups), the two added, the lanes summed
 * (halves, pairs, the last two). AVX512-BF16: each group's sum over its 16 column pairs in order, from
 * zero, by VDPBF16PS (the codes as bfloat16, exact; two products a step, denormal x as zero, as the
 * instruction does), that sum times the group's scale added by a fused multiply-add into the row's one
 * accumulator, the groups in order (x read as its own bfloat16 pairs). Rounded once to bfloat16. The widths sum in different orders (different bits, the same documented weight).
 */
#define INT4_MAX_COLS 16384     /* inner dimension at most (a row's float32 scales on the stack) */
#define INT4_AHEAD 2048        /* bytes: the next rows' lines asked for (cold 1.7 -> 0.65 ms a layer step) */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define INT4_VECTOR 1
#define INT4_PAIRS 1
#define INT4_LAYOUT 3        /* panels of 16 rows, lanes as rows (pack_int4 layout 3) */
#define INT4_PANEL 16        /* weight rows a panel (rows padded to a multiple of it) */
/* a code's value as a bfloat16 by its nibble (two's complement), twice: vpermw reads 5 index bits, the
 * fifth being the next nibble's lowest */
static const uint16_t INT4_BF16[32] = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040,
    0xc000, 0xbf80, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0xc100, 0xc0e0, 0xc0c0, 0xc0a0,
    0xc080, 0xc040, 0xc000, 0xbf80};

/* acc[r] (16 lanes: the panel's 16 weight rows) for nx <= 4 activation rows x (bfloat16 pairs, ldx pairs a
 * row): a group's 256 bytes are 4 vectors of 32 16-bit words, word 2 i + t of vector c holding in nibble m
 * the code of row i, column 2 (4 c + m) + t of the group, so one shift (none for m = 0) and one VPERMW give
 * the bfloat16 pairs of pair p = 4 c + m for the 16 rows, times x's pair p broadcast, by VDPBF16PS into the
 * group's 16 sums (from zero, pairs in order); each sum times its row's group scale (16 scales, one load)
 * added into the row's accumulator, the groups in order. GB groups at a time (their sums are independent
 * chains: VDPBF16PS's latency hidden); GB does not change a row's arithmetic. */
static inline __attribute__((always_inline)) void int4_panel(const uint8_t *w, const uint16_t *s, int64_t cols,
                                                             const uint32_t *x, int64_t ldx, const int nx,
                                                             const int GB, __m512 *acc) {
    const __m512i table = _mm512_loadu_si512((const void *)INT4_BF16);
    for (int r = 0; r < nx; r++) acc[r] = _mm512_setzero_ps();
    const int64_t groups = cols / 32;
    for (int64_t g = 0; g < groups; g += GB) {
        const uint8_t *wg = w + 256 * g;
        __m512 part[4][8];
#pragma GCC unroll 4
        for (int r = 0; r < nx; r++)
#pragma GCC unroll 8
            for (int gg = 0; gg < GB; gg++) part[r][gg] = _mm512_setzero_ps();
#pragma GCC unroll 32
        for (int i = 0; i < 4 * GB; i++) _mm_prefetch((const char *)(wg + INT4_AHEAD + 64 * i), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m512i v[8];
#pragma GCC unroll 8
            for (int gg = 0; gg < GB; gg++) v[gg] = _mm512_loadu_si512((const void *)(wg + 256 * gg + 64 * c));
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++)
#pragma GCC unroll 8
                for (int gg = 0; gg < GB; gg++) {
                    const __m512i q = _mm512_permutexvar_epi16(m ? _mm512_srli_epi16(v[gg], 4 * m) : v[gg], table);
#pragma GCC unroll 4
                    for (int r = 0; r < nx; r++) {
                        const __m512i xv = _mm512_set1_epi32((int)x[r * ldx + 16 * (g + gg) + 4 * c + m]);
                        part[r][gg] = _mm512_dpbf16_ps(part[r][gg], (__m512bh)q, (__m512bh)xv);
                    }
                }
        }
#pragma GCC unroll 8
        for (int gg = 0; gg < GB; gg++) {
            const __m256i s16 = _mm256_loadu_si256((const __m256i *)(const void *)(s + 16 * (g + gg)));
            const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s16), 16));
#pragma GCC unroll 4
            for (int r = 0; r < nx; r++) acc[r] = _mm512_fmadd_ps(part[r][gg], sc, acc[r]);
        }
    }
}
#elif defined(__AVX512F__)
#define INT4_VECTOR 1
/* a code's value by its nibble (two's complement), a lane's index into it its low 4 bits (vpermps) */
static const float INT4_VALUES[16] = {0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, -8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f};

static inline __attribute__((always_inline)) void int4_row(const uint8_t *w, const uint16_t *s, int64_t cols,
                                                           const float *x, int64_t ldx, int nx, float *out) {
    const __m512 values = _mm512_loadu_ps(INT4_VALUES);
    float sf[INT4_MAX_COLS / 32];   /* the row's scales in float32: broadcast from memory (no shuffle port) */
    for (int64_t g = 0; g < cols / 32; g++) sf[g] = bf16_to_f32(s[g]);
    __m512 a[4][4];
    for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm512_setzero_ps();
    for (int64_t b = 0; b < cols / 128; b++) {
        const __m512i v = _mm512_loadu_si512((const void *)(w + 64 * b));
        _mm_prefetch((const char *)(w + 64 * b + INT4_AHEAD), _MM_HINT_T0);
        const float *xb = x + 128 * b, *sb = sf + 4 * b;
#define INT4_GROUP16(m)                                                                                       \
        {                                                                                                     \
            const __m512 ws = _mm512_mul_ps(values, _mm512_set1_ps(sb[m]));   /* q * s, exact */               \
            const __m512 w0 = _mm512_permutexvar_ps((m) ? _mm512_srli_epi32(v, 8 * (m)) : v, ws);             \
            const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * (m) + 4), ws);                   \
            for (int r = 0; r < nx; r++) {                                                                    \
                const float *xr = xb + r * ldx + 32 * (m);                                                    \
                a[r][2 * ((m) & 1)] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a[r][2 * ((m) & 1)]);          \
                a[r][2 * ((m) & 1) + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a[r][2 * ((m) & 1) + 1]); \
            }                                                                                                 \
        }
        INT4_GROUP16(0) INT4_GROUP16(1) INT4_GROUP16(2) INT4_GROUP16(3)
#undef INT4_GROUP16
    }
    for (int r = 0; r < nx; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3])));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define INT4_VECTOR 1
#define NIB8(v, k) _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32((v), 28 - 4 * (k)), 28))

static inline __attribute__((always_inline)) void int4_row(const uint8_t *w, const uint16_t *s, int64_t cols,
                                                           const float *x, int64_t ldx, int nx, float *out) {
    __m256 a[4][2];
    for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < cols / 128; b++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + 64 * b));        /* words 0-7: codes 16 k + 0..7 */
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + 64 * b + 32));   /* words 8-15: 16 k + 8..15 */
        _mm_prefetch((const char *)(w + 64 * b + INT4_AHEAD), _MM_HINT_T0);
        const float *xb = x + 128 * b;
        const uint16_t *sb = s + 4 * b;
#define INT4_GROUP8(m)                                                                                        \
        {                                                                                                     \
            const __m256 q0 = NIB8(v0, 2 * (m)), q1 = NIB8(v1, 2 * (m));                                      \
            const __m256 q2 = NIB8(v0, 2 * (m) + 1), q3 = NIB8(v1, 2 * (m) + 1);                              \
            const __m256 sc = _mm256_set1_ps(bf16_to_f32(sb[m]));                                             \
            for (int r = 0; r < nx; r++) {                                                                    \
                const float *xr = xb + r * ldx + 32 * (m);                                                    \
                __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xr));                                            \
                t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8), t);                                          \
                t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xr + 16), t);                                         \
                t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xr + 24), t);                                         \
                a[r][(m) & 1] = _mm256_fmadd_ps(t, sc, a[r][(m) & 1]);                                        \
            }                                                                                                 \
        }
        INT4_GROUP8(0) INT4_GROUP8(1) INT4_GROUP8(2) INT4_GROUP8(3)
#undef INT4_GROUP8
    }
    for (int r = 0; r < nx; r++) {
        const __m256 t = _mm256_add_ps(a[r][0], a[r][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        out[r] = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
    }
}
#endif

#if defined(INT4_VECTOR)
#if !defined(INT4_LAYOUT)
#define INT4_LAYOUT 1        /* 32-bit words: nibble k of word j holds code 16 k + j of the block */
#endif
#if defined(INT4_PAIRS)
#define INT4_LD(cols) ((cols) / 2)     /* an activation row's words (pairs) */
#else
#define INT4_LD(cols) (cols)           /* an activation row's floats */
#endif

/* n activation rows of cols as int4_row reads them, each row INT4_LD(cols) words: on AVX512-BF16 the
 * bfloat16 rows themselves (*owned NULL), else a float32 copy (*owned: to free) */
static const float *int4_activations(const uint16_t *x, int64_t n, int64_t cols, float **owned) {
#if defined(INT4_PAIRS)
    (void)n, (void)cols;
    *owned = NULL;
    return (const float *)(const void *)x;
#else
    *owned = as_float(x, n * cols);
    return *owned;
#endif
}

/* item it of an int4 group: y[starts[e] + j, r] for its weight rows r, up to 4 activation rows a pass
 * over the item's weight rows (ROW_BLOCK rows of cols / 2 bytes: in L1 / L2 for the next 4 rows; a
 * prefill's rows would not be, 1024 rows of 1024 took 110 ms a weight row at a time against 21 for
 * torch's kernel) */
#if INT4_LAYOUT == 3
/* layout 3: the item's panels (ROW_BLOCK is a multiple of 16: an item starts a panel) for up to 4
 * activation rows a pass; the padded rows of a last panel are computed and not stored */
static void int4_item(const group_plan *p, int64_t it, const uint8_t *const *w, const uint16_t *const *scales,
                      const int64_t *counts, int64_t cols, const float *xf, uint16_t *y) {
    int64_t e, r0, r1;
    item_rows(p, it, &e, &r0, &r1);
    const int64_t n = counts[e], first = p->starts[e], rows_out = p->rows_out, groups = cols / 32;
    const int eight = groups % 8 == 0;                  /* 8 groups at a time for up to 2 rows (registers) */
    for (int64_t j = 0; j < n; j += 4) {
        const uint32_t *xr = (const uint32_t *)(const void *)xf + (first + j) * (cols / 2);
        const int nx = n - j < 4 ? (int)(n - j) : 4;
        for (int64_t r = r0; r < r1; r += INT4_PANEL) {
            const uint8_t *wp = w[e] + r * (cols / 2);          /* panel r / 16: 16 rows of cols / 2 bytes */
            const uint16_t *sp = scales[e] + r * groups;        /* its [groups, 16] scales */
            __m512 acc[4];
            switch (nx) {   /* (constant row and group counts: the sums stay in registers) */
            case 1: if (eight) int4_panel(wp, sp, cols, xr, cols / 2, 1, 8, acc); else int4_panel(wp, sp, cols, xr, cols / 2, 1, 4, acc); break;
            case 2: if (eight) int4_panel(wp, sp, cols, xr, cols / 2, 2, 8, acc); else int4_panel(wp, sp, cols, xr, cols / 2, 2, 4, acc); break;
            case 3: int4_panel(wp, sp, cols, xr, cols / 2, 3, 4, acc); break;
            default: int4_panel(wp, sp, cols, xr, cols / 2, 4, 4, acc); break;
            }
            const int valid = r1 - r < INT4_PANEL ? (int)(r1 - r) : INT4_PANEL;
            for (int a = 0; a < nx; a++) {
                float c[16];
                _mm512_storeu_ps(c, acc[a]);
                uint16_t *out = y + (first + j + a) * rows_out + r;
                for (int i = 0; i < valid; i++) out[i] = f32_to_bf16(c[i]);
            }
        }
    }
}
#else
static void int4_item(const group_plan *p, int64_t it, const uint8_t *const *w, const uint16_t *const *scales,
                      const int64_t *counts, int64_t cols, const float *xf, uint16_t *y) {
    int64_t e, r0, r1;
    item_rows(p, it, &e, &r0, &r1);
    const int64_t n = counts[e], first = p->starts[e], rows_out = p->rows_out;
    float out[4];
    for (int64_t j = 0; j < n; j += 4) {
        const float *xr = xf + (first + j) * INT4_LD(cols);
        const int nx = n - j < 4 ? (int)(n - j) : 4;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *wr = w[e] + r * (cols / 2);
            const uint16_t *sr = scales[e] + r * (cols / 32);
            switch (nx) {   /* (constant row counts: the accumulators stay in registers) */
            case 1: int4_row(wr, sr, cols, xr, INT4_LD(cols), 1, out); break;
            case 2: int4_row(wr, sr, cols, xr, INT4_LD(cols), 2, out); break;
            case 3: int4_row(wr, sr, cols, xr, INT4_LD(cols), 3, out); break;
            default: int4_row(wr, sr, cols, xr, INT4_LD(cols), 4, out); break;
            }
            for (int i = 0; i < nx; i++) y[(first + j + i) * rows_out + r] = f32_to_bf16(out[i]);
        }
    }
}
#endif
#endif

/* the int4 layout this build reads (pack_int4's ``layout``: 1 32-bit words, 3 panels of 16 rows), 0 where the
 * int4 group does not compute here (no vector build); cols must be a multiple of 128 */
int kinject_host_gemv_int4(void) {
#if defined(INT4_VECTOR)
    return INT4_LAYOUT;
#else
    return 0;
#endif
}

/* y[starts[e] + j, r] = bf16(sum over groups g of s_e[r, g] * sum_{c in g} q_e[r, c] * x[starts[e] + j, c]) */
void kinject_grouped_gemv_int4(int64_t k, const uint8_t *const *w, const uint16_t *const *scales,
                               const int64_t *counts, int64_t rows_out, int64_t cols, const uint16_t *x, uint16_t *y,
                               int threads) {
#if defined(INT4_VECTOR)
    group_plan p = plan_group(k, counts, rows_out);
    float *owned;
    const float *xf = int4_activations(x, p.total, cols, &owned);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t it = 0; it < p.items; it++) int4_item(&p, it, w, scales, counts, cols, xf, y);
    free(owned);
    free(p.starts);
#else
    (void)k, (void)w, (void)scales, (void)counts, (void)rows_out, (void)cols, (void)x, (void)y, (void)threads;
#endif
}

/* A layer step's int4 experts whole, in one parallel region: up, transformers' default gate, down.
 * ``wide``: the gate with torch's AVX-512 exp (``expf`` is Sleef_expf16_u10; AVX-512 builds), else its AVX2 one. */
static void swiglu_int4(int64_t k, const uint8_t *const *w_up, const uint16_t *const *s_up,
                                 const uint8_t *const *w_down, const uint16_t *const *s_down,
                                 const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                                 uint16_t *gu, uint16_t *h, uint16_t *y, int threads, void *expf, int wide) {
#if defined(INT4_VECTOR)
    group_plan up = plan_group(k, counts, 2 * inter), down = plan_group(k, counts, hidden);
    float *owned;
    const float *xf = int4_activations(x, up.total, hidden, &owned);
#if defined(INT4_PAIRS)
    float *hf = NULL;                                  /* (the down projection reads h itself) */
    const float *down_x = (const float *)(const void *)h;
#else
    float *hf = (float *)malloc(sizeof(float) * (size_t)((up.total * inter) > 0 ? up.total * inter : 1));
    const float *down_x = hf;                          /* (the gate writes its float32 copy) */
#endif
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < up.items; it++) int4_item(&up, it, w_up, s_up, counts, hidden, xf, gu);
        float *gate_hf = hf;
#if defined(__AVX512F__)
        if (wide) gate_rows(up.total, inter, gu, h, gate_hf, (expf16_fn)expf); else
#endif
        {
#if defined(__AVX2__) && defined(__FMA__)
            gate_rows8(up.total, inter, gu, h, gate_hf, (expf8_fn)expf);
#endif
        }
#pragma omp for schedule(static)   /* (after the gate's barrier) */
        for (int64_t it = 0; it < down.items; it++) int4_item(&down, it, w_down, s_down, counts, inter, down_x, y);
    }
    free(owned);
    free(hf);
    free(up.starts);
    free(down.starts);
#else
    (void)k, (void)w_up, (void)s_up, (void)w_down, (void)s_down, (void)counts, (void)inter, (void)hidden, (void)x;
    (void)gu, (void)h, (void)y, (void)threads, (void)expf;
#endif
    (void)wide;   /* (read only by AVX-512 builds) */
}

/* ------------------------------------------------------------------ int8 weights on AMX
 *
 * The same float32 arithmetic, at memory speed: a block of int8 weights is widened to bfloat16
 * (exact: every int8 value is a bfloat16) into a tile-sized scratch in L1 and multiplied by the
 * bfloat16 activation with TDPBF16PS, whose products are exact in float32 and whose sum runs over
 * the inner dimension in order (the kernel's own order, as above; denormal activations count as
 * zero), then times the row's scale, rounded once. The int8 kernel above converts and multiplies
 * each weight with vector FMAs and is compute-bound at 9-10 GB/s on 2 cores at the bench's shape;
 * this one streams. Rows in blocks of 16 (rows_out a multiple of 16), cols a multiple of 32.
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KINJECT_INT8_AMX 1

/* 16 int8 weight rows (row stride cols) -> t in tiles: t + 512 * b holds columns [32 b, 32 b + 32) of
 * the 16 rows, 64 bytes a row (what one tile load takes). Converted whole before the tile loop: a
 * tile load right behind the stores that fill it waits for them, one block at a time. */
#define INT8_AHEAD 2048   /* bytes: the conversion's own loads leave the prefetchers behind (5.2 -> 7.0 GB/s a core) */
static inline void int8_rows_to_tiles(const int8_t *w, int64_t cols, uint16_t *t) {
    for (int i = 0; i < 16; i++)
        for (int64_t k = 0; k < cols; k += 32) {
            const int8_t *src = w + i * cols + k;
            if (!(k & 63)) _mm_prefetch((const char *)(src + INT8_AHEAD), _MM_HINT_T0);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
            _mm512_store_si512((void *)(t + 16 * k + 32 * i), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    __asm__ volatile("" ::: "memory");   /* GCC's tile load is asm that names no memory: the stores stay first */
}

/* y[i] = bf16(dot(row i, x) * scale[i]) for the 16 rows converted into t (tiles 0-2 as configure_tiles) */
static inline void tiles16_amx(const uint16_t *t, int64_t cols, const uint16_t *x, const uint16_t *scale, uint16_t *y) {
    float c[16];
    _tile_zero(0);
    for (int64_t k = 0; k < cols; k += 32) {
        _tile_loadd(1, t + 16 * k, 64);
        _tile_loadd(2, x + k, 4);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, 4);
    for (int i = 0; i < 16; i++) y[i] = f32_to_bf16(c[i] * bf16_to_f32(scale[i]));
}

/* scratch: 16 x cols bfloat16, 64-byte aligned, the calling thread's own */
static void int8_amx_item(const group_plan *p, int64_t it, const int8_t *const *w, const uint16_t *const *scales,
                          const int64_t *counts, int64_t cols, const uint16_t *x, uint16_t *y, uint16_t *scratch) {
    int64_t e, r0, r1;
    item_rows(p, it, &e, &r0, &r1);
    for (int64_t r = r0; r < r1; r += 16) {
        int8_rows_to_tiles(w[e] + r * cols, cols, scratch);
        for (int64_t j = 0; j < counts[e]; j++) {
            const int64_t row = p->starts[e] + j;
            tiles16_amx(scratch, cols, x + row * cols, scales[e] + r, y + row * p->rows_out + r);
        }
    }
}

static uint16_t *tile_scratch(int64_t cols) {
    return (uint16_t *)aligned_alloc(64, (size_t)(16 * cols * 2 + 63) / 64 * 64);
}
#endif

/* ------------------------------------------------------------------ int8 weights on AMX-INT8, exact sums
 *
 * No conversion of the weights at all. Each activation row is written exactly as a few signed bytes
 * per value, "digits": on the fixed-point grid of the row's smallest nonzero magnitude, x = 2^lsb *
 * sum_d 256^d * digit_d (balanced base 256). TDPBSSD then multiplies the int8 weights, loaded into
 * tiles straight from memory, by every digit of a few rows at once (one tile column per digit: up
 * to 16 columns cost what one does). Each column's sum is exact in int32 and their combination
 * exact in 64 (or 128) bits, so a row's result is sum(x * q) exactly, rounded once to float32
 * (times 2^lsb), times the row's scale, rounded to bfloat16: the float32 result closest to the true
 * sum, which does not depend on the order of the sum, the thread count or the other rows of the call.
 * A row whose nonzero values' exponents span more than DIGITS_SPAN is held on the grid 2^-(DIGITS_SPAN + 7)
 * of its largest value's power of two (2^-62; smaller values rounded to nearest even on it). Measured on the
 * bench's experts, 2 cores: 1.30 -> 0.85 ms a layer step, ~23 GB/s against the tile conversion's ~14.
 * NaN or infinite activations leave the call to the conversion kernel above.
 */
/* the biased exponent range [lo, hi] of a row's nonzero values (subnormals as 1; hi < lo: all zero);
 * 0 where the row holds a NaN or an infinity */
static __attribute__((unused)) int row_exponents(const uint16_t *x, int64_t cols, int *lo, int *hi) {
    int a = 255, b = 0, bad = 0;
    for (int64_t i = 0; i < cols; i++) {
        const int e = (x[i] >> 7) & 0xff, nonzero = (x[i] & 0x7fff) != 0, ee = e ? e : 1;
        bad |= e == 255;
        if (nonzero) a = ee < a ? ee : a, b = ee > b ? ee : b;
    }
    *lo = a, *hi = b;
    return !bad;
}

/* a bfloat16 value as an integer on the grid 2^(low - 134) (a bfloat16 is m * 2^(e - 134), m its 8-bit
 * integer): exact at or above the grid, rounded to nearest even below it */
static inline __attribute__((unused)) int64_t grid_integer(uint16_t v, int low) {
    const int e = (v >> 7) & 0xff, shift = (e ? e : 1) - low;
    const int64_t m = (v & 0x7f) | (e ? 0x80 : 0);
    int64_t X = 0;
    if (shift >= 0) X = m << shift;
    else if (shift > -10) {
        const int64_t half = (int64_t)1 << (-shift - 1), q = m >> -shift, r = m & ((half << 1) - 1);
        X = q + (r > half || (r == half && (q & 1)));
    }
    return v & 0x8000 ? -X : X;
}

#if defined(KINJECT_INT8_AMX) && defined(__AMX_INT8__) && defined(__AVX512VBMI__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define KINJECT_INT8_DIGITS 1
#define DIGITS_MAX 8                       /* digits a row: 64-bit integers on the grid */
#define DIGITS_SPAN (8 * DIGITS_MAX - 9)   /* binary orders of magnitude those hold with a sign */
#define DIGIT_BLOCK 1024                   /* bytes of one B tile: 64 inner values x 16 columns */

typedef struct {
    int64_t total, cols;
    int digits;           /* digits per activation row (the call's largest need) */
    int wide;             /* a sum may pass 2^63 (128-bit combination): 128 * cols * 2^(8 digits - 1) */
    int rows_per_chunk;   /* activation rows per tile of 16 columns: 16 / digits */
    int64_t chunks, *chunk0, *expert_of;   /* expert e's first chunk; row j's expert */
    int8_t *b;            /* chunks x cols / 64 B tiles (VNNI layout: 4 inner values per column word) */
    int *lo, *hi, *low;   /* per row: biased exponent range of its nonzero values; its grid's exponent */
    float *unit;          /* per row: 2^lsb, the value of one grid step */
    int ok;               /* 0: a NaN or infinity (the call goes to the conversion kernel) */
} digit_plan;

/* where value i's digit words go: its B tile, its row of 4 inner values, then (slot, digit) columns */
static inline int8_t *digit_words(int8_t *b, int64_t i, int slot, int digits) {
    return b + (i / 64) * DIGIT_BLOCK + ((i % 64) / 4) * 64 + slot * digits * 4 + (i % 4);
}

/* any row: the integer of each value on the grid (rounded to nearest even below it), digit by digit */
static void digitize_row(const uint16_t *x, int64_t cols, int low, int digits, int slot, int8_t *b) {
    for (int64_t i = 0; i < cols; i++) {
        int64_t X = grid_integer(x[i], low);
        int8_t *dst = digit_words(b, i, slot, digits);
        for (int d = 0; d < digits; d++) {
            const int8_t s = (int8_t)(uint8_t)(X & 0xff);   /* X mod 256 in [-128, 128) */
            dst[4 * d] = s;
            X = (X - s) >> 8;
        }
    }
}

/* digitize_row for a row with no value below its grid (cols a multiple of 8), 8 values a step: the
 * balanced digits of X are the bytes of (X + C) ^ C (C: 0x80 in each digit byte), and one byte
 * permutation turns 4 values' 8-byte integers into their digit words, stored as 4 * digits bytes */
static void digitize_row_exact(const uint16_t *x, int64_t cols, int low, int digits, int slot, int8_t *b) {
    const __m512i grid = _mm512_set1_epi64(low), one = _mm512_set1_epi64(1), byte = _mm512_set1_epi64(0xff);
    const __m512i mant = _mm512_set1_epi64(0x7f), lead = _mm512_set1_epi64(0x80), sign = _mm512_set1_epi64(0x8000);
    const __m512i carry = _mm512_set1_epi64((int64_t)(0x8080808080808080ull >> (64 - 8 * digits)));
    const __m256i order = _mm256_setr_epi8(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
                                           4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31);
    const __mmask32 keep = (__mmask32)((1ull << (4 * digits)) - 1);
    for (int64_t i = 0; i < cols; i += 8) {
        const __m512i v = _mm512_cvtepu16_epi64(_mm_loadu_si128((const __m128i *)(x + i)));
        const __m512i e = _mm512_and_si512(_mm512_srli_epi64(v, 7), byte), m0 = _mm512_and_si512(v, mant);
        const __m512i m = _mm512_mask_or_epi64(m0, _mm512_test_epi64_mask(e, e), m0, lead);
        __m512i X = _mm512_sllv_epi64(m, _mm512_sub_epi64(_mm512_max_epi64(e, one), grid));
        X = _mm512_mask_sub_epi64(X, _mm512_test_epi64_mask(v, sign), _mm512_setzero_si512(), X);
        const __m512i Y = _mm512_xor_si512(_mm512_add_epi64(X, carry), carry);
        _mm256_mask_storeu_epi8(digit_words(b, i, slot, digits), keep,
                                _mm256_permutexvar_epi8(order, _mm512_castsi512_si256(Y)));
        _mm256_mask_storeu_epi8(digit_words(b, i + 4, slot, digits), keep,
                                _mm256_permutexvar_epi8(order, _mm512_extracti64x4_epi64(Y, 1)));
    }
}

static inline int64_t chunks_of(int64_t n, int rows_per_chunk) { return (n + rows_per_chunk - 1) / rows_per_chunk; }

static digit_plan new_digit_plan(int64_t k, int64_t total, int64_t cols) {
    digit_plan dp;
    memset(&dp, 0, sizeof dp);
    const size_t n = (size_t)(total ? total : 1);
    dp.total = total, dp.cols = cols, dp.ok = 1;
    dp.chunk0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(k ? k : 1));
    dp.expert_of = (int64_t *)malloc(sizeof(int64_t) * n);
    dp.lo = (int *)malloc(sizeof(int) * n * 3);
    dp.hi = dp.lo + n, dp.low = dp.lo + 2 * n;
    dp.unit = (float *)malloc(sizeof(float) * n);
    if (!dp.chunk0 || !dp.expert_of || !dp.lo || !dp.unit) dp.ok = 0;
    return dp;
}

static void free_digit_plan(digit_plan *dp) {
    free(dp->chunk0), free(dp->expert_of), free(dp->lo), free(dp->unit), free(dp->b);
}

/* the rows' grids and digits, written once for every work item (inside a parallel region: every
 * thread calls it); afterwards dp->ok says whether the digits are there */
static void digit_rows(const group_plan *p, int64_t k, const int64_t *counts, const uint16_t *x, digit_plan *dp) {
    const int64_t cols = dp->cols;
    if (!dp->ok) return;   /* (the same for every thread: set before the region) */
#pragma omp for schedule(static)
    for (int64_t j = 0; j < p->total; j++)
        if (!row_exponents(x + j * cols, cols, dp->lo + j, dp->hi + j)) __atomic_store_n(&dp->ok, 0, __ATOMIC_RELAXED);
#pragma omp single
    if (dp->ok) {
        int digits = 1;
        for (int64_t j = 0; j < p->total; j++) {
            int low = dp->hi[j] < dp->lo[j] ? 1 : dp->lo[j];
            if (dp->hi[j] - low > DIGITS_SPAN) low = dp->hi[j] - DIGITS_SPAN;
            const int need = dp->hi[j] < dp->lo[j] ? 1 : (dp->hi[j] - low + 9 + 7) / 8;   /* |X| < 2^(8 d - 1) */
            digits = need > digits ? need : digits;
            dp->low[j] = low;
            dp->unit[j] = ldexpf(1.0f, low - 134);   /* a bfloat16 is m * 2^(e - 134), m its 8-bit integer */
        }
        dp->digits = digits, dp->rows_per_chunk = 16 / digits, dp->chunks = 0;
        int bits = 0;   /* |sum| <= 128 * cols * 2^(8 digits - 1) < 2^(bits + 8 digits + 6) */
        while (((int64_t)1 << bits) < cols) bits++;
        dp->wide = bits + 8 * digits + 6 > 62;
        for (int64_t e = 0; e < k; e++) {
            dp->chunk0[e] = dp->chunks, dp->chunks += chunks_of(counts[e], dp->rows_per_chunk);
            for (int64_t j = p->starts[e]; j < p->starts[e] + counts[e]; j++) dp->expert_of[j] = e;
        }
        /* unwritten columns (a last chunk's missing rows, the columns past 16 / digits * digits) are
         * multiplied too, into tile columns nobody reads: no need to clear them */
        dp->b = (int8_t *)aligned_alloc(64, (size_t)(dp->chunks ? dp->chunks : 1) * (size_t)(cols / 64) * DIGIT_BLOCK);
        if (!dp->b) dp->ok = 0;
    }
    if (!dp->ok) return;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < p->total; j++) {
        const int64_t e = dp->expert_of[j], i = j - p->starts[e];
        int8_t *b = dp->b + (dp->chunk0[e] + i / dp->rows_per_chunk) * (cols / 64) * DIGIT_BLOCK;
        const int slot = (int)(i % dp->rows_per_chunk);
        if (dp->lo[j] >= dp->low[j] && cols % 8 == 0) digitize_row_exact(x + j * cols, cols, dp->low[j], dp->digits, slot, b);
        else digitize_row(x + j * cols, cols, dp->low[j], dp->digits, slot, b);
    }
}

static void configure_digit_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;   /* C, A, B, C, A: 16 x 64 bytes */
    _tile_loadconfig(&cfg);
}


/* y[r] = bf16(float(sum_d c[r][slot digits + d] 256^d) * unit * scale[r]) for the 16 rows of a C tile */
static inline void combine16(const int32_t *c, int digits, int wide, int slot, float unit, const uint16_t *scale,
                             uint16_t *y) {
    if (wide) {   /* up to 2^(31 + 8 * 7): 128 bits */
        for (int r = 0; r < 16; r++) {
            const int32_t *cr = c + r * 16 + slot * digits;
            __int128 s = 0;
            for (int d = digits - 1; d >= 0; d--) s = s * 256 + cr[d];
            y[r] = f32_to_bf16((float)s * unit * bf16_to_f32(scale[r]));
        }
        return;
    }
    const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    for (int d = digits - 1; d >= 0; d--) {
        const __m512i col = _mm512_i32gather_epi32(_mm512_add_epi32(rows, _mm512_set1_epi32(slot * digits + d)), c, 4);
        lo = _mm512_add_epi64(_mm512_slli_epi64(lo, 8), _mm512_cvtepi32_epi64(_mm512_castsi512_si256(col)));
        hi = _mm512_add_epi64(_mm512_slli_epi64(hi, 8), _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(col, 1)));
    }
    __m512 f = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtepi64_ps(lo)), _mm512_cvtepi64_ps(hi), 1);
    f = _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(unit)), bf16x16(scale));
    _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(bf16x16_round(f)));
}

/* one work item (up to ROW_BLOCK weight rows of one expert) against every chunk of its rows */
static void int8_digits_item(const group_plan *p, const digit_plan *dp, int64_t it, const int8_t *const *w,
                             const uint16_t *const *scales, const int64_t *counts, int64_t cols, uint16_t *y) {
    int64_t e, r0, r1;
    item_rows(p, it, &e, &r0, &r1);
    const int8_t *we = w[e];
    const int64_t blocks = cols / 64, per = dp->rows_per_chunk;
    int32_t c0[256], c1[256];
    for (int64_t c = 0; c < chunks_of(counts[e], (int)per); c++) {
        const int8_t *b = dp->b + (dp->chunk0[e] + c) * blocks * DIGIT_BLOCK;
        const int64_t first = c * per, rows = counts[e] - first < per ? counts[e] - first : per;
        int64_t r = r0;
        for (; r + 32 <= r1; r += 32) {
            _tile_zero(0);
            _tile_zero(3);
            for (int64_t q = 0; q < blocks; q++) {
                _tile_loadd(2, b + q * DIGIT_BLOCK, 64);
                _tile_loadd(1, we + r * cols + q * 64, cols);
                _tile_loadd(4, we + (r + 16) * cols + q * 64, cols);
                _tile_dpbssd(0, 1, 2);
                _tile_dpbssd(3, 4, 2);
            }
            if (r + 64 <= r1)   /* the next block's first lines, while this one's sums are combined */
                for (int i = 0; i < 32; i++) _mm_prefetch((const char *)(we + (r + 32 + i) * cols), _MM_HINT_T0);
            _tile_stored(0, c0, 64);
            _tile_stored(3, c1, 64);
            for (int64_t i = 0; i < rows; i++) {
                const int64_t row = p->starts[e] + first + i;
                uint16_t *out = y + row * p->rows_out + r;
                combine16(c0, dp->digits, dp->wide, (int)i, dp->unit[row], scales[e] + r, out);
                combine16(c1, dp->digits, dp->wide, (int)i, dp->unit[row], scales[e] + r + 16, out + 16);
            }
        }
        for (; r < r1; r += 16) {
            _tile_zero(0);
            for (int64_t q = 0; q < blocks; q++) {
                _tile_loadd(2, b + q * DIGIT_BLOCK, 64);
                _tile_loadd(1, we + r * cols + q * 64, cols);
                _tile_dpbssd(0, 1, 2);
            }
            _tile_stored(0, c0, 64);
            for (int64_t i = 0; i < rows; i++) {
                const int64_t row = p->starts[e] + first + i;
                combine16(c0, dp->digits, dp->wide, (int)i, dp->unit[row], scales[e] + r, y + row * p->rows_out + r);
            }
        }
    }
}

/* one projection of a group on digits (inside a parallel region): 0 where a NaN or infinity left it */
static int int8_digits_group(const group_plan *p, digit_plan *dp, int64_t k, const int8_t *const *w,
                             const uint16_t *const *scales, const int64_t *counts, const uint16_t *x, uint16_t *y) {
    digit_rows(p, k, counts, x, dp);
    if (!dp->ok) return 0;
    configure_digit_tiles();
#pragma omp for schedule(static)
    for (int64_t it = 0; it < p->items; it++) int8_digits_item(p, dp, it, w, scales, counts, dp->cols, y);
    return 1;
}
#endif

/* 1: the int8 group computes on AMX here (built for it; the caller asked for AMX first) */
int kinject_host_gemv_int8_amx(void) {
#if defined(KINJECT_INT8_AMX)
    return 1;
#else
    return 0;
#endif
}

/* 1: where cols is a multiple of 64, the int8 group's sums are exact (AMX-INT8 digits, above) */
int kinject_host_gemv_int8_exact(void) {
#if defined(KINJECT_INT8_DIGITS)
    return 1;
#else
    return 0;
#endif
}

/* kinject_grouped_gemv_int8 on AMX (rows_out a multiple of 16, cols of 32; AMX permitted): the exact
 * digits where cols is a multiple of 64 and the activations are finite, else the tile conversion */
void kinject_grouped_gemv_int8_amx(int64_t k, const int8_t *const *w, const uint16_t *const *scales,
                                   const int64_t *counts, int64_t rows_out, int64_t cols, const uint16_t *x,
                                   uint16_t *y, int threads) {
#if defined(KINJECT_INT8_AMX)
    group_plan p = plan_group(k, counts, rows_out);
#if defined(KINJECT_INT8_DIGITS)
    if (cols % 64 == 0) {
        digit_plan dp = new_digit_plan(k, p.total, cols);
#pragma omp parallel num_threads(threads)
        {
            int8_digits_group(&p, &dp, k, w, scales, counts, x, y);
            _tile_release();
        }
        const int done = dp.ok;
        free_digit_plan(&dp);
        if (done) {
            free(p.starts);
            return;
        }
    }
#endif
#pragma omp parallel num_threads(threads)
    {
        uint16_t *scratch = tile_scratch(cols);
        configure_tiles(0);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < p.items; it++) int8_amx_item(&p, it, w, scales, counts, cols, x, y, scratch);
        _tile_release();
        free(scratch);
    }
    free(p.starts);
#else
    (void)k, (void)w, (void)scales, (void)counts, (void)rows_out, (void)cols, (void)x, (void)y, (void)threads;
#endif
}

/* kinject_grouped_swiglu_bf16_amx for int8 experts (their scales beside them): one parallel region */
static void swiglu_int8_amx(int64_t k, const int8_t *const *w_up, const uint16_t *const *s_up,
                                     const int8_t *const *w_down, const uint16_t *const *s_down,
                                     const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                                     uint16_t *gu, uint16_t *h, uint16_t *y, int threads, void *expf16) {
#if defined(KINJECT_INT8_DIGITS)
    if (hidden % 64 == 0 && inter % 64 == 0) {
        group_plan gup = plan_group(k, counts, 2 * inter), gdown = plan_group(k, counts, hidden);
        digit_plan dx = new_digit_plan(k, gup.total, hidden), dh = new_digit_plan(k, gup.total, inter);
#pragma omp parallel num_threads(threads)
        {
            if (int8_digits_group(&gup, &dx, k, w_up, s_up, counts, x, gu)) {
                gate_rows(gup.total, inter, gu, h, NULL, (expf16_fn)expf16);
                if (!int8_digits_group(&gdown, &dh, k, w_down, s_down, counts, h, y)) {   /* h overflowed */
                    uint16_t *scratch = tile_scratch(inter);
                    configure_tiles(0);
#pragma omp for schedule(static)
                    for (int64_t it = 0; it < gdown.items; it++)
                        int8_amx_item(&gdown, it, w_down, s_down, counts, inter, h, y, scratch);
                    free(scratch);
                }
            }
            _tile_release();
        }
        const int done = dx.ok;
        free_digit_plan(&dx), free_digit_plan(&dh);
        free(gup.starts), free(gdown.starts);
        if (done) return;
    }
#endif
#if defined(KINJECT_INT8_AMX)
    group_plan up = plan_group(k, counts, 2 * inter), down = plan_group(k, counts, hidden);
#pragma omp parallel num_threads(threads)
    {
        uint16_t *scratch = tile_scratch(hidden > inter ? hidden : inter);
        configure_tiles(0);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < up.items; it++) int8_amx_item(&up, it, w_up, s_up, counts, hidden, x, gu, scratch);
        gate_rows(up.total, inter, gu, h, NULL, (expf16_fn)expf16);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < down.items; it++) int8_amx_item(&down, it, w_down, s_down, counts, inter, h, y, scratch);
        _tile_release();
        free(scratch);
    }
    free(up.starts);
    free(down.starts);
#else
    (void)k, (void)w_up, (void)s_up, (void)w_down, (void)s_down, (void)counts, (void)inter, (void)hidden, (void)x;
    (void)gu, (void)h, (void)y, (void)threads, (void)expf16;
#endif
}

/* ------------------------------------------------------------------ bfloat16 and int8 on AVX512-BF16: torch's order
 *
 * Where there is no AMX but the CPU has AVX512-BF16 (AMD Zen 4 and 5, Intel Cooper Lake), torch's
 * bfloat16 GEMV and GEMM are oneDNN's avx512_core_bf16 kernels: VDPBF16PS with 16 outputs in the lanes
 * of one accumulator each, the inner dimension in order, a pair of columns a step (found here on
 * inputs built to cancel: one float32 accumulator per output, the pair's second product added before
 * its first, as the instruction does). The same instruction in the same order gives the same bits
 * (checked against torch when the kernel loads, as the AMX one is). Weights stay in their row-major
 * layout: a block of 16 rows x 32 columns is loaded (16 lines, one per row stream) and transposed in
 * registers (16 x 16 dwords: four stages of interleaves), so that vector j holds column pair j
 * of the 16 rows; each is multiplied by the activation's pair j, broadcast. INT8 weights (without
 * AVX512-VNNI, or for rows holding a NaN: the exact sums below take the rest) are widened to bfloat16 first
 * (exact), then the same: the float32 arithmetic of the AMX INT8 path, in its order.
 */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KINJECT_DP 1
#define DP_ROWS 4            /* activation rows a pass over a weight block (their accumulators in registers) */

/* r[j] lane i <- r[i] lane j, for 16 x 16 dwords: 32-bit, 64-bit, then 128-bit and 256-bit interleaves
 * (64 in-register shuffles for 1 KB of weights) */
static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
    __m512i t[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; i += 8)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* acc[a] += the 16 rows' columns [k, k + 32) (transposed in t) times activation row a's (m rows, row stride
 * x_ld), pairs of columns < cols only */
static inline __attribute__((always_inline)) void dp_step(const __m512i *t, const uint16_t *x, int64_t x_ld, int m,
                                                         int64_t k, int64_t cols, __m512 *acc) {
    const int64_t left = cols - k;
    if (left >= 32) {
        for (int a = 0; a < m; a++) {
            const uint16_t *xr = x + a * x_ld + k;
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                int32_t v;
                memcpy(&v, xr + 2 * j, 4);
                acc[a] = _mm512_dpbf16_ps(acc[a], (__m512bh)t[j], (__m512bh)_mm512_set1_epi32(v));
            }
        }
        return;
    }
    const int pairs = (int)((left + 1) / 2);
    for (int a = 0; a < m; a++) {
        const uint16_t *xr = x + a * x_ld + k;
        for (int j = 0; j < pairs; j++) {
            uint32_t v = xr[2 * j];
            if (2 * j + 1 < left) v |= (uint32_t)xr[2 * j + 1] << 16;
            acc[a] = _mm512_dpbf16_ps(acc[a], (__m512bh)t[j], (__m512bh)_mm512_set1_epi32((int)v));
        }
    }
}

/* oneDNN's blocks of the inner dimension: each block's sum starts from zero and is then added to the
 * output's; 512 columns for one activation row, and for several where cols <= 1024, else 1024 (found as
 * the order is, on inputs built to cancel) */
static inline int64_t dp_kblock(int64_t rows, int64_t cols) { return rows == 1 || cols <= 1024 ? 512 : 1024; }

/* acc[a] += part[a], part[a] = 0, at the end of each inner block */
static inline void dp_close_block(__m512 *acc, __m512 *part, int m) {
    for (int a = 0; a < m; a++) acc[a] = _mm512_add_ps(acc[a], part[a]), part[a] = _mm512_setzero_ps();
}

/* acc[a] (16 lanes: the 16 rows) = the dot products of 16 bfloat16 weight rows with m <= DP_ROWS activation
 * rows, the inner dimension in blocks of kblock */
static inline void dp_block16(const uint16_t *const *row, int64_t cols, const uint16_t *x, int64_t x_ld, int m,
                              int64_t kblock, const char *next, __m512 *acc) {
    __m512 part[DP_ROWS];
    for (int a = 0; a < m; a++) acc[a] = part[a] = _mm512_setzero_ps();
    __m512i t[16];
    for (int64_t k = 0; k < cols; k += 32) {
        if (k && k % kblock == 0) dp_close_block(acc, part, m);
        const __mmask32 mk = cols - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (cols - k)) - 1u);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            _mm_prefetch(next + k * 32 + 64 * i, _MM_HINT_T1);
            t[i] = _mm512_maskz_loadu_epi16(mk, row[i] + k);
        }
        transpose16(t);
        dp_step(t, x, x_ld, m, k, cols, part);
    }
    dp_close_block(acc, part, m);
}

/* dp_block16 for int8 rows, each 32 weights widened to bfloat16 (exact) as loaded */
static inline void dp_block16_int8(const int8_t *const *row, int64_t cols, const uint16_t *x, int64_t x_ld, int m,
                                   int64_t kblock, const char *next, __m512 *acc) {
    __m512 part[DP_ROWS];
    for (int a = 0; a < m; a++) acc[a] = part[a] = _mm512_setzero_ps();
    __m512i t[16];
    for (int64_t k = 0; k < cols; k += 32) {
        if (k && k % kblock == 0) dp_close_block(acc, part, m);
        const __mmask32 mk = cols - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (cols - k)) - 1u);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) _mm_prefetch(next + k * 16 + 64 * i, _MM_HINT_T1);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            const __m256i q = _mm256_maskz_loadu_epi8(mk, row[i] + k);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
            t[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        }
        transpose16(t);
        dp_step(t, x, x_ld, m, k, cols, part);
    }
    dp_close_block(acc, part, m);
}

/* One work item (up to ROW_BLOCK weight rows of one expert, every activation row of its expert): bfloat16
 * weights (scales NULL) or int8 ones times their per-row bfloat16 scales. The rows past rows_out in the
 * last block read the block's first row again and are not stored. */
static void dp_item(const group_plan *p, int64_t it, const void *const *w, const uint16_t *const *scales,
                    const int64_t *counts, int64_t cols, const uint16_t *x, uint16_t *y) {
    int64_t e, r0, r1;
    item_rows(p, it, &e, &r0, &r1);
    const int64_t rows_out = p->rows_out;
    for (int64_t r = r0; r < r1; r += 16) {
        const int valid = r + 16 <= r1 ? 16 : (int)(r1 - r);
        const void *row[16];
        for (int i = 0; i < 16; i++) {
            const int64_t rr = r + (i < valid ? i : 0);
            row[i] = scales == NULL ? (const void *)((const uint16_t *)w[e] + rr * cols)
                                    : (const void *)((const int8_t *)w[e] + rr * cols);
        }
        float s[16];
        if (scales != NULL)
            for (int i = 0; i < valid; i++) s[i] = bf16_to_f32(scales[e][r + i]);
        /* INT8: blocks of 512 whatever the rows, so that a row's bits do not depend on the call's other rows
         * (a long prompt's call is cut into windows of rows) */
        const int64_t kblock = scales == NULL ? dp_kblock(counts[e], cols) : 512;
        for (int64_t j = 0; j < counts[e]; j += DP_ROWS) {
            const int m = counts[e] - j < DP_ROWS ? (int)(counts[e] - j) : DP_ROWS;
            const int64_t first = p->starts[e] + j;
            __m512 acc[DP_ROWS];
            /* the next block's bytes, in address order, asked for while this one is computed (the 16 row
             * streams alone left the prefetchers behind: 11 GB/s on 2 cores) */
            const char *next = (const char *)row[0] + (j ? 0 : 16 * cols * (scales == NULL ? 2 : 1));
            if (scales == NULL) dp_block16((const uint16_t *const *)row, cols, x + first * cols, cols, m, kblock, next, acc);
            else dp_block16_int8((const int8_t *const *)row, cols, x + first * cols, cols, m, kblock, next, acc);
            for (int a = 0; a < m; a++) {
                float c[16];
                _mm512_storeu_ps(c, acc[a]);
                uint16_t *out = y + (first + a) * rows_out + r;
                for (int i = 0; i < valid; i++) out[i] = f32_to_bf16(scales == NULL ? c[i] : c[i] * s[i]);
            }
        }
    }
}
#endif

/* ------------------------------------------------------------------ int8 on AVX512-VNNI: exact sums
 *
 * The arithmetic of the AMX-INT8 path above, with VPDPBUSD (unsigned bytes times signed bytes, four
 * products a lane into int32): each activation row is put once per call on its grid (grid_integer: the
 * smallest nonzero value's unit, no finer than 2^-DIGITS_SPAN of the largest), offset by 2^(8 D - 1) so
 * that it is nonnegative and cut into D unsigned base-256 digits; the int8 weights are read straight
 * from memory, 64 a load, and multiplied by every digit, and once by ones (their row sum, for the
 * offset). Each lane's int32 sum is exact (cols <= VNNI_MAX_COLS), their combination exact in 64 or 128
 * bits: an output is the float32 nearest to the true sum(x * q), times the row's scale, rounded to
 * bfloat16, whatever the order, the threads or the call's other rows. No conversion and no transpose:
 * 1 + D + 1 instructions a 64 weights against the widening kernel's ~20, which was compute-bound at
 * 13-15 GB/s on 2 Zen 4 cores. A NaN or an infinity leaves the projection to the widening kernel.
 */
#if defined(KINJECT_DP) && defined(__AVX512VNNI__)
#define KINJECT_VNNI 1
#define VNNI_DIGITS_MAX 8                        /* digits a row: 64-bit integers on the grid */
#define VNNI_SPAN (8 * VNNI_DIGITS_MAX - 9)      /* binary orders of magnitude those hold with a sign */
#define VNNI_MAX_COLS 32768                      /* 16 lanes of int32 sums stay exact */
#define VNNI_ROWS 4                              /* weight rows a pass over a row's digits */

typedef struct {
    int64_t padded;       /* cols rounded up to 64: a digit plane's length */
    uint8_t *planes;      /* row j's digit d at planes[(j * VNNI_DIGITS_MAX + d) * padded] */
    int *digits;          /* digits of row j */
    float *unit;          /* 2^(low - 134) of row j */
    int ready;            /* the memory is there (set before the parallel region, then only read) */
    int finite;           /* 0: a NaN or infinity somewhere (the projection goes to the widening kernel) */
} vnni_rows;

static vnni_rows new_vnni_rows(int64_t total, int64_t cols) {
    vnni_rows v;
    const size_t n = (size_t)(total ? total : 1);
    v.padded = (cols + 63) / 64 * 64;
    v.planes = (uint8_t *)aligned_alloc(64, n * VNNI_DIGITS_MAX * (size_t)v.padded);
    v.digits = (int *)malloc(sizeof(int) * n);
    v.unit = (float *)malloc(sizeof(float) * n);
    v.ready = v.finite = v.planes && v.digits && v.unit;
    return v;
}

static void free_vnni_rows(vnni_rows *v) { free(v->planes), free(v->digits), free(v->unit); }

/* row j of x on its grid, as digits (inside a parallel region: every thread calls it; a barrier after) */
static void vnni_digit_rows(int64_t total, int64_t cols, const uint16_t *x, vnni_rows *v) {
#pragma omp for schedule(static)
    for (int64_t j = 0; j < total; j++) {
        const uint16_t *xr = x + j * cols;
        int lo, hi;
        if (!row_exponents(xr, cols, &lo, &hi)) {
            __atomic_store_n(&v->finite, 0, __ATOMIC_RELAXED);
            continue;
        }
        int low = hi < lo ? 1 : lo;
        if (hi - low > VNNI_SPAN) low = hi - VNNI_SPAN;
        const int d = hi < lo ? 1 : (hi - low + 9 + 7) / 8;       /* |X| < 2^(8 d - 1) */
        v->digits[j] = d, v->unit[j] = ldexpf(1.0f, low - 134);
        const uint64_t offset = (uint64_t)1 << (8 * d - 1);
        uint8_t *plane = v->planes + (size_t)j * VNNI_DIGITS_MAX * (size_t)v->padded;
        for (int64_t i = 0; i < v->padded; i++) {
            const uint64_t u = i < cols ? (uint64_t)grid_integer(xr[i], low) + offset : 0;
            for (int k = 0; k < d; k++) plane[k * v->padded + i] = (uint8_t)(u >> (8 * k));
        }
    }
}

/* y[q] for n <= R weight rows (row stride cols) and one activation row's D digits; R and D constants where
 * it is inlined, so that the R x (D + 1) accumulators are registers (R = 4 up to 4 digits, else 2) */
static inline __attribute__((always_inline)) void vnni_rows_d(const int8_t *w, int64_t cols, int n,
                                                              const uint8_t *plane, int64_t padded, const int R,
                                                              const int D, float unit, const uint16_t *scale,
                                                              uint16_t *y) {
    __m512i acc[VNNI_ROWS][VNNI_DIGITS_MAX], sums[VNNI_ROWS];
    const __m512i ones = _mm512_set1_epi8(1);
#pragma GCC unroll 4
    for (int q = 0; q < R; q++) {
        sums[q] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int d = 0; d < D; d++) acc[q][d] = _mm512_setzero_si512();
    }
    for (int64_t k = 0; k < cols; k += 64) {
        const __mmask64 mk = cols - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (cols - k)) - 1);
        __m512i wq[VNNI_ROWS];
#pragma GCC unroll 4
        for (int q = 0; q < R; q++) {
            /* the rows 16 ahead, in address order, into L2 (as dp_block16's next block) */
            _mm_prefetch((const char *)(w + 16 * cols) + k * R + 64 * q, _MM_HINT_T1);
            wq[q] = _mm512_maskz_loadu_epi8(q < n ? mk : 0, w + q * cols + k);
        }
#pragma GCC unroll 8
        for (int d = 0; d < D; d++) {
            const __m512i xd = _mm512_load_si512((const void *)(plane + d * padded + k));
#pragma GCC unroll 4
            for (int q = 0; q < R; q++) acc[q][d] = _mm512_dpbusd_epi32(acc[q][d], xd, wq[q]);
        }
#pragma GCC unroll 4
        for (int q = 0; q < R; q++) sums[q] = _mm512_dpbusd_epi32(sums[q], ones, wq[q]);
    }
#pragma GCC unroll 4
    for (int q = 0; q < R; q++) {
        if (q >= n) break;
        float f;
        if (D <= 4) {   /* |sum| < 2^31 a digit, shifted at most 24; the offset's term < 2^(31 + 22): int64 */
            int64_t s = -(int64_t)_mm512_reduce_add_epi32(sums[q]) * ((int64_t)1 << (8 * D - 1));
#pragma GCC unroll 8
            for (int d = 0; d < D; d++) s += (int64_t)_mm512_reduce_add_epi32(acc[q][d]) * ((int64_t)1 << (8 * d));
            f = (float)s;
        } else {
            __int128 s = -(__int128)_mm512_reduce_add_epi32(sums[q]) * (__int128)((uint64_t)1 << (8 * D - 1));
#pragma GCC unroll 8
            for (int d = 0; d < D; d++) s += (__int128)_mm512_reduce_add_epi32(acc[q][d]) << (8 * d);
            f = (float)s;
        }
        y[q] = f32_to_bf16(f * unit * bf16_to_f32(scale[q]));
    }
}

/* one work item (up to ROW_BLOCK weight rows of one expert) against every activation row of its expert */
static void vnni_item(const group_plan *p, int64_t it, const int8_t *const *w, const uint16_t *const *scales,
                      const int64_t *counts, int64_t cols, const vnni_rows *v, uint16_t *y) {
    int64_t e, r0, r1;
    item_rows(p, it, &e, &r0, &r1);
    int most = 1;   /* the most digits of the expert's rows: 4 weight rows a pass up to 4, else 2 */
    for (int64_t j = 0; j < counts[e]; j++) most = v->digits[p->starts[e] + j] > most ? v->digits[p->starts[e] + j] : most;
    const int step = most <= 4 ? 4 : 2;
    for (int64_t r = r0; r < r1; r += step) {        /* each pass's weight rows in L1 for all of the expert's rows */
        const int n = r + step <= r1 ? step : (int)(r1 - r);
        const int8_t *wr = w[e] + r * cols;
        for (int64_t j = 0; j < counts[e]; j++) {
            const int64_t row = p->starts[e] + j;
            const uint8_t *plane = v->planes + (size_t)row * VNNI_DIGITS_MAX * (size_t)v->padded;
            const float unit = v->unit[row];
            uint16_t *out = y + row * p->rows_out + r;
            if (step == 4)
                switch (v->digits[row]) {   /* rows and digits constants in each: the accumulators stay in registers */
#define VNNI_CASE(R, D) case D: vnni_rows_d(wr, cols, n, plane, v->padded, R, D, unit, scales[e] + r, out); break;
                    VNNI_CASE(4, 1) VNNI_CASE(4, 2) VNNI_CASE(4, 3) VNNI_CASE(4, 4)
                }
            else
                switch (v->digits[row]) {
                    VNNI_CASE(2, 1) VNNI_CASE(2, 2) VNNI_CASE(2, 3) VNNI_CASE(2, 4) VNNI_CASE(2, 5) VNNI_CASE(2, 6)
                    VNNI_CASE(2, 7) VNNI_CASE(2, 8)
#undef VNNI_CASE
                }
        }
    }
}

/* one int8 projection inside a parallel region: exact sums where the rows are finite, else the widening kernel */
static void int8_dp_projection(const group_plan *p, const int8_t *const *w, const uint16_t *const *scales,
                               const int64_t *counts, int64_t cols, const uint16_t *x, vnni_rows *v, uint16_t *y) {
    if (v->ready) vnni_digit_rows(p->total, cols, x, v);  /* (the same for every thread; ends with a barrier) */
    const int exact = v->ready && __atomic_load_n(&v->finite, __ATOMIC_RELAXED);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < p->items; it++) {
        if (exact) vnni_item(p, it, w, scales, counts, cols, v, y);
        else dp_item(p, it, (const void *const *)w, scales, counts, cols, x, y);
    }
}
#endif

/* 1: the int8 group sums exactly here on AVX512-VNNI (inner dimension <= VNNI_MAX_COLS) */
int kinject_host_gemv_int8_vnni(void) {
#if defined(KINJECT_VNNI)
    return VNNI_MAX_COLS;
#else
    return 0;
#endif
}

#if defined(KINJECT_DP)
/* int8 on AVX512-VNNI (exact sums) where there, else widened to bfloat16 (dp_item) */
static void int8_dp_group(int64_t k, const int8_t *const *w, const uint16_t *const *scales, const int64_t *counts,
                          int64_t rows_out, int64_t cols, const uint16_t *x, uint16_t *y, int threads) {
    group_plan p = plan_group(k, counts, rows_out);
#if defined(KINJECT_VNNI)
    vnni_rows v = new_vnni_rows(p.total, cols);
    v.ready = v.ready && cols <= VNNI_MAX_COLS;
#pragma omp parallel num_threads(threads)
    int8_dp_projection(&p, w, scales, counts, cols, x, &v, y);
    free_vnni_rows(&v);
#else
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t it = 0; it < p.items; it++) dp_item(&p, it, (const void *const *)w, scales, counts, cols, x, y);
#endif
    free(p.starts);
}
#endif

/* 1: this build has the AVX512-BF16 kernels (dp_item) */
int kinject_host_gemv_dp(void) {
#if defined(KINJECT_DP)
    return 1;
#else
    return 0;
#endif
}

/* y[starts[e] + j, r] as torch computes it on AVX512-BF16 (any rows_out and cols) */
void kinject_grouped_gemv_bf16_dp(int64_t k, const uint16_t *const *w, const int64_t *counts, int64_t rows_out,
                                  int64_t cols, const uint16_t *x, uint16_t *y, int threads) {
#if defined(KINJECT_DP)
    group_plan p = plan_group(k, counts, rows_out);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t it = 0; it < p.items; it++) dp_item(&p, it, (const void *const *)w, NULL, counts, cols, x, y);
    free(p.starts);
#else
    (void)k, (void)w, (void)counts, (void)rows_out, (void)cols, (void)x, (void)y, (void)threads;
#endif
}

/* y[starts[e] + j, r] = bf16(float32(sum_c q_e[r, c] * x[., c], in order) * scale_e[r]) on AVX512-BF16 */
void kinject_grouped_gemv_int8_dp(int64_t k, const int8_t *const *w, const uint16_t *const *scales,
                                  const int64_t *counts, int64_t rows_out, int64_t cols, const uint16_t *x,
                                  uint16_t *y, int threads) {
#if defined(KINJECT_DP)
    int8_dp_group(k, w, scales, counts, rows_out, cols, x, y, threads);
#else
    (void)k, (void)w, (void)scales, (void)counts, (void)rows_out, (void)cols, (void)x, (void)y, (void)threads;
#endif
}

/* A layer step's bfloat16 (s_up NULL) or int8 experts whole on AVX512-BF16, in one parallel region:
 * up, transformers' default gate (torch's AVX-512 exp), down. */
static void swiglu_dp(int64_t k, const void *const *w_up, const uint16_t *const *s_up, const void *const *w_down,
                      const uint16_t *const *s_down, const int64_t *counts, int64_t inter, int64_t hidden,
                      const uint16_t *x, uint16_t *gu, uint16_t *h, uint16_t *y, int threads, void *expf16) {
#if defined(KINJECT_DP)
    group_plan up = plan_group(k, counts, 2 * inter), down = plan_group(k, counts, hidden);
#if defined(KINJECT_VNNI)
    const int vnni = s_up != NULL && hidden <= VNNI_MAX_COLS && inter <= VNNI_MAX_COLS;
    vnni_rows vx = new_vnni_rows(vnni ? up.total : 0, hidden), vh = new_vnni_rows(vnni ? up.total : 0, inter);
    vx.ready = vx.ready && vnni, vh.ready = vh.ready && vnni;
#endif
#pragma omp parallel num_threads(threads)
    {
#if defined(KINJECT_VNNI)
        if (vnni) int8_dp_projection(&up, (const int8_t *const *)w_up, s_up, counts, hidden, x, &vx, gu); else
#endif
        {
#pragma omp for schedule(static)
            for (int64_t it = 0; it < up.items; it++) dp_item(&up, it, w_up, s_up, counts, hidden, x, gu);
        }
        gate_rows(up.total, inter, gu, h, NULL, (expf16_fn)expf16);
#if defined(KINJECT_VNNI)
        if (vnni) int8_dp_projection(&down, (const int8_t *const *)w_down, s_down, counts, inter, h, &vh, y); else
#endif
        {
#pragma omp for schedule(static)
            for (int64_t it = 0; it < down.items; it++) dp_item(&down, it, w_down, s_down, counts, inter, h, y);
        }
    }
#if defined(KINJECT_VNNI)
    free_vnni_rows(&vx);
    free_vnni_rows(&vh);
#endif
    free(up.starts);
    free(down.starts);
#else
    (void)k, (void)w_up, (void)s_up, (void)w_down, (void)s_down, (void)counts, (void)inter, (void)hidden, (void)x;
    (void)gu, (void)h, (void)y, (void)threads, (void)expf16;
#endif
}

/* ------------------------------------------------------------------ the fused entries' rows and scratch
 *
 * Each fused SwiGLU entry takes its activation rows as a pointer and a row stride: ``x_stride ==
 * hidden`` for [total, hidden] rows, 0 for one row standing for every row (a decode step's token,
 * routed to k experts: the caller makes no k-row tensor for it, a torch operation that costs tens of
 * microseconds after the experts' weights have flushed the caches). ``gu`` and ``h`` may be NULL: the
 * scratch is then made here. The rows are copied into place once (a few KB), then the entry runs as
 * on [total, hidden] rows. */
typedef struct {
    const uint16_t *x;
    uint16_t *gu, *h;
    void *own[3];
} fused_io;

static fused_io fused_begin(int64_t k, const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                            int64_t x_stride, uint16_t *gu, uint16_t *h) {
    fused_io io = {x, gu, h, {NULL, NULL, NULL}};
    int64_t total = 0;
    for (int64_t e = 0; e < k; e++) total += counts[e];
    if (x_stride != hidden && total > 1) {
        uint16_t *rows = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(total * hidden));
        for (int64_t r = 0; r < total; r++) memcpy(rows + r * hidden, x + r * x_stride, sizeof(uint16_t) * (size_t)hidden);
        io.x = rows, io.own[0] = rows;
    }
    if (gu == NULL) io.gu = (uint16_t *)(io.own[1] = malloc(sizeof(uint16_t) * (size_t)(total > 0 ? total * 2 * inter : 1)));
    if (h == NULL) io.h = (uint16_t *)(io.own[2] = malloc(sizeof(uint16_t) * (size_t)(total > 0 ? total * inter : 1)));
    return io;
}

static void fused_end(fused_io *io) {
    for (int i = 0; i < 3; i++) free(io->own[i]);
}

void kinject_grouped_swiglu_bf16_amx(int64_t k, const uint16_t *const *w_up, const uint16_t *const *w_down,
                                     const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                                     int64_t x_stride, uint16_t *gu, uint16_t *h, uint16_t *y, int threads,
                                     void *expf16) {
    fused_io io = fused_begin(k, counts, inter, hidden, x, x_stride, gu, h);
    swiglu_bf16_amx(k, w_up, w_down, counts, inter, hidden, io.x, io.gu, io.h, y, threads, expf16);
    fused_end(&io);
}

void kinject_grouped_swiglu_bf16_avx2(int64_t k, const uint16_t *const *w_up, const uint16_t *const *w_down,
                                      const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                                      int64_t x_stride, uint16_t *gu, uint16_t *h, uint16_t *y, int threads,
                                      void *expf8) {
    fused_io io = fused_begin(k, counts, inter, hidden, x, x_stride, gu, h);
    swiglu_avx2(k, (const void *const *)w_up, NULL, (const void *const *)w_down, NULL, counts, inter, hidden, io.x,
                io.gu, io.h, y, threads, expf8);
    fused_end(&io);
}

void kinject_grouped_swiglu_int8_avx2(int64_t k, const int8_t *const *w_up, const uint16_t *const *s_up,
                                      const int8_t *const *w_down, const uint16_t *const *s_down,
                                      const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                                      int64_t x_stride, uint16_t *gu, uint16_t *h, uint16_t *y, int threads,
                                      void *expf8) {
    fused_io io = fused_begin(k, counts, inter, hidden, x, x_stride, gu, h);
    swiglu_avx2(k, (const void *const *)w_up, s_up, (const void *const *)w_down, s_down, counts, inter, hidden, io.x,
                io.gu, io.h, y, threads, expf8);
    fused_end(&io);
}

void kinject_grouped_swiglu_int8_amx(int64_t k, const int8_t *const *w_up, const uint16_t *const *s_up,
                                     const int8_t *const *w_down, const uint16_t *const *s_down,
                                     const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                                     int64_t x_stride, uint16_t *gu, uint16_t *h, uint16_t *y, int threads,
                                     void *expf16) {
    fused_io io = fused_begin(k, counts, inter, hidden, x, x_stride, gu, h);
    swiglu_int8_amx(k, w_up, s_up, w_down, s_down, counts, inter, hidden, io.x, io.gu, io.h, y, threads, expf16);
    fused_end(&io);
}

void kinject_grouped_swiglu_int4(int64_t k, const uint8_t *const *w_up, const uint16_t *const *s_up,
                                 const uint8_t *const *w_down, const uint16_t *const *s_down,
                                 const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                                 int64_t x_stride, uint16_t *gu, uint16_t *h, uint16_t *y, int threads, void *expf,
                                 int wide) {
    fused_io io = fused_begin(k, counts, inter, hidden, x, x_stride, gu, h);
    swiglu_int4(k, w_up, s_up, w_down, s_down, counts, inter, hidden, io.x, io.gu, io.h, y, threads, expf, wide);
    fused_end(&io);
}

void kinject_grouped_swiglu_bf16_dp(int64_t k, const uint16_t *const *w_up, const uint16_t *const *w_down,
                                    const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                                    int64_t x_stride, uint16_t *gu, uint16_t *h, uint16_t *y, int threads,
                                    void *expf16) {
    fused_io io = fused_begin(k, counts, inter, hidden, x, x_stride, gu, h);
    swiglu_dp(k, (const void *const *)w_up, NULL, (const void *const *)w_down, NULL, counts, inter, hidden, io.x,
              io.gu, io.h, y, threads, expf16);
    fused_end(&io);
}

void kinject_grouped_swiglu_int8_dp(int64_t k, const int8_t *const *w_up, const uint16_t *const *s_up,
                                    const int8_t *const *w_down, const uint16_t *const *s_down,
                                    const int64_t *counts, int64_t inter, int64_t hidden, const uint16_t *x,
                                    int64_t x_stride, uint16_t *gu, uint16_t *h, uint16_t *y, int threads,
                                    void *expf16) {
    fused_io io = fused_begin(k, counts, inter, hidden, x, x_stride, gu, h);
    swiglu_dp(k, (const void *const *)w_up, s_up, (const void *const *)w_down, s_down, counts, inter, hidden, io.x,
              io.gu, io.h, y, threads, expf16);
    fused_end(&io);
}

/* ------------------------------------------------------------------ RMSNorm of a few rows
 *
 * torch's float32 sum of a contiguous row of n values, in its order (at::native's cascade sum for an
 * inner reduction, a vector of `lanes` floats per load): the n / lanes whole vectors are summed by 4
 * interleaved accumulators (vector i into accumulator i % 4) whose groups of 16 are carried up 4
 * levels, the accumulators then added 0 + 1 + 2 + 3; the tail values one by one from 0, then the
 * lanes in order. Plain C on arrays of floats: every addition is the one torch makes, in its order. */
#define SUM_LEVELS 4
#define MAX_LANES 16

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t b = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) b++;
    return b;
}

/* (no fused multiply-adds here: each product and sum is rounded on its own, as torch's are) */
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

NO_CONTRACT static float torch_row_sum(const float *v, int64_t n, int lanes) {
    if (n < lanes) lanes = 1;            /* shorter than a vector: torch's scalar sum, the same order per value */
    const int64_t vectors = n / lanes, size = vectors / 4;
    int64_t power = ceil_log2(size) / SUM_LEVELS;
    if (power < 4) power = 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[SUM_LEVELS][4][MAX_LANES];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    for (; i + step <= size;) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int r = 0; r < 4; r++)
                for (int l = 0; l < lanes; l++) acc[0][r][l] += v[(i * 4 + r) * lanes + l];
        for (int j = 1; j < SUM_LEVELS; ++j) {
            for (int r = 0; r < 4; r++)
                for (int l = 0; l < lanes; l++) {
                    acc[j][r][l] += acc[j - 1][r][l];
                    acc[j - 1][r][l] = 0.0f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < lanes; l++) acc[0][r][l] += v[(i * 4 + r) * lanes + l];
    for (int j = 1; j < SUM_LEVELS; ++j)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < lanes; l++) acc[0][r][l] += acc[j][r][l];
    for (int64_t t = size * 4; t < vectors; t++)              /* whole vectors past the last group of 4 */
        for (int l = 0; l < lanes; l++) acc[0][0][l] += v[t * lanes + l];
    for (int r = 1; r < 4; r++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][r][l];
    float total = 0.0f;
    for (int64_t t = vectors * lanes; t < n; t++) total += v[t];
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* torch_row_sum, for the check at load that finds the vector width torch's sum kernel uses here */
float kinject_row_sum_f32(int64_t n, const float *v, int lanes) {
    return lanes >= 1 && lanes <= MAX_LANES ? torch_row_sum(v, n, lanes) : 0.0f;
}

/* y = RMSNorm(x) for `rows` contiguous rows of n bfloat16 values, as transformers' RMSNorm computes it
 * (`variant` 0: weight * bf16(x * rsqrt(mean(x^2) + eps)), both bfloat16; 1: bf16(weight * (x * rsqrt(..)))
 * with the product in float32), each step rounded as torch rounds it: x^2 and the sum in float32, the
 * mean a division by n, 1 / sqrt, the products in float32. n <= 16384. */
NO_CONTRACT void kinject_rms_norm_bf16(int64_t rows, int64_t n, const uint16_t *x, const uint16_t *w, uint16_t *y, float eps,
                           int lanes, int variant) {
    float sq[16384];
    if (lanes > MAX_LANES || lanes < 1 || n > 16384) return;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
        uint16_t *yr = y + r * n;
        for (int64_t j = 0; j < n; j++) {
            const float f = bf16_to_f32(xr[j]);
            sq[j] = f * f;
        }
        const float mean = torch_row_sum(sq, n, lanes) / (float)n;
        const float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t j = 0; j < n; j++) {
            const float h = bf16_to_f32(xr[j]) * scale;
            yr[j] = variant == 0 ? f32_to_bf16(bf16_to_f32(w[j]) * bf16_to_f32(f32_to_bf16(h)))
                                 : f32_to_bf16(bf16_to_f32(w[j]) * h);
        }
    }
}

/* transformers' rotary embedding (Llama's apply_rotary_pos_emb, unsqueeze_dim 1) of a query and a key:
 * out = x * cos + rotate_half(x) * sin for x [b, h, s, d] (h = hq for q, hk for k) and cos, sin
 * [b, s, d], all contiguous bfloat16, d even; each product rounded to bfloat16, their sum in float32
 * rounded to bfloat16, as torch computes bfloat16 `*` and `+` (rotate_half(x) = cat(-x[d/2:], x[:d/2]):
 * exact). */
NO_CONTRACT static void rotary_rows(int64_t b, int64_t h, int64_t s, int64_t d, const uint16_t *x,
                                    const uint16_t *cos, const uint16_t *sin, uint16_t *out) {
    const int64_t half = d / 2;
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t hi = 0; hi < h; hi++)
            for (int64_t si = 0; si < s; si++) {
                const int64_t row = ((bi * h + hi) * s + si) * d, cs = (bi * s + si) * d;
                for (int64_t j = 0; j < d; j++) {
                    const float xc = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[row + j]) * bf16_to_f32(cos[cs + j])));
                    const float rot = j < half ? -bf16_to_f32(x[row + j + half]) : bf16_to_f32(x[row + j - half]);
                    const float rs = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(sin[cs + j])));
                    out[row + j] = f32_to_bf16(xc + rs);
                }
            }
}

void kinject_rotary_bf16(int64_t b, int64_t hq, int64_t hk, int64_t s, int64_t d, const uint16_t *q,
                         const uint16_t *k, const uint16_t *cos, const uint16_t *sin, uint16_t *out_q,
                         uint16_t *out_k) {
    rotary_rows(b, hq, s, d, q, cos, sin, out_q);
    rotary_rows(b, hk, s, d, k, cos, sin, out_k);
}

/* ------------------------------------------------------------------ a decode step's attention inputs
 *
 * q, k, v = x W_q^T, x W_k^T, x W_v^T for `rows` query rows (each one token), the per-head RMSNorm of q
 * and k where the attention has one (q_norm / k_norm non-NULL), then the rotary embedding of both: the
 * calls an attention forward makes one by one (decode_attention.py), through the same functions in the
 * same order, so with the same bits; in one call instead of six (each a Python frame, a buffer and
 * argument conversion: at batch 1 they cost more than their arithmetic). `kernel`: the GEMV the one-row
 * linears use (0 the vectorized order `order`, 1 AMX, 2 AVX512-BF16, as HostGemv.rows_checked picks
 * it). q_raw / k_raw hold the projections before the rotary (normed in place); q_out [rows, nq],
 * k_out and v_out [rows, nk] are the results (nq, nk multiples of d). */
static void one_weight_gemv(int kernel, int order, int threads, const uint16_t *w, int64_t rows, int64_t out,
                            int64_t cols, const uint16_t *x, uint16_t *y) {
    const uint16_t *ws[1] = {w};
    const int64_t counts[1] = {rows};
    if (kernel == 1) kinject_grouped_gemv_bf16_amx(1, ws, counts, out, cols, x, y, threads);
    else if (kernel == 2) kinject_grouped_gemv_bf16_dp(1, ws, counts, out, cols, x, y, threads);
    else kinject_grouped_gemv_bf16(1, ws, counts, out, cols, x, y, threads, order);
}

void kinject_attention_inputs_bf16(int64_t rows, int64_t cols, const uint16_t *x, const uint16_t *wq, int64_t nq,
                                   const uint16_t *wk, const uint16_t *wv, int64_t nk, int kernel, int order,
                                   int threads, int64_t d, const uint16_t *q_norm, const uint16_t *k_norm, float eps,
                                   int lanes, int variant, const uint16_t *cos, const uint16_t *sin, uint16_t *q_raw,
                                   uint16_t *k_raw, uint16_t *q_out, uint16_t *k_out, uint16_t *v_out) {
    one_weight_gemv(kernel, order, threads, wq, rows, nq, cols, x, q_raw);
    if (q_norm) kinject_rms_norm_bf16(rows * (nq / d), d, q_raw, q_norm, q_raw, eps, lanes, variant);
    one_weight_gemv(kernel, order, threads, wk, rows, nk, cols, x, k_raw);
    if (k_norm) kinject_rms_norm_bf16(rows * (nk / d), d, k_raw, k_norm, k_raw, eps, lanes, variant);
    one_weight_gemv(kernel, order, threads, wv, rows, nk, cols, x, v_out);
    kinject_rotary_bf16(rows, nq / d, nk / d, 1, d, q_raw, k_raw, cos, sin, q_out, k_out);
}

/* ------------------------------------------------------------------ a decode step's router
 *
 * transformers' top-k router of one token (Qwen2/3-MoE, OLMoE and their kin: ``F.linear`` -> ``softmax(
 * dtype=float)`` -> ``topk`` -> ``/ sum`` where ``norm`` -> bfloat16) in one call: the logits through the
 * one-row GEMV (``kernel`` / ``order`` as the attention's projections), then torch's CPU softmax of a
 * contiguous last dimension in its arithmetic (``_vec_softmax_lastdim`` on AVX-512: the maximum, exp(x -
 * max) with torch's own vector exp, their sum as its ``reduce_all`` adds 16-lane vectors and then halves the
 * lanes, one reciprocal and a product per value), the k largest in descending order, their sum in torch's
 * order (torch_row_sum) and quotients, each rounded to bfloat16. Where torch's topk could order them
 * otherwise (two of the k largest equal, or the k-th equal to one left out) or a logit is NaN, it returns 1
 * and the caller runs the router's own forward: the logits are written, nothing else is used. */
#define ROUTE_MAX_EXPERTS 1024
#define ROUTE_MAX_K 64

/* libstdc++'s std::nth_element / std::sort pieces on (value, index) pairs with torch's topk comparator
 * for the largest (``a > b``; NaN never reaches them), as torch's CPU topk calls them */
static inline void route_swap(float *v, int64_t *id, int64_t a, int64_t b) {
    const float tv = v[a];
    const int64_t ti = id[a];
    v[a] = v[b], id[a] = id[b], v[b] = tv, id[b] = ti;
}

static void route_insertion_sort(float *v, int64_t *id, int64_t first, int64_t last) {
    if (first == last) return;
    for (int64_t i = first + 1; i < last; i++) {
        const float val = v[i];
        const int64_t vid = id[i];
        if (val > v[first]) {                         /* move_backward, then the value first */
            for (int64_t j = i; j > first; j--) v[j] = v[j - 1], id[j] = id[j - 1];
            v[first] = val, id[first] = vid;
        } else {                                      /* unguarded linear insert */
            int64_t j = i;
            while (val > v[j - 1]) v[j] = v[j - 1], id[j] = id[j - 1], j--;
            v[j] = val, id[j] = vid;
        }
    }
}

static void route_median_to_first(float *v, int64_t *id, int64_t result, int64_t a, int64_t b, int64_t c) {
    if (v[a] > v[b]) {
        if (v[b] > v[c]) route_swap(v, id, result, b);
        else if (v[a] > v[c]) route_swap(v, id, result, c);
        else route_swap(v, id, result, a);
    } else if (v[a] > v[c]) route_swap(v, id, result, a);
    else if (v[b] > v[c]) route_swap(v, id, result, c);
    else route_swap(v, id, result, b);
}

static int64_t route_partition(float *v, int64_t *id, int64_t first, int64_t last, int64_t pivot) {
    for (;;) {
        while (v[first] > v[pivot]) first++;
        last--;
        while (v[pivot] > v[last]) last--;
        if (!(first < last)) return first;
        route_swap(v, id, first, last);
        first++;
    }
}

/* std::nth_element(begin, begin + nth, end): introselect; 1 where its depth limit would switch to a heap
 * select (not reproduced: the caller refuses) */
static int topk_select(float *v, int64_t *id, int64_t n, int64_t nth) {
    int64_t first = 0, last = n, depth = 0;
    for (int64_t m = n; m > 1; m >>= 1) depth++;      /* std::__lg(n) */
    depth *= 2;
    while (last - first > 3) {
        if (depth == 0) return 1;
        depth--;
        const int64_t mid = first + (last - first) / 2;
        route_median_to_first(v, id, first, first + 1, mid, last - 1);
        const int64_t cut = route_partition(v, id, first + 1, last, first);
        if (cut <= nth) first = cut;
        else last = cut;
    }
    route_insertion_sort(v, id, first, last);
    return 0;
}

NO_CONTRACT int kinject_route_topk_bf16(int kernel, int order, int threads, const uint16_t *x, const uint16_t *w,
                            int64_t experts, int64_t cols, int64_t k, int norm, int lanes, void *expf16,
                            uint16_t *logits, uint16_t *scores, int64_t *indices) {
#if defined(__AVX512F__)
    if (experts < 1 || experts > ROUTE_MAX_EXPERTS || k < 1 || k > ROUTE_MAX_K || k > experts || expf16 == NULL)
        return -1;
    one_weight_gemv(kernel, order, threads, w, 1, experts, cols, x, logits);
    float p[ROUTE_MAX_EXPERTS];
    for (int64_t i = 0; i < experts; i++) {
        p[i] = bf16_to_f32(logits[i]);
        if (p[i] != p[i]) return 1;
    }
    /* the maximum (no NaN: any order gives it) */
    float mx = p[0];
    for (int64_t i = 1; i < experts; i++) mx = p[i] > mx ? p[i] : mx;
    /* exp(x - max), whole vectors and the tail as a vector (torch's map loads and stores count lanes) */
    const __m512 vmax = _mm512_set1_ps(mx);
    for (int64_t i = 0; i < experts; i += 16) {
        const int64_t n = experts - i < 16 ? experts - i : 16;
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(m, p + i);
        _mm512_mask_storeu_ps(p + i, m, ((expf16_fn)expf16)(_mm512_sub_ps(v, vmax)));
    }
    /* reduce_all(+): a row shorter than a vector summed in order; else the first vector, each whole one
     * added, the tail added into its lanes, then the lanes halved */
    float sum = p[0];
    if (experts < 16) {
        for (int64_t i = 1; i < experts; i++) sum += p[i];
    } else {
        __m512 acc = _mm512_loadu_ps(p);
        int64_t d = 16;
        for (; d < experts - (experts % 16); d += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + d));
        if (experts - d > 0) {
            const __mmask16 m = (__mmask16)((1u << (experts - d)) - 1u);
            acc = _mm512_mask_add_ps(acc, m, acc, _mm512_maskz_loadu_ps(m, p + d));
        }
        acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0x4E));
        acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0xB1));
        acc = _mm512_add_ps(acc, _mm512_shuffle_ps(acc, acc, 0x4E));
        acc = _mm512_add_ps(acc, _mm512_shuffle_ps(acc, acc, 0xB1));
        sum = _mm512_cvtss_f32(acc);
    }
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < experts; i++) p[i] = p[i] * inv;
    float top[ROUTE_MAX_K];
    if (k * 64 > experts && k - 1 <= 16) {
        /* torch's topk here: std::nth_element at k - 1, then std::sort of the k - 1 before it (libstdc++'s
         * introselect and insertion sort, step for step: ties come out in its order) */
        float v[ROUTE_MAX_EXPERTS];
        int64_t id[ROUTE_MAX_EXPERTS];
        for (int64_t i = 0; i < experts; i++) v[i] = p[i], id[i] = i;
        if (topk_select(v, id, experts, k - 1) != 0) return 1;
        route_insertion_sort(v, id, 0, k - 1);
        for (int64_t j = 0; j < k; j++) top[j] = v[j], indices[j] = id[j];
    } else {
        /* (torch's partial sort: its order of ties is not reproduced here; refused where there are any) */
        unsigned char taken[ROUTE_MAX_EXPERTS];
        memset(taken, 0, (size_t)experts);
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t i = 0; i < experts; i++)
                if (!taken[i] && (best < 0 || p[i] > p[best])) best = i;
            taken[best] = 1;
            top[j] = p[best];
            indices[j] = best;
            if (j > 0 && !(top[j - 1] > top[j])) return 1;
        }
        for (int64_t i = 0; i < experts; i++)
            if (!taken[i] && !(top[k - 1] > p[i])) return 1;
    }
    if (norm) {
        const float s = torch_row_sum(top, k, lanes);
        for (int64_t j = 0; j < k; j++) top[j] = top[j] / s;
    }
    for (int64_t j = 0; j < k; j++) scores[j] = f32_to_bf16(top[j]);
    return 0;
#else
    (void)kernel, (void)order, (void)threads, (void)x, (void)w, (void)experts, (void)cols, (void)k, (void)norm;
    (void)lanes, (void)expf16, (void)logits, (void)scores, (void)indices;
    return -1;
#endif
}

/* ------------------------------------------------------------------ a decode step's weighted sum of its experts
 *
 * out[h] = bf16(sum over s < k, in order, in float32, of bf16(y[rows[s], h] * w[s])): torch's
 * (y.index_select(0, rows) * w.view(k, 1)).view(1, k, cols).sum(1) in bfloat16, bit for bit (its
 * product rounds to bfloat16, its sum over a middle dimension accumulates the k rows in order in
 * float32 from zero). One call instead of four torch operations, each of which, right after the
 * experts' weights have streamed through the caches, costs tens of microseconds. */
static inline float bf16_rounded(float f) { return bf16_to_f32(f32_to_bf16(f)); }

NO_CONTRACT void kinject_weighted_rows_bf16(int64_t k, int64_t cols, const uint16_t *y, const int64_t *rows,
                                            const uint16_t *w, uint16_t *out) {
    int64_t h = 0;
#if defined(__AVX512F__)
    for (; h + 16 <= cols; h += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t s = 0; s < k; s++) {
            const __m512 p = _mm512_mul_ps(bf16x16(y + rows[s] * cols + h), _mm512_set1_ps(bf16_to_f32(w[s])));
            acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_round(p), 16)));
        }
        _mm256_storeu_si256((__m256i *)(out + h), _mm512_cvtepi32_epi16(bf16x16_round(acc)));
    }
#endif
    for (; h < cols; h++) {
        float acc = 0.f;
        for (int64_t s = 0; s < k; s++) acc += bf16_rounded(bf16_to_f32(y[rows[s] * cols + h]) * bf16_to_f32(w[s]));
        out[h] = f32_to_bf16(acc);
    }
}

/* ------------------------------------------------------------------ a decode step's experts whole
 *
 * One token's k routed experts and their weighted sum in one call: ``ids`` (the router's k choices, in
 * slot order) are checked (each < n_experts, all distinct; else -1 and nothing is written), sorted
 * ascending, each expert's pointers taken from the layer's tables (``up`` / ``down`` and their scales, one
 * entry per expert), the fused SwiGLU ``fn`` run on the token broadcast to the k experts (``sig``: its
 * arguments, 0 bfloat16, 1 int8, 2 int4), and kinject_weighted_rows_bf16 sums the outputs in slot order
 * into ``out``: what the one-token path of the interception computes with those two calls, bit for bit,
 * without the Python between them (lists of k pointers, their ctypes arrays, the ids' sort, the k-row
 * buffer), each step of which costs microseconds once the experts' weights have streamed through the
 * caches. */
typedef void (*swiglu_bf16_fn)(int64_t, const void *const *, const void *const *, const int64_t *, int64_t,
                               int64_t, const uint16_t *, int64_t, uint16_t *, uint16_t *, uint16_t *, int, void *);
typedef void (*swiglu_scaled_fn)(int64_t, const void *const *, const uint16_t *const *, const void *const *,
                                 const uint16_t *const *, const int64_t *, int64_t, int64_t, const uint16_t *,
                                 int64_t, uint16_t *, uint16_t *, uint16_t *, int, void *);
typedef void (*swiglu_int4_fn)(int64_t, const void *const *, const uint16_t *const *, const void *const *,
                               const uint16_t *const *, const int64_t *, int64_t, int64_t, const uint16_t *,
                               int64_t, uint16_t *, uint16_t *, uint16_t *, int, void *, int);

#define ONE_TOKEN_MAX_K 64

int kinject_one_token_swiglu(int sig, void *fn, int64_t k, int64_t n_experts, const int64_t *ids,
                             const uint16_t *weights, const void *const *up, const uint16_t *const *s_up,
                             const void *const *down, const uint16_t *const *s_down, int64_t inter,
                             int64_t hidden, const uint16_t *x, uint16_t *out, int threads, void *expf, int wide) {
    if (k < 1 || k > ONE_TOKEN_MAX_K || sig < 0 || sig > 2) return -1;
    int64_t order[ONE_TOKEN_MAX_K], rows[ONE_TOKEN_MAX_K], counts[ONE_TOKEN_MAX_K];
    for (int64_t s = 0; s < k; s++) {
        if (ids[s] < 0 || ids[s] >= n_experts) return -1;
        int64_t j = s;                                   /* insertion sort: k is a handful */
        while (j > 0 && order[j - 1] > ids[s]) order[j] = order[j - 1], j--;
        if (j > 0 && order[j - 1] == ids[s]) return -1;
        order[j] = ids[s];
        counts[s] = 1;
    }
    const void *u[ONE_TOKEN_MAX_K], *d[ONE_TOKEN_MAX_K];
    const uint16_t *su[ONE_TOKEN_MAX_K], *sd[ONE_TOKEN_MAX_K];
    for (int64_t i = 0; i < k; i++) {
        u[i] = up[order[i]], d[i] = down[order[i]];
        su[i] = s_up != NULL ? s_up[order[i]] : NULL, sd[i] = s_down != NULL ? s_down[order[i]] : NULL;
    }
    for (int64_t s = 0; s < k; s++) {
        int64_t i = 0;
        while (order[i] != ids[s]) i++;
        rows[s] = i;
    }
    uint16_t *y = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(k * hidden));
    if (y == NULL) return -2;
    if (sig == 0)
        ((swiglu_bf16_fn)fn)(k, u, d, counts, inter, hidden, x, 0, NULL, NULL, y, threads, expf);
    else if (sig == 1)
        ((swiglu_scaled_fn)fn)(k, u, su, d, sd, counts, inter, hidden, x, 0, NULL, NULL, y, threads, expf);
    else
        ((swiglu_int4_fn)fn)(k, u, su, d, sd, counts, inter, hidden, x, 0, NULL, NULL, y, threads, expf, wide);
    kinject_weighted_rows_bf16(k, hidden, y, rows, weights, out);
    free(y);
    return 0;
}

/* ------------------------------------------------------------------ a decode step's attention
 *
 * One query row per (batch, head) against its key/value head's cached rows, in the arithmetic of
 * torch's CPU flash kernel (scaled_dot_product_attention in bfloat16, a query block of one row):
 * keys in blocks of 512, an online softmax across them (the running sum and output rescaled by
 * exp(old max - new max), each block's p @ v summed from zero and then added); per block, scores
 * q . k in float32 times the scale, their maximum, exp(s - max) as torch's ``fexp_u20`` on whole
 * vectors of ``lanes`` and libm's exp on the tail, their sum in lanes then halved pairwise, each
 * probability rounded to bfloat16; at the end times 1 / sum, rounded to bfloat16. torch computes
 * both products with ``cpublas::gemm``, which in torch's x86 build is the MKL inside its library
 * (``cblas_gemm_bf16bf16f32``: its q . k gives torch's scores bit for bit at every size tried, read
 * off the flash kernel's logsumexp, and with MKL doing both products this kernel gave torch's output
 * everywhere but 1 value in 10^4-10^5). Calling MKL per head costs what torch's kernel costs (90 us at
 * 64 keys), so the products are this kernel's own, in float32: q . k in lanes with a halving tree
 * (scores_in_order; MKL's order agrees on 93 % of random rows, not all), p @ v over the keys in order
 * up to 4096 multiply-adds a block and in pairs of keys with VDPBF16PS beyond, where the build has it
 * (both agree with MKL on values built to cancel under a zero query). Every product of two bfloat16 values is exact in float32,
 * so only the order of the sums differs: on random inputs about one output in 10^4 (10^3 for 1500 keys
 * of 128) is a bfloat16 ulp off torch's, so it runs under ``host_gemv: fast`` only. What it replaces,
 * at batch 1: a dozen library calls and buffers per head, 50-70 us per layer for a few dozen keys,
 * 0.5 ms at 600 and 1.8 ms at 2048. */
#define ATT_BLOCK 512
#define ATT_MAX_LANES 16
#define ATT_SMALL 4096

static inline float fexp_u20_lane(float x) {
    uint32_t umin = 0xc2aeac50u, umax = 0x42b17218u, ulog2e = 0x3fb8aa3bu;
    float fmin, fmax, log2e;
    memcpy(&fmin, &umin, 4); memcpy(&fmax, &umax, 4); memcpy(&log2e, &ulog2e, 4);
    const int below = x < fmin, above = x > fmax;
    float src = x * log2e;
    const float frac = src - floorf(src);
    float r = fmaf(frac, -0.079204240219773236f, -0.22433836478672356f);
    r = fmaf(frac, r, 0.30354260500649682f);
    r = fmaf(frac, r, 0.00010703434948458272f);
    src = src - r;
    int32_t bits = (int32_t)fmaf(8388608.f, src, 8388608.f * 127.f);
    if (below) bits = 0;
    if (above) bits = 0x7f800000;
    float y;
    memcpy(&y, &bits, 4);
    return y;
}

/* lanes halved pairwise to l[0] (lane i plus lane i + h, h = lanes / 2 ... 1): torch's vec_reduce_all */
static inline __attribute__((always_inline)) void halve_lanes(float *l, const int lanes) {
    for (int h = lanes / 2; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) l[i] += l[i + h];
}

/* exp(s - mx) of one block: returns the block's sum, writes the probabilities as bfloat16 */
NO_CONTRACT static float softmax_block(const float *s, int64_t n, float mx, int lanes, int vector_exp,
                                       uint16_t *p) {
    float l[ATT_MAX_LANES] = {0};
    const int64_t full = vector_exp ? n - n % lanes : 0;
    for (int64_t j = 0; j < full; j += lanes)
        for (int i = 0; i < lanes; i++) {
            const float e = fexp_u20_lane(s[j + i] - mx);
            l[i] += e;
            p[j + i] = f32_to_bf16(e);
        }
    halve_lanes(l, lanes);
    float total = vector_exp ? l[0] : 0.f;
    for (int64_t j = full; j < n; j++) {
        const float e = expf(s[j] - mx);
        total += e;
        p[j] = f32_to_bf16(e);
    }
    return total;
}

/* q . k_j for m keys: ``lanes``-wide float32 registers, eight of them over each whole 8 x lanes block
 * of head dims (one multiply-add each, from zero), halved pairwise to one; then one multiply-add per
 * further whole register of dims into it; its lanes halved pairwise to one; then the last dims one by
 * one (torch's own GEMV's shape; MKL, which torch's build uses, agrees on most rows, not all) */
static inline __attribute__((always_inline)) float dot_like_torch(const float *x, const uint16_t *w, int64_t d,
                                                                   const int lanes) {
    float reg[8][ATT_MAX_LANES];
    float acc[ATT_MAX_LANES];
    const int64_t block = 8 * (int64_t)lanes, whole = d - d % block;
    for (int i = 0; i < lanes; i++) acc[i] = 0.f;
    if (whole > 0) {
        for (int r = 0; r < 8; r++)
            for (int i = 0; i < lanes; i++) reg[r][i] = 0.f;
        for (int64_t c = 0; c < whole; c += block)
            for (int r = 0; r < 8; r++)
                for (int i = 0; i < lanes; i++) {
                    const int64_t e = c + r * lanes + i;
                    reg[r][i] = fmaf(x[e], bf16_to_f32(w[e]), reg[r][i]);
                }
        for (int h = 4; h >= 1; h /= 2)
            for (int r = 0; r < h; r++)
                for (int i = 0; i < lanes; i++) reg[r][i] += reg[r + h][i];
        for (int i = 0; i < lanes; i++) acc[i] = reg[0][i];
    }
    const int64_t regs = d - d % lanes;
    for (int64_t c = whole; c < regs; c += lanes)
        for (int i = 0; i < lanes; i++) acc[i] = fmaf(x[c + i], bf16_to_f32(w[c + i]), acc[i]);
    halve_lanes(acc, lanes);
    float sum = acc[0];
    for (int64_t c = regs; c < d; c++) sum = fmaf(x[c], bf16_to_f32(w[c]), sum);
    return sum;
}

NO_CONTRACT static void scores_in_order(const float *qf, const uint16_t *k, int64_t ksn, int64_t m, int64_t d,
                                        int lanes, float *s) {
    if (lanes == 16)                                  /* (a constant width: the compiler keeps it in registers) */
        for (int64_t j = 0; j < m; j++) s[j] = dot_like_torch(qf, k + j * ksn, d, 16);
    else
        for (int64_t j = 0; j < m; j++) s[j] = dot_like_torch(qf, k + j * ksn, d, 8);
}

/* acc[c] = sum over the m keys of p_j * v_j[c] from zero, the keys in order (what torch's MKL gives on
 * values built to cancel; four partial sums over the keys differ) */
NO_CONTRACT static void values_in_order(const uint16_t *p, const uint16_t *v, int64_t vsn, int64_t m, int64_t d,
                                        float *acc) {
    for (int64_t c = 0; c < d; c++) acc[c] = 0.f;
    for (int64_t j = 0; j < m; j++) {
        const float pj = bf16_to_f32(p[j]);
        const uint16_t *vj = v + j * vsn;
        for (int64_t c = 0; c < d; c++) acc[c] = fmaf(bf16_to_f32(vj[c]), pj, acc[c]);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define ATT_PAIRS 1
/* acc[c] = p @ v from zero over pairs of keys with VDPBF16PS (the second key's product first) */
static void values_in_pairs(const uint16_t *p, const uint16_t *v, int64_t vsn, int64_t m, int64_t d, float *acc) {
    int64_t c = 0;
    for (; c < d; c += 16) {
        const __mmask16 live = d - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (d - c)) - 1u);
        __m512 a = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 2 <= m; j += 2) {
            const __m256i v0 = _mm256_maskz_loadu_epi16(live, v + j * vsn + c);
            const __m256i v1 = _mm256_maskz_loadu_epi16(live, v + (j + 1) * vsn + c);
            const __m512i pairs = _mm512_or_si512(_mm512_cvtepu16_epi32(v0),
                                                  _mm512_slli_epi32(_mm512_cvtepu16_epi32(v1), 16));
            const uint32_t pp = (uint32_t)p[j] | ((uint32_t)p[j + 1] << 16);
            a = _mm512_dpbf16_ps(a, (__m512bh)pairs, (__m512bh)_mm512_set1_epi32((int)pp));
        }
        if (j < m) {
            const __m512i pairs = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, v + j * vsn + c));
            a = _mm512_dpbf16_ps(a, (__m512bh)pairs, (__m512bh)_mm512_set1_epi32((int)p[j]));
        }
        _mm512_mask_storeu_ps(acc + c, live, a);
    }
}
#endif

int kinject_attend_pairs(void) {
#if defined(ATT_PAIRS)
    return 1;
#else
    return 0;
#endif
}

NO_CONTRACT static void attend_head(const uint16_t *q, const uint16_t *k, int64_t ksn, const uint16_t *v,
                                    int64_t vsn, int64_t n, int64_t d, float scale, int lanes, int vector_exp,
                                    float *s, uint16_t *p, float *acc, uint16_t *out) {
    float qf[512];
    for (int64_t c = 0; c < d; c++) qf[c] = bf16_to_f32(q[c]);
    float run_max = -INFINITY, run_sum = 0.f;
    for (int64_t c = 0; c < d; c++) acc[c] = 0.f;
    for (int64_t j0 = 0; j0 < n; j0 += ATT_BLOCK) {
        const int64_t m = n - j0 < ATT_BLOCK ? n - j0 : ATT_BLOCK;
        const int pairs = m * d > ATT_SMALL;          /* p @ v in pairs of keys (checked by the caller) */
        scores_in_order(qf, k + j0 * ksn, ksn, m, d, lanes, s);
        float mx = -INFINITY;
        for (int64_t j = 0; j < m; j++) {
            s[j] = s[j] * scale;
            mx = s[j] > mx ? s[j] : mx;
        }
        mx = run_max > mx ? run_max : mx;
        if (mx == -INFINITY) {                        /* (only -inf scores: no key counts) */
            for (int64_t j = 0; j < m; j++) p[j] = 0;
        } else {
            const float part = softmax_block(s, m, mx, lanes, vector_exp, p);
            const float rescale = expf(run_max - mx);
            run_sum = part + rescale * run_sum;
            run_max = mx;
            if (j0 > 0)
                for (int64_t c = 0; c < d; c++) acc[c] = acc[c] * rescale;
        }
        float *part = acc + d;                        /* this block's p @ v, from zero */
#if defined(ATT_PAIRS)
        if (pairs) values_in_pairs(p, v + j0 * vsn, vsn, m, d, part);
        else
#endif
            values_in_order(p, v + j0 * vsn, vsn, m, d, part);
        for (int64_t c = 0; c < d; c++) acc[c] = j0 > 0 ? part[c] + acc[c] : part[c];
    }
    const float inv = 1.f / (run_sum == 0.f ? 1.f : run_sum);
    for (int64_t c = 0; c < d; c++) out[c] = f32_to_bf16(acc[c] * inv);
}

/* q [b, h, 1, d] (strides qsb, qsh; d contiguous), k / v [b, hk, n, d] (strides in elements, d
 * contiguous), out [b, 1, h, d] contiguous; head hh reads key/value head hh / (h / hk). ``lanes``:
 * torch's float vector width (16 AVX-512, 8 AVX2); ``vector_exp`` 0: libm's exp everywhere (torch's
 * scalar build). A build without AVX512-BF16 sums every block's p @ v over the keys in order. Returns
 * 0, or -1 for what it does not take (d over 512, h not a multiple of hk): the caller checks first. */
int kinject_attend_bf16(int64_t b, int64_t h, int64_t hk, int64_t n, int64_t d, const uint16_t *q, int64_t qsb,
                        int64_t qsh, const uint16_t *k, int64_t ksb, int64_t ksh, int64_t ksn, const uint16_t *v,
                        int64_t vsb, int64_t vsh, int64_t vsn, uint16_t *out, float scale, int lanes,
                        int vector_exp, int threads) {
    if (d > 512 || d < 1 || n < 1 || lanes > ATT_MAX_LANES || lanes < 1 || hk < 1 || h % hk) return -1;
    const int64_t group = h / hk, tasks = b * h;
    const int par = threads > 1 && tasks > 1 && tasks * n * d >= 65536;
#pragma omp parallel num_threads(par ? threads : 1)
    {
        const int64_t block = n < ATT_BLOCK ? n : ATT_BLOCK;
        float *s = (float *)malloc(sizeof(float) * (size_t)(block + 2 * d));
        uint16_t *p = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)block);
        float *acc = s + block;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t bi = t / h, hh = t % h, kh = hh / group;
            attend_head(q + bi * qsb + hh * qsh, k + bi * ksb + kh * ksh, ksn, v + bi * vsb + kh * vsh, vsn, n, d,
                        scale, lanes, vector_exp, s, p, acc, out + t * d);
        }
        free(p);
        free(s);
    }
    return 0;
}

int kinject_host_gemv_abi(void) { return 20; }
