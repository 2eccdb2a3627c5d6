/* gpu_check: CUDA backend vs the CPU reference on the GPU machine (no cmocka / OpenBLAS / jansson
 * needed). Prints PASS/FAIL per op (tests/unit/gpu/ops_check.c), then model-level checks of the
 * product's own prism_llm / prism_vision on random-weight Llama- and CLIP-shaped configs
 * (gpu_kit.h): logits within the bf16 tolerance and 32 greedy steps identical, plus "no
 * cudaMalloc after start-up".
 * Exit status 0 only when everything passed.
 *
 *   gpu_check [--op NAME] [--big] [--verbose] [--json FILE] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "gpu_kit.h"
#include "ops_check.h"

static FILE *g_json;
static int g_fail;

static void result(const char *name, bool ok, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void result(const char *name, bool ok, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    printf("%s %-24s %s\n", ok ? "PASS" : "FAIL", name, msg);
    fflush(stdout);
    if (!ok) g_fail++;
    if (g_json) fprintf(g_json, "  {\"check\": \"%s\", \"pass\": %s, \"detail\": \"%s\"},\n", name, ok ? "true" : "false", msg);
}

static double stddev(const float *x, int n)
{
    double m = 0, v = 0;
    for (int i = 0; i < n; i++) m += x[i];
    m /= n;
    for (int i = 0; i < n; i++) v += (x[i] - m) * (x[i] - m);
    return sqrt(v / n);
}

static int argmax_margin(const float *x, int n, float *margin)
{
    int b = 0, s = -1;
    for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i;
    for (int i = 0; i < n; i++) if (i != b && (s < 0 || x[i] > x[s])) s = i;
    *margin = s < 0 ? INFINITY : x[b] - x[s];
    return b;
}

/* Prefill a prompt, then 32 teacher-forced greedy steps on both backends (batch of 2 sequences). */
static void llm_check(const char *name, prism_backend_t *cpu, prism_backend_t *gpu, const prism_model_config_t *c)
{
    enum { S = 2, P = 37, STEPS = 32, BPS = 8, BS = 16 };
    kit_llm_t *mc = NULL, *mg = NULL;
    int rc = kit_llm_create(cpu, c, 7, 2 * P, S, BPS, BS, &mc);
    if (!rc) rc = kit_llm_create(gpu, c, 7, 2 * P, S, BPS, BS, &mg);
    if (rc) { result(name, false, "create: %s", prism_strerror(rc)); goto out; }
    int V = c->vocab;
    float *lc = malloc((size_t)S * V * 4), *lg = malloc((size_t)S * V * 4);
    int32_t toks[2 * P], ql[S] = {P, P - 11}, pos0[S] = {0, 0};
    for (int i = 0; i < 2 * P; i++) toks[i] = (i * 131 + 7) % V;
    uint64_t m0 = prism_cuda_malloc_count();
    rc = kit_llm_forward(mc, S, toks, ql, pos0, lc);
    if (!rc) rc = kit_llm_forward(mg, S, toks, ql, pos0, lg);
    int same = 0, amb = 0, bad = 0;
    double worst_rel = 0;
    for (int step = 0; step < STEPS && !rc; step++) {
        int32_t next[S], one[S] = {1, 1};
        for (int s = 0; s < S; s++) {
            const float *a = lc + (size_t)s * V, *b = lg + (size_t)s * V;
            double sd = stddev(a, V), w = 0;
            for (int i = 0; i < V; i++) w = fmax(w, fabs((double)a[i] - b[i]));
            worst_rel = fmax(worst_rel, w / sd);
            float mcpu, mgpu;
            int tc = argmax_margin(a, V, &mcpu), tg = argmax_margin(b, V, &mgpu);
            if (tc == tg) same++;
            else if (mcpu <= 2 * w) amb++;
            else bad++;
            next[s] = tc;
            pos0[s] += ql[s];
        }
        memcpy(ql, one, sizeof one);
        rc = kit_llm_forward(mc, S, next, ql, pos0, lc);
        if (!rc) rc = kit_llm_forward(mg, S, next, ql, pos0, lg);
    }
    bool no_alloc = prism_cuda_malloc_count() == m0;
    result(name, !rc && bad == 0 && amb <= 2 && worst_rel <= 0.05 && no_alloc,
           "rc %d, %d/%d greedy steps identical, %d near-ties, %d wrong, worst |dlogit| %.4f x std, "
           "device allocs during forwards %llu", rc, same, S * STEPS, amb, bad, worst_rel,
           (unsigned long long)(prism_cuda_malloc_count() - m0));
    free(lc); free(lg);
out:
    kit_llm_free(mc);
    kit_llm_free(mg);
}

