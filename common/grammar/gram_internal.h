/* grammar internals: expression IR (builder), compiled DFA tables, vocabulary trie, stack pool.
 * Only files under common/grammar include this. */
#ifndef PRISM_GRAM_INTERNAL_H
#define PRISM_GRAM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "grammar/grammar.h"

#include <jansson.h>
#include <stdlib.h>

/* Frees what json_dumps returned with the allocator jansson was given (the router gives it
 * prism_malloc / prism_free; plain free() there would corrupt the heap). */
static inline void gram_json_free(void *p)
{
    json_free_t f = NULL;
    json_get_alloc_funcs(NULL, &f);
    if (p) (f ? f : free)(p);
}

/* ---- defaults ---- */
#define GRAM_DEF_SCHEMA_BYTES  (256 << 10)
#define GRAM_DEF_SCHEMA_DEPTH  32
#define GRAM_DEF_SCHEMA_NODES  4096
#define GRAM_DEF_EXPANSION     256
#define GRAM_DEF_STATES        200000
#define GRAM_DEF_STACK_DEPTH   128
#define GRAM_DEF_STACKS        256
#define GRAM_DEF_NODES         4096
#define GRAM_DEF_ROLLBACK      16
#define GRAM_DEF_COMPILE_MS    1000
#define GRAM_DEF_COMPILE_BYTES (256 << 20)
#define GRAM_DEF_MASK_WORK     (1 << 25)
#define GRAM_MAX_EXPR_NODES    (1 << 21)

void gram_limits_resolve(prism_grammar_limits_t *out, const prism_grammar_limits_t *in);

/* ---- expression IR ---- */
typedef enum { GX_EMPTY, GX_CLASS, GX_LIT, GX_SEQ, GX_ALT, GX_REP, GX_REF } gx_kind_t;

typedef struct {
    uint8_t kind;
    int32_t a, b, c; /* SEQ/ALT: kids[a..a+b); LIT: bytes[a..a+b); CLASS: classes[a];
                        REP: child a, min b, max c (-1 unbounded); REF: rule a */
} gx_node_t;

typedef struct { uint32_t w[8]; } gx_class_t;  /* 256-bit byte set */

static inline void gx_class_set(gx_class_t *c, unsigned b) { c->w[b >> 5] |= 1u << (b & 31); }
static inline bool gx_class_has(const gx_class_t *c, unsigned b) { return (c->w[b >> 5] >> (b & 31)) & 1u; }

struct prism_grammar_builder {
    prism_grammar_limits_t lim;
    gx_node_t *nodes;   size_t n_nodes, cap_nodes;
    int32_t *kids;      size_t n_kids, cap_kids;
    uint8_t *bytes;     size_t n_bytes, cap_bytes;
    gx_class_t *classes; size_t n_classes, cap_classes;
    int32_t *rules;     size_t n_rules, cap_rules;  /* body expr per rule; -1 until set */
    int err;
    char err_path[128];
    char err_msg[256];
    /* what compiling has spent (gram_compile.c): work units (about one memory word touched each),
     * scratch bytes held now, and the monotonic deadline */
    struct { uint64_t work, next_clock, deadline_ns; size_t bytes; } spent;
    /* cached shared rules (JSON string, number, any value) per syntax flavour */
    int32_t rule_json_string, rule_json_any[2], rule_json_object_any[2];
};

