/* guide: what a request constrains its output to (response_format, vLLM's guided_json /
 * guided_regex / guided_choice, tool_choice "required" or a named function), as the source text
 * that travels router -> prefill -> decode in Sampling.guide, and a bounded cache of the grammars
 * compiled from it. The one place that maps a guide to a grammar: the router compiles to answer
 * 400 on a bad schema, each worker compiles against its own vocabulary (built from the model's
 * tokenizer.json at start-up), and both go through here.
 *
 * Ownership and threads: a cache may be shared by threads (the router's preparation threads): its
 * table is locked, and a miss compiles outside the lock (a compile is bounded by the grammar's
 * compile budget: grammar.h), so one thread's compile never holds up another's lookup. It holds
 * one reference to each compiled guide it keeps and evicts the least recently used beyond its
 * bounds. prism_guide_get hands out a reference of its own, so a guide in use outlives eviction
 * and the cache; release it with prism_guide_release. A guide is immutable.
 *
 *   prism_guide_cache_t *c; prism_guide_cache_create(vocab, 0, 0, &c);
 *   prism_guide_spec_t s = {.kind = PRISM_GUIDE_JSON_SCHEMA, .text = schema, .len = n};
 *   prism_guide_t *g; prism_grammar_error_t err;
 *   if (prism_guide_get(c, &s, &g, &err) < 0) reply_400(err.path, err.message);
 *   ... prism_grammar_matcher_create(prism_guide_grammar(g), ...) ...
 *   prism_guide_release(g);
 */
#ifndef PRISM_GUIDE_H
#define PRISM_GUIDE_H

#include "core/core.h"
#include "grammar/grammar.h"

typedef enum {
    PRISM_GUIDE_NONE = 0,
    PRISM_GUIDE_JSON_SCHEMA = 1,  /* text: a JSON Schema */
    PRISM_GUIDE_JSON_OBJECT = 2,  /* any JSON object (text unused) */
    PRISM_GUIDE_REGEX = 3,        /* text: a regular expression the whole output matches */
    PRISM_GUIDE_CHOICE = 4,       /* text: a JSON array of strings; the output is one of them */
    PRISM_GUIDE_TOOLS = 5,        /* text: the request's "tools" array; a forced tool call */
} prism_guide_kind_t;

#define PRISM_GUIDE_MAX_CHOICES 1024
#define PRISM_GUIDE_MAX_TOOL_NAME 64

/* Values the wire carries (proto Sampling.guide): same numbers. */
typedef struct {
    int kind;                     /* prism_guide_kind_t */
    const char *text;             /* not NUL-terminated necessarily */
    size_t len;
    const char *tool_name;        /* TOOLS: the function that must be called; NULL or "" = any */
    bool tool_parallel;           /* TOOLS: several calls (parallel_tool_calls) */
    int tool_format;              /* TOOLS: prism_toolcall_format_t */
} prism_guide_spec_t;

typedef struct prism_guide prism_guide_t;
typedef struct prism_guide_cache prism_guide_cache_t;

/* max_entries 0 = 64, max_text_bytes 0 = 16 MiB (guide text kept by the cache, all entries). The
 * vocabulary must outlive the cache and every guide. */
int  prism_guide_cache_create(const prism_grammar_vocab_t *v, int max_entries, size_t max_text_bytes,
                              prism_guide_cache_t **out);
void prism_guide_cache_destroy(prism_guide_cache_t *c);
/* The compiled guide for spec, from the cache or compiled now (and cached). On failure returns a
 * negative status with err filled (PRISM_EINVAL malformed, PRISM_ENOTSUP unsupported construct,
 * PRISM_ELIMIT over a bound); err->path names the place inside the text. */
int  prism_guide_get(prism_guide_cache_t *c, const prism_guide_spec_t *spec, prism_guide_t **out,
                     prism_grammar_error_t *err);
void prism_guide_retain(prism_guide_t *g);
void prism_guide_release(prism_guide_t *g);
prism_grammar_t *prism_guide_grammar(const prism_guide_t *g);
/* The spec it was compiled from (text, tool_name owned by the guide, NUL-terminated). */
const prism_guide_spec_t *prism_guide_spec(const prism_guide_t *g);

typedef struct {
    uint64_t hits, misses, evictions;
    int entries;
    size_t text_bytes;
} prism_guide_cache_stats_t;
void prism_guide_cache_stats(prism_guide_cache_t *c, prism_guide_cache_stats_t *out);

/* Compiles without a cache (tests, tools). */
int  prism_guide_compile(const prism_grammar_vocab_t *v, const prism_guide_spec_t *spec, prism_grammar_t **out,
                         prism_grammar_error_t *err);

#endif
