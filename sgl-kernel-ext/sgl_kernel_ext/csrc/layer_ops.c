/* A decoder layer's small ops on the CPU, one call each: RMSNorm (with the residual
 * add before it), rotary position embedding applied in place, and the KV write.
 *
 * Why: in torch each is 2-20 tensor ops, and at a decode step's few rows every op costs
 * its dispatch, not its arithmetic (~40 us a norm, ~120 us a rotary against ~2-5 us of
 * work). Norm and rotary: row-major float32 only; the Python side keeps torch's path for
 * anything else.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* out[r] = norm(src[r]) * weight, src = x (+ residual, the sum written to residual_out).
 * Strides are in elements between rows; the last dimension is contiguous. out may be x
 * and residual_out residual (in place): each row is read before it is written. */
int sgl_rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *residual_out,
                     int64_t rows, int64_t hidden, int64_t x_stride, int64_t r_stride, int64_t o_stride,
                     int64_t ro_stride, float eps) {
    if (rows < 0 || hidden < 1) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *orow = out + r * o_stride;
        const float *src = xr;
        float sum = 0.0f;
        if (residual) {
            const float *rr = residual + r * r_stride;
            float *sr = residual_out + r * ro_stride;
            for (int64_t i = 0; i < hidden; i++) {
                const float v = xr[i] + rr[i];
                sr[i] = v;
                sum += v * v;
            }
            src = sr;
        } else {
            for (int64_t i = 0; i < hidden; i++) sum += xr[i] * xr[i];
        }
        const float scale = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++) orow[i] = src[i] * scale * weight[i];
    }
    return 0;
}

/* Rotates the first rotary_dim of every head of one row in place. cos and sin hold
 * rotary_dim / 2 values. neox: pairs (i, i + half); else interleaved (2i, 2i + 1). */
static inline void rotate_heads(float *row, int64_t heads, int64_t head_size, int64_t rotary_dim,
                                const float *cos, const float *sin, int neox) {
    const int64_t half = rotary_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x = row + h * head_size;
        if (neox) {
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * cos[i] - b * sin[i];
                x[i + half] = b * cos[i] + a * sin[i];
            }
        } else {
            for (int64_t i = 0; i < half; i++) {
                const float a = x[2 * i], b = x[2 * i + 1];
                x[2 * i] = a * cos[i] - b * sin[i];
                x[2 * i + 1] = b * cos[i] + a * sin[i];
            }
        }
    }
}

/* Rotary embedding of q and k in place: token t takes row positions[t] of cos_sin
 * ([max_position, rotary_dim], cos then sin). A position outside the cache: -2, and
 * nothing is written past the positions checked so far (they are checked first). */
int sgl_rotary_f32(const int64_t *positions, float *q, float *k, const float *cos_sin, int64_t tokens,
                   int64_t q_heads, int64_t k_heads, int64_t head_size, int64_t rotary_dim, int64_t q_stride,
                   int64_t k_stride, int64_t max_position, int neox) {
    if (tokens < 0 || rotary_dim < 2 || rotary_dim % 2 || rotary_dim > head_size) return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return -2;
    const int64_t half = rotary_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *cos = cos_sin + positions[t] * rotary_dim;
        rotate_heads(q + t * q_stride, q_heads, head_size, rotary_dim, cos, cos + half, neox);
        rotate_heads(k + t * k_stride, k_heads, head_size, rotary_dim, cos, cos + half, neox);
    }
    return 0;
}

/* A step's new K and V rows into their pool slots: row i of k (v) goes to slot loc[i] of
 * k_pool (v_pool), row_bytes each; src strides in bytes. A slot outside the pool: -2,
 * and nothing is written (the slots are checked first). */
int sgl_store_kv(const char *k, const char *v, char *k_pool, char *v_pool, const int64_t *loc, int64_t n,
                 int64_t k_row_bytes, int64_t v_row_bytes, int64_t k_stride, int64_t v_stride, int64_t slots) {
    if (n < 0 || k_row_bytes < 1 || v_row_bytes < 1) return -1;
    for (int64_t i = 0; i < n; i++)
        if (loc[i] < 0 || loc[i] >= slots) return -2;
    for (int64_t i = 0; i < n; i++) {
        memcpy(k_pool + loc[i] * k_row_bytes, k + i * k_stride, (size_t)k_row_bytes);
        memcpy(v_pool + loc[i] * v_row_bytes, v + i * v_stride, (size_t)v_row_bytes);
    }
    return 0;
}
