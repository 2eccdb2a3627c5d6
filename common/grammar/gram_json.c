/* JSON Schema (the common subset used for structured output and tool parameters) to grammar
 * expressions, and the compile entry points.
 *
 * Supported: type (one or a list), properties, required, additionalProperties (false, true or a
 * schema; absent = false, as xgrammar's strict mode), enum, const, anyOf, oneOf (as anyOf),
 * allOf with one element, $ref to "#", "#/$defs/.." or "#/definitions/.." (recursive refs
 * allowed), items, prefixItems, minItems, maxItems, minLength, maxLength, pattern, format (date,
 * time, date-time, email, uuid, ipv4, ipv6-less: unknown formats are annotations). Annotation
 * keywords are ignored; every other keyword is refused with PRISM_ENOTSUP naming it, so a request
 * never gets output that silently ignores one of its constraints.
 *
 * Properties come out in "properties" order; an extra key (when allowed) never equals a declared
 * one and uses no escapes. */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "core/utf8.h"
#include "gram_internal.h"

typedef struct { char *ptr; int32_t rule; } js_ref_t;

typedef struct {
    prism_grammar_builder_t *b;
    json_t *root;
    prism_grammar_json_opts_t o;
    int visited, depth;
    js_ref_t *refs; int n_refs, cap_refs;
    char path[512];
    size_t path_len;
} js_t;

/* ---- error paths ---- */
static size_t path_push(js_t *j, const char *seg)
{
    size_t old = j->path_len;
    int w = snprintf(j->path + old, sizeof j->path - old, "/%s", seg);
    if (w > 0) j->path_len = PRISM_MIN(old + (size_t)w, sizeof j->path - 1);
    return old;
}

static size_t path_push_i(js_t *j, size_t i)
{
    char s[24];
    snprintf(s, sizeof s, "%zu", i);
    return path_push(j, s);
}

static void path_pop(js_t *j, size_t old)
{
    j->path_len = old;
    j->path[old] = 0;
}

