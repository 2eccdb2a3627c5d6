/* CPU attention: blockwise online softmax (flash-attention style) so memory stays O(tile) per
 * worker whatever the context length; no N×N score matrix is ever formed. Work is split over
 * (query token, kv head) items so the q heads of one GQA group share each K/V tile load. */
#include "backend/cpu/cpu_impl.h"

#include <math.h>

static inline float dot(const float *a, const float *b, int n)
{
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        s0 += a[i] * b[i]; s1 += a[i + 1] * b[i + 1]; s2 += a[i + 2] * b[i + 2]; s3 += a[i + 3] * b[i + 3];
        s4 += a[i + 4] * b[i + 4]; s5 += a[i + 5] * b[i + 5]; s6 += a[i + 6] * b[i + 6]; s7 += a[i + 7] * b[i + 7];
    }
    for (; i < n; i++) s0 += a[i] * b[i];
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
}

/* Online-softmax state of the G query heads of one (token, kv head) item. */
typedef struct {
    float m[PRISM_CPU_MAX_GQA];   /* running max score */
    float l[PRISM_CPU_MAX_GQA];   /* running sum of exp */
} softmax_state_t;

static void state_begin(softmax_state_t *st, float *o, int G, int hd, int ld_head)
{
    for (int h = 0; h < G; h++) {
        st->m[h] = -INFINITY;
        st->l[h] = 0;
        memset(o + (size_t)h * ld_head, 0, (size_t)hd * 4);
    }
}

/* Folds n keys/values (rows kv_stride apart) into the state of G heads. q/o heads are ld_head apart. */
static void attend_tile(softmax_state_t *st, const float *q, float *o, int G, int hd, int ld_head,
                        const float *k, const float *v, size_t kv_stride, int n, float scale)
{
    float sc[PRISM_CPU_ATTN_TILE];
    for (int h = 0; h < G; h++) {
        const float *qh = q + (size_t)h * ld_head;
        float *oh = o + (size_t)h * ld_head;
        float mx = -INFINITY;
        for (int j = 0; j < n; j++) {
            sc[j] = dot(qh, k + (size_t)j * kv_stride, hd) * scale;
            if (sc[j] > mx) mx = sc[j];
        }
        float m_new = st->m[h] > mx ? st->m[h] : mx;
        float corr = st->m[h] == -INFINITY ? 0.0f : expf(st->m[h] - m_new);
        if (corr != 1.0f) {
            st->l[h] *= corr;
            for (int d = 0; d < hd; d++) oh[d] *= corr;
        }
        float lsum = 0;
        for (int j = 0; j < n; j++) {
            float pj = expf(sc[j] - m_new);
            lsum += pj;
            const float *vj = v + (size_t)j * kv_stride;
            for (int d = 0; d < hd; d++) oh[d] += pj * vj[d];
        }
        st->l[h] += lsum;
        st->m[h] = m_new;
    }
}

static void state_end(softmax_state_t *st, float *o, int G, int hd, int ld_head)
{
    for (int h = 0; h < G; h++) {
        float inv = st->l[h] > 0 ? 1.0f / st->l[h] : 0.0f;
        float *oh = o + (size_t)h * ld_head;
        for (int d = 0; d < hd; d++) oh[d] *= inv;
    }
}

/* ---- paged (causal, over the KV cache) ---- */

typedef struct {
    float *out; int ldo;
    const float *q; int ldq;
    const float *k_cache, *v_cache;
    const prism_attn_meta_t *meta;
    int n_heads, n_kv, hd;
    float scale;
} paged_task_t;

