/* Conformance with HF tokenizers: for every corpus string and tokenizer, encode (with and without
 * special tokens), decode (skip_special both ways) and the streaming detokenizer must reproduce
 * the goldens made by tools/gen_tokenizer_goldens.py exactly.
 *
 * Without arguments: the tokenizers in the source tree. With --shared: the real tokenizers from the
 * shared folder ($PRISM_SHARED_DIR, default $PRISM_SOURCE_DIR/../shared); when any of them is
 * absent the run ends with exit code 77, which ctest (SKIP_RETURN_CODE) reports as Skipped, never
 * as Passed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "tok_test_util.h"
#include "tokenizer/tokenizer.h"

typedef struct {
    const char *name;      /* golden_<name>.jsonl */
    const char *rel;       /* tokenizer.json path */
    bool shared;           /* rel is under the shared folder (else the source tree) */
    bool byte_level;       /* decode == lossy(concat token_bytes) */
} tok_case_t;

static const tok_case_t CASES[] = {
    { "llama3_1", "tokenizers/llama3_1/tokenizer.json", true, true },
    { "qwen3", "tokenizers/qwen3/tokenizer.json", true, true },
    { "llama2", "tokenizers/llama2/tokenizer.json", true, false },
    { "prism_tiny_llava", "models/prism-tiny-llava/tokenizer.json", false, true },
    { "synth_metaspace", "tests/data/tokenizer/synth_metaspace.json", false, false },
    { "synth_wordpiece_like", "tests/data/tokenizer/synth_wordpiece_like.json", false, false },
    { "synth_bytelevel", "tests/data/tokenizer/synth_bytelevel.json", false, true },
};

static tt_corpus_t corpus;
static int n_missing;  /* shared tokenizers not found */

static int setup(void **state)
{
    (void)state;
    return tt_load_corpus(&corpus);
}

static int teardown(void **state)
{
    (void)state;
    tt_free_corpus(&corpus);
    return 0;
}

static bool ids_equal_json(const int32_t *ids, size_t n, json_t *arr)
{
    if (json_array_size(arr) != n) return false;
    for (size_t i = 0; i < n; i++)
        if (json_integer_value(json_array_get(arr, i)) != ids[i]) return false;
    return true;
}

static void print_ids(const char *what, const int32_t *ids, size_t n)
{
    fprintf(stderr, "  %s:", what);
    for (size_t i = 0; i < n && i < 60; i++) fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, "\n");
}

/* arr may be NULL (absent field): no ids */
static void json_ids(json_t *arr, int32_t **v, size_t *n)
{
    *n = arr ? json_array_size(arr) : 0;
    *v = malloc((*n + 1) * sizeof **v);
    for (size_t i = 0; i < *n; i++) (*v)[i] = (int32_t)json_integer_value(json_array_get(arr, i));
}

static bool str_eq(const prism_buf_t *b, const char *s, size_t n)
{
    return b->len == n && (n == 0 || memcmp(b->data, s, n) == 0);
}

