/* Encoding: added-token extraction, pre-tokenizers, BPE, post-processing (normalizers are in
 * tok_normalize.c). Each step reproduces the corresponding HF tokenizers routine, including its
 * corner cases (onig find_iter empty-match rule, split behaviours, merge queue tie-breaking). */
#include <string.h>

#include "tokenizer/tok_internal.h"

typedef struct {
    uint32_t off, len;  /* string in the arena */
    int32_t id;         /* >= 0: an added token, final */
    uint8_t first;      /* starts at original offset 0 (Metaspace prepend_scheme "first") */
} piece_t;

typedef struct { piece_t *v; size_t n, cap; } pvec_t;

typedef struct { int32_t id, prev, next; uint32_t len; } sym_t;
typedef struct { uint32_t rank, pos; int32_t new_id; } hent_t;

typedef struct {
    const prism_tokenizer_t *t;
    prism_buf_t arena;              /* every string pieces refer to */
    prism_buf_t tmp, tmp2;
    pvec_t a, b;
    pcre2_match_data *md;
    prism_tok_span_t *spans;        /* [spans_cap] scratch for one split */
    size_t spans_cap;
    sym_t *syms;                    /* [syms_cap] BPE word */
    size_t syms_cap;
    hent_t *heap;                   /* [heap_cap] BPE merge queue */
    size_t heap_cap;
    int32_t *ids;                   /* caller's array, grown in place */
    size_t n, cap;
} enc_t;

static uint8_t bl_utf8[256][2], bl_len[256];

static int grow(void **p, size_t *cap, size_t need, size_t elt)
{
    if (need <= *cap) return PRISM_OK;
    size_t nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    void *q = prism_realloc(*p, nc * elt);
    if (!q) return PRISM_ENOMEM;
    *p = q;
    *cap = nc;
    return PRISM_OK;
}

static inline int emit(enc_t *E, int32_t id)
{
    if (E->n == E->cap) {
        size_t nc = E->cap ? E->cap * 2 : 64;
        int32_t *p = prism_realloc(E->ids, nc * sizeof *p);
        if (!p) return PRISM_ENOMEM;
        E->ids = p;
        E->cap = nc;
    }
    E->ids[E->n++] = id;
    return PRISM_OK;
}

static inline int push(pvec_t *v, uint32_t off, uint32_t len, int32_t id, bool first)
{
    if (len == 0 && id < 0) return PRISM_OK;   /* HF drops empty splits */
    if (v->n == v->cap && grow((void **)&v->v, &v->cap, v->n + 1, sizeof *v->v)) return PRISM_ENOMEM;
    v->v[v->n++] = (piece_t){ off, len, id, first };
    return PRISM_OK;
}

/* Appends n bytes to the arena; returns the new string's offset via *off. */
static int arena_add(enc_t *E, const char *s, size_t n, uint32_t *off)
{
    if (E->arena.len + n > UINT32_MAX) return PRISM_ELIMIT;
    *off = (uint32_t)E->arena.len;
    return prism_buf_append(&E->arena, s, n) < 0 ? PRISM_ENOMEM : PRISM_OK;
}

/* ---------------- patterns ---------------- */

