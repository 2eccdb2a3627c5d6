/* Regular expressions (Python re / vLLM guided_regex syntax, the regular subset) to grammar
 * expressions. Character sets are code-point range lists turned into UTF-8 byte automata, so
 * '.', negated classes and \uHHHH produce valid UTF-8 only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/utf8.h"
#include "gram_internal.h"

#define CP_MAX 0x10FFFF
#define MAX_RANGES 512

typedef struct { uint32_t lo, hi; } cp_range_t;
typedef struct { cp_range_t r[MAX_RANGES]; int n; } cp_set_t;

typedef struct {
    prism_grammar_builder_t *b;
    const char *s;
    size_t n, pos;
    int depth;
    bool json_escape;
    const char *prefix;
} rx_t;

static int32_t rx_fail(rx_t *r, int code, const char *fmt, const char *detail)
{
    char path[128];
    snprintf(path, sizeof path, "%s@%zu", r->prefix, r->pos);
    return gram_fail(r->b, code, path, fmt, detail);
}

static int set_add(rx_t *r, cp_set_t *s, uint32_t lo, uint32_t hi)
{
    if (s->n >= MAX_RANGES) return rx_fail(r, PRISM_ELIMIT, "%s", "character class too large");
    s->r[s->n++] = (cp_range_t){ lo, hi };
    return 0;
}

static int cmp_range(const void *a, const void *b)
{
    const cp_range_t *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

static void set_norm(cp_set_t *s)
{
    if (!s->n) return;
    qsort(s->r, (size_t)s->n, sizeof *s->r, cmp_range);
    int k = 0;
    for (int i = 1; i < s->n; i++) {
        if (s->r[i].lo <= s->r[k].hi + 1) {
            if (s->r[i].hi > s->r[k].hi) s->r[k].hi = s->r[i].hi;
        } else {
            s->r[++k] = s->r[i];
        }
    }
    s->n = k + 1;
}

static void set_negate(cp_set_t *s)
{
    set_norm(s);
    cp_set_t o = { .n = 0 };
    uint32_t next = 0;
    for (int i = 0; i < s->n; i++) {
        if (s->r[i].lo > next) o.r[o.n++] = (cp_range_t){ next, s->r[i].lo - 1 };
        next = s->r[i].hi + 1;
    }
    if (next <= CP_MAX) o.r[o.n++] = (cp_range_t){ next, CP_MAX };
    *s = o;
}

/* JSON escape for one code point below 0x20 or '"' / '\\'. */
/* c as it appears inside a JSON string, spelt by the one JSON writer (core/utf8). */
static int32_t json_escaped(prism_grammar_builder_t *b, uint32_t c)
{
    prism_buf_t o = {0};
    int32_t r = prism_json_escape_cp(&o, c) ? gram_fail(b, PRISM_ENOMEM, "", "out of memory building the grammar")
                                            : prism_gexpr_literal(b, o.data, o.len);
    prism_buf_free(&o);
    return r;
}

static int32_t set_expr(rx_t *r, cp_set_t *s)
{
    prism_grammar_builder_t *b = r->b;
    set_norm(s);
    int32_t alts[MAX_RANGES * 3 + 40];
    int n = 0;
    for (int i = 0; i < s->n; i++) {
        uint32_t lo = s->r[i].lo, hi = s->r[i].hi;
        if (r->json_escape) {
            /* code points that JSON strings must escape come out escaped */
            for (uint32_t c = lo; c <= hi && c < 0x20; c++) alts[n++] = json_escaped(b, c);
            if (lo < 0x20) lo = 0x20;
            if (lo > hi) continue;
            static const uint32_t special[2] = { '"', '\\' };
            for (int k = 0; k < 2; k++) {
                uint32_t c = special[k];
                if (lo <= c && c <= hi) {
                    alts[n++] = json_escaped(b, c);
                    if (lo < c) alts[n++] = gx_utf8_range(b, lo, c - 1);
                    lo = c + 1;
                }
            }
            if (lo > hi) continue;
        }
        alts[n++] = gx_utf8_range(b, lo, hi);
    }
    if (b->err) return b->err;
    if (n == 0) return rx_fail(r, PRISM_EINVAL, "%s", "empty character class matches nothing");
    return prism_gexpr_alt(b, alts, (size_t)n);
}

static bool rx_eof(rx_t *r) { return r->pos >= r->n; }
static int rx_peek(rx_t *r) { return rx_eof(r) ? -1 : (uint8_t)r->s[r->pos]; }

