/* Expression IR -> per-rule automata over bytes with call edges (a recursive transition network).
 *
 * Each rule body becomes a Thompson NFA (edges: epsilon, byte, byte class, call), then a DFA by
 * subset construction in which a call to rule R is one more symbol, then the minimal DFA
 * (Valmari-Lehtinen partition refinement, O(m log n) in transitions m and states n).
 * Determinizing makes alternatives that share prefixes (enum values, choices, keys) one path, so
 * a matcher keeps few parallel stacks.
 *
 * Subset construction can cost exponentially more than the NFA (`(a|b)*a(a|b){k}` has 2^k
 * states). A rule whose construction spends more than a small multiple of its NFA's size is left
 * an NFA instead (jump states whose epsilon closures a matcher follows: gram_internal.h), as
 * regex engines fall back from a DFA to NFA simulation: a matcher then carries one stack per live
 * NFA state, bounded by max_stacks (paths beyond it are pruned; what is produced still matches).
 * Everything else the compiler does is charged to a budget of wall time and scratch memory
 * (limits), past which it refuses with PRISM_ELIMIT. Rules that can never complete are pruned; a
 * grammar whose root cannot complete is an error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gram_internal.h"

/* ---- the budget ---- */
#define GRAM_CLOCK_EVERY  (1u << 15)   /* work units between two looks at the clock */
/* A rule is determinized while that costs at most GRAM_DET_MIN_WORK + GRAM_DET_PER_NFA work units
 * per NFA state and edge of the rule (and never more than GRAM_DET_MAX_WORK, about half a second);
 * past that it stays an NFA. The grammars of the tests (random JSON schemas, tool calls, regexes,
 * choices) take at most 110 per NFA state and edge. */
#define GRAM_DET_MIN_WORK (1u << 16)
#define GRAM_DET_PER_NFA  512u
#define GRAM_DET_MAX_WORK (1u << 26)
#define GRAM_GAVE_UP      1            /* dfa_rule: not determinized (not an error) */

/* The compile's clock: this thread's CPU time, so a loaded machine (other processes, other threads)
 * does not turn a grammar that compiles into a refusal, while a compile that works too long is
 * stopped all the same. */
static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int spend(prism_grammar_builder_t *b, uint64_t units)
{
    if (b->err) return -1;
    b->spent.work += units;
    if (b->spent.work < b->spent.next_clock) return 0;
    b->spent.next_clock = b->spent.work + GRAM_CLOCK_EVERY;
    if (cpu_ns() <= b->spent.deadline_ns) return 0;
    return gram_fail(b, PRISM_ELIMIT, "", "grammar too complex (compiling it took over %d ms of CPU)",
                     b->lim.max_compile_ms);
}

/* Memory the compile holds: charged as its buffers grow, all of it given back when it ends. */
static int hold(prism_grammar_builder_t *b, size_t bytes)
{
    if (b->err) return -1;
    b->spent.bytes += bytes;
    if (b->spent.bytes > (size_t)b->lim.max_compile_bytes)
        return gram_fail(b, PRISM_ELIMIT, "", "grammar too complex (compiling it needs over %d bytes of memory)",
                         b->lim.max_compile_bytes);
    return spend(b, bytes / 16);
}

