/* gpu_bench: throughput of the CUDA backend and of the product's own model code (prism_llm_forward,
 * prism_vision_encode) on Llama-3-8B and CLIP-L/336 shapes with random weights (the
 * --random-weights path, no checkpoint needed), against the H200's ceilings:
 *   - bf16 dense GEMM: ~790 TFLOP/s measured on these machines (datasheet 989);
 *   - HBM: 4.8 TB/s datasheet (~4.3 TB/s measured copy bandwidth).
 * Sections (all by default, or pick with --only gemm|decode|prefill|vit):
 *   gemm     backend matmul (fp32 in -> bf16 -> cuBLAS -> fp32 out) on the 8B layer shapes
 *   decode   one prism_llm_forward decode step (all layers + lm_head + logits to the host, as the
 *            decode worker runs it) at batch 1, 8, 64, context 512
 *   prefill  one 2048-token prompt
 *   vit      prism_vision_encode: CLIP-L/336 tower (23 layers run, feature layer -2) + LLaVA
 *            projector, features to the host; images/s and device memory at batch 1..64
 * Text goes to stdout, one JSON object per measurement to --json FILE. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "gpu_kit.h"

#define PEAK_TFLOPS 790.0
#define HBM_TBS 4.8

static FILE *g_json;
static prism_backend_t *g_be;

static void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emit(const char *fmt, ...)
{
    if (!g_json) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(g_json, fmt, ap);
    va_end(ap);
    fputc('\n', g_json);
    fflush(g_json);
}

static double gib(size_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }

/* ------------------------------------------------------------------ gemm */

static void bench_gemm(void)
{
    static const struct { const char *name; int N, K; } shapes[] = {
        {"qkv", 6144, 4096}, {"o_proj", 4096, 4096}, {"gate_up", 28672, 4096}, {"down", 4096, 14336},
        {"lm_head", 128256, 4096}, {"square8k", 8192, 8192},
    };
    static const int Ms[] = {1, 8, 64, 512, 2048, 8192};
    const prism_backend_i *o = &g_be->i;
    void *bx = g_be->ctx;
    printf("\n== GEMM y[M,N] = x[M,K] . W[N,K]^T  (fp32 x -> bf16, bf16 W, fp32 accumulate/out)\n");
    printf("%-9s %6s %7s %6s %10s %9s %7s %9s\n", "shape", "M", "N", "K", "time_us", "TFLOP/s", "%peak", "W GB/s");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++) {
            int M = Ms[mi], N = shapes[s].N, K = shapes[s].K;
            if (!strcmp(shapes[s].name, "square8k") && M != 8192) continue;
            float *x = prism_backend_buf_alloc(g_be, (size_t)M * K * 4), *y = prism_backend_buf_alloc(g_be, (size_t)M * N * 4);
            void *w = prism_backend_buf_alloc(g_be, (size_t)N * K * 2);
            if (!x || !y || !w) {
                printf("%-9s %6d: out of pool\n", shapes[s].name, M);
                prism_backend_buf_free(g_be, x); prism_backend_buf_free(g_be, y); prism_backend_buf_free(g_be, w);
                continue;
            }
            g_be->i.fill_random(bx, x, PRISM_DTYPE_F32, (size_t)M * K, 1, 1.0f);
            g_be->i.fill_random(bx, w, PRISM_DTYPE_BF16, (size_t)N * K, 2, 0.02f);
            int rc = PRISM_OK;
            for (int i = 0; i < 3 && !rc; i++) rc = o->matmul(bx, y, N, x, K, w, PRISM_DTYPE_BF16, NULL, M, N, K, false);
            o->synchronize(bx);
            double flop = 2.0 * M * N * K;
            int reps = (int)fmin(200, fmax(5, 2e13 / flop));   /* ~25 ms of work at peak */
            double t0 = prism_now_s();
            for (int i = 0; i < reps && !rc; i++) rc = o->matmul(bx, y, N, x, K, w, PRISM_DTYPE_BF16, NULL, M, N, K, false);
            o->synchronize(bx);
            double dt = (prism_now_s() - t0) / reps;
            double tf = flop / dt / 1e12, wgbs = (double)N * K * 2 / dt / 1e9;
            printf("%-9s %6d %7d %6d %10.1f %9.1f %6.1f%% %9.0f%s\n", shapes[s].name, M, N, K, dt * 1e6, tf,
                   100 * tf / PEAK_TFLOPS, wgbs, rc ? "  (error)" : "");
            emit("{\"bench\":\"gemm\",\"shape\":\"%s\",\"M\":%d,\"N\":%d,\"K\":%d,\"us\":%.2f,\"tflops\":%.2f,"
                 "\"pct_peak\":%.2f,\"weight_gbs\":%.1f,\"rc\":%d}", shapes[s].name, M, N, K, dt * 1e6, tf,
                 100 * tf / PEAK_TFLOPS, wgbs, rc);
            prism_backend_buf_free(g_be, x); prism_backend_buf_free(g_be, y); prism_backend_buf_free(g_be, w);
        }
}

