/* Vision towers: CLIP + LLaVA projector, and Llama-4's (cfg.vision_arch), one ViT forward.
 *
 * CLIP: runs only the layers the feature layer needs (-2: all but the last), never post_layernorm
 * (LLaVA reads hidden_states, which are pre-post-norm), drops CLS for the "default" strategy, then
 * linear_2(act(linear_1(f))).
 * Llama-4: patches by unfold (the same im2patch order), CLS appended LAST, positional_embedding_vlm,
 * layernorm_pre, every layer with 2D RoPE on q and k (interleaved pairs: the first half of each
 * head rotates by (x+1)*f_j, the second by (y+1)*f_j; CLS by 0), layernorm_post, CLS dropped by
 * the pixel shuffle (ratio 1/v_shuffle), adapter GELU(fc2(GELU(fc1))), projector linear_1.
 * Images (tiles) are encoded as a batch of independent non-causal sequences. */
#include "model/model_impl.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)

typedef struct {
    float *ln1_w, *ln1_b, *ln2_w, *ln2_b;  /* [v_hidden] */
    void *wqkv;                            /* [3*v_hidden][v_hidden] q, k, v rows */
    float *bqkv;                           /* [3*v_hidden] */
    void *wo;                              /* [v_hidden][v_hidden] */
    float *bo;
    void *fc1;                             /* [v_intermediate][v_hidden] */
    float *fc1_b;
    void *fc2;                             /* [v_hidden][v_intermediate] */
    float *fc2_b;
} vit_layer_t;

struct prism_vision {
    prism_backend_t *be;
    prism_model_config_t cfg;
    prism_dtype_t wdt;
    int n_run;                   /* encoder layers actually run */
    int n_patches, seq, n_out;   /* patches per image, +CLS, features per image */
    void *wbuf;
    size_t wbytes;
    void *patch_w;               /* [v_hidden][C*p*p] */
    float *cls;                  /* [v_hidden] */
    float *pos;                  /* [seq][v_hidden] */
    float *pre_w, *pre_b;        /* [v_hidden] */
    vit_layer_t *layers;         /* [n_run] */
    void *p1_w, *p2_w;           /* [hidden][v_hidden], [hidden][hidden] (Llama-4: [hidden][v_output_dim], none) */
    float *p1_b, *p2_b;          /* [hidden] or NULL */
    /* Llama-4 */
    bool l4;
    int shuf_dim;                /* v_hidden * v_shuffle^2 */
    float *post_w, *post_b;      /* layernorm_post [v_hidden] */
    void *ad1_w, *ad2_w;         /* adapter fc1 [v_adapter_dim][shuf_dim], fc2 [v_adapter_dim][v_adapter_dim] */

    int max_images;
    void *abuf;
    size_t abytes;
    float *pix;                  /* [B][C][S][S] */
    float *patches;              /* [B*np][C*p*p] */
    float *h, *xn;               /* [B*seq][v_hidden] */
    float *qkv;                  /* [B*seq][3*v_hidden] */
    float *attn;                 /* [B*seq][v_hidden] */
    float *mlp;                  /* [B*seq][v_intermediate] */
    float *sel;                  /* [B*n_out][v_hidden] */
    float *p1, *p2;              /* [B*n_out][hidden] */
    float *shuf;                 /* Llama-4: [B*n_out][shuf_dim] */
    float *ad1, *ad2;            /* Llama-4: [B*n_out][v_adapter_dim] */
    int32_t *rope_x, *rope_y;    /* Llama-4: [B*seq] 2D RoPE positions (x+1, y+1; CLS 0) */
    float *rope_inv;             /* Llama-4: [head_dim/4] */
};

static int vit_layers_to_run(const prism_model_config_t *c)
{
    /* hidden_states[0] is the embedding output, hidden_states[k] the output of layer k. */
    return c->v_feature_layer < 0 ? c->v_layers + 1 + c->v_feature_layer : c->v_feature_layer;
}

static bool is_l4(const prism_model_config_t *c) { return c->vision_arch == PRISM_VISION_LLAMA4; }

/* Features per image: patches (CLIP default), patches + CLS (CLIP full), shuffled grid (Llama-4). */
static int vis_n_out(const prism_model_config_t *c)
{
    int g = c->v_image_size / c->v_patch;
    if (is_l4(c)) return (g / c->v_shuffle) * (g / c->v_shuffle);
    return c->v_select_default ? g * g : g * g + 1;
}

