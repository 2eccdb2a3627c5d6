/* Random-weight Llama / CLIP forwards over prism_backend_i: see gpu_model.h. The op sequence is
 * common/model/llm.c's and vision.c's; keep them in step when those change. */
#include "gpu_model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CK(x) do { int rc_ = (x); if (rc_ != PRISM_OK) return rc_; } while (0)
#define ALIGN 256

typedef struct {
    prism_backend_t *be;
    uint64_t seed;
    bool device_init;
    uint8_t *base;
    size_t off;
    float *host;        /* generation buffer (host init) */
    size_t host_n;
} winit_t;

static float urand(uint64_t *s)
{
    *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17;
    return (float)((*s >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

/* Carves n elements of dt from the weight block (base NULL: sizing pass) and fills them with
 * offset + scale * U(-1, 1). */
static void *wtake(winit_t *w, size_t n, prism_dtype_t dt, float scale, float offset, int *rc)
{
    size_t o = (w->off + ALIGN - 1) / ALIGN * ALIGN;
    w->off = o + n * prism_dtype_size(dt);
    if (!w->base || *rc) return NULL;
    void *p = w->base + o;
    w->seed = w->seed * 6364136223846793005ull + 1442695040888963407ull;
    if (w->device_init) {
        *rc = gm_device_fill(w->be, p, dt, n, scale, offset, w->seed);
        return p;
    }
    uint64_t s = w->seed | 1;
    for (size_t i0 = 0; i0 < n && !*rc; i0 += w->host_n) {
        size_t m = n - i0 < w->host_n ? n - i0 : w->host_n;
        for (size_t i = 0; i < m; i++) w->host[i] = offset + scale * urand(&s);
        *rc = w->be->i.upload_convert(w->be->ctx, (uint8_t *)p + i0 * prism_dtype_size(dt), dt, w->host, m);
    }
    return p;
}

/* ============================================================ language model */

typedef struct {
    float *attn_norm, *mlp_norm;
    void *wqkv, *wo, *wgu, *wdown;
} gm_layer_t;

struct gm_llm {
    prism_backend_t *be;
    gm_llm_cfg_t c;
    prism_dtype_t wdt;
    void *wbuf;
    size_t wbytes;
    void *embed, *lm_head;
    float *norm, *inv_freq;
    gm_layer_t *layers;
    int max_tokens, max_seqs, n_blocks, bs;
    float *kv;          /* [L][2][n_blocks][bs][n_kv][hd] */
    size_t kv_layer;    /* floats of K (or V) per layer */
    void *abuf;
    float *x, *xn, *qkv, *attn, *gu, *act, *xsel, *logits;
    int32_t *d_meta, *h_meta;
    size_t meta_cap;    /* int32 entries */
};

static int llm_weights(gm_llm_t *m, winit_t *w)
{
    const gm_llm_cfg_t *c = &m->c;
    size_t H = c->hidden, I = c->inter, V = c->vocab, Q = (size_t)(c->n_heads + 2 * c->n_kv) * c->head_dim;
    size_t NQ = (size_t)c->n_heads * c->head_dim;
    int rc = PRISM_OK;
    float sh = 1.0f / sqrtf((float)H), si = 1.0f / sqrtf((float)I), sq = 1.0f / sqrtf((float)NQ);
    m->embed = wtake(w, V * H, m->wdt, 1.0f, 0.0f, &rc);
    m->lm_head = wtake(w, V * H, m->wdt, sh, 0.0f, &rc);
    m->norm = wtake(w, H, PRISM_DTYPE_F32, 0.1f, 1.0f, &rc);
    for (int L = 0; L < c->n_layers; L++) {
        gm_layer_t *ly = &m->layers[L];
        ly->attn_norm = wtake(w, H, PRISM_DTYPE_F32, 0.1f, 1.0f, &rc);
        ly->mlp_norm = wtake(w, H, PRISM_DTYPE_F32, 0.1f, 1.0f, &rc);
        ly->wqkv = wtake(w, Q * H, m->wdt, sh, 0.0f, &rc);
        ly->wo = wtake(w, H * NQ, m->wdt, sq, 0.0f, &rc);
        ly->wgu = wtake(w, 2 * I * H, m->wdt, sh, 0.0f, &rc);
        ly->wdown = wtake(w, H * I, m->wdt, si, 0.0f, &rc);
    }
    m->inv_freq = wtake(w, (size_t)c->head_dim / 2, PRISM_DTYPE_F32, 0.0f, 0.0f, &rc);
    return rc;
}

int gm_llm_create(prism_backend_t *be, const gm_llm_cfg_t *c, uint64_t seed, bool device_init, int max_tokens,
                  int max_seqs, int n_blocks, int block_size, gm_llm_t **out)
{
    *out = NULL;
    gm_llm_t *m = calloc(1, sizeof *m);
    if (!m) return PRISM_ENOMEM;
    m->be = be;
    m->c = *c;
    m->wdt = be->weight_dtype;
    m->max_tokens = max_tokens;
    m->max_seqs = max_seqs;
    m->n_blocks = n_blocks;
    m->bs = block_size;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    int rc = PRISM_ENOMEM;
    if (!m->layers) goto fail;
    winit_t w = {be, seed, device_init, NULL, 0, NULL, 0};
    llm_weights(m, &w);
    m->wbytes = w.off;
    m->wbuf = prism_backend_alloc(be, m->wbytes);
    if (!m->wbuf) goto fail;
    w.base = m->wbuf;
    w.off = 0;
    w.host_n = (size_t)1 << 22;
    w.host = device_init ? NULL : malloc(w.host_n * sizeof(float));
    if (!device_init && !w.host) goto fail;
    rc = llm_weights(m, &w);
    free(w.host);
    if (rc) goto fail;
    {
        float inv[512];
        int half = c->head_dim / 2;
        for (int i = 0; i < half; i++) inv[i] = powf(c->theta, -2.0f * (float)i / (float)c->head_dim);
        if ((rc = be->i.upload(be->ctx, m->inv_freq, inv, (size_t)half * 4))) goto fail;
    }
    /* KV cache and activation arena */
    m->kv_layer = (size_t)n_blocks * block_size * c->n_kv * c->head_dim;
    m->kv = prism_backend_alloc(be, m->kv_layer * 2 * (size_t)c->n_layers * 4);
    rc = PRISM_ENOMEM;
    if (!m->kv) goto fail;
    if ((rc = be->i.memset0(be->ctx, m->kv, m->kv_layer * 2 * (size_t)c->n_layers * 4))) goto fail;
    size_t T = max_tokens, S = max_seqs, H = c->hidden, Q = (size_t)(c->n_heads + 2 * c->n_kv) * c->head_dim;
    size_t NQ = (size_t)c->n_heads * c->head_dim, I = c->inter;
    m->meta_cap = 3 * T + 2 * S + 1 + S + S * (size_t)n_blocks;
    size_t sizes[] = {T * H, T * H, T * Q, T * NQ, T * 2 * I, T * I, S * H, S * c->vocab, m->meta_cap};
    size_t total = 0;
    for (size_t i = 0; i < 9; i++) total += (sizes[i] * 4 + ALIGN - 1) / ALIGN * ALIGN;
    rc = PRISM_ENOMEM;
    m->abuf = prism_backend_alloc(be, total);
    m->h_meta = malloc(m->meta_cap * 4);
    if (!m->abuf || !m->h_meta) goto fail;
    uint8_t *p = m->abuf;
    float **dst[] = {&m->x, &m->xn, &m->qkv, &m->attn, &m->gu, &m->act, &m->xsel, &m->logits, (float **)&m->d_meta};
    for (size_t i = 0; i < 9; i++) {
        *dst[i] = (float *)p;
        p += (sizes[i] * 4 + ALIGN - 1) / ALIGN * ALIGN;
    }
    *out = m;
    return PRISM_OK;
fail:
    gm_llm_free(m);
    return rc;
}

void gm_llm_free(gm_llm_t *m)
{
    if (!m) return;
    prism_backend_free(m->be, m->wbuf);
    prism_backend_free(m->be, m->kv);
    prism_backend_free(m->be, m->abuf);
    free(m->h_meta);
    free(m->layers);
    free(m);
}

size_t gm_llm_weight_bytes(const gm_llm_t *m) { return m->wbytes; }
size_t gm_llm_kv_bytes_per_token(const gm_llm_t *m)
{
    return (size_t)m->c.n_layers * 2 * m->c.n_kv * m->c.head_dim * 4;
}

int gm_llm_forward(gm_llm_t *m, int S, const int32_t *tokens, const int32_t *q_len, const int32_t *pos0_in,
                   int bps, float *logits_host, int32_t *argmax_host)
{
    const gm_llm_cfg_t *c = &m->c;
    const prism_backend_i *o = &m->be->i;
    void *bx = m->be->ctx;
    int T = 0, max_q = 0, max_ctx = 0, bs = m->bs;
    for (int s = 0; s < S; s++) {
        T += q_len[s];
        max_q = PRISM_MAX(max_q, q_len[s]);
        max_ctx = PRISM_MAX(max_ctx, pos0_in[s] + q_len[s]);
    }
    if (S <= 0 || S > m->max_seqs || T > m->max_tokens || (size_t)S * bps > (size_t)m->n_blocks ||
        (max_ctx + bs - 1) / bs > bps)
        return PRISM_ELIMIT;
    int32_t *ids = m->h_meta, *pos = ids + T, *slots = pos + T, *seq_start = slots + T, *pos0 = seq_start + S + 1;
    int32_t *rows = pos0 + S, *tables = rows + S;
    bool all_decode = true;
    for (int s = 0, t = 0; s < S; s++) {
        seq_start[s] = t;
        pos0[s] = pos0_in[s];
        rows[s] = t + q_len[s] - 1;
        for (int i = 0; i < bps; i++) tables[s * bps + i] = s * bps + i;
        for (int i = 0; i < q_len[s]; i++, t++) {
            int p = pos0_in[s] + i;
            ids[t] = tokens[t];
            pos[t] = p;
            slots[t] = tables[s * bps + p / bs] * bs + p % bs;
        }
        all_decode = all_decode && q_len[s] == 1;
    }
    seq_start[S] = T;
    size_t used = (size_t)(tables - ids) + (size_t)S * bps;
    CK(o->upload(bx, m->d_meta, m->h_meta, used * 4));
    int32_t *d_ids = m->d_meta, *d_pos = d_ids + T, *d_slots = d_pos + T, *d_seq = d_slots + T, *d_pos0 = d_seq + S + 1;
    int32_t *d_rows = d_pos0 + S, *d_tab = d_rows + S;

    const int H = c->hidden, I = c->inter, hd = c->head_dim, nh = c->n_heads, nkv = c->n_kv;
    const int QKV = (nh + 2 * nkv) * hd, NQ = nh * hd;
    prism_attn_meta_t meta = {S, T, max_q, max_ctx, bs, bps, d_seq, d_pos0, d_tab};
    float scale = 1.0f / sqrtf((float)hd);
    CK(o->get_rows(bx, m->x, m->embed, m->wdt, c->vocab, d_ids, T, H));
    for (int L = 0; L < c->n_layers; L++) {
        const gm_layer_t *ly = &m->layers[L];
        float *kc = m->kv + (size_t)L * 2 * m->kv_layer, *vc = kc + m->kv_layer;
        CK(o->rmsnorm(bx, m->xn, m->x, ly->attn_norm, T, H, c->eps));
        CK(o->matmul(bx, m->qkv, QKV, m->xn, H, ly->wqkv, m->wdt, NULL, T, QKV, H, false));
        CK(o->rope(bx, m->qkv, QKV, T, nh, hd, hd, d_pos, m->inv_freq, PRISM_ROPE_NEOX));
        CK(o->rope(bx, m->qkv + NQ, QKV, T, nkv, hd, hd, d_pos, m->inv_freq, PRISM_ROPE_NEOX));
        CK(o->kv_write(bx, kc, vc, m->qkv + NQ, m->qkv + NQ + nkv * hd, QKV, d_slots, T, nkv, hd));
        if (all_decode && o->attn_decode)
            CK(o->attn_decode(bx, m->attn, NQ, m->qkv, QKV, kc, vc, &meta, nh, nkv, hd, scale));
        else
            CK(o->attn_paged(bx, m->attn, NQ, m->qkv, QKV, kc, vc, &meta, nh, nkv, hd, scale));
        CK(o->matmul(bx, m->x, H, m->attn, NQ, ly->wo, m->wdt, NULL, T, H, NQ, true));
        CK(o->rmsnorm(bx, m->xn, m->x, ly->mlp_norm, T, H, c->eps));
        CK(o->matmul(bx, m->gu, 2 * I, m->xn, H, ly->wgu, m->wdt, NULL, T, 2 * I, H, false));
        CK(o->silu_mul(bx, m->act, m->gu, m->gu + I, 2 * I, T, I));
        CK(o->matmul(bx, m->x, H, m->act, I, ly->wdown, m->wdt, NULL, T, H, I, true));
    }
    CK(o->get_rows(bx, m->xsel, m->x, PRISM_DTYPE_F32, T, d_rows, S, H));
    CK(o->rmsnorm(bx, m->xsel, m->xsel, m->norm, S, H, c->eps));
    CK(o->matmul(bx, m->logits, c->vocab, m->xsel, H, m->lm_head, m->wdt, NULL, S, c->vocab, H, false));
    if (argmax_host && o->argmax) CK(o->argmax(bx, argmax_host, m->logits, S, c->vocab));
    if (logits_host) CK(o->download(bx, logits_host, m->logits, (size_t)S * c->vocab * 4));
    return o->synchronize(bx);
}

/* ============================================================ CLIP-shaped ViT + projector */

typedef struct {
    float *ln1_w, *ln1_b, *ln2_w, *ln2_b, *bqkv, *bo, *fc1_b, *fc2_b;
    void *wqkv, *wo, *fc1, *fc2;
} gm_vlayer_t;

struct gm_vit {
    prism_backend_t *be;
    gm_vit_cfg_t c;
    prism_dtype_t wdt;
    int np, seq, max_images;
    void *wbuf;
    size_t wbytes;
    void *patch_w, *p1_w, *p2_w;
    float *cls, *pos, *pre_w, *pre_b, *p1_b, *p2_b;
    gm_vlayer_t *layers;
    void *abuf;
    float *pix, *patches, *h, *xn, *qkv, *attn, *mlp, *sel, *p1, *p2;
};

static int vit_weights(gm_vit_t *v, winit_t *w)
{
    const gm_vit_cfg_t *c = &v->c;
    size_t VH = c->hidden, VI = c->inter, F = (size_t)3 * c->patch * c->patch, P = c->proj;
    int rc = PRISM_OK;
    float sh = 1.0f / sqrtf((float)VH), si = 1.0f / sqrtf((float)VI), sf = 1.0f / sqrtf((float)F);
    v->patch_w = wtake(w, VH * F, v->wdt, sf, 0.0f, &rc);
    v->cls = wtake(w, VH, PRISM_DTYPE_F32, 0.5f, 0.0f, &rc);
    v->pos = wtake(w, (size_t)v->seq * VH, PRISM_DTYPE_F32, 0.1f, 0.0f, &rc);
    v->pre_w = wtake(w, VH, PRISM_DTYPE_F32, 0.1f, 1.0f, &rc);
    v->pre_b = wtake(w, VH, PRISM_DTYPE_F32, 0.1f, 0.0f, &rc);
    for (int L = 0; L < c->n_layers; L++) {
        gm_vlayer_t *ly = &v->layers[L];
        ly->ln1_w = wtake(w, VH, PRISM_DTYPE_F32, 0.1f, 1.0f, &rc);
        ly->ln1_b = wtake(w, VH, PRISM_DTYPE_F32, 0.1f, 0.0f, &rc);
        ly->ln2_w = wtake(w, VH, PRISM_DTYPE_F32, 0.1f, 1.0f, &rc);
        ly->ln2_b = wtake(w, VH, PRISM_DTYPE_F32, 0.1f, 0.0f, &rc);
        ly->wqkv = wtake(w, 3 * VH * VH, v->wdt, sh, 0.0f, &rc);
        ly->bqkv = wtake(w, 3 * VH, PRISM_DTYPE_F32, 0.1f, 0.0f, &rc);
        ly->wo = wtake(w, VH * VH, v->wdt, sh, 0.0f, &rc);
        ly->bo = wtake(w, VH, PRISM_DTYPE_F32, 0.1f, 0.0f, &rc);
        ly->fc1 = wtake(w, VI * VH, v->wdt, sh, 0.0f, &rc);
        ly->fc1_b = wtake(w, VI, PRISM_DTYPE_F32, 0.1f, 0.0f, &rc);
        ly->fc2 = wtake(w, VH * VI, v->wdt, si, 0.0f, &rc);
        ly->fc2_b = wtake(w, VH, PRISM_DTYPE_F32, 0.1f, 0.0f, &rc);
    }
    v->p1_w = wtake(w, P * VH, v->wdt, sh, 0.0f, &rc);
    v->p1_b = wtake(w, P, PRISM_DTYPE_F32, 0.1f, 0.0f, &rc);
    v->p2_w = wtake(w, P * P, v->wdt, 1.0f / sqrtf((float)P), 0.0f, &rc);
    v->p2_b = wtake(w, P, PRISM_DTYPE_F32, 0.1f, 0.0f, &rc);
    return rc;
}

int gm_vit_create(prism_backend_t *be, const gm_vit_cfg_t *c, uint64_t seed, bool device_init, int max_images,
                  gm_vit_t **out)
{
    *out = NULL;
    gm_vit_t *v = calloc(1, sizeof *v);
    if (!v) return PRISM_ENOMEM;
    v->be = be;
    v->c = *c;
    v->wdt = be->weight_dtype;
    v->max_images = max_images;
    int g = c->image / c->patch;
    v->np = g * g;
    v->seq = v->np + 1;
    v->layers = calloc((size_t)c->n_layers, sizeof *v->layers);
    int rc = PRISM_ENOMEM;
    if (!v->layers) goto fail;
    winit_t w = {be, seed, device_init, NULL, 0, NULL, 0};
    vit_weights(v, &w);
    v->wbytes = w.off;
    v->wbuf = prism_backend_alloc(be, v->wbytes);
    if (!v->wbuf) goto fail;
    w.base = v->wbuf;
    w.off = 0;
    w.host_n = (size_t)1 << 22;
    w.host = device_init ? NULL : malloc(w.host_n * sizeof(float));
    if (!device_init && !w.host) goto fail;
    rc = vit_weights(v, &w);
    free(w.host);
    if (rc) goto fail;
    size_t B = max_images, VH = c->hidden, T = B * v->seq, F = (size_t)3 * c->patch * c->patch;
    size_t sizes[] = {B * 3 * c->image * c->image, B * v->np * F, T * VH, T * VH, T * 3 * VH, T * VH,
                      T * (size_t)c->inter, B * v->np * VH, B * v->np * (size_t)c->proj, B * v->np * (size_t)c->proj};
    size_t total = 0;
    for (size_t i = 0; i < 10; i++) total += (sizes[i] * 4 + ALIGN - 1) / ALIGN * ALIGN;
    rc = PRISM_ENOMEM;
    v->abuf = prism_backend_alloc(be, total);
    if (!v->abuf) goto fail;
    uint8_t *p = v->abuf;
    float **dst[] = {&v->pix, &v->patches, &v->h, &v->xn, &v->qkv, &v->attn, &v->mlp, &v->sel, &v->p1, &v->p2};
    for (size_t i = 0; i < 10; i++) {
        *dst[i] = (float *)p;
        p += (sizes[i] * 4 + ALIGN - 1) / ALIGN * ALIGN;
    }
    *out = v;
    return PRISM_OK;
fail:
    gm_vit_free(v);
    return rc;
}

void gm_vit_free(gm_vit_t *v)
{
    if (!v) return;
    prism_backend_free(v->be, v->wbuf);
    prism_backend_free(v->be, v->abuf);
    free(v->layers);
    free(v);
}

size_t gm_vit_weight_bytes(const gm_vit_t *v) { return v->wbytes; }

int gm_vit_encode(gm_vit_t *v, const float *pixels, int n, float *out)
{
    const gm_vit_cfg_t *c = &v->c;
    const prism_backend_i *o = &v->be->i;
    void *bx = v->be->ctx;
    if (n <= 0 || n > v->max_images) return PRISM_ELIMIT;
    const int B = n, VH = c->hidden, VI = c->inter, P = c->patch, S = c->image, np = v->np, seq = v->seq;
    const int T = B * seq, feat = 3 * P * P, hd = VH / c->heads, PJ = c->proj;
    if (pixels) CK(o->upload(bx, v->pix, pixels, (size_t)B * 3 * S * S * 4));
    CK(o->im2patch(bx, v->patches, v->pix, B, 3, S, S, P));
    CK(o->matmul(bx, v->xn, VH, v->patches, feat, v->patch_w, v->wdt, NULL, B * np, VH, feat, false));
    for (int i = 0; i < B; i++) {   /* CLS, then the patch rows, per image (as vision.c) */
        float *img = v->h + (size_t)i * seq * VH;
        CK(o->copy(bx, img, v->cls, (size_t)VH * 4));
        CK(o->copy(bx, img + VH, v->xn + (size_t)i * np * VH, (size_t)np * VH * 4));
    }
    CK(o->add(bx, v->h, v->h, v->pos, (size_t)T * VH, (size_t)seq * VH));
    CK(o->layernorm(bx, v->h, v->h, v->pre_w, v->pre_b, T, VH, c->eps));
    float scale = 1.0f / sqrtf((float)hd);
    for (int L = 0; L < c->n_layers; L++) {
        const gm_vlayer_t *ly = &v->layers[L];
        CK(o->layernorm(bx, v->xn, v->h, ly->ln1_w, ly->ln1_b, T, VH, c->eps));
        CK(o->matmul(bx, v->qkv, 3 * VH, v->xn, VH, ly->wqkv, v->wdt, ly->bqkv, T, 3 * VH, VH, false));
        CK(o->attn_dense(bx, v->attn, VH, v->qkv, 3 * VH, v->qkv + VH, 3 * VH, v->qkv + 2 * VH, 3 * VH, B, seq,
                         c->heads, c->heads, hd, scale, false));
        CK(o->matmul(bx, v->h, VH, v->attn, VH, ly->wo, v->wdt, ly->bo, T, VH, VH, true));
        CK(o->layernorm(bx, v->xn, v->h, ly->ln2_w, ly->ln2_b, T, VH, c->eps));
        CK(o->matmul(bx, v->mlp, VI, v->xn, VH, ly->fc1, v->wdt, ly->fc1_b, T, VI, VH, false));
        CK(o->act(bx, PRISM_ACT_QUICK_GELU, v->mlp, v->mlp, (size_t)T * VI));
        CK(o->matmul(bx, v->h, VH, v->mlp, VI, ly->fc2, v->wdt, ly->fc2_b, T, VH, VI, true));
    }
    CK(o->copy_2d(bx, v->sel, (size_t)np * VH * 4, v->h + VH, (size_t)seq * VH * 4, (size_t)np * VH * 4, (size_t)B));
    int R = B * np;
    CK(o->matmul(bx, v->p1, PJ, v->sel, VH, v->p1_w, v->wdt, v->p1_b, R, PJ, VH, false));
    CK(o->act(bx, PRISM_ACT_GELU_ERF, v->p1, v->p1, (size_t)R * PJ));
    CK(o->matmul(bx, v->p2, PJ, v->p1, PJ, v->p2_w, v->wdt, v->p2_b, R, PJ, PJ, false));
    if (out) CK(o->download(bx, out, v->p2, (size_t)R * PJ * 4));
    return o->synchronize(bx);
}
