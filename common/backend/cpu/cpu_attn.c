/* CPU attention as tiled matrix products with online softmax (flash-attention style).
 *
 * A work item is a tile of up to PRISM_CPU_ATTN_ROWS query rows — (token, q head) pairs of one
 * kv head, so the q heads of a GQA group share every K/V tile — walked over key tiles of
 * PRISM_CPU_ATTN_NK keys:
 *   S = Q·Kᵀ   (K tile packed transposed once per tile, register-blocked micro-kernel; for a few
 *               rows, as in decode, dot products straight from the cache rows instead)
 *   masks      only on tiles that straddle a row's causal/chunk limits; tiles outside every row's
 *              range are never visited
 *   P = exp(S - m), running max/sum per row, O = O·corr + P·V (V rows read in place)
 * so memory stays O(tile) per thread (scratch carved at create) whatever the context length.
 * Items are tiles of the flattened token stream (a tile crossing a sequence boundary is handled
 * as one segment per sequence) times kv heads; threads take them from a shared counter, last
 * tokens first, because under a causal mask they are the most expensive. */
#include "backend/cpu/cpu_impl.h"

#include <math.h>

#define NK PRISM_CPU_ATTN_NK
#define QK_PACK_MIN 12   /* a sequence with fewer rows per item: dot products beat packing Kᵀ */

/* Where key j of one segment's sequence lives. */
typedef struct {
    const float *kc, *vc;         /* paged: cache base; dense: the sequence's first row (+ head) */
    const int32_t *table;         /* paged block table of the sequence, NULL for dense */
    int bs;                       /* paged block size */
    size_t row, off;              /* paged: floats per cached token, offset of the kv head */
    int ldk, ldv;                 /* dense row strides */
} kv_src_t;

static inline void kv_rows(const kv_src_t *src, int j0, int n, const float **kr, const float **vr)
{
    if (src->table) {
        for (int j = 0; j < n; j++) {
            int p = j0 + j;
            size_t r = ((size_t)src->table[p / src->bs] * src->bs + (size_t)(p % src->bs)) * src->row + src->off;
            kr[j] = src->kc + r;
            vr[j] = src->vc + r;
        }
    } else {
        for (int j = 0; j < n; j++) {
            kr[j] = src->kc + (size_t)(j0 + j) * src->ldk;
            vr[j] = src->vc + (size_t)(j0 + j) * src->ldv;
        }
    }
}

typedef struct {
    const prism_cpu_kern_t *k;
    float *scratch;               /* [nth][PRISM_CPU_ATTN_SCRATCH] */
    float *out; int ldo;
    const float *q; int ldq;
    int n_heads, n_kv, hd, G;
    int gc, n_hc;                 /* q heads per item, head chunks per kv head */
    int tq, n_tiles;              /* tokens per item, token tiles */
    long T;                       /* flattened query tokens */
    long n_items;
    float scale;
    atomic_long next;             /* next item to take */
    /* paged */
    const float *k_cache, *v_cache;
    const prism_attn_meta_t *meta;
    /* dense */
    const float *dk, *dv; int ldk, ldv;
    int seq_len;
    bool causal;
    /* varlen (dense, non-causal): sequence s is rows [cu[s], cu[s+1]) */
    const int32_t *cu;
    int n_seqs;
} attn_call_t;

/* Rows of one segment: nt consecutive tokens (flat index tok0) of one sequence, heads
 * [h0, h0+nh) of one kv head; token i sees keys [lo[i], hi[i]). pack: packed Kᵀ micro-kernel
 * (else dot products from the rows).
 * A row's result does not depend on which other rows share its segment: key tiles start at
 * multiples of NK whatever the segment's first key, masked scores are exact zeros after the
 * exp, and `pack` is decided per sequence. So outputs do not change with the thread count or
 * with the other sequences of a batch. */