static void run_case(const tok_case_t *c)
{
    char path[1024], gpath[1024], err[256], what[64];
    if (c->shared) tt_shared_path(path, sizeof path, c->rel);
    else tt_source_path(path, sizeof path, c->rel);
    if (!prism_file_exists(path)) {
        fprintf(stderr, "SKIPPED %s: %s not found\n", c->name, path);
        n_missing++;
        skip();
    }
    snprintf(what, sizeof what, "tests/data/tokenizer/golden_%s.jsonl", c->name);
    tt_source_path(gpath, sizeof gpath, what);
    if (!prism_file_exists(gpath)) fail_msg("%s exists but %s is missing: run tools/gen_tokenizer_goldens.py", path, gpath);

    double t0 = prism_now_s();
    prism_tokenizer_t *tok = NULL;
    int rc = prism_tokenizer_load(path, &tok, err, sizeof err);
    if (rc) fail_msg("load %s: %s (%d)", path, err, rc);
    double t_load = prism_now_s() - t0;

    size_t ng;
    json_t **g = tt_read_jsonl(gpath, &ng);
    assert_non_null(g);
    /* header, then one line per corpus string i with i < edge or i % stride == 0 */
    json_t *jst = json_object_get(g[0], "stride"), *jed = json_object_get(g[0], "edge");
    size_t stride = json_is_integer(jst) && json_integer_value(jst) > 0 ? (size_t)json_integer_value(jst) : 1;
    size_t edge = json_is_integer(jed) && json_integer_value(jed) > 0 ? (size_t)json_integer_value(jed) : 0;
    size_t *sel = malloc(corpus.n * sizeof *sel), n_lines = 0;
    for (size_t i = 0; i < corpus.n; i++)
        if (i < edge || i % stride == 0) sel[n_lines++] = i;
    assert_int_equal(ng, n_lines + 1);

    int32_t *ids = NULL, *ids_sp = NULL;
    size_t cap = 0, cap_sp = 0;
    prism_buf_t out = {0}, tmp = {0}, delta = {0};
    size_t bad_enc = 0, bad_enc_sp = 0, bad_dec = 0, bad_ds = 0, bad_dk = 0, bad_detok = 0, bad_bytes = 0, reported = 0;
    size_t total_tokens = 0;
    for (size_t li = 0; li < n_lines; li++) {
        json_t *gl = g[li + 1];
        size_t i = sel[li];
        const char *s = corpus.s[i];
        size_t sl = corpus.len[i];
        size_t n = 0, n_sp = 0;
        rc = prism_tokenizer_encode(tok, s, sl, false, &ids, &n, &cap);
        assert_int_equal(rc, PRISM_OK);
        rc = prism_tokenizer_encode(tok, s, sl, true, &ids_sp, &n_sp, &cap_sp);
        assert_int_equal(rc, PRISM_OK);
        total_tokens += n;

        json_t *gids = json_object_get(gl, "ids");
        int32_t *pre, *suf, *full;
        size_t npre, nsuf;
        json_ids(json_object_get(gl, "pre"), &pre, &npre);
        json_ids(json_object_get(gl, "suf"), &suf, &nsuf);
        size_t nfull = npre + json_array_size(gids) + nsuf;
        full = malloc((nfull + 1) * sizeof *full);
        memcpy(full, pre, npre * sizeof *pre);
        for (size_t k = 0; k < json_array_size(gids); k++) full[npre + k] = (int32_t)json_integer_value(json_array_get(gids, k));
        memcpy(full + npre + json_array_size(gids), suf, nsuf * sizeof *suf);

        bool ok_enc = ids_equal_json(ids, n, gids);
        bool ok_sp = n_sp == nfull && (nfull == 0 || !memcmp(ids_sp, full, nfull * sizeof *full));
        if (!ok_enc) bad_enc++;
        if (!ok_sp) bad_enc_sp++;
        if ((!ok_enc || !ok_sp) && reported++ < 8) {
            fprintf(stderr, "[%s] line %zu encode mismatch for \"", c->name, i);
            tt_print_escaped(stderr, s, sl);
            fprintf(stderr, "\"\n");
            print_ids("got ", ids, n);
            int32_t *gv;
            size_t gn;
            json_ids(gids, &gv, &gn);
            print_ids("want", gv, gn);
            free(gv);
        }

        /* decode(ids, skip=false) == d (or s) */
        json_t *jd = json_object_get(gl, "d");
        const char *want_d = jd ? json_string_value(jd) : s;
        size_t want_dl = jd ? json_string_length(jd) : sl;
        out.len = 0;
        assert_int_equal(prism_tokenizer_decode(tok, ids, n, false, &out), PRISM_OK);
        if (!str_eq(&out, want_d, want_dl)) {
            bad_dec++;
            if (reported++ < 8) {
                fprintf(stderr, "[%s] line %zu decode mismatch\n  got : \"", c->name, i);
                tt_print_escaped(stderr, out.data, out.len);
                fprintf(stderr, "\"\n  want: \"");
                tt_print_escaped(stderr, want_d, want_dl);
                fprintf(stderr, "\"\n");
            }
        }
        /* decode(pre+ids+suf, skip=true) == ds (or d) */
        json_t *jds = json_object_get(gl, "ds");
        const char *want_ds = jds ? json_string_value(jds) : want_d;
        size_t want_dsl = jds ? json_string_length(jds) : want_dl;
        out.len = 0;
        assert_int_equal(prism_tokenizer_decode(tok, full, nfull, true, &out), PRISM_OK);
        if (!str_eq(&out, want_ds, want_dsl)) {
            bad_ds++;
            if (reported++ < 8) {
                fprintf(stderr, "[%s] line %zu decode(skip_special) mismatch\n  got : \"", c->name, i);
                tt_print_escaped(stderr, out.data, out.len);
                fprintf(stderr, "\"\n");
            }
        }
        /* decode(pre+ids+suf, skip=false): dk, or decode(pre) + d + decode(suf) on sampled lines */
        if (li % 8 == 0) {
            json_t *jdk = json_object_get(gl, "dk");
            tmp.len = 0;
            if (jdk) prism_buf_append(&tmp, json_string_value(jdk), json_string_length(jdk));
            else {
                prism_tokenizer_decode(tok, pre, npre, false, &tmp);
                prism_buf_append(&tmp, want_d, want_dl);
                prism_tokenizer_decode(tok, suf, nsuf, false, &tmp);
            }
            out.len = 0;
            assert_int_equal(prism_tokenizer_decode(tok, full, nfull, false, &out), PRISM_OK);
            if (!str_eq(&out, tmp.data ? tmp.data : "", tmp.len)) {
                bad_dk++;
                if (reported++ < 8) {
                    fprintf(stderr, "[%s] line %zu decode(with specials) mismatch\n  got : \"", c->name, i);
                    tt_print_escaped(stderr, out.data, out.len);
                    fprintf(stderr, "\"\n  want: \"");
                    tt_print_escaped(stderr, tmp.data, tmp.len);
                    fprintf(stderr, "\"\n");
                }
            }
        }
        /* streaming: concatenated deltas == full decode, both skip modes */
        for (int skip_sp = 0; skip_sp < 2; skip_sp++) {
            prism_detok_t d;
            prism_detok_init(&d, tok, skip_sp);
            delta.len = 0;
            for (size_t k = 0; k < nfull; k++) assert_int_equal(prism_detok_push(&d, full[k], &delta), PRISM_OK);
            assert_int_equal(prism_detok_flush(&d, &delta), PRISM_OK);
            prism_detok_free(&d);
            out.len = 0;
            prism_tokenizer_decode(tok, full, nfull, skip_sp, &out);
            if (!str_eq(&delta, out.data ? out.data : "", out.len)) {
                bad_detok++;
                if (reported++ < 8) {
                    fprintf(stderr, "[%s] line %zu detok(skip=%d) mismatch\n  got : \"", c->name, i, skip_sp);
                    tt_print_escaped(stderr, delta.data, delta.len);
                    fprintf(stderr, "\"\n  want: \"");
                    tt_print_escaped(stderr, out.data, out.len);
                    fprintf(stderr, "\"\n");
                }
            }
        }
        /* byte-level: the logprob bytes of the tokens are exactly the decoded bytes */
        if (c->byte_level) {
            tmp.len = 0;
            for (size_t k = 0; k < n; k++) assert_int_equal(prism_tokenizer_token_bytes(tok, ids[k], &tmp), PRISM_OK);
            if (!memchr(want_d, 0xEF, want_dl) && !str_eq(&tmp, want_d, want_dl)) bad_bytes++;
        }
        free(pre);
        free(suf);
        free(full);
        json_decref(gl);
    }
    json_decref(g[0]);
    free(g);
    free(sel);
    fprintf(stderr, "[%s] %zu strings, %zu tokens, load %.3fs: encode mismatches %zu (+special %zu), decode %zu, "
            "decode(skip) %zu, decode(specials) %zu, detok %zu, token_bytes %zu\n",
            c->name, n_lines, total_tokens, t_load, bad_enc, bad_enc_sp, bad_dec, bad_ds, bad_dk, bad_detok, bad_bytes);
    prism_free(ids);
    prism_free(ids_sp);
    prism_buf_free(&out);
    prism_buf_free(&tmp);
    prism_buf_free(&delta);
    prism_tokenizer_free(tok);
    assert_int_equal(bad_enc + bad_enc_sp + bad_dec + bad_ds + bad_dk + bad_detok + bad_bytes, 0);
}

