/* prism_bench_llama4: Llama-4 benchmarks with seeded random weights (any config.json shape).
 *
 *   prism_bench_llama4 --mode vision --model-path tests/bench/llama4/vision_scaled --tiles 17 --batch 4
 *     image tokens/s of the vision tower + adapter + projector, encoding tiles in micro-batches
 *   prism_bench_llama4 --mode moe --model-path tests/bench/llama4/moe_layer --tokens 256 --decode-seqs 16
 *     the config's first layer as a MoE layer (shared expert + top-k routed experts) against the same
 *     layer with a dense SwiGLU of the same active parameters (width (1 + top_k) * intermediate_size);
 *     attention, embeddings and lm_head are identical in both runs
 *
 * Prints one JSON line per measurement (medians over --reps runs after one warm-up). */
#include "core/core.h"
#include "core/cli.h"
#include "backend/backend.h"
#include "model/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void bench_vision(prism_backend_t *be, prism_model_config_t *cfg, int tiles, int batch, int reps)
{
    char err[512];
    prism_vision_t *v = NULL;
    if (prism_vision_load(be, cfg, NULL, batch, &v, err, sizeof err)) PRISM_FATAL("vision: %s", err);
    size_t tile_px = (size_t)3 * cfg->v_image_size * cfg->v_image_size;
    float *px = prism_malloc((size_t)batch * tile_px * sizeof(float));
    float *out = prism_malloc((size_t)batch * cfg->image_seq_length * cfg->hidden * sizeof(float));
    if (!px || !out) PRISM_FATAL("out of memory");
    for (size_t i = 0; i < (size_t)batch * tile_px; i++) px[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    double *t = prism_malloc(sizeof(double) * (size_t)reps);
    for (int r = -1; r < reps; r++) {
        double t0 = prism_now_s();
        for (int k = 0; k < tiles; k += batch) {
            int n = PRISM_MIN(batch, tiles - k);
            if (prism_vision_encode(v, px, n, out)) PRISM_FATAL("encode failed");
        }
        be->i.synchronize(be->ctx);
        if (r >= 0) t[r] = prism_now_s() - t0;
    }
    double s = median(t, reps);
    printf("{\"bench\":\"vision\",\"device\":\"%s\",\"threads\":%d,\"tile\":%d,\"hidden\":%d,\"layers\":%d,\"tiles\":%d,"
           "\"batch\":%d,\"seconds\":%.4f,\"tiles_per_s\":%.2f,\"image_tokens_per_s\":%.1f,\"arena_bytes\":%zu}\n",
           be->device, be->n_threads, cfg->v_image_size, cfg->v_hidden, cfg->v_layers, tiles, batch, s, tiles / s,
           tiles * cfg->image_seq_length / s, prism_vision_arena_bytes(cfg, batch));
    prism_free(t);
    prism_free(px);
    prism_free(out);
    prism_vision_free(v);
}

/* One forward of `n_seqs` sequences with `q` new tokens each at position `pos0`. */
static double time_forward(prism_llm_t *m, prism_kv_cache_t *kv, const prism_model_config_t *cfg, int n_seqs, int q,
                           int pos0, int reps)
{
    int T = n_seqs * q, bs = prism_kv_cache_block_size(kv), nb = (pos0 + q + bs - 1) / bs;
    int32_t *tok = prism_malloc(sizeof(int32_t) * (size_t)T), *start = prism_malloc(sizeof(int32_t) * (size_t)(n_seqs + 1));
    int32_t *p0 = prism_malloc(sizeof(int32_t) * (size_t)n_seqs), *tab = prism_malloc(sizeof(int32_t) * (size_t)n_seqs * nb);
    const int32_t **tables = prism_malloc(sizeof(int32_t *) * (size_t)n_seqs);
    float *logits = prism_malloc(sizeof(float) * (size_t)n_seqs * cfg->vocab);
    double *t = prism_malloc(sizeof(double) * (size_t)reps);
    if (!tok || !start || !p0 || !tab || !tables || !logits || !t) PRISM_FATAL("out of memory");
    for (int i = 0; i < T; i++) tok[i] = (int32_t)((i * 7919) % cfg->vocab);
    for (int s = 0; s <= n_seqs; s++) start[s] = s * q;
    for (int s = 0; s < n_seqs; s++) {
        p0[s] = pos0;
        for (int b = 0; b < nb; b++) tab[s * nb + b] = s * nb + b;
        tables[s] = tab + (size_t)s * nb;
    }
    prism_llm_batch_t b = {.n_seqs = n_seqs, .n_tokens = T, .tokens = tok, .seq_start = start, .pos0 = p0,
                           .block_tables = tables};
    for (int r = -1; r < reps; r++) {
        double t0 = prism_now_s();
        if (prism_llm_forward(m, kv, &b, logits)) PRISM_FATAL("forward failed");
        if (r >= 0) t[r] = prism_now_s() - t0;
    }
    double s = median(t, reps);
    prism_free(tok); prism_free(start); prism_free(p0); prism_free(tab); prism_free(tables); prism_free(logits); prism_free(t);
    return s;
}

static void bench_moe(prism_backend_t *be, prism_model_config_t *cfg, int tokens, int decode_seqs, int ctx, int reps)
{
    if (!(cfg->layer_flags[0] & PRISM_LAYER_MOE)) PRISM_FATAL("layer 0 of this config is not a MoE layer");
    cfg->n_layers = 1;
    prism_model_config_t dense = *cfg;
    dense.layer_flags[0] &= (uint8_t)~PRISM_LAYER_MOE;
    dense.dense_intermediate = (1 + cfg->top_k) * cfg->intermediate;   /* shared + top_k experts, same active params */
    int bs = 16, n_blocks = PRISM_MAX(decode_seqs * ((ctx + 1 + bs - 1) / bs), (tokens + bs - 1) / bs) + 1;
    prism_model_config_t *cfgs[2] = {cfg, &dense};
    const char *names[2] = {"moe", "dense_same_active"};
    for (int k = 0; k < 2; k++) {
        char err[512];
        prism_llm_t *m = NULL;
        prism_kv_cache_t *kv = NULL;
        int max_tok = PRISM_MAX(tokens, decode_seqs);
        if (prism_llm_load(be, cfgs[k], NULL, max_tok, PRISM_MAX(decode_seqs, 1), &m, err, sizeof err))
            PRISM_FATAL("load: %s", err);
        if (prism_kv_cache_create(be, cfgs[k], n_blocks, bs, &kv)) PRISM_FATAL("kv cache");
        double tp = time_forward(m, kv, cfgs[k], 1, tokens, 0, reps);
        double td = time_forward(m, kv, cfgs[k], decode_seqs, 1, ctx, reps);
        size_t H = (size_t)cfg->hidden, I = (size_t)cfg->intermediate;
        size_t active = k == 0 ? (size_t)(1 + cfg->top_k) * 3 * H * I + (size_t)cfg->n_experts * H
                               : 3 * H * (size_t)dense.dense_intermediate;
        printf("{\"bench\":\"%s\",\"device\":\"%s\",\"threads\":%d,\"hidden\":%d,\"intermediate\":%d,\"experts\":%d,"
               "\"top_k\":%d,\"ffn_active_params\":%zu,\"ffn_total_params\":%zu,\"prefill_tokens\":%d,\"prefill_ms\":%.3f,"
               "\"prefill_tokens_per_s\":%.1f,\"decode_seqs\":%d,\"decode_ctx\":%d,\"decode_step_ms\":%.3f}\n",
               names[k], be->device, be->n_threads, cfg->hidden, cfg->intermediate, cfg->n_experts, cfg->top_k, active,
               k == 0 ? (size_t)cfg->n_experts * 3 * H * I + 3 * H * I + (size_t)cfg->n_experts * H : active, tokens,
               tp * 1e3, tokens / tp, decode_seqs, ctx, td * 1e3);
        prism_kv_cache_free(kv);
        prism_llm_free(m);
    }
}

int main(int argc, char **argv)
{
    const char *mode = "vision", *model = "tests/bench/llama4/vision_scaled", *device = "cpu";
    int64_t threads = 2, tiles = 17, batch = 4, tokens = 256, decode_seqs = 16, ctx = 1024, reps = 5, seed = 1;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("mode", &mode, "vision | moe"),
        PRISM_FLAG_STR("model-path", &model, "Directory with a Llama-4 config.json (weights are random)"),
        PRISM_FLAG_STR("device", &device, "cpu | cuda"),
        PRISM_FLAG_INT("threads", &threads, "CPU threads"),
        PRISM_FLAG_INT("tiles", &tiles, "vision: tiles per measurement (17 = one 4096x4096 image at Scout's config)"),
        PRISM_FLAG_INT("batch", &batch, "vision: tiles per encoder micro-batch"),
        PRISM_FLAG_INT("tokens", &tokens, "moe: prefill tokens in one forward"),
        PRISM_FLAG_INT("decode-seqs", &decode_seqs, "moe: sequences in one decode step"),
        PRISM_FLAG_INT("decode-ctx", &ctx, "moe: cached tokens per decoding sequence"),
        PRISM_FLAG_INT("reps", &reps, "measured runs (median reported), after one warm-up"),
        PRISM_FLAG_INT("seed", &seed, "random-weights seed"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "prism_bench_llama4", "Llama-4 vision and MoE benchmarks on random weights.", flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init("bench_llama4", PRISM_LOG_WARN);
    if (tiles < 1 || batch < 1 || tokens < 1 || decode_seqs < 1 || ctx < 0 || reps < 1 || threads < 1)
        PRISM_FATAL("counts must be positive");
    char err[512];
    prism_model_config_t cfg;
    if (prism_model_config_load(model, &cfg, err, sizeof err)) PRISM_FATAL("config: %s", err);
    cfg.random_weights = true;
    cfg.random_seed = (uint64_t)seed;
    prism_backend_t *be = NULL;
    if (prism_backend_create(device, (int)threads, 0, &be)) PRISM_FATAL("backend %s unavailable", device);
    if (!strcmp(mode, "vision")) {
        if (!cfg.has_vision || cfg.vision_arch != PRISM_VISION_LLAMA4) PRISM_FATAL("%s has no Llama-4 vision tower", model);
        bench_vision(be, &cfg, (int)tiles, (int)batch, (int)reps);
    } else if (!strcmp(mode, "moe")) {
        bench_moe(be, &cfg, (int)tokens, (int)decode_seqs, (int)ctx, (int)reps);
    } else {
        PRISM_FATAL("unknown --mode %s", mode);
    }
    prism_backend_destroy(be);
    return 0;
}
