/* Helpers for the grammar tests: the tokenizers to run against, an independent JSON Schema
 * validator for the subset the compiler supports, a seeded random schema generator and a
 * random-walk generator that samples only tokens the mask allows. */
#ifndef PRISM_GRAM_TEST_UTIL_H
#define PRISM_GRAM_TEST_UTIL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tokenizer/tok_test_util.h"
#include "grammar/grammar.h"
#include "tokenizer/tokenizer.h"

typedef struct {
    const char *name;
    const char *rel;     /* tokenizer.json */
    bool shared;         /* under the shared folder (skipped when absent) */
    const char *eos;     /* end-of-sequence token */
} gt_tok_case_t;

static const gt_tok_case_t GT_TOKS[] = {
    { "prism_tiny_llava", "models/prism-tiny-llava/tokenizer.json", false, "</s>" },
    { "llama3_1", "tokenizers/llama3_1/tokenizer.json", true, "<|eot_id|>" },
    { "qwen3", "tokenizers/qwen3/tokenizer.json", true, "<|im_end|>" },
    { "llama2", "tokenizers/llama2/tokenizer.json", true, "</s>" },
};

/* ---- seeded RNG ---- */
static inline uint64_t gt_rand(uint64_t *s)
{
    uint64_t x = *s += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}
static inline int gt_randint(uint64_t *s, int n) { return (int)(gt_rand(s) % (uint64_t)n); }

typedef struct {
    prism_tokenizer_t *tok;
    prism_grammar_vocab_t *v;
    int32_t eos;
    uint8_t *closes;     /* [vocab] 2: token has a '"', 1: a ']' or '}' */
    uint16_t *len;       /* [vocab] token bytes */
    uint8_t *bytes;      /* all token bytes; token i = bytes[off[i] .. off[i+1]) */
    uint32_t *off;       /* [vocab + 1] */
    bool *special;       /* [vocab] */
} gt_tok_t;

static inline const uint8_t *gt_tok_bytes(const gt_tok_t *t, int32_t id, size_t *n)
{
    *n = t->off[id + 1] - t->off[id];
    return t->bytes + t->off[id];
}

static inline void gt_tok_index(gt_tok_t *t, size_t nv)
{
    t->closes = calloc(nv, 1);
    t->len = calloc(nv, sizeof *t->len);
    for (size_t i = 0; i < nv; i++) {
        size_t n;
        const uint8_t *b = gt_tok_bytes(t, (int32_t)i, &n);
        t->len[i] = (uint16_t)PRISM_MIN(n, 65535);
        for (size_t q = 0; q < n; q++)
            if (b[q] == '"') t->closes[i] = 2;  /* ends strings: the first thing a walk must finish */
            else if ((b[q] == ']' || b[q] == '}') && !t->closes[i]) t->closes[i] = 1;
    }
}

/* A synthetic vocabulary: the 256 single bytes (invalid UTF-8 ones included), an EOS, and
 * random multi-byte tokens over JSON punctuation, digits, letters and UTF-8 pieces, so tokens
 * that cross grammar rule boundaries ("}, ", "1,\"", "e\"]") are plentiful. */
