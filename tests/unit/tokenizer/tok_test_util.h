/* Helpers shared by the tokenizer tests: locating data and reading the JSONL corpus. */
#ifndef PRISM_TOK_TEST_UTIL_H
#define PRISM_TOK_TEST_UTIL_H

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

static inline const char *tt_source_dir(void)
{
    const char *s = getenv("PRISM_SOURCE_DIR");
    return s && *s ? s : PRISM_SOURCE_DIR;
}

/* $PRISM_SHARED_DIR, else $PRISM_SOURCE_DIR/../shared */
static inline void tt_shared_path(char *out, size_t n, const char *rel)
{
    const char *sh = getenv("PRISM_SHARED_DIR");
    if (sh && *sh) snprintf(out, n, "%s/%s", sh, rel);
    else snprintf(out, n, "%s/../shared/%s", tt_source_dir(), rel);
}

static inline void tt_source_path(char *out, size_t n, const char *rel)
{
    snprintf(out, n, "%s/%s", tt_source_dir(), rel);
}

typedef struct {
    char **s;        /* [n] strings (may contain NUL; use len) */
    size_t *len;     /* [n] */
    size_t n;
} tt_corpus_t;

/* Reads a JSONL file whose lines are JSON values; returns them (caller json_decref's each). */
static inline json_t **tt_read_jsonl(const char *path, size_t *n_out)
{
    char *buf = NULL;
    size_t len = 0;
    *n_out = 0;
    if (prism_read_file(path, (size_t)256 << 20, &buf, &len) < 0) return NULL;
    size_t cap = 1024, n = 0;
    json_t **v = malloc(cap * sizeof *v);
    char *p = buf, *end = buf + len;
    while (p < end) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t ll = nl ? (size_t)(nl - p) : (size_t)(end - p);
        if (ll) {
            json_error_t je;
            json_t *j = json_loadb(p, ll, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            if (!j) {
                fprintf(stderr, "%s: line %zu: %s\n", path, n + 1, je.text);
                exit(1);
            }
            if (n == cap) v = realloc(v, (cap *= 2) * sizeof *v);
            v[n++] = j;
        }
        p += ll + 1;
    }
    prism_free(buf);
    *n_out = n;
    return v;
}

static inline int tt_load_corpus(tt_corpus_t *c)
{
    char path[1024];
    tt_source_path(path, sizeof path, "tests/data/tokenizer/corpus.jsonl");
    size_t n;
    json_t **v = tt_read_jsonl(path, &n);
    if (!v) return -1;
    c->s = calloc(n, sizeof *c->s);
    c->len = calloc(n, sizeof *c->len);
    c->n = n;
    for (size_t i = 0; i < n; i++) {
        c->len[i] = json_string_length(v[i]);
        c->s[i] = malloc(c->len[i] + 1);
        memcpy(c->s[i], json_string_value(v[i]), c->len[i] + 1);
        json_decref(v[i]);
    }
    free(v);
    return 0;
}

static inline void tt_free_corpus(tt_corpus_t *c)
{
    for (size_t i = 0; i < c->n; i++) free(c->s[i]);
    free(c->s);
    free(c->len);
    memset(c, 0, sizeof *c);
}

static inline void tt_print_escaped(FILE *f, const char *s, size_t n)
{
    for (size_t i = 0; i < n && i < 300; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == '\\') fprintf(f, "\\x%02x", c);
        else fputc(c, f);
    }
}

#endif
