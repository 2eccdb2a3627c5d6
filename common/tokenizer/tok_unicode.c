/* Character classes, NFC/NFD, the Oniguruma -> PCRE2 regex rewrite and pattern matching (find,
 * replace-all) shared by the encoder, the normalizers and the decoders. */
#define _GNU_SOURCE 1   /* memmem */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "tokenizer/tok_internal.h"

bool prism_tok_is_white_space(uint32_t cp)
{
    for (size_t i = 0; i < prism_tok_white_space_n; i++)
        if (cp >= prism_tok_white_space[i].lo && cp <= prism_tok_white_space[i].hi) return true;
    return false;
}

static pthread_once_t alnum_once = PTHREAD_ONCE_INIT;
static pcre2_code *alnum_re;
static void alnum_init(void)
{
    int e;
    PCRE2_SIZE eo;
    alnum_re = pcre2_compile((PCRE2_SPTR) "[\\p{Alphabetic}\\p{N}]", PCRE2_ZERO_TERMINATED,
                             PCRE2_UTF | PCRE2_UCP, &e, &eo, NULL);
    PRISM_ASSERT(alnum_re);
}

bool prism_tok_is_alnum(uint32_t cp)
{
    if (cp < 0x80) return (cp >= '0' && cp <= '9') || ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z');
    pthread_once(&alnum_once, alnum_init);
    char b[4];
    int k = prism_utf8_encode(cp, b);
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md) return false;
    int rc = pcre2_match(alnum_re, (PCRE2_SPTR)b, (size_t)k, 0, PCRE2_ANCHORED, md, NULL);
    pcre2_match_data_free(md);
    return rc >= 0;
}

/* ---------------- NFC / NFD ---------------- */

enum { SBASE = 0xAC00, LBASE = 0x1100, VBASE = 0x1161, TBASE = 0x11A7, LCOUNT = 19, VCOUNT = 21,
       TCOUNT = 28, NCOUNT = VCOUNT * TCOUNT, SCOUNT = LCOUNT * NCOUNT };

static uint8_t nf_interesting[0x110000 / 8];
static pthread_once_t nf_once = PTHREAD_ONCE_INIT;

static void nf_mark(uint32_t cp) { nf_interesting[cp >> 3] |= (uint8_t)(1u << (cp & 7)); }
static void nf_init(void)
{
    for (size_t i = 0; i < prism_tok_ccc_ranges_n; i++)
        for (uint32_t c = prism_tok_ccc_ranges[i].lo; c <= prism_tok_ccc_ranges[i].hi; c++) nf_mark(c);
    for (size_t i = 0; i < prism_tok_decomps_n; i++) nf_mark(prism_tok_decomps[i].cp);
    for (size_t i = 0; i < prism_tok_comps_n; i++) nf_mark(prism_tok_comps[i].b);
    for (uint32_t c = VBASE; c < VBASE + VCOUNT; c++) nf_mark(c);
    for (uint32_t c = TBASE + 1; c < TBASE + TCOUNT; c++) nf_mark(c);
    for (uint32_t c = SBASE; c < SBASE + SCOUNT; c++) nf_mark(c);  /* NFD must split syllables */
}

static uint8_t nf_ccc(uint32_t cp)
{
    size_t lo = 0, hi = prism_tok_ccc_ranges_n;
    while (lo < hi) {
        size_t m = (lo + hi) / 2;
        if (cp < prism_tok_ccc_ranges[m].lo) hi = m;
        else if (cp > prism_tok_ccc_ranges[m].hi) lo = m + 1;
        else return prism_tok_ccc_ranges[m].ccc;
    }
    return 0;
}

static const prism_tok_decomp_t *nf_decomp(uint32_t cp)
{
    size_t lo = 0, hi = prism_tok_decomps_n;
    while (lo < hi) {
        size_t m = (lo + hi) / 2;
        if (cp < prism_tok_decomps[m].cp) hi = m;
        else if (cp > prism_tok_decomps[m].cp) lo = m + 1;
        else return &prism_tok_decomps[m];
    }
    return NULL;
}

static uint32_t nf_compose(uint32_t a, uint32_t b)
{
    if (a >= LBASE && a < LBASE + LCOUNT && b >= VBASE && b < VBASE + VCOUNT)
        return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT;
    if (a >= SBASE && a < SBASE + SCOUNT && (a - SBASE) % TCOUNT == 0 && b > TBASE && b < TBASE + TCOUNT)
        return a + (b - TBASE);
    size_t lo = 0, hi = prism_tok_comps_n;
    while (lo < hi) {
        size_t m = (lo + hi) / 2;
        const prism_tok_comp_t *c = &prism_tok_comps[m];
        if (a < c->a || (a == c->a && b < c->b)) hi = m;
        else if (a > c->a || b > c->b) lo = m + 1;
        else return c->c;
    }
    return 0;
}

