/* Llama-4 config.json parsing: the released Scout config (transformers 4.51 spelling: rope_scaling +
 * top-level rope_theta, equal llama3 frequency factors, attn_temperature_tuning written as 4, explicit
 * moe_layers / no_rope_layers, vision rope_theta at top level) gives the per-layer table and the
 * numbers in the design notes; the transformers 5 spelling (rope_parameters, layer_types) of the
 * tiny fixture parses too; defaults follow Llama4TextConfig.__post_init__; configs transformers
 * itself could not build are refused with a message; random weights instantiate the shapes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

static char *scout_config(const char *text_extra, const char *vision_extra)
{
    static char buf[16384];
    char moe[512] = "", nope[512] = "";
    for (int i = 0; i < 48; i++) {
        snprintf(moe + strlen(moe), sizeof moe - strlen(moe), "%s%d", i ? "," : "", i);
        snprintf(nope + strlen(nope), sizeof nope - strlen(nope), "%s%d", i ? "," : "", (i + 1) % 4 != 0);
    }
    snprintf(buf, sizeof buf,
             "{\"architectures\":[\"Llama4ForConditionalGeneration\"],\"boi_token_index\":200080,"
             "\"eoi_token_index\":200081,\"image_token_index\":200092,\"model_type\":\"llama4\","
             "\"text_config\":{\"attention_bias\":false,\"attention_chunk_size\":8192,\"attn_scale\":0.1,"
             "\"attn_temperature_tuning\":4,\"bos_token_id\":200000,\"eos_token_id\":[200001,200007,200008],"
             "\"floor_scale\":8192,\"head_dim\":128,\"hidden_act\":\"silu\",\"hidden_size\":5120,"
             "\"interleave_moe_layer_step\":1,\"intermediate_size\":8192,\"intermediate_size_mlp\":16384,"
             "\"max_position_embeddings\":10485760,\"model_type\":\"llama4_text\",\"moe_layers\":[%s],"
             "\"no_rope_layers\":[%s],\"num_attention_heads\":40,\"num_experts_per_tok\":1,"
             "\"num_hidden_layers\":48,\"num_key_value_heads\":8,\"num_local_experts\":16,\"pad_token_id\":200018,"
             "\"rms_norm_eps\":1e-05,\"rope_scaling\":{\"factor\":16.0,\"high_freq_factor\":1.0,"
             "\"low_freq_factor\":1.0,\"original_max_position_embeddings\":8192,\"rope_type\":\"llama3\"},"
             "\"rope_theta\":500000.0,\"use_qk_norm\":true,\"vocab_size\":202048%s},"
             "\"tie_word_embeddings\":false,"
             "\"vision_config\":{\"hidden_act\":\"gelu\",\"hidden_size\":1408,\"image_size\":336,"
             "\"intermediate_size\":5632,\"model_type\":\"llama4_vision_model\",\"multi_modal_projector_bias\":false,"
             "\"norm_eps\":1e-05,\"num_attention_heads\":16,\"num_channels\":3,\"num_hidden_layers\":34,"
             "\"patch_size\":14,\"pixel_shuffle_ratio\":0.5,\"projector_input_dim\":4096,\"projector_output_dim\":4096,"
             "\"rope_theta\":10000,\"vision_feature_layer\":-1,\"vision_feature_select_strategy\":\"default\","
             "\"vision_output_dim\":4096%s}}",
             moe, nope, text_extra, vision_extra);
    return buf;
}

static void test_scout(void **state)
{
    prism_model_config_t c;
    char err[256];
    int rc = prism_model_config_parse(scout_config("", ""), NULL, &c, err, sizeof err);
    if (rc) fail_msg("%s", err);
    assert_string_equal(c.arch, "llama4");
    assert_int_equal(c.n_layers, 48);
    assert_int_equal(c.hidden, 5120);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.n_kv_heads, 8);
    assert_int_equal(c.intermediate, 8192);
    assert_int_equal(c.dense_intermediate, 16384);
    assert_int_equal(c.n_experts, 16);
    assert_int_equal(c.top_k, 1);
    assert_int_equal(c.attention_chunk, 8192);
    assert_int_equal(c.rope_mode, PRISM_ROPE_INTERLEAVE);
    assert_int_equal(c.rope_scaling_type, 1);
    assert_true(c.rope_factor == 16.0f && c.rope_low_freq_factor == c.rope_high_freq_factor);
    assert_true(c.floor_scale == 8192.0f && fabsf(c.attn_scale - 0.1f) < 1e-7f);
    assert_int_equal(c.n_eos, 3);
    assert_int_equal(c.image_token_index, 200092);
    assert_int_equal(c.boi_token_id, 200080);
    assert_int_equal(c.eoi_token_id, 200081);
    for (int i = 0; i < 48; i++) {
        int want = (i + 1) % 4 ? PRISM_LAYER_ROPE | PRISM_LAYER_QK_NORM | PRISM_LAYER_CHUNKED | PRISM_LAYER_MOE
                               : PRISM_LAYER_TEMP | PRISM_LAYER_MOE;   /* every 4th layer: NoPE, full attention */
        assert_int_equal(c.layer_flags[i], want);
    }
    /* vision: 336 px tiles of 24x24 patches, 144 tokens per tile after the 0.5 pixel shuffle */
    assert_true(c.has_vision);
    assert_int_equal(c.vision_arch, PRISM_VISION_LLAMA4);
    assert_int_equal(c.v_image_size, 336);
    assert_int_equal(c.image_seq_length, 144);
    assert_int_equal(c.v_shuffle, 2);
    assert_int_equal(c.v_adapter_dim, 4096);
    assert_int_equal(c.v_output_dim, 4096);
    assert_true(c.v_rope_theta == 10000.0f);
    assert_int_equal(c.v_act, PRISM_ACT_GELU_ERF);
    /* llama3 scaling with equal factors: no NaN, low frequencies divided by 16 */
    float inv[64];
    prism_model_rope_inv_freq(&c, inv);
    for (int i = 0; i < 64; i++) assert_true(isfinite(inv[i]) && inv[i] > 0);
    assert_true(fabsf(inv[63] - 1.0f / powf(500000.0f, 126.0f / 128.0f) / 16.0f) < 1e-12f);
    assert_true(inv[0] == 1.0f);
}

