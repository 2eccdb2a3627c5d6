/* tokenizer.json loader robustness (malformed, odd and unsupported files fail cleanly with a
 * message) and API edge cases (limits, invalid UTF-8, byte-fallback streaming, token bytes). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "tok_test_util.h"
#include "tokenizer/tokenizer.h"

/* A minimal SentencePiece-style tokenizer: byte fallback, Metaspace markers, BOS template. */
static const char MINI[] =
    "{\"version\":\"1.0\",\"added_tokens\":["
    "{\"id\":0,\"content\":\"<unk>\",\"special\":true,\"normalized\":false},"
    "{\"id\":1,\"content\":\"<s>\",\"special\":true,\"normalized\":false}],"
    "\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\",\"prepend\":\"\\u2581\"},"
    "{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"\\u2581\"}]},"
    "\"pre_tokenizer\":null,"
    "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},"
    "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[1],\"tokens\":[\"<s>\"]}}},"
    "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":\"\\u2581\"},\"content\":\" \"},"
    "{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\" \",\"start\":1,\"stop\":0}]},"
    "\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"byte_fallback\":true,\"fuse_unk\":true,"
    "\"vocab\":{\"<unk>\":0,\"<s>\":1,\"<0xE4>\":2,\"<0xB8>\":3,\"<0xAD>\":4,\"\\u2581\":5,\"a\":6,\"b\":7,"
    "\"ab\":8,\"\\u2581ab\":9,\"c\":10},"
    "\"merges\":[\"a b\",[\"\\u2581\",\"ab\"]]}}";

static prism_tokenizer_t *load_mini(void)
{
    prism_tokenizer_t *t = NULL;
    char err[256];
    int rc = prism_tokenizer_load_from_memory(MINI, sizeof MINI - 1, &t, err, sizeof err);
    if (rc) fail_msg("mini tokenizer: %s", err);
    return t;
}

/* Replaces the first occurrence of `from` in MINI with `to` and loads it; returns the status. */
static int load_patched(const char *from, const char *to, char *err, size_t errlen)
{
    const char *p = strstr(MINI, from);
    if (!p) fail_msg("patch anchor not found: %s", from);
    size_t a = (size_t)(p - MINI), fl = strlen(from), tl = strlen(to), n = sizeof MINI - 1 - fl + tl;
    char *buf = malloc(n + 1);
    memcpy(buf, MINI, a);
    memcpy(buf + a, to, tl);
    memcpy(buf + a + tl, p + fl, sizeof MINI - 1 - a - fl);
    buf[n] = 0;
    prism_tokenizer_t *t = NULL;
    err[0] = 0;
    int rc = prism_tokenizer_load_from_memory(buf, n, &t, err, errlen);
    free(buf);
    if (rc == PRISM_OK) {
        assert_non_null(t);
        prism_tokenizer_free(t);
    } else {
        assert_null(t);
        assert_true(err[0] != 0);   /* every failure explains itself */
    }
    return rc;
}

static void expect_fail(const char *from, const char *to, int want, const char *msg_part)
{
    char err[256];
    int rc = load_patched(from, to, err, sizeof err);
    if (rc != want || (msg_part && !strstr(err, msg_part)))
        fail_msg("patch %s -> %s: got %d \"%s\", want %d containing \"%s\"", from, to, rc, err, want,
                 msg_part ? msg_part : "");
}

