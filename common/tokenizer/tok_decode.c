/* Decoding (HF Decoder::decode_chain per component), token bytes and the streaming
 * detokenizer. */
#include <string.h>

#include "tokenizer/tok_internal.h"

typedef struct { uint32_t off, len; } tspan_t;
typedef struct {
    prism_buf_t s;          /* token strings back to back */
    tspan_t *v;             /* [cap] tokens */
    size_t n, cap;
} tlist_t;

static int tl_add(tlist_t *l, const char *s, size_t n)
{
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 32;
        tspan_t *p = prism_realloc(l->v, nc * sizeof *p);
        if (!p) return PRISM_ENOMEM;
        l->v = p;
        l->cap = nc;
    }
    if (l->s.len + n > UINT32_MAX) return PRISM_ELIMIT;
    l->v[l->n++] = (tspan_t){ (uint32_t)l->s.len, (uint32_t)n };
    return prism_buf_append(&l->s, s, n) < 0 ? PRISM_ENOMEM : PRISM_OK;
}

/* Starts a new token at the end of l->s whose bytes the caller appends. */
static int tl_open(tlist_t *l)
{
    int rc = tl_add(l, "", 0);
    if (rc == PRISM_OK && !l->s.data && prism_buf_reserve(&l->s, 16) < 0) return PRISM_ENOMEM;
    return rc;
}
static void tl_close(tlist_t *l) { l->v[l->n - 1].len = (uint32_t)(l->s.len - l->v[l->n - 1].off); }

static void tl_free(tlist_t *l)
{
    prism_buf_free(&l->s);
    prism_free(l->v);
}

static inline const char *tl_str(const tlist_t *l, size_t i) { return l->s.data + l->v[i].off; }

static bool byte_token(const char *s, size_t n, uint8_t *out)
{
    /* "<0xNN>": Rust u8::from_str_radix(.., 16) also accepts lowercase and a leading '+' */
    if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>') return false;
    unsigned v = 0;
    int digits = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        if (i == 3 && c == '+') continue;
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return false;
        v = v * 16 + (unsigned)d;
        digits++;
    }
    if (!digits) return false;
    *out = (uint8_t)v;
    return true;
}

/* ByteLevel: chars back to bytes (a token with a char outside the alphabet is taken raw). */
static int bytelevel_bytes(const char *s, size_t n, prism_buf_t *out)
{
    size_t start = out->len;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        i += (size_t)prism_utf8_decode_valid(s + i, &cp);
        if (cp >= 512 || prism_tok_cp_byte[cp] < 0) {
            out->len = start;
            return prism_buf_append(out, s, n) < 0 ? PRISM_ENOMEM : PRISM_OK;
        }
        char b = (char)prism_tok_cp_byte[cp];
        if (prism_buf_append(out, &b, 1) < 0) return PRISM_ENOMEM;
    }
    return PRISM_OK;
}

static int flush_bytes(tlist_t *out, prism_buf_t *pending)
{
    int rc = PRISM_OK;
    if (!pending->len) return rc;
    if (prism_utf8_valid(pending->data, pending->len)) rc = tl_add(out, pending->data, pending->len);
    else   /* String::from_utf8 failed: one U+FFFD per byte */
        for (size_t i = 0; i < pending->len && !rc; i++) rc = tl_add(out, "\xEF\xBF\xBD", 3);
    pending->len = 0;
    return rc;
}

