/* Normalizers (NFC/NFD, Prepend, Replace, Strip, Sequence), applied to text pieces by the encoder
 * and to added-token contents at load. */
#include "tokenizer/tok_internal.h"

int prism_tok_normalize(const prism_tokenizer_t *t, const prism_tok_norm_t *nz, const char *s, size_t n,
                        prism_buf_t *out, pcre2_match_data *md)
{
    switch (nz->type) {
    case PRISM_TOK_NORM_NFC:
    case PRISM_TOK_NORM_NFD: {
        bool changed;
        int rc = prism_tok_nfc(s, n, nz->type == PRISM_TOK_NORM_NFC, out, &changed);
        if (rc) return rc;
        if (!changed && prism_buf_append(out, s, n) < 0) return PRISM_ENOMEM;
        return PRISM_OK;
    }
    case PRISM_TOK_NORM_PREPEND:
        if (n && prism_buf_append(out, nz->str, nz->str_len) < 0) return PRISM_ENOMEM;
        return prism_buf_append(out, s, n) < 0 ? PRISM_ENOMEM : PRISM_OK;
    case PRISM_TOK_NORM_REPLACE:
        return prism_tok_replace_all(&nz->pat, md, s, n, nz->str, nz->str_len, out);
    case PRISM_TOK_NORM_STRIP: {
        size_t a = 0, b = n;
        if (nz->left)
            while (a < b) {
                uint32_t cp;
                int k = prism_utf8_decode_valid(s + a, &cp);
                if (!prism_tok_is_white_space(cp)) break;
                a += (size_t)k;
            }
        if (nz->right)
            while (b > a) {
                size_t q = b - 1;
                while (q > a && ((uint8_t)s[q] & 0xC0) == 0x80) q--;
                uint32_t cp;
                prism_utf8_decode_valid(s + q, &cp);
                if (!prism_tok_is_white_space(cp)) break;
                b = q;
            }
        return prism_buf_append(out, s + a, b - a) < 0 ? PRISM_ENOMEM : PRISM_OK;
    }
    case PRISM_TOK_NORM_SEQUENCE: {
        prism_buf_t cur = {0}, nxt = {0};
        int rc = PRISM_ENOMEM;
        if (prism_buf_append(&cur, s, n) < 0) goto done;
        for (size_t i = 0; i < nz->n_items; i++) {
            nxt.len = 0;
            if ((rc = prism_tok_normalize(t, &nz->items[i], cur.data ? cur.data : "", cur.len, &nxt, md))) goto done;
            prism_buf_t sw = cur; cur = nxt; nxt = sw;
        }
        rc = prism_buf_append(out, cur.data ? cur.data : "", cur.len) < 0 ? PRISM_ENOMEM : PRISM_OK;
    done:
        prism_buf_free(&cur);
        prism_buf_free(&nxt);
        return rc;
    }
    }
    return PRISM_EINVAL;
}