static void attend_segment(const attn_call_t *a, float *scratch, const kv_src_t *src, int tok0, int nt, int h0,
                           int nh, const int *lo, const int *hi, bool pack)
{
    const prism_cpu_kern_t *k = a->k;
    const int hd = a->hd, m = nt * nh;
    float *Qp = scratch, *O = Qp + PRISM_CPU_ATTN_QO, *Kt = O + PRISM_CPU_ATTN_QO;
    float *Vp = Kt + PRISM_CPU_MAX_HEAD_DIM * NK, *S = Vp + PRISM_CPU_MAX_HEAD_DIM * NK;
    float mrun[PRISM_CPU_ATTN_ROWS], lrun[PRISM_CPU_ATTN_ROWS], corr[PRISM_CPU_ATTN_ROWS];
    const float *kr[NK], *vr[NK];

    int kmin = lo[0], kmax = hi[0];
    for (int i = 0; i < nt; i++) {
        const float *qrow = a->q + (size_t)(tok0 + i) * a->ldq + (size_t)h0 * hd;
        for (int hh = 0; hh < nh; hh++) k->scale(Qp + (size_t)(i * nh + hh) * hd, qrow + (size_t)hh * hd, a->scale, (size_t)hd);
        kmin = PRISM_MIN(kmin, lo[i]);
        kmax = PRISM_MAX(kmax, hi[i]);
    }
    for (int r = 0; r < m; r++) {
        mrun[r] = -INFINITY;
        lrun[r] = 0.0f;
    }
    memset(O, 0, sizeof(float) * (size_t)m * hd);

    for (int j0 = kmin / NK * NK; j0 < kmax; j0 += NK) {
        int n = PRISM_MIN(NK, kmax - j0);
        kv_rows(src, j0, n, kr, vr);
        if (pack) {
            int ldk = (n + 15) & ~15;
            k->pack_kt(Kt, ldk, kr, n, hd);
            k->qk(S, NK, Qp, hd, Kt, ldk, m, hd);
            /* V rows sit a whole token row (or KV block) apart: a contiguous copy keeps the P·V
             * micro-kernel in a few pages instead of one page per key */
            for (int j = 0; j < n; j++) {
                memcpy(Vp + (size_t)j * hd, vr[j], sizeof(float) * (size_t)hd);
                vr[j] = Vp + (size_t)j * hd;
            }
        } else {
            k->qk_rows(S, NK, Qp, hd, kr, m, n, hd);
        }
        for (int i = 0; i < nt; i++) {
            if (lo[i] <= j0 && hi[i] >= j0 + n) continue;   /* whole tile visible to this token */
            int b0 = PRISM_MIN(PRISM_MAX(lo[i] - j0, 0), n), b1 = PRISM_MIN(PRISM_MAX(hi[i] - j0, 0), n);
            for (int hh = 0; hh < nh; hh++) {
                float *s = S + (size_t)(i * nh + hh) * NK;
                for (int j = 0; j < b0; j++) s[j] = -INFINITY;
                for (int j = b1; j < n; j++) s[j] = -INFINITY;
            }
        }
        k->softmax(S, NK, m, n, mrun, lrun, corr);
        k->pv(O, hd, S, NK, vr, corr, m, n, hd);
    }

    for (int i = 0; i < nt; i++) {
        float *orow = a->out + (size_t)(tok0 + i) * a->ldo + (size_t)h0 * hd;
        for (int hh = 0; hh < nh; hh++) {
            int r = i * nh + hh;
            k->scale(orow + (size_t)hh * hd, O + (size_t)r * hd, lrun[r] > 0 ? 1.0f / lrun[r] : 0.0f, (size_t)hd);
        }
    }
}