/* ------------------------------------------------------------------ llama-3-8B decode / prefill */

#define BENCH_BPS 136   /* 2176 tokens per sequence */
#define BENCH_BS 16
#define BENCH_SEQS 64

static prism_model_config_t g_cfg;   /* Llama-3-8B text shapes */
static kit_llm_t *g_llm;
static float *g_logits;              /* [BENCH_SEQS][vocab] host */

static int llm_get(void)
{
    if (g_llm) return PRISM_OK;
    double t0 = prism_now_s();
    int rc = kit_llm_create(g_be, &g_cfg, 1, 2048, BENCH_SEQS, BENCH_BPS, BENCH_BS, &g_llm);
    if (rc) { printf("llama-3-8B random model: %s\n", prism_strerror(rc)); return rc; }
    g_logits = malloc(sizeof(float) * (size_t)BENCH_SEQS * g_cfg.vocab);
    if (!g_logits) return PRISM_ENOMEM;
    printf("llama-3-8B-shaped model: %.2f GiB bf16 weights, KV pool %.1f GiB (fp32), ready in %.1fs\n",
           gib(prism_llm_weight_bytes(g_llm->llm)),
           gib((size_t)BENCH_SEQS * BENCH_BPS * BENCH_BS * kit_kv_bytes_per_token(g_llm)), prism_now_s() - t0);
    return PRISM_OK;
}

static void bench_decode(int ctx)
{
    if (llm_get()) return;
    static const int batches[] = {1, 8, 64};
    const prism_model_config_t *c = &g_cfg;
    size_t embed = (size_t)c->vocab * c->hidden * 2;
    size_t wread = prism_llm_weight_bytes(g_llm->llm) - embed;   /* every weight but the gathered embedding rows */
    printf("\n== decode step, Llama-3-8B shapes, context %d (HBM roofline %.1f TB/s)\n", ctx, HBM_TBS);
    printf("%5s %10s %10s %12s %14s %12s\n", "batch", "step_ms", "tok/s", "roof_w_ms", "roof_w+kv_ms", "%roof(w+kv)");
    for (size_t bi = 0; bi < 3; bi++) {
        int B = batches[bi];
        int32_t toks[BENCH_SEQS], ql[BENCH_SEQS], pos0[BENCH_SEQS];
        for (int s = 0; s < B; s++) { toks[s] = (s * 7919) % c->vocab; ql[s] = 1; pos0[s] = ctx; }
        int rc = PRISM_OK;
        for (int i = 0; i < 3 && !rc; i++) rc = kit_llm_forward(g_llm, B, toks, ql, pos0, g_logits);
        int reps = B >= 64 ? 10 : 20;
        double t0 = prism_now_s();
        for (int i = 0; i < reps && !rc; i++) rc = kit_llm_forward(g_llm, B, toks, ql, pos0, g_logits);
        double dt = (prism_now_s() - t0) / reps;
        size_t kv = (size_t)B * (ctx + 1) * kit_kv_bytes_per_token(g_llm);
        double roof_w = wread / (HBM_TBS * 1e12), roof = (wread + kv) / (HBM_TBS * 1e12);
        printf("%5d %10.3f %10.0f %12.3f %14.3f %11.1f%%%s\n", B, dt * 1e3, B / dt, roof_w * 1e3, roof * 1e3,
               100 * roof / dt, rc ? "  (error)" : "");
        emit("{\"bench\":\"decode\",\"batch\":%d,\"ctx\":%d,\"step_ms\":%.4f,\"tok_s\":%.1f,\"roofline_weights_ms\":%.4f,"
             "\"roofline_weights_kv_ms\":%.4f,\"pct_roofline\":%.2f,\"rc\":%d}", B, ctx, dt * 1e3, B / dt, roof_w * 1e3,
             roof * 1e3, 100 * roof / dt, rc);
    }
}

