/* Language model (Llama / Qwen2 / Mistral / Llama-4 decoder) over the paged KV cache.
 *
 * One forward handles a flattened batch: every sequence contributes q_len new tokens that attend
 * causally to its pos0 cached tokens plus themselves. Weights are fused where it saves passes
 * (q|k|v rows in one matrix, gate|up rows in one matrix); activations live in one arena sized
 * for (max_batch_tokens, max_seqs) at load, so forward never allocates.
 *
 * Each layer is driven by cfg.layer_flags (PRISM_LAYER_*): RoPE (NeoX or interleaved pairs), QK
 * norm, attention temperature, chunked attention, and a dense MLP or MoE. A MoE layer runs the
 * shared expert on every token, then routes: top-k sigmoid scores scale each token's expert INPUT,
 * the routed rows are grouped by expert (device-side), one GEMM per expert group, and the results
 * are summed back per token — no per-token host round trip.
 *
 * Tensor parallelism (cfg.tp_size > 1; the rules are in model.h, prism_tp_shard_t): the rank holds
 * its heads / columns / vocab rows, and a forward adds four kinds of collective: the vocab-parallel
 * embedding lookup is all-reduced; o_proj and the MLP (down, plus the routed experts) are
 * row-parallel, and their partial sums are all-reduced straight into the residual stream — rank 0
 * accumulates onto the stream (with the row-parallel biases), the other ranks overwrite it with
 * their partial, so the all-reduce leaves x + sum of partials on every rank, bit-identical; the
 * logits are all-gathered and reassembled into whole rows (in forward_end). Two all-reduces per
 * layer. A shard never drops cancelled sequences between layers (model.h, prism_model_hook_t). */
#include "model/model_impl.h"
#include "comm/comm.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)
#define MIN_BLOCK_SIZE_PLANNED 16   /* block tables are sized for blocks of >= 16 tokens */

typedef struct {
    float *attn_norm, *mlp_norm;  /* [hidden] */
    float *q_norm, *k_norm;       /* PRISM_LAYER_QK_RMS: [head_dim] per-head RMSNorm weights (Qwen3) */
    /* matmul weights below: [N][K] as commented, or the backend's packed layout of it (load_weights) */
    void *wqkv;                   /* [(n_heads + 2*n_kv)*head_dim][hidden]: q rows, k rows, v rows */
    float *bqkv;                  /* [(n_heads + 2*n_kv)*head_dim] or NULL */
    void *wo;                     /* [hidden][n_heads*head_dim] */
    float *bo;                    /* [hidden] or NULL */
    void *wgu;                    /* [2*I][hidden]: gate rows, then up rows (dense MLP, or the shared
                                   * expert of a MoE layer); I = dense_intermediate / intermediate */
    float *bgu;                   /* [2*I] or NULL */
    void *wdown;                  /* [hidden][I] */
    float *bdown;                 /* [hidden] or NULL */
    void *router;                 /* MoE: [n_experts][hidden] */
    void *exp_gu;                 /* MoE: [n_experts][hidden][2*intermediate] HF layout (x @ W), gate half first */
    void *exp_down;               /* MoE: [n_experts][intermediate][hidden] (x @ W) */
} llm_layer_t;

struct prism_llm {
    prism_backend_t *be;
    prism_model_config_t cfg;
    prism_dtype_t wdt;
    void *wbuf;                   /* the one weight allocation */
    size_t wbytes;
    void *embed;                  /* [vocab][hidden] */
    float *norm;                  /* [hidden] */
    void *lm_head;                /* [vocab][hidden]; == embed when tied (then never packed) */
    float *inv_freq;              /* [head_dim/2] */
    bool mrope;                   /* M-RoPE: rotary positions from meta mpos [3][T], rows per rsec */
    prism_rope_sections_t rsec;   /* M-RoPE: the position row (t, h, w) of each rotary pair */
    llm_layer_t *layers;          /* [n_layers] (host array of device pointers) */
    prism_tp_shard_t tp;          /* this rank's part (the whole model at T = 1) */
    struct prism_comm *comm;      /* collectives (T > 1) */
    size_t read_bytes;            /* checkpoint bytes read at load */

    int max_tokens, max_seqs;
    int lchunk;                   /* rows of logits computed per lm_head matmul */
    int table_cap;                /* int32 entries available for block tables */
    void *abuf;                   /* activation arena (device) */
    size_t abytes;
    float *x, *xn;                /* [T][hidden] residual stream, normed copy */
    float *qkv;                   /* [T][(nh+2nkv)*hd] */
    float *attn;                  /* [T][nh*hd] */
    float *gu;                    /* [T][2*ffn] (ffn: widest dense / shared-expert MLP) */
    float *act;                   /* [T][ffn] */
    float *qscale;                /* [T] attention temperature of each token (device) */
    float *h_qscale;              /* host mirror */
    /* MoE scratch (R = T * top_k routed rows); NULL without MoE layers */
    float *rlogits;               /* [T][n_experts] */
    int32_t *r_choice, *r_order, *r_slot;  /* [R] */
    int32_t *r_off;               /* [n_experts+1] */
    float *r_w;                   /* [R] router scores of the routed rows */
    float *xs;                    /* [R][hidden] scaled expert inputs, grouped by expert */
    float *gu2;                   /* [R][2*intermediate] */
    float *act2;                  /* [R][intermediate] */
    float *ys;                    /* [R][hidden] expert outputs */
    float *xsel;                  /* [S][hidden] last-token rows */
    /* DeepStack (cfg.n_deepstack > 0): the batch's image-token rows' feature levels and the tokens they
     * belong to; level k is added to the residual stream after layer k */
    float *ds_rows;               /* [T][n_deepstack * hidden] */
    int32_t *ds_tok;              /* [T] device: token of each row (-1 once its sequence left the batch) */
    int32_t *h_ds_tok;            /* host mirror */
    int n_ds;                     /* rows in ds_rows this forward */
    float *logits;                /* [lchunk][vocab] */
    float *llocal;                /* T > 1: [lchunk][vocab_stride] this rank's logits */
    float *lgather;               /* T > 1: [tp_size][lchunk][vocab_stride] everyone's */
    int32_t *d_meta;              /* device: ids[T] pos[T] slots[T] seq_start[S+1] pos0[S] rows[S] tables[cap] lids[T]
                                   * lslots[T] ltables[cap] (the last two: chunked layers of a split cache)
                                   * mpos[3][T] (M-RoPE models) */
    int32_t *h_meta;              /* host mirror, same layout */
    int32_t *h_meta2;             /* host scratch: the mirror rebuilt when sequences drop out */
    size_t meta_n;
    const prism_model_hook_t *hook;
    /* the forward between begin and end */
    bool f_open;
    int f_T, f_S, f_S0;           /* tokens and sequences left; sequences at begin */
    bool f_all_logits;
    bool f_split;                 /* the chunked layers use the sequences' rings of a split cache */
    float *f_x, *f_xn;            /* residual stream and spare (they swap when sequences drop out) */
    int32_t *f_rows;              /* device: last-token row of each sequence */
    const int32_t *f_seq_start;   /* host: [f_S+1] */
    int32_t *keep;                /* [max_seqs] caller's index of each sequence still in the batch */
    int32_t *ostart;              /* [max_seqs+1] caller's seq_start (row mapping of all_logits) */
    uint8_t *gone;                /* [max_seqs] scratch of the between-layer check */
};

struct prism_kv_cache {
    prism_backend_t *be;
    int n_layers, n_kv, head_dim, n_blocks, block_size;
    int n_local_blocks;           /* split cache: the chunked layers' own pool; 0: they use the block ids
                                   * of the others (one pool, every layer) */
    size_t lbb;                   /* bytes of one block of K (or V) in one layer */
    uint8_t *buf;                 /* per layer [2][its pool's blocks][block_size][n_kv][head_dim] f32 */
    size_t *layer_off;            /* [n_layers] where each layer's K starts in buf */
    int *layer_blocks;            /* [n_layers] blocks of the pool the layer uses */
    uint8_t *local;               /* [n_layers] 1: a chunked layer (PRISM_KV_CLASS_LOCAL) */
};

/* ---------------------------------------------------------------- sizing */

static prism_tp_shard_t shard_of(const prism_model_config_t *c)
{
    prism_tp_shard_t s;
    int rc = prism_tp_shard(c, c->tp_size > 1 ? c->tp_size : 1, c->tp_size > 1 ? c->tp_rank : 0, &s, NULL, 0);
    PRISM_ASSERT(rc == PRISM_OK);   /* prism_model_config_set_tp validated it */
    return s;
}

/* Rows of this rank's fused q|k|v output. */
static int qkv_dim(const prism_tp_shard_t *s, const prism_model_config_t *c)
{
    return (s->n_heads + 2 * s->n_kv_heads) * c->head_dim;
}