static void test_mini_roundtrip(void **state)
{
    (void)state;
    prism_tokenizer_t *t = load_mini();
    int32_t *ids = NULL;
    size_t n = 0, cap = 0;
    assert_int_equal(prism_tokenizer_encode(t, "ab ab", 5, true, &ids, &n, &cap), PRISM_OK);
    /* "▁ab▁ab": BOS, then the merges "a b" and "▁ ab" give ▁ab twice */
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 9);
    assert_int_equal(ids[2], 9);
    prism_buf_t s = {0};
    assert_int_equal(prism_tokenizer_decode(t, ids, n, true, &s), PRISM_OK);
    assert_int_equal(s.len, 5);
    assert_memory_equal(s.data, "ab ab", 5);
    /* "中" has no token: byte fallback; "d" has neither: unk */
    n = 0;
    assert_int_equal(prism_tokenizer_encode(t, "\xE4\xB8\xAD" "dd", 5, false, &ids, &n, &cap), PRISM_OK);
    int32_t want[] = { 5, 2, 3, 4, 0 };   /* ▁, <0xE4>, <0xB8>, <0xAD>, fused <unk> */
    assert_int_equal(n, 5);
    assert_memory_equal(ids, want, sizeof want);
    /* appends after existing ids */
    assert_int_equal(prism_tokenizer_encode(t, "c", 1, false, &ids, &n, &cap), PRISM_OK);
    assert_int_equal(n, 7);
    assert_int_equal(ids[5], 5);
    assert_int_equal(ids[6], 10);

    assert_int_equal(prism_tokenizer_token_to_id(t, "ab"), 8);
    assert_int_equal(prism_tokenizer_token_to_id(t, "<s>"), 1);
    assert_int_equal(prism_tokenizer_token_to_id(t, "zz"), -1);
    assert_string_equal(prism_tokenizer_id_to_token(t, 9), "\xE2\x96\x81" "ab");
    assert_null(prism_tokenizer_id_to_token(t, 11));
    assert_null(prism_tokenizer_id_to_token(t, -1));
    assert_int_equal(prism_tokenizer_vocab_size(t), 11);
    assert_true(prism_tokenizer_is_special(t, 1));
    assert_false(prism_tokenizer_is_special(t, 8));
    assert_false(prism_tokenizer_is_special(t, 12345));

    s.len = 0;
    assert_int_equal(prism_tokenizer_token_bytes(t, 9, &s), PRISM_OK);
    assert_int_equal(s.len, 3);
    assert_memory_equal(s.data, " ab", 3);
    s.len = 0;
    assert_int_equal(prism_tokenizer_token_bytes(t, 2, &s), PRISM_OK);
    assert_int_equal(s.len, 1);
    assert_int_equal((uint8_t)s.data[0], 0xE4);
    assert_int_not_equal(prism_tokenizer_token_bytes(t, 99, &s), PRISM_OK);

    /* unknown ids are ignored by decode, like HF */
    int32_t odd[] = { 6, 12345, -7, 7 };
    s.len = 0;
    assert_int_equal(prism_tokenizer_decode(t, odd, 4, false, &s), PRISM_OK);
    assert_int_equal(s.len, 2);
    assert_memory_equal(s.data, "ab", 2);
    prism_buf_free(&s);
    prism_free(ids);
    prism_tokenizer_free(t);
}

static void test_encode_limits(void **state)
{
    (void)state;
    prism_tokenizer_t *t = load_mini();
    int32_t *ids = NULL;
    size_t n = 0, cap = 0;
    assert_int_equal(prism_tokenizer_encode(t, "a\xC3", 2, false, &ids, &n, &cap), PRISM_EINVAL);
    assert_int_equal(prism_tokenizer_encode(t, "\xED\xA0\x80", 3, false, &ids, &n, &cap), PRISM_EINVAL);  /* surrogate */
    assert_int_equal(prism_tokenizer_encode(t, "\xC0\x80", 2, false, &ids, &n, &cap), PRISM_EINVAL);      /* overlong */
    assert_int_equal(n, 0);
    size_t big = ((size_t)8 << 20) + 1;
    char *s = malloc(big);
    memset(s, 'a', big);
    assert_int_equal(prism_tokenizer_encode(t, s, big, false, &ids, &n, &cap), PRISM_ELIMIT);
    assert_int_equal(n, 0);
    /* the bound itself is fine: 8 MiB, mostly the added token "<s>" (cheap under sanitizers) */
    for (size_t i = 0; i + 1 < big; i++) s[i] = "<s>"[i % 3];
    memcpy(s + big - 7, "ab ab ", 6);
    assert_int_equal(prism_tokenizer_encode(t, s, big - 1, false, &ids, &n, &cap), PRISM_OK);
    assert_true(n > 2000000);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[n - 1], 5);
    free(s);
    /* empty text: only the post-processor's ids */
    n = 0;
    assert_int_equal(prism_tokenizer_encode(t, "", 0, true, &ids, &n, &cap), PRISM_OK);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 1);
    prism_free(ids);
    prism_tokenizer_free(t);
}

