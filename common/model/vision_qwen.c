/* Native-resolution vision towers: Qwen2.5-VL (transformers' Qwen2_5_VisionTransformerPretrainedModel)
 * and Qwen3-VL (Qwen3VLVisionModel; the differences are listed after the Qwen2.5-VL walk-through).
 *
 * An image of h x w patches (HF's patch order: merged row, merged column, then the merge x merge
 * block) goes through:
 *   patch embedding   the host frame repeated temporal_patch_size times on the device (copy_2d),
 *                     then one matmul with the Conv3d weight [hidden][C*T*p*p] (stride = kernel);
 *   window order      merged tokens regrouped window by window (HF's window_index: windows of
 *                     window_size / patch / merge merged tokens a side, row-major, the last ones
 *                     clipped at the image's edge), the merge blocks staying together;
 *   layers            x += proj(attn(RMSNorm(x))), x += down(silu(gate) * up)(RMSNorm(x)), every
 *                     linear with its bias; 2D rotary on q and k (rotate_half pairs: the first
 *                     head_dim/4 pairs turn with the patch's row, the next with its column, the
 *                     same frequencies twice); attention within each window, or over the whole
 *                     image in the layers of fullatt_block_indexes: attn_varlen over cu_seqlens,
 *                     blockwise, never an n x n matrix;
 *   merger            RMSNorm (ln_q), each merge block's rows side by side ([n/4][4*hidden], a view:
 *                     the block's rows are adjacent), Linear, GELU (erf), Linear to the LM width;
 *   image order       the inverse window permutation (HF's argsort(window_index)) on the way out.
 * Qwen3-VL: the Conv3d has a bias; learned position embeddings (a square grid of
 * num_position_embeddings) bilinearly interpolated to the image's grid (align_corners, HF's
 * get_vision_interpolation_indices_and_weights: 4 taps and weights per patch) are added to the
 * patch embeddings; no windows (every layer attends over its image, the window order is the
 * identity); LayerNorm with biases; a plain MLP (fc1, GELU tanh, fc2); after each DeepStack layer a
 * merger of its own (LayerNorm over the 2x2 block's concatenated rows) writes a feature level of
 * the output rows; the final merger's LayerNorm is over each row before the concatenation.
 * Output rows: [embedding][DeepStack level 0]...[level n-1] (prism_model_embed_row_floats).
 * The metadata (gather indices, positions, cu_seqlens) is built on the host per forward and
 * uploaded once; weights and activations were carved at load, so a forward never allocates. */
#include "model/model_impl.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)
#define CK(x) do { int rc_ = (x); if (rc_ != PRISM_OK) return rc_; } while (0)

#define MLP_CHUNK 4096   /* rows of the MLP per matmul: its [rows][3 * intermediate] scratch is the only
                          * part of the arena that does not grow with the image */

typedef struct {
    float *n1, *n2;          /* [VH] RMSNorm (Qwen3: LayerNorm) weights */
    float *n1b, *n2b;        /* [VH] Qwen3: LayerNorm biases */
    void *wqkv;              /* [3 VH][VH]: q rows, k rows, v rows (HF's fused qkv) */
    float *bqkv;             /* [3 VH] */
    void *wo;                /* [VH][VH] */
    float *bo;               /* [VH] */
    void *wgu;               /* [2 VI][VH]: gate rows, then up rows (Qwen3: fc1 [VI][VH]) */
    float *bgu;              /* [2 VI] (Qwen3: [VI]) */
    void *wd;                /* [VH][VI] */
    float *bd;               /* [VH] */
} qv_layer_t;

struct prism_vision_native {
    prism_backend_t *be;
    prism_model_config_t cfg;
    prism_dtype_t wdt;
    int max_patches;
    int hd, mm;              /* head dim; patches per LM token (merge^2) */
    int pix_feat, feat;      /* floats of a host patch row (one frame), of the embedding's input (T frames) */
    void *wbuf;
    size_t wbytes;
    void *patch_w;           /* [VH][C*T*p*p] */
    qv_layer_t *layers;      /* [v_layers] */
    float *ln_q;             /* [VH] merger RMSNorm (Qwen3: LayerNorm weight) */
    void *m1_w, *m2_w;       /* [mm VH][mm VH], [H][mm VH] */
    float *m1_b, *m2_b;      /* [mm VH], [H] */
    /* Qwen3-VL */
    bool q3;
    int rw;                  /* floats of an output row: hidden x (1 + DeepStack levels) */
    float *patch_b;          /* [VH] */
    float *pos_embed;        /* [num_pos][VH] */
    int side;                /* sqrt(num_pos) */
    float *ln_b;             /* [VH] final merger LayerNorm bias */
    struct {
        float *nw, *nb;      /* [mm VH] LayerNorm over the concatenated block */
        void *w1, *w2;       /* [mm VH][mm VH], [H][mm VH] */
        float *b1, *b2;
    } ds[PRISM_MODEL_MAX_DEEPSTACK];   /* config.json's order (deepstack_merger_list) */
    int ds_level[PRISM_MODEL_MAX_VLAYERS];   /* vision layer -> output level + 1 (0: none) */
    int ds_merger[PRISM_MODEL_MAX_VLAYERS];  /* vision layer -> its merger */

    void *abuf;
    size_t abytes;
    float *pix;              /* [N][pix_feat] */
    float *big;              /* [N][max(3 VH, feat)]: expanded frames, then qkv, then the merger's input */
    float *h, *xn, *attn;    /* [N][VH], each at least [N/mm][H] (the merger's outputs); h and attn take
                              * turns as the residual stream (images dropped between layers) */
    float *mlp;              /* [MLP_CHUNK][3 VI]: gate|up, then the activation */
    float *rope_inv;         /* [hd/2] row frequencies, then the same for columns */
    float *obuf;             /* Qwen3: [N/mm][rw] output rows */
    float *iw, *h_iw;        /* Qwen3: [4][N] interpolation weights (device, host) */
    int32_t *d_meta;         /* device: widx[N] rev[N/mm] pos[2][N] cu_win[N/mm + 2] cu_full[N/mm + 2] (itap[4][N]) */
    int32_t *h_meta;         /* host mirror */
    size_t meta_n;
    prism_rope_sections_t sec;
    const prism_model_hook_t *hook;
    int *keep;               /* [max images] caller's index of each image still in the batch */
    prism_vgrid_t *kgrid;    /* [max images] their grids */
    uint8_t *gone;
};

