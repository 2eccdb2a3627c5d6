/* grammar: grammar-constrained decoding. Compiles JSON Schema, regular expressions, choice lists
 * and tool-call formats into a byte-level context-free grammar, and matches it against a
 * tokenizer's vocabulary to give, per decode step, the set of tokens that keep the output inside
 * the grammar (a bitmask of int32 words, bit i of word i/32 = token i allowed).
 *
 * Why our own engine (docs/STRUCTURED_OUTPUT.md has the survey): llguidance's and xgrammar's PyPI
 * packages ship CPython extensions only (no header, no standalone library; llguidance's exported
 * C symbols need libpython at load time, xgrammar exposes C++/TVM-FFI objects only).
 *
 * Design (after xgrammar and llguidance):
 *  - Each grammar rule is compiled to a DFA over bytes whose edges are byte ranges or calls to
 *    other rules (a recursive transition network). A matcher state is a small set of stacks,
 *    kept as hash-consed nodes of a persistent stack tree in a pre-sized per-matcher pool.
 *  - The vocabulary is sorted by token bytes once per tokenizer (a token trie in array form,
 *    with longest-common-prefix lengths), so a walk over all tokens shares work on common
 *    prefixes.
 *  - Token masks are cached per DFA state, independent of the stack below it: for each state,
 *    the tokens accepted without leaving the rule, and the few "uncertain" tokens that leave it
 *    with bytes still to consume. Per step only the uncertain tokens are checked against the
 *    real stack. The cache is filled lazily (or eagerly with prism_grammar_warm) and shared by
 *    every matcher of the grammar.
 *
 * Ownership and threads:
 *  - prism_grammar_vocab_t: immutable after creation; shared by any number of grammars and
 *    threads; must outlive every grammar compiled against it.
 *  - prism_grammar_t: reference counted (retain/release; creation returns one reference). Its
 *    mask cache is filled under an internal lock, so grammars may be shared across threads.
 *  - prism_grammar_matcher_t: one per sequence; holds a reference to its grammar. Not locked:
 *    calls on one matcher must not overlap, but different matchers run concurrently, so the
 *    mask for step n+1 can be computed on another thread while the forward pass runs.
 *    After creation a matcher allocates nothing: its node pool, stack sets and history are
 *    pre-sized from prism_grammar_limits_t; running out is a typed error, not a crash.
 *
 * Usage:
 *   prism_grammar_vocab_t *v; prism_grammar_t *g; prism_grammar_matcher_t *m;
 *   prism_grammar_error_t err;
 *   prism_grammar_vocab_create(tok, eos_ids, n_eos, 0, &v);
 *   if (prism_grammar_compile_json_schema(v, schema, len, NULL, &g, &err) < 0)
 *       reply_400(err.path, err.message);
 *   prism_grammar_matcher_create(g, NULL, &m);
 *   int32_t *mask = ...prism_grammar_mask_words(v) words...;
 *   loop: prism_grammar_matcher_fill_mask(m, mask); prism_grammar_apply_mask(logits, mask, n);
 *         tok = sample(); prism_grammar_matcher_accept_token(m, tok);
 *         if (prism_grammar_matcher_is_terminated(m)) break;
 *   prism_grammar_matcher_free(m); prism_grammar_release(g); prism_grammar_vocab_free(v);
 */
#ifndef PRISM_GRAMMAR_H
#define PRISM_GRAMMAR_H

#include "core/core.h"

typedef struct prism_tokenizer prism_tokenizer_t;
typedef struct prism_grammar_vocab prism_grammar_vocab_t;
typedef struct prism_grammar prism_grammar_t;
typedef struct prism_grammar_matcher prism_grammar_matcher_t;
typedef struct prism_grammar_builder prism_grammar_builder_t;

