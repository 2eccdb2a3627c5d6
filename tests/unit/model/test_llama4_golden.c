/* Llama-4 against Hugging Face transformers (fp32), fixtures from tools/gen_llama4_goldens.py.
 *
 * Which golden case exercises what (the generator cross-checks HF itself against an independent
 * torch implementation before writing them):
 *  llama4_tiny (Llama4ForConditionalGeneration, bf16 checkpoint in HF's 'language_model.model.' /
 *    'vision_model.' layout; 180-token chat prompt from the real processor with a 300x200 image):
 *    - interleaved-pair RoPE with llama3 scaling (original_max_position_embeddings 16): layers 0, 1, 3
 *    - per-head QK L2 norm after RoPE: layers 0, 1, 3
 *    - chunked attention, attention_chunk_size 32 < prompt: layers 0, 1, 3; the prompt spans 6
 *      chunks, the chunked prefill test cuts mid-chunk, greedy decode crosses position 192
 *    - NoPE layer with attention temperature tuning (floor_scale 16, attn_scale 0.4): layer 2
 *    - MoE, 4 experts, top-1 sigmoid router scaling the expert INPUT, shared expert: layers 1, 3
 *    - dense MLP of intermediate_size_mlp: layers 0, 2
 *    - vision: unfold patches (7 px on 56 px tiles), CLS appended last, 2D RoPE, non-causal
 *      attention, layernorm_post, pixel shuffle 0.5, adapter, projector; 2x3 tiles + global tile
 *  llama4_text (Llama4ForCausalLM, model_type llama4_text, 'model.' keys, f32):
 *    - top-2 routing (two experts per token, each scored by its own sigmoid), MoE in every layer
 *    - use_qk_norm false, chunk 16, NoPE layer 3, default RoPE
 *  Both: logits within 1e-4 of HF at every prompt position and every greedy step (teacher-forced
 *  golden), 32 greedy tokens identical through the paged KV cache. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "image/llama4_proc.h"
#include "model/model.h"
#include "../image/llama4_synth.h"

#define BS 16
#define MAX_TOK 512
#define N_GREEDY 32

typedef struct {
    const char *name;
    bool bf16;       /* weights stored as bf16 (the checkpoint is bf16: the same tolerance holds) */
    char dir[1024];
    int n_prompt, vocab, hidden, n_tiles, tile, per_tile, chunk, img_w, img_h, img_seed;
    int32_t ids[MAX_TOK];
    int32_t greedy[N_GREEDY];
    double tol;
    float *logits;   /* [n_prompt + N_GREEDY][vocab]: teacher-forced HF logits */
    float *pixels;   /* [n_tiles][3][tile][tile] */
    float *feats;    /* [n_tiles * per_tile][hidden] */
    prism_model_config_t cfg;
    prism_backend_t *be;
    prism_llm_t *llm;
    prism_vision_t *vis;
    float *embeds;   /* [n_prompt][hidden] from our vision output (or NULL) */
    uint8_t *mask;
} golden_t;

static const char *source_dir(void)
{
    const char *s = getenv("PRISM_SOURCE_DIR");
    return s && *s ? s : PRISM_SOURCE_DIR;
}

static float *read_f32(const char *dir, const char *file, size_t expect_n)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    char *buf = NULL;
    size_t n = 0;
    assert_int_equal(prism_read_file(path, 64u << 20, &buf, &n), PRISM_OK);
    assert_int_equal(n, expect_n * sizeof(float));
    return (float *)buf;
}

static double max_abs_diff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= m)) m = d;
    }
    return m;
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static int geti(json_t *j, const char *k) { return (int)json_integer_value(json_object_get(j, k)); }

