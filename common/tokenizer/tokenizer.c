/* tokenizer.json loading (jansson) and the id/token accessors. */
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "tokenizer/tok_internal.h"

typedef struct {
    prism_tokenizer_t *t;
    char *err;
    size_t errlen;
} ld_t;

static int ld_err(ld_t *L, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int ld_err(ld_t *L, int code, const char *fmt, ...)
{
    if (L->err && L->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(L->err, L->errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* ---------------- byte-level alphabet ---------------- */

uint16_t prism_tok_byte_cp[256];
int16_t prism_tok_cp_byte[512];
static pthread_once_t bl_once = PTHREAD_ONCE_INIT;

static void bl_init(void)
{
    /* GPT-2 bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to 256+k. */
    int k = 0;
    for (int i = 0; i < 512; i++) prism_tok_cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        prism_tok_byte_cp[b] = (uint16_t)(keep ? b : 256 + k++);
        prism_tok_cp_byte[prism_tok_byte_cp[b]] = (int16_t)b;
    }
}
void prism_tok_bytelevel_init(void) { pthread_once(&bl_once, bl_init); }

/* ---------------- pool and maps ---------------- */

static int pool_add(prism_tokenizer_t *t, const char *s, size_t n, uint32_t *off)
{
    if (t->pool_len + n + 1 > UINT32_MAX) return PRISM_ELIMIT;
    if (t->pool_len + n + 1 > t->pool_cap) {
        size_t nc = t->pool_cap ? t->pool_cap : 1 << 16;
        while (nc < t->pool_len + n + 1) nc *= 2;
        char *p = prism_realloc(t->pool, nc);
        if (!p) return PRISM_ENOMEM;
        t->pool = p;
        t->pool_cap = nc;
    }
    memcpy(t->pool + t->pool_len, s, n);
    t->pool[t->pool_len + n] = 0;
    *off = (uint32_t)t->pool_len;
    t->pool_len += n + 1;
    return PRISM_OK;
}

static int smap_init(prism_tok_smap_t *m, size_t expect)
{
    size_t cap = 16;
    while (cap < expect * 2) cap *= 2;
    m->slots = prism_malloc(cap * sizeof *m->slots);
    if (!m->slots) return PRISM_ENOMEM;
    for (size_t i = 0; i < cap; i++) m->slots[i].len = UINT32_MAX;
    m->mask = cap - 1;
    m->n = 0;
    return PRISM_OK;
}

static int smap_grow(prism_tok_smap_t *m)
{
    prism_tok_smap_t nm;
    if (smap_init(&nm, (m->mask + 1)) < 0) return PRISM_ENOMEM;
    for (size_t i = 0; i <= m->mask; i++) {
        prism_tok_sslot_t *s = &m->slots[i];
        if (s->len == UINT32_MAX) continue;
        size_t j = s->h & nm.mask;
        while (nm.slots[j].len != UINT32_MAX) j = (j + 1) & nm.mask;
        nm.slots[j] = *s;
        nm.n++;
    }
    prism_free(m->slots);
    *m = nm;
    return PRISM_OK;
}

/* Inserts or overwrites (later wins, as serde's map does). */
static int smap_put(prism_tok_smap_t *m, const char *pool, uint32_t off, uint32_t len, int32_t val)
{
    if ((m->n + 1) * 2 > m->mask + 1 && smap_grow(m) < 0) return PRISM_ENOMEM;
    uint32_t h = (uint32_t)XXH3_64bits(pool + off, len);
    size_t j = h & m->mask;
    for (;;) {
        prism_tok_sslot_t *s = &m->slots[j];
        if (s->len == UINT32_MAX) {
            *s = (prism_tok_sslot_t){ off, len, val, h };
            m->n++;
            return PRISM_OK;
        }
        if (s->h == h && s->len == len && memcmp(pool + s->off, pool + off, len) == 0) {
            s->val = val;
            return PRISM_OK;
        }
        j = (j + 1) & m->mask;
    }
}

int32_t prism_tok_smap_get(const prism_tok_smap_t *m, const char *pool, const char *str, size_t n)
{
    if (!m->slots) return -1;
    uint32_t h = (uint32_t)XXH3_64bits(str, n);
    size_t j = h & m->mask;
    for (;;) {
        const prism_tok_sslot_t *s = &m->slots[j];
        if (s->len == UINT32_MAX) return -1;
        if (s->h == h && s->len == n && memcmp(pool + s->off, str, n) == 0) return s->val;
        j = (j + 1) & m->mask;
    }
}

int32_t prism_tok_vocab_get(const prism_tokenizer_t *t, const char *s, size_t n)
{
    return prism_tok_smap_get(&t->vocab, t->pool, s, n);
}

static inline uint64_t merge_hash(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

static void merges_put(prism_tokenizer_t *t, int32_t a, int32_t b, uint32_t rank, int32_t new_id)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t j = merge_hash(key) & t->merges_mask;
    for (;;) {
        prism_tok_mslot_t *s = &t->merges[j];
        if (s->key == UINT64_MAX) { *s = (prism_tok_mslot_t){ key, rank, new_id }; t->n_merges++; return; }
        if (s->key == key) { s->rank = rank; s->new_id = new_id; return; }
        j = (j + 1) & t->merges_mask;
    }
}

/* ---------------- JSON helpers ---------------- */

static const char *jtype(const json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    case JSON_STRING: return "string";
    case JSON_INTEGER: return "integer";
    case JSON_REAL: return "number";
    case JSON_TRUE: case JSON_FALSE: return "boolean";
    default: return "null";
    }
}

/* Optional boolean field: absent or null gives dflt; any other non-boolean is an error. */
static int get_bool(ld_t *L, const json_t *o, const char *where, const char *key, bool dflt, bool *out)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) { *out = dflt; return PRISM_OK; }
    if (!json_is_boolean(v))
        return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s.%s must be a boolean, not %s", where, key, jtype(v));
    *out = json_is_true(v);
    return PRISM_OK;
}

/* Optional string field: *out = NULL when absent or null. */
static int get_str(ld_t *L, const json_t *o, const char *where, const char *key, const char **out, size_t *len)
{
    json_t *v = json_object_get(o, key);
    *out = NULL;
    if (len) *len = 0;
    if (!v || json_is_null(v)) return PRISM_OK;
    if (!json_is_string(v))
        return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s.%s must be a string, not %s", where, key, jtype(v));
    *out = json_string_value(v);
    if (len) *len = json_string_length(v);
    return PRISM_OK;
}

