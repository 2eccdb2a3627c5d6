/* Images given by URL: a prepared request's http(s) and file:// image URLs, fetched on the loop
 * (fetch.h: libcurl's multi interface driven by libuv, so no download ever blocks the loop) between
 * its preparation on the thread pool (parse, data URLs, chat template, tokens) and its admission.
 * From the first byte on, a fetched image takes the path of an uploaded one:
 *
 *   - its header is checked as its bytes arrive (router_image_check on the first 64 bytes, then each
 *     time they double, as the HTTP server asks for lifted data URLs): a decompression bomb or a file
 *     that is no image is refused at its first bytes, and its download stopped;
 *   - backpressure: while the router holds --max-image-bytes-in-flight of admitted requests' image
 *     bytes, downloads pause (libcurl stops reading their sockets; the fetcher's minimum rate is not
 *     checked meanwhile), as uploads that carry an image do (api.c router_body_gate, HOLD), the
 *     oldest too: that room comes back as admitted requests end (router_url_images_resume), never
 *     from requests that wait, so waiting requests cannot lock each other out;
 *   - once whole it is checked again (the same function's final verdict), keyed by the content hash
 *     the fetcher computed once with the router's secret (the encoders' embedding caches key images
 *     by their bytes, never by URL, so a URL and a data URL of the same bytes share an entry), and
 *     becomes the prompt's by reference (prompt.img_blob): the bytes stay where libcurl's copy put
 *     them, shared with the URL cache and with every request for the same URL;
 *   - an image that is whole while its request's other images still download goes to an encoder's
 *     cache at once (router_early_send), as an uploaded image does while its body still arrives.
 *
 * One download per URL among all requests (the fetcher joins them). The first image that fails ends
 * the request's fetch at once (its other downloads cancelled) with the rule that refused it; each
 * refusal is counted by the fetcher by reason (prism:image_fetch_refused_total) and by the router as
 * image_fetch. Loop thread only. */
#include "request.h"
#include "fetch.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#define URL_FIRST_ASK 64   /* bytes: as the HTTP server's first ask of a lifted image */

static void unlist(router_req_t *q)
{
    router_url_fetch_t *uf = q->fetch;
    if (!uf->listed) return;
    if (uf->prev) uf->prev->fetch->next = uf->next;
    else q->r->fetching = uf->next;
    if (uf->next) uf->next->fetch->prev = uf->prev;
    uf->prev = uf->next = NULL;
    uf->listed = false;
}

/* The fetch is over (every image in, or a failure): its time, then the request goes on. */
static void fetch_end(router_req_t *q)
{
    router_url_fetch_t *uf = q->fetch;
    double now = prism_now_s();
    unlist(q);
    q->time.fetch_ms = (float)((now - uf->t_start) * 1e3);
    if (!q->prep.status) prism_hist_observe(&q->r->fetch_stage, now - uf->t_start);
    uf->done(q);   /* may free q */
}

static void fetch_fail(router_req_t *q, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(q->prep.msg, sizeof q->prep.msg, fmt, ap);
    va_end(ap);
    q->prep.status = status;
    router_url_images_cancel(q);
    fetch_end(q);
}

static int on_data(prism_fetch_req_t *fq, const uint8_t *data, size_t len, int64_t declared, void *ud)
{
    (void)fq;
    (void)declared;   /* beyond the limit the fetcher refused it already, from the headers */
    router_url_image_t *u = ud;
    router_req_t *q = u->q;
    router_t *r = q->r;
    if (len >= u->ask_at) {
        prism_image_info_t info;
        char msg[sizeof q->prep.msg];
        int st = router_image_check(r, u->index, NULL, 0, false, data, len, false, &info, q->prep.refused, msg,
                                    sizeof msg);
        if (st != ROUTER_IMAGE_MORE) {
            u->fq = NULL;   /* stopped by our answer, not cancelled again */
            fetch_fail(q, st, "%s", msg);
            return PRISM_FETCH_STOP;
        }
        u->ask_at = 2 * len;
    }
    if (r->image_bytes_inflight >= r->max_image_bytes_inflight) {
        u->paused = u->waited = true;   /* router_url_images_resume lets it go on */
        return PRISM_FETCH_PAUSE;
    }
    return PRISM_FETCH_CONTINUE;
}

