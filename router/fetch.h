/* fetch: image URLs fetched by the router, on its libuv loop, safe by default.
 *
 * libcurl's multi interface driven by the loop (the socket-action pattern: curl tells us which
 * sockets to watch, uv_poll watches them, one uv_timer carries curl's timeouts; no thread per
 * download; name resolution runs on libcurl's resolver threads). http and https, HTTP/1.1 and
 * HTTP/2 (negotiated by ALPN over TLS), TLS verified against the system CA store plus, optionally, one
 * more CA file (tests). file:// only under an allowed directory, read on libuv's thread pool.
 *
 * What a caller gets: the bytes as they arrive, in one buffer the download owns (curl's receive
 * buffer is copied once into it; nobody copies it again), so a caller can check an image's header
 * from its first bytes and refuse the rest; then the whole image as a reference-counted blob. A
 * caller may pause a download (backpressure: libcurl stops reading the socket) and resume it.
 *
 * Safe by default (fetch_policy.h has the rules): only http/https; every address a connection is
 * opened to is checked as it is opened (CURLOPT_OPENSOCKETFUNCTION, after DNS, on every redirect hop,
 * for every address tried; so a name that resolves to a public address when checked and to a private
 * one when connected gains nothing: there is no earlier check), and again once connected
 * (CURLOPT_PREREQFUNCTION, which also covers a reused connection); loopback, private, link-local,
 * CGNAT, unique-local, multicast, unspecified, reserved and cloud-metadata addresses are refused
 * unless an allowed network holds them; an optional host allowlist; redirects followed by us, each
 * one checked like the first URL; no proxy (environment variables ignored), no cookies, no
 * credentials, no decompression (what arrives is what is counted).
 *
 * Limits (prism_fetch_config_t; each refusal counted by reason): connect timeout, total timeout
 * (waiting for a slot and every redirect included), minimum transfer rate, maximum bytes (a larger
 * Content-Length or file size is refused before the body; a body that runs past it is cut off),
 * redirects, downloads in flight (more wait in a bounded queue; beyond it: PRISM_FETCH_BUSY).
 *
 * A URL cache: callers asking for a URL being downloaded join that download (one download, several
 * waiters); a finished image stays cached (LRU) within a byte budget for a TTL, unless its answer
 * said Cache-Control no-store, no-cache, private or max-age=0 (max-age shortens the TTL). Failures
 * are not cached; file:// images are not kept after their read (the file may change). The cache is
 * keyed by URL; whoever caches what the image *is* (the encoder's embedding cache) keys it by the
 * bytes, as for data URLs.
 *
 * OWNERSHIP AND THREADS (read this):
 *   Everything here runs on the loop thread, except the blob functions (any thread).
 *   prism_fetch_start hands back a request q. Its callbacks are never called from inside a
 *   prism_fetch_* call; on_data may be called any number of times, then on_done exactly once, after
 *   which q is gone (freed by the fetcher). prism_fetch_cancel(q) before on_done: no callback for q
 *   afterwards, and q is gone. Inside a callback the caller may call any prism_fetch_* function
 *   (start, cancel of any request, pause, resume) except prism_fetch_close.
 *   on_data's bytes and on_done's blob are the download's: read them during the call; to keep the
 *   image, prism_fetch_blob_ref it (and prism_fetch_blob_unref when done, from any thread).
 *
 * Usage:
 *   static int on_data(prism_fetch_req_t *q, const uint8_t *p, size_t n, int64_t declared, void *ud)
 *   {   return looks_like_an_image(p, n) ? PRISM_FETCH_CONTINUE : PRISM_FETCH_STOP;   }
 *   static void on_done(prism_fetch_req_t *q, const prism_fetch_result_t *res, void *ud)
 *   {   if (res->reason == PRISM_FETCH_OK) keep(prism_fetch_blob_ref(res->blob)); else fail(res->message);   }
 *
 *   prism_fetch_config_t cfg;  prism_fetch_config_default(&cfg);
 *   prism_fetch_t *f;  prism_fetch_open(loop, &cfg, &f, why, sizeof why);
 *   prism_fetch_cb_t cb = {on_data, on_done, ud};
 *   prism_fetch_req_t *q;  prism_fetch_start(f, url, strlen(url), &cb, &q);
 *   ...  prism_fetch_close(f, NULL, NULL);   (the loop then runs until its handles are closed)
 */
