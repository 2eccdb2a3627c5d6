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
    /* matrices: [N][K] as commented, or the backend's packed layout of it (load_weights: MAT) */
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
    int32_t *rope_x, *rope_y;    /* Llama-4: [B*seq] 2D RoPE positions (x+1, y+1; CLS 0), alike for every image */
    float *rope_inv;             /* Llama-4: [head_dim/4] */
    const prism_model_hook_t *hook;
    int *keep;                   /* [max_images] caller's index of each image still in the batch */
    uint8_t *gone;               /* [max_images] scratch of the between-layer check */
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

/* The towers' checkpoint names, one table per architecture (as the text model's loader, llm.c,
 * names its tensors): where the tower sits (the first prefix under which `probe` exists), the names
 * below it, and the projector's. A NULL name: the architecture has no such tensor. Per-layer names
 * are under <tower prefix><layers><L>.; q, k, v are self_attn.{q,k,v}_proj, the MLP mlp.fc1/fc2, and
 * every layer tensor has a bias. */
typedef struct {
    const char *const *prefixes;
    int n_prefixes;
    const char *probe;
    const char *patch;      /* patch embedding weight: CLIP a Conv2d [VH][C][P][P], Llama-4 a Linear [VH][C*P*P] */
    int patch_ndim;
    const char *cls, *pos;  /* [VH], [seq][VH] */
    const char *pre, *post; /* layer norms before / after the layers (.weight, .bias) */
    const char *layers;     /* per-layer prefix, followed by the layer index and "." */
    const char *ln1, *ln2, *o_proj;
    const char *adapter;    /* Llama-4's vision adapter MLP (fc1 [A][shuffled], fc2 [A][A]) */
    bool proj2;             /* the projector has linear_2 (CLIP: linear_2(act(linear_1))) */
} vit_names_t;

static const char *const k_clip_prefixes[] = {"vision_tower.vision_model.", "model.vision_tower.vision_model.",
                                              "vision_tower.", "model.vision_tower."};
static const char *const k_l4_prefixes[] = {"vision_model.", "model.vision_model."};
static const char *const k_proj_prefixes[] = {"multi_modal_projector.", "model.multi_modal_projector."};

static const vit_names_t k_clip_names = {
    .prefixes = k_clip_prefixes, .n_prefixes = (int)PRISM_ARRAY_LEN(k_clip_prefixes),
    .probe = "embeddings.patch_embedding.weight",
    .patch = "embeddings.patch_embedding.weight", .patch_ndim = 4,
    .cls = "embeddings.class_embedding", .pos = "embeddings.position_embedding.weight",
    .pre = "pre_layrnorm", .post = NULL,   /* LLaVA reads hidden states before post_layernorm */
    .layers = "encoder.layers.", .ln1 = "layer_norm1", .ln2 = "layer_norm2", .o_proj = "out_proj",
    .adapter = NULL, .proj2 = true,
};

/* Llama-4: vision_model.{patch_embedding.linear, class_embedding, positional_embedding_vlm,
 * layernorm_pre/post, model.layers.N.*, vision_adapter.mlp.fc1/fc2}, multi_modal_projector.linear_1
 * (no biases outside the layers). */
static const vit_names_t k_l4_names = {
    .prefixes = k_l4_prefixes, .n_prefixes = (int)PRISM_ARRAY_LEN(k_l4_prefixes),
    .probe = "patch_embedding.linear.weight",
    .patch = "patch_embedding.linear.weight", .patch_ndim = 2,
    .cls = "class_embedding", .pos = "positional_embedding_vlm",
    .pre = "layernorm_pre", .post = "layernorm_post",
    .layers = "model.layers.", .ln1 = "input_layernorm", .ln2 = "post_attention_layernorm", .o_proj = "o_proj",
    .adapter = "vision_adapter.mlp.", .proj2 = false,
};

static const vit_names_t *vit_names(const prism_model_config_t *c) { return is_l4(c) ? &k_l4_names : &k_clip_names; }

