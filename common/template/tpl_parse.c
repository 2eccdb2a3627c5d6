/* Parser: jinja2's grammar (jinja2/parser.py) over the token array, producing the AST in the template
 * pool. Filters, tests and a few methods/globals are resolved here so that anything unsupported is
 * reported at compile time. */
#include "template/tpl_internal.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    prism_template_t *t;
    const tpl_token_t *tok;
    size_t n, i;
    int depth;
    int loop_depth;
    char *err;
    size_t errlen;
    int status;
} parser_t;

static int pfail(parser_t *P, int status, int line, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int pfail(parser_t *P, int status, int line, const char *fmt, ...)
{
    if (P->status) return P->status;
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (P->err && P->errlen) snprintf(P->err, P->errlen, "%s at line %d", msg, line);
    P->status = status;
    return status;
}

static const tpl_token_t *cur(parser_t *P) { return &P->tok[P->i]; }
static const tpl_token_t *look(parser_t *P) { return &P->tok[P->i + 1 < P->n ? P->i + 1 : P->n - 1]; }
static void advance(parser_t *P) { if (P->i + 1 < P->n) P->i++; }
static bool is_op(parser_t *P, int op) { return cur(P)->kind == TK_OP && cur(P)->op == op; }
static bool is_name(parser_t *P, const char *name)
{
    return cur(P)->kind == TK_NAME && !strcmp(cur(P)->s, name);
}

static const char *tok_desc(const tpl_token_t *t)
{
    switch (t->kind) {
    case TK_EOF: return "end of template";
    case TK_DATA: return "template data";
    case TK_VAR_BEGIN: return "begin of print statement";
    case TK_VAR_END: return "end of print statement";
    case TK_BLOCK_BEGIN: return "begin of statement block";
    case TK_BLOCK_END: return "end of statement block";
    case TK_NAME: return t->s;
    case TK_STRING: return "string";
    case TK_INT: return "integer";
    case TK_FLOAT: return "float";
    default: return t->s ? t->s : "operator";
    }
}

static int unexpected(parser_t *P)
{
    return pfail(P, PRISM_EINVAL, cur(P)->line, "unexpected '%s'", tok_desc(cur(P)));
}

static int expect_op(parser_t *P, int op, const char *what)
{
    if (!is_op(P, op)) return pfail(P, PRISM_EINVAL, cur(P)->line, "expected '%s', got '%s'", what, tok_desc(cur(P)));
    advance(P);
    return 0;
}

static int expect_kind(parser_t *P, int kind, const char *what)
{
    if (cur(P)->kind != kind)
        return pfail(P, PRISM_EINVAL, cur(P)->line, "expected %s, got '%s'", what, tok_desc(cur(P)));
    advance(P);
    return 0;
}

static tpl_node_t *node_new(parser_t *P, int kind, int line)
{
    tpl_node_t *n = tpl_pool_alloc(&P->t->pool, sizeof(*n));
    if (!n) { pfail(P, PRISM_ENOMEM, line, "out of memory"); return NULL; }
    memset(n, 0, sizeof(*n));
    n->kind = (uint8_t)kind;
    n->line = line;
    return n;
}

/* growable node-pointer vector in the pool */
typedef struct {
    tpl_node_t **v;
    int n, cap;
} nvec_t;

static int nvec_push(parser_t *P, nvec_t *v, tpl_node_t *x)
{
    if (v->n == v->cap) {
        int ncap = v->cap ? v->cap * 2 : 4;
        tpl_node_t **nv = tpl_pool_alloc(&P->t->pool, (size_t)ncap * sizeof(*nv));
        if (!nv) return pfail(P, PRISM_ENOMEM, cur(P)->line, "out of memory");
        if (v->n) memcpy(nv, v->v, (size_t)v->n * sizeof(*nv));
        v->v = nv;
        v->cap = ncap;
    }
    v->v[v->n++] = x;
    return 0;
}

typedef struct {
    const char **v;
    int n, cap;
} svec_t;

static int svec_push(parser_t *P, svec_t *v, const char *s)
{
    if (v->n == v->cap) {
        int ncap = v->cap ? v->cap * 2 : 4;
        const char **nv = tpl_pool_alloc(&P->t->pool, (size_t)ncap * sizeof(*nv));
        if (!nv) return pfail(P, PRISM_ENOMEM, cur(P)->line, "out of memory");
        if (v->n) memcpy(nv, v->v, (size_t)v->n * sizeof(*nv));
        v->v = nv;
        v->cap = ncap;
    }
    v->v[v->n++] = s;
    return 0;
}

static int enter(parser_t *P)
{
    if (++P->depth > PRISM_TEMPLATE_MAX_NESTING)
        return pfail(P, PRISM_ELIMIT, cur(P)->line, "template nested too deeply (limit %d)", PRISM_TEMPLATE_MAX_NESTING);
    return 0;
}

static tpl_node_t *parse_expression(parser_t *P, bool with_condexpr);
static tpl_node_t *parse_tuple(parser_t *P, bool simplified, bool with_condexpr, const char *extra_end,
                               bool explicit_paren);
static tpl_node_t *parse_unary(parser_t *P, bool with_filter);
static tpl_node_t *parse_primary(parser_t *P);
static tpl_node_t *parse_postfix(parser_t *P, tpl_node_t *node);
static tpl_node_t *parse_filter(parser_t *P, tpl_node_t *node, bool start_inline);

/* ( args, k=v ) -> n->items / n->names+items2 */
static int parse_call_args(parser_t *P, tpl_node_t *n)
{
    if (expect_op(P, OP_LPAREN, "(")) return P->status;
    nvec_t args = {0}, kwv = {0};
    svec_t kwn = {0};
    bool require_comma = false;
    while (!is_op(P, OP_RPAREN)) {
        if (require_comma) {
            if (expect_op(P, OP_COMMA, ",")) return P->status;
            if (is_op(P, OP_RPAREN)) break;
        }
        if (is_op(P, OP_MUL) || is_op(P, OP_POW))
            return pfail(P, PRISM_ENOTSUP, cur(P)->line, "unsupported '*args' / '**kwargs' in call");
        if (cur(P)->kind == TK_NAME && look(P)->kind == TK_OP && look(P)->op == OP_ASSIGN) {
            const char *key = cur(P)->s;
            advance(P);
            advance(P);
            tpl_node_t *v = parse_expression(P, true);
            if (!v) return P->status;
            if (svec_push(P, &kwn, key) || nvec_push(P, &kwv, v)) return P->status;
        } else {
            if (kwn.n) return pfail(P, PRISM_EINVAL, cur(P)->line, "invalid argument syntax (positional after keyword)");
            tpl_node_t *v = parse_expression(P, true);
            if (!v) return P->status;
            if (nvec_push(P, &args, v)) return P->status;
        }
        require_comma = true;
    }
    if (expect_op(P, OP_RPAREN, ")")) return P->status;
    n->items = args.v;
    n->nitems = args.n;
    n->items2 = kwv.v;
    n->nitems2 = kwv.n;
    n->names = kwn.v;
    n->nnames = kwn.n;
    return 0;
}

static const char *dotted_name(parser_t *P)
{
    if (cur(P)->kind != TK_NAME) {
        pfail(P, PRISM_EINVAL, cur(P)->line, "expected name, got '%s'", tok_desc(cur(P)));
        return NULL;
    }
    const char *name = cur(P)->s;
    advance(P);
    while (is_op(P, OP_DOT)) {
        advance(P);
        if (cur(P)->kind != TK_NAME) {
            pfail(P, PRISM_EINVAL, cur(P)->line, "expected name, got '%s'", tok_desc(cur(P)));
            return NULL;
        }
        size_t a = strlen(name), b = strlen(cur(P)->s);
        char *d = tpl_pool_alloc(&P->t->pool, a + b + 2);
        if (!d) { pfail(P, PRISM_ENOMEM, cur(P)->line, "out of memory"); return NULL; }
        memcpy(d, name, a);
        d[a] = '.';
        memcpy(d + a + 1, cur(P)->s, b + 1);
        name = d;
        advance(P);
    }
    return name;
}

/* select/reject/selectattr/rejectattr/map name other tests/filters in string arguments: check literal ones now */
static int check_named_builtin_args(parser_t *P, tpl_node_t *f)
{
    const char *fn = f->name;
    int idx = -1;
    bool is_test = true;
    if (!strcmp(fn, "select") || !strcmp(fn, "reject")) idx = 0;
    else if (!strcmp(fn, "selectattr") || !strcmp(fn, "rejectattr")) idx = 1;
    else if (!strcmp(fn, "map")) { idx = 0; is_test = false; }
    if (idx < 0 || f->nitems <= idx) return 0;
    tpl_node_t *a = f->items[idx];
    if (a->kind != E_CONST || a->val.t != TV_STR) return 0;
    if (is_test && tpl_test_lookup(a->val.u.s.p) < 0)
        return pfail(P, PRISM_ENOTSUP, f->line, "unsupported test '%s'", a->val.u.s.p);
    if (!is_test && tpl_filter_lookup(a->val.u.s.p) < 0)
        return pfail(P, PRISM_ENOTSUP, f->line, "unsupported filter '%s'", a->val.u.s.p);
    return 0;
}

static tpl_node_t *parse_filter(parser_t *P, tpl_node_t *node, bool start_inline)
{
    while (is_op(P, OP_PIPE) || start_inline) {
        if (!start_inline) advance(P);
        start_inline = false;
        int line = cur(P)->line;
        const char *name = dotted_name(P);
        if (!name) return NULL;
        int id = tpl_filter_lookup(name);
        if (id < 0) { pfail(P, PRISM_ENOTSUP, line, "unsupported filter '%s'", name); return NULL; }
        tpl_node_t *f = node_new(P, E_FILTER, line);
        if (!f) return NULL;
        f->a = node;
        f->name = name;
        f->id = id;
        if (is_op(P, OP_LPAREN) && parse_call_args(P, f)) return NULL;
        if (check_named_builtin_args(P, f)) return NULL;
        node = f;
    }
    return node;
}

static tpl_node_t *parse_test(parser_t *P, tpl_node_t *node)
{
    int line = cur(P)->line;
    advance(P); /* is */
    bool negated = false;
    if (is_name(P, "not")) { advance(P); negated = true; }
    const char *name = dotted_name(P);
    if (!name) return NULL;
    int id = tpl_test_lookup(name);
    if (id < 0) { pfail(P, PRISM_ENOTSUP, line, "unsupported test '%s'", name); return NULL; }
    tpl_node_t *t = node_new(P, E_TEST, line);
    if (!t) return NULL;
    t->a = node;
    t->name = name;
    t->id = id;
    if (negated) t->flags |= NF_NEGATED;
    const tpl_token_t *c = cur(P);
    if (is_op(P, OP_LPAREN)) {
        if (parse_call_args(P, t)) return NULL;
    } else if ((c->kind == TK_NAME || c->kind == TK_STRING || c->kind == TK_INT || c->kind == TK_FLOAT ||
                (c->kind == TK_OP && (c->op == OP_LPAREN || c->op == OP_LBRACKET || c->op == OP_LBRACE))) &&
               !is_name(P, "else") && !is_name(P, "or") && !is_name(P, "and")) {
        if (is_name(P, "is")) { pfail(P, PRISM_EINVAL, c->line, "cannot chain multiple tests with 'is'"); return NULL; }
        tpl_node_t *arg = parse_primary(P);
        if (!arg) return NULL;
        arg = parse_postfix(P, arg);
        if (!arg) return NULL;
        tpl_node_t **items = tpl_pool_alloc(&P->t->pool, sizeof(*items));
        if (!items) { pfail(P, PRISM_ENOMEM, line, "out of memory"); return NULL; }
        items[0] = arg;
        t->items = items;
        t->nitems = 1;
    }
    return t;
}

static tpl_node_t *parse_subscribed(parser_t *P, bool *is_slice, tpl_node_t *sl[3])
{
    *is_slice = false;
    tpl_node_t *first = NULL;
    if (is_op(P, OP_COLON)) {
        advance(P);
    } else {
        first = parse_expression(P, true);
        if (!first) return NULL;
        if (!is_op(P, OP_COLON)) return first;
        advance(P);
    }
    *is_slice = true;
    sl[0] = first;
    sl[1] = sl[2] = NULL;
    if (is_op(P, OP_COLON)) {
        sl[1] = NULL;
    } else if (!is_op(P, OP_RBRACKET) && !is_op(P, OP_COMMA)) {
        if (!(sl[1] = parse_expression(P, true))) return NULL;
    }
    if (is_op(P, OP_COLON)) {
        advance(P);
        if (!is_op(P, OP_RBRACKET) && !is_op(P, OP_COMMA))
            if (!(sl[2] = parse_expression(P, true))) return NULL;
    }
    return (tpl_node_t *)sl; /* non-NULL marker */
}

static tpl_node_t *parse_subscript(parser_t *P, tpl_node_t *node)
{
    const tpl_token_t *tok = cur(P);
    int line = tok->line;
    advance(P);
    if (tok->op == OP_DOT) {
        const tpl_token_t *at = cur(P);
        if (at->kind == TK_NAME) {
            advance(P);
            tpl_node_t *g = node_new(P, E_GETATTR, line);
            if (!g) return NULL;
            g->a = node;
            g->name = at->s;
            return g;
        }
        if (at->kind != TK_INT) { pfail(P, PRISM_EINVAL, line, "expected name or number"); return NULL; }
        advance(P);
        tpl_node_t *k = node_new(P, E_CONST, line);
        tpl_node_t *g = node_new(P, E_GETITEM, line);
        if (!k || !g) return NULL;
        k->val = tv_int(at->i);
        g->a = node;
        g->b = k;
        return g;
    }
    /* '[' */
    tpl_node_t *sl[3];
    bool is_slice;
    tpl_node_t *r = parse_subscribed(P, &is_slice, sl);
    if (!r) return NULL;
    if (is_op(P, OP_COMMA)) { pfail(P, PRISM_ENOTSUP, line, "unsupported tuple subscript"); return NULL; }
    if (expect_op(P, OP_RBRACKET, "]")) return NULL;
    tpl_node_t *g = node_new(P, is_slice ? E_SLICE : E_GETITEM, line);
    if (!g) return NULL;
    g->a = node;
    if (is_slice) { g->b = sl[0]; g->c = sl[1]; g->d = sl[2]; }
    else g->b = r;
    return g;
}

static tpl_node_t *parse_call(parser_t *P, tpl_node_t *node)
{
    tpl_node_t *c = node_new(P, E_CALL, cur(P)->line);
    if (!c) return NULL;
    c->a = node;
    if (parse_call_args(P, c)) return NULL;
    if (node->kind == E_GETATTR && tpl_method_status(node->name) < 0) {
        pfail(P, PRISM_ENOTSUP, c->line, "unsupported method '%s'", node->name);
        return NULL;
    }
    return c;
}

static tpl_node_t *parse_postfix(parser_t *P, tpl_node_t *node)
{
    while (node) {
        if (is_op(P, OP_DOT) || is_op(P, OP_LBRACKET)) node = parse_subscript(P, node);
        else if (is_op(P, OP_LPAREN)) node = parse_call(P, node);
        else break;
    }
    return node;
}

static tpl_node_t *parse_filter_expr(parser_t *P, tpl_node_t *node)
{
    while (node) {
        if (is_op(P, OP_PIPE)) node = parse_filter(P, node, false);
        else if (is_name(P, "is")) node = parse_test(P, node);
        else if (is_op(P, OP_LPAREN)) node = parse_call(P, node);
        else break;
    }
    return node;
}

static tpl_node_t *parse_primary(parser_t *P)
{
    if (enter(P)) return NULL;
    const tpl_token_t *t = cur(P);
    tpl_node_t *n = NULL;
    int line = t->line;
    if (t->kind == TK_NAME) {
        const char *s = t->s;
        if (!strcmp(s, "true") || !strcmp(s, "True") || !strcmp(s, "false") || !strcmp(s, "False")) {
            if (!(n = node_new(P, E_CONST, line))) return NULL;
            n->val = tv_bool(s[0] == 't' || s[0] == 'T');
        } else if (!strcmp(s, "none") || !strcmp(s, "None")) {
            if (!(n = node_new(P, E_CONST, line))) return NULL;
            n->val = tv_none();
        } else {
            if (tpl_global_unsupported(s)) {
                pfail(P, PRISM_ENOTSUP, line, "unsupported global '%s'", s);
                return NULL;
            }
            if (!(n = node_new(P, E_NAME, line))) return NULL;
            n->name = s;
        }
        advance(P);
    } else if (t->kind == TK_STRING) {
        advance(P);
        if (cur(P)->kind != TK_STRING) {
            if (!(n = node_new(P, E_CONST, line))) return NULL;
            n->val = tv_str(t->s, t->n);
        } else {
            size_t total = t->n;
            for (size_t j = P->i; P->tok[j].kind == TK_STRING; j++) total += P->tok[j].n;
            char *d = tpl_pool_alloc(&P->t->pool, total + 1);
            if (!d) { pfail(P, PRISM_ENOMEM, line, "out of memory"); return NULL; }
            memcpy(d, t->s, t->n);
            size_t o = t->n;
            while (cur(P)->kind == TK_STRING) {
                memcpy(d + o, cur(P)->s, cur(P)->n);
                o += cur(P)->n;
                advance(P);
            }
            d[o] = 0;
            if (!(n = node_new(P, E_CONST, line))) return NULL;
            n->val = tv_str(d, o);
        }
    } else if (t->kind == TK_INT || t->kind == TK_FLOAT) {
        if (!(n = node_new(P, E_CONST, line))) return NULL;
        n->val = t->kind == TK_INT ? tv_int(t->i) : tv_float(t->f);
        advance(P);
    } else if (is_op(P, OP_LPAREN)) {
        advance(P);
        n = parse_tuple(P, false, true, NULL, true);
        if (!n) return NULL;
        if (expect_op(P, OP_RPAREN, ")")) return NULL;
    } else if (is_op(P, OP_LBRACKET)) {
        advance(P);
        nvec_t items = {0};
        while (!is_op(P, OP_RBRACKET)) {
            if (items.n) {
                if (expect_op(P, OP_COMMA, ",")) return NULL;
                if (is_op(P, OP_RBRACKET)) break;
            }
            tpl_node_t *x = parse_expression(P, true);
            if (!x || nvec_push(P, &items, x)) return NULL;
        }
        if (expect_op(P, OP_RBRACKET, "]")) return NULL;
        if (!(n = node_new(P, E_LIST, line))) return NULL;
        n->items = items.v;
        n->nitems = items.n;
    } else if (is_op(P, OP_LBRACE)) {
        advance(P);
        nvec_t keys = {0}, vals = {0};
        while (!is_op(P, OP_RBRACE)) {
            if (keys.n) {
                if (expect_op(P, OP_COMMA, ",")) return NULL;
                if (is_op(P, OP_RBRACE)) break;
            }
            tpl_node_t *k = parse_expression(P, true);
            if (!k) return NULL;
            if (expect_op(P, OP_COLON, ":")) return NULL;
            tpl_node_t *v = parse_expression(P, true);
            if (!v || nvec_push(P, &keys, k) || nvec_push(P, &vals, v)) return NULL;
        }
        if (expect_op(P, OP_RBRACE, "}")) return NULL;
        if (!(n = node_new(P, E_DICT, line))) return NULL;
        n->items = keys.v;
        n->nitems = keys.n;
        n->items2 = vals.v;
        n->nitems2 = vals.n;
    } else {
        unexpected(P);
        return NULL;
    }
    P->depth--;
    return n;
}

static tpl_node_t *parse_unary(parser_t *P, bool with_filter)
{
    if (enter(P)) return NULL;
    tpl_node_t *node;
    int line = cur(P)->line;
    if (is_op(P, OP_SUB) || is_op(P, OP_ADD)) {
        int kind = is_op(P, OP_SUB) ? E_NEG : E_POS;
        advance(P);
        tpl_node_t *x = parse_unary(P, false);
        if (!x) return NULL;
        if (!(node = node_new(P, kind, line))) return NULL;
        node->a = x;
    } else {
        node = parse_primary(P);
    }
    node = parse_postfix(P, node);
    if (with_filter) node = parse_filter_expr(P, node);
    P->depth--;
    return node;
}

static tpl_node_t *binop(parser_t *P, int op, tpl_node_t *l, tpl_node_t *r, int line)
{
    if (!l || !r) return NULL;
    tpl_node_t *n = node_new(P, E_BIN, line);
    if (!n) return NULL;
    n->op = (uint8_t)op;
    n->a = l;
    n->b = r;
    return n;
}

static bool is_num_const(const tpl_node_t *n)
{
    if (n->kind == E_NEG || n->kind == E_POS) n = n->a;
    return n->kind == E_CONST && (n->val.t == TV_INT || n->val.t == TV_FLOAT);
}

static tpl_node_t *parse_pow(parser_t *P)
{
    tpl_node_t *l = parse_unary(P, true);
    while (l && is_op(P, OP_POW)) {
        int line = cur(P)->line;
        advance(P);
        tpl_node_t *r = parse_unary(P, true);
        if (!r) return NULL;
        /* jinja2 folds "-2" into a negative literal and emits "(-2 ** x)" into Python, where ** binds
         * tighter than unary minus: a negated number literal raised to a non-constant power means
         * -(2 ** x). With a constant exponent the whole thing folds as (-2) ** 2. */
        if (l->kind == E_NEG && l->a->kind == E_CONST && is_num_const(l->a) && !is_num_const(r)) {
            tpl_node_t *p = binop(P, OP_POW, l->a, r, line);
            if (!p) return NULL;
            l->a = p;
            continue;
        }
        l = binop(P, OP_POW, l, r, line);
    }
    return l;
}

static tpl_node_t *parse_math2(parser_t *P)
{
    tpl_node_t *l = parse_pow(P);
    while (l && (is_op(P, OP_MUL) || is_op(P, OP_DIV) || is_op(P, OP_FLOORDIV) || is_op(P, OP_MOD))) {
        int op = cur(P)->op, line = cur(P)->line;
        advance(P);
        l = binop(P, op, l, parse_pow(P), line);
    }
    return l;
}

static tpl_node_t *parse_concat(parser_t *P)
{
    tpl_node_t *l = parse_math2(P);
    while (l && is_op(P, OP_TILDE)) {
        int line = cur(P)->line;
        advance(P);
        l = binop(P, OP_TILDE, l, parse_math2(P), line);
    }
    return l;
}

static tpl_node_t *parse_math1(parser_t *P)
{
    tpl_node_t *l = parse_concat(P);
    while (l && (is_op(P, OP_ADD) || is_op(P, OP_SUB))) {
        int op = cur(P)->op, line = cur(P)->line;
        advance(P);
        l = binop(P, op, l, parse_concat(P), line);
    }
    return l;
}

static tpl_node_t *parse_compare(parser_t *P)
{
    int line = cur(P)->line;
    tpl_node_t *expr = parse_math1(P);
    if (!expr) return NULL;
    nvec_t operands = {0};
    uint8_t ops[64];
    for (;;) {
        int op = 0;
        const tpl_token_t *t = cur(P);
        if (t->kind == TK_OP && (t->op == OP_EQ || t->op == OP_NE || t->op == OP_LT || t->op == OP_LE ||
                                 t->op == OP_GT || t->op == OP_GE)) {
            op = t->op;
            advance(P);
        } else if (is_name(P, "in")) {
            op = OP_IN;
            advance(P);
        } else if (is_name(P, "not") && look(P)->kind == TK_NAME && !strcmp(look(P)->s, "in")) {
            op = OP_NOTIN;
            advance(P);
            advance(P);
        } else {
            break;
        }
        if (operands.n >= (int)sizeof(ops)) { pfail(P, PRISM_ELIMIT, line, "comparison chain too long"); return NULL; }
        tpl_node_t *r = parse_math1(P);
        if (!r) return NULL;
        ops[operands.n] = (uint8_t)op;
        if (nvec_push(P, &operands, r)) return NULL;
    }
    if (!operands.n) return expr;
    tpl_node_t *n = node_new(P, E_CMP, line);
    if (!n) return NULL;
    n->a = expr;
    n->items = operands.v;
    n->nitems = operands.n;
    n->ops = tpl_pool_alloc(&P->t->pool, (size_t)operands.n);
    if (!n->ops) { pfail(P, PRISM_ENOMEM, line, "out of memory"); return NULL; }
    memcpy(n->ops, ops, (size_t)operands.n);
    return n;
}

static tpl_node_t *parse_not(parser_t *P)
{
    if (is_name(P, "not")) {
        int line = cur(P)->line;
        advance(P);
        if (enter(P)) return NULL;
        tpl_node_t *x = parse_not(P);
        P->depth--;
        if (!x) return NULL;
        tpl_node_t *n = node_new(P, E_NOT, line);
        if (!n) return NULL;
        n->a = x;
        return n;
    }
    return parse_compare(P);
}

static tpl_node_t *parse_and(parser_t *P)
{
    tpl_node_t *l = parse_not(P);
    while (l && is_name(P, "and")) {
        int line = cur(P)->line;
        advance(P);
        l = binop(P, OP_AND, l, parse_not(P), line);
    }
    return l;
}

static tpl_node_t *parse_or(parser_t *P)
{
    tpl_node_t *l = parse_and(P);
    while (l && is_name(P, "or")) {
        int line = cur(P)->line;
        advance(P);
        l = binop(P, OP_OR, l, parse_and(P), line);
    }
    return l;
}

static tpl_node_t *parse_condexpr(parser_t *P)
{
    tpl_node_t *e1 = parse_or(P);
    while (e1 && is_name(P, "if")) {
        int line = cur(P)->line;
        advance(P);
        tpl_node_t *e2 = parse_or(P);
        if (!e2) return NULL;
        tpl_node_t *e3 = NULL;
        if (is_name(P, "else")) {
            advance(P);
            if (enter(P)) return NULL;
            e3 = parse_condexpr(P);
            P->depth--;
            if (!e3) return NULL;
        }
        tpl_node_t *n = node_new(P, E_COND, line);
        if (!n) return NULL;
        n->a = e2;
        n->b = e1;
        n->c = e3;
        e1 = n;
    }
    return e1;
}

static tpl_node_t *parse_expression(parser_t *P, bool with_condexpr)
{
    if (enter(P)) return NULL;
    tpl_node_t *n = with_condexpr ? parse_condexpr(P) : parse_or(P);
    P->depth--;
    return n;
}

static bool is_tuple_end(parser_t *P, const char *extra_end)
{
    const tpl_token_t *t = cur(P);
    if (t->kind == TK_VAR_END || t->kind == TK_BLOCK_END || t->kind == TK_EOF) return true;
    if (t->kind == TK_OP && t->op == OP_RPAREN) return true;
    if (extra_end && t->kind == TK_NAME && !strcmp(t->s, extra_end)) return true;
    return false;
}

static tpl_node_t *parse_tuple(parser_t *P, bool simplified, bool with_condexpr, const char *extra_end,
                               bool explicit_paren)
{
    int line = cur(P)->line;
    nvec_t args = {0};
    bool is_tuple = false;
    for (;;) {
        if (args.n && expect_op(P, OP_COMMA, ",")) return NULL;
        if (is_tuple_end(P, extra_end)) break;
        tpl_node_t *x = simplified ? parse_primary(P) : parse_expression(P, with_condexpr);
        if (!x || nvec_push(P, &args, x)) return NULL;
        if (is_op(P, OP_COMMA)) is_tuple = true;
        else break;
    }
    if (!is_tuple) {
        if (args.n) return args.v[0];
        if (!explicit_paren) {
            pfail(P, PRISM_EINVAL, line, "expected an expression, got '%s'", tok_desc(cur(P)));
            return NULL;
        }
    }
    tpl_node_t *n = node_new(P, E_TUPLE, line);
    if (!n) return NULL;
    n->items = args.v;
    n->nitems = args.n;
    return n;
}

/* ------------------------------------------------------------------ statements */

static tpl_node_t *subparse(parser_t *P, const char *const *end_tokens);

/* Parses until one of end_tokens ("endfor", "else", ...) is the next block tag name; leaves it current. */
static tpl_node_t *parse_statements(parser_t *P, const char *const *end_tokens, bool drop_needle)
{
    if (is_op(P, OP_COLON)) advance(P);
    if (expect_kind(P, TK_BLOCK_END, "end of statement block")) return NULL;
    if (enter(P)) return NULL;
    tpl_node_t *body = subparse(P, end_tokens);
    P->depth--;
    if (!body) return NULL;
    if (cur(P)->kind == TK_EOF) {
        pfail(P, PRISM_EINVAL, cur(P)->line, "unexpected end of template, expected '%s'", end_tokens[0]);
        return NULL;
    }
    if (drop_needle) advance(P);
    return body;
}

static int collect_targets(parser_t *P, tpl_node_t *target, tpl_node_t *into)
{
    svec_t v = {0};
    if (target->kind == E_NAME) {
        if (svec_push(P, &v, target->name)) return P->status;
    } else if (target->kind == E_TUPLE) {
        for (int i = 0; i < target->nitems; i++) {
            if (target->items[i]->kind != E_NAME)
                return pfail(P, PRISM_ENOTSUP, target->line, "unsupported nested assignment target");
            if (svec_push(P, &v, target->items[i]->name)) return P->status;
        }
        into->flags |= NF_TARGET_TUPLE;
    } else {
        return pfail(P, PRISM_EINVAL, target->line, "can't assign to this expression");
    }
    for (int i = 0; i < v.n; i++) {
        const char *s = v.v[i];
        if (!strcmp(s, "true") || !strcmp(s, "false") || !strcmp(s, "none") || !strcmp(s, "True") ||
            !strcmp(s, "False") || !strcmp(s, "None"))
            return pfail(P, PRISM_EINVAL, target->line, "can't assign to constant '%s'", s);
    }
    into->names = v.v;
    into->nnames = v.n;
    return 0;
}

static tpl_node_t *parse_for(parser_t *P, int line)
{
    tpl_node_t *n = node_new(P, S_FOR, line);
    if (!n) return NULL;
    tpl_node_t *target = parse_tuple(P, true, true, "in", false);
    if (!target || collect_targets(P, target, n)) return NULL;
    if (!is_name(P, "in")) { pfail(P, PRISM_EINVAL, cur(P)->line, "expected 'in', got '%s'", tok_desc(cur(P))); return NULL; }
    advance(P);
    if (!(n->a = parse_tuple(P, false, false, "recursive", false))) return NULL;
    if (is_name(P, "if")) {
        advance(P);
        if (!(n->b = parse_expression(P, true))) return NULL;
    }
    if (is_name(P, "recursive")) { pfail(P, PRISM_ENOTSUP, cur(P)->line, "unsupported recursive for loop"); return NULL; }
    static const char *const ends[] = {"endfor", "else", NULL};
    static const char *const ends2[] = {"endfor", NULL};
    P->loop_depth++;
    n->c = parse_statements(P, ends, false);
    P->loop_depth--;
    if (!n->c) return NULL;
    bool is_else = !strcmp(cur(P)->s, "else");
    advance(P);
    if (is_else && !(n->d = parse_statements(P, ends2, true))) return NULL;
    return n;
}

static tpl_node_t *parse_if(parser_t *P, int line)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    static const char *const ends2[] = {"endif", NULL};
    tpl_node_t *result = node_new(P, S_IF, line), *node = result;
    if (!result) return NULL;
    for (;;) {
        if (!(node->a = parse_tuple(P, false, false, NULL, false))) return NULL;
        if (!(node->b = parse_statements(P, ends, false))) return NULL;
        const char *which = cur(P)->s;
        int l = cur(P)->line;
        advance(P);
        if (!strcmp(which, "elif")) {
            tpl_node_t *e = node_new(P, S_IF, l);
            if (!e) return NULL;
            node->c = e;
            node = e; /* the renderer walks elif chains iteratively */
            continue;
        }
        if (!strcmp(which, "else") && !(node->c = parse_statements(P, ends2, true))) return NULL;
        break;
    }
    return result;
}