#ifndef PRISM_ROUTER_FETCH_H
#define PRISM_ROUTER_FETCH_H

#include "core/core.h"
#include "core/cli.h"
#include "fetch_policy.h"
#include "metrics/metrics.h"

#include <uv.h>

typedef struct prism_fetch prism_fetch_t;
typedef struct prism_fetch_req prism_fetch_req_t;

/* ---- configuration ---- */

typedef struct {
    double connect_timeout_s;     /* per connection (5) */
    double timeout_s;             /* the whole fetch: waiting for a slot, redirects, body (30) */
    int64_t min_rate;             /* bytes/s averaged over min_rate_window_s; slower fails (8 KiB; 0 = off) */
    double min_rate_window_s;     /* (10) */
    int64_t max_bytes;            /* largest image (20 MiB) */
    int64_t max_redirects;        /* (3) */
    int64_t max_inflight;         /* downloads at once (64) */
    int64_t max_queued;           /* downloads waiting for a slot (1024); beyond: PRISM_FETCH_BUSY */
    int64_t cache_bytes;          /* finished images kept (256 MiB; 0 = no cache, in-flight sharing only) */
    int64_t cache_entries;        /* ... at most this many (4096) */
    double cache_ttl_s;           /* ... for at most this long (600) */
    const char *ca_file;          /* one more CA bundle besides the system's (PEM), NULL: none */
    bool http2;                   /* offer HTTP/2 over TLS (true) */
    prism_str_list_t allowed_networks;  /* CIDR networks allowed although not public */
    prism_str_list_t allowed_domains;   /* when any: the only hosts fetched from */
    const char *allowed_local_path;     /* file:// URLs under this directory; NULL: file:// refused */
    /* Optional: an XXH3 secret (at least 136 bytes; copied). Each image's keyed content hash is then
     * computed once, when its download completes (prism_fetch_blob_hash), so callers that key images
     * by their bytes (the encoders' embedding caches) read them no second time however many requests
     * share the image. NULL: no hash. */
    const uint8_t *hash_secret;
    size_t hash_secret_len;
} prism_fetch_config_t;

void prism_fetch_config_default(prism_fetch_config_t *c);

/* The most the fetcher's images hold, for a process's memory plan: every download in flight at its
 * largest (max_inflight x (max_bytes + libcurl's receive buffer); queued downloads hold nothing), and
 * the URL cache's budget. An image a caller keeps (prism_fetch_blob_ref) after its download ended and
 * the cache let it go is the caller's to count (the router counts it as its request's image bytes). */
typedef struct {
    uint64_t downloads;
    uint64_t cache;
    uint64_t total;   /* downloads + cache */
} prism_fetch_bounds_t;
void prism_fetch_config_bounds(const prism_fetch_config_t *c, prism_fetch_bounds_t *out);

/* The fetcher's flags (vLLM's names where vLLM has one), for a process's flag table:
 *   prism_flag_t flags[] = { ..., PRISM_FETCH_FLAGS(&cfg), PRISM_FLAG_END };
 * max_bytes has no flag here: the process sets it from its own image size limit. */
