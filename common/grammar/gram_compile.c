/* Expression IR -> per-rule DFA over bytes with call edges (a recursive transition network).
 *
 * Each rule body becomes a Thompson NFA (edges: epsilon, byte, byte class, call), then a DFA by
 * subset construction in which a call to rule R is one more symbol. Determinizing makes
 * alternatives that share prefixes (enum values, choices, keys) one path, so a matcher keeps few
 * parallel stacks. Rules that can never complete are pruned; a grammar whose root cannot
 * complete is an error. */
#define _GNU_SOURCE 1   /* qsort_r */
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"

typedef enum { NE_EPS, NE_BYTE, NE_CLASS, NE_CALL } ne_kind_t;
typedef struct { uint8_t kind; int32_t arg, to, next; } nedge_t;

typedef struct {
    prism_grammar_builder_t *b;
    int32_t *head;   int32_t n_st, cap_st;
    nedge_t *edges;  int32_t n_ed, cap_ed;
    int32_t limit;
    int depth;
} nfa_t;

static int32_t nfa_state(nfa_t *f)
{
    if (f->b->err) return -1;
    if (f->n_st >= f->limit) {
        gram_fail(f->b, PRISM_ELIMIT, "", "grammar too complex (over %d automaton states)", f->limit);
        return -1;
    }
    if (f->n_st == f->cap_st) {
        int32_t nc = f->cap_st ? f->cap_st * 2 : 256;
        int32_t *h = prism_realloc(f->head, (size_t)nc * sizeof *h);
        if (!h) { gram_fail(f->b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); return -1; }
        f->head = h;
        f->cap_st = nc;
    }
    f->head[f->n_st] = -1;
    return f->n_st++;
}

static int nfa_edge(nfa_t *f, int32_t from, ne_kind_t k, int32_t arg, int32_t to)
{
    if (f->b->err || from < 0 || to < 0) return -1;
    if (f->n_ed == f->cap_ed) {
        int32_t nc = f->cap_ed ? f->cap_ed * 2 : 512;
        nedge_t *e = prism_realloc(f->edges, (size_t)nc * sizeof *e);
        if (!e) { gram_fail(f->b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); return -1; }
        f->edges = e;
        f->cap_ed = nc;
    }
    f->edges[f->n_ed] = (nedge_t){ (uint8_t)k, arg, to, f->head[from] };
    f->head[from] = f->n_ed++;
    return 0;
}

/* Emits expression e starting at state `from`; returns the end state (-1 on error). */
static int32_t nfa_emit(nfa_t *f, int32_t e, int32_t from)
{
    prism_grammar_builder_t *b = f->b;
    if (b->err || from < 0) return -1;
    if (++f->depth > 2000) {
        gram_fail(b, PRISM_ELIMIT, "", "grammar nested too deeply");
        return -1;
    }
    const gx_node_t *x = &b->nodes[e];
    int32_t out = -1, s;
    switch ((gx_kind_t)x->kind) {
    case GX_EMPTY:
        out = from;
        break;
    case GX_CLASS:
        s = nfa_state(f);
        nfa_edge(f, from, NE_CLASS, x->a, s);
        out = s;
        break;
    case GX_LIT:
        out = from;
        for (int32_t i = 0; i < x->b && out >= 0; i++) {
            s = nfa_state(f);
            nfa_edge(f, out, NE_BYTE, b->bytes[x->a + i], s);
            out = s;
        }
        break;
    case GX_SEQ:
        out = from;
        for (int32_t i = 0; i < x->b && out >= 0; i++) out = nfa_emit(f, b->kids[x->a + i], out);
        break;
    case GX_ALT:
        out = nfa_state(f);
        for (int32_t i = 0; i < x->b && !b->err; i++) {
            s = nfa_state(f);
            nfa_edge(f, from, NE_EPS, 0, s);
            int32_t t = nfa_emit(f, b->kids[x->a + i], s);
            nfa_edge(f, t, NE_EPS, 0, out);
        }
        break;
    case GX_REP: {
        int32_t cur = from;
        for (int32_t i = 0; i < x->b && cur >= 0; i++) cur = nfa_emit(f, x->a, cur);
        if (cur < 0) break;
        if (x->c < 0) {
            /* loop point s: either go round the body again or continue */
            s = nfa_state(f);
            int32_t body = nfa_state(f);
            nfa_edge(f, cur, NE_EPS, 0, s);
            nfa_edge(f, s, NE_EPS, 0, body);
            int32_t t = nfa_emit(f, x->a, body);
            nfa_edge(f, t, NE_EPS, 0, s);
            out = s;
        } else {
            int32_t end = nfa_state(f);
            nfa_edge(f, cur, NE_EPS, 0, end);
            for (int32_t i = x->b; i < x->c && cur >= 0; i++) {
                int32_t body = nfa_state(f);
                nfa_edge(f, cur, NE_EPS, 0, body);
                cur = nfa_emit(f, x->a, body);
                nfa_edge(f, cur, NE_EPS, 0, end);
            }
            out = end;
        }
        break;
    }
    case GX_REF:
        s = nfa_state(f);
        nfa_edge(f, from, NE_CALL, x->a, s);
        out = s;
        break;
    }
    f->depth--;
    return b->err ? -1 : out;
}