static size_t vis_layout(const prism_model_config_t *c, int B, struct prism_vision *v)
{
    prism_layout_t l = {v ? v->abuf : NULL, 0};
    int g = c->v_image_size / c->v_patch, np = g * g, seq = np + 1;
    int n_out = vis_n_out(c);
    size_t VH = (size_t)c->v_hidden, C = (size_t)c->v_num_channels, S = (size_t)c->v_image_size;
    size_t T = (size_t)B * seq;
    float *pix = prism_layout_take(&l, (size_t)B * C * S * S * 4);
    float *patches = prism_layout_take(&l, (size_t)B * np * C * c->v_patch * c->v_patch * 4);
    float *h = prism_layout_take(&l, T * VH * 4);
    float *xn = prism_layout_take(&l, T * VH * 4);
    float *qkv = prism_layout_take(&l, T * 3 * VH * 4);
    float *attn = prism_layout_take(&l, T * VH * 4);
    float *mlp = prism_layout_take(&l, T * (size_t)c->v_intermediate * 4);
    float *sel = prism_layout_take(&l, (size_t)B * n_out * VH * 4);
    float *p1 = prism_layout_take(&l, (size_t)B * n_out * c->hidden * 4);
    float *p2 = prism_layout_take(&l, (size_t)B * n_out * c->hidden * 4);
    float *shuf = NULL, *ad1 = NULL, *ad2 = NULL, *rope_inv = NULL;
    int32_t *rope_x = NULL, *rope_y = NULL;
    if (is_l4(c)) {
        size_t sd = VH * c->v_shuffle * c->v_shuffle, A = (size_t)c->v_adapter_dim;
        shuf = prism_layout_take(&l, (size_t)B * n_out * sd * 4);
        ad1 = prism_layout_take(&l, (size_t)B * n_out * A * 4);
        ad2 = prism_layout_take(&l, (size_t)B * n_out * A * 4);
        rope_x = prism_layout_take(&l, T * 4);
        rope_y = prism_layout_take(&l, T * 4);
        rope_inv = prism_layout_take(&l, (size_t)(c->v_hidden / c->v_heads / 4) * 4);
    }
    if (v && v->abuf) {
        v->pix = pix; v->patches = patches; v->h = h; v->xn = xn; v->qkv = qkv; v->attn = attn;
        v->mlp = mlp; v->sel = sel; v->p1 = p1; v->p2 = p2;
        v->shuf = shuf; v->ad1 = ad1; v->ad2 = ad2; v->rope_x = rope_x; v->rope_y = rope_y; v->rope_inv = rope_inv;
    }
    return PRISM_ALIGN_UP(l.off, PRISM_TENSOR_ALIGN);
}

size_t prism_vision_arena_bytes(const prism_model_config_t *cfg, int max_images)
{
    if (!cfg->has_vision || max_images <= 0) return 0;
    return vis_layout(cfg, max_images, NULL);
}

static const char *const k_vis_prefixes[] = {"vision_tower.vision_model.", "model.vision_tower.vision_model.",
                                             "vision_tower.", "model.vision_tower."};
static const char *const k_l4_vis_prefixes[] = {"vision_model.", "model.vision_model."};
static const char *const k_proj_prefixes[] = {"multi_modal_projector.", "model.multi_modal_projector."};