/* HF Pattern::find_matches into E->spans: spans covering s, each flagged match or not. */
static int find_spans(enc_t *E, const prism_tok_pattern_t *p, const char *s, size_t n, size_t *out_n)
{
    size_t k = 0, prev = 0, last_end = 0;
    bool have_last = false;
    size_t last_match_end = 0;
#define SPAN(a, b, m) do { \
        if (k + 1 > E->spans_cap && grow((void **)&E->spans, &E->spans_cap, k + 1, sizeof *E->spans)) return PRISM_ENOMEM; \
        E->spans[k++] = (prism_tok_span_t){ (uint32_t)(a), (uint32_t)(b), (m) }; } while (0)
    if (n == 0) { SPAN(0, 0, false); *out_n = k; return PRISM_OK; }
    while (last_end <= n) {
        size_t ms, me;
        if (!prism_tok_pattern_find(p, E->md, s, n, last_end, &ms, &me)) break;
        if (ms == me && have_last && last_match_end == me) {
            /* onig FindMatches: no empty match right after the previous match */
            if (last_end >= n) break;
            last_end += (size_t)prism_utf8_len((uint8_t)s[last_end]);
            continue;
        }
        last_end = me;
        have_last = true;
        last_match_end = me;
        if (prev != ms) SPAN(prev, ms, false);
        SPAN(ms, me, true);
        prev = me;
        if (ms == me) {
            /* an accepted empty match: the next search starts one char later (onig restarts at
             * the same place and rejects the repeat, which ends up here too) */
            if (last_end >= n) break;
            last_end += (size_t)prism_utf8_len((uint8_t)s[last_end]);
        }
    }
    if (prev != n) SPAN(prev, n, false);
#undef SPAN
    *out_n = k;
    return PRISM_OK;
}

/* NormalizedString::split: splits piece p by pattern with a behaviour; results to out. */
static int split_piece(enc_t *E, const piece_t *p, const prism_tok_pattern_t *pat, prism_tok_split_behavior_t bh,
                       bool invert, pvec_t *out)
{
    size_t k;
    int rc = find_spans(E, pat, E->arena.data + p->off, p->len, &k);
    if (rc) return rc;
    prism_tok_span_t *sp = E->spans;
    if (invert)
        for (size_t i = 0; i < k; i++) sp[i].is_match = !sp[i].is_match;
    /* fold into (range, remove) entries; is_match is reused as "remove" */
    size_t m = 0;
    switch (bh) {
    case PRISM_TOK_SPLIT_ISOLATED:
        for (size_t i = 0; i < k; i++) sp[i].is_match = false;
        m = k;
        break;
    case PRISM_TOK_SPLIT_REMOVED:
        m = k;
        break;
    case PRISM_TOK_SPLIT_CONTIGUOUS: {
        bool prev = false;
        for (size_t i = 0; i < k; i++) {
            bool im = sp[i].is_match;
            if (im == prev && m > 0) sp[m - 1].e = sp[i].e;
            else sp[m++] = (prism_tok_span_t){ sp[i].s, sp[i].e, false };
            prev = im;
        }
        break;
    }
    case PRISM_TOK_SPLIT_MERGED_PREV: {
        bool prev = false;
        for (size_t i = 0; i < k; i++) {
            bool im = sp[i].is_match;
            if (im && !prev && m > 0) sp[m - 1].e = sp[i].e;
            else sp[m++] = (prism_tok_span_t){ sp[i].s, sp[i].e, false };
            prev = im;
        }
        break;
    }
    case PRISM_TOK_SPLIT_MERGED_NEXT: {
        /* right to left, building from the end of the array */
        bool prev = false;
        size_t w = k;
        for (size_t i = k; i-- > 0;) {
            bool im = sp[i].is_match;
            prism_tok_span_t cur = sp[i];
            if (im && !prev && w < k) sp[w].s = cur.s;
            else sp[--w] = (prism_tok_span_t){ cur.s, cur.e, false };
            prev = im;
        }
        memmove(sp, sp + w, (k - w) * sizeof *sp);
        m = k - w;
        break;
    }
    }
    for (size_t i = 0; i < m; i++) {
        if (sp[i].is_match) continue;
        if ((rc = push(out, p->off + sp[i].s, sp[i].e - sp[i].s, -1, p->first && sp[i].s == 0))) return rc;
    }
    return PRISM_OK;
}

/* ---------------- added tokens ---------------- */

static bool ends_with_word(const char *s, size_t n)
{
    if (!n) return false;
    size_t q = n - 1;
    while (q > 0 && ((uint8_t)s[q] & 0xC0) == 0x80) q--;
    uint32_t cp;
    prism_utf8_decode_valid(s + q, &cp);
    return cp == '_' || prism_tok_is_alnum(cp);
}