/* Pass 1 (sizes) or 2 (upload) of the tower's weights under the names of its architecture. */
static int load_weights(struct prism_vision *v, prism_wload_t *w, const vit_names_t *nm, const char *vp,
                        const char *pp)
{
    const prism_model_config_t *c = &v->cfg;
    prism_dtype_t wdt = v->wdt;
    int64_t VH = c->v_hidden, VI = c->v_intermediate, H = c->hidden, C = c->v_num_channels, P = c->v_patch;
    /* the projector's input: the tower's width (CLIP), or the adapter's output (Llama-4) */
    int64_t PI = nm->adapter ? c->v_output_dim : VH;
    size_t es = prism_dtype_size(wdt);
    char name[256];
    int rc;
#define NAME(...) (snprintf(name, sizeof name, __VA_ARGS__), name)
#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define F32(dst, shp, ...) \
    if ((rc = prism_wload_tensor(w, (void **)&(dst), PRISM_DTYPE_F32, NAME(__VA_ARGS__), 1, SHAPE(shp)))) return rc
/* every matrix here is read by matmul only: the backend's matmul layout (prism_wload_pack_matmul) */
#define MAT(dst, rows, cols, ...)                                                                 \
    do {                                                                                          \
        (dst) = prism_wload_reserve_matmul(w, rows, cols);                                        \
        if ((rc = prism_wload_fill(w, (dst), wdt, NAME(__VA_ARGS__), 2, SHAPE(rows, cols))) ||    \
            (rc = prism_wload_pack_matmul(w, (dst), rows, cols)))                                 \
            return rc;                                                                            \
    } while (0)
    if (nm->patch_ndim == 4) {   /* Conv2d [VH][C][P][P]: the matmul's [VH][C*P*P] */
        v->patch_w = prism_wload_reserve_matmul(w, VH, C * P * P);
        if ((rc = prism_wload_fill(w, v->patch_w, wdt, NAME("%s%s", vp, nm->patch), 4, SHAPE(VH, C, P, P))) ||
            (rc = prism_wload_pack_matmul(w, v->patch_w, VH, C * P * P)))
            return rc;
    } else {
        MAT(v->patch_w, VH, C * P * P, "%s%s", vp, nm->patch);
    }
    F32(v->cls, VH, "%s%s", vp, nm->cls);
    if ((rc = prism_wload_tensor(w, (void **)&v->pos, PRISM_DTYPE_F32, NAME("%s%s", vp, nm->pos), 2, SHAPE(v->seq, VH)))) return rc;
    F32(v->pre_w, VH, "%s%s.weight", vp, nm->pre);
    F32(v->pre_b, VH, "%s%s.bias", vp, nm->pre);
    if (nm->post) {
        F32(v->post_w, VH, "%s%s.weight", vp, nm->post);
        F32(v->post_b, VH, "%s%s.bias", vp, nm->post);
    }
    for (int L = 0; L < v->n_run; L++) {
        vit_layer_t *ly = &v->layers[L];
        char p[160];
        snprintf(p, sizeof p, "%s%s%d.", vp, nm->layers, L);
        F32(ly->ln1_w, VH, "%s%s.weight", p, nm->ln1);
        F32(ly->ln1_b, VH, "%s%s.bias", p, nm->ln1);
        F32(ly->ln2_w, VH, "%s%s.weight", p, nm->ln2);
        F32(ly->ln2_b, VH, "%s%s.bias", p, nm->ln2);
        ly->wqkv = prism_wload_reserve_matmul(w, 3 * VH, VH);
        ly->bqkv = prism_wload_reserve(w, (size_t)(3 * VH) * 4);
        static const char *const qkv[3] = {"q", "k", "v"};
        for (int j = 0; j < 3; j++) {
            uint8_t *wd = ly->wqkv ? (uint8_t *)ly->wqkv + (size_t)j * VH * VH * es : NULL;
            float *bd = ly->bqkv ? ly->bqkv + j * VH : NULL;
            if ((rc = prism_wload_fill(w, wd, wdt, NAME("%sself_attn.%s_proj.weight", p, qkv[j]), 2, SHAPE(VH, VH)))) return rc;
            if ((rc = prism_wload_fill(w, bd, PRISM_DTYPE_F32, NAME("%sself_attn.%s_proj.bias", p, qkv[j]), 1, SHAPE(VH)))) return rc;
        }
        if ((rc = prism_wload_pack_matmul(w, ly->wqkv, 3 * VH, VH))) return rc;
        MAT(ly->wo, VH, VH, "%sself_attn.%s.weight", p, nm->o_proj);
        F32(ly->bo, VH, "%sself_attn.%s.bias", p, nm->o_proj);
        MAT(ly->fc1, VI, VH, "%smlp.fc1.weight", p);
        F32(ly->fc1_b, VI, "%smlp.fc1.bias", p);
        MAT(ly->fc2, VH, VI, "%smlp.fc2.weight", p);
        F32(ly->fc2_b, VH, "%smlp.fc2.bias", p);
    }
    if (nm->adapter) {
        int64_t A = c->v_adapter_dim;
        MAT(v->ad1_w, A, v->shuf_dim, "%s%sfc1.weight", vp, nm->adapter);
        MAT(v->ad2_w, A, A, "%s%sfc2.weight", vp, nm->adapter);
    }
    MAT(v->p1_w, H, PI, "%slinear_1.weight", pp);
    if (nm->proj2) MAT(v->p2_w, H, H, "%slinear_2.weight", pp);
    if (c->proj_bias) {
        F32(v->p1_b, H, "%slinear_1.bias", pp);
        if (nm->proj2) F32(v->p2_b, H, "%slinear_2.bias", pp);
    }
#undef MAT
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
    v->keep = prism_calloc((size_t)max_images, sizeof *v->keep);
    v->gone = prism_calloc((size_t)max_images, 1);
    if (!v->layers || !v->keep || !v->gone) goto fail;
    const vit_names_t *nm = vit_names(cfg);
    const char *vp = nm->prefixes[0], *pp = k_proj_prefixes[0];
    if (!cfg->random_weights) {
        rc = prism_st_open_dir(model_dir, &st, err, errlen);
        if (rc != PRISM_OK) goto fail;
        vp = prism_wload_find_prefix(st, nm->prefixes, nm->n_prefixes, nm->probe);
        pp = prism_wload_find_prefix(st, k_proj_prefixes, (int)PRISM_ARRAY_LEN(k_proj_prefixes), "linear_1.weight");
    }
    if (!vp || !pp) {
        ERR("weights: no %s found in %s", vp ? "multi_modal_projector" : "vision tower", model_dir);
        rc = PRISM_ENOTFOUND;
        goto fail;
    }
    w = (prism_wload_t){.be = be, .st = st, .err = err, .errlen = errlen, .random = cfg->random_weights,
                        .seed = cfg->random_seed};
    if ((rc = load_weights(v, &w, nm, vp, pp)) != PRISM_OK) goto fail;
    if ((rc = prism_wload_begin_upload(&w, &v->wbuf, &v->wbytes)) != PRISM_OK) goto fail;
    if ((rc = load_weights(v, &w, nm, vp, pp)) != PRISM_OK) goto fail;
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
        char packed[48] = "";
        if (w.n_packed) snprintf(packed, sizeof packed, " (%d matmul weights packed)", w.n_packed);
        PRISM_INFO("vision: %s %dpx/%d, %d of %d layers, %s weights%s + %s arena for %d images",
                   v->l4 ? "Llama-4" : "CLIP", cfg->v_image_size, cfg->v_patch, v->n_run, cfg->v_layers, prism_fmt_bytes(v->wbytes, a, sizeof a),
                   packed, prism_fmt_bytes(v->abytes, b, sizeof b), max_images);
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
    prism_free(v->keep);
    prism_free(v->gone);
    prism_free(v);
}