#define PRISM_FETCH_FLAGS(c)                                                                              \
    PRISM_FLAG_LIST("allowed-media-domains", &(c)->allowed_domains,                                       \
                    "Hosts image URLs may be fetched from (exact names; default: any public host)"),     \
    PRISM_FLAG_LIST("allowed-media-networks", &(c)->allowed_networks,                                     \
                    "CIDR networks image URLs may reach although not public (loopback, private, "        \
                    "link-local, metadata... are refused by default)"),                                   \
    PRISM_FLAG_STR("allowed-local-media-path", &(c)->allowed_local_path,                                  \
                   "Directory file:// image URLs may read from, without following symlinks (default: none)"), \
    PRISM_FLAG_DOUBLE("media-fetch-connect-timeout", &(c)->connect_timeout_s,                             \
                      "Seconds to connect to an image URL's server"),                                     \
    PRISM_FLAG_DOUBLE("media-fetch-timeout", &(c)->timeout_s,                                             \
                      "Seconds for a whole image fetch (waiting, redirects and body)"),                   \
    PRISM_FLAG_BYTES("media-fetch-min-rate", &(c)->min_rate,                                              \
                     "Bytes/s an image download must average over --media-fetch-min-rate-window (0 = no minimum)"), \
    PRISM_FLAG_DOUBLE("media-fetch-min-rate-window", &(c)->min_rate_window_s,                             \
                      "Seconds (whole) over which --media-fetch-min-rate is averaged"),                   \
    PRISM_FLAG_INT("media-fetch-max-redirects", &(c)->max_redirects, "Redirects an image fetch follows"), \
    PRISM_FLAG_INT("media-fetch-max-inflight", &(c)->max_inflight, "Image downloads at once; more wait"), \
    PRISM_FLAG_INT("media-fetch-max-queued", &(c)->max_queued,                                            \
                   "Image downloads waiting for a slot; more are refused (503)"),                        \
    PRISM_FLAG_BYTES("media-cache-bytes", &(c)->cache_bytes, "Fetched images kept by URL (0 = none)"),    \
    PRISM_FLAG_DOUBLE("media-cache-ttl", &(c)->cache_ttl_s, "Seconds a fetched image stays cached"),      \
    PRISM_FLAG_STR("media-ca-file", &(c)->ca_file,                                                        \
                   "PEM CA bundle trusted for https image URLs besides the system's")

/* ---- images ---- */

/* A fetched image: reference-counted, immutable once whole. */
typedef struct prism_fetch_blob prism_fetch_blob_t;
const uint8_t *prism_fetch_blob_data(const prism_fetch_blob_t *b);
size_t prism_fetch_blob_len(const prism_fetch_blob_t *b);
prism_fetch_blob_t *prism_fetch_blob_ref(prism_fetch_blob_t *b);
/* The image's keyed content hash (prism_fetch_config_t.hash_secret) into *out: false when the fetcher
 * has no secret, or the image is not whole yet. */
bool prism_fetch_blob_hash(const prism_fetch_blob_t *b, uint64_t *out);
void prism_fetch_blob_unref(prism_fetch_blob_t *b);
/* The bytes as a prism_malloc'd buffer the caller owns (to hand on, e.g. to prism_msg_send_take),
 * dropping the caller's reference: the buffer itself when that reference was the last (no copy), a
 * copy otherwise. NULL (the reference still dropped) when a copy cannot be allocated. */
uint8_t *prism_fetch_blob_take(prism_fetch_blob_t *b, size_t *len);

/* ---- requests ---- */

enum {
    PRISM_FETCH_CONTINUE = 0,
    PRISM_FETCH_PAUSE = 1,   /* no more bytes until prism_fetch_resume(q) */
    PRISM_FETCH_STOP = 2,    /* the caller is done with q: as prism_fetch_cancel(q) */
};

typedef struct {
    prism_fetch_reason_t reason;     /* PRISM_FETCH_OK, or why there is no image */
    const char *message;             /* one sentence naming the rule (prism_fetch_reason_message) */
    int http_status;                 /* the last HTTP answer's status (0: none, or file://) */
    prism_fetch_blob_t *blob;        /* OK: the image (borrowed: prism_fetch_blob_ref to keep it) */
    bool cache_hit;                  /* served from the cache: nothing downloaded for it */
    bool joined;                     /* joined a download another request had started */
    int redirects;                   /* redirects followed */
    int http_version;                /* 1 or 2 (0: file://, or no answer) */
    double seconds;                  /* from prism_fetch_start to now */
} prism_fetch_result_t;