static int ensure(prism_grammar_builder_t *b, void **p, size_t *cap, size_t need, size_t elem)
{
    if (b->err) return -1;
    if (need <= *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 256;
    while (nc < need) nc *= 2;
    if (hold(b, (nc - *cap) * elem) < 0) return -1;
    void *q = prism_realloc(*p, nc * elem);
    if (!q) return gram_fail(b, PRISM_ENOMEM, "", "out of memory compiling the grammar");
    *p = q;
    *cap = nc;
    return 0;
}

/* A scratch array of n elements, charged (freed with prism_free: the charge ends with the compile). */
static void *scratch(prism_grammar_builder_t *b, size_t n, size_t elem)
{
    if (hold(b, n * elem) < 0) return NULL;
    void *p = prism_malloc(n ? n * elem : 1);
    if (!p) gram_fail(b, PRISM_ENOMEM, "", "out of memory compiling the grammar");
    return p;
}

typedef enum { NE_EPS, NE_BYTE, NE_CLASS, NE_CALL } ne_kind_t;
typedef struct { uint8_t kind; int32_t arg, to, next; } nedge_t;

typedef struct {
    prism_grammar_builder_t *b;
    int32_t *head;   int32_t n_st; size_t cap_st;
    nedge_t *edges;  int32_t n_ed; size_t cap_ed;
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
    if (ensure(f->b, (void **)&f->head, &f->cap_st, (size_t)f->n_st + 1, sizeof *f->head) < 0) return -1;
    f->head[f->n_st] = -1;
    return f->n_st++;
}

static int nfa_edge(nfa_t *f, int32_t from, ne_kind_t k, int32_t arg, int32_t to)
{
    if (f->b->err || from < 0 || to < 0) return -1;
    if (ensure(f->b, (void **)&f->edges, &f->cap_ed, (size_t)f->n_ed + 1, sizeof *f->edges) < 0) return -1;
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
    size_t *set_off; int32_t n_sets; size_t cap_sets;
    int32_t *hash; uint32_t hash_mask;
    /* scratch of one state's expansion */
    int32_t *eds; size_t cap_eds;         /* candidate edges of the current set */
    int32_t *tmp; size_t cap_tmp;         /* raw targets of a call */
    int32_t *byte_tg; size_t cap_byte;    /* [256][n_eds] targets per byte */
    /* output of this rule, local ids */
    gram_range_t *rg; size_t n_rg, cap_rg;
    gram_call_t *cl;  size_t n_cl, cap_cl;
    int32_t *ep;      size_t n_ep, cap_ep;
    gram_state_t *st; size_t cap_st;
    size_t global_base, global_limit;
    uint64_t det_limit;      /* work this rule's subset construction may take */
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

static uint64_t log2_ceil(uint64_t n)
{
    uint64_t k = 1;
    while (n >> k) k++;
    return k;
}

/* Epsilon closure of in[0..n) into d->pool at its end (sorted); returns the length. */
static size_t closure(dfa_t *d, const int32_t *in, size_t n)
{
    if (++d->gen == 0) { memset(d->mark, 0, (size_t)d->f->n_st * sizeof *d->mark); d->gen = 1; }
    size_t start = d->n_pool, sp = 0, scanned = 0;
    for (size_t i = 0; i < n; i++)
        if (d->mark[in[i]] != d->gen) { d->mark[in[i]] = d->gen; d->stack[sp++] = in[i]; }
    while (sp) {
        int32_t s = d->stack[--sp];
        if (ensure(d->b, (void **)&d->pool, &d->cap_pool, d->n_pool + 1, sizeof *d->pool) < 0) return 0;
        d->pool[d->n_pool++] = s;
        for (int32_t e = d->f->head[s]; e >= 0; e = d->f->edges[e].next) {
            const nedge_t *ed = &d->f->edges[e];
            scanned++;
            if (ed->kind == NE_EPS && d->mark[ed->to] != d->gen) { d->mark[ed->to] = d->gen; d->stack[sp++] = ed->to; }
        }
    }
    size_t m = d->n_pool - start;
    qsort(d->pool + start, m, sizeof *d->pool, cmp_i32);
    spend(d->b, n + scanned + m * log2_ceil(m));
    return m;
}

static int rehash(dfa_t *d)
{
    uint32_t nm = d->hash_mask ? d->hash_mask * 2 + 1 : 1023;
    int32_t *h = scratch(d->b, (size_t)nm + 1, sizeof *h);
    if (!h) return -1;
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

/* Interns the set just closed at the end of the pool: returns its DFA id (new or existing), -1 on
 * error, -2 when the grammar's state bound is reached (the rule then stays an NFA). */
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
            spend(d->b, n);
            return i;
        }
    }
    if (d->global_base + (size_t)d->n_sets + 1 > d->global_limit) return -2;
    if (ensure(d->b, (void **)&d->set_off, &d->cap_sets, (size_t)d->n_sets + 2, sizeof *d->set_off) < 0) return -1;
    int32_t id = d->n_sets++;
    d->set_off[id] = start;
    d->set_off[id + 1] = start + n;
    d->hash[k] = id;
    if ((uint32_t)d->n_sets * 2 > d->hash_mask && rehash(d) < 0) return -1;
    return id;
}

/* Subset construction of the rule whose NFA starts at nfa_start: 0, GRAM_GAVE_UP past the rule's
 * budget or the grammar's state bound (the caller makes it an NFA), -1 on error. */