static int load_weights(struct prism_vision *v, prism_wload_t *w, const char *vp, const char *pp)
{
    const prism_model_config_t *c = &v->cfg;
    prism_dtype_t wdt = v->wdt;
    int64_t VH = c->v_hidden, VI = c->v_intermediate, H = c->hidden, C = c->v_num_channels, P = c->v_patch;
    size_t es = prism_dtype_size(wdt);
    char name[256];
    int rc;
#define NAME(...) (snprintf(name, sizeof name, __VA_ARGS__), name)
#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define F32(dst, shp, ...) \
    if ((rc = prism_wload_tensor(w, (void **)&(dst), PRISM_DTYPE_F32, NAME(__VA_ARGS__), 1, SHAPE(shp)))) return rc
    if ((rc = prism_wload_tensor(w, &v->patch_w, wdt, NAME("%sembeddings.patch_embedding.weight", vp), 4, SHAPE(VH, C, P, P)))) return rc;
    F32(v->cls, VH, "%sembeddings.class_embedding", vp);
    if ((rc = prism_wload_tensor(w, (void **)&v->pos, PRISM_DTYPE_F32, NAME("%sembeddings.position_embedding.weight", vp), 2, SHAPE(v->seq, VH)))) return rc;
    F32(v->pre_w, VH, "%spre_layrnorm.weight", vp);
    F32(v->pre_b, VH, "%spre_layrnorm.bias", vp);
    for (int L = 0; L < v->n_run; L++) {
        vit_layer_t *ly = &v->layers[L];
        char p[128];
        snprintf(p, sizeof p, "%sencoder.layers.%d.", vp, L);
        F32(ly->ln1_w, VH, "%slayer_norm1.weight", p);
        F32(ly->ln1_b, VH, "%slayer_norm1.bias", p);
        F32(ly->ln2_w, VH, "%slayer_norm2.weight", p);
        F32(ly->ln2_b, VH, "%slayer_norm2.bias", p);
        ly->wqkv = prism_wload_reserve(w, (size_t)(3 * VH * VH) * es);
        ly->bqkv = prism_wload_reserve(w, (size_t)(3 * VH) * 4);
        static const char *const qkv[3] = {"q", "k", "v"};
        for (int j = 0; j < 3; j++) {
            uint8_t *wd = ly->wqkv ? (uint8_t *)ly->wqkv + (size_t)j * VH * VH * es : NULL;
            float *bd = ly->bqkv ? ly->bqkv + j * VH : NULL;
            if ((rc = prism_wload_fill(w, wd, wdt, NAME("%sself_attn.%s_proj.weight", p, qkv[j]), 2, SHAPE(VH, VH)))) return rc;
            if ((rc = prism_wload_fill(w, bd, PRISM_DTYPE_F32, NAME("%sself_attn.%s_proj.bias", p, qkv[j]), 1, SHAPE(VH)))) return rc;
        }
        if ((rc = prism_wload_tensor(w, &ly->wo, wdt, NAME("%sself_attn.out_proj.weight", p), 2, SHAPE(VH, VH)))) return rc;
        F32(ly->bo, VH, "%sself_attn.out_proj.bias", p);
        if ((rc = prism_wload_tensor(w, &ly->fc1, wdt, NAME("%smlp.fc1.weight", p), 2, SHAPE(VI, VH)))) return rc;
        F32(ly->fc1_b, VI, "%smlp.fc1.bias", p);
        if ((rc = prism_wload_tensor(w, &ly->fc2, wdt, NAME("%smlp.fc2.weight", p), 2, SHAPE(VH, VI)))) return rc;
        F32(ly->fc2_b, VH, "%smlp.fc2.bias", p);
    }
    if ((rc = prism_wload_tensor(w, &v->p1_w, wdt, NAME("%slinear_1.weight", pp), 2, SHAPE(H, VH)))) return rc;
    if ((rc = prism_wload_tensor(w, &v->p2_w, wdt, NAME("%slinear_2.weight", pp), 2, SHAPE(H, H)))) return rc;
    if (c->proj_bias) {
        F32(v->p1_b, H, "%slinear_1.bias", pp);
        F32(v->p2_b, H, "%slinear_2.bias", pp);
    }
#undef F32
#undef NAME
#undef SHAPE
    return PRISM_OK;
}

/* 2D RoPE constants, uploaded once into the arena: per row of every image slot the x+1 / y+1 grid
 * position (CLS, the last row, gets 0: no rotation) and f_j = theta^(-2j/(head_dim/2)), j < head_dim/4,
 * in float32 as transformers computes them. */
