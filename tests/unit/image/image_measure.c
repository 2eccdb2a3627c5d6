/* image_measure: numbers for the image pipeline, not a pass/fail test.
 *
 *   python3 tools/gen_image_goldens.py --measure-dir /tmp/image-measure   (needs transformers;
 *       torchvision optional, see the script)
 *   image_measure [/tmp/image-measure]
 *
 * Prints, per fixture and preprocessing size (224, 336), the difference of our output (PIL and
 * torchvision resampler modes) against the full reference arrays of both transformers backends;
 * the effect of DCT-domain downscaling (policy of prism_image_decode_opts_for_target, and a
 * 2x-target variant) against the full decode and against the reference; and decode + preprocess
 * time for a synthetic 4096x4096 JPEG with and without DCT scaling.
 */
#include "image/clip.h"
#include "image/image.h"
#include "image_test_util.h"

#include <math.h>
#include <turbojpeg.h>

typedef struct {
    double max_abs, mean_abs;
    size_t n_diff, n_over_level;
} diff_t;

static diff_t compare(const float *a, const float *b, size_t n)
{
    diff_t d = {0};
    const double level = 1.0 / 255.0 / 0.27577711 + 1e-6;   /* one uint8 step, largest std */
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]);
        d.max_abs = fmax(d.max_abs, e);
        d.mean_abs += e;
        d.n_diff += e > 0;
        d.n_over_level += e > level * 1.0001 + 1e-6 && e > 1.0 / 255.0 / 0.26130258 + 1e-5;
    }
    d.mean_abs /= (double)n;
    return d;
}

static float *preprocess(const prism_clip_preproc_t *p, const prism_image_t *img)
{
    int w, h;
    prism_clip_output_size(p, img->src_w, img->src_h, &w, &h);
    size_t ws = prism_clip_preprocess_workspace_bytes(p, img->w, img->h);
    void *wsp = prism_malloc(ws);
    float *out = prism_malloc((size_t)3 * w * h * sizeof(float));
    int rc = prism_clip_preprocess(p, img, wsp, ws, out);
    PRISM_ASSERT(rc == PRISM_OK);
    prism_free(wsp);
    return out;
}

static float *load_ref(const char *dir, const char *name, const char *tag, int size)
{
    char path[1400];
    snprintf(path, sizeof path, "%s/%s.%s%d.f32", dir, name, tag, size);
    char *buf = NULL;
    size_t len = 0;
    if (prism_read_file(path, 64u << 20, &buf, &len) != PRISM_OK)
        return NULL;
    if (len != (size_t)3 * size * size * sizeof(float)) {
        prism_free(buf);
        return NULL;
    }
    return (float *)buf;
}

static void print_diff(const char *label, diff_t d)
{
    printf("  %-34s max %.5f  mean %.2e  differing %6zu  >1 level %zu\n", label, d.max_abs, d.mean_abs, d.n_diff,
           d.n_over_level);
}