static void test_detok_bytes(void **state)
{
    (void)state;
    prism_tokenizer_t *t = load_mini();
    prism_detok_t d;
    prism_buf_t delta = {0};
    prism_detok_init(&d, t, true);
    assert_int_equal(prism_detok_push(&d, 1, &delta), PRISM_OK);   /* <s>, skipped */
    assert_int_equal(prism_detok_push(&d, 9, &delta), PRISM_OK);   /* ▁ab: leading space stripped */
    assert_int_equal(delta.len, 2);
    assert_memory_equal(delta.data, "ab", 2);
    assert_int_equal(prism_detok_push(&d, 5, &delta), PRISM_OK);   /* ▁ */
    assert_int_equal(prism_detok_push(&d, 2, &delta), PRISM_OK);   /* <0xE4>: incomplete, held back */
    assert_int_equal(prism_detok_push(&d, 3, &delta), PRISM_OK);   /* <0xB8> */
    assert_int_equal(delta.len, 3);
    assert_memory_equal(delta.data, "ab ", 3);
    assert_int_equal(prism_detok_push(&d, 4, &delta), PRISM_OK);   /* <0xAD> completes 中 */
    assert_int_equal(delta.len, 6);
    assert_memory_equal(delta.data, "ab \xE4\xB8\xAD", 6);
    /* a dangling lead byte is emitted as U+FFFD at the end of the stream, like decode() */
    assert_int_equal(prism_detok_push(&d, 5, &delta), PRISM_OK);
    assert_int_equal(prism_detok_push(&d, 2, &delta), PRISM_OK);
    assert_int_equal(delta.len, 7);
    assert_int_equal(prism_detok_flush(&d, &delta), PRISM_OK);
    int32_t all[] = { 1, 9, 5, 2, 3, 4, 5, 2 };
    prism_buf_t full = {0};
    assert_int_equal(prism_tokenizer_decode(t, all, 8, true, &full), PRISM_OK);
    assert_int_equal(delta.len, 10);
    assert_int_equal(full.len, 10);
    assert_memory_equal(delta.data, full.data, 10);
    assert_memory_equal(delta.data + 6, " \xEF\xBF\xBD", 4);
    prism_buf_free(&full);
    prism_detok_free(&d);

    /* a long run of invalid bytes cannot stall the stream forever */
    prism_detok_init(&d, t, false);
    delta.len = 0;
    for (int i = 0; i < 100; i++) assert_int_equal(prism_detok_push(&d, 3, &delta), PRISM_OK);
    assert_true(delta.len > 0);
    assert_true(d.n < 100);   /* window compacted */
    prism_detok_free(&d);
    prism_buf_free(&delta);
    prism_tokenizer_free(t);
}

/* Finding 8: ids that produce no text (skipped specials, ids outside the vocabulary, tokens the decoder
 * erases) used to stay in the detokenizer's window, so every later id re-decoded the whole run: one
 * Tokens message of such ids cost O(n^2) and froze the router. The work must stay linear: at most a
 * constant number of decoded ids per pushed id, whatever the run. */
#define NO_TEXT_RUN 100000
#define WORK_PER_ID 256   /* generous: the window holds at most ~2 x PRISM_TOK_DETOK_MAX_PENDING ids */

static void push_run_linear(prism_detok_t *d, int32_t id, prism_buf_t *delta)
{
    for (int i = 0; i < NO_TEXT_RUN; i++) {
        assert_int_equal(prism_detok_push(d, id, delta), PRISM_OK);
        if (d->decoded_ids > (uint64_t)WORK_PER_ID * (uint64_t)(i + 8))
            fail_msg("id %d x %d: %llu ids decoded (quadratic)", id, i + 1, (unsigned long long)d->decoded_ids);
    }
}