static int32_t js_fail(js_t *j, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int32_t js_fail(js_t *j, int code, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return gram_fail(j->b, code, j->path, "%s", msg);
}

/* ---- lexical pieces ---- */
static int32_t ws(js_t *j)
{
    if (j->o.max_whitespace <= 0) return gx_empty(j->b);
    gx_class_t c = {0};
    gx_class_set(&c, ' ');
    gx_class_set(&c, '\t');
    gx_class_set(&c, '\n');
    return prism_gexpr_repeat(j->b, gx_class(j->b, &c), 0, j->o.max_whitespace);
}

static int32_t sep(js_t *j, const char *ch)
{
    prism_grammar_builder_t *b = j->b;
    if (j->o.max_whitespace <= 0) return gx_seq2(b, gx_lit(b, ch), gx_opt(b, gx_lit(b, " ")));
    return gx_seq3(b, ws(j), gx_lit(b, ch), ws(j));
}

static int32_t comma(js_t *j) { return sep(j, ","); }
static int32_t colon(js_t *j) { return sep(j, ":"); }

/* One JSON string character (code point), unescaped or as an escape; no_escape leaves escapes out. */
static int32_t str_char(prism_grammar_builder_t *b, bool no_escape)
{
    int32_t plain[3] = { gx_utf8_range(b, 0x20, 0x21), gx_utf8_range(b, 0x23, 0x5B), gx_utf8_range(b, 0x5D, 0x10FFFF) };
    int32_t p = prism_gexpr_alt(b, plain, 3);
    if (no_escape) return p;
    gx_class_t simple = {0};
    for (const char *s = "\"\\bfnrt"; *s; s++) gx_class_set(&simple, (unsigned char)*s);
    /* \uXXXX without lone surrogates (JSON parsers reject them) and without \u0000 (C parsers,
     * jansson among them, reject NUL in keys; no model output needs it) */
    int32_t u_alts[4] = {
        gram_regex_expr(b, "0([1-9a-fA-F][0-9a-fA-F]{2}|0[1-9a-fA-F][0-9a-fA-F]|00[1-9a-fA-F])", 66, false, ""),
        gram_regex_expr(b, "[1-9a-cA-C][0-9a-fA-F]{3}", 25, false, ""),
        gram_regex_expr(b, "[dD][0-7][0-9a-fA-F]{2}", 23, false, ""),
        gram_regex_expr(b, "[eEfF][0-9a-fA-F]{3}", 20, false, ""),
    };
    int32_t esc = gx_seq2(b, gx_lit(b, "\\"),
                          gx_alt2(b, gx_class(b, &simple), gx_seq2(b, gx_lit(b, "u"), prism_gexpr_alt(b, u_alts, 4))));
    return gx_alt2(b, p, esc);
}

static int32_t string_rule(js_t *j)
{
    prism_grammar_builder_t *b = j->b;
    if (b->rule_json_string >= 0) return gx_ref(b, b->rule_json_string);
    int32_t r = gx_rule_new(b);
    int32_t body = gx_seq3(b, gx_lit(b, "\""), prism_gexpr_repeat(b, str_char(b, false), 0, -1), gx_lit(b, "\""));
    if (r < 0 || body < 0) return b->err;
    gx_rule_set(b, r, body);
    b->rule_json_string = r;
    return gx_ref(b, r);
}

static int32_t number_expr(js_t *j, bool integer)
{
    /* digits bounded so values stay exact in int64 and double (common parsers reject or round
     * beyond that) and a model cannot loop on digits forever */
    const char *re = integer ? "-?(0|[1-9][0-9]{0,14})" : "-?(0|[1-9][0-9]{0,14})(\\.[0-9]{1,15})?([eE][+-]?[0-9]{1,2})?";
    return gram_regex_expr(j->b, re, strlen(re), false, "");
}

static const char *lit_true(js_t *j) { return j->o.pythonic ? "True" : "true"; }
static const char *lit_false(js_t *j) { return j->o.pythonic ? "False" : "false"; }
static const char *lit_null(js_t *j) { return j->o.pythonic ? "None" : "null"; }

/* Any JSON value (shared rules, one set per syntax flavour and whitespace setting). */
static int32_t any_value(js_t *j)
{
    prism_grammar_builder_t *b = j->b;
    int fl = j->o.pythonic ? 1 : 0;
    bool cacheable = j->o.max_whitespace <= 0;
    if (cacheable && b->rule_json_any[fl] >= 0) return gx_ref(b, b->rule_json_any[fl]);
    int32_t rv = gx_rule_new(b), ro = gx_rule_new(b), ra = gx_rule_new(b);
    if (b->err) return b->err;
    int32_t kv = gx_seq3(b, string_rule(j), colon(j), gx_ref(b, rv));
    int32_t members = gx_seq2(b, kv, prism_gexpr_repeat(b, gx_seq2(b, comma(j), kv), 0, -1));
    int32_t obj_items[5] = { gx_lit(b, "{"), ws(j), gx_opt(b, members), ws(j), gx_lit(b, "}") };
    gx_rule_set(b, ro, prism_gexpr_seq(b, obj_items, 5));
    int32_t elems = gx_seq2(b, gx_ref(b, rv), prism_gexpr_repeat(b, gx_seq2(b, comma(j), gx_ref(b, rv)), 0, -1));
    int32_t arr_items[5] = { gx_lit(b, "["), ws(j), gx_opt(b, elems), ws(j), gx_lit(b, "]") };
    gx_rule_set(b, ra, prism_gexpr_seq(b, arr_items, 5));
    int32_t alts[7] = { gx_ref(b, ro), gx_ref(b, ra), string_rule(j), number_expr(j, false),
                        gx_lit(b, lit_true(j)), gx_lit(b, lit_false(j)), gx_lit(b, lit_null(j)) };
    gx_rule_set(b, rv, prism_gexpr_alt(b, alts, 7));
    if (b->err) return b->err;
    if (cacheable) {
        b->rule_json_any[fl] = rv;
        b->rule_json_object_any[fl] = ro;
    }
    return gx_ref(b, rv);
}

static int32_t any_object(js_t *j)
{
    prism_grammar_builder_t *b = j->b;
    int fl = j->o.pythonic ? 1 : 0;
    if (j->o.max_whitespace <= 0) {
        if (any_value(j) < 0) return b->err;
        return gx_ref(b, b->rule_json_object_any[fl]);
    }
    int32_t kv = gx_seq3(b, string_rule(j), colon(j), any_value(j));
    int32_t members = gx_seq2(b, kv, prism_gexpr_repeat(b, gx_seq2(b, comma(j), kv), 0, -1));
    int32_t items[5] = { gx_lit(b, "{"), ws(j), gx_opt(b, members), ws(j), gx_lit(b, "}") };
    return prism_gexpr_seq(b, items, 5);
}

/* ---- literal values (enum / const) ---- */
static int dump_value(js_t *j, json_t *v, prism_buf_t *out, int depth)
{
    if (depth > 64) return js_fail(j, PRISM_ELIMIT, "enum/const value nested too deeply");
    char *s;
    size_t i;
    const char *k;
    json_t *x;
    switch (json_typeof(v)) {
    case JSON_TRUE: return prism_buf_append_str(out, lit_true(j));
    case JSON_FALSE: return prism_buf_append_str(out, lit_false(j));
    case JSON_NULL: return prism_buf_append_str(out, lit_null(j));
    case JSON_OBJECT:
        prism_buf_append_str(out, "{");
        i = 0;
        json_object_foreach(v, k, x) {
            if (i++) prism_buf_append_str(out, ", ");
            json_t *ks = json_string(k);
            s = ks ? json_dumps(ks, JSON_ENCODE_ANY) : NULL;
            json_decref(ks);
            if (!s) return PRISM_ENOMEM;
            prism_buf_append_str(out, s);
            gram_json_free(s);
            prism_buf_append_str(out, ": ");
            if (dump_value(j, x, out, depth + 1) < 0) return -1;
        }
        return prism_buf_append_str(out, "}");
    case JSON_ARRAY:
        prism_buf_append_str(out, "[");
        json_array_foreach(v, i, x) {
            if (i) prism_buf_append_str(out, ", ");
            if (dump_value(j, x, out, depth + 1) < 0) return -1;
        }
        return prism_buf_append_str(out, "]");
    default:
        s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
        if (!s) return PRISM_ENOMEM;
        prism_buf_append_str(out, s);
        gram_json_free(s);
        return 0;
    }
}

static int32_t literal_value(js_t *j, json_t *v)
{
    prism_buf_t buf = {0};
    int32_t r;
    if (dump_value(j, v, &buf, 0) < 0) r = j->b->err ? j->b->err : js_fail(j, PRISM_ENOMEM, "out of memory");
    else r = prism_gexpr_literal(j->b, buf.data ? buf.data : "", buf.len);
    prism_buf_free(&buf);
    return r;
}

static bool type_matches(const char *type, json_t *v)
{
    if (!strcmp(type, "string")) return json_is_string(v);
    if (!strcmp(type, "integer")) return json_is_integer(v) || (json_is_real(v) && json_real_value(v) == (double)(long long)json_real_value(v));
    if (!strcmp(type, "number")) return json_is_number(v);
    if (!strcmp(type, "boolean")) return json_is_boolean(v);
    if (!strcmp(type, "null")) return json_is_null(v);
    if (!strcmp(type, "object")) return json_is_object(v);
    if (!strcmp(type, "array")) return json_is_array(v);
    return false;
}

/* An expression used in several places becomes a rule, referenced by a call: the automaton then
 * holds it once instead of once per use (nested arrays and objects would otherwise grow it
 * exponentially with depth), and its states share one mask cache. */
static int32_t shared(js_t *j, int32_t e) { return e < 0 ? e : prism_gexpr_shared(j->b, e); }

/* ---- schema walk ---- */
static int32_t schema_expr(js_t *j, json_t *s);

static const char *const ANNOTATIONS[] = {
    "$schema", "$id", "$comment", "title", "description", "default", "examples", "deprecated", "readOnly",
    "writeOnly", "$defs", "definitions", "$anchor", "contentMediaType", "contentEncoding", "discriminator",
    "example", "x-order", NULL,
};
static const char *const HANDLED[] = {
    "type", "properties", "required", "additionalProperties", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
    "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "uniqueItems",
    NULL,
};

static bool in_list(const char *const *l, const char *k)
{
    for (; *l; l++)
        if (!strcmp(*l, k)) return true;
    return false;
}

static int check_keywords(js_t *j, json_t *s)
{
    const char *k;
    json_t *v;
    json_object_foreach(s, k, v) {
        if (in_list(ANNOTATIONS, k) || in_list(HANDLED, k)) continue;
        if (!strncmp(k, "x-", 2)) continue;  /* vendor extensions are annotations */
        size_t old = path_push(j, k);
        int32_t r = js_fail(j, PRISM_ENOTSUP, "JSON Schema keyword '%s' is not supported", k);
        path_pop(j, old);
        return r;
    }
    if ((v = json_object_get(s, "uniqueItems")) && json_is_true(v)) {
        size_t old = path_push(j, "uniqueItems");
        int32_t r = js_fail(j, PRISM_ENOTSUP, "uniqueItems: true is not supported");
        path_pop(j, old);
        return r;
    }
    return 0;
}

static int get_count(js_t *j, json_t *s, const char *key, int def, int *out)
{
    json_t *v = json_object_get(s, key);
    *out = def;
    if (!v) return 0;
    size_t old = path_push(j, key);
    int rc = 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0) rc = js_fail(j, PRISM_EINVAL, "'%s' must be a non-negative integer", key);
    else if (json_integer_value(v) > j->b->lim.max_expansion)
        rc = js_fail(j, PRISM_ELIMIT, "'%s' of %lld exceeds the limit %d", key, (long long)json_integer_value(v),
                     j->b->lim.max_expansion);
    else *out = (int)json_integer_value(v);
    path_pop(j, old);
    return rc;
}

