/* Internal declarations of the template interpreter: memory pools, lexer tokens, AST, values.
 *
 * Memory: a compiled template owns one pool (AST, decoded literals, normalized source). Each render
 * owns another pool for every value it creates (strings, lists, dicts, scopes) and drops it whole at
 * the end, so values carry no reference counts and error paths need no cleanup. The render pool is
 * capped (PRISM_TEMPLATE_MAX_MEMORY) which bounds templates that build values in loops.
 */
#ifndef PRISM_TPL_INTERNAL_H
#define PRISM_TPL_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "core/core.h"
#include "core/utf8.h"
#include "template/template.h"

/* ------------------------------------------------------------------ pool */
typedef struct tpl_chunk {
    struct tpl_chunk *next;
    size_t cap, used;
    /* data follows, 16-byte aligned */
} tpl_chunk_t;

typedef struct {
    tpl_chunk_t *head;
    size_t total; /* bytes of all chunks */
    size_t cap;   /* 0: unlimited */
    size_t next_chunk;
} tpl_pool_t;

void  tpl_pool_init(tpl_pool_t *p, size_t cap);
void *tpl_pool_alloc(tpl_pool_t *p, size_t n); /* 16-aligned; NULL when over cap or OOM */
char *tpl_pool_strndup(tpl_pool_t *p, const char *s, size_t n);
void  tpl_pool_free(tpl_pool_t *p);

/* ------------------------------------------------------------------ unicode helpers */
/* UTF-8 itself is core/utf8.h (templates and their values are always valid UTF-8). */
bool   tpl_py_isspace(uint32_t cp); /* Python str.isspace for one code point */
const char *tpl_memfind(const char *h, size_t hn, const char *needle, size_t nn);

/* ------------------------------------------------------------------ lexer */
typedef enum {
    TK_EOF, TK_DATA, TK_VAR_BEGIN, TK_VAR_END, TK_BLOCK_BEGIN, TK_BLOCK_END,
    TK_NAME, TK_STRING, TK_INT, TK_FLOAT, TK_OP,
} tpl_tk_kind_t;

typedef enum {
    OP_NONE, OP_ADD, OP_SUB, OP_DIV, OP_FLOORDIV, OP_MUL, OP_MOD, OP_POW, OP_TILDE,
    OP_LBRACKET, OP_RBRACKET, OP_LPAREN, OP_RPAREN, OP_LBRACE, OP_RBRACE,
    OP_EQ, OP_NE, OP_GT, OP_GE, OP_LT, OP_LE, OP_ASSIGN, OP_DOT, OP_COLON, OP_PIPE, OP_COMMA, OP_SEMICOLON,
    /* not lexer tokens: operators the AST uses */
    OP_AND, OP_OR, OP_IN, OP_NOTIN,
} tpl_op_t;

typedef struct {
    uint8_t kind; /* tpl_tk_kind_t */
    uint8_t op;   /* tpl_op_t for TK_OP */
    int line;
    const char *s; /* names, data and decoded strings (pool-owned, NUL-terminated) */
    size_t n;
    int64_t i;
    double f;
} tpl_token_t;

typedef struct {
    tpl_token_t *v; /* [n] */
    size_t n, cap;
} tpl_tokens_t;

/* Tokenizes src (already newline-normalized by the caller). Status + message on failure. */
int tpl_lex(tpl_pool_t *pool, const char *src, size_t len, tpl_tokens_t *out, char *err, size_t errlen);

/* ------------------------------------------------------------------ values */
typedef enum {
    TV_MISSING, /* internal: an argument that was not passed */
    TV_UNDEF, TV_NONE, TV_BOOL, TV_INT, TV_FLOAT, TV_STR,
    TV_OBJ,     /* list / tuple / iterator / dict / namespace / callable / loop */
} tv_kind_t;

typedef struct tobj tobj_t;

typedef struct {
    uint8_t t;
    union {
        int64_t i;
        double f;
        struct { const char *p; size_t n; } s;
        tobj_t *o;
        const char *uname; /* TV_UNDEF: the name that was missing (may be NULL) */
    } u;
} tv_t;

typedef enum { OBJ_LIST, OBJ_DICT, OBJ_NS, OBJ_FUNC, OBJ_LOOP } tobj_kind_t;
/* OBJ_LIST flavours: what Python type the sequence stands for (matters for repr, len, truthiness). */
typedef enum { SEQ_LIST, SEQ_TUPLE, SEQ_ITER, SEQ_RANGE } tseq_t;

struct tpl_node;
struct tpl_scope;

struct tobj {
    uint8_t kind; /* tobj_kind_t */
    uint8_t sub;  /* tseq_t for lists; func kind for callables */
    size_t len, cap;
    tv_t *items; /* [cap] list items or dict keys */
    tv_t *vals;  /* [cap] dict / namespace values */
    size_t pos;  /* SEQ_ITER: items consumed */
    const char *poison; /* SEQ_ITER: error jinja2 would raise when the generator is consumed */
    int64_t r_start, r_stop, r_step; /* SEQ_RANGE, for repr */
    /* OBJ_FUNC */
    int fid;
    tv_t recv;
    const struct tpl_node *macro;
    struct tpl_scope *scope; /* macro / caller: the frame it was defined in (closure) */
    /* OBJ_LOOP */
    int64_t index0, length, depth;
    tobj_t *loop_items;
};

