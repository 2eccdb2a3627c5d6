/* --random-weights: any config.json shape instantiates without a checkpoint, deterministically. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/model.h"

static float *run(const prism_model_config_t *cfg, const char *dir)
{
    prism_backend_t *be = prism_backend_cpu_create(1);
    char err[256] = "";
    prism_llm_t *m = NULL;
    assert_int_equal(prism_llm_load(be, cfg, dir, 16, 1, &m, err, sizeof err), PRISM_OK);
    prism_kv_cache_t *kv = NULL;
    assert_int_equal(prism_kv_cache_create(be, cfg, 4, 16, &kv), PRISM_OK);
    int32_t toks[5] = {0, 5, 9, 100, 7}, start[2] = {0, 5}, pos0[1] = {0}, table[4] = {0, 1, 2, 3};
    const int32_t *tables[1] = {table};
    prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = 5, .tokens = toks, .seq_start = start, .pos0 = pos0,
                           .block_tables = tables};
    float *logits = prism_malloc(sizeof(float) * (size_t)cfg->vocab);
    assert_int_equal(prism_llm_forward(m, kv, &b, logits), PRISM_OK);
    prism_kv_cache_free(kv);
    prism_llm_free(m);
    prism_backend_destroy(be);
    return logits;
}

static void test_random_weights_deterministic(void **state)
{
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/models/prism-tiny-llava", PRISM_SOURCE_DIR);
    prism_model_config_t cfg;
    assert_int_equal(prism_model_config_load(dir, &cfg, err, sizeof err), PRISM_OK);
    cfg.random_weights = true;
    cfg.random_seed = 7;
    /* a directory with no safetensors at all: nothing is read */
    float *a = run(&cfg, "/nonexistent");
    float *b = run(&cfg, "/nonexistent");
    assert_memory_equal(a, b, sizeof(float) * (size_t)cfg.vocab);
    double ss = 0;
    for (int i = 0; i < cfg.vocab; i++) {
        assert_true(isfinite(a[i]));
        ss += (double)a[i] * a[i];
    }
    assert_true(ss > 0);
    cfg.random_seed = 8;
    float *c = run(&cfg, "/nonexistent");
    assert_true(memcmp(a, c, sizeof(float) * (size_t)cfg.vocab) != 0);
    prism_vision_t *v = NULL;
    prism_backend_t *be = prism_backend_cpu_create(1);
    assert_int_equal(prism_vision_load(be, &cfg, "/nonexistent", 1, &v, err, sizeof err), PRISM_OK);
    prism_vision_free(v);
    prism_backend_destroy(be);
    prism_free(a);
    prism_free(b);
    prism_free(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_random_weights_deterministic)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