static void load_case(golden_t *g, int max_images)
{
    char path[1200], err[256];
    snprintf(g->dir, sizeof g->dir, "%s/tests/data/model/%s", source_dir(), g->name);
    snprintf(path, sizeof path, "%s/golden.json", g->dir);
    json_error_t jerr;
    json_t *j = json_load_file(path, 0, &jerr);
    assert_non_null(j);
    json_t *ids = json_object_get(j, "input_ids"), *gr = json_object_get(j, "greedy");
    g->n_prompt = (int)json_array_size(ids);
    assert_true(g->n_prompt > 0 && g->n_prompt + N_GREEDY <= MAX_TOK);
    for (int i = 0; i < g->n_prompt; i++) g->ids[i] = (int32_t)json_integer_value(json_array_get(ids, i));
    assert_int_equal(json_array_size(gr), N_GREEDY);
    for (int i = 0; i < N_GREEDY; i++) g->greedy[i] = (int32_t)json_integer_value(json_array_get(gr, i));
    g->vocab = geti(j, "vocab");
    g->hidden = geti(j, "hidden");
    g->n_tiles = geti(j, "n_tiles");
    g->chunk = geti(j, "attention_chunk_size");
    g->tol = json_number_value(json_object_get(j, "tolerance"));
    if (g->n_tiles) {
        g->tile = geti(j, "tile_size");
        g->per_tile = geti(j, "tokens_per_tile");
        g->img_w = geti(j, "image_w");
        g->img_h = geti(j, "image_h");
        g->img_seed = geti(j, "image_seed");
    }
    json_decref(j);
    g->logits = read_f32(g->dir, "logits.bin", (size_t)(g->n_prompt + N_GREEDY) * g->vocab);
    int rc = prism_model_config_load(g->dir, &g->cfg, err, sizeof err);
    if (rc) fprintf(stderr, "config: %s\n", err);
    assert_int_equal(rc, PRISM_OK);
    g->be = prism_backend_cpu_create(2);
    assert_non_null(g->be);
    if (g->bf16) assert_int_equal(prism_backend_set_weight_dtype(g->be, PRISM_DTYPE_BF16), PRISM_OK);
    rc = prism_llm_load(g->be, &g->cfg, g->dir, MAX_TOK, 4, &g->llm, err, sizeof err);
    if (rc) fprintf(stderr, "llm: %s\n", err);
    assert_int_equal(rc, PRISM_OK);
    if (!g->n_tiles) return;
    g->pixels = read_f32(g->dir, "pixel_values.bin", (size_t)g->n_tiles * 3 * g->tile * g->tile);
    g->feats = read_f32(g->dir, "vision_features.bin", (size_t)g->n_tiles * g->per_tile * g->hidden);
    rc = prism_vision_load(g->be, &g->cfg, g->dir, max_images, &g->vis, err, sizeof err);
    if (rc) fprintf(stderr, "vision: %s\n", err);
    assert_int_equal(rc, PRISM_OK);
    /* Prompt embeddings from OUR encoder (compared with HF in its own test), in tile micro-batches. */
    size_t nf = (size_t)g->n_tiles * g->per_tile * g->hidden;
    float *feats = malloc(nf * sizeof(float));
    for (int t0 = 0; t0 < g->n_tiles; t0 += max_images) {
        int n = PRISM_MIN(max_images, g->n_tiles - t0);
        assert_int_equal(prism_vision_encode(g->vis, g->pixels + (size_t)t0 * 3 * g->tile * g->tile, n,
                                             feats + (size_t)t0 * g->per_tile * g->hidden), PRISM_OK);
    }
    g->embeds = calloc((size_t)g->n_prompt * g->hidden, sizeof(float));
    g->mask = calloc((size_t)g->n_prompt, 1);
    int k = 0;
    for (int i = 0; i < g->n_prompt; i++)
        if (g->ids[i] == g->cfg.image_token_index) {
            assert_true(k < g->n_tiles * g->per_tile);
            memcpy(g->embeds + (size_t)i * g->hidden, feats + (size_t)k * g->hidden, g->hidden * sizeof(float));
            g->mask[i] = 1;
            k++;
        }
    assert_int_equal(k, g->n_tiles * g->per_tile);
    free(feats);
}

static int setup_tiny(void **state)
{
    static golden_t g = {.name = "llama4_tiny"};
    load_case(&g, 3);   /* 7 tiles encoded as 3 + 3 + 1 */
    *state = &g;
    return 0;
}

/* The same checkpoint (bf16) with the weights stored as bf16 (--weight-dtype bf16): the experts'
 * grouped matmul and the other matmuls widen them on the fly. */
static int setup_tiny_bf16(void **state)
{
    static golden_t g = {.name = "llama4_tiny", .bf16 = true};
    load_case(&g, 3);
    *state = &g;
    return 0;
}

static int setup_text(void **state)
{
    static golden_t g = {.name = "llama4_text"};
    load_case(&g, 1);
    *state = &g;
    return 0;
}

