/* prism_bench_image: times the encoder's image path on one file, in one process.
 *
 *   prism_bench_image FILE [REPS] [SIZE] [MODES]     (MODES: comma-separated, default all)
 *
 * Prints one JSON line per mode with the median and minimum over REPS runs (default 7), in wall
 * and in thread CPU milliseconds, of:
 *  - "exact":  the encoder's default path, streaming decode (full size) + CLIP preprocessing to
 *              SIZE x SIZE (default 336, torchvision arithmetic), identical to transformers;
 *  - "exact_relay": the same with preprocessing on a helper thread while decoding (the encoder's
 *              default: --decode-threads 2);
 *  - "dct":    the exact path with libjpeg-turbo DCT scaling (--jpeg-dct-scaling always);
 *  - "decode": the streaming decode alone (rows dropped), what libjpeg-turbo itself costs here;
 * and the decoder's region bytes used. tests/bench/bench_image.py runs it next to djpeg and Pillow. */
#include "core/core.h"
#include "image/clip.h"
#include "image/image.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int drop_begin(void *ud, const prism_image_t *g) { (void)ud; (void)g; return PRISM_OK; }
static int drop_row(void *ud, int y, const uint8_t *rgb) { (void)ud; (void)y; (void)rgb; return PRISM_OK; }

/* CPU time of this thread: on a shared machine it moves far less than wall time. */
static double cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static bool mode_on(const char *list, const char *mode)
{
    size_t n = strlen(mode);
    for (const char *p = list; (p = strstr(p, mode)) != NULL; p += n)
        if ((p == list || p[-1] == ',') && (p[n] == 0 || p[n] == ','))
            return true;
    return false;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help")) {
        fprintf(stderr, "usage: %s FILE [REPS] [SIZE] [exact,exact_relay,dct,decode]\n", argv[0]);
        return argc < 2 ? 2 : 0;
    }
    int reps = argc > 2 ? atoi(argv[2]) : 7, size = argc > 3 ? atoi(argv[3]) : 336;
    if (reps < 1 || reps > 1000 || size < 1 || size > 4096) {
        fprintf(stderr, "bad REPS or SIZE\n");
        return 2;
    }
    char *data;
    size_t len;
    if (prism_read_file(argv[1], 256u << 20, &data, &len) != PRISM_OK) {
        fprintf(stderr, "cannot read %s\n", argv[1]);
        return 1;
    }
    prism_image_info_t info;
    if (prism_image_probe((uint8_t *)data, len, &info) != PRISM_OK) {
        fprintf(stderr, "%s: not a JPEG or PNG\n", argv[1]);
        return 1;
    }
    uint64_t px = (uint64_t)info.width * info.height;
    prism_clip_preproc_t p;
    prism_clip_preproc_default(&p, size);
    prism_image_decoder_t *dec;
    if (prism_image_decoder_create(prism_image_decoder_bytes(info.width, px), &dec) != PRISM_OK)
        return 1;
    size_t ws_n = prism_clip_workspace_bound(&p, px);
    void *ws = prism_malloc_aligned(ws_n, 64);
    float *out = prism_malloc_aligned((size_t)3 * size * size * sizeof(float), 64);
    /* Modes take turns within each repetition so that a busy machine slows them alike. */
    enum { NM = 4 };
    const char *modes[NM] = {"exact", "exact_relay", "dct", "decode"};
    prism_image_relay_t *relay;
    if (prism_image_relay_create(info.width, &relay) != PRISM_OK)
        return 1;
    double *tm[NM], *cm[NM];
    for (int m = 0; m < NM; m++) {
        tm[m] = prism_malloc(sizeof(double) * (size_t)reps);
        cm[m] = prism_malloc(sizeof(double) * (size_t)reps);
    }
    size_t used[NM] = {0};
    for (int r = 0; r < reps; r++) {
        for (int m = 0; m < NM; m++) {
            if (argc > 4 && !mode_on(argv[4], modes[m]))
                continue;
            prism_image_decode_opts_t o = {.max_pixels = px};
            if (m == 2)
                prism_clip_decode_opts(&p, &info, &o);
            prism_clip_stream_t st;
            prism_image_sink_t sink = m == 3 ? (prism_image_sink_t){.begin = drop_begin, .row = drop_row}
                                             : prism_clip_stream_sink(&st, &p, ws, ws_n, out);
            prism_image_sink_t inner = sink;
            if (m == 1)
                sink = prism_image_relay_sink(relay, &inner);
            double t0 = prism_now_s(), c0 = cpu_ms();
            int rc = prism_image_decoder_run(dec, (uint8_t *)data, len, &o, &sink);
            if (rc == PRISM_OK && m != 3)
                rc = prism_clip_stream_finish(&st);
            tm[m][r] = (prism_now_s() - t0) * 1e3;
            cm[m][r] = cpu_ms() - c0;
            used[m] = prism_image_decoder_last_bytes(dec);
            if (rc != PRISM_OK) {
                fprintf(stderr, "%s: %s (%s)\n", modes[m], prism_strerror(rc), prism_image_decoder_error(dec));
                return 1;
            }
        }
    }
    for (int m = 0; m < NM; m++) {
        if (argc > 4 && !mode_on(argv[4], modes[m]))
            continue;
        qsort(tm[m], (size_t)reps, sizeof(double), cmp_double);
        qsort(cm[m], (size_t)reps, sizeof(double), cmp_double);
        printf("{\"mode\": \"%s\", \"file\": \"%s\", \"width\": %d, \"height\": %d, \"size\": %d, \"reps\": %d, "
               "\"median_ms\": %.2f, \"min_ms\": %.2f, \"cpu_median_ms\": %.2f, \"cpu_min_ms\": %.2f, "
               "\"decoder_bytes\": %zu, \"workspace_bytes\": %zu}\n",
               modes[m], argv[1], info.width, info.height, size, reps, tm[m][reps / 2], tm[m][0], cm[m][reps / 2],
               cm[m][0], used[m], ws_n);
        prism_free(tm[m]);
        prism_free(cm[m]);
    }
    fflush(stdout);
    prism_free_aligned(out);
    prism_free_aligned(ws);
    prism_image_decoder_destroy(dec);
    prism_image_relay_destroy(relay);
    prism_free(data);
    return 0;
}