static int get_uint(ld_t *L, const json_t *o, const char *where, const char *key, uint64_t max, uint64_t dflt,
                    uint64_t *out)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) { *out = dflt; return PRISM_OK; }
    if (!json_is_integer(v))
        return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s.%s must be an integer, not %s", where, key, jtype(v));
    json_int_t x = json_integer_value(v);
    if (x < 0 || (uint64_t)x > max)
        return ld_err(L, PRISM_ELIMIT, "tokenizer.json: %s.%s = %lld is out of range [0, %llu]", where, key,
                      (long long)x, (unsigned long long)max);
    *out = (uint64_t)x;
    return PRISM_OK;
}

static int get_type(ld_t *L, const json_t *o, const char *where, const char **type)
{
    if (!json_is_object(o))
        return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s must be an object, not %s", where, jtype(o));
    json_t *v = json_object_get(o, "type");
    if (!json_is_string(v))
        return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s has no string \"type\"", where);
    *type = json_string_value(v);
    return PRISM_OK;
}

/* One Unicode char given as a JSON string (Metaspace replacement, Strip content). */
static int get_char(ld_t *L, const json_t *o, const char *where, const char *key, const char *dflt, char out[5],
                    int *out_len)
{
    const char *s;
    size_t n;
    int rc = get_str(L, o, where, key, &s, &n);
    if (rc) return rc;
    if (!s) { s = dflt; n = strlen(dflt); }
    if (n == 0 || n > 4 || (size_t)prism_utf8_len((uint8_t)s[0]) != n)
        return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s.%s must be a single character", where, key);
    memcpy(out, s, n);
    out[n] = 0;
    *out_len = (int)n;
    return PRISM_OK;
}

/* ---------------- patterns ---------------- */

void prism_tok_pattern_free(prism_tok_pattern_t *p)
{
    prism_free(p->lit);
    if (p->re) pcre2_code_free(p->re);
    memset(p, 0, sizeof *p);
}

static int compile_regex(ld_t *L, const char *src, size_t n, const char *where, pcre2_code **out)
{
    if (n > PRISM_TOK_MAX_PATTERN)
        return ld_err(L, PRISM_ELIMIT, "tokenizer.json: %s regex is longer than %d bytes", where, PRISM_TOK_MAX_PATTERN);
    prism_buf_t b = {0};
    char rerr[160];
    int rc = prism_tok_regex_rewrite(src, n, &b, rerr, sizeof rerr);
    if (rc) {
        prism_buf_free(&b);
        return ld_err(L, rc, "tokenizer.json: %s regex: %s", where, rerr);
    }
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)(b.data ? b.data : ""), b.len, PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    prism_buf_free(&b);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s regex /%.*s/ does not compile: %s", where,
                      (int)PRISM_MIN(n, 200), src, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);   /* falls back to the interpreter if JIT is absent */
    *out = re;
    return PRISM_OK;
}

/* {"String": s} or {"Regex": r} */
static int parse_pattern(ld_t *L, const json_t *o, const char *where, prism_tok_pattern_t *p)
{
    if (!json_is_object(o))
        return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s.pattern must be an object", where);
    json_t *s = json_object_get(o, "String"), *r = json_object_get(o, "Regex");
    if (json_is_string(s)) {
        size_t n = json_string_length(s);
        if (n == 0) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s.pattern.String is empty", where);
        p->lit = prism_strndup(json_string_value(s), n);
        if (!p->lit) return PRISM_ENOMEM;
        p->lit_len = n;
        return PRISM_OK;
    }
    if (json_is_string(r)) return compile_regex(L, json_string_value(r), json_string_length(r), where, &p->re);
    return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s.pattern needs a \"String\" or \"Regex\" string", where);
}

/* ---------------- normalizers ---------------- */

void prism_tok_norm_free(prism_tok_norm_t *n)
{
    if (!n) return;
    prism_free(n->str);
    prism_tok_pattern_free(&n->pat);
    for (size_t i = 0; i < n->n_items; i++) prism_tok_norm_free(&n->items[i]);
    prism_free(n->items);
}

static int parse_norm(ld_t *L, const json_t *o, int depth, prism_tok_norm_t *n)
{
    const char *type, *s;
    size_t len;
    int rc;
    if (depth > PRISM_TOK_MAX_DEPTH)
        return ld_err(L, PRISM_ELIMIT, "tokenizer.json: normalizer nesting deeper than %d", PRISM_TOK_MAX_DEPTH);
    if ((rc = get_type(L, o, "normalizer", &type))) return rc;
    if (!strcmp(type, "NFC")) { n->type = PRISM_TOK_NORM_NFC; return PRISM_OK; }
    if (!strcmp(type, "NFD")) { n->type = PRISM_TOK_NORM_NFD; return PRISM_OK; }
    if (!strcmp(type, "Prepend")) {
        n->type = PRISM_TOK_NORM_PREPEND;
        if ((rc = get_str(L, o, "normalizer(Prepend)", "prepend", &s, &len))) return rc;
        if (!s) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: normalizer Prepend has no \"prepend\" string");
        if (!(n->str = prism_strndup(s, len))) return PRISM_ENOMEM;
        n->str_len = len;
        return PRISM_OK;
    }
    if (!strcmp(type, "Replace")) {
        n->type = PRISM_TOK_NORM_REPLACE;
        if ((rc = get_str(L, o, "normalizer(Replace)", "content", &s, &len))) return rc;
        if (!s) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: normalizer Replace has no \"content\" string");
        if (!(n->str = prism_strndup(s, len))) return PRISM_ENOMEM;
        n->str_len = len;
        return parse_pattern(L, json_object_get(o, "pattern"), "normalizer(Replace)", &n->pat);
    }
    if (!strcmp(type, "Strip")) {
        n->type = PRISM_TOK_NORM_STRIP;
        if ((rc = get_bool(L, o, "normalizer(Strip)", "strip_left", false, &n->left))) return rc;
        return get_bool(L, o, "normalizer(Strip)", "strip_right", false, &n->right);
    }
    if (!strcmp(type, "Sequence")) {
        n->type = PRISM_TOK_NORM_SEQUENCE;
        json_t *arr = json_object_get(o, "normalizers");
        if (!json_is_array(arr))
            return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: normalizer Sequence needs a \"normalizers\" array");
        size_t k = json_array_size(arr);
        if (k > PRISM_TOK_MAX_SEQ_ITEMS)
            return ld_err(L, PRISM_ELIMIT, "tokenizer.json: normalizer Sequence has more than %d items", PRISM_TOK_MAX_SEQ_ITEMS);
        if (k && !(n->items = prism_calloc(k, sizeof *n->items))) return PRISM_ENOMEM;
        for (size_t i = 0; i < k; i++) {
            n->n_items = i + 1;
            if ((rc = parse_norm(L, json_array_get(arr, i), depth + 1, &n->items[i]))) return rc;
        }
        return PRISM_OK;
    }
    return ld_err(L, PRISM_ENOTSUP, "tokenizer.json: normalizer type '%s' is not supported", type);
}