static int teardown(void **state)
{
    golden_t *g = *state;
    prism_vision_free(g->vis);
    prism_llm_free(g->llm);
    prism_backend_destroy(g->be);
    prism_free(g->logits);
    prism_free(g->pixels);
    prism_free(g->feats);
    free(g->embeds);
    free(g->mask);
    return 0;
}

/* ---- a tiny sequence / block manager ---- */

typedef struct {
    int32_t table[64];
    int n_blocks, len;
    int32_t *next;
} seq_t;

static void seq_reserve(seq_t *s, int new_len)
{
    while (s->n_blocks * BS < new_len) {
        assert_true(s->n_blocks < 64);
        s->table[s->n_blocks++] = (*s->next)++;
    }
}

static int run_seq(golden_t *g, prism_kv_cache_t *kv, seq_t *s, const int32_t *toks, int n, const float *embeds,
                   const uint8_t *mask, bool all, float *logits)
{
    seq_reserve(s, s->len + n);
    int32_t start[2] = {0, n}, pos0[1] = {s->len};
    const int32_t *tables[1] = {s->table};
    prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = n, .tokens = toks, .seq_start = start, .pos0 = pos0,
                           .block_tables = tables, .embeds = embeds, .embed_mask = mask, .all_logits = all};
    int rc = prism_llm_forward(g->llm, kv, &b, logits);
    if (rc == PRISM_OK) s->len += n;
    return rc;
}

static const float *emb_at(golden_t *g, int i) { return g->embeds ? g->embeds + (size_t)i * g->hidden : NULL; }
static const uint8_t *mask_at(golden_t *g, int i) { return g->mask ? g->mask + i : NULL; }

/* ---- tests ---- */

static void test_config_table(void **state)
{
    golden_t *g = *state;
    const prism_model_config_t *c = &g->cfg;
    assert_int_equal(c->rope_mode, PRISM_ROPE_INTERLEAVE);
    if (!strcmp(g->name, "llama4_tiny")) {
        const int R = PRISM_LAYER_ROPE | PRISM_LAYER_QK_NORM | PRISM_LAYER_CHUNKED;
        static const int want[4] = {R, R | PRISM_LAYER_MOE, PRISM_LAYER_TEMP, R | PRISM_LAYER_MOE};
        for (int i = 0; i < 4; i++) assert_int_equal(c->layer_flags[i], want[i]);
        assert_int_equal(c->attention_chunk, 32);
        assert_int_equal(c->n_experts, 4);
        assert_int_equal(c->top_k, 1);
        assert_int_equal(c->dense_intermediate, 96);
        assert_int_equal(c->intermediate, 32);
        assert_int_equal(c->rope_scaling_type, 1);
        assert_true(c->has_vision && c->vision_arch == PRISM_VISION_LLAMA4);
        assert_int_equal(c->image_seq_length, 16);
        assert_int_equal(c->v_shuffle, 2);
        assert_int_equal(c->n_eos, 3);
    } else {
        const int R = PRISM_LAYER_ROPE | PRISM_LAYER_CHUNKED | PRISM_LAYER_MOE;
        static const int want4[4] = {0, 0, 0, PRISM_LAYER_TEMP | PRISM_LAYER_MOE};
        for (int i = 0; i < 4; i++) assert_int_equal(c->layer_flags[i], i < 3 ? R : want4[3]);
        assert_int_equal(c->top_k, 2);
        assert_int_equal(c->n_experts, 5);
        assert_false(c->has_vision);
    }
}

/* The processor on the same synthetic picture gives HF's pixel values bit for bit. */
static void test_pixels(void **state)
{
    golden_t *g = *state;
    if (!g->n_tiles) skip();
    char err[256];
    prism_llama4_proc_t p;
    assert_int_equal(prism_llama4_proc_load_dir(g->dir, &p, err, sizeof err), PRISM_OK);
    prism_llama4_grid_t gr;
    assert_int_equal(prism_llama4_grid(&p, g->img_w, g->img_h, &gr), PRISM_OK);
    assert_int_equal(gr.n_tiles, g->n_tiles);
    assert_int_equal(gr.n_patch_tokens, g->n_tiles * g->per_tile);
    assert_int_equal(p.tokens_per_tile, g->cfg.image_seq_length);
    prism_image_t img = {.rgb = llama4_synth_image(g->img_w, g->img_h, (uint32_t)g->img_seed), .w = g->img_w,
                         .h = g->img_h, .src_w = g->img_w, .src_h = g->img_h};
    size_t wsn = prism_llama4_preprocess_workspace_bytes(&p, g->img_w, g->img_h);
    void *ws = malloc(wsn);
    size_t n = (size_t)g->n_tiles * 3 * g->tile * g->tile;
    float *px = malloc(n * sizeof(float));
    assert_int_equal(prism_llama4_preprocess(&p, &img, ws, wsn, px), PRISM_OK);
    assert_memory_equal(px, g->pixels, n * sizeof(float));
    free(px);
    free(ws);
    prism_free(img.rgb);
}

