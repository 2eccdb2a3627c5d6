/* prism_bench_model: CPU figures for the kernel benchmark (tests/bench/bench_cpu.py drives it and
 * puts HF transformers beside it). One mode per run, one JSON object per line on stdout:
 *
 *   prism_bench_model --mode sgemm  --threads 1 --m 577 --n 4096 --k 1024   OpenBLAS sgemm GFLOP/s
 *   prism_bench_model --mode matmul --threads 1 --m 577 --n 4096 --k 1024   the backend's matmul, same shape
 *   prism_bench_model --mode mmdtype --threads 1 --m 16 --n 688 --k 256     the backend's matmul with fp32 weights,
 *                                   bf16 weights (fp32 arithmetic) and --compute-dtype bf16 on [N][K] and on
 *                                   packed weights (as the model loader packs them), and bf16 weights packed
 *                                   under fp32 compute (matmul_f32p), best GFLOP/s
 *   prism_bench_model --mode copy   --threads 1                             memcpy and read-only bandwidth GB/s
 *   prism_bench_model --mode qkrows --k 32                                  the selected table's qk_rows (decode
 *                                   attention scores) ns/call for m 1..8 query rows x n 16..2048 keys
 *   prism_bench_model --mode vit    --threads 1 --model-path DIR            ViT + projector ms/image
 *   prism_bench_model --mode llm    --threads 1 --model-path DIR --tokens 2048 --decode-tokens 32
 *                                   prefill ms and batch-1 decode tokens/s
 *
 * Models come from config.json with seeded random weights (--random-weights), or from the
 * checkpoint with --checkpoint. Every figure is the median of --reps timed runs after one warm-up.
 */
#include "core/core.h"
#include "core/cli.h"
#include "backend/backend.h"
#include "backend/cpu/cpu_kern.h"
#include "model/model.h"

#include <cblas.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

static void print_runs(const double *v, int n)
{
    printf("[");
    for (int i = 0; i < n; i++) printf("%s%.3f", i ? "," : "", v[i]);
    printf("]");
}

/* CPU seconds of the whole process (all threads): on a shared machine, wall time / CPU time
 * says how much of the run was spent waiting for a core. */
static double cpu_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void fill_rand(float *x, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        x[i] = (float)((s >> 40) * (1.0 / 16777216.0)) - 0.5f;
    }
}

/* ---- sgemm: the same call the backend's matmul makes (x · Wᵀ, row-major) ---- */

/* One timed OpenBLAS sgemm with its own `threads` threads (restored afterwards to what the backend
 * set: 1 today, n_threads in builds before issue 17, which --baseline-build may be); GFLOP/s. */
static double sgemm_once(int threads, const float *x, const float *w, float *y, int M, int N, int K)
{
    int prev = openblas_get_num_threads();
    openblas_set_num_threads(threads);
    double t0 = prism_now_s();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, w, K, 0.0f, y, N);
    double dt = prism_now_s() - t0;
    openblas_set_num_threads(prev);
    return 2.0 * M * N * K / dt / 1e9;
}

static int run_sgemm(int threads, int reps, int M, int N, int K)
{
    float *x = prism_malloc_aligned(sizeof(float) * (size_t)M * K, 64);
    float *w = prism_malloc_aligned(sizeof(float) * (size_t)N * K, 64);
    float *y = prism_malloc_aligned(sizeof(float) * (size_t)M * N, 64);
    if (!x || !w || !y) PRISM_FATAL("sgemm: out of memory");
    fill_rand(x, (size_t)M * K, 1);
    fill_rand(w, (size_t)N * K, 2);
    openblas_set_num_threads(threads);
    double gf[64];
    if (reps > 64) reps = 64;
    for (int r = -1; r < reps; r++) {
        double t0 = prism_now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, w, K, 0.0f, y, N);
        double dt = prism_now_s() - t0;
        if (r >= 0) gf[r] = 2.0 * M * N * K / dt / 1e9;
    }
    printf("{\"mode\":\"sgemm\",\"threads\":%d,\"m\":%d,\"n\":%d,\"k\":%d,\"gflops_runs\":", threads, M, N, K);
    print_runs(gf, reps);
    printf(",\"gflops\":%.2f}\n", median(gf, reps));
    prism_free_aligned(x);
    prism_free_aligned(w);
    prism_free_aligned(y);
    return 0;
}

