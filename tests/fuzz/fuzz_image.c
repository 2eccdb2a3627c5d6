/* libFuzzer: JPEG/PNG header probe and full decode (common/image: libjpeg-turbo, libspng), with the
 * bounds the encoder uses: a pixel limit, a caller buffer, and DCT downscaling on request. */
#include "fuzz_common.h"
#include "image/image.h"

#define FUZZ_MAX_PIXELS (2048u * 2048u)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    fuzz_init_once();
    uint8_t mode = data[0];
    data++, size--;
    prism_image_info_t info;
    int prc = prism_image_probe(data, size, &info);
    if (prc == PRISM_OK) FUZZ_ASSERT(info.width > 0 && info.height > 0);
    prism_image_decode_opts_t o = {.max_pixels = FUZZ_MAX_PIXELS};
    static uint8_t pool[FUZZ_MAX_PIXELS * 3];
    if (mode & 1) {                      /* the encoder's pre-sized buffer */
        o.out_buf = pool;
        o.out_cap = (mode & 2) ? sizeof pool : 64 * 64 * 3;
    }
    if (mode & 4) {                      /* DCT downscaling towards a small target */
        o.min_w = 16 + (mode >> 4) * 8;
        o.min_h = o.min_w;
    }
    prism_image_t img;
    int rc = prism_image_decode(data, size, &o, &img);
    if (rc == PRISM_OK) {
        FUZZ_ASSERT(img.w > 0 && img.h > 0 && img.rgb);
        FUZZ_ASSERT((uint64_t)img.w * img.h <= FUZZ_MAX_PIXELS);
        if (o.out_buf) FUZZ_ASSERT((size_t)img.w * img.h * 3 <= o.out_cap);
        volatile uint8_t sink = img.rgb[(size_t)img.w * img.h * 3 - 1];  /* the whole output is ours */
        (void)sink;
        prism_image_free(&img);
    }
    return 0;
}
