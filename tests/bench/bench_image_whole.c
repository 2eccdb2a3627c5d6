/* prism_bench_image_whole: the image path through the whole-image API only (decode the whole
 * image, then preprocess it), which is also all the encoder had before streaming, so the same file
 * builds against an older tree to time the previous code in the same run:
 *
 *   prism_bench_image_whole FILE [REPS] [SIZE]
 *   gcc -O2 -I OLD/common tests/bench/bench_image_whole.c OLD/build/common/image/libprism_image.a \
 *       OLD/build/common/core/libprism_core.a -ljansson -lspng -lturbojpeg -ljpeg -lm -lpthread
 *
 * Prints one JSON line: median and minimum wall milliseconds of decode + CLIP preprocessing to
 * SIZE x SIZE (default 336, torchvision arithmetic) at full size. */
#include "core/core.h"
#include "image/clip.h"
#include "image/image.h"

#include <stdio.h>
#include <stdlib.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE [REPS] [SIZE]\n", argv[0]);
        return 2;
    }
    int reps = argc > 2 ? atoi(argv[2]) : 7, size = argc > 3 ? atoi(argv[3]) : 336;
    if (reps < 1 || reps > 1000 || size < 1 || size > 4096)
        return 2;
    char *data;
    size_t len;
    if (prism_read_file(argv[1], 256u << 20, &data, &len) != PRISM_OK)
        return 1;
    prism_clip_preproc_t p;
    prism_clip_preproc_default(&p, size);
    float *out = prism_malloc((size_t)3 * size * size * sizeof(float));
    double *t = prism_malloc(sizeof(double) * (size_t)reps);
    for (int r = 0; r < reps; r++) {
        double t0 = prism_now_s();
        prism_image_t img;
        int rc = prism_image_decode((uint8_t *)data, len, NULL, &img);
        if (rc != PRISM_OK)
            return 1;
        size_t ws_n = prism_clip_preprocess_workspace_bytes(&p, img.w, img.h);
        void *ws = prism_malloc(ws_n);
        rc = prism_clip_preprocess(&p, &img, ws, ws_n, out);
        prism_free(ws);
        prism_image_free(&img);
        t[r] = (prism_now_s() - t0) * 1e3;
        if (rc != PRISM_OK)
            return 1;
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    printf("{\"mode\": \"whole\", \"file\": \"%s\", \"size\": %d, \"reps\": %d, \"median_ms\": %.2f, \"min_ms\": %.2f}\n",
           argv[1], size, reps, t[reps / 2], t[0]);
    prism_free(t);
    prism_free(out);
    prism_free(data);
    return 0;
}
