/* Token masks against brute force, on sampled states of random walks, for every tokenizer:
 *  - JSON Schema grammars: bit i set <=> accept_token(i) succeeds (the byte stepper, which the
 *    cached/trie mask path does not use), for every token of the vocabulary;
 *  - regex grammars: bit i set <=> PCRE2 says prefix+bytes(i) is a prefix of a match (an
 *    engine that shares nothing with ours); EOS <=> a complete match;
 *  - choice grammars: bit i set <=> some choice starts with prefix+bytes(i).
 * Also: no allocation per token once the cache is warm, rollback, the node pool staying
 * bounded over long outputs, and concurrent matchers sharing one grammar. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "gram_test_util.h"

typedef struct {
    const gt_tok_t *t;
    int32_t *mask, *allowed;
    size_t nv;
    prism_buf_t tb;
} mctx_t;

/* How many states to check per grammar: every state for small vocabularies. */
static int check_every(const mctx_t *c) { return c->nv > 20000 ? 3 : 1; }

static bool token_bytes(mctx_t *c, int32_t id)
{
    size_t n;
    const uint8_t *b = gt_tok_bytes(c->t, id, &n);
    prism_buf_reset(&c->tb);
    prism_buf_append(&c->tb, b, n);
    return !c->t->special[id];
}

/* Oracle: accept + rollback for every token. */
static void check_by_accept(mctx_t *c, prism_grammar_matcher_t *m, const char *what)
{
    int n = prism_grammar_matcher_fill_mask(m, c->mask);
    assert_true(n > 0);
    for (size_t i = 0; i < c->nv; i++) {
        bool bit = prism_grammar_mask_test(c->mask, (int32_t)i);
        int rc = prism_grammar_matcher_accept_token(m, (int32_t)i);
        bool ok = rc == PRISM_OK;
        if (ok) assert_int_equal(prism_grammar_matcher_rollback(m, 1), PRISM_OK);
        if (bit != ok) {
            token_bytes(c, (int32_t)i);
            fail_msg("%s: token %zu '%.*s': mask %d, accept %d", what, i, (int)c->tb.len, c->tb.data, bit, ok);
        }
    }
}

/* Walks with random allowed tokens, checking the mask at sampled states with oracle(). */
typedef bool (*oracle_fn)(void *arg, const prism_buf_t *prefix, const uint8_t *tok, size_t n, bool eos);

static void walk_and_check(mctx_t *c, prism_grammar_t *g, uint64_t seed, int steps, oracle_fn oracle, void *arg,
                           const char *what)
{
    prism_grammar_matcher_t *m;
    assert_int_equal(prism_grammar_matcher_create(g, NULL, &m), PRISM_OK);
    prism_buf_t prefix = {0};
    uint64_t r = seed;
    for (int s = 0; s < steps; s++) {
        int n = prism_grammar_matcher_fill_mask(m, c->mask);
        assert_true(n > 0);
        if (s % check_every(c) == 0) {
            if (oracle) {
                for (size_t i = 0; i < c->nv; i++) {
                    bool bit = prism_grammar_mask_test(c->mask, (int32_t)i);
                    bool want;
                    if ((int32_t)i == c->t->eos) want = oracle(arg, &prefix, NULL, 0, true);
                    else if (!token_bytes(c, (int32_t)i) || c->tb.len == 0) want = false;
                    else want = oracle(arg, &prefix, (const uint8_t *)c->tb.data, c->tb.len, false);
                    if (bit != want) {
                        token_bytes(c, (int32_t)i);
                        fail_msg("%s: after '%.*s' token %zu '%.*s': mask %d, oracle %d", what, (int)prefix.len,
                                 prefix.data, i, (int)c->tb.len, c->tb.data, bit, want);
                    }
                }
            } else {
                check_by_accept(c, m, what);
                prism_grammar_matcher_fill_mask(m, c->mask);
            }
        }
        int na = 0;
        for (size_t i = 0; i < c->nv; i++)
            if (prism_grammar_mask_test(c->mask, (int32_t)i) && (int32_t)i != c->t->eos) c->allowed[na++] = (int32_t)i;
        if (na == 0) break;
        int32_t pick = c->allowed[gt_randint(&r, na)];
        /* prefer short tokens half the time so walks reach deep structure */
        if (gt_randint(&r, 2)) {
            for (int k = 0; k < 8; k++) {
                int32_t alt = c->allowed[gt_randint(&r, na)];
                if (c->t->len[alt] < c->t->len[pick]) pick = alt;
            }
        }
        assert_int_equal(prism_grammar_matcher_accept_token(m, pick), PRISM_OK);
        token_bytes(c, pick);
        prism_buf_append(&prefix, c->tb.data, c->tb.len);
    }
    prism_buf_free(&prefix);
    prism_grammar_matcher_free(m);
}