/* ---- the backend's matmul on the same shape (its pool over single-threaded sgemm slices) ---- */

static int run_matmul(int threads, int reps, int M, int N, int K)
{
    prism_backend_t *be = prism_backend_cpu_create(threads);
    float *x = prism_malloc_aligned(sizeof(float) * (size_t)M * K, 64);
    float *w = prism_malloc_aligned(sizeof(float) * (size_t)N * K, 64);
    float *y = prism_malloc_aligned(sizeof(float) * (size_t)M * N, 64);
    if (!be || !x || !w || !y) PRISM_FATAL("matmul: out of memory");
    fill_rand(x, (size_t)M * K, 1);
    fill_rand(w, (size_t)N * K, 2);
    double gf[64], sg[64], ratio[64];
    if (reps > 64) reps = 64;
    for (int r = -1; r < reps; r++) {   /* alternating with OpenBLAS's own threading, same shape */
        double t0 = prism_now_s();
        if (be->i.matmul(be->ctx, y, N, x, K, w, PRISM_DTYPE_F32, NULL, M, N, K, false)) PRISM_FATAL("matmul");
        double dt = prism_now_s() - t0;
        double g = sgemm_once(threads, x, w, y, M, N, K);
        if (r >= 0) {
            gf[r] = 2.0 * M * N * K / dt / 1e9;
            sg[r] = g;
            ratio[r] = gf[r] / g;
        }
    }
    printf("{\"mode\":\"matmul\",\"threads\":%d,\"m\":%d,\"n\":%d,\"k\":%d,\"gflops_runs\":", threads, M, N, K);
    print_runs(gf, reps);
    printf(",\"gflops\":%.2f,\"sgemm_gflops\":%.2f,\"vs_sgemm\":%.3f}\n", median(gf, reps), median(sg, reps),
           median(ratio, reps));
    prism_free_aligned(x);
    prism_free_aligned(w);
    prism_free_aligned(y);
    prism_backend_destroy(be);
    return 0;
}

/* ---- the backend's matmul per dtype: f32 weights, bf16 weights (--weight-dtype bf16), bf16 dot
 * products (--compute-dtype bf16) on [N][K] weights (matmul_bf16dp) and on the packed weights the
 * model loader gives it (weight_pack: matmul_bf16p; 0 where the backend does not pack), interleaved
 * run by run so a busy machine hurts all alike ---- */

