/* UTF-8 decoding, encoding, replacement and the JSON string writer: see utf8.h. */
#include "core/utf8.h"

#include <string.h>

prism_utf8_res_t prism_utf8_next(const char *str, size_t n, size_t *used)
{
    const unsigned char *s = (const unsigned char *)str;
    unsigned char c = s[0];
    if (c < 0x80) {
        *used = 1;
        return PRISM_UTF8_OK;
    }
    int need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) need = 1;
    else if (c == 0xE0) { need = 2; lo = 0xA0; }
    else if (c >= 0xE1 && c <= 0xEC) need = 2;
    else if (c == 0xED) { need = 2; hi = 0x9F; }
    else if (c >= 0xEE && c <= 0xEF) need = 2;
    else if (c == 0xF0) { need = 3; lo = 0x90; }
    else if (c >= 0xF1 && c <= 0xF3) need = 3;
    else if (c == 0xF4) { need = 3; hi = 0x8F; }
    else {
        *used = 1;
        return PRISM_UTF8_INVALID;
    }
    size_t i = 1;
    for (int k = 0; k < need; k++, i++) {
        if (i >= n) {
            *used = i;
            return PRISM_UTF8_TRUNCATED;
        }
        unsigned char l = k == 0 ? lo : 0x80, h = k == 0 ? hi : 0xBF;
        if (s[i] < l || s[i] > h) {
            *used = i;
            return PRISM_UTF8_INVALID;
        }
    }
    *used = i;
    return PRISM_UTF8_OK;
}

size_t prism_utf8_decode(const char *s, size_t n, uint32_t *cp)
{
    size_t used;
    if (n == 0) {
        *cp = 0;
        return 0;
    }
    if (prism_utf8_next(s, n, &used) != PRISM_UTF8_OK) {
        *cp = 0xFFFD;
        return used;
    }
    prism_utf8_decode_valid(s, cp);
    return used;
}

int prism_utf8_encode(uint32_t cp, char o[4])
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

bool prism_utf8_valid(const char *s, size_t n)
{
    const uint8_t *u = (const uint8_t *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) { i++; continue; }
        size_t k;
        if (prism_utf8_next(s + i, n - i, &k) != PRISM_UTF8_OK) return false;
        i += k;
    }
    return true;
}

int prism_utf8_lossy_append(prism_buf_t *out, const char *s, size_t n)
{
    const uint8_t *u = (const uint8_t *)s;
    size_t i = 0, run = 0;
    while (i < n) {
        if (u[i] < 0x80) { i++; continue; }
        size_t k;
        if (prism_utf8_next(s + i, n - i, &k) == PRISM_UTF8_OK) { i += k; continue; }
        if (prism_buf_append(out, s + run, i - run) < 0) return PRISM_ENOMEM;
        if (prism_buf_append(out, "\xEF\xBF\xBD", 3) < 0) return PRISM_ENOMEM;
        i += k;
        run = i;
    }
    return prism_buf_append(out, s + run, n - run) < 0 ? PRISM_ENOMEM : PRISM_OK;
}

size_t prism_utf8_count(const char *s, size_t n)
{
    const uint8_t *u = (const uint8_t *)s;
    size_t k = 0;
    for (size_t i = 0; i < n; k++) {
        size_t used = 1;
        if (u[i] >= 0x80) prism_utf8_next(s + i, n - i, &used);
        i += used;
    }
    return k;
}

size_t prism_utf8_complete_prefix(const char *s, size_t len)
{
    const unsigned char *u = (const unsigned char *)s;
    /* a sequence is at most 4 bytes: only the last 3 can start an unfinished one */
    size_t from = len > 3 ? len - 3 : 0;
    for (size_t p = from; p < len; p++) {
        if (u[p] < 0xC2 || u[p] > 0xF4) continue;
        size_t used;
        if (prism_utf8_next(s + p, len - p, &used) == PRISM_UTF8_TRUNCATED && p + used == len) return p;
    }
    return len;
}

/* ---------------------------------------------------------------- JSON */

int prism_json_escape(prism_buf_t *b, const char *s, size_t len)
{
    static const char hexd[] = "0123456789abcdef";
    const unsigned char *u = (const unsigned char *)s;
    /* worst case 6 bytes out per byte in; reserve a typical amount up front */
    int rc = prism_buf_reserve(b, len + 16);
    size_t i = 0;
    while (!rc && i < len) {
        size_t run = i;
        while (run < len && u[run] >= 0x20 && u[run] < 0x80 && u[run] != '"' && u[run] != '\\') run++;
        if (run > i) {
            rc = prism_buf_append(b, s + i, run - i);
            i = run;
            continue;
        }
        unsigned char c = u[i];
        if (c < 0x80) {
            char e[6] = {'\\', 0};
            size_t el = 2;
            switch (c) {
            case '"': e[1] = '"'; break;
            case '\\': e[1] = '\\'; break;
            case '\n': e[1] = 'n'; break;
            case '\r': e[1] = 'r'; break;
            case '\t': e[1] = 't'; break;
            case '\b': e[1] = 'b'; break;
            case '\f': e[1] = 'f'; break;
            default:
                e[1] = 'u'; e[2] = '0'; e[3] = '0'; e[4] = hexd[c >> 4]; e[5] = hexd[c & 15];
                el = 6;
                break;
            }
            rc = prism_buf_append(b, e, el);
            i++;
            continue;
        }
        size_t used;
        if (prism_utf8_next(s + i, len - i, &used) == PRISM_UTF8_OK) rc = prism_buf_append(b, s + i, used);
        else rc = prism_buf_append(b, "\xEF\xBF\xBD", 3);  /* U+FFFD */
        i += used;
    }
    return rc;
}

int prism_json_escape_cp(prism_buf_t *b, uint32_t cp)
{
    char u[4];
    return prism_json_escape(b, u, (size_t)prism_utf8_encode(cp, u));
}

int prism_json_string(prism_buf_t *b, const char *s, size_t len)
{
    int rc = prism_buf_append(b, "\"", 1);
    if (!rc) rc = prism_json_escape(b, s, len);
    if (!rc) rc = prism_buf_append(b, "\"", 1);
    return rc;
}

int prism_json_cstr(prism_buf_t *b, const char *s)
{
    if (!s) return prism_buf_append(b, "null", 4);
    return prism_json_string(b, s, strlen(s));
}