/* which < 0: the synthetic vocabulary */
static bool mctx_init(mctx_t *c, int which, gt_tok_t *t)
{
    memset(c, 0, sizeof *c);
    if (which < 0) gt_tok_synth(12345, 6000, t);
    else if (!gt_tok_load(&GT_TOKS[which], t)) return false;
    c->t = t;
    c->nv = prism_grammar_vocab_size(t->v);
    c->mask = malloc(prism_grammar_mask_words(t->v) * sizeof *c->mask);
    c->allowed = malloc(c->nv * sizeof *c->allowed);
    return true;
}

static void mctx_free(mctx_t *c, gt_tok_t *t)
{
    free(c->mask);
    free(c->allowed);
    prism_buf_free(&c->tb);
    gt_tok_free(t);
}

/* ---- JSON ---- */
static void run_json(int which)
{
    gt_tok_t t;
    mctx_t c;
    if (!mctx_init(&c, which, &t)) fail();
    int n = c.nv > 20000 ? 4 : 12;
    for (int i = 0; i < n; i++) {
        /* the first is any JSON object: strings, numbers and nesting everywhere */
        char *schema = i == 0 ? strdup("{\"type\":\"object\",\"additionalProperties\":true}")
                              : gt_random_schema(0xBEEF + (uint64_t)i * 104729);
        prism_grammar_t *g;
        prism_grammar_error_t err;
        prism_grammar_json_opts_t o = { .max_whitespace = i % 3 == 2 ? 2 : 0 };
        if (prism_grammar_compile_json_schema(t.v, schema, strlen(schema), &o, NULL, &g, &err) < 0)
            fail_msg("compile: %s %s", err.path, err.message);
        walk_and_check(&c, g, (uint64_t)i, c.nv > 20000 ? 24 : 40, NULL, NULL, schema);
        prism_grammar_release(g);
        free(schema);
    }
    mctx_free(&c, &t);
}

/* ---- regex vs PCRE2 ---- */
typedef struct { pcre2_code *re; pcre2_match_data *md; prism_buf_t s; } rx_oracle_t;

static bool rx_oracle(void *arg, const prism_buf_t *prefix, const uint8_t *tok, size_t n, bool eos)
{
    rx_oracle_t *o = arg;
    prism_buf_reset(&o->s);
    prism_buf_append(&o->s, prefix->data ? prefix->data : "", prefix->len);
    if (n) prism_buf_append(&o->s, tok, n);
    PCRE2_SPTR subj = (PCRE2_SPTR)(o->s.data ? o->s.data : "");
    int full = pcre2_match(o->re, subj, o->s.len, 0, PCRE2_ANCHORED | PCRE2_ENDANCHORED, o->md, NULL);
    if (eos) return full >= 0;
    if (full >= 0) return true;
    int part = pcre2_match(o->re, subj, o->s.len, 0, PCRE2_ANCHORED | PCRE2_PARTIAL_HARD, o->md, NULL);
    return part == PCRE2_ERROR_PARTIAL;
}

