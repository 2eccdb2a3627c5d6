/* config.json parsing: the bundled model, HF defaults, rope variants, and corrupt configs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

static void test_bundled(void **state)
{
    (void)state;
    const char *src = getenv("PRISM_SOURCE_DIR");
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/models/prism-tiny-llava", src && *src ? src : PRISM_SOURCE_DIR);
    prism_model_config_t c;
    assert_int_equal(prism_model_config_load(dir, &c, err, sizeof err), PRISM_OK);
    assert_string_equal(c.arch, "llava");
    assert_true(c.has_vision);
    assert_int_equal(c.hidden, 256);
    assert_int_equal(c.n_layers, 4);
    assert_int_equal(c.n_heads, 8);
    assert_int_equal(c.n_kv_heads, 4);
    assert_int_equal(c.head_dim, 32);
    assert_int_equal(c.intermediate, 688);
    assert_int_equal(c.vocab, 4096);
    assert_int_equal(c.max_pos, 2048);
    assert_true(c.rms_eps == 1e-5f);
    assert_true(c.rope_theta == 10000.0f);
    assert_int_equal(c.rope_scaling_type, 0);
    assert_false(c.tie_word_embeddings);
    assert_false(c.attention_bias);
    assert_int_equal(c.bos_token_id, 0);
    assert_int_equal(c.n_eos, 1);
    assert_int_equal(c.eos_token_ids[0], 1);
    assert_int_equal(c.v_image_size, 112);
    assert_int_equal(c.v_patch, 14);
    assert_int_equal(c.v_hidden, 128);
    assert_int_equal(c.v_layers, 4);
    assert_int_equal(c.v_heads, 4);
    assert_int_equal(c.v_intermediate, 512);
    assert_int_equal(c.v_act, PRISM_ACT_QUICK_GELU);
    assert_int_equal(c.v_feature_layer, -2);
    assert_true(c.v_select_default);
    assert_int_equal(c.proj_act, PRISM_ACT_GELU_ERF);
    assert_int_equal(c.image_token_index, 3);
    assert_int_equal(c.image_seq_length, 64);
}

static int parse(const char *cfg, const char *gen, prism_model_config_t *c)
{
    char err[256] = "";
    int rc = prism_model_config_parse(cfg, gen, c, err, sizeof err);
    if (rc != PRISM_OK) assert_true(err[0] != '\0');
    return rc;
}

static void test_defaults_and_variants(void **state)
{
    (void)state;
    prism_model_config_t c;
    /* Llama defaults (LlamaConfig) */
    assert_int_equal(parse("{\"model_type\":\"llama\"}", NULL, &c), PRISM_OK);
    assert_int_equal(c.hidden, 4096);
    assert_int_equal(c.n_kv_heads, 32);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.vocab, 32000);
    assert_true(c.rms_eps == 1e-6f);
    assert_int_equal(c.bos_token_id, 1);
    assert_int_equal(c.eos_token_ids[0], 2);
    assert_false(c.has_vision);
    /* Qwen2: biases on by definition, eos list, generation_config overrides */
    assert_int_equal(parse("{\"model_type\":\"qwen2\",\"hidden_size\":64,\"num_attention_heads\":4,"
                           "\"num_key_value_heads\":2,\"vocab_size\":1000,\"eos_token_id\":[5,7],"
                           "\"rope_theta\":1000000.0}",
                           "{\"eos_token_id\":[9,10,11],\"bos_token_id\":3}", &c), PRISM_OK);
    assert_true(c.attention_bias);
    assert_false(c.o_bias);
    assert_int_equal(c.head_dim, 16);
    assert_int_equal(c.n_eos, 3);
    assert_int_equal(c.eos_token_ids[2], 11);
    assert_int_equal(c.bos_token_id, 3);
    assert_true(c.rope_theta == 1e6f);
    /* Old-style rope_scaling (llama 3.1 checkpoints) */
    assert_int_equal(parse("{\"model_type\":\"llama\",\"rope_theta\":500000.0,\"eos_token_id\":[128001,128008,128009],"
                           "\"vocab_size\":128256,\"rope_scaling\":{\"factor\":8.0,\"low_freq_factor\":1.0,"
                           "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192,\"rope_type\":\"llama3\"}}",
                           NULL, &c), PRISM_OK);
    assert_int_equal(c.rope_scaling_type, 1);
    assert_true(c.rope_theta == 500000.0f);
    assert_int_equal(c.rope_orig_max_pos, 8192);
    float inv[64];
    prism_model_rope_inv_freq(&c, inv);
    /* highest frequencies untouched, lowest divided by factor, middle smoothed */
    assert_true(fabsf(inv[0] - 1.0f) < 1e-7f);
    double base_last = pow(500000.0, -126.0 / 128.0);
    assert_true(fabs(inv[63] - base_last / 8.0) < 1e-9);
    for (int i = 1; i < 64; i++) assert_true(inv[i] < inv[i - 1]);
    /* New-style rope_parameters; LLaVA without vision_config gets LLaVA's CLIP-L/336 defaults */
    assert_int_equal(parse("{\"model_type\":\"llava\",\"text_config\":{\"model_type\":\"llama\",\"vocab_size\":32064,"
                           "\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":10000.0}}}", NULL, &c), PRISM_OK);
    assert_int_equal(c.v_hidden, 1024);
    assert_int_equal(c.v_image_size, 336);
    assert_int_equal(c.image_seq_length, 576);
    assert_int_equal(c.image_token_index, 32000);
    assert_true(c.proj_bias);
    /* "full" strategy keeps CLS */
    assert_int_equal(parse("{\"model_type\":\"llava\",\"image_seq_length\":577,\"vision_feature_select_strategy\":\"full\","
                           "\"text_config\":{\"vocab_size\":32064}}", NULL, &c), PRISM_OK);
    assert_false(c.v_select_default);
    assert_int_equal(c.image_seq_length, 577);
}

