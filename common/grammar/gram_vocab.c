/* Vocabulary for grammar matching: every token's bytes, and the usable tokens sorted by bytes with
 * longest-common-prefix lengths (a token trie in array form: a walk in this order shares the
 * work of common prefixes). Built once per tokenizer. */
#define _GNU_SOURCE 1   /* qsort_r */
#include <stdlib.h>
#include <string.h>

#include "gram_internal.h"
#include "tokenizer/tokenizer.h"

static int cmp_tok(const void *a, const void *b, void *arg)
{
    const prism_grammar_vocab_t *v = arg;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx, ly;
    const uint8_t *px = gram_tok_bytes(v, x, &lx), *py = gram_tok_bytes(v, y, &ly);
    int c = memcmp(px, py, lx < ly ? lx : ly);
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return (x > y) - (x < y);
}

void prism_grammar_vocab_free(prism_grammar_vocab_t *v)
{
    if (!v) return;
    prism_free(v->data);
    prism_free(v->off);
    prism_free(v->sorted);
    prism_free(v->lcp);
    prism_free(v->sdata);
    prism_free(v->soff);
    prism_free(v->eos);
    prism_free(v->is_eos);
    prism_free(v->usable);
    prism_free(v->usable_mask);
    prism_free(v);
}

/* Takes ownership of data/off. */
static int vocab_finish(prism_grammar_vocab_t *v, const bool *special, const int32_t *eos_ids, size_t n_eos,
                        size_t n_vocab_model)
{
    if (n_eos == 0) return PRISM_EINVAL;
    v->n_vocab = n_vocab_model > v->n_tokens ? n_vocab_model : v->n_tokens;
    v->mask_words = (v->n_vocab + 31) / 32;
    v->eos = prism_malloc(n_eos * sizeof *v->eos);
    v->is_eos = prism_calloc(v->n_tokens ? v->n_tokens : 1, sizeof *v->is_eos);
    v->usable = prism_calloc(v->n_tokens ? v->n_tokens : 1, sizeof *v->usable);
    v->sorted = prism_malloc((v->n_tokens ? v->n_tokens : 1) * sizeof *v->sorted);
    v->lcp = prism_calloc(v->n_tokens ? v->n_tokens : 1, sizeof *v->lcp);
    v->usable_mask = prism_calloc(v->mask_words ? v->mask_words : 1, sizeof *v->usable_mask);
    if (!v->eos || !v->is_eos || !v->usable || !v->sorted || !v->lcp || !v->usable_mask) return PRISM_ENOMEM;
    for (size_t i = 0; i < n_eos; i++) {
        if (eos_ids[i] < 0 || (size_t)eos_ids[i] >= v->n_tokens) return PRISM_EINVAL;
        v->eos[i] = eos_ids[i];
        v->is_eos[eos_ids[i]] = true;
    }
    v->n_eos = n_eos;
    for (size_t i = 0; i < v->n_tokens; i++) {
        uint32_t len = v->off[i + 1] - v->off[i];
        /* longer tokens than 65535 bytes would not fit the lcp type; no real vocabulary has them */
        if (len == 0 || len > 4096 || (special && special[i]) || v->is_eos[i]) continue;
        v->usable[i] = true;
        v->usable_mask[i >> 5] |= (int32_t)(1u << (i & 31));
        v->sorted[v->n_sorted++] = (int32_t)i;
        if (len > v->max_len) v->max_len = len;
    }
    qsort_r(v->sorted, v->n_sorted, sizeof *v->sorted, cmp_tok, v);
    for (size_t i = 1; i < v->n_sorted; i++) {
        uint32_t la, lb;
        const uint8_t *a = gram_tok_bytes(v, v->sorted[i - 1], &la), *b = gram_tok_bytes(v, v->sorted[i], &lb);
        uint32_t k = 0;
        while (k < la && k < lb && a[k] == b[k]) k++;
        v->lcp[i] = (uint16_t)k;
    }
    v->soff = prism_malloc((v->n_sorted + 1) * sizeof *v->soff);
    v->sdata = prism_malloc(v->off[v->n_tokens] ? v->off[v->n_tokens] : 1);
    if (!v->soff || !v->sdata) return PRISM_ENOMEM;
    uint32_t at = 0;
    for (size_t i = 0; i < v->n_sorted; i++) {
        uint32_t len;
        const uint8_t *b = gram_tok_bytes(v, v->sorted[i], &len);
        v->soff[i] = at;
        memcpy(v->sdata + at, b, len);
        at += len;
    }
    v->soff[v->n_sorted] = at;
    size_t j = 0;
    for (int b = 0; b < 256; b++) {
        v->first_start[b] = (uint32_t)j;
        while (j < v->n_sorted && v->data[v->off[v->sorted[j]]] == b) j++;
    }
    v->first_start[256] = (uint32_t)j;
    return PRISM_OK;
}