static void references(const char *dir)
{
    json_t *m = itu_manifest();
    json_t *imgs = json_object_get(m, "images");
    size_t i;
    json_t *e;
    diff_t worst[2][2] = {{{0}}};   /* [impl][ref] */
    printf("== preprocessing vs transformers references (%s)\n", dir);
    json_array_foreach(imgs, i, e) {
        const char *file = itu_str(e, "file");
        char name[256];
        snprintf(name, sizeof name, "%s", file);
        *strrchr(name, '.') = 0;
        size_t len;
        uint8_t *data = itu_read(file, &len);
        prism_image_t img;
        PRISM_ASSERT(prism_image_decode(data, len, NULL, &img) == PRISM_OK);
        printf("%s (%dx%d)\n", file, img.w, img.h);
        for (int s = 0; s < 2; s++) {
            int size = s ? 336 : 224;
            for (int impl = 0; impl < 2; impl++) {
                prism_clip_preproc_t p;
                prism_clip_preproc_default(&p, size);
                p.impl = impl ? PRISM_CLIP_RESAMPLE_TORCHVISION : PRISM_CLIP_RESAMPLE_PIL;
                float *out = preprocess(&p, &img);
                for (int r = 0; r < 2; r++) {
                    float *ref = load_ref(dir, name, r ? "tv" : "pil", size);
                    if (!ref)
                        continue;
                    diff_t d = compare(out, ref, (size_t)3 * size * size);
                    char label[96];
                    snprintf(label, sizeof label, "%d %s-mode vs %s", size, impl ? "tv" : "pil", r ? "torchvision" : "PIL");
                    print_diff(label, d);
                    worst[impl][r].max_abs = fmax(worst[impl][r].max_abs, d.max_abs);
                    worst[impl][r].mean_abs = fmax(worst[impl][r].mean_abs, d.mean_abs);
                    worst[impl][r].n_diff += d.n_diff;
                    worst[impl][r].n_over_level += d.n_over_level;
                    prism_free(ref);
                }
                prism_free(out);
            }
        }
        prism_image_free(&img);
        prism_free(data);
    }
    printf("== worst case over all images and sizes (max abs, worst mean, total differing values)\n");
    for (int impl = 0; impl < 2; impl++)
        for (int r = 0; r < 2; r++) {
            char label[96];
            snprintf(label, sizeof label, "%s-mode vs %s", impl ? "tv" : "pil", r ? "torchvision" : "PIL");
            print_diff(label, worst[impl][r]);
        }
    json_decref(m);
}

