/* Matching: persistent stacks, token walks, the per-state mask cache and the matcher API.
 *
 * A stack is a chain of hash-consed nodes (state, parent): the top node holds the current DFA
 * state, each node below holds the state its rule returns to. Equal (state, parent) pairs are
 * one node, so a loop inside a rule (string characters, digits) creates no nodes and a matcher
 * state is a short list of node ids. Nodes made while testing tokens are dropped in LIFO order
 * (chained hash buckets make that exact), so a mask computation leaves the pool as it found it. */
#include <string.h>

#include "gram_internal.h"

static inline uint32_t node_hash(int32_t s, int32_t p)
{
    uint32_t h = (uint32_t)s * 0x9E3779B1u ^ ((uint32_t)p + 7u) * 0x85EBCA77u;
    return h ^ (h >> 15);
}

int gram_ctx_init(gram_ctx_t *c, const prism_grammar_t *g, int max_nodes, int max_stacks, int max_depth, int max_len)
{
    memset(c, 0, sizeof *c);
    c->g = g;
    c->max_depth = max_depth;
    c->max_stacks = max_stacks;
    c->cap_nodes = max_nodes;
    c->max_len = max_len;
    uint32_t nb = 64;
    while (nb < (uint32_t)max_nodes * 2) nb *= 2;
    c->bucket_mask = nb - 1;
    c->cap_lvl = max_stacks * 8 > 4096 ? max_stacks * 8 : 4096;
    c->nodes = prism_malloc((size_t)max_nodes * sizeof *c->nodes);
    c->bucket = prism_malloc((size_t)nb * sizeof *c->bucket);
    c->visit = prism_calloc((size_t)max_nodes, sizeof *c->visit);
    c->lvl = prism_malloc((size_t)c->cap_lvl * sizeof *c->lvl);
    size_t nl = (size_t)max_len + 2;
    c->lvl_off = prism_malloc(nl * sizeof *c->lvl_off);
    c->lvl_n = prism_malloc(nl * sizeof *c->lvl_n);
    c->lvl_mark = prism_malloc(nl * sizeof *c->lvl_mark);
    c->lvl_end = prism_malloc(nl);
    c->lvl_esc = prism_malloc(nl);
    c->lvl_esc_any = prism_malloc(nl);
    if (!c->nodes || !c->bucket || !c->visit || !c->lvl || !c->lvl_off || !c->lvl_n || !c->lvl_mark ||
        !c->lvl_end || !c->lvl_esc || !c->lvl_esc_any) {
        gram_ctx_free(c);
        return PRISM_ENOMEM;
    }
    memset(c->bucket, 0xff, (size_t)nb * sizeof *c->bucket);
    return PRISM_OK;
}

void gram_ctx_free(gram_ctx_t *c)
{
    prism_free(c->nodes);
    prism_free(c->bucket);
    prism_free(c->visit);
    prism_free(c->lvl);
    prism_free(c->lvl_off);
    prism_free(c->lvl_n);
    prism_free(c->lvl_mark);
    prism_free(c->lvl_end);
    prism_free(c->lvl_esc);
    prism_free(c->lvl_esc_any);
    memset(c, 0, sizeof *c);
}

static void ctx_clear(gram_ctx_t *c)
{
    c->n_nodes = 0;
    memset(c->bucket, 0xff, ((size_t)c->bucket_mask + 1) * sizeof *c->bucket);
    c->overflow = false;
}

int32_t gram_node_get(gram_ctx_t *c, int32_t state, int32_t parent)
{
    uint32_t h = node_hash(state, parent) & c->bucket_mask;
    for (int32_t i = c->bucket[h]; i >= 0; i = c->nodes[i].next)
        if (c->nodes[i].state == state && c->nodes[i].parent == parent) return i;
    int depth = parent >= 0 ? c->nodes[parent].depth + 1 : 1;
    if (depth > c->max_depth || c->n_nodes >= c->cap_nodes) {
        c->overflow = true;
        return -1;
    }
    int32_t id = c->n_nodes++;
    if (depth > c->max_depth_seen) c->max_depth_seen = depth;
    c->nodes[id] = (gram_node_t){ state, parent, (uint16_t)depth, c->bucket[h] };
    c->bucket[h] = id;
    c->visit[id] = 0;
    return id;
}

void gram_ctx_truncate(gram_ctx_t *c, int32_t n)
{
    while (c->n_nodes > n) {
        int32_t id = --c->n_nodes;
        uint32_t h = node_hash(c->nodes[id].state, c->nodes[id].parent) & c->bucket_mask;
        PRISM_ASSERT(c->bucket[h] == id);
        c->bucket[h] = c->nodes[id].next;
    }
}

