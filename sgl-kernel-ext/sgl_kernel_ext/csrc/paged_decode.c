/* Decode attention over page lists with per-page attention mass, for CPUs.
 *
 * The contract of sgl_kernel_ext.decode_importance_paged (see paged.py), read
 * straight from the KV pool: no gathered copy of the context, no float32 copy of
 * a bf16/f16 pool, one pass over K and V. Work items are (request, split of its
 * page list); each keeps an online softmax over its pages and records, per
 * page and query head, the page's logit maximum and its sum of exp(logit - max).
 * A merge pass then combines the splits, and each page's mass follows from its
 * (max, sum) and the final (max, denominator) without touching the page again.
 *
 * Threads: OpenMP, the runtime torch itself loads (libgomp), so the two share
 * one pool; the caller passes torch's thread count.
 *
 * A split is a fixed number of a request's listed pages (split_pages), never a share of the
 * batch's longest list (the caller passes both and sized the split buffers by splits): a request's sums run in the same order whatever its batch, so it
 * decodes alike alone and beside others (the merge skips a split with no page).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

/* e^x for x <= 0 to float32 rounding (Taylor degree 7 of 2^f on |f| <= 1/2,
 * relative error < 1e-8 before rounding). Plain arithmetic, so loops over it
 * vectorise, unlike libm's expf. Below -87 the result is flushed to 0. */
static inline __attribute__((always_inline)) float exp_nonpos(float x) {
    float c = x < -87.0f ? -87.0f : x;
    float t = c * 1.44269504088896341f;
    float n = __builtin_rintf(t); /* nearest; an add-and-subtract trick would not survive -fassociative-math */
    float f = (t - n) * 0.693147180559945309f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720 + f * (1.0f / 5040)))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : p * scale;
}

/* `n` elements of a pool of `dtype` from `offset`, as float32: the pool itself when
 * it is float32, else converted into `tile`. */
static inline __attribute__((always_inline)) const float *page_f32(const void *base, int dtype, int64_t offset,
                                                                     int64_t n, float *tile) {
    if (dtype == DT_F32) return (const float *)base + offset;
    if (dtype == DT_BF16) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)p[i] << 16;
            memcpy(&tile[i], &u, 4);
        }
    } else {
        const _Float16 *p = (const _Float16 *)base + offset;
        for (int64_t i = 0; i < n; i++) tile[i] = (float)p[i];
    }
    return tile;
}

/* `n` token rows of `row` elements of a pool not in float32, `stride` elements apart from
 * `offset` (a staging page's tokens may lie apart: a host pool's layer view in SGLang's
 * page_first layout, every layer of a token together), converted into `tile` side by side.
 * A float32 page is never converted: it is read where it lies. */
static inline __attribute__((always_inline)) const float *rows_f32(const void *base, int dtype, int64_t offset,
                                                                     int64_t n, int64_t row, int64_t stride,
                                                                     float *tile) {
    if (stride == row) return page_f32(base, dtype, offset, n * row, tile);
    for (int64_t t = 0; t < n; t++) page_f32(base, dtype, offset + t * stride, row, tile + t * row);
    return tile;
}

/* Tokens of one online-softmax update: pages join a block whole while it has room, so
 * small pages (SGLang's default page of 1 token) share the update and its rescale of
 * the running sums instead of paying them per token. */
#ifndef BLOCK_TOKENS
#define BLOCK_TOKENS 32
#endif
/* Partial sums of a block's weighted V rows, token t in sum t % VSUMS: one chain of adds
 * would wait on each add's latency, and a fixed split keeps every sum the same steps
 * wherever the block's pages lie. */
#define VSUMS 2

