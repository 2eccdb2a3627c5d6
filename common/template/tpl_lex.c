/* Lexer: the jinja2 lexer rules for trim_blocks=True, lstrip_blocks=True and the default delimiters,
 * including its whitespace control ({%- -%} {%+ +%}), raw blocks, and the rule that tag ends are only
 * recognised while brackets are balanced. */
#include "template/tpl_internal.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    tpl_pool_t *pool;
    const char *src;
    size_t len;
    size_t lpos; /* line counting cursor */
    int line;
    tpl_tokens_t *out;
    char *err;
    size_t errlen;
    int status;
} lexer_t;

static int lex_fail(lexer_t *L, int status, size_t pos, const char *fmt, const char *arg)
{
    char msg[160];
    snprintf(msg, sizeof(msg), fmt, arg ? arg : "");
    int line = L->line;
    for (size_t i = L->lpos; i < pos && i < L->len; i++)
        if (L->src[i] == '\n') line++;
    if (L->err && L->errlen) snprintf(L->err, L->errlen, "%s at line %d", msg, line);
    L->status = status;
    return status;
}

static int line_at(lexer_t *L, size_t pos)
{
    for (; L->lpos < pos && L->lpos < L->len; L->lpos++)
        if (L->src[L->lpos] == '\n') L->line++;
    return L->line;
}

static tpl_token_t *push(lexer_t *L, int kind, size_t pos)
{
    tpl_tokens_t *t = L->out;
    if (t->n == t->cap) {
        size_t ncap = t->cap ? t->cap * 2 : 256;
        tpl_token_t *nv = tpl_pool_alloc(L->pool, ncap * sizeof(*nv));
        if (!nv) { lex_fail(L, PRISM_ENOMEM, pos, "out of memory%s", NULL); return NULL; }
        if (t->n) memcpy(nv, t->v, t->n * sizeof(*nv));
        t->v = nv;
        t->cap = ncap;
    }
    tpl_token_t *k = &t->v[t->n++];
    memset(k, 0, sizeof(*k));
    k->kind = (uint8_t)kind;
    k->line = line_at(L, pos);
    return k;
}

/* Python's str.isspace over UTF-8: returns the byte length of the whitespace char at p, 0 if none. */
static size_t space_at(const char *p, size_t n)
{
    if (!n) return 0;
    unsigned char c = (unsigned char)p[0];
    if (c < 0x80) return tpl_py_isspace(c) ? 1 : 0;
    uint32_t cp;
    size_t k = prism_utf8_decode(p, n, &cp);
    return tpl_py_isspace(cp) ? k : 0;
}

static size_t skip_space(const char *s, size_t pos, size_t len)
{
    size_t k;
    while (pos < len && (k = space_at(s + pos, len - pos)) > 0) pos += k;
    return pos;
}

/* Length of text after Python's str.rstrip(). */
static size_t rstrip_len(const char *s, size_t n)
{
    size_t end = n;
    while (end > 0) {
        size_t st = end - 1;
        while (st > 0 && ((unsigned char)s[st] & 0xC0) == 0x80 && end - st < 4) st--;
        if (space_at(s + st, end - st) == end - st) end = st;
        else break;
    }
    return end;
}

/* Applies the data-before-tag whitespace rules (jinja2's OptionalLStrip) and emits the data token. */
static int emit_data(lexer_t *L, size_t start, size_t n, char sign, bool is_var, bool line_starting)
{
    const char *text = L->src + start;
    if (sign == '-') {
        n = rstrip_len(text, n);
    } else if (sign != '+' && !is_var) {
        size_t l_pos = 0;
        for (size_t i = n; i > 0; i--)
            if (text[i - 1] == '\n') { l_pos = i; break; }
        if (l_pos > 0 || line_starting) {
            /* jinja2 3.1.6: whitespace_re (\s+, i.e. Unicode whitespace) must fullmatch the rest */
            size_t i = l_pos, k;
            while (i < n && (k = space_at(text + i, n - i)) > 0) i += k;
            if (i == n) n = l_pos;
        }
    }
    if (!n) return 0;
    tpl_token_t *k = push(L, TK_DATA, start);
    if (!k) return L->status;
    k->s = text;
    k->n = n;
    return 0;
}