/* ---- subset construction ---- */
typedef struct {
    prism_grammar_builder_t *b;
    nfa_t *f;
    int32_t accept;          /* NFA accept state of the rule */
    uint32_t *mark; uint32_t gen;
    int32_t *stack;
    /* DFA sets: set i = pool[set_off[i] .. set_off[i+1]) */
    int32_t *pool; size_t n_pool, cap_pool;
    size_t *set_off; int32_t n_sets, cap_sets;
    int32_t *hash; uint32_t hash_mask;
    /* output of this rule, local ids */
    gram_range_t *rg; size_t n_rg, cap_rg;
    gram_call_t *cl;  size_t n_cl, cap_cl;
    gram_state_t *st; size_t cap_st;
    size_t global_base, global_limit;
} dfa_t;

static uint32_t set_hash(const int32_t *s, size_t n)
{
    uint64_t h = 1469598103934665603ULL ^ n;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint32_t)s[i]) * 1099511628211ULL;
    return (uint32_t)(h ^ (h >> 29));
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static int ensure(prism_grammar_builder_t *b, void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 256;
    while (nc < need) nc *= 2;
    void *q = prism_realloc(*p, nc * elem);
    if (!q) return gram_fail(b, PRISM_ENOMEM, "", "out of memory compiling the grammar");
    *p = q;
    *cap = nc;
    return 0;
}

/* Epsilon closure of in[0..n) into d->pool at its end (sorted); returns the length. */
static size_t closure(dfa_t *d, const int32_t *in, size_t n)
{
    if (++d->gen == 0) { memset(d->mark, 0, (size_t)d->f->n_st * sizeof *d->mark); d->gen = 1; }
    size_t start = d->n_pool, sp = 0;
    for (size_t i = 0; i < n; i++)
        if (d->mark[in[i]] != d->gen) { d->mark[in[i]] = d->gen; d->stack[sp++] = in[i]; }
    while (sp) {
        int32_t s = d->stack[--sp];
        if (ensure(d->b, (void **)&d->pool, &d->cap_pool, d->n_pool + 1, sizeof *d->pool) < 0) return 0;
        d->pool[d->n_pool++] = s;
        for (int32_t e = d->f->head[s]; e >= 0; e = d->f->edges[e].next) {
            const nedge_t *ed = &d->f->edges[e];
            if (ed->kind == NE_EPS && d->mark[ed->to] != d->gen) { d->mark[ed->to] = d->gen; d->stack[sp++] = ed->to; }
        }
    }
    qsort(d->pool + start, d->n_pool - start, sizeof *d->pool, cmp_i32);
    return d->n_pool - start;
}