/* ASCII-only patterns without '.' or negated classes: PCRE2's byte semantics equal ours. */
static const char *const REGEXES[] = {
    "[a-z]+@[a-z]+\\.(com|org)",
    "\\d{3}-\\d{2,4}",
    "(ab|a)*c",
    "(true|false|maybe)",
    "[0-9a-f]{2,8}(,[0-9a-f]{2,8}){0,3}",
    "-?\\d+(\\.\\d+)?([eE][+-]?\\d+)?",
    "(\\w+ ){1,3}\\w+",
    "\\[(\"[a-z]{1,3}\"(, )?){1,3}\\]",
    /* 2^k DFA states: matched as NFAs (issue 26), masks still exact */
    "(a|b)*a(a|b){13}",
    "(\\w|\\s)*a(\\w|\\s){30}",
    "(a|ab|b)*b(a|b){20}c?",
};

static void run_regex(int which)
{
    gt_tok_t t;
    mctx_t c;
    if (!mctx_init(&c, which, &t)) fail();
    for (size_t i = 0; i < PRISM_ARRAY_LEN(REGEXES); i++) {
        prism_grammar_t *g;
        prism_grammar_error_t err;
        if (prism_grammar_compile_regex(t.v, REGEXES[i], strlen(REGEXES[i]), NULL, &g, &err) < 0)
            fail_msg("compile %s: %s %s", REGEXES[i], err.path, err.message);
        rx_oracle_t o = {0};
        int ec;
        PCRE2_SIZE eo;
        o.re = pcre2_compile((PCRE2_SPTR)REGEXES[i], PCRE2_ZERO_TERMINATED, 0, &ec, &eo, NULL);
        assert_non_null(o.re);
        o.md = pcre2_match_data_create_from_pattern(o.re, NULL);
        for (int w = 0; w < 2; w++) walk_and_check(&c, g, i * 31 + (uint64_t)w, 12, rx_oracle, &o, REGEXES[i]);
        pcre2_match_data_free(o.md);
        pcre2_code_free(o.re);
        prism_buf_free(&o.s);
        prism_grammar_release(g);
    }
    mctx_free(&c, &t);
}

/* ---- choice ---- */
typedef struct { const char *const *ch; size_t n; } ch_oracle_t;

static bool ch_oracle(void *arg, const prism_buf_t *prefix, const uint8_t *tok, size_t n, bool eos)
{
    ch_oracle_t *o = arg;
    for (size_t i = 0; i < o->n; i++) {
        size_t l = strlen(o->ch[i]);
        if (eos) {
            if (l == prefix->len && !memcmp(o->ch[i], prefix->data ? prefix->data : "", l)) return true;
            continue;
        }
        if (l >= prefix->len + n && !memcmp(o->ch[i], prefix->data ? prefix->data : "", prefix->len) &&
            !memcmp(o->ch[i] + prefix->len, tok, n))
            return true;
    }
    return false;
}

static void run_choice(int which)
{
    gt_tok_t t;
    mctx_t c;
    if (!mctx_init(&c, which, &t)) fail();
    static const char *const CH[] = { "positive", "negative", "neutral", "neg", "pos itive", "日本語", "x" };
    size_t lens[PRISM_ARRAY_LEN(CH)];
    for (size_t i = 0; i < PRISM_ARRAY_LEN(CH); i++) lens[i] = strlen(CH[i]);
    prism_grammar_t *g;
    prism_grammar_error_t err;
    assert_int_equal(prism_grammar_compile_choice(t.v, CH, lens, PRISM_ARRAY_LEN(CH), NULL, &g, &err), PRISM_OK);
    ch_oracle_t o = { CH, PRISM_ARRAY_LEN(CH) };
    for (int w = 0; w < 6; w++) walk_and_check(&c, g, (uint64_t)w, 10, ch_oracle, &o, "choice");
    prism_grammar_release(g);
    mctx_free(&c, &t);
}