/* Matches "{%" sign? \s* word \s* ("-%}" \s* | "%}" trim?) at pos. Returns end position or 0. */
static size_t match_raw_tag(lexer_t *L, size_t pos, const char *word, bool trim_nl, char *sign_out,
                            bool *ends_nl)
{
    const char *s = L->src;
    size_t len = L->len, p = pos;
    if (p + 2 > len || s[p] != '{' || s[p + 1] != '%') return 0;
    p += 2;
    char sign = 0;
    if (p < len && (s[p] == '-' || s[p] == '+')) sign = s[p++];
    p = skip_space(s, p, len);
    size_t wl = strlen(word);
    if (p + wl > len || memcmp(s + p, word, wl)) return 0;
    p += wl;
    size_t q = skip_space(s, p, len);
    /* raw/endraw must be followed by whitespace or the tag end; "rawx" is another tag */
    p = q;
    if (p + 3 <= len && s[p] == '-' && s[p + 1] == '%' && s[p + 2] == '}') {
        p = skip_space(s, p + 3, len);
    } else if (trim_nl && p + 3 <= len && s[p] == '+' && s[p + 1] == '%' && s[p + 2] == '}') {
        p += 3;
    } else if (p + 2 <= len && s[p] == '%' && s[p + 1] == '}') {
        p += 2;
        if (trim_nl && p < len && s[p] == '\n') p++;
    } else {
        return 0;
    }
    if (sign_out) *sign_out = sign;
    if (ends_nl) *ends_nl = s[p - 1] == '\n';
    return p;
}

static int decode_string(lexer_t *L, size_t pos, const char *q, size_t n, tpl_token_t *k)
{
    char *d = tpl_pool_alloc(L->pool, n * 2 + 1); /* escapes never grow text beyond 2x (\777 -> 2 bytes) */
    if (!d) return lex_fail(L, PRISM_ENOMEM, pos, "out of memory%s", NULL);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = q[i];
        if (ch != '\\') { d[o++] = ch; continue; }
        if (i + 1 >= n) { d[o++] = '\\'; break; }
        char e = q[++i];
        uint32_t cp = 0;
        int digits = 0;
        switch (e) {
        case '\n': continue;
        case '\\': d[o++] = '\\'; continue;
        case '\'': d[o++] = '\''; continue;
        case '"': d[o++] = '"'; continue;
        case 'a': d[o++] = '\a'; continue;
        case 'b': d[o++] = '\b'; continue;
        case 'f': d[o++] = '\f'; continue;
        case 'n': d[o++] = '\n'; continue;
        case 'r': d[o++] = '\r'; continue;
        case 't': d[o++] = '\t'; continue;
        case 'v': d[o++] = '\v'; continue;
        case 'x': digits = 2; break;
        case 'u': digits = 4; break;
        case 'U': digits = 8; break;
        case 'N': return lex_fail(L, PRISM_ENOTSUP, pos, "unsupported string escape '\\N{...}'%s", NULL);
        default:
            if (e >= '0' && e <= '7') {
                cp = (uint32_t)(e - '0');
                for (int j = 0; j < 2 && i + 1 < n && q[i + 1] >= '0' && q[i + 1] <= '7'; j++)
                    cp = cp * 8 + (uint32_t)(q[++i] - '0');
                o += prism_utf8_encode(cp, d + o);
                continue;
            }
            d[o++] = '\\';
            d[o++] = e;
            continue;
        }
        for (int j = 0; j < digits; j++) {
            if (i + 1 >= n) return lex_fail(L, PRISM_EINVAL, pos, "truncated \\%s escape in string literal", (char[]){e, 0});
            char h = q[++i];
            int v = (h >= '0' && h <= '9') ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                  : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
            if (v < 0) return lex_fail(L, PRISM_EINVAL, pos, "truncated \\%s escape in string literal", (char[]){e, 0});
            cp = cp * 16 + (uint32_t)v;
        }
        if (cp > 0x10FFFF) return lex_fail(L, PRISM_EINVAL, pos, "illegal Unicode character in string literal%s", NULL);
        if (cp >= 0xD800 && cp <= 0xDFFF)
            return lex_fail(L, PRISM_ENOTSUP, pos, "unsupported surrogate escape in string literal%s", NULL);
        o += prism_utf8_encode(cp, d + o);
    }
    d[o] = 0;
    k->s = d;
    k->n = o;
    return 0;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