/* ---------------------------------------------------------------- sizing */

static int max_images_of(int max_patches, int mm) { return PRISM_MAX(1, max_patches / mm); }

static size_t big_width(const prism_model_config_t *c)
{
    size_t feat = (size_t)c->v_num_channels * c->v_temporal_patch * c->v_patch * c->v_patch;
    return PRISM_MAX((size_t)3 * c->v_hidden, feat);   /* >= the merger's [N/4][4 VH] view */
}

static size_t meta_count(int N, int mm, bool q3)
{
    size_t nt = (size_t)N / mm;
    return (size_t)N + nt + 2 * (size_t)N + 2 * (nt + 2) + (q3 ? 4 * (size_t)N : 0);   /* + Qwen3's taps */
}

static size_t qv_layout(const prism_model_config_t *c, int N, struct prism_vision_native *v)
{
    prism_layout_t l = {v ? v->abuf : NULL, 0};
    size_t VH = (size_t)c->v_hidden, H = (size_t)c->hidden, mm = (size_t)c->v_merge * c->v_merge;
    size_t nt = (size_t)N / mm, wide = PRISM_MAX((size_t)N * VH, nt * H);
    size_t pix_feat = (size_t)c->v_num_channels * c->v_patch * c->v_patch;
    size_t chunk = (size_t)PRISM_MIN(N, MLP_CHUNK);
    float *pix = prism_layout_take(&l, (size_t)N * pix_feat * 4);
    float *big = prism_layout_take(&l, (size_t)N * big_width(c) * 4);
    float *h = prism_layout_take(&l, wide * 4);
    float *xn = prism_layout_take(&l, wide * 4);
    float *attn = prism_layout_take(&l, wide * 4);
    float *mlp = prism_layout_take(&l, chunk * 3 * (size_t)c->v_intermediate * 4);   /* Qwen3 uses a third */
    float *inv = prism_layout_take(&l, (size_t)(c->v_hidden / c->v_heads / 2) * 4);
    int32_t *meta = prism_layout_take(&l, meta_count(N, (int)mm, c->vision_arch == PRISM_VISION_QWEN3) * 4);
    float *obuf = NULL, *iw = NULL;
    if (c->vision_arch == PRISM_VISION_QWEN3) {
        obuf = prism_layout_take(&l, nt * (size_t)prism_model_embed_row_floats(c) * 4);
        iw = prism_layout_take(&l, 4 * (size_t)N * 4);
    }
    if (v && v->abuf) {
        v->pix = pix; v->big = big; v->h = h; v->xn = xn; v->attn = attn; v->mlp = mlp; v->rope_inv = inv;
        v->d_meta = meta; v->obuf = obuf; v->iw = iw;
    }
    return PRISM_ALIGN_UP(l.off, PRISM_TENSOR_ALIGN);
}

size_t prism_vision_native_arena_bytes(const prism_model_config_t *cfg, int max_patches)
{
    if (!cfg->has_vision || (cfg->vision_arch != PRISM_VISION_QWEN25 && cfg->vision_arch != PRISM_VISION_QWEN3) ||
        max_patches <= 0)
        return 0;
    return qv_layout(cfg, max_patches, NULL);
}

size_t prism_vision_native_host_bytes(const prism_model_config_t *cfg, int max_patches)
{
    if (!cfg->has_vision || (cfg->vision_arch != PRISM_VISION_QWEN25 && cfg->vision_arch != PRISM_VISION_QWEN3)) return 0;
    int mm = cfg->v_merge * cfg->v_merge;
    bool q3 = cfg->vision_arch == PRISM_VISION_QWEN3;
    size_t b = sizeof(struct prism_vision_native) + (size_t)cfg->v_layers * sizeof(qv_layer_t);
    if (max_patches <= 0) return b;
    /* as prism_vision_native_reserve allocates them: keep, kgrid, gone, h_meta (and Qwen3's h_iw) */
    size_t imgs = (size_t)max_images_of(max_patches, mm);
    return b + imgs * (sizeof(int) + sizeof(prism_vgrid_t) + 1) + meta_count(max_patches, mm, q3) * sizeof(int32_t) +
           (q3 ? 4 * (size_t)max_patches * sizeof(float) : 0);
}

size_t prism_vision_native_row_floats(const prism_model_config_t *cfg)
{
    return (size_t)prism_model_embed_row_floats(cfg);
}

/* ---------------------------------------------------------------- weights */

/* Tensors of one layer: HF name, field, and the part of a fused matrix it fills. Dimensions are
 * symbolic (VH, VI: the vision hidden and intermediate widths). */
enum { D_1 = 0, D_VH, D_VI, D_2VI, D_3VH };
typedef struct {
    const char *name;
    size_t off;              /* offsetof the field in qv_layer_t */
    bool f32;                /* norms and biases: float32; matrices: the backend's weight dtype */
    int rows, cols;          /* this tensor */
    int fused_rows, row0;    /* the field's whole matrix and where this tensor starts in it (D_1: row 0) */
} qv_tensor_t;

static const qv_tensor_t k_qwen25_layer[] = {
    {"norm1.weight", offsetof(qv_layer_t, n1), true, D_VH, D_1, D_VH, 0},
    {"norm2.weight", offsetof(qv_layer_t, n2), true, D_VH, D_1, D_VH, 0},
    {"attn.qkv.weight", offsetof(qv_layer_t, wqkv), false, D_3VH, D_VH, D_3VH, 0},
    {"attn.qkv.bias", offsetof(qv_layer_t, bqkv), true, D_3VH, D_1, D_3VH, 0},
    {"attn.proj.weight", offsetof(qv_layer_t, wo), false, D_VH, D_VH, D_VH, 0},
    {"attn.proj.bias", offsetof(qv_layer_t, bo), true, D_VH, D_1, D_VH, 0},
    {"mlp.gate_proj.weight", offsetof(qv_layer_t, wgu), false, D_VI, D_VH, D_2VI, 0},
    {"mlp.up_proj.weight", offsetof(qv_layer_t, wgu), false, D_VI, D_VH, D_2VI, D_VI},
    {"mlp.gate_proj.bias", offsetof(qv_layer_t, bgu), true, D_VI, D_1, D_2VI, 0},
    {"mlp.up_proj.bias", offsetof(qv_layer_t, bgu), true, D_VI, D_1, D_2VI, D_VI},
    {"mlp.down_proj.weight", offsetof(qv_layer_t, wd), false, D_VH, D_VI, D_VH, 0},
    {"mlp.down_proj.bias", offsetof(qv_layer_t, bd), true, D_VH, D_1, D_VH, 0},
};