static int32_t resolve_ref(js_t *j, const char *ref)
{
    prism_grammar_builder_t *b = j->b;
    for (int i = 0; i < j->n_refs; i++)
        if (!strcmp(j->refs[i].ptr, ref)) return gx_ref(b, j->refs[i].rule);
    if (ref[0] != '#') return js_fail(j, PRISM_ENOTSUP, "only local $ref (\"#...\") is supported, got \"%.64s\"", ref);
    /* JSON pointer walk with ~0 ~1 unescaping */
    json_t *cur = j->root;
    const char *p = ref + 1;
    char seg[256];
    while (*p) {
        if (*p != '/') return js_fail(j, PRISM_EINVAL, "$ref \"%.64s\" is not a JSON pointer", ref);
        p++;
        size_t n = 0;
        while (*p && *p != '/') {
            char c = *p++;
            if (c == '~' && *p == '0') { c = '~'; p++; }
            else if (c == '~' && *p == '1') { c = '/'; p++; }
            if (n + 1 >= sizeof seg) return js_fail(j, PRISM_ELIMIT, "$ref segment too long");
            seg[n++] = c;
        }
        seg[n] = 0;
        if (json_is_object(cur)) cur = json_object_get(cur, seg);
        else if (json_is_array(cur)) {
            char *end;
            long idx = strtol(seg, &end, 10);
            cur = *end || idx < 0 ? NULL : json_array_get(cur, (size_t)idx);
        } else cur = NULL;
        if (!cur) return js_fail(j, PRISM_EINVAL, "$ref \"%.64s\" does not resolve", ref);
    }
    if (j->n_refs == j->cap_refs) {
        int nc = j->cap_refs ? j->cap_refs * 2 : 16;
        js_ref_t *r = prism_realloc(j->refs, (size_t)nc * sizeof *r);
        if (!r) return js_fail(j, PRISM_ENOMEM, "out of memory");
        j->refs = r;
        j->cap_refs = nc;
    }
    int32_t rule = gx_rule_new(b);
    if (rule < 0) return rule;
    j->refs[j->n_refs].ptr = prism_strdup(ref);
    if (!j->refs[j->n_refs].ptr) return js_fail(j, PRISM_ENOMEM, "out of memory");
    j->refs[j->n_refs++].rule = rule;
    /* errors inside name the definition's own path */
    char saved[512];
    size_t saved_len = j->path_len;
    memcpy(saved, j->path, sizeof saved);
    snprintf(j->path, sizeof j->path, "%s", ref);
    j->path_len = strlen(j->path);
    int32_t body = schema_expr(j, cur);
    if (body >= 0) {
        memcpy(j->path, saved, sizeof saved);
        j->path_len = saved_len;
        gx_rule_set(b, rule, body);
    }
    return body < 0 ? body : gx_ref(b, rule);
}