typedef struct { uint32_t *v; size_t n, cap; } cpvec_t;

static int cp_push(cpvec_t *v, uint32_t c)
{
    if (v->n == v->cap) {
        size_t nc = v->cap ? v->cap * 2 : 64;
        uint32_t *p = prism_realloc(v->v, nc * sizeof *p);
        if (!p) return PRISM_ENOMEM;
        v->v = p;
        v->cap = nc;
    }
    v->v[v->n++] = c;
    return PRISM_OK;
}

static int nf_decompose(cpvec_t *v, uint32_t cp, int depth)
{
    if (cp >= SBASE && cp < SBASE + SCOUNT) {
        uint32_t s = cp - SBASE;
        if (cp_push(v, LBASE + s / NCOUNT) || cp_push(v, VBASE + (s % NCOUNT) / TCOUNT)) return PRISM_ENOMEM;
        if (s % TCOUNT && cp_push(v, TBASE + s % TCOUNT)) return PRISM_ENOMEM;
        return PRISM_OK;
    }
    const prism_tok_decomp_t *d = depth < 8 ? nf_decomp(cp) : NULL;
    if (!d) return cp_push(v, cp);
    if (nf_decompose(v, d->d0, depth + 1)) return PRISM_ENOMEM;
    if (d->d1 && nf_decompose(v, d->d1, depth + 1)) return PRISM_ENOMEM;
    return PRISM_OK;
}

int prism_tok_nfc(const char *s, size_t n, bool compose, prism_buf_t *out, bool *changed)
{
    *changed = false;
    size_t i;
    /* Everything below U+0300 (lead byte < 0xCC) is stable under NFC; under NFD everything
     * below U+00C0 (lead byte < 0xC3), the first canonically decomposable char. */
    uint8_t fast_below = compose ? 0xCC : 0xC3;
    for (i = 0; i < n; i++)
        if ((uint8_t)s[i] >= fast_below) break;
    if (i == n) return PRISM_OK;
    pthread_once(&nf_once, nf_init);
    bool any = false;
    for (i = 0; i < n;) {
        uint32_t cp;
        i += (size_t)prism_utf8_decode_valid(s + i, &cp);
        if (nf_interesting[cp >> 3] & (1u << (cp & 7))) { any = true; break; }
    }
    if (!any) return PRISM_OK;

    cpvec_t v = {0};
    int rc = PRISM_ENOMEM;
    for (i = 0; i < n;) {
        uint32_t cp;
        i += (size_t)prism_utf8_decode_valid(s + i, &cp);
        if (nf_decompose(&v, cp, 0)) goto fail;
    }
    /* canonical ordering: stable insertion sort of each run of non-starters */
    for (size_t k = 1; k < v.n; k++) {
        uint8_t ck = nf_ccc(v.v[k]);
        if (!ck) continue;
        size_t j = k;
        uint32_t c = v.v[k];
        while (j > 0) {
            uint8_t cj = nf_ccc(v.v[j - 1]);
            if (cj <= ck || cj == 0) break;
            v.v[j] = v.v[j - 1];
            j--;
        }
        v.v[j] = c;
    }
    size_t m = v.n;
    if (compose && v.n) {
        size_t o = 1;
        long starter = nf_ccc(v.v[0]) == 0 ? 0 : -1;
        uint8_t last = nf_ccc(v.v[0]);
        for (size_t k = 1; k < v.n; k++) {
            uint32_t c = v.v[k];
            uint8_t cc = nf_ccc(c);
            if (starter >= 0) {
                bool adjacent = (size_t)starter == o - 1;
                if (adjacent || (last != 0 && last < cc)) {
                    uint32_t comp = nf_compose(v.v[starter], c);
                    if (comp) { v.v[starter] = comp; continue; }
                }
            }
            if (cc == 0) starter = (long)o;
            last = cc;
            v.v[o++] = c;
        }
        m = o;
    }
    if (prism_buf_reserve(out, m * 4) < 0) goto fail;
    for (size_t k = 0; k < m; k++) out->len += (size_t)prism_utf8_encode(v.v[k], out->data + out->len);
    *changed = true;
    rc = PRISM_OK;
fail:
    prism_free(v.v);
    return rc;
}

/* ---------------- regex rewrite ---------------- */