static bool starts_with_word(const char *s, size_t n)
{
    if (!n) return false;
    uint32_t cp;
    prism_utf8_decode_valid(s, &cp);
    return cp == '_' || prism_tok_is_alnum(cp);
}

/* AddedVocabulary::find_matches + split_with_indices on one text piece. */
static int split_added(enc_t *E, const prism_tok_matcher_t *mt, bool normalized, const piece_t *p, pvec_t *out)
{
    const prism_tokenizer_t *t = E->t;
    if (!mt->n) return push(out, p->off, p->len, p->id, p->first);
    const char *s = E->arena.data + p->off;
    size_t n = p->len, pos = 0, start_offset = 0;
    int rc;
    while (pos < n) {
        /* leftmost-longest: the first position with any candidate, longest candidate there */
        size_t ms = n, me = 0;
        uint32_t hit = UINT32_MAX;
        for (; pos < n; pos++) {
            uint8_t b = (uint8_t)s[pos];
            uint32_t lo = mt->start[b], hi = mt->start[b + 1];
            for (uint32_t k = lo; k < hi; k++) {
                const prism_tok_added_t *a = &t->added[mt->order[k]];
                uint32_t al = normalized ? a->nlen : a->len;
                const char *ac = t->pool + (normalized ? a->noff : a->off);
                if (al <= n - pos && memcmp(s + pos, ac, al) == 0) { hit = mt->order[k]; ms = pos; me = pos + al; break; }
            }
            if (hit != UINT32_MAX) break;
        }
        if (hit == UINT32_MAX) break;
        pos = me;   /* the matcher resumes after the raw match, whatever is decided below */
        const prism_tok_added_t *a = &t->added[hit];
        size_t start = ms, stop = me;
        if (a->single_word) {
            bool start_space = ms == 0 || !ends_with_word(s, ms);
            bool stop_space = me == n || !starts_with_word(s + me, n - me);
            if (!start_space || !stop_space) continue;
        }
        if (a->lstrip) {
            size_t ns = ms;
            while (ns > 0) {
                size_t q = ns - 1;
                while (q > 0 && ((uint8_t)s[q] & 0xC0) == 0x80) q--;
                uint32_t cp;
                prism_utf8_decode_valid(s + q, &cp);
                if (!prism_tok_is_white_space(cp)) break;
                ns = q;
            }
            start = PRISM_MAX(ns, start_offset);
        }
        if (a->rstrip) {
            while (stop < n) {
                uint32_t cp;
                int k = prism_utf8_decode_valid(s + stop, &cp);
                if (!prism_tok_is_white_space(cp)) break;
                stop += (size_t)k;
            }
        }
        if (start_offset < start &&
            (rc = push(out, p->off + (uint32_t)start_offset, (uint32_t)(start - start_offset), -1, p->first && start_offset == 0)))
            return rc;
        if ((rc = push(out, p->off + (uint32_t)start, (uint32_t)(stop - start), a->id, false))) return rc;
        start_offset = stop;
    }
    if (start_offset < n)
        return push(out, p->off + (uint32_t)start_offset, (uint32_t)(n - start_offset), -1, p->first && start_offset == 0);
    return PRISM_OK;
}

/* ---------------- pre-tokenizers ---------------- */

static int pre_apply(enc_t *E, const prism_tok_pre_t *pt, pvec_t *in, pvec_t *out);