static bool any_layer(const prism_model_config_t *c, int flag)
{
    for (int i = 0; i < c->n_layers; i++)
        if (c->layer_flags[i] & flag) return true;
    return false;
}

/* Widest MLP run on all T tokens (this rank's columns): dense layers (dense_intermediate) or
 * shared experts (intermediate). */
static size_t ffn_width(const prism_tp_shard_t *s, const prism_model_config_t *c)
{
    size_t w = 0;
    for (int i = 0; i < c->n_layers; i++) {
        size_t li = (c->layer_flags[i] & PRISM_LAYER_MOE) ? (size_t)s->n_eff : (size_t)s->n_ffn;
        if (li > w) w = li;
    }
    return w;
}

static int logits_chunk(int T, int S)
{
    int l = PRISM_MAX(S, 32);
    return PRISM_MIN(l, PRISM_MAX(T, S));
}

static int table_capacity(const prism_model_config_t *c, int S)
{
    int per_seq = (c->max_pos + MIN_BLOCK_SIZE_PLANNED - 1) / MIN_BLOCK_SIZE_PLANNED;
    return S * per_seq;
}

static size_t meta_count(const prism_model_config_t *c, int T, int S)
{
    size_t n = (size_t)4 * T + (size_t)(S + 1) + 2 * (size_t)S + (size_t)table_capacity(c, S);
    if (any_layer(c, PRISM_LAYER_CHUNKED) || prism_model_mrope(c))
        n += (size_t)T + (size_t)table_capacity(c, S);   /* split caches (and the place of what follows) */
    if (prism_model_mrope(c)) n += (size_t)3 * T;        /* M-RoPE positions */
    return n;
}

/* Carves the arena (or sizes it when m->abuf is NULL). */
static size_t llm_layout(const prism_model_config_t *c, int T, int S, struct prism_llm *m)
{
    prism_layout_t l = {m ? m->abuf : NULL, 0};
    prism_tp_shard_t sh = shard_of(c);
    size_t H = (size_t)c->hidden, I = ffn_width(&sh, c);
    float *x = prism_layout_take(&l, (size_t)T * H * 4);
    float *xn = prism_layout_take(&l, (size_t)T * H * 4);
    float *qkv = prism_layout_take(&l, (size_t)T * qkv_dim(&sh, c) * 4);
    float *attn = prism_layout_take(&l, (size_t)T * sh.n_heads * c->head_dim * 4);
    float *gu = prism_layout_take(&l, (size_t)T * 2 * I * 4);
    float *act = prism_layout_take(&l, (size_t)T * I * 4);
    float *qscale = any_layer(c, PRISM_LAYER_TEMP) ? prism_layout_take(&l, (size_t)T * 4) : NULL;
    float *rlogits = NULL, *r_w = NULL, *xs = NULL, *gu2 = NULL, *act2 = NULL, *ys = NULL;
    int32_t *r_choice = NULL, *r_order = NULL, *r_slot = NULL, *r_off = NULL;
    if (any_layer(c, PRISM_LAYER_MOE)) {
        size_t R = (size_t)T * c->top_k, E = (size_t)c->n_experts, EI = (size_t)sh.n_eff;
        rlogits = prism_layout_take(&l, (size_t)T * E * 4);
        r_choice = prism_layout_take(&l, R * 4);
        r_order = prism_layout_take(&l, R * 4);
        r_slot = prism_layout_take(&l, R * 4);
        r_off = prism_layout_take(&l, (E + 1) * 4);
        r_w = prism_layout_take(&l, R * 4);
        xs = prism_layout_take(&l, R * H * 4);
        gu2 = prism_layout_take(&l, R * 2 * EI * 4);
        act2 = prism_layout_take(&l, R * EI * 4);
        ys = prism_layout_take(&l, R * H * 4);
    }
    float *xsel = prism_layout_take(&l, (size_t)S * H * 4);
    float *ds_rows = NULL;
    int32_t *ds_tok = NULL;
    if (c->n_deepstack > 0) {
        ds_rows = prism_layout_take(&l, (size_t)T * c->n_deepstack * H * 4);
        ds_tok = prism_layout_take(&l, (size_t)T * 4);
    }
    size_t lc = (size_t)logits_chunk(T, S);
    float *logits = prism_layout_take(&l, lc * c->vocab * 4);
    float *llocal = NULL, *lgather = NULL;
    if (sh.size > 1) {
        llocal = prism_layout_take(&l, lc * sh.vocab_stride * 4);
        lgather = prism_layout_take(&l, (size_t)sh.size * lc * sh.vocab_stride * 4);
    }
    int32_t *meta = prism_layout_take(&l, meta_count(c, T, S) * 4);
    if (m && m->abuf) {
        m->x = x; m->xn = xn; m->qkv = qkv; m->attn = attn; m->gu = gu; m->act = act; m->qscale = qscale;
        m->rlogits = rlogits; m->r_choice = r_choice; m->r_order = r_order; m->r_slot = r_slot; m->r_off = r_off;
        m->r_w = r_w; m->xs = xs; m->gu2 = gu2; m->act2 = act2; m->ys = ys;
        m->xsel = xsel; m->logits = logits; m->llocal = llocal; m->lgather = lgather; m->d_meta = meta;
        m->ds_rows = ds_rows; m->ds_tok = ds_tok;
    }
    return PRISM_ALIGN_UP(l.off, PRISM_TENSOR_ALIGN);
}

size_t prism_llm_arena_bytes(const prism_model_config_t *cfg, int max_batch_tokens, int max_seqs)
{
    if (max_batch_tokens <= 0 || max_seqs <= 0) return 0;
    return llm_layout(cfg, max_batch_tokens, max_seqs, NULL);
}

size_t prism_llm_host_bytes(const prism_model_config_t *cfg, int max_batch_tokens, int max_seqs)
{
    if (max_batch_tokens <= 0 || max_seqs <= 0) return 0;
    size_t T = (size_t)max_batch_tokens, S = (size_t)max_seqs;
    /* as prism_llm_load allocates them: m, m->layers, h_meta + h_meta2, keep, ostart, gone, h_qscale
     * (and DeepStack's h_ds_tok) */
    return sizeof(struct prism_llm) + (size_t)cfg->n_layers * sizeof(llm_layer_t) +
           2 * meta_count(cfg, max_batch_tokens, max_seqs) * sizeof(int32_t) + S * sizeof(int32_t) +
           (S + 1) * sizeof(int32_t) + S + T * sizeof(float) + (cfg->n_deepstack > 0 ? T * sizeof(int32_t) : 0);
}

/* ---------------------------------------------------------------- weights */

static const char *const k_text_prefixes[] = {"language_model.model.", "model.language_model.", "model.", ""};

/* Loads this rank's part of every tensor (the whole tensor at T = 1): row slices (q/k/v, gate/up,
 * embedding and lm_head rows, expert down rows) and column slices (o_proj, down, expert gate/up
 * columns) are read straight from the checkpoint; norms, biases of row-parallel layers and the MoE
 * router are replicated. The weights only matmul reads (qkv, o, gate/up, down, router, an untied
 * lm_head) then go into the backend's matmul layout (prism_wload_pack_matmul: the CPU's packed
 * panels under --compute-dtype bf16, [N][K] elsewhere); the embedding table, which get_rows reads
 * (and a tied lm_head with it), and the grouped experts stay [N][K]. */