int prism_grammar_vocab_create_from_bytes(const uint8_t *data, const uint32_t *off, size_t n_tokens,
                                          const bool *special, const int32_t *eos_ids, size_t n_eos,
                                          size_t n_vocab_model, prism_grammar_vocab_t **out)
{
    *out = NULL;
    if (n_tokens > (1u << 24)) return PRISM_ELIMIT;
    prism_grammar_vocab_t *v = prism_calloc(1, sizeof *v);
    if (!v) return PRISM_ENOMEM;
    v->n_tokens = n_tokens;
    size_t total = off[n_tokens];
    v->data = prism_malloc(total ? total : 1);
    v->off = prism_malloc((n_tokens + 1) * sizeof *v->off);
    int rc = PRISM_ENOMEM;
    if (!v->data || !v->off) goto fail;
    memcpy(v->data, data, total);
    memcpy(v->off, off, (n_tokens + 1) * sizeof *off);
    rc = vocab_finish(v, special, eos_ids, n_eos, n_vocab_model);
    if (rc < 0) goto fail;
    *out = v;
    return PRISM_OK;
fail:
    prism_grammar_vocab_free(v);
    return rc;
}

int prism_grammar_vocab_create(const prism_tokenizer_t *tok, const int32_t *eos_ids, size_t n_eos,
                               size_t n_vocab_model, prism_grammar_vocab_t **out)
{
    *out = NULL;
    size_t n = prism_tokenizer_vocab_size(tok);
    prism_buf_t all = {0};
    uint32_t *off = prism_malloc((n + 1) * sizeof *off);
    bool *special = prism_calloc(n ? n : 1, sizeof *special);
    int rc = PRISM_ENOMEM;
    if (!off || !special) goto done;
    for (size_t i = 0; i < n; i++) {
        off[i] = (uint32_t)all.len;
        special[i] = prism_tokenizer_is_special(tok, (int32_t)i);
        /* ids with no token (holes in the vocabulary) give no bytes and stay unusable */
        if (prism_tokenizer_id_to_token(tok, (int32_t)i) && !special[i]) {
            rc = prism_tokenizer_token_bytes(tok, (int32_t)i, &all);
            if (rc < 0) goto done;
        }
    }
    off[n] = (uint32_t)all.len;
    rc = prism_grammar_vocab_create_from_bytes((const uint8_t *)(all.data ? all.data : ""), off, n, special,
                                               eos_ids, n_eos, n_vocab_model, out);
done:
    prism_buf_free(&all);
    prism_free(off);
    prism_free(special);
    return rc;
}

size_t prism_grammar_vocab_size(const prism_grammar_vocab_t *v) { return v->n_vocab; }
size_t prism_grammar_mask_words(const prism_grammar_vocab_t *v) { return v->mask_words; }

void prism_grammar_apply_mask(float *logits, const int32_t *mask, size_t n_vocab)
{
    for (size_t w = 0; w * 32 < n_vocab; w++) {
        uint32_t bits = (uint32_t)mask[w];
        if (bits == 0xffffffffu) continue;
        size_t end = (w + 1) * 32 < n_vocab ? (w + 1) * 32 : n_vocab;
        for (size_t i = w * 32; i < end; i++)
            if (!((bits >> (i & 31)) & 1u)) logits[i] = -__builtin_inff();
    }
}