static void test_text_defaults_and_transformers5(void **state)
{
    prism_model_config_t c;
    char err[256];
    /* llama4_text with nothing set: Llama4TextConfig defaults (NoPE every 4th layer, MoE everywhere). */
    assert_int_equal(prism_model_config_parse("{\"model_type\":\"llama4_text\"}", NULL, &c, err, sizeof err), PRISM_OK);
    assert_int_equal(c.n_layers, 48);
    assert_int_equal(c.vocab, 202048);
    assert_false(c.has_vision);
    assert_int_equal(c.layer_flags[2], PRISM_LAYER_ROPE | PRISM_LAYER_QK_NORM | PRISM_LAYER_CHUNKED | PRISM_LAYER_MOE);
    assert_int_equal(c.layer_flags[3], PRISM_LAYER_TEMP | PRISM_LAYER_MOE);
    /* interleave_moe_layer_step 2 (Maverick): MoE in odd layers; null chunk: no chunked layers;
     * explicit layer_types win over the derivation; no QK norm, no temperature tuning. */
    const char *cfg = "{\"model_type\":\"llama4_text\",\"num_hidden_layers\":4,\"interleave_moe_layer_step\":2,"
                      "\"attention_chunk_size\":null,\"use_qk_norm\":false,\"attn_temperature_tuning\":false,"
                      "\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":1000.0}}";
    int rc = prism_model_config_parse(cfg, NULL, &c, err, sizeof err);
    if (rc) fail_msg("%s", err);
    static const int want[4] = {PRISM_LAYER_ROPE, PRISM_LAYER_ROPE | PRISM_LAYER_MOE, PRISM_LAYER_ROPE, PRISM_LAYER_MOE};
    for (int i = 0; i < 4; i++) assert_int_equal(c.layer_flags[i], want[i]);
    assert_true(c.rope_theta == 1000.0f);
    cfg = "{\"model_type\":\"llama4_text\",\"num_hidden_layers\":3,\"attention_chunk_size\":16,\"no_rope_layers\":[1,1,1],"
          "\"layer_types\":[\"full_attention\",\"chunked_attention\",\"full_attention\"],\"moe_layers\":[]}";
    assert_int_equal(prism_model_config_parse(cfg, NULL, &c, err, sizeof err), PRISM_OK);
    assert_int_equal(c.layer_flags[0], PRISM_LAYER_ROPE | PRISM_LAYER_QK_NORM);
    assert_int_equal(c.layer_flags[1], PRISM_LAYER_ROPE | PRISM_LAYER_QK_NORM | PRISM_LAYER_CHUNKED);
    /* the Llama path keeps its table: RoPE everywhere, NeoX pairing, dense MLPs */
    assert_int_equal(prism_model_config_parse("{\"model_type\":\"llama\",\"num_hidden_layers\":2}", NULL, &c, err, sizeof err),
                     PRISM_OK);
    assert_int_equal(c.layer_flags[0], PRISM_LAYER_ROPE);
    assert_int_equal(c.rope_mode, PRISM_ROPE_NEOX);
    assert_int_equal(c.dense_intermediate, c.intermediate);
}