static void bench_prefill(int T)
{
    if (llm_get()) return;
    const prism_model_config_t *c = &g_cfg;
    int32_t *toks = malloc((size_t)T * 4), ql[1] = {T}, pos0[1] = {0};
    for (int i = 0; i < T; i++) toks[i] = (i * 7919 + 13) % c->vocab;
    int rc = kit_llm_forward(g_llm, 1, toks, ql, pos0, g_logits);
    int reps = 3;
    double t0 = prism_now_s();
    for (int i = 0; i < reps && !rc; i++) rc = kit_llm_forward(g_llm, 1, toks, ql, pos0, g_logits);
    double dt = (prism_now_s() - t0) / reps;
    double H = c->hidden, I = c->intermediate, hd = c->head_dim;
    double layer_params = H * (c->n_heads + 2.0 * c->n_kv_heads) * hd + H * c->n_heads * hd + 3.0 * H * I;
    double gemm_flop = 2.0 * T * layer_params * c->n_layers + 2.0 * H * c->vocab;
    double attn_flop = 4.0 * (double)T * (T + 1) / 2 * hd * c->n_heads * c->n_layers;
    double tf = (gemm_flop + attn_flop) / dt / 1e12;
    printf("\n== prefill %d tokens, Llama-3-8B shapes: %.1f ms, %.0f tok/s, %.1f TFLOP/s (%.1f%% of %.0f; attention "
           "%.1f%% of the FLOPs)%s\n", T, dt * 1e3, T / dt, tf, 100 * tf / PEAK_TFLOPS, PEAK_TFLOPS,
           100 * attn_flop / (gemm_flop + attn_flop), rc ? "  (error)" : "");
    emit("{\"bench\":\"prefill\",\"tokens\":%d,\"ms\":%.3f,\"tok_s\":%.1f,\"tflops\":%.2f,\"pct_peak\":%.2f,"
         "\"attn_flop_frac\":%.4f,\"rc\":%d}", T, dt * 1e3, T / dt, tf, 100 * tf / PEAK_TFLOPS,
         attn_flop / (gemm_flop + attn_flop), rc);
    free(toks);
}

/* ------------------------------------------------------------------ CLIP-L/336 */