static inline void gt_tok_synth(uint64_t seed, size_t n, gt_tok_t *t)
{
    static const char *const PIECES[] = { "{", "}", "[", "]", "\"", ",", ":", " ", "\n", "\\", "0", "1", "7", "-", ".",
                                          "e", "a", "b", "k", "x", "true", "null", "al", "\xc3\xa9", "\xe6\x97\xa5",
                                          "\xe6", "\x97", "\\u", "00", "E+", "@", "_" };
    memset(t, 0, sizeof *t);
    t->off = malloc((n + 1) * sizeof *t->off);
    t->bytes = malloc(n * 16);
    t->special = calloc(n, sizeof *t->special);
    uint64_t r = seed;
    uint32_t pos = 0;
    for (size_t i = 0; i < n; i++) {
        t->off[i] = pos;
        if (i < 256) { t->bytes[pos++] = (uint8_t)i; continue; }
        if (i == 256) { memcpy(t->bytes + pos, "</s>", 4); pos += 4; t->special[i] = true; continue; }
        int parts = 2 + (int)(gt_rand(&r) % 3);
        for (int k = 0; k < parts; k++) {
            const char *p = PIECES[gt_rand(&r) % PRISM_ARRAY_LEN(PIECES)];
            size_t l = strlen(p);
            if (pos - t->off[i] + l > 12) break;
            memcpy(t->bytes + pos, p, l);
            pos += (uint32_t)l;
        }
    }
    t->off[n] = pos;
    t->eos = 256;
    if (prism_grammar_vocab_create_from_bytes(t->bytes, t->off, n, t->special, &t->eos, 1, 0, &t->v) < 0) abort();
    gt_tok_index(t, n);
}

/* The tests on the shared tokenizers run as their own ctest entry (`NAME --shared`, NAME_shared):
 * when the shared folder lacks one of them it exits 77, which ctest reports as Skipped, never as a
 * pass that checked nothing (docs/TESTING.md, "Skipped is never Passed"). Without --shared only the
 * tests on the in-tree and synthetic vocabularies run. */
static inline int gt_run(int argc, char **argv, const char *name, const struct CMUnitTest *local, size_t n_local,
                         const struct CMUnitTest *shared, size_t n_shared)
{
    if (argc < 2 || strcmp(argv[1], "--shared")) return _cmocka_run_group_tests(name, local, n_local, NULL, NULL);
    int missing = 0;
    for (size_t i = 0; i < sizeof GT_TOKS / sizeof GT_TOKS[0]; i++) {
        char path[1024];
        if (!GT_TOKS[i].shared) continue;
        tt_shared_path(path, sizeof path, GT_TOKS[i].rel);
        if (!prism_file_exists(path)) {
            printf("SKIP %s --shared: %s not found (set PRISM_SHARED_DIR)\n", name, path);
            missing++;
        }
    }
    return missing ? 77 : _cmocka_run_group_tests(name, shared, n_shared, NULL, NULL);
}

/* Loads a case; returns false (and prints why) when a shared tokenizer is absent. */
static inline bool gt_tok_load(const gt_tok_case_t *c, gt_tok_t *t)
{
    char path[1024], err[256];
    if (c->shared) tt_shared_path(path, sizeof path, c->rel);
    else tt_source_path(path, sizeof path, c->rel);
    if (!prism_file_exists(path)) {
        fprintf(stderr, "skip %s: %s not found\n", c->name, path);
        return false;
    }
    if (prism_tokenizer_load(path, &t->tok, err, sizeof err) < 0) {
        fprintf(stderr, "load %s: %s\n", path, err);
        abort();
    }
    t->eos = prism_tokenizer_token_to_id(t->tok, c->eos);
    if (t->eos < 0) abort();
    if (prism_grammar_vocab_create(t->tok, &t->eos, 1, 0, &t->v) < 0) abort();
    size_t nv = prism_grammar_vocab_size(t->v);
    prism_buf_t b = {0};
    t->off = malloc((nv + 1) * sizeof *t->off);
    t->special = calloc(nv, sizeof *t->special);
    for (size_t i = 0; i < nv; i++) {
        t->off[i] = (uint32_t)b.len;
        t->special[i] = prism_tokenizer_is_special(t->tok, (int32_t)i);
        if (!t->special[i]) prism_tokenizer_token_bytes(t->tok, (int32_t)i, &b);
    }
    t->off[nv] = (uint32_t)b.len;
    t->bytes = (uint8_t *)b.data;
    gt_tok_index(t, nv);
    return true;
}