static int dec_apply(const prism_tok_dec_t *d, pcre2_match_data *md, tlist_t *in, tlist_t *out)
{
    int rc = PRISM_OK;
    switch (d->type) {
    case PRISM_TOK_DEC_BYTELEVEL: {
        prism_buf_t raw = {0};
        for (size_t i = 0; i < in->n && !rc; i++) rc = bytelevel_bytes(tl_str(in, i), in->v[i].len, &raw);
        if (!rc && !(rc = tl_open(out))) {
            rc = prism_utf8_lossy_append(&out->s, raw.data ? raw.data : "", raw.len);
            tl_close(out);
        }
        prism_buf_free(&raw);
        return rc;
    }
    case PRISM_TOK_DEC_METASPACE:
        for (size_t i = 0; i < in->n && !rc; i++) {
            const char *s = tl_str(in, i);
            size_t n = in->v[i].len, run = 0;
            if ((rc = tl_open(out))) return rc;
            for (size_t k = 0; k + (size_t)d->repl_len <= n;) {
                if (memcmp(s + k, d->repl, (size_t)d->repl_len) == 0) {
                    if (prism_buf_append(&out->s, s + run, k - run) < 0) return PRISM_ENOMEM;
                    if (!(i == 0 && d->prepend != PRISM_TOK_PREPEND_NEVER) && prism_buf_append(&out->s, " ", 1) < 0)
                        return PRISM_ENOMEM;
                    k += (size_t)d->repl_len;
                    run = k;
                } else {
                    k += (size_t)prism_utf8_len((uint8_t)s[k]);
                }
            }
            if (prism_buf_append(&out->s, s + run, n - run) < 0) return PRISM_ENOMEM;
            tl_close(out);
        }
        return rc;
    case PRISM_TOK_DEC_BYTEFALLBACK: {
        prism_buf_t pending = {0};
        for (size_t i = 0; i < in->n && !rc; i++) {
            uint8_t b;
            if (byte_token(tl_str(in, i), in->v[i].len, &b)) {
                if (prism_buf_append(&pending, &b, 1) < 0) rc = PRISM_ENOMEM;
                continue;
            }
            if (!(rc = flush_bytes(out, &pending))) rc = tl_add(out, tl_str(in, i), in->v[i].len);
        }
        if (!rc) rc = flush_bytes(out, &pending);
        prism_buf_free(&pending);
        return rc;
    }
    case PRISM_TOK_DEC_FUSE:
        if ((rc = tl_open(out))) return rc;
        for (size_t i = 0; i < in->n; i++)
            if (prism_buf_append(&out->s, tl_str(in, i), in->v[i].len) < 0) return PRISM_ENOMEM;
        tl_close(out);
        return PRISM_OK;
    case PRISM_TOK_DEC_STRIP:
        for (size_t i = 0; i < in->n && !rc; i++) {
            const char *s = tl_str(in, i);
            size_t n = in->v[i].len, a = 0, b = n, rl = (size_t)d->repl_len;
            for (size_t k = 0; k < d->start && a + rl <= n && !memcmp(s + a, d->repl, rl); k++) a += rl;
            for (size_t k = 0; k < d->stop && b >= a + rl && !memcmp(s + b - rl, d->repl, rl); k++) b -= rl;
            rc = tl_add(out, s + a, b > a ? b - a : 0);
        }
        return rc;
    case PRISM_TOK_DEC_REPLACE:
        for (size_t i = 0; i < in->n && !rc; i++) {
            if ((rc = tl_open(out))) return rc;
            /* replace_in reads from `in` and writes to `out`: distinct buffers */
            rc = prism_tok_replace_all(&d->pat, md, tl_str(in, i), in->v[i].len, d->str, d->str_len, &out->s);
            tl_close(out);
        }
        return rc;
    case PRISM_TOK_DEC_SEQUENCE: {
        tlist_t a = {0}, b = {0};
        for (size_t i = 0; i < in->n && !rc; i++) rc = tl_add(&a, tl_str(in, i), in->v[i].len);
        for (size_t k = 0; k < d->n_items && !rc; k++) {
            b.n = 0;
            b.s.len = 0;
            rc = dec_apply(&d->items[k], md, &a, &b);
            tlist_t sw = a; a = b; b = sw;
        }
        for (size_t i = 0; i < a.n && !rc; i++) rc = tl_add(out, tl_str(&a, i), a.v[i].len);
        tl_free(&a);
        tl_free(&b);
        return rc;
    }
    }
    return PRISM_EINVAL;
}