/* ---------------- pre-tokenizers ---------------- */

static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

void prism_tok_pre_free(prism_tok_pre_t *p)
{
    if (!p) return;
    prism_tok_pattern_free(&p->pat);
    for (size_t i = 0; i < p->n_items; i++) prism_tok_pre_free(&p->items[i]);
    prism_free(p->items);
}

static int parse_prepend_scheme(ld_t *L, const json_t *o, const char *where, prism_tok_prepend_t *out)
{
    const char *s;
    int rc = get_str(L, o, where, "prepend_scheme", &s, NULL);
    if (rc) return rc;
    if (!s) {   /* legacy files: add_prefix_space (default true) */
        bool aps;
        if ((rc = get_bool(L, o, where, "add_prefix_space", true, &aps))) return rc;
        *out = aps ? PRISM_TOK_PREPEND_ALWAYS : PRISM_TOK_PREPEND_NEVER;
        return PRISM_OK;
    }
    if (!strcmp(s, "always")) *out = PRISM_TOK_PREPEND_ALWAYS;
    else if (!strcmp(s, "first")) *out = PRISM_TOK_PREPEND_FIRST;
    else if (!strcmp(s, "never")) *out = PRISM_TOK_PREPEND_NEVER;
    else return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s.prepend_scheme '%s' is unknown", where, s);
    return PRISM_OK;
}

static int parse_pre(ld_t *L, const json_t *o, int depth, prism_tok_pre_t *p)
{
    const char *type, *s;
    int rc;
    if (depth > PRISM_TOK_MAX_DEPTH)
        return ld_err(L, PRISM_ELIMIT, "tokenizer.json: pre_tokenizer nesting deeper than %d", PRISM_TOK_MAX_DEPTH);
    if ((rc = get_type(L, o, "pre_tokenizer", &type))) return rc;
    if (!strcmp(type, "ByteLevel")) {
        p->type = PRISM_TOK_PRE_BYTELEVEL;
        if ((rc = get_bool(L, o, "pre_tokenizer(ByteLevel)", "add_prefix_space", true, &p->add_prefix_space))) return rc;
        if ((rc = get_bool(L, o, "pre_tokenizer(ByteLevel)", "use_regex", true, &p->use_regex))) return rc;
        p->behavior = PRISM_TOK_SPLIT_ISOLATED;
        if (p->use_regex)
            return compile_regex(L, GPT2_PATTERN, strlen(GPT2_PATTERN), "pre_tokenizer(ByteLevel)", &p->pat.re);
        return PRISM_OK;
    }
    if (!strcmp(type, "Split")) {
        p->type = PRISM_TOK_PRE_SPLIT;
        if ((rc = get_bool(L, o, "pre_tokenizer(Split)", "invert", false, &p->invert))) return rc;
        if ((rc = get_str(L, o, "pre_tokenizer(Split)", "behavior", &s, NULL))) return rc;
        if (!s) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: pre_tokenizer Split has no \"behavior\"");
        if (!strcmp(s, "Removed")) p->behavior = PRISM_TOK_SPLIT_REMOVED;
        else if (!strcmp(s, "Isolated")) p->behavior = PRISM_TOK_SPLIT_ISOLATED;
        else if (!strcmp(s, "MergedWithPrevious")) p->behavior = PRISM_TOK_SPLIT_MERGED_PREV;
        else if (!strcmp(s, "MergedWithNext")) p->behavior = PRISM_TOK_SPLIT_MERGED_NEXT;
        else if (!strcmp(s, "Contiguous")) p->behavior = PRISM_TOK_SPLIT_CONTIGUOUS;
        else return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: pre_tokenizer Split behavior '%s' is unknown", s);
        return parse_pattern(L, json_object_get(o, "pattern"), "pre_tokenizer(Split)", &p->pat);
    }
    if (!strcmp(type, "Metaspace")) {
        p->type = PRISM_TOK_PRE_METASPACE;
        if ((rc = get_char(L, o, "pre_tokenizer(Metaspace)", "replacement", "\xE2\x96\x81", p->repl, &p->repl_len)))
            return rc;
        if ((rc = parse_prepend_scheme(L, o, "pre_tokenizer(Metaspace)", &p->prepend))) return rc;
        return get_bool(L, o, "pre_tokenizer(Metaspace)", "split", true, &p->split);
    }
    if (!strcmp(type, "Digits")) {
        bool individual;
        p->type = PRISM_TOK_PRE_DIGITS;
        if ((rc = get_bool(L, o, "pre_tokenizer(Digits)", "individual_digits", false, &individual))) return rc;
        p->behavior = individual ? PRISM_TOK_SPLIT_ISOLATED : PRISM_TOK_SPLIT_CONTIGUOUS;
        return compile_regex(L, "\\p{N}", 5, "pre_tokenizer(Digits)", &p->pat.re);
    }
    if (!strcmp(type, "WhitespaceSplit")) {
        p->type = PRISM_TOK_PRE_WHITESPACE_SPLIT;
        p->behavior = PRISM_TOK_SPLIT_REMOVED;
        return compile_regex(L, "\\s", 2, "pre_tokenizer(WhitespaceSplit)", &p->pat.re);
    }
    if (!strcmp(type, "Sequence")) {
        p->type = PRISM_TOK_PRE_SEQUENCE;
        json_t *arr = json_object_get(o, "pretokenizers");
        if (!json_is_array(arr))
            return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: pre_tokenizer Sequence needs a \"pretokenizers\" array");
        size_t k = json_array_size(arr);
        if (k > PRISM_TOK_MAX_SEQ_ITEMS)
            return ld_err(L, PRISM_ELIMIT, "tokenizer.json: pre_tokenizer Sequence has more than %d items", PRISM_TOK_MAX_SEQ_ITEMS);
        if (k && !(p->items = prism_calloc(k, sizeof *p->items))) return PRISM_ENOMEM;
        for (size_t i = 0; i < k; i++) {
            p->n_items = i + 1;
            if ((rc = parse_pre(L, json_array_get(arr, i), depth + 1, &p->items[i]))) return rc;
        }
        return PRISM_OK;
    }
    return ld_err(L, PRISM_ENOTSUP, "tokenizer.json: pre_tokenizer type '%s' is not supported", type);
}