static int dfa_rule(dfa_t *d, int32_t nfa_start)
{
    prism_grammar_builder_t *b = d->b;
    uint64_t w0 = b->spent.work;
    d->n_sets = 0;
    d->n_pool = 0;
    d->n_rg = d->n_cl = d->n_ep = 0;
    if (d->hash) memset(d->hash, 0xff, ((size_t)d->hash_mask + 1) * sizeof *d->hash);
    else if (rehash(d) < 0) return -1;
    if (ensure(b, (void **)&d->set_off, &d->cap_sets, 2, sizeof *d->set_off) < 0) return -1;
    d->set_off[0] = 0;
    size_t n = closure(d, &nfa_start, 1);
    if (intern(d, 0, n) < 0) return b->err ? -1 : GRAM_GAVE_UP;

    int32_t byte_n[256];
    for (int32_t cur = 0; cur < d->n_sets; cur++) {
        if (b->err) return -1;
        if (b->spent.work - w0 > d->det_limit) return GRAM_GAVE_UP;
        if (ensure(b, (void **)&d->st, &d->cap_st, (size_t)cur + 1, sizeof *d->st) < 0) return -1;
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
                if (ensure(b, (void **)&d->eds, &d->cap_eds, (size_t)n_eds + 1, sizeof *d->eds) < 0) return -1;
                d->eds[n_eds++] = e;
            }
        }
        if (ensure(b, (void **)&d->tmp, &d->cap_tmp, (size_t)n_eds + 1, sizeof *d->tmp) < 0 ||
            ensure(b, (void **)&d->byte_tg, &d->cap_byte, (size_t)n_eds * 256, sizeof *d->byte_tg) < 0 ||
            spend(b, 32 + (uint64_t)(d->set_off[cur + 1] - d->set_off[cur])) < 0)
            return -1;
        const int32_t *eds = d->eds;
        int32_t *byte_tg = d->byte_tg, *tmp = d->tmp;
        /* byte transitions: per byte, the targets of the member edges that take it (in edge
         * order), then grouped into ranges of equal target */
        memset(byte_n, 0, sizeof byte_n);
        uint64_t bits_seen = 0;
        for (int32_t i = 0; i < n_eds; i++) {
            const nedge_t *ed = &d->f->edges[eds[i]];
            if (ed->kind == NE_BYTE) {
                byte_tg[ed->arg * n_eds + byte_n[ed->arg]++] = ed->to;
                bits_seen++;
            } else if (ed->kind == NE_CLASS) {
                const gx_class_t *cl = &b->classes[ed->arg];
                for (int w = 0; w < 8; w++)
                    for (uint32_t bits = cl->w[w]; bits; bits &= bits - 1) {
                        int bt = w * 32 + __builtin_ctz(bits);
                        byte_tg[bt * n_eds + byte_n[bt]++] = ed->to;
                        bits_seen++;
                    }
            }
        }
        if (spend(b, bits_seen) < 0) return -1;
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
                    if (b->err) return -1;
                    to = intern(d, start, m);
                    if (to < 0) return b->err ? -1 : GRAM_GAVE_UP;
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
                    if (ensure(b, (void **)&d->rg, &d->cap_rg, d->n_rg + 1, sizeof *d->rg) < 0) return -1;
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
            if (spend(b, (uint64_t)n_eds * 2) < 0) return -1;
            size_t start = d->n_pool;
            size_t m = closure(d, tmp, (size_t)nr);
            if (b->err) return -1;
            int32_t to = intern(d, start, m);
            if (to < 0) return b->err ? -1 : GRAM_GAVE_UP;
            if (ensure(b, (void **)&d->cl, &d->cap_cl, d->n_cl + 1, sizeof *d->cl) < 0) return -1;
            d->cl[d->n_cl++] = (gram_call_t){ ed->arg, to };
        }
        gs = &d->st[cur];
        gs->n_ranges = (uint16_t)(d->n_rg - gs->range_off);
        gs->n_calls = (uint16_t)(d->n_cl - gs->call_off);
        if (d->n_rg - gs->range_off > 256 || d->n_cl - gs->call_off > 60000)
            return gram_fail(b, PRISM_ELIMIT, "", "grammar too complex (a state with too many calls)");
    }
    return b->err ? -1 : 0;
}

/* ---- the NFA form of a rule (subset construction gave up on it) ----
 * A jump for the start and for every state a non-epsilon edge enters (local ids 0.., the start
 * first), then a leaf per non-epsilon edge and one for the accept state. A jump's eps are the
 * leaves of its epsilon closure, so a matcher reaches every live NFA state in one hop and never
 * follows a chain (leaves have no eps). States [lo, hi) and their edges are the rule's NFA. */
