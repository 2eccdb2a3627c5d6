/* Internal structures of the tokenizer library (not part of the public API).
 *
 * Pipeline, mirroring HF tokenizers' Tokenizer::encode:
 *   text -> split on non-normalized added tokens -> normalizer per text piece -> split on
 *   normalized added tokens -> pre-tokenizer (pieces) -> BPE per piece -> post-processor.
 * Every string the pipeline creates lives in one per-call arena and pieces refer to it by
 * offset, so a call makes a handful of allocations regardless of input size.
 */
#ifndef PRISM_TOK_INTERNAL_H
#define PRISM_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/utf8.h"
#include "tokenizer/tokenizer.h"

/* ---- limits on tokenizer.json contents ---- */
#define PRISM_TOK_MAX_JSON_BYTES   ((size_t)64 << 20)
#define PRISM_TOK_MAX_TEXT_BYTES   ((size_t)8 << 20)
#define PRISM_TOK_MAX_VOCAB        (1u << 22)     /* ids must be below this */
#define PRISM_TOK_MAX_MERGES       (1u << 23)
#define PRISM_TOK_MAX_TOKEN_BYTES  16384u
#define PRISM_TOK_MAX_ADDED        (1u << 20)
#define PRISM_TOK_MAX_DEPTH        8              /* nesting of Sequence components */
#define PRISM_TOK_MAX_SEQ_ITEMS    64
#define PRISM_TOK_MAX_PATTERN      65536          /* regex source bytes */
#define PRISM_TOK_MAX_PP_IDS       64             /* ids a post-processor may add */
/* A stream that keeps ending in U+FFFD for this many tokens is emitted anyway: an incomplete
 * UTF-8 sequence spans at most 4 byte tokens, so such text is final. Keeps push O(1). */
#define PRISM_TOK_DETOK_MAX_PENDING 32

/* ---- generated Unicode tables (tok_unicode_tables.c) ---- */
typedef struct { uint32_t lo, hi; uint8_t ccc; } prism_tok_ccc_range_t;
typedef struct { uint32_t cp, d0, d1; } prism_tok_decomp_t;   /* d1 == 0: singleton */
typedef struct { uint32_t a, b, c; } prism_tok_comp_t;        /* sorted by (a, b) */
typedef struct { uint32_t lo, hi; } prism_tok_range_t;
extern const prism_tok_ccc_range_t prism_tok_ccc_ranges[];
extern const size_t prism_tok_ccc_ranges_n;
extern const prism_tok_decomp_t prism_tok_decomps[];
extern const size_t prism_tok_decomps_n;
extern const prism_tok_comp_t prism_tok_comps[];
extern const size_t prism_tok_comps_n;
extern const prism_tok_range_t prism_tok_extra_letter[];
extern const size_t prism_tok_extra_letter_n;
extern const prism_tok_range_t prism_tok_extra_number[];
extern const size_t prism_tok_extra_number_n;
extern const prism_tok_range_t prism_tok_white_space[];
extern const size_t prism_tok_white_space_n;

/* ---- unicode helpers (tok_unicode.c; UTF-8 itself is core/utf8.h) ---- */
bool prism_tok_is_white_space(uint32_t cp);                   /* Rust char::is_whitespace */
bool prism_tok_is_alnum(uint32_t cp);                         /* Rust char::is_alphanumeric */
/* NFC / NFD of s appended to out; *changed=false (and nothing appended) when s is already
 * normalized, which is the common case and costs one scan. */
int prism_tok_nfc(const char *s, size_t n, bool compose, prism_buf_t *out, bool *changed);
/* Rewrites an HF (Oniguruma) regex into PCRE2 syntax with HF's Unicode semantics:
 * \p{L}/\p{N} gain the code points HF's newer tables know, \s becomes HF's White_Space set and
 * (?i:...) folds ASCII letters only (what HF's engine does for the contraction patterns). */
int prism_tok_regex_rewrite(const char *pat, size_t n, prism_buf_t *out, char *err, size_t errlen);

/* ---- patterns (Split / Replace): a literal or a compiled regex ---- */
typedef struct {
    char *lit;          /* literal bytes when re == NULL */
    size_t lit_len;
    pcre2_code *re;
} prism_tok_pattern_t;