static void new_gen(gram_ctx_t *c)
{
    if (++c->gen == 0) {
        memset(c->visit, 0, (size_t)c->cap_nodes * sizeof *c->visit);
        c->gen = 1;
    }
}

static void visit(gram_ctx_t *c, int32_t n, int32_t *out, int32_t *n_out, int cap, bool *end, bool *esc)
{
    if (c->visit[n] == c->gen) return;
    c->visit[n] = c->gen;
    c->work++;
    const prism_grammar_t *g = c->g;
    const gram_node_t nd = c->nodes[n];
    const gram_state_t *st = &g->states[nd.state];
    if (st->n_ranges) {
        if (*n_out < cap) out[(*n_out)++] = n;
        else c->overflow = true;
    }
    for (uint32_t i = 0; i < st->n_calls; i++) {
        const gram_call_t *cl = &g->calls[st->call_off + i];
        int32_t ret = gram_node_get(c, cl->ret, nd.parent);
        if (ret < 0) continue;
        int32_t callee = gram_node_get(c, g->rule_start[cl->rule], ret);
        if (callee < 0) continue;
        visit(c, callee, out, n_out, cap, end, esc);
    }
    /* an NFA rule's jump: the leaves of its closure (leaves have no eps: one hop, no chains) */
    for (uint32_t i = 0; i < st->n_eps; i++) {
        int32_t leaf = gram_node_get(c, g->eps[st->eps_off + i], nd.parent);
        if (leaf >= 0) visit(c, leaf, out, n_out, cap, end, esc);
    }
    if (st->final) {
        if (nd.parent == GRAM_PARENT_ROOT) *end = true;
        else if (nd.parent == GRAM_PARENT_UNKNOWN) *esc = true;
        else visit(c, nd.parent, out, n_out, cap, end, esc);
    }
}

void gram_closure(gram_ctx_t *c, int32_t node, int32_t *out, int32_t *n_out, int cap, bool *end, bool *esc)
{
    new_gen(c);
    visit(c, node, out, n_out, cap, end, esc);
}

static inline int32_t range_next(const prism_grammar_t *g, const gram_state_t *st, uint8_t b)
{
    const gram_range_t *r = g->ranges + st->range_off;
    uint32_t lo = 0, hi = st->n_ranges;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (b < r[mid].lo) hi = mid;
        else if (b > r[mid].hi) lo = mid + 1;
        else return r[mid].to;
    }
    return -1;
}

int gram_step(gram_ctx_t *c, const int32_t *in, int n, uint8_t byte, int32_t *out, int cap, bool *end, bool *esc)
{
    new_gen(c);
    int32_t n_out = 0;
    c->work += (uint64_t)n;
    if (cap > c->max_stacks) cap = c->max_stacks;
    for (int i = 0; i < n; i++) {
        const gram_node_t nd = c->nodes[in[i]];
        int32_t to = range_next(c->g, &c->g->states[nd.state], byte);
        if (to < 0) continue;
        int32_t t = gram_node_get(c, to, nd.parent);
        if (t >= 0) visit(c, t, out, &n_out, cap, end, esc);
    }
    return n_out;
}

/* ---- token walks over levels (level d = stack tops after d bytes of the current token) ---- */
static void walk_begin(gram_ctx_t *c, const int32_t *set, int n)
{
    memcpy(c->lvl, set, (size_t)n * sizeof *set);
    c->lvl_off[0] = 0;
    c->lvl_n[0] = n;
    c->lvl_end[0] = c->lvl_esc[0] = c->lvl_esc_any[0] = 0;
    c->lvl_mark[0] = c->n_nodes;
    c->k = 0;
}

/* Makes levels 0..min(L, dead level) valid for bytes[0..L), reusing the first lcp levels of the
 * previous walk. Returns k: k == L, or k < L with level k empty. */
static int walk_to(gram_ctx_t *c, const uint8_t *bytes, int L, int lcp)
{
    if (lcp < c->k) {
        gram_ctx_truncate(c, c->lvl_mark[lcp + 1]);
        c->k = lcp;
    }
    while (c->k < L && c->lvl_n[c->k] > 0) {
        int k = c->k;
        int32_t off = c->lvl_off[k] + c->lvl_n[k];
        c->lvl_off[k + 1] = off;
        c->lvl_mark[k + 1] = c->n_nodes;
        bool end = false, esc = false;
        int n = gram_step(c, c->lvl + c->lvl_off[k], c->lvl_n[k], bytes[k], c->lvl + off, c->cap_lvl - off, &end, &esc);
        c->lvl_n[k + 1] = n;
        c->lvl_end[k + 1] = end;
        c->lvl_esc[k + 1] = esc;
        c->lvl_esc_any[k + 1] = c->lvl_esc_any[k] | esc;
        c->k = k + 1;
    }
    return c->k < L ? c->k : L;
}