static void vit_check(prism_backend_t *cpu, prism_backend_t *gpu)
{
    /* tiny-llava's tower shape */
    prism_model_config_t text = kit_text_config(256, 4, 8, 4, 32, 688, 4096, 1e-5f, 10000.0f);
    prism_model_config_t c = kit_vision_config(&text, 112, 14, 128, 3, 4, 512);
    c.random_seed = 11;
    char err[256] = "";
    prism_vision_t *vc = NULL, *vg = NULL;
    int rc = prism_vision_load(cpu, &c, NULL, 3, &vc, err, sizeof err);
    if (!rc) rc = prism_vision_load(gpu, &c, NULL, 3, &vg, err, sizeof err);
    size_t np = (size_t)3 * 3 * 112 * 112, nf = (size_t)3 * c.image_seq_length * c.hidden;
    float *pix = malloc(np * 4), *a = malloc(nf * 4), *b = malloc(nf * 4);
    for (size_t i = 0; i < np; i++) pix[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    if (!rc) rc = prism_vision_encode(vc, pix, 3, a);
    if (!rc) rc = prism_vision_encode(vg, pix, 3, b);
    double sd = rc ? 1 : stddev(a, (int)nf), w = 0;
    for (size_t i = 0; !rc && i < nf; i++) w = fmax(w, fabs((double)a[i] - b[i]));
    result("vit_112px_3_images", !rc && w <= 0.05 * sd, "rc %d%s%s, max |diff| %.4g (std %.4g)", rc, err[0] ? ": " : "",
           err, w, sd);
    free(pix); free(a); free(b);
    prism_vision_free(vc);
    prism_vision_free(vg);
}

int main(int argc, char **argv)
{
    const char *only = NULL, *json = NULL;
    bool big = false, verbose = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--op") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--big")) big = true;
        else if (!strcmp(argv[i], "--verbose")) verbose = true;
        else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else { fprintf(stderr, "usage: %s [--op NAME] [--big] [--verbose] [--json FILE]\n", argv[0]); return 2; }
    }
    prism_log_init("gpu_check", PRISM_LOG_WARN);
    if (!prism_cuda_available()) {
        printf("SKIPPED: no CUDA device\n");
        return 77;
    }
    prism_backend_t *cpu = prism_backend_cpu_create(8), *gpu = NULL;
    int rc = prism_backend_create("cuda", 1, (size_t)8 << 30, &gpu);
    if (rc) { printf("FAIL cuda backend create: %s\n", prism_strerror(rc)); return 1; }
    printf("device: %s\n", gpu->i.name(gpu->ctx));
    if (json) g_json = fopen(json, "w");
    if (g_json) fprintf(g_json, "{\"device\": \"%s\", \"results\": [\n", gpu->i.name(gpu->ctx));
    uint64_t m0 = prism_cuda_malloc_count();

    prism_opcheck_t t = {.out = stdout, .verbose = verbose, .big = big};
    prism_opcheck_run(&t, cpu, gpu, only);
    result("ops", t.n_fail == 0, "%d ops passed, %d failed; %d cases passed, %d failed%s%s", t.ops_pass, t.ops_fail,
           t.n_pass, t.n_fail, t.n_fail ? "; first: " : "", t.first_fail);
    result("ops_no_device_alloc", prism_cuda_malloc_count() == m0 &&
           gpu->i.pool_used(gpu->ctx) == prism_cuda_reserved_bytes(gpu),
           "cudaMalloc calls during ops: %llu, pool bytes still held: %zu",
           (unsigned long long)(prism_cuda_malloc_count() - m0),
           gpu->i.pool_used(gpu->ctx) - prism_cuda_reserved_bytes(gpu));
    if (!only) {
        prism_model_config_t tiny = kit_text_config(256, 4, 8, 4, 32, 688, 4096, 1e-5f, 10000.0f);  /* tiny-llava text */
        prism_model_config_t gqa8 = kit_text_config(1024, 2, 8, 1, 128, 2816, 32000, 1e-5f, 500000.0f); /* hd 128, GQA 8 */
        llm_check("llm_tiny_greedy32", cpu, gpu, &tiny);
        llm_check("llm_hd128_gqa8_greedy32", cpu, gpu, &gqa8);
        vit_check(cpu, gpu);
    }
    if (g_json) {
        fprintf(g_json, "  {\"check\": \"summary\", \"pass\": %s, \"detail\": \"%d failed\"}\n]}\n", g_fail ? "false" : "true", g_fail);
        fclose(g_json);
    }
    printf("%s: %d check(s) failed\n", g_fail ? "FAIL" : "PASS", g_fail);
    prism_backend_destroy(gpu);
    prism_backend_destroy(cpu);
    return g_fail ? 1 : 0;
}
