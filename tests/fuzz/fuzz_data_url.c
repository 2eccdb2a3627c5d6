/* libFuzzer: data URLs and strict base64 (common/image/data_url.c), then the header probe of the
 * decoded bytes, as the router does for every image_url part. */
#include "fuzz_common.h"
#include "image/data_url.h"
#include "image/image.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_init_once();
    const char *mime, *b64;
    size_t mime_len, b64_len;
    if (prism_data_url_parse((const char *)data, size, &mime, &mime_len, &b64, &b64_len) != PRISM_OK) {
        /* the payload alone is base64 too: fuzz the decoder on the raw input as well */
        b64 = (const char *)data;
        b64_len = size;
    } else {
        FUZZ_ASSERT(mime >= (const char *)data && mime + mime_len <= (const char *)data + size);
        FUZZ_ASSERT(b64 >= (const char *)data && b64 + b64_len <= (const char *)data + size);
        (void)prism_data_url_mime_is_image(mime, mime_len);
    }
    size_t cap = prism_base64_decoded_max(b64_len), n = 0;
    uint8_t *buf = malloc(cap ? cap : 1);
    if (prism_base64_decode(b64, b64_len, buf, cap, &n) == PRISM_OK) {
        FUZZ_ASSERT(n <= cap);
        prism_image_info_t info;
        (void)prism_image_probe(buf, n, &info);
        /* a one-byte-short buffer must be refused, never overrun */
        if (n > 0) {
            size_t n2 = 0;
            FUZZ_ASSERT(prism_base64_decode(b64, b64_len, buf, n - 1, &n2) != PRISM_OK);
        }
    }
    free(buf);
    return 0;
}