static int load_weights(struct prism_llm *m, prism_wload_t *w, const char *pfx, const char *head_name)
{
    const prism_model_config_t *c = &m->cfg;
    const prism_tp_shard_t *sh = &m->tp;
    prism_dtype_t wdt = m->wdt;
    int64_t H = c->hidden, V = c->vocab, hd = c->head_dim, E = c->n_experts, EI = c->intermediate;
    int64_t nq = (int64_t)c->n_heads * hd, nkv = (int64_t)c->n_kv_heads * hd;
    /* this rank's rows of q, k, v (in elements of the projection's output) */
    int64_t q0 = (int64_t)sh->head0 * hd, nq_l = (int64_t)sh->n_heads * hd;
    int64_t k0 = (int64_t)sh->kv_head0 * hd, nkv_l = (int64_t)sh->n_kv_heads * hd;
    const prism_wload_range_t vrows = {sh->vocab0, sh->vocab0 + sh->n_vocab};
    const prism_wload_range_t qr = {q0, q0 + nq_l}, kr = {k0, k0 + nkv_l};
    const prism_wload_range_t er = {sh->eff0, sh->eff0 + sh->n_eff};
    const prism_wload_range_t egu[2] = {{sh->eff0, sh->eff0 + sh->n_eff}, {EI + sh->eff0, EI + sh->eff0 + sh->n_eff}};
    char name[256];
    int rc;
#define NAME(...) (snprintf(name, sizeof name, __VA_ARGS__), name)
#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
    if ((rc = prism_wload_tensor_slice(w, &m->embed, wdt, NAME("%sembed_tokens.weight", pfx), 2, SHAPE(V, H), 0, 1, &vrows))) return rc;
    if ((rc = prism_wload_tensor(w, (void **)&m->norm, PRISM_DTYPE_F32, NAME("%snorm.weight", pfx), 1, SHAPE(H)))) return rc;
    if (c->tie_word_embeddings && !head_name) {
        m->lm_head = m->embed;
    } else {
        if (!head_name) {
            if (w->err && w->errlen)
                snprintf(w->err, w->errlen, "weights: lm_head.weight not found (and tie_word_embeddings is false)");
            return PRISM_ENOTFOUND;
        }
        m->lm_head = prism_wload_reserve_matmul(w, sh->n_vocab, H);
        if ((rc = prism_wload_fill_slice(w, m->lm_head, wdt, head_name, 2, SHAPE(V, H), 0, 1, &vrows)) ||
            (rc = prism_wload_pack_matmul(w, m->lm_head, sh->n_vocab, H)))
            return rc;
    }
    size_t es = prism_dtype_size(wdt);
    for (int L = 0; L < c->n_layers; L++) {
        llm_layer_t *ly = &m->layers[L];
        char p[128];
        snprintf(p, sizeof p, "%slayers.%d.", pfx, L);
        if ((rc = prism_wload_tensor(w, (void **)&ly->attn_norm, PRISM_DTYPE_F32, NAME("%sinput_layernorm.weight", p), 1, SHAPE(H)))) return rc;
        if ((rc = prism_wload_tensor(w, (void **)&ly->mlp_norm, PRISM_DTYPE_F32, NAME("%spost_attention_layernorm.weight", p), 1, SHAPE(H)))) return rc;
        ly->wqkv = prism_wload_reserve_matmul(w, nq_l + 2 * nkv_l, H);
        uint8_t *q = ly->wqkv;
        if ((rc = prism_wload_fill_slice(w, q, wdt, NAME("%sself_attn.q_proj.weight", p), 2, SHAPE(nq, H), 0, 1, &qr))) return rc;
        if ((rc = prism_wload_fill_slice(w, q ? q + nq_l * H * es : NULL, wdt, NAME("%sself_attn.k_proj.weight", p), 2, SHAPE(nkv, H), 0, 1, &kr))) return rc;
        if ((rc = prism_wload_fill_slice(w, q ? q + (nq_l + nkv_l) * H * es : NULL, wdt, NAME("%sself_attn.v_proj.weight", p), 2, SHAPE(nkv, H), 0, 1, &kr))) return rc;
        if ((rc = prism_wload_pack_matmul(w, ly->wqkv, nq_l + 2 * nkv_l, H))) return rc;
        if (c->attention_bias) {
            ly->bqkv = prism_wload_reserve(w, (size_t)(nq_l + 2 * nkv_l) * 4);
            float *b = ly->bqkv;
            if ((rc = prism_wload_fill_slice(w, b, PRISM_DTYPE_F32, NAME("%sself_attn.q_proj.bias", p), 1, SHAPE(nq), 0, 1, &qr))) return rc;
            if ((rc = prism_wload_fill_slice(w, b ? b + nq_l : NULL, PRISM_DTYPE_F32, NAME("%sself_attn.k_proj.bias", p), 1, SHAPE(nkv), 0, 1, &kr))) return rc;
            if ((rc = prism_wload_fill_slice(w, b ? b + nq_l + nkv_l : NULL, PRISM_DTYPE_F32, NAME("%sself_attn.v_proj.bias", p), 1, SHAPE(nkv), 0, 1, &kr))) return rc;
        }
        ly->wo = prism_wload_reserve_matmul(w, H, nq_l);
        if ((rc = prism_wload_fill_slice(w, ly->wo, wdt, NAME("%sself_attn.o_proj.weight", p), 2, SHAPE(H, nq), 1, 1, &qr)) ||
            (rc = prism_wload_pack_matmul(w, ly->wo, H, nq_l)))
            return rc;
        if (c->o_bias &&
            (rc = prism_wload_tensor(w, (void **)&ly->bo, PRISM_DTYPE_F32, NAME("%sself_attn.o_proj.bias", p), 1, SHAPE(H)))) return rc;
        if (c->layer_flags[L] & PRISM_LAYER_QK_RMS) {   /* replicated: every rank norms its own heads */
            if ((rc = prism_wload_tensor(w, (void **)&ly->q_norm, PRISM_DTYPE_F32, NAME("%sself_attn.q_norm.weight", p), 1,
                                         SHAPE(hd)))) return rc;
            if ((rc = prism_wload_tensor(w, (void **)&ly->k_norm, PRISM_DTYPE_F32, NAME("%sself_attn.k_norm.weight", p), 1,
                                         SHAPE(hd)))) return rc;
        }
        /* The MLP: Llama's mlp.*, Llama-4's feed_forward.* (dense) or feed_forward.shared_expert.* */
        bool moe = c->layer_flags[L] & PRISM_LAYER_MOE;
        int64_t I = moe ? EI : c->dense_intermediate;
        prism_wload_range_t fr = moe ? er : (prism_wload_range_t){sh->ffn0, sh->ffn0 + sh->n_ffn};
        int64_t I_l = fr.hi - fr.lo;
        char f[160];
        bool l4_names = strncmp(c->arch, "llama4", 6) == 0;   /* Llama-4 checkpoints say feed_forward */
        snprintf(f, sizeof f, "%s%s", p, l4_names ? (moe ? "feed_forward.shared_expert." : "feed_forward.") : "mlp.");
        ly->wgu = prism_wload_reserve_matmul(w, 2 * I_l, H);
        uint8_t *g = ly->wgu;
        if ((rc = prism_wload_fill_slice(w, g, wdt, NAME("%sgate_proj.weight", f), 2, SHAPE(I, H), 0, 1, &fr))) return rc;
        if ((rc = prism_wload_fill_slice(w, g ? g + I_l * H * es : NULL, wdt, NAME("%sup_proj.weight", f), 2, SHAPE(I, H), 0, 1, &fr))) return rc;
        if ((rc = prism_wload_pack_matmul(w, ly->wgu, 2 * I_l, H))) return rc;
        ly->wdown = prism_wload_reserve_matmul(w, H, I_l);
        if ((rc = prism_wload_fill_slice(w, ly->wdown, wdt, NAME("%sdown_proj.weight", f), 2, SHAPE(H, I), 1, 1, &fr)) ||
            (rc = prism_wload_pack_matmul(w, ly->wdown, H, I_l)))
            return rc;
        if (c->mlp_bias) {
            ly->bgu = prism_wload_reserve(w, (size_t)2 * I_l * 4);
            if ((rc = prism_wload_fill_slice(w, ly->bgu, PRISM_DTYPE_F32, NAME("%sgate_proj.bias", f), 1, SHAPE(I), 0, 1, &fr))) return rc;
            if ((rc = prism_wload_fill_slice(w, ly->bgu ? ly->bgu + I_l : NULL, PRISM_DTYPE_F32, NAME("%sup_proj.bias", f), 1, SHAPE(I), 0, 1, &fr))) return rc;
            if ((rc = prism_wload_tensor(w, (void **)&ly->bdown, PRISM_DTYPE_F32, NAME("%sdown_proj.bias", f), 1, SHAPE(H)))) return rc;
        }
        if (moe) {
            ly->router = prism_wload_reserve_matmul(w, E, H);
            if ((rc = prism_wload_fill(w, ly->router, wdt, NAME("%sfeed_forward.router.weight", p), 2, SHAPE(E, H))) ||
                (rc = prism_wload_pack_matmul(w, ly->router, E, H)))
                return rc;
            /* gate_up_proj [E][H][2*EI]: this rank's gate columns then its up columns, per row */
            if ((rc = prism_wload_tensor_slice(w, &ly->exp_gu, wdt, NAME("%sfeed_forward.experts.gate_up_proj", p), 3,
                                               SHAPE(E, H, 2 * EI), 2, 2, egu))) return rc;
            if ((rc = prism_wload_tensor_slice(w, &ly->exp_down, wdt, NAME("%sfeed_forward.experts.down_proj", p), 3,
                                               SHAPE(E, EI, H), 1, 1, &er))) return rc;
        }
    }
    m->inv_freq = prism_wload_reserve(w, (size_t)(hd / 2) * 4);
#undef NAME
#undef SHAPE
    return PRISM_OK;
}

