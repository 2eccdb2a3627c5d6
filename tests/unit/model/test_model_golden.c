/* Golden tests of the language model and vision tower against Hugging Face transformers (fp32),
 * from fixtures written by tools/gen_model_goldens.py, plus paged-KV properties: greedy decoding
 * through the cache, chunked prefill, KV export/import (disaggregated transfer), mixed batches.
 * tiny_llava runs twice: with weights stored as fp32 and as bf16 (--weight-dtype bf16). Its
 * checkpoint is bf16, so both compute on the very weights HF does and meet the same tolerance.
 * With --compute-dtype bf16 (matmul inputs rounded to bf16) each model is held to a measured bound. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "backend/cpu/cpu_impl.h"

#define BS 16
#define MAX_PROMPT 512
#define N_GREEDY 32
#define GREEDY_TIE 0.01   /* test_bf16_compute_effect: logits this close are a tie */

typedef struct {
    const char *name;
    bool bf16;       /* weights stored as bf16 */
    bool bf16dp;     /* --compute-dtype bf16: matmul inputs rounded to bf16 too */
    double tol_feat_bf16;   /* test_bf16_compute_effect: bound on |vision features - HF| */
    int min_greedy;  /* test_bf16_compute_effect: greedy tokens equal to HF's from the first one */
    double tol_bf16; /* test_bf16_rounding_effect: bound on |logits - HF| */
    const char *ckpt_dtype;   /* test_bf16_rounding_effect: what the checkpoint stores */
    char model_dir[1024];
    int n_prompt;
    int32_t ids[MAX_PROMPT];
    int32_t greedy[N_GREEDY];
    int vocab, n_images, image_size, image_seq, hidden;
    double tol;
    float *logits;   /* [n_prompt][vocab] */
    float *pixels;   /* [n_images][3][S][S] */
    float *feats;    /* [n_images][image_seq][hidden] */
    prism_model_config_t cfg;
    prism_backend_t *be;
    prism_llm_t *llm;
    prism_vision_t *vis;
    float *embeds;   /* [n_prompt][hidden] from our vision output (or NULL) */
    uint8_t *mask;   /* [n_prompt] */
    int packed_llm, packed_all;   /* matmul weights the backend packed after the llm's load, after the tower's */
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
        if (!(d <= m)) m = d;  /* NaN propagates as a failure */
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

static int golden_setup(void **state)
{
    golden_t *g = *state;
    char dir[1024], path[1200], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/model/%s", source_dir(), g->name);
    snprintf(path, sizeof path, "%s/golden.json", dir);
    json_error_t jerr;
    json_t *j = json_load_file(path, 0, &jerr);
    assert_non_null(j);
    json_t *ids = json_object_get(j, "input_ids"), *gr = json_object_get(j, "greedy");
    g->n_prompt = (int)json_array_size(ids);
    assert_true(g->n_prompt > 0 && g->n_prompt <= MAX_PROMPT);
    for (int i = 0; i < g->n_prompt; i++) g->ids[i] = (int32_t)json_integer_value(json_array_get(ids, i));
    assert_int_equal(json_array_size(gr), N_GREEDY);
    for (int i = 0; i < N_GREEDY; i++) g->greedy[i] = (int32_t)json_integer_value(json_array_get(gr, i));
    g->vocab = (int)json_integer_value(json_object_get(j, "vocab"));
    g->n_images = (int)json_integer_value(json_object_get(j, "n_images"));
    g->image_size = (int)json_integer_value(json_object_get(j, "image_size"));
    g->image_seq = (int)json_integer_value(json_object_get(j, "image_seq_length"));
    g->hidden = (int)json_integer_value(json_object_get(j, "hidden"));
    g->tol = json_number_value(json_object_get(j, "tolerance"));
    snprintf(g->model_dir, sizeof g->model_dir, "%s/%s", source_dir(),
             json_string_value(json_object_get(j, "model_dir")));
    json_decref(j);

    g->logits = read_f32(dir, "logits.bin", (size_t)g->n_prompt * g->vocab);
    if (g->n_images) {
        g->pixels = read_f32(dir, "pixel_values.bin", (size_t)g->n_images * 3 * g->image_size * g->image_size);
        g->feats = read_f32(dir, "vision_features.bin", (size_t)g->n_images * g->image_seq * g->hidden);
    }
    int rc = prism_model_config_load(g->model_dir, &g->cfg, err, sizeof err);
    if (rc) fprintf(stderr, "config: %s\n", err);
    assert_int_equal(rc, PRISM_OK);
    assert_int_equal(g->cfg.vocab, g->vocab);
    g->be = prism_backend_cpu_create(2);
    assert_non_null(g->be);
    if (g->bf16) assert_int_equal(prism_backend_set_weight_dtype(g->be, PRISM_DTYPE_BF16), PRISM_OK);
    if (g->bf16dp) assert_int_equal(prism_backend_set_compute_dtype(g->be, PRISM_DTYPE_BF16), PRISM_OK);
    rc = prism_llm_load(g->be, &g->cfg, g->model_dir, MAX_PROMPT, 4, &g->llm, err, sizeof err);
    if (rc) fprintf(stderr, "llm: %s\n", err);
    assert_int_equal(rc, PRISM_OK);
    g->packed_llm = g->packed_all = ((prism_cpu_ctx_t *)g->be->ctx)->n_packed;
    if (g->n_images) {
        assert_true(g->cfg.has_vision);
        assert_int_equal(g->cfg.image_seq_length, g->image_seq);
        assert_int_equal(g->cfg.hidden, g->hidden);
        rc = prism_vision_load(g->be, &g->cfg, g->model_dir, g->n_images, &g->vis, err, sizeof err);
        if (rc) fprintf(stderr, "vision: %s\n", err);
        assert_int_equal(rc, PRISM_OK);
        g->packed_all = ((prism_cpu_ctx_t *)g->be->ctx)->n_packed;
        /* Prompt embeddings from OUR encoder output (checked against HF in its own test). */
        float *feats = malloc((size_t)g->n_images * g->image_seq * g->hidden * sizeof(float));
        assert_int_equal(prism_vision_encode(g->vis, g->pixels, g->n_images, feats), PRISM_OK);
        g->embeds = calloc((size_t)g->n_prompt * g->hidden, sizeof(float));
        g->mask = calloc((size_t)g->n_prompt, 1);
        int k = 0;
        for (int i = 0; i < g->n_prompt; i++)
            if (g->ids[i] == g->cfg.image_token_index) {
                assert_true(k < g->n_images * g->image_seq);
                memcpy(g->embeds + (size_t)i * g->hidden, feats + (size_t)k * g->hidden, g->hidden * sizeof(float));
                g->mask[i] = 1;
                k++;
            }
        assert_int_equal(k, g->n_images * g->image_seq);
        free(feats);
    }
    return 0;
}

static int golden_teardown(void **state)
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
    g->vis = NULL; g->llm = NULL; g->be = NULL; g->logits = g->pixels = g->feats = NULL;
    g->embeds = NULL; g->mask = NULL;
    return 0;
}