/* ------------------------------------------------------------------ AST */
typedef enum {
    /* expressions */
    E_CONST, E_NAME, E_LIST, E_TUPLE, E_DICT, E_GETATTR, E_GETITEM, E_SLICE, E_CALL, E_FILTER, E_TEST,
    E_NOT, E_NEG, E_POS, E_BIN, E_CMP, E_COND,
    /* statements */
    S_BODY, S_TEXT, S_OUT, S_IF, S_FOR, S_SET, S_SETBLOCK, S_MACRO, S_CALLBLOCK, S_FILTERBLOCK, S_WITH,
    S_BREAK, S_CONTINUE,
} tpl_node_kind_t;

enum { NF_NEGATED = 1, NF_NSATTR = 2, NF_VARARGS = 4, NF_KWARGS = 8, NF_CALLER = 16, NF_TARGET_TUPLE = 32 };

typedef struct tpl_node {
    uint8_t kind;
    uint8_t op;
    uint8_t flags;
    int line;
    int id;              /* filter / test id */
    const char *name;    /* NUL-terminated, pool-owned */
    tv_t val;            /* E_CONST, S_TEXT */
    struct tpl_node *a, *b, *c, *d;
    struct tpl_node **items; int nitems;   /* args, list items, dict keys, body, defaults, cmp operands */
    struct tpl_node **items2; int nitems2; /* kwarg values, dict values */
    const char **names; int nnames;        /* kwarg names, targets, params */
    uint8_t *ops;                          /* E_CMP: [nitems] */
} tpl_node_t;

struct prism_template {
    tpl_pool_t pool;
    char *source;  /* as given, NUL-terminated (pool) */
    size_t source_len;
    tpl_node_t *root; /* S_BODY */
};

int tpl_parse(prism_template_t *t, const tpl_tokens_t *toks, char *err, size_t errlen);

/* ------------------------------------------------------------------ builtins (ids resolved at compile) */
int tpl_filter_lookup(const char *name);  /* >=0 id; -1 unknown */
int tpl_test_lookup(const char *name);
/* Method names a template may call: 1 supported, 0 unknown (left to render time), -1 a Python method
 * of str/list/dict that is not implemented (compile rejects it). */
int tpl_method_status(const char *name);
bool tpl_global_unsupported(const char *name);

/* ------------------------------------------------------------------ render context */
typedef struct {
    char *p;
    size_t n, cap;
} tpl_sb_t;

typedef struct tpl_scope {
    struct tpl_scope *parent;
    const char **names; /* [cap] */
    tv_t *vals;         /* [cap] */
    int n, cap;
} tpl_scope_t;

typedef struct tpl_rctx {
    const prism_template_t *t;
    tpl_pool_t pool;
    tpl_sb_t *sink;
    tpl_scope_t *root;
    int call_depth;
    int eval_depth;    /* tpl_eval + statements on the C stack now */
    uint64_t iterations;
    int status;
    char *err;
    size_t errlen;
    bool fixed_time;
    int64_t fixed_time_s;
    tv_t filter_input; /* value a {% filter %} block feeds its chain */
} tpl_rctx_t;

#define TPL_BREAK 1
#define TPL_CONTINUE 2

