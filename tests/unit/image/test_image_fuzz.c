/* Mutation fuzzing of probe + decode + preprocess on valid JPEG / PNG fixtures: bit flips, byte
 * overwrites (incl. marker bytes), truncation, insertion, chunk-length corruption. Every call
 * must return a status (no crash, no ASan report) and leave no memory behind.
 * PRISM_FUZZ_ITERS overrides the iteration count (default keeps the test to a few seconds). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "image/clip.h"
#include "image/image.h"
#include "image_test_util.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rnd(void)
{
    /* xorshift64*: deterministic across platforms */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static size_t mutate(const uint8_t *src, size_t len, uint8_t *dst, size_t cap)
{
    memcpy(dst, src, len);
    size_t n = len;
    int ops = 1 + (int)(rnd() % 4);
    for (int k = 0; k < ops; k++) {
        size_t pos = n ? rnd() % n : 0;
        switch (rnd() % 7) {
        case 0: if (n) dst[pos] ^= (uint8_t)(1u << (rnd() % 8)); break;
        case 1: if (n) dst[pos] = (uint8_t)rnd(); break;
        case 2: if (n) dst[pos] = 0xFF; break;                       /* fake JPEG marker */
        case 3: n = pos; break;                                     /* truncate */
        case 4:                                                     /* insert bytes */
            if (n + 8 <= cap) {
                memmove(dst + pos + 8, dst + pos, n - pos);
                for (int i = 0; i < 8; i++)
                    dst[pos + i] = (uint8_t)rnd();
                n += 8;
            }
            break;
        case 5:                                                     /* corrupt a length field */
            if (n > 40) {
                size_t p = rnd() % (n < 200 ? n - 4 : 200);
                dst[p] = (uint8_t)rnd();
                dst[p + 1] = (uint8_t)rnd();
            }
            break;
        case 6:                                                     /* header byte (sizes, types) */
            if (n > 30) dst[rnd() % 30] = (uint8_t)rnd();
            break;
        }
    }
    return n;
}

static void test_fuzz(void **state)
{
    const char *files[] = {"jpeg_444_64x64.jpg", "jpeg_422_333x217.jpg", "jpeg_gray_300x500.jpg",
                           "jpeg_cmyk_200x150.jpg", "jpeg_prog_800x600.jpg", "png_rgba_interlaced_97x61.png",
                           "png_palette4_150x100.png", "png_gray_trns_120x120.png", "png_la_120x90.png",
                           "png_rgb16_100x80.png", "png_gray1_100x50.png", "png_palette_trns_200x200.png"};
    size_t nf = PRISM_ARRAY_LEN(files);
    uint8_t *data[PRISM_ARRAY_LEN(files)];
    size_t len[PRISM_ARRAY_LEN(files)], maxlen = 0;
    for (size_t f = 0; f < nf; f++) {
        data[f] = itu_read(files[f], &len[f]);
        maxlen = PRISM_MAX(maxlen, len[f]);
    }
    const char *env = getenv("PRISM_FUZZ_ITERS");
    long iters = env ? atol(env) : 1500;
    size_t cap = maxlen + 64;
    uint8_t *buf = prism_malloc(cap);
    prism_clip_preproc_t p;
    prism_clip_preproc_default(&p, 32);
    float out[3 * 32 * 32];
    long ok = 0, counts[16] = {0};
    static uint8_t outbuf[800 * 600 * 3];
    size_t base = prism_mem_used();
    for (long it = 0; it < iters; it++) {
        size_t f = (size_t)(rnd() % nf);
        size_t n = mutate(data[f], len[f], buf, cap);
        /* exact-size copy so ASan catches reads past the end */
        uint8_t *in = prism_malloc(n ? n : 1);
        memcpy(in, buf, n);
        prism_image_info_t info;
        int rc = prism_image_probe(in, n, &info), probe_rc = rc;
        assert_true(rc <= 0 && rc >= PRISM_ENOTFOUND);
        /* A pixel limit between a tiny one and one above every fixture, and sometimes a caller
         * buffer (the encoder's pre-sized decode buffer): whatever a mutated header claims, a
         * successful decode must respect both. */
        uint64_t limits[] = {4096, 20000, 100000, 4u << 20};
        prism_image_decode_opts_t o = {.max_pixels = limits[rnd() % 4]};
        if (rnd() % 4 == 0) {
            o.min_w = 16;
            o.min_h = 16;
        }
        if (rnd() % 3 == 0) {
            o.out_buf = outbuf;
            o.out_cap = (size_t)(rnd() % sizeof outbuf);
        }
        prism_image_t img;
        rc = prism_image_decode(in, n, &o, &img);
        assert_true(rc == PRISM_OK || rc == PRISM_ECORRUPT || rc == PRISM_ELIMIT || rc == PRISM_ENOTSUP ||
                    rc == PRISM_EINVAL);
        counts[-rc]++;
        if (rc == PRISM_OK) {
            ok++;
            assert_true(img.w > 0 && img.h > 0 && img.w <= 65535 && img.h <= 65535);
            /* the limit is on the file's declared size (a bomb is refused before decoding) */
            if ((uint64_t)img.src_w * (uint64_t)img.src_h > o.max_pixels)
                fail_msg("iteration %ld: decoded a %dx%d file with max_pixels %llu", it, img.src_w, img.src_h,
                         (unsigned long long)o.max_pixels);
            assert_true(img.w <= img.src_w && img.h <= img.src_h);
            /* the probe and the decoder agree on the declared size */
            if (probe_rc == PRISM_OK) {
                assert_int_equal(img.src_w, info.width);
                assert_int_equal(img.src_h, info.height);
            }
            if (o.out_buf) {
                if ((size_t)img.w * (size_t)img.h * 3 > o.out_cap)
                    fail_msg("iteration %ld: %dx%d RGB decoded into a %zu-byte buffer", it, img.w, img.h, o.out_cap);
                assert_ptr_equal(img.rgb, outbuf);
                assert_false(img.owned);
            }
            size_t ws = prism_clip_preprocess_workspace_bytes(&p, img.w, img.h);
            void *w = prism_malloc(ws);
            assert_int_equal(prism_clip_preprocess(&p, &img, w, ws, out), PRISM_OK);
            prism_free(w);
            prism_image_free(&img);
        } else {
            assert_null(img.rgb);
        }
        prism_free(in);
        assert_int_equal(prism_mem_used(), base);
    }
    print_message("fuzz: %ld iterations, %ld decoded, corrupt %ld, limit %ld, notsup %ld, inval %ld\n", iters, ok,
                  counts[-PRISM_ECORRUPT], counts[-PRISM_ELIMIT], counts[-PRISM_ENOTSUP], counts[-PRISM_EINVAL]);
    prism_free(buf);
    for (size_t f = 0; f < nf; f++)
        prism_free(data[f]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_fuzz)};
    return cmocka_run_group_tests_name("image_fuzz", tests, NULL, NULL);
}