/* ---- a tiny sequence/block manager for the tests ---- */

typedef struct {
    int32_t table[64];
    int n_blocks;
    int len;            /* tokens in cache */
    int32_t *next;      /* shared bump allocator of block ids */
} seq_t;

static void seq_reserve(seq_t *s, int new_len)
{
    while (s->n_blocks * BS < new_len) {
        assert_true(s->n_blocks < 64);
        s->table[s->n_blocks++] = (*s->next)++;
    }
}

/* Runs one forward of n tokens (optionally with embeds) for a single sequence. */
static int run_seq(golden_t *g, prism_kv_cache_t *kv, seq_t *s, const int32_t *toks, int n,
                   const float *embeds, const uint8_t *mask, bool all, float *logits)
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

static void test_vision_features(void **state)
{
    golden_t *g = *state;
    if (!g->n_images) skip();
    size_t n = (size_t)g->n_images * g->image_seq * g->hidden;
    float *out = malloc(n * sizeof(float));
    uint64_t allocs = prism_mem_alloc_count();
    assert_int_equal(prism_vision_encode(g->vis, g->pixels, g->n_images, out), PRISM_OK);
    assert_int_equal(prism_mem_alloc_count(), allocs);  /* encode never allocates */
    double d = max_abs_diff(out, g->feats, n);
    printf("  %s%s: vision features max |diff| %.3g\n", g->name, g->bf16 ? " (bf16 weights)" : "", d);
    assert_true(d <= g->tol);
    /* over the limit is refused, not crashed */
    assert_int_equal(prism_vision_encode(g->vis, g->pixels, g->n_images + 1, out), PRISM_ELIMIT);
    free(out);
}