static const qv_tensor_t k_qwen3_layer[] = {
    {"norm1.weight", offsetof(qv_layer_t, n1), true, D_VH, D_1, D_VH, 0},
    {"norm1.bias", offsetof(qv_layer_t, n1b), true, D_VH, D_1, D_VH, 0},
    {"norm2.weight", offsetof(qv_layer_t, n2), true, D_VH, D_1, D_VH, 0},
    {"norm2.bias", offsetof(qv_layer_t, n2b), true, D_VH, D_1, D_VH, 0},
    {"attn.qkv.weight", offsetof(qv_layer_t, wqkv), false, D_3VH, D_VH, D_3VH, 0},
    {"attn.qkv.bias", offsetof(qv_layer_t, bqkv), true, D_3VH, D_1, D_3VH, 0},
    {"attn.proj.weight", offsetof(qv_layer_t, wo), false, D_VH, D_VH, D_VH, 0},
    {"attn.proj.bias", offsetof(qv_layer_t, bo), true, D_VH, D_1, D_VH, 0},
    {"mlp.linear_fc1.weight", offsetof(qv_layer_t, wgu), false, D_VI, D_VH, D_VI, 0},
    {"mlp.linear_fc1.bias", offsetof(qv_layer_t, bgu), true, D_VI, D_1, D_VI, 0},
    {"mlp.linear_fc2.weight", offsetof(qv_layer_t, wd), false, D_VH, D_VI, D_VH, 0},
    {"mlp.linear_fc2.bias", offsetof(qv_layer_t, bd), true, D_VH, D_1, D_VH, 0},
};

/* The towers' checkpoint names, one table per architecture (as vision.c's CLIP / Llama-4 tables and the
 * text model's loader name theirs): the tensors outside the layers, the per-layer table under
 * <prefix><layers><L>., and the mergers'. A NULL name: the architecture has no such tensor. */
typedef struct {
    const char *patch;            /* Conv3d [VH][C][T][p][p] (kernel = stride: a matmul over T frames' patch rows) */
    const char *patch_bias;       /* [VH] */
    const char *pos;              /* [num_pos][VH] learned position grid */
    const char *layers;           /* per-layer prefix, followed by the layer index and "." */
    const qv_tensor_t *layer;
    int n_layer;
    const char *merger_norm;      /* .weight [VH] (RMSNorm or LayerNorm), .bias when merger_norm_bias */
    bool merger_norm_bias;
    const char *merger_fc1, *merger_fc2;   /* [mm VH][mm VH], [H][mm VH], with biases */
    const char *deepstack;        /* <deepstack><k>.{norm, linear_fc1, linear_fc2}: one merger per DeepStack layer */
} qv_names_t;

/* where both architectures put the tower: the first prefix under which the patch embedding exists */
static const char *const k_prefixes[] = {"visual.", "model.visual."};

/* Qwen2.5-VL: visual.{patch_embed.proj, blocks.N.*, merger.{ln_q, mlp.0, mlp.2}} */
static const qv_names_t k_qwen25_names = {
    .patch = "patch_embed.proj.weight", .layers = "blocks.",
    .layer = k_qwen25_layer, .n_layer = (int)PRISM_ARRAY_LEN(k_qwen25_layer),
    .merger_norm = "merger.ln_q", .merger_fc1 = "merger.mlp.0", .merger_fc2 = "merger.mlp.2",
};

/* Qwen3-VL: visual.{patch_embed.proj (+ bias), pos_embed, blocks.N.*, merger.{norm, linear_fc1,
 * linear_fc2}, deepstack_merger_list.K.*} */
static const qv_names_t k_qwen3_names = {
    .patch = "patch_embed.proj.weight", .patch_bias = "patch_embed.proj.bias", .pos = "pos_embed.weight",
    .layers = "blocks.", .layer = k_qwen3_layer, .n_layer = (int)PRISM_ARRAY_LEN(k_qwen3_layer),
    .merger_norm = "merger.norm", .merger_norm_bias = true, .merger_fc1 = "merger.linear_fc1",
    .merger_fc2 = "merger.linear_fc2", .deepstack = "deepstack_merger_list.",
};

static int64_t dim_of(const prism_model_config_t *c, int d)
{
    switch (d) {
    case D_VH: return c->v_hidden;
    case D_VI: return c->v_intermediate;
    case D_2VI: return 2 * (int64_t)c->v_intermediate;
    case D_3VH: return 3 * (int64_t)c->v_hidden;
    default: return 1;
    }
}

static int load_table(struct prism_vision_native *v, prism_wload_t *w, const char *pfx, void *base,
                      const qv_tensor_t *tab, size_t n)
{
    const prism_model_config_t *c = &v->cfg;
    char name[256];
    for (size_t i = 0; i < n; i++) {
        const qv_tensor_t *t = &tab[i];
        prism_dtype_t dt = t->f32 ? PRISM_DTYPE_F32 : v->wdt;
        size_t es = prism_dtype_size(dt);
        int64_t rows = dim_of(c, t->rows), cols = dim_of(c, t->cols);
        void **field = (void **)((uint8_t *)base + t->off);
        /* the first part of a matrix reserves all of it; later parts start row0 rows in */
        int64_t row0 = t->row0 == D_1 ? 0 : dim_of(c, t->row0);
        if (!row0) *field = prism_wload_reserve(w, (size_t)(dim_of(c, t->fused_rows) * cols) * es);
        uint8_t *dst = *field ? (uint8_t *)*field + (size_t)(row0 * cols) * es : NULL;
        snprintf(name, sizeof name, "%s%s", pfx, t->name);
        int rc = t->cols == D_1 ? prism_wload_fill(w, dst, dt, name, 1, (const int64_t[]){rows})
                                : prism_wload_fill(w, dst, dt, name, 2, (const int64_t[]){rows, cols});
        if (rc != PRISM_OK) return rc;
    }
    return PRISM_OK;
}