/* (a, b=1, ...) into n->names / n->items (defaults, NULL where none) */
static int parse_signature(parser_t *P, tpl_node_t *n)
{
    if (expect_op(P, OP_LPAREN, "(")) return P->status;
    svec_t names = {0};
    nvec_t defs = {0};
    bool any_default = false;
    while (!is_op(P, OP_RPAREN)) {
        if (names.n && expect_op(P, OP_COMMA, ",")) return P->status;
        if (is_op(P, OP_RPAREN)) break;
        if (cur(P)->kind != TK_NAME) return pfail(P, PRISM_EINVAL, cur(P)->line, "expected parameter name, got '%s'", tok_desc(cur(P)));
        const char *pn = cur(P)->s;
        advance(P);
        tpl_node_t *d = NULL;
        if (is_op(P, OP_ASSIGN)) {
            advance(P);
            if (!(d = parse_expression(P, true))) return P->status;
            any_default = true;
        } else if (any_default) {
            return pfail(P, PRISM_EINVAL, cur(P)->line, "non-default argument follows default argument");
        }
        if (svec_push(P, &names, pn) || nvec_push(P, &defs, d)) return P->status;
    }
    advance(P);
    n->names = names.v;
    n->nnames = names.n;
    n->items = defs.v;
    n->nitems = defs.n;
    return 0;
}