static int run_mmdtype(int threads, int reps, int M, int N, int K)
{
    enum { D = 5 };
    prism_backend_t *be[D];
    for (int d = 0; d < D; d++) be[d] = prism_backend_cpu_create(threads);
    static const char *const name[D] = {"f32", "bf16_weights", "bf16_compute", "bf16_packed", "f32_packed"};
    float *x = prism_malloc_aligned(sizeof(float) * (size_t)M * K, 64);
    float *w = prism_malloc_aligned(sizeof(float) * (size_t)N * K, 64);
    uint16_t *wb = prism_malloc_aligned(sizeof(uint16_t) * (size_t)N * K, 64);
    float *y = prism_malloc_aligned(sizeof(float) * (size_t)M * N, 64);
    if (!be[0] || !be[1] || !be[2] || !be[3] || !be[4] || !x || !w || !wb || !y) PRISM_FATAL("mmdtype: out of memory");
    if (prism_backend_set_weight_dtype(be[1], PRISM_DTYPE_BF16) ||
        prism_backend_set_compute_dtype(be[2], PRISM_DTYPE_BF16) ||
        prism_backend_set_compute_dtype(be[3], PRISM_DTYPE_BF16) ||
        prism_backend_set_weight_dtype(be[4], PRISM_DTYPE_BF16))
        PRISM_FATAL("mmdtype: bf16 refused");
    fill_rand(x, (size_t)M * K, 1);
    fill_rand(w, (size_t)N * K, 2);
    for (size_t i = 0; i < (size_t)N * K; i++) wb[i] = prism_f32_to_bf16(w[i]);
    size_t pbytes = be[3]->i.weight_pack_bytes ? be[3]->i.weight_pack_bytes(be[3]->ctx, N, K) : 0;
    void *wp = pbytes ? prism_backend_buf_alloc(be[3], pbytes) : NULL;
    if (wp) {
        memcpy(wp, wb, sizeof(uint16_t) * (size_t)N * K);
        if (be[3]->i.weight_pack(be[3]->ctx, wp, N, K)) PRISM_FATAL("mmdtype: packing refused");
    }
    /* bf16 weights under fp32 compute, packed where the table has matmul_f32p (AVX-512) */
    size_t fbytes = be[4]->i.weight_pack_bytes ? be[4]->i.weight_pack_bytes(be[4]->ctx, N, K) : 0;
    void *wf = fbytes ? prism_backend_buf_alloc(be[4], fbytes) : NULL;
    if (wf) {
        memcpy(wf, wb, sizeof(uint16_t) * (size_t)N * K);
        if (be[4]->i.weight_pack(be[4]->ctx, wf, N, K)) PRISM_FATAL("mmdtype: packing refused");
    }
    /* enough calls per timing for ~20 ms */
    int calls = (int)PRISM_MAX(1, PRISM_MIN(100000, 2e7 / ((double)M * N * K)));
    double best[D] = {0};
    if (reps > 64) reps = 64;
    for (int r = -1; r < reps; r++)
        for (int d = 0; d < D; d++) {
            const void *wt = d == 4 ? wf : d == 3 ? wp : d ? (const void *)wb : (const void *)w;
            prism_dtype_t dt = d ? PRISM_DTYPE_BF16 : PRISM_DTYPE_F32;
            if (!wt) continue;
            double t0 = prism_now_s();
            for (int c = 0; c < calls; c++)
                if (be[d]->i.matmul(be[d]->ctx, y, N, x, K, wt, dt, NULL, M, N, K, false)) PRISM_FATAL("matmul");
            double g = 2.0 * M * N * K * calls / (prism_now_s() - t0) / 1e9;
            if (r >= 0 && g > best[d]) best[d] = g;
        }
    printf("{\"mode\":\"mmdtype\",\"threads\":%d,\"m\":%d,\"n\":%d,\"k\":%d", threads, M, N, K);
    for (int d = 0; d < D; d++) printf(",\"%s_gflops\":%.2f", name[d], best[d]);
    printf(",\"bf16_compute_vs_f32\":%.2f,\"bf16_packed_vs_compute\":%.2f,\"f32_packed_vs_bf16_weights\":%.2f}\n",
           best[2] / best[0], best[3] / best[2], best[4] / best[1]);
    prism_backend_buf_free(be[3], wp);
    prism_backend_buf_free(be[4], wf);
    prism_free_aligned(x);
    prism_free_aligned(w);
    prism_free_aligned(wb);
    prism_free_aligned(y);
    for (int d = 0; d < D; d++) prism_backend_destroy(be[d]);
    return 0;
}

/* ---- qk_rows: decode attention scores S[i][j] = Q[i]·K[j] over key rows given as pointers, as
 * cpu_attn.c passes them (rows of a paged cache: here every other row of a strided block) ---- */

static int run_qkrows(int reps, int hd)
{
    const prism_cpu_kern_t *kk = prism_cpu_kern_select(getenv("PRISM_CPU_ISA"));
    enum { NMAX = 2048, MMAX = 8 };
    int ld = hd + 16;
    float *kv = prism_malloc_aligned(sizeof(float) * (size_t)2 * NMAX * ld, 64);
    float *Q = prism_malloc_aligned(sizeof(float) * (size_t)MMAX * hd, 64);
    float *S = prism_malloc_aligned(sizeof(float) * (size_t)MMAX * NMAX, 64);
    const float **kr = malloc(sizeof(*kr) * NMAX);
    if (!kv || !Q || !S || !kr) PRISM_FATAL("qkrows: out of memory");
    fill_rand(kv, (size_t)2 * NMAX * ld, 1);
    fill_rand(Q, (size_t)MMAX * hd, 2);
    for (int j = 0; j < NMAX; j++) kr[j] = kv + (size_t)2 * j * ld;
    static const int ns[] = {16, 64, 256, 2048};
    if (reps > 64) reps = 64;
    for (int m = 1; m <= MMAX; m++)
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            int n = ns[ni];
            int calls = (int)PRISM_MAX(1, 2e6 / ((double)m * n * hd));   /* ~1 ms a timing */
            double best = 1e30;
            for (int r = -1; r < reps; r++) {
                double t0 = prism_now_s();
                for (int c = 0; c < calls; c++) kk->qk_rows(S, NMAX, Q, hd, kr, m, n, hd);
                double dt = (prism_now_s() - t0) / calls;
                if (r >= 0 && dt < best) best = dt;
            }
            printf("{\"mode\":\"qkrows\",\"isa\":\"%s\",\"hd\":%d,\"m\":%d,\"n\":%d,\"ns\":%.1f,"
                   "\"gflops\":%.2f}\n", kk->name, hd, m, n, best * 1e9, 2.0 * m * n * hd / best / 1e9);
        }
    free(kr);
    prism_free_aligned(kv);
    prism_free_aligned(Q);
    prism_free_aligned(S);
    return 0;
}

