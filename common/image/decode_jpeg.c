/* JPEG by scanlines with libjpeg-turbo, allocating nothing: one decompressor per decoder, whose
 * memory manager is replaced by ours (every pool, sample array and virtual coefficient array is
 * carved from the decoder's region), with an in-memory source, an error manager that turns
 * libjpeg's errors and truncation warnings into status codes, and a progress monitor that caps
 * the scan count. Settings match what PIL and turbojpeg decode with (ISLOW IDCT, fancy
 * upsampling, block smoothing), so rows are identical to a whole-image decode. */
#include "image/image.h"
#include "image/image_internal.h"

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

/* libjpeg-turbo's scaling factors at or below 1 (what turbojpeg offers: M/8, reduced). */
static const struct { int num, denom; } jpeg_scales[] = {
    {1, 1}, {7, 8}, {3, 4}, {5, 8}, {1, 2}, {3, 8}, {1, 4}, {1, 8},
};

static int scaled(int d, int num, int denom) { return (int)(((int64_t)d * num + denom - 1) / denom); }

void prism_image_jpeg_pick_scale(int w, int h, int min_w, int min_h, int *num, int *denom)
{
    *num = 1;
    *denom = 1;
    if (min_w <= 0 || min_h <= 0)
        return;
    double best = 1.0;
    for (size_t i = 0; i < PRISM_ARRAY_LEN(jpeg_scales); i++) {
        int n = jpeg_scales[i].num, dd = jpeg_scales[i].denom;
        double r = (double)n / dd;
        if (scaled(w, n, dd) >= min_w && scaled(h, n, dd) >= min_h && r < best) {
            best = r;
            *num = n;
            *denom = dd;
        }
    }
}

void prism_image_scaled_size(const prism_image_info_t *info, int min_w, int min_h, int *w, int *h)
{
    *w = info->width;
    *h = info->height;
    if (info->format != PRISM_IMAGE_FORMAT_JPEG)
        return;
    int num, denom;
    prism_image_jpeg_pick_scale(info->width, info->height, min_w, min_h, &num, &denom);
    *w = scaled(info->width, num, denom);
    *h = scaled(info->height, num, denom);
}

#define JALIGN 32                     /* libjpeg-turbo's ALIGN_SIZE with SIMD */
#define JMAX_CHUNK 1000000000L        /* libjpeg's MAX_ALLOC_CHUNK */

/* Our virtual arrays: always wholly in memory (libjpeg-turbo has no backing store either). */
struct jvirt_sarray_control {
    JSAMPARRAY mem_buffer;
    JDIMENSION rows_in_array, samplesperrow, maxaccess, first_undef_row;
    boolean pre_zero;
    struct jvirt_sarray_control *next;
};

struct jvirt_barray_control {
    JBLOCKARRAY mem_buffer;
    JDIMENSION rows_in_array, blocksperrow, maxaccess, first_undef_row;
    boolean pre_zero;
    struct jvirt_barray_control *next;
};

typedef struct {
    struct jpeg_memory_mgr pub;       /* must stay first: libjpeg sees only this */
    struct jpeg_memory_mgr *lib;      /* libjpeg's own manager: owns what jpeg_create_decompress made */
    prism_image_decoder_t *d;
    jvirt_sarray_ptr virt_s;
    jvirt_barray_ptr virt_b;
} jmem_t;

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jb;
    int rc;
    prism_image_decoder_t *d;
} jerr_t;

typedef struct {
    struct jpeg_progress_mgr pub;     /* must stay first */
    int last_scan;
    uint64_t visits;                  /* coefficient blocks the scans so far cover */
    uint64_t blocks;                  /* blocks of the whole image */
} jprog_t;

struct prism_jpeg_state {
    struct jpeg_decompress_struct ci;
    jerr_t err;
    jmem_t mem;
    struct jpeg_source_mgr src;
    jprog_t progress;
};