/* The logits of every prompt position in one forward (the caller frees them); *allocs: heap
 * allocations the forward made. */
static float *prompt_logits(golden_t *g, uint64_t *allocs)
{
    prism_kv_cache_t *kv;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &kv), PRISM_OK);
    int32_t next = 0;
    seq_t s = {.next = &next};
    float *lg = malloc((size_t)g->n_prompt * g->vocab * sizeof(float));
    uint64_t before = prism_mem_alloc_count();
    assert_int_equal(run_seq(g, kv, &s, g->ids, g->n_prompt, g->embeds, g->mask, true, lg), PRISM_OK);
    *allocs = prism_mem_alloc_count() - before;
    prism_kv_cache_free(kv);
    return lg;
}

static void test_prompt_logits(void **state)
{
    golden_t *g = *state;
    uint64_t allocs;
    float *lg = prompt_logits(g, &allocs);
    assert_int_equal(allocs, 0);  /* forward never allocates */
    double d = max_abs_diff(lg, g->logits, (size_t)g->n_prompt * g->vocab);
    printf("  %s%s: %d prompt positions x %d vocab, logits max |diff| %.3g\n", g->name,
           g->bf16 ? " (bf16 weights)" : "", g->n_prompt, g->vocab, d);
    assert_true(d <= g->tol);
    free(lg);
}

static void test_greedy_decode(void **state)
{
    golden_t *g = *state;
    prism_kv_cache_t *kv;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &kv), PRISM_OK);
    int32_t next = 3;  /* non-zero, non-contiguous start */
    seq_t s = {.next = &next};
    float *lg = malloc((size_t)g->vocab * sizeof(float));
    assert_int_equal(run_seq(g, kv, &s, g->ids, g->n_prompt, g->embeds, g->mask, false, lg), PRISM_OK);
    int32_t out[N_GREEDY];
    out[0] = argmax(lg, g->vocab);
    uint64_t allocs = prism_mem_alloc_count();
    for (int i = 1; i < N_GREEDY; i++) {
        assert_int_equal(run_seq(g, kv, &s, &out[i - 1], 1, NULL, NULL, false, lg), PRISM_OK);
        out[i] = argmax(lg, g->vocab);
    }
    assert_int_equal(prism_mem_alloc_count(), allocs);
    assert_true(s.n_blocks >= 3);  /* the context spans several blocks */
    for (int i = 0; i < N_GREEDY; i++) {
        if (out[i] != g->greedy[i]) fprintf(stderr, "  %s: token %d: got %d, HF %d\n", g->name, i, out[i], g->greedy[i]);
        assert_int_equal(out[i], g->greedy[i]);
    }
    free(lg);
    prism_kv_cache_free(kv);
}

static void test_chunked_prefill(void **state)
{
    golden_t *g = *state;
    prism_kv_cache_t *kv;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &kv), PRISM_OK);
    int32_t next = 0;
    seq_t s = {.next = &next};
    int n = g->n_prompt, cut = n / 2 + 3;  /* not block aligned; inside an image span for the VLMs */
    float *lg = malloc((size_t)n * g->vocab * sizeof(float));
    assert_int_equal(run_seq(g, kv, &s, g->ids, cut, emb_at(g, 0), mask_at(g, 0), true, lg), PRISM_OK);
    assert_int_equal(run_seq(g, kv, &s, g->ids + cut, n - cut, emb_at(g, cut), mask_at(g, cut), true,
                             lg + (size_t)cut * g->vocab), PRISM_OK);
    double d = max_abs_diff(lg, g->logits, (size_t)n * g->vocab);
    printf("  %s: two-chunk prefill (%d + %d) max |diff| vs HF %.3g\n", g->name, cut, n - cut, d);
    assert_true(d <= g->tol);
    /* and the next token agrees with one-shot greedy */
    assert_int_equal(argmax(lg + (size_t)(n - 1) * g->vocab, g->vocab), g->greedy[0]);
    free(lg);
    prism_kv_cache_free(kv);
}