static int bytelevel_map(enc_t *E, const piece_t *p, pvec_t *out)
{
    if (prism_buf_reserve(&E->arena, (size_t)p->len * 2) < 0) return PRISM_ENOMEM;
    if (E->arena.len + (size_t)p->len * 2 > UINT32_MAX) return PRISM_ELIMIT;
    const uint8_t *s = (const uint8_t *)E->arena.data + p->off;
    char *w = E->arena.data + E->arena.len;
    size_t o = 0;
    for (uint32_t i = 0; i < p->len; i++) {
        uint8_t b = s[i];
        w[o] = (char)bl_utf8[b][0];
        w[o + 1] = (char)bl_utf8[b][1];
        o += bl_len[b];
    }
    uint32_t off = (uint32_t)E->arena.len;
    E->arena.len += o;
    return push(out, off, (uint32_t)o, -1, p->first);
}

static int pre_piece(enc_t *E, const prism_tok_pre_t *pt, const piece_t *p0, pvec_t *out)
{
    int rc;
    piece_t p = *p0;
    switch (pt->type) {
    case PRISM_TOK_PRE_SPLIT:
    case PRISM_TOK_PRE_DIGITS:
    case PRISM_TOK_PRE_WHITESPACE_SPLIT:
        return split_piece(E, &p, &pt->pat, pt->behavior, pt->invert, out);
    case PRISM_TOK_PRE_BYTELEVEL: {
        if (pt->add_prefix_space && E->arena.data[p.off] != ' ') {
            uint32_t off;
            if (prism_buf_reserve(&E->arena, (size_t)p.len + 1) < 0) return PRISM_ENOMEM;
            if ((rc = arena_add(E, " ", 1, &off))) return rc;
            memcpy(E->arena.data + E->arena.len, E->arena.data + p.off, p.len);
            E->arena.len += p.len;
            p.off = off;
            p.len += 1;
        }
        if (!pt->use_regex) return bytelevel_map(E, &p, out);
        pvec_t tmp = {0};
        if ((rc = split_piece(E, &p, &pt->pat, PRISM_TOK_SPLIT_ISOLATED, false, &tmp)) == 0)
            for (size_t i = 0; i < tmp.n && !rc; i++) rc = bytelevel_map(E, &tmp.v[i], out);
        prism_free(tmp.v);
        return rc;
    }
    case PRISM_TOK_PRE_METASPACE: {
        /* replace ' ' by the replacement, prepend it per scheme, split before each one */
        E->tmp.len = 0;
        const char *s = E->arena.data + p.off;
        bool starts = p.len >= (uint32_t)pt->repl_len && memcmp(s, pt->repl, (size_t)pt->repl_len) == 0;
        if (!starts && s[0] == ' ') starts = true;   /* the leading space becomes the replacement */
        bool prepend = !starts && (pt->prepend == PRISM_TOK_PREPEND_ALWAYS ||
                                   (pt->prepend == PRISM_TOK_PREPEND_FIRST && p.first));
        if (prepend && prism_buf_append(&E->tmp, pt->repl, (size_t)pt->repl_len) < 0) return PRISM_ENOMEM;
        size_t run = 0;
        for (size_t i = 0; i < p.len; i++) {
            if (s[i] != ' ') continue;
            if (prism_buf_append(&E->tmp, s + run, i - run) < 0 ||
                prism_buf_append(&E->tmp, pt->repl, (size_t)pt->repl_len) < 0)
                return PRISM_ENOMEM;
            run = i + 1;
        }
        if (prism_buf_append(&E->tmp, s + run, p.len - run) < 0) return PRISM_ENOMEM;
        uint32_t off;
        if ((rc = arena_add(E, E->tmp.data, E->tmp.len, &off))) return rc;
        piece_t q = { off, (uint32_t)E->tmp.len, -1, p.first };
        if (!pt->split) return push(out, q.off, q.len, -1, q.first);
        prism_tok_pattern_t lit = { (char *)pt->repl, (size_t)pt->repl_len, NULL };
        return split_piece(E, &q, &lit, PRISM_TOK_SPLIT_MERGED_NEXT, false, out);
    }
    case PRISM_TOK_PRE_SEQUENCE: {
        pvec_t cur = {0}, nxt = {0};
        rc = push(&cur, p.off, p.len, -1, p.first);
        for (size_t i = 0; i < pt->n_items && !rc; i++) {
            nxt.n = 0;
            rc = pre_apply(E, &pt->items[i], &cur, &nxt);
            pvec_t sw = cur; cur = nxt; nxt = sw;
        }
        for (size_t i = 0; i < cur.n && !rc; i++) rc = push(out, cur.v[i].off, cur.v[i].len, -1, cur.v[i].first);
        prism_free(cur.v);
        prism_free(nxt.v);
        return rc;
    }
    }
    return PRISM_EINVAL;
}