int prism_tok_decode_tokens(const prism_tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                            prism_buf_t *out)
{
    tlist_t in = {0}, res = {0};
    pcre2_match_data *md = NULL;
    int rc = PRISM_OK;
    for (size_t i = 0; i < n && !rc; i++) {
        int32_t id = ids[i];
        if (id < 0 || (size_t)id >= t->vocab_size || t->id_len[id] == UINT32_MAX) continue;
        if (skip_special && t->is_special[id]) continue;
        rc = tl_add(&in, t->pool + t->id_off[id], t->id_len[id]);
    }
    if (rc) goto done;
    if (!t->decoder) {
        for (size_t i = 0; i < in.n && !rc; i++)
            if ((i && prism_buf_append(out, " ", 1) < 0) || prism_buf_append(out, tl_str(&in, i), in.v[i].len) < 0)
                rc = PRISM_ENOMEM;
        goto done;
    }
    if (!(md = pcre2_match_data_create(32, NULL))) { rc = PRISM_ENOMEM; goto done; }
    if ((rc = dec_apply(t->decoder, md, &in, &res))) goto done;
    if (prism_buf_reserve(out, res.s.len + 1) < 0) { rc = PRISM_ENOMEM; goto done; }
    for (size_t i = 0; i < res.n; i++) prism_buf_append(out, tl_str(&res, i), res.v[i].len);
done:
    if (md) pcre2_match_data_free(md);
    tl_free(&in);
    tl_free(&res);
    return rc;
}

int prism_tokenizer_decode(const prism_tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special, prism_buf_t *out)
{
    if (!t || (!ids && n) || !out) return PRISM_EINVAL;
    prism_tok_bytelevel_init();
    return prism_tok_decode_tokens(t, ids, n, skip_special, out);
}

/* Per-token part of the decoder chain (Replace, Metaspace marker) for token_bytes. */
static int token_text(const prism_tok_dec_t *d, pcre2_match_data *md, prism_buf_t *cur)
{
    int rc = PRISM_OK;
    if (d->type == PRISM_TOK_DEC_SEQUENCE) {
        for (size_t i = 0; i < d->n_items && !rc; i++) rc = token_text(&d->items[i], md, cur);
        return rc;
    }
    if (d->type != PRISM_TOK_DEC_REPLACE && d->type != PRISM_TOK_DEC_METASPACE) return PRISM_OK;
    prism_buf_t nb = {0};
    if (d->type == PRISM_TOK_DEC_REPLACE) {
        rc = prism_tok_replace_all(&d->pat, md, cur->data ? cur->data : "", cur->len, d->str, d->str_len, &nb);
    } else {
        prism_tok_pattern_t lit = { (char *)d->repl, (size_t)d->repl_len, NULL };
        rc = prism_tok_replace_all(&lit, md, cur->data ? cur->data : "", cur->len, " ", 1, &nb);
    }
    if (!rc) { prism_buf_free(cur); *cur = nb; } else prism_buf_free(&nb);
    return rc;
}

int prism_tokenizer_token_bytes(const prism_tokenizer_t *t, int32_t id, prism_buf_t *out)
{
    const char *s = prism_tokenizer_id_to_token(t, id);
    if (!s) return PRISM_EINVAL;
    size_t n = t->id_len[id];
    prism_tok_bytelevel_init();
    if (t->dec_bytelevel) return bytelevel_bytes(s, n, out);
    uint8_t b;
    if (t->dec_bytefallback && byte_token(s, n, &b)) return prism_buf_append(out, &b, 1) < 0 ? PRISM_ENOMEM : PRISM_OK;
    if (!t->decoder) return prism_buf_append(out, s, n) < 0 ? PRISM_ENOMEM : PRISM_OK;
    prism_buf_t cur = {0};
    pcre2_match_data *md = pcre2_match_data_create(32, NULL);
    int rc = md ? PRISM_OK : PRISM_ENOMEM;
    if (!rc && prism_buf_append(&cur, s, n) < 0) rc = PRISM_ENOMEM;
    if (!rc) rc = token_text(t->decoder, md, &cur);
    if (!rc && prism_buf_append(out, cur.data ? cur.data : "", cur.len) < 0) rc = PRISM_ENOMEM;
    prism_buf_free(&cur);
    if (md) pcre2_match_data_free(md);
    return rc;
}