static void test_kv_export_import(void **state)
{
    golden_t *g = *state;
    prism_kv_cache_t *a, *b;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &a), PRISM_OK);
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 40, BS, &b), PRISM_OK);
    int32_t next_a = 5;
    seq_t sa = {.next = &next_a};
    float *lg = malloc((size_t)g->vocab * sizeof(float)), *lg2 = malloc((size_t)g->vocab * sizeof(float));
    assert_int_equal(run_seq(g, a, &sa, g->ids, g->n_prompt, g->embeds, g->mask, false, lg), PRISM_OK);
    int32_t first = argmax(lg, g->vocab);

    /* Ship the prefill's blocks to another cache at different block ids. */
    size_t bb = prism_kv_cache_block_bytes(&g->cfg, BS);
    uint8_t *wire = malloc(bb * sa.n_blocks);
    assert_int_equal(prism_kv_cache_export(a, sa.table, sa.n_blocks, wire), PRISM_OK);
    int32_t next_b = 0;
    seq_t sb = {.next = &next_b, .len = sa.len};
    for (int i = 0; i < sa.n_blocks; i++) sb.table[i] = 39 - 2 * i;
    sb.n_blocks = sa.n_blocks;
    next_b = 0;  /* new blocks for decode come from 0.. (disjoint from 39, 37, ...) */
    assert_int_equal(prism_kv_cache_import(b, sb.table, sb.n_blocks, wire), PRISM_OK);
    /* Round trip is exact. */
    uint8_t *wire2 = malloc(bb * sa.n_blocks);
    assert_int_equal(prism_kv_cache_export(b, sb.table, sb.n_blocks, wire2), PRISM_OK);
    assert_memory_equal(wire, wire2, bb * sa.n_blocks);
    /* Bad block ids are refused. */
    int32_t bad[1] = {40};
    assert_int_equal(prism_kv_cache_export(b, bad, 1, wire2), PRISM_EINVAL);
    assert_int_equal(prism_kv_cache_import(b, bad, 1, wire2), PRISM_EINVAL);

    /* Both continue identically, and match HF's greedy tokens. */
    int32_t ta = first, tb = first;
    assert_int_equal(first, g->greedy[0]);
    for (int i = 1; i < 12; i++) {
        assert_int_equal(run_seq(g, a, &sa, &ta, 1, NULL, NULL, false, lg), PRISM_OK);
        assert_int_equal(run_seq(g, b, &sb, &tb, 1, NULL, NULL, false, lg2), PRISM_OK);
        assert_true(max_abs_diff(lg, lg2, g->vocab) <= 1e-6);
        ta = argmax(lg, g->vocab);
        tb = argmax(lg2, g->vocab);
        assert_int_equal(ta, tb);
        assert_int_equal(tb, g->greedy[i]);
    }
    free(wire);
    free(wire2);
    free(lg);
    free(lg2);
    prism_kv_cache_free(a);
    prism_kv_cache_free(b);
}