int prism_llm_load(prism_backend_t *be, const prism_model_config_t *cfg, const char *model_dir,
                   int max_batch_tokens, int max_seqs, prism_llm_t **out, char *err, size_t errlen)
{
    *out = NULL;
    if (max_batch_tokens <= 0 || max_seqs <= 0 || max_seqs > max_batch_tokens || max_batch_tokens > (1 << 24)) {
        ERR("llm: bad limits (max_batch_tokens %d, max_seqs %d)", max_batch_tokens, max_seqs);
        return PRISM_EINVAL;
    }
    if (cfg->n_layers < 1 || cfg->n_layers > PRISM_MODEL_MAX_LAYERS) {
        ERR("llm: bad layer count %d", cfg->n_layers);
        return PRISM_EINVAL;
    }
    if (((any_layer(cfg, PRISM_LAYER_QK_NORM) || any_layer(cfg, PRISM_LAYER_QK_RMS)) && !be->i.head_rmsnorm) ||
        (cfg->n_deepstack > 0 && !be->i.add_rows) ||
        (any_layer(cfg, PRISM_LAYER_TEMP) && !be->i.scale_rows) ||
        (any_layer(cfg, PRISM_LAYER_MOE) &&
         (!be->i.moe_route || !be->i.matmul_grouped || !be->i.moe_combine || !be->i.scale_rows)) ||
        (prism_model_mrope(cfg) && !be->i.rope_multi)) {
        ERR("llm: the %s backend lacks the ops %s needs", be->device, cfg->arch);
        return PRISM_ENOTSUP;
    }
    prism_tp_shard_t shard;
    {
        int trc = prism_tp_shard(cfg, cfg->tp_size > 1 ? cfg->tp_size : 1, cfg->tp_size > 1 ? cfg->tp_rank : 0, &shard,
                                 err, errlen);
        if (trc != PRISM_OK) return trc;
    }
    prism_st_t *st = NULL;
    struct prism_llm *m = prism_calloc(1, sizeof *m);
    prism_wload_t w = {0};
    int rc = PRISM_ENOMEM;
    if (!m) goto fail;
    m->be = be;
    m->cfg = *cfg;
    m->wdt = be->weight_dtype;
    m->max_tokens = max_batch_tokens;
    m->max_seqs = max_seqs;
    m->tp = shard;
    m->mrope = prism_model_mrope(cfg);
    if (m->mrope) {
        /* M-RoPE: pairs [0, s0) turn with the t row, the next s1 with h, the next s2 with w */
        int s0 = cfg->mrope_section[0], s1 = cfg->mrope_section[1], half = cfg->head_dim / 2;
        if (s0 + s1 + cfg->mrope_section[2] != half || half > PRISM_ROPE_MAX_PAIRS) {
            ERR("llm: mrope_section does not cover the %d rotary pairs", half);
            rc = PRISM_EINVAL;
            goto fail;
        }
        int s2 = cfg->mrope_section[2];
        for (int j = 0; j < half; j++)
            m->rsec.of[j] = cfg->mrope_interleaved   /* Qwen3-VL: t h w t h w ..., t past the sections */
                                ? (uint8_t)(j % 3 == 1 && j < 3 * s1 ? 1 : j % 3 == 2 && j < 3 * s2 ? 2 : 0)
                                : (uint8_t)(j < s0 ? 0 : j < s0 + s1 ? 1 : 2);
    }
    m->layers = prism_calloc((size_t)cfg->n_layers, sizeof *m->layers);
    if (!m->layers) goto fail;
    const char *pfx = "model.", *head = cfg->tie_word_embeddings ? NULL : "lm_head.weight";
    if (!cfg->random_weights) {
        rc = prism_st_open_dir(model_dir, &st, err, errlen);
        if (rc != PRISM_OK) goto fail;
        pfx = prism_wload_find_prefix(st, k_text_prefixes, (int)PRISM_ARRAY_LEN(k_text_prefixes), "embed_tokens.weight");
        if (!pfx) {
            ERR("weights: no embed_tokens.weight under any known prefix in %s", model_dir);
            rc = PRISM_ENOTFOUND;
            goto fail;
        }
        head = prism_st_find(st, "language_model.lm_head.weight") ? "language_model.lm_head.weight"
             : prism_st_find(st, "lm_head.weight") ? "lm_head.weight" : NULL;
    }
    double t0 = prism_now_s();
    w = (prism_wload_t){.be = be, .st = st, .err = err, .errlen = errlen, .random = cfg->random_weights,
                        .seed = cfg->random_seed};
    if ((rc = load_weights(m, &w, pfx, head)) != PRISM_OK) goto fail;   /* pass 1: validate + size */
    if ((rc = prism_wload_begin_upload(&w, &m->wbuf, &m->wbytes)) != PRISM_OK) goto fail;
    if ((rc = load_weights(m, &w, pfx, head)) != PRISM_OK) goto fail;   /* pass 2: upload */
    {
        int half = cfg->head_dim / 2;
        float inv[512];
        prism_model_rope_inv_freq(cfg, inv);
        if ((rc = be->i.upload(be->ctx, m->inv_freq, inv, (size_t)half * 4)) != PRISM_OK) goto fail;
    }
    prism_free(w.staging);
    w.staging = NULL;
    prism_st_close(st);
    st = NULL;
    m->read_bytes = w.read_bytes;

    m->lchunk = logits_chunk(max_batch_tokens, max_seqs);
    m->table_cap = table_capacity(cfg, max_seqs);
    m->meta_n = meta_count(cfg, max_batch_tokens, max_seqs);
    m->abytes = llm_layout(cfg, max_batch_tokens, max_seqs, NULL);
    m->abuf = prism_backend_buf_alloc(be, m->abytes);
    m->h_meta = prism_malloc(m->meta_n * sizeof(int32_t));
    m->h_meta2 = prism_malloc(m->meta_n * sizeof(int32_t));
    m->keep = prism_malloc((size_t)max_seqs * sizeof(int32_t));
    m->ostart = prism_malloc(((size_t)max_seqs + 1) * sizeof(int32_t));
    m->gone = prism_malloc((size_t)max_seqs);
    m->h_qscale = prism_malloc((size_t)max_batch_tokens * sizeof(float));
    if (cfg->n_deepstack > 0) m->h_ds_tok = prism_malloc((size_t)max_batch_tokens * sizeof(int32_t));
    if (!m->abuf || !m->h_meta || !m->h_meta2 || !m->keep || !m->ostart || !m->gone || !m->h_qscale ||
        (cfg->n_deepstack > 0 && !m->h_ds_tok)) {
        char b[32];
        ERR("llm: cannot allocate the %s activation arena", prism_fmt_bytes(m->abytes, b, sizeof b));
        rc = PRISM_ENOMEM;
        goto fail;
    }
    llm_layout(cfg, max_batch_tokens, max_seqs, m);
    {
        char a[32], b[32];
        char packed[48] = "";
        if (w.n_packed) snprintf(packed, sizeof packed, ", %d matmul weights packed", w.n_packed);
        PRISM_INFO("llm: %s weights (%d tensors, %s%s) + %s arena for %d tokens / %d seqs in %.2fs%s",
                   cfg->arch, w.n_tensors, prism_fmt_bytes(m->wbytes, a, sizeof a), packed,
                   prism_fmt_bytes(m->abytes, b, sizeof b), max_batch_tokens, max_seqs, prism_now_s() - t0,
                   shard.size > 1 ? " (tensor-parallel shard)" : "");
        if (shard.size > 1)
            PRISM_INFO("llm: rank %d of %d: query heads [%d,%d), KV heads [%d,%d) (each on %d rank(s)), vocab [%d,%d), "
                       "MLP columns [%d,%d), expert columns [%d,%d)", shard.rank, shard.size, shard.head0,
                       shard.head0 + shard.n_heads, shard.kv_head0, shard.kv_head0 + shard.n_kv_heads, shard.kv_replicas,
                       shard.vocab0, shard.vocab0 + shard.n_vocab, shard.ffn0, shard.ffn0 + shard.n_ffn, shard.eff0,
                       shard.eff0 + shard.n_eff);
    }
    *out = m;
    return PRISM_OK;
fail:
    prism_free(w.staging);
    prism_st_close(st);
    prism_llm_free(m);
    return rc;
}

void prism_llm_free(prism_llm_t *m)
{
    if (!m) return;
    prism_backend_buf_free(m->be, m->wbuf);
    prism_backend_buf_free(m->be, m->abuf);
    prism_free(m->h_meta);
    prism_free(m->h_meta2);
    prism_free(m->keep);
    prism_free(m->ostart);
    prism_free(m->gone);
    prism_free(m->h_qscale);
    prism_free(m->h_ds_tok);
    prism_free(m->layers);
    prism_free(m);
}

size_t prism_llm_weight_bytes(const prism_llm_t *m) { return m->wbytes; }
size_t prism_llm_read_bytes(const prism_llm_t *m) { return m->read_bytes; }
const prism_tp_shard_t *prism_llm_shard(const prism_llm_t *m) { return &m->tp; }

