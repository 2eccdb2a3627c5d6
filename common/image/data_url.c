/* Strict base64 (RFC 4648 section 4) and data: URL (RFC 2397) parsing. */
#include "image/data_url.h"

#include <pthread.h>
#include <string.h>
#include <strings.h>

size_t prism_base64_decoded_max(size_t len)
{
    return len / 4 * 3 + 3;
}

/* 0..63 for alphabet symbols, 64 for '=', 255 for everything else. */
static uint8_t b64_tab[256];
static pthread_once_t b64_once = PTHREAD_ONCE_INIT;

static void b64_init(void)
{
    memset(b64_tab, 255, sizeof b64_tab);
    const char *a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; i++)
        b64_tab[(uint8_t)a[i]] = (uint8_t)i;
    b64_tab['='] = 64;
}

static const uint8_t *b64_table(void)
{
    pthread_once(&b64_once, b64_init);
    return b64_tab;
}

int prism_base64_decode(const char *in, size_t len, uint8_t *out, size_t cap, size_t *out_len)
{
    if (out_len)
        *out_len = 0;
    if ((!in && len) || (!out && cap))
        return PRISM_EINVAL;
    const uint8_t *t = b64_table();
    /* Padding is mandatory, as in Python's base64.b64decode (validate=True), which vLLM uses. */
    if (len % 4 != 0)
        return PRISM_EINVAL;
    size_t pad = 0;
    if (len >= 1 && in[len - 1] == '=')
        pad = (len >= 2 && in[len - 2] == '=') ? 2 : 1;
    size_t data = len - pad;   /* symbols carrying bits */
    size_t rem = data % 4;     /* 0, 2 or 3 symbols in the final quantum */
    if (rem == 1)
        return PRISM_EINVAL;
    size_t need = data / 4 * 3 + (rem ? rem - 1 : 0);
    if (need > cap)
        return PRISM_ELIMIT;
    size_t o = 0, i = 0;
    for (; i + 4 <= data; i += 4) {
        uint8_t a = t[(uint8_t)in[i]], b = t[(uint8_t)in[i + 1]];
        uint8_t c = t[(uint8_t)in[i + 2]], d = t[(uint8_t)in[i + 3]];
        if ((a | b | c | d) & 0xC0)   /* 64 ('=') or 255 */
            return PRISM_EINVAL;
        uint32_t v = (uint32_t)a << 18 | (uint32_t)b << 12 | (uint32_t)c << 6 | d;
        out[o++] = (uint8_t)(v >> 16);
        out[o++] = (uint8_t)(v >> 8);
        out[o++] = (uint8_t)v;
    }
    if (rem) {
        uint8_t a = t[(uint8_t)in[i]], b = t[(uint8_t)in[i + 1]];
        uint8_t c = rem == 3 ? t[(uint8_t)in[i + 2]] : 0;
        if ((a | b | c) & 0xC0)
            return PRISM_EINVAL;
        /* Non-zero leftover bits in the last symbol carry no data; Python accepts them, so do we. */
        uint32_t v = (uint32_t)a << 18 | (uint32_t)b << 12 | (uint32_t)c << 6;
        out[o++] = (uint8_t)(v >> 16);
        if (rem == 3)
            out[o++] = (uint8_t)(v >> 8);
    }
    PRISM_ASSERT(o == need);
    if (out_len)
        *out_len = o;
    return PRISM_OK;
}

int prism_data_url_parse(const char *url, size_t len, const char **mime, size_t *mime_len,
                         const char **b64, size_t *b64_len)
{
    if (!url || !mime || !mime_len || !b64 || !b64_len)
        return PRISM_EINVAL;
    *mime = *b64 = NULL;
    *mime_len = *b64_len = 0;
    if (len < 5 || strncasecmp(url, "data:", 5) != 0)
        return PRISM_EINVAL;
    const char *comma = memchr(url + 5, ',', len - 5);
    if (!comma)
        return PRISM_EINVAL;
    const char *p = url + 5, *end = comma;
    /* media type: up to the first ';' (or the comma) */
    const char *semi = memchr(p, ';', (size_t)(end - p));
    const char *mend = semi ? semi : end;
    const char *slash = memchr(p, '/', (size_t)(mend - p));
    if (mend == p || !slash || slash == p || slash + 1 == mend)
        return PRISM_EINVAL;
    for (const char *q = p; q < mend; q++) {
        unsigned char ch = (unsigned char)*q;
        if (ch <= ' ' || ch >= 0x7f || ch == '"' || ch == '\\')
            return PRISM_EINVAL;
    }
    /* parameters; the last one must be exactly "base64" */
    bool base64 = false;
    while (semi && semi < end) {
        const char *ps = semi + 1;
        const char *pe = memchr(ps, ';', (size_t)(end - ps));
        if (!pe)
            pe = end;
        size_t n = (size_t)(pe - ps);
        if (n == 0)
            return PRISM_EINVAL;
        if (pe == end && n == 6 && strncasecmp(ps, "base64", 6) == 0)
            base64 = true;
        else if (!memchr(ps, '=', n))
            return PRISM_EINVAL;
        semi = pe < end ? pe : NULL;
    }
    if (!base64)
        return PRISM_ENOTSUP;
    *mime = p;
    *mime_len = (size_t)(mend - p);
    *b64 = comma + 1;
    *b64_len = len - (size_t)(comma + 1 - url);
    return PRISM_OK;
}

bool prism_data_url_mime_is_image(const char *mime, size_t n)
{
    static const char *const ok[] = {"image/jpeg", "image/jpg", "image/pjpeg", "image/png"};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(ok); i++)
        if (strlen(ok[i]) == n && strncasecmp(mime, ok[i], n) == 0)
            return true;
    return false;
}
