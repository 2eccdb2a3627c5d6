/* Grammar builder: the expression IR that JSON Schema, regex, choice and tool-call formats are
 * translated into, with a sticky first error. */
#include <stdio.h>
#include <string.h>

#include "core/utf8.h"
#include "gram_internal.h"

void gram_limits_resolve(prism_grammar_limits_t *o, const prism_grammar_limits_t *in)
{
    prism_grammar_limits_t z = {0};
    if (in) z = *in;
#define D(f, v) o->f = z.f > 0 ? z.f : (v)
    D(max_schema_bytes, GRAM_DEF_SCHEMA_BYTES);
    D(max_schema_depth, GRAM_DEF_SCHEMA_DEPTH);
    D(max_schema_nodes, GRAM_DEF_SCHEMA_NODES);
    D(max_expansion, GRAM_DEF_EXPANSION);
    D(max_states, GRAM_DEF_STATES);
    D(max_stack_depth, GRAM_DEF_STACK_DEPTH);
    D(max_stacks, GRAM_DEF_STACKS);
    D(max_nodes, GRAM_DEF_NODES);
    D(max_rollback, GRAM_DEF_ROLLBACK);
    D(max_compile_ms, GRAM_DEF_COMPILE_MS);
    D(max_compile_bytes, GRAM_DEF_COMPILE_BYTES);
    D(max_mask_work, GRAM_DEF_MASK_WORK);
#undef D
    if (o->max_stack_depth > 60000) o->max_stack_depth = 60000;
}

prism_grammar_builder_t *prism_grammar_builder_create(const prism_grammar_limits_t *limits)
{
    prism_grammar_builder_t *b = prism_calloc(1, sizeof *b);
    if (!b) return NULL;
    gram_limits_resolve(&b->lim, limits);
    b->rule_json_string = -1;
    b->rule_json_any[0] = b->rule_json_any[1] = -1;
    b->rule_json_object_any[0] = b->rule_json_object_any[1] = -1;
    return b;
}

void prism_grammar_builder_free(prism_grammar_builder_t *b)
{
    if (!b) return;
    prism_free(b->nodes);
    prism_free(b->kids);
    prism_free(b->bytes);
    prism_free(b->classes);
    prism_free(b->rules);
    prism_free(b);
}

static int vfail(prism_grammar_builder_t *b, int code, const char *path, const char *fmt, va_list ap)
{
    if (b->err) return b->err;
    b->err = code;
    snprintf(b->err_path, sizeof b->err_path, "%s", path ? path : "");
    vsnprintf(b->err_msg, sizeof b->err_msg, fmt, ap);
    return code;
}

int gram_fail(prism_grammar_builder_t *b, int code, const char *path, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = vfail(b, code, path, fmt, ap);
    va_end(ap);
    return rc;
}

int prism_grammar_builder_fail(prism_grammar_builder_t *b, int code, const char *path, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = vfail(b, code, path, fmt, ap);
    va_end(ap);
    return rc;
}

static int grow(prism_grammar_builder_t *b, void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    if (need > GRAM_MAX_EXPR_NODES * 4)
        return gram_fail(b, PRISM_ELIMIT, "", "grammar too large (over %d expression parts)", GRAM_MAX_EXPR_NODES);
    size_t nc = *cap ? *cap * 2 : 64;
    while (nc < need) nc *= 2;
    void *q = prism_realloc(*p, nc * elem);
    if (!q) return gram_fail(b, PRISM_ENOMEM, "", "out of memory building the grammar");
    *p = q;
    *cap = nc;
    return 0;
}

int32_t gx_new(prism_grammar_builder_t *b, gx_kind_t k, int32_t a, int32_t bb, int32_t c)
{
    if (b->err) return b->err;
    if (b->n_nodes >= GRAM_MAX_EXPR_NODES)
        return gram_fail(b, PRISM_ELIMIT, "", "grammar too large (over %d expression parts)", GRAM_MAX_EXPR_NODES);
    if (grow(b, (void **)&b->nodes, &b->cap_nodes, b->n_nodes + 1, sizeof *b->nodes) < 0) return b->err;
    b->nodes[b->n_nodes] = (gx_node_t){ .kind = (uint8_t)k, .a = a, .b = bb, .c = c };
    return (int32_t)b->n_nodes++;
}