/* ---------------- decoders ---------------- */

void prism_tok_dec_free(prism_tok_dec_t *d)
{
    if (!d) return;
    prism_free(d->str);
    prism_tok_pattern_free(&d->pat);
    for (size_t i = 0; i < d->n_items; i++) prism_tok_dec_free(&d->items[i]);
    prism_free(d->items);
}

static int parse_dec(ld_t *L, const json_t *o, int depth, prism_tok_dec_t *d)
{
    const char *type, *s;
    size_t len;
    uint64_t v;
    int rc;
    prism_tokenizer_t *t = L->t;
    if (depth > PRISM_TOK_MAX_DEPTH)
        return ld_err(L, PRISM_ELIMIT, "tokenizer.json: decoder nesting deeper than %d", PRISM_TOK_MAX_DEPTH);
    if ((rc = get_type(L, o, "decoder", &type))) return rc;
    if (!strcmp(type, "ByteLevel")) { d->type = PRISM_TOK_DEC_BYTELEVEL; t->dec_bytelevel = true; return PRISM_OK; }
    if (!strcmp(type, "ByteFallback")) { d->type = PRISM_TOK_DEC_BYTEFALLBACK; t->dec_bytefallback = true; return PRISM_OK; }
    if (!strcmp(type, "Fuse")) { d->type = PRISM_TOK_DEC_FUSE; return PRISM_OK; }
    if (!strcmp(type, "Metaspace")) {
        d->type = PRISM_TOK_DEC_METASPACE;
        if ((rc = get_char(L, o, "decoder(Metaspace)", "replacement", "\xE2\x96\x81", d->repl, &d->repl_len))) return rc;
        return parse_prepend_scheme(L, o, "decoder(Metaspace)", &d->prepend);
    }
    if (!strcmp(type, "Strip")) {
        d->type = PRISM_TOK_DEC_STRIP;
        if ((rc = get_char(L, o, "decoder(Strip)", "content", " ", d->repl, &d->repl_len))) return rc;
        if ((rc = get_uint(L, o, "decoder(Strip)", "start", 1 << 20, 0, &v))) return rc;
        d->start = (size_t)v;
        if ((rc = get_uint(L, o, "decoder(Strip)", "stop", 1 << 20, 0, &v))) return rc;
        d->stop = (size_t)v;
        return PRISM_OK;
    }
    if (!strcmp(type, "Replace")) {
        d->type = PRISM_TOK_DEC_REPLACE;
        if ((rc = get_str(L, o, "decoder(Replace)", "content", &s, &len))) return rc;
        if (!s) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: decoder Replace has no \"content\" string");
        if (!(d->str = prism_strndup(s, len))) return PRISM_ENOMEM;
        d->str_len = len;
        return parse_pattern(L, json_object_get(o, "pattern"), "decoder(Replace)", &d->pat);
    }
    if (!strcmp(type, "Sequence")) {
        d->type = PRISM_TOK_DEC_SEQUENCE;
        json_t *arr = json_object_get(o, "decoders");
        if (!json_is_array(arr))
            return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: decoder Sequence needs a \"decoders\" array");
        size_t k = json_array_size(arr);
        if (k > PRISM_TOK_MAX_SEQ_ITEMS)
            return ld_err(L, PRISM_ELIMIT, "tokenizer.json: decoder Sequence has more than %d items", PRISM_TOK_MAX_SEQ_ITEMS);
        if (k && !(d->items = prism_calloc(k, sizeof *d->items))) return PRISM_ENOMEM;
        for (size_t i = 0; i < k; i++) {
            d->n_items = i + 1;
            if ((rc = parse_dec(L, json_array_get(arr, i), depth + 1, &d->items[i]))) return rc;
        }
        return PRISM_OK;
    }
    return ld_err(L, PRISM_ENOTSUP, "tokenizer.json: decoder type '%s' is not supported", type);
}

/* ---------------- post-processors ---------------- */

static int pp_add(ld_t *L, int32_t *arr, size_t *n, int32_t id)
{
    if (*n >= PRISM_TOK_MAX_PP_IDS)
        return ld_err(L, PRISM_ELIMIT, "tokenizer.json: post_processor adds more than %d ids", PRISM_TOK_MAX_PP_IDS);
    if (id < 0 || (uint32_t)id >= PRISM_TOK_MAX_VOCAB)
        return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: post_processor special id %d is out of range", id);
    arr[(*n)++] = id;
    return PRISM_OK;
}

/* Single-sequence template as prefix/suffix ids. `pre`/`suf` are this processor's own; the
 * caller wraps them around what earlier processors of a Sequence produced. */