static void test_detok_no_text_runs_linear(void **state)
{
    (void)state;
    prism_tokenizer_t *t = load_mini();
    prism_detok_t d;
    prism_buf_t delta = {0};
    /* skipped special tokens between text */
    prism_detok_init(&d, t, true);
    assert_int_equal(prism_detok_push(&d, 9, &delta), PRISM_OK);   /* "ab" */
    push_run_linear(&d, 1, &delta);                                  /* <s> x N, skipped */
    assert_int_equal(prism_detok_push(&d, 9, &delta), PRISM_OK);   /* " ab" */
    assert_int_equal(prism_detok_flush(&d, &delta), PRISM_OK);
    assert_int_equal(delta.len, 5);
    assert_memory_equal(delta.data, "ab ab", 5);
    prism_detok_free(&d);
    /* ids outside the vocabulary (what a broken or hostile worker could send) */
    prism_detok_init(&d, t, false);
    delta.len = 0;
    assert_int_equal(prism_detok_push(&d, 9, &delta), PRISM_OK);
    push_run_linear(&d, 1000000, &delta);
    push_run_linear(&d, -5, &delta);
    assert_int_equal(prism_detok_push(&d, 9, &delta), PRISM_OK);
    assert_int_equal(prism_detok_flush(&d, &delta), PRISM_OK);
    assert_int_equal(delta.len, 5);
    assert_memory_equal(delta.data, "ab ab", 5);
    prism_detok_free(&d);
    prism_tokenizer_free(t);

    /* a token the decoder chain erases ("c" replaced by nothing): not skippable up front, still linear,
     * and the streamed text still equals decode() of all ids */
    static const char from[] = "\"decoders\":[";
    const char *p = strstr(MINI, from);
    assert_non_null(p);
    size_t a = (size_t)(p - MINI) + sizeof from - 1;
    static const char ins[] = "{\"type\":\"Replace\",\"pattern\":{\"String\":\"c\"},\"content\":\"\"},";
    char *buf = malloc(sizeof MINI + sizeof ins);
    memcpy(buf, MINI, a);
    memcpy(buf + a, ins, sizeof ins - 1);
    memcpy(buf + a + sizeof ins - 1, MINI + a, sizeof MINI - a);
    char err[256];
    assert_int_equal(prism_tokenizer_load_from_memory(buf, strlen(buf), &t, err, sizeof err), PRISM_OK);
    free(buf);
    prism_detok_init(&d, t, true);
    delta.len = 0;
    assert_int_equal(prism_detok_push(&d, 6, &delta), PRISM_OK);   /* "a" */
    push_run_linear(&d, 10, &delta);                                 /* "c" x N: no text */
    assert_int_equal(prism_detok_push(&d, 7, &delta), PRISM_OK);   /* "b" */
    assert_int_equal(prism_detok_flush(&d, &delta), PRISM_OK);
    assert_int_equal(delta.len, 2);
    assert_memory_equal(delta.data, "ab", 2);
    prism_detok_free(&d);
    prism_buf_free(&delta);
    prism_tokenizer_free(t);
}

