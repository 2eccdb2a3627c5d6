/* Decoding allocates nothing: after start-up, streaming baseline / progressive / CMYK / grayscale
 * JPEG and plain / alpha / interlaced / 16-bit PNG (with metadata) through the encoder's decoder,
 * relay and CLIP sink makes no prism_malloc call and, below us, no malloc call from libjpeg-turbo,
 * libspng or zlib either: this binary interposes malloc & co. to count every heap allocation of the
 * process. (Under AddressSanitizer, which owns malloc, only our own counter is checked.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdatomic.h>

#include "image/clip.h"
#include "image/image.h"
#include "image_gen.h"

#if defined(__SANITIZE_ADDRESS__)
#define COUNT_LIBC 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COUNT_LIBC 0
#endif
#endif
#ifndef COUNT_LIBC
#define COUNT_LIBC 1
#endif

#if COUNT_LIBC
/* glibc's allocator under its public names: every malloc of the process (libraries included)
 * comes through here. */
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);
static atomic_ulong libc_allocs;

void *malloc(size_t n)
{
    atomic_fetch_add(&libc_allocs, 1);
    return __libc_malloc(n);
}

void *calloc(size_t c, size_t n)
{
    atomic_fetch_add(&libc_allocs, 1);
    return __libc_calloc(c, n);
}

void *realloc(void *p, size_t n)
{
    atomic_fetch_add(&libc_allocs, 1);
    return __libc_realloc(p, n);
}

void free(void *p) { __libc_free(p); }

void *memalign(size_t a, size_t n)
{
    atomic_fetch_add(&libc_allocs, 1);
    return __libc_memalign(a, n);
}

void *aligned_alloc(size_t a, size_t n)
{
    atomic_fetch_add(&libc_allocs, 1);
    return __libc_memalign(a, n);
}

int posix_memalign(void **p, size_t a, size_t n)
{
    atomic_fetch_add(&libc_allocs, 1);
    *p = __libc_memalign(a, n);
    return *p ? 0 : 12;
}
#endif

static unsigned long libc_count(void)
{
#if COUNT_LIBC
    return atomic_load(&libc_allocs);
#else
    return 0;
#endif
}

typedef struct {
    const char *name;
    uint8_t *data;
    size_t len;
} file_t;

