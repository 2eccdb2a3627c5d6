/* Header probing: walks JPEG markers / PNG chunks with explicit bounds; never touches pixels. */
#include "image/image.h"
#include "image/image_internal.h"

#include <pthread.h>
#include <string.h>

/* Every segment advances at least 2 bytes, so the walk is bounded by len; this cap only keeps
 * pathological files (thousands of empty APPn segments) cheap. */
#define JPEG_MAX_SEGMENTS 4096
#define PNG_MAX_CHUNKS_BEFORE_IDAT 4096

static const uint8_t png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};

const char *prism_image_format_name(prism_image_format_t f)
{
    switch (f) {
    case PRISM_IMAGE_FORMAT_JPEG: return "jpeg";
    case PRISM_IMAGE_FORMAT_PNG:  return "png";
    default:                      return "unknown";
    }
}

static uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }
static uint16_t be16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }

static uint32_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

uint32_t prism_image_crc32(uint32_t crc, const uint8_t *p, size_t n)
{
    pthread_once(&crc_once, crc_init);
    const uint32_t *table = crc_table;
    crc = ~crc;
    for (size_t i = 0; i < n; i++)
        crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

static bool is_sof(uint8_t m)
{
    /* C4 = DHT, C8 = JPG extension, CC = DAC are not frame headers. */
    return m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
}

int prism_image_jpeg_scan_header(const uint8_t *d, size_t len, prism_image_info_t *info,
                                 prism_jpeg_extra_t *extra)
{
    memset(info, 0, sizeof *info);
    if (extra)
        memset(extra, 0, sizeof *extra);
    info->format = PRISM_IMAGE_FORMAT_JPEG;
    if (len < 2 || d[0] != 0xFF || d[1] != 0xD8)
        return PRISM_ENOTSUP;
    size_t pos = 2;
    for (int seg = 0; seg < JPEG_MAX_SEGMENTS; seg++) {
        /* Junk between segments is skipped, as libjpeg ("extraneous bytes before marker") and
         * PIL do; markers may be preceded by any number of 0xFF fill bytes. */
        while (pos < len && d[pos] != 0xFF)
            pos++;
        while (pos < len && d[pos] == 0xFF)
            pos++;
        if (pos >= len)
            return PRISM_ECORRUPT;
        uint8_t m = d[pos++];
        if (m == 0x01 || (m >= 0xD0 && m <= 0xD7))
            continue;                        /* standalone: TEM, RSTn */
        if (m == 0xD8 || m == 0xD9 || m == 0xDA || m == 0x00)
            return PRISM_ECORRUPT;           /* SOI again, EOI or SOS before any frame header */
        if (len - pos < 2)
            return PRISM_ECORRUPT;
        uint16_t seglen = be16(d + pos);
        if (seglen < 2 || seglen > len - pos)
            return PRISM_ECORRUPT;
        const uint8_t *s = d + pos + 2;      /* payload */
        size_t n = seglen - 2;
        if (m == 0xEE && n >= 12 && memcmp(s, "Adobe", 5) == 0 && extra) {
            extra->adobe = true;
            extra->adobe_transform = s[11];
        }
        if (is_sof(m)) {
            if (n < 6)
                return PRISM_ECORRUPT;
            int ncomp = s[5];
            if (ncomp < 1 || n < 6 + 3 * (size_t)ncomp)
                return PRISM_ECORRUPT;
            info->bit_depth = s[0];
            info->height = be16(s + 1);
            info->width = be16(s + 3);
            info->channels = ncomp;
            info->progressive = (m == 0xC2 || m == 0xC6 || m == 0xCA || m == 0xCE);
            info->cmyk = ncomp == 4;
            if (extra)
                extra->sof_marker = m;
            /* Height 0 means "defined later by DNL": legal but unsupported by libjpeg. */
            if (info->width == 0 || info->height == 0)
                return PRISM_ECORRUPT;
            if (ncomp != 1 && ncomp != 3 && ncomp != 4)
                return PRISM_ENOTSUP;
            return PRISM_OK;
        }
        pos += seglen;
    }
    return PRISM_ECORRUPT;
}

int prism_image_png_scan_header(const uint8_t *d, size_t len, prism_image_info_t *info)
{
    memset(info, 0, sizeof *info);
    info->format = PRISM_IMAGE_FORMAT_PNG;
    if (len < 8 || memcmp(d, png_sig, 8) != 0)
        return PRISM_ENOTSUP;
    if (len < 8 + 8 + 13 + 4)
        return PRISM_ECORRUPT;
    const uint8_t *c = d + 8;
    if (be32(c) != 13 || memcmp(c + 4, "IHDR", 4) != 0)
        return PRISM_ECORRUPT;
    if (prism_image_crc32(0, c + 4, 4 + 13) != be32(c + 8 + 13))
        return PRISM_ECORRUPT;
    const uint8_t *h = c + 8;
    uint32_t w = be32(h), ht = be32(h + 4);
    uint8_t depth = h[8], ctype = h[9];
    if (w == 0 || ht == 0 || w > 0x7fffffffu || ht > 0x7fffffffu)
        return PRISM_ECORRUPT;
    if (h[10] != 0 || h[11] != 0 || h[12] > 1)
        return PRISM_ECORRUPT;      /* compression, filter method, interlace */
    bool ok;
    switch (ctype) {
    case 0: ok = depth == 1 || depth == 2 || depth == 4 || depth == 8 || depth == 16; info->channels = 1; break;
    case 2: ok = depth == 8 || depth == 16; info->channels = 3; break;
    case 3: ok = depth == 1 || depth == 2 || depth == 4 || depth == 8; info->channels = 1; info->palette = true; break;
    case 4: ok = depth == 8 || depth == 16; info->channels = 2; info->has_alpha = true; break;
    case 6: ok = depth == 8 || depth == 16; info->channels = 4; info->has_alpha = true; break;
    default: ok = false;
    }
    if (!ok)
        return PRISM_ECORRUPT;
    info->width = (int)w;
    info->height = (int)ht;
    info->bit_depth = depth;
    info->progressive = h[12] == 1;

    /* tRNS must precede IDAT; walk chunk headers (no CRC: the decoder checks those) to find it.
     * A header that ends before IDAT is reported as truncated. */
    size_t pos = 8 + 8 + 13 + 4;
    for (int i = 0; i < PNG_MAX_CHUNKS_BEFORE_IDAT; i++) {
        if (len - pos < 8)
            return PRISM_ECORRUPT;
        uint32_t clen = be32(d + pos);
        const uint8_t *type = d + pos + 4;
        if (clen > 0x7fffffffu)
            return PRISM_ECORRUPT;
        if (memcmp(type, "IDAT", 4) == 0 || memcmp(type, "IEND", 4) == 0)
            break;
        if (memcmp(type, "tRNS", 4) == 0 && ctype != 4 && ctype != 6)
            info->has_alpha = true;
        if ((uint64_t)clen + 12 > len - pos)
            return PRISM_ECORRUPT;
        pos += (size_t)clen + 12;
    }
    if (w > PRISM_IMAGE_MAX_DIM || ht > PRISM_IMAGE_MAX_DIM)
        return PRISM_ELIMIT;
    return PRISM_OK;
}

int prism_image_probe(const uint8_t *data, size_t len, prism_image_info_t *info)
{
    if (!info)
        return PRISM_EINVAL;
    memset(info, 0, sizeof *info);
    if (!data)
        return PRISM_EINVAL;
    if (len >= 2 && data[0] == 0xFF && data[1] == 0xD8)
        return prism_image_jpeg_scan_header(data, len, info, NULL);
    if (len >= 8 && memcmp(data, png_sig, 8) == 0)
        return prism_image_png_scan_header(data, len, info);
    /* A cut-off PNG signature is a truncated PNG, anything else is not an image we know. */
    if (len > 0 && len < 8 && memcmp(data, png_sig, len) == 0)
        return PRISM_ECORRUPT;
    if (len == 1 && data[0] == 0xFF)
        return PRISM_ECORRUPT;
    return PRISM_ENOTSUP;
}

void prism_image_decode_opts_for_target(prism_image_decode_opts_t *opts, const prism_image_info_t *info,
                                        int target_w, int target_h)
{
    opts->min_w = 0;
    opts->min_h = 0;
    if (info->format != PRISM_IMAGE_FORMAT_JPEG || target_w <= 0 || target_h <= 0)
        return;
    if ((int64_t)info->width >= 2 * (int64_t)target_w && (int64_t)info->height >= 2 * (int64_t)target_h) {
        opts->min_w = target_w;
        opts->min_h = target_h;
    }
}