static void test_mixed_batch(void **state)
{
    golden_t *g = *state;
    /* Three sequences: prompt prefixes of different lengths. One forward with two decode steps and
     * one prefill chunk must equal running each alone. */
    int lens[3] = {5, 23, g->n_prompt};
    if (lens[1] >= g->n_prompt) lens[1] = g->n_prompt / 2;
    prism_kv_cache_t *kb, *k1;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &kb), PRISM_OK);
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &k1), PRISM_OK);
    int32_t next_b = 0, next_1 = 0;
    seq_t sb[3], s1[3];
    float *lg = malloc((size_t)4 * g->vocab * sizeof(float));
    int32_t tok[3];
    for (int i = 0; i < 3; i++) {
        sb[i] = (seq_t){.next = &next_b};
        s1[i] = (seq_t){.next = &next_1};
        int n = i == 1 ? lens[1] - 7 : lens[i];  /* seq 1 leaves 7 prompt tokens for the batch */
        assert_int_equal(run_seq(g, kb, &sb[i], g->ids, n, g->embeds, g->mask, false, lg), PRISM_OK);
        assert_int_equal(run_seq(g, k1, &s1[i], g->ids, n, g->embeds, g->mask, false, lg), PRISM_OK);
        tok[i] = argmax(lg, g->vocab);
    }
    for (int step = 0; step < 3; step++) {
        /* batch: seq0 decode, seq1 (prefill chunk at step 0, then decode), seq2 decode */
        int n1 = step == 0 ? 7 : 1;
        int32_t toks[16];
        toks[0] = tok[0];
        const int32_t *src1 = step == 0 ? g->ids + sb[1].len : &tok[1];
        memcpy(toks + 1, src1, n1 * sizeof(int32_t));
        toks[1 + n1] = tok[2];
        int T = n1 + 2;
        int32_t start[4] = {0, 1, 1 + n1, T}, pos0[3];
        const int32_t *tables[3];
        float emb[16 * 256];
        uint8_t mask[16] = {0};
        bool use_emb = false;
        for (int i = 0; i < 3; i++) {
            seq_reserve(&sb[i], sb[i].len + (start[i + 1] - start[i]));
            pos0[i] = sb[i].len;
            tables[i] = sb[i].table;
        }
        if (step == 0 && g->mask) {
            for (int k = 0; k < n1; k++)
                if (g->mask[sb[1].len + k]) {
                    assert_true(g->hidden <= 256);
                    memcpy(emb + (size_t)(1 + k) * g->hidden, g->embeds + (size_t)(sb[1].len + k) * g->hidden,
                           g->hidden * sizeof(float));
                    mask[1 + k] = 1;
                    use_emb = true;
                }
        }
        prism_llm_batch_t b = {.n_seqs = 3, .n_tokens = T, .tokens = toks, .seq_start = start, .pos0 = pos0,
                               .block_tables = tables, .embeds = use_emb ? emb : NULL,
                               .embed_mask = use_emb ? mask : NULL, .all_logits = false};
        assert_int_equal(prism_llm_forward(g->llm, kb, &b, lg), PRISM_OK);
        for (int i = 0; i < 3; i++) sb[i].len += start[i + 1] - start[i];
        float *one = lg + (size_t)3 * g->vocab;
        for (int i = 0; i < 3; i++) {
            int n = start[i + 1] - start[i];
            assert_int_equal(run_seq(g, k1, &s1[i], toks + start[i], n, use_emb ? emb + (size_t)start[i] * g->hidden : NULL,
                                     use_emb ? mask + start[i] : NULL, false, one), PRISM_OK);
            double d = max_abs_diff(lg + (size_t)i * g->vocab, one, g->vocab);
            assert_true(d <= 1e-4);
        }
        for (int i = 0; i < 3; i++) tok[i] = argmax(lg + (size_t)i * g->vocab, g->vocab);
    }
    free(lg);
    prism_kv_cache_free(kb);
    prism_kv_cache_free(k1);
}