/* Next code point of the pattern itself (UTF-8). */
static int64_t rx_cp(rx_t *r)
{
    const uint8_t *p = (const uint8_t *)r->s + r->pos;
    size_t left = r->n - r->pos;
    uint32_t c = p[0];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!len || (size_t)len > left) return rx_fail(r, PRISM_EINVAL, "%s", "invalid UTF-8 in the pattern");
    if (len > 1) {
        c &= 0x3Fu >> (len - 1);
        for (int i = 1; i < len; i++) {
            if ((p[i] & 0xC0) != 0x80) return rx_fail(r, PRISM_EINVAL, "%s", "invalid UTF-8 in the pattern");
            c = c << 6 | (p[i] & 0x3F);
        }
    }
    r->pos += (size_t)len;
    return c;
}

static int hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int64_t rx_hex(rx_t *r, int digits)
{
    uint32_t v = 0;
    for (int i = 0; i < digits; i++) {
        int h = hexval(rx_peek(r));
        if (h < 0) return rx_fail(r, PRISM_EINVAL, "%s", "bad hexadecimal escape");
        v = v * 16 + (uint32_t)h;
        r->pos++;
    }
    return v;
}

/* After '\\': a class escape fills set (returns 1), a single code point returns 0 with *cp. */
static int rx_escape(rx_t *r, cp_set_t *set, uint32_t *cp)
{
    if (rx_eof(r)) return rx_fail(r, PRISM_EINVAL, "%s", "pattern ends with a backslash");
    int c = rx_peek(r);
    r->pos++;
    bool neg = false;
    switch (c) {
    case 'd': case 'D':
        neg = c == 'D';
        set_add(r, set, '0', '9');
        break;
    case 'w': case 'W':
        neg = c == 'W';
        set_add(r, set, '0', '9'); set_add(r, set, 'A', 'Z'); set_add(r, set, 'a', 'z'); set_add(r, set, '_', '_');
        break;
    case 's': case 'S':
        neg = c == 'S';
        set_add(r, set, ' ', ' '); set_add(r, set, '\t', '\r');
        break;
    case 'n': *cp = '\n'; return 0;
    case 't': *cp = '\t'; return 0;
    case 'r': *cp = '\r'; return 0;
    case 'f': *cp = '\f'; return 0;
    case 'v': *cp = '\v'; return 0;
    case 'a': *cp = 7; return 0;
    case '0': *cp = 0; return 0;
    case 'x': { int64_t v = rx_hex(r, 2); if (v < 0) return (int)v; *cp = (uint32_t)v; return 0; }
    case 'u': { int64_t v = rx_hex(r, 4); if (v < 0) return (int)v; *cp = (uint32_t)v; return 0; }
    case 'U': { int64_t v = rx_hex(r, 8); if (v < 0) return (int)v; if (v > CP_MAX) return rx_fail(r, PRISM_EINVAL, "%s", "code point out of range"); *cp = (uint32_t)v; return 0; }
    case 'b': case 'B': case 'A': case 'Z': case 'z': case 'G':
        r->pos--;
        return rx_fail(r, PRISM_ENOTSUP, "%s", "anchors and word boundaries inside a pattern are not supported");
    default:
        if (c >= '1' && c <= '9') {
            r->pos--;
            return rx_fail(r, PRISM_ENOTSUP, "%s", "back-references are not supported");
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
            r->pos--;
            return rx_fail(r, PRISM_EINVAL, "unknown escape \\%s", (char[]){ (char)c, 0 });
        }
        r->pos--;
        {
            int64_t v = rx_cp(r);
            if (v < 0) return (int)v;
            *cp = (uint32_t)v;
        }
        return 0;
    }
    if (neg) set_negate(set);
    return r->b->err ? r->b->err : 1;
}