static void test_llama3_1(void **s) { (void)s; run_case(&CASES[0]); }
static void test_qwen3(void **s) { (void)s; run_case(&CASES[1]); }
static void test_llama2(void **s) { (void)s; run_case(&CASES[2]); }
static void test_prism_tiny_llava(void **s) { (void)s; run_case(&CASES[3]); }
static void test_synth_metaspace(void **s) { (void)s; run_case(&CASES[4]); }
static void test_synth_wordpiece_like(void **s) { (void)s; run_case(&CASES[5]); }
static void test_synth_bytelevel(void **s) { (void)s; run_case(&CASES[6]); }

int main(int argc, char **argv)
{
    const struct CMUnitTest shared[] = {
        cmocka_unit_test(test_llama3_1),
        cmocka_unit_test(test_qwen3),
        cmocka_unit_test(test_llama2),
    };
    const struct CMUnitTest tree[] = {
        cmocka_unit_test(test_prism_tiny_llava),
        cmocka_unit_test(test_synth_metaspace),
        cmocka_unit_test(test_synth_wordpiece_like),
        cmocka_unit_test(test_synth_bytelevel),
    };
    if (argc > 1 && !strcmp(argv[1], "--shared")) {
        int rc = cmocka_run_group_tests_name("shared_tokenizers", shared, setup, teardown);
        if (rc) return rc;
        return n_missing ? 77 : 0;
    }
    return cmocka_run_group_tests_name("tree_tokenizers", tree, setup, teardown);
}