/* (\d+_)*\d+ : returns end or start when no digits */
static size_t scan_digits(const char *s, size_t p, size_t len)
{
    size_t st = p;
    for (;;) {
        size_t q = p;
        while (q < len && is_digit(s[q])) q++;
        if (q == p) return p == st ? st : p - 1; /* dangling '_' is not part of the number */
        p = q;
        if (p + 1 < len && s[p] == '_' && is_digit(s[p + 1])) { p++; continue; }
        return p;
    }
}

static int lex_number(lexer_t *L, size_t pos, size_t *endp)
{
    const char *s = L->src;
    size_t len = L->len;
    size_t p = scan_digits(s, pos, len);
    if (p == pos) return 1;
    bool lookbehind_ok = pos == 0 || s[pos - 1] != '.';
    size_t fend = 0;
    if (lookbehind_ok) {
        /* \.(\d+_)*\d+ optionally followed by exponent, or exponent alone */
        size_t q = p;
        if (q < len && s[q] == '.') {
            size_t r = scan_digits(s, q + 1, len);
            if (r > q + 1) q = r;
        }
        size_t e = q;
        if (e < len && (s[e] == 'e' || s[e] == 'E')) {
            size_t r = e + 1;
            if (r < len && (s[r] == '+' || s[r] == '-')) r++;
            size_t t = scan_digits(s, r, len);
            if (t > r) e = t;
        }
        if (e > p) fend = e;
    }
    char buf[96];
    if (fend) {
        size_t o = 0;
        for (size_t i = pos; i < fend && o < sizeof(buf) - 1; i++)
            if (s[i] != '_') buf[o++] = s[i];
        buf[o] = 0;
        tpl_token_t *k = push(L, TK_FLOAT, pos);
        if (!k) return L->status;
        k->f = strtod(buf, NULL);
        *endp = fend;
        return 0;
    }
    /* integers: 0b / 0o / 0x prefixes, [1-9](_?\d)* or 0(_?0)* */
    int base = 10;
    size_t q = pos, digits_start = pos;
    if (s[pos] == '0' && pos + 1 < len && strchr("bBoOxX", s[pos + 1])) {
        char b = s[pos + 1];
        base = (b == 'b' || b == 'B') ? 2 : (b == 'o' || b == 'O') ? 8 : 16;
        q = pos + 2;
        digits_start = q;
        for (;;) {
            size_t r = q;
            if (r < len && s[r] == '_') r++;
            if (r >= len) break;
            char c = s[r];
            int v = is_digit(c) ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : 99;
            if (v >= base) break;
            q = r + 1;
        }
        if (q == digits_start) { base = 10; q = pos + 1; digits_start = pos; }
    } else if (s[pos] == '0') {
        q = pos + 1;
        while (q + 1 < len && s[q] == '_' && s[q + 1] == '0') q += 2;
        while (q < len && s[q] == '0') q++;
    } else {
        q = scan_digits(s, pos, len);
    }
    uint64_t v = 0;
    for (size_t i = digits_start; i < q; i++) {
        char c = s[i];
        if (c == '_') continue;
        int d = is_digit(c) ? c - '0' : (c | 0x20) - 'a' + 10;
        if (v > (uint64_t)(INT64_MAX - d) / (uint64_t)base)
            return lex_fail(L, PRISM_ENOTSUP, pos, "unsupported integer literal (too large)%s", NULL);
        v = v * (uint64_t)base + (uint64_t)d;
    }
    tpl_token_t *k = push(L, TK_INT, pos);
    if (!k) return L->status;
    k->i = (int64_t)v;
    *endp = q;
    return 0;
}

static const struct { const char *s; uint8_t op; } ops_tab[] = {
    {"//", OP_FLOORDIV}, {"**", OP_POW}, {"==", OP_EQ}, {"!=", OP_NE}, {">=", OP_GE}, {"<=", OP_LE},
    {"+", OP_ADD}, {"-", OP_SUB}, {"/", OP_DIV}, {"*", OP_MUL}, {"%", OP_MOD}, {"~", OP_TILDE},
    {"[", OP_LBRACKET}, {"]", OP_RBRACKET}, {"(", OP_LPAREN}, {")", OP_RPAREN}, {"{", OP_LBRACE},
    {"}", OP_RBRACE}, {">", OP_GT}, {"<", OP_LT}, {"=", OP_ASSIGN}, {".", OP_DOT}, {":", OP_COLON},
    {"|", OP_PIPE}, {",", OP_COMMA}, {";", OP_SEMICOLON},
};