/* ---- the per-state cache ---- */
static int cache_fill(prism_grammar_t *g, int32_t state, uint64_t budget, gram_cache_entry_t **out)
{
    const prism_grammar_vocab_t *v = g->vocab;
    if (!g->cache_ctx) {
        g->cache_ctx = prism_calloc(1, sizeof *g->cache_ctx);
        if (!g->cache_ctx) return PRISM_ENOMEM;
        /* a walk from one state keeps few nodes at once; the pool is cleared per fill. It is no
         * larger than what a matcher has free when it accepts a token (over half its pool: it
         * compacts past half), so a token the cache accepts is never one a matcher's run from
         * that state alone would prune for want of nodes (accept_bytes). */
        if (gram_ctx_init(g->cache_ctx, g, PRISM_MAX(g->lim.max_nodes / 2 - 1, 64), g->lim.max_stacks, g->lim.max_stack_depth,
                          (int)v->max_len) < 0) {
            prism_free(g->cache_ctx);
            g->cache_ctx = NULL;
            return PRISM_ENOMEM;
        }
        g->cache_mask = prism_calloc(v->mask_words ? v->mask_words : 1, sizeof *g->cache_mask);
        if (!g->cache_mask) return PRISM_ENOMEM;
    }
    gram_ctx_t *c = g->cache_ctx;
    ctx_clear(c);
    c->work = 0;
    int32_t top = gram_node_get(c, state, GRAM_PARENT_UNKNOWN);
    PRISM_ASSERT(top >= 0);
    c->max_depth_seen = 1;
    const gram_state_t *st = &g->states[state];
    int32_t *acc_ids = prism_malloc((v->n_sorted ? v->n_sorted : 1) * sizeof *acc_ids);
    int32_t *unc = prism_malloc((v->n_sorted ? v->n_sorted : 1) * sizeof *unc);
    uint16_t *unc_lcp = prism_malloc((v->n_sorted ? v->n_sorted : 1) * sizeof *unc_lcp);
    gram_cache_entry_t *e = prism_calloc(1, sizeof *e);
    int rc = PRISM_ENOMEM;
    if (!acc_ids || !unc || !unc_lcp || !e) goto fail;
    uint32_t n_acc = 0, n_unc = 0;
    uint32_t run_min = 0;
    walk_begin(c, &top, 1);
    for (uint32_t r = 0; r < st->n_ranges; r++) {
        const gram_range_t *rg = &g->ranges[st->range_off + r];
        uint32_t j0 = v->first_start[rg->lo], j1 = v->first_start[rg->hi + 1];
        run_min = 0;  /* a new first-byte group: no common prefix with earlier tokens */
        for (uint32_t j = j0; j < j1; j++) {
            if (c->work > budget) {
                rc = PRISM_ELIMIT;
                goto fail;
            }
            uint32_t L;
            const uint8_t *bytes = gram_sorted_bytes(v, j, &L);
            int lcp = j == j0 ? 0 : v->lcp[j];
            if ((uint32_t)lcp < run_min) run_min = (uint32_t)lcp;
            int k = walk_to(c, bytes, (int)L, lcp);
            if (k == (int)L && (c->lvl_n[L] > 0 || c->lvl_esc[L])) {
                acc_ids[n_acc++] = v->sorted[j];
            } else if (c->lvl_esc_any[k == (int)L ? (int)L - 1 : k]) {
                unc_lcp[n_unc] = (uint16_t)(n_unc ? run_min : 0);
                unc[n_unc++] = (int32_t)j;
                run_min = 0xffff;
            }
        }
    }
    /* the smallest of: accepted ids, usable-but-rejected ids, a bitmask */
    size_t words = v->mask_words;
    if ((size_t)n_acc <= words) {
        e->acc_kind = GRAM_ACC_LIST;
        e->n_acc = n_acc;
        e->acc = prism_malloc((n_acc ? n_acc : 1) * sizeof *e->acc);
        if (!e->acc) goto fail;
        memcpy(e->acc, acc_ids, n_acc * sizeof *acc_ids);
    } else {
        int32_t *m = g->cache_mask;
        memset(m, 0, words * sizeof *m);
        for (uint32_t i = 0; i < n_acc; i++) m[acc_ids[i] >> 5] |= (int32_t)(1u << (acc_ids[i] & 31));
        size_t n_rej = v->n_sorted - n_acc;
        if (n_rej <= words) {
            e->acc_kind = GRAM_ACC_ALL_BUT;
            e->n_acc = 0;
            e->acc = prism_malloc((n_rej ? n_rej : 1) * sizeof *e->acc);
            if (!e->acc) goto fail;
            for (size_t j = 0; j < v->n_sorted; j++) {
                int32_t id = v->sorted[j];
                if (!((m[id >> 5] >> (id & 31)) & 1)) e->acc[e->n_acc++] = id;
            }
        } else {
            e->acc_kind = GRAM_ACC_BITMASK;
            e->acc = prism_malloc(words * sizeof *e->acc);
            if (!e->acc) goto fail;
            memcpy(e->acc, m, words * sizeof *m);
        }
    }
    e->max_push = (uint16_t)(c->max_depth_seen - 1);
    e->n_unc = n_unc;
    e->unc = prism_malloc((n_unc ? n_unc : 1) * sizeof *e->unc);
    e->unc_lcp = prism_malloc((n_unc ? n_unc : 1) * sizeof *e->unc_lcp);
    if (!e->unc || !e->unc_lcp) goto fail;
    memcpy(e->unc, unc, n_unc * sizeof *unc);
    memcpy(e->unc_lcp, unc_lcp, n_unc * sizeof *unc_lcp);
    g->cache_bytes += sizeof *e + (e->acc_kind == GRAM_ACC_BITMASK ? words : e->n_acc) * 4 + n_unc * 6;
    prism_free(acc_ids);
    prism_free(unc);
    prism_free(unc_lcp);
    *out = e;
    return PRISM_OK;
fail:
    prism_free(acc_ids);
    prism_free(unc);
    prism_free(unc_lcp);
    if (e) {
        prism_free(e->acc);
        prism_free(e->unc);
        prism_free(e->unc_lcp);
        prism_free(e);
    }
    return rc;
}

