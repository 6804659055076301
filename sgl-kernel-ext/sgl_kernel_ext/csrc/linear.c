/* A linear layer at a decode step's few rows: y = x W^T (+ bias), float32, W row-major.
 *
 * Why: at 1-16 rows a decode step's matmuls read every weight once and do little else, and
 * a general GEMM (MKL's sgemm behind torch here) spends more on packing and blocking for
 * large matrices than the step has work: on a 2-core AMD EPYC its 8-row matmuls ran at
 * ~20 GFLOP/s. Here each tile holds up to MR rows of x against NR rows of W in registers
 * and walks the shared dimension once; the W rows of a tile stay in L1 while every row
 * block of x passes over them, so W is read from memory once a call. Vectors are GCC's
 * generic vectors (AVX2 on x86 with -march=native, NEON pairs on ARM); the sum of a tile's
 * lanes is one fixed tree, so a row's result does not depend on the rows beside it.
 */
/* A row's sum must not depend on the rows beside it: no contraction the compiler picks per
 * tile shape (it fused some products and not others); explicit FMA where the CPU has it. */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <string.h>
#if defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));

#define MR 4 /* rows of x a tile holds */
#define NR 3 /* rows of W a tile holds: MR * NR accumulators + NR weights + 1 row of x in 16 registers */
/* One row of x (a batch of one) is bound by reading W: more rows of W in flight at once
 * (6 streams) read it ~20 % faster than 3 and than torch's matrix-vector product. */
#define NR1 6
#define NR_MOST NR1

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8 fma8(v8 a, v8 b, v8 acc) {
#if defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return a * b + acc;
#endif
}

static inline float lanes_sum(v8 s) {
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

/* y[i][j] = x[i] . w[j] for i < mr, j < nr; k8 = k rounded down to 8 (the rest is scalar). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t xs, const int mr, const float *w,
                                                         int64_t k, const int nr, int64_t k8, float *y, int64_t ys) {
    v8 acc[MR][NR_MOST];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = (v8){0};
    for (int64_t c = 0; c < k8; c += 8) {
        v8 wv[NR_MOST];
        for (int j = 0; j < nr; j++) wv[j] = load8(w + j * k + c);
        for (int i = 0; i < mr; i++) {
            const v8 xv = load8(x + i * xs + c);
            for (int j = 0; j < nr; j++) acc[i][j] = fma8(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = lanes_sum(acc[i][j]);
            for (int64_t c = k8; c < k; c++) s += x[i * xs + c] * w[j * k + c];
            y[i * ys + j] = s;
        }
}

/* One column block (nr rows of W) against every row of x, mr = MR at a time; each call
 * names its shape with constants so the compiler keeps the accumulators in registers. */
static void column_block(const float *x, int64_t xs, int64_t m, const float *w, int64_t k, int nr, float *y,
                         int64_t ys) {
    const int64_t k8 = k - k % 8;
    int64_t r = 0;
    for (; r + MR <= m; r += MR) {
        if (nr == NR) tile(x + r * xs, xs, MR, w, k, NR, k8, y + r * ys, ys);
        else if (nr == 2) tile(x + r * xs, xs, MR, w, k, 2, k8, y + r * ys, ys);
        else tile(x + r * xs, xs, MR, w, k, 1, k8, y + r * ys, ys);
    }
    for (; r < m; r++) { /* 1 to MR - 1 rows left: one at a time */
        if (nr == NR) tile(x + r * xs, xs, 1, w, k, NR, k8, y + r * ys, ys);
        else if (nr == 2) tile(x + r * xs, xs, 1, w, k, 2, k8, y + r * ys, ys);
        else tile(x + r * xs, xs, 1, w, k, 1, k8, y + r * ys, ys);
    }
}

/* One row of x against nr <= NR1 rows of W (constants again, one case each). */
static void single_row(const float *x, const float *w, int64_t k, int nr, float *y) {
    const int64_t k8 = k - k % 8;
    switch (nr) {
        case 6: tile(x, 0, 1, w, k, 6, k8, y, 0); break;
        case 5: tile(x, 0, 1, w, k, 5, k8, y, 0); break;
        case 4: tile(x, 0, 1, w, k, 4, k8, y, 0); break;
        case 3: tile(x, 0, 1, w, k, 3, k8, y, 0); break;
        case 2: tile(x, 0, 1, w, k, 2, k8, y, 0); break;
        default: tile(x, 0, 1, w, k, 1, k8, y, 0); break;
    }
}

/* y[m][n] = sum_c x[m][c] w[n][c] (+ bias[n]). x: m rows of k (row stride xs), w: n rows of k,
 * contiguous; y: m rows of n (row stride ys); bias may be NULL. Returns 0, or -1 on a bad
 * shape (nothing written). */
int sgl_linear_f32(const float *x, int64_t xs, int64_t m, const float *w, int64_t k, int64_t n, const float *bias,
                   float *y, int64_t ys, int threads) {
    if (m < 0 || k < 1 || n < 0 || xs < k || ys < n) return -1;
    /* Each (row, output) sum is the same FMAs in the same order whatever tile computes it. */
    const int width = m == 1 ? NR1 : NR;
    const int64_t blocks = (n + width - 1) / width;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * width;
        const int nr = n - n0 < width ? (int)(n - n0) : width;
        if (m == 1) single_row(x, w + n0 * k, k, nr, y + n0);
        else column_block(x, xs, m, w + n0 * k, k, nr, y + n0, ys);
        if (bias)
            for (int64_t r = 0; r < m; r++)
                for (int j = 0; j < nr; j++) y[r * ys + n0 + j] += bias[n0 + j];
    }
    return 0;
}
