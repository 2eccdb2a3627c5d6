/* prism_bench_qwen_vision: the Qwen-VL vision tower on one synthetic image, CPU, for
 * tests/bench/bench_qwen_vision.py (which puts HF transformers beside it). One JSON object on stdout:
 *
 *   prism_bench_qwen_vision --model-path tests/bench/configs/qwen2.5-vl-7b --width 1024 --height 1024 \
 *                           --threads 2 --reps 3
 *
 * The model is config.json with seeded random weights (full width: the published shapes). The
 * image is the synthetic picture of tools/gen_llama4_goldens.py, preprocessed by the model's
 * processor (preprocessor_config.json of the same directory); the timed part is the tower alone
 * (prism_vision_native_encode: patch embedding through the merger), as HF's is. Figures: the
 * median of --reps runs after one warm-up; the process's peak RSS (VmHWM) and the counting
 * allocator's peak, so what the weights, the arena and the buffers cost is in the numbers. */
#include "core/core.h"
#include "core/cli.h"
#include "backend/backend.h"
#include "model/model.h"
#include "image/qwenvl_proc.h"
#include "../unit/image/llama4_synth.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double cpu_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* VmHWM of this process, bytes (0 when unknown). */
static size_t peak_rss(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    size_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) kb = (size_t)strtoull(line + 6, NULL, 10);
    if (f) fclose(f);
    return kb * 1024;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *dtype = "f32";
    int64_t width = 1024, height = 1024, threads = 1, reps = 3, seed = 1;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("model-path", &model, "Directory with config.json and preprocessor_config.json"),
        PRISM_FLAG_INT("width", &width, "Image width"),
        PRISM_FLAG_INT("height", &height, "Image height"),
        PRISM_FLAG_INT("threads", &threads, "CPU backend threads"),
        PRISM_FLAG_INT("reps", &reps, "Timed runs (after one warm-up)"),
        PRISM_FLAG_INT("seed", &seed, "Synthetic picture seed"),
        PRISM_FLAG_STR("weight-dtype", &dtype, "f32 or bf16 weight storage"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "prism_bench_qwen_vision", "The Qwen-VL vision tower on one image (CPU).",
                             flags);
    if (rc) return rc > 0 ? 0 : 2;
    if (!model || width < 1 || height < 1 || threads < 1 || reps < 1) {
        fprintf(stderr, "--model-path is required; sizes, threads and reps must be positive\n");
        return 2;
    }
    char err[512];
    prism_model_config_t cfg;
    if (prism_model_config_load(model, &cfg, err, sizeof err) != PRISM_OK) {
        fprintf(stderr, "config: %s\n", err);
        return 1;
    }
    cfg.random_weights = true;
    cfg.random_seed = 1;
    prism_qwenvl_proc_t proc;
    if (prism_qwenvl_proc_load_dir(model, &proc, err, sizeof err) != PRISM_OK) {
        fprintf(stderr, "processor: %s\n", err);
        return 1;
    }
    prism_qwenvl_grid_t g;
    if (prism_qwenvl_grid(&proc, (int)width, (int)height, &g) != PRISM_OK) {
        fprintf(stderr, "%lldx%lld: no grid\n", (long long)width, (long long)height);
        return 1;
    }
    prism_backend_t *be = prism_backend_cpu_create((int)threads);
    if (!be || (!strcmp(dtype, "bf16") && prism_backend_set_weight_dtype(be, PRISM_DTYPE_BF16) != PRISM_OK)) {
        fprintf(stderr, "backend\n");
        return 1;
    }
    double t_load = prism_now_s();
    prism_vision_native_t *v;
    if (prism_vision_native_load(be, &cfg, model, g.n_patches, &v, err, sizeof err) != PRISM_OK) {
        fprintf(stderr, "vision: %s\n", err);
        return 1;
    }
    t_load = prism_now_s() - t_load;
    /* the processor, once (the tower is what is timed) */
    prism_image_t img = {.rgb = llama4_synth_image((int)width, (int)height, (uint32_t)seed), .w = (int)width,
                         .h = (int)height, .src_w = (int)width, .src_h = (int)height, .owned = true};
    size_t ws_n = prism_qwenvl_workspace_bytes(&proc, (int)width, (int)height);
    void *ws = prism_malloc(ws_n);
    float *px = prism_malloc((size_t)g.n_patches * prism_qwenvl_patch_floats(&proc) * sizeof(float));
    float *out = prism_malloc((size_t)g.n_tokens * prism_vision_native_row_floats(&cfg) * sizeof(float));
    if (!img.rgb || !ws || !px || !out || prism_qwenvl_preprocess(&proc, &img, ws, ws_n, px) != PRISM_OK) {
        fprintf(stderr, "preprocessing failed\n");
        return 1;
    }
    prism_image_free(&img);
    prism_free(ws);
    prism_vgrid_t vg = {g.grid_h, g.grid_w};
    double *wall = calloc((size_t)reps, sizeof(double)), cpu0 = 0, cpu1 = 0;
    for (int r = -1; r < reps; r++) {   /* one warm-up */
        double c0 = cpu_now_s(), t0 = prism_now_s();
        if (prism_vision_native_encode(v, px, &vg, 1, out) != PRISM_OK) {
            fprintf(stderr, "encode failed\n");
            return 1;
        }
        double dt = prism_now_s() - t0;
        if (r >= 0) {
            wall[r] = dt;
            cpu1 += cpu_now_s() - c0;
            cpu0 += dt;
        }
    }
    double checksum = 0;
    for (size_t i = 0; i < (size_t)g.n_tokens * cfg.hidden; i++) checksum += out[i];
    qsort(wall, (size_t)reps, sizeof *wall, cmp_double);
    printf("{\"impl\": \"prism\", \"width\": %lld, \"height\": %lld, \"grid\": [%d, %d], \"patches\": %d, "
           "\"tokens\": %d, \"threads\": %lld, \"weight_dtype\": \"%s\", \"seconds\": %.3f, \"runs\": [",
           (long long)width, (long long)height, g.grid_h, g.grid_w, g.n_patches, g.n_tokens, (long long)threads, dtype,
           reps % 2 ? wall[reps / 2] : 0.5 * (wall[reps / 2 - 1] + wall[reps / 2]));
    for (int r = 0; r < reps; r++) printf("%s%.3f", r ? ", " : "", wall[r]);
    printf("], \"cpu_per_wall\": %.2f, \"load_seconds\": %.2f, \"weight_bytes\": %zu, \"arena_bytes\": %zu, "
           "\"heap_peak_bytes\": %zu, \"peak_rss_bytes\": %zu, \"checksum\": %.6g}\n",
           cpu0 > 0 ? cpu1 / cpu0 : 0, t_load, prism_vision_native_weight_bytes(v),
           prism_vision_native_arena_bytes(&cfg, g.n_patches), prism_mem_peak(), peak_rss(), checksum);
    free(wall);
    prism_free(px);
    prism_free(out);
    prism_vision_native_free(v);
    prism_backend_destroy(be);
    return 0;
}