int32_t gx_empty(prism_grammar_builder_t *b) { return gx_new(b, GX_EMPTY, 0, 0, 0); }

int32_t gx_class(prism_grammar_builder_t *b, const gx_class_t *c)
{
    if (b->err) return b->err;
    if (grow(b, (void **)&b->classes, &b->cap_classes, b->n_classes + 1, sizeof *b->classes) < 0) return b->err;
    b->classes[b->n_classes] = *c;
    return gx_new(b, GX_CLASS, (int32_t)b->n_classes++, 0, 0);
}

int32_t gx_byte_range(prism_grammar_builder_t *b, unsigned lo, unsigned hi)
{
    gx_class_t c = {0};
    for (unsigned x = lo; x <= hi && x < 256; x++) gx_class_set(&c, x);
    return gx_class(b, &c);
}

prism_gexpr_t prism_gexpr_literal(prism_grammar_builder_t *b, const char *s, size_t n)
{
    if (b->err) return b->err;
    if (n == 0) return gx_empty(b);
    if (grow(b, (void **)&b->bytes, &b->cap_bytes, b->n_bytes + n, 1) < 0) return b->err;
    memcpy(b->bytes + b->n_bytes, s, n);
    int32_t r = gx_new(b, GX_LIT, (int32_t)b->n_bytes, (int32_t)n, 0);
    if (r >= 0) b->n_bytes += n;
    return r;
}

int32_t gx_lit(prism_grammar_builder_t *b, const char *s) { return prism_gexpr_literal(b, s, strlen(s)); }

static int32_t list(prism_grammar_builder_t *b, gx_kind_t k, const prism_gexpr_t *items, size_t n)
{
    if (b->err) return b->err;
    for (size_t i = 0; i < n; i++)
        if (items[i] < 0 || (size_t)items[i] >= b->n_nodes)
            return gram_fail(b, PRISM_EINVAL, "", "invalid grammar expression handle");
    if (n == 1) return items[0];
    if (n == 0 && k == GX_SEQ) return gx_empty(b);
    if (grow(b, (void **)&b->kids, &b->cap_kids, b->n_kids + n, sizeof *b->kids) < 0) return b->err;
    if (n) memcpy(b->kids + b->n_kids, items, n * sizeof *items);
    int32_t r = gx_new(b, k, (int32_t)b->n_kids, (int32_t)n, 0);
    if (r >= 0) b->n_kids += n;
    return r;
}

prism_gexpr_t prism_gexpr_seq(prism_grammar_builder_t *b, const prism_gexpr_t *items, size_t n)
{
    return list(b, GX_SEQ, items, n);
}

/* An empty alternation matches nothing: callers get an unproductive rule, which compile rejects
 * with a message, or which is pruned when it is one branch of several. */
prism_gexpr_t prism_gexpr_alt(prism_grammar_builder_t *b, const prism_gexpr_t *items, size_t n)
{
    return list(b, GX_ALT, items, n);
}

int32_t gx_seq2(prism_grammar_builder_t *b, int32_t x, int32_t y)
{
    int32_t k[2] = { x, y };
    return list(b, GX_SEQ, k, 2);
}

int32_t gx_seq3(prism_grammar_builder_t *b, int32_t x, int32_t y, int32_t z)
{
    int32_t k[3] = { x, y, z };
    return list(b, GX_SEQ, k, 3);
}

int32_t gx_alt2(prism_grammar_builder_t *b, int32_t x, int32_t y)
{
    int32_t k[2] = { x, y };
    return list(b, GX_ALT, k, 2);
}

int32_t gx_opt(prism_grammar_builder_t *b, int32_t x) { return prism_gexpr_repeat(b, x, 0, 1); }

prism_gexpr_t prism_gexpr_repeat(prism_grammar_builder_t *b, prism_gexpr_t e, int min, int max)
{
    if (b->err) return b->err;
    if (e < 0 || (size_t)e >= b->n_nodes) return gram_fail(b, PRISM_EINVAL, "", "invalid grammar expression handle");
    if (min < 0 || (max >= 0 && max < min))
        return gram_fail(b, PRISM_EINVAL, "", "invalid repetition bounds {%d,%d}", min, max);
    int bound = max >= 0 ? max : min;
    if (bound > b->lim.max_expansion)
        return gram_fail(b, PRISM_ELIMIT, "", "repetition bound %d exceeds the limit %d", bound, b->lim.max_expansion);
    if (min == 1 && max == 1) return e;
    return gx_new(b, GX_REP, e, min, max);
}