/* ---- errors ----
 * Compilation failures return a negative prism_status_t and fill this struct: PRISM_EINVAL for
 * malformed input, PRISM_ENOTSUP for a valid keyword or construct we do not implement,
 * PRISM_ELIMIT for input over a bound. `path` is a JSON pointer into the schema ("#/properties/
 * age/type") or a byte offset into a regex ("@12"); the router puts it in the 400 message. */
typedef struct {
    int  code;
    char path[128];
    char message[256];
} prism_grammar_error_t;

/* ---- limits (0 in a field = the default in brackets) ---- */
typedef struct {
    int max_schema_bytes;    /* JSON schema / regex / choice text bytes [256 KiB] */
    int max_schema_depth;    /* nesting of schema objects [32] */
    int max_schema_nodes;    /* sub-schemas visited, $ref expansions included [4096] */
    int max_expansion;       /* largest bounded repetition unrolled (maxItems, {n,m}) [256] */
    int max_states;          /* DFA states of the compiled grammar [200000] */
    int max_stack_depth;     /* rule frames on one stack: bounds recursion at run time [128] */
    int max_stacks;          /* parallel stacks in one matcher state [256] */
    int max_nodes;           /* per-matcher persistent stack node pool [4096] */
    int max_rollback;        /* tokens a matcher can roll back [16] */
    /* Compiling one grammar: the compiling thread's CPU time [1000 ms] and the compiler's memory [256 MiB]
     * (PRISM_ELIMIT past either). A rule whose determinization costs more than a small multiple
     * of its NFA is not determinized (it is matched as an NFA), so `(a|b)*a(a|b){k}` compiles in
     * time linear in k; these budgets bound what remains. */
    int max_compile_ms;
    int max_compile_bytes;
    /* Work one mask may take (stack nodes stepped, cache fills included) [32 Mi, about 0.3 s]:
     * past it fill_mask returns PRISM_ELIMIT. The grammars of the tests take at most 6.6 Mi in
     * one mask; 256 parallel stacks each needing a fresh cache fill would take seconds. */
    int max_mask_work;
} prism_grammar_limits_t;

/* ---- JSON options ---- */
typedef struct {
    /* Whitespace allowed between JSON tokens. 0 (default): none except one optional space after
     * ':' and ','. N > 0: up to N of [ \t\n] at every place JSON allows whitespace. Bounded so a
     * model cannot loop on whitespace forever. */
    int max_whitespace;
    bool pythonic;           /* literals as Python: True/False/None (tool-call arguments) */
} prism_grammar_json_opts_t;
/* Schema semantics worth knowing (docs/STRUCTURED_OUTPUT.md has the full list): keys not in
 * "properties" only when "additionalProperties" is true or a schema (absent = false, as
 * xgrammar's strict mode); properties in declared order; unsupported keywords are PRISM_ENOTSUP. */

/* ---- vocabulary: built once per tokenizer ----
 * Token bytes come from prism_tokenizer_token_bytes. Special tokens are never allowed by a
 * grammar; eos_ids (at least one) are allowed exactly where the grammar can end. n_vocab_model is
 * the model's logits width (>= tokenizer vocab; 0 = the tokenizer's); ids past the tokenizer's
 * vocab are never allowed. */
int  prism_grammar_vocab_create(const prism_tokenizer_t *tok, const int32_t *eos_ids, size_t n_eos,
                                size_t n_vocab_model, prism_grammar_vocab_t **out);
/* Same from explicit byte strings (tests, other tokenizers): bytes of token i are
 * data[off[i] .. off[i+1]); special[i] may be NULL. */
int  prism_grammar_vocab_create_from_bytes(const uint8_t *data, const uint32_t *off, size_t n_tokens,
                                           const bool *special, const int32_t *eos_ids, size_t n_eos,
                                           size_t n_vocab_model, prism_grammar_vocab_t **out);
void prism_grammar_vocab_free(prism_grammar_vocab_t *v);
size_t prism_grammar_vocab_size(const prism_grammar_vocab_t *v);   /* mask width in tokens */
size_t prism_grammar_mask_words(const prism_grammar_vocab_t *v);   /* int32 words in a mask */