static int nfa_rule(dfa_t *d, int32_t lo, int32_t hi, int32_t start)
{
    prism_grammar_builder_t *b = d->b;
    const nfa_t *f = d->f;
    int32_t n = hi - lo;
    int32_t *jump = scratch(b, (size_t)n, sizeof *jump);      /* NFA state -> jump id or -1 */
    int32_t *leaf0 = scratch(b, (size_t)n, sizeof *leaf0);    /* NFA state -> its first leaf id */
    int32_t *qof = scratch(b, (size_t)n, sizeof *qof);        /* jump id -> NFA state */
    int rc = -1;
    if (!jump || !leaf0 || !qof) goto done;
    d->n_sets = 0;
    d->n_rg = d->n_cl = d->n_ep = 0;
    for (int32_t q = 0; q < n; q++) jump[q] = -1;
    int32_t n_jump = 0, n_leaf = 0;
    jump[start - lo] = n_jump++;
    for (int32_t q = lo; q < hi; q++)
        for (int32_t e = f->head[q]; e >= 0; e = f->edges[e].next)
            if (f->edges[e].kind != NE_EPS && jump[f->edges[e].to - lo] < 0) jump[f->edges[e].to - lo] = n_jump++;
    for (int32_t q = lo; q < hi; q++) {
        leaf0[q - lo] = n_jump + n_leaf;
        for (int32_t e = f->head[q]; e >= 0; e = f->edges[e].next) n_leaf += f->edges[e].kind != NE_EPS;
    }
    int32_t accept_leaf = n_jump + n_leaf, n_states = accept_leaf + 1;
    if (d->global_base + (size_t)n_states > d->global_limit) {
        gram_fail(b, PRISM_ELIMIT, "", "grammar too complex (over %zu states)", d->global_limit);
        goto done;
    }
    if (ensure(b, (void **)&d->st, &d->cap_st, (size_t)n_states, sizeof *d->st) < 0 || spend(b, (uint64_t)n * 4) < 0)
        goto done;
    memset(d->st, 0, (size_t)n_states * sizeof *d->st);
    d->n_sets = n_states;
    /* jumps, in id order (offsets grow with state ids: pruning compacts in place): the leaves of
     * each closure. */
    for (int32_t q = lo; q < hi; q++)
        if (jump[q - lo] >= 0) qof[jump[q - lo]] = q;
    for (int32_t j = 0; j < n_jump; j++) {
        int32_t q = qof[j];
        gram_state_t *js = &d->st[j];
        js->eps_off = (uint32_t)d->n_ep;
        if (++d->gen == 0) { memset(d->mark, 0, (size_t)f->n_st * sizeof *d->mark); d->gen = 1; }
        size_t sp = 0, scanned = 0;
        d->mark[q] = d->gen;
        d->stack[sp++] = q;
        while (sp) {
            int32_t s = d->stack[--sp];
            if (s == d->accept) {
                if (ensure(b, (void **)&d->ep, &d->cap_ep, d->n_ep + 1, sizeof *d->ep) < 0) goto done;
                d->ep[d->n_ep++] = accept_leaf;
            }
            int32_t k = leaf0[s - lo];
            for (int32_t e = f->head[s]; e >= 0; e = f->edges[e].next) {
                const nedge_t *ed = &f->edges[e];
                scanned++;
                if (ed->kind == NE_EPS) {
                    if (d->mark[ed->to] != d->gen) { d->mark[ed->to] = d->gen; d->stack[sp++] = ed->to; }
                    continue;
                }
                if (ensure(b, (void **)&d->ep, &d->cap_ep, d->n_ep + 1, sizeof *d->ep) < 0) goto done;
                d->ep[d->n_ep++] = k++;
            }
        }
        if (spend(b, scanned) < 0) goto done;
        js = &d->st[j];
        js->n_eps = (uint32_t)(d->n_ep - js->eps_off);
    }
    /* leaves: one edge each */
    for (int32_t q = lo; q < hi; q++) {
        int32_t k = leaf0[q - lo];
        for (int32_t e = f->head[q]; e >= 0; e = f->edges[e].next) {
            const nedge_t *ed = &f->edges[e];
            if (ed->kind == NE_EPS) continue;
            gram_state_t *ls = &d->st[k++];
            int32_t to = jump[ed->to - lo];
            ls->range_off = (uint32_t)d->n_rg;
            ls->call_off = (uint32_t)d->n_cl;
            if (ed->kind == NE_CALL) {
                if (ensure(b, (void **)&d->cl, &d->cap_cl, d->n_cl + 1, sizeof *d->cl) < 0) goto done;
                d->cl[d->n_cl++] = (gram_call_t){ ed->arg, to };
                ls->n_calls = 1;
                continue;
            }
            gx_class_t one = {0};
            if (ed->kind == NE_BYTE) gx_class_set(&one, (unsigned)ed->arg);
            const gx_class_t *cl = ed->kind == NE_BYTE ? &one : &b->classes[ed->arg];
            for (int bt = 0; bt < 256;) {
                if (!gx_class_has(cl, (unsigned)bt)) { bt++; continue; }
                int hi_b = bt;
                while (hi_b + 1 < 256 && gx_class_has(cl, (unsigned)hi_b + 1)) hi_b++;
                if (ensure(b, (void **)&d->rg, &d->cap_rg, d->n_rg + 1, sizeof *d->rg) < 0) goto done;
                d->rg[d->n_rg++] = (gram_range_t){ (uint8_t)bt, (uint8_t)hi_b, to };
                ls->n_ranges++;
                bt = hi_b + 1;
            }
        }
    }
    d->st[accept_leaf].final = 1;
    rc = 0;
done:
    prism_free(jump);
    prism_free(leaf0);
    prism_free(qof);
    return b->err ? -1 : rc;
}

/* ---- minimization (Valmari & Lehtinen, "Fast brief practical DFA minimization", 2012) ----
 * Subset construction leaves equivalent states apart (after an ASCII character and after a
 * multi-byte one, a JSON string is in "the same" place through different NFA sets). Merging
 * them matters beyond size: every distinct state costs a mask-cache fill over the vocabulary.
 * Hopcroft's refinement over transitions labelled by byte class (the coarsest partition of the
 * 256 bytes that the rule's ranges respect) or by callee; a missing transition differs from any
 * transition, as in Moore's refinement, so the result is the coarsest partition that respects
 * finality, bytes and calls. O(m log n): a long literal (a chain) no longer costs O(n^2). */
typedef struct { int32_t z, *E, *L, *S, *F, *P; } part_t;
typedef struct { int32_t *M, *W, w; } part_work_t;

static void part_mark(part_t *p, part_work_t *k, int32_t e)
{
    int32_t s = p->S[e], i = p->L[e], j = p->F[s] + k->M[s];
    p->E[i] = p->E[j];
    p->L[p->E[i]] = i;
    p->E[j] = e;
    p->L[e] = j;
    if (!k->M[s]++) k->W[k->w++] = s;
}

