/* Two-pass weight loader: validate + size, then one backend allocation carved into tensors. */
#include "model/model_impl.h"

#include <stdio.h>
#include <string.h>

#define ERR(...) do { if (w->err && w->errlen) snprintf(w->err, w->errlen, __VA_ARGS__); } while (0)

void *prism_wload_reserve(prism_wload_t *w, size_t bytes)
{
    size_t o = PRISM_ALIGN_UP(w->off, PRISM_TENSOR_ALIGN);
    w->off = o + bytes;
    return w->base ? w->base + o : NULL;
}

void *prism_wload_reserve_matmul(prism_wload_t *w, int64_t N, int64_t K)
{
    const prism_backend_i *o = &w->be->i;
    size_t plain = (size_t)(N * K) * prism_dtype_size(w->be->weight_dtype);
    size_t own = o->weight_pack_bytes && N <= INT32_MAX && K <= INT32_MAX ? o->weight_pack_bytes(w->be->ctx, (int)N, (int)K) : 0;
    return prism_wload_reserve(w, PRISM_MAX(plain, own));
}

int prism_wload_pack_matmul(prism_wload_t *w, void *dst, int64_t N, int64_t K)
{
    const prism_backend_i *o = &w->be->i;
    if (!w->base || !o->weight_pack) return PRISM_OK;
    int rc = o->weight_pack(w->be->ctx, dst, (int)N, (int)K);
    if (rc == PRISM_OK && o->weight_pack_bytes && o->weight_pack_bytes(w->be->ctx, (int)N, (int)K)) w->n_packed++;
    if (rc != PRISM_OK) ERR("weights: packing a %lld x %lld matmul weight failed: %s", (long long)N, (long long)K, prism_strerror(rc));
    return rc;
}