static const char *format_regex(const char *f)
{
    static const struct { const char *name, *re; } F[] = {
        { "date", "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])" },
        { "time", "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])" },
        { "date-time", "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
                       "(\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])" },
        /* unbounded parts: counted ones would add hundreds of states, each a mask-cache fill */
        { "email", "[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\\.[A-Za-z0-9-]+)+" },
        { "uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}" },
        { "ipv4", "((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])" },
        { NULL, NULL },
    };
    for (int i = 0; F[i].name; i++)
        if (!strcmp(F[i].name, f)) return F[i].re;
    return NULL;
}

static int32_t string_expr(js_t *j, json_t *s)
{
    prism_grammar_builder_t *b = j->b;
    int minl, maxl;
    if (get_count(j, s, "minLength", 0, &minl) < 0 || get_count(j, s, "maxLength", -1, &maxl) < 0) return b->err;
    json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    const char *re = NULL;
    size_t old = 0;
    if (pat) {
        old = path_push(j, "pattern");
        if (!json_is_string(pat)) { int32_t r = js_fail(j, PRISM_EINVAL, "'pattern' must be a string"); return r; }
        re = json_string_value(pat);
    } else if (fmt) {
        old = path_push(j, "format");
        if (!json_is_string(fmt)) return js_fail(j, PRISM_EINVAL, "'format' must be a string");
        re = format_regex(json_string_value(fmt));
        if (!re) path_pop(j, old);  /* unknown formats are annotations */
    }
    if (re) {
        if ((pat && fmt) || minl > 0 || maxl >= 0)
            return js_fail(j, PRISM_ENOTSUP, "pattern/format combined with other string constraints is not supported");
        /* JSON Schema patterns are unanchored: ^...$ are the common form; we match the whole string */
        int32_t body = gram_regex_expr(b, re, strlen(re), true, j->path);
        path_pop(j, old);
        return gx_seq3(b, gx_lit(b, "\""), body, gx_lit(b, "\""));
    }
    if (maxl >= 0 && maxl < minl) return js_fail(j, PRISM_EINVAL, "maxLength is below minLength");
    if (minl == 0 && maxl < 0) return string_rule(j);
    return gx_seq3(b, gx_lit(b, "\""), prism_gexpr_repeat(b, str_char(b, false), minl, maxl), gx_lit(b, "\""));
}

/* Array: elements i = 0.. with prefixItems[i] for i < k, then items; minItems / maxItems. */
static int32_t array_expr(js_t *j, json_t *s)
{
    prism_grammar_builder_t *b = j->b;
    int minn, maxn;
    if (get_count(j, s, "minItems", 0, &minn) < 0 || get_count(j, s, "maxItems", -1, &maxn) < 0) return b->err;
    json_t *prefix = json_object_get(s, "prefixItems"), *items = json_object_get(s, "items");
    if (prefix && !json_is_array(prefix)) return js_fail(j, PRISM_EINVAL, "'prefixItems' must be an array");
    if (items && json_is_array(items)) return js_fail(j, PRISM_ENOTSUP, "array-form 'items' (draft 4 tuples) is not supported; use prefixItems");
    size_t k = prefix ? json_array_size(prefix) : 0;
    if (k > (size_t)b->lim.max_expansion) return js_fail(j, PRISM_ELIMIT, "too many prefixItems");
    bool items_false = items && json_is_false(items);
    if (items_false && (maxn < 0 || (size_t)maxn > k)) maxn = (int)k;
    if (maxn >= 0 && maxn < minn) return js_fail(j, PRISM_EINVAL, "maxItems is below minItems (or items: false)");
    int32_t item = -1;
    if (!items_false) {
        size_t old = path_push(j, "items");
        item = shared(j, items ? schema_expr(j, items) : any_value(j));
        path_pop(j, old);
        if (item < 0) return item;
    }
    /* tail after the prefix: elements k.. (each preceded by a comma, as k > 0 or not first) */
    int32_t tail = gx_empty(b);
    if (item >= 0) {
        int rest_min = minn > (int)k ? minn - (int)k : 0;
        int rest_max = maxn < 0 ? -1 : maxn - (int)k;
        if (rest_max != 0) {
            int32_t ci = gx_seq2(b, comma(j), item);
            if (k > 0) {
                tail = prism_gexpr_repeat(b, ci, rest_min, rest_max);
            } else {
                /* first element without a comma */
                int32_t more = prism_gexpr_repeat(b, ci, rest_min > 0 ? rest_min - 1 : 0, rest_max < 0 ? -1 : rest_max - 1);
                int32_t list = gx_seq2(b, item, more);
                tail = rest_min > 0 ? list : gx_opt(b, list);
            }
        }
    }
    /* prefix elements, right to left: e_i = sep? p_i e_{i+1}, optional when i >= minItems */
    int32_t acc = tail;
    for (size_t i = k; i-- > 0;) {
        size_t old = path_push(j, "prefixItems");
        size_t old2 = path_push_i(j, i);
        int32_t p = schema_expr(j, json_array_get(prefix, i));
        path_pop(j, old2);
        path_pop(j, old);
        if (p < 0) return p;
        int32_t el = i ? gx_seq3(b, comma(j), p, acc) : gx_seq2(b, p, acc);
        acc = (int)i >= minn ? gx_opt(b, el) : el;
    }
    int32_t parts[5] = { gx_lit(b, "["), ws(j), acc, ws(j), gx_lit(b, "]") };
    return prism_gexpr_seq(b, parts, 5);
}

/* A key that is none of the declared ones: walk the declared keys' trie; at a character boundary
 * a different character leaves it (then any characters, no escapes); the closing quote is
 * allowed only off a declared key's end. */
typedef struct { const char *k; size_t n; } key_t_;

static bool is_lead(uint8_t c) { return (c & 0xC0) != 0x80; }

