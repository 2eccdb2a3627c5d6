/* Relay: the decoder (caller's thread) fills a ring of rows; a helper thread hands them, in order,
 * to the inner sink. One mutex, two condition variables. A sleeping helper is woken only once a
 * quarter of the ring is ready (or the image ends) and takes every row available at once, and the
 * decoder is woken only when it waits for a free slot: a few hundred wake-ups per image, not one
 * per row. */
#include "image/image.h"

#include <pthread.h>
#include <string.h>

#define RELAY_RING_BYTES (256u << 10)
#define RELAY_MIN_ROWS 8          /* more than libjpeg's rows per call (at most 4) */
#define RELAY_MAX_ROWS 64
#define RELAY_STACK PRISM_IMAGE_RELAY_STACK_BYTES

struct prism_image_relay {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t produced_cv, consumed_cv;
    uint8_t *ring;
    size_t ring_bytes;
    int max_width;
    /* per image */
    prism_image_sink_t inner;
    size_t stride;                /* row slot bytes */
    size_t row_bytes;             /* w * 3 */
    int depth;                    /* row slots */
    int produced, consumed;       /* rows handed over / done */
    int err;                      /* first error of the inner sink */
    bool abort;                   /* the decode failed: skip what is left */
    bool stop;
    bool helper_sleeps, decoder_sleeps;
};

static size_t row_stride(int w) { return ((size_t)w * 3 + 63) & ~(size_t)63; }

static size_t ring_bytes(int max_width)
{
    if (max_width < 1)
        max_width = 1;
    return PRISM_MAX((size_t)RELAY_RING_BYTES, RELAY_MIN_ROWS * row_stride(max_width));
}

size_t prism_image_relay_bytes(int max_width) { return ring_bytes(max_width) + RELAY_STACK; }

static uint8_t *slot(prism_image_relay_t *r, int y) { return r->ring + (size_t)(y % r->depth) * r->stride; }

static void *relay_main(void *arg)
{
    prism_image_relay_t *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && r->consumed == r->produced) {
            r->helper_sleeps = true;
            pthread_cond_wait(&r->produced_cv, &r->mu);
            r->helper_sleeps = false;
        }
        if (r->stop)
            break;
        int from = r->consumed, to = r->produced;
        bool skip = r->abort || r->err;
        pthread_mutex_unlock(&r->mu);
        int rc = PRISM_OK;
        for (int y = from; y < to && rc == PRISM_OK && !skip; y++)
            rc = r->inner.row(r->inner.ud, y, slot(r, y));
        pthread_mutex_lock(&r->mu);
        if (rc != PRISM_OK && !r->err)
            r->err = rc;
        r->consumed = to;
        if (r->decoder_sleeps)
            pthread_cond_signal(&r->consumed_cv);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

int prism_image_relay_create(int max_width, prism_image_relay_t **out)
{
    if (!out || max_width < 1 || max_width > PRISM_IMAGE_MAX_DIM)
        return PRISM_EINVAL;
    *out = NULL;
    prism_image_relay_t *r = prism_calloc(1, sizeof *r);
    if (!r)
        return PRISM_ENOMEM;
    r->max_width = max_width;
    r->ring_bytes = ring_bytes(max_width);
    r->ring = prism_malloc_aligned(r->ring_bytes, 64);
    if (!r->ring) {
        prism_free(r);
        return PRISM_ENOMEM;
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->produced_cv, NULL);
    pthread_cond_init(&r->consumed_cv, NULL);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, RELAY_STACK);
    int e = pthread_create(&r->th, &attr, relay_main, r);
    pthread_attr_destroy(&attr);
    if (e != 0) {
        pthread_cond_destroy(&r->produced_cv);
        pthread_cond_destroy(&r->consumed_cv);
        pthread_mutex_destroy(&r->mu);
        prism_free_aligned(r->ring);
        prism_free(r);
        return PRISM_ENOMEM;
    }
    *out = r;
    return PRISM_OK;
}