static const qv_names_t *qv_names(const prism_model_config_t *c)
{
    return c->vision_arch == PRISM_VISION_QWEN3 ? &k_qwen3_names : &k_qwen25_names;
}

/* Pass 1 (sizes) or 2 (upload) of the tower's weights under the names of its architecture. */
static int load_weights(struct prism_vision_native *v, prism_wload_t *w, const qv_names_t *nm, const char *vp)
{
    const prism_model_config_t *c = &v->cfg;
    int64_t VH = c->v_hidden, H = c->hidden, C = c->v_num_channels, T = c->v_temporal_patch, P = c->v_patch;
    int64_t MV = (int64_t)v->mm * VH;
    char name[256], p[160];
    int rc;
#define NAME(...) (snprintf(name, sizeof name, __VA_ARGS__), name)
#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define F32(dst, shp, ...) \
    if ((rc = prism_wload_tensor(w, (void **)&(dst), PRISM_DTYPE_F32, NAME(__VA_ARGS__), 1, SHAPE(shp)))) return rc
#define MAT(dst, rows, cols, ...) \
    if ((rc = prism_wload_tensor(w, &(dst), v->wdt, NAME(__VA_ARGS__), 2, SHAPE(rows, cols)))) return rc
    if ((rc = prism_wload_tensor(w, &v->patch_w, v->wdt, NAME("%s%s", vp, nm->patch), 5, SHAPE(VH, C, T, P, P))))
        return rc;
    if (nm->patch_bias) F32(v->patch_b, VH, "%s%s", vp, nm->patch_bias);
    if (nm->pos &&
        (rc = prism_wload_tensor(w, (void **)&v->pos_embed, PRISM_DTYPE_F32, NAME("%s%s", vp, nm->pos), 2,
                                 SHAPE(c->v_num_pos, VH))))
        return rc;
    for (int L = 0; L < c->v_layers; L++) {
        snprintf(p, sizeof p, "%s%s%d.", vp, nm->layers, L);
        if ((rc = load_table(v, w, p, &v->layers[L], nm->layer, (size_t)nm->n_layer))) return rc;
    }
    F32(v->ln_q, VH, "%s%s.weight", vp, nm->merger_norm);
    if (nm->merger_norm_bias) F32(v->ln_b, VH, "%s%s.bias", vp, nm->merger_norm);
    MAT(v->m1_w, MV, MV, "%s%s.weight", vp, nm->merger_fc1);
    F32(v->m1_b, MV, "%s%s.bias", vp, nm->merger_fc1);
    MAT(v->m2_w, H, MV, "%s%s.weight", vp, nm->merger_fc2);
    F32(v->m2_b, H, "%s%s.bias", vp, nm->merger_fc2);
    /* DeepStack: one merger per level, its norm over the concatenated merge block */
    for (int k = 0; nm->deepstack && k < c->n_deepstack; k++) {
        snprintf(p, sizeof p, "%s%s%d.", vp, nm->deepstack, k);
        F32(v->ds[k].nw, MV, "%snorm.weight", p);
        F32(v->ds[k].nb, MV, "%snorm.bias", p);
        MAT(v->ds[k].w1, MV, MV, "%slinear_fc1.weight", p);
        F32(v->ds[k].b1, MV, "%slinear_fc1.bias", p);
        MAT(v->ds[k].w2, H, MV, "%slinear_fc2.weight", p);
        F32(v->ds[k].b2, H, "%slinear_fc2.bias", p);
    }
#undef MAT
#undef F32
#undef NAME
#undef SHAPE
    return PRISM_OK;
}