static int seq_of_token(const int32_t *seq_start, int n_seqs, int t)
{
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (seq_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* One item: token tile `tile`, kv head g, head chunk hc; split into per-sequence segments. */
static void attend_item(const attn_call_t *a, float *scratch, long it)
{
    int per_tile = a->n_kv * a->n_hc;
    int tile = a->n_tiles - 1 - (int)(it / per_tile);   /* last tokens first */
    int g = (int)(it % per_tile) / a->n_hc, hc = (int)(it % per_tile) % a->n_hc;
    int h0 = g * a->G + hc * a->gc, nh = PRISM_MIN(a->gc, a->G - hc * a->gc);
    const prism_attn_meta_t *me = a->meta;
    int t = tile * a->tq, end = (int)PRISM_MIN((long)t + a->tq, a->T);
    int lo[PRISM_CPU_ATTN_ROWS], hi[PRISM_CPU_ATTN_ROWS];
    while (t < end) {
        kv_src_t src;
        int s, seg_end, first_pos, q_len;
        if (me) {
            s = seq_of_token(me->seq_start, me->n_seqs, t);
            q_len = me->seq_start[s + 1] - me->seq_start[s];
            seg_end = PRISM_MIN(end, me->seq_start[s + 1]);
            first_pos = me->pos0[s] + (t - me->seq_start[s]);
            src = (kv_src_t){a->k_cache, a->v_cache, me->block_tables + (size_t)s * me->max_blocks_per_seq,
                             me->block_size, (size_t)a->n_kv * a->hd, (size_t)g * a->hd, 0, 0};
            for (int i = 0; i < seg_end - t; i++) {
                int p = first_pos + i;
                hi[i] = p + 1;
                lo[i] = me->chunk > 0 ? p / me->chunk * me->chunk : 0;
            }
        } else if (a->cu) {
            s = seq_of_token(a->cu, a->n_seqs, t);   /* the last s with cu[s] <= t: never an empty one */
            int r0 = a->cu[s];
            q_len = a->cu[s + 1] - r0;
            seg_end = PRISM_MIN(end, a->cu[s + 1]);
            src = (kv_src_t){a->dk + (size_t)r0 * a->ldk + (size_t)g * a->hd, a->dv + (size_t)r0 * a->ldv + (size_t)g * a->hd,
                             NULL, 0, 0, 0, a->ldk, a->ldv};
            for (int i = 0; i < seg_end - t; i++) {
                hi[i] = q_len;
                lo[i] = 0;
            }
        } else {
            s = t / a->seq_len;
            q_len = a->seq_len;
            seg_end = PRISM_MIN(end, (s + 1) * a->seq_len);
            first_pos = t - s * a->seq_len;
            src = (kv_src_t){a->dk + (size_t)s * a->seq_len * a->ldk + (size_t)g * a->hd,
                             a->dv + (size_t)s * a->seq_len * a->ldv + (size_t)g * a->hd,
                             NULL, 0, 0, 0, a->ldk, a->ldv};
            for (int i = 0; i < seg_end - t; i++) {
                hi[i] = a->causal ? first_pos + i + 1 : a->seq_len;
                lo[i] = 0;
            }
        }
        attend_segment(a, scratch, &src, t, seg_end - t, h0, nh, lo, hi, q_len * nh >= QK_PACK_MIN);
        t = seg_end;
    }
}

static void attn_worker(void *arg, int ith, int nth)
{
    attn_call_t *a = arg;
    float *scratch = a->scratch + (size_t)ith * PRISM_CPU_ATTN_SCRATCH;
    for (;;) {
        long it = atomic_fetch_add_explicit(&a->next, 1, memory_order_relaxed);
        if (it >= a->n_items) break;
        attend_item(a, scratch, it);
    }
}

/* Fills the tiling fields and runs the call over the pool. T = flattened query tokens. */
static void attn_run(prism_cpu_ctx_t *c, attn_call_t *a, long T)
{
    int rows = PRISM_MIN(PRISM_CPU_ATTN_ROWS, PRISM_CPU_ATTN_QO / a->hd);
    a->k = c->k;
    a->scratch = c->attn_scratch;
    a->G = a->n_heads / a->n_kv;
    a->gc = PRISM_MIN(a->G, rows);
    a->n_hc = (a->G + a->gc - 1) / a->gc;
    /* As many tokens per item as fit the rows, but at least ~4 items per thread (decode batches:
     * one token per sequence) so every thread has work. */
    long per_tile = (long)a->n_kv * a->n_hc, want = 4L * c->pool.n_threads;
    a->tq = (int)PRISM_MAX(1L, PRISM_MIN((long)(rows / a->gc), T * per_tile / want));
    a->T = T;
    a->n_tiles = (int)((T + a->tq - 1) / a->tq);
    a->n_items = (long)a->n_tiles * a->n_kv * a->n_hc;
    atomic_init(&a->next, 0);
    int nth = (int)PRISM_MIN((long)c->pool.n_threads, a->n_items);
    prism_cpu_pool_run(&c->pool, nth < 1 ? 1 : nth, attn_worker, a);
}

int prism_cpu_attn_paged(void *ctx, float *out, int ldo, const float *q, int ldq,
                         const float *k_cache, const float *v_cache, const prism_attn_meta_t *meta,
                         int n_heads, int n_kv_heads, int head_dim, float scale)
{
    prism_cpu_ctx_t *c = ctx;
    if (!meta || n_kv_heads <= 0 || n_heads % n_kv_heads || n_heads / n_kv_heads > PRISM_CPU_MAX_GQA ||
        head_dim <= 0 || head_dim > PRISM_CPU_MAX_HEAD_DIM || meta->block_size <= 0 || meta->n_seqs <= 0 ||
        meta->chunk < 0 || meta->n_tokens < 0 || ldq < n_heads * head_dim || ldo < n_heads * head_dim)
        return PRISM_EINVAL;
    if (meta->n_tokens == 0) return PRISM_OK;
    attn_call_t a = {.out = out, .ldo = ldo, .q = q, .ldq = ldq, .n_heads = n_heads, .n_kv = n_kv_heads,
                     .hd = head_dim, .scale = scale, .k_cache = k_cache, .v_cache = v_cache, .meta = meta};
    attn_run(c, &a, meta->n_tokens);
    return PRISM_OK;
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
    if (n_seqs == 0) return PRISM_OK;
    attn_call_t a = {.out = out, .ldo = ldo, .q = q, .ldq = ldq, .n_heads = n_heads, .n_kv = n_kv_heads,
                     .hd = head_dim, .scale = scale, .dk = k, .dv = v, .ldk = ldk, .ldv = ldv, .seq_len = seq_len,
                     .causal = causal};
    attn_run(c, &a, (long)n_seqs * seq_len);
    return PRISM_OK;
}

int prism_cpu_attn_varlen(void *ctx, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                          const float *v, int ldv, const int32_t *cu, int n_seqs, int max_len, int n_heads,
                          int n_kv_heads, int head_dim, float scale)
{
    prism_cpu_ctx_t *c = ctx;
    if (n_kv_heads <= 0 || n_heads % n_kv_heads || n_heads / n_kv_heads > PRISM_CPU_MAX_GQA || head_dim <= 0 ||
        head_dim > PRISM_CPU_MAX_HEAD_DIM || n_seqs < 0 || max_len < 0 || !cu || ldq < n_heads * head_dim ||
        ldo < n_heads * head_dim || ldk < n_kv_heads * head_dim || ldv < n_kv_heads * head_dim)
        return PRISM_EINVAL;
    if (n_seqs == 0 || cu[n_seqs] == 0) return PRISM_OK;
    for (int s = 0; s < n_seqs; s++)
        if (cu[s + 1] < cu[s] || cu[s + 1] - cu[s] > max_len) return PRISM_EINVAL;
    if (cu[0] != 0) return PRISM_EINVAL;
    attn_call_t a = {.out = out, .ldo = ldo, .q = q, .ldq = ldq, .n_heads = n_heads, .n_kv = n_kv_heads,
                     .hd = head_dim, .scale = scale, .dk = k, .dv = v, .ldk = ldk, .ldv = ldv, .cu = cu,
                     .n_seqs = n_seqs};
    attn_run(c, &a, (long)cu[n_seqs]);
    return PRISM_OK;
}
