/* The between-layer hook: a cancelled item leaves a batch in the middle of a forward without
 * changing what the others compute, its outputs are never written, progress is reported for every
 * layer, and begin + end equal the one-call forward. Tiny LLaVA shapes with random weights. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/model.h"

typedef struct {
    int cancel_item;      /* -1: none; -2: all */
    int cancel_at;        /* layer count (done) from which the item is cancelled */
    int done, total, calls;
    int asked[64];        /* how often cancelled() was asked per item */
} hook_state_t;

static bool on_layer(void *ud, int done, int total)
{
    hook_state_t *h = ud;
    h->done = done;
    h->total = total;
    h->calls++;
    return h->cancel_item != -1 && done >= h->cancel_at;
}

static bool on_cancelled(void *ud, int item)
{
    hook_state_t *h = ud;
    h->asked[item]++;
    return h->cancel_item == -2 || item == h->cancel_item;
}

static prism_model_config_t tiny(void)
{
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/models/prism-tiny-llava", PRISM_SOURCE_DIR);
    prism_model_config_t cfg;
    assert_int_equal(prism_model_config_load(dir, &cfg, err, sizeof err), PRISM_OK);
    cfg.random_weights = true;
    cfg.random_seed = 11;
    return cfg;
}

static void assert_close(const float *a, const float *b, size_t n, float tol)
{
    for (size_t i = 0; i < n; i++)
        if (fabsf(a[i] - b[i]) > tol * (1.0f + fabsf(b[i]))) fail_msg("element %zu: %g vs %g", i, a[i], b[i]);
}

static void vision_cancel_mid_batch(const prism_model_config_t *cfg_in, const char *dir)
{
    prism_model_config_t cfg = *cfg_in;
    prism_backend_t *be = prism_backend_cpu_create(1);
    char err[256];
    prism_vision_t *v = NULL;
    assert_int_equal(prism_vision_load(be, &cfg, dir, 3, &v, err, sizeof err), PRISM_OK);
    size_t S = (size_t)cfg.v_image_size, px = 3 * S * S, per = (size_t)cfg.image_seq_length * cfg.hidden;
    float *pix = prism_malloc(3 * px * sizeof(float)), *ref = prism_malloc(3 * per * sizeof(float)),
          *out = prism_malloc(3 * per * sizeof(float));
    for (size_t i = 0; i < 3 * px; i++) pix[i] = sinf((float)i * 0.013f);
    assert_int_equal(prism_vision_encode(v, pix, 3, ref), PRISM_OK);

    /* image 1 cancelled after layer 2: 0 and 2 unchanged, 1 never written */
    hook_state_t h = {.cancel_item = 1, .cancel_at = 2};
    prism_model_hook_t hook = {on_layer, on_cancelled, &h};
    prism_vision_set_hook(v, &hook);
    for (size_t i = 0; i < 3 * per; i++) out[i] = NAN;
    assert_int_equal(prism_vision_encode(v, pix, 3, out), PRISM_OK);
    int n_run = h.total;
    assert_true(n_run >= 2);
    assert_int_equal(h.calls, n_run + 1);   /* after the embeddings and after every layer */
    assert_int_equal(h.done, n_run);
    assert_int_equal(h.asked[1], 1);        /* asked once, then gone */
    assert_close(out, ref, per, 1e-4f);
    assert_close(out + 2 * per, ref + 2 * per, per, 1e-4f);
    for (size_t i = 0; i < per; i++) assert_true(isnan(out[per + i]));

    /* the first image cancelled before layer 0: the others renumber inside, not outside */
    h = (hook_state_t){.cancel_item = 0, .cancel_at = 0};
    for (size_t i = 0; i < 3 * per; i++) out[i] = NAN;
    assert_int_equal(prism_vision_encode(v, pix, 3, out), PRISM_OK);
    assert_true(isnan(out[0]) && isnan(out[per - 1]));
    assert_close(out + per, ref + per, 2 * per, 1e-4f);

    /* everything cancelled: PRISM_OK, nothing written, the layers stop */
    h = (hook_state_t){.cancel_item = -2, .cancel_at = 1};
    for (size_t i = 0; i < 3 * per; i++) out[i] = NAN;
    assert_int_equal(prism_vision_encode(v, pix, 3, out), PRISM_OK);
    assert_int_equal(h.calls, 2);
    for (size_t i = 0; i < 3 * per; i++) assert_true(isnan(out[i]));

    /* a hook that never reports an abort changes nothing */
    h = (hook_state_t){.cancel_item = -1};
    assert_int_equal(prism_vision_encode(v, pix, 3, out), PRISM_OK);
    assert_memory_equal(out, ref, 3 * per * sizeof(float));
    assert_int_equal(h.asked[0] + h.asked[1] + h.asked[2], 0);

    prism_free(pix);
    prism_free(ref);
    prism_free(out);
    prism_vision_free(v);
    prism_backend_destroy(be);
}