static int parse_pp(ld_t *L, const json_t *o, int depth, int32_t *pre, size_t *npre, int32_t *suf, size_t *nsuf)
{
    const char *type;
    int rc;
    if (depth > PRISM_TOK_MAX_DEPTH)
        return ld_err(L, PRISM_ELIMIT, "tokenizer.json: post_processor nesting deeper than %d", PRISM_TOK_MAX_DEPTH);
    if ((rc = get_type(L, o, "post_processor", &type))) return rc;
    if (!strcmp(type, "ByteLevel")) return PRISM_OK;   /* offsets only */
    if (!strcmp(type, "RobertaProcessing") || !strcmp(type, "BertProcessing")) {
        json_t *cls = json_object_get(o, "cls"), *sep = json_object_get(o, "sep");
        if (!json_is_array(cls) || json_array_size(cls) != 2 || !json_is_integer(json_array_get(cls, 1)) ||
            !json_is_array(sep) || json_array_size(sep) != 2 || !json_is_integer(json_array_get(sep, 1)))
            return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: post_processor %s needs cls/sep [token, id] pairs", type);
        json_int_t c = json_integer_value(json_array_get(cls, 1)), s = json_integer_value(json_array_get(sep, 1));
        if (c < 0 || c >= PRISM_TOK_MAX_VOCAB || s < 0 || s >= PRISM_TOK_MAX_VOCAB)
            return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: post_processor %s id out of range", type);
        if ((rc = pp_add(L, pre, npre, (int32_t)c))) return rc;
        return pp_add(L, suf, nsuf, (int32_t)s);
    }
    if (!strcmp(type, "TemplateProcessing")) {
        json_t *single = json_object_get(o, "single"), *specials = json_object_get(o, "special_tokens");
        if (!json_is_array(single))
            return ld_err(L, PRISM_ENOTSUP, "tokenizer.json: post_processor TemplateProcessing.single must be an array");
        if (specials && !json_is_null(specials) && !json_is_object(specials))
            return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: post_processor TemplateProcessing.special_tokens must be an object");
        int seen_a = 0;
        size_t i;
        json_t *item;
        json_array_foreach(single, i, item) {
            json_t *st = json_object_get(item, "SpecialToken"), *sq = json_object_get(item, "Sequence");
            if (json_is_object(sq)) {
                json_t *id = json_object_get(sq, "id");
                if (!json_is_string(id) || strcmp(json_string_value(id), "A"))
                    return ld_err(L, PRISM_ENOTSUP, "tokenizer.json: TemplateProcessing.single may only use sequence A");
                seen_a++;
                continue;
            }
            if (!json_is_object(st) || !json_is_string(json_object_get(st, "id")))
                return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: TemplateProcessing.single item %zu is malformed", i);
            const char *name = json_string_value(json_object_get(st, "id"));
            json_t *sp = specials ? json_object_get(specials, name) : NULL;
            json_t *ids = sp ? json_object_get(sp, "ids") : NULL;
            if (!json_is_array(ids))
                return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: TemplateProcessing special token '%s' has no ids", name);
            size_t k;
            json_t *x;
            json_array_foreach(ids, k, x) {
                if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= PRISM_TOK_MAX_VOCAB)
                    return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: TemplateProcessing special token '%s' has a bad id", name);
                if ((rc = seen_a ? pp_add(L, suf, nsuf, (int32_t)json_integer_value(x))
                                 : pp_add(L, pre, npre, (int32_t)json_integer_value(x))))
                    return rc;
            }
        }
        if (seen_a != 1)
            return ld_err(L, PRISM_ENOTSUP, "tokenizer.json: TemplateProcessing.single must contain sequence A exactly once");
        return PRISM_OK;
    }
    if (!strcmp(type, "Sequence")) {
        json_t *arr = json_object_get(o, "processors");
        if (!json_is_array(arr))
            return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: post_processor Sequence needs a \"processors\" array");
        if (json_array_size(arr) > PRISM_TOK_MAX_SEQ_ITEMS)
            return ld_err(L, PRISM_ELIMIT, "tokenizer.json: post_processor Sequence has too many items");
        size_t i;
        json_t *item;
        json_array_foreach(arr, i, item) {
            /* a later processor wraps the output of the earlier ones */
            int32_t p2[PRISM_TOK_MAX_PP_IDS], s2[PRISM_TOK_MAX_PP_IDS];
            size_t np2 = 0, ns2 = 0;
            if ((rc = parse_pp(L, item, depth + 1, p2, &np2, s2, &ns2))) return rc;
            if (*npre + np2 > PRISM_TOK_MAX_PP_IDS || *nsuf + ns2 > PRISM_TOK_MAX_PP_IDS)
                return ld_err(L, PRISM_ELIMIT, "tokenizer.json: post_processor adds more than %d ids", PRISM_TOK_MAX_PP_IDS);
            memmove(pre + np2, pre, *npre * sizeof *pre);
            memcpy(pre, p2, np2 * sizeof *pre);
            *npre += np2;
            memcpy(suf + *nsuf, s2, ns2 * sizeof *suf);
            *nsuf += ns2;
        }
        return PRISM_OK;
    }
    return ld_err(L, PRISM_ENOTSUP, "tokenizer.json: post_processor type '%s' is not supported", type);
}

/* ---------------- model ---------------- */

static int merge_pair(ld_t *L, const json_t *m, size_t rank, const char **a, size_t *al, const char **b, size_t *bl)
{
    if (json_is_string(m)) {
        const char *s = json_string_value(m);
        size_t n = json_string_length(m);
        const char *sp = memchr(s, ' ', n);
        if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s)))
            return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: model.merges[%zu] \"%.64s\" is not \"a b\"", rank, s);
        *a = s; *al = (size_t)(sp - s);
        *b = sp + 1; *bl = n - *al - 1;
        return PRISM_OK;
    }
    if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
        json_is_string(json_array_get(m, 1))) {
        *a = json_string_value(json_array_get(m, 0)); *al = json_string_length(json_array_get(m, 0));
        *b = json_string_value(json_array_get(m, 1)); *bl = json_string_length(json_array_get(m, 1));
        return PRISM_OK;
    }
    return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: model.merges[%zu] must be \"a b\" or [\"a\", \"b\"]", rank);
}