/* Every token a mask allows is accepted, on the regexes fuzz_grammar found refusing one (their
 * seeds in tests/fuzz/corpus/fuzz_grammar, replayed here in every build): wide alternations kept as
 * NFAs, whose many stacks (1) made the run from all of them prune what one alone accepts, and (2)
 * made a walk of the uncertain tokens reuse levels of a token it had skipped. Random walks, with
 * the bundled tokenizer and the synthetic one. */
static void test_allowed_tokens_are_accepted(void **st)
{
    (void)st;
    static const char *const SEEDS[] = { "regress-mask-allows-token-accept-prunes",
                                         "regress-mask-walk-levels-after-skipped-token", "regress-subset-blowup-1k" };
    for (int which = -1; which <= 0; which++) {
        gt_tok_t t;
        mctx_t c;
        if (!mctx_init(&c, which, &t)) continue;
        for (size_t f = 0; f < PRISM_ARRAY_LEN(SEEDS); f++) {
            char path[1024];
            tt_source_path(path, sizeof path, "tests/fuzz/corpus/fuzz_grammar/");
            strncat(path, SEEDS[f], sizeof path - strlen(path) - 1);
            char *text = NULL;
            size_t len = 0;
            assert_int_equal(prism_read_file(path, 1 << 20, &text, &len), PRISM_OK);
            prism_grammar_t *g;
            prism_grammar_error_t err;
            if (prism_grammar_compile_regex(t.v, text + 1, len - 1, NULL, &g, &err) != PRISM_OK)
                fail_msg("%s: %s", SEEDS[f], err.message);
            uint64_t r = 7;
            for (int walk = 0; walk < 24; walk++) {
                prism_grammar_matcher_t *m;
                assert_int_equal(prism_grammar_matcher_create(g, NULL, &m), PRISM_OK);
                for (int step = 0; step < 16 && !prism_grammar_matcher_is_terminated(m); step++) {
                    int n = prism_grammar_matcher_fill_mask(m, c.mask);
                    assert_true(n >= 0);
                    if (n == 0) break;
                    int k = gt_randint(&r, n), seen = 0;
                    int32_t pick = -1;
                    for (size_t id = 0; id < c.nv && pick < 0; id++)
                        if (prism_grammar_mask_test(c.mask, (int32_t)id) && seen++ == k) pick = (int32_t)id;
                    if (prism_grammar_matcher_accept_token(m, pick) != PRISM_OK)
                        fail_msg("%s (tokenizer %d, walk %d, step %d): token %d allowed but refused", SEEDS[f], which,
                                 walk, step, pick);
                }
                prism_grammar_matcher_free(m);
            }
            prism_grammar_release(g);
            prism_free(text);
        }
        mctx_free(&c, &t);
    }
}

static void test_json_synth(void **s) { (void)s; run_json(-1); }
static void test_regex_synth(void **s) { (void)s; run_regex(-1); }
static void test_choice_synth(void **s) { (void)s; run_choice(-1); }
static void test_json_tiny(void **s) { (void)s; run_json(0); }
static void test_json_llama3(void **s) { (void)s; run_json(1); }
static void test_json_qwen3(void **s) { (void)s; run_json(2); }
static void test_json_llama2(void **s) { (void)s; run_json(3); }
static void test_regex_tiny(void **s) { (void)s; run_regex(0); }
static void test_regex_llama3(void **s) { (void)s; run_regex(1); }
static void test_regex_llama2(void **s) { (void)s; run_regex(3); }
static void test_choice_tiny(void **s) { (void)s; run_choice(0); }
static void test_choice_qwen3(void **s) { (void)s; run_choice(2); }
static void test_choice_llama2(void **s) { (void)s; run_choice(3); }