typedef struct {
    const float *q;        /* [bs, kv, group, d], rows q_stride floats apart; times sm_scale here */
    int64_t q_stride;
    float sm_scale;
    const void *k_pool;    /* [num_pages, page_size, kv, d] */
    const void *v_pool;    /* [num_pages, page_size, kv, dv] */
    const void *k_extra;   /* [extra_pages, page_size, kv, d] or NULL: rows of kv * d adjacent, */
    const void *v_extra;   /* tokens and pages at the strides below (elements) */
    int64_t xk_page, xk_tok, xv_page, xv_tok;
    const int64_t *table;  /* [bs, max_pages] page ids; >= num_pages: extra page */
    const int64_t *tokens; /* [bs, max_pages] valid tokens per listed page */
    int64_t num_pages, bs, max_pages, page_size, kv, group, d, dv;
    int dtype, split_pages, splits, importance;
    float logit_cap;
    float *page_max;   /* [bs, kv, max_pages, group]: the logit each page's sum is taken from */
    float *page_sum;   /* [bs, kv, max_pages, group]; both NULL without importance */
    float *split_max;  /* [bs, kv, splits, group] */
    float *split_sum;  /* [bs, kv, splits, group] */
    float *split_acc;  /* [bs, kv, splits, group, dv] */
} Args;

/* One split of request b's page list, every KV head at once: a token's K (and V)
 * row holds all its KV heads side by side, so each row is read once, in order.
 * (Items per KV head would read every row once per head; past the last-level
 * cache that is once from memory per head.) Pages are taken in blocks of up to
 * BLOCK_TOKENS tokens (a larger page is a block of its own); a block's logits share
 * one maximum, and with importance each page of it records that maximum and the sum
 * of its own tokens' exp(logit - maximum), which is all its mass needs. Inlined into
 * copies with G, D and DV fixed at compile time for the common shapes, so the
 * compiler unrolls the dot products and keeps each head's sums in registers. With
 * IMP a compile-time 0, the importance code is not there at all. */