static int l4_rope_tables(struct prism_vision *v)
{
    const prism_model_config_t *c = &v->cfg;
    int g = c->v_image_size / c->v_patch, hd = c->v_hidden / c->v_heads, nf = hd / 4;
    size_t T = (size_t)v->max_images * v->seq;
    int32_t *px = prism_malloc(T * 2 * sizeof(int32_t));
    float inv[256];
    if (!px) return PRISM_ENOMEM;
    int32_t *py = px + T;
    for (size_t r = 0; r < T; r++) {
        int n = (int)(r % (size_t)v->seq);
        px[r] = n < v->n_patches ? n % g + 1 : 0;
        py[r] = n < v->n_patches ? n / g + 1 : 0;
    }
    for (int j = 0; j < nf; j++) inv[j] = 1.0f / powf(c->v_rope_theta, (float)(2 * j) / (float)(hd / 2));
    const prism_backend_i *o = &v->be->i;
    int rc = o->upload(v->be->ctx, v->rope_x, px, T * 4);
    if (rc == PRISM_OK) rc = o->upload(v->be->ctx, v->rope_y, py, T * 4);
    if (rc == PRISM_OK) rc = o->upload(v->be->ctx, v->rope_inv, inv, (size_t)nf * 4);
    if (rc == PRISM_OK) rc = o->synchronize(v->be->ctx);
    prism_free(px);
    return rc;
}

/* Llama-4 keys: vision_model.{patch_embedding.linear, class_embedding, positional_embedding_vlm,
 * layernorm_pre/post, model.layers.N.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
 * mlp.fc1/fc2}, vision_adapter.mlp.fc1/fc2}, multi_modal_projector.linear_1 (no biases outside the
 * layers). */
static int load_weights_l4(struct prism_vision *v, prism_wload_t *w, const char *vp, const char *pp)
{
    const prism_model_config_t *c = &v->cfg;
    prism_dtype_t wdt = v->wdt;
    int64_t VH = c->v_hidden, VI = c->v_intermediate, H = c->hidden, C = c->v_num_channels, P = c->v_patch;
    int64_t A = c->v_adapter_dim, SD = v->shuf_dim;
    size_t es = prism_dtype_size(wdt);
    char name[256];
    int rc;
#define NAME(...) (snprintf(name, sizeof name, __VA_ARGS__), name)
#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define F32(dst, shp, ...) \
    if ((rc = prism_wload_tensor(w, (void **)&(dst), PRISM_DTYPE_F32, NAME(__VA_ARGS__), 1, SHAPE(shp)))) return rc
#define MAT(dst, rows, cols, ...) \
    if ((rc = prism_wload_tensor(w, &(dst), wdt, NAME(__VA_ARGS__), 2, SHAPE(rows, cols)))) return rc
    MAT(v->patch_w, VH, C * P * P, "%spatch_embedding.linear.weight", vp);
    F32(v->cls, VH, "%sclass_embedding", vp);
    if ((rc = prism_wload_tensor(w, (void **)&v->pos, PRISM_DTYPE_F32, NAME("%spositional_embedding_vlm", vp), 2, SHAPE(v->seq, VH)))) return rc;
    F32(v->pre_w, VH, "%slayernorm_pre.weight", vp);
    F32(v->pre_b, VH, "%slayernorm_pre.bias", vp);
    F32(v->post_w, VH, "%slayernorm_post.weight", vp);
    F32(v->post_b, VH, "%slayernorm_post.bias", vp);
    for (int L = 0; L < v->n_run; L++) {
        vit_layer_t *ly = &v->layers[L];
        char p[128];
        snprintf(p, sizeof p, "%smodel.layers.%d.", vp, L);
        F32(ly->ln1_w, VH, "%sinput_layernorm.weight", p);
        F32(ly->ln1_b, VH, "%sinput_layernorm.bias", p);
        F32(ly->ln2_w, VH, "%spost_attention_layernorm.weight", p);
        F32(ly->ln2_b, VH, "%spost_attention_layernorm.bias", p);
        ly->wqkv = prism_wload_reserve(w, (size_t)(3 * VH * VH) * es);
        ly->bqkv = prism_wload_reserve(w, (size_t)(3 * VH) * 4);
        static const char *const qkv[3] = {"q", "k", "v"};
        for (int j = 0; j < 3; j++) {
            uint8_t *wd = ly->wqkv ? (uint8_t *)ly->wqkv + (size_t)j * VH * VH * es : NULL;
            float *bd = ly->bqkv ? ly->bqkv + j * VH : NULL;
            if ((rc = prism_wload_fill(w, wd, wdt, NAME("%sself_attn.%s_proj.weight", p, qkv[j]), 2, SHAPE(VH, VH)))) return rc;
            if ((rc = prism_wload_fill(w, bd, PRISM_DTYPE_F32, NAME("%sself_attn.%s_proj.bias", p, qkv[j]), 1, SHAPE(VH)))) return rc;
        }
        MAT(ly->wo, VH, VH, "%sself_attn.o_proj.weight", p);
        F32(ly->bo, VH, "%sself_attn.o_proj.bias", p);
        MAT(ly->fc1, VI, VH, "%smlp.fc1.weight", p);
        F32(ly->fc1_b, VI, "%smlp.fc1.bias", p);
        MAT(ly->fc2, VH, VI, "%smlp.fc2.weight", p);
        F32(ly->fc2_b, VH, "%smlp.fc2.bias", p);
    }
    MAT(v->ad1_w, A, SD, "%svision_adapter.mlp.fc1.weight", vp);
    MAT(v->ad2_w, A, A, "%svision_adapter.mlp.fc2.weight", vp);
    MAT(v->p1_w, H, c->v_output_dim, "%slinear_1.weight", pp);
#undef MAT
#undef F32
#undef NAME
#undef SHAPE
    return PRISM_OK;
}