int prism_llm_set_comm(prism_llm_t *m, struct prism_comm *comm)
{
    if (comm && (comm->size != m->tp.size || comm->rank != m->tp.rank)) {
        PRISM_ERROR("llm: a communicator of rank %d/%d for a shard of rank %d/%d", comm->rank, comm->size, m->tp.rank,
                    m->tp.size);
        return PRISM_EINVAL;
    }
    m->comm = comm;
    return PRISM_OK;
}
const prism_model_config_t *prism_llm_config(const prism_llm_t *m) { return &m->cfg; }

/* ---------------------------------------------------------------- KV cache */

/* Layers of a split cache's local pool: chunked attention never reads before its chunk. */
static bool layer_is_local(const prism_model_config_t *c, int L)
{
    return (c->layer_flags[L] & PRISM_LAYER_CHUNKED) && c->attention_chunk > 0;
}

static int class_layers(const prism_model_config_t *c, int cls)
{
    int n = 0;
    for (int L = 0; L < c->n_layers; L++) n += layer_is_local(c, L) == (cls == PRISM_KV_CLASS_LOCAL);
    return n;
}

size_t prism_kv_cache_block_bytes(const prism_model_config_t *c, int block_size)
{
    return (size_t)c->n_layers * 2 * (size_t)block_size * prism_model_local_kv_heads(c) * c->head_dim * sizeof(float);
}

size_t prism_kv_cache_class_block_bytes(const prism_model_config_t *c, int block_size, int cls)
{
    return (size_t)class_layers(c, cls) * 2 * (size_t)block_size * c->n_kv_heads * c->head_dim * sizeof(float);
}

int prism_kv_local_ring(const prism_model_config_t *c, int block_size, int max_q)
{
    if (!any_layer(c, PRISM_LAYER_CHUNKED) || c->attention_chunk <= 0 || block_size <= 0 || max_q <= 0) return 0;
    /* A step of q tokens at pos0 writes [pos0, pos0 + q) and its queries read from the chunk start of
     * pos0: at most chunk - 1 + q positions, spread over one block more than they fill. */
    return (c->attention_chunk - 1 + max_q + block_size - 1) / block_size + 1;
}

int prism_kv_local_first_block(const prism_model_config_t *c, int block_size, int n_tokens)
{
    if (!any_layer(c, PRISM_LAYER_CHUNKED) || c->attention_chunk <= 0) return (n_tokens + block_size - 1) / block_size;
    return n_tokens / c->attention_chunk * c->attention_chunk / block_size;
}

int prism_kv_cache_create_split(prism_backend_t *be, const prism_model_config_t *c, int n_blocks, int n_local_blocks,
                                int block_size, prism_kv_cache_t **out)
{
    *out = NULL;
    if (n_blocks <= 0 || block_size <= 0 || block_size > 4096 || n_blocks > (1 << 28) || n_local_blocks < 0 ||
        n_local_blocks > (1 << 28) || c->n_layers < 1 || c->n_layers > PRISM_MODEL_MAX_LAYERS)
        return PRISM_EINVAL;
    if (n_local_blocks && !class_layers(c, PRISM_KV_CLASS_LOCAL)) return PRISM_EINVAL;
    prism_kv_cache_t *kv = prism_calloc(1, sizeof *kv);
    if (!kv) return PRISM_ENOMEM;
    kv->be = be;
    kv->n_layers = c->n_layers;
    kv->n_kv = prism_model_local_kv_heads(c);
    kv->head_dim = c->head_dim;
    kv->n_blocks = n_blocks;
    kv->n_local_blocks = n_local_blocks;
    kv->block_size = block_size;
    kv->lbb = (size_t)block_size * kv->n_kv * c->head_dim * sizeof(float);
    kv->layer_off = prism_calloc((size_t)c->n_layers, sizeof(size_t));
    kv->layer_blocks = prism_calloc((size_t)c->n_layers, sizeof(int));
    kv->local = prism_calloc((size_t)c->n_layers, 1);
    if (!kv->layer_off || !kv->layer_blocks || !kv->local) {
        prism_kv_cache_free(kv);
        return PRISM_ENOMEM;
    }
    size_t total = 0;
    for (int L = 0; L < c->n_layers; L++) {
        kv->local[L] = layer_is_local(c, L);
        kv->layer_blocks[L] = kv->local[L] && n_local_blocks ? n_local_blocks : n_blocks;
        kv->layer_off[L] = total;
        total += kv->lbb * 2 * (size_t)kv->layer_blocks[L];
    }
    kv->buf = prism_backend_buf_alloc(be, total);
    if (!kv->buf) {
        prism_kv_cache_free(kv);
        return PRISM_ENOMEM;
    }
    /* Zeroed so padding rows of partially written blocks export deterministically. */
    be->i.memset0(be->ctx, kv->buf, total);
    *out = kv;
    return PRISM_OK;
}

int prism_kv_cache_create(prism_backend_t *be, const prism_model_config_t *c, int n_blocks, int block_size,
                          prism_kv_cache_t **out)
{
    return prism_kv_cache_create_split(be, c, n_blocks, 0, block_size, out);
}

void prism_kv_cache_free(prism_kv_cache_t *kv)
{
    if (!kv) return;
    if (kv->buf) prism_backend_buf_free(kv->be, kv->buf);
    prism_free(kv->layer_off);
    prism_free(kv->layer_blocks);
    prism_free(kv->local);
    prism_free(kv);
}

int prism_kv_cache_n_blocks(const prism_kv_cache_t *kv) { return kv->n_blocks; }
int prism_kv_cache_n_local_blocks(const prism_kv_cache_t *kv) { return kv->n_local_blocks; }
int prism_kv_cache_block_size(const prism_kv_cache_t *kv) { return kv->block_size; }

static uint8_t *kv_layer(const prism_kv_cache_t *kv, int layer, int which)
{
    return kv->buf + kv->layer_off[layer] + (size_t)which * (size_t)kv->layer_blocks[layer] * kv->lbb;
}

static int check_blocks(const int32_t *blocks, int n, int limit)
{
    if (n < 0 || (n > 0 && !blocks)) return PRISM_EINVAL;
    for (int i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= limit) return PRISM_EINVAL;
    return PRISM_OK;
}

/* Blocks of the layers in `cls` (-1: every layer) to or from host bytes laid out per block as
 * [those layers][2][block_size][n_kv][head_dim]. */
static int kv_copy(prism_kv_cache_t *kv, int cls, const int32_t *blocks, int n_blocks, void *host, bool to_host)
{
    /* A split cache keeps the two classes in different pools: one call may address only one. */
    if (cls < 0 && kv->n_local_blocks) return PRISM_EINVAL;
    int n_sel = 0;
    for (int l = 0; l < kv->n_layers; l++) n_sel += cls < 0 || kv->local[l] == (cls == PRISM_KV_CLASS_LOCAL);
    int limit = cls == PRISM_KV_CLASS_LOCAL && kv->n_local_blocks ? kv->n_local_blocks : kv->n_blocks;
    int rc = check_blocks(blocks, n_blocks, limit);
    if (rc != PRISM_OK || n_blocks == 0 || n_sel == 0) return rc;
    size_t bb = kv->lbb * 2 * (size_t)n_sel;
    for (int l = 0, k = 0; l < kv->n_layers; l++) {
        if (!(cls < 0 || kv->local[l] == (cls == PRISM_KV_CLASS_LOCAL))) continue;
        for (int j = 0; j < 2; j++) {
            uint8_t *h = (uint8_t *)host + ((size_t)k * 2 + j) * kv->lbb;
            rc = to_host ? kv->be->i.blocks_to_host(kv->be->ctx, h, bb, kv_layer(kv, l, j), kv->lbb, blocks, n_blocks)
                         : kv->be->i.blocks_from_host(kv->be->ctx, kv_layer(kv, l, j), kv->lbb, blocks, n_blocks, h, bb);
            if (rc != PRISM_OK) return rc;
        }
        k++;
    }
    return kv->be->i.synchronize(kv->be->ctx);
}

int prism_kv_cache_export(prism_kv_cache_t *kv, const int32_t *blocks, int n_blocks, void *dst)
{
    return kv_copy(kv, -1, blocks, n_blocks, dst, true);
}

int prism_kv_cache_import(prism_kv_cache_t *kv, const int32_t *blocks, int n_blocks, const void *src)
{
    return kv_copy(kv, -1, blocks, n_blocks, (void *)src, false);
}

int prism_kv_cache_export_class(prism_kv_cache_t *kv, int cls, const int32_t *blocks, int n_blocks, void *dst)
{
    if (cls != PRISM_KV_CLASS_FULL && cls != PRISM_KV_CLASS_LOCAL) return PRISM_EINVAL;
    return kv_copy(kv, cls, blocks, n_blocks, dst, true);
}