static void test_vision_features(void **state)
{
    golden_t *g = *state;
    if (!g->n_tiles) skip();
    size_t n = (size_t)g->n_tiles * g->per_tile * g->hidden;
    float *out = malloc(n * sizeof(float)), *one = malloc(n * sizeof(float));
    uint64_t allocs = prism_mem_alloc_count();
    /* micro-batches of at most max_images (3) tiles, as an encoder under its arena would run them */
    for (int t0 = 0; t0 < g->n_tiles; t0 += 3) {
        int k = PRISM_MIN(3, g->n_tiles - t0);
        assert_int_equal(prism_vision_encode(g->vis, g->pixels + (size_t)t0 * 3 * g->tile * g->tile, k,
                                             out + (size_t)t0 * g->per_tile * g->hidden), PRISM_OK);
    }
    assert_int_equal(prism_mem_alloc_count(), allocs);   /* encode never allocates */
    double d = max_abs_diff(out, g->feats, n);
    printf("  %s: %d tiles -> %d x %d features, max |diff| vs HF %.3g\n", g->name, g->n_tiles, g->n_tiles * g->per_tile,
           g->hidden, d);
    assert_true(d <= g->tol);
    /* Tiles are independent: one at a time gives the same rows. */
    for (int t = 0; t < g->n_tiles; t++)
        assert_int_equal(prism_vision_encode(g->vis, g->pixels + (size_t)t * 3 * g->tile * g->tile, 1,
                                             one + (size_t)t * g->per_tile * g->hidden), PRISM_OK);
    assert_true(max_abs_diff(out, one, n) <= 1e-5);
    assert_int_equal(prism_vision_encode(g->vis, g->pixels, 4, out), PRISM_ELIMIT);   /* over max_images */
    free(out);
    free(one);
}

static void test_prompt_logits(void **state)
{
    golden_t *g = *state;
    prism_kv_cache_t *kv;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &kv), PRISM_OK);
    int32_t next = 0;
    seq_t s = {.next = &next};
    float *lg = malloc((size_t)g->n_prompt * g->vocab * sizeof(float));
    uint64_t allocs = prism_mem_alloc_count();
    assert_int_equal(run_seq(g, kv, &s, g->ids, g->n_prompt, g->embeds, g->mask, true, lg), PRISM_OK);
    assert_int_equal(prism_mem_alloc_count(), allocs);   /* forward never allocates */
    double d = max_abs_diff(lg, g->logits, (size_t)g->n_prompt * g->vocab);
    printf("  %s: %d prompt positions x %d vocab (%d attention chunks), logits max |diff| %.3g\n", g->name, g->n_prompt,
           g->vocab, (g->n_prompt + g->chunk - 1) / g->chunk, d);
    assert_true(g->n_prompt > 2 * g->chunk);
    assert_true(d <= g->tol);
    free(lg);
    prism_kv_cache_free(kv);
}

/* Greedy through the paged KV cache: every step's logits equal HF's teacher-forced logits at that
 * position, the tokens equal HF's greedy tokens, and decoding crosses an attention-chunk boundary. */
