/* PNG by rows with libspng, allocating nothing: libspng's allocator hooks carve from the decoder's
 * region, and the file reaches libspng through a read callback that drops the ancillary chunks
 * that cannot change pixels (text, ICC, EXIF, ...; CRCs still checked), so metadata costs no
 * memory and the region per image is a fixed function of the width. Non-interlaced images stream
 * row by row; Adam7 images are assembled (as RGB8) in the region first. */
#include "image/image.h"
#include "image/image_internal.h"

#include <spng.h>
#include <stdio.h>
#include <string.h>

/* libspng's allocator hooks carry no context: the region of the decode running on this thread. */
static _Thread_local prism_arena_t *png_arena;

typedef struct {
    size_t size;
    size_t pad;   /* keeps blocks 16-byte aligned */
} blk_t;

static void *png_malloc(size_t n)
{
    prism_arena_t *a = png_arena;
    if (!a || n > a->cap)
        return NULL;
    uint8_t *p = prism_arena_alloc(a, sizeof(blk_t) + n, 16);
    if (!p)
        return NULL;
    ((blk_t *)p)->size = n;
    return p + sizeof(blk_t);
}

static void *png_calloc(size_t count, size_t n)
{
    if (n && count > SIZE_MAX / n)
        return NULL;
    void *p = png_malloc(count * n);
    if (p)
        memset(p, 0, count * n);
    return p;
}

static bool is_last(const prism_arena_t *a, const uint8_t *p)
{
    return p + ((const blk_t *)(p - sizeof(blk_t)))->size == a->base + a->used;
}

/* Only the most recent block is really freed (libspng frees mostly in reverse order); the whole
 * region is reset after each image anyway. */
static void png_free(void *ptr)
{
    prism_arena_t *a = png_arena;
    uint8_t *p = ptr;
    if (!p || !a)
        return;
    if (is_last(a, p))
        a->used = (size_t)(p - sizeof(blk_t) - a->base);
}

static void *png_realloc(void *ptr, size_t n)
{
    prism_arena_t *a = png_arena;
    uint8_t *p = ptr;
    if (!p)
        return png_malloc(n);
    if (!a)
        return NULL;
    blk_t *h = (blk_t *)(p - sizeof(blk_t));
    if (is_last(a, p)) {   /* grow or shrink in place */
        size_t off = (size_t)(p - a->base);
        if (n > a->cap - off)
            return NULL;
        h->size = n;
        a->used = off + n;
        if (a->used > a->peak)
            a->peak = a->used;
        return p;
    }
    uint8_t *q = png_malloc(n);
    if (!q)
        return NULL;
    memcpy(q, p, PRISM_MIN(h->size, n));
    return q;
}

static struct spng_alloc png_hooks = {
    .malloc_fn = png_malloc,
    .realloc_fn = png_realloc,
    .calloc_fn = png_calloc,
    .free_fn = png_free,
};

static int spng_status(int err)
{
    if (err == 0)
        return PRISM_OK;
    if (err == SPNG_EMEM)
        return PRISM_ELIMIT;   /* the region, not the heap, ran out */
    if (err == SPNG_EUSER_WIDTH || err == SPNG_EUSER_HEIGHT || err == SPNG_EOVERFLOW ||
        err == SPNG_ECHUNK_LIMITS)
        return PRISM_ELIMIT;
    return PRISM_ECORRUPT;
}

/* ---------------------------------------------------------------- chunk filter */

typedef struct {
    const uint8_t *d;
    size_t len, pos;
    size_t next;   /* offset of the next chunk header, where the filter looks again */
} png_src_t;

static uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }

/* Chunks that decide pixels: every critical chunk (IHDR, PLTE, IDAT, IEND, and unknown critical
 * ones, which libspng must see to refuse) and tRNS. */
static bool keep_chunk(const uint8_t *type) { return !(type[0] & 0x20) || memcmp(type, "tRNS", 4) == 0; }

/* At a chunk boundary: skip ancillary chunks, checking their CRC as libspng would. Anything
 * malformed or cut short is passed through for libspng to report. */