static bool refers_to(const tpl_node_t *n, const char *name, int depth)
{
    if (!n || depth > 4 * PRISM_TEMPLATE_MAX_NESTING) return false;
    if (n->kind == E_NAME && !strcmp(n->name, name)) return true;
    if (refers_to(n->a, name, depth + 1) || refers_to(n->b, name, depth + 1) || refers_to(n->c, name, depth + 1) ||
        refers_to(n->d, name, depth + 1))
        return true;
    for (int i = 0; i < n->nitems; i++)
        if (refers_to(n->items[i], name, depth + 1)) return true;
    for (int i = 0; i < n->nitems2; i++)
        if (refers_to(n->items2[i], name, depth + 1)) return true;
    return false;
}

static tpl_node_t *parse_macro(parser_t *P, int line)
{
    tpl_node_t *n = node_new(P, S_MACRO, line);
    if (!n) return NULL;
    if (cur(P)->kind != TK_NAME) { pfail(P, PRISM_EINVAL, line, "expected macro name"); return NULL; }
    n->name = cur(P)->s;
    advance(P);
    if (parse_signature(P, n)) return NULL;
    static const char *const ends[] = {"endmacro", NULL};
    int saved = P->loop_depth;
    P->loop_depth = 0;
    n->a = parse_statements(P, ends, true);
    P->loop_depth = saved;
    if (!n->a) return NULL;
    if (refers_to(n->a, "varargs", 0)) n->flags |= NF_VARARGS;
    if (refers_to(n->a, "kwargs", 0)) n->flags |= NF_KWARGS;
    if (refers_to(n->a, "caller", 0)) n->flags |= NF_CALLER;
    return n;
}