static void test_greedy_decode(void **state)
{
    golden_t *g = *state;
    prism_kv_cache_t *kv;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &kv), PRISM_OK);
    int32_t next = 3;
    seq_t s = {.next = &next};
    float *lg = malloc((size_t)g->vocab * sizeof(float));
    assert_int_equal(run_seq(g, kv, &s, g->ids, g->n_prompt, g->embeds, g->mask, false, lg), PRISM_OK);
    int32_t out[N_GREEDY];
    double worst = max_abs_diff(lg, g->logits + (size_t)(g->n_prompt - 1) * g->vocab, g->vocab);
    out[0] = argmax(lg, g->vocab);
    uint64_t allocs = prism_mem_alloc_count();
    for (int i = 1; i < N_GREEDY; i++) {
        assert_int_equal(run_seq(g, kv, &s, &out[i - 1], 1, NULL, NULL, false, lg), PRISM_OK);
        double d = max_abs_diff(lg, g->logits + (size_t)(g->n_prompt - 1 + i) * g->vocab, g->vocab);
        if (d > worst) worst = d;
        out[i] = argmax(lg, g->vocab);
    }
    assert_int_equal(prism_mem_alloc_count(), allocs);
    int first = g->n_prompt, last = g->n_prompt + N_GREEDY - 1;
    printf("  %s: decode positions %d..%d (chunk boundary at %d), step logits max |diff| %.3g\n", g->name, first, last,
           (first / g->chunk + 1) * g->chunk, worst);
    assert_true(first / g->chunk != last / g->chunk);   /* a decode step opens a new chunk */
    for (int i = 0; i < N_GREEDY; i++) {
        if (out[i] != g->greedy[i]) fprintf(stderr, "  %s: token %d: got %d, HF %d\n", g->name, i, out[i], g->greedy[i]);
        assert_int_equal(out[i], g->greedy[i]);
    }
    assert_true(worst <= g->tol);
    free(lg);
    prism_kv_cache_free(kv);
}

/* Prefill in pieces that end mid attention-chunk (and, for the tiny case, mid image). */
static void test_chunked_prefill(void **state)
{
    golden_t *g = *state;
    prism_kv_cache_t *kv;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &kv), PRISM_OK);
    int32_t next = 7;
    seq_t s = {.next = &next};
    int n = g->n_prompt, piece = g->chunk - 9, crossed = 0;
    float *lg = malloc((size_t)n * g->vocab * sizeof(float));
    for (int p0 = 0; p0 < n; p0 += piece) {
        int k = PRISM_MIN(piece, n - p0);
        crossed += p0 / g->chunk != (p0 + k - 1) / g->chunk;
        assert_int_equal(run_seq(g, kv, &s, g->ids + p0, k, emb_at(g, p0), mask_at(g, p0), true,
                                 lg + (size_t)p0 * g->vocab), PRISM_OK);
    }
    assert_true(crossed >= 2);
    double d = max_abs_diff(lg, g->logits, (size_t)n * g->vocab);
    printf("  %s: prefill in %d-token pieces (%d cross a chunk boundary) max |diff| vs HF %.3g\n", g->name, piece, crossed,
           d);
    assert_true(d <= g->tol);
    assert_int_equal(argmax(lg + (size_t)(n - 1) * g->vocab, g->vocab), g->greedy[0]);
    free(lg);
    prism_kv_cache_free(kv);
}

/* One forward holding a decode step and a prefill piece of two sequences equals running each alone. */
static void test_mixed_batch(void **state)
{
    golden_t *g = *state;
    prism_kv_cache_t *kb, *k1;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &kb), PRISM_OK);
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &k1), PRISM_OK);
    int32_t nb = 0, n1 = 0;
    seq_t a = {.next = &nb}, b = {.next = &nb}, a1 = {.next = &n1}, b1 = {.next = &n1};
    float *lg = malloc((size_t)4 * g->vocab * sizeof(float));
    int la = g->n_prompt, lb = g->n_prompt - 20;
    assert_int_equal(run_seq(g, kb, &a, g->ids, la, g->embeds, g->mask, false, lg), PRISM_OK);
    assert_int_equal(run_seq(g, k1, &a1, g->ids, la, g->embeds, g->mask, false, lg), PRISM_OK);
    int32_t ta = argmax(lg, g->vocab);
    assert_int_equal(run_seq(g, kb, &b, g->ids, lb, g->embeds, g->mask, false, lg), PRISM_OK);
    assert_int_equal(run_seq(g, k1, &b1, g->ids, lb, g->embeds, g->mask, false, lg), PRISM_OK);
    /* batch: a decodes one token, b prefills its last 20 prompt tokens */
    int32_t toks[21];
    toks[0] = ta;
    memcpy(toks + 1, g->ids + lb, 20 * sizeof(int32_t));
    seq_reserve(&a, a.len + 1);
    seq_reserve(&b, b.len + 20);
    int32_t start[3] = {0, 1, 21}, pos0[2] = {a.len, b.len};
    const int32_t *tables[2] = {a.table, b.table};
    float *emb = calloc((size_t)21 * g->hidden, sizeof(float));
    uint8_t mask[21] = {0};
    for (int k = 0; g->mask && k < 20; k++)
        if (g->mask[lb + k]) {
            memcpy(emb + (size_t)(1 + k) * g->hidden, g->embeds + (size_t)(lb + k) * g->hidden, g->hidden * sizeof(float));
            mask[1 + k] = 1;
        }
    prism_llm_batch_t bt = {.n_seqs = 2, .n_tokens = 21, .tokens = toks, .seq_start = start, .pos0 = pos0,
                            .block_tables = tables, .embeds = emb, .embed_mask = mask};
    assert_int_equal(prism_llm_forward(g->llm, kb, &bt, lg), PRISM_OK);
    float *one = lg + 2 * (size_t)g->vocab;
    assert_int_equal(run_seq(g, k1, &a1, &ta, 1, NULL, NULL, false, one), PRISM_OK);
    assert_true(max_abs_diff(lg, one, g->vocab) <= 1e-4);
    assert_true(max_abs_diff(lg, g->logits + (size_t)la * g->vocab, g->vocab) <= g->tol);
    assert_int_equal(run_seq(g, k1, &b1, toks + 1, 20, emb + g->hidden, mask + 1, false, one), PRISM_OK);
    assert_true(max_abs_diff(lg + g->vocab, one, g->vocab) <= 1e-4);
    assert_true(max_abs_diff(lg + g->vocab, g->logits + (size_t)(g->n_prompt - 1) * g->vocab, g->vocab) <= g->tol);
    free(emb);
    free(lg);
    prism_kv_cache_free(kb);
    prism_kv_cache_free(k1);
}