static int rehash(dfa_t *d)
{
    uint32_t nm = d->hash_mask ? d->hash_mask * 2 + 1 : 1023;
    int32_t *h = prism_malloc(((size_t)nm + 1) * sizeof *h);
    if (!h) return gram_fail(d->b, PRISM_ENOMEM, "", "out of memory compiling the grammar");
    memset(h, 0xff, ((size_t)nm + 1) * sizeof *h);
    for (int32_t i = 0; i < d->n_sets; i++) {
        size_t o = d->set_off[i], n = d->set_off[i + 1] - o;
        uint32_t k = set_hash(d->pool + o, n) & nm;
        while (h[k] >= 0) k = (k + 1) & nm;
        h[k] = i;
    }
    prism_free(d->hash);
    d->hash = h;
    d->hash_mask = nm;
    return 0;
}

/* Interns the set just closed at the end of the pool: returns its DFA id (new or existing). */
static int32_t intern(dfa_t *d, size_t start, size_t n)
{
    if (d->b->err) return -1;
    const int32_t *s = d->pool + start;
    uint32_t k = set_hash(s, n) & d->hash_mask;
    for (; d->hash[k] >= 0; k = (k + 1) & d->hash_mask) {
        int32_t i = d->hash[k];
        size_t o = d->set_off[i], m = d->set_off[i + 1] - o;
        if (m == n && !memcmp(d->pool + o, s, n * sizeof *s)) {
            d->n_pool = start;  /* drop the duplicate */
            return i;
        }
    }
    if (d->global_base + (size_t)d->n_sets + 1 > d->global_limit) {
        gram_fail(d->b, PRISM_ELIMIT, "", "grammar too complex (over %zu states)", d->global_limit);
        return -1;
    }
    if ((size_t)d->n_sets + 2 > (size_t)d->cap_sets) {
        int32_t nc = d->cap_sets ? d->cap_sets * 2 : 256;
        size_t *o = prism_realloc(d->set_off, (size_t)(nc + 1) * sizeof *o);
        if (!o) { gram_fail(d->b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); return -1; }
        d->set_off = o;
        d->cap_sets = nc;
    }
    int32_t id = d->n_sets++;
    d->set_off[id] = start;
    d->set_off[id + 1] = start + n;
    d->hash[k] = id;
    if ((uint32_t)d->n_sets * 2 > d->hash_mask && rehash(d) < 0) return -1;
    return id;
}