static tpl_node_t *parse_call_block(parser_t *P, int line)
{
    tpl_node_t *n = node_new(P, S_CALLBLOCK, line);
    if (!n) return NULL;
    if (is_op(P, OP_LPAREN) && parse_signature(P, n)) return NULL;
    tpl_node_t *call = parse_expression(P, true);
    if (!call) return NULL;
    if (call->kind != E_CALL) { pfail(P, PRISM_EINVAL, line, "expected call"); return NULL; }
    n->a = call;
    static const char *const ends[] = {"endcall", NULL};
    int saved = P->loop_depth;
    P->loop_depth = 0;
    n->b = parse_statements(P, ends, true);
    P->loop_depth = saved;
    if (!n->b) return NULL;
    if (refers_to(n->b, "varargs", 0)) n->flags |= NF_VARARGS;
    if (refers_to(n->b, "kwargs", 0)) n->flags |= NF_KWARGS;
    return n;
}

static tpl_node_t *parse_set(parser_t *P, int line)
{
    tpl_node_t *n = node_new(P, S_SET, line);
    if (!n) return NULL;
    if (cur(P)->kind == TK_NAME && look(P)->kind == TK_OP && look(P)->op == OP_DOT) {
        n->name = cur(P)->s;
        advance(P);
        advance(P);
        if (cur(P)->kind != TK_NAME) { pfail(P, PRISM_EINVAL, line, "expected attribute name"); return NULL; }
        const char **names = tpl_pool_alloc(&P->t->pool, sizeof(*names));
        if (!names) { pfail(P, PRISM_ENOMEM, line, "out of memory"); return NULL; }
        names[0] = cur(P)->s;
        n->names = names;
        n->nnames = 1;
        n->flags |= NF_NSATTR;
        advance(P);
    } else {
        tpl_node_t *target = parse_tuple(P, true, true, NULL, false);
        if (!target || collect_targets(P, target, n)) return NULL;
    }
    if (is_op(P, OP_ASSIGN)) {
        advance(P);
        if (!(n->a = parse_tuple(P, false, true, NULL, false))) return NULL;
        return n;
    }
    if (n->flags & NF_NSATTR || n->nnames != 1) {
        pfail(P, PRISM_ENOTSUP, line, "unsupported block assignment target");
        return NULL;
    }
    n->kind = S_SETBLOCK;
    n->name = n->names[0];
    if (is_op(P, OP_PIPE)) {
        if (!(n->b = parse_filter(P, NULL, false))) return NULL;
    }
    static const char *const ends[] = {"endset", NULL};
    if (!(n->a = parse_statements(P, ends, true))) return NULL;
    return n;
}