/* The prefill -> decode hand-off of the cluster with a split KV cache: the prompt is prefilled in
 * an ordinary cache, only the full-attention layers' blocks and the chunked layers' blocks from the
 * current chunk's start are exported (less than the whole prompt's KV), imported into a decode
 * cache whose chunked layers live in a per-sequence ring of prism_kv_local_ring blocks, and greedy
 * decoding there, across an attention-chunk boundary and around the ring more than once, gives
 * HF's tokens and logits. A step that would not fit the ring is refused, not corrupted. */
static void test_split_cache_handoff(void **state)
{
    golden_t *g = *state;
    const prism_model_config_t *c = &g->cfg;
    prism_kv_cache_t *kp, *kd;
    assert_int_equal(prism_kv_cache_create(g->be, c, 64, BS, &kp), PRISM_OK);
    int32_t next = 5;
    seq_t p = {.next = &next};
    float *lg = malloc((size_t)g->vocab * sizeof(float));
    assert_int_equal(run_seq(g, kp, &p, g->ids, g->n_prompt, g->embeds, g->mask, false, lg), PRISM_OK);
    int n = g->n_prompt, nb = (n + BS - 1) / BS, c0b = prism_kv_local_first_block(c, BS, n);
    assert_int_equal(c0b, n / g->chunk * g->chunk / BS);
    size_t fbb = prism_kv_cache_class_block_bytes(c, BS, PRISM_KV_CLASS_FULL);
    size_t lbb = prism_kv_cache_class_block_bytes(c, BS, PRISM_KV_CLASS_LOCAL);
    assert_int_equal(fbb + lbb, prism_kv_cache_block_bytes(c, BS));
    size_t bytes = (size_t)nb * fbb + (size_t)(nb - c0b) * lbb;
    printf("  %s: hand-off of %d tokens: %zu bytes instead of %zu (chunked layers from block %d of %d)\n", g->name, n,
           bytes, (size_t)nb * prism_kv_cache_block_bytes(c, BS), c0b, nb);
    assert_true(bytes < (size_t)nb * prism_kv_cache_block_bytes(c, BS));
    uint8_t *wire = malloc(bytes);
    assert_int_equal(prism_kv_cache_export_class(kp, PRISM_KV_CLASS_FULL, p.table, nb, wire), PRISM_OK);
    assert_int_equal(prism_kv_cache_export_class(kp, PRISM_KV_CLASS_LOCAL, p.table + c0b, nb - c0b,
                                                 wire + (size_t)nb * fbb), PRISM_OK);

    int R = prism_kv_local_ring(c, BS, 1);
    assert_int_equal(R, (g->chunk + BS - 1) / BS + 1);
    assert_int_equal(prism_kv_cache_create_split(g->be, c, 64, 2 * R, BS, &kd), PRISM_OK);
    assert_int_equal(prism_kv_cache_export(kd, p.table, 1, wire), PRISM_EINVAL);   /* two pools: per class only */
    int32_t ring[64], ids[64];
    for (int i = 0; i < R; i++) ring[i] = 2 * R - 1 - i;   /* the second half of the pool, backwards */
    int32_t dnext = 11;
    seq_t d = {.next = &dnext};
    seq_reserve(&d, n);
    d.len = n;
    for (int k = 0; k < nb - c0b; k++) ids[k] = ring[(c0b + k) % R];
    assert_int_equal(prism_kv_cache_import_class(kd, PRISM_KV_CLASS_FULL, d.table, nb, wire), PRISM_OK);
    assert_int_equal(prism_kv_cache_import_class(kd, PRISM_KV_CLASS_LOCAL, ids, nb - c0b, wire + (size_t)nb * fbb),
                     PRISM_OK);

    int32_t out[N_GREEDY + 64];
    out[0] = argmax(lg, g->vocab);
    double worst = 0;
    const int32_t *rings[1] = {ring};
    int steps = N_GREEDY + 2 * g->chunk;   /* past the golden: around the ring twice more */
    for (int i = 1; i < steps && i < N_GREEDY + 64; i++) {
        seq_reserve(&d, d.len + 1);
        int32_t start[2] = {0, 1}, pos0[1] = {d.len};
        const int32_t *tables[1] = {d.table};
        prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = 1, .tokens = &out[i - 1], .seq_start = start, .pos0 = pos0,
                               .block_tables = tables, .local_tables = rings, .local_ring = R};
        assert_int_equal(prism_llm_forward(g->llm, kd, &b, lg), PRISM_OK);
        d.len++;
        out[i] = argmax(lg, g->vocab);
        if (i < N_GREEDY) {
            double e = max_abs_diff(lg, g->logits + (size_t)(n - 1 + i) * g->vocab, g->vocab);
            if (e > worst) worst = e;
            assert_int_equal(out[i], g->greedy[i]);
        }
    }
    assert_int_equal(out[0], g->greedy[0]);
    assert_true(worst <= g->tol);
    /* The ring holds decode steps; a step spanning more blocks than the ring does not fit and is refused. */
    int q = R * BS + 1;
    assert_true(q <= g->n_prompt);
    seq_reserve(&d, d.len + q);
    int32_t start[2] = {0, q}, pos0[1] = {d.len};
    const int32_t *tables[1] = {d.table};
    prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = q, .tokens = g->ids, .seq_start = start, .pos0 = pos0,
                           .block_tables = tables, .local_tables = rings, .local_ring = R};
    assert_int_equal(prism_llm_forward(g->llm, kd, &b, lg), PRISM_EINVAL);
    b.local_tables = NULL;
    assert_int_equal(prism_llm_forward(g->llm, kd, &b, lg), PRISM_EINVAL);   /* a split cache needs the rings */
    free(wire);
    free(lg);
    prism_kv_cache_free(kp);
    prism_kv_cache_free(kd);
}