/* ---- compiling ----
 * limits and opts may be NULL (defaults). On success *out holds one reference. */
int prism_grammar_compile_json_schema(const prism_grammar_vocab_t *v, const char *schema, size_t len,
                                      const prism_grammar_json_opts_t *opts,
                                      const prism_grammar_limits_t *limits, prism_grammar_t **out,
                                      prism_grammar_error_t *err);
/* response_format {"type": "json_object"}: any JSON object. */
int prism_grammar_compile_json_object(const prism_grammar_vocab_t *v, const prism_grammar_json_opts_t *opts,
                                      const prism_grammar_limits_t *limits, prism_grammar_t **out,
                                      prism_grammar_error_t *err);
/* vLLM guided_regex: the whole output matches (Python re syntax: literals, escapes \d\w\s\D\W\S
 * \xHH \uHHHH, classes, ., groups, (?:), |, * + ? {n} {n,} {n,m} and lazy forms, ^ and $ at the
 * ends). Back-references and look-around are PRISM_ENOTSUP. */
int prism_grammar_compile_regex(const prism_grammar_vocab_t *v, const char *regex, size_t len,
                                const prism_grammar_limits_t *limits, prism_grammar_t **out,
                                prism_grammar_error_t *err);
/* vLLM guided_choice: the output is exactly one of the n strings. */
int prism_grammar_compile_choice(const prism_grammar_vocab_t *v, const char *const *choices, const size_t *lens,
                                 size_t n, const prism_grammar_limits_t *limits, prism_grammar_t **out,
                                 prism_grammar_error_t *err);

void prism_grammar_retain(prism_grammar_t *g);
void prism_grammar_release(prism_grammar_t *g);
/* Fills the mask cache of every state now (compile-time cost instead of first-use cost). */
int  prism_grammar_warm(prism_grammar_t *g);
size_t prism_grammar_n_states(const prism_grammar_t *g);
const prism_grammar_vocab_t *prism_grammar_vocab(const prism_grammar_t *g);
/* Whether bytes[0..n) is a complete sentence of the grammar (no tokenizer involved; tests). */
bool prism_grammar_accepts_bytes(const prism_grammar_t *g, const uint8_t *bytes, size_t n);

/* ---- builder: composing grammars (tool-call formats, prefixes around a schema) ----
 * Expression handles are >= 0; every constructor returns a negative status once the builder
 * has an error (sticky: the first error is kept), so calls can be chained and checked once at
 * prism_grammar_builder_finish. */
typedef int32_t prism_gexpr_t;
prism_grammar_builder_t *prism_grammar_builder_create(const prism_grammar_limits_t *limits);
void prism_grammar_builder_free(prism_grammar_builder_t *b);
prism_gexpr_t prism_gexpr_literal(prism_grammar_builder_t *b, const char *s, size_t n);
prism_gexpr_t prism_gexpr_seq(prism_grammar_builder_t *b, const prism_gexpr_t *items, size_t n);
prism_gexpr_t prism_gexpr_alt(prism_grammar_builder_t *b, const prism_gexpr_t *items, size_t n);
prism_gexpr_t prism_gexpr_repeat(prism_grammar_builder_t *b, prism_gexpr_t e, int min, int max); /* max -1: unbounded */
prism_gexpr_t prism_gexpr_regex(prism_grammar_builder_t *b, const char *re, size_t n);
/* e as a rule of its own, referenced by a call: an expression used in many places is then held
 * once by the automaton (and its states share one mask cache). */
prism_gexpr_t prism_gexpr_shared(prism_grammar_builder_t *b, prism_gexpr_t e);
/* A JSON value valid against the schema; err_path_prefix is prepended to error paths
 * (e.g. "tools[2].function.parameters"). */