static size_t jround(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* ---------------------------------------------------------------- errors */

static _Noreturn void jfail(j_common_ptr c, int rc, const char *fmt, const char *detail)
{
    jerr_t *e = (jerr_t *)c->err;
    e->rc = rc;
    if (!e->d->err[0])
        snprintf(e->d->err, sizeof e->d->err, fmt, detail);
    longjmp(e->jb, 1);
}

static void jerr_exit(j_common_ptr c)
{
    char buf[JMSG_LENGTH_MAX];
    (*c->err->format_message)(c, buf);
    if (c->err->msg_code == JERR_OUT_OF_MEMORY)
        jfail(c, PRISM_ELIMIT, "the JPEG needs more decode memory than the decoder has (%s)", buf);
    jfail(c, PRISM_ECORRUPT, "the JPEG data is corrupt (%s)", buf);
}

static void jerr_emit(j_common_ptr c, int level)
{
    if (level >= 0)
        return;   /* trace messages */
    /* A truncated file is an error for us, as it is for PIL; other warnings (extraneous bytes,
     * a bad code that libjpeg skips) are common in camera files and PIL accepts them too. */
    if (c->err->msg_code == JWRN_JPEG_EOF || c->err->msg_code == JWRN_HIT_MARKER)
        jfail(c, PRISM_ECORRUPT, "%s", "the JPEG data is truncated");
    c->err->num_warnings++;
}

static void jerr_output(j_common_ptr c) { (void)c; }

/* ---------------------------------------------------------------- memory manager */

static void *jmem_get(j_common_ptr c, int pool, size_t n)
{
    jmem_t *m = (jmem_t *)c->mem;
    if (pool != JPOOL_PERMANENT && pool != JPOOL_IMAGE)
        ERREXIT1(c, JERR_BAD_POOL_ID, pool);
    if (n > (size_t)JMAX_CHUNK)
        ERREXIT1(c, JERR_OUT_OF_MEMORY, 1);
    /* sizes rounded like libjpeg's, since SIMD code may touch up to the alignment */
    n = jround(n ? n : 1, JALIGN);
    prism_arena_t *a = pool == JPOOL_PERMANENT ? &m->d->perm : &m->d->arena;
    void *p = prism_arena_alloc(a, n, JALIGN);
    if (!p)
        ERREXIT1(c, JERR_OUT_OF_MEMORY, pool == JPOOL_PERMANENT ? 2 : 3);
    return p;
}

static void *jmem_small(j_common_ptr c, int pool, size_t n) { return jmem_get(c, pool, n); }
static void *jmem_large(j_common_ptr c, int pool, size_t n) { return jmem_get(c, pool, n); }

static JSAMPARRAY jmem_sarray(j_common_ptr c, int pool, JDIMENSION samplesperrow, JDIMENSION numrows)
{
    if (samplesperrow > JMAX_CHUNK)
        ERREXIT1(c, JERR_OUT_OF_MEMORY, 9);
    /* libjpeg pads rows to 2 * ALIGN_SIZE so upsamplers may write whole vectors */
    size_t spr = jround(samplesperrow, 2 * JALIGN);
    if (numrows && spr > (size_t)JMAX_CHUNK / numrows)
        ERREXIT1(c, JERR_OUT_OF_MEMORY, 4);
    JSAMPARRAY rows = jmem_get(c, pool, (size_t)numrows * sizeof(JSAMPROW));
    JSAMPLE *ws = jmem_get(c, pool, (size_t)numrows * spr);
    for (JDIMENSION i = 0; i < numrows; i++)
        rows[i] = ws + (size_t)i * spr;
    return rows;
}

static JBLOCKARRAY jmem_barray(j_common_ptr c, int pool, JDIMENSION blocksperrow, JDIMENSION numrows)
{
    size_t row = (size_t)blocksperrow * sizeof(JBLOCK);
    if (blocksperrow > JMAX_CHUNK / sizeof(JBLOCK) || (numrows && row > (size_t)JMAX_CHUNK / numrows))
        ERREXIT1(c, JERR_OUT_OF_MEMORY, 5);
    JBLOCKARRAY rows = jmem_get(c, pool, (size_t)numrows * sizeof(JBLOCKROW));
    JBLOCK *ws = jmem_get(c, pool, (size_t)numrows * row);
    for (JDIMENSION i = 0; i < numrows; i++)
        rows[i] = ws + (size_t)i * blocksperrow;
    return rows;
}

static jvirt_sarray_ptr jmem_req_sarray(j_common_ptr c, int pool, boolean pre_zero, JDIMENSION samplesperrow,
                                        JDIMENSION numrows, JDIMENSION maxaccess)
{
    jmem_t *m = (jmem_t *)c->mem;
    if (pool != JPOOL_IMAGE)
        ERREXIT1(c, JERR_BAD_POOL_ID, pool);
    jvirt_sarray_ptr v = jmem_get(c, pool, sizeof *v);
    memset(v, 0, sizeof *v);
    v->rows_in_array = numrows;
    v->samplesperrow = samplesperrow;
    v->maxaccess = maxaccess;
    v->pre_zero = pre_zero;
    v->next = m->virt_s;
    m->virt_s = v;
    return v;
}

static jvirt_barray_ptr jmem_req_barray(j_common_ptr c, int pool, boolean pre_zero, JDIMENSION blocksperrow,
                                        JDIMENSION numrows, JDIMENSION maxaccess)
{
    jmem_t *m = (jmem_t *)c->mem;
    if (pool != JPOOL_IMAGE)
        ERREXIT1(c, JERR_BAD_POOL_ID, pool);
    jvirt_barray_ptr v = jmem_get(c, pool, sizeof *v);
    memset(v, 0, sizeof *v);
    v->rows_in_array = numrows;
    v->blocksperrow = blocksperrow;
    v->maxaccess = maxaccess;
    v->pre_zero = pre_zero;
    v->next = m->virt_b;
    m->virt_b = v;
    return v;
}

static void jmem_realize(j_common_ptr c)
{
    jmem_t *m = (jmem_t *)c->mem;
    for (jvirt_sarray_ptr v = m->virt_s; v; v = v->next)
        if (!v->mem_buffer) {
            v->mem_buffer = jmem_sarray(c, JPOOL_IMAGE, v->samplesperrow, v->rows_in_array);
            v->first_undef_row = 0;
        }
    for (jvirt_barray_ptr v = m->virt_b; v; v = v->next)
        if (!v->mem_buffer) {
            v->mem_buffer = jmem_barray(c, JPOOL_IMAGE, v->blocksperrow, v->rows_in_array);
            v->first_undef_row = 0;
        }
}

/* Rows [start, start + num): libjpeg's checks, and lazy zeroing of pre-zeroed arrays. */
static void jvirt_touch(j_common_ptr c, void **rows, size_t rowbytes, JDIMENSION rows_in_array, JDIMENSION maxaccess,
                        JDIMENSION *first_undef, boolean pre_zero, JDIMENSION start, JDIMENSION num, boolean writable)
{
    JDIMENSION end = start + num;
    if (end < start || end > rows_in_array || num > maxaccess || !rows)
        ERREXIT(c, JERR_BAD_VIRTUAL_ACCESS);
    if (*first_undef < end) {
        JDIMENSION undef;
        if (*first_undef < start) {
            if (writable)   /* a writer skipped part of the array */
                ERREXIT(c, JERR_BAD_VIRTUAL_ACCESS);
            undef = start;  /* a reader may read ahead */
        } else {
            undef = *first_undef;
        }
        if (writable)
            *first_undef = end;
        if (pre_zero) {
            for (JDIMENSION r = undef; r < end; r++)
                memset(rows[r], 0, rowbytes);
        } else if (!writable) {
            ERREXIT(c, JERR_BAD_VIRTUAL_ACCESS);   /* reading data nobody wrote */
        }
    }
}

static JSAMPARRAY jmem_access_s(j_common_ptr c, jvirt_sarray_ptr v, JDIMENSION start, JDIMENSION num,
                                boolean writable)
{
    jvirt_touch(c, (void **)v->mem_buffer, v->samplesperrow, v->rows_in_array, v->maxaccess, &v->first_undef_row,
                v->pre_zero, start, num, writable);
    return v->mem_buffer + start;
}

static JBLOCKARRAY jmem_access_b(j_common_ptr c, jvirt_barray_ptr v, JDIMENSION start, JDIMENSION num,
                                 boolean writable)
{
    jvirt_touch(c, (void **)v->mem_buffer, (size_t)v->blocksperrow * sizeof(JBLOCK), v->rows_in_array, v->maxaccess,
                &v->first_undef_row, v->pre_zero, start, num, writable);
    return v->mem_buffer + start;
}

static void jmem_free_pool(j_common_ptr c, int pool)
{
    jmem_t *m = (jmem_t *)c->mem;
    if (pool != JPOOL_PERMANENT && pool != JPOOL_IMAGE)
        ERREXIT1(c, JERR_BAD_POOL_ID, pool);
    m->virt_s = NULL;
    m->virt_b = NULL;
    prism_arena_reset(&m->d->arena);
    if (pool == JPOOL_PERMANENT)
        prism_arena_reset(&m->d->perm);
}

static void jmem_self_destruct(j_common_ptr c)
{
    jmem_t *m = (jmem_t *)c->mem;
    jmem_free_pool(c, JPOOL_PERMANENT);
    /* hand back to libjpeg's manager the objects it made at creation */
    c->mem = m->lib;
    (*c->mem->self_destruct)(c);
}

/* ---------------------------------------------------------------- source, progress */

static void src_init(j_decompress_ptr c) { (void)c; }
static void src_term(j_decompress_ptr c) { (void)c; }

static boolean src_fill(j_decompress_ptr c)
{
    /* Out of data: warn (our emit turns it into an error) and, should it return, feed an EOI. */
    static const JOCTET eoi[2] = {0xFF, JPEG_EOI};
    WARNMS(c, JWRN_JPEG_EOF);
    c->src->next_input_byte = eoi;
    c->src->bytes_in_buffer = 2;
    return TRUE;
}

static void src_skip(j_decompress_ptr c, long n)
{
    struct jpeg_source_mgr *s = c->src;
    if (n <= 0)
        return;
    while (n > (long)s->bytes_in_buffer) {
        n -= (long)s->bytes_in_buffer;
        (void)(*s->fill_input_buffer)(c);
    }
    s->next_input_byte += n;
    s->bytes_in_buffer -= (size_t)n;
}

/* Called before every unit of input libjpeg consumes: a new scan is accounted when it starts.
 * Decoding a scan visits every block of its components, so the scans bound the CPU a file costs. */
static void progress_monitor(j_common_ptr c)
{
    j_decompress_ptr ci = (j_decompress_ptr)c;
    jprog_t *p = (jprog_t *)ci->progress;
    if (ci->input_scan_number == p->last_scan)
        return;
    p->last_scan = ci->input_scan_number;
    char n[16];
    if (ci->input_scan_number > PRISM_IMAGE_MAX_JPEG_SCANS) {
        snprintf(n, sizeof n, "%d", PRISM_IMAGE_MAX_JPEG_SCANS);
        jfail(c, PRISM_ELIMIT, "the JPEG has more than %s scans", n);
    }
    for (int i = 0; i < ci->comps_in_scan && i < MAX_COMPS_IN_SCAN; i++)
        if (ci->cur_comp_info[i])
            p->visits += (uint64_t)ci->cur_comp_info[i]->width_in_blocks * ci->cur_comp_info[i]->height_in_blocks;
    if (p->visits > (uint64_t)PRISM_IMAGE_MAX_JPEG_PASSES * p->blocks) {
        snprintf(n, sizeof n, "%d", PRISM_IMAGE_MAX_JPEG_PASSES);
        jfail(c, PRISM_ELIMIT, "the JPEG's scans revisit its coefficients more than %s times", n);
    }
}

/* ---------------------------------------------------------------- life cycle */

int prism_image_jpeg_state_create(prism_image_decoder_t *d)
{
    struct prism_jpeg_state *J = prism_calloc(1, sizeof *J);
    if (!J)
        return PRISM_ENOMEM;
    J->ci.err = jpeg_std_error(&J->err.pub);
    J->err.pub.error_exit = jerr_exit;
    J->err.pub.emit_message = jerr_emit;
    J->err.pub.output_message = jerr_output;
    J->err.d = d;
    if (setjmp(J->err.jb)) {
        jpeg_destroy_decompress(&J->ci);
        prism_free(J);
        return PRISM_ENOMEM;
    }
    jpeg_create_decompress(&J->ci);
    J->mem.lib = J->ci.mem;
    J->mem.d = d;
    J->mem.pub.alloc_small = jmem_small;
    J->mem.pub.alloc_large = jmem_large;
    J->mem.pub.alloc_sarray = jmem_sarray;
    J->mem.pub.alloc_barray = jmem_barray;
    J->mem.pub.request_virt_sarray = jmem_req_sarray;
    J->mem.pub.request_virt_barray = jmem_req_barray;
    J->mem.pub.realize_virt_arrays = jmem_realize;
    J->mem.pub.access_virt_sarray = jmem_access_s;
    J->mem.pub.access_virt_barray = jmem_access_b;
    J->mem.pub.free_pool = jmem_free_pool;
    J->mem.pub.self_destruct = jmem_self_destruct;
    J->mem.pub.max_memory_to_use = 0;
    J->mem.pub.max_alloc_chunk = JMAX_CHUNK;
    J->ci.mem = &J->mem.pub;
    J->src.init_source = src_init;
    J->src.fill_input_buffer = src_fill;
    J->src.skip_input_data = src_skip;
    J->src.resync_to_restart = jpeg_resync_to_restart;
    J->src.term_source = src_term;
    J->ci.src = &J->src;
    J->progress.pub.progress_monitor = progress_monitor;
    J->ci.progress = &J->progress.pub;
    d->jpeg = J;
    return PRISM_OK;
}

void prism_image_jpeg_state_destroy(prism_image_decoder_t *d)
{
    if (!d || !d->jpeg)
        return;
    jpeg_destroy_decompress(&d->jpeg->ci);
    prism_free(d->jpeg);
    d->jpeg = NULL;
}

/* ---------------------------------------------------------------- sizing */

size_t prism_image_jpeg_stream_bytes(int width, bool multi_scan)
{
    /* Bounds on libjpeg-turbo 2.1's working memory besides coefficients, with our rows. Its main
     * buffer keeps v_samp * 10 rows (8 + 2 of context) per component at h_samp / max_h of the
     * width: with at most 10 blocks per MCU a single-scan file stays near 100 bytes per column
     * plus upsampling and output rows (119 measured, 4-component 1x4/1x4/1x1/1x1); a multi-scan
     * one may use 4x4 for every component (about 165 in theory, 145 measured).
     * tests/unit/image/test_image_stream.c checks these over sampling layouts and color spaces. */
    return (size_t)(64u << 10) + (size_t)width * (multi_scan ? 224u : 160u);
}

/* Coefficient memory of a multi-scan image, from the frame header libjpeg has read. */
static size_t coef_bytes(j_decompress_ptr ci)
{
    size_t total = 0;
    for (int i = 0; i < ci->num_components; i++) {
        const jpeg_component_info *c = &ci->comp_info[i];
        size_t bw = jround(c->width_in_blocks, (size_t)c->h_samp_factor);
        size_t bh = jround(c->height_in_blocks, (size_t)c->v_samp_factor);
        total += jround(bh * sizeof(JBLOCKROW), JALIGN) + bw * bh * sizeof(JBLOCK) + 4 * JALIGN;
    }
    return total;
}

/* ---------------------------------------------------------------- decode */

/* PIL's cmyk2rgb (Convert.c): r = 255-k - (c*(255-k))/255 with its rounded division. */
static inline uint8_t muldiv255_sub(uint8_t c, int nk)
{
    int t = c * nk + 128;
    int v = nk - (((t >> 8) + t) >> 8);
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

static void cmyk_to_rgb(const uint8_t *cmyk, int w, bool inverted, uint8_t *rgb)
{
    for (int x = 0; x < w; x++) {
        uint8_t c = cmyk[x * 4], m = cmyk[x * 4 + 1], y = cmyk[x * 4 + 2], k = cmyk[x * 4 + 3];
        if (inverted) {
            c = 255 - c; m = 255 - m; y = 255 - y; k = 255 - k;
        }
        int nk = 255 - k;
        rgb[x * 3 + 0] = muldiv255_sub(c, nk);
        rgb[x * 3 + 1] = muldiv255_sub(m, nk);
        rgb[x * 3 + 2] = muldiv255_sub(y, nk);
    }
}

int prism_image_jpeg_run(prism_image_decoder_t *d, const uint8_t *data, size_t len,
                         const prism_image_decode_opts_t *o, const prism_image_info_t *info,
                         const prism_jpeg_extra_t *ex, const prism_image_sink_t *sink)
{
    struct prism_jpeg_state *J = d->jpeg;
    j_decompress_ptr ci = &J->ci;
    /* A fresh decompressor's tables: none. Tables of the previous image must never stand in for
     * ones this file lacks (the arena they lived in is reset too). */
    for (int i = 0; i < NUM_QUANT_TBLS; i++)
        ci->quant_tbl_ptrs[i] = NULL;
    for (int i = 0; i < NUM_HUFF_TBLS; i++)
        ci->dc_huff_tbl_ptrs[i] = ci->ac_huff_tbl_ptrs[i] = NULL;
    J->src.next_input_byte = data;
    J->src.bytes_in_buffer = len;
    J->err.rc = PRISM_OK;
    J->err.pub.num_warnings = 0;
    if (setjmp(J->err.jb)) {
        int rc = J->err.rc ? J->err.rc : PRISM_ECORRUPT;
        jpeg_abort_decompress(ci);
        return rc;
    }
    J->progress.last_scan = 0;
    J->progress.visits = 0;
    J->progress.blocks = 0;
    jpeg_read_header(ci, TRUE);
    for (int i = 0; i < ci->num_components; i++)
        J->progress.blocks += (uint64_t)ci->comp_info[i].width_in_blocks * ci->comp_info[i].height_in_blocks;
    int rc = PRISM_OK;
    if ((int)ci->image_width != info->width || (int)ci->image_height != info->height) {
        rc = PRISM_ECORRUPT;
        goto done;
    }
    bool cmyk = ci->jpeg_color_space == JCS_CMYK || ci->jpeg_color_space == JCS_YCCK;
    /* libjpeg cannot convert CMYK to RGB; we do it the way PIL does (naive, no ICC). */
    ci->out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
    ci->dct_method = JDCT_ISLOW;
    ci->do_fancy_upsampling = TRUE;
    ci->do_block_smoothing = TRUE;
    ci->quantize_colors = FALSE;
    int num, denom;
    prism_image_jpeg_pick_scale(info->width, info->height, o ? o->min_w : 0, o ? o->min_h : 0, &num, &denom);
    ci->scale_num = (unsigned)num;
    ci->scale_denom = (unsigned)denom;
    jpeg_calc_output_dimensions(ci);
    int w = (int)ci->output_width, h = (int)ci->output_height;
    if (w <= 0 || h <= 0 || ci->output_components != (cmyk ? 4 : 3)) {
        rc = PRISM_ECORRUPT;
        goto done;
    }
    /* What a failed allocation would have needed (the whole-image decode retries with it). */
    bool multi = jpeg_has_multiple_scans(ci);
    d->need_bytes = d->arena.used + prism_image_jpeg_stream_bytes(info->width, multi);
    if (multi) {
        /* Every coefficient stays until the last scan: refuse before decoding anything when they
         * alone cannot fit (rows that do not fit next to them fail in jpeg_start_decompress, also
         * before any scan is decoded). */
        size_t need = coef_bytes(ci);
        size_t avail = d->arena.cap - d->arena.used;
        d->need_bytes += need;
        if (need > avail) {
            char a[32], b[32];
            snprintf(d->err, sizeof d->err,
                     "the %dx%d %s JPEG needs %s of decode memory for its DCT coefficients; the decoder has %s",
                     info->width, info->height, info->progressive ? "progressive" : "multi-scan",
                     prism_fmt_bytes(need, a, sizeof a), prism_fmt_bytes(avail, b, sizeof b));
            rc = PRISM_ELIMIT;
            goto done;
        }
    }
    prism_image_t g = {.w = w, .h = h, .src_w = info->width, .src_h = info->height, .scale_num = num,
                       .scale_denom = denom, .format = PRISM_IMAGE_FORMAT_JPEG};
    if (sink->begin && (rc = sink->begin(sink->ud, &g)) != PRISM_OK)
        goto done;
    jpeg_start_decompress(ci);
    int comps = ci->output_components;
    int batch = ci->rec_outbuf_height > 0 ? ci->rec_outbuf_height : 1;
    JSAMPROW own[16], rows[16];
    if (batch > (int)PRISM_ARRAY_LEN(own))
        batch = (int)PRISM_ARRAY_LEN(own);
    /* With a sink that offers its buffers, RGB rows are written straight into them; CMYK rows are
     * converted into them. */
    bool direct = sink->rowbuf != NULL;
    for (int i = 0; i < batch; i++) {
        own[i] = NULL;
        if (cmyk || !direct) {
            own[i] = prism_arena_alloc(&d->arena, jround((size_t)w * comps, 64), 64);
            if (!own[i])
                ERREXIT1((j_common_ptr)ci, JERR_OUT_OF_MEMORY, 6);
        }
    }
    uint8_t *rgb = NULL;
    if (cmyk && !direct && !(rgb = prism_arena_alloc(&d->arena, (size_t)w * 3, 64)))
        ERREXIT1((j_common_ptr)ci, JERR_OUT_OF_MEMORY, 7);
    bool inverted = ex && ex->adobe;   /* Adobe (Photoshop) CMYK is stored inverted: PIL's "CMYK;I" */
    while (ci->output_scanline < ci->output_height) {
        JDIMENSION y0 = ci->output_scanline;
        int want = (int)PRISM_MIN((JDIMENSION)batch, ci->output_height - y0);
        for (int i = 0; i < want; i++) {
            rows[i] = own[i];
            if (direct && !cmyk && (rc = sink->rowbuf(sink->ud, (int)y0 + i, &rows[i])) != PRISM_OK)
                goto done;
        }
        JDIMENSION n = jpeg_read_scanlines(ci, rows, (JDIMENSION)want);
        if (n == 0) {
            rc = PRISM_ECORRUPT;   /* cannot happen with an in-memory source: no suspension */
            goto done;
        }
        for (JDIMENSION i = 0; i < n; i++) {
            uint8_t *row = rows[i];
            if (cmyk) {
                uint8_t *dst = rgb;
                if (direct && (rc = sink->rowbuf(sink->ud, (int)(y0 + i), &dst)) != PRISM_OK)
                    goto done;
                cmyk_to_rgb(rows[i], w, inverted, dst);
                row = dst;
            }
            if ((rc = sink->row(sink->ud, (int)(y0 + i), row)) != PRISM_OK)
                goto done;
        }
    }
    jpeg_finish_decompress(ci);
    d->need_bytes = 0;
    return PRISM_OK;

done:
    jpeg_abort_decompress(ci);
    return rc;
}