static int dfa_rule(dfa_t *d, int32_t nfa_start)
{
    d->n_sets = 0;
    d->n_pool = 0;
    d->n_rg = d->n_cl = 0;
    if (d->hash) memset(d->hash, 0xff, ((size_t)d->hash_mask + 1) * sizeof *d->hash);
    else if (rehash(d) < 0) return -1;
    if (!d->set_off) {
        d->set_off = prism_malloc(257 * sizeof *d->set_off);
        if (!d->set_off) return gram_fail(d->b, PRISM_ENOMEM, "", "out of memory compiling the grammar");
        d->cap_sets = 256;
    }
    d->set_off[0] = 0;
    size_t n = closure(d, &nfa_start, 1);
    if (intern(d, 0, n) < 0) return -1;

    int32_t tmp_cap = 0, *tmp = NULL;  /* raw targets */
    int32_t edge_cap = 0, *eds = NULL; /* candidate edges of the current set */
    int32_t *byte_tg = NULL;           /* [256][n_eds] targets per byte */
    size_t byte_cap = 0;
    int32_t byte_n[256];
    for (int32_t cur = 0; cur < d->n_sets && !d->b->err; cur++) {
        if (ensure(d->b, (void **)&d->st, &d->cap_st, (size_t)cur + 1, sizeof *d->st) < 0) break;
        gram_state_t *gs = &d->st[cur];
        memset(gs, 0, sizeof *gs);
        gs->range_off = (uint32_t)d->n_rg;
        gs->call_off = (uint32_t)d->n_cl;
        int32_t n_eds = 0;
        /* members' edges (set_off may move as sets are interned: re-read each time) */
        for (size_t i = d->set_off[cur]; i < d->set_off[cur + 1]; i++) {
            int32_t s = d->pool[i];
            if (s == d->accept) gs->final = 1;
            for (int32_t e = d->f->head[s]; e >= 0; e = d->f->edges[e].next) {
                if (d->f->edges[e].kind == NE_EPS) continue;
                if (n_eds == edge_cap) {
                    edge_cap = edge_cap ? edge_cap * 2 : 64;
                    int32_t *ne = prism_realloc(eds, (size_t)edge_cap * sizeof *ne);
                    if (!ne) { gram_fail(d->b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); goto done; }
                    eds = ne;
                }
                eds[n_eds++] = e;
            }
        }
        if (tmp_cap < n_eds + 1) {
            tmp_cap = n_eds + 64;
            int32_t *nt = prism_realloc(tmp, (size_t)tmp_cap * sizeof *nt);
            if (!nt) { gram_fail(d->b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); goto done; }
            tmp = nt;
        }
        /* byte transitions: per byte, the targets of the member edges that take it (in edge
         * order), then grouped into ranges of equal target */
        if (byte_cap < (size_t)n_eds * 256) {
            byte_cap = (size_t)n_eds * 256;
            int32_t *nb = prism_realloc(byte_tg, byte_cap * sizeof *nb);
            if (!nb) { gram_fail(d->b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); goto done; }
            byte_tg = nb;
        }
        memset(byte_n, 0, sizeof byte_n);
        for (int32_t i = 0; i < n_eds; i++) {
            const nedge_t *ed = &d->f->edges[eds[i]];
            if (ed->kind == NE_BYTE) {
                byte_tg[ed->arg * n_eds + byte_n[ed->arg]++] = ed->to;
            } else if (ed->kind == NE_CLASS) {
                const gx_class_t *cl = &d->b->classes[ed->arg];
                for (int w = 0; w < 8; w++)
                    for (uint32_t bits = cl->w[w]; bits; bits &= bits - 1) {
                        int bt = w * 32 + __builtin_ctz(bits);
                        byte_tg[bt * n_eds + byte_n[bt]++] = ed->to;
                    }
            }
        }
        int32_t prev_to = -1;
        int32_t prev_raw_n = -1;
        const int32_t *prev_raw = NULL;
        for (int bt = 0; bt < 256; bt++) {
            int32_t nr = byte_n[bt];
            int32_t to = -1;
            if (nr) {   /* (a state without edges has no byte_tg at all: NULL + 0 is undefined) */
                const int32_t *raw = byte_tg + (size_t)bt * n_eds;
                if (prev_raw && prev_raw_n == nr && !memcmp(prev_raw, raw, (size_t)nr * sizeof *raw)) {
                    to = prev_to;
                } else {
                    size_t start = d->n_pool;
                    size_t m = closure(d, raw, (size_t)nr);
                    if (d->b->err) goto done;
                    to = intern(d, start, m);
                    if (to < 0) goto done;
                }
                prev_raw = raw;
                prev_raw_n = nr;
            } else {
                prev_raw_n = -1;
            }
            if (to >= 0) {
                gram_range_t *last = d->n_rg > gs->range_off ? &d->rg[d->n_rg - 1] : NULL;
                if (last && last->to == to && last->hi == bt - 1) {
                    last->hi = (uint8_t)bt;
                } else {
                    if (ensure(d->b, (void **)&d->rg, &d->cap_rg, d->n_rg + 1, sizeof *d->rg) < 0) goto done;
                    d->rg[d->n_rg++] = (gram_range_t){ (uint8_t)bt, (uint8_t)bt, to };
                }
            }
            prev_to = to;
        }
        /* calls, grouped by callee */
        for (int32_t i = 0; i < n_eds; i++) {
            const nedge_t *ed = &d->f->edges[eds[i]];
            if (ed->kind != NE_CALL) continue;
            bool seen = false;
            for (int32_t j = 0; j < i; j++) {
                const nedge_t *ej = &d->f->edges[eds[j]];
                if (ej->kind == NE_CALL && ej->arg == ed->arg) { seen = true; break; }
            }
            if (seen) continue;
            int32_t nr = 0;
            for (int32_t j = i; j < n_eds; j++) {
                const nedge_t *ej = &d->f->edges[eds[j]];
                if (ej->kind == NE_CALL && ej->arg == ed->arg) tmp[nr++] = ej->to;
            }
            size_t start = d->n_pool;
            size_t m = closure(d, tmp, (size_t)nr);
            if (d->b->err) goto done;
            int32_t to = intern(d, start, m);
            if (to < 0) goto done;
            if (ensure(d->b, (void **)&d->cl, &d->cap_cl, d->n_cl + 1, sizeof *d->cl) < 0) goto done;
            d->cl[d->n_cl++] = (gram_call_t){ ed->arg, to };
        }
        gs = &d->st[cur];
        gs->n_ranges = (uint16_t)(d->n_rg - gs->range_off);
        gs->n_calls = (uint16_t)(d->n_cl - gs->call_off);
        if (d->n_rg - gs->range_off > 256 || d->n_cl - gs->call_off > 60000) {
            gram_fail(d->b, PRISM_ELIMIT, "", "grammar too complex (a state with too many calls)");
            goto done;
        }
    }
done:
    prism_free(tmp);
    prism_free(eds);
    prism_free(byte_tg);
    return d->b->err ? -1 : 0;
}