/* Lexes the inside of a {{ }} or {% %} tag starting at pos. Returns position after the end tag. */
static int lex_tag(lexer_t *L, size_t pos, bool is_block, size_t *endp, bool *ends_nl)
{
    const char *s = L->src;
    size_t len = L->len;
    char stack[PRISM_TEMPLATE_MAX_NESTING];
    int depth = 0;
    for (;;) {
        if (pos >= len)
            return lex_fail(L, PRISM_EINVAL, pos, "unexpected end of template, expected end of %s",
                            is_block ? "block tag" : "print statement");
        if (depth == 0) {
            size_t e = 0;
            if (is_block) {
                if (pos + 3 <= len && s[pos] == '+' && s[pos + 1] == '%' && s[pos + 2] == '}') e = pos + 3;
                else if (pos + 3 <= len && s[pos] == '-' && s[pos + 1] == '%' && s[pos + 2] == '}') e = skip_space(s, pos + 3, len);
                else if (pos + 2 <= len && s[pos] == '%' && s[pos + 1] == '}') {
                    e = pos + 2;
                    if (e < len && s[e] == '\n') e++;
                }
            } else {
                if (pos + 3 <= len && s[pos] == '-' && s[pos + 1] == '}' && s[pos + 2] == '}') e = skip_space(s, pos + 3, len);
                else if (pos + 2 <= len && s[pos] == '}' && s[pos + 1] == '}') e = pos + 2;
            }
            if (e) {
                if (!push(L, is_block ? TK_BLOCK_END : TK_VAR_END, pos)) return L->status;
                *endp = e;
                *ends_nl = s[e - 1] == '\n';
                return 0;
            }
        }
        size_t w = skip_space(s, pos, len);
        if (w > pos) { pos = w; continue; }
        char c = s[pos];
        if (is_digit(c)) {
            size_t e = pos;
            int rc = lex_number(L, pos, &e);
            if (rc < 0) return rc;
            if (rc == 0) { pos = e; continue; }
        }
        if (c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
            size_t e = pos + 1;
            while (e < len && (s[e] == '_' || is_digit(s[e]) || (s[e] >= 'a' && s[e] <= 'z') || (s[e] >= 'A' && s[e] <= 'Z'))) e++;
            tpl_token_t *k = push(L, TK_NAME, pos);
            if (!k) return L->status;
            k->s = tpl_pool_strndup(L->pool, s + pos, e - pos);
            if (!k->s) return lex_fail(L, PRISM_ENOMEM, pos, "out of memory%s", NULL);
            k->n = e - pos;
            pos = e;
            continue;
        }
        if (c == '\'' || c == '"') {
            size_t e = pos + 1;
            bool closed = false;
            while (e < len) {
                if (s[e] == '\\') { e += 2; continue; }
                if (s[e] == c) { closed = true; break; }
                e++;
            }
            if (closed) {
                tpl_token_t *k = push(L, TK_STRING, pos);
                if (!k) return L->status;
                int rc = decode_string(L, pos, s + pos + 1, e - pos - 1, k);
                if (rc) return rc;
                pos = e + 1;
                continue;
            }
            return lex_fail(L, PRISM_EINVAL, pos, "unexpected char '%s'", (char[]){c, 0});
        }
        bool matched = false;
        for (size_t i = 0; i < PRISM_ARRAY_LEN(ops_tab); i++) {
            size_t ol = strlen(ops_tab[i].s);
            if (pos + ol > len || memcmp(s + pos, ops_tab[i].s, ol)) continue;
            uint8_t op = ops_tab[i].op;
            if (op == OP_LPAREN || op == OP_LBRACKET || op == OP_LBRACE) {
                if (depth >= (int)sizeof(stack))
                    return lex_fail(L, PRISM_ELIMIT, pos, "brackets nested too deeply%s", NULL);
                stack[depth++] = op == OP_LPAREN ? ')' : op == OP_LBRACKET ? ']' : '}';
            } else if (op == OP_RPAREN || op == OP_RBRACKET || op == OP_RBRACE) {
                if (depth == 0) return lex_fail(L, PRISM_EINVAL, pos, "unexpected '%s'", ops_tab[i].s);
                if (stack[depth - 1] != ops_tab[i].s[0])
                    return lex_fail(L, PRISM_EINVAL, pos, "unexpected '%s'", ops_tab[i].s);
                depth--;
            }
            tpl_token_t *k = push(L, TK_OP, pos);
            if (!k) return L->status;
            k->op = op;
            k->s = ops_tab[i].s;
            k->n = ol;
            pos += ol;
            matched = true;
            break;
        }
        if (!matched) {
            char shown[8] = {0};
            if ((unsigned char)c < 0x20 || (unsigned char)c >= 0x7f) snprintf(shown, sizeof(shown), "\\x%02x", (unsigned char)c);
            else shown[0] = c;
            return lex_fail(L, PRISM_EINVAL, pos, "unexpected char '%s'", shown);
        }
    }
}