int prism_vision_native_load(prism_backend_t *be, const prism_model_config_t *cfg, const char *model_dir,
                             int max_patches, prism_vision_native_t **out, char *err, size_t errlen)
{
    *out = NULL;
    if (!cfg->has_vision || (cfg->vision_arch != PRISM_VISION_QWEN25 && cfg->vision_arch != PRISM_VISION_QWEN3)) {
        ERR("vision: %s has no native-resolution vision tower", cfg->arch);
        return PRISM_ENOTSUP;
    }
    int mm = cfg->v_merge * cfg->v_merge;
    if ((max_patches && max_patches < mm) || max_patches < 0 || max_patches > (1 << 24) || cfg->v_layers < 1 ||
        cfg->v_layers > PRISM_MODEL_MAX_VLAYERS) {
        ERR("vision: bad max_patches %d", max_patches);
        return PRISM_EINVAL;
    }
    if (!be->i.rope_multi || !be->i.attn_varlen ||
        (cfg->vision_arch == PRISM_VISION_QWEN3 && (!be->i.scale_rows || !be->i.layernorm))) {
        ERR("vision: the %s backend lacks the ops Qwen-VL needs (rope_multi, attn_varlen, scale_rows)", be->device);
        return PRISM_ENOTSUP;
    }
    prism_st_t *st = NULL;
    prism_wload_t w = {0};
    struct prism_vision_native *v = prism_calloc(1, sizeof *v);
    int rc = PRISM_ENOMEM;
    if (!v) goto fail;
    v->be = be;
    v->cfg = *cfg;
    v->wdt = be->weight_dtype;
    v->mm = mm;
    v->hd = cfg->v_hidden / cfg->v_heads;
    v->pix_feat = cfg->v_num_channels * cfg->v_patch * cfg->v_patch;
    v->feat = v->pix_feat * cfg->v_temporal_patch;
    v->q3 = cfg->vision_arch == PRISM_VISION_QWEN3;
    v->rw = prism_model_embed_row_floats(cfg);
    if (v->q3) {
        v->side = (int)lround(sqrt((double)cfg->v_num_pos));
        /* HF appends the DeepStack features in layer order (the LM's layer k gets the k-th), each
         * from the merger at its layer's place in deepstack_visual_indexes */
        for (int k = 0; k < cfg->n_deepstack; k++) {
            int L = cfg->v_deepstack[k], level = 0;
            for (int j = 0; j < cfg->n_deepstack; j++) level += cfg->v_deepstack[j] < L;
            v->ds_level[L] = level + 1;
            v->ds_merger[L] = k;
        }
    }
    v->layers = prism_calloc((size_t)cfg->v_layers, sizeof *v->layers);
    if (!v->layers) goto fail;
    const qv_names_t *nm = qv_names(cfg);
    const char *vp = k_prefixes[0];
    if (!cfg->random_weights) {
        if ((rc = prism_st_open_dir(model_dir, &st, err, errlen)) != PRISM_OK) goto fail;
        vp = prism_wload_find_prefix(st, k_prefixes, (int)PRISM_ARRAY_LEN(k_prefixes), nm->patch);
        if (!vp) {
            ERR("weights: no Qwen-VL vision tower (visual.%s) in %s", nm->patch, model_dir);
            rc = PRISM_ENOTFOUND;
            goto fail;
        }
    }
    w = (prism_wload_t){.be = be, .st = st, .err = err, .errlen = errlen, .random = cfg->random_weights,
                        .seed = cfg->random_seed};
    if ((rc = load_weights(v, &w, nm, vp)) != PRISM_OK) goto fail;   /* pass 1: validate + size */
    if ((rc = prism_wload_begin_upload(&w, &v->wbuf, &v->wbytes)) != PRISM_OK) goto fail;
    if ((rc = load_weights(v, &w, nm, vp)) != PRISM_OK) goto fail;   /* pass 2: upload */
    prism_free(w.staging);
    w.staging = NULL;
    prism_st_close(st);
    st = NULL;

    {
        char a[32];
        int full = 0;
        for (int L = 0; L < cfg->v_layers; L++) full += (cfg->v_layer_flags[L] & PRISM_VLAYER_FULLATT) != 0;
        if (v->q3)
            PRISM_INFO("vision: Qwen3-VL tower, %d layers, %d DeepStack levels, %s weights", cfg->v_layers,
                       cfg->n_deepstack, prism_fmt_bytes(v->wbytes, a, sizeof a));
        else
            PRISM_INFO("vision: Qwen2.5-VL tower, %d layers (%d full attention, windows of %d px), %s weights",
                       cfg->v_layers, full, cfg->v_window, prism_fmt_bytes(v->wbytes, a, sizeof a));
    }
    if (max_patches && (rc = prism_vision_native_reserve(v, max_patches, err, errlen)) != PRISM_OK) goto fail;
    *out = v;
    return PRISM_OK;
fail:
    prism_free(w.staging);
    prism_st_close(st);
    prism_vision_native_free(v);
    return rc;
}

int prism_vision_native_reserve(prism_vision_native_t *v, int max_patches, char *err, size_t errlen)
{
    const prism_model_config_t *c = &v->cfg;
    if (max_patches < v->mm || max_patches > (1 << 24)) {
        ERR("vision: bad max_patches %d", max_patches);
        return PRISM_EINVAL;
    }
    prism_backend_buf_free(v->be, v->abuf);
    prism_free(v->keep);
    prism_free(v->kgrid);
    prism_free(v->gone);
    prism_free(v->h_meta);
    v->abuf = NULL;
    v->keep = NULL;
    v->kgrid = NULL;
    v->gone = NULL;
    v->h_meta = NULL;
    v->max_patches = 0;
    int max_img = max_images_of(max_patches, v->mm);
    v->keep = prism_calloc((size_t)max_img, sizeof *v->keep);
    v->kgrid = prism_calloc((size_t)max_img, sizeof *v->kgrid);
    v->gone = prism_calloc((size_t)max_img, 1);
    v->meta_n = meta_count(max_patches, v->mm, v->q3);
    v->h_meta = prism_malloc(v->meta_n * sizeof(int32_t));
    prism_free(v->h_iw);
    v->h_iw = v->q3 ? prism_malloc(4 * (size_t)max_patches * sizeof(float)) : NULL;
    if (v->q3 && !v->h_iw) return PRISM_ENOMEM;
    v->abytes = qv_layout(c, max_patches, NULL);
    v->abuf = prism_backend_buf_alloc(v->be, v->abytes);
    if (!v->keep || !v->kgrid || !v->gone || !v->h_meta || !v->abuf) {
        char b[32];
        ERR("vision: cannot allocate the %s activation arena", prism_fmt_bytes(v->abytes, b, sizeof b));
        return PRISM_ENOMEM;
    }
    qv_layout(c, max_patches, v);
    /* 2D rotary: HF's inv_freq over head_dim/2 (theta^(-2j/(head_dim/2)), j < head_dim/4), once for
     * the row positions and once for the columns. */
    int q = v->hd / 4;
    float inv[256];
    for (int j = 0; j < q; j++) {
        inv[j] = 1.0f / powf(c->v_rope_theta, (float)(2 * j) / (float)(v->hd / 2));
        inv[q + j] = inv[j];
        v->sec.of[j] = 0;
        v->sec.of[q + j] = 1;
    }
    int rc = v->be->i.upload(v->be->ctx, v->rope_inv, inv, (size_t)(2 * q) * 4);
    if (rc != PRISM_OK) return rc;
    v->max_patches = max_patches;
    char b[32];
    PRISM_INFO("vision: %s activation arena for %d patches (%d LM tokens)", prism_fmt_bytes(v->abytes, b, sizeof b),
               max_patches, max_patches / v->mm);
    return PRISM_OK;
}

void prism_vision_native_free(prism_vision_native_t *v)
{
    if (!v) return;
    prism_backend_buf_free(v->be, v->wbuf);
    prism_backend_buf_free(v->be, v->abuf);
    prism_free(v->layers);
    prism_free(v->keep);
    prism_free(v->kgrid);
    prism_free(v->gone);
    prism_free(v->h_meta);
    prism_free(v->h_iw);
    prism_free(v);
}

size_t prism_vision_native_weight_bytes(const prism_vision_native_t *v) { return v->wbytes; }
void prism_vision_native_set_hook(prism_vision_native_t *v, const prism_model_hook_t *hook) { v->hook = hook; }

/* ---------------------------------------------------------------- metadata */