static void test_vision_cancel_mid_batch(void **state)
{
    (void)state;
    prism_model_config_t cfg = tiny();
    vision_cancel_mid_batch(&cfg, "/nonexistent");
}

/* The Llama-4 tower: CLS last, 2D RoPE positions per image, pixel shuffle and adapter after. */
static void test_llama4_vision_cancel_mid_batch(void **state)
{
    (void)state;
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/model/llama4_tiny", PRISM_SOURCE_DIR);
    prism_model_config_t cfg;
    assert_int_equal(prism_model_config_load(dir, &cfg, err, sizeof err), PRISM_OK);
    vision_cancel_mid_batch(&cfg, dir);
}

/* Three sequences of a mixed batch: two prompts and a decode-like token late in its context (so
 * positions, and Llama-4's per-token attention temperature, differ once sequences drop out). */
#define NS 3
static const int32_t k_len[NS] = {20, 12, 1}, k_pos0[NS] = {0, 0, 40};
#define NT 33

static void llm_run_rings(prism_llm_t *m, prism_kv_cache_t *kv, int vocab, bool all_logits, bool split,
                          const int32_t **rings, int ring, float *logits)
{
    int32_t toks[NT], start[NS + 1] = {0};
    int32_t tab[NS][3] = {{0, 1, 0}, {2, 0, 0}, {3, 4, 5}};
    const int32_t *tables[NS] = {tab[0], tab[1], tab[2]};
    for (int s = 0; s < NS; s++) start[s + 1] = start[s] + k_len[s];
    for (int t = 0; t < start[NS]; t++) toks[t] = (5 + 37 * t) % vocab;
    prism_llm_batch_t b = {.n_seqs = NS, .n_tokens = start[NS], .tokens = toks, .seq_start = start, .pos0 = k_pos0,
                           .block_tables = tables, .all_logits = all_logits, .local_tables = rings,
                           .local_ring = ring};
    if (split) {
        assert_int_equal(prism_llm_forward_begin(m, kv, &b), PRISM_OK);
        assert_int_equal(prism_llm_forward_end(m, logits), PRISM_OK);
    } else {
        assert_int_equal(prism_llm_forward(m, kv, &b, logits), PRISM_OK);
    }
}

static void llm_run(prism_llm_t *m, prism_kv_cache_t *kv, int vocab, bool all_logits, bool split, float *logits)
{
    llm_run_rings(m, kv, vocab, all_logits, split, NULL, 0, logits);
}

static void llm_cancel_mid_forward(const prism_model_config_t *cfg, const char *dir)
{
    prism_backend_t *be = prism_backend_cpu_create(1);
    char err[256];
    prism_llm_t *m = NULL;
    prism_kv_cache_t *kv = NULL;
    assert_int_equal(prism_llm_load(be, cfg, dir, 64, NS, &m, err, sizeof err), PRISM_OK);
    assert_int_equal(prism_kv_cache_create(be, cfg, 8, 16, &kv), PRISM_OK);
    const size_t V = (size_t)cfg->vocab;
    float *ref = prism_malloc(NT * V * sizeof(float)), *out = prism_malloc(NT * V * sizeof(float));
    hook_state_t h = {.cancel_item = -1};
    prism_model_hook_t hook = {on_layer, on_cancelled, &h};

    for (int all = 0; all < 2; all++) {
        size_t rows = all ? NT : NS;
        prism_llm_set_hook(m, NULL);
        llm_run(m, kv, cfg->vocab, all, false, ref);
        llm_run(m, kv, cfg->vocab, all, true, out);     /* begin + end == forward */
        assert_memory_equal(out, ref, rows * V * sizeof(float));

        prism_llm_set_hook(m, &hook);
        h = (hook_state_t){.cancel_item = 1, .cancel_at = 1};
        for (size_t i = 0; i < rows * V; i++) out[i] = NAN;
        llm_run(m, kv, cfg->vocab, all, true, out);
        assert_int_equal(h.calls, cfg->n_layers + 1);
        assert_int_equal(h.asked[1], 1);
        /* rows of sequence 1: [1] of last-token logits, tokens 20..31 of all_logits */
        size_t lo = all ? 20 : 1, hi = all ? 32 : 2;
        for (size_t r = 0; r < rows; r++) {
            if (r >= lo && r < hi) {
                assert_true(isnan(out[r * V]) && isnan(out[r * V + V - 1]));
            } else {
                assert_close(out + r * V, ref + r * V, V, 1e-4f);
            }
        }

        /* the last sequence cancelled, then the first as well: one left */
        h = (hook_state_t){.cancel_item = 2, .cancel_at = 1};
        for (size_t i = 0; i < rows * V; i++) out[i] = NAN;
        llm_run(m, kv, cfg->vocab, all, false, out);
        assert_close(out, ref, (rows - 1) * V, 1e-4f);
        assert_true(isnan(out[(rows - 1) * V]));

        h = (hook_state_t){.cancel_item = -2, .cancel_at = 0};
        for (size_t i = 0; i < rows * V; i++) out[i] = NAN;
        llm_run(m, kv, cfg->vocab, all, true, out);
        assert_int_equal(h.calls, 1);             /* nothing left after the embeddings */
        for (size_t i = 0; i < rows * V; i++) assert_true(isnan(out[i]));
    }
    /* end without begin is refused */
    assert_int_equal(prism_llm_forward_end(m, out), PRISM_EINVAL);
    prism_free(ref);
    prism_free(out);
    prism_kv_cache_free(kv);
    prism_llm_free(m);
    prism_backend_destroy(be);
}