static void part_split(part_t *p, part_work_t *k)
{
    while (k->w) {
        int32_t s = k->W[--k->w], j = p->F[s] + k->M[s];
        if (j == p->P[s]) { k->M[s] = 0; continue; }
        int32_t z = p->z++;
        if (k->M[s] <= p->P[s] - j) { p->F[z] = p->F[s]; p->P[z] = p->F[s] = j; }
        else { p->P[z] = p->P[s]; p->F[z] = p->P[s] = j; }
        for (int32_t i = p->F[z]; i < p->P[z]; i++) p->S[p->E[i]] = z;
        k->M[s] = k->M[z] = 0;
    }
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Rebuilds the rule's tables from one representative per class (cls[state], n_cls classes). */
static int rebuild(dfa_t *d, const int32_t *cls, int32_t n_cls)
{
    int32_t n = d->n_sets;
    int32_t *map = scratch(d->b, (size_t)n_cls, sizeof *map), *rep = scratch(d->b, (size_t)n_cls, sizeof *rep);
    gram_state_t *st = scratch(d->b, (size_t)n_cls, sizeof *st);
    gram_range_t *rg = scratch(d->b, d->n_rg ? d->n_rg : 1, sizeof *rg);
    gram_call_t *cl = scratch(d->b, d->n_cl ? d->n_cl : 1, sizeof *cl);
    if (!map || !rep || !st || !rg || !cl) {
        prism_free(map); prism_free(rep); prism_free(st); prism_free(rg); prism_free(cl);
        return -1;
    }
    /* renumber so the start state keeps index 0 */
    for (int32_t c = 0; c < n_cls; c++) map[c] = -1;
    int32_t next = 0;
    for (int32_t i = 0; i < n; i++)
        if (map[cls[i]] < 0) map[cls[i]] = next++;
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
        for (uint32_t c = 0; c < s->n_calls; c++) {
            gram_call_t x = d->cl[s->call_off + c];
            x.ret = map[cls[x.ret]];
            cl[nc++] = x;   /* one call per callee in a DFA state: no duplicates */
        }
        t.n_ranges = (uint16_t)(nr - t.range_off);
        t.n_calls = (uint16_t)(nc - t.call_off);
        st[ni] = t;
    }
    prism_free(map);
    prism_free(rep);
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
    return 0;
}

static int minimize(dfa_t *d)
{
    prism_grammar_builder_t *b = d->b;
    int32_t n = d->n_sets;
    if (n <= 1) return 0;
    /* byte classes: cut before every range start and after every range end */
    uint8_t cut[257] = {0};
    int32_t cls_of[256];
    cut[0] = 1;
    for (size_t r = 0; r < d->n_rg; r++) {
        cut[d->rg[r].lo] = 1;
        cut[d->rg[r].hi + 1] = 1;
    }
    for (int bt = 0, c = -1; bt < 256; bt++) cls_of[bt] = c += cut[bt];
    size_t m = d->n_cl;
    for (size_t r = 0; r < d->n_rg; r++) m += (size_t)(cls_of[d->rg[r].hi] - cls_of[d->rg[r].lo] + 1);
    if (m > INT32_MAX / 2) return gram_fail(b, PRISM_ELIMIT, "", "grammar too complex (too many transitions)");
    size_t mx = (size_t)(m > (size_t)n ? m : (size_t)n) + 1;
    int rc = -1;
    int32_t *T = scratch(b, m, sizeof *T), *H = scratch(b, m, sizeof *H);
    uint64_t *key = scratch(b, m, sizeof *key);
    int32_t *A = scratch(b, m, sizeof *A), *adj = scratch(b, (size_t)n + 1, sizeof *adj);
    int32_t *M = scratch(b, mx, sizeof *M), *W = scratch(b, mx, sizeof *W);
    int32_t *bufB = scratch(b, (size_t)n * 5, sizeof *bufB), *bufC = scratch(b, m * 5 + 1, sizeof *bufC);
    if (!T || !H || !key || !A || !adj || !M || !W || !bufB || !bufC ||
        spend(b, (uint64_t)(m + (size_t)n) * (2 + log2_ceil(m + (size_t)n))) < 0)
        goto done;
    /* transitions, keyed by label (byte class, or 256 + callee) */
    size_t t = 0;
    for (int32_t s = 0; s < n; s++) {
        const gram_state_t *gs = &d->st[s];
        for (uint32_t r = 0; r < gs->n_ranges; r++) {
            const gram_range_t *x = &d->rg[gs->range_off + r];
            for (int32_t c = cls_of[x->lo]; c <= cls_of[x->hi]; c++, t++) {
                T[t] = s;
                H[t] = x->to;
                key[t] = (uint64_t)c << 32 | t;
            }
        }
        for (uint32_t c = 0; c < gs->n_calls; c++, t++) {
            T[t] = s;
            H[t] = d->cl[gs->call_off + c].ret;
            key[t] = (uint64_t)(256u + (uint32_t)d->cl[gs->call_off + c].rule) << 32 | t;
        }
    }
    memset(M, 0, mx * sizeof *M);
    part_work_t wk = { M, W, 0 };
    /* blocks: all states, then finals split off */
    part_t B = { 1, bufB, bufB + n, bufB + 2 * n, bufB + 3 * n, bufB + 4 * n };
    for (int32_t i = 0; i < n; i++) B.E[i] = B.L[i] = i, B.S[i] = 0;
    B.F[0] = 0;
    B.P[0] = n;
    for (int32_t i = 0; i < n; i++)
        if (d->st[i].final) part_mark(&B, &wk, i);
    part_split(&B, &wk);
    /* cords: transitions grouped by label */
    qsort(key, m, sizeof *key, cmp_u64);
    part_t C = { 0, bufC, bufC + m, bufC + 2 * m, bufC + 3 * m, bufC + 4 * m };
    for (size_t i = 0; i < m; i++) {
        int32_t e = (int32_t)(uint32_t)key[i];
        if (i == 0 || key[i] >> 32 != key[i - 1] >> 32) {
            if (i) C.P[C.z - 1] = (int32_t)i;
            C.F[C.z++] = (int32_t)i;
        }
        C.E[i] = e;
        C.L[e] = (int32_t)i;
        C.S[e] = C.z - 1;
    }
    if (m) C.P[C.z - 1] = (int32_t)m;
    /* transitions by head */
    memset(adj, 0, ((size_t)n + 1) * sizeof *adj);
    for (size_t i = 0; i < m; i++) adj[H[i]]++;
    for (int32_t q = 0; q < n; q++) adj[q + 1] += adj[q];
    for (size_t i = m; i-- > 0;) A[--adj[H[i]]] = (int32_t)i;
    /* refine: each cord splits blocks by its tails, each new block splits cords by their heads */
    for (int32_t c = 0, bk = 1; c < C.z; c++) {
        for (int32_t i = C.F[c]; i < C.P[c]; i++) part_mark(&B, &wk, T[C.E[i]]);
        part_split(&B, &wk);
        for (; bk < B.z; bk++) {
            for (int32_t i = B.F[bk]; i < B.P[bk]; i++)
                for (int32_t j = adj[B.E[i]]; j < adj[B.E[i] + 1]; j++) part_mark(&C, &wk, A[j]);
            part_split(&C, &wk);
        }
    }
    rc = B.z == n ? 0 : rebuild(d, B.S, B.z);
done:
    prism_free(T); prism_free(H); prism_free(key); prism_free(A); prism_free(adj);
    prism_free(M); prism_free(W); prism_free(bufB); prism_free(bufC);
    return b->err ? -1 : rc;
}