typedef struct {
    int32_t *widx, *rev, *pos, *cu_win, *cu_full;
    int32_t *itap;           /* Qwen3: [4][N] position-grid rows of each patch's bilinear taps */
    int n_win;
} qv_meta_t;

static qv_meta_t meta_at(int32_t *base, int N, int mm)
{
    int nt = N / mm;
    qv_meta_t m = {0};
    m.widx = base;
    m.rev = m.widx + N;
    m.pos = m.rev + nt;
    m.cu_win = m.pos + 2 * (size_t)N;
    m.cu_full = m.cu_win + nt + 2;
    m.itap = m.cu_full + nt + 2;
    return m;
}

/* HF's get_vision_interpolation_indices_and_weights (bilinear, align_corners, clamped taps) along
 * one axis, in float32 as torch computes it: the source coordinate i * (side - 1) / (n - 1), its
 * floor and floor + 1 (clamped to the grid) with weights 1 - |src - floor - offset|. */
static void interp_axis(int i, int n, int side, int tap[2], float w[2])
{
    float src = (float)i * (float)(side - 1) / (float)PRISM_MAX(n - 1, 1);
    float fl = floorf(src);
    for (int o = 0; o < 2; o++) {
        tap[o] = PRISM_MIN((int)fl + o, side - 1);
        float d = fabsf(src - fl - (float)o);
        w[o] = fmaxf(1.0f - d, 0.0f);
    }
}

/* HF's get_vision_window_index for the images of the batch, at patch level: widx[r] is the
 * patch (image order) at row r of the window order, rev[k] the window-order merged token of image
 * order token k; pos the (row, column) of each window-order row; cu_win / cu_full the window and
 * image boundaries. Returns the number of windows. */
static int build_meta(const struct prism_vision_native *v, const prism_vgrid_t *g, int n_img, int N, qv_meta_t *m)
{
    const prism_model_config_t *c = &v->cfg;
    const int M = c->v_merge, mm = v->mm;
    int r = 0, k = 0, nw = 0, p0 = 0;
    m->cu_win[0] = 0;
    m->cu_full[0] = 0;
    for (int i = 0; i < n_img; i++) {
        const int lh = g[i].h / M, lw = g[i].w / M, t0 = p0 / mm;
        /* Qwen3-VL: no windows, i.e. one window of the whole image (the identity order) */
        const int ws = c->v_window ? c->v_window / M / c->v_patch : PRISM_MAX(lh, lw);
        for (int wh = 0; wh * ws < lh; wh++)
            for (int ww = 0; ww * ws < lw; ww++) {
                for (int rr = wh * ws; rr < PRISM_MIN(lh, (wh + 1) * ws); rr++)
                    for (int cc = ww * ws; cc < PRISM_MIN(lw, (ww + 1) * ws); cc++) {
                        int src = t0 + rr * lw + cc;   /* merged token, image order */
                        m->rev[src] = k++;
                        for (int u = 0; u < mm; u++, r++) {
                            m->widx[r] = src * mm + u;
                            m->pos[r] = rr * M + u / M;        /* patch row */
                            m->pos[N + r] = cc * M + u % M;    /* patch column */
                        }
                    }
                m->cu_win[++nw] = r;
            }
        p0 += g[i].h * g[i].w;
        m->cu_full[i + 1] = p0;
    }
    PRISM_ASSERT(r == N && k == N / mm);
    m->n_win = nw;
    if (v->q3) {
        /* the learned position grid resampled to each image's patch grid: 4 taps per patch (rows
         * of pos_embed) and their weights (h weight x w weight), tap (a, b) at a * 2 + b */
        for (int i = 0, r0 = 0; i < n_img; r0 += g[i].h * g[i].w, i++)
            for (int rr = r0; rr < r0 + g[i].h * g[i].w; rr++) {
                int th[2], tw[2];
                float wh[2], ww[2];
                interp_axis(m->pos[rr], g[i].h, v->side, th, wh);
                interp_axis(m->pos[N + rr], g[i].w, v->side, tw, ww);
                for (int a = 0; a < 2; a++)
                    for (int b = 0; b < 2; b++) {
                        m->itap[(size_t)(a * 2 + b) * N + rr] = th[a] * v->side + tw[b];
                        v->h_iw[(size_t)(a * 2 + b) * N + rr] = wh[a] * ww[b];
                    }
            }
    }
    return nw;
}

/* Uploads the metadata of the images still in the batch (v->kgrid[0..n)). */
static int upload_meta(struct prism_vision_native *v, int n, int N, qv_meta_t *d, int *max_win, int *max_img)
{
    qv_meta_t h = meta_at(v->h_meta, N, v->mm);
    build_meta(v, v->kgrid, n, N, &h);
    *max_win = *max_img = 0;
    for (int w = 0; w < h.n_win; w++) *max_win = PRISM_MAX(*max_win, h.cu_win[w + 1] - h.cu_win[w]);
    for (int i = 0; i < n; i++) *max_img = PRISM_MAX(*max_img, h.cu_full[i + 1] - h.cu_full[i]);
    *d = meta_at(v->d_meta, N, v->mm);
    d->n_win = h.n_win;
    /* one upload: widx .. cu_full (.. itap) are contiguous */
    size_t used = (size_t)(v->q3 ? h.itap + 4 * (size_t)N - v->h_meta : h.cu_full + n + 1 - v->h_meta);
    int rc = v->be->i.upload(v->be->ctx, v->d_meta, v->h_meta, used * 4);
    if (rc == PRISM_OK && v->q3) rc = v->be->i.upload(v->be->ctx, v->iw, v->h_iw, 4 * (size_t)N * 4);
    return rc;
}

/* Between layers: asks the hook and drops cancelled images. An image's rows are contiguous in the
 * window order too (HF offsets each image's window index by the tokens before it), so the kept
 * ones move down into the spare buffer, which becomes the residual stream, and the metadata is
 * rebuilt for the smaller batch. Returns the images left (*N their patches). */
