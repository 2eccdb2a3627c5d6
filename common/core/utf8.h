/* utf8: the tree's one UTF-8 codec, and its one JSON string writer.
 *
 * Decoding is strict, by the Unicode rules (no overlong forms, no surrogates, nothing past
 * U+10FFFF). Ill-formed input is replaced the way Python's errors="replace" and Rust's
 * String::from_utf8_lossy do ("substitution of maximal subparts"): each maximal prefix of a
 * sequence that could still have become valid is one U+FFFD, so "\xE2\x82" + "A" gives
 * U+FFFD then 'A', and "\xED\xA0\x80" (a surrogate) gives three.
 *
 *   size_t used;
 *   if (prism_utf8_next(s, n, &used) == PRISM_UTF8_OK) ... s[0..used) is one code point
 *   prism_json_string(&buf, text, len);    // "..." with escapes; invalid UTF-8 -> U+FFFD
 */
#ifndef PRISM_CORE_UTF8_H
#define PRISM_CORE_UTF8_H

#include "core/core.h"

typedef enum {
    PRISM_UTF8_OK        = 0,
    PRISM_UTF8_INVALID   = 1,  /* ill-formed: *used is the maximal subpart (>= 1) to replace */
    PRISM_UTF8_TRUNCATED = 2,  /* a valid prefix cut short by the end of the input (*used bytes) */
} prism_utf8_res_t;

/* Examines the sequence at s[0..n), n >= 1. *used: its length when OK, otherwise the bytes one
 * U+FFFD replaces. */
prism_utf8_res_t prism_utf8_next(const char *s, size_t n, size_t *used);
/* Decodes one code point from s[0..n) (n >= 1), U+FFFD for an ill-formed maximal subpart;
 * returns the bytes consumed. */
size_t prism_utf8_decode(const char *s, size_t n, uint32_t *cp);
/* Encodes cp (<= U+10FFFF) into out; returns 1..4. */
int    prism_utf8_encode(uint32_t cp, char out[4]);
bool   prism_utf8_valid(const char *s, size_t n);
/* Appends s with every ill-formed maximal subpart replaced by U+FFFD. */
int    prism_utf8_lossy_append(prism_buf_t *out, const char *s, size_t n);
/* Code points after replacement (what Python's len() sees on the decoded text). */
size_t prism_utf8_count(const char *s, size_t n);
/* Length of the longest prefix of s that does not end inside an incomplete-but-valid-so-far
 * sequence (hold the tail back until the next bytes complete it). */
size_t prism_utf8_complete_prefix(const char *s, size_t n);

/* Fast paths for text already known to be valid UTF-8 (the tokenizer's inner loops). */
static inline int prism_utf8_len(uint8_t lead)
{
    return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}
static inline int prism_utf8_decode_valid(const char *s, uint32_t *cp)
{
    const uint8_t *u = (const uint8_t *)s;
    if (u[0] < 0x80) { *cp = u[0]; return 1; }
    if (u[0] < 0xE0) { *cp = ((uint32_t)(u[0] & 0x1F) << 6) | (u[1] & 0x3F); return 2; }
    if (u[0] < 0xF0) {
        *cp = ((uint32_t)(u[0] & 0x0F) << 12) | ((uint32_t)(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
        return 3;
    }
    *cp = ((uint32_t)(u[0] & 0x07) << 18) | ((uint32_t)(u[1] & 0x3F) << 12) |
          ((uint32_t)(u[2] & 0x3F) << 6) | (u[3] & 0x3F);
    return 4;
}

/* ---- JSON output ---- */
/* A JSON string literal (with the quotes) of s[0..len): '"', '\\' and control characters
 * escaped, invalid UTF-8 replaced by U+FFFD, so the output is always valid JSON. */
int prism_json_string(prism_buf_t *b, const char *s, size_t len);
/* The same without the quotes (text that goes inside a string being written). */
int prism_json_escape(prism_buf_t *b, const char *s, size_t len);
/* One code point (<= U+10FFFF, not a surrogate), escaped as above. */
int prism_json_escape_cp(prism_buf_t *b, uint32_t cp);
/* The same for a C string; NULL writes null. */
int prism_json_cstr(prism_buf_t *b, const char *s);

#endif