static void dfa_free(nfa_t *f, dfa_t *d)
{
    prism_free(f->head); prism_free(f->edges);
    prism_free(d->mark); prism_free(d->stack); prism_free(d->pool); prism_free(d->set_off); prism_free(d->hash);
    prism_free(d->eds); prism_free(d->tmp); prism_free(d->byte_tg);
    prism_free(d->rg); prism_free(d->cl); prism_free(d->ep); prism_free(d->st);
}

/* A state is productive when some path from it completes its rule; edges into unproductive
 * states are dropped. Found backwards from the final states over reversed edges (a worklist:
 * O(states + edges), where sweeping until nothing changes cost a pass per state of a chain). A
 * call makes its state productive once both the callee's start and the return are. */
static int prune_unproductive(prism_grammar_builder_t *b, prism_grammar_t *g)
{
    size_t n = g->n_states, n_dep = g->n_ranges + g->n_eps + 2 * g->n_calls;
    uint8_t *prod = scratch(b, n, 1);
    uint32_t *head = scratch(b, n + 1, sizeof *head);
    /* dependents of state t: head[t] .. head[t+1] in dep; an entry is a state (edge into t) or,
     * with the top bit, a call index (t is its callee's start or its return) */
    uint32_t *dep = scratch(b, n_dep, sizeof *dep);
    int32_t *owner = scratch(b, g->n_calls, sizeof *owner);   /* call -> its state */
    int32_t *queue = scratch(b, n, sizeof *queue);
    int rc = -1;
    if (!prod || !head || !dep || !owner || !queue || spend(b, 4 * (n + n_dep)) < 0) goto done;
    if (g->n_calls >= 0x80000000u || n >= 0x80000000u) { gram_fail(b, PRISM_ELIMIT, "", "grammar too large"); goto done; }
    memset(prod, 0, n);
    memset(head, 0, (n + 1) * sizeof *head);
    for (size_t s = 0; s < n; s++) {
        const gram_state_t *st = &g->states[s];
        for (uint32_t i = 0; i < st->n_ranges; i++) head[g->ranges[st->range_off + i].to]++;
        for (uint32_t i = 0; i < st->n_eps; i++) head[g->eps[st->eps_off + i]]++;
        for (uint32_t i = 0; i < st->n_calls; i++) {
            const gram_call_t *c = &g->calls[st->call_off + i];
            head[g->rule_start[c->rule]]++;
            head[c->ret]++;
            owner[st->call_off + i] = (int32_t)s;
        }
    }
    for (size_t t = 0; t < n; t++) head[t + 1] += head[t];
    for (size_t s = 0; s < n; s++) {
        const gram_state_t *st = &g->states[s];
        for (uint32_t i = 0; i < st->n_ranges; i++) dep[--head[g->ranges[st->range_off + i].to]] = (uint32_t)s;
        for (uint32_t i = 0; i < st->n_eps; i++) dep[--head[g->eps[st->eps_off + i]]] = (uint32_t)s;
        for (uint32_t i = 0; i < st->n_calls; i++) {
            const gram_call_t *c = &g->calls[st->call_off + i];
            dep[--head[g->rule_start[c->rule]]] = 0x80000000u | (st->call_off + i);
            dep[--head[c->ret]] = 0x80000000u | (st->call_off + i);
        }
    }
    size_t qh = 0, qt = 0;
    for (size_t s = 0; s < n; s++)
        if (g->states[s].final) { prod[s] = 1; queue[qt++] = (int32_t)s; }
    while (qh < qt) {
        int32_t t = queue[qh++];
        for (uint32_t i = head[t]; i < head[t + 1]; i++) {
            int32_t s;
            if (dep[i] & 0x80000000u) {
                const gram_call_t *c = &g->calls[dep[i] & 0x7fffffffu];
                if (!prod[g->rule_start[c->rule]] || !prod[c->ret]) continue;
                s = owner[dep[i] & 0x7fffffffu];
            } else {
                s = (int32_t)dep[i];
            }
            if (!prod[s]) { prod[s] = 1; queue[qt++] = s; }
        }
    }
    rc = 0;
done:
    prism_free(head);
    prism_free(dep);
    prism_free(owner);
    prism_free(queue);
    if (rc < 0) {
        prism_free(prod);
        return -1;
    }
    if (!prod[g->rule_start[g->root_rule]]) {
        prism_free(prod);
        return gram_fail(b, PRISM_EINVAL, "", "the grammar matches no output at all (e.g. an empty enum or "
                                              "contradictory constraints)");
    }
    /* compact in place */
    size_t nr = 0, nc = 0, ne = 0;
    for (size_t s = 0; s < g->n_states; s++) {
        gram_state_t *st = &g->states[s];
        uint32_t ro = (uint32_t)nr, co = (uint32_t)nc, eo = (uint32_t)ne;
        for (uint32_t i = 0; i < st->n_ranges; i++) {
            gram_range_t x = g->ranges[st->range_off + i];
            if (prod[x.to]) g->ranges[nr++] = x;
        }
        for (uint32_t i = 0; i < st->n_calls; i++) {
            gram_call_t x = g->calls[st->call_off + i];
            if (prod[g->rule_start[x.rule]] && prod[x.ret]) g->calls[nc++] = x;
        }
        for (uint32_t i = 0; i < st->n_eps; i++) {
            int32_t x = g->eps[st->eps_off + i];
            if (prod[x]) g->eps[ne++] = x;
        }
        st->range_off = ro;
        st->n_ranges = (uint16_t)(nr - ro);
        st->call_off = co;
        st->n_calls = (uint16_t)(nc - co);
        st->eps_off = eo;
        st->n_eps = (uint32_t)(ne - eo);
    }
    g->n_ranges = nr;
    g->n_calls = nc;
    g->n_eps = ne;
    prism_free(prod);
    return 0;
}