static int parse_model(ld_t *L, const json_t *m, size_t *max_id)
{
    prism_tokenizer_t *t = L->t;
    int rc;
    const char *s;
    size_t len;
    if (!json_is_object(m)) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: \"model\" must be an object");
    json_t *ty = json_object_get(m, "type");
    if (ty && !json_is_string(ty)) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: model.type must be a string");
    if (ty && strcmp(json_string_value(ty), "BPE"))
        return ld_err(L, PRISM_ENOTSUP, "tokenizer.json: model type '%s' is not supported (only BPE)", json_string_value(ty));
    json_t *vocab = json_object_get(m, "vocab"), *merges = json_object_get(m, "merges");
    if (!ty && !merges)
        return ld_err(L, PRISM_ENOTSUP, "tokenizer.json: model has no type and no merges (only BPE is supported)");
    if (!json_is_object(vocab)) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: model.vocab must be an object");
    if (merges && !json_is_null(merges) && !json_is_array(merges))
        return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: model.merges must be an array");
    json_t *dropout = json_object_get(m, "dropout");
    if (dropout && !json_is_null(dropout) && !(json_is_number(dropout) && json_number_value(dropout) == 0.0))
        return ld_err(L, PRISM_ENOTSUP, "tokenizer.json: BPE dropout is not supported (randomised)");
    if ((rc = get_bool(L, m, "model", "byte_fallback", false, &t->byte_fallback))) return rc;
    if ((rc = get_bool(L, m, "model", "fuse_unk", false, &t->fuse_unk))) return rc;
    if ((rc = get_bool(L, m, "model", "ignore_merges", false, &t->ignore_merges))) return rc;
    if ((rc = get_str(L, m, "model", "continuing_subword_prefix", &s, &len))) return rc;
    if (s && len && !(t->cont_prefix = prism_strndup(s, len))) return PRISM_ENOMEM;
    t->cont_prefix_len = s ? len : 0;
    if ((rc = get_str(L, m, "model", "end_of_word_suffix", &s, &len))) return rc;
    if (s && len && !(t->eow_suffix = prism_strndup(s, len))) return PRISM_ENOMEM;
    t->eow_suffix_len = s ? len : 0;

    size_t nv = json_object_size(vocab);
    if (nv > PRISM_TOK_MAX_VOCAB)
        return ld_err(L, PRISM_ELIMIT, "tokenizer.json: model.vocab has %zu entries (limit %u)", nv, PRISM_TOK_MAX_VOCAB);
    if ((rc = smap_init(&t->vocab, nv))) return rc;
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)vocab, key, val) {
        size_t kl = strlen(key);   /* jansson object keys are NUL-terminated */
        if (!json_is_integer(val))
            return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: model.vocab[\"%.64s\"] must be an integer id, not %s", key, jtype(val));
        json_int_t id = json_integer_value(val);
        if (id < 0 || id >= PRISM_TOK_MAX_VOCAB)
            return ld_err(L, PRISM_ELIMIT, "tokenizer.json: model.vocab[\"%.64s\"] = %lld is out of range", key, (long long)id);
        if (kl > PRISM_TOK_MAX_TOKEN_BYTES)
            return ld_err(L, PRISM_ELIMIT, "tokenizer.json: a vocab token is longer than %u bytes", PRISM_TOK_MAX_TOKEN_BYTES);
        uint32_t off;
        if ((rc = pool_add(t, key, kl, &off))) return rc;
        if ((rc = smap_put(&t->vocab, t->pool, off, (uint32_t)kl, (int32_t)id))) return rc;
        if ((size_t)id + 1 > *max_id) *max_id = (size_t)id + 1;
    }

    if ((rc = get_str(L, m, "model", "unk_token", &s, &len))) return rc;
    t->unk_id = -1;
    if (s) {
        t->unk_id = prism_tok_vocab_get(t, s, len);
        t->unk_missing = t->unk_id < 0;
    }
    for (int b = 0; b < 256; b++) {
        char nm[8];
        snprintf(nm, sizeof nm, "<0x%02X>", b);
        t->byte_id[b] = prism_tok_vocab_get(t, nm, 6);
    }

    size_t nm = merges && json_is_array(merges) ? json_array_size(merges) : 0;
    if (nm > PRISM_TOK_MAX_MERGES)
        return ld_err(L, PRISM_ELIMIT, "tokenizer.json: model.merges has %zu entries (limit %u)", nm, PRISM_TOK_MAX_MERGES);
    size_t cap = 16;
    while (cap < nm * 2) cap *= 2;
    if (!(t->merges = prism_malloc(cap * sizeof *t->merges))) return PRISM_ENOMEM;
    for (size_t i = 0; i < cap; i++) t->merges[i].key = UINT64_MAX;
    t->merges_mask = cap - 1;
    char *cat = NULL;
    size_t catcap = 0;
    for (size_t r = 0; r < nm; r++) {
        const char *a = NULL, *b = NULL;
        size_t al = 0, bl = 0;
        if ((rc = merge_pair(L, json_array_get(merges, r), r, &a, &al, &b, &bl))) goto merr;
        int32_t ia = prism_tok_vocab_get(t, a, al), ib = prism_tok_vocab_get(t, b, bl);
        if (ia < 0 || ib < 0) {
            rc = ld_err(L, PRISM_ECORRUPT, "tokenizer.json: model.merges[%zu]: token \"%.*s\" is not in the vocab", r,
                        (int)PRISM_MIN(ia < 0 ? al : bl, 64), ia < 0 ? a : b);
            goto merr;
        }
        size_t skip = t->cont_prefix_len;
        if (skip && (bl < skip || memcmp(b, t->cont_prefix, skip))) skip = 0;
        if (al + bl > catcap) {
            catcap = (al + bl) * 2;
            char *p = prism_realloc(cat, catcap);
            if (!p) { rc = PRISM_ENOMEM; goto merr; }
            cat = p;
        }
        memcpy(cat, a, al);
        memcpy(cat + al, b + skip, bl - skip);
        int32_t in = prism_tok_vocab_get(t, cat, al + bl - skip);
        if (in < 0) {
            rc = ld_err(L, PRISM_ECORRUPT, "tokenizer.json: model.merges[%zu]: merged token \"%.*s\" is not in the vocab", r,
                        (int)PRISM_MIN(al + bl - skip, 64), cat);
            goto merr;
        }
        merges_put(t, ia, ib, (uint32_t)r, in);
    }
    prism_free(cat);

    t->char_table = !t->cont_prefix && !t->eow_suffix;
    for (uint32_t cp = 0; cp < 0x800; cp++) {
        char b[4];
        int k = prism_utf8_encode(cp, b);
        t->char_id[cp] = prism_tok_vocab_get(t, b, (size_t)k);
    }
    return PRISM_OK;
merr:
    prism_free(cat);
    return rc;
}

/* ---------------- added tokens ---------------- */

static void normalize_for_match(prism_tokenizer_t *t, const char *s, size_t n, prism_buf_t *out);