typedef struct {
    /* Optional. The bytes so far, data[0..len) (len grows between calls); declared: the whole size
     * when known (Content-Length or file size), else -1. Returns PRISM_FETCH_CONTINUE / _PAUSE / _STOP.
     * A request that joins a download under way, or hits the cache, gets what is there at once (in
     * one call). */
    int (*on_data)(prism_fetch_req_t *q, const uint8_t *data, size_t len, int64_t declared, void *ud);
    /* Required. Exactly once, unless cancelled. */
    void (*on_done)(prism_fetch_req_t *q, const prism_fetch_result_t *res, void *ud);
    void *ud;
} prism_fetch_cb_t;

/* Opens the fetcher on loop. PRISM_EINVAL with why[] for a bad configuration (a network that does not
 * parse, a directory that cannot be opened, a CA file that cannot be read). */
int  prism_fetch_open(uv_loop_t *loop, const prism_fetch_config_t *cfg, prism_fetch_t **out, char *why, size_t why_n);
/* Cancels every request (no callbacks), stops every download and closes the loop handles; cb (may be
 * NULL) runs from the loop once all are closed, and then f is gone. Not from inside a callback. */
void prism_fetch_close(prism_fetch_t *f, void (*cb)(void *ud), void *ud);

/* Starts (or joins, or serves from the cache) a fetch of url[0..len). The answer always comes through
 * cb->on_done, refusals by the URL rules included (from the loop, never from inside this call).
 * PRISM_ENOMEM (and no callback) when q cannot be allocated. */
int  prism_fetch_start(prism_fetch_t *f, const char *url, size_t len, const prism_fetch_cb_t *cb, prism_fetch_req_t **q);
void prism_fetch_cancel(prism_fetch_req_t *q);
/* Backpressure: a download pauses while any of its requests is paused (libcurl stops reading the
 * socket; what it had read is held until resumed). The total timeout still runs; the minimum rate
 * is not checked while paused. */
void prism_fetch_pause(prism_fetch_req_t *q);
void prism_fetch_resume(prism_fetch_req_t *q);

/* The URL rules alone (fetch_policy.h rules 1-3), synchronously: a caller may refuse a request before
 * it is queued. */
prism_fetch_reason_t prism_fetch_check_url(const prism_fetch_t *f, const char *url, size_t len);
const prism_fetch_policy_t *prism_fetch_policy(const prism_fetch_t *f);

/* ---- metrics ---- */

typedef struct {
    uint64_t requests;            /* prism_fetch_start calls */
    uint64_t downloads;           /* downloads started (network or file) */
    uint64_t downloads_ok;
    uint64_t cache_hits;          /* requests served from the cache */
    uint64_t joined;              /* requests that joined a download under way */
    uint64_t bytes;               /* body bytes received */
    uint64_t redirects;
    uint64_t pauses;              /* times a download was paused for its requests */
    uint64_t refused[PRISM_FETCH_REASON_COUNT];   /* requests that got no image, by reason */
    prism_hist_t seconds;         /* downloads that gave an image: start to done */
    /* gauges */
    uint64_t inflight, queued, peak_inflight;
    uint64_t held_bytes;          /* download buffers in flight plus the cache (capacity) */
    uint64_t cache_bytes_used, cache_entries_used;
} prism_fetch_metrics_t;

const prism_fetch_metrics_t *prism_fetch_metrics(const prism_fetch_t *f);
/* Appends the prism:image_fetch_* metrics (Prometheus text) to out. */
void prism_fetch_metrics_write(const prism_fetch_t *f, prism_buf_t *out);

#endif