static int pre_apply(enc_t *E, const prism_tok_pre_t *pt, pvec_t *in, pvec_t *out)
{
    for (size_t i = 0; i < in->n; i++) {
        piece_t p = in->v[i];
        int rc = p.id >= 0 ? push(out, p.off, p.len, p.id, p.first) : pre_piece(E, pt, &p, out);
        if (rc) return rc;
    }
    return PRISM_OK;
}

/* ---------------- BPE ---------------- */

static inline const prism_tok_mslot_t *merge_get(const prism_tokenizer_t *t, int32_t a, int32_t b)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint64_t h = key;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    size_t j = h & t->merges_mask;
    for (;;) {
        const prism_tok_mslot_t *s = &t->merges[j];
        if (s->key == key) return s;
        if (s->key == UINT64_MAX) return NULL;
        j = (j + 1) & t->merges_mask;
    }
}

static inline bool hent_less(const hent_t *x, const hent_t *y)
{
    return x->rank < y->rank || (x->rank == y->rank && x->pos < y->pos);
}

static void heap_push(hent_t *h, size_t *n, hent_t e)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!hent_less(&e, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
}

static hent_t heap_pop(hent_t *h, size_t *n)
{
    hent_t top = h[0], last = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, c = i;
        const hent_t *best = &last;
        if (l < m && hent_less(&h[l], best)) { c = l; best = &h[l]; }
        if (r < m && hent_less(&h[r], best)) { c = r; }
        if (c == i) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = last;
    return top;
}

static int sym_add(enc_t *E, size_t *ns, int32_t id, uint32_t len)
{
    if (*ns + 1 > E->syms_cap && grow((void **)&E->syms, &E->syms_cap, *ns + 1, sizeof *E->syms)) return PRISM_ENOMEM;
    sym_t *s = E->syms;
    if (*ns) s[*ns - 1].next = (int32_t)*ns;
    s[*ns] = (sym_t){ id, *ns ? (int32_t)*ns - 1 : -1, -1, len };
    (*ns)++;
    return PRISM_OK;
}

