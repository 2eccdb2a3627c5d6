/* prism_bench_grammar: what grammar-constrained decoding costs.
 *
 * Part 1 (mask): for a tokenizer and typical schemas, compile time, eager cache fill time, and
 * the per-token time of fill_mask + accept_token on seeded walks, with a cold cache (first
 * request of a schema) and a warm one (later requests).
 * Part 2 (model, with --model-path): the bundled model's decode step without a grammar, with the
 * mask computed in series (forward, then mask), and with the mask for step n+1 computed on a
 * second thread while the forward of step n+1 runs (the integration the engine is built for).
 *
 *   prism_bench_grammar --tokenizer models/prism-tiny-llava/tokenizer.json --model-path models/prism-tiny-llava
 *   prism_bench_grammar --tokenizer ../shared/tokenizers/llama3_1/tokenizer.json --eos '<|eot_id|>'
 */
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "core/cli.h"
#include "core/core.h"
#include "grammar/grammar.h"
#include "kv/kv.h"
#include "model/model.h"
#include "sample/sample.h"
#include "tokenizer/tokenizer.h"
#include "toolcall/toolcall.h"

static const struct { const char *name, *schema; } SCHEMAS[] = {
    { "person", "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
                "\"email\":{\"type\":\"string\",\"format\":\"email\"}},\"required\":[\"name\",\"age\"],\"additionalProperties\":false}" },
    { "order", "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}[0-9]{6}$\"},"
               "\"status\":{\"enum\":[\"pending\",\"shipped\",\"delivered\"]},\"items\":{\"type\":\"array\",\"items\":"
               "{\"type\":\"object\",\"properties\":{\"sku\":{\"type\":\"string\"},\"qty\":{\"type\":\"integer\"},"
               "\"price\":{\"type\":\"number\"}},\"required\":[\"sku\",\"qty\"]},\"minItems\":1,\"maxItems\":20},"
               "\"note\":{\"type\":[\"string\",\"null\"]}},\"required\":[\"id\",\"status\",\"items\"]}" },
    { "json_object", NULL },
    { "tool_required", "" },
};
static const char TOOLS[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\",\"properties\":"
    "{\"city\":{\"type\":\"string\"},\"unit\":{\"enum\":[\"c\",\"f\"]}},\"required\":[\"city\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"search\",\"parameters\":{\"type\":\"object\",\"properties\":"
    "{\"query\":{\"type\":\"string\"},\"limit\":{\"type\":\"integer\"}},\"required\":[\"query\"]}}}]";

/* Per-token costs are taken in thread CPU time: on a shared machine, wall time would mostly
 * measure the scheduler (the model table below is wall time). */
static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, int n, double p)
{
    if (n == 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

static int compile_case(int i, prism_grammar_vocab_t *v, prism_grammar_t **g)
{
    prism_grammar_error_t err;
    int rc;
    if (!SCHEMAS[i].schema) rc = prism_grammar_compile_json_object(v, NULL, NULL, g, &err);
    else if (!SCHEMAS[i].schema[0])
        rc = prism_toolcall_grammar(PRISM_TOOLCALL_HERMES, v, TOOLS, strlen(TOOLS), NULL, true, NULL, g, &err);
    else rc = prism_grammar_compile_json_schema(v, SCHEMAS[i].schema, strlen(SCHEMAS[i].schema), NULL, NULL, g, &err);
    if (rc < 0) fprintf(stderr, "%s: %s %s\n", SCHEMAS[i].name, err.path, err.message);
    return rc;
}

/* One seeded walk: per step fill_mask + accept; picks a pseudo-random allowed token, EOS once
 * allowed after a few steps. Returns steps; times[] gets per-step microseconds. */
static int walk(prism_grammar_matcher_t *m, const prism_grammar_vocab_t *v, int32_t eos, uint64_t seed, int max_steps,
                int32_t *mask, double *times)
{
    size_t nv = prism_grammar_vocab_size(v);
    uint64_t r = prism_rng_seed(seed);
    int s;
    for (s = 0; s < max_steps; s++) {
        uint64_t t0 = cpu_ns();
        int n = prism_grammar_matcher_fill_mask(m, mask);
        if (n <= 0) break;
        /* a stand-in for sampling: the k-th allowed token (not timed) */
        int32_t pick = -1;
        if (prism_grammar_mask_test(mask, eos) && s > 12) pick = eos;
        uint64_t t1 = cpu_ns();
        if (pick < 0) {
            int k = (int)(prism_rng_uniform(&r) * n);
            for (size_t i = 0; i < nv; i++)
                if (prism_grammar_mask_test(mask, (int32_t)i) && k-- == 0) { pick = (int32_t)i; break; }
        }
        uint64_t t2 = cpu_ns();
        if (prism_grammar_matcher_accept_token(m, pick) < 0) { fprintf(stderr, "accept failed\n"); exit(1); }
        uint64_t t3 = cpu_ns();
        times[s] = ((double)(t1 - t0) + (double)(t3 - t2)) / 1e3;
        if (pick == eos) { s++; break; }
    }
    return s;
}

static void bench_masks(prism_grammar_vocab_t *v, int32_t eos, int runs, int steps)
{
    size_t words = prism_grammar_mask_words(v);
    int32_t *mask = malloc(words * sizeof *mask);
    double *t_cold = malloc((size_t)steps * sizeof(double)), *t_warm = malloc((size_t)runs * steps * sizeof(double));
    printf("fill_mask + accept_token per token, thread CPU time; cold = first walk after compile (lazy cache fills),\n"
           "warm = every state's cache entry filled beforehand\n\n");
    printf("| grammar | states | compile ms | full cache fill ms | cold: mean us/token | warm: median | p90 | p99 | max (us) | tokens |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < PRISM_ARRAY_LEN(SCHEMAS); i++) {
        prism_grammar_t *g;
        double c0 = prism_now_s();
        if (compile_case((int)i, v, &g) < 0) continue;
        double compile_ms = (prism_now_s() - c0) * 1e3;
        prism_grammar_matcher_t *m;
        prism_grammar_matcher_create(g, NULL, &m);
        /* cold: first walk fills the cache lazily */
        int n_cold = walk(m, v, eos, 1, steps, mask, t_cold);
        double cold = 0;
        for (int k = 0; k < n_cold; k++) cold += t_cold[k];
        cold /= n_cold ? n_cold : 1;
        /* warm: every state's cache entry filled up front (prism_grammar_warm), so these are the
         * steady-state costs a schema used before pays */
        prism_grammar_t *g2;
        compile_case((int)i, v, &g2);
        double w0 = prism_now_s();
        prism_grammar_warm(g2);
        double warm_ms = (prism_now_s() - w0) * 1e3;
        prism_grammar_matcher_t *m2;
        prism_grammar_matcher_create(g2, NULL, &m2);
        int n = 0;
        for (int r = 0; r < runs; r++) {
            prism_grammar_matcher_reset(m2);
            n += walk(m2, v, eos, 100 + (uint64_t)r, steps, mask, t_warm + n);
        }
        prism_grammar_matcher_free(m2);
        prism_grammar_release(g2);
        double mx = pct(t_warm, n, 1.0);
        printf("| %s | %zu | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f | %d |\n", SCHEMAS[i].name,
               prism_grammar_n_states(g), compile_ms, warm_ms, cold, pct(t_warm, n, 0.5), pct(t_warm, n, 0.9),
               pct(t_warm, n, 0.99), mx, n);
        prism_grammar_matcher_free(m);
        prism_grammar_release(g);
    }
    free(mask);
    free(t_cold);
    free(t_warm);
}

/* ---- model: decode step with and without a grammar ---- */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    prism_grammar_matcher_t *m;
    int32_t *mask;
    int32_t token;     /* to accept, then fill the next mask */
    int job;           /* 1: work to do, 0: done */
    bool quit;
    double busy_us;
} helper_t;

/* Accepts the sampled token and computes the next mask; an EOS starts the grammar over, as the
 * next request with the same schema would. */
static void advance(prism_grammar_matcher_t *m, int32_t t, int32_t *mask)
{
    if (prism_grammar_matcher_accept_token(m, t) < 0) PRISM_FATAL("accept");
    if (prism_grammar_matcher_is_terminated(m)) prism_grammar_matcher_reset(m);
    prism_grammar_matcher_fill_mask(m, mask);
}

static void *helper_main(void *p)
{
    helper_t *h = p;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (h->job == 0 && !h->quit) pthread_cond_wait(&h->cv, &h->mu);
        if (h->quit) break;
        pthread_mutex_unlock(&h->mu);
        uint64_t t0 = prism_now_ns();
        advance(h->m, h->token, h->mask);
        h->busy_us += (double)(prism_now_ns() - t0) / 1e3;
        pthread_mutex_lock(&h->mu);
        h->job = 0;
        pthread_cond_broadcast(&h->cv);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

typedef enum { MODE_FREE, MODE_SERIAL, MODE_OVERLAP } mode_t_;

static double run_model(const char *model, prism_grammar_t *g, mode_t_ mode, int tokens, int *generated, double *cpu_ms)
{
    char err[512], path[1024];
    prism_model_config_t cfg;
    if (prism_model_config_load(model, &cfg, err, sizeof err)) PRISM_FATAL("config: %s", err);
    prism_backend_t *be = prism_backend_cpu_create(1);
    int32_t prompt[16];
    for (int i = 0; i < 16; i++) prompt[i] = 10 + i * 7;
    int n = 16, max_len = n + tokens + 2, bs = 16, nb = (max_len + bs - 1) / bs;
    prism_llm_t *llm;
    if (prism_llm_load(be, &cfg, model, n, 1, &llm, err, sizeof err)) PRISM_FATAL("llm: %s", err);
    prism_kv_cache_t *kv;
    if (prism_kv_cache_create(be, &cfg, nb, bs, &kv)) PRISM_FATAL("kv");
    int32_t *table = prism_xmalloc(sizeof(int32_t) * (size_t)nb);
    for (int i = 0; i < nb; i++) table[i] = i;
    const int32_t *tables[1] = { table };
    float *logits = prism_xmalloc(sizeof(float) * (size_t)cfg.vocab);
    prism_sampler_t sampler;
    prism_sampler_init(&sampler, cfg.vocab);
    prism_sample_params_t greedy = {0};
    uint64_t rng = 1;
    int32_t ss[2] = { 0, n }, p0[1] = { 0 };
    prism_llm_batch_t b = { .n_seqs = 1, .n_tokens = n, .tokens = prompt, .seq_start = ss, .pos0 = p0, .block_tables = tables };
    if (prism_llm_forward(llm, kv, &b, logits)) PRISM_FATAL("prefill");
    (void)path;

    prism_grammar_matcher_t *m = NULL;
    int32_t *mask = NULL;
    helper_t h = { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };
    pthread_t th;
    if (g) {
        prism_grammar_matcher_create(g, NULL, &m);
        mask = prism_xmalloc(prism_grammar_mask_words(prism_grammar_vocab(g)) * sizeof *mask);
        prism_grammar_matcher_fill_mask(m, mask);
        if (mode == MODE_OVERLAP) {
            h.m = m;
            h.mask = mask;
            pthread_create(&th, NULL, helper_main, &h);
        }
    }
    int len = n, step;
    double t0 = prism_now_s();
    uint64_t c0 = cpu_ns();
    for (step = 0; step < tokens; step++) {
        if (g) prism_grammar_apply_mask(logits, mask, (size_t)cfg.vocab);
        int32_t t = prism_sample(&sampler, logits, &greedy, &rng);
        if (g && prism_grammar_mask_test(mask, t) == false) PRISM_FATAL("sampled a masked token");
        /* without a grammar EOS is ignored (ignore_eos) so every run has the same length */
        if (g && mode == MODE_OVERLAP) {
            pthread_mutex_lock(&h.mu);
            h.token = t;
            h.job = 1;
            pthread_cond_broadcast(&h.cv);
            pthread_mutex_unlock(&h.mu);
        }
        int32_t s2[2] = { 0, 1 }, p2[1] = { len };
        prism_llm_batch_t d = { .n_seqs = 1, .n_tokens = 1, .tokens = &t, .seq_start = s2, .pos0 = p2, .block_tables = tables };
        if (prism_llm_forward(llm, kv, &d, logits)) PRISM_FATAL("decode");
        len++;
        if (g && mode == MODE_SERIAL) advance(m, t, mask);
        if (g && mode == MODE_OVERLAP) {
            pthread_mutex_lock(&h.mu);
            while (h.job) pthread_cond_wait(&h.cv, &h.mu);
            pthread_mutex_unlock(&h.mu);
        }
        if (len >= max_len - 1) break;
    }
    double dt = prism_now_s() - t0;
    *cpu_ms = (double)(cpu_ns() - c0) / 1e6 / (step ? step : 1);
    if (g && mode == MODE_OVERLAP) {
        pthread_mutex_lock(&h.mu);
        h.quit = true;
        pthread_cond_broadcast(&h.cv);
        pthread_mutex_unlock(&h.mu);
        pthread_join(th, NULL);
    }
    *generated = step;
    prism_grammar_matcher_free(m);
    prism_free(mask);
    prism_free(logits);
    prism_free(table);
    prism_sampler_free(&sampler);
    prism_kv_cache_free(kv);
    prism_llm_free(llm);
    prism_backend_destroy(be);
    return dt * 1e3 / (step ? step : 1);
}

int main(int argc, char **argv)
{
    const char *tok_path = "models/prism-tiny-llava/tokenizer.json", *model = NULL, *eos_tok = "</s>";
    int64_t runs = 5, steps = 200, tokens = 200, reps = 5;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("tokenizer", &tok_path, "tokenizer.json to build the vocabulary from"),
        PRISM_FLAG_STR("eos", &eos_tok, "end-of-sequence token of that tokenizer"),
        PRISM_FLAG_STR("model-path", &model, "also time the model's decode step (its own tokenizer)"),
        PRISM_FLAG_INT("runs", &runs, "warm walks per grammar"),
        PRISM_FLAG_INT("steps", &steps, "max tokens per walk"),
        PRISM_FLAG_INT("tokens", &tokens, "decode steps per model run"),
        PRISM_FLAG_INT("reps", &reps, "model runs per mode (median reported)"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "prism_bench_grammar", "Grammar mask cost per token, and against the model's decode step.", flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init("bench_grammar", PRISM_LOG_WARN);
    char err[256];
    prism_tokenizer_t *tok;
    if (prism_tokenizer_load(tok_path, &tok, err, sizeof err)) PRISM_FATAL("tokenizer: %s", err);
    int32_t eos = prism_tokenizer_token_to_id(tok, eos_tok);
    if (eos < 0) PRISM_FATAL("no token %s", eos_tok);
    prism_grammar_vocab_t *v;
    double v0 = prism_now_s();
    if (prism_grammar_vocab_create(tok, &eos, 1, 0, &v)) PRISM_FATAL("vocab");
    printf("tokenizer %s: vocab %zu, vocabulary index built in %.1f ms\n\n", tok_path, prism_grammar_vocab_size(v),
           (prism_now_s() - v0) * 1e3);
    bench_masks(v, eos, (int)runs, (int)steps);

    if (model) {
        prism_grammar_vocab_t *mv;
        char path[1024];
        prism_tokenizer_t *mt;
        prism_path_join(path, sizeof path, model, "tokenizer.json");
        if (prism_tokenizer_load(path, &mt, err, sizeof err)) PRISM_FATAL("tokenizer: %s", err);
        prism_model_config_t cfg;
        if (prism_model_config_load(model, &cfg, err, sizeof err)) PRISM_FATAL("config: %s", err);
        if (prism_grammar_vocab_create(mt, cfg.eos_token_ids, (size_t)cfg.n_eos, (size_t)cfg.vocab, &mv)) PRISM_FATAL("vocab");
        printf("\nmodel %s, one sequence, %lld decode steps per run, median of %lld runs:\n\n", model, (long long)tokens, (long long)reps);
        printf("wall: elapsed per step; cpu: the decoding thread's CPU time per step (forward, sampling and, in\n"
               "series, the mask), which a shared machine does not inflate\n\n");
        printf("| grammar | no grammar ms/step (wall / cpu) | mask in series (wall / cpu) | overhead (wall / cpu) | mask overlapped, wall | overhead |\n");
        printf("|---|---|---|---|---|---|\n");
        for (size_t i = 0; i < PRISM_ARRAY_LEN(SCHEMAS); i++) {
            prism_grammar_t *g;
            if (compile_case((int)i, mv, &g) < 0) continue;
            prism_grammar_warm(g);
            double f[32], s[32], o[32], fc[32], sc[32], oc[32];
            int gen;
            for (int r = 0; r < reps && r < 32; r++) {
                f[r] = run_model(model, NULL, MODE_FREE, (int)tokens, &gen, &fc[r]);
                s[r] = run_model(model, g, MODE_SERIAL, (int)tokens, &gen, &sc[r]);
                o[r] = run_model(model, g, MODE_OVERLAP, (int)tokens, &gen, &oc[r]);
            }
            int n = reps < 32 ? (int)reps : 32;
            double fm = pct(f, n, 0.5), sm = pct(s, n, 0.5), om = pct(o, n, 0.5);
            double fcm = pct(fc, n, 0.5), scm = pct(sc, n, 0.5);
            printf("| %s | %.3f / %.3f | %.3f / %.3f | %+.1f%% / %+.1f%% | %.3f | %+.1f%% |\n", SCHEMAS[i].name, fm, fcm, sm,
                   scm, (sm / fm - 1) * 100, (scm / fcm - 1) * 100, om, (om / fm - 1) * 100);
            prism_grammar_release(g);
        }
        prism_grammar_vocab_free(mv);
        prism_tokenizer_free(mt);
    }
    prism_grammar_vocab_free(v);
    prism_tokenizer_free(tok);
    return 0;
}
