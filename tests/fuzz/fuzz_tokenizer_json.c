/* libFuzzer: tokenizer.json loading (common/tokenizer) from arbitrary text; a tokenizer that loads is
 * then used: encode a mixed-script text, decode it back, token bytes of every id. */
#include "fuzz_common.h"
#include "tokenizer/tokenizer.h"

static const char TEXT[] = "Hello world! <s> What's in the image? \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 a  b\n\t12345";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_init_once();
    prism_tokenizer_t *t = NULL;
    char err[256];
    if (prism_tokenizer_load_from_memory((const char *)data, size, &t, err, sizeof err) != PRISM_OK) {
        FUZZ_ASSERT(t == NULL && err[0]);
        return 0;
    }
    int32_t *ids = NULL;
    size_t n = 0, cap = 0;
    for (int special = 0; special < 2; special++) {
        n = 0;
        if (prism_tokenizer_encode(t, TEXT, sizeof TEXT - 1, special, &ids, &n, &cap) != PRISM_OK) continue;
        prism_buf_t out = {0};
        (void)prism_tokenizer_decode(t, ids, n, special, &out);
        prism_buf_free(&out);
    }
    size_t v = prism_tokenizer_vocab_size(t);
    prism_buf_t b = {0};
    for (size_t i = 0; i < v && i < 4096; i++) {
        b.len = 0;
        (void)prism_tokenizer_token_bytes(t, (int32_t)i, &b);
        (void)prism_tokenizer_is_special(t, (int32_t)i);
    }
    prism_buf_free(&b);
    prism_free(ids);
    prism_tokenizer_free(t);
    return 0;
}