static int32_t free_char_not_starting(js_t *j, const bool *lead_used)
{
    prism_grammar_builder_t *b = j->b;
    int32_t alts[300];
    int n = 0;
    gx_class_t ascii = {0};
    bool any_ascii = false;
    for (unsigned c = 0x20; c < 0x80; c++)
        if (c != '"' && c != '\\' && !lead_used[c]) { gx_class_set(&ascii, c); any_ascii = true; }
    if (any_ascii) alts[n++] = gx_class(b, &ascii);
    for (unsigned c = 0xC2; c <= 0xF4; c++) {
        if (lead_used[c]) continue;
        uint32_t lo, hi;
        /* the code points whose encoding starts with lead byte c (overlong forms excluded) */
        if (c < 0xE0) { lo = (c - 0xC0) << 6; hi = lo + 0x3F; }
        else if (c < 0xF0) { lo = (c - 0xE0) << 12; hi = lo + 0xFFF; if (lo < 0x800) lo = 0x800; }
        else { lo = (c - 0xF0) << 18; hi = lo + 0x3FFFF; if (lo < 0x10000) lo = 0x10000; }
        alts[n++] = gx_utf8_range(b, lo, hi);
    }
    return prism_gexpr_alt(b, alts, (size_t)n);
}

static int32_t key_trie(js_t *j, const key_t_ *keys, size_t nk, size_t depth, int32_t free_tail)
{
    prism_grammar_builder_t *b = j->b;
    int32_t alts[260];
    int n = 0;
    bool is_end = false, lead_used[256] = { false };
    for (size_t i = 0; i < nk; i++) {
        if (keys[i].n == depth) { is_end = true; continue; }
        lead_used[(uint8_t)keys[i].k[depth]] = true;
    }
    /* children, keys are sorted so equal next bytes are adjacent */
    for (size_t i = 0; i < nk;) {
        if (keys[i].n == depth) { i++; continue; }
        uint8_t c = (uint8_t)keys[i].k[depth];
        size_t e = i;
        while (e < nk && keys[e].n > depth && (uint8_t)keys[e].k[depth] == c) e++;
        char ch = (char)c;
        alts[n++] = gx_seq2(b, prism_gexpr_literal(b, &ch, 1), key_trie(j, keys + i, e - i, depth + 1, free_tail));
        i = e;
    }
    /* at a character boundary of every key below: leave the trie with another character */
    bool boundary = true;
    for (size_t i = 0; i < nk; i++)
        if (keys[i].n > depth && !is_lead((uint8_t)keys[i].k[depth])) boundary = false;
    if (boundary) alts[n++] = gx_seq2(b, free_char_not_starting(j, lead_used), free_tail);
    if (!is_end && depth > 0) alts[n++] = gx_lit(b, "\"");
    return prism_gexpr_alt(b, alts, (size_t)n);
}

static int cmp_key(const void *a, const void *b)
{
    const key_t_ *x = a, *y = b;
    int c = memcmp(x->k, y->k, x->n < y->n ? x->n : y->n);
    return c ? c : (x->n > y->n) - (x->n < y->n);
}

static int32_t extra_key(js_t *j, json_t *props)
{
    prism_grammar_builder_t *b = j->b;
    size_t np = props ? json_object_size(props) : 0;
    if (np == 0) return string_rule(j);
    key_t_ *keys = prism_malloc(np * sizeof *keys);
    if (!keys) return js_fail(j, PRISM_ENOMEM, "out of memory");
    size_t n = 0;
    const char *k;
    json_t *v;
    json_object_foreach(props, k, v) keys[n++] = (key_t_){ k, strlen(k) };
    qsort(keys, n, sizeof *keys, cmp_key);
    int32_t free_tail = gx_seq2(b, prism_gexpr_repeat(b, str_char(b, true), 0, -1), gx_lit(b, "\""));
    /* the empty key "" is extra unless declared */
    int32_t body = key_trie(j, keys, n, 0, free_tail);
    bool empty_declared = n && keys[0].n == 0;
    if (!empty_declared) body = gx_alt2(b, body, gx_lit(b, "\""));
    prism_free(keys);
    return gx_seq2(b, gx_lit(b, "\""), body);
}