int prism_vision_load(prism_backend_t *be, const prism_model_config_t *cfg, const char *model_dir,
                      int max_images, prism_vision_t **out, char *err, size_t errlen)
{
    *out = NULL;
    if (!cfg->has_vision) {
        ERR("vision: %s has no vision tower", cfg->arch);
        return PRISM_ENOTSUP;
    }
    if (max_images <= 0 || max_images > 4096) {
        ERR("vision: bad max_images %d", max_images);
        return PRISM_EINVAL;
    }
    prism_st_t *st = NULL;
    prism_wload_t w = {0};
    struct prism_vision *v = prism_calloc(1, sizeof *v);
    int rc = PRISM_ENOMEM;
    if (!v) goto fail;
    v->be = be;
    v->cfg = *cfg;
    v->wdt = be->weight_dtype;
    v->max_images = max_images;
    int g = cfg->v_image_size / cfg->v_patch;
    v->n_patches = g * g;
    v->seq = v->n_patches + 1;
    v->n_out = vis_n_out(cfg);
    v->n_run = vit_layers_to_run(cfg);
    v->l4 = is_l4(cfg);
    if (v->l4) {
        v->shuf_dim = cfg->v_hidden * cfg->v_shuffle * cfg->v_shuffle;
        if (!be->i.pixel_shuffle) {
            ERR("vision: the %s backend has no pixel_shuffle op", be->device);
            rc = PRISM_ENOTSUP;
            goto fail;
        }
    }
    if (v->n_out != cfg->image_seq_length || v->n_run < 0 || v->n_run > cfg->v_layers) {
        ERR("vision: inconsistent config (image_seq_length %d, %d features, %d layers to run)",
            cfg->image_seq_length, v->n_out, v->n_run);
        rc = PRISM_ECORRUPT;
        goto fail;
    }
    v->layers = prism_calloc((size_t)PRISM_MAX(v->n_run, 1), sizeof *v->layers);
    if (!v->layers) goto fail;
    const char *vp = v->l4 ? k_l4_vis_prefixes[0] : k_vis_prefixes[0], *pp = k_proj_prefixes[0];
    if (!cfg->random_weights) {
        rc = prism_st_open_dir(model_dir, &st, err, errlen);
        if (rc != PRISM_OK) goto fail;
        vp = v->l4 ? prism_wload_find_prefix(st, k_l4_vis_prefixes, (int)PRISM_ARRAY_LEN(k_l4_vis_prefixes),
                                             "patch_embedding.linear.weight")
                   : prism_wload_find_prefix(st, k_vis_prefixes, (int)PRISM_ARRAY_LEN(k_vis_prefixes),
                                             "embeddings.patch_embedding.weight");
        pp = prism_wload_find_prefix(st, k_proj_prefixes, (int)PRISM_ARRAY_LEN(k_proj_prefixes), "linear_1.weight");
    }
    if (!vp || !pp) {
        ERR("weights: no %s found in %s", vp ? "multi_modal_projector" : "vision tower", model_dir);
        rc = PRISM_ENOTFOUND;
        goto fail;
    }
    w = (prism_wload_t){.be = be, .st = st, .err = err, .errlen = errlen, .random = cfg->random_weights,
                        .seed = cfg->random_seed};
    if ((rc = (v->l4 ? load_weights_l4 : load_weights)(v, &w, vp, pp)) != PRISM_OK) goto fail;
    v->wbytes = PRISM_ALIGN_UP(w.off, PRISM_TENSOR_ALIGN);
    v->wbuf = prism_backend_buf_alloc(be, v->wbytes);
    w.staging_n = 1u << 20;
    w.staging = prism_malloc(w.staging_n * sizeof(float));
    if (!v->wbuf || !w.staging) {
        ERR("vision: cannot allocate weights");
        rc = PRISM_ENOMEM;
        goto fail;
    }
    w.base = v->wbuf;
    w.total = v->wbytes;
    w.off = 0;
    w.next_log = (size_t)1 << 30;
    if ((rc = (v->l4 ? load_weights_l4 : load_weights)(v, &w, vp, pp)) != PRISM_OK) goto fail;
    prism_free(w.staging);
    w.staging = NULL;
    prism_st_close(st);
    st = NULL;

    v->abytes = vis_layout(cfg, max_images, NULL);
    v->abuf = prism_backend_buf_alloc(be, v->abytes);
    if (!v->abuf) {
        char b[32];
        ERR("vision: cannot allocate the %s activation arena", prism_fmt_bytes(v->abytes, b, sizeof b));
        rc = PRISM_ENOMEM;
        goto fail;
    }
    vis_layout(cfg, max_images, v);
    if (v->l4 && (rc = l4_rope_tables(v)) != PRISM_OK) goto fail;
    {
        char a[32], b[32];
        PRISM_INFO("vision: %s %dpx/%d, %d of %d layers, %s weights + %s arena for %d images",
                   v->l4 ? "Llama-4" : "CLIP", cfg->v_image_size, cfg->v_patch, v->n_run, cfg->v_layers, prism_fmt_bytes(v->wbytes, a, sizeof a),
                   prism_fmt_bytes(v->abytes, b, sizeof b), max_images);
    }
    *out = v;
    return PRISM_OK;
fail:
    prism_free(w.staging);
    prism_st_close(st);
    prism_vision_free(v);
    return rc;
}