static void on_done(prism_fetch_req_t *fq, const prism_fetch_result_t *res, void *ud)
{
    (void)fq;
    router_url_image_t *u = ud;
    router_req_t *q = u->q;
    router_t *r = q->r;
    router_prompt_t *p = &q->prompt;
    int i = u->index;
    u->fq = NULL;
    u->paused = false;
    q->fetch->n_pending--;
    if (res->reason != PRISM_FETCH_OK) {
        q->prep.refused[PRISM_REFUSE_IMAGE_FETCH]++;
        int st = prism_fetch_reason_http_status(res->reason);
        if (res->reason == PRISM_FETCH_TIMEOUT && u->waited)   /* as an upload paused too long: 503 */
            fetch_fail(q, 503, "Image %d: its download waited for room for images (the server holds "
                       "--max-image-bytes-in-flight) past the fetch timeout; retry after a short wait.", i);
        else if (res->reason == PRISM_FETCH_HTTP_STATUS)
            fetch_fail(q, st, "Image %d: %s (HTTP %d).", i, res->message, res->http_status);
        else
            fetch_fail(q, st, "Image %d: %s.", i, res->message);
        return;
    }
    /* the prompt's from here, by reference: freed with it (router_prompt_drop_image) */
    p->img_blob[i] = prism_fetch_blob_ref(res->blob);
    p->img[i] = (uint8_t *)prism_fetch_blob_data(res->blob);
    p->img_len[i] = prism_fetch_blob_len(res->blob);
    prism_image_info_t info;
    char msg[sizeof q->prep.msg];
    int st = router_image_check(r, i, NULL, 0, false, p->img[i], p->img_len[i], true, &info, q->prep.refused, msg,
                                sizeof msg);
    if (st) {
        fetch_fail(q, st, "%s", msg);
        return;
    }
    p->img_w[i] = info.width;
    p->img_h[i] = info.height;
    if (!prism_fetch_blob_hash(res->blob, &p->img_hash[i]))   /* computed once per download, normally */
        p->img_hash[i] = XXH3_64bits_withSecret(p->img[i], p->img_len[i], r->img_secret, sizeof r->img_secret);
    p->image_bytes += p->img_len[i];
    if (q->fetch->n_pending > 0) {
        router_early_send(r, q->h, i, p->img[i], p->img_len[i]);   /* while the others still download */
        return;
    }
    fetch_end(q);
}

int router_url_images_fetch(router_req_t *q, void (*done)(router_req_t *q))
{
    router_t *r = q->r;
    router_prompt_t *p = &q->prompt;
    PRISM_ASSERT(r->fetch && p->n_urls > 0 && !q->fetch);
    router_url_fetch_t *uf = prism_calloc(1, sizeof *uf + (size_t)p->n_urls * sizeof uf->img[0]);
    if (!uf) return PRISM_ENOMEM;
    q->fetch = uf;   /* freed with the request */
    uf->done = done;
    uf->t_start = prism_now_s();
    uf->next = r->fetching;
    if (r->fetching) r->fetching->fetch->prev = q;
    r->fetching = q;
    uf->listed = true;
    for (int i = 0; i < p->n_images; i++) {
        if (!p->img_url[i]) continue;
        router_url_image_t *u = &uf->img[uf->n++];
        *u = (router_url_image_t){.q = q, .index = i, .ask_at = URL_FIRST_ASK};
        prism_fetch_cb_t cb = {on_data, on_done, u};
        if (prism_fetch_start(r->fetch, p->img_url[i], p->img_url_len[i], &cb, &u->fq) != PRISM_OK) {
            u->fq = NULL;
            router_url_images_cancel(q);
            return PRISM_ENOMEM;
        }
        uf->n_pending++;
    }
    PRISM_DEBUG("request: %d image(s) by URL fetching", uf->n);
    return PRISM_OK;
}

void router_url_images_cancel(router_req_t *q)
{
    router_url_fetch_t *uf = q->fetch;
    if (!uf) return;
    for (int k = 0; k < uf->n; k++)
        if (uf->img[k].fq) {
            prism_fetch_cancel(uf->img[k].fq);
            uf->img[k].fq = NULL;
            uf->img[k].paused = false;
        }
    unlist(q);
}

void router_url_images_resume(router_t *r)
{
    if (r->image_bytes_inflight >= r->max_image_bytes_inflight) return;
    for (router_req_t *q = r->fetching; q; q = q->fetch->next)
        for (int k = 0; k < q->fetch->n; k++) {
            router_url_image_t *u = &q->fetch->img[k];
            if (u->paused && u->fq) {
                u->paused = false;
                prism_fetch_resume(u->fq);   /* marks only: its bytes come from the fetcher's next turn */
            }
        }
}