/* Records the first error (status + message) and returns the status. */
int tpl_fail(tpl_rctx_t *c, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void *tpl_alloc(tpl_rctx_t *c, size_t n); /* sets ELIMIT on failure */

static inline tv_t tv_undef(const char *name) { tv_t v; v.t = TV_UNDEF; v.u.uname = name; return v; }
static inline tv_t tv_none(void) { tv_t v; v.t = TV_NONE; v.u.i = 0; return v; }
static inline tv_t tv_missing(void) { tv_t v; v.t = TV_MISSING; v.u.i = 0; return v; }
static inline tv_t tv_bool(bool b) { tv_t v; v.t = TV_BOOL; v.u.i = b ? 1 : 0; return v; }
static inline tv_t tv_int(int64_t i) { tv_t v; v.t = TV_INT; v.u.i = i; return v; }
static inline tv_t tv_float(double f) { tv_t v; v.t = TV_FLOAT; v.u.f = f; return v; }
static inline tv_t tv_str(const char *p, size_t n) { tv_t v; v.t = TV_STR; v.u.s.p = p; v.u.s.n = n; return v; }
static inline tv_t tv_obj(tobj_t *o) { tv_t v; v.t = TV_OBJ; v.u.o = o; return v; }
static inline bool tv_is_list(tv_t v) { return v.t == TV_OBJ && v.u.o->kind == OBJ_LIST; }
static inline bool tv_is_dict(tv_t v) { return v.t == TV_OBJ && v.u.o->kind == OBJ_DICT; }
static inline bool tv_is_seq(tv_t v, int sub) { return tv_is_list(v) && v.u.o->sub == sub; }
static inline bool tv_is_num(tv_t v) { return v.t == TV_INT || v.t == TV_FLOAT || v.t == TV_BOOL; }
static inline bool tv_is_intlike(tv_t v) { return v.t == TV_INT || v.t == TV_BOOL; }

/* string builder (render pool) */
int  tpl_sb_reserve(tpl_rctx_t *c, tpl_sb_t *b, size_t extra);
int  tpl_sb_add(tpl_rctx_t *c, tpl_sb_t *b, const char *p, size_t n);
int  tpl_sb_addc(tpl_rctx_t *c, tpl_sb_t *b, char ch);
int  tpl_sb_addf(tpl_rctx_t *c, tpl_sb_t *b, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
tv_t tpl_sb_value(tpl_sb_t *b);

/* containers */
tobj_t *tpl_list_new(tpl_rctx_t *c, int sub, size_t cap);
int     tpl_list_push(tpl_rctx_t *c, tobj_t *l, tv_t v);
tobj_t *tpl_dict_new(tpl_rctx_t *c, int kind, size_t cap);
int     tpl_dict_set(tpl_rctx_t *c, tobj_t *d, tv_t k, tv_t v);
bool    tpl_dict_get(const tobj_t *d, tv_t k, tv_t *out);
bool    tpl_dict_get_str(const tobj_t *d, const char *k, size_t kn, tv_t *out);
tobj_t *tpl_func_new(tpl_rctx_t *c, int sub, int fid);

/* conversions and Python semantics */
int  tpl_from_json(tpl_rctx_t *c, const json_t *j, tv_t *out, int depth);
bool tpl_truthy(tv_t v);
int  tpl_to_str(tpl_rctx_t *c, tv_t v, tv_t *out);             /* Python str() */
int  tpl_write_str(tpl_rctx_t *c, tpl_sb_t *b, tv_t v);          /* str() appended */
int  tpl_write_repr(tpl_rctx_t *c, tpl_sb_t *b, tv_t v, int depth);
void tpl_float_repr(double f, char out[40]);
bool tpl_eq(tv_t a, tv_t b, int depth);
int  tpl_cmp(tpl_rctx_t *c, tv_t a, tv_t b, int *res, int depth);  /* <0 =0 >0, TypeError otherwise */
const char *tpl_type_name(tv_t v);
/* items of an iterable as an array (dict -> keys, str -> chars, undefined -> empty); consumes iterators */
int  tpl_iterate(tpl_rctx_t *c, tv_t v, tobj_t **out);
int  tpl_len(tpl_rctx_t *c, tv_t v, int64_t *out);
typedef struct { bool ensure_ascii; bool sort_keys; bool has_indent; tv_t indent; const char *item_sep, *key_sep;
                 size_t item_sep_n, key_sep_n; } tpl_json_opts_t;
int  tpl_write_json(tpl_rctx_t *c, tpl_sb_t *b, tv_t v, const tpl_json_opts_t *o, int level, int depth);

/* evaluation (tpl_render.c) */
int tpl_eval(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n, tv_t *out);
int tpl_call_value(tpl_rctx_t *c, tpl_scope_t *s, tv_t fn, int nargs, const tv_t *args, int nkw,
                   const char **kwn, const tv_t *kwv, tv_t *out, int line);
int tpl_getattr(tpl_rctx_t *c, tv_t obj, const char *name, size_t nlen, tv_t *out);
int tpl_getitem(tpl_rctx_t *c, tv_t obj, tv_t key, tv_t *out);
int tpl_binop(tpl_rctx_t *c, int op, tv_t a, tv_t b, tv_t *out);
int tpl_format_printf(tpl_rctx_t *c, tv_t fmt, tv_t args, tv_t *out); /* Python's str % args */

/* builtins (tpl_builtins.c) */
typedef struct {
    int nargs; const tv_t *args;
    int nkw; const char **kwn; const tv_t *kwv;
} tpl_args_t;
int tpl_apply_filter(tpl_rctx_t *c, tpl_scope_t *s, int id, tv_t v, const tpl_args_t *a, tv_t *out, int line);
int tpl_apply_test(tpl_rctx_t *c, int id, tv_t v, const tpl_args_t *a, bool *out, int line);
/* Methods bound to strings/dicts/lists/loops: lookup returns fid >= 0 or -1. */
int tpl_method_lookup(tv_t recv, const char *name, size_t n);
int tpl_call_method(tpl_rctx_t *c, tv_t recv, int fid, const tpl_args_t *a, tv_t *out);
/* Globals: fid >= 0 or -1 */
int tpl_global_lookup(const char *name);
int tpl_call_global(tpl_rctx_t *c, int fid, const tpl_args_t *a, tv_t *out);
const char *tpl_func_name(const tobj_t *f);

enum { FN_GLOBAL, FN_METHOD, FN_MACRO, FN_CALLER, FN_UNSAFE };

#endif