static void test_forward_limits(void **state)
{
    golden_t *g = *state;
    prism_kv_cache_t *kv;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 8, BS, &kv), PRISM_OK);
    float *lg = malloc((size_t)5 * g->vocab * sizeof(float));
    int32_t toks[MAX_PROMPT + 1] = {0};
    int32_t table[64] = {0, 1, 2, 3, 4, 5, 6, 7};
    const int32_t *tables[5] = {table, table, table, table, table};
    int32_t start[6] = {0, 1, 2, 3, 4, 5}, pos0[5] = {0};
    prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = MAX_PROMPT + 1, .tokens = toks, .seq_start = (int32_t[]){0, MAX_PROMPT + 1},
                           .pos0 = pos0, .block_tables = tables};
    assert_int_equal(prism_llm_forward(g->llm, kv, &b, lg), PRISM_ELIMIT);         /* too many tokens */
    b = (prism_llm_batch_t){.n_seqs = 5, .n_tokens = 5, .tokens = toks, .seq_start = start, .pos0 = pos0, .block_tables = tables};
    assert_int_equal(prism_llm_forward(g->llm, kv, &b, lg), PRISM_ELIMIT);         /* too many seqs */
    int32_t bad_tok[1] = {g->vocab};
    b = (prism_llm_batch_t){.n_seqs = 1, .n_tokens = 1, .tokens = bad_tok, .seq_start = start, .pos0 = pos0, .block_tables = tables};
    assert_int_equal(prism_llm_forward(g->llm, kv, &b, lg), PRISM_EINVAL);         /* token out of range */
    int32_t bad_table[1] = {8};
    const int32_t *bt[1] = {bad_table};
    b = (prism_llm_batch_t){.n_seqs = 1, .n_tokens = 1, .tokens = toks, .seq_start = start, .pos0 = pos0, .block_tables = bt};
    assert_int_equal(prism_llm_forward(g->llm, kv, &b, lg), PRISM_EINVAL);         /* block id out of range */
    int32_t far[1] = {g->cfg.max_pos};
    b = (prism_llm_batch_t){.n_seqs = 1, .n_tokens = 1, .tokens = toks, .seq_start = start, .pos0 = far, .block_tables = tables};
    assert_int_equal(prism_llm_forward(g->llm, kv, &b, lg), PRISM_EINVAL);         /* beyond max_pos */
    int32_t bad_start[2] = {0, 0};
    b = (prism_llm_batch_t){.n_seqs = 1, .n_tokens = 1, .tokens = toks, .seq_start = bad_start, .pos0 = pos0, .block_tables = tables};
    assert_int_equal(prism_llm_forward(g->llm, kv, &b, lg), PRISM_EINVAL);         /* bad offsets */
    free(lg);
    prism_kv_cache_free(kv);
}

static void test_budget_planning(void **state)
{
    golden_t *g = *state;
    /* The planning functions match what load actually allocates. */
    prism_backend_t *be = g->be;
    size_t before = be->i.pool_used(be->ctx);
    prism_llm_t *m;
    char err[256];
    assert_int_equal(prism_llm_load(be, &g->cfg, g->model_dir, 64, 2, &m, err, sizeof err), PRISM_OK);
    size_t used = be->i.pool_used(be->ctx) - before;
    assert_int_equal(used, prism_llm_weight_bytes(m) + prism_llm_arena_bytes(&g->cfg, 64, 2));
    prism_llm_free(m);
    assert_int_equal(be->i.pool_used(be->ctx), before);
    /* A pool too small for the weights fails cleanly. */
    prism_backend_t *small = prism_backend_cpu_create_pool(1, 4096);
    assert_int_equal(prism_llm_load(small, &g->cfg, g->model_dir, 64, 2, &m, err, sizeof err), PRISM_ENOMEM);
    prism_backend_destroy(small);
    size_t bb = prism_kv_cache_block_bytes(&g->cfg, BS);
    assert_int_equal(bb, (size_t)g->cfg.n_layers * 2 * BS * g->cfg.n_kv_heads * g->cfg.head_dim * 4);
}

/* A checkpoint that is not bf16 (llava_like: fp32, qwen2_text: f16) loaded with bf16 weights: the
 * weights round, so the logits leave HF's fp32 ones by what the rounding costs (the figure docs/
 * PERFORMANCE.md reports), bounded here; greedy tokens are counted, not required. */
