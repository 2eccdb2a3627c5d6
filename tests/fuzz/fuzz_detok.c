/* libFuzzer: the streaming detokenizer (common/tokenizer/tok_decode.c) over the bundled model's real
 * tokenizer, fed arbitrary id sequences as a worker's Tokens messages would (ids may be out of range).
 * Invariants: the work stays linear in the ids pushed, and every delta is whole UTF-8. */
#include "fuzz_common.h"
#include "tokenizer/tokenizer.h"

static prism_tokenizer_t *g_tok;

static bool utf8_whole(const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n) return false;
        i += k;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_init_once();
    if (!g_tok) {
        char err[256];
        if (prism_tokenizer_load(PRISM_SOURCE_DIR "/models/prism-tiny-llava/tokenizer.json", &g_tok, err, sizeof err)) {
            fprintf(stderr, "fuzz_detok: %s\n", err);
            abort();
        }
    }
    if (size < 1) return 0;
    prism_detok_t d;
    prism_detok_init(&d, g_tok, data[0] & 1);
    prism_buf_t delta = {0};
    size_t n = (size - 1) / 2, vocab = prism_tokenizer_vocab_size(g_tok);
    for (size_t i = 0; i < n; i++) {
        /* 2 bytes per id: mostly real ids, some just past the vocabulary or negative */
        uint16_t raw = (uint16_t)(data[1 + 2 * i] | data[2 + 2 * i] << 8);
        int32_t id = (raw & 0x8000) ? (int32_t)(raw & 0x7fff) % (int32_t)vocab
                                    : (raw & 0x4000) ? (int32_t)vocab + (raw & 0xff) - 16 : (int32_t)(raw % vocab);
        size_t before = delta.len;
        FUZZ_ASSERT(prism_detok_push(&d, id, &delta) == PRISM_OK);
        if (delta.len > before) FUZZ_ASSERT(utf8_whole(delta.data + before, delta.len - before));
        FUZZ_ASSERT(d.decoded_ids <= 256 * (uint64_t)(i + 8));
    }
    FUZZ_ASSERT(prism_detok_flush(&d, &delta) == PRISM_OK);
    prism_detok_free(&d);
    prism_buf_free(&delta);
    return 0;
}