int32_t gx_new(prism_grammar_builder_t *b, gx_kind_t k, int32_t a, int32_t bb, int32_t c);
int32_t gx_class(prism_grammar_builder_t *b, const gx_class_t *c);
int32_t gx_byte_range(prism_grammar_builder_t *b, unsigned lo, unsigned hi);
int32_t gx_seq2(prism_grammar_builder_t *b, int32_t x, int32_t y);
int32_t gx_seq3(prism_grammar_builder_t *b, int32_t x, int32_t y, int32_t z);
int32_t gx_alt2(prism_grammar_builder_t *b, int32_t x, int32_t y);
int32_t gx_opt(prism_grammar_builder_t *b, int32_t x);
int32_t gx_empty(prism_grammar_builder_t *b);
int32_t gx_lit(prism_grammar_builder_t *b, const char *s);
int32_t gx_rule_new(prism_grammar_builder_t *b);
int32_t gx_rule_set(prism_grammar_builder_t *b, int32_t rule, int32_t body);
int32_t gx_ref(prism_grammar_builder_t *b, int32_t rule);
/* UTF-8 encodings of the code points [lo, hi] (surrogates excluded) as an expression. */
int32_t gx_utf8_range(prism_grammar_builder_t *b, uint32_t lo, uint32_t hi);
int gram_fail(prism_grammar_builder_t *b, int code, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* regex -> expression; json_escape: the text lands inside a JSON string, so '"', '\\' and
 * control characters are produced in escaped form. */
int32_t gram_regex_expr(prism_grammar_builder_t *b, const char *re, size_t n, bool json_escape,
                        const char *path_prefix);

/* ---- compiled grammar ---- */
typedef struct { uint8_t lo, hi; int32_t to; } gram_range_t;
typedef struct { int32_t rule, ret; } gram_call_t;

/* A state of a rule's automaton. Rules are DFAs (edges: disjoint byte ranges, at most one call per
 * callee), except a rule whose subset construction ran past its budget, which stays an NFA
 * (gram_compile.c): its "jump" states have only eps (the leaves of their epsilon closure, each a
 * state with one edge or the final flag, never a jump), which a matcher follows as it steps, so
 * the stack set simulates the NFA. */
typedef struct {
    uint32_t range_off, call_off, eps_off, n_eps;
    uint16_t n_ranges, n_calls;
    uint8_t  final;
} gram_state_t;

/* One cache entry per DFA state: tokens accepted from this state whatever lies below it on
 * the stack, and the uncertain ones (which leave the rule with bytes left). Tokens are named
 * by their index in the vocabulary's sorted order. */
typedef enum { GRAM_ACC_LIST, GRAM_ACC_ALL_BUT, GRAM_ACC_BITMASK } gram_acc_kind_t;
typedef struct {
    uint8_t  acc_kind;
    uint32_t n_acc;          /* ids in acc (LIST / ALL_BUT), unused for BITMASK */
    int32_t *acc;            /* token ids (LIST, ALL_BUT) or mask words (BITMASK) */
    uint32_t n_unc;
    int32_t *unc;            /* sorted-order indices of uncertain tokens, ascending */
    uint16_t *unc_lcp;       /* lcp of unc[i] with unc[i-1] (0 for i = 0) */
    uint16_t max_push;       /* most frames any token pushed above this state during the fill */
} gram_cache_entry_t;

struct prism_grammar {
    atomic_int refs;
    const prism_grammar_vocab_t *vocab;
    prism_grammar_limits_t lim;
    gram_state_t *states;  size_t n_states;
    gram_range_t *ranges;  size_t n_ranges;
    gram_call_t  *calls;   size_t n_calls;
    int32_t      *eps;     size_t n_eps;   /* epsilon targets of NFA rules' jump states */
    int32_t *rule_start;   size_t n_rules;
    int32_t root_rule;
    _Atomic(gram_cache_entry_t *) *cache;  /* [n_states] */
    pthread_mutex_t cache_lock;
    struct gram_ctx *cache_ctx;            /* scratch for cache fills, under cache_lock */
    int32_t *cache_mask;                   /* [mask words] scratch, under cache_lock */
    size_t cache_bytes;
};

int gram_compile(prism_grammar_builder_t *b, int32_t root, const prism_grammar_vocab_t *v, prism_grammar_t **out);
/* Frees what gram_compile made (the tables and g); the mask cache is the matcher's (gram_match.c). */
void gram_tables_free(prism_grammar_t *g);

/* ---- vocabulary ---- */
struct prism_grammar_vocab {
    size_t n_vocab;          /* mask width */
    size_t n_tokens;         /* tokenizer tokens */
    size_t mask_words;
    uint8_t *data;           /* all token bytes */
    uint32_t *off;           /* [n_tokens + 1] */
    /* tokens usable by grammars (non-special, non-empty), sorted by bytes */
    size_t n_sorted;
    int32_t *sorted;         /* [n_sorted] token ids */
    uint16_t *lcp;           /* [n_sorted] lcp with the previous (0 for the first) */
    uint8_t *sdata;          /* token bytes again, in sorted order: walks read them sequentially */
    uint32_t *soff;          /* [n_sorted + 1] */
    uint32_t first_start[257]; /* sorted range of tokens whose first byte is b: [first_start[b], first_start[b+1]) */
    uint32_t max_len;
    int32_t *eos;            size_t n_eos;
    bool *is_eos;            /* [n_tokens] */
    bool *usable;            /* [n_tokens] */
    int32_t *usable_mask;    /* [mask_words] bits of the usable tokens */
};

static inline const uint8_t *gram_tok_bytes(const prism_grammar_vocab_t *v, int32_t id, uint32_t *len)
{
    *len = v->off[id + 1] - v->off[id];
    return v->data + v->off[id];
}

static inline const uint8_t *gram_sorted_bytes(const prism_grammar_vocab_t *v, uint32_t j, uint32_t *len)
{
    *len = v->soff[j + 1] - v->soff[j];
    return v->sdata + v->soff[j];
}

/* ---- stack pool and stepping (shared by matchers and cache fills) ---- */
#define GRAM_PARENT_ROOT    (-1)   /* bottom of the stack: popping it ends the grammar */
#define GRAM_PARENT_UNKNOWN (-2)   /* cache fills: context below is unknown */

typedef struct { int32_t state, parent; uint16_t depth; int32_t next; } gram_node_t;

typedef struct gram_ctx {
    const prism_grammar_t *g;
    int max_depth, max_stacks;
    gram_node_t *nodes;  int32_t n_nodes, cap_nodes;
    int32_t *bucket;     uint32_t bucket_mask;
    uint32_t *visit;     uint32_t gen;
    /* level sets for token walks: set d lives at lvl[lvl_off[d] .. lvl_off[d] + lvl_n[d]) */
    int32_t *lvl;        int32_t cap_lvl;
    int32_t *lvl_off, *lvl_n, *lvl_mark;     /* [max_len + 2] */
    uint8_t *lvl_end, *lvl_esc, *lvl_esc_any; /* can end / escaped to unknown after d bytes / at any d' <= d */
    int32_t max_len;
    int32_t k;           /* levels 0..k are valid for the current walk */
    bool overflow;       /* a limit pruned a path (pool, stacks, depth) */
    uint64_t work;       /* stack nodes stepped and visited so far (the mask budget counts it) */
    int max_depth_seen;  /* deepest node made since the last reset of this counter */
} gram_ctx_t;

int  gram_ctx_init(gram_ctx_t *c, const prism_grammar_t *g, int max_nodes, int max_stacks, int max_depth,
                   int max_len);
void gram_ctx_free(gram_ctx_t *c);
int32_t gram_node_get(gram_ctx_t *c, int32_t state, int32_t parent);   /* -1: pool full */
void gram_ctx_truncate(gram_ctx_t *c, int32_t n_nodes);
/* Closure of the set {node}: appends stack tops with byte edges to out (deduped by the current
 * generation), sets *end when the root is popped, *esc when the unknown parent is popped. */
void gram_closure(gram_ctx_t *c, int32_t node, int32_t *out, int32_t *n_out, int cap, bool *end, bool *esc);
/* One byte from set in[0..n) into out; returns the new count. */
int  gram_step(gram_ctx_t *c, const int32_t *in, int n, uint8_t byte, int32_t *out, int cap, bool *end, bool *esc);
/* The state's cache entry, filled now if it is not yet. A fill stops (PRISM_ELIMIT, nothing
 * cached) once it has done more than budget work; *work (may be NULL) gets what it did. */
int gram_cache_get(prism_grammar_t *g, int32_t state, uint64_t budget, uint64_t *work, gram_cache_entry_t **out);

#endif