/* One match event list entry: HF's find_matches output. */
typedef struct { uint32_t s, e; bool is_match; } prism_tok_span_t;

/* ---- components ---- */
typedef enum {
    PRISM_TOK_NORM_NFC, PRISM_TOK_NORM_NFD, PRISM_TOK_NORM_PREPEND, PRISM_TOK_NORM_REPLACE,
    PRISM_TOK_NORM_STRIP, PRISM_TOK_NORM_SEQUENCE,
} prism_tok_norm_type_t;

typedef struct prism_tok_norm {
    prism_tok_norm_type_t type;
    char *str;                      /* PREPEND text / REPLACE content */
    size_t str_len;
    prism_tok_pattern_t pat;        /* REPLACE */
    bool left, right;               /* STRIP */
    struct prism_tok_norm *items;   /* SEQUENCE: [n_items] */
    size_t n_items;
} prism_tok_norm_t;

typedef enum {
    PRISM_TOK_SPLIT_REMOVED, PRISM_TOK_SPLIT_ISOLATED, PRISM_TOK_SPLIT_MERGED_PREV,
    PRISM_TOK_SPLIT_MERGED_NEXT, PRISM_TOK_SPLIT_CONTIGUOUS,
} prism_tok_split_behavior_t;

typedef enum {
    PRISM_TOK_PRE_BYTELEVEL, PRISM_TOK_PRE_SPLIT, PRISM_TOK_PRE_METASPACE, PRISM_TOK_PRE_DIGITS,
    PRISM_TOK_PRE_WHITESPACE_SPLIT, PRISM_TOK_PRE_SEQUENCE,
} prism_tok_pre_type_t;

typedef enum { PRISM_TOK_PREPEND_ALWAYS, PRISM_TOK_PREPEND_FIRST, PRISM_TOK_PREPEND_NEVER } prism_tok_prepend_t;

typedef struct prism_tok_pre {
    prism_tok_pre_type_t type;
    bool add_prefix_space;          /* BYTELEVEL */
    bool use_regex;                 /* BYTELEVEL: split with the GPT-2 pattern first */
    prism_tok_pattern_t pat;        /* SPLIT, DIGITS, WHITESPACE_SPLIT, BYTELEVEL(use_regex) */
    prism_tok_split_behavior_t behavior;
    bool invert;
    char repl[5];                   /* METASPACE replacement char, UTF-8 */
    int repl_len;
    prism_tok_prepend_t prepend;    /* METASPACE */
    bool split;                     /* METASPACE */
    struct prism_tok_pre *items;    /* SEQUENCE: [n_items] */
    size_t n_items;
} prism_tok_pre_t;

typedef enum {
    PRISM_TOK_DEC_BYTELEVEL, PRISM_TOK_DEC_METASPACE, PRISM_TOK_DEC_BYTEFALLBACK, PRISM_TOK_DEC_FUSE,
    PRISM_TOK_DEC_STRIP, PRISM_TOK_DEC_REPLACE, PRISM_TOK_DEC_SEQUENCE,
} prism_tok_dec_type_t;

typedef struct prism_tok_dec {
    prism_tok_dec_type_t type;
    char repl[5];                   /* METASPACE replacement / STRIP content char, UTF-8 */
    int repl_len;
    prism_tok_prepend_t prepend;    /* METASPACE */
    size_t start, stop;             /* STRIP */
    prism_tok_pattern_t pat;        /* REPLACE */
    char *str;                      /* REPLACE content */
    size_t str_len;
    struct prism_tok_dec *items;    /* SEQUENCE: [n_items] */
    size_t n_items;
} prism_tok_dec_t;

/* ---- hash maps ---- */
/* string -> int32 over a shared string pool (strings referenced by offset). */
typedef struct { uint32_t off, len; int32_t val; uint32_t h; } prism_tok_sslot_t;
typedef struct {
    prism_tok_sslot_t *slots;       /* [mask + 1]; len == UINT32_MAX marks empty */
    size_t mask, n;
} prism_tok_smap_t;

typedef struct { uint64_t key; uint32_t rank; int32_t new_id; } prism_tok_mslot_t;

typedef struct {
    uint32_t off, len;              /* content in pool */
    uint32_t noff, nlen;            /* normalized content (== content if not normalized) */
    int32_t id;
    bool single_word, lstrip, rstrip, normalized, special;
} prism_tok_added_t;