/* ---- runtime properties ---- */
static void test_no_alloc_rollback_pool(void **s)
{
    (void)s;
    gt_tok_t t;
    mctx_t c;
    assert_true(mctx_init(&c, 0, &t));
    prism_grammar_t *g;
    prism_grammar_error_t err;
    assert_int_equal(prism_grammar_compile_json_object(t.v, NULL, NULL, &g, &err), PRISM_OK);
    assert_int_equal(prism_grammar_warm(g), PRISM_OK);
    /* a small pool: long outputs must keep working through compaction */
    prism_grammar_limits_t lim = { .max_nodes = 256, .max_rollback = 4 };
    prism_grammar_matcher_t *m;
    assert_int_equal(prism_grammar_matcher_create(g, &lim, &m), PRISM_OK);
    const char *head = "{\"k\": ";
    size_t words = prism_grammar_mask_words(t.v);
    int32_t *masks[3];
    for (int i = 0; i < 3; i++) masks[i] = malloc(words * sizeof *masks[i]);
    uint64_t r = 5;
    /* rollback: the masks after undoing equal the masks seen before */
    assert_int_equal(prism_grammar_matcher_accept_bytes(m, (const uint8_t *)head, strlen(head)), PRISM_OK);
    prism_grammar_matcher_fill_mask(m, masks[0]);
    assert_int_equal(prism_grammar_matcher_accept_bytes(m, (const uint8_t *)"[", 1), PRISM_OK);
    prism_grammar_matcher_fill_mask(m, masks[1]);
    assert_int_equal(prism_grammar_matcher_accept_bytes(m, (const uint8_t *)"\"", 1), PRISM_OK);
    assert_int_equal(prism_grammar_matcher_rollback(m, 1), PRISM_OK);
    prism_grammar_matcher_fill_mask(m, masks[2]);
    assert_memory_equal(masks[1], masks[2], words * sizeof(int32_t));
    assert_int_equal(prism_grammar_matcher_rollback(m, 1), PRISM_OK);
    prism_grammar_matcher_fill_mask(m, masks[2]);
    assert_memory_equal(masks[0], masks[2], words * sizeof(int32_t));
    assert_int_equal(prism_grammar_matcher_rollback(m, 5), PRISM_EINVAL);
    uint64_t allocs = prism_mem_alloc_count();
    int resets = 0;
    for (int step = 0; step < 3000; step++) {
        int n = prism_grammar_matcher_fill_mask(m, c.mask);
        assert_true(n > 0);
        int na = 0;
        for (size_t i = 0; i < c.nv; i++)
            if (prism_grammar_mask_test(c.mask, (int32_t)i) && (int32_t)i != t.eos) c.allowed[na++] = (int32_t)i;
        if (na == 0) {  /* the object closed: start another */
            prism_grammar_matcher_reset(m);
            assert_int_equal(prism_grammar_matcher_accept_bytes(m, (const uint8_t *)head, strlen(head)), PRISM_OK);
            resets++;
            continue;
        }
        int32_t pick = c.allowed[gt_randint(&r, na)];
        assert_int_equal(prism_grammar_matcher_accept_token(m, pick), PRISM_OK);
    }
    fprintf(stderr, "3000 steps, %d resets\n", resets);
    /* the masks, token acceptance and compaction allocated nothing */
    assert_int_equal(prism_mem_alloc_count(), allocs);
    for (int i = 0; i < 3; i++) free(masks[i]);
    prism_grammar_matcher_free(m);
    prism_grammar_release(g);
    mctx_free(&c, &t);
}

/* Run-time nesting bound: deeper nesting is cut off, the matcher stays usable, and near the
 * bound the mask still allows exactly the tokens the matcher accepts (tokens such as "[[" push
 * several frames at once, which the cached sets cannot know about). */