static inline __attribute__((always_inline)) void run_split_shape(const Args *a, int64_t b, int64_t s, const int64_t G,
                                                                   const int64_t D, const int64_t DV, const int IMP) {
    const int64_t P = a->page_size, KV = a->kv, MP = a->max_pages;
    const int64_t BT = P > BLOCK_TOKENS ? P : BLOCK_TOKENS;
    const int64_t per = a->split_pages;
    const int64_t j0 = s * per, j1 = j0 + per < MP ? j0 + per : MP;
    /* The request's query, scaled once here rather than by the caller (one torch op a
     * layer, which at a short step costs more than this loop). */
    float q[KV * G * D];
    for (int64_t x = 0; x < KV * G * D; x++) q[x] = a->q[b * a->q_stride + x] * a->sm_scale;
    /* Pages read through a tile: a pool not in float32 (converted). A float32 page is read where
     * it lies, staging pages whose tokens lie apart too (a K run and a V row per token). */
    const int tiled = a->dtype != DT_F32;
    float M[KV * G], L[KV * G], beta[KV * G], acc[KV * G * DV], logit[KV * G * BT];
    float ktile[tiled ? BT * KV * D : 1], vtile[tiled ? BT * KV * DV : 1];
    /* Per run of the block (pages whose K rows follow one another in memory, read as one: a
     * request's consecutive slots of 1-token pages, a converted tile): its K rows, tokens and
     * first token in the block. Per token: its V row. Per page: tokens, first token, column. */
    const float *rk[BT], *vrow[BT];
    int64_t rn[BT], rfirst[BT], pn[BT], first[BT], page_of[BT];
    for (int64_t x = 0; x < KV * G; x++) M[x] = -INFINITY, L[x] = 0.0f;
    memset(acc, 0, sizeof(float) * KV * G * DV);
    int64_t j = j0;
    while (j < j1) {
        int64_t n_tok = 0, n_pages = 0, n_runs = 0;
        for (; j < j1; j++) {
            const int64_t col = b * MP + j, n = a->tokens[col];
            if (n <= 0) {
                if (IMP)
                    for (int64_t h = 0; h < KV; h++)
                        for (int64_t g = 0; g < G; g++) {
                            const int64_t at = ((b * KV + h) * MP + j) * G + g;
                            a->page_max[at] = -INFINITY, a->page_sum[at] = 0.0f;
                        }
                continue;
            }
            if (n_tok + n > BT) break;
            int64_t id = a->table[col];
            const void *kb = a->k_pool, *vb = a->v_pool;
            int64_t ko = id * P * KV * D, vo = id * P * KV * DV, kt = KV * D, vt = KV * DV;
            if (id >= a->num_pages) {
                id -= a->num_pages, kb = a->k_extra, vb = a->v_extra;
                ko = id * a->xk_page, vo = id * a->xv_page, kt = a->xk_tok, vt = a->xv_tok;
            }
            const float *k0, *v0;
            if (tiled) { /* converted into the tile: its rows side by side */
                k0 = rows_f32(kb, a->dtype, ko, n, KV * D, kt, ktile + n_tok * KV * D), kt = KV * D;
                v0 = rows_f32(vb, a->dtype, vo, n, KV * DV, vt, vtile + n_tok * KV * DV), vt = KV * DV;
            } else {
                k0 = (const float *)kb + ko, v0 = (const float *)vb + vo;
            }
            /* Each token's K row joins the run it follows in memory (a page's, a request's
             * consecutive 1-token pages'), else starts one; each token's V row on its own, not
             * a run's: the sums below then take the same steps wherever the pages lie (a loop per
             * run let the compiler group a long run's tokens otherwise than short ones', so a page
             * moved to another slot changed the output's last bits). */
            for (int64_t t = 0; t < n; t++) {
                const float *kr = k0 + t * kt;
                const int64_t last = n_runs - 1;
                if (n_runs && kr == rk[last] + rn[last] * KV * D) {
                    rn[last]++;
                } else {
                    rk[n_runs] = kr, rn[n_runs] = 1, rfirst[n_runs] = n_tok + t, n_runs++;
                }
                vrow[n_tok + t] = v0 + t * vt;
            }
            pn[n_pages] = n, first[n_pages] = n_tok, page_of[n_pages] = j, n_pages++;
            n_tok += n;
        }
        if (n_tok == 0) continue;
        for (int64_t u = 0; u < n_runs; u++) {
            const float *kp = rk[u];
            const int64_t n = rn[u], t0 = rfirst[u];
            for (int64_t t = 0; t < n; t++) {
                const float *krow = kp + t * KV * D;
                for (int64_t h = 0; h < KV; h++) {
                    const float *k = krow + h * D;
                    for (int64_t g = 0; g < G; g++) {
                        const float *qg = q + (h * G + g) * D;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t i = 0; i < D; i++) dot += qg[i] * k[i];
                        if (a->logit_cap > 0.0f) dot = a->logit_cap * tanhf(dot / a->logit_cap);
                        logit[(h * G + g) * BT + t0 + t] = dot;
                    }
                }
            }
        }
        for (int64_t x = 0; x < KV * G; x++) {
            float *lg = logit + x * BT;
            float m = lg[0];
            for (int64_t t = 1; t < n_tok; t++) m = lg[t] > m ? lg[t] : m;
            float l = 0.0f;
#pragma omp simd reduction(+ : l)
            for (int64_t t = 0; t < n_tok; t++) {
                lg[t] = exp_nonpos(lg[t] - m);
                l += lg[t];
            }
            if (IMP) {
                const int64_t h = x / G, g = x % G;
                for (int64_t p = 0; p < n_pages; p++) {
                    float ps = 0.0f;
                    for (int64_t t = first[p]; t < first[p] + pn[p]; t++) ps += lg[t];
                    const int64_t at = ((b * KV + h) * MP + page_of[p]) * G + g;
                    a->page_max[at] = m, a->page_sum[at] = ps;
                }
            }
            if (m > M[x]) { /* rescale what this split has so far to the new maximum */
                const float alpha = M[x] == -INFINITY ? 0.0f : exp_nonpos(M[x] - m);
                L[x] *= alpha;
                for (int64_t i = 0; i < DV; i++) acc[x * DV + i] *= alpha;
                M[x] = m;
                beta[x] = 1.0f;
            } else {
                beta[x] = exp_nonpos(m - M[x]);
            }
            L[x] += beta[x] * l;
        }
        /* Per query head, the block's tokens in turn into VSUMS sums of DV, kept in registers,
         * met in a fixed order at the block's end. */
        for (int64_t x = 0; x < KV * G; x++) {
            const float *w = logit + x * BT;
            const int64_t head = (x / G) * DV;
            float r[VSUMS][DV];
            for (int64_t i = 0; i < DV; i++) r[0][i] = acc[x * DV + i];
            for (int64_t c = 1; c < VSUMS; c++)
                for (int64_t i = 0; i < DV; i++) r[c][i] = 0.0f;
            int64_t t = 0;
            for (; t + VSUMS <= n_tok; t += VSUMS)
                for (int64_t c = 0; c < VSUMS; c++) {
                    const float wt = beta[x] * w[t + c], *v = vrow[t + c] + head;
#pragma omp simd
                    for (int64_t i = 0; i < DV; i++) r[c][i] += wt * v[i];
                }
            for (int64_t c = 0; t < n_tok; t++, c++) {
                const float wt = beta[x] * w[t], *v = vrow[t] + head;
#pragma omp simd
                for (int64_t i = 0; i < DV; i++) r[c][i] += wt * v[i];
            }
            for (int64_t i = 0; i < DV; i++) {
                float sum = r[0][i];
                for (int64_t c = 1; c < VSUMS; c++) sum += r[c][i];
                acc[x * DV + i] = sum;
            }
        }
    }
    for (int64_t h = 0; h < KV; h++) {
        const int64_t base = ((b * KV + h) * a->splits + s) * G;
        for (int64_t g = 0; g < G; g++) a->split_max[base + g] = M[h * G + g], a->split_sum[base + g] = L[h * G + g];
        memcpy(a->split_acc + base * DV, acc + h * G * DV, sizeof(float) * G * DV);
    }
}

