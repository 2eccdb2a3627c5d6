/* Streaming data-URL lifter. See body_lift.h. */
#include "body_lift.h"
#include "image/data_url.h"

#include <stdio.h>
#include <string.h>

enum { S_OUT = 0, S_STR, S_CAND, S_LIFT };

#define LIFT_GROW_MIN (64 * 1024)

/* 0..63 alphabet, 64 '=', 255 anything else: the same alphabet as prism_base64_decode. */
static const uint8_t *b64_tab(void)
{
    static uint8_t t[256];
    static bool init;
    if (!init) {
        memset(t, 255, sizeof t);
        const char *a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        for (int i = 0; i < 64; i++) t[(uint8_t)a[i]] = (uint8_t)i;
        t['='] = 64;
        init = true;  /* idempotent: a racing second init writes the same bytes */
    }
    return t;
}

void prism_lift_init(prism_lift_t *l, uint64_t declared, size_t max_image)
{
    memset(l, 0, sizeof *l);
    l->declared = declared;
    l->max_image = max_image;
    (void)b64_tab();
}

static int hexval(uint8_t c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* JSON unescaping, one raw byte at a time. Returns 1 with *ch set when a character is complete,
 * 0 when more bytes are needed, -1 for an escape that is malformed or outside printable ASCII
 * (never part of a data URL header or of base64). */
static int unescape(prism_lift_t *l, uint8_t b, uint8_t *ch)
{
    switch (l->u_state) {
    case 0:
        if (b == '\\') {
            l->u_state = 1;
            return 0;
        }
        *ch = b;
        return 1;
    case 1:
        l->u_state = 0;
        switch (b) {
        case '"': case '\\': case '/': *ch = b; return 1;
        case 'u': l->u_state = 2; l->u_val = 0; return 0;
        default: return -1;  /* \b \f \n \r \t are control characters; anything else is malformed */
        }
    default: {
        int h = hexval(b);
        if (h < 0) {
            l->u_state = 0;
            return -1;
        }
        l->u_val = l->u_val * 16 + (uint32_t)h;
        if (++l->u_state < 6) return 0;
        l->u_state = 0;
        if (l->u_val < 0x20 || l->u_val >= 0x7f) return -1;
        *ch = (uint8_t)l->u_val;
        return 1;
    }
    }
}

static int img_reserve(prism_lift_t *l, prism_lift_image_t *im, size_t extra)
{
    if (im->len + extra <= im->cap) return PRISM_OK;
    /* Doubling, so what is allocated (and charged) stays within twice what arrived; never past what
     * the rest of a declared body can still decode to. */
    size_t cap = PRISM_MAX(im->cap * 2, (size_t)LIFT_GROW_MIN);
    if (l->declared > l->fed) {
        uint64_t most = im->len + (l->declared - l->fed) / 4 * 3 + 3;
        if (cap > most) cap = (size_t)most;
    }
    if (cap < im->len + extra) cap = im->len + extra;
    uint8_t *d = prism_realloc(im->data, cap);
    if (!d) return PRISM_ENOMEM;
    l->held += cap - im->cap;
    im->data = d;
    im->cap = cap;
    return PRISM_OK;
}

static void img_bad(prism_lift_t *l, prism_lift_image_t *im)
{
    if (im->bad) return;
    im->bad = true;
    l->held -= im->cap;
    prism_free(im->data);
    im->data = NULL;
    im->len = im->cap = 0;
}

/* One base64 character of the payload (strict, as prism_base64_decode). */
static int b64_feed(prism_lift_t *l, prism_lift_image_t *im, uint8_t c)
{
    if (im->bad) return PRISM_OK;
    uint8_t v = b64_tab()[c];
    if (v == 255 || (v != 64 && l->pads)) {  /* not in the alphabet, or data after padding */
        img_bad(l, im);
        return PRISM_OK;
    }
    if (v == 64) {
        if (++l->pads > 2) img_bad(l, im);
        return PRISM_OK;
    }
    l->quad[l->nq++] = v;
    if (l->nq < 4) return PRISM_OK;
    l->nq = 0;
    if (img_reserve(l, im, 3)) return PRISM_ENOMEM;
    uint32_t x = (uint32_t)l->quad[0] << 18 | (uint32_t)l->quad[1] << 12 | (uint32_t)l->quad[2] << 6 | l->quad[3];
    im->data[im->len++] = (uint8_t)(x >> 16);
    im->data[im->len++] = (uint8_t)(x >> 8);
    im->data[im->len++] = (uint8_t)x;
    return PRISM_OK;
}

/* The closing quote: the last quantum and the padding rules, then trim the buffer. */
static int b64_finish(prism_lift_t *l, prism_lift_image_t *im)
{
    im->done = true;
    if (im->bad) return PRISM_OK;
    int nq = l->nq, p = l->pads;
    if (!((nq == 0 && p == 0) || (nq == 2 && p == 2) || (nq == 3 && p == 1))) {
        img_bad(l, im);
        return PRISM_OK;
    }
    if (nq) {
        if (img_reserve(l, im, 2)) return PRISM_ENOMEM;
        uint32_t x = (uint32_t)l->quad[0] << 18 | (uint32_t)l->quad[1] << 12 | (nq == 3 ? (uint32_t)l->quad[2] << 6 : 0);
        im->data[im->len++] = (uint8_t)(x >> 16);
        if (nq == 3) im->data[im->len++] = (uint8_t)(x >> 8);
    }
    if (im->cap > im->len && im->len) {  /* the doubling's slack is given back */
        uint8_t *d = prism_realloc(im->data, im->len);
        if (d) {
            l->held -= im->cap - im->len;
            im->data = d;
            im->cap = im->len;
        }
    }
    return PRISM_OK;
}

/* A candidate that is not a data URL after all: its bytes go to the skeleton as they came. */
static int cand_flush(prism_lift_t *l, prism_buf_t *out)
{
    if (prism_buf_append(out, "\"", 1) || prism_buf_append(out, l->raw, l->raw_len)) return PRISM_ENOMEM;
    l->state = S_STR;
    l->esc = l->u_state == 1;  /* cut right after a backslash: the next byte is escaped */
    l->u_state = 0;
    l->cur_len = PRISM_MIN(l->raw_len, sizeof l->cur);
    memcpy(l->cur, l->raw, l->cur_len);
    return PRISM_OK;
}

/* The header ends at its comma: lift when it is a base64 data URL the image path would accept. */
static int cand_decide(prism_lift_t *l, prism_buf_t *out)
{
    const char *mime, *b64;
    size_t mime_len, b64_len;
    if (prism_data_url_parse(l->hdr, l->hdr_len, &mime, &mime_len, &b64, &b64_len) != PRISM_OK ||
        mime_len >= sizeof l->img[0].mime)
        return cand_flush(l, out);
    prism_lift_image_t *im = &l->img[l->n];
    memset(im, 0, sizeof *im);
    memcpy(im->mime, mime, mime_len);
    im->mime[mime_len] = 0;
    im->ordinal = l->n_urls - 1;
    char ref[48];
    int n = snprintf(ref, sizeof ref, "\"" PRISM_LIFT_REF_PREFIX "%d", l->n);
    if (prism_buf_append(out, ref, (size_t)n)) return PRISM_ENOMEM;
    l->n++;
    l->nq = l->pads = 0;
    l->state = S_LIFT;
    return PRISM_OK;
}

static int feed_cand(prism_lift_t *l, prism_buf_t *out, uint8_t b)
{
    if (l->u_state == 0 && b == '"') {  /* ended before any comma: an ordinary string */
        if (prism_buf_append(out, "\"", 1) || prism_buf_append(out, l->raw, l->raw_len) ||
            prism_buf_append(out, "\"", 1))
            return PRISM_ENOMEM;
        l->state = S_OUT;
        l->last_is_url = false;
        return PRISM_OK;
    }
    l->raw[l->raw_len++] = (char)b;
    uint8_t ch;
    int u = unescape(l, b, &ch);
    if (u < 0 || (u > 0 && (ch < 0x20 || ch >= 0x7f))) return cand_flush(l, out);
    if (u == 0) {
        if (l->raw_len + 8 > sizeof l->raw) return cand_flush(l, out);
        return PRISM_OK;
    }
    l->hdr[l->hdr_len++] = (char)ch;
    l->hdr[l->hdr_len] = 0;
    if (ch == ',') return cand_decide(l, out);
    if (l->hdr_len >= PRISM_LIFT_MAX_HEADER || l->raw_len + 8 > sizeof l->raw) return cand_flush(l, out);
    return PRISM_OK;
}

/* Each state's feed takes bytes from s[*i] on (at least one when *i < n) and returns 0 or PRISM_ENOMEM. */

/* Outside strings: the run of structure bytes up to the next string, noting whether the string that
 * opens there is the value of a "url" / "image_url" key (a data URL candidate). */
static int feed_out(prism_lift_t *l, prism_buf_t *out, const uint8_t *s, size_t n, size_t *ip)
{
    size_t i = *ip, j = i;
    while (j < n && s[j] != '"') {
        uint8_t c = s[j];
        if (c == ':') {
            l->expect_value = true;
            l->key_is_url = l->last_is_url;
        } else if (c != ' ' && c != '\t' && c != '\n' && c != '\r') {
            l->expect_value = false;
            l->last_is_url = false;
        }
        j++;
    }
    if (j > i && prism_buf_append(out, s + i, j - i)) return PRISM_ENOMEM;
    l->fed += j - i;
    *ip = j;
    if (j == n) return PRISM_OK;
    bool url_value = l->expect_value && l->key_is_url;
    bool cand = url_value && l->n < PRISM_LIFT_MAX;
    l->n_urls += url_value;
    l->expect_value = false;
    l->last_is_url = false;
    l->u_state = 0;
    l->esc = false;
    l->cur_len = 0;
    (*ip)++;
    l->fed++;
    if (cand) {
        l->state = S_CAND;
        l->raw_len = l->hdr_len = 0;
        return PRISM_OK;
    }
    if (prism_buf_append(out, "\"", 1)) return PRISM_ENOMEM;
    l->state = S_STR;
    return PRISM_OK;
}

/* Inside an ordinary string: copied as it is, its first bytes kept to recognise a url key. */
static int feed_str(prism_lift_t *l, prism_buf_t *out, const uint8_t *s, size_t n, size_t *ip)
{
    size_t i = *ip, j = i;
    bool end = false;
    while (j < n) {
        uint8_t c = s[j++];
        if (l->cur_len < sizeof l->cur) l->cur[l->cur_len] = (char)c;
        l->cur_len++;
        if (l->esc) {
            l->esc = false;
        } else if (c == '\\') {
            l->esc = true;
        } else if (c == '"') {
            end = true;
            break;
        }
    }
    if (prism_buf_append(out, s + i, j - i)) return PRISM_ENOMEM;
    l->fed += j - i;
    *ip = j;
    if (end) {
        size_t len = l->cur_len - 1;  /* without the quote */
        l->last_is_url = (len == 3 && !memcmp(l->cur, "url", 3)) || (len == 9 && !memcmp(l->cur, "image_url", 9));
        l->state = S_OUT;
    }
    return PRISM_OK;
}

/* Inside a lifted data URL's base64: decoded into the image, whole quanta of plain alphabet bytes
 * on a fast path, escapes and padding a byte at a time. */
static int feed_lift(prism_lift_t *l, prism_buf_t *out, const uint8_t *s, size_t n, size_t *ip)
{
    const uint8_t *t = b64_tab();
    prism_lift_image_t *im = &l->img[l->n - 1];
    size_t i = *ip;
    if (l->u_state == 0 && !l->pads && !im->bad) {
        size_t j = i;
        while (j < n && l->nq == 0 && j + 4 <= n) {
            uint8_t a = t[s[j]], b = t[s[j + 1]], c = t[s[j + 2]], d = t[s[j + 3]];
            if ((a | b | c | d) & 0xC0) break;
            if (img_reserve(l, im, 3)) return PRISM_ENOMEM;
            uint32_t x = (uint32_t)a << 18 | (uint32_t)b << 12 | (uint32_t)c << 6 | d;
            im->data[im->len++] = (uint8_t)(x >> 16);
            im->data[im->len++] = (uint8_t)(x >> 8);
            im->data[im->len++] = (uint8_t)x;
            j += 4;
        }
        l->fed += j - i;
        *ip = i = j;
        if (i == n) return PRISM_OK;
    }
    uint8_t b = s[i];
    *ip = i + 1;
    l->fed++;
    if (l->u_state == 0 && b == '"') {
        if (b64_finish(l, im) || prism_buf_append(out, "\"", 1)) return PRISM_ENOMEM;
        l->state = S_OUT;
        l->last_is_url = false;
        return PRISM_OK;
    }
    uint8_t ch;
    int u = unescape(l, b, &ch);
    if (u < 0) img_bad(l, im);
    else if (u > 0 && b64_feed(l, im, ch)) return PRISM_ENOMEM;
    return PRISM_OK;
}

int prism_lift_feed(prism_lift_t *l, prism_buf_t *out, const char *p, size_t n)
{
    const uint8_t *s = (const uint8_t *)p;
    size_t i = 0;
    while (i < n) {
        int rc;
        switch (l->state) {
        case S_OUT:  rc = feed_out(l, out, s, n, &i); break;
        case S_STR:  rc = feed_str(l, out, s, n, &i); break;
        case S_LIFT: rc = feed_lift(l, out, s, n, &i); break;
        case S_CAND:
            rc = feed_cand(l, out, s[i]);
            i++;
            l->fed++;
            break;
        default:
            PRISM_ASSERT(!"lifter state");
            return PRISM_EINVAL;
        }
        if (rc) return rc;
    }
    return PRISM_OK;
}

int prism_lift_finish(prism_lift_t *l, prism_buf_t *out)
{
    if (l->state == S_CAND) return cand_flush(l, out);
    return PRISM_OK;
}

int prism_lift_take(prism_lift_t *l, int i, uint8_t **data, size_t *len, const char **mime, bool *bad)
{
    if (i < 0 || i >= l->n || l->img[i].taken || !l->img[i].done) return PRISM_EINVAL;
    prism_lift_image_t *im = &l->img[i];
    im->taken = true;
    *data = im->data;
    *len = im->len;
    if (mime) *mime = im->mime;
    if (bad) *bad = im->bad;
    l->held -= im->cap;
    im->data = NULL;
    im->len = im->cap = 0;
    return PRISM_OK;
}

int prism_lift_peek(const prism_lift_t *l, int i, const uint8_t **data, size_t *len, const char **mime, bool *bad)
{
    if (i < 0 || i >= l->n || l->img[i].taken || !l->img[i].done) return PRISM_EINVAL;
    const prism_lift_image_t *im = &l->img[i];
    *data = im->data;
    *len = im->len;
    if (mime) *mime = im->mime;
    if (bad) *bad = im->bad;
    return PRISM_OK;
}

void prism_lift_free(prism_lift_t *l)
{
    for (int i = 0; i < l->n; i++) {
        prism_free(l->img[i].data);
        l->img[i].data = NULL;
    }
    l->held = 0;
    l->n = 0;
}

int prism_lift_ref(const char *s, size_t len)
{
    size_t pl = sizeof PRISM_LIFT_REF_PREFIX - 1;
    if (len <= pl || len > pl + 2 || memcmp(s, PRISM_LIFT_REF_PREFIX, pl) != 0) return -1;
    int v = 0;
    for (size_t k = pl; k < len; k++) {
        if (s[k] < '0' || s[k] > '9') return -1;
        v = v * 10 + (s[k] - '0');
    }
    if (len == pl + 2 && s[pl] == '0') return -1;  /* one spelling per index */
    return v < PRISM_LIFT_MAX ? v : -1;
}