static int append_ranges(prism_buf_t *o, const prism_tok_range_t *r, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int rc = r[i].lo == r[i].hi ? prism_buf_appendf(o, "\\x{%X}", r[i].lo)
                                    : prism_buf_appendf(o, "\\x{%X}-\\x{%X}", r[i].lo, r[i].hi);
        if (rc < 0) return PRISM_ENOMEM;
    }
    return PRISM_OK;
}

static int class_items(prism_buf_t *o, char what)
{
    if (what == 'L') {
        if (prism_buf_append_str(o, "\\p{L}") < 0) return PRISM_ENOMEM;
        return append_ranges(o, prism_tok_extra_letter, prism_tok_extra_letter_n);
    }
    if (what == 'N') {
        if (prism_buf_append_str(o, "\\p{N}") < 0) return PRISM_ENOMEM;
        return append_ranges(o, prism_tok_extra_number, prism_tok_extra_number_n);
    }
    return append_ranges(o, prism_tok_white_space, prism_tok_white_space_n);
}

static bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
static char other_case(char c) { return (char)(c ^ 0x20); }

int prism_tok_regex_rewrite(const char *p, size_t n, prism_buf_t *o, char *err, size_t errlen)
{
    enum { MAXD = 64 };
    bool ci[MAXD + 1] = {false};
    int depth = 0;
    bool in_class = false;
    size_t i = 0;
#define EMIT(s, k) do { if (prism_buf_append(o, (s), (k)) < 0) return PRISM_ENOMEM; } while (0)
    while (i < n) {
        char c = p[i];
        if (c == '\\') {
            if (i + 1 >= n) { snprintf(err, errlen, "regex ends with a backslash"); return PRISM_ECORRUPT; }
            char e = p[i + 1];
            if ((e == 'p' || e == 'P') && i + 2 < n) {
                size_t j = i + 2, ns, nl;
                if (p[j] == '{') {
                    size_t k = j + 1;
                    while (k < n && p[k] != '}') k++;
                    if (k >= n) { snprintf(err, errlen, "unterminated \\p{...} in regex"); return PRISM_ECORRUPT; }
                    ns = j + 1; nl = k - ns; j = k + 1;
                } else {
                    ns = j; nl = 1; j = j + 1;
                }
                char what = 0;
                if (nl == 1 && (p[ns] == 'L' || p[ns] == 'N')) what = p[ns];
                if (what && e == 'p') {
                    if (!in_class) EMIT("[", 1);
                    if (class_items(o, what)) return PRISM_ENOMEM;
                    if (!in_class) EMIT("]", 1);
                } else {
                    EMIT(p + i, j - i);
                }
                i = j;
                continue;
            }
            if (e == 's' || (e == 'S' && !in_class)) {
                if (!in_class) EMIT(e == 's' ? "[" : "[^", e == 's' ? 1 : 2);
                if (class_items(o, 's')) return PRISM_ENOMEM;
                if (!in_class) EMIT("]", 1);
                i += 2;
                continue;
            }
            if (e == 'Q') {
                size_t j = i + 2;
                while (j + 1 < n && !(p[j] == '\\' && p[j + 1] == 'E')) j++;
                j = j + 1 < n ? j + 2 : n;
                EMIT(p + i, j - i);
                i = j;
                continue;
            }
            if (e == 'x' || e == 'o') {
                size_t j = i + 2;
                if (j < n && p[j] == '{') {
                    while (j < n && p[j] != '}') j++;
                    if (j < n) j++;
                } else {
                    while (j < n && j < i + 4 && ((p[j] >= '0' && p[j] <= '9') || is_alpha(p[j]))) j++;
                }
                EMIT(p + i, j - i);
                i = j;
                continue;
            }
            if (e == 'u' && i + 6 <= n) {   /* Oniguruma \uHHHH */
                if (prism_buf_appendf(o, "\\x{%.4s}", p + i + 2) < 0) return PRISM_ENOMEM;
                i += 6;
                continue;
            }
            EMIT(p + i, 2);
            i += 2;
            continue;
        }
        if (in_class) {
            if (c == '[' && i + 1 < n && p[i + 1] == ':') {
                size_t j = i + 2;
                while (j + 1 < n && !(p[j] == ':' && p[j + 1] == ']')) j++;
                j = j + 1 < n ? j + 2 : n;
                EMIT(p + i, j - i);
                i = j;
                continue;
            }
            if (c == ']') { in_class = false; EMIT("]", 1); i++; continue; }
            if (ci[depth] && is_alpha(c)) {
                if (i + 2 < n && p[i + 1] == '-' && is_alpha(p[i + 2])) {
                    char r[6] = { c, '-', p[i + 2], other_case(c), '-', other_case(p[i + 2]) };
                    EMIT(r, 6);
                    i += 3;
                } else {
                    char r[2] = { c, other_case(c) };
                    EMIT(r, 2);
                    i++;
                }
                continue;
            }
            EMIT(&c, 1);
            i++;
            continue;
        }
        if (c == '[') {
            in_class = true;
            EMIT("[", 1);
            i++;
            if (i < n && p[i] == '^') { EMIT("^", 1); i++; }
            if (i < n && p[i] == ']') { EMIT("]", 1); i++; }
            continue;
        }
        if (c == '(') {
            if (depth >= MAXD) { snprintf(err, errlen, "regex nests groups deeper than %d", MAXD); return PRISM_ELIMIT; }
            depth++;
            ci[depth] = ci[depth - 1];
            if (i + 3 < n && p[i + 1] == '?' && p[i + 2] == 'i' && p[i + 3] == ':') {
                ci[depth] = true;
                EMIT("(?:", 3);
                i += 4;
                continue;
            }
            if (i + 4 < n && p[i + 1] == '?' && p[i + 2] == '-' && p[i + 3] == 'i' && p[i + 4] == ':') {
                ci[depth] = false;
                EMIT("(?:", 3);
                i += 5;
                continue;
            }
            if (i + 3 < n && p[i + 1] == '?' && p[i + 2] == 'i' && p[i + 3] == ')') {
                depth--;
                ci[depth] = true;   /* applies to the rest of the enclosing group */
                i += 4;
                continue;
            }
            if (i + 2 < n && p[i + 1] == '?' &&
                (p[i + 2] == '<' || p[i + 2] == 'P' || p[i + 2] == '\'')) {
                /* group names are not letters to case-fold */
                size_t j = i + 2;
                char close = p[i + 2] == '\'' ? '\'' : '>';
                if (p[i + 2] == '<' && i + 3 < n && (p[i + 3] == '=' || p[i + 3] == '!')) j = i + 4;
                else {
                    j++;
                    while (j < n && p[j] != close) j++;
                    if (j < n) j++;
                }
                EMIT(p + i, j - i);
                i = j;
                continue;
            }
            EMIT("(", 1);
            i++;
            continue;
        }
        if (c == ')') {
            if (depth > 0) depth--;
            EMIT(")", 1);
            i++;
            continue;
        }
        if (ci[depth] && is_alpha(c)) {
            char r[4] = { '[', c, other_case(c), ']' };
            EMIT(r, 4);
            i++;
            continue;
        }
        EMIT(&c, 1);
        i++;
    }
#undef EMIT
    return PRISM_OK;
}