int gram_cache_get(prism_grammar_t *g, int32_t state, uint64_t budget, uint64_t *work, gram_cache_entry_t **out)
{
    if (work) *work = 0;
    gram_cache_entry_t *e = atomic_load_explicit(&g->cache[state], memory_order_acquire);
    int rc = PRISM_OK;
    if (!e) {
        pthread_mutex_lock(&g->cache_lock);
        e = atomic_load_explicit(&g->cache[state], memory_order_relaxed);
        if (!e) {
            rc = cache_fill(g, state, budget, &e);
            if (work && g->cache_ctx) *work = g->cache_ctx->work;
            if (rc == PRISM_OK) atomic_store_explicit(&g->cache[state], e, memory_order_release);
        }
        pthread_mutex_unlock(&g->cache_lock);
    }
    *out = rc == PRISM_OK ? e : NULL;
    return rc;
}

int prism_grammar_warm(prism_grammar_t *g)
{
    gram_cache_entry_t *e;
    for (size_t s = 0; s < g->n_states; s++)
        if (g->states[s].n_ranges && gram_cache_get(g, (int32_t)s, UINT64_MAX, NULL, &e) != PRISM_OK) return PRISM_ENOMEM;
    return PRISM_OK;
}

/* ---- lifetime (the mask cache is this file's; the tables are gram_compile.c's) ---- */
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
    gram_tables_free(g);
}

void prism_grammar_retain(prism_grammar_t *g) { atomic_fetch_add(&g->refs, 1); }

void prism_grammar_release(prism_grammar_t *g)
{
    if (g && atomic_fetch_sub(&g->refs, 1) == 1) grammar_free(g);
}

/* ---- matcher ---- */
struct prism_grammar_matcher {
    prism_grammar_t *g;
    prism_grammar_limits_t lim;
    gram_ctx_t c;
    int32_t *tops; int n_tops;
    bool can_end, terminated;
    /* history ring of earlier states for rollback: entry i = hist[i * max_stacks ..] */
    int32_t *hist; int *hist_n; uint8_t *hist_end, *hist_term;
    int hist_head, hist_len;
    int32_t *buf_a, *buf_b;  /* [max_stacks] stepping buffers */
    int32_t *buf_c;          /* [max_stacks] union of per-top runs (accept_bytes) */
    int32_t *scratch;        /* [mask words] */
    int32_t *remap;          /* [max_nodes] for compaction */
};

static void matcher_start(prism_grammar_matcher_t *m)
{
    ctx_clear(&m->c);
    m->n_tops = 0;
    m->can_end = false;
    m->terminated = false;
    m->hist_head = m->hist_len = 0;
    int32_t n = gram_node_get(&m->c, m->g->rule_start[m->g->root_rule], GRAM_PARENT_ROOT);
    PRISM_ASSERT(n >= 0);
    bool esc = false;
    gram_closure(&m->c, n, m->tops, &m->n_tops, m->lim.max_stacks, &m->can_end, &esc);
}