/* Replaces the first `from` in the Scout config by `to` (into a static buffer). */
static const char *scout_with(const char *from, const char *to)
{
    static char out[16384];
    const char *base = scout_config("", "");
    const char *at = strstr(base, from);
    assert_non_null(at);
    snprintf(out, sizeof out, "%.*s%s%s", (int)(at - base), base, to, at + strlen(from));
    return out;
}

static void test_refused(void **state)
{
    static const struct {
        const char *from, *to;
        const char *needle;
    } bad[] = {
        {"\"num_experts_per_tok\":1", "\"num_experts_per_tok\":17", "num_experts_per_tok"},
        {"\"no_rope_layers\":[", "\"no_rope_layers\":[1,0],\"x\":[", "no_rope_layers"},
        {"\"no_rope_layers\":[1", "\"no_rope_layers\":[2", "no_rope_layers"},
        {"\"use_qk_norm\"", "\"layer_types\":[\"full_attention\"],\"use_qk_norm\"", "layer_types"},
        {"\"hidden_act\":\"silu\"", "\"hidden_act\":\"gelu\"", "hidden_act"},
        {"\"intermediate_size\":5632", "\"intermediate_size\":5000", "chain"},
        {"\"vision_output_dim\":4096", "\"vision_output_dim\":7680", "chain"},
        {"\"pixel_shuffle_ratio\":0.5", "\"pixel_shuffle_ratio\":0.3", "pixel_shuffle_ratio"},
        {"\"num_attention_heads\":16", "\"num_attention_heads\":64", "vision head dim"},
        {"\"model_type\":\"llama4_vision_model\"", "\"model_type\":\"clip_vision_model\"", "llama4_vision_model"},
        {"\"moe_layers\":[0,", "\"moe_layers\":[48,", "moe_layers"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        prism_model_config_t c;
        char err[256] = "";
        int rc = prism_model_config_parse(scout_with(bad[i].from, bad[i].to), NULL, &c, err, sizeof err);
        if (rc == PRISM_OK) fail_msg("case %zu accepted", i);
        if (!strstr(err, bad[i].needle)) fail_msg("case %zu: message '%s' lacks '%s'", i, err, bad[i].needle);
    }
    prism_model_config_t c;
    char err[256];
    const char *moe_oob = "{\"model_type\":\"llama4_text\",\"num_hidden_layers\":2,\"moe_layers\":[2]}";
    assert_int_not_equal(prism_model_config_parse(moe_oob, NULL, &c, err, sizeof err), PRISM_OK);
    const char *chunk_null = "{\"model_type\":\"llama4_text\",\"num_hidden_layers\":1,\"attention_chunk_size\":null,"
                             "\"layer_types\":[\"chunked_attention\"]}";
    assert_int_not_equal(prism_model_config_parse(chunk_null, NULL, &c, err, sizeof err), PRISM_OK);
}

/* --random-weights instantiates a Llama-4 shape (benchmarks of architectures that cannot be
 * downloaded here); the forward and the encoder run and stay finite. */
static void test_random_weights(void **state)
{
    const char *src = getenv("PRISM_SOURCE_DIR");
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/model/llama4_tiny", src && *src ? src : PRISM_SOURCE_DIR);
    prism_model_config_t c;
    assert_int_equal(prism_model_config_load(dir, &c, err, sizeof err), PRISM_OK);
    c.random_weights = true;
    c.random_seed = 7;
    prism_backend_t *be = prism_backend_cpu_create(1);
    prism_llm_t *llm = NULL;
    prism_vision_t *vis = NULL;
    int rc = prism_llm_load(be, &c, "/nonexistent", 64, 2, &llm, err, sizeof err);
    if (rc) fail_msg("%s", err);
    rc = prism_vision_load(be, &c, "/nonexistent", 2, &vis, err, sizeof err);
    if (rc) fail_msg("%s", err);
    float *px = calloc((size_t)2 * 3 * c.v_image_size * c.v_image_size, sizeof(float));
    float *f = malloc((size_t)2 * c.image_seq_length * c.hidden * sizeof(float));
    assert_int_equal(prism_vision_encode(vis, px, 2, f), PRISM_OK);
    for (int i = 0; i < 2 * c.image_seq_length * c.hidden; i++) assert_true(isfinite(f[i]));
    prism_kv_cache_t *kv;
    assert_int_equal(prism_kv_cache_create(be, &c, 8, 16, &kv), PRISM_OK);
    int32_t toks[40], table[4] = {0, 1, 2, 3}, start[2] = {0, 40}, pos0[1] = {0};
    for (int i = 0; i < 40; i++) toks[i] = (i * 37) % c.vocab;
    const int32_t *tables[1] = {table};
    prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = 40, .tokens = toks, .seq_start = start, .pos0 = pos0,
                           .block_tables = tables};
    float *lg = malloc((size_t)c.vocab * sizeof(float));
    assert_int_equal(prism_llm_forward(llm, kv, &b, lg), PRISM_OK);
    for (int i = 0; i < c.vocab; i++) assert_true(isfinite(lg[i]));
    free(lg); free(px); free(f);
    prism_kv_cache_free(kv);
    prism_vision_free(vis);
    prism_llm_free(llm);
    prism_backend_destroy(be);
}