static tpl_node_t *parse_with(parser_t *P, int line)
{
    tpl_node_t *n = node_new(P, S_WITH, line);
    if (!n) return NULL;
    svec_t names = {0};
    nvec_t vals = {0};
    while (cur(P)->kind != TK_BLOCK_END) {
        if (names.n && expect_op(P, OP_COMMA, ",")) return NULL;
        if (cur(P)->kind != TK_NAME) { unexpected(P); return NULL; }
        const char *nm = cur(P)->s;
        advance(P);
        if (expect_op(P, OP_ASSIGN, "=")) return NULL;
        tpl_node_t *v = parse_expression(P, true);
        if (!v || svec_push(P, &names, nm) || nvec_push(P, &vals, v)) return NULL;
    }
    n->names = names.v;
    n->nnames = names.n;
    n->items = vals.v;
    n->nitems = vals.n;
    static const char *const ends[] = {"endwith", NULL};
    if (!(n->a = parse_statements(P, ends, true))) return NULL;
    return n;
}

static tpl_node_t *parse_statement(parser_t *P)
{
    const tpl_token_t *t = cur(P);
    if (t->kind != TK_NAME) {
        pfail(P, PRISM_EINVAL, t->line, "tag name expected");
        return NULL;
    }
    const char *k = t->s;
    int line = t->line;
    advance(P);
    if (!strcmp(k, "for")) return parse_for(P, line);
    if (!strcmp(k, "if")) return parse_if(P, line);
    if (!strcmp(k, "set")) return parse_set(P, line);
    if (!strcmp(k, "macro")) return parse_macro(P, line);
    if (!strcmp(k, "call")) return parse_call_block(P, line);
    if (!strcmp(k, "with")) return parse_with(P, line);
    if (!strcmp(k, "print")) {
        tpl_node_t *n = node_new(P, S_OUT, line);
        if (!n || !(n->a = parse_tuple(P, false, true, NULL, false))) return NULL;
        return n;
    }
    if (!strcmp(k, "filter")) {
        tpl_node_t *n = node_new(P, S_FILTERBLOCK, line);
        if (!n || !(n->a = parse_filter(P, NULL, true))) return NULL;
        static const char *const ends[] = {"endfilter", NULL};
        if (!(n->b = parse_statements(P, ends, true))) return NULL;
        return n;
    }
    if (!strcmp(k, "generation")) {
        static const char *const ends[] = {"endgeneration", NULL};
        return parse_statements(P, ends, true);
    }
    if (!strcmp(k, "break") || !strcmp(k, "continue")) {
        if (!P->loop_depth) {
            pfail(P, PRISM_EINVAL, line, "'%s' outside loop", k);
            return NULL;
        }
        return node_new(P, k[0] == 'b' ? S_BREAK : S_CONTINUE, line);
    }
    static const char *const unsupported[] = {"block", "extends", "include", "import", "from", "autoescape",
                                              "do", "trans", "pluralize", "debug"};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(unsupported); i++)
        if (!strcmp(k, unsupported[i])) {
            pfail(P, PRISM_ENOTSUP, line, "unsupported tag '%s'", k);
            return NULL;
        }
    pfail(P, PRISM_EINVAL, line, "encountered unknown tag '%s'", k);
    return NULL;
}