/* ---------------- streaming detokenizer ---------------- */

void prism_detok_init(prism_detok_t *d, const prism_tokenizer_t *t, bool skip_special)
{
    memset(d, 0, sizeof *d);
    d->tok = t;
    d->skip_special = skip_special;
}

void prism_detok_free(prism_detok_t *d)
{
    prism_free(d->ids);
    prism_buf_free(&d->prefix_text);
    prism_buf_free(&d->new_text);
    memset(d, 0, sizeof *d);
}

static int detok_step(prism_detok_t *d, prism_buf_t *delta, bool final)
{
    int rc;
    d->prefix_text.len = 0;
    d->new_text.len = 0;
    d->decoded_ids += (d->read_offset - d->prefix_offset) + (d->n - d->prefix_offset);
    if ((rc = prism_tok_decode_tokens(d->tok, d->ids + d->prefix_offset, d->read_offset - d->prefix_offset,
                                      d->skip_special, &d->prefix_text)))
        return rc;
    if ((rc = prism_tok_decode_tokens(d->tok, d->ids + d->prefix_offset, d->n - d->prefix_offset, d->skip_special,
                                      &d->new_text)))
        return rc;
    size_t pl = d->prefix_text.len, nl = d->new_text.len;
    const char *nt = d->new_text.data;
    bool partial = nl >= 3 && memcmp(nt + nl - 3, "\xEF\xBF\xBD", 3) == 0;
    bool stalled = d->n - d->read_offset >= PRISM_TOK_DETOK_MAX_PENDING;
    /* Ids that add no text wait for context, but not forever: past the bound the window moves on
     * (else every later id would re-decode the whole run: O(n^2) for one Tokens message). */
    if (nl <= pl && !stalled) return PRISM_OK;
    if (partial && !final && !stalled) return PRISM_OK;
    if (nl > pl) {
        size_t from = pl;
        while (from < nl && ((uint8_t)nt[from] & 0xC0) == 0x80) from++;   /* never split a char */
        if (prism_buf_append(delta, nt + from, nl - from) < 0) return PRISM_ENOMEM;
    }
    d->prefix_offset = d->read_offset;
    d->read_offset = d->n;
    /* drop ids before the window so memory stays bounded */
    memmove(d->ids, d->ids + d->prefix_offset, (d->n - d->prefix_offset) * sizeof *d->ids);
    d->n -= d->prefix_offset;
    d->read_offset -= d->prefix_offset;
    d->prefix_offset = 0;
    return PRISM_OK;
}

int prism_detok_push(prism_detok_t *d, int32_t id, prism_buf_t *delta)
{
    /* Ids that decode() drops before the decoder chain never change the text: keep them out of
     * the window (a hostile or broken worker may send millions of them). */
    const prism_tokenizer_t *t = d->tok;
    if (id < 0 || (size_t)id >= t->vocab_size || t->id_len[id] == UINT32_MAX || (d->skip_special && t->is_special[id]))
        return PRISM_OK;
    if (d->n == d->cap) {
        size_t nc = d->cap ? d->cap * 2 : 16;
        int32_t *p = prism_realloc(d->ids, nc * sizeof *p);
        if (!p) return PRISM_ENOMEM;
        d->ids = p;
        d->cap = nc;
    }
    d->ids[d->n++] = id;
    return detok_step(d, delta, false);
}

int prism_detok_flush(prism_detok_t *d, prism_buf_t *delta)
{
    if (d->read_offset >= d->n) return PRISM_OK;
    return detok_step(d, delta, true);
}