/* ---- memory bandwidth: buffers far beyond the last-level cache, split over threads ----
 * Two references for a decode step, which only reads its weights:
 *   copy: memcpy, GB/s counting bytes read + bytes written, as STREAM counts copy;
 *   read: a read-only stream (a sum over the buffer), GB/s of bytes read — what one core can pull
 *         is bounded by its outstanding cache misses, so at few threads it sits well below copy. */

typedef struct {
    uint8_t *dst;                 /* NULL: read only */
    const uint8_t *src;
    size_t n;
    uint64_t sum;
} copy_arg_t;

#define READ_PF_BYTES 4096

/* A read-only stream with the widest loads the CPU has: a core keeps a bounded number of loads in
 * flight, so narrow loads (four per cache line) pull ~30% less than one 64-byte load per line. */
#define READ_STREAM(name, bytes_per_vec, target)                                                   \
    target static uint64_t name(const uint8_t *p, size_t n)                                       \
    {                                                                                             \
        typedef uint64_t vec __attribute__((vector_size(bytes_per_vec)));                         \
        vec s0 = {0}, s1 = s0, s2 = s0, s3 = s0;                                                  \
        const vec *v = (const vec *)(const void *)p; /* 4096-aligned buffers, 256-byte slices */  \
        for (size_t i = 0; i < n / (4 * bytes_per_vec); i++, v += 4) {                            \
            for (size_t l = 0; l < 4 * bytes_per_vec; l += 64)                                    \
                __builtin_prefetch((const uint8_t *)v + READ_PF_BYTES + l);                       \
            s0 += v[0];                                                                           \
            s1 += v[1];                                                                           \
            s2 += v[2];                                                                           \
            s3 += v[3];                                                                           \
        }                                                                                         \
        vec s = s0 ^ s1 ^ s2 ^ s3;                                                                \
        uint64_t r = 0;                                                                           \
        for (size_t j = 0; j < bytes_per_vec / 8; j++) r ^= s[j];                                 \
        return r;                                                                                 \
    }
READ_STREAM(read_stream_16, 16, )
#if defined(__x86_64__) && defined(__GNUC__)
READ_STREAM(read_stream_32, 32, __attribute__((target("avx2"))))
READ_STREAM(read_stream_64, 64, __attribute__((target("avx512f"))))
#endif

static uint64_t read_stream(const uint8_t *p, size_t n)
{
#if defined(__x86_64__) && defined(__GNUC__)
    prism_cpu_isa_t isa = prism_cpu_isa_detect();   /* the backend's own cpuid + OS-state check */
    if (isa >= PRISM_CPU_ISA_AVX512) return read_stream_64(p, n);
    if (isa == PRISM_CPU_ISA_AVX2) return read_stream_32(p, n);
#endif
    return read_stream_16(p, n);
}

static void *copy_main(void *p)
{
    copy_arg_t *a = p;
    if (a->dst)
        memcpy(a->dst, a->src, a->n);
    else
        a->sum = read_stream(a->src, a->n);
    return NULL;
}

static volatile uint64_t read_sink;

/* One pass over `bytes` split over `threads` threads: a memcpy into dst, or with dst NULL a
 * read-only stream of src. GB/s as described above. */
static double copy_once(int threads, uint8_t *dst, const uint8_t *src, size_t bytes)
{
    pthread_t th[64];
    copy_arg_t args[64];
    if (threads > 64) threads = 64;
    double t0 = prism_now_s();
    for (size_t i = 0; i < (size_t)threads; i++) {
        size_t nt = (size_t)threads, a = bytes * i / nt / 256 * 256, b = bytes * (i + 1) / nt / 256 * 256;
        args[i] = (copy_arg_t){dst ? dst + a : NULL, src + a, b - a, 0};
        if (i) pthread_create(&th[i], NULL, copy_main, &args[i]);
    }
    copy_main(&args[0]);
    for (int i = 1; i < threads; i++) pthread_join(th[i], NULL);
    double s = prism_now_s() - t0;
    for (int i = 0; i < threads; i++) read_sink ^= args[i].sum;
    return (dst ? 2.0 : 1.0) * (double)bytes / s / 1e9;
}