static int between_layers(struct prism_vision_native *v, int n, int *N, int done, float **h, float **spare,
                          qv_meta_t *d, int *max_win, int *max_img, int *rc)
{
    const prism_model_hook_t *k = v->hook;
    *rc = PRISM_OK;
    if (!k || !k->layer || !k->layer(k->ud, done, v->cfg.v_layers) || !k->cancelled) return n;
    int nn = 0;
    for (int i = 0; i < n; i++) {
        v->gone[i] = k->cancelled(k->ud, v->keep[i]);
        nn += !v->gone[i];
    }
    if (nn == n || nn == 0) return nn;
    const size_t VH = (size_t)v->cfg.v_hidden;
    int src = 0, dst = 0, j = 0;
    for (int i = 0; i < n; i++) {
        int np = v->kgrid[i].h * v->kgrid[i].w;
        if (!v->gone[i]) {
            *rc = v->be->i.copy(v->be->ctx, *spare + (size_t)dst * VH, *h + (size_t)src * VH, (size_t)np * VH * 4);
            if (*rc != PRISM_OK) return 0;
            v->keep[j] = v->keep[i];
            v->kgrid[j++] = v->kgrid[i];
            dst += np;
        }
        src += np;
    }
    float *t = *h;
    *h = *spare;
    *spare = t;
    *N = dst;
    *rc = upload_meta(v, nn, dst, d, max_win, max_img);
    return nn;
}

/* ---------------------------------------------------------------- forward */

/* Qwen3-VL: rows [NT][H] of the images still in the batch (src) to column col of their rows of the
 * output buffer, which keeps the caller's row order (a dropped image's rows stay unused). */
static int scatter_out(struct prism_vision_native *v, const prism_vgrid_t *grids, int n_images, int n, int N,
                       const float *src, int col)
{
    const prism_backend_i *o = &v->be->i;
    const size_t H = (size_t)v->cfg.hidden, rw = (size_t)v->rw;
    if (n == n_images)
        return o->copy_2d(v->be->ctx, v->obuf + col, rw * 4, src, H * 4, H * 4, (size_t)(N / v->mm));
    size_t s = 0, dst = 0;
    for (int i = 0, j = 0; i < n_images && j < n; i++) {
        size_t nt = (size_t)(grids[i].h / v->cfg.v_merge) * (grids[i].w / v->cfg.v_merge);
        if (v->keep[j] == i) {
            int rc = o->copy_2d(v->be->ctx, v->obuf + dst * rw + col, rw * 4, src + s * H, H * 4, H * 4, nt);
            if (rc != PRISM_OK) return rc;
            s += nt;
            j++;
        }
        dst += nt;
    }
    return PRISM_OK;
}