/* Every shape's copy, for importance on (IMP 1) or off (IMP 0). Each is a function of its
 * own, optimised alone, so the importance-off decode is the same code whether or not the
 * build also holds the importance one (-DSGL_PAGED_DECODE_NO_IMPORTANCE holds only it: the
 * baseline the importance-off path is measured against). */
#define SHAPE(g, d, IMPV) \
    if (G == g && D == d && DV == d) return run_split_shape(a, b, s, g, d, d, IMPV);
#define SHAPES(d, IMPV)                                                                                             \
    SHAPE(1, d, IMPV) SHAPE(2, d, IMPV) SHAPE(3, d, IMPV) SHAPE(4, d, IMPV) SHAPE(5, d, IMPV) SHAPE(6, d, IMPV) \
    SHAPE(7, d, IMPV) SHAPE(8, d, IMPV)
#define DISPATCH(IMPV)                                     \
    const int64_t G = a->group, D = a->d, DV = a->dv;      \
    SHAPES(64, IMPV)                                       \
    SHAPES(128, IMPV)                                      \
    run_split_shape(a, b, s, G, D, DV, IMPV); /* any other shape, not unrolled */

static __attribute__((noinline)) void run_split_off(const Args *a, int64_t b, int64_t s) { DISPATCH(0) }
#ifndef SGL_PAGED_DECODE_NO_IMPORTANCE
static __attribute__((noinline)) void run_split_on(const Args *a, int64_t b, int64_t s) { DISPATCH(1) }
#endif
#undef DISPATCH
#undef SHAPES
#undef SHAPE

static void run_split(const Args *a, int64_t b, int64_t s) {
#ifndef SGL_PAGED_DECODE_NO_IMPORTANCE
    if (a->importance) return run_split_on(a, b, s);
#endif
    run_split_off(a, b, s);
}