/* ---- minimization (Moore partition refinement) ----
 * Subset construction leaves equivalent states apart (after an ASCII character and after a
 * multi-byte one, a JSON string is in "the same" place through different NFA sets). Merging
 * them matters beyond size: every distinct state costs a mask-cache fill over the vocabulary. */
typedef struct { const int32_t *pool; const size_t *off; } sig_t;

static int cmp_sig(const void *a, const void *b, void *arg)
{
    const sig_t *sg = arg;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    size_t lx = sg->off[x + 1] - sg->off[x], ly = sg->off[y + 1] - sg->off[y];
    size_t n = lx < ly ? lx : ly;
    int c = memcmp(sg->pool + sg->off[x], sg->pool + sg->off[y], n * sizeof(int32_t));
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return (x > y) - (x < y);
}

static int cmp_call(const void *a, const void *b)
{
    const gram_call_t *x = a, *y = b;
    if (x->rule != y->rule) return x->rule < y->rule ? -1 : 1;
    return (x->ret > y->ret) - (x->ret < y->ret);
}

static int minimize(dfa_t *d)
{
    int32_t n = d->n_sets;
    if (n <= 1) return 0;
    int32_t *cls = prism_malloc((size_t)n * sizeof *cls), *ncls = prism_malloc((size_t)n * sizeof *ncls);
    int32_t *order = prism_malloc((size_t)n * sizeof *order);
    size_t *off = prism_malloc(((size_t)n + 1) * sizeof *off);
    int32_t *pool = NULL;
    size_t cap_pool = 0;
    gram_call_t *ctmp = NULL;
    size_t cap_ctmp = 0;
    int rc = -1;
    if (!cls || !ncls || !order || !off) { gram_fail(d->b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); goto done; }
    for (int32_t i = 0; i < n; i++) cls[i] = d->st[i].final;
    int32_t n_cls = 0;
    for (;;) {
        size_t np = 0;
        for (int32_t i = 0; i < n; i++) {
            const gram_state_t *s = &d->st[i];
            size_t need = np + 3 + (size_t)s->n_ranges * 3 + (size_t)s->n_calls * 2;
            if (ensure(d->b, (void **)&pool, &cap_pool, need, sizeof *pool) < 0 ||
                ensure(d->b, (void **)&ctmp, &cap_ctmp, (size_t)s->n_calls + 1, sizeof *ctmp) < 0)
                goto done;
            off[i] = np;
            pool[np++] = cls[i];
            size_t at_n = np++;
            int32_t nr = 0;
            for (uint32_t r = 0; r < s->n_ranges; r++) {
                const gram_range_t *x = &d->rg[s->range_off + r];
                int32_t tc = cls[x->to];
                if (nr && pool[np - 1] == tc && pool[np - 2] == (int32_t)x->lo - 1) { pool[np - 2] = x->hi; continue; }
                pool[np++] = x->lo;
                pool[np++] = x->hi;
                pool[np++] = tc;
                nr++;
            }
            pool[at_n] = nr;
            for (uint32_t c = 0; c < s->n_calls; c++) {
                ctmp[c] = d->cl[s->call_off + c];
                ctmp[c].ret = cls[ctmp[c].ret];
            }
            qsort(ctmp, s->n_calls, sizeof *ctmp, cmp_call);
            for (uint32_t c = 0; c < s->n_calls; c++) {
                pool[np++] = ctmp[c].rule;
                pool[np++] = ctmp[c].ret;
            }
            order[i] = i;
        }
        off[n] = np;
        sig_t sg = { pool, off };
        qsort_r(order, (size_t)n, sizeof *order, cmp_sig, &sg);
        int32_t k = -1;
        for (int32_t i = 0; i < n; i++) {
            bool same = i > 0;  /* equal signatures (the sort breaks ties by index: compare arrays) */
            if (same) {
                int32_t x = order[i - 1], y = order[i];
                size_t lx = off[x + 1] - off[x], ly = off[y + 1] - off[y];
                same = lx == ly && !memcmp(pool + off[x], pool + off[y], lx * sizeof *pool);
            }
            if (!same) k++;
            ncls[order[i]] = k;
        }
        int32_t m = k + 1;
        memcpy(cls, ncls, (size_t)n * sizeof *cls);
        if (m == n_cls) break;
        n_cls = m;
    }
    if (n_cls == n) { rc = 0; goto done; }
    /* renumber so the start state keeps index 0, then rebuild from one representative each */
    {
        int32_t *map = order;  /* class -> new index */
        for (int32_t c = 0; c < n_cls; c++) map[c] = -1;
        int32_t next = 0;
        map[cls[0]] = next++;
        for (int32_t i = 1; i < n; i++)
            if (map[cls[i]] < 0) map[cls[i]] = next++;
        gram_state_t *st = prism_malloc((size_t)n_cls * sizeof *st);
        gram_range_t *rg = prism_malloc((d->n_rg ? d->n_rg : 1) * sizeof *rg);
        gram_call_t *cl = prism_malloc((d->n_cl ? d->n_cl : 1) * sizeof *cl);
        if (!st || !rg || !cl) {
            prism_free(st); prism_free(rg); prism_free(cl);
            gram_fail(d->b, PRISM_ENOMEM, "", "out of memory compiling the grammar");
            goto done;
        }
        /* states in new-index order: walk representatives */
        int32_t *rep = ncls;
        for (int32_t i = n - 1; i >= 0; i--) rep[map[cls[i]]] = i;  /* lowest index represents */
        size_t nr = 0, nc = 0;
        for (int32_t ni = 0; ni < n_cls; ni++) {
            const gram_state_t *s = &d->st[rep[ni]];
            gram_state_t t = { .range_off = (uint32_t)nr, .call_off = (uint32_t)nc, .final = s->final };
            for (uint32_t r = 0; r < s->n_ranges; r++) {
                gram_range_t x = d->rg[s->range_off + r];
                x.to = map[cls[x.to]];
                if (nr > t.range_off && rg[nr - 1].to == x.to && rg[nr - 1].hi + 1 == x.lo) rg[nr - 1].hi = x.hi;
                else rg[nr++] = x;
            }
            size_t c0 = nc;
            for (uint32_t c = 0; c < s->n_calls; c++) {
                gram_call_t x = d->cl[s->call_off + c];
                x.ret = map[cls[x.ret]];
                bool dup = false;
                for (size_t q = c0; q < nc; q++) dup |= cl[q].rule == x.rule && cl[q].ret == x.ret;
                if (!dup) cl[nc++] = x;
            }
            t.n_ranges = (uint16_t)(nr - t.range_off);
            t.n_calls = (uint16_t)(nc - t.call_off);
            st[ni] = t;
        }
        prism_free(d->st);
        prism_free(d->rg);
        prism_free(d->cl);
        d->st = st;
        d->cap_st = (size_t)n_cls;
        d->rg = rg;
        d->cap_rg = d->n_rg ? d->n_rg : 1;
        d->n_rg = nr;
        d->cl = cl;
        d->cap_cl = d->n_cl ? d->n_cl : 1;
        d->n_cl = nc;
        d->n_sets = n_cls;
    }
    rc = 0;
done:
    prism_free(cls);
    prism_free(ncls);
    prism_free(order);
    prism_free(off);
    prism_free(pool);
    prism_free(ctmp);
    return rc;
}