static void test_stack_depth_limit(void **s)
{
    (void)s;
    for (int which = -1; which <= 0; which++) {
        gt_tok_t t;
        mctx_t c;
        assert_true(mctx_init(&c, which, &t));
        prism_grammar_limits_t lim = { .max_stack_depth = 12 };
        prism_grammar_t *g;
        prism_grammar_error_t err;
        assert_int_equal(prism_grammar_compile_json_object(t.v, NULL, &lim, &g, &err), PRISM_OK);
        prism_grammar_matcher_t *m;
        assert_int_equal(prism_grammar_matcher_create(g, NULL, &m), PRISM_OK);
        int depth = 0;
        assert_int_equal(prism_grammar_matcher_accept_bytes(m, (const uint8_t *)"{\"a\": ", 6), PRISM_OK);
        check_by_accept(&c, m, "depth 0");
        while (prism_grammar_matcher_accept_bytes(m, (const uint8_t *)"[", 1) == PRISM_OK) {
            depth++;
            check_by_accept(&c, m, "near the depth limit");
        }
        assert_true(depth > 2 && depth < 12);
        /* still a valid, non-empty state: it can close what it opened */
        assert_true(prism_grammar_matcher_fill_mask(m, c.mask) > 0);
        for (int i = 0; i < depth; i++) assert_int_equal(prism_grammar_matcher_accept_bytes(m, (const uint8_t *)"]", 1), PRISM_OK);
        assert_int_equal(prism_grammar_matcher_accept_bytes(m, (const uint8_t *)"}", 1), PRISM_OK);
        assert_true(prism_grammar_matcher_can_end(m));
        assert_int_equal(prism_grammar_matcher_accept_token(m, t.eos), PRISM_OK);
        assert_true(prism_grammar_matcher_is_terminated(m));
        assert_int_equal(prism_grammar_matcher_fill_mask(m, c.mask), 0);
        assert_int_equal(prism_grammar_matcher_accept_token(m, t.eos), PRISM_EINVAL);
        prism_grammar_matcher_free(m);
        prism_grammar_release(g);
        mctx_free(&c, &t);
    }
}

/* Special tokens are never allowed; EOS only where the grammar can end; forced bytes. */
static void test_special_eos_forced(void **s)
{
    (void)s;
    gt_tok_t t;
    mctx_t c;
    assert_true(mctx_init(&c, 0, &t));
    const char *schema = "{\"type\":\"object\",\"properties\":{\"answer\":{\"type\":\"boolean\"}},\"required\":[\"answer\"],"
                         "\"additionalProperties\":false}";
    prism_grammar_t *g;
    prism_grammar_error_t err;
    assert_int_equal(prism_grammar_compile_json_schema(t.v, schema, strlen(schema), NULL, NULL, &g, &err), PRISM_OK);
    prism_grammar_matcher_t *m;
    assert_int_equal(prism_grammar_matcher_create(g, NULL, &m), PRISM_OK);
    uint8_t forced[64];
    size_t nf = prism_grammar_matcher_forced_bytes(m, forced, sizeof forced);
    assert_int_equal(nf, strlen("{\"answer\":"));
    assert_memory_equal(forced, "{\"answer\":", nf);
    assert_int_equal(prism_grammar_matcher_accept_bytes(m, forced, nf), PRISM_OK);
    prism_grammar_matcher_fill_mask(m, c.mask);
    assert_false(prism_grammar_mask_test(c.mask, t.eos));
    for (size_t i = 0; i < c.nv; i++)
        if (t.special[i]) assert_false(prism_grammar_mask_test(c.mask, (int32_t)i));
    assert_int_equal(prism_grammar_matcher_accept_bytes(m, (const uint8_t *)" tru", 4), PRISM_OK);
    assert_int_equal(prism_grammar_matcher_forced_bytes(m, forced, sizeof forced), 2);  /* "e}" */
    assert_int_equal(prism_grammar_matcher_accept_bytes(m, (const uint8_t *)"e}", 2), PRISM_OK);
    prism_grammar_matcher_fill_mask(m, c.mask);
    assert_true(prism_grammar_mask_test(c.mask, t.eos));
    assert_int_equal(prism_grammar_matcher_fill_mask(m, c.mask), 1);
    prism_grammar_matcher_free(m);
    prism_grammar_release(g);
    mctx_free(&c, &t);
}