static inline void gt_tok_free(gt_tok_t *t)
{
    prism_grammar_vocab_free(t->v);
    if (t->tok) {
        prism_tokenizer_free(t->tok);
        prism_free(t->bytes);
    } else {
        free(t->bytes);
    }
    free(t->off);
    free(t->special);
    free(t->closes);
    free(t->len);
}

/* ---- validator for the supported subset (independent of the compiler) ---- */
static inline size_t gt_utf8_len(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) k++;
    return k;
}

static inline bool gt_regex_search(const char *pat, const char *s, size_t n, bool anchored)
{
    int errc;
    PCRE2_SIZE erroff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | (anchored ? PCRE2_ANCHORED | PCRE2_ENDANCHORED : 0),
                                   &errc, &erroff, NULL);
    if (!re) return false;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, 0, 0, md, NULL);
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return rc >= 0;
}

static inline json_t *gt_resolve(json_t *root, const char *ref)
{
    if (!strcmp(ref, "#")) return root;
    const char *p = strrchr(ref, '/');
    if (!strncmp(ref, "#/$defs/", 8)) return json_object_get(json_object_get(root, "$defs"), p + 1);
    if (!strncmp(ref, "#/definitions/", 14)) return json_object_get(json_object_get(root, "definitions"), p + 1);
    return NULL;
}

static inline bool gt_type_ok(const char *t, json_t *x)
{
    if (!strcmp(t, "string")) return json_is_string(x);
    if (!strcmp(t, "integer")) return json_is_integer(x);
    if (!strcmp(t, "number")) return json_is_number(x);
    if (!strcmp(t, "boolean")) return json_is_boolean(x);
    if (!strcmp(t, "null")) return json_is_null(x);
    if (!strcmp(t, "object")) return json_is_object(x);
    if (!strcmp(t, "array")) return json_is_array(x);
    return false;
}

static const struct { const char *name, *re; } GT_FORMATS[] = {
    { "date", "^\\d{4}-\\d{2}-\\d{2}$" },
    { "date-time", "^\\d{4}-\\d{2}-\\d{2}T\\d{2}:\\d{2}:\\d{2}(\\.\\d+)?(Z|[+-]\\d{2}:\\d{2})$" },
    { "time", "^\\d{2}:\\d{2}:\\d{2}(\\.\\d+)?(Z|[+-]\\d{2}:\\d{2})$" },
    { "email", "^[^@\\s]+@[^@\\s]+\\.[^@\\s]+$" },
    { "uuid", "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$" },
    { "ipv4", "^(\\d{1,3})\\.(\\d{1,3})\\.(\\d{1,3})\\.(\\d{1,3})$" },
};