static int run_copy(int threads, int reps)
{
    const size_t bytes = (size_t)512 << 20;
    uint8_t *src = prism_malloc_aligned(bytes, 4096), *dst = prism_malloc_aligned(bytes, 4096);
    if (!src || !dst) PRISM_FATAL("copy: out of memory");
    memset(src, 1, bytes);
    memset(dst, 2, bytes);
    double gbs[64], rgbs[64];
    if (reps > 64) reps = 64;
    for (int r = -1; r < reps; r++) {
        double g = copy_once(threads, dst, src, bytes);
        /* src then dst read back to back: 1 GiB read in order, so nothing is left in the cache */
        double rg = 0.5 * (copy_once(threads, NULL, src, bytes) + copy_once(threads, NULL, dst, bytes));
        if (r >= 0) gbs[r] = g, rgbs[r] = rg;
    }
    printf("{\"mode\":\"copy\",\"threads\":%d,\"bytes\":%zu,\"gbs_runs\":", threads, bytes);
    print_runs(gbs, reps);
    printf(",\"read_gbs_runs\":");
    print_runs(rgbs, reps);
    double gm = median(gbs, reps), rm = median(rgbs, reps);
    printf(",\"gbs\":%.2f,\"read_gbs\":%.2f}\n", gm, rm);
    prism_free_aligned(src);
    prism_free_aligned(dst);
    return 0;
}

/* ---- models ---- */

static int load_cfg(const char *dir, bool checkpoint, prism_model_config_t *cfg)
{
    char err[512] = "";
    if (prism_model_config_load(dir, cfg, err, sizeof err)) PRISM_FATAL("config: %s", err);
    cfg->random_weights = !checkpoint;
    cfg->random_seed = 1234;
    return 0;
}

static bool g_bf16;     /* --bf16-weights */
static bool g_bf16dp;   /* --bf16-compute */

/* The backend the vit and llm modes run on: weights bf16 with --bf16-weights, bf16 arithmetic too
 * with --bf16-compute. */
static prism_backend_t *model_backend(int threads)
{
    prism_backend_t *be = prism_backend_cpu_create(threads);
    if (be && g_bf16 && prism_backend_set_weight_dtype(be, PRISM_DTYPE_BF16)) PRISM_FATAL("bf16 weights refused");
    if (be && g_bf16dp && prism_backend_set_compute_dtype(be, PRISM_DTYPE_BF16)) PRISM_FATAL("bf16 compute refused");
    return be;
}