int prism_kv_cache_import_class(prism_kv_cache_t *kv, int cls, const int32_t *blocks, int n_blocks, const void *src)
{
    if (cls != PRISM_KV_CLASS_FULL && cls != PRISM_KV_CLASS_LOCAL) return PRISM_EINVAL;
    return kv_copy(kv, cls, blocks, n_blocks, (void *)src, false);
}

/* ---------------------------------------------------------------- forward */

#define CK(x) do { int rc_ = (x); if (rc_ != PRISM_OK) return rc_; } while (0)

/* Host row that replaces token t's embedding (image features), or NULL. */
static const float *embed_row(const prism_llm_batch_t *b, int t, int H)
{
    if (b->embed_rows) return b->embed_rows[t];
    return b->embeds && b->embed_mask && b->embed_mask[t] ? b->embeds + (size_t)t * H : NULL;
}

void prism_llm_set_hook(prism_llm_t *m, const prism_model_hook_t *hook) { m->hook = hook; }

/* Attention temperature of each token from its position (HF: float32
 * log1p(floor((p + 1) / floor_scale)) * attn_scale + 1), uploaded once per forward for every NoPE
 * layer (again when sequences drop out). */
static int upload_qscale(struct prism_llm *m, const int32_t *pos, int T)
{
    if (!m->qscale) return PRISM_OK;
    const prism_model_config_t *c = &m->cfg;
    for (int t = 0; t < T; t++) {
        float fl = floorf(((float)pos[t] + 1.0f) / c->floor_scale);
        m->h_qscale[t] = log1pf(fl) * c->attn_scale + 1.0f;
    }
    return m->be->i.upload(m->be->ctx, m->qscale, m->h_qscale, (size_t)T * 4);
}

/* Where the metadata arrays sit in the host mirror and on the device for T tokens, S sequences. */
typedef struct {
    int32_t *ids, *pos, *slots, *seq_start, *pos0, *rows, *tables;
    int32_t *lids;                /* tensor-parallel ranks: embedding rows of this rank's vocabulary slice */
    int32_t *lslots, *ltables;    /* split caches only: the chunked layers' slots and ring tables */
    int32_t *mpos;                /* M-RoPE models only: [3][T] rotary positions (t, h, w) */
} meta_ptrs_t;

static meta_ptrs_t meta_at(int32_t *base, int T, int S, int mbps)
{
    meta_ptrs_t p;
    p.ids = base;
    p.pos = p.ids + T;
    p.slots = p.pos + T;
    p.seq_start = p.slots + T;
    p.pos0 = p.seq_start + S + 1;
    p.rows = p.pos0 + S;
    p.tables = p.rows + S;
    p.lids = p.tables + (size_t)S * mbps;
    p.lslots = p.lids + T;
    p.ltables = p.lslots + T;
    p.mpos = p.ltables + (size_t)S * mbps;
    return p;
}

/* Entries of the metadata in use for T tokens and S sequences (M-RoPE: up to the end of mpos). */
static size_t meta_used(int T, int S, int mbps, bool split, bool mrope)
{
    size_t n = (size_t)4 * T + (size_t)(S + 1) + 2 * (size_t)S + (size_t)S * mbps;   /* lids included */
    if (mrope) return n + (size_t)T + (size_t)S * mbps + (size_t)3 * T;
    return n + (split ? (size_t)T + (size_t)S * mbps : 0);
}

/* The sequence that token t of a batch belongs to. */
static int seq_of(const int32_t *seq_start, int S, int t)
{
    int s = 0;
    while (s + 1 < S && seq_start[s + 1] <= t) s++;
    return s;
}

/* Between layers: asks the hook and drops cancelled sequences — their rows leave the residual
 * stream (moved into the spare buffer, which the next layer rewrites anyway, and the two swap)
 * and the metadata is rebuilt and uploaded for the smaller batch. Their KV blocks keep partial
 * state; the caller releases them. */
static int llm_between_layers(struct prism_llm *m, int done, int mbps, meta_ptrs_t *h, meta_ptrs_t *d,
                              prism_attn_meta_t *meta)
{
    const prism_model_hook_t *k = m->hook;
    if (!k || !k->layer || !k->layer(k->ud, done, m->cfg.n_layers) || !k->cancelled) return PRISM_OK;
    /* A tensor-parallel rank never drops a sequence on its own: every rank must run the same
     * collectives over the same rows, and only the leader hears of aborts. The leader leaves an
     * aborted sequence out of its next step plan instead (the hook still counts the layers). */
    if (m->tp.size > 1) return PRISM_OK;
    int S = m->f_S, nS = 0;
    for (int s = 0; s < S; s++) {
        m->gone[s] = k->cancelled(k->ud, m->keep[s]);
        nS += !m->gone[s];
    }
    if (nS == S) return PRISM_OK;
    m->f_S = nS;
    if (nS == 0) return PRISM_OK;
    const prism_backend_i *o = &m->be->i;
    void *bx = m->be->ctx;
    const size_t H = (size_t)m->cfg.hidden;
    int nT = 0;
    for (int s = 0; s < S; s++) nT += m->gone[s] ? 0 : h->seq_start[s + 1] - h->seq_start[s];
    meta_ptrs_t n = meta_at(m->h_meta2, nT, nS, mbps);
    for (int s = 0, j = 0, t = 0; s < S; s++) {
        if (m->gone[s]) continue;
        int t0 = h->seq_start[s], q = h->seq_start[s + 1] - t0;
        memcpy(n.ids + t, h->ids + t0, (size_t)q * 4);
        memcpy(n.pos + t, h->pos + t0, (size_t)q * 4);
        memcpy(n.slots + t, h->slots + t0, (size_t)q * 4);
        memcpy(n.tables + (size_t)j * mbps, h->tables + (size_t)s * mbps, (size_t)mbps * 4);
        if (m->f_split) {
            memcpy(n.lslots + t, h->lslots + t0, (size_t)q * 4);
            memcpy(n.ltables + (size_t)j * mbps, h->ltables + (size_t)s * mbps, (size_t)mbps * 4);
        }
        if (m->mrope)
            for (int r = 0; r < 3; r++)
                memcpy(n.mpos + (size_t)r * nT + t, h->mpos + (size_t)r * m->f_T + t0, (size_t)q * 4);
        n.seq_start[j] = t;
        n.pos0[j] = h->pos0[s];
        n.rows[j] = t + q - 1;
        m->keep[j] = m->keep[s];
        int rc = o->copy(bx, m->f_xn + (size_t)t * H, m->f_x + (size_t)t0 * H, (size_t)q * H * 4);
        if (rc != PRISM_OK) return rc;
        t += q;
        j++;
    }
    n.seq_start[nS] = nT;
    if (m->n_ds) {
        /* DeepStack rows stay where they are; the tokens they add into move with their sequences */
        for (int k = 0; k < m->n_ds; k++) {
            int t = m->h_ds_tok[k];
            if (t < 0) continue;
            int s = seq_of(h->seq_start, S, t), j = 0;
            if (m->gone[s]) {
                m->h_ds_tok[k] = -1;
                continue;
            }
            for (int q = 0; q < s; q++) j += !m->gone[q];
            m->h_ds_tok[k] = n.seq_start[j] + (t - h->seq_start[s]);
        }
        int rc = o->upload(bx, m->ds_tok, m->h_ds_tok, (size_t)m->n_ds * 4);
        if (rc != PRISM_OK) return rc;
    }
    float *x = m->f_x;
    m->f_x = m->f_xn;
    m->f_xn = x;
    int32_t *hm = m->h_meta;
    m->h_meta = m->h_meta2;
    m->h_meta2 = hm;
    *h = n;
    size_t used = meta_used(nT, nS, mbps, m->f_split, m->mrope);
    int rc = o->upload(bx, m->d_meta, m->h_meta, used * 4);   /* stream-ordered after the layers so far */
    if (rc != PRISM_OK) return rc;
    *d = meta_at(m->d_meta, nT, nS, mbps);
    if ((rc = upload_qscale(m, n.pos, nT)) != PRISM_OK) return rc;
    m->f_T = nT;
    meta->n_seqs = nS;
    meta->n_tokens = nT;
    meta->seq_start = d->seq_start;
    meta->pos0 = d->pos0;
    meta->block_tables = d->tables;
    return PRISM_OK;
}

