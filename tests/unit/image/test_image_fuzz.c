/* Mutation fuzzing of probe + decode + preprocess on valid JPEG / PNG fixtures: bit flips, byte
 * overwrites (incl. marker bytes), truncation, insertion, chunk-length corruption. Every call
 * must return a status (no crash, no ASan report) and leave no memory behind. Each input also goes
 * through one long-lived streaming decoder (the encoder's, with its relay thread): it must reach
 * the same verdict as a fresh whole-image decode and, when both succeed, the same pixels, so no
 * corrupt image can leave state behind that changes the next one; and what it accepts respects
 * the pixel limit. PRISM_FUZZ_ITERS overrides the iteration count (default: a few seconds). */
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
    const uint64_t maxpx = 4u << 20;
    prism_image_decoder_t *dec;
    prism_image_relay_t *relay;
    /* sized as the encoder sizes them for this pixel limit: any width up to 65535 */
    assert_int_equal(prism_image_decoder_create(prism_image_decoder_bytes(PRISM_IMAGE_MAX_DIM, maxpx), &dec), PRISM_OK);
    assert_int_equal(prism_image_relay_create(PRISM_IMAGE_MAX_DIM, &relay), PRISM_OK);
    size_t sws_n = prism_clip_workspace_bound(&p, maxpx);
    void *sws = prism_malloc(sws_n);
    float sout[3 * 32 * 32];
    long same = 0;
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
        /* a pixel limit between a tiny one and one above every fixture: whatever a mutated header
         * claims, a successful decode must respect it */
        const uint64_t limits[] = {4096, 20000, 100000, maxpx};
        prism_image_decode_opts_t o = {.max_pixels = limits[rnd() % 4]};
        if (rnd() % 4 == 0) {
            o.min_w = 16;
            o.min_h = 16;
        }
        prism_image_t img;
        rc = prism_image_decode(in, n, &o, &img);
        assert_true(rc == PRISM_OK || rc == PRISM_ECORRUPT || rc == PRISM_ELIMIT || rc == PRISM_ENOTSUP ||
                    rc == PRISM_EINVAL);
        counts[-rc]++;
        /* the long-lived decoder, streaming into the preprocessor (via the relay every other time) */
        prism_clip_stream_t st;
        prism_image_sink_t sink = prism_clip_stream_sink(&st, &p, sws, sws_n, sout);
        prism_image_sink_t inner = sink;
        if (it % 2)
            sink = prism_image_relay_sink(relay, &inner);
        int src = prism_image_decoder_run(dec, in, n, &o, &sink);
        if (src == PRISM_OK)
            src = prism_clip_stream_finish(&st);
        /* the exceptions are limits checked before decoding: more whole-image memory than the
         * long-lived decoder has (a fresh decode sizes its region for the image), or a shape the
         * preprocessor cannot resize (the sink refuses it before any row) */
        int tw, th;
        bool refused_first = src == PRISM_ELIMIT && (strstr(prism_image_decoder_error(dec), "decode memory") ||
                                                     prism_clip_resize_target(&p, info.width, info.height, &tw, &th));
        if (src != rc && !refused_first)
            fail_msg("iteration %ld: streaming decoder says %s (%s), a fresh decode %s; %dx%d", it, prism_strerror(src),
                     prism_image_decoder_error(dec), prism_strerror(rc), info.width, info.height);
        if (rc == PRISM_OK && src == PRISM_OK) {
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
            /* into a caller's buffer (the encoder's pre-sized one): accepted exactly when it fits */
            if (rnd() % 3 == 0) {
                prism_image_decode_opts_t ob = o;
                ob.out_buf = outbuf;
                ob.out_cap = (size_t)(rnd() % sizeof outbuf);
                prism_image_t img2;
                int rc2 = prism_image_decode(in, n, &ob, &img2);
                size_t need = (size_t)img.w * (size_t)img.h * 3;
                if (need <= ob.out_cap) {
                    if (rc2 != PRISM_OK) fail_msg("iteration %ld: %zu bytes refused by a %zu-byte buffer", it, need, ob.out_cap);
                    assert_ptr_equal(img2.rgb, outbuf);
                    assert_false(img2.owned);
                    assert_int_equal(img2.w, img.w);
                    prism_image_free(&img2);
                } else if (rc2 != PRISM_ELIMIT) {
                    fail_msg("iteration %ld: %dx%d RGB into a %zu-byte buffer returned %d", it, img.w, img.h,
                             ob.out_cap, rc2);
                }
            }
            size_t ws = prism_clip_preprocess_workspace_bytes(&p, img.w, img.h);
            void *w = prism_malloc(ws);
            assert_int_equal(prism_clip_preprocess(&p, &img, w, ws, out), PRISM_OK);
            if (memcmp(out, sout, sizeof sout) != 0)
                fail_msg("iteration %ld: the long-lived decoder's pixels differ from a fresh decode", it);
            same++;
            prism_free(w);
            prism_image_free(&img);
        } else {
            if (rc != PRISM_OK)
                assert_null(img.rgb);
            prism_image_free(&img);
        }
        prism_free(in);
        assert_int_equal(prism_mem_used(), base);
    }
    print_message("fuzz: %ld iterations, %ld decoded (%ld identical streamed), corrupt %ld, limit %ld, notsup %ld, "
                  "inval %ld\n", iters, ok, same, counts[-PRISM_ECORRUPT], counts[-PRISM_ELIMIT],
                  counts[-PRISM_ENOTSUP], counts[-PRISM_EINVAL]);
    prism_free(sws);
    prism_image_relay_destroy(relay);
    prism_image_decoder_destroy(dec);
    prism_free(buf);
    for (size_t f = 0; f < nf; f++)
        prism_free(data[f]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_fuzz)};
    return cmocka_run_group_tests_name("image_fuzz", tests, NULL, NULL);
}