size_t prism_vision_weight_bytes(const prism_vision_t *v) { return v->wbytes; }

#define CK(x) do { int rc_ = (x); if (rc_ != PRISM_OK) return rc_; } while (0)

void prism_vision_set_hook(prism_vision_t *v, const prism_model_hook_t *hook) { v->hook = hook; }

/* Between layers: asks the hook and drops cancelled images by moving the rows of the others
 * into the spare buffer (*xn, rewritten by the next layer anyway) and swapping the two.
 * Returns the images left. */
static int vis_between_layers(struct prism_vision *v, int B, float **h, float **xn, int done, int *rc)
{
    const prism_model_hook_t *k = v->hook;
    *rc = PRISM_OK;
    if (!k || !k->layer || !k->layer(k->ud, done, v->n_run) || !k->cancelled) return B;
    int nb = 0;
    for (int i = 0; i < B; i++) {
        v->gone[i] = k->cancelled(k->ud, v->keep[i]);
        nb += !v->gone[i];
    }
    if (nb == B || nb == 0) return nb;
    const size_t rows = (size_t)v->seq * v->cfg.v_hidden;
    for (int i = 0, j = 0; i < B; i++) {
        if (v->gone[i]) continue;
        *rc = v->be->i.copy(v->be->ctx, *xn + (size_t)j * rows, *h + (size_t)i * rows, rows * 4);
        if (*rc != PRISM_OK) return 0;
        v->keep[j++] = v->keep[i];
    }
    float *t = *h;
    *h = *xn;
    *xn = t;
    return nb;
}