prism_gexpr_t prism_gexpr_json_schema(prism_grammar_builder_t *b, const char *schema, size_t n,
                                      const prism_grammar_json_opts_t *opts, const char *err_path_prefix);
prism_gexpr_t prism_gexpr_json_string_literal(prism_grammar_builder_t *b, const char *s, size_t n); /* "s" escaped */
/* Any JSON value (or, with pythonic opts, any Python literal of the same shapes). */
prism_gexpr_t prism_gexpr_json_any(prism_grammar_builder_t *b, const prism_grammar_json_opts_t *opts);
/* Sets the error by hand (callers that validate their own input). Returns code. */
int  prism_grammar_builder_fail(prism_grammar_builder_t *b, int code, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Compiles root; consumes nothing (free the builder after). */
int  prism_grammar_builder_finish(prism_grammar_builder_t *b, prism_gexpr_t root, const prism_grammar_vocab_t *v,
                                  prism_grammar_t **out, prism_grammar_error_t *err);

/* ---- matching ---- */
int  prism_grammar_matcher_create(prism_grammar_t *g, const prism_grammar_limits_t *limits,
                                  prism_grammar_matcher_t **out);
void prism_grammar_matcher_free(prism_grammar_matcher_t *m);
/* Writes prism_grammar_mask_words(v) words. Returns the number of allowed tokens (EOS included)
 * or a negative status (PRISM_ELIMIT past limits.max_mask_work). 0 allowed means the matcher is stuck (a run-time limit pruned every
 * path); the caller ends the sequence. Allocates nothing, except that the first time any
 * matcher of the grammar reaches a state, that state's cache entry is filled (under the
 * grammar's lock); prism_grammar_warm does all of them up front. */
int  prism_grammar_matcher_fill_mask(prism_grammar_matcher_t *m, int32_t *mask);
/* Advances by one sampled token. PRISM_EINVAL (state unchanged) when the token is not allowed;
 * an EOS id is accepted only where the grammar can end and terminates the matcher. */
int  prism_grammar_matcher_accept_token(prism_grammar_matcher_t *m, int32_t token);
/* Advances by raw bytes (forced text, jump-forward); same rules, no EOS. */
int  prism_grammar_matcher_accept_bytes(prism_grammar_matcher_t *m, const uint8_t *bytes, size_t n);
bool prism_grammar_matcher_is_terminated(const prism_grammar_matcher_t *m); /* EOS accepted */
bool prism_grammar_matcher_can_end(const prism_grammar_matcher_t *m);       /* EOS allowed now */
/* Undoes the last n accepted tokens (n <= limits.max_rollback and <= tokens accepted since the
 * last reset); PRISM_EINVAL otherwise. */
int  prism_grammar_matcher_rollback(prism_grammar_matcher_t *m, int n);
void prism_grammar_matcher_reset(prism_grammar_matcher_t *m);
/* Points the matcher at another grammar over the same vocabulary and restarts it, keeping its
 * pre-sized pools (a worker keeps one matcher per sequence slot across requests, so serving a
 * guided request allocates nothing once the slot has been used). Takes a reference to g and
 * drops the old one. PRISM_EINVAL (matcher unchanged) when g has another vocabulary. */
int  prism_grammar_matcher_rebind(prism_grammar_matcher_t *m, prism_grammar_t *g);
/* Bytes the grammar forces next, whatever the model picks (jump-forward decoding): writes up to
 * cap bytes, returns the count (stops before any byte with a choice). */
size_t prism_grammar_matcher_forced_bytes(prism_grammar_matcher_t *m, uint8_t *out, size_t cap);

/* ---- applying a mask (CPU) ---- logits[i] = -inf where bit i is clear, for i < n_vocab. */
void prism_grammar_apply_mask(float *logits, const int32_t *mask, size_t n_vocab);
static inline bool prism_grammar_mask_test(const int32_t *mask, int32_t id)
{
    return ((uint32_t)mask[id >> 5] >> (id & 31)) & 1u;
}

#endif