static int run_vit(const char *dir, bool checkpoint, int threads, int reps)
{
    prism_model_config_t cfg;
    load_cfg(dir, checkpoint, &cfg);
    if (!cfg.has_vision) PRISM_FATAL("%s has no vision tower", dir);
    prism_backend_t *be = model_backend(threads);
    char err[512] = "";
    prism_vision_t *v = NULL;
    if (!be || prism_vision_load(be, &cfg, dir, 1, &v, err, sizeof err)) PRISM_FATAL("vision: %s", err);
    size_t S = (size_t)cfg.v_image_size, npix = 3 * S * S;
    size_t nout = (size_t)cfg.image_seq_length * cfg.hidden;
    float *pix = prism_xmalloc(npix * sizeof(float)), *out = prism_xmalloc(nout * sizeof(float));
    fill_rand(pix, npix, 3);
    /* OpenBLAS sgemm on the ViT's largest GEMM, timed right after each image: on a shared
     * machine the ratio of neighbouring runs is steadier than either figure. */
    enum { RM = 577, RN = 4096, RK = 1024 };
    float *rx = prism_xmalloc(sizeof(float) * RM * RK), *rw = prism_xmalloc(sizeof(float) * RN * RK);
    float *ry = prism_xmalloc(sizeof(float) * RM * RN);
    fill_rand(rx, (size_t)RM * RK, 4);
    fill_rand(rw, (size_t)RN * RK, 5);
    double ms[64], cms[64], sg[64], ratio[64];
    if (reps > 64) reps = 64;
    for (int r = -1; r < reps; r++) {
        double t0 = prism_now_s(), c0 = cpu_now_s();
        if (prism_vision_encode(v, pix, 1, out)) PRISM_FATAL("vision encode");
        double t1 = prism_now_s(), c1 = cpu_now_s();
        double g = 0;
        for (int i = 0; i < 3; i++) g = PRISM_MAX(g, sgemm_once(threads, rx, rw, ry, RM, RN, RK));
        if (r >= 0) {
            ms[r] = (t1 - t0) * 1e3;
            cms[r] = (c1 - c0) * 1e3;
            sg[r] = g;
        }
    }
    /* FLOPs of the layers actually run: 2·(4·VH² + 2·VH·VI) per token per layer for the GEMMs,
     * 4·seq·VH per token per layer for QKᵀ and PV, plus patch embedding and projector. */
    int g = cfg.v_image_size / cfg.v_patch, np = g * g, seq = np + 1;
    int n_run = cfg.v_feature_layer < 0 ? cfg.v_layers + 1 + cfg.v_feature_layer : cfg.v_feature_layer;
    double VH = cfg.v_hidden, VI = cfg.v_intermediate, H = cfg.hidden;
    double flops = (double)n_run * seq * (2.0 * (4 * VH * VH + 2 * VH * VI) + 4.0 * seq * VH) +
                   2.0 * np * VH * (3.0 * cfg.v_patch * cfg.v_patch) +
                   2.0 * cfg.image_seq_length * (VH * H + H * H);
    for (int r = 0; r < reps; r++) ratio[r] = flops / (ms[r] / 1e3) / 1e9 / sg[r];
    printf("{\"mode\":\"vit\",\"threads\":%d,\"layers\":%d,\"gflop\":%.1f,\"ms_runs\":", threads, n_run, flops / 1e9);
    print_runs(ms, reps);
    printf(",\"sgemm_gflops_runs\":");
    print_runs(sg, reps);
    double med = median(ms, reps);
    printf(",\"ms\":%.1f,\"cpu_ms\":%.1f,\"gflops\":%.2f,\"sgemm_gflops\":%.2f,\"vs_sgemm\":%.3f}\n", med,
           median(cms, reps), flops / (med / 1e3) / 1e9, median(sg, reps), median(ratio, reps));
    prism_free(rx);
    prism_free(rw);
    prism_free(ry);
    prism_free(pix);
    prism_free(out);
    prism_vision_free(v);
    prism_backend_destroy(be);
    return 0;
}