static int bpe_piece(enc_t *E, const char *s, size_t n)
{
    const prism_tokenizer_t *t = E->t;
    int rc;
    if (t->ignore_merges) {
        int32_t id = prism_tok_vocab_get(t, s, n);
        if (id >= 0) return emit(E, id);
    }
    size_t ns = 0;
    int32_t unk = -1;
    uint32_t unk_len = 0;
    for (size_t i = 0; i < n;) {
        size_t cl = (size_t)prism_utf8_len((uint8_t)s[i]);
        bool first = i == 0, last = i + cl >= n;
        int32_t id;
        const char *cs = s + i;
        size_t csl = cl;
        if (t->char_table && cl <= 2) {
            uint32_t cp;
            prism_utf8_decode_valid(s + i, &cp);
            id = t->char_id[cp];
        } else if (!t->cont_prefix && !t->eow_suffix) {
            id = prism_tok_vocab_get(t, s + i, cl);
        } else {
            E->tmp2.len = 0;
            if ((!first && t->cont_prefix && prism_buf_append(&E->tmp2, t->cont_prefix, t->cont_prefix_len) < 0) ||
                prism_buf_append(&E->tmp2, s + i, cl) < 0 ||
                (last && t->eow_suffix && prism_buf_append(&E->tmp2, t->eow_suffix, t->eow_suffix_len) < 0))
                return PRISM_ENOMEM;
            cs = E->tmp2.data;
            csl = E->tmp2.len;
            id = prism_tok_vocab_get(t, cs, csl);
        }
        i += cl;
        if (id >= 0) {
            if (unk >= 0) { if ((rc = sym_add(E, &ns, unk, unk_len))) return rc; unk = -1; }
            if ((rc = sym_add(E, &ns, id, (uint32_t)cl))) return rc;
            continue;
        }
        if (t->byte_fallback) {
            bool all = true;
            for (size_t k = 0; k < csl; k++) all = all && t->byte_id[(uint8_t)cs[k]] >= 0;
            if (all) {
                for (size_t k = 0; k < csl; k++)
                    if ((rc = sym_add(E, &ns, t->byte_id[(uint8_t)cs[k]], 1))) return rc;
                continue;
            }
        }
        if (t->unk_missing) return PRISM_ECORRUPT;   /* HF: UnkTokenOutOfVocabulary */
        if (t->unk_id >= 0) {
            if (unk >= 0 && t->fuse_unk) unk_len += (uint32_t)cl;
            else {
                if (unk >= 0 && (rc = sym_add(E, &ns, unk, unk_len))) return rc;
                unk = t->unk_id;
                unk_len = (uint32_t)cl;
            }
        }
    }
    if (unk >= 0 && (rc = sym_add(E, &ns, unk, unk_len))) return rc;
    if (ns <= 1) return ns ? emit(E, E->syms[0].id) : PRISM_OK;

    /* Word::merge_all: queue ordered by (rank, pos); stale entries are detected by new_id. */
    if (grow((void **)&E->heap, &E->heap_cap, ns * 2 + 4, sizeof *E->heap)) return PRISM_ENOMEM;
    sym_t *sy = E->syms;
    hent_t *h = E->heap;
    size_t hn = 0;
    for (size_t i = 0; i + 1 < ns; i++) {
        const prism_tok_mslot_t *m = merge_get(t, sy[i].id, sy[i + 1].id);
        if (m) heap_push(h, &hn, (hent_t){ m->rank, (uint32_t)i, m->new_id });
    }
    while (hn) {
        hent_t top = heap_pop(h, &hn);
        sym_t *cur = &sy[top.pos];
        if (cur->len == 0 || cur->next == -1) continue;
        int32_t np = cur->next;
        sym_t right = sy[np];
        const prism_tok_mslot_t *m = merge_get(t, cur->id, right.id);
        if (!m || m->new_id != top.new_id) continue;
        cur->id = top.new_id;
        cur->len += right.len;
        cur->next = right.next;
        sy[np].len = 0;
        if (right.next > -1 && (size_t)right.next < ns) sy[right.next].prev = (int32_t)top.pos;
        /* each merge adds at most two entries; keep headroom */
        if (hn + 2 > E->heap_cap) {
            if (grow((void **)&E->heap, &E->heap_cap, hn + 2, sizeof *E->heap)) return PRISM_ENOMEM;
            h = E->heap;
        }
        if (cur->prev >= 0) {
            const prism_tok_mslot_t *pm = merge_get(t, sy[cur->prev].id, cur->id);
            if (pm) heap_push(h, &hn, (hent_t){ pm->rank, (uint32_t)cur->prev, pm->new_id });
        }
        if (cur->next > -1 && (size_t)cur->next < ns) {
            const prism_tok_mslot_t *nm = merge_get(t, cur->id, sy[cur->next].id);
            if (nm) heap_push(h, &hn, (hent_t){ nm->rank, top.pos, nm->new_id });
        }
    }
    for (size_t i = 0; i < ns; i++)
        if (sy[i].len && (rc = emit(E, sy[i].id))) return rc;
    return PRISM_OK;
}

/* ---------------- encode ---------------- */