/* Combine the splits of (b, h): output, lse and (with importance) the masses of its pages. */
static void merge(const Args *a, int64_t b, int64_t h, const float *sinks, const uint8_t *live, float *out,
                  float *lse, float *mass) {
    const int64_t G = a->group, DV = a->dv, KV = a->kv, S = a->splits, MP = a->max_pages;
    for (int64_t g = 0; g < G; g++) {
        const int64_t qh = h * G + g;
        float *o = out + (b * KV * G + qh) * DV;
        if (!live[b]) {
            memset(o, 0, sizeof(float) * DV);
            lse[b * KV * G + qh] = 0.0f;
            continue;
        }
        const int64_t base = (b * KV + h) * S * G;
        float peak = sinks ? sinks[qh] : -INFINITY;
        for (int64_t s = 0; s < S; s++) peak = a->split_max[base + s * G + g] > peak ? a->split_max[base + s * G + g] : peak;
        float denom = sinks ? exp_nonpos(sinks[qh] - peak) : 0.0f;
        memset(o, 0, sizeof(float) * DV);
        for (int64_t s = 0; s < S; s++) {
            const float m = a->split_max[base + s * G + g];
            if (m == -INFINITY) continue;
            const float w = exp_nonpos(m - peak);
            denom += w * a->split_sum[base + s * G + g];
            const float *acc = a->split_acc + (base + s * G + g) * DV;
            for (int64_t i = 0; i < DV; i++) o[i] += w * acc[i];
        }
        const float inv = 1.0f / denom;
        for (int64_t i = 0; i < DV; i++) o[i] *= inv;
        lse[b * KV * G + qh] = peak + logf(denom);
        if (!a->importance) continue;
        /* mass[b, j, h] is the mean over the group of each head's share */
        const float *pmax = a->page_max + (b * KV + h) * MP * G;
        const float *psum = a->page_sum + (b * KV + h) * MP * G;
        for (int64_t j = 0; j < MP; j++) {
            const float m = pmax[j * G + g];
            const float share = m == -INFINITY ? 0.0f : exp_nonpos(m - peak) * psum[j * G + g] * inv;
            mass[(b * MP + j) * KV + h] += share / (float)G;
        }
    }
}

/* Returns 0; -1 for arguments it cannot serve, -2 when a listed page with tokens
 * is outside the pool and the staging pages. */
int sgl_paged_decode(const float *q, int64_t q_stride, float sm_scale, const void *k_pool, const void *v_pool, const void *k_extra, const void *v_extra,
                     const int64_t *table, const int64_t *tokens, const uint8_t *live, const float *sinks,
                     int64_t num_pages, int64_t extra_pages, int64_t xk_page, int64_t xk_tok, int64_t xv_page,
                     int64_t xv_tok, int64_t bs, int64_t max_pages, int64_t page_size, int64_t kv, int64_t group,
                     int64_t d, int64_t dv, int dtype, int split_pages, int splits, float logit_cap, int importance, float *page_max,
                     float *page_sum, float *split_max, float *split_sum, float *split_acc, float *out, float *lse,
                     float *mass, int threads) {
#ifdef SGL_PAGED_DECODE_NO_IMPORTANCE
    if (importance) return -1; /* this build has no importance code */
#endif
    if (dtype < DT_F32 || dtype > DT_F16 || split_pages < 1 || page_size < 1 || group < 1) return -1;
    /* The caller sized the split buffers by splits: they must cover the longest list. */
    if (splits < 1 || (int64_t)splits * split_pages < max_pages) return -1;
    if (importance && (!page_max || !page_sum || !mass)) return -1;
    for (int64_t c = 0; c < bs * max_pages; c++)
        if (tokens[c] > 0 && (table[c] < 0 || table[c] >= num_pages + (k_extra ? extra_pages : 0) || tokens[c] > page_size))
            return -2;
    if (k_extra && (xk_tok < kv * d || xv_tok < kv * dv || xk_page < 1 || xv_page < 1)) return -1;
    Args a = {q, q_stride, sm_scale, k_pool, v_pool, k_extra, v_extra, xk_page, xk_tok, xv_page, xv_tok, table, tokens, num_pages, bs, max_pages, page_size, kv, group, d, dv,
              dtype, split_pages, splits, importance, logit_cap, page_max, page_sum, split_max, split_sum, split_acc};
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t it = 0; it < bs * splits; it++) run_split(&a, it / splits, it % splits);
    if (importance) memset(mass, 0, sizeof(float) * bs * max_pages * kv);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t it = 0; it < bs * kv; it++) merge(&a, it / kv, it % kv, sinks, live, out, lse, mass);
    return 0;
}