static void grammar_free(prism_grammar_t *g);

int gram_compile(prism_grammar_builder_t *b, int32_t root, const prism_grammar_vocab_t *v, prism_grammar_t **out)
{
    int32_t root_rule = gx_rule_new(b);
    if (root_rule >= 0) gx_rule_set(b, root_rule, root);
    if (b->err) return b->err;
    for (size_t r = 0; r < b->n_rules; r++)
        if (b->rules[r] < 0) return gram_fail(b, PRISM_EINVAL, "", "internal: grammar rule %zu has no body", r);

    nfa_t f = { .b = b, .limit = b->lim.max_states * 4 };
    dfa_t d = { .b = b, .f = &f, .global_limit = (size_t)b->lim.max_states };
    prism_grammar_t *g = prism_calloc(1, sizeof *g);
    size_t n_rules = b->n_rules;
    int32_t *nfa_start = prism_malloc(n_rules * sizeof *nfa_start);
    int32_t *nfa_accept = prism_malloc(n_rules * sizeof *nfa_accept);
    size_t cap_states = 0, cap_ranges = 0, cap_calls = 0;
    if (!g || !nfa_start || !nfa_accept) { gram_fail(b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); goto fail; }
    atomic_init(&g->refs, 1);
    g->vocab = v;
    g->lim = b->lim;
    g->n_rules = n_rules;
    g->root_rule = root_rule;
    g->rule_start = prism_malloc(n_rules * sizeof *g->rule_start);
    if (!g->rule_start) { gram_fail(b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); goto fail; }

    for (size_t r = 0; r < n_rules && !b->err; r++) {
        nfa_start[r] = nfa_state(&f);
        nfa_accept[r] = nfa_emit(&f, b->rules[r], nfa_start[r]);
    }
    if (b->err) goto fail;
    d.mark = prism_calloc((size_t)f.n_st, sizeof *d.mark);
    d.stack = prism_malloc((size_t)f.n_st * sizeof *d.stack);
    if (!d.mark || !d.stack) { gram_fail(b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); goto fail; }

    for (size_t r = 0; r < n_rules; r++) {
        d.accept = nfa_accept[r];
        d.global_base = g->n_states;
        if (dfa_rule(&d, nfa_start[r]) < 0 || minimize(&d) < 0) goto fail;
        size_t base = g->n_states, n = (size_t)d.n_sets;
        g->rule_start[r] = (int32_t)base;
        if (ensure(b, (void **)&g->states, &cap_states, base + n, sizeof *g->states) < 0 ||
            ensure(b, (void **)&g->ranges, &cap_ranges, g->n_ranges + d.n_rg, sizeof *g->ranges) < 0 ||
            ensure(b, (void **)&g->calls, &cap_calls, g->n_calls + d.n_cl, sizeof *g->calls) < 0)
            goto fail;
        for (size_t i = 0; i < n; i++) {
            gram_state_t s = d.st[i];
            s.range_off += (uint32_t)g->n_ranges;
            s.call_off += (uint32_t)g->n_calls;
            g->states[base + i] = s;
        }
        for (size_t i = 0; i < d.n_rg; i++) {
            gram_range_t x = d.rg[i];
            x.to += (int32_t)base;
            g->ranges[g->n_ranges + i] = x;
        }
        for (size_t i = 0; i < d.n_cl; i++) {
            gram_call_t x = d.cl[i];
            x.ret += (int32_t)base;   /* callee stays a rule id: rule_start maps it */
            g->calls[g->n_calls + i] = x;
        }
        g->n_states += n;
        g->n_ranges += d.n_rg;
        g->n_calls += d.n_cl;
    }

    /* productivity: a state is productive when some path from it completes its rule */
    {
        uint8_t *prod = prism_calloc(g->n_states, 1);
        if (!prod) { gram_fail(b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); goto fail; }
        bool changed = true;
        while (changed) {
            changed = false;
            for (size_t s = 0; s < g->n_states; s++) {
                if (prod[s]) continue;
                const gram_state_t *st = &g->states[s];
                bool p = st->final;
                for (uint32_t i = 0; i < st->n_ranges && !p; i++) p = prod[g->ranges[st->range_off + i].to];
                for (uint32_t i = 0; i < st->n_calls && !p; i++) {
                    const gram_call_t *c = &g->calls[st->call_off + i];
                    p = prod[g->rule_start[c->rule]] && prod[c->ret];
                }
                if (p) { prod[s] = 1; changed = true; }
            }
        }
        if (!prod[g->rule_start[root_rule]]) {
            prism_free(prod);
            gram_fail(b, PRISM_EINVAL, "", "the grammar matches no output at all (e.g. an empty enum or "
                                           "contradictory constraints)");
            goto fail;
        }
        /* prune edges into unproductive states, compacting in place */
        size_t nr = 0, nc = 0;
        for (size_t s = 0; s < g->n_states; s++) {
            gram_state_t *st = &g->states[s];
            uint32_t ro = (uint32_t)nr, co = (uint32_t)nc;
            for (uint32_t i = 0; i < st->n_ranges; i++) {
                gram_range_t x = g->ranges[st->range_off + i];
                if (prod[x.to]) g->ranges[nr++] = x;
            }
            for (uint32_t i = 0; i < st->n_calls; i++) {
                gram_call_t x = g->calls[st->call_off + i];
                if (prod[g->rule_start[x.rule]] && prod[x.ret]) g->calls[nc++] = x;
            }
            st->range_off = ro;
            st->n_ranges = (uint16_t)(nr - ro);
            st->call_off = co;
            st->n_calls = (uint16_t)(nc - co);
        }
        g->n_ranges = nr;
        g->n_calls = nc;
        prism_free(prod);
    }

    g->cache = prism_calloc(g->n_states ? g->n_states : 1, sizeof *g->cache);
    if (!g->cache) { gram_fail(b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); goto fail; }
    pthread_mutex_init(&g->cache_lock, NULL);
    prism_free(f.head); prism_free(f.edges);
    prism_free(d.mark); prism_free(d.stack); prism_free(d.pool); prism_free(d.set_off); prism_free(d.hash);
    prism_free(d.rg); prism_free(d.cl); prism_free(d.st);
    prism_free(nfa_start); prism_free(nfa_accept);
    *out = g;
    return PRISM_OK;

fail:
    prism_free(f.head); prism_free(f.edges);
    prism_free(d.mark); prism_free(d.stack); prism_free(d.pool); prism_free(d.set_off); prism_free(d.hash);
    prism_free(d.rg); prism_free(d.cl); prism_free(d.st);
    prism_free(nfa_start); prism_free(nfa_accept);
    if (g) {
        g->cache = NULL;
        grammar_free(g);
    }
    return b->err ? b->err : PRISM_ENOMEM;
}

static void grammar_free(prism_grammar_t *g)
{
    if (g->cache) {
        for (size_t s = 0; s < g->n_states; s++) {
            gram_cache_entry_t *e = atomic_load(&g->cache[s]);
            if (!e) continue;
            prism_free(e->acc);
            prism_free(e->unc);
            prism_free(e->unc_lcp);
            prism_free(e);
        }
        prism_free(g->cache);
        pthread_mutex_destroy(&g->cache_lock);
    }
    if (g->cache_ctx) {
        gram_ctx_free(g->cache_ctx);
        prism_free(g->cache_ctx);
    }
    prism_free(g->cache_mask);
    prism_free(g->states);
    prism_free(g->ranges);
    prism_free(g->calls);
    prism_free(g->rule_start);
    prism_free(g);
}

void prism_grammar_retain(prism_grammar_t *g) { atomic_fetch_add(&g->refs, 1); }

void prism_grammar_release(prism_grammar_t *g)
{
    if (g && atomic_fetch_sub(&g->refs, 1) == 1) grammar_free(g);
}

size_t prism_grammar_n_states(const prism_grammar_t *g) { return g->n_states; }
const prism_grammar_vocab_t *prism_grammar_vocab(const prism_grammar_t *g) { return g->vocab; }