int prism_vision_native_encode(prism_vision_native_t *v, const float *pixels, const prism_vgrid_t *grids, int n_images,
                               float *out)
{
    const prism_model_config_t *c = &v->cfg;
    const prism_backend_i *o = &v->be->i;
    void *bx = v->be->ctx;
    if (n_images <= 0 || !pixels || !grids || !out || !v->abuf) return PRISM_EINVAL;
    int64_t total = 0;
    for (int i = 0; i < n_images; i++) {
        if (grids[i].h < c->v_merge || grids[i].w < c->v_merge || grids[i].h % c->v_merge || grids[i].w % c->v_merge)
            return PRISM_EINVAL;
        total += (int64_t)grids[i].h * grids[i].w;
    }
    if (total > v->max_patches || n_images > max_images_of(v->max_patches, v->mm)) return PRISM_ELIMIT;
    const int VH = c->v_hidden, VI = c->v_intermediate, H = c->hidden, hd = v->hd, mm = v->mm, T = c->v_temporal_patch;
    const int QKV = 3 * VH, PF = v->pix_feat, F = v->feat, BW = (int)big_width(c);
    prism_dtype_t wdt = v->wdt;
    int N = (int)total, n = n_images, rc = PRISM_OK;
    for (int i = 0; i < n; i++) {
        v->keep[i] = i;
        v->kgrid[i] = grids[i];
    }

    /* Patch embedding: the frame repeated T times per row ([C][T][p][p], as the Conv3d weight),
     * then one matmul, in image order (into xn), then gathered into the window order (h). */
    CK(o->upload(bx, v->pix, pixels, (size_t)N * PF * 4));
    const size_t pp = (size_t)c->v_patch * c->v_patch;
    for (int ch = 0; ch < c->v_num_channels; ch++)
        for (int t = 0; t < T; t++)
            CK(o->copy_2d(bx, v->big + (size_t)(ch * T + t) * pp, (size_t)BW * 4, v->pix + (size_t)ch * pp,
                          (size_t)PF * 4, pp * 4, (size_t)N));
    CK(o->matmul(bx, v->xn, VH, v->big, BW, v->patch_w, wdt, v->patch_b, N, VH, F, false));
    qv_meta_t d;
    int max_win, max_img;
    CK(upload_meta(v, n, N, &d, &max_win, &max_img));
    float *h = v->h, *spare = v->attn;
    CK(o->get_rows(bx, h, v->xn, PRISM_DTYPE_F32, N, d.widx, N, VH));
    if (v->q3) {
        /* + the interpolated position embeddings: sum over the 4 taps of weight x pos_embed row */
        float *acc = v->big, *tmp = v->big + (size_t)N * VH;   /* big holds 3 [N][VH] */
        for (int j = 0; j < 4; j++) {
            float *dst = j ? tmp : acc;
            CK(o->get_rows(bx, dst, v->pos_embed, PRISM_DTYPE_F32, c->v_num_pos, d.itap + (size_t)j * N, N, VH));
            CK(o->scale_rows(bx, dst, VH, N, VH, v->iw + (size_t)j * N));
            if (j) CK(o->add(bx, acc, acc, tmp, (size_t)N * VH, (size_t)N * VH));
        }
        CK(o->add(bx, h, h, acc, (size_t)N * VH, (size_t)N * VH));
    }
    n = between_layers(v, n, &N, 0, &h, &spare, &d, &max_win, &max_img, &rc);
    CK(rc);

    const float scale = 1.0f / sqrtf((float)hd);
    for (int L = 0; L < c->v_layers && n > 0; L++) {
        const qv_layer_t *ly = &v->layers[L];
        const bool full = c->v_layer_flags[L] & PRISM_VLAYER_FULLATT;
        float *qkv = v->big, *attn = spare;
        if (v->q3)
            CK(o->layernorm(bx, v->xn, h, ly->n1, ly->n1b, N, VH, c->v_eps));
        else
            CK(o->rmsnorm(bx, v->xn, h, ly->n1, N, VH, c->v_eps));
        CK(o->matmul(bx, qkv, QKV, v->xn, VH, ly->wqkv, wdt, ly->bqkv, N, QKV, VH, false));
        CK(o->rope_multi(bx, qkv, QKV, N, c->v_heads, hd, d.pos, N, v->rope_inv, &v->sec));
        CK(o->rope_multi(bx, qkv + VH, QKV, N, c->v_heads, hd, d.pos, N, v->rope_inv, &v->sec));
        CK(o->attn_varlen(bx, attn, VH, qkv, QKV, qkv + VH, QKV, qkv + 2 * VH, QKV, full ? d.cu_full : d.cu_win,
                          full ? n : d.n_win, full ? max_img : max_win, c->v_heads, c->v_heads, hd, scale));
        CK(o->matmul(bx, h, VH, attn, VH, ly->wo, wdt, ly->bo, N, VH, VH, true));
        if (v->q3)
            CK(o->layernorm(bx, v->xn, h, ly->n2, ly->n2b, N, VH, c->v_eps));
        else
            CK(o->rmsnorm(bx, v->xn, h, ly->n2, N, VH, c->v_eps));
        for (int r0 = 0; r0 < N; r0 += MLP_CHUNK) {
            int m = PRISM_MIN(MLP_CHUNK, N - r0);
            if (v->q3) {   /* fc1, GELU (tanh), fc2 */
                float *a = v->mlp;
                CK(o->matmul(bx, a, VI, v->xn + (size_t)r0 * VH, VH, ly->wgu, wdt, ly->bgu, m, VI, VH, false));
                CK(o->act(bx, (prism_act_t)c->v_act, a, a, (size_t)m * VI));
                CK(o->matmul(bx, h + (size_t)r0 * VH, VH, a, VI, ly->wd, wdt, ly->bd, m, VH, VI, true));
                continue;
            }
            float *gu = v->mlp, *act = v->mlp + (size_t)m * 2 * VI;
            CK(o->matmul(bx, gu, 2 * VI, v->xn + (size_t)r0 * VH, VH, ly->wgu, wdt, ly->bgu, m, 2 * VI, VH, false));
            CK(o->silu_mul(bx, act, gu, gu + VI, 2 * VI, m, VI));
            CK(o->matmul(bx, h + (size_t)r0 * VH, VH, act, VI, ly->wd, wdt, ly->bd, m, VH, VI, true));
        }
        if (v->q3 && v->ds_level[L]) {
            /* DeepStack: this layer's merger (LayerNorm over each 2x2 block's rows side by side),
             * into its feature level of the output rows */
            const int k = v->ds_merger[L], nt = N / mm, mv = mm * VH;
            CK(o->layernorm(bx, v->big, h, v->ds[k].nw, v->ds[k].nb, nt, mv, 1e-6f));
            CK(o->matmul(bx, spare, mv, v->big, mv, v->ds[k].w1, wdt, v->ds[k].b1, nt, mv, mv, false));
            CK(o->act(bx, PRISM_ACT_GELU_ERF, spare, spare, (size_t)nt * mv));
            CK(o->matmul(bx, v->xn, H, spare, mv, v->ds[k].w2, wdt, v->ds[k].b2, nt, H, mv, false));
            CK(scatter_out(v, grids, n_images, n, N, v->xn, v->ds_level[L] * H));
        }
        n = between_layers(v, n, &N, L + 1, &h, &spare, &d, &max_win, &max_img, &rc);
        CK(rc);
    }
    if (n == 0) return PRISM_OK;   /* every image was cancelled */

    /* Merger: RMSNorm, merge blocks side by side (adjacent rows: a view), Linear, GELU, Linear;
     * then the image order. */
    const int NT = N / mm, MV = mm * VH;
    float *m1 = spare, *m2 = v->xn, *res = h;   /* [NT][mm VH] = N x VH; [NT][H] twice (wide buffers) */
    if (v->q3)
        CK(o->layernorm(bx, v->big, h, v->ln_q, v->ln_b, N, VH, 1e-6f));
    else
        CK(o->rmsnorm(bx, v->big, h, v->ln_q, N, VH, 1e-6f));
    CK(o->matmul(bx, m1, MV, v->big, MV, v->m1_w, wdt, v->m1_b, NT, MV, MV, false));
    CK(o->act(bx, PRISM_ACT_GELU_ERF, m1, m1, (size_t)NT * MV));
    CK(o->matmul(bx, m2, H, m1, MV, v->m2_w, wdt, v->m2_b, NT, H, MV, false));
    if (v->q3) {   /* the identity order: the embeddings go to level 0 of the output rows */
        CK(scatter_out(v, grids, n_images, n, N, m2, 0));
        const size_t rw = (size_t)v->rw;
        if (n == n_images) return o->download(bx, out, v->obuf, (size_t)NT * rw * 4);
        size_t dst = 0;
        for (int i = 0, j = 0; i < n_images && j < n; i++) {
            size_t nt = (size_t)(grids[i].h / c->v_merge) * (grids[i].w / c->v_merge);
            if (v->keep[j] == i) {
                CK(o->download(bx, out + dst * rw, v->obuf + dst * rw, nt * rw * 4));
                j++;
            }
            dst += nt;
        }
        return PRISM_OK;
    }
    CK(o->get_rows(bx, res, m2, PRISM_DTYPE_F32, NT, d.rev, NT, H));
    if (n == n_images) return o->download(bx, out, res, (size_t)NT * H * 4);
    /* Some images left the batch: each kept one's rows to its own place in out (kept images are
     * in the caller's order). */
    size_t src = 0, dst = 0;
    for (int i = 0, j = 0; i < n_images && j < n; i++) {
        size_t nt = (size_t)(grids[i].h / c->v_merge) * (grids[i].w / c->v_merge);
        if (v->keep[j] == i) {
            CK(o->download(bx, out + dst * H, res + src * H, nt * H * 4));
            src += nt;
            j++;
        }
        dst += nt;
    }
    return PRISM_OK;
}