static void test_corrupt(void **state)
{
    (void)state;
    static const struct { const char *cfg; const char *gen; int rc; } cases[] = {
        {"", NULL, PRISM_ECORRUPT},
        {"[]", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"gpt2\"}", NULL, PRISM_ENOTSUP},
        {"{\"model_type\":\"llama\",\"hidden_size\":\"4096\"}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"hidden_size\":-1}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"hidden_size\":99999999999}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"num_attention_heads\":32,\"num_key_value_heads\":5}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"hidden_size\":100,\"num_attention_heads\":3}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"head_dim\":7}", NULL, PRISM_ENOTSUP},
        {"{\"model_type\":\"llama\",\"rms_norm_eps\":\"x\"}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"tie_word_embeddings\":1}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"eos_token_id\":[1,2,3,4,5,6,7,8,9]}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"eos_token_id\":40000}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4}}", NULL, PRISM_ENOTSUP},
        {"{\"model_type\":\"llama\",\"rope_scaling\":{\"rope_type\":\"llama3\",\"low_freq_factor\":4,\"high_freq_factor\":1}}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"rope_scaling\":7}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"hidden_act\":\"gelu\"}", NULL, PRISM_ENOTSUP},
        {"{\"model_type\":\"qwen2\",\"use_sliding_window\":true}", NULL, PRISM_ENOTSUP},
        {"{\"model_type\":\"llava\",\"text_config\":{},\"image_seq_length\":100}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llava\",\"text_config\":{},\"vision_feature_layer\":[-2,-5]}", NULL, PRISM_ENOTSUP},
        {"{\"model_type\":\"llava\",\"text_config\":{},\"vision_feature_layer\":-40}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llava\",\"text_config\":{},\"vision_config\":{\"image_size\":100,\"patch_size\":14}}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llava\",\"text_config\":{},\"vision_config\":{\"model_type\":\"siglip_vision_model\"}}", NULL, PRISM_ENOTSUP},
        {"{\"model_type\":\"llava\",\"text_config\":{},\"image_token_index\":40000}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llava\",\"text_config\":{},\"vision_feature_select_strategy\":\"mean\"}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llava\",\"text_config\":5}", NULL, PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\"}", "{\"eos_token_id\":\"x\"}", PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\"}", "not json", PRISM_ECORRUPT},
        {"{\"model_type\":\"llama\",\"a\":1,\"a\":2}", NULL, PRISM_ECORRUPT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        prism_model_config_t c;
        int rc = parse(cases[i].cfg, cases[i].gen, &c);
        if (rc != cases[i].rc) fprintf(stderr, "case %zu: rc %d want %d\n", i, rc, cases[i].rc);
        assert_int_equal(rc, cases[i].rc);
    }
    /* deep nesting is bounded by the JSON parser, never a stack overflow */
    size_t depth = 100000;
    char *deep = malloc(2 * depth + 64);
    strcpy(deep, "{\"model_type\":\"llama\",\"x\":");
    size_t o = strlen(deep);
    for (size_t i = 0; i < depth; i++) deep[o++] = '[';
    for (size_t i = 0; i < depth; i++) deep[o++] = ']';
    deep[o++] = '}';
    deep[o] = 0;
    prism_model_config_t c;
    assert_int_equal(parse(deep, NULL, &c), PRISM_ECORRUPT);
    free(deep);
    char err[128];
    assert_int_equal(prism_model_config_load("/nonexistent/prism", &c, err, sizeof err), PRISM_ENOTFOUND);
}

/* Mutation fuzzing of real config.json files (the bundled LLaVA, the llava_like and qwen2_text
 * goldens): byte overwrites with JSON-significant characters, digits and junk, truncation. Every
 * parse either fails with a message or yields a config the loaders can trust: shapes positive,
 * heads dividing the hidden size, GQA groups whole, special ids inside the vocabulary, vision
 * geometry consistent with image_seq_length. No leak either way. */
static void check_invariants(const prism_model_config_t *c, int it)
{
    bool ok = c->hidden > 0 && c->n_layers > 0 && c->n_heads > 0 && c->n_kv_heads > 0 && c->head_dim > 0 &&
              c->intermediate > 0 && c->vocab > 0 && c->max_pos > 0 && c->n_heads % c->n_kv_heads == 0 &&
              c->n_eos >= 0 && c->n_eos <= PRISM_MODEL_MAX_EOS && c->bos_token_id < c->vocab &&
              isfinite(c->rms_eps) && c->rms_eps > 0 && isfinite(c->rope_theta) && c->rope_theta > 0;
    for (int i = 0; ok && i < c->n_eos; i++) ok = c->eos_token_ids[i] >= 0 && c->eos_token_ids[i] < c->vocab;
    if (ok && c->has_vision) {
        int side = c->v_patch > 0 ? c->v_image_size / c->v_patch : 0;
        ok = c->v_patch > 0 && c->v_image_size % c->v_patch == 0 && c->v_hidden > 0 && c->v_heads > 0 &&
             c->v_hidden % c->v_heads == 0 && c->v_layers > 0 && c->image_token_index >= 0 &&
             c->image_token_index < c->vocab && c->image_seq_length == side * side + (c->v_select_default ? 0 : 1);
    }
    if (!ok) fail_msg("mutation %d parsed into an inconsistent config (hidden %d heads %d/%d vocab %d, vision %d)",
                      it, c->hidden, c->n_heads, c->n_kv_heads, c->vocab, c->has_vision);
}

static void test_mutations(void **state)
{
    (void)state;
    const char *src = getenv("PRISM_SOURCE_DIR");
    const char *files[] = {"models/prism-tiny-llava/config.json", "tests/data/model/llava_like/config.json",
                           "tests/data/model/qwen2_text/config.json"};
    static const char junk[] = "{}[]\",:0123456789-eE.\\ntfa\x80\xff ";
    uint64_t seed = 0xC0F1C0F1ull;
    size_t mem0 = prism_mem_used();
    int loaded = 0, total = 0;
    for (size_t f = 0; f < PRISM_ARRAY_LEN(files); f++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", src && *src ? src : PRISM_SOURCE_DIR, files[f]);
        char *text = NULL;
        size_t len = 0;
        assert_int_equal(prism_read_file(path, 1 << 20, &text, &len), PRISM_OK);
        prism_model_config_t c;
        assert_int_equal(parse(text, NULL, &c), PRISM_OK);  /* the unmutated file is valid */
        check_invariants(&c, -1);
        char *m = malloc(len + 1);
        for (int it = 0; it < 400; it++, total++) {
            memcpy(m, text, len + 1);
            int flips = 1 + it % 4;
            for (int k = 0; k < flips; k++) {
                seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17;
                m[seed % len] = junk[(seed >> 32) % (sizeof junk - 1)];
            }
            if (it % 10 == 9) m[seed % len] = 0;  /* truncated */
            int rc = parse(m, NULL, &c);          /* parse() asserts a message on failure */
            assert_true(rc == PRISM_OK || rc == PRISM_ECORRUPT || rc == PRISM_ENOTSUP || rc == PRISM_ELIMIT);
            if (rc == PRISM_OK) {
                check_invariants(&c, it);
                loaded++;
            }
        }
        free(m);
        prism_free(text);
    }
    assert_int_equal(prism_mem_used(), mem0);
    fprintf(stderr, "config mutations: %d of %d still parsed (all consistent)\n", loaded, total);
}

int main(void)
{
    prism_log_init("test_model_config", PRISM_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bundled),
        cmocka_unit_test(test_defaults_and_variants),
        cmocka_unit_test(test_corrupt),
        cmocka_unit_test(test_mutations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