static void bench_vit(void)
{
    prism_model_config_t clip = kit_vision_config(&g_cfg, 336, 14, 1024, 24, 16, 4096);
    clip.random_seed = 3;
    static const int batches[] = {1, 8, 16, 32, 64};
    printf("\n== CLIP-L/336 (23 of 24 layers run, 577 tokens) + LLaVA projector to 4096\n");
    printf("%5s %10s %10s %12s %14s %10s\n", "batch", "ms", "images/s", "TFLOP/s", "device_GiB", "act_GiB");
    double flop_img = 0;
    {
        double T = 577, VH = 1024, VI = 4096, P = 4096, np = 576, L = 23;
        flop_img = L * (2 * T * (4 * VH * VH + 2 * VH * VI) + 4 * T * T * VH) + 2 * np * 588 * VH +
                   2 * np * (VH * P + P * P);
    }
    for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++) {
        int B = batches[bi];
        size_t before = g_be->i.pool_used(g_be->ctx);
        prism_vision_t *v = NULL;
        char err[256] = "";
        int rc = prism_vision_load(g_be, &clip, NULL, B, &v, err, sizeof err);
        if (rc) { printf("%5d: %s %s\n", B, prism_strerror(rc), err); continue; }
        size_t mem = g_be->i.pool_used(g_be->ctx) - before, wb = prism_vision_weight_bytes(v);
        size_t npix = (size_t)B * 3 * 336 * 336, nout = (size_t)B * clip.image_seq_length * clip.hidden;
        float *pix = malloc(npix * 4), *out = malloc(nout * 4);
        for (size_t i = 0; i < npix; i++) pix[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
        rc = prism_vision_encode(v, pix, B, out);
        int reps = B >= 32 ? 3 : 8;
        double t0 = prism_now_s();
        for (int i = 0; i < reps && !rc; i++) rc = prism_vision_encode(v, pix, B, out);
        double dt = (prism_now_s() - t0) / reps;
        double tf = flop_img * B / dt / 1e12;
        printf("%5d %10.2f %10.1f %12.1f %14.2f %10.2f%s\n", B, dt * 1e3, B / dt, tf, gib(mem), gib(mem - wb),
               rc ? "  (error)" : "");
        emit("{\"bench\":\"vit\",\"batch\":%d,\"ms\":%.3f,\"images_s\":%.2f,\"tflops\":%.2f,\"device_bytes\":%zu,"
             "\"activation_bytes\":%zu,\"rc\":%d}", B, dt * 1e3, B / dt, tf, mem, mem - wb, rc);
        free(pix);
        free(out);
        prism_vision_free(v);
    }
}

int main(int argc, char **argv)
{
    const char *only = NULL, *json = NULL;
    int ctx = 512, prefill = 2048;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else if (!strcmp(argv[i], "--ctx") && i + 1 < argc) ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prefill") && i + 1 < argc) prefill = atoi(argv[++i]);
        else { fprintf(stderr, "usage: %s [--only gemm|decode|prefill|vit] [--ctx N] [--prefill N] [--json FILE]\n", argv[0]); return 2; }
    }
    if (ctx < 1 || ctx + 1 > BENCH_BPS * BENCH_BS || prefill < 1 || prefill > 2048) {
        fprintf(stderr, "--ctx must be < %d and --prefill <= 2048\n", BENCH_BPS * BENCH_BS);
        return 2;
    }
    prism_log_init("gpu_bench", PRISM_LOG_WARN);
    g_cfg = kit_text_config(4096, 32, 32, 8, 128, 14336, 128256, 1e-5f, 500000.0f);
    if (!prism_cuda_available()) { printf("SKIPPED: no CUDA device\n"); return 77; }
    int rc = prism_backend_create("cuda", 1, 0, &g_be);
    if (rc) { printf("cuda backend: %s\n", prism_strerror(rc)); return 1; }
    printf("device: %s, pool %.1f GiB\n", g_be->i.name(g_be->ctx), gib(g_be->i.pool_cap(g_be->ctx)));
    if (json) g_json = fopen(json, "w");
    emit("{\"bench\":\"device\",\"name\":\"%s\",\"peak_tflops_ref\":%.0f,\"hbm_tbs_ref\":%.1f}", g_be->i.name(g_be->ctx),
         PEAK_TFLOPS, HBM_TBS);
    uint64_t m0 = prism_cuda_malloc_count();
    if (!only || !strcmp(only, "gemm")) bench_gemm();
    if (!only || !strcmp(only, "decode")) bench_decode(ctx);
    if (!only || !strcmp(only, "prefill")) bench_prefill(prefill);
    kit_llm_free(g_llm);
    g_llm = NULL;
    free(g_logits);
    if (!only || !strcmp(only, "vit")) bench_vit();
    printf("\ndevice allocations after start-up: %llu (must be 0)\n", (unsigned long long)(prism_cuda_malloc_count() - m0));
    emit("{\"bench\":\"allocs_after_start\",\"count\":%llu}", (unsigned long long)(prism_cuda_malloc_count() - m0));
    if (g_json) fclose(g_json);
    prism_backend_destroy(g_be);
    return 0;
}