static int png_skip(png_src_t *s)
{
    for (;;) {
        if (s->len - s->pos < 8) {
            s->next = s->len;
            return 0;
        }
        uint32_t n = be32(s->d + s->pos);
        const uint8_t *type = s->d + s->pos + 4;
        if (n > 0x7fffffffu || (uint64_t)n + 12 > s->len - s->pos || keep_chunk(type)) {
            s->next = (n > 0x7fffffffu || (uint64_t)n + 12 > s->len - s->pos) ? s->len : s->pos + 12 + n;
            return 0;
        }
        if (prism_image_crc32(0, type, 4 + (size_t)n) != be32(type + 4 + n))
            return SPNG_IO_ERROR;
        s->pos += 12 + (size_t)n;
    }
}

static int png_read(spng_ctx *ctx, void *user, void *dest, size_t n)
{
    (void)ctx;
    png_src_t *s = user;
    uint8_t *out = dest;
    while (n) {
        if (s->pos == s->next) {
            int rc = png_skip(s);
            if (rc)
                return rc;
        }
        size_t lim = s->next > s->pos ? s->next : s->len;
        size_t take = PRISM_MIN(n, lim - s->pos);
        if (take == 0)
            return SPNG_IO_EOF;
        memcpy(out, s->d + s->pos, take);
        s->pos += take;
        out += take;
        n -= take;
    }
    return 0;
}

/* ---------------------------------------------------------------- decode */

size_t prism_image_png_stream_bytes(int width)
{
    /* libspng's context, zlib's inflate state and 32 KiB window, its stream buffer (52 KiB
     * measured); per column two scanlines of up to 8 bytes (16-bit RGBA), its row buffer, and our
     * RGBA and RGB rows (23 bytes measured). */
    return (size_t)(96u << 10) + (size_t)width * 32u;
}

static const int adam7_x0[7] = {0, 4, 0, 2, 0, 1, 0};
static const int adam7_dx[7] = {8, 8, 4, 4, 2, 2, 1};

static void composite(const uint8_t *rgba, int x0, int dx, int w, uint8_t *rgb)
{
    for (int x = x0; x < w; x += dx) {
        uint8_t a = rgba[x * 4 + 3];
        rgb[x * 3 + 0] = prism_image_over_white(rgba[x * 4 + 0], a);
        rgb[x * 3 + 1] = prism_image_over_white(rgba[x * 4 + 1], a);
        rgb[x * 3 + 2] = prism_image_over_white(rgba[x * 4 + 2], a);
    }
}