/* Matchers on several threads share one grammar (and fill its cache concurrently); each
 * thread's masks equal a single-threaded run's. */
typedef struct { prism_grammar_t *g; const gt_tok_t *t; uint64_t seed; uint64_t digest; } thr_arg_t;

static void *thr_run(void *p)
{
    thr_arg_t *a = p;
    prism_grammar_matcher_t *m;
    if (prism_grammar_matcher_create(a->g, NULL, &m) < 0) return NULL;
    size_t words = prism_grammar_mask_words(a->t->v), nv = prism_grammar_vocab_size(a->t->v);
    int32_t *mask = malloc(words * sizeof *mask), *allowed = malloc(nv * sizeof *allowed);
    uint64_t r = a->seed, h = 1469598103934665603ULL;
    for (int s = 0; s < 60; s++) {
        if (prism_grammar_matcher_fill_mask(m, mask) <= 0) break;
        for (size_t w = 0; w < words; w++) h = (h ^ (uint32_t)mask[w]) * 1099511628211ULL;
        int na = 0;
        for (size_t i = 0; i < nv; i++)
            if (prism_grammar_mask_test(mask, (int32_t)i) && (int32_t)i != a->t->eos) allowed[na++] = (int32_t)i;
        if (!na) break;
        prism_grammar_matcher_accept_token(m, allowed[gt_randint(&r, na)]);
    }
    a->digest = h;
    free(mask);
    free(allowed);
    prism_grammar_matcher_free(m);
    return NULL;
}

static void test_threads(void **s)
{
    (void)s;
    gt_tok_t t;
    assert_true(gt_tok_load(&GT_TOKS[0], &t));
    char *schema = gt_random_schema(77);
    prism_grammar_t *g1, *g2;
    prism_grammar_error_t err;
    assert_int_equal(prism_grammar_compile_json_schema(t.v, schema, strlen(schema), NULL, NULL, &g1, &err), PRISM_OK);
    assert_int_equal(prism_grammar_compile_json_schema(t.v, schema, strlen(schema), NULL, NULL, &g2, &err), PRISM_OK);
    thr_arg_t single[4], multi[4];
    for (int i = 0; i < 4; i++) {
        single[i] = (thr_arg_t){ g1, &t, (uint64_t)i + 1, 0 };
        thr_run(&single[i]);
    }
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        multi[i] = (thr_arg_t){ g2, &t, (uint64_t)i + 1, 0 };
        pthread_create(&th[i], NULL, thr_run, &multi[i]);
    }
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++) assert_true(single[i].digest == multi[i].digest && single[i].digest != 0);
    prism_grammar_release(g1);
    prism_grammar_release(g2);
    free(schema);
    gt_tok_free(&t);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_special_eos_forced),
        cmocka_unit_test(test_no_alloc_rollback_pool),
        cmocka_unit_test(test_stack_depth_limit),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_allowed_tokens_are_accepted),
        cmocka_unit_test(test_json_synth),
        cmocka_unit_test(test_regex_synth),
        cmocka_unit_test(test_choice_synth),
        cmocka_unit_test(test_json_tiny),
        cmocka_unit_test(test_regex_tiny),
        cmocka_unit_test(test_choice_tiny),
    };
    /* on the shared tokenizers: their own entry, Skipped (77) without them (gt_run) */
    const struct CMUnitTest shared[] = {
        cmocka_unit_test(test_json_llama3),
        cmocka_unit_test(test_regex_llama3),
        cmocka_unit_test(test_json_qwen3),
        cmocka_unit_test(test_choice_qwen3),
        cmocka_unit_test(test_json_llama2),
        cmocka_unit_test(test_regex_llama2),
        cmocka_unit_test(test_choice_llama2),
    };
    return gt_run(argc, argv, "test_grammar_mask", tests, PRISM_ARRAY_LEN(tests), shared, PRISM_ARRAY_LEN(shared));
}