/* Returns NULL when x validates, else a static message. */
static inline const char *gt_validate(json_t *root, json_t *s, json_t *x, int depth)
{
    if (depth > 200) return "validator depth";
    if (json_is_true(s)) return NULL;
    if (json_is_false(s)) return "false schema";
    json_t *v;
    if ((v = json_object_get(s, "$ref"))) {
        json_t *t = gt_resolve(root, json_string_value(v));
        if (!t) return "unresolved ref";
        return gt_validate(root, t, x, depth + 1);
    }
    if ((v = json_object_get(s, "anyOf")) || (v = json_object_get(s, "oneOf"))) {
        bool one = json_object_get(s, "oneOf") != NULL;
        int hits = 0;
        for (size_t i = 0; i < json_array_size(v); i++)
            if (!gt_validate(root, json_array_get(v, i), x, depth + 1)) hits++;
        if (hits == 0) return "no anyOf/oneOf branch matches";
        if (one && hits > 1) return "several oneOf branches match";
    }
    if ((v = json_object_get(s, "allOf")))
        for (size_t i = 0; i < json_array_size(v); i++) {
            const char *e = gt_validate(root, json_array_get(v, i), x, depth + 1);
            if (e) return e;
        }
    if ((v = json_object_get(s, "type"))) {
        bool ok = false;
        if (json_is_string(v)) ok = gt_type_ok(json_string_value(v), x);
        for (size_t i = 0; json_is_array(v) && i < json_array_size(v); i++)
            ok |= gt_type_ok(json_string_value(json_array_get(v, i)), x);
        if (!ok) return "type mismatch";
    }
    if ((v = json_object_get(s, "const")) && !json_equal(v, x)) return "const mismatch";
    if ((v = json_object_get(s, "enum"))) {
        bool ok = false;
        for (size_t i = 0; i < json_array_size(v); i++) ok |= json_equal(json_array_get(v, i), x);
        if (!ok) return "not in enum";
    }
    if (json_is_string(x)) {
        size_t n = gt_utf8_len(json_string_value(x), json_string_length(x));
        if ((v = json_object_get(s, "minLength")) && n < (size_t)json_integer_value(v)) return "minLength";
        if ((v = json_object_get(s, "maxLength")) && n > (size_t)json_integer_value(v)) return "maxLength";
        if ((v = json_object_get(s, "pattern")) &&
            !gt_regex_search(json_string_value(v), json_string_value(x), json_string_length(x), false))
            return "pattern";
        if ((v = json_object_get(s, "format")))
            for (size_t i = 0; i < PRISM_ARRAY_LEN(GT_FORMATS); i++)
                if (!strcmp(GT_FORMATS[i].name, json_string_value(v)) &&
                    !gt_regex_search(GT_FORMATS[i].re, json_string_value(x), json_string_length(x), false))
                    return "format";
    }
    if (json_is_array(x)) {
        size_t n = json_array_size(x);
        if ((v = json_object_get(s, "minItems")) && n < (size_t)json_integer_value(v)) return "minItems";
        if ((v = json_object_get(s, "maxItems")) && n > (size_t)json_integer_value(v)) return "maxItems";
        json_t *pre = json_object_get(s, "prefixItems");
        size_t k = pre ? json_array_size(pre) : 0;
        for (size_t i = 0; i < n; i++) {
            json_t *sub = i < k ? json_array_get(pre, i) : json_object_get(s, "items");
            if (!sub) continue;
            const char *e = gt_validate(root, sub, json_array_get(x, i), depth + 1);
            if (e) return e;
        }
    }
    if (json_is_object(x)) {
        json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required"),
               *addl = json_object_get(s, "additionalProperties");
        for (size_t i = 0; req && i < json_array_size(req); i++)
            if (!json_object_get(x, json_string_value(json_array_get(req, i)))) return "required missing";
        const char *k;
        json_t *val;
        json_object_foreach(x, k, val) {
            json_t *ps = props ? json_object_get(props, k) : NULL;
            const char *e = NULL;
            if (ps) e = gt_validate(root, ps, val, depth + 1);
            else if (addl) e = gt_validate(root, addl, val, depth + 1);
            if (e) return e;
        }
    }
    return NULL;
}

/* ---- random schemas ---- */
static const char *const GT_PATTERNS[] = {
    "^[a-z]{1,8}$", "^\\d{3}-\\d{4}$", "^(yes|no|maybe)$", "^[A-Z][a-z]+ [A-Z][a-z]+$", "^\\w+@\\w+\\.com$",
    "^[^\"\\\\]{0,5}$", "^(\\+|-)?\\d+(\\.\\d{1,2})?$", "^.{2,4}$",
};
static const char *const GT_WORDS[] = { "name", "age", "id", "tags", "city", "value", "ok", "items", "kind", "x",
                                        "note", "é\u00fc", "a\"b", "count", "data", "ünï" };

static json_t *gt_gen_schema(uint64_t *r, int depth, bool *used_defs);