/* Leftmost-longest matcher over a set of added tokens: candidates bucketed by first byte,
 * longest first. Added-token sets are small (hundreds), so this beats a full automaton. */
typedef struct {
    uint32_t *order;                /* [n] indices into added[], grouped by first byte */
    uint32_t start[257];            /* bucket b is order[start[b] .. start[b+1]) */
    size_t n;
} prism_tok_matcher_t;

struct prism_tokenizer {
    char *pool;                     /* [pool_len] NUL-terminated strings: vocab, added, misc */
    size_t pool_len, pool_cap;

    size_t vocab_size;              /* max id + 1 over model and added tokens */
    uint32_t *id_off;               /* [vocab_size] pool offset of id_to_token(id) */
    uint32_t *id_len;               /* [vocab_size] byte length; UINT32_MAX when the id has no token */
    uint8_t *is_special;            /* [vocab_size] */

    /* BPE model */
    prism_tok_smap_t vocab;         /* model vocab: token -> id */
    prism_tok_mslot_t *merges;      /* [merges_mask + 1]; key UINT64_MAX marks empty */
    size_t merges_mask, n_merges;
    int32_t char_id[0x800];         /* id of single-char tokens for cp < 0x800 (-1 absent), when no affixes */
    bool char_table;
    int32_t byte_id[256];           /* <0xNN> ids for byte_fallback (-1 absent) */
    bool byte_fallback, fuse_unk, ignore_merges;
    int32_t unk_id;                 /* -1: none */
    bool unk_missing;               /* unk_token named but not in vocab: encode fails like HF */
    char *cont_prefix, *eow_suffix; /* NULL when absent or empty */
    size_t cont_prefix_len, eow_suffix_len;

    /* added tokens */
    prism_tok_added_t *added;       /* [n_added] */
    size_t n_added;
    prism_tok_smap_t added_map;     /* content -> index into added[] */
    prism_tok_matcher_t match_raw, match_norm;

    prism_tok_norm_t *normalizer;   /* NULL when absent */
    prism_tok_pre_t *pre;
    prism_tok_dec_t *decoder;
    int32_t pp_prefix[PRISM_TOK_MAX_PP_IDS], pp_suffix[PRISM_TOK_MAX_PP_IDS];
    size_t n_pp_prefix, n_pp_suffix;

    bool dec_bytelevel;             /* decoder chain contains ByteLevel (token_bytes) */
    bool dec_bytefallback;
};

/* ---- shared helpers ---- */
static inline const char *prism_tok_str(const prism_tokenizer_t *t, uint32_t off) { return t->pool + off; }
int32_t prism_tok_smap_get(const prism_tok_smap_t *m, const char *pool, const char *s, size_t n);
int32_t prism_tok_vocab_get(const prism_tokenizer_t *t, const char *s, size_t n);
/* Onig find_iter semantics; subject is valid UTF-8. Returns true with [*ms, *me) on a match
 * (tok_unicode.c). */
bool prism_tok_pattern_find(const prism_tok_pattern_t *p, pcre2_match_data *md, const char *s,
                            size_t n, size_t from, size_t *ms, size_t *me);
/* Byte-level alphabet: byte -> code point and back (-1 if cp is not in the alphabet). */
extern uint16_t prism_tok_byte_cp[256];
extern int16_t prism_tok_cp_byte[512];
void prism_tok_bytelevel_init(void);

/* Applies normalizer n to s, appending the result to out (tok_normalize.c). */
int prism_tok_normalize(const prism_tokenizer_t *t, const prism_tok_norm_t *n, const char *s, size_t len,
                        prism_buf_t *out, pcre2_match_data *md);

/* decoders */
int prism_tok_decode_tokens(const prism_tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                            prism_buf_t *out);

void prism_tok_pattern_free(prism_tok_pattern_t *p);
void prism_tok_norm_free(prism_tok_norm_t *n);
void prism_tok_pre_free(prism_tok_pre_t *p);
void prism_tok_dec_free(prism_tok_dec_t *d);

/* Replaces every match of pat in s[0..n) by with, appending to out (tok_unicode.c). */
int prism_tok_replace_all(const prism_tok_pattern_t *pat, pcre2_match_data *md, const char *s, size_t n,
                          const char *with, size_t wl, prism_buf_t *out);

#endif