int prism_llm_forward_begin(prism_llm_t *m, prism_kv_cache_t *kv, const prism_llm_batch_t *b)
{
    const prism_model_config_t *c = &m->cfg;
    prism_backend_t *be = m->be;
    void *bx = be->ctx;
    const prism_backend_i *o = &be->i;
    m->f_open = false;
    int T = b->n_tokens, S = b->n_seqs;

    if (S <= 0 || T <= 0 || !b->tokens || !b->seq_start || !b->pos0 || !b->block_tables)
        return PRISM_EINVAL;
    if (T > m->max_tokens || S > m->max_seqs) return PRISM_ELIMIT;
    const prism_tp_shard_t *sh = &m->tp;
    const bool tp = sh->size > 1, lead = sh->rank == 0;
    if (tp && !m->comm) return PRISM_EINVAL;
    if (kv->n_layers != c->n_layers || kv->n_kv != sh->n_kv_heads || kv->head_dim != c->head_dim)
        return PRISM_EINVAL;
    if (b->seq_start[0] != 0 || b->seq_start[S] != T) return PRISM_EINVAL;
    int bs = kv->block_size, mbps = 1, max_q = 0, max_ctx = 0;
    bool all_decode = true;
    for (int s = 0; s < S; s++) {
        int q = b->seq_start[s + 1] - b->seq_start[s];
        if (q <= 0 || b->pos0[s] < 0 || !b->block_tables[s]) return PRISM_EINVAL;
        if ((int64_t)b->pos0[s] + q > c->max_pos) return PRISM_EINVAL;
        int ctx_len = b->pos0[s] + q;
        int need = (ctx_len + bs - 1) / bs;
        if (need > mbps) mbps = need;
        if (q > max_q) max_q = q;
        if (ctx_len > max_ctx) max_ctx = ctx_len;
        all_decode = all_decode && q == 1;
    }
    if ((int64_t)S * mbps > m->table_cap) return PRISM_ELIMIT;
    /* A split cache: the chunked layers' blocks come from each sequence's ring, which must hold
     * every block this step writes or reads for them (from the chunk start of its first query). */
    const bool split = kv->n_local_blocks > 0;
    const int R = b->local_ring;
    if (split) {
        if (!b->local_tables || R < 1 || c->attention_chunk <= 0) return PRISM_EINVAL;
        for (int s = 0; s < S; s++) {
            int q = b->seq_start[s + 1] - b->seq_start[s], p0 = b->pos0[s];
            if (!b->local_tables[s] || (p0 + q - 1) / bs - p0 / c->attention_chunk * c->attention_chunk / bs + 1 > R)
                return PRISM_EINVAL;
        }
    }

    /* Host metadata, uploaded once. */
    meta_ptrs_t h = meta_at(m->h_meta, T, S, mbps);
    for (int s = 0; s < S; s++) {
        int q = b->seq_start[s + 1] - b->seq_start[s];
        int need = (b->pos0[s] + q + bs - 1) / bs;
        for (int i = 0; i < mbps; i++) {
            int id = i < need ? b->block_tables[s][i] : 0;
            if (id < 0 || id >= kv->n_blocks) return PRISM_EINVAL;
            h.tables[s * mbps + i] = id;
        }
        if (split) {
            for (int i = 0; i < mbps; i++) {
                int id = i < need ? b->local_tables[s][i % R] : 0;
                if (id < 0 || id >= kv->n_local_blocks) return PRISM_EINVAL;
                h.ltables[s * mbps + i] = id;
            }
        }
        for (int i = 0; i < q; i++) {
            int t = b->seq_start[s] + i, p = b->pos0[s] + i;
            int32_t tok = b->tokens[t];
            bool embedded = embed_row(b, t, c->hidden) != NULL;
            if (tok < 0 || tok >= c->vocab) {
                if (!embedded) return PRISM_EINVAL;
                tok = 0;
            }
            h.ids[t] = tok;
            h.pos[t] = p;
            if (m->mrope)
                for (int r = 0; r < 3; r++)
                    h.mpos[(size_t)r * T + t] = b->rope_pos ? b->rope_pos[(size_t)r * T + t]
                                                            : p + (b->rope_delta ? b->rope_delta[s] : 0);
            h.slots[t] = h.tables[s * mbps + p / bs] * bs + p % bs;
            if (split) h.lslots[t] = h.ltables[s * mbps + p / bs] * bs + p % bs;
        }
        h.seq_start[s] = b->seq_start[s];
        h.pos0[s] = b->pos0[s];
        h.rows[s] = b->seq_start[s + 1] - 1;
        m->keep[s] = s;
        m->ostart[s] = b->seq_start[s];
    }
    h.seq_start[S] = T;
    m->ostart[S] = T;
    /* Vocab-parallel embedding: ids of this rank's rows, -1 (a zero row) for everyone else's. */
    if (tp)
        for (int t = 0; t < T; t++) {
            int id = h.ids[t] - sh->vocab0;
            h.lids[t] = id >= 0 && id < sh->n_vocab ? id : -1;
        }
    CK(o->upload(bx, m->d_meta, m->h_meta, meta_used(T, S, mbps, split, m->mrope) * 4));
    meta_ptrs_t d = meta_at(m->d_meta, T, S, mbps);
    m->f_T = T;
    m->f_S = m->f_S0 = S;
    m->f_split = split;
    m->f_all_logits = b->all_logits;
    m->f_x = m->x;
    m->f_xn = m->xn;

    const int H = c->hidden, hd = c->head_dim, nh = sh->n_heads, nkv = sh->n_kv_heads;
    const int QKV = qkv_dim(sh, c), NQ = nh * hd;
    prism_dtype_t wdt = m->wdt;
    struct prism_comm *cm = m->comm;

    /* Embeddings, with image features overwriting masked rows (contiguous runs per upload). */
    CK(o->get_rows(bx, m->f_x, m->embed, wdt, sh->n_vocab, tp ? d.lids : d.ids, T, H));
    if (tp) CK(prism_comm_all_reduce_sum(cm, m->f_x, (size_t)T * H));
    if (b->embed_rows || (b->embeds && b->embed_mask)) {
        for (int t = 0; t < T;) {
            const float *src = embed_row(b, t, H);
            if (!src) { t++; continue; }
            int e = t + 1;
            while (e < T && embed_row(b, e, H) == src + (size_t)(e - t) * H) e++;
            CK(o->upload(bx, m->f_x + (size_t)t * H, src, (size_t)(e - t) * H * 4));
            t = e;
        }
    }
    CK(upload_qscale(m, h.pos, T));
    /* DeepStack: each image token's feature levels (after its embedding in the row) in one row of
     * ds_rows, and the token they add into. */
    m->n_ds = 0;
    if (c->n_deepstack > 0 && b->embed_rows) {
        const size_t L = (size_t)c->n_deepstack * H;
        for (int t = 0; t < T; t++) {
            if (!b->embed_rows[t]) continue;
            CK(o->upload(bx, m->ds_rows + (size_t)m->n_ds * L, b->embed_rows[t] + H, L * 4));
            m->h_ds_tok[m->n_ds++] = t;
        }
        if (m->n_ds) CK(o->upload(bx, m->ds_tok, m->h_ds_tok, (size_t)m->n_ds * 4));
    }

    prism_attn_meta_t meta = {
        .n_seqs = S, .n_tokens = T, .max_q_len = max_q, .max_ctx_len = max_ctx, .block_size = bs,
        .max_blocks_per_seq = mbps, .seq_start = d.seq_start, .pos0 = d.pos0, .block_tables = d.tables,
    };
    float scale = 1.0f / sqrtf((float)hd);
    CK(llm_between_layers(m, 0, mbps, &h, &d, &meta));
    for (int L = 0; L < c->n_layers && m->f_S > 0; L++) {
        const llm_layer_t *ly = &m->layers[L];
        const int fl = c->layer_flags[L];
        float *kc = (float *)kv_layer(kv, L, 0), *vc = (float *)kv_layer(kv, L, 1);
        float *x = m->f_x, *xn = m->f_xn;
        T = m->f_T;
        CK(o->rmsnorm(bx, xn, x, ly->attn_norm, T, H, c->rms_eps));
        CK(o->matmul(bx, m->qkv, QKV, xn, H, ly->wqkv, wdt, ly->bqkv, T, QKV, H, false));
        if (fl & PRISM_LAYER_QK_RMS) {   /* Qwen3: q_norm / k_norm per head, before RoPE */
            CK(o->head_rmsnorm(bx, m->qkv, QKV, T, nh, hd, ly->q_norm, c->rms_eps));
            CK(o->head_rmsnorm(bx, m->qkv + NQ, QKV, T, nkv, hd, ly->k_norm, c->rms_eps));
        }
        if ((fl & PRISM_LAYER_ROPE) && m->mrope) {
            CK(o->rope_multi(bx, m->qkv, QKV, T, nh, hd, d.mpos, T, m->inv_freq, &m->rsec));
            CK(o->rope_multi(bx, m->qkv + NQ, QKV, T, nkv, hd, d.mpos, T, m->inv_freq, &m->rsec));
        } else if (fl & PRISM_LAYER_ROPE) {
            CK(o->rope(bx, m->qkv, QKV, T, nh, hd, hd, d.pos, m->inv_freq, (prism_rope_mode_t)c->rope_mode));
            CK(o->rope(bx, m->qkv + NQ, QKV, T, nkv, hd, hd, d.pos, m->inv_freq, (prism_rope_mode_t)c->rope_mode));
        }
        if (fl & PRISM_LAYER_QK_NORM) {
            CK(o->head_rmsnorm(bx, m->qkv, QKV, T, nh, hd, NULL, c->rms_eps));
            CK(o->head_rmsnorm(bx, m->qkv + NQ, QKV, T, nkv, hd, NULL, c->rms_eps));
        }
        if (fl & PRISM_LAYER_TEMP) CK(o->scale_rows(bx, m->qkv, QKV, T, NQ, m->qscale));
        const bool ring = split && kv->local[L];   /* this layer's blocks: the sequence's ring */
        CK(o->kv_write(bx, kc, vc, m->qkv + NQ, m->qkv + NQ + nkv * hd, QKV, ring ? d.lslots : d.slots, T, nkv, hd));
        meta.block_tables = ring ? d.ltables : d.tables;
        meta.chunk = (fl & PRISM_LAYER_CHUNKED) ? c->attention_chunk : 0;
        if (all_decode && o->attn_decode)
            CK(o->attn_decode(bx, m->attn, NQ, m->qkv, QKV, kc, vc, &meta, nh, nkv, hd, scale));
        else
            CK(o->attn_paged(bx, m->attn, NQ, m->qkv, QKV, kc, vc, &meta, nh, nkv, hd, scale));
        /* Row-parallel o_proj: rank 0 adds onto the residual (with the bias), the others write their
         * partial sum; the all-reduce leaves x + every partial on every rank. */
        CK(o->matmul(bx, x, H, m->attn, NQ, ly->wo, wdt, lead ? ly->bo : NULL, T, H, NQ, lead));
        if (tp) CK(prism_comm_all_reduce_sum(cm, x, (size_t)T * H));
        CK(o->rmsnorm(bx, xn, x, ly->mlp_norm, T, H, c->rms_eps));
        /* Dense MLP, or the shared expert of a MoE layer: both add straight into the residual. */
        const int I = (fl & PRISM_LAYER_MOE) ? sh->n_eff : sh->n_ffn;
        CK(o->matmul(bx, m->gu, 2 * I, xn, H, ly->wgu, wdt, ly->bgu, T, 2 * I, H, false));
        CK(o->silu_mul(bx, m->act, m->gu, m->gu + I, 2 * I, T, I));
        CK(o->matmul(bx, x, H, m->act, I, ly->wdown, wdt, lead ? ly->bdown : NULL, T, H, I, lead));
        if (fl & PRISM_LAYER_MOE) {
            /* Every rank routes identically (replicated router over the same xn) and runs its
             * columns of each chosen expert; the partial sums join the shared expert's. */
            const int E = c->n_experts, K = c->top_k, R = T * K, EI = sh->n_eff;
            CK(o->matmul(bx, m->rlogits, E, xn, H, ly->router, wdt, NULL, T, E, H, false));
            CK(o->moe_route(bx, m->rlogits, T, E, K, m->r_choice, m->r_order, m->r_w, m->r_off, m->r_slot));
            /* Expert inputs: each routed row is its token's normed state times the router score. */
            CK(o->get_rows(bx, m->xs, xn, PRISM_DTYPE_F32, T, m->r_order, R, H));
            CK(o->scale_rows(bx, m->xs, H, R, H, m->r_w));
            CK(o->matmul_grouped(bx, m->gu2, 2 * EI, m->xs, H, ly->exp_gu, wdt, m->r_off, E, R, 2 * EI, H));
            CK(o->silu_mul(bx, m->act2, m->gu2, m->gu2 + EI, 2 * EI, R, EI));
            CK(o->matmul_grouped(bx, m->ys, H, m->act2, EI, ly->exp_down, wdt, m->r_off, E, R, H, EI));
            CK(o->moe_combine(bx, x, H, m->ys, m->r_slot, T, K, H));
        }
        if (tp) CK(prism_comm_all_reduce_sum(cm, x, (size_t)T * H));
        /* DeepStack: level L of the image tokens' features joins the residual stream after layer L */
        if (m->n_ds && L < c->n_deepstack)
            CK(o->add_rows(bx, x, H, m->ds_rows + (size_t)L * H, c->n_deepstack * H, m->ds_tok, m->n_ds, H));
        CK(llm_between_layers(m, L + 1, mbps, &h, &d, &meta));
    }
    m->f_rows = d.rows;
    m->f_seq_start = h.seq_start;
    m->f_open = true;
    return PRISM_OK;
}