/* A backend without the Llama-4 ops refuses the model at load, not mid-forward. */
static void test_missing_ops(void **state)
{
    prism_model_config_t c;
    char err[256];
    assert_int_equal(prism_model_config_parse(scout_config("", ""), NULL, &c, err, sizeof err), PRISM_OK);
    c.random_weights = true;
    prism_backend_t *be = prism_backend_cpu_create(1);
    be->i.moe_route = NULL;
    prism_llm_t *llm = NULL;
    assert_int_equal(prism_llm_load(be, &c, "/nonexistent", 16, 1, &llm, err, sizeof err), PRISM_ENOTSUP);
    assert_null(llm);
    assert_non_null(strstr(err, "ops"));
    be->i.pixel_shuffle = NULL;
    prism_vision_t *vis = NULL;
    assert_int_equal(prism_vision_load(be, &c, "/nonexistent", 1, &vis, err, sizeof err), PRISM_ENOTSUP);
    assert_null(vis);
    prism_backend_destroy(be);
}

/* Mutated configs (byte flips, digit swaps, truncations) are parsed or refused, never crash (this
 * test runs under ASan/UBSan in the sanitizer build); whatever parses satisfies the invariants the
 * model code relies on. */
static void test_mutations(void **state)
{
    char *base = strdup(scout_config("", ""));
    size_t n = strlen(base);
    char *buf = malloc(n + 1);
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    int parsed = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(buf, base, n + 1);
        int edits = 1 + it % 4;
        for (int e = 0; e < edits; e++) {
            rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
            size_t at = (size_t)(rng % n);
            static const char repl[] = "0123456789-.,:[]{}\"e ";
            switch ((rng >> 32) % 3) {
            case 0: buf[at] = repl[(rng >> 40) % (sizeof repl - 1)]; break;
            case 1: if (buf[at] >= '0' && buf[at] <= '9') buf[at] = (char)('0' + (rng >> 44) % 10); break;
            default: if (it % 50 == 0) buf[at] = 0; break;
            }
        }
        prism_model_config_t c;
        char err[256];
        if (prism_model_config_parse(buf, NULL, &c, err, sizeof err) != PRISM_OK) continue;
        parsed++;
        assert_true(c.n_layers >= 1 && c.n_layers <= PRISM_MODEL_MAX_LAYERS);
        assert_true(c.head_dim >= 2 && c.head_dim % 2 == 0 && c.n_heads % c.n_kv_heads == 0);
        for (int i = 0; i < c.n_layers; i++) assert_int_equal(c.layer_flags[i] & ~0x1F, 0);
        if (c.n_experts) assert_true(c.top_k >= 1 && c.top_k <= c.n_experts && c.top_k <= PRISM_MOE_MAX_TOPK);
        if (c.has_vision) {
            int g = c.v_image_size / c.v_patch;
            assert_int_equal(c.image_seq_length, (g / c.v_shuffle) * (g / c.v_shuffle));
            assert_int_equal(c.v_intermediate, c.v_hidden * c.v_shuffle * c.v_shuffle);
            assert_int_equal((c.v_hidden / c.v_heads) % 4, 0);
            assert_true(c.image_token_index < c.vocab);
        }
    }
    assert_true(parsed > 100);   /* the mutations also reach the valid-config paths */
    free(buf);
    free(base);
}

int main(void)
{
    prism_log_init("test_llama4_config", PRISM_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scout),
        cmocka_unit_test(test_text_defaults_and_transformers5),
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_random_weights),
        cmocka_unit_test(test_missing_ops),
        cmocka_unit_test(test_mutations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