static void test_corrupt_fields(void **state)
{
    (void)state;
    char err[256];
    prism_tokenizer_t *t = NULL;
    /* not JSON / wrong top level */
    assert_int_equal(prism_tokenizer_load_from_memory("", 0, &t, err, sizeof err), PRISM_ECORRUPT);
    assert_int_equal(prism_tokenizer_load_from_memory("{", 1, &t, err, sizeof err), PRISM_ECORRUPT);
    assert_int_equal(prism_tokenizer_load_from_memory("[]", 2, &t, err, sizeof err), PRISM_ECORRUPT);
    assert_int_equal(prism_tokenizer_load_from_memory("{}", 2, &t, err, sizeof err), PRISM_ECORRUPT);
    assert_non_null(strstr(err, "model"));
    assert_int_equal(prism_tokenizer_load_from_memory("{\"model\":5}", 11, &t, err, sizeof err), PRISM_ECORRUPT);
    assert_null(t);
    /* over the size limit: rejected before parsing */
    assert_int_equal(prism_tokenizer_load_from_memory("{}", ((size_t)64 << 20) + 1, &t, err, sizeof err), PRISM_ELIMIT);
    assert_int_not_equal(prism_tokenizer_load("/nonexistent/tokenizer.json", &t, err, sizeof err), PRISM_OK);
    assert_non_null(strstr(err, "/nonexistent"));

    expect_fail("\"type\":\"BPE\"", "\"type\":\"Unigram\"", PRISM_ENOTSUP, "Unigram");
    expect_fail("\"type\":\"BPE\"", "\"type\":7", PRISM_ECORRUPT, "model.type");
    expect_fail("\"vocab\":{", "\"vocab\":[],\"x\":{", PRISM_ECORRUPT, "model.vocab");
    expect_fail("\"<unk>\":0,\"<s>\"", "\"<unk>\":\"zero\",\"<s>\"", PRISM_ECORRUPT, "integer id");
    expect_fail("\"<unk>\":0,\"<s>\"", "\"<unk>\":-1,\"<s>\"", PRISM_ELIMIT, "out of range");
    expect_fail("\"<unk>\":0,\"<s>\"", "\"<unk>\":4294967296000,\"<s>\"", PRISM_ELIMIT, "out of range");
    expect_fail("\"<unk>\":0,\"<s>\"", "\"<unk>\":99999999999999999999999,\"<s>\"", PRISM_ECORRUPT, "JSON");
    expect_fail("\"<unk>\":0,\"<s>\"", "\"<unk>\":1e400,\"<s>\"", PRISM_ECORRUPT, NULL);
    expect_fail("\"merges\":[", "\"merges\":7,\"x\":[", PRISM_ECORRUPT, "model.merges");
    expect_fail("\"merges\":[\"a b\"", "\"merges\":[\"ab\"", PRISM_ECORRUPT, "merges[0]");
    expect_fail("\"merges\":[\"a b\"", "\"merges\":[\"a b c\"", PRISM_ECORRUPT, "merges[0]");
    expect_fail("\"merges\":[\"a b\"", "\"merges\":[\"a zz\"", PRISM_ECORRUPT, "not in the vocab");
    expect_fail("\"merges\":[\"a b\"", "\"merges\":[\"b a\"", PRISM_ECORRUPT, "merged token");
    expect_fail("\"merges\":[\"a b\"", "\"merges\":[[1,2]", PRISM_ECORRUPT, "merges[0]");
    expect_fail("\"merges\":[\"a b\"", "\"merges\":[[\"a\"]", PRISM_ECORRUPT, "merges[0]");
    expect_fail("\"byte_fallback\":true", "\"byte_fallback\":\"yes\"", PRISM_ECORRUPT, "byte_fallback");
    expect_fail("\"fuse_unk\":true", "\"fuse_unk\":true,\"dropout\":0.1", PRISM_ENOTSUP, "dropout");
    expect_fail("\"added_tokens\":[", "\"added_tokens\":7,\"x\":[", PRISM_ECORRUPT, "added_tokens");
    expect_fail("{\"id\":0,\"content\":\"<unk>\"", "{\"id\":\"0\",\"content\":\"<unk>\"", PRISM_ECORRUPT, "added_tokens[0]");
    expect_fail("{\"id\":0,\"content\":\"<unk>\"", "{\"content\":\"<unk>\"", PRISM_ECORRUPT, "added_tokens[0]");
    expect_fail("{\"id\":0,\"content\":\"<unk>\"", "{\"id\":0,\"content\":null", PRISM_ECORRUPT, "content");
    expect_fail("{\"id\":0,\"content\":\"<unk>\"", "{\"id\":0,\"content\":\"<unk>\",\"lstrip\":1", PRISM_ECORRUPT, "lstrip");
    expect_fail("\"type\":\"Prepend\"", "\"type\":\"Lowercase\"", PRISM_ENOTSUP, "normalizer type 'Lowercase'");
    expect_fail("\"type\":\"Prepend\",\"prepend\":\"\\u2581\"", "\"type\":\"Prepend\"", PRISM_ECORRUPT, "Prepend");
    expect_fail("\"normalizers\":[", "\"normalizers\":7,\"x\":[", PRISM_ECORRUPT, "normalizers");
    expect_fail("\"pre_tokenizer\":null", "\"pre_tokenizer\":{\"type\":\"BertPreTokenizer\"}", PRISM_ENOTSUP,
                "pre_tokenizer type 'BertPreTokenizer'");
    expect_fail("\"pre_tokenizer\":null", "\"pre_tokenizer\":{\"kind\":\"Split\"}", PRISM_ECORRUPT, "type");
    expect_fail("\"pre_tokenizer\":null",
                "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(a|\"},\"behavior\":\"Isolated\"}",
                PRISM_ECORRUPT, "does not compile");
    expect_fail("\"pre_tokenizer\":null",
                "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\p{Foo}\"},\"behavior\":\"Isolated\"}",
                PRISM_ECORRUPT, "does not compile");
    expect_fail("\"pre_tokenizer\":null",
                "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"a\"},\"behavior\":\"Sideways\"}",
                PRISM_ECORRUPT, "Sideways");
    expect_fail("\"pre_tokenizer\":null",
                "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"String\":\"\"},\"behavior\":\"Isolated\"}",
                PRISM_ECORRUPT, "empty");
    expect_fail("\"pre_tokenizer\":null",
                "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Glob\":\"*\"},\"behavior\":\"Isolated\"}",
                PRISM_ECORRUPT, "pattern");
    expect_fail("\"pre_tokenizer\":null", "\"pre_tokenizer\":{\"type\":\"Metaspace\",\"replacement\":\"ab\"}",
                PRISM_ECORRUPT, "single character");
    expect_fail("\"pre_tokenizer\":null", "\"pre_tokenizer\":{\"type\":\"Metaspace\",\"prepend_scheme\":\"sometimes\"}",
                PRISM_ECORRUPT, "prepend_scheme");
    expect_fail("\"type\":\"ByteFallback\"", "\"type\":\"WordPiece\"", PRISM_ENOTSUP, "decoder type 'WordPiece'");
    expect_fail("\"start\":1", "\"start\":-1", PRISM_ELIMIT, "start");
    expect_fail("\"type\":\"TemplateProcessing\"", "\"type\":\"Magic\"", PRISM_ENOTSUP, "post_processor type 'Magic'");
    expect_fail("\"ids\":[1]", "\"ids\":[\"one\"]", PRISM_ECORRUPT, "bad id");
    expect_fail("{\"Sequence\":{\"id\":\"A\"", "{\"Sequence\":{\"id\":\"B\"", PRISM_ENOTSUP, "sequence A");
    expect_fail("\"special_tokens\":{\"<s>\"", "\"special_tokens\":{\"<x>\"", PRISM_ECORRUPT, "has no ids");

    /* nesting bombs are bounded */
    char deep[4096] = "\"pre_tokenizer\":";
    for (int i = 0; i < 20; i++) strcat(deep, "{\"type\":\"Sequence\",\"pretokenizers\":[");
    strcat(deep, "{\"type\":\"Digits\"}");
    for (int i = 0; i < 20; i++) strcat(deep, "]}");
    expect_fail("\"pre_tokenizer\":null", deep, PRISM_ELIMIT, "nesting");
    /* fine when shallow */
    char err2[256];
    assert_int_equal(load_patched("\"pre_tokenizer\":null",
                                  "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\"}]}",
                                  err2, sizeof err2), PRISM_OK);
}