void prism_vision_free(prism_vision_t *v)
{
    if (!v) return;
    prism_backend_buf_free(v->be, v->wbuf);
    prism_backend_buf_free(v->be, v->abuf);
    prism_free(v->layers);
    prism_free(v);
}

size_t prism_vision_weight_bytes(const prism_vision_t *v) { return v->wbytes; }

#define CK(x) do { int rc_ = (x); if (rc_ != PRISM_OK) return rc_; } while (0)

int prism_vision_encode(prism_vision_t *v, const float *pixels, int n_images, float *out)
{
    const prism_model_config_t *c = &v->cfg;
    const prism_backend_i *o = &v->be->i;
    void *bx = v->be->ctx;
    if (n_images <= 0 || !pixels || !out) return PRISM_EINVAL;
    if (n_images > v->max_images) return PRISM_ELIMIT;
    const int B = n_images, VH = c->v_hidden, VI = c->v_intermediate, P = c->v_patch, Cn = c->v_num_channels;
    const int S = c->v_image_size, np = v->n_patches, seq = v->seq, T = B * seq, H = c->hidden;
    const int hd = VH / c->v_heads, feat = Cn * P * P;
    prism_dtype_t wdt = v->wdt;

    CK(o->upload(bx, v->pix, pixels, (size_t)B * Cn * S * S * 4));
    CK(o->im2patch(bx, v->patches, v->pix, B, Cn, S, S, P));
    /* Patch embeddings staged in xn, then placed around the CLS row: CLIP puts CLS first (row 0),
     * Llama-4 last (row np). */
    CK(o->matmul(bx, v->xn, VH, v->patches, feat, v->patch_w, wdt, NULL, B * np, VH, feat, false));
    const int cls_row = v->l4 ? np : 0, patch_row = v->l4 ? 0 : 1;
    for (int i = 0; i < B; i++) {
        float *img = v->h + (size_t)i * seq * VH;
        CK(o->copy(bx, img + (size_t)cls_row * VH, v->cls, (size_t)VH * 4));
        CK(o->copy(bx, img + (size_t)patch_row * VH, v->xn + (size_t)i * np * VH, (size_t)np * VH * 4));
    }
    CK(o->add(bx, v->h, v->h, v->pos, (size_t)T * VH, (size_t)seq * VH));
    CK(o->layernorm(bx, v->h, v->h, v->pre_w, v->pre_b, T, VH, c->v_eps));

    float scale = 1.0f / sqrtf((float)hd);
    for (int L = 0; L < v->n_run; L++) {
        const vit_layer_t *ly = &v->layers[L];
        CK(o->layernorm(bx, v->xn, v->h, ly->ln1_w, ly->ln1_b, T, VH, c->v_eps));
        CK(o->matmul(bx, v->qkv, 3 * VH, v->xn, VH, ly->wqkv, wdt, ly->bqkv, T, 3 * VH, VH, false));
        if (v->l4) {
            /* 2D RoPE: the first half of every q/k head turns with the column, the second with the row. */
            for (int j = 0; j < 2; j++) {
                float *base = v->qkv + (size_t)j * VH;
                CK(o->rope(bx, base, 3 * VH, T, c->v_heads, hd, hd / 2, v->rope_x, v->rope_inv, PRISM_ROPE_INTERLEAVE));
                CK(o->rope(bx, base + hd / 2, 3 * VH, T, c->v_heads, hd, hd / 2, v->rope_y, v->rope_inv,
                           PRISM_ROPE_INTERLEAVE));
            }
        }
        CK(o->attn_dense(bx, v->attn, VH, v->qkv, 3 * VH, v->qkv + VH, 3 * VH, v->qkv + 2 * VH, 3 * VH,
                         B, seq, c->v_heads, c->v_heads, hd, scale, false));
        CK(o->matmul(bx, v->h, VH, v->attn, VH, ly->wo, wdt, ly->bo, T, VH, VH, true));
        CK(o->layernorm(bx, v->xn, v->h, ly->ln2_w, ly->ln2_b, T, VH, c->v_eps));
        CK(o->matmul(bx, v->mlp, VI, v->xn, VH, ly->fc1, wdt, ly->fc1_b, T, VI, VH, false));
        CK(o->act(bx, (prism_act_t)c->v_act, v->mlp, v->mlp, (size_t)T * VI));
        CK(o->matmul(bx, v->h, VH, v->mlp, VI, ly->fc2, wdt, ly->fc2_b, T, VH, VI, true));
    }

    int R = B * v->n_out;
    if (v->l4) {
        const int A = c->v_adapter_dim;
        CK(o->layernorm(bx, v->h, v->h, v->post_w, v->post_b, T, VH, c->v_eps));
        CK(o->pixel_shuffle(bx, v->shuf, v->h, B, seq, S / P, VH, c->v_shuffle));   /* skips CLS */
        CK(o->matmul(bx, v->ad1, A, v->shuf, v->shuf_dim, v->ad1_w, wdt, NULL, R, A, v->shuf_dim, false));
        CK(o->act(bx, PRISM_ACT_GELU_ERF, v->ad1, v->ad1, (size_t)R * A));
        CK(o->matmul(bx, v->ad2, A, v->ad1, A, v->ad2_w, wdt, NULL, R, A, A, false));
        CK(o->act(bx, PRISM_ACT_GELU_ERF, v->ad2, v->ad2, (size_t)R * A));
        CK(o->matmul(bx, v->p1, H, v->ad2, A, v->p1_w, wdt, NULL, R, H, A, false));
        CK(o->download(bx, out, v->p1, (size_t)R * H * 4));
        return PRISM_OK;
    }
    const float *feats = v->h;
    if (c->v_select_default) {
        CK(o->copy_2d(bx, v->sel, (size_t)np * VH * 4, v->h + VH, (size_t)seq * VH * 4, (size_t)np * VH * 4, (size_t)B));
        feats = v->sel;
    }
    CK(o->matmul(bx, v->p1, H, feats, VH, v->p1_w, wdt, v->p1_b, R, H, VH, false));
    CK(o->act(bx, (prism_act_t)c->proj_act, v->p1, v->p1, (size_t)R * H));
    CK(o->matmul(bx, v->p2, H, v->p1, H, v->p2_w, wdt, v->p2_b, R, H, H, false));
    CK(o->download(bx, out, v->p2, (size_t)R * H * 4));
    return PRISM_OK;
}