void prism_image_relay_destroy(prism_image_relay_t *r)
{
    if (!r)
        return;
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_signal(&r->produced_cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->th, NULL);
    pthread_cond_destroy(&r->produced_cv);
    pthread_cond_destroy(&r->consumed_cv);
    pthread_mutex_destroy(&r->mu);
    prism_free_aligned(r->ring);
    prism_free(r);
}

static int relay_begin(void *ud, const prism_image_t *g)
{
    prism_image_relay_t *r = ud;
    if (g->w > r->max_width)
        return PRISM_ELIMIT;
    pthread_mutex_lock(&r->mu);
    PRISM_ASSERT(r->consumed == r->produced);   /* the previous image's end() drained the ring */
    r->stride = row_stride(g->w);
    r->row_bytes = (size_t)g->w * 3;
    r->depth = (int)PRISM_MIN((size_t)RELAY_MAX_ROWS, r->ring_bytes / r->stride);
    r->produced = r->consumed = 0;
    r->err = PRISM_OK;
    r->abort = false;
    pthread_mutex_unlock(&r->mu);
    return r->inner.begin ? r->inner.begin(r->inner.ud, g) : PRISM_OK;
}

static int relay_rowbuf(void *ud, int y, uint8_t **buf)
{
    prism_image_relay_t *r = ud;
    pthread_mutex_lock(&r->mu);
    int rc = PRISM_OK;
    if (y < r->produced || y - r->produced >= r->depth) {
        rc = PRISM_EINVAL;   /* out of order, or more rows at once than the ring holds */
    } else {
        while (y - r->consumed >= r->depth && !r->err) {
            if (r->helper_sleeps)   /* the ring is full: it must run */
                pthread_cond_signal(&r->produced_cv);
            r->decoder_sleeps = true;
            pthread_cond_wait(&r->consumed_cv, &r->mu);
            r->decoder_sleeps = false;
        }
        rc = r->err;
    }
    pthread_mutex_unlock(&r->mu);
    *buf = rc == PRISM_OK ? slot(r, y) : NULL;
    return rc;
}

static int relay_row(void *ud, int y, const uint8_t *rgb)
{
    prism_image_relay_t *r = ud;
    uint8_t *s = slot(r, y);
    if (rgb != s) {   /* written elsewhere: copy it in */
        int rc = relay_rowbuf(ud, y, &s);
        if (rc != PRISM_OK)
            return rc;
        memcpy(s, rgb, r->row_bytes);
    }
    pthread_mutex_lock(&r->mu);
    int rc = r->err;
    if (y != r->produced)
        rc = PRISM_EINVAL;
    if (rc == PRISM_OK) {
        r->produced = y + 1;
        if (r->helper_sleeps && r->produced - r->consumed >= (r->depth + 3) / 4)
            pthread_cond_signal(&r->produced_cv);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

static int relay_end(void *ud, int status)
{
    prism_image_relay_t *r = ud;
    pthread_mutex_lock(&r->mu);
    if (status != PRISM_OK)
        r->abort = true;
    while (r->consumed < r->produced) {
        if (r->helper_sleeps)
            pthread_cond_signal(&r->produced_cv);
        r->decoder_sleeps = true;
        pthread_cond_wait(&r->consumed_cv, &r->mu);
        r->decoder_sleeps = false;
    }
    int rc = status != PRISM_OK ? status : r->err;
    pthread_mutex_unlock(&r->mu);
    if (r->inner.end)
        rc = r->inner.end(r->inner.ud, rc);
    return rc;
}

prism_image_sink_t prism_image_relay_sink(prism_image_relay_t *r, const prism_image_sink_t *inner)
{
    r->inner = *inner;
    return (prism_image_sink_t){.begin = relay_begin, .row = relay_row, .rowbuf = relay_rowbuf, .end = relay_end,
                                .ud = r};
}