/* Appends the rule just built in d to g's tables. */
static int append_rule(prism_grammar_builder_t *b, prism_grammar_t *g, const dfa_t *d, size_t caps[4])
{
    size_t base = g->n_states, n = (size_t)d->n_sets;
    if (ensure(b, (void **)&g->states, &caps[0], base + n, sizeof *g->states) < 0 ||
        ensure(b, (void **)&g->ranges, &caps[1], g->n_ranges + d->n_rg, sizeof *g->ranges) < 0 ||
        ensure(b, (void **)&g->calls, &caps[2], g->n_calls + d->n_cl, sizeof *g->calls) < 0 ||
        ensure(b, (void **)&g->eps, &caps[3], g->n_eps + d->n_ep, sizeof *g->eps) < 0)
        return -1;
    for (size_t i = 0; i < n; i++) {
        gram_state_t s = d->st[i];
        s.range_off += (uint32_t)g->n_ranges;
        s.call_off += (uint32_t)g->n_calls;
        s.eps_off += (uint32_t)g->n_eps;
        g->states[base + i] = s;
    }
    for (size_t i = 0; i < d->n_rg; i++) {
        gram_range_t x = d->rg[i];
        x.to += (int32_t)base;
        g->ranges[g->n_ranges + i] = x;
    }
    for (size_t i = 0; i < d->n_cl; i++) {
        gram_call_t x = d->cl[i];
        x.ret += (int32_t)base;   /* callee stays a rule id: rule_start maps it */
        g->calls[g->n_calls + i] = x;
    }
    for (size_t i = 0; i < d->n_ep; i++) g->eps[g->n_eps + i] = d->ep[i] + (int32_t)base;
    g->n_states += n;
    g->n_ranges += d->n_rg;
    g->n_calls += d->n_cl;
    g->n_eps += d->n_ep;
    return 0;
}