static void test_bf16_rounding_effect(void **state)
{
    golden_t *g = *state;
    uint64_t allocs;
    float *lg = prompt_logits(g, &allocs);
    double d = max_abs_diff(lg, g->logits, (size_t)g->n_prompt * g->vocab), mx = 0;
    int same_top = 0;
    for (int i = 0; i < g->n_prompt; i++) {
        same_top += argmax(lg + (size_t)i * g->vocab, g->vocab) == argmax(g->logits + (size_t)i * g->vocab, g->vocab);
        for (int v = 0; v < g->vocab; v++) mx = fmax(mx, fabs(g->logits[(size_t)i * g->vocab + v]));
    }
    printf("  %s (bf16 weights from a %s checkpoint): logits max |diff| %.3g (largest |logit| %.3g), "
           "top token equal at %d of %d positions\n", g->name, g->ckpt_dtype, d, mx, same_top,
           g->n_prompt);
    assert_true(d <= g->tol_bf16);
    free(lg);
}

/* --compute-dtype bf16: every matmul's input rounds to bf16 as well, so the logits and the vision
 * features leave HF's fp32 ones by what that costs (docs/PERFORMANCE.md), bounded here; the greedy
 * answer agrees with HF's for its first min_greedy tokens (measured, with a margin). */
static void test_bf16_compute_effect(void **state)
{
    golden_t *g = *state;
    /* with AVX-512 BF16 the loaders packed the matmul weights of every layer (qkv, o, gate/up, down),
     * an untied lm_head and the vision tower's, never the embedding table; all below run on them */
    if (prism_cpu_has_avx512_bf16()) {
        assert_int_equal(g->packed_llm, 4 * g->cfg.n_layers + !g->cfg.tie_word_embeddings);
        /* and the tower's: the patch embedding, 4 per layer, the projector's 1-2 */
        if (g->n_images) assert_true(g->packed_all >= g->packed_llm + 6);
    }
    double dv = 0;
    if (g->n_images) {
        size_t n = (size_t)g->n_images * g->image_seq * g->hidden;
        float *out = malloc(n * sizeof(float));
        assert_int_equal(prism_vision_encode(g->vis, g->pixels, g->n_images, out), PRISM_OK);
        dv = max_abs_diff(out, g->feats, n);
        free(out);
    }
    uint64_t allocs;
    float *lg = prompt_logits(g, &allocs);
    assert_int_equal(allocs, 0);
    double d = max_abs_diff(lg, g->logits, (size_t)g->n_prompt * g->vocab);
    int same_top = 0;
    for (int i = 0; i < g->n_prompt; i++)
        same_top += argmax(lg + (size_t)i * g->vocab, g->vocab) == argmax(g->logits + (size_t)i * g->vocab, g->vocab);
    free(lg);
    /* greedy through the cache (prefill, then decode steps of one row: the small-M kernel) */
    prism_kv_cache_t *kv;
    assert_int_equal(prism_kv_cache_create(g->be, &g->cfg, 64, BS, &kv), PRISM_OK);
    int32_t next = 0;
    seq_t s = {.next = &next};
    float *l1 = malloc((size_t)g->vocab * sizeof(float));
    assert_int_equal(run_seq(g, kv, &s, g->ids, g->n_prompt, g->embeds, g->mask, false, l1), PRISM_OK);
    /* tokens equal to HF's from the first; where they part, how far our logit of HF's token is
     * below our choice */
    int32_t out[N_GREEDY];
    int agree = 0;
    double tie_gap = 0;
    out[0] = argmax(l1, g->vocab);
    if (out[0] == g->greedy[0]) agree = 1;
    else tie_gap = l1[out[0]] - l1[g->greedy[0]];
    for (int i = 1; i < N_GREEDY; i++) {
        assert_int_equal(run_seq(g, kv, &s, &out[i - 1], 1, NULL, NULL, false, l1), PRISM_OK);
        out[i] = argmax(l1, g->vocab);
        if (agree == i && out[i] != g->greedy[i]) tie_gap = l1[out[i]] - l1[g->greedy[i]];
        if (agree == i && out[i] == g->greedy[i]) agree++;
    }
    printf("  %s (--compute-dtype bf16): vision features max |diff| %.3g, logits max |diff| %.3g, top token equal "
           "at %d of %d positions, greedy equal to HF for the first %d of %d tokens", g->name, dv, d, same_top,
           g->n_prompt, agree, N_GREEDY);
    if (agree < N_GREEDY) printf(" (then HF's token %.4f below ours)", tie_gap);
    printf("\n");
    assert_true(dv <= g->tol_feat_bf16);
    assert_true(d <= g->tol_bf16);
    /* Fewer than min_greedy only at a near tie: HF's token within GREEDY_TIE of ours, a tenth of the
     * logit error rounding x to bf16 costs here (0.02-0.15): which of the two wins is not
     * determined by bf16 arithmetic, and the answers part there. */
    assert_true(agree >= g->min_greedy || tie_gap <= GREEDY_TIE);
    free(l1);
    prism_kv_cache_free(kv);
}