int prism_grammar_matcher_create(prism_grammar_t *g, const prism_grammar_limits_t *limits,
                                 prism_grammar_matcher_t **out)
{
    *out = NULL;
    prism_grammar_matcher_t *m = prism_calloc(1, sizeof *m);
    if (!m) return PRISM_ENOMEM;
    gram_limits_resolve(&m->lim, limits ? limits : &g->lim);
    const prism_grammar_vocab_t *v = g->vocab;
    int S = m->lim.max_stacks, H = m->lim.max_rollback + 1;
    if (gram_ctx_init(&m->c, g, m->lim.max_nodes, S, m->lim.max_stack_depth, (int)(v->max_len + 1)) < 0) {
        prism_free(m);
        return PRISM_ENOMEM;
    }
    m->tops = prism_malloc((size_t)S * sizeof *m->tops);
    m->hist = prism_malloc((size_t)S * H * sizeof *m->hist);
    m->hist_n = prism_malloc((size_t)H * sizeof *m->hist_n);
    m->hist_end = prism_malloc((size_t)H);
    m->hist_term = prism_malloc((size_t)H);
    m->buf_a = prism_malloc((size_t)S * sizeof *m->buf_a);
    m->buf_b = prism_malloc((size_t)S * sizeof *m->buf_b);
    m->buf_c = prism_malloc((size_t)S * sizeof *m->buf_c);
    m->scratch = prism_malloc((v->mask_words ? v->mask_words : 1) * sizeof *m->scratch);
    m->remap = prism_malloc((size_t)m->lim.max_nodes * sizeof *m->remap);
    if (!m->tops || !m->hist || !m->hist_n || !m->hist_end || !m->hist_term || !m->buf_a || !m->buf_b || !m->buf_c || !m->scratch || !m->remap) {
        m->g = NULL;
        prism_grammar_matcher_free(m);
        return PRISM_ENOMEM;
    }
    prism_grammar_retain(g);
    m->g = g;
    matcher_start(m);
    *out = m;
    return PRISM_OK;
}

void prism_grammar_matcher_free(prism_grammar_matcher_t *m)
{
    if (!m) return;
    gram_ctx_free(&m->c);
    prism_free(m->tops);
    prism_free(m->hist);
    prism_free(m->hist_n);
    prism_free(m->hist_end);
    prism_free(m->hist_term);
    prism_free(m->buf_a);
    prism_free(m->buf_b);
    prism_free(m->buf_c);
    prism_free(m->scratch);
    prism_free(m->remap);
    if (m->g) prism_grammar_release(m->g);
    prism_free(m);
}

void prism_grammar_matcher_reset(prism_grammar_matcher_t *m) { matcher_start(m); }

int prism_grammar_matcher_rebind(prism_grammar_matcher_t *m, prism_grammar_t *g)
{
    if (!g || g->vocab != m->g->vocab) return PRISM_EINVAL;
    if (g != m->g) {
        prism_grammar_retain(g);
        prism_grammar_release(m->g);
        m->g = g;
        m->c.g = g;
    }
    matcher_start(m);
    return PRISM_OK;
}
bool prism_grammar_matcher_is_terminated(const prism_grammar_matcher_t *m) { return m->terminated; }
bool prism_grammar_matcher_can_end(const prism_grammar_matcher_t *m) { return !m->terminated && m->can_end; }

/* Drops nodes no live state refers to (current tops and the rollback history), keeping creation
 * order so parents stay below children and LIFO truncation stays exact. */
static void compact(prism_grammar_matcher_t *m)
{
    gram_ctx_t *c = &m->c;
    int S = m->lim.max_stacks, H = m->lim.max_rollback + 1;
    int32_t *live = m->remap;
    memset(live, 0, (size_t)c->n_nodes * sizeof *live);
    for (int i = 0; i < m->n_tops; i++)
        for (int32_t n = m->tops[i]; n >= 0 && !live[n]; n = c->nodes[n].parent) live[n] = 1;
    for (int h = 0; h < m->hist_len; h++) {
        int e = (m->hist_head - 1 - h + H) % H;
        for (int i = 0; i < m->hist_n[e]; i++)
            for (int32_t n = m->hist[e * S + i]; n >= 0 && !live[n]; n = c->nodes[n].parent) live[n] = 1;
    }
    int32_t k = 0;
    memset(c->bucket, 0xff, ((size_t)c->bucket_mask + 1) * sizeof *c->bucket);
    for (int32_t i = 0; i < c->n_nodes; i++) {
        if (!live[i]) { live[i] = -1; continue; }
        gram_node_t nd = c->nodes[i];
        if (nd.parent >= 0) nd.parent = live[nd.parent];
        uint32_t h = node_hash(nd.state, nd.parent) & c->bucket_mask;
        nd.next = c->bucket[h];
        c->bucket[h] = k;
        c->nodes[k] = nd;
        c->visit[k] = 0;
        live[i] = k++;
    }
    c->n_nodes = k;
    for (int i = 0; i < m->n_tops; i++) m->tops[i] = live[m->tops[i]];
    for (int h = 0; h < m->hist_len; h++) {
        int e = (m->hist_head - 1 - h + H) % H;
        for (int i = 0; i < m->hist_n[e]; i++) m->hist[e * S + i] = live[m->hist[e * S + i]];
    }
}