/* Every prefix of a valid file and many byte-mutated copies fail cleanly or load (no crash, no
 * leak: the counting allocator returns to its starting level). */
static void test_truncation_and_mutation(void **state)
{
    (void)state;
    char path[1024], err[256];
    tt_source_path(path, sizeof path, "tests/data/tokenizer/synth_metaspace.json");
    char *buf = NULL;
    size_t len = 0;
    const char *src = MINI;
    size_t srclen = sizeof MINI - 1;
    size_t mem0 = prism_mem_used();
    if (prism_read_file(path, (size_t)1 << 24, &buf, &len) == 0) { src = buf; srclen = len; }
    size_t step = srclen / 400 + 1, loaded = 0;
    for (size_t cut = 0; cut < srclen; cut += step) {
        prism_tokenizer_t *t = NULL;
        int rc = prism_tokenizer_load_from_memory(src, cut, &t, err, sizeof err);
        assert_int_not_equal(rc, PRISM_OK);
        assert_null(t);
    }
    uint64_t seed = 0x9E3779B97F4A7C15ULL;
    char *m = malloc(srclen);
    static const char junk[] = "{}[]\",:0123456789-eE.\\ntfa\x80\xff";
    for (int iter = 0; iter < 400; iter++) {
        memcpy(m, src, srclen);
        int flips = 1 + iter % 4;
        for (int k = 0; k < flips; k++) {
            seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17;
            m[seed % srclen] = junk[(seed >> 32) % (sizeof junk - 1)];
        }
        prism_tokenizer_t *t = NULL;
        int rc = prism_tokenizer_load_from_memory(m, srclen, &t, err, sizeof err);
        if (rc == PRISM_OK) {
            /* whatever loaded must still encode/decode without crashing */
            int32_t *ids = NULL;
            size_t n = 0, cap = 0;
            const char *txt = "Hello [MASK] world 123 ça va? \xE4\xB8\xAD  <sep> x";
            /* The text is valid UTF-8 far below the size bound, so the only failure encode may
             * report is HF's UnkTokenOutOfVocabulary (PRISM_ECORRUPT: a piece with no token and no
             * usable unk), and then it must leave *n alone. On success every id is in range and
             * a second encode gives the same ids. */
            int erc = prism_tokenizer_encode(t, txt, strlen(txt), true, &ids, &n, &cap);
            if (erc != PRISM_OK && erc != PRISM_ECORRUPT) fail_msg("mutation %d: encode returned %d", iter, erc);
            size_t vocab = prism_tokenizer_vocab_size(t);
            if (erc == PRISM_OK) {
                assert_true(n > 0);
                for (size_t i = 0; i < n; i++)
                    if (ids[i] < 0 || (size_t)ids[i] >= vocab)
                        fail_msg("mutation %d: id %d out of the vocabulary (%zu)", iter, ids[i], vocab);
                int32_t *again = NULL;
                size_t n2 = 0, cap2 = 0;
                assert_int_equal(prism_tokenizer_encode(t, txt, strlen(txt), true, &again, &n2, &cap2), PRISM_OK);
                assert_int_equal(n2, n);
                assert_memory_equal(again, ids, n * sizeof *ids);
                prism_free(again);
            } else {
                assert_int_equal(n, 0);
            }
            prism_buf_t s = {0};
            assert_int_equal(prism_tokenizer_decode(t, ids, n, false, &s), PRISM_OK);
            prism_buf_free(&s);
            prism_free(ids);
            prism_tokenizer_free(t);
            loaded++;
        } else {
            assert_null(t);
            assert_true(err[0] != 0);
        }
    }
    free(m);
    prism_free(buf);
    assert_int_equal(prism_mem_used(), mem0);
    fprintf(stderr, "mutations: %zu of 400 still loaded\n", loaded);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mini_roundtrip),
        cmocka_unit_test(test_encode_limits),
        cmocka_unit_test(test_detok_bytes),
        cmocka_unit_test(test_detok_no_text_runs_linear),
        cmocka_unit_test(test_corrupt_fields),
        cmocka_unit_test(test_truncation_and_mutation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