int gram_compile(prism_grammar_builder_t *b, int32_t root, const prism_grammar_vocab_t *v, prism_grammar_t **out)
{
    b->spent.work = 0;
    b->spent.bytes = 0;
    b->spent.next_clock = GRAM_CLOCK_EVERY;
    b->spent.deadline_ns = cpu_ns() + (uint64_t)b->lim.max_compile_ms * 1000000u;
    int32_t root_rule = gx_rule_new(b);
    if (root_rule >= 0) gx_rule_set(b, root_rule, root);
    if (b->err) return b->err;
    for (size_t r = 0; r < b->n_rules; r++)
        if (b->rules[r] < 0) return gram_fail(b, PRISM_EINVAL, "", "internal: grammar rule %zu has no body", r);

    nfa_t f = { .b = b, .limit = b->lim.max_states * 4 };
    dfa_t d = { .b = b, .f = &f, .global_limit = (size_t)b->lim.max_states };
    prism_grammar_t *g = prism_calloc(1, sizeof *g);
    size_t n_rules = b->n_rules;
    int32_t *nfa_start = scratch(b, n_rules + 1, sizeof *nfa_start);
    int32_t *nfa_edge0 = scratch(b, n_rules + 1, sizeof *nfa_edge0);
    int32_t *nfa_accept = scratch(b, n_rules, sizeof *nfa_accept);
    size_t caps[4] = {0};
    if (!g) gram_fail(b, PRISM_ENOMEM, "", "out of memory compiling the grammar");
    if (b->err) goto fail;
    atomic_init(&g->refs, 1);
    g->vocab = v;
    g->lim = b->lim;
    g->n_rules = n_rules;
    g->root_rule = root_rule;
    g->rule_start = scratch(b, n_rules, sizeof *g->rule_start);
    if (!g->rule_start) goto fail;

    for (size_t r = 0; r < n_rules && !b->err; r++) {
        nfa_start[r] = nfa_state(&f);
        nfa_edge0[r] = f.n_ed;
        nfa_accept[r] = nfa_emit(&f, b->rules[r], nfa_start[r]);
    }
    nfa_start[n_rules] = f.n_st;
    nfa_edge0[n_rules] = f.n_ed;
    if (b->err) goto fail;
    d.mark = scratch(b, (size_t)f.n_st, sizeof *d.mark);
    d.stack = scratch(b, (size_t)f.n_st, sizeof *d.stack);
    if (!d.mark || !d.stack) goto fail;
    memset(d.mark, 0, (size_t)f.n_st * sizeof *d.mark);

    for (size_t r = 0; r < n_rules; r++) {
        d.accept = nfa_accept[r];
        d.global_base = g->n_states;
        uint64_t size = (uint64_t)(nfa_start[r + 1] - nfa_start[r]) + (uint64_t)(nfa_edge0[r + 1] - nfa_edge0[r]);
        d.det_limit = PRISM_MIN(GRAM_DET_MIN_WORK + GRAM_DET_PER_NFA * size, (uint64_t)GRAM_DET_MAX_WORK);
        int rc = dfa_rule(&d, nfa_start[r]);
        if (rc < 0) goto fail;
        if (rc == GRAM_GAVE_UP) rc = nfa_rule(&d, nfa_start[r], nfa_start[r + 1], nfa_start[r]);
        else rc = minimize(&d);
        if (rc < 0) goto fail;
        g->rule_start[r] = (int32_t)g->n_states;
        if (append_rule(b, g, &d, caps) < 0) goto fail;
    }
    if (prune_unproductive(b, g) < 0) goto fail;

    g->cache = prism_calloc(g->n_states ? g->n_states : 1, sizeof *g->cache);
    if (!g->cache) { gram_fail(b, PRISM_ENOMEM, "", "out of memory compiling the grammar"); goto fail; }
    pthread_mutex_init(&g->cache_lock, NULL);
    dfa_free(&f, &d);
    prism_free(nfa_start); prism_free(nfa_edge0); prism_free(nfa_accept);
    *out = g;
    return PRISM_OK;

fail:
    dfa_free(&f, &d);
    prism_free(nfa_start); prism_free(nfa_edge0); prism_free(nfa_accept);
    if (g) gram_tables_free(g);
    return b->err ? b->err : PRISM_ENOMEM;
}

void gram_tables_free(prism_grammar_t *g)
{
    prism_free(g->states);
    prism_free(g->ranges);
    prism_free(g->calls);
    prism_free(g->eps);
    prism_free(g->rule_start);
    prism_free(g);
}

int prism_grammar_builder_finish(prism_grammar_builder_t *b, prism_gexpr_t root, const prism_grammar_vocab_t *v,
                                 prism_grammar_t **out, prism_grammar_error_t *err)
{
    *out = NULL;
    int rc = b->err;
    if (!rc && (root < 0 || (size_t)root >= b->n_nodes))
        rc = gram_fail(b, PRISM_EINVAL, "", "invalid grammar expression handle");
    if (!rc) rc = gram_compile(b, root, v, out);
    if (rc < 0 && err) {
        err->code = b->err ? b->err : rc;
        snprintf(err->path, sizeof err->path, "%s", b->err_path);
        snprintf(err->message, sizeof err->message, "%s", b->err ? b->err_msg : prism_strerror(rc));
    }
    return rc < 0 ? rc : PRISM_OK;
}

size_t prism_grammar_n_states(const prism_grammar_t *g) { return g->n_states; }
const prism_grammar_vocab_t *prism_grammar_vocab(const prism_grammar_t *g) { return g->vocab; }