static int run_llm(const char *dir, bool checkpoint, int threads, int reps, int tokens, int chunk, int prompt,
                   int decode_tokens)
{
    prism_model_config_t cfg;
    load_cfg(dir, checkpoint, &cfg);
    if (chunk <= 0 || chunk > tokens) chunk = tokens;
    const int bs = 16;
    int ctx = PRISM_MAX(tokens, prompt + decode_tokens) + 1;
    int n_blocks = (ctx + bs - 1) / bs;
    prism_backend_t *be = model_backend(threads);
    char err[512] = "";
    prism_llm_t *m = NULL;
    prism_kv_cache_t *kv = NULL;
    if (!be || prism_llm_load(be, &cfg, dir, chunk, 1, &m, err, sizeof err)) PRISM_FATAL("llm: %s", err);
    if (prism_kv_cache_create(be, &cfg, n_blocks, bs, &kv)) PRISM_FATAL("kv cache");
    int32_t *table = prism_xmalloc(sizeof(int32_t) * (size_t)n_blocks);
    for (int i = 0; i < n_blocks; i++) table[i] = i;
    const int32_t *tables[1] = {table};
    int32_t *ids = prism_xmalloc(sizeof(int32_t) * (size_t)ctx);
    for (int i = 0; i < ctx; i++) ids[i] = (int32_t)((i * 7919u + 17u) % (unsigned)cfg.vocab);
    float *logits = prism_xmalloc(sizeof(float) * (size_t)cfg.vocab);

    /* prefill of `tokens` tokens in chunks of `chunk` (one forward each) */
    double pms[64], tps[64], pcms[64], tcms[64], cbw[64], rbw[64], roof[64], rroof[64];
    const size_t cbytes = (size_t)256 << 20;
    uint8_t *csrc = prism_malloc_aligned(cbytes, 4096), *cdst = prism_malloc_aligned(cbytes, 4096);
    if (!csrc || !cdst) PRISM_FATAL("copy buffers: out of memory");
    memset(csrc, 1, cbytes);
    memset(cdst, 2, cbytes);
    if (reps > 64) reps = 64;
    for (int r = -1; r < reps; r++) {
        double t0 = prism_now_s(), c0 = cpu_now_s();
        for (int p = 0; p < tokens; p += chunk) {
            int n = PRISM_MIN(chunk, tokens - p);
            int32_t start[2] = {0, n}, pos0[1] = {p};
            prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = n, .tokens = ids + p, .seq_start = start, .pos0 = pos0,
                                   .block_tables = tables};
            if (prism_llm_forward(m, kv, &b, logits)) PRISM_FATAL("prefill forward");
        }
        if (r >= 0) {
            pms[r] = (prism_now_s() - t0) * 1e3;
            pcms[r] = (cpu_now_s() - c0) * 1e3;
        }
    }
    /* batch-1 decode after a `prompt`-token prefill (greedy on the random model's logits) */
    for (int r = -1; r < reps; r++) {
        for (int p = 0; p < prompt; p += chunk) {
            int n = PRISM_MIN(chunk, prompt - p);
            int32_t start[2] = {0, n}, pos0[1] = {p};
            prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = n, .tokens = ids + p, .seq_start = start, .pos0 = pos0,
                                   .block_tables = tables};
            if (prism_llm_forward(m, kv, &b, logits)) PRISM_FATAL("prompt forward");
        }
        double t0 = prism_now_s(), c0 = cpu_now_s();
        for (int i = 0; i < decode_tokens; i++) {
            int32_t tok = 0;
            for (int j = 1; j < cfg.vocab; j++)
                if (logits[j] > logits[tok]) tok = j;
            int32_t start[2] = {0, 1}, pos0[1] = {prompt + i};
            prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = 1, .tokens = &tok, .seq_start = start, .pos0 = pos0,
                                   .block_tables = tables};
            if (prism_llm_forward(m, kv, &b, logits)) PRISM_FATAL("decode forward");
        }
        double t1 = prism_now_s(), c1 = cpu_now_s();
        /* the copy and read bandwidths right after the steps: the rooflines of this very run */
        double bw = 0, rb = 0;
        for (int i = 0; i < 3; i++) {
            bw = PRISM_MAX(bw, copy_once(threads, cdst, csrc, cbytes));
            rb = PRISM_MAX(rb, 0.5 * (copy_once(threads, NULL, csrc, cbytes) + copy_once(threads, NULL, cdst, cbytes)));
        }
        if (r >= 0) {
            tps[r] = decode_tokens / (t1 - t0);
            tcms[r] = (c1 - c0) * 1e3 / decode_tokens;
            cbw[r] = bw;
            rbw[r] = rb;
        }
    }
    /* Bytes a decode step must stream: every weight except the embedding table (one row read). */
    size_t wbytes = prism_llm_weight_bytes(m);
    size_t emb = (size_t)cfg.vocab * cfg.hidden * prism_dtype_size(be->weight_dtype);
    size_t step_bytes = wbytes - (cfg.tie_word_embeddings ? 0 : emb);
    for (int r = 0; r < reps; r++) {
        roof[r] = tps[r] / (cbw[r] * 1e9 / (double)step_bytes);
        rroof[r] = tps[r] / (rbw[r] * 1e9 / (double)step_bytes);
    }
    printf("{\"mode\":\"llm\",\"threads\":%d,\"tokens\":%d,\"chunk\":%d,\"prompt\":%d,\"decode_tokens\":%d,"
           "\"weight_dtype\":\"%s\",\"weight_bytes\":%zu,\"decode_bytes_per_token\":%zu,\"prefill_ms_runs\":",
           threads, tokens, chunk, prompt, decode_tokens, prism_dtype_name(be->weight_dtype), wbytes, step_bytes);
    print_runs(pms, reps);
    printf(",\"decode_tok_s_runs\":");
    print_runs(tps, reps);
    double pm = median(pms, reps), tm = median(tps, reps);
    printf(",\"prefill_ms\":%.1f,\"prefill_cpu_ms\":%.1f,\"prefill_tok_s\":%.1f,\"decode_tok_s\":%.2f,"
           "\"decode_cpu_ms_per_token\":%.2f,\"copy_gbs\":%.2f,\"vs_roofline\":%.3f,\"read_gbs\":%.2f,"
           "\"vs_read_roofline\":%.3f}\n", pm, median(pcms, reps), tokens / (pm / 1e3), tm, median(tcms, reps),
           median(cbw, reps), median(roof, reps), median(rbw, reps), median(rroof, reps));
    prism_free_aligned(csrc);
    prism_free_aligned(cdst);
    prism_free(ids);
    prism_free(table);
    prism_free(logits);
    prism_kv_cache_free(kv);
    prism_llm_free(m);
    prism_backend_destroy(be);
    return 0;
}