/* Copies logits rows [r0, r0+n) of the kept batch (device m->logits) to the caller's rows. */
static int llm_logits_out(struct prism_llm *m, float *logits, int r0, int n)
{
    const prism_backend_i *o = &m->be->i;
    void *bx = m->be->ctx;
    const size_t V = (size_t)m->cfg.vocab;
    if (m->f_S == m->f_S0)   /* nothing dropped: the caller's rows are ours */
        return o->download(bx, logits + (size_t)r0 * V, m->logits, (size_t)n * V * 4);
    if (!m->f_all_logits) {
        for (int r = r0; r < r0 + n; r++)
            CK(o->download(bx, logits + (size_t)m->keep[r] * V, m->logits + (size_t)(r - r0) * V, V * 4));
        return PRISM_OK;
    }
    for (int s = 0; s < m->f_S; s++) {
        int a = PRISM_MAX(r0, m->f_seq_start[s]), e = PRISM_MIN(r0 + n, m->f_seq_start[s + 1]);
        if (a >= e) continue;
        size_t dst = (size_t)m->ostart[m->keep[s]] + (size_t)(a - m->f_seq_start[s]);
        CK(o->download(bx, logits + dst * V, m->logits + (size_t)(a - r0) * V, (size_t)(e - a) * V * 4));
    }
    return PRISM_OK;
}

int prism_llm_forward_end(prism_llm_t *m, float *logits)
{
    const prism_model_config_t *c = &m->cfg;
    void *bx = m->be->ctx;
    const prism_backend_i *o = &m->be->i;
    if (!m->f_open || !logits) return PRISM_EINVAL;
    m->f_open = false;
    if (m->f_S == 0) return PRISM_OK;   /* every sequence was cancelled (never under tensor parallelism) */
    const int H = c->hidden, T = m->f_T, S = m->f_S;
    const prism_tp_shard_t *sh = &m->tp;
    const bool tp = sh->size > 1;
    struct prism_comm *cm = m->comm;
    prism_dtype_t wdt = m->wdt;
    /* Final norm over the rows whose logits are wanted, then lm_head in chunks of lchunk rows. */
    const float *rows_in = m->f_xn;
    int n_out = T;
    if (m->f_all_logits) {
        CK(o->rmsnorm(bx, m->f_xn, m->f_x, m->norm, T, H, c->rms_eps));
    } else {
        CK(o->get_rows(bx, m->xsel, m->f_x, PRISM_DTYPE_F32, T, m->f_rows, S, H));
        CK(o->rmsnorm(bx, m->xsel, m->xsel, m->norm, S, H, c->rms_eps));
        rows_in = m->xsel;
        n_out = S;
    }
    for (int r0 = 0; r0 < n_out; r0 += m->lchunk) {
        int n = PRISM_MIN(m->lchunk, n_out - r0);
        if (!tp) {
            CK(o->matmul(bx, m->logits, c->vocab, rows_in + (size_t)r0 * H, H, m->lm_head, wdt, NULL, n, c->vocab, H, false));
        } else {
            /* This rank's vocab columns, gathered from every rank and laid side by side. */
            const int st = sh->vocab_stride;
            CK(o->matmul(bx, m->llocal, st, rows_in + (size_t)r0 * H, H, m->lm_head, wdt, NULL, n, sh->n_vocab, H, false));
            CK(prism_comm_all_gather(cm, m->lgather, m->llocal, (size_t)n * st * 4));
            for (int r = 0; r < sh->size; r++) {
                /* rank r holds vocab rows [V*r/T, V*(r+1)/T) (prism_tp_shard) */
                int64_t v0 = (int64_t)c->vocab * r / sh->size, v1 = (int64_t)c->vocab * (r + 1) / sh->size;
                CK(o->copy_2d(bx, m->logits + v0, (size_t)c->vocab * 4, m->lgather + (size_t)r * n * st,
                              (size_t)st * 4, (size_t)(v1 - v0) * 4, (size_t)n));
            }
            CK(prism_comm_wait(cm));
        }
        CK(llm_logits_out(m, logits, r0, n));
    }
    return PRISM_OK;
}

int prism_llm_forward(prism_llm_t *m, prism_kv_cache_t *kv, const prism_llm_batch_t *b, float *logits)
{
    if (!logits) return PRISM_EINVAL;
    CK(prism_llm_forward_begin(m, kv, b));
    return prism_llm_forward_end(m, logits);
}
