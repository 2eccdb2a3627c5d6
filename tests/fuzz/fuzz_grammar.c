/* libFuzzer: the grammar compiler (common/grammar, common/toolcall) on any regex, JSON schema,
 * choice list or tool list, over the bundled model's vocabulary, each with a budget of time and
 * memory (issue 26: `(a|b)*a(a|b){k}` grew subset construction to 2^k states), then a matcher
 * driven a few tokens along what its masks allow.
 *
 * Input: one mode byte, then the text. 'r' regex, 'j' JSON schema, 'c' choices (one per line),
 * 'h' / 'p' hermes / pythonic tool list (a JSON array of tools); other bytes pick a mode by value.
 * Invariants: a compile succeeds or fails with a typed error and a message; every token a mask
 * allows is accepted; EOS is allowed exactly where the matcher can end; a mask either answers or
 * runs out of its work budget (PRISM_ELIMIT), never anything else. */
#include "fuzz_common.h"
#include "grammar/grammar.h"
#include "tokenizer/tokenizer.h"
#include "toolcall/toolcall.h"

static prism_tokenizer_t *g_tok;
static prism_grammar_vocab_t *g_v;
static int32_t g_eos;

/* Budgets per input: compiles refused past them count as correct answers. */
static const prism_grammar_limits_t LIM = {
    .max_compile_ms = 250,
    .max_compile_bytes = 64 << 20,
    .max_mask_work = 1 << 20,
};

static void setup(void)
{
    char err[256];
    if (prism_tokenizer_load(PRISM_SOURCE_DIR "/models/prism-tiny-llava/tokenizer.json", &g_tok, err, sizeof err)) {
        fprintf(stderr, "fuzz_grammar: %s\n", err);
        abort();
    }
    g_eos = prism_tokenizer_token_to_id(g_tok, "</s>");
    FUZZ_ASSERT(g_eos >= 0);
    FUZZ_ASSERT(prism_grammar_vocab_create(g_tok, &g_eos, 1, 0, &g_v) == PRISM_OK);
}

static int compile_choices(const char *text, size_t len, prism_grammar_t **g, prism_grammar_error_t *err)
{
    const char *items[64];
    size_t lens[64], n = 0, start = 0;
    for (size_t i = 0; i <= len && n < 64; i++)
        if (i == len || text[i] == '\n') {
            items[n] = text + start;
            lens[n++] = i - start;
            start = i + 1;
        }
    return prism_grammar_compile_choice(g_v, items, lens, n, &LIM, g, err);
}

static void drive(prism_grammar_t *g, const uint8_t *data, size_t size)
{
    prism_grammar_matcher_t *m;
    FUZZ_ASSERT(prism_grammar_matcher_create(g, &LIM, &m) == PRISM_OK);
    size_t words = prism_grammar_mask_words(g_v), nv = prism_grammar_vocab_size(g_v);
    int32_t *mask = prism_malloc(words * sizeof *mask);
    FUZZ_ASSERT(mask);
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < size; i++) h = (h ^ data[i]) * 1099511628211ULL;
    for (int step = 0; step < 12 && !prism_grammar_matcher_is_terminated(m); step++) {
        int n = prism_grammar_matcher_fill_mask(m, mask);
        FUZZ_ASSERT(n >= 0 || n == PRISM_ELIMIT);
        if (n <= 0) break;
        FUZZ_ASSERT(prism_grammar_mask_test(mask, g_eos) == prism_grammar_matcher_can_end(m));
        uint8_t forced[16];
        (void)prism_grammar_matcher_forced_bytes(m, forced, sizeof forced);
        /* the k-th allowed token, k from the input's hash */
        h = h * 6364136223846793005ULL + 1442695040888963407ULL;
        int k = (int)((h >> 33) % (uint64_t)n), seen = 0;
        int32_t pick = -1;
        for (size_t id = 0; id < nv && pick < 0; id++)
            if (prism_grammar_mask_test(mask, (int32_t)id) && seen++ == k) pick = (int32_t)id;
        FUZZ_ASSERT(pick >= 0);
        FUZZ_ASSERT(prism_grammar_matcher_accept_token(m, pick) == PRISM_OK);
    }
    if (prism_grammar_matcher_rollback(m, 1) == PRISM_OK) (void)prism_grammar_matcher_fill_mask(m, mask);
    prism_free(mask);
    prism_grammar_matcher_free(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_init_once();
    if (!g_v) setup();
    if (size < 1) return 0;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int mode = data[0] == 'r' || data[0] == 'j' || data[0] == 'c' || data[0] == 'h' || data[0] == 'p'
                   ? data[0] : "rjchp"[data[0] % 5];
    prism_grammar_t *g = NULL;
    prism_grammar_error_t err = {0};
    int rc;
    switch (mode) {
    case 'r': rc = prism_grammar_compile_regex(g_v, text, len, &LIM, &g, &err); break;
    case 'j': rc = prism_grammar_compile_json_schema(g_v, text, len, NULL, &LIM, &g, &err); break;
    case 'c': rc = compile_choices(text, len, &g, &err); break;
    default:
        rc = prism_toolcall_grammar(mode == 'h' ? PRISM_TOOLCALL_HERMES : PRISM_TOOLCALL_PYTHONIC, g_v, text, len, NULL,
                                    len & 1, &LIM, &g, &err);
        break;
    }
    if (rc != PRISM_OK) {
        FUZZ_ASSERT(rc == PRISM_EINVAL || rc == PRISM_ENOTSUP || rc == PRISM_ELIMIT);
        FUZZ_ASSERT(err.code == rc && err.message[0] && !g);
        return 0;
    }
    FUZZ_ASSERT(g);
    drive(g, data, size);
    prism_grammar_release(g);
    return 0;
}