static void test_decode_allocates_nothing(void **state)
{
    file_t files[10];
    size_t nf = 0;
    uint8_t *pix3 = ig_pixels(1280, 720, 3, 1), *pix4 = ig_pixels(640, 480, 4, 2), *pix1 = ig_pixels(800, 600, 1, 3);
    ig_jpeg_t base = {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr};
    ig_jpeg_t prog = {.comps = 3, .in_cs = JCS_RGB, .jpeg_cs = JCS_YCbCr, .progressive = true};
    ig_jpeg_t cmyk = {.comps = 4, .in_cs = JCS_CMYK, .jpeg_cs = JCS_CMYK};
    ig_jpeg_t ycck = {.comps = 4, .in_cs = JCS_CMYK, .jpeg_cs = JCS_YCCK, .progressive = true};
    ig_jpeg_t gray = {.comps = 1, .in_cs = JCS_GRAYSCALE, .jpeg_cs = JCS_GRAYSCALE};
    files[nf].name = "baseline JPEG";
    files[nf].data = ig_jpeg(pix3, 1280, 720, &base, &files[nf].len), nf++;
    files[nf].name = "progressive JPEG";
    files[nf].data = ig_jpeg(pix3, 1280, 720, &prog, &files[nf].len), nf++;
    files[nf].name = "CMYK JPEG";
    files[nf].data = ig_jpeg(pix4, 640, 480, &cmyk, &files[nf].len), nf++;
    files[nf].name = "progressive YCCK JPEG";
    files[nf].data = ig_jpeg(pix4, 640, 480, &ycck, &files[nf].len), nf++;
    files[nf].name = "grayscale JPEG";
    files[nf].data = ig_jpeg(pix1, 800, 600, &gray, &files[nf].len), nf++;
    ig_png_t pngs[] = {{SPNG_COLOR_TYPE_TRUECOLOR, 8, false, false, true},
                       {SPNG_COLOR_TYPE_TRUECOLOR_ALPHA, 8, false, false, true},
                       {SPNG_COLOR_TYPE_TRUECOLOR_ALPHA, 16, true, false, false},
                       {SPNG_COLOR_TYPE_INDEXED, 8, false, true, false},
                       {SPNG_COLOR_TYPE_GRAYSCALE, 16, true, true, true}};
    const char *png_names[] = {"PNG with text", "RGBA PNG", "16-bit interlaced RGBA PNG", "palette PNG with tRNS",
                               "interlaced 16-bit gray PNG with tRNS"};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(pngs); i++) {
        files[nf].name = png_names[i];
        files[nf].data = ig_png(700, 500, &pngs[i], (uint32_t)i + 9, &files[nf].len), nf++;
    }
    prism_free(pix1);
    prism_free(pix3);
    prism_free(pix4);

    /* start-up, as the encoder does it */
    prism_clip_preproc_t p;
    prism_clip_preproc_default(&p, 336);
    uint64_t maxpx = 4096ull * 4096;
    prism_image_decoder_t *dec;
    prism_image_relay_t *relay;
    assert_int_equal(prism_image_decoder_create(prism_image_decoder_bytes(4096, maxpx), &dec), PRISM_OK);
    assert_int_equal(prism_image_relay_create(4096, &relay), PRISM_OK);
    size_t ws_n = prism_clip_workspace_bound(&p, maxpx);
    void *ws = prism_malloc(ws_n);
    float *out = prism_malloc((size_t)3 * 336 * 336 * sizeof(float));

    for (int pass = 0; pass < 2; pass++)
        for (size_t f = 0; f < nf; f++)
            for (int use_relay = 0; use_relay < 2; use_relay++) {
                uint64_t ours = prism_mem_alloc_count();
                unsigned long libc = libc_count();
                prism_clip_stream_t st;
                prism_image_sink_t sink = prism_clip_stream_sink(&st, &p, ws, ws_n, out);
                prism_image_sink_t inner = sink;
                if (use_relay)
                    sink = prism_image_relay_sink(relay, &inner);
                prism_image_decode_opts_t o = {.max_pixels = maxpx};
                int rc = prism_image_decoder_run(dec, files[f].data, files[f].len, &o, &sink);
                if (rc == PRISM_OK)
                    rc = prism_clip_stream_finish(&st);
                if (rc != PRISM_OK)
                    fail_msg("%s: %s (%s)", files[f].name, prism_strerror(rc), prism_image_decoder_error(dec));
                /* the very first image may be the first of its kind for libc internals; from the
                 * second pass on, nothing at all */
                if (pass == 1) {
                    if (prism_mem_alloc_count() != ours)
                        fail_msg("%s: %llu prism_malloc calls", files[f].name,
                                 (unsigned long long)(prism_mem_alloc_count() - ours));
                    if (libc_count() != libc)
                        fail_msg("%s (relay %d): %lu malloc calls inside the decode", files[f].name, use_relay,
                                 libc_count() - libc);
                }
            }
    /* the counter itself works: a whole-image decode allocates (its output and region) */
    uint64_t ours = prism_mem_alloc_count();
    unsigned long libc = libc_count();
    prism_image_t img;
    assert_int_equal(prism_image_decode(files[0].data, files[0].len, NULL, &img), PRISM_OK);
    assert_true(prism_mem_alloc_count() > ours);
    if (COUNT_LIBC)
        assert_true(libc_count() > libc);   /* libjpeg's create-time objects */
    prism_image_free(&img);

    prism_free(out);
    prism_free(ws);
    prism_image_relay_destroy(relay);
    prism_image_decoder_destroy(dec);
    for (size_t f = 0; f < nf; f++)
        prism_free(files[f].data);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_decode_allocates_nothing)};
    return cmocka_run_group_tests_name("image_alloc", tests, NULL, NULL);
}