static void dct_effect(const char *dir)
{
    json_t *m = itu_manifest();
    json_t *imgs = json_object_get(m, "images");
    size_t i;
    json_t *e;
    printf("== DCT-domain downscaling (336, PIL mode): scaled decode vs full decode, and vs PIL reference\n");
    json_array_foreach(imgs, i, e) {
        const char *file = itu_str(e, "file");
        if (strncmp(file, "jpeg", 4) != 0)
            continue;
        char name[256];
        snprintf(name, sizeof name, "%s", file);
        *strrchr(name, '.') = 0;
        size_t len;
        uint8_t *data = itu_read(file, &len);
        prism_clip_preproc_t p;
        prism_clip_preproc_default(&p, 336);
        p.impl = PRISM_CLIP_RESAMPLE_PIL;   /* compared with the PIL reference arrays below */
        prism_image_info_t info;
        PRISM_ASSERT(prism_image_probe(data, len, &info) == PRISM_OK);
        int tw, th;
        PRISM_ASSERT(prism_clip_resize_target(&p, info.width, info.height, &tw, &th) == PRISM_OK);
        prism_image_t full;
        PRISM_ASSERT(prism_image_decode(data, len, NULL, &full) == PRISM_OK);
        float *a = preprocess(&p, &full);
        float *ref = load_ref(dir, name, "pil", 336);
        for (int variant = 0; variant < 3; variant++) {
            /* 0: policy (min = target when src >= 2x target); 1: min = 2x target; 2: always min = target */
            prism_image_decode_opts_t o = {0};
            if (variant == 0)
                prism_image_decode_opts_for_target(&o, &info, tw, th);
            else if (variant == 1 && info.width >= 4 * tw && info.height >= 4 * th) {
                o.min_w = 2 * tw;
                o.min_h = 2 * th;
            } else if (variant == 2) {
                o.min_w = tw;
                o.min_h = th;
            }
            if (variant > 0 && o.min_w == 0)
                continue;
            prism_image_t img;
            PRISM_ASSERT(prism_image_decode(data, len, &o, &img) == PRISM_OK);
            if (img.w == full.w) {
                prism_image_free(&img);
                if (variant == 0)
                    printf("%-26s policy: full decode (source < 2x target %dx%d)\n", file, tw, th);
                continue;
            }
            float *b = preprocess(&p, &img);
            static const char *vn[] = {"policy (min=target)", "min=2x target", "always min=target"};
            printf("%-26s %-20s decoded %4dx%-4d\n", file, vn[variant], img.w, img.h);
            print_diff("vs full decode", compare(a, b, 3 * 336 * 336));
            if (ref)
                print_diff("vs PIL reference", compare(ref, b, 3 * 336 * 336));
            prism_free(b);
            prism_image_free(&img);
        }
        prism_free(ref);
        prism_free(a);
        prism_image_free(&full);
        prism_free(data);
    }
    json_decref(m);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void timing_4096(void)
{
    const int W = 4096, H = 4096;
    uint8_t *rgb = prism_malloc((size_t)W * H * 3);
    uint64_t s = 12345;
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            int n = (int)((s >> 59) & 7) - 4;
            uint8_t *px = rgb + ((size_t)y * W + x) * 3;
            bool disc = ((x - 1500) * (x - 1500) + (y - 2200) * (y - 2200)) < 600 * 600;
            px[0] = (uint8_t)PRISM_MAX(0, PRISM_MIN(255, x * 255 / W + n));
            px[1] = (uint8_t)PRISM_MAX(0, PRISM_MIN(255, (disc ? 40 : y * 255 / H) + n));
            px[2] = (uint8_t)PRISM_MAX(0, PRISM_MIN(255, 128 + (int)(100 * sin(x / 97.0) * cos(y / 131.0)) + n));
        }
    tjhandle tj = tjInitCompress();
    unsigned char *jpg = NULL;
    unsigned long jlen = 0;
    PRISM_ASSERT(tjCompress2(tj, rgb, W, 0, H, TJPF_RGB, &jpg, &jlen, TJSAMP_420, 90, 0) == 0);
    tjDestroy(tj);
    prism_free(rgb);
    printf("== 4096x4096 JPEG (q90 4:2:0, %lu bytes): decode + preprocess to 336 (torchvision mode), median of 5\n", jlen);
    prism_clip_preproc_t p;
    prism_clip_preproc_default(&p, 336);
    prism_image_info_t info;
    PRISM_ASSERT(prism_image_probe(jpg, jlen, &info) == PRISM_OK);
    int tw, th;
    prism_clip_resize_target(&p, info.width, info.height, &tw, &th);
    float *outs[2] = {0};
    for (int dct = 0; dct < 2; dct++) {
        double td[5], tp[5];
        prism_image_decode_opts_t o = {0};
        if (dct)
            prism_image_decode_opts_for_target(&o, &info, tw, th);
        int dw = 0, dh = 0;
        for (int r = 0; r < 5; r++) {
            double t0 = prism_now_s();
            prism_image_t img;
            PRISM_ASSERT(prism_image_decode(jpg, jlen, &o, &img) == PRISM_OK);
            double t1 = prism_now_s();
            float *out = preprocess(&p, &img);
            double t2 = prism_now_s();
            td[r] = t1 - t0;
            tp[r] = t2 - t1;
            dw = img.w;
            dh = img.h;
            prism_image_free(&img);
            if (r == 0)
                outs[dct] = out;
            else
                prism_free(out);
        }
        qsort(td, 5, sizeof td[0], cmp_double);
        qsort(tp, 5, sizeof tp[0], cmp_double);
        printf("  %-13s decoded %4dx%-4d  decode %7.1f ms  preprocess %6.1f ms  total %7.1f ms\n",
               dct ? "DCT scaling" : "full decode", dw, dh, td[2] * 1e3, tp[2] * 1e3, (td[2] + tp[2]) * 1e3);
    }
    print_diff("DCT vs full (final pixels)", compare(outs[0], outs[1], 3 * 336 * 336));
    prism_free(outs[0]);
    prism_free(outs[1]);
    tjFree(jpg);
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : "/tmp/image-measure";
    references(dir);
    dct_effect(dir);
    timing_4096();
    return 0;
}
