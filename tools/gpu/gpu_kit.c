/* Config builders and a batch driver around the product's model: see gpu_kit.h. */
#include "gpu_kit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

prism_model_config_t kit_text_config(int hidden, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                                     int intermediate, int vocab, float rms_eps, float rope_theta)
{
    prism_model_config_t c;
    memset(&c, 0, sizeof c);
    c.hidden = hidden;
    c.n_layers = n_layers;
    c.n_heads = n_heads;
    c.n_kv_heads = n_kv_heads;
    c.head_dim = head_dim;
    c.intermediate = intermediate;
    c.vocab = vocab;
    c.max_pos = 8192;
    c.rms_eps = rms_eps;
    c.rope_theta = rope_theta;
    c.act = PRISM_ACT_SILU;
    c.bos_token_id = 1;
    c.pad_token_id = -1;
    c.v_num_channels = 3;
    snprintf(c.arch, sizeof c.arch, "random-llama");
    c.random_weights = true;
    return c;
}

prism_model_config_t kit_vision_config(const prism_model_config_t *text, int image_size, int patch, int v_hidden,
                                       int v_layers, int v_heads, int v_intermediate)
{
    prism_model_config_t c = *text;
    c.has_vision = true;
    c.v_image_size = image_size;
    c.v_patch = patch;
    c.v_hidden = v_hidden;
    c.v_layers = v_layers;
    c.v_heads = v_heads;
    c.v_intermediate = v_intermediate;
    c.v_eps = 1e-5f;
    c.v_act = PRISM_ACT_QUICK_GELU;
    c.v_feature_layer = -2;
    c.v_select_default = true;
    c.proj_act = PRISM_ACT_GELU_ERF;
    c.proj_bias = true;
    c.image_seq_length = (image_size / patch) * (image_size / patch);
    snprintf(c.arch, sizeof c.arch, "random-llava");
    return c;
}

int kit_llm_create(prism_backend_t *be, const prism_model_config_t *cfg, uint64_t seed, int max_tokens,
                   int max_seqs, int bps, int block_size, kit_llm_t **out)
{
    char err[256] = "";
    kit_llm_t *m = calloc(1, sizeof *m);
    if (!m) return PRISM_ENOMEM;
    m->cfg = *cfg;
    m->cfg.random_weights = true;
    m->cfg.random_seed = seed;
    m->max_seqs = max_seqs;
    m->bps = bps;
    m->block_size = block_size;
    int rc = prism_llm_load(be, &m->cfg, NULL, max_tokens, max_seqs, &m->llm, err, sizeof err);
    if (rc == PRISM_OK) rc = prism_kv_cache_create(be, &m->cfg, max_seqs * bps, block_size, &m->kv);
    m->tables = malloc(sizeof(int32_t) * (size_t)max_seqs * bps);
    m->rows = malloc(sizeof(*m->rows) * (size_t)max_seqs);
    m->seq_start = malloc(sizeof(int32_t) * (size_t)(max_seqs + 1));
    if (rc == PRISM_OK && (!m->tables || !m->rows || !m->seq_start)) rc = PRISM_ENOMEM;
    if (rc != PRISM_OK) {
        if (err[0]) fprintf(stderr, "kit_llm_create: %s\n", err);
        kit_llm_free(m);
        return rc;
    }
    for (int s = 0; s < max_seqs; s++) {
        for (int b = 0; b < bps; b++) m->tables[(size_t)s * bps + b] = s * bps + b;
        m->rows[s] = m->tables + (size_t)s * bps;
    }
    *out = m;
    return PRISM_OK;
}

void kit_llm_free(kit_llm_t *m)
{
    if (!m) return;
    prism_kv_cache_free(m->kv);
    prism_llm_free(m->llm);
    free(m->tables);
    free(m->rows);
    free(m->seq_start);
    free(m);
}

int kit_llm_forward(kit_llm_t *m, int S, const int32_t *tokens, const int32_t *q_len, const int32_t *pos0,
                    float *logits_host)
{
    if (S > m->max_seqs) return PRISM_ELIMIT;
    m->seq_start[0] = 0;
    for (int s = 0; s < S; s++) m->seq_start[s + 1] = m->seq_start[s] + q_len[s];
    prism_llm_batch_t b = {.n_seqs = S, .n_tokens = m->seq_start[S], .tokens = tokens, .seq_start = m->seq_start,
                           .pos0 = pos0, .block_tables = m->rows};
    return prism_llm_forward(m->llm, m->kv, &b, logits_host);
}

size_t kit_kv_bytes_per_token(const kit_llm_t *m)
{
    return prism_kv_cache_block_bytes(&m->cfg, m->block_size) / (size_t)m->block_size;
}