static int seq_of_token(const int32_t *seq_start, int n_seqs, int t)
{
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (seq_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static void paged_worker(void *arg, int ith, int nth)
{
    const paged_task_t *a = arg;
    const prism_attn_meta_t *me = a->meta;
    int G = a->n_heads / a->n_kv, hd = a->hd, bs = me->block_size;
    size_t kv_stride = (size_t)a->n_kv * hd;
    long items = (long)me->n_tokens * a->n_kv;
    long i0 = items * ith / nth, i1 = items * (ith + 1) / nth;
    softmax_state_t st;
    for (long it = i0; it < i1; it++) {
        int t = (int)(it / a->n_kv), g = (int)(it % a->n_kv);
        int s = seq_of_token(me->seq_start, me->n_seqs, t);
        int pos = me->pos0[s] + (t - me->seq_start[s]), ctx_len = pos + 1;
        int first = me->chunk > 0 ? pos / me->chunk * me->chunk : 0;  /* keys before the chunk never load */
        const int32_t *table = me->block_tables + (size_t)s * me->max_blocks_per_seq;
        const float *qh = a->q + (size_t)t * a->ldq + (size_t)g * G * hd;
        float *oh = a->out + (size_t)t * a->ldo + (size_t)g * G * hd;
        state_begin(&st, oh, G, hd, hd);
        for (int j0 = first; j0 < ctx_len;) {
            int bi = j0 / bs, off = j0 % bs;
            int n = PRISM_MIN(PRISM_MIN(PRISM_CPU_ATTN_TILE, bs - off), ctx_len - j0);
            size_t row = (size_t)table[bi] * bs + off;
            attend_tile(&st, qh, oh, G, hd, hd, a->k_cache + row * kv_stride + (size_t)g * hd,
                        a->v_cache + row * kv_stride + (size_t)g * hd, kv_stride, n, a->scale);
            j0 += n;
        }
        state_end(&st, oh, G, hd, hd);
    }
}

int prism_cpu_attn_paged(void *ctx, float *out, int ldo, const float *q, int ldq,
                         const float *k_cache, const float *v_cache, const prism_attn_meta_t *meta,
                         int n_heads, int n_kv_heads, int head_dim, float scale)
{
    prism_cpu_ctx_t *c = ctx;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads || n_heads / n_kv_heads > PRISM_CPU_MAX_GQA ||
        head_dim <= 0 || head_dim > PRISM_CPU_MAX_HEAD_DIM || meta->block_size <= 0 || meta->n_seqs <= 0 ||
        meta->chunk < 0 || ldq < n_heads * head_dim || ldo < n_heads * head_dim)
        return PRISM_EINVAL;
    paged_task_t a = {out, ldo, q, ldq, k_cache, v_cache, meta, n_heads, n_kv_heads, head_dim, scale};
    long items = (long)meta->n_tokens * n_kv_heads;
    int nth = (int)PRISM_MIN((long)c->pool.n_threads, items);
    prism_cpu_pool_run(&c->pool, nth < 1 ? 1 : nth, paged_worker, &a);
    return PRISM_OK;
}

/* ---- dense (ViT tiles; optional causal) ---- */

typedef struct {
    float *out; int ldo;
    const float *q; int ldq;
    const float *k; int ldk;
    const float *v; int ldv;
    int n_seqs, seq_len, n_heads, n_kv, hd;
    float scale;
    bool causal;
} dense_task_t;

static void dense_worker(void *arg, int ith, int nth)
{
    const dense_task_t *a = arg;
    int G = a->n_heads / a->n_kv, hd = a->hd;
    long items = (long)a->n_seqs * a->seq_len * a->n_kv;
    long i0 = items * ith / nth, i1 = items * (ith + 1) / nth;
    softmax_state_t st;
    for (long it = i0; it < i1; it++) {
        long tok = it / a->n_kv;
        int g = (int)(it % a->n_kv);
        int s = (int)(tok / a->seq_len), i = (int)(tok % a->seq_len);
        int ctx_len = a->causal ? i + 1 : a->seq_len;
        const float *qh = a->q + (size_t)tok * a->ldq + (size_t)g * G * hd;
        float *oh = a->out + (size_t)tok * a->ldo + (size_t)g * G * hd;
        const float *kb = a->k + (size_t)s * a->seq_len * a->ldk + (size_t)g * hd;
        const float *vb = a->v + (size_t)s * a->seq_len * a->ldv + (size_t)g * hd;
        state_begin(&st, oh, G, hd, hd);
        for (int j0 = 0; j0 < ctx_len; j0 += PRISM_CPU_ATTN_TILE) {
            int n = PRISM_MIN(PRISM_CPU_ATTN_TILE, ctx_len - j0);
            if (a->ldk == a->ldv) {
                attend_tile(&st, qh, oh, G, hd, hd, kb + (size_t)j0 * a->ldk, vb + (size_t)j0 * a->ldv,
                            (size_t)a->ldk, n, a->scale);
            } else {
                /* distinct k/v strides: fold one key at a time */
                for (int j = 0; j < n; j++)
                    attend_tile(&st, qh, oh, G, hd, hd, kb + (size_t)(j0 + j) * a->ldk,
                                vb + (size_t)(j0 + j) * a->ldv, 0, 1, a->scale);
            }
        }
        state_end(&st, oh, G, hd, hd);
    }
}

int prism_cpu_attn_dense(void *ctx, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                         const float *v, int ldv, int n_seqs, int seq_len, int n_heads, int n_kv_heads,
                         int head_dim, float scale, bool causal)
{
    prism_cpu_ctx_t *c = ctx;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads || n_heads / n_kv_heads > PRISM_CPU_MAX_GQA ||
        head_dim <= 0 || head_dim > PRISM_CPU_MAX_HEAD_DIM || n_seqs < 0 || seq_len <= 0 ||
        ldq < n_heads * head_dim || ldo < n_heads * head_dim || ldk < n_kv_heads * head_dim ||
        ldv < n_kv_heads * head_dim)
        return PRISM_EINVAL;
    dense_task_t a = {out, ldo, q, ldq, k, ldk, v, ldv, n_seqs, seq_len, n_heads, n_kv_heads, head_dim,
                      scale, causal};
    long items = (long)n_seqs * seq_len * n_kv_heads;
    int nth = (int)PRISM_MIN((long)c->pool.n_threads, items);
    prism_cpu_pool_run(&c->pool, nth < 1 ? 1 : nth, dense_worker, &a);
    return PRISM_OK;
}