int tpl_lex(tpl_pool_t *pool, const char *src, size_t len, tpl_tokens_t *out, char *err, size_t errlen)
{
    lexer_t L = {.pool = pool, .src = src, .len = len, .line = 1, .out = out, .err = err, .errlen = errlen};
    memset(out, 0, sizeof(*out));
    size_t pos = 0;
    bool line_starting = true;
    while (pos < len) {
        /* earliest tag start */
        size_t i = pos;
        const char *hit = NULL;
        while (i + 1 < len) {
            const char *f = memchr(src + i, '{', len - i - 1);
            if (!f) break;
            i = (size_t)(f - src);
            if (src[i + 1] == '{' || src[i + 1] == '%' || src[i + 1] == '#') { hit = f; break; }
            i++;
        }
        if (!hit) {
            if (emit_data(&L, pos, len - pos, '+', true, line_starting)) return L.status;
            break;
        }
        char kind = src[i + 1];
        char sign = (i + 2 < len && (src[i + 2] == '-' || src[i + 2] == '+')) ? src[i + 2] : 0;
        if (kind == '%') {
            char rsign = 0;
            bool nl = false;
            size_t rend = match_raw_tag(&L, i, "raw", false, &rsign, &nl);
            if (rend) {
                if (emit_data(&L, pos, i - pos, rsign, false, line_starting)) return L.status;
                line_starting = nl;
                /* find {% endraw %} */
                size_t j = rend, eend = 0;
                char esign = 0;
                bool enl = false;
                while (j + 1 < len) {
                    const char *f = memchr(src + j, '{', len - j - 1);
                    if (!f) break;
                    j = (size_t)(f - src);
                    if ((eend = match_raw_tag(&L, j, "endraw", true, &esign, &enl)) > 0) break;
                    j++;
                }
                if (!eend) return lex_fail(&L, PRISM_EINVAL, i, "missing end of raw directive%s", NULL);
                if (emit_data(&L, rend, j - rend, esign, false, line_starting)) return L.status;
                line_starting = enl;
                pos = eend;
                continue;
            }
        }
        if (emit_data(&L, pos, i - pos, sign, kind == '{', line_starting)) return L.status;
        size_t p = i + 2 + (sign ? 1 : 0);
        if (kind == '#') {
            /* first "#}" at or after p; a '-' or '+' right before it (inside the comment) is its sign */
            size_t j = p;
            const char *f = NULL;
            while (j + 1 < len) {
                f = memchr(src + j, '#', len - j - 1);
                if (!f) break;
                j = (size_t)(f - src);
                if (src[j + 1] == '}') break;
                j++;
                f = NULL;
            }
            if (!f) return lex_fail(&L, PRISM_EINVAL, i, "missing end of comment tag%s", NULL);
            size_t e;
            if (j > p && src[j - 1] == '-') e = skip_space(src, j + 2, len);
            else if (j > p && src[j - 1] == '+') e = j + 2;
            else {
                e = j + 2;
                if (e < len && src[e] == '\n') e++;
            }
            line_starting = src[e - 1] == '\n';
            pos = e;
            continue;
        }
        if (!push(&L, kind == '%' ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, i)) return L.status;
        size_t e = len;
        bool nl = false;
        int rc = lex_tag(&L, p, kind == '%', &e, &nl);
        if (rc) return rc;
        line_starting = nl;
        pos = e;
    }
    if (!push(&L, TK_EOF, len)) return L.status;
    return 0;
}