/* The B images left of n_images, per floats each, to their caller's slots; dropped slots untouched. */
static int vis_download(struct prism_vision *v, float *out, const float *src, int B, int n_images, size_t per)
{
    const prism_backend_i *o = &v->be->i;
    if (B == n_images) return o->download(v->be->ctx, out, src, (size_t)B * per * 4);
    for (int i = 0; i < B; i++)
        CK(o->download(v->be->ctx, out + (size_t)v->keep[i] * per, src + (size_t)i * per, per * 4));
    return PRISM_OK;
}

int prism_vision_encode(prism_vision_t *v, const float *pixels, int n_images, float *out)
{
    const prism_model_config_t *c = &v->cfg;
    const prism_backend_i *o = &v->be->i;
    void *bx = v->be->ctx;
    if (n_images <= 0 || !pixels || !out) return PRISM_EINVAL;
    if (n_images > v->max_images) return PRISM_ELIMIT;
    int B = n_images;
    const int VH = c->v_hidden, VI = c->v_intermediate, P = c->v_patch, Cn = c->v_num_channels;
    const int S = c->v_image_size, np = v->n_patches, seq = v->seq, H = c->hidden;
    const int hd = VH / c->v_heads, feat = Cn * P * P;
    prism_dtype_t wdt = v->wdt;
    float *h = v->h, *xn = v->xn;   /* swapped when images are dropped */
    int rc = PRISM_OK;
    for (int i = 0; i < B; i++) v->keep[i] = i;

    CK(o->upload(bx, v->pix, pixels, (size_t)B * Cn * S * S * 4));
    CK(o->im2patch(bx, v->patches, v->pix, B, Cn, S, S, P));
    /* Patch embeddings staged in xn, then placed around the CLS row: CLIP puts CLS first (row 0),
     * Llama-4 last (row np). */
    CK(o->matmul(bx, xn, VH, v->patches, feat, v->patch_w, wdt, NULL, B * np, VH, feat, false));
    const int cls_row = v->l4 ? np : 0, patch_row = v->l4 ? 0 : 1;
    for (int i = 0; i < B; i++) {
        float *img = h + (size_t)i * seq * VH;
        CK(o->copy(bx, img + (size_t)cls_row * VH, v->cls, (size_t)VH * 4));
        CK(o->copy(bx, img + (size_t)patch_row * VH, xn + (size_t)i * np * VH, (size_t)np * VH * 4));
    }
    CK(o->add(bx, h, h, v->pos, (size_t)B * seq * VH, (size_t)seq * VH));
    CK(o->layernorm(bx, h, h, v->pre_w, v->pre_b, B * seq, VH, c->v_eps));
    B = vis_between_layers(v, B, &h, &xn, 0, &rc);
    CK(rc);

    float scale = 1.0f / sqrtf((float)hd);
    for (int L = 0; L < v->n_run && B > 0; L++) {
        const vit_layer_t *ly = &v->layers[L];
        const int T = B * seq;
        CK(o->layernorm(bx, xn, h, ly->ln1_w, ly->ln1_b, T, VH, c->v_eps));
        CK(o->matmul(bx, v->qkv, 3 * VH, xn, VH, ly->wqkv, wdt, ly->bqkv, T, 3 * VH, VH, false));
        if (v->l4) {
            /* 2D RoPE: the first half of every q/k head turns with the column, the second with the row.
             * Positions repeat per image, so they hold for the first B images after any drop. */
            for (int j = 0; j < 2; j++) {
                float *base = v->qkv + (size_t)j * VH;
                CK(o->rope(bx, base, 3 * VH, T, c->v_heads, hd, hd / 2, v->rope_x, v->rope_inv, PRISM_ROPE_INTERLEAVE));
                CK(o->rope(bx, base + hd / 2, 3 * VH, T, c->v_heads, hd, hd / 2, v->rope_y, v->rope_inv,
                           PRISM_ROPE_INTERLEAVE));
            }
        }
        CK(o->attn_dense(bx, v->attn, VH, v->qkv, 3 * VH, v->qkv + VH, 3 * VH, v->qkv + 2 * VH, 3 * VH,
                         B, seq, c->v_heads, c->v_heads, hd, scale, false));
        CK(o->matmul(bx, h, VH, v->attn, VH, ly->wo, wdt, ly->bo, T, VH, VH, true));
        CK(o->layernorm(bx, xn, h, ly->ln2_w, ly->ln2_b, T, VH, c->v_eps));
        CK(o->matmul(bx, v->mlp, VI, xn, VH, ly->fc1, wdt, ly->fc1_b, T, VI, VH, false));
        CK(o->act(bx, (prism_act_t)c->v_act, v->mlp, v->mlp, (size_t)T * VI));
        CK(o->matmul(bx, h, VH, v->mlp, VI, ly->fc2, wdt, ly->fc2_b, T, VH, VI, true));
        B = vis_between_layers(v, B, &h, &xn, L + 1, &rc);
        CK(rc);
    }
    if (B == 0) return PRISM_OK;   /* every image was cancelled */

    const int T = B * seq, R = B * v->n_out;
    const size_t per = (size_t)v->n_out * H;
    if (v->l4) {
        const int A = c->v_adapter_dim;
        CK(o->layernorm(bx, h, h, v->post_w, v->post_b, T, VH, c->v_eps));
        CK(o->pixel_shuffle(bx, v->shuf, h, B, seq, S / P, VH, c->v_shuffle));   /* skips CLS */
        CK(o->matmul(bx, v->ad1, A, v->shuf, v->shuf_dim, v->ad1_w, wdt, NULL, R, A, v->shuf_dim, false));
        CK(o->act(bx, PRISM_ACT_GELU_ERF, v->ad1, v->ad1, (size_t)R * A));
        CK(o->matmul(bx, v->ad2, A, v->ad1, A, v->ad2_w, wdt, NULL, R, A, A, false));
        CK(o->act(bx, PRISM_ACT_GELU_ERF, v->ad2, v->ad2, (size_t)R * A));
        CK(o->matmul(bx, v->p1, H, v->ad2, A, v->p1_w, wdt, NULL, R, H, A, false));
        return vis_download(v, out, v->p1, B, n_images, per);
    }
    const float *feats = h;
    if (c->v_select_default) {
        CK(o->copy_2d(bx, v->sel, (size_t)np * VH * 4, h + VH, (size_t)seq * VH * 4, (size_t)np * VH * 4, (size_t)B));
        feats = v->sel;
    }
    CK(o->matmul(bx, v->p1, H, feats, VH, v->p1_w, wdt, v->p1_b, R, H, VH, false));
    CK(o->act(bx, (prism_act_t)c->proj_act, v->p1, v->p1, (size_t)R * H));
    CK(o->matmul(bx, v->p2, H, v->p1, H, v->p2_w, wdt, v->p2_b, R, H, H, false));
    return vis_download(v, out, v->p2, B, n_images, per);
}