#define CASE_TESTS(st)                                                                   \
    cmocka_unit_test_prestate_setup_teardown(test_vision_features, golden_setup, golden_teardown, st), \
    cmocka_unit_test_prestate_setup_teardown(test_prompt_logits, golden_setup, golden_teardown, st),   \
    cmocka_unit_test_prestate_setup_teardown(test_greedy_decode, golden_setup, golden_teardown, st),   \
    cmocka_unit_test_prestate_setup_teardown(test_chunked_prefill, golden_setup, golden_teardown, st), \
    cmocka_unit_test_prestate_setup_teardown(test_kv_export_import, golden_setup, golden_teardown, st),\
    cmocka_unit_test_prestate_setup_teardown(test_mixed_batch, golden_setup, golden_teardown, st),     \
    cmocka_unit_test_prestate_setup_teardown(test_forward_limits, golden_setup, golden_teardown, st),  \
    cmocka_unit_test_prestate_setup_teardown(test_budget_planning, golden_setup, golden_teardown, st)

int main(void)
{
    prism_log_init("test_model_golden", PRISM_LOG_WARN);
    static golden_t tiny = {.name = "tiny_llava"}, like = {.name = "llava_like"}, qwen = {.name = "qwen2_text"};
    static golden_t tiny16 = {.name = "tiny_llava", .bf16 = true};
    /* measured: 0.071 and 0.14 (a wrong bf16 matmul is off by whole logits) */
    static golden_t like16 = {.name = "llava_like", .bf16 = true, .tol_bf16 = 0.2, .ckpt_dtype = "fp32"},
                    qwen16 = {.name = "qwen2_text", .bf16 = true, .tol_bf16 = 0.3, .ckpt_dtype = "f16"};
    /* --compute-dtype bf16, measured (logits, features, greedy tokens equal to HF's of 32): tiny_llava
     * 0.019, 0.336, 32; llava_like 0.094, 0.058, 32; qwen2_text 0.147, -, 32 */
    static golden_t tinydp = {.name = "tiny_llava", .bf16 = true, .bf16dp = true, .tol_bf16 = 0.05,
                              .tol_feat_bf16 = 0.5, .min_greedy = 24},
                    likedp = {.name = "llava_like", .bf16 = true, .bf16dp = true, .tol_bf16 = 0.2,
                              .tol_feat_bf16 = 0.15, .min_greedy = 24},
                    qwendp = {.name = "qwen2_text", .bf16 = true, .bf16dp = true, .tol_bf16 = 0.3, .min_greedy = 24};
    const struct CMUnitTest tests[] = {
        CASE_TESTS(&tiny),
        CASE_TESTS(&tiny16),
        cmocka_unit_test_prestate_setup_teardown(test_bf16_compute_effect, golden_setup, golden_teardown, &tinydp),
        cmocka_unit_test_prestate_setup_teardown(test_bf16_compute_effect, golden_setup, golden_teardown, &likedp),
        cmocka_unit_test_prestate_setup_teardown(test_bf16_compute_effect, golden_setup, golden_teardown, &qwendp),
        cmocka_unit_test_prestate_setup_teardown(test_bf16_rounding_effect, golden_setup, golden_teardown, &like16),
        cmocka_unit_test_prestate_setup_teardown(test_bf16_rounding_effect, golden_setup, golden_teardown, &qwen16),
        CASE_TESTS(&like),
        CASE_TESTS(&qwen),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