static void push_history(prism_grammar_matcher_t *m)
{
    int S = m->lim.max_stacks, H = m->lim.max_rollback + 1;
    int e = m->hist_head;
    memcpy(m->hist + (size_t)e * S, m->tops, (size_t)m->n_tops * sizeof *m->tops);
    m->hist_n[e] = m->n_tops;
    m->hist_end[e] = m->can_end;
    m->hist_term[e] = m->terminated;
    m->hist_head = (e + 1) % H;
    if (m->hist_len < H - 1) m->hist_len++;
}

/* Runs bytes from tops[0..n_tops) into m->buf_a (ping-pong with buf_b). */
static int run_bytes(prism_grammar_matcher_t *m, const int32_t *tops, int n_tops, bool can_end, const uint8_t *bytes,
                     size_t n, int *n_out, bool *end)
{
    gram_ctx_t *c = &m->c;
    int32_t *a = m->buf_a, *b = m->buf_b;
    int na = n_tops;
    if (a != tops) memcpy(a, tops, (size_t)na * sizeof *a);
    bool e = can_end;
    for (size_t i = 0; i < n; i++) {
        bool esc = false;
        e = false;
        int nb = gram_step(c, a, na, bytes[i], b, m->lim.max_stacks, &e, &esc);
        int32_t *t = a; a = b; b = t;
        na = nb;
        if (na == 0 && !(e && i + 1 == n)) return PRISM_EINVAL;
    }
    if (a != m->buf_a) memcpy(m->buf_a, a, (size_t)na * sizeof *a);
    *n_out = na;
    *end = e;
    return PRISM_OK;
}

/* The run from all tops failed after a limit pruned paths (max_stacks, the node pool): a mask
 * allows a token when some top alone accepts it (its cache entry), so run from each top alone
 * and keep the union (up to max_stacks). Each failed run's nodes are dropped, so the run of the
 * first top that accepts starts with the pool as the mask saw it. Result in m->buf_a. */
static int run_each(prism_grammar_matcher_t *m, const uint8_t *bytes, size_t n, int *n_out, bool *end)
{
    gram_ctx_t *c = &m->c;
    int32_t *seen = m->remap;   /* [max_nodes] marks of the nodes kept (compact() reuses it) */
    memset(seen, 0, (size_t)c->cap_nodes * sizeof *seen);
    int na = 0;
    bool any_end = false, ok = false;
    for (int t = 0; t < m->n_tops && na < m->lim.max_stacks; t++) {
        int32_t mark = c->n_nodes;
        int k = 0;
        bool e = false;
        if (run_bytes(m, &m->tops[t], 1, m->can_end, bytes, n, &k, &e) < 0) {
            gram_ctx_truncate(c, mark);
            continue;
        }
        ok = true;
        any_end |= e;
        for (int i = 0; i < k && na < m->lim.max_stacks; i++)
            if (!seen[m->buf_a[i]]) {
                seen[m->buf_a[i]] = 1;
                m->buf_c[na++] = m->buf_a[i];
            }
    }
    if (!ok) return PRISM_EINVAL;
    memcpy(m->buf_a, m->buf_c, (size_t)na * sizeof *m->buf_a);
    *n_out = na;
    *end = any_end;
    return PRISM_OK;
}

static int accept_bytes(prism_grammar_matcher_t *m, const uint8_t *bytes, size_t n)
{
    if (m->terminated) return PRISM_EINVAL;
    gram_ctx_t *c = &m->c;
    if (c->n_nodes > c->cap_nodes / 2) compact(m);
    int32_t mark = c->n_nodes;
    int n_out = 0;
    bool end = false;
    c->overflow = false;
    int rc = run_bytes(m, m->tops, m->n_tops, m->can_end, bytes, n, &n_out, &end);
    if (rc < 0 && c->overflow && m->n_tops > 1) {
        gram_ctx_truncate(c, mark);
        rc = run_each(m, bytes, n, &n_out, &end);
    }
    if (rc < 0) {
        gram_ctx_truncate(c, mark);
        return rc;
    }
    push_history(m);
    memcpy(m->tops, m->buf_a, (size_t)n_out * sizeof *m->tops);
    m->n_tops = n_out;
    m->can_end = end;
    return PRISM_OK;
}