int prism_image_png_run(prism_image_decoder_t *d, const uint8_t *data, size_t len,
                        const prism_image_info_t *info, const prism_image_sink_t *sink)
{
    png_src_t src = {.d = data, .len = len, .pos = 0, .next = 8};
    int rc = PRISM_OK, err = 0;
    png_arena = &d->arena;
    spng_ctx *ctx = spng_ctx_new2(&png_hooks, 0);
    if (!ctx) {
        png_arena = NULL;
        snprintf(d->err, sizeof d->err, "the PNG decoder does not fit the decode memory");
        return PRISM_ELIMIT;
    }
    err = spng_set_image_limits(ctx, PRISM_IMAGE_MAX_DIM, PRISM_IMAGE_MAX_DIM);
    if (!err)
        err = spng_set_png_stream(ctx, png_read, &src);
    struct spng_ihdr ihdr;
    if (!err)
        err = spng_get_ihdr(ctx, &ihdr);
    if (err)
        goto spng_fail;
    if ((int)ihdr.width != info->width || (int)ihdr.height != info->height) {
        rc = PRISM_ECORRUPT;
        goto done;
    }
    /* spng reports tRNS only once it has read the chunks before IDAT (get_ihdr did). */
    struct spng_trns trns;
    bool alpha = ihdr.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA ||
                 ihdr.color_type == SPNG_COLOR_TYPE_TRUECOLOR_ALPHA || spng_get_trns(ctx, &trns) == 0;
    int w = info->width, h = info->height;
    bool interlaced = ihdr.interlace_method != 0;
    size_t rgb_row = (size_t)w * 3, rgba_row = (size_t)w * 4;
    uint8_t *tmp = NULL, *whole = NULL, *rgb = NULL;
    if (alpha && !(tmp = prism_arena_alloc(&d->arena, rgba_row, 64)))
        goto no_room;
    if (interlaced) {
        /* Adam7 rows arrive pass by pass: assemble the image (RGB8) before handing out rows. */
        size_t bytes = rgb_row * (size_t)h;
        if (!(whole = prism_arena_alloc(&d->arena, bytes, 64))) {
            char a[32], b[32];
            d->need_bytes = d->arena.used + bytes + prism_image_png_stream_bytes(w);
            snprintf(d->err, sizeof d->err,
                     "the %dx%d interlaced PNG needs %s of decode memory to assemble; the decoder has %s", w, h,
                     prism_fmt_bytes(bytes, a, sizeof a), prism_fmt_bytes(d->arena.cap - d->arena.used, b, sizeof b));
            rc = PRISM_ELIMIT;
            goto done;
        }
    } else if (!sink->rowbuf && !(rgb = prism_arena_alloc(&d->arena, rgb_row, 64))) {
        goto no_room;
    }
    prism_image_t g = {.w = w, .h = h, .src_w = w, .src_h = h, .scale_num = 1, .scale_denom = 1,
                       .format = PRISM_IMAGE_FORMAT_PNG};
    if (sink->begin && (rc = sink->begin(sink->ud, &g)) != PRISM_OK)
        goto done;
    int fmt = alpha ? SPNG_FMT_RGBA8 : SPNG_FMT_RGB8;
    err = spng_decode_image(ctx, NULL, 0, fmt, SPNG_DECODE_PROGRESSIVE | (alpha ? SPNG_DECODE_TRNS : 0));
    if (err)
        goto spng_fail;
    size_t rows = 0, max_rows = interlaced ? (size_t)h * 7 : (size_t)h;
    for (;;) {
        struct spng_row_info ri;
        if ((err = spng_get_row_info(ctx, &ri)) != 0)
            break;
        if (ri.row_num >= (uint32_t)h || ri.pass < 0 || ri.pass > 6 || ++rows > max_rows) {
            err = SPNG_EINTERNAL;
            break;
        }
        uint8_t *dst = interlaced ? whole + (size_t)ri.row_num * rgb_row : rgb;
        if (!interlaced && sink->rowbuf && (rc = sink->rowbuf(sink->ud, (int)ri.row_num, &dst)) != PRISM_OK)
            goto done;
        err = spng_decode_row(ctx, alpha ? tmp : dst, alpha ? rgba_row : rgb_row);
        if (err && err != SPNG_EOI)
            break;
        if (alpha)
            composite(tmp, interlaced ? adam7_x0[ri.pass] : 0, interlaced ? adam7_dx[ri.pass] : 1, w, dst);
        if (!interlaced && (rc = sink->row(sink->ud, (int)ri.row_num, dst)) != PRISM_OK)
            goto done;
        if (err == SPNG_EOI) {
            err = !interlaced && ri.row_num != (uint32_t)h - 1 ? SPNG_EOI : 0;
            break;
        }
    }
    if (err)
        goto spng_fail;
    if (interlaced)
        for (int y = 0; y < h; y++) {
            uint8_t *src_row = whole + (size_t)y * rgb_row, *dst = src_row;
            if (sink->rowbuf) {
                if ((rc = sink->rowbuf(sink->ud, y, &dst)) != PRISM_OK)
                    goto done;
                memcpy(dst, src_row, rgb_row);
            }
            if ((rc = sink->row(sink->ud, y, dst)) != PRISM_OK)
                goto done;
        }
    goto done;

no_room:
    snprintf(d->err, sizeof d->err, "the %dx%d PNG's rows do not fit the decode memory", info->width, info->height);
    d->need_bytes = d->arena.used + prism_image_png_stream_bytes(info->width);
    rc = PRISM_ELIMIT;
    goto done;
spng_fail:
    rc = spng_status(err);
    if (rc == PRISM_ELIMIT)
        snprintf(d->err, sizeof d->err, "the PNG does not fit the decode memory (%s)", spng_strerror(err));
    else
        snprintf(d->err, sizeof d->err, "the PNG data is corrupt or truncated (%s)", spng_strerror(err));
done:
    spng_ctx_free(ctx);
    png_arena = NULL;
    return rc;
}
