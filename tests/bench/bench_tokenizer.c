/* prism_bench_tokenizer <tokenizer.json> <corpus> [seconds]
 *
 * Single-thread encode throughput on a corpus: a JSONL file of strings (tests/data/tokenizer/
 * corpus.jsonl) or any text file (one string per line). Prints MB/s for encoding the strings one
 * by one (what the router does per request), for one call on the whole corpus joined with
 * newlines, and for decoding. Compare with tools/bench_tokenizer_hf.py on the same corpus. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

typedef struct { char **s; size_t *len; size_t n, bytes; } corpus_t;

static int load_corpus(const char *path, corpus_t *c)
{
    char *buf;
    size_t len;
    if (prism_read_file(path, (size_t)1 << 30, &buf, &len) < 0) return -1;
    size_t cap = 1024;
    c->s = malloc(cap * sizeof *c->s);
    c->len = malloc(cap * sizeof *c->len);
    bool jsonl = len && buf[0] == '"';
    for (char *p = buf, *end = buf + len; p < end;) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t ll = nl ? (size_t)(nl - p) : (size_t)(end - p);
        if (c->n == cap) {
            cap *= 2;
            c->s = realloc(c->s, cap * sizeof *c->s);
            c->len = realloc(c->len, cap * sizeof *c->len);
        }
        if (jsonl) {
            json_error_t je;
            json_t *j = json_loadb(p, ll, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            if (j && json_is_string(j)) {
                c->len[c->n] = json_string_length(j);
                c->s[c->n] = malloc(c->len[c->n] + 1);
                memcpy(c->s[c->n], json_string_value(j), c->len[c->n] + 1);
                c->bytes += c->len[c->n++];
            }
            json_decref(j);
        } else {
            c->len[c->n] = ll + (nl ? 1 : 0);
            c->s[c->n] = malloc(c->len[c->n] + 1);
            memcpy(c->s[c->n], p, c->len[c->n]);
            c->bytes += c->len[c->n++];
        }
        p += ll + 1;
    }
    prism_free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s <tokenizer.json> <corpus.jsonl|text> [seconds]\n", argv[0]);
        return 2;
    }
    double secs = argc > 3 ? atof(argv[3]) : 2.0;
    char err[256];
    prism_tokenizer_t *t;
    double t0 = prism_now_s();
    if (prism_tokenizer_load(argv[1], &t, err, sizeof err) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    double t_load = prism_now_s() - t0;
    corpus_t c = {0};
    if (load_corpus(argv[2], &c) < 0) {
        fprintf(stderr, "cannot read %s\n", argv[2]);
        return 1;
    }
    int32_t *ids = NULL;
    size_t n = 0, cap = 0, tokens = 0;

    /* one by one */
    size_t reps = 0;
    t0 = prism_now_s();
    do {
        tokens = 0;
        for (size_t i = 0; i < c.n; i++) {
            n = 0;
            if (prism_tokenizer_encode(t, c.s[i], c.len[i], false, &ids, &n, &cap) < 0) {
                fprintf(stderr, "encode failed on line %zu\n", i);
                return 1;
            }
            tokens += n;
        }
        reps++;
    } while (prism_now_s() - t0 < secs);
    double el = prism_now_s() - t0;
    double mbs_one = (double)c.bytes * reps / el / 1e6;

    /* whole corpus in one call (newline-joined, capped at the 8 MiB input bound) */
    prism_buf_t all = {0};
    for (size_t i = 0; i < c.n && all.len < ((size_t)8 << 20) - 1024 * 1024; i++) {
        prism_buf_append(&all, c.s[i], c.len[i]);
        prism_buf_append(&all, "\n", 1);
    }
    size_t reps2 = 0, tok2 = 0;
    t0 = prism_now_s();
    do {
        n = 0;
        if (prism_tokenizer_encode(t, all.data, all.len, false, &ids, &n, &cap) < 0) return 1;
        tok2 = n;
        reps2++;
    } while (prism_now_s() - t0 < secs);
    double el2 = prism_now_s() - t0;

    /* decode what the one call produced */
    prism_buf_t out = {0};
    size_t reps3 = 0;
    t0 = prism_now_s();
    do {
        out.len = 0;
        prism_tokenizer_decode(t, ids, tok2, false, &out);
        reps3++;
    } while (prism_now_s() - t0 < secs / 2);
    double el3 = prism_now_s() - t0;

    printf("tokenizer %s (load %.3f s)\n", argv[1], t_load);
    printf("corpus    %s: %zu strings, %.3f MB, %zu tokens\n", argv[2], c.n, c.bytes / 1e6, tokens);
    printf("encode one-by-one : %8.2f MB/s  %10.0f tokens/s  (%zu passes)\n", mbs_one, (double)tokens * reps / el, reps);
    printf("encode one call   : %8.2f MB/s  %10.0f tokens/s\n", (double)all.len * reps2 / el2 / 1e6, (double)tok2 * reps2 / el2);
    printf("decode            : %8.2f MB/s  %10.0f tokens/s\n", (double)out.len * reps3 / el3 / 1e6, (double)tok2 * reps3 / el3);
    for (size_t i = 0; i < c.n; i++) free(c.s[i]);
    free(c.s);
    free(c.len);
    prism_free(ids);
    prism_buf_free(&all);
    prism_buf_free(&out);
    prism_tokenizer_free(t);
    return 0;
}