int main(int argc, char **argv)
{
    const char *mode = NULL, *model = NULL;
    int64_t threads = 1, reps = 3, m = 577, n = 4096, k = 1024, tokens = 2048, chunk = 0, prompt = 128, dec = 32;
    bool checkpoint = false;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("mode", &mode, "sgemm | matmul | mmdtype | qkrows | copy | vit | llm"),
        PRISM_FLAG_STR("model-path", &model, "Directory with config.json (vit, llm)"),
        PRISM_FLAG_BOOL("checkpoint", &checkpoint, "Read the safetensors instead of seeded random weights"),
        PRISM_FLAG_BOOL("bf16-weights", &g_bf16, "vit, llm: store the weights as bf16 (--weight-dtype bf16)"),
        PRISM_FLAG_BOOL("bf16-compute", &g_bf16dp, "vit, llm: bf16 dot-product matmuls (--compute-dtype bf16)"),
        PRISM_FLAG_INT("threads", &threads, "Backend threads (OpenBLAS threads for sgemm, copy threads for copy)"),
        PRISM_FLAG_INT("reps", &reps, "Timed repetitions after one warm-up (median reported, at most 64)"),
        PRISM_FLAG_INT("m", &m, "sgemm rows of x"),
        PRISM_FLAG_INT("n", &n, "sgemm rows of W (output features)"),
        PRISM_FLAG_INT("k", &k, "sgemm inner dimension (qkrows: head_dim)"),
        PRISM_FLAG_INT("tokens", &tokens, "llm: prefill length"),
        PRISM_FLAG_INT("chunk", &chunk, "llm: prefill tokens per forward (0: the whole prompt at once)"),
        PRISM_FLAG_INT("prompt", &prompt, "llm: prompt length before the timed decode steps"),
        PRISM_FLAG_INT("decode-tokens", &dec, "llm: timed decode steps at batch 1"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "prism_bench_model", "CPU kernel and model benchmark (JSON lines).", flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init("bench_model", PRISM_LOG_WARN);
    if (threads < 1 || threads > 64 || reps < 1 || m < 1 || n < 1 || k < 1 || tokens < 1 || prompt < 1 || dec < 1) {
        fprintf(stderr, "prism_bench_model: bad sizes\n");
        return 2;
    }
    if (!mode) {
        fprintf(stderr, "prism_bench_model: --mode is required (see --help)\n");
        return 2;
    }
    prism_backend_cpu_blas_setup();   /* the same OpenBLAS kernels the backend uses, for the sgemm reference too */
    if (!strcmp(mode, "sgemm")) return run_sgemm((int)threads, (int)reps, (int)m, (int)n, (int)k);
    if (!strcmp(mode, "qkrows")) return run_qkrows((int)reps, (int)k);
    if (!strcmp(mode, "copy")) return run_copy((int)threads, (int)reps);
    if (!strcmp(mode, "matmul")) return run_matmul((int)threads, (int)reps, (int)m, (int)n, (int)k);
    if (!strcmp(mode, "mmdtype")) return run_mmdtype((int)threads, (int)reps, (int)m, (int)n, (int)k);
    if (!model) {
        fprintf(stderr, "prism_bench_model: --model-path is required for --mode %s\n", mode);
        return 2;
    }
    if (!strcmp(mode, "vit")) return run_vit(model, checkpoint, (int)threads, (int)reps);
    if (!strcmp(mode, "llm"))
        return run_llm(model, checkpoint, (int)threads, (int)reps, (int)tokens, (int)chunk, (int)prompt, (int)dec);
    fprintf(stderr, "prism_bench_model: unknown --mode %s\n", mode);
    return 2;
}