static uint64_t name_hash(const char *s, uint64_t seed)
{
    uint64_t h = 1469598103934665603ull ^ seed;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* Random weights: norms 1, biases 0, everything else std 0.02 from a per-tensor counter-based
 * stream (prism_random_normalish keyed by the tensor's name), so a tensor's values depend neither
 * on load order nor on the backend: a device with fill_random makes them in place, any other
 * backend gets the same values computed here. */
static uint64_t random_seed_of(const prism_wload_t *w, const char *name) { return name_hash(name, w->seed); }

static int fill_random(prism_wload_t *w, void *dst, prism_dtype_t dt, const char *name, int64_t numel)
{
    if (!w->base) return PRISM_OK;
    size_t len = strlen(name), esz = prism_dtype_size(dt);
    bool bias = len >= 4 && !strcmp(name + len - 4, "bias");
    bool norm = !bias && (strstr(name, "norm") || strstr(name, "layrnorm"));
    uint64_t seed = random_seed_of(w, name);
    const prism_backend_i *o = &w->be->i;
    if (!bias && !norm && o->fill_random) {
        int rc = o->fill_random(w->be->ctx, dst, dt, (size_t)numel, seed, 0.02f);
        if (rc != PRISM_OK) return rc;
    } else {
        for (int64_t off = 0; off < numel; off += (int64_t)w->staging_n) {
            int64_t n = PRISM_MIN((int64_t)w->staging_n, numel - off);
            for (int64_t i = 0; i < n; i++)
                w->staging[i] = bias ? 0.0f : norm ? 1.0f : 0.02f * prism_random_normalish(seed, (uint64_t)(off + i));
            int rc = o->upload_convert(w->be->ctx, (uint8_t *)dst + (size_t)off * esz, dt, w->staging, (size_t)n);
            if (rc != PRISM_OK) return rc;
        }
    }
    w->loaded_bytes += (size_t)numel * esz;
    w->n_tensors++;
    return PRISM_OK;
}

/* Finds `name` and checks its dtype and shape (numel when ndim < 0). */
static int find_checked(prism_wload_t *w, const char *name, int ndim, const int64_t *shape, const prism_st_tensor_t **out)
{
    const prism_st_tensor_t *t = prism_st_find(w->st, name);
    if (!t) {
        ERR("weights: tensor '%s' not found", name);
        return PRISM_ENOTFOUND;
    }
    if (t->dtype != PRISM_ST_F32 && t->dtype != PRISM_ST_BF16 && t->dtype != PRISM_ST_F16) {
        ERR("weights: tensor '%s' has an unsupported dtype", name);
        return PRISM_ENOTSUP;
    }
    bool ok = true;
    if (ndim < 0) {
        ok = t->numel == shape[0];
    } else {
        ok = t->ndim == ndim;
        for (int d = 0; ok && d < ndim; d++) ok = t->shape[d] == shape[d];
    }
    if (!ok) {
        char have[128] = "", want[128] = "";
        for (int d = 0; d < t->ndim; d++)
            snprintf(have + strlen(have), sizeof have - strlen(have), "%s%lld", d ? "," : "", (long long)t->shape[d]);
        for (int d = 0; d < (ndim < 0 ? 1 : ndim); d++)
            snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", d ? "," : "", (long long)shape[d]);
        ERR("weights: tensor '%s' has shape [%s], expected [%s]", name, have, want);
        return PRISM_ECORRUPT;
    }
    *out = t;
    return PRISM_OK;
}

static void log_progress(prism_wload_t *w)
{
    if (w->loaded_bytes >= w->next_log) {
        char a[32], b[32];
        PRISM_INFO("loading weights: %s / %s", prism_fmt_bytes(w->loaded_bytes, a, sizeof a),
                   prism_fmt_bytes(w->total, b, sizeof b));
        w->next_log += (size_t)1 << 30;
    }
}

int prism_wload_fill(prism_wload_t *w, void *dst, prism_dtype_t dt, const char *name, int ndim, const int64_t *shape)
{
    if (w->random) {
        int64_t numel = 1;
        if (ndim < 0) numel = shape[0];
        else for (int d = 0; d < ndim; d++) numel *= shape[d];
        return fill_random(w, dst, dt, name, numel);
    }
    const prism_st_tensor_t *t = NULL;
    int rc = find_checked(w, name, ndim, shape, &t);
    if (rc != PRISM_OK || !w->base) return rc;
    size_t esz = prism_dtype_size(dt);
    for (int64_t off = 0; off < t->numel; off += (int64_t)w->staging_n) {
        int64_t n = PRISM_MIN((int64_t)w->staging_n, t->numel - off);
        rc = prism_st_read_f32(t, off, n, w->staging);
        if (rc == PRISM_OK) rc = w->be->i.upload_convert(w->be->ctx, (uint8_t *)dst + (size_t)off * esz, dt, w->staging, (size_t)n);
        if (rc != PRISM_OK) {
            ERR("weights: uploading '%s' failed: %s", name, prism_strerror(rc));
            return rc;
        }
    }
    w->read_bytes += t->nbytes;
    w->loaded_bytes += (size_t)t->numel * esz;
    w->n_tensors++;
    log_progress(w);
    return PRISM_OK;
}

int prism_wload_fill_slice(prism_wload_t *w, void *dst, prism_dtype_t dt, const char *name, int ndim,
                           const int64_t *shape, int axis, int n_ranges, const prism_wload_range_t *ranges)
{
    PRISM_ASSERT(ndim >= 1 && axis >= 0 && axis < ndim && n_ranges >= 1);
    int64_t outer = 1, inner = 1, D = shape[axis], width = 0;
    for (int d = 0; d < axis; d++) outer *= shape[d];
    for (int d = axis + 1; d < ndim; d++) inner *= shape[d];
    for (int k = 0; k < n_ranges; k++) {
        PRISM_ASSERT(ranges[k].lo >= 0 && ranges[k].lo <= ranges[k].hi && ranges[k].hi <= D);
        width += ranges[k].hi - ranges[k].lo;
    }
    const prism_wload_range_t whole = {0, 1};
    if (n_ranges == 1 && ranges[0].lo == 0 && ranges[0].hi == D) {   /* the whole tensor: one run */
        inner *= D * outer;
        outer = 1;
        D = 1;
        ranges = &whole;
        width = 1;
    }
    const prism_st_tensor_t *t = NULL;
    uint64_t seed = 0;
    int rc;
    if (w->random) {
        seed = random_seed_of(w, name);
    } else if ((rc = find_checked(w, name, ndim, shape, &t)) != PRISM_OK) {
        return rc;
    }
    if (!w->base) return PRISM_OK;
    size_t len = strlen(name), esz = prism_dtype_size(dt);
    bool bias = len >= 4 && !strcmp(name + len - 4, "bias");
    bool norm = !bias && (strstr(name, "norm") || strstr(name, "layrnorm"));
    /* Contiguous source runs (one per outer index and range) are packed into the staging buffer
     * and uploaded whenever it fills: dst is dense in the same order. */
    size_t staged = 0, written = 0;
    for (int64_t o = 0; o < outer; o++)
        for (int k = 0; k < n_ranges; k++) {
            int64_t src = (o * D + ranges[k].lo) * inner, left = (ranges[k].hi - ranges[k].lo) * inner;
            while (left > 0) {
                int64_t n = PRISM_MIN(left, (int64_t)(w->staging_n - staged));
                if (w->random) {
                    for (int64_t i = 0; i < n; i++)
                        w->staging[staged + (size_t)i] =
                            bias ? 0.0f : norm ? 1.0f : 0.02f * prism_random_normalish(seed, (uint64_t)(src + i));
                } else if ((rc = prism_st_read_f32(t, src, n, w->staging + staged)) != PRISM_OK) {
                    ERR("weights: reading '%s' failed: %s", name, prism_strerror(rc));
                    return rc;
                } else {
                    w->read_bytes += (size_t)n * prism_st_dtype_size(t->dtype);
                }
                staged += (size_t)n;
                src += n;
                left -= n;
                if (staged == w->staging_n) {
                    rc = w->be->i.upload_convert(w->be->ctx, (uint8_t *)dst + written * esz, dt, w->staging, staged);
                    if (rc != PRISM_OK) return rc;
                    written += staged;
                    staged = 0;
                }
            }
        }
    if (staged) {
        rc = w->be->i.upload_convert(w->be->ctx, (uint8_t *)dst + written * esz, dt, w->staging, staged);
        if (rc != PRISM_OK) return rc;
        written += staged;
    }
    PRISM_ASSERT(written == (size_t)(outer * width * inner));
    w->loaded_bytes += written * esz;
    w->n_tensors++;
    log_progress(w);
    return PRISM_OK;
}

int prism_wload_tensor_slice(prism_wload_t *w, void **out, prism_dtype_t dt, const char *name, int ndim,
                             const int64_t *shape, int axis, int n_ranges, const prism_wload_range_t *ranges)
{
    int64_t numel = 1, width = 0;
    for (int d = 0; d < ndim; d++) numel *= d == axis ? 1 : shape[d];
    for (int k = 0; k < n_ranges; k++) width += ranges[k].hi - ranges[k].lo;
    void *p = prism_wload_reserve(w, (size_t)(numel * width) * prism_dtype_size(dt));
    *out = p;
    return prism_wload_fill_slice(w, p, dt, name, ndim, shape, axis, n_ranges, ranges);
}

int prism_wload_tensor(prism_wload_t *w, void **out, prism_dtype_t dt, const char *name, int ndim, const int64_t *shape)
{
    int64_t numel = 1;
    if (ndim < 0) numel = shape[0];
    else for (int d = 0; d < ndim; d++) numel *= shape[d];
    void *p = prism_wload_reserve(w, (size_t)numel * prism_dtype_size(dt));
    *out = p;
    return prism_wload_fill(w, p, dt, name, ndim, shape);
}

int prism_wload_begin_upload(prism_wload_t *w, void **buf, size_t *bytes)
{
    *bytes = PRISM_ALIGN_UP(w->off, PRISM_TENSOR_ALIGN);
    *buf = prism_backend_buf_alloc(w->be, *bytes);
    w->staging_n = 1u << 20;
    w->staging = prism_malloc(w->staging_n * sizeof(float));
    if (!*buf || !w->staging) {
        char b[32];
        ERR("weights: cannot allocate %s of weights", prism_fmt_bytes(*bytes, b, sizeof b));
        return PRISM_ENOMEM;
    }
    w->base = *buf;
    w->total = *bytes;
    w->off = 0;
    w->next_log = (size_t)1 << 30;
    return PRISM_OK;
}

const char *prism_wload_find_prefix(const prism_st_t *st, const char *const *prefixes, int n, const char *suffix)
{
    char name[PRISM_ST_MAX_NAME + 64];
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s%s", prefixes[i], suffix);
        if (prism_st_find(st, name)) return prefixes[i];
    }
    return NULL;
}