static tpl_node_t *subparse(parser_t *P, const char *const *end_tokens)
{
    nvec_t body = {0};
    int line = cur(P)->line;
    for (;;) {
        const tpl_token_t *t = cur(P);
        if (t->kind == TK_EOF) break;
        if (t->kind == TK_DATA) {
            tpl_node_t *n = node_new(P, S_TEXT, t->line);
            if (!n) return NULL;
            n->val = tv_str(t->s, t->n);
            if (nvec_push(P, &body, n)) return NULL;
            advance(P);
        } else if (t->kind == TK_VAR_BEGIN) {
            advance(P);
            tpl_node_t *n = node_new(P, S_OUT, t->line);
            if (!n || !(n->a = parse_tuple(P, false, true, NULL, false))) return NULL;
            if (expect_kind(P, TK_VAR_END, "end of print statement")) return NULL;
            if (nvec_push(P, &body, n)) return NULL;
        } else if (t->kind == TK_BLOCK_BEGIN) {
            advance(P);
            if (end_tokens && cur(P)->kind == TK_NAME) {
                for (int i = 0; end_tokens[i]; i++)
                    if (!strcmp(cur(P)->s, end_tokens[i])) goto done;
            }
            tpl_node_t *n = parse_statement(P);
            if (!n) return NULL;
            if (expect_kind(P, TK_BLOCK_END, "end of statement block")) return NULL;
            if (nvec_push(P, &body, n)) return NULL;
        } else {
            unexpected(P);
            return NULL;
        }
    }
    if (end_tokens) {
        pfail(P, PRISM_EINVAL, cur(P)->line, "unexpected end of template, expected '%s'", end_tokens[0]);
        return NULL;
    }
done:;
    tpl_node_t *b = node_new(P, S_BODY, line);
    if (!b) return NULL;
    b->items = body.v;
    b->nitems = body.n;
    return b;
}

int tpl_parse(prism_template_t *t, const tpl_tokens_t *toks, char *err, size_t errlen)
{
    parser_t P = {.t = t, .tok = toks->v, .n = toks->n, .err = err, .errlen = errlen};
    tpl_node_t *root = subparse(&P, NULL);
    if (!root) return P.status ? P.status : PRISM_EINVAL;
    t->root = root;
    return 0;
}