static json_t *gt_gen_scalar(uint64_t *r)
{
    switch (gt_randint(r, 12)) {
    case 0: return json_pack("{s:s}", "type", "integer");
    case 1: return json_pack("{s:s}", "type", "number");
    case 2: return json_pack("{s:s}", "type", "boolean");
    case 3: return json_pack("{s:s}", "type", "null");
    case 4: return json_pack("{s:s, s:i, s:i}", "type", "string", "minLength", gt_randint(r, 3), "maxLength", 3 + gt_randint(r, 6));
    case 5: return json_pack("{s:s, s:s}", "type", "string", "pattern", GT_PATTERNS[gt_randint(r, (int)PRISM_ARRAY_LEN(GT_PATTERNS))]);
    case 6: {
        static const char *const f[] = { "date", "date-time", "time", "email", "uuid", "ipv4" };
        return json_pack("{s:s, s:s}", "type", "string", "format", f[gt_randint(r, 6)]);
    }
    case 7: return json_pack("{s:[s,i,b,n,f]}", "enum", "red", 42, 1, 2.5);
    case 8: return json_pack("{s:s}", "const", GT_WORDS[gt_randint(r, (int)PRISM_ARRAY_LEN(GT_WORDS))]);
    case 9: return json_pack("{s:[s,s]}", "type", "string", "null");
    case 10: return json_pack("{s:s, s:s}", "type", "string", "description", "free text");
    default: return json_pack("{s:s, s:[s,s,s]}", "type", "string", "enum", "a", "b\"c", "日本");
    }
}

static json_t *gt_gen_schema(uint64_t *r, int depth, bool *used_defs)
{
    int k = depth >= 3 ? 0 : gt_randint(r, 10);
    if (k <= 3) return gt_gen_scalar(r);
    if (k <= 6) {
        json_t *props = json_object(), *req = json_array();
        int n = gt_randint(r, 5);
        for (int i = 0; i < n; i++) {
            char key[32];
            snprintf(key, sizeof key, "%s%d", GT_WORDS[gt_randint(r, (int)PRISM_ARRAY_LEN(GT_WORDS))], i);
            json_object_set_new(props, key, gt_gen_schema(r, depth + 1, used_defs));
            if (gt_randint(r, 2)) json_array_append_new(req, json_string(key));
        }
        json_t *o = json_pack("{s:s, s:o, s:o}", "type", "object", "properties", props, "required", req);
        int a = gt_randint(r, 4);
        if (a == 0) json_object_set_new(o, "additionalProperties", json_false());
        else if (a == 1) json_object_set_new(o, "additionalProperties", json_pack("{s:s}", "type", "integer"));
        else if (a == 2 && depth > 0) json_object_set_new(o, "additionalProperties", json_true());
        return o;
    }
    if (k == 7) {
        int mn = gt_randint(r, 3), mx = mn + gt_randint(r, 4);
        json_t *a = json_pack("{s:s, s:o, s:i}", "type", "array", "items", gt_gen_schema(r, depth + 1, used_defs), "minItems", mn);
        if (gt_randint(r, 2)) json_object_set_new(a, "maxItems", json_integer(mx));
        if (gt_randint(r, 4) == 0)
            json_object_set_new(a, "prefixItems", json_pack("[o]", gt_gen_scalar(r)));
        return a;
    }
    if (k == 8) {
        /* anyOf over distinct types so oneOf semantics also hold */
        return json_pack("{s:[{s:s},{s:s,s:{s:{s:s}},s:[s]}]}", gt_randint(r, 2) ? "anyOf" : "oneOf", "type", "integer",
                         "type", "object", "properties", "v", "type", "string", "required", "v");
    }
    *used_defs = true;
    return json_pack("{s:s}", "$ref", gt_randint(r, 2) ? "#/$defs/point" : "#/$defs/tree");
}