static void bl_tables(void)
{
    prism_tok_bytelevel_init();
    for (int b = 0; b < 256; b++) {
        char u[4];
        int k = prism_utf8_encode(prism_tok_byte_cp[b], u);
        bl_utf8[b][0] = (uint8_t)u[0];
        bl_utf8[b][1] = (uint8_t)(k > 1 ? u[1] : 0);
        bl_len[b] = (uint8_t)k;
    }
}

#include <pthread.h>
static pthread_once_t bl_tables_once = PTHREAD_ONCE_INIT;

int prism_tokenizer_encode(const prism_tokenizer_t *t, const char *text, size_t len, bool add_special,
                           int32_t **ids, size_t *n, size_t *cap)
{
    if (!t || (!text && len) || !ids || !n || !cap) return PRISM_EINVAL;
    if (len > PRISM_TOK_MAX_TEXT_BYTES) return PRISM_ELIMIT;
    if (!prism_utf8_valid(text, len)) return PRISM_EINVAL;
    pthread_once(&bl_tables_once, bl_tables);

    enc_t E = { .t = t, .ids = *ids, .n = *n, .cap = *cap };
    int rc = PRISM_ENOMEM;
    if (!(E.md = pcre2_match_data_create(32, NULL))) goto fail;
    uint32_t off;
    if (prism_buf_reserve(&E.arena, len * 3 + 64) < 0) goto fail;
    if ((rc = arena_add(&E, text ? text : "", len, &off))) goto fail;

    piece_t whole = { 0, (uint32_t)len, -1, 1 };
    if ((rc = split_added(&E, &t->match_raw, false, &whole, &E.a))) goto fail;
    if (t->normalizer || t->match_norm.n) {
        E.b.n = 0;
        for (size_t i = 0; i < E.a.n; i++) {
            piece_t p = E.a.v[i];
            if (p.id >= 0) { if ((rc = push(&E.b, p.off, p.len, p.id, p.first))) goto fail; continue; }
            if (t->normalizer) {
                E.tmp.len = 0;
                if ((rc = prism_tok_normalize(t, t->normalizer, E.arena.data + p.off, p.len, &E.tmp, E.md))) goto fail;
                if ((rc = arena_add(&E, E.tmp.data ? E.tmp.data : "", E.tmp.len, &p.off))) goto fail;
                p.len = (uint32_t)E.tmp.len;
            }
            if (p.len == 0) continue;
            if ((rc = split_added(&E, &t->match_norm, true, &p, &E.b))) goto fail;
        }
        pvec_t sw = E.a; E.a = E.b; E.b = sw;
    }
    if (t->pre) {
        E.b.n = 0;
        if ((rc = pre_apply(&E, t->pre, &E.a, &E.b))) goto fail;
        pvec_t sw = E.a; E.a = E.b; E.b = sw;
    }
    if (add_special)
        for (size_t i = 0; i < t->n_pp_prefix; i++) if ((rc = emit(&E, t->pp_prefix[i]))) goto fail;
    for (size_t i = 0; i < E.a.n; i++) {
        piece_t p = E.a.v[i];
        rc = p.id >= 0 ? emit(&E, p.id) : bpe_piece(&E, E.arena.data + p.off, p.len);
        if (rc) goto fail;
    }
    if (add_special)
        for (size_t i = 0; i < t->n_pp_suffix; i++) if ((rc = emit(&E, t->pp_suffix[i]))) goto fail;
    *n = E.n;
    rc = PRISM_OK;
fail:
    *ids = E.ids;
    *cap = E.cap;
    if (E.md) pcre2_match_data_free(E.md);
    prism_buf_free(&E.arena);
    prism_buf_free(&E.tmp);
    prism_buf_free(&E.tmp2);
    prism_free(E.a.v);
    prism_free(E.b.v);
    prism_free(E.spans);
    prism_free(E.syms);
    prism_free(E.heap);
    return rc;
}