/* ---------------- pattern matching ---------------- */

bool prism_tok_pattern_find(const prism_tok_pattern_t *p, pcre2_match_data *md, const char *s, size_t n,
                            size_t from, size_t *ms, size_t *me)
{
    if (from > n) return false;
    if (!p->re) {
        if (p->lit_len > n - from) return false;
        const char *hit = memmem(s + from, n - from, p->lit, p->lit_len);
        if (!hit) return false;
        *ms = (size_t)(hit - s);
        *me = *ms + p->lit_len;
        return true;
    }
    int rc = pcre2_match(p->re, (PCRE2_SPTR)s, n, from, PCRE2_NO_UTF_CHECK, md, NULL);
    if (rc < 0) return false;   /* no match, or a matching limit: treat as no match */
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    if (ov[0] > ov[1] || ov[1] > n) return false;   /* \K games */
    *ms = ov[0];
    *me = ov[1];
    return true;
}

/* Replaces every match of pat in s[0..n) by `with`, with the regex crate's rules for empty matches
 * (shared by the Replace normalizer and the Replace decoder). */
int prism_tok_replace_all(const prism_tok_pattern_t *pat, pcre2_match_data *md, const char *s, size_t n,
                          const char *with, size_t wl, prism_buf_t *out)
{
    size_t from = 0, copied = 0;
    bool have_last = false;
    size_t last_end = 0;
    while (from <= n) {
        size_t ms, me;
        if (!prism_tok_pattern_find(pat, md, s, n, from, &ms, &me)) break;
        if (ms == me && have_last && last_end == me) {
            if (from >= n) break;
            from += (size_t)prism_utf8_len((uint8_t)s[from]);
            continue;
        }
        if (prism_buf_append(out, s + copied, ms - copied) < 0 || prism_buf_append(out, with, wl) < 0)
            return PRISM_ENOMEM;
        copied = me;
        have_last = true;
        last_end = me;
        from = me;
        if (ms == me) {
            if (from >= n) break;
            from += (size_t)prism_utf8_len((uint8_t)s[from]);
        }
    }
    return prism_buf_append(out, s + copied, n - copied) < 0 ? PRISM_ENOMEM : PRISM_OK;
}