static int32_t rx_class(rx_t *r)
{
    cp_set_t set = { .n = 0 };
    bool neg = false;
    if (rx_peek(r) == '^') { neg = true; r->pos++; }
    bool first = true;
    for (;;) {
        if (rx_eof(r)) return rx_fail(r, PRISM_EINVAL, "%s", "unterminated character class");
        int c = rx_peek(r);
        if (c == ']' && !first) { r->pos++; break; }
        first = false;
        uint32_t lo;
        if (c == '[' && r->pos + 1 < r->n && r->s[r->pos + 1] == ':')
            return rx_fail(r, PRISM_ENOTSUP, "%s", "POSIX classes are not supported");
        if (c == '\\') {
            r->pos++;
            cp_set_t sub = { .n = 0 };
            int k = rx_escape(r, &sub, &lo);
            if (k < 0) return k;
            if (k == 1) {
                for (int i = 0; i < sub.n; i++) set_add(r, &set, sub.r[i].lo, sub.r[i].hi);
                continue;
            }
        } else {
            int64_t v = rx_cp(r);
            if (v < 0) return (int32_t)v;
            lo = (uint32_t)v;
        }
        uint32_t hi = lo;
        if (rx_peek(r) == '-' && r->pos + 1 < r->n && r->s[r->pos + 1] != ']') {
            r->pos++;
            if (rx_peek(r) == '\\') {
                r->pos++;
                cp_set_t sub = { .n = 0 };
                int k = rx_escape(r, &sub, &hi);
                if (k < 0) return k;
                if (k == 1) return rx_fail(r, PRISM_EINVAL, "%s", "a class escape cannot end a range");
            } else {
                int64_t v = rx_cp(r);
                if (v < 0) return (int32_t)v;
                hi = (uint32_t)v;
            }
            if (hi < lo) return rx_fail(r, PRISM_EINVAL, "%s", "character range out of order");
        }
        if (set_add(r, &set, lo, hi) < 0) return r->b->err;
    }
    if (neg) set_negate(&set);
    return set_expr(r, &set);
}

static int32_t rx_alt(rx_t *r);

static int rx_int(rx_t *r, int *out)
{
    int v = 0, d = 0;
    while (!rx_eof(r) && rx_peek(r) >= '0' && rx_peek(r) <= '9') {
        v = v * 10 + (rx_peek(r) - '0');
        if (v > 1000000) return rx_fail(r, PRISM_ELIMIT, "%s", "repetition count too large");
        r->pos++;
        d++;
    }
    *out = v;
    return d;
}

static int32_t rx_atom(rx_t *r)
{
    prism_grammar_builder_t *b = r->b;
    int c = rx_peek(r);
    if (c == '(') {
        r->pos++;
        if (rx_peek(r) == '?') {
            r->pos++;
            int k = rx_peek(r);
            if (k == ':') {
                r->pos++;
            } else if (k == 'P' || k == '<') {
                if (k == 'P') r->pos++;
                if (rx_peek(r) != '<') return rx_fail(r, PRISM_ENOTSUP, "%s", "unsupported group syntax");
                if (r->pos + 1 < r->n && (r->s[r->pos + 1] == '=' || r->s[r->pos + 1] == '!'))
                    return rx_fail(r, PRISM_ENOTSUP, "%s", "look-behind is not supported");
                while (!rx_eof(r) && rx_peek(r) != '>') r->pos++;
                if (rx_eof(r)) return rx_fail(r, PRISM_EINVAL, "%s", "unterminated group name");
                r->pos++;
            } else if (k == '=' || k == '!') {
                return rx_fail(r, PRISM_ENOTSUP, "%s", "look-ahead is not supported");
            } else {
                return rx_fail(r, PRISM_ENOTSUP, "%s", "inline flags and other (?...) groups are not supported");
            }
        }
        if (++r->depth > 100) return rx_fail(r, PRISM_ELIMIT, "%s", "groups nested too deeply");
        int32_t e = rx_alt(r);
        r->depth--;
        if (e < 0) return e;
        if (rx_peek(r) != ')') return rx_fail(r, PRISM_EINVAL, "%s", "missing ')'");
        r->pos++;
        return e;
    }
    if (c == '[') {
        r->pos++;
        return rx_class(r);
    }
    if (c == '.') {
        r->pos++;
        cp_set_t s = { .n = 0 };
        set_add(r, &s, '\n', '\n');
        set_negate(&s);
        return set_expr(r, &s);
    }
    if (c == '^') {
        if (r->pos != 0) return rx_fail(r, PRISM_ENOTSUP, "%s", "'^' is supported only at the start");
        r->pos++;
        return gx_empty(b);
    }
    if (c == '$') {
        r->pos++;
        if (!rx_eof(r)) return rx_fail(r, PRISM_ENOTSUP, "%s", "'$' is supported only at the end");
        return gx_empty(b);
    }
    if (c == '*' || c == '+' || c == '?' || c == '{')
        return rx_fail(r, PRISM_EINVAL, "%s", "nothing to repeat");
    cp_set_t s = { .n = 0 };
    uint32_t cp;
    if (c == '\\') {
        r->pos++;
        int k = rx_escape(r, &s, &cp);
        if (k < 0) return k;
        if (k == 1) return set_expr(r, &s);
    } else {
        int64_t v = rx_cp(r);
        if (v < 0) return (int32_t)v;
        cp = (uint32_t)v;
    }
    set_add(r, &s, cp, cp);
    return set_expr(r, &s);
}