/* ---- the other checkpoint key spelling: model.language_model. / model.vision_model. / lm_head ---- */

static void write_renamed_checkpoint(const char *src_dir, const char *dst_dir)
{
    char path[1300];
    snprintf(path, sizeof path, "%s/model.safetensors", src_dir);
    char *buf = NULL;
    size_t n = 0;
    assert_int_equal(prism_read_file(path, 64u << 20, &buf, &n), PRISM_OK);
    uint64_t hl = 0;
    memcpy(&hl, buf, 8);
    json_error_t jerr;
    json_t *h = json_loadb(buf + 8, hl, 0, &jerr), *nh = json_object();
    assert_non_null(h);
    const char *k;
    json_t *v;
    json_object_foreach(h, k, v) {
        char nk[512];
        if (!strncmp(k, "language_model.model.", 21)) snprintf(nk, sizeof nk, "model.language_model.%s", k + 21);
        else if (!strcmp(k, "language_model.lm_head.weight")) snprintf(nk, sizeof nk, "lm_head.weight");
        else if (!strncmp(k, "vision_model.", 13)) snprintf(nk, sizeof nk, "model.vision_model.%s", k + 13);
        else if (!strncmp(k, "multi_modal_projector.", 22)) snprintf(nk, sizeof nk, "model.%s", k);
        else snprintf(nk, sizeof nk, "%s", k);
        json_object_set(nh, nk, v);
    }
    char *hs = json_dumps(nh, JSON_COMPACT);
    size_t hn = strlen(hs), pad = (8 - hn % 8) % 8;
    snprintf(path, sizeof path, "%s/model.safetensors", dst_dir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint64_t nhl = hn + pad;
    fwrite(&nhl, 8, 1, f);
    fwrite(hs, 1, hn, f);
    for (size_t i = 0; i < pad; i++) fputc(' ', f);
    fwrite(buf + 8 + hl, 1, n - 8 - hl, f);
    fclose(f);
    free(hs);
    json_decref(h);
    json_decref(nh);
    prism_free(buf);
    char cmd[2700];
    snprintf(cmd, sizeof cmd, "cp '%s/config.json' '%s/'", src_dir, dst_dir);
    assert_int_equal(system(cmd), 0);
}

static void test_other_key_prefixes(void **state)
{
    golden_t *g = *state;
    if (!g->n_tiles) skip();
    char tmp[] = "/tmp/prism_llama4_keys_XXXXXX", err[256];
    assert_non_null(mkdtemp(tmp));
    write_renamed_checkpoint(g->dir, tmp);
    prism_model_config_t cfg;
    assert_int_equal(prism_model_config_load(tmp, &cfg, err, sizeof err), PRISM_OK);
    prism_llm_t *llm = NULL;
    prism_vision_t *vis = NULL;
    int rc = prism_llm_load(g->be, &cfg, tmp, MAX_TOK, 1, &llm, err, sizeof err);
    if (rc) fail_msg("llm: %s", err);
    rc = prism_vision_load(g->be, &cfg, tmp, 1, &vis, err, sizeof err);
    if (rc) fail_msg("vision: %s", err);
    size_t nf = (size_t)g->per_tile * g->hidden;
    float *f = malloc(nf * sizeof(float));
    assert_int_equal(prism_vision_encode(vis, g->pixels, 1, f), PRISM_OK);
    assert_true(max_abs_diff(f, g->feats, nf) <= g->tol);
    prism_kv_cache_t *kv;
    assert_int_equal(prism_kv_cache_create(g->be, &cfg, 64, BS, &kv), PRISM_OK);
    float *lg = malloc((size_t)g->vocab * sizeof(float));
    int32_t start[2] = {0, g->n_prompt}, pos0[1] = {0}, table[16];
    for (int i = 0; i < 16; i++) table[i] = i;
    const int32_t *tables[1] = {table};
    prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = g->n_prompt, .tokens = g->ids, .seq_start = start, .pos0 = pos0,
                           .block_tables = tables, .embeds = g->embeds, .embed_mask = g->mask};
    assert_int_equal(prism_llm_forward(llm, kv, &b, lg), PRISM_OK);
    assert_true(max_abs_diff(lg, g->logits + (size_t)(g->n_prompt - 1) * g->vocab, g->vocab) <= g->tol);
    free(lg);
    free(f);
    prism_kv_cache_free(kv);
    prism_vision_free(vis);
    prism_llm_free(llm);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tiny[] = {
        cmocka_unit_test(test_config_table),
        cmocka_unit_test(test_pixels),
        cmocka_unit_test(test_vision_features),
        cmocka_unit_test(test_prompt_logits),
        cmocka_unit_test(test_greedy_decode),
        cmocka_unit_test(test_chunked_prefill),
        cmocka_unit_test(test_mixed_batch),
        cmocka_unit_test(test_split_cache_handoff),
        cmocka_unit_test(test_other_key_prefixes),
    };
    const struct CMUnitTest text[] = {
        cmocka_unit_test(test_config_table),
        cmocka_unit_test(test_prompt_logits),
        cmocka_unit_test(test_greedy_decode),
        cmocka_unit_test(test_chunked_prefill),
        cmocka_unit_test(test_mixed_batch),
        cmocka_unit_test(test_split_cache_handoff),
    };
    const struct CMUnitTest tiny_bf16[] = {
        cmocka_unit_test(test_vision_features),
        cmocka_unit_test(test_prompt_logits),
        cmocka_unit_test(test_greedy_decode),
        cmocka_unit_test(test_mixed_batch),
    };
    int fails = cmocka_run_group_tests_name("llama4_tiny", tiny, setup_tiny, teardown);
    fails += cmocka_run_group_tests_name("llama4_tiny, bf16 weights", tiny_bf16, setup_tiny_bf16, teardown);
    fails += cmocka_run_group_tests_name("llama4_text", text, setup_text, teardown);
    return fails;
}