static int build_matcher(prism_tokenizer_t *t, prism_tok_matcher_t *mt, bool normalized)
{
    size_t cnt[256] = {0}, total = 0;
    for (size_t i = 0; i < t->n_added; i++) {
        prism_tok_added_t *a = &t->added[i];
        uint32_t len = normalized ? a->nlen : a->len;
        if (a->normalized != normalized || len == 0) continue;
        cnt[(uint8_t)t->pool[normalized ? a->noff : a->off]]++;
        total++;
    }
    mt->n = total;
    if (!total) return PRISM_OK;
    if (!(mt->order = prism_malloc(total * sizeof *mt->order))) return PRISM_ENOMEM;
    mt->start[0] = 0;
    for (int b = 0; b < 256; b++) mt->start[b + 1] = mt->start[b] + (uint32_t)cnt[b];
    uint32_t fill[256];
    memcpy(fill, mt->start, sizeof fill);
    for (size_t i = 0; i < t->n_added; i++) {
        prism_tok_added_t *a = &t->added[i];
        uint32_t len = normalized ? a->nlen : a->len;
        if (a->normalized != normalized || len == 0) continue;
        uint8_t b = (uint8_t)t->pool[normalized ? a->noff : a->off];
        /* insertion keeps each bucket longest-first (ties: earlier token first) */
        uint32_t j = fill[b]++;
        while (j > mt->start[b]) {
            prism_tok_added_t *p = &t->added[mt->order[j - 1]];
            if ((normalized ? p->nlen : p->len) >= len) break;
            mt->order[j] = mt->order[j - 1];
            j--;
        }
        mt->order[j] = (uint32_t)i;
    }
    return PRISM_OK;
}

static int parse_added(ld_t *L, const json_t *arr, size_t *max_id)
{
    prism_tokenizer_t *t = L->t;
    int rc;
    if (!arr || json_is_null(arr)) return PRISM_OK;
    if (!json_is_array(arr)) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: \"added_tokens\" must be an array");
    size_t n = json_array_size(arr);
    if (n > PRISM_TOK_MAX_ADDED)
        return ld_err(L, PRISM_ELIMIT, "tokenizer.json: %zu added tokens (limit %u)", n, PRISM_TOK_MAX_ADDED);
    if (n && !(t->added = prism_calloc(n, sizeof *t->added))) return PRISM_ENOMEM;
    if ((rc = smap_init(&t->added_map, n))) return rc;
    for (size_t i = 0; i < n; i++) {
        json_t *o = json_array_get(arr, i);
        char where[48];
        snprintf(where, sizeof where, "added_tokens[%zu]", i);
        if (!json_is_object(o)) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s must be an object", where);
        prism_tok_added_t *a = &t->added[t->n_added];
        uint64_t id;
        const char *s;
        size_t len;
        if ((rc = get_uint(L, o, where, "id", PRISM_TOK_MAX_VOCAB - 1, UINT64_MAX, &id))) return rc;
        if (id == UINT64_MAX) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s has no \"id\"", where);
        if ((rc = get_str(L, o, where, "content", &s, &len))) return rc;
        if (!s) return ld_err(L, PRISM_ECORRUPT, "tokenizer.json: %s has no \"content\"", where);
        if (len > PRISM_TOK_MAX_TOKEN_BYTES)
            return ld_err(L, PRISM_ELIMIT, "tokenizer.json: %s is longer than %u bytes", where, PRISM_TOK_MAX_TOKEN_BYTES);
        if ((rc = get_bool(L, o, where, "special", false, &a->special))) return rc;
        if ((rc = get_bool(L, o, where, "single_word", false, &a->single_word))) return rc;
        if ((rc = get_bool(L, o, where, "lstrip", false, &a->lstrip))) return rc;
        if ((rc = get_bool(L, o, where, "rstrip", false, &a->rstrip))) return rc;
        if ((rc = get_bool(L, o, where, "normalized", !a->special, &a->normalized))) return rc;
        a->id = (int32_t)id;
        if ((rc = pool_add(t, s, len, &a->off))) return rc;
        a->len = (uint32_t)len;
        a->noff = a->off;
        a->nlen = a->len;
        if ((rc = smap_put(&t->added_map, t->pool, a->off, a->len, (int32_t)t->n_added))) return rc;
        t->n_added++;
        if ((size_t)id + 1 > *max_id) *max_id = (size_t)id + 1;
    }
    return PRISM_OK;
}

/* Normalized added tokens are matched against normalized text, so their content is normalized
 * once here (HF does the same when it builds its normalized trie). */
static int normalize_added(prism_tokenizer_t *t)
{
    if (!t->normalizer) return PRISM_OK;
    prism_buf_t b = {0};
    for (size_t i = 0; i < t->n_added; i++) {
        prism_tok_added_t *a = &t->added[i];
        if (!a->normalized) continue;
        b.len = 0;
        normalize_for_match(t, t->pool + a->off, a->len, &b);
        if (!b.data) { prism_buf_free(&b); return PRISM_ENOMEM; }
        uint32_t off;
        if (pool_add(t, b.data, b.len, &off)) { prism_buf_free(&b); return PRISM_ENOMEM; }
        a->noff = off;
        a->nlen = (uint32_t)b.len;
    }
    prism_buf_free(&b);
    return PRISM_OK;
}

static void normalize_for_match(prism_tokenizer_t *t, const char *s, size_t n, prism_buf_t *out)
{
    pcre2_match_data *md = pcre2_match_data_create(32, NULL);
    if (!md || prism_tok_normalize(t, t->normalizer, s, n, out, md) < 0 || prism_buf_reserve(out, 1) < 0) {
        prism_buf_free(out);
    }
    if (md) pcre2_match_data_free(md);
}

/* ---------------- top level ---------------- */

void prism_tokenizer_free(prism_tokenizer_t *t)
{
    if (!t) return;
    prism_free(t->pool);
    prism_free(t->id_off);
    prism_free(t->id_len);
    prism_free(t->is_special);
    prism_free(t->vocab.slots);
    prism_free(t->merges);
    prism_free(t->cont_prefix);
    prism_free(t->eow_suffix);
    prism_free(t->added);
    prism_free(t->added_map.slots);
    prism_free(t->match_raw.order);
    prism_free(t->match_norm.order);
    if (t->normalizer) { prism_tok_norm_free(t->normalizer); prism_free(t->normalizer); }
    if (t->pre) { prism_tok_pre_free(t->pre); prism_free(t->pre); }
    if (t->decoder) { prism_tok_dec_free(t->decoder); prism_free(t->decoder); }
    prism_free(t);
}