static int32_t rx_repeat(rx_t *r)
{
    int32_t e = rx_atom(r);
    while (e >= 0 && !rx_eof(r)) {
        int c = rx_peek(r), min, max;
        size_t at = r->pos;
        if (c == '*') { min = 0; max = -1; r->pos++; }
        else if (c == '+') { min = 1; max = -1; r->pos++; }
        else if (c == '?') { min = 0; max = 1; r->pos++; }
        else if (c == '{') {
            r->pos++;
            int d1 = rx_int(r, &min);
            if (d1 < 0) return d1;
            if (rx_peek(r) == ',') {
                r->pos++;
                int d2 = rx_int(r, &max);
                if (d2 < 0) return d2;
                if (d2 == 0) max = -1;
                if (d1 == 0) min = 0;
            } else {
                if (d1 == 0) { r->pos = at; return rx_fail(r, PRISM_EINVAL, "%s", "bad repetition {..}"); }
                max = min;
            }
            if (rx_peek(r) != '}') { r->pos = at; return rx_fail(r, PRISM_EINVAL, "%s", "bad repetition {..}"); }
            r->pos++;
        } else {
            break;
        }
        if (rx_peek(r) == '?') r->pos++;  /* lazy: same language */
        else if (rx_peek(r) == '+') return rx_fail(r, PRISM_ENOTSUP, "%s", "possessive quantifiers are not supported");
        if (max >= 0 && max < min) { r->pos = at; return rx_fail(r, PRISM_EINVAL, "%s", "repetition bounds out of order"); }
        int bound = max >= 0 ? max : min;
        if (bound > r->b->lim.max_expansion) {
            r->pos = at;
            char msg[64];
            snprintf(msg, sizeof msg, "%d (limit %d)", bound, r->b->lim.max_expansion);
            return rx_fail(r, PRISM_ELIMIT, "repetition bound too large: %s", msg);
        }
        e = prism_gexpr_repeat(r->b, e, min, max);
        int nx = rx_peek(r);
        if (nx == '*' || nx == '+' || nx == '?' || nx == '{')
            return rx_fail(r, PRISM_EINVAL, "%s", "multiple repeat");
    }
    return e;
}

static int32_t rx_concat(rx_t *r)
{
    int32_t items[256];
    int n = 0;
    int32_t acc = -1;
    while (!rx_eof(r) && rx_peek(r) != '|' && rx_peek(r) != ')') {
        int32_t e = rx_repeat(r);
        if (e < 0) return e;
        items[n++] = e;
        if (n == 256) {  /* fold long sequences */
            int32_t s = prism_gexpr_seq(r->b, items, (size_t)n);
            acc = acc < 0 ? s : gx_seq2(r->b, acc, s);
            n = 0;
        }
    }
    int32_t s = prism_gexpr_seq(r->b, items, (size_t)n);
    return acc < 0 ? s : gx_seq2(r->b, acc, s);
}

static int32_t rx_alt(rx_t *r)
{
    int32_t alts[256];
    int n = 0;
    for (;;) {
        int32_t e = rx_concat(r);
        if (e < 0) return e;
        if (n == 256) return rx_fail(r, PRISM_ELIMIT, "%s", "too many alternatives in one group (limit 256)");
        alts[n++] = e;
        if (rx_peek(r) != '|') break;
        r->pos++;
    }
    return prism_gexpr_alt(r->b, alts, (size_t)n);
}

int32_t gram_regex_expr(prism_grammar_builder_t *b, const char *re, size_t n, bool json_escape, const char *prefix)
{
    if (b->err) return b->err;
    rx_t r = { .b = b, .s = re, .n = n, .json_escape = json_escape, .prefix = prefix ? prefix : "" };
    int32_t e = rx_alt(&r);
    if (e >= 0 && !rx_eof(&r)) return rx_fail(&r, PRISM_EINVAL, "%s", "unbalanced ')'");
    return e;
}

prism_gexpr_t prism_gexpr_regex(prism_grammar_builder_t *b, const char *re, size_t n)
{
    if (b->err) return b->err;
    if (n > (size_t)b->lim.max_schema_bytes)
        return gram_fail(b, PRISM_ELIMIT, "", "regex of %zu bytes exceeds the limit %d", n, b->lim.max_schema_bytes);
    return gram_regex_expr(b, re, n, false, "");
}