/* The hot set's guard: each listed page's estimated log-mass from its 4-bit key codes.
 *
 * For KV head h, request r and listed page c (code row ids[r, c] of this layer's codes,
 * [kv, rows, page_size, d / 2] at byte strides stride_h and stride_r, tokens d / 2 bytes
 * apart; channel j in the low nibble and j + d/2 in the high one), every token's logit is estimated as q . (low + code * step), soft-
 * capped, and lse[h, r, c, :] = log sum_t exp(logit) per query head of the group;
 * err[h, r, c, :] = sum_j |q_j| step_j / 2 + sum_j |q_j| * max|key| * margin bounds
 * every token's logit error. Reads d / 2 bytes per token: no float copy of the keys.
 * q is scaled by sm_scale already; low and step are float32 [n, listed, kv, d]. */
#define KC_PAGE 256  // the most tokens a page holds for sgl_key_code_pages

int sgl_key_code_pages(const float *q, const uint8_t *codes, const int64_t *ids, const float *low,
                       const float *step, const uint8_t *valid, int64_t kv, int64_t n, int64_t g, int64_t d,
                       int64_t listed, int64_t page_size, int64_t stride_h, int64_t stride_r, float logit_cap,
                       float margin, float *lse, float *err, int threads) {
    if (g > 16 || d > 256 || (d & 1) || page_size > KC_PAGE) return -1;
    const int64_t half = d / 2, items = kv * n * listed;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const int64_t h = it / (n * listed), r = (it / listed) % n, c = it % listed;
        float *lse_out = lse + it * g, *err_out = err + it * g;
        if (!valid[r * listed + c]) {
            for (int64_t i = 0; i < g; i++) {
                lse_out[i] = -INFINITY;
                err_out[i] = 0.0f;
            }
            continue;
        }
        const float *qh = q + (h * n + r) * g * d;
        const float *lo = low + ((r * listed + c) * kv + h) * d;
        const float *st = step + ((r * listed + c) * kv + h) * d;
        const uint8_t *cp = codes + h * stride_h + ids[r * listed + c] * stride_r;
        float qs[16][256], base[16], m[16], cf[256], xs[16][KC_PAGE];
        float mag = 0.0f;
        for (int64_t j = 0; j < d; j++) {
            float a = fabsf(lo[j]), b = fabsf(lo[j] + 15.0f * st[j]);
            mag = fmaxf(mag, fmaxf(a, b));
        }
        for (int64_t i = 0; i < g; i++) {
            float b = 0.0f, e = 0.0f, a = 0.0f;
            for (int64_t j = 0; j < d; j++) {
                float x = qh[i * d + j];
                qs[i][j] = x * st[j];
                b += x * lo[j];
                e += fabsf(x) * st[j];
                a += fabsf(x);
            }
            base[i] = b;
            err_out[i] = 0.5f * e + a * mag * margin;
            m[i] = -INFINITY;
        }
        for (int64_t t = 0; t < page_size; t++) {
            const uint8_t *ct = cp + t * half;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                cf[j] = (float)(ct[j] & 15);
                cf[j + half] = (float)(ct[j] >> 4);
            }
            for (int64_t i = 0; i < g; i++) {
                // A vector reduction (its order differs from a serial sum by float32
                // rounding, inside the margin).
                float x = 0.0f;
                const float *qi = qs[i];
#pragma omp simd reduction(+ : x)
                for (int64_t j = 0; j < d; j++) x += qi[j] * cf[j];
                x += base[i];
                if (logit_cap > 0.0f) x = logit_cap * tanhf(x / logit_cap);
                xs[i][t] = x;
                m[i] = fmaxf(m[i], x);
            }
        }
        // The page's log-sum-exp per head in one vector pass (exp vectorised) rather than
        // an online update per token.
        for (int64_t i = 0; i < g; i++) {
            const float top = m[i], *xi = xs[i];
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < page_size; t++) sum += expf(xi[t] - top);
            lse_out[i] = top + logf(sum);
        }
    }
    return 0;
}