static int32_t object_expr(js_t *j, json_t *s)
{
    prism_grammar_builder_t *b = j->b;
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required"),
           *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) return js_fail(j, PRISM_EINVAL, "'properties' must be an object");
    if (req && !json_is_array(req)) return js_fail(j, PRISM_EINVAL, "'required' must be an array");
    size_t np = props ? json_object_size(props) : 0;
    if (np > 256) return js_fail(j, PRISM_ELIMIT, "%zu properties exceed the limit 256", np);
    bool extra = addl && !json_is_false(addl);
    if (!props && !addl) extra = true;  /* {"type": "object"} alone: any object */
    if (addl && !json_is_boolean(addl) && !json_is_object(addl))
        return js_fail(j, PRISM_EINVAL, "'additionalProperties' must be a boolean or a schema");

    int32_t *kv = prism_calloc(np ? np : 1, sizeof *kv);
    bool *required = prism_calloc(np ? np : 1, sizeof *required);
    if (!kv || !required) { prism_free(kv); prism_free(required); return js_fail(j, PRISM_ENOMEM, "out of memory"); }
    int32_t result = -1;
    size_t i = 0, n_req = 0;
    const char *k;
    json_t *v;
    for (size_t r = 0; req && r < json_array_size(req); r++) {
        json_t *name = json_array_get(req, r);
        size_t old = path_push(j, "required");
        size_t old2 = path_push_i(j, r);
        if (!json_is_string(name)) { result = js_fail(j, PRISM_EINVAL, "required entries must be strings"); goto done; }
        size_t idx = 0;
        bool found = false;
        json_object_foreach(props, k, v) {
            if (!strcmp(k, json_string_value(name))) { found = true; break; }
            idx++;
        }
        if (!found) {
            if (!extra) { result = js_fail(j, PRISM_ENOTSUP, "required property '%.64s' is not in 'properties'", json_string_value(name)); goto done; }
            result = js_fail(j, PRISM_ENOTSUP, "required property '%.64s' without a schema in 'properties' is not supported", json_string_value(name));
            goto done;
        }
        if (!required[idx]) n_req++;
        required[idx] = true;
        path_pop(j, old2);
        path_pop(j, old);
    }
    size_t first_req = np;
    for (size_t x = 0; x < np; x++)
        if (required[x]) { first_req = x; break; }
    i = 0;
    json_object_foreach(props, k, v) {
        size_t old = path_push(j, "properties");
        size_t old2 = path_push(j, k);
        int32_t val = schema_expr(j, v);
        /* with optional properties first, every value appears in several member chains */
        if (first_req > 0 && np > 1) val = shared(j, val);
        path_pop(j, old2);
        path_pop(j, old);
        if (val < 0) { result = val; goto done; }
        kv[i++] = gx_seq3(b, prism_gexpr_json_string_literal(b, k, strlen(k)), colon(j), val);
    }
    int32_t extra_kv = -1;
    if (extra) {
        int32_t val;
        if (addl && json_is_object(addl)) {
            size_t old = path_push(j, "additionalProperties");
            val = shared(j, schema_expr(j, addl));
            path_pop(j, old);
        } else {
            val = any_value(j);
        }
        if (val < 0) { result = val; goto done; }
        extra_kv = gx_seq3(b, extra_key(j, props), colon(j), val);
    }
    /* members: the first emitted property is some j0 (every property before it optional);
     * after it each property comes with a comma, optional unless required */
    int32_t alts[260];
    int na = 0;
    int32_t extra_after = extra_kv >= 0 ? prism_gexpr_repeat(b, gx_seq2(b, comma(j), extra_kv), 0, -1) : gx_empty(b);
    for (size_t j0 = 0; j0 < np && j0 <= first_req; j0++) {
        int32_t chain[260];
        int nc = 0;
        chain[nc++] = kv[j0];
        for (size_t x = j0 + 1; x < np; x++) {
            int32_t ckv = gx_seq2(b, comma(j), kv[x]);
            chain[nc++] = required[x] ? ckv : gx_opt(b, ckv);
        }
        chain[nc++] = extra_after;
        alts[na++] = prism_gexpr_seq(b, chain, (size_t)nc);
    }
    if (n_req == 0 && extra_kv >= 0) alts[na++] = gx_seq2(b, extra_kv, extra_after);
    int32_t members = prism_gexpr_alt(b, alts, (size_t)na);
    if (n_req == 0) members = na ? gx_opt(b, members) : gx_empty(b);
    int32_t parts[5] = { gx_lit(b, "{"), ws(j), members, ws(j), gx_lit(b, "}") };
    result = prism_gexpr_seq(b, parts, 5);
done:
    prism_free(kv);
    prism_free(required);
    return result;
}

static int32_t typed_expr(js_t *j, json_t *s, const char *type)
{
    prism_grammar_builder_t *b = j->b;
    if (!strcmp(type, "string")) return string_expr(j, s);
    if (!strcmp(type, "integer")) return number_expr(j, true);
    if (!strcmp(type, "number")) return number_expr(j, false);
    if (!strcmp(type, "boolean")) return gx_alt2(b, gx_lit(b, lit_true(j)), gx_lit(b, lit_false(j)));
    if (!strcmp(type, "null")) return gx_lit(b, lit_null(j));
    if (!strcmp(type, "object")) return object_expr(j, s);
    if (!strcmp(type, "array")) return array_expr(j, s);
    return js_fail(j, PRISM_EINVAL, "unknown type '%.32s'", type);
}

static int32_t enum_expr(js_t *j, json_t *s, json_t *values, json_t *type)
{
    prism_grammar_builder_t *b = j->b;
    size_t n = json_array_size(values);
    if (n > 4096) return js_fail(j, PRISM_ELIMIT, "enum of %zu values exceeds the limit 4096", n);
    int32_t *alts = prism_malloc((n ? n : 1) * sizeof *alts);
    if (!alts) return js_fail(j, PRISM_ENOMEM, "out of memory");
    size_t na = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(values, i);
        bool ok = true;
        if (json_is_string(type)) ok = type_matches(json_string_value(type), v);
        else if (json_is_array(type)) {
            ok = false;
            for (size_t t = 0; t < json_array_size(type); t++)
                if (json_is_string(json_array_get(type, t)) && type_matches(json_string_value(json_array_get(type, t)), v)) ok = true;
        }
        if (!ok) continue;
        int32_t e = literal_value(j, v);
        if (e < 0) { prism_free(alts); return e; }
        alts[na++] = e;
    }
    int32_t r = prism_gexpr_alt(b, alts, na);
    prism_free(alts);
    (void)s;
    return r;
}

static bool has_any(json_t *s, const char *const *keys)
{
    for (; *keys; keys++)
        if (json_object_get(s, *keys)) return true;
    return false;
}