int prism_tokenizer_load_from_memory(const char *json, size_t len, prism_tokenizer_t **out, char *err, size_t errlen)
{
    *out = NULL;
    if (err && errlen) err[0] = 0;
    ld_t L = { NULL, err, errlen };
    if (len > PRISM_TOK_MAX_JSON_BYTES)
        return ld_err(&L, PRISM_ELIMIT, "tokenizer.json is %zu bytes (limit %zu)", len, PRISM_TOK_MAX_JSON_BYTES);
    prism_tok_bytelevel_init();
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_ALLOW_NUL, &je);
    if (!root) return ld_err(&L, PRISM_ECORRUPT, "tokenizer.json: invalid JSON at line %d column %d: %s", je.line, je.column, je.text);
    int rc;
    prism_tokenizer_t *t = prism_calloc(1, sizeof *t);
    if (!t) { rc = PRISM_ENOMEM; goto fail; }
    L.t = t;
    if (!json_is_object(root)) { rc = ld_err(&L, PRISM_ECORRUPT, "tokenizer.json: top level must be an object"); goto fail; }
    json_t *model = json_object_get(root, "model");
    if (!model || json_is_null(model)) { rc = ld_err(&L, PRISM_ECORRUPT, "tokenizer.json: missing \"model\""); goto fail; }
    json_t *trunc = json_object_get(root, "truncation"), *pad = json_object_get(root, "padding");
    if ((trunc && !json_is_null(trunc)) || (pad && !json_is_null(pad)))
        PRISM_WARN("tokenizer.json: truncation/padding settings are ignored");

    size_t max_id = 0;
    if ((rc = parse_model(&L, model, &max_id))) goto fail;
    if ((rc = parse_added(&L, json_object_get(root, "added_tokens"), &max_id))) goto fail;

    json_t *c;
    if ((c = json_object_get(root, "normalizer")) && !json_is_null(c)) {
        if (!(t->normalizer = prism_calloc(1, sizeof *t->normalizer))) { rc = PRISM_ENOMEM; goto fail; }
        if ((rc = parse_norm(&L, c, 0, t->normalizer))) goto fail;
    }
    if ((c = json_object_get(root, "pre_tokenizer")) && !json_is_null(c)) {
        if (!(t->pre = prism_calloc(1, sizeof *t->pre))) { rc = PRISM_ENOMEM; goto fail; }
        if ((rc = parse_pre(&L, c, 0, t->pre))) goto fail;
    }
    if ((c = json_object_get(root, "decoder")) && !json_is_null(c)) {
        if (!(t->decoder = prism_calloc(1, sizeof *t->decoder))) { rc = PRISM_ENOMEM; goto fail; }
        if ((rc = parse_dec(&L, c, 0, t->decoder))) goto fail;
    }
    if ((c = json_object_get(root, "post_processor")) && !json_is_null(c)) {
        if ((rc = parse_pp(&L, c, 0, t->pp_prefix, &t->n_pp_prefix, t->pp_suffix, &t->n_pp_suffix))) goto fail;
    }
    for (size_t i = 0; i < t->n_pp_prefix; i++) if ((size_t)t->pp_prefix[i] + 1 > max_id) max_id = (size_t)t->pp_prefix[i] + 1;
    for (size_t i = 0; i < t->n_pp_suffix; i++) if ((size_t)t->pp_suffix[i] + 1 > max_id) max_id = (size_t)t->pp_suffix[i] + 1;

    if ((rc = normalize_added(t))) goto fail;
    if ((rc = build_matcher(t, &t->match_raw, false)) || (rc = build_matcher(t, &t->match_norm, true))) goto fail;

    /* id -> token: model vocab, then added tokens (they win, as in HF) */
    t->vocab_size = max_id;
    if (max_id) {
        t->id_off = prism_malloc(max_id * sizeof *t->id_off);
        t->id_len = prism_malloc(max_id * sizeof *t->id_len);
        t->is_special = prism_calloc(max_id, 1);
        if (!t->id_off || !t->id_len || !t->is_special) { rc = PRISM_ENOMEM; goto fail; }
    }
    for (size_t i = 0; i < max_id; i++) t->id_len[i] = UINT32_MAX;
    for (size_t i = 0; i <= t->vocab.mask; i++) {
        prism_tok_sslot_t *s = &t->vocab.slots[i];
        if (s->len == UINT32_MAX) continue;
        /* duplicate ids: the later vocab entry wins, like serde building vocab_r */
        if (t->id_len[s->val] == UINT32_MAX || s->off > t->id_off[s->val]) {
            t->id_off[s->val] = s->off;
            t->id_len[s->val] = s->len;
        }
    }
    for (size_t i = 0; i < t->n_added; i++) {
        t->id_off[t->added[i].id] = t->added[i].off;
        t->id_len[t->added[i].id] = t->added[i].len;
    }
    for (size_t id = 0; id < max_id; id++) {
        if (t->id_len[id] == UINT32_MAX) continue;
        int32_t k = prism_tok_smap_get(&t->added_map, t->pool, t->pool + t->id_off[id], t->id_len[id]);
        t->is_special[id] = k >= 0 && t->added[k].special;
    }
    json_decref(root);
    *out = t;
    return PRISM_OK;
fail:
    if (rc == PRISM_ENOMEM && err && errlen && !err[0]) snprintf(err, errlen, "tokenizer.json: out of memory");
    prism_tokenizer_free(t);
    json_decref(root);
    return rc;
}

int prism_tokenizer_load(const char *path, prism_tokenizer_t **out, char *err, size_t errlen)
{
    char *buf = NULL;
    size_t len = 0;
    *out = NULL;
    int rc = prism_read_file(path, PRISM_TOK_MAX_JSON_BYTES, &buf, &len);
    if (rc < 0) {
        if (err && errlen)
            snprintf(err, errlen, "%s: %s", path,
                     rc == PRISM_ELIMIT ? "tokenizer.json is larger than 64 MiB" : prism_strerror(rc));
        return rc;
    }
    rc = prism_tokenizer_load_from_memory(buf, len, out, err, errlen);
    prism_free(buf);
    return rc;
}

/* ---------------- accessors ---------------- */

int32_t prism_tokenizer_token_to_id(const prism_tokenizer_t *t, const char *token)
{
    size_t n = strlen(token);
    int32_t k = prism_tok_smap_get(&t->added_map, t->pool, token, n);
    if (k >= 0) return t->added[k].id;
    return prism_tok_vocab_get(t, token, n);
}

const char *prism_tokenizer_id_to_token(const prism_tokenizer_t *t, int32_t id)
{
    if (id < 0 || (size_t)id >= t->vocab_size || t->id_len[id] == UINT32_MAX) return NULL;
    return t->pool + t->id_off[id];
}

size_t prism_tokenizer_vocab_size(const prism_tokenizer_t *t) { return t->vocab_size; }

bool prism_tokenizer_is_special(const prism_tokenizer_t *t, int32_t id)
{
    return id >= 0 && (size_t)id < t->vocab_size && t->is_special[id];
}