int prism_grammar_matcher_accept_token(prism_grammar_matcher_t *m, int32_t token)
{
    const prism_grammar_vocab_t *v = m->g->vocab;
    if (m->terminated || token < 0 || (size_t)token >= v->n_tokens) return PRISM_EINVAL;
    if (v->is_eos[token]) {
        if (!m->can_end) return PRISM_EINVAL;
        push_history(m);
        m->terminated = true;
        return PRISM_OK;
    }
    if (!v->usable[token]) return PRISM_EINVAL;
    uint32_t L;
    const uint8_t *b = gram_tok_bytes(v, token, &L);
    return accept_bytes(m, b, L);
}

int prism_grammar_matcher_accept_bytes(prism_grammar_matcher_t *m, const uint8_t *bytes, size_t n)
{
    if (n == 0) return m->terminated ? PRISM_EINVAL : PRISM_OK;
    return accept_bytes(m, bytes, n);
}

int prism_grammar_matcher_rollback(prism_grammar_matcher_t *m, int n)
{
    if (n < 0 || n > m->hist_len) return PRISM_EINVAL;
    int S = m->lim.max_stacks, H = m->lim.max_rollback + 1;
    for (int i = 0; i < n; i++) {
        int e = (m->hist_head - 1 + H) % H;
        memcpy(m->tops, m->hist + (size_t)e * S, (size_t)m->hist_n[e] * sizeof *m->tops);
        m->n_tops = m->hist_n[e];
        m->can_end = m->hist_end[e];
        m->terminated = m->hist_term[e];
        m->hist_head = e;
        m->hist_len--;
    }
    return PRISM_OK;
}

static inline void set_bit(int32_t *mask, int32_t id) { mask[id >> 5] |= (int32_t)(1u << (id & 31)); }

/* Every token that can start from top's state, checked against the real stack. */
/* Every token that can start from top's state, checked against the real stack; false once the
 * context's work passes limit. */
static bool walk_all(prism_grammar_matcher_t *m, int32_t top, int32_t *mask, uint64_t limit)
{
    const prism_grammar_vocab_t *v = m->g->vocab;
    gram_ctx_t *c = &m->c;
    const gram_state_t *st = &m->g->states[c->nodes[top].state];
    int32_t mark = c->n_nodes;
    bool ok = true;
    walk_begin(c, &top, 1);
    for (uint32_t r = 0; r < st->n_ranges && ok; r++) {
        const gram_range_t *rg = &m->g->ranges[st->range_off + r];
        uint32_t j0 = v->first_start[rg->lo], j1 = v->first_start[rg->hi + 1];
        for (uint32_t j = j0; j < j1 && (ok = c->work <= limit); j++) {
            uint32_t L;
            const uint8_t *bytes = gram_sorted_bytes(v, j, &L);
            int k = walk_to(c, bytes, (int)L, j == j0 ? 0 : v->lcp[j]);
            if (k == (int)L && (c->lvl_n[L] > 0 || c->lvl_end[L])) set_bit(mask, v->sorted[j]);
        }
    }
    gram_ctx_truncate(c, mark);
    return ok;
}