static int32_t schema_expr(js_t *j, json_t *s)
{
    prism_grammar_builder_t *b = j->b;
    if (b->err) return b->err;
    if (++j->visited > b->lim.max_schema_nodes)
        return js_fail(j, PRISM_ELIMIT, "schema has more than %d sub-schemas", b->lim.max_schema_nodes);
    if (json_is_true(s)) return any_value(j);
    if (json_is_false(s)) return prism_gexpr_alt(b, NULL, 0);
    if (!json_is_object(s)) return js_fail(j, PRISM_EINVAL, "a schema must be an object or a boolean");
    if (++j->depth > b->lim.max_schema_depth) {
        j->depth--;
        return js_fail(j, PRISM_ELIMIT, "schema nested deeper than %d", b->lim.max_schema_depth);
    }
    int32_t r = -1;
    if (check_keywords(j, s) < 0) { r = b->err; goto out; }
    static const char *const CONSTRAINTS[] = { "type", "properties", "required", "additionalProperties", "items",
        "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "enum", "const", NULL };
    json_t *ref = json_object_get(s, "$ref");
    json_t *any = json_object_get(s, "anyOf");
    if (!any) any = json_object_get(s, "oneOf");  /* grammar cannot enforce exclusivity: treated as anyOf */
    json_t *all = json_object_get(s, "allOf");
    if (ref) {
        size_t old = path_push(j, "$ref");
        if (!json_is_string(ref)) r = js_fail(j, PRISM_EINVAL, "$ref must be a string");
        else if (has_any(s, CONSTRAINTS) || any || all) r = js_fail(j, PRISM_ENOTSUP, "$ref with sibling constraints is not supported");
        else r = resolve_ref(j, json_string_value(ref));
        path_pop(j, old);
        goto out;
    }
    if (all) {
        size_t old = path_push(j, "allOf");
        if (!json_is_array(all) || json_array_size(all) != 1 || has_any(s, CONSTRAINTS) || any)
            r = js_fail(j, PRISM_ENOTSUP, "allOf is supported only with a single schema and no siblings");
        else {
            size_t old2 = path_push_i(j, 0);
            r = schema_expr(j, json_array_get(all, 0));
            path_pop(j, old2);
        }
        path_pop(j, old);
        goto out;
    }
    if (any) {
        const char *kw = json_object_get(s, "anyOf") ? "anyOf" : "oneOf";
        size_t old = path_push(j, kw);
        if (!json_is_array(any) || json_array_size(any) == 0) r = js_fail(j, PRISM_EINVAL, "%s must be a non-empty array", kw);
        else if (has_any(s, CONSTRAINTS)) r = js_fail(j, PRISM_ENOTSUP, "%s combined with sibling constraints is not supported", kw);
        else if (json_array_size(any) > 256) r = js_fail(j, PRISM_ELIMIT, "%s has more than 256 alternatives", kw);
        else {
            int32_t alts[256];
            size_t n = json_array_size(any);
            r = 0;
            for (size_t i = 0; i < n && r >= 0; i++) {
                size_t old2 = path_push_i(j, i);
                r = alts[i] = schema_expr(j, json_array_get(any, i));
                path_pop(j, old2);
            }
            if (r >= 0) r = prism_gexpr_alt(b, alts, n);
        }
        path_pop(j, old);
        goto out;
    }
    json_t *type = json_object_get(s, "type");
    json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    if (type && !json_is_string(type) && !json_is_array(type)) {
        size_t old = path_push(j, "type");
        r = js_fail(j, PRISM_EINVAL, "'type' must be a string or an array of strings");
        path_pop(j, old);
        goto out;
    }
    if (cn) {
        json_t *arr = json_array();
        json_array_append(arr, cn);
        size_t old = path_push(j, "const");
        r = enum_expr(j, s, arr, type);
        path_pop(j, old);
        json_decref(arr);
        goto out;
    }
    if (en) {
        size_t old = path_push(j, "enum");
        if (!json_is_array(en)) r = js_fail(j, PRISM_EINVAL, "'enum' must be an array");
        else r = enum_expr(j, s, en, type);
        path_pop(j, old);
        goto out;
    }
    if (json_is_string(type)) {
        const char *t = json_string_value(type);
        static const char *const TYPES[] = { "string", "integer", "number", "boolean", "null", "object", "array", NULL };
        if (!in_list(TYPES, t)) {
            size_t old = path_push(j, "type");
            r = js_fail(j, PRISM_EINVAL, "unknown type '%.32s'", t);
            path_pop(j, old);
            goto out;
        }
        r = typed_expr(j, s, t);
        goto out;
    }
    if (json_is_array(type)) {
        size_t n = json_array_size(type);
        int32_t alts[8];
        if (n == 0 || n > 7) {
            size_t old = path_push(j, "type");
            r = js_fail(j, PRISM_EINVAL, "'type' list must have 1 to 7 entries");
            path_pop(j, old);
            goto out;
        }
        for (size_t i = 0; i < n; i++) {
            json_t *t = json_array_get(type, i);
            if (!json_is_string(t)) {
                size_t old = path_push(j, "type");
                r = js_fail(j, PRISM_EINVAL, "'type' list entries must be strings");
                path_pop(j, old);
                goto out;
            }
            alts[i] = typed_expr(j, s, json_string_value(t));
            if (alts[i] < 0) { r = alts[i]; goto out; }
        }
        r = prism_gexpr_alt(b, alts, n);
        goto out;
    }
    /* no type: infer from the keywords present, else any value */
    static const char *const OBJ[] = { "properties", "required", "additionalProperties", NULL };
    static const char *const ARR[] = { "items", "prefixItems", "minItems", "maxItems", NULL };
    static const char *const STR[] = { "minLength", "maxLength", "pattern", NULL };
    if (has_any(s, OBJ)) r = object_expr(j, s);
    else if (has_any(s, ARR)) r = array_expr(j, s);
    else if (has_any(s, STR)) r = string_expr(j, s);
    else r = any_value(j);
out:
    j->depth--;
    return r;
}

prism_gexpr_t prism_gexpr_json_string_literal(prism_grammar_builder_t *b, const char *s, size_t n)
{
    if (b->err) return b->err;
    if (!prism_utf8_valid(s, n)) return gram_fail(b, PRISM_EINVAL, "", "string is not valid UTF-8");
    prism_buf_t o = {0};
    int32_t r = prism_json_string(&o, s, n) ? gram_fail(b, PRISM_ENOMEM, "", "out of memory building the grammar")
                                            : prism_gexpr_literal(b, o.data, o.len);
    prism_buf_free(&o);
    return r;
}

prism_gexpr_t prism_gexpr_json_any(prism_grammar_builder_t *b, const prism_grammar_json_opts_t *opts)
{
    js_t j = { .b = b };
    if (opts) j.o = *opts;
    return any_value(&j);
}

static int32_t json_schema_expr(prism_grammar_builder_t *b, const char *schema, size_t n,
                                const prism_grammar_json_opts_t *opts, const char *prefix, bool object_only)
{
    if (b->err) return b->err;
    if (n > (size_t)b->lim.max_schema_bytes)
        return gram_fail(b, PRISM_ELIMIT, prefix, "schema of %zu bytes exceeds the limit %d", n, b->lim.max_schema_bytes);
    js_t j = { .b = b };
    if (opts) j.o = *opts;
    if (j.o.max_whitespace > 64) j.o.max_whitespace = 64;
    snprintf(j.path, sizeof j.path, "%s#", prefix ? prefix : "");
    j.path_len = strlen(j.path);
    json_error_t je;
    j.root = json_loadb(schema, n, JSON_DECODE_ANY, &je);
    if (!j.root) return gram_fail(b, PRISM_EINVAL, prefix, "schema is not valid JSON: %s (at %d:%d)", je.text, je.line, je.column);
    int32_t r = object_only ? any_object(&j) : schema_expr(&j, j.root);
    for (int i = 0; i < j.n_refs; i++) prism_free(j.refs[i].ptr);
    prism_free(j.refs);
    json_decref(j.root);
    return r;
}

prism_gexpr_t prism_gexpr_json_schema(prism_grammar_builder_t *b, const char *schema, size_t n,
                                      const prism_grammar_json_opts_t *opts, const char *err_path_prefix)
{
    return json_schema_expr(b, schema, n, opts, err_path_prefix ? err_path_prefix : "", false);
}

/* ---- compile entry points ---- */
static int finish(prism_grammar_builder_t *b, int32_t root, const prism_grammar_vocab_t *v, prism_grammar_t **out,
                  prism_grammar_error_t *err)
{
    int rc = prism_grammar_builder_finish(b, root, v, out, err);
    prism_grammar_builder_free(b);
    return rc;
}

static prism_grammar_builder_t *new_builder(const prism_grammar_limits_t *limits, prism_grammar_error_t *err)
{
    prism_grammar_builder_t *b = prism_grammar_builder_create(limits);
    if (!b && err) {
        err->code = PRISM_ENOMEM;
        err->path[0] = 0;
        snprintf(err->message, sizeof err->message, "out of memory");
    }
    return b;
}

int prism_grammar_compile_json_schema(const prism_grammar_vocab_t *v, const char *schema, size_t len,
                                      const prism_grammar_json_opts_t *opts, const prism_grammar_limits_t *limits,
                                      prism_grammar_t **out, prism_grammar_error_t *err)
{
    *out = NULL;
    prism_grammar_builder_t *b = new_builder(limits, err);
    if (!b) return PRISM_ENOMEM;
    int32_t root = json_schema_expr(b, schema, len, opts, "", false);
    return finish(b, root, v, out, err);
}

int prism_grammar_compile_json_object(const prism_grammar_vocab_t *v, const prism_grammar_json_opts_t *opts,
                                      const prism_grammar_limits_t *limits, prism_grammar_t **out,
                                      prism_grammar_error_t *err)
{
    *out = NULL;
    prism_grammar_builder_t *b = new_builder(limits, err);
    if (!b) return PRISM_ENOMEM;
    int32_t root = json_schema_expr(b, "{}", 2, opts, "", true);
    return finish(b, root, v, out, err);
}

int prism_grammar_compile_regex(const prism_grammar_vocab_t *v, const char *regex, size_t len,
                                const prism_grammar_limits_t *limits, prism_grammar_t **out, prism_grammar_error_t *err)
{
    *out = NULL;
    prism_grammar_builder_t *b = new_builder(limits, err);
    if (!b) return PRISM_ENOMEM;
    int32_t root = prism_gexpr_regex(b, regex, len);
    return finish(b, root, v, out, err);
}

int prism_grammar_compile_choice(const prism_grammar_vocab_t *v, const char *const *choices, const size_t *lens,
                                 size_t n, const prism_grammar_limits_t *limits, prism_grammar_t **out,
                                 prism_grammar_error_t *err)
{
    *out = NULL;
    prism_grammar_builder_t *b = new_builder(limits, err);
    if (!b) return PRISM_ENOMEM;
    size_t total = 0;
    int32_t *alts = prism_malloc((n ? n : 1) * sizeof *alts);
    if (!alts) { gram_fail(b, PRISM_ENOMEM, "", "out of memory"); n = 0; }
    if (n == 0 && !b->err) gram_fail(b, PRISM_EINVAL, "", "guided_choice needs at least one choice");
    for (size_t i = 0; i < n && !b->err; i++) {
        total += lens[i];
        if (total > (size_t)b->lim.max_schema_bytes) {
            char p[32];
            snprintf(p, sizeof p, "[%zu]", i);
            gram_fail(b, PRISM_ELIMIT, p, "choices exceed %d bytes in all", b->lim.max_schema_bytes);
            break;
        }
        alts[i] = prism_gexpr_literal(b, choices[i], lens[i]);
    }
    int32_t root = b->err ? b->err : prism_gexpr_alt(b, alts, n);
    prism_free(alts);
    return finish(b, root, v, out, err);
}