static void test_llm_cancel_mid_forward(void **state)
{
    (void)state;
    prism_model_config_t cfg = tiny();
    llm_cancel_mid_forward(&cfg, "/nonexistent");
}

/* Llama-4 text layers: MoE routing per token, attention temperature per position, chunked
 * attention — the per-token state a smaller batch must carry over correctly. */
static void test_llama4_cancel_mid_forward(void **state)
{
    (void)state;
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/model/llama4_text", PRISM_SOURCE_DIR);
    prism_model_config_t cfg;
    assert_int_equal(prism_model_config_load(dir, &cfg, err, sizeof err), PRISM_OK);
    llm_cancel_mid_forward(&cfg, dir);
}

/* A split cache (the decode worker's: Llama-4's chunked layers in per-sequence rings): the ring
 * slots and tables of the sequences left are carried over when one drops out, so they compute what
 * they compute without the hook. */
static void test_llama4_split_cache_cancel(void **state)
{
    (void)state;
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/model/llama4_text", PRISM_SOURCE_DIR);
    prism_model_config_t cfg;
    assert_int_equal(prism_model_config_load(dir, &cfg, err, sizeof err), PRISM_OK);
    prism_backend_t *be = prism_backend_cpu_create(1);
    prism_llm_t *m = NULL;
    prism_kv_cache_t *kv = NULL;
    assert_int_equal(prism_llm_load(be, &cfg, dir, 64, NS, &m, err, sizeof err), PRISM_OK);
    const int R = prism_kv_local_ring(&cfg, 16, 20);
    assert_true(R > 0 && R <= 8);
    assert_int_equal(prism_kv_cache_create_split(be, &cfg, 8, NS * R, 16, &kv), PRISM_OK);
    int32_t ring[NS][8];
    const int32_t *rings[NS];
    for (int s = 0; s < NS; s++) {
        for (int i = 0; i < R; i++) ring[s][i] = NS * R - 1 - (s * R + i);   /* backwards: ids != positions */
        rings[s] = ring[s];
    }
    const size_t V = (size_t)cfg.vocab;
    float *ref = prism_malloc(NT * V * sizeof(float)), *out = prism_malloc(NT * V * sizeof(float));
    hook_state_t h;
    prism_model_hook_t hook = {on_layer, on_cancelled, &h};
    for (int all = 0; all < 2; all++) {
        size_t rows = all ? NT : NS;
        prism_llm_set_hook(m, NULL);
        llm_run_rings(m, kv, cfg.vocab, all, false, rings, R, ref);
        prism_llm_set_hook(m, &hook);
        for (int item = 0; item < NS; item++) {
            h = (hook_state_t){.cancel_item = item, .cancel_at = 1 + item};
            for (size_t i = 0; i < rows * V; i++) out[i] = NAN;
            llm_run_rings(m, kv, cfg.vocab, all, true, rings, R, out);
            size_t lo = all ? (size_t)(item == 0 ? 0 : item == 1 ? 20 : 32) : (size_t)item;
            size_t hi = all ? (size_t)(item == 0 ? 20 : item == 1 ? 32 : 33) : (size_t)item + 1;
            for (size_t r = 0; r < rows; r++) {
                if (r >= lo && r < hi) assert_true(isnan(out[r * V]));
                else assert_close(out + r * V, ref + r * V, V, 1e-4f);
            }
        }
    }
    prism_free(ref);
    prism_free(out);
    prism_kv_cache_free(kv);
    prism_llm_free(m);
    prism_backend_destroy(be);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vision_cancel_mid_batch),
        cmocka_unit_test(test_llama4_vision_cancel_mid_batch),
        cmocka_unit_test(test_llm_cancel_mid_forward),
        cmocka_unit_test(test_llama4_cancel_mid_forward),
        cmocka_unit_test(test_llama4_split_cache_cancel),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