int32_t gx_rule_new(prism_grammar_builder_t *b)
{
    if (b->err) return b->err;
    if (grow(b, (void **)&b->rules, &b->cap_rules, b->n_rules + 1, sizeof *b->rules) < 0) return b->err;
    b->rules[b->n_rules] = -1;
    return (int32_t)b->n_rules++;
}

int32_t gx_rule_set(prism_grammar_builder_t *b, int32_t rule, int32_t body)
{
    if (b->err) return b->err;
    PRISM_ASSERT(rule >= 0 && (size_t)rule < b->n_rules && body >= 0);
    b->rules[rule] = body;
    return rule;
}

int32_t gx_ref(prism_grammar_builder_t *b, int32_t rule)
{
    if (b->err) return b->err;
    return gx_new(b, GX_REF, rule, 0, 0);
}

prism_gexpr_t prism_gexpr_shared(prism_grammar_builder_t *b, prism_gexpr_t e)
{
    if (b->err) return b->err;
    if (e < 0 || (size_t)e >= b->n_nodes) return gram_fail(b, PRISM_EINVAL, "", "invalid grammar expression handle");
    gx_kind_t k = (gx_kind_t)b->nodes[e].kind;
    if (k == GX_REF || k == GX_LIT || k == GX_CLASS || k == GX_EMPTY) return e;
    int32_t r = gx_rule_new(b);
    if (r < 0) return r;
    gx_rule_set(b, r, e);
    return gx_ref(b, r);
}

/* ---- UTF-8 ranges: split [lo, hi] until every piece is a product of byte ranges ---- */
static int utf8_rec(prism_grammar_builder_t *b, uint32_t lo, uint32_t hi, int32_t *alts, int *n, int cap)
{
    if (lo > hi) return 0;
    static const uint32_t bounds[] = { 0x7F, 0x7FF, 0xFFFF };  /* where the encoded length changes */
    for (int i = 0; i < 3; i++)
        if (lo <= bounds[i] && hi > bounds[i]) {
            if (utf8_rec(b, lo, bounds[i], alts, n, cap) < 0) return -1;
            return utf8_rec(b, bounds[i] + 1, hi, alts, n, cap);
        }
    if (hi >= 0x80) {
        for (int i = 1; i < 4; i++) {
            uint32_t m = (1u << (6 * i)) - 1;
            if ((lo & ~m) != (hi & ~m)) {
                if ((lo & m) != 0) {
                    if (utf8_rec(b, lo, lo | m, alts, n, cap) < 0) return -1;
                    return utf8_rec(b, (lo | m) + 1, hi, alts, n, cap);
                }
                if ((hi & m) != m) {
                    if (utf8_rec(b, lo, (hi & ~m) - 1, alts, n, cap) < 0) return -1;
                    return utf8_rec(b, hi & ~m, hi, alts, n, cap);
                }
            }
        }
    }
    char a[4], z[4];
    int len = prism_utf8_encode(lo, a);
    prism_utf8_encode(hi, z);
    int32_t parts[4];
    for (int i = 0; i < len; i++) parts[i] = gx_byte_range(b, (uint8_t)a[i], (uint8_t)z[i]);
    if (*n >= cap) return gram_fail(b, PRISM_ELIMIT, "", "character class too complex");
    alts[(*n)++] = prism_gexpr_seq(b, parts, (size_t)len);
    return b->err ? -1 : 0;
}

int32_t gx_utf8_range(prism_grammar_builder_t *b, uint32_t lo, uint32_t hi)
{
    if (b->err) return b->err;
    if (hi > 0x10FFFF) hi = 0x10FFFF;
    int32_t alts[64];
    int n = 0;
    /* surrogates are not scalar values and never valid in UTF-8 */
    if (lo <= 0xDFFF && hi >= 0xD800) {
        if (lo < 0xD800 && utf8_rec(b, lo, 0xD7FF, alts, &n, 64) < 0) return b->err;
        if (hi > 0xDFFF && utf8_rec(b, 0xE000, hi, alts, &n, 64) < 0) return b->err;
    } else if (utf8_rec(b, lo, hi, alts, &n, 64) < 0) {
        return b->err;
    }
    return prism_gexpr_alt(b, alts, (size_t)n);
}