int prism_grammar_matcher_fill_mask(prism_grammar_matcher_t *m, int32_t *mask)
{
    prism_grammar_t *g = m->g;
    const prism_grammar_vocab_t *v = g->vocab;
    gram_ctx_t *c = &m->c;
    size_t words = v->mask_words;
    memset(mask, 0, words * sizeof *mask);
    if (m->terminated) return 0;
    int32_t mark = c->n_nodes;
    /* the mask's work budget: this matcher's steps, counted on c->work, plus cache fills */
    uint64_t limit = c->work + (uint64_t)m->lim.max_mask_work;
    for (int t = 0; t < m->n_tops; t++) {
        int32_t top = m->tops[t];
        gram_cache_entry_t *e;
        uint64_t filled = 0;
        int rc = c->work > limit ? PRISM_ELIMIT : gram_cache_get(g, c->nodes[top].state, limit - c->work, &filled, &e);
        c->work += filled;
        if (rc != PRISM_OK) return rc;
        if (c->nodes[top].depth + e->max_push > c->max_depth) {
            /* near the depth limit the cached "accepted" may not hold here: walk every token */
            if (!walk_all(m, top, mask, limit)) return PRISM_ELIMIT;
            continue;
        }
        switch ((gram_acc_kind_t)e->acc_kind) {
        case GRAM_ACC_LIST:
            for (uint32_t i = 0; i < e->n_acc; i++) set_bit(mask, e->acc[i]);
            break;
        case GRAM_ACC_ALL_BUT:
            memcpy(m->scratch, v->usable_mask, words * sizeof *mask);
            for (uint32_t i = 0; i < e->n_acc; i++)
                m->scratch[e->acc[i] >> 5] &= ~(int32_t)(1u << (e->acc[i] & 31));
            for (size_t w = 0; w < words; w++) mask[w] |= m->scratch[w];
            break;
        case GRAM_ACC_BITMASK:
            for (size_t w = 0; w < words; w++) mask[w] |= e->acc[w];
            break;
        }
        c->work += e->acc_kind == GRAM_ACC_LIST ? e->n_acc / 8 : words / 8;
        if (!e->n_unc) continue;
        walk_begin(c, &top, 1);
        /* levels are shared with the last token walked: a token skipped in between still shortens
         * the prefix they share (its lcp with the next may be longer than the walked one's) */
        int carry = INT32_MAX;
        for (uint32_t i = 0; i < e->n_unc; i++) {
            if (c->work > limit) {
                gram_ctx_truncate(c, mark);
                return PRISM_ELIMIT;
            }
            int32_t id = v->sorted[e->unc[i]];
            int lcp = PRISM_MIN(carry, (int)e->unc_lcp[i]);
            if (prism_grammar_mask_test(mask, id)) {   /* another top already allows it */
                carry = lcp;
                continue;
            }
            carry = INT32_MAX;
            uint32_t L;
            const uint8_t *bytes = gram_sorted_bytes(v, (uint32_t)e->unc[i], &L);
            int k = walk_to(c, bytes, (int)L, lcp);
            if (k == (int)L && (c->lvl_n[L] > 0 || c->lvl_end[L])) set_bit(mask, id);
        }
        gram_ctx_truncate(c, mark);
    }
    if (m->can_end)
        for (size_t i = 0; i < v->n_eos; i++) set_bit(mask, v->eos[i]);
    /* SWAR bit count: without -mpopcnt the builtin is a libgcc call per word */
    int count = 0;
    for (size_t w = 0; w < words; w++) {
        uint32_t x = (uint32_t)mask[w];
        if (!x) continue;
        x = x - ((x >> 1) & 0x55555555u);
        x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
        count += (int)((((x + (x >> 4)) & 0x0F0F0F0Fu) * 0x01010101u) >> 24);
    }
    return count;
}

size_t prism_grammar_matcher_forced_bytes(prism_grammar_matcher_t *m, uint8_t *out, size_t cap)
{
    if (m->terminated || m->can_end) return 0;
    gram_ctx_t *c = &m->c;
    int32_t mark = c->n_nodes;
    const prism_grammar_t *g = m->g;
    int32_t *set = m->buf_a, *next = m->buf_b;
    int n = m->n_tops;
    memcpy(set, m->tops, (size_t)n * sizeof *set);
    size_t k = 0;
    while (k < cap && n > 0) {
        int only = -1;
        bool multi = false;
        for (int i = 0; i < n && !multi; i++) {
            const gram_state_t *st = &g->states[c->nodes[set[i]].state];
            for (uint32_t r = 0; r < st->n_ranges && !multi; r++) {
                const gram_range_t *rg = &g->ranges[st->range_off + r];
                if (rg->lo != rg->hi || (only >= 0 && only != rg->lo)) multi = true;
                else only = rg->lo;
            }
        }
        if (multi || only < 0) break;
        bool end = false, esc = false;
        int nn = gram_step(c, set, n, (uint8_t)only, next, m->lim.max_stacks, &end, &esc);
        out[k++] = (uint8_t)only;
        if (end) break;
        int32_t *t = set; set = next; next = t;
        n = nn;
    }
    gram_ctx_truncate(c, mark);
    return k;
}

bool prism_grammar_accepts_bytes(const prism_grammar_t *g, const uint8_t *bytes, size_t n)
{
    gram_ctx_t c;
    if (gram_ctx_init(&c, g, 1 << 16, g->lim.max_stacks, g->lim.max_stack_depth, 1) < 0) return false;
    int32_t *a = prism_malloc((size_t)g->lim.max_stacks * sizeof *a);
    int32_t *b = prism_malloc((size_t)g->lim.max_stacks * sizeof *b);
    bool ok = false;
    if (a && b) {
        int32_t na = 0;
        bool end = false, esc = false;
        int32_t root = gram_node_get(&c, g->rule_start[g->root_rule], GRAM_PARENT_ROOT);
        gram_closure(&c, root, a, &na, g->lim.max_stacks, &end, &esc);
        for (size_t i = 0; i < n; i++) {
            end = false;
            int nb = gram_step(&c, a, na, bytes[i], b, g->lim.max_stacks, &end, &esc);
            int32_t *t = a; a = b; b = t;
            na = nb;
            if (na == 0 && !(end && i + 1 == n)) { end = false; break; }
        }
        ok = end;
    }
    prism_free(a);
    prism_free(b);
    gram_ctx_free(&c);
    return ok;
}