/* A schema (JSON text, malloc'd) for seed. */
static inline char *gt_random_schema(uint64_t seed)
{
    uint64_t r = seed;
    bool defs = false;
    json_t *s = gt_gen_schema(&r, 0, &defs);
    if (gt_randint(&r, 3) == 0) {  /* top level: an object most of the time */
        json_t *o = json_pack("{s:s, s:{s:o}, s:[s]}", "type", "object", "properties", "root", s, "required", "root");
        s = o;
    }
    if (defs) {
        json_t *d = json_pack("{s:{s:s,s:{s:{s:s},s:{s:s}},s:[s,s],s:b},"
                              " s:{s:s,s:{s:{s:s},s:{s:s,s:{s:s},s:i}},s:[s]}}",
                              "point", "type", "object", "properties", "x", "type", "number", "y", "type", "integer",
                              "required", "x", "y", "additionalProperties", 0,
                              "tree", "type", "object", "properties", "label", "type", "string", "kids", "type", "array",
                              "items", "$ref", "#/$defs/tree", "maxItems", 2, "required", "label");
        json_object_set_new(s, "$defs", d);
    }
    char *txt = json_dumps(s, JSON_COMPACT);
    json_decref(s);
    return txt;
}

/* ---- random walk ---- */
typedef struct {
    prism_buf_t out;        /* generated bytes */
    int steps;
    bool terminated;
    int max_allowed_seen;
} gt_walk_t;

/* Samples allowed tokens until EOS or max_steps: half the time uniformly, else the allowed token
 * with the best fixed pseudo-random score, which favours closing characters after a while so
 * walks end. Every sampled token must be accepted. Returns false on an engine inconsistency. */
static inline bool gt_walk(prism_grammar_matcher_t *m, const gt_tok_t *t, uint64_t seed, int max_steps, gt_walk_t *w,
                           int32_t *mask, int32_t *allowed)
{
    const prism_grammar_vocab_t *v = t->v;
    size_t nv = prism_grammar_vocab_size(v);
    uint64_t r = seed;
    for (w->steps = 0; w->steps < max_steps; w->steps++) {
        int n = prism_grammar_matcher_fill_mask(m, mask);
        if (n <= 0) { fprintf(stderr, "walk: mask empty at step %d (n=%d)\n", w->steps, n); return false; }
        int na = 0;
        for (size_t i = 0; i < nv; i++)
            if (prism_grammar_mask_test(mask, (int32_t)i)) allowed[na++] = (int32_t)i;
        if (na != n) { fprintf(stderr, "walk: count %d != bits %d\n", n, na); return false; }
        if (na > w->max_allowed_seen) w->max_allowed_seen = na;
        int32_t pick;
        bool eos_ok = prism_grammar_mask_test(mask, t->eos);
        if (eos_ok && (w->steps > 8 || gt_randint(&r, 2) == 0)) {
            pick = t->eos;
        } else if (gt_randint(&r, 2) == 0 && w->steps < max_steps / 4) {
            pick = allowed[gt_randint(&r, na)];
        } else {
            uint64_t best = 0;
            pick = allowed[0];
            bool late = w->steps > 24;
            for (int i = 0; i < na; i++) {
                uint64_t h = (uint64_t)allowed[i] * 0x9E3779B97F4A7C15ULL ^ seed;
                h ^= h >> 29;
                h *= 0xBF58476D1CE4E5B9ULL;
                h >>= 8;
                if (late) {
                    h += (uint64_t)t->closes[allowed[i]] << 56;
                    if (t->len[allowed[i]] > 3) h >>= 4;
                }
                if (h >= best) { best = h; pick = allowed[i]; }
            }
        }
        int rc = prism_grammar_matcher_accept_token(m, pick);
        if (rc != PRISM_OK) { fprintf(stderr, "walk: allowed token %d rejected (%d)\n", pick, rc); return false; }
        if (pick == t->eos) { w->terminated = true; w->steps++; break; }
        size_t pl;
        const uint8_t *pb = gt_tok_bytes(t, pick, &pl);
        prism_buf_append(&w->out, pb, pl);
    }
    return true;
}

#endif
