/* fetch: image URLs fetched on the router's loop with libcurl's multi interface (see fetch.h).
 *
 * Shape: one download (entry_t) per URL being fetched or cached, found by URL in a hash map; the
 * requests (prism_fetch_req_t) waiting for it hang off it. Bytes land once, in the entry's blob.
 *
 * Re-entrancy: libcurl forbids calling its multi functions from inside its callbacks, and a
 * caller's callback may call any prism_fetch_* function. So the API functions only mark state (an
 * entry is put on the dirty list) and schedule the kick, a zero-delay timer; every libcurl call
 * (add, remove, pause) and every on_done happens there, or after curl_multi_socket_action has
 * returned. on_data alone runs inside a libcurl callback (the write callback), where the caller's
 * calls still only mark. Nothing is freed while it may be on a stack: requests are marked and swept
 * after the walk over them, entries are freed only off the dirty list. */
#define _GNU_SOURCE
#include "fetch.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#define FETCH_BUCKETS 4096              /* map buckets (power of two) */
#define FETCH_FILE_CHUNK (1u << 20)     /* bytes per file read */
#define FETCH_MIN_GROW (64u << 10)      /* first buffer when the size is not declared */
#define FETCH_MAX_LOCATION 8192
#define FETCH_CURL_BUFFER (128u << 10)  /* libcurl's receive buffer per transfer (CURLOPT_BUFFERSIZE) */
#define FETCH_MIN_SECRET 136            /* XXH3_SECRET_SIZE_MIN */

struct prism_fetch_blob {
    atomic_int refs;
    uint8_t *data;   /* prism_malloc'd [cap] */
    size_t len, cap;
    uint64_t hash;   /* keyed content hash, once whole (hashed) */
    bool hashed;
};

typedef enum { E_QUEUED, E_RUNNING, E_DONE, E_FAILED } entry_state_t;

typedef struct entry entry_t;

struct prism_fetch_req {
    prism_fetch_t *f;
    entry_t *e;                  /* NULL: refused before it had a download (f->orphans) */
    prism_fetch_req_t *prev, *next;  /* the entry's requests, or the orphans */
    prism_fetch_cb_t cb;
    size_t seen;                 /* bytes given to on_data */
    bool paused, cancelled, done;
    bool joined, cache_hit;
    prism_fetch_reason_t why;    /* orphans: the refusal */
    double t_start;
};

struct entry {
    prism_fetch_t *f;
    char *key;                   /* the URL asked for (normalized): the map key */
    uint64_t hash;
    entry_t *hnext;              /* map chain */
    entry_t *aprev, *anext;      /* every entry */
    entry_t *lprev, *lnext;      /* the queue (E_QUEUED) or the cache's LRU (E_DONE, in_cache) */
    entry_t *dnext;              /* dirty list */
    bool in_map, in_cache, dirty;
    entry_state_t state;
    prism_fetch_url_t url;       /* the current hop */
    prism_fetch_blob_t *blob;
    int64_t declared;
    prism_fetch_req_t *reqs, *reqs_tail;
    int n_active, n_paused;      /* requests not cancelled nor done; of those, paused */
    prism_fetch_reason_t why;    /* a failure (ours, or the transfer's) */
    double t_created, t_start, deadline, expires;
    /* network */
    CURL *easy;
    bool curl_paused;
    bool hdr_done;               /* the final answer's headers passed */
    bool redirect;               /* the answer is a redirect to location */
    char *location;
    bool no_store;
    double max_age;              /* from Cache-Control; < 0: none */
    int http_status, http_version, redirects;
    prism_fetch_reason_t addr_why;   /* an address the open-socket check refused */
    char errbuf[CURL_ERROR_SIZE];
    /* file */
    int fd;
    uint64_t fsize;
    uv_fs_t fsreq;
    bool fs_pending;
};

typedef struct sock {
    uv_poll_t poll;
    prism_fetch_t *f;
    curl_socket_t fd;
    struct sock *prev, *next;
} sock_t;

struct prism_fetch {
    uv_loop_t *loop;
    prism_fetch_config_t cfg;
    char *ca_file, *ca_path;
    uint8_t *secret;             /* the content hash's (cfg.hash_secret, copied), NULL: none */
    size_t secret_len;
    prism_fetch_policy_t policy;
    CURLM *multi;
    uv_timer_t timer;            /* libcurl's timeout */
    uv_timer_t kick;             /* deferred work */
    uv_timer_t sweep;            /* expiry of cached images and queued downloads */
    bool kick_pending;
    entry_t *buckets[FETCH_BUCKETS];
    uint64_t seed;
    entry_t *all;
    entry_t *queue_head, *queue_tail;
    entry_t *lru_head, *lru_tail;  /* most recently used first */
    entry_t *dirty;
    prism_fetch_req_t *orphans;
    sock_t *socks;
    prism_fetch_metrics_t m;
    int depth;                   /* inside a caller's callback */
    bool closing;
    int open_handles, fs_pending;
    void (*close_cb)(void *);
    void *close_ud;
};

static const double fetch_buckets[] = {.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 40};

static void kick(prism_fetch_t *f);
static void settle(entry_t *e);
static void check_done(prism_fetch_t *f);
static void pump(prism_fetch_t *f);

/* ---- blobs ---- */

const uint8_t *prism_fetch_blob_data(const prism_fetch_blob_t *b) { return b->data; }
size_t prism_fetch_blob_len(const prism_fetch_blob_t *b) { return b->len; }

bool prism_fetch_blob_hash(const prism_fetch_blob_t *b, uint64_t *out)
{
    if (!b->hashed) return false;
    *out = b->hash;
    return true;
}

prism_fetch_blob_t *prism_fetch_blob_ref(prism_fetch_blob_t *b)
{
    atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed);
    return b;
}

void prism_fetch_blob_unref(prism_fetch_blob_t *b)
{
    if (!b || atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) != 1) return;
    prism_free(b->data);
    prism_free(b);
}

uint8_t *prism_fetch_blob_take(prism_fetch_blob_t *b, size_t *len)
{
    *len = b->len;
    if (atomic_load_explicit(&b->refs, memory_order_acquire) == 1) {
        uint8_t *d = b->data;
        if (!d) d = prism_malloc(1);   /* an empty image still hands over a buffer */
        prism_free(b);
        return d;
    }
    uint8_t *d = prism_malloc(b->len ? b->len : 1);
    if (d && b->len) memcpy(d, b->data, b->len);
    prism_fetch_blob_unref(b);
    return d;
}

/* Grows e's buffer to hold need bytes (doubling, never past max_bytes). */
static bool blob_reserve(entry_t *e, size_t need)
{
    prism_fetch_blob_t *b = e->blob;
    if (need <= b->cap) return true;
    size_t max = (size_t)e->f->cfg.max_bytes;
    size_t cap = PRISM_MAX(need, PRISM_MAX(b->cap * 2, (size_t)FETCH_MIN_GROW));
    if (cap > max) cap = PRISM_MAX(max, need);
    uint8_t *d = prism_realloc(b->data, cap);
    if (!d) return false;
    e->f->m.held_bytes += cap - b->cap;
    b->data = d;
    b->cap = cap;
    return true;
}

/* ---- the map, the queue, the cache ---- */

static uint64_t key_hash(const prism_fetch_t *f, const char *key)
{
    return XXH3_64bits_withSeed(key, strlen(key), f->seed);
}

static entry_t *map_find(prism_fetch_t *f, const char *key, uint64_t h)
{
    for (entry_t *e = f->buckets[h & (FETCH_BUCKETS - 1)]; e; e = e->hnext)
        if (e->hash == h && !strcmp(e->key, key)) return e;
    return NULL;
}

static void map_remove(entry_t *e)
{
    if (!e->in_map) return;
    entry_t **pp = &e->f->buckets[e->hash & (FETCH_BUCKETS - 1)];
    while (*pp != e) pp = &(*pp)->hnext;
    *pp = e->hnext;
    e->hnext = NULL;
    e->in_map = false;
}

/* The queue and the LRU share the lprev/lnext links (an entry is in one at most). */
static void list_push(entry_t **head, entry_t **tail, entry_t *e, bool front)
{
    e->lprev = e->lnext = NULL;
    if (!*head) {
        *head = *tail = e;
    } else if (front) {
        e->lnext = *head;
        (*head)->lprev = e;
        *head = e;
    } else {
        e->lprev = *tail;
        (*tail)->lnext = e;
        *tail = e;
    }
}

static void list_unlink(entry_t **head, entry_t **tail, entry_t *e)
{
    if (e->lprev) e->lprev->lnext = e->lnext;
    else *head = e->lnext;
    if (e->lnext) e->lnext->lprev = e->lprev;
    else *tail = e->lprev;
    e->lprev = e->lnext = NULL;
}

static void mark_dirty(entry_t *e)
{
    if (!e->dirty) {
        e->dirty = true;
        e->dnext = e->f->dirty;
        e->f->dirty = e;
    }
    kick(e->f);
}

static void cache_drop(entry_t *e)
{
    prism_fetch_t *f = e->f;
    if (!e->in_cache) return;
    list_unlink(&f->lru_head, &f->lru_tail, e);
    e->in_cache = false;
    f->m.cache_bytes_used -= e->blob->cap;
    f->m.cache_entries_used--;
    map_remove(e);
    mark_dirty(e);   /* freed there once no request reads it */
}

static void entry_free(entry_t *e)
{
    prism_fetch_t *f = e->f;
    PRISM_ASSERT(!e->reqs && !e->in_map && !e->in_cache && !e->dirty && !e->fs_pending);
    if (e->aprev) e->aprev->anext = e->anext;
    else f->all = e->anext;
    if (e->anext) e->anext->aprev = e->aprev;
    if (e->easy) {
        curl_multi_remove_handle(f->multi, e->easy);
        curl_easy_cleanup(e->easy);
    }
    if (e->fd >= 0) close(e->fd);
    if (e->blob) {
        f->m.held_bytes -= e->blob->cap;
        prism_fetch_blob_unref(e->blob);
    }
    prism_fetch_url_free(&e->url);
    prism_free(e->location);
    prism_free(e->key);
    prism_free(e);
}

/* ---- delivering to requests ---- */

static void req_unlink(entry_t *e, prism_fetch_req_t *q)
{
    if (q->prev) q->prev->next = q->next;
    else e->reqs = q->next;
    if (q->next) q->next->prev = q->prev;
    else e->reqs_tail = q->prev;
}

static void deliver(entry_t *e)
{
    prism_fetch_t *f = e->f;
    size_t len = e->blob->len;
    for (prism_fetch_req_t *q = e->reqs; q; q = q->next) {
        if (q->cancelled || q->done || q->seen >= len) continue;
        q->seen = len;
        if (!q->cb.on_data) continue;
        f->depth++;
        int r = q->cb.on_data(q, e->blob->data, len, e->declared, q->cb.ud);
        f->depth--;
        if (r == PRISM_FETCH_PAUSE) prism_fetch_pause(q);
        else if (r == PRISM_FETCH_STOP) prism_fetch_cancel(q);
    }
}

static void result_of(const prism_fetch_req_t *q, const entry_t *e, prism_fetch_reason_t why, prism_fetch_result_t *r)
{
    *r = (prism_fetch_result_t){
        .reason = why,
        .message = prism_fetch_reason_message(why),
        .cache_hit = q->cache_hit,
        .joined = q->joined,
        .seconds = prism_now_s() - q->t_start,
    };
    if (e) {
        r->http_status = e->http_status;
        r->http_version = e->http_version;
        r->redirects = e->redirects;
        if (why == PRISM_FETCH_OK) r->blob = e->blob;
    }
}

static void req_done(prism_fetch_req_t *q, entry_t *e, prism_fetch_reason_t why)
{
    prism_fetch_t *f = q->f;
    q->done = true;
    if (e) {
        e->n_active--;
        if (q->paused) e->n_paused--;
    }
    if (why != PRISM_FETCH_OK) f->m.refused[why]++;
    prism_fetch_result_t r;
    result_of(q, e, why, &r);
    f->depth++;
    q->cb.on_done(q, &r, q->cb.ud);
    f->depth--;
}

/* ---- transfers ---- */

static void set_failed(entry_t *e, prism_fetch_reason_t why);

static void stop_transfer(entry_t *e)
{
    prism_fetch_t *f = e->f;
    if (e->easy) {
        curl_multi_remove_handle(f->multi, e->easy);
        curl_easy_cleanup(e->easy);
        e->easy = NULL;
    }
    if (e->fd >= 0 && !e->fs_pending) {
        close(e->fd);
        e->fd = -1;
    }
    if (e->state == E_RUNNING) f->m.inflight--;
    if (e->state == E_QUEUED) {
        list_unlink(&f->queue_head, &f->queue_tail, e);
        f->m.queued--;
    }
}

static void set_failed(entry_t *e, prism_fetch_reason_t why)
{
    stop_transfer(e);
    map_remove(e);
    e->state = E_FAILED;
    e->why = why;
    PRISM_DEBUG("image fetch %s: %s%s%s", prism_fetch_reason_names[why], prism_fetch_reason_message(why),
                e->errbuf[0] ? " / libcurl: " : "", e->errbuf);
}

static void trim_and_cache(entry_t *e)
{
    prism_fetch_t *f = e->f;
    prism_fetch_blob_t *b = e->blob;
    if (b->cap > b->len + b->len / 8 && b->len > 0) {
        uint8_t *d = prism_realloc(b->data, b->len);
        if (d) {
            f->m.held_bytes -= b->cap - b->len;
            b->data = d;
            b->cap = b->len;
        }
    }
    double ttl = f->cfg.cache_ttl_s;
    if (e->max_age >= 0 && e->max_age < ttl) ttl = e->max_age;
    bool keep = f->cfg.cache_bytes > 0 && f->cfg.cache_entries > 0 && !e->no_store && !e->url.is_file &&
                ttl > 0 && b->cap <= (uint64_t)f->cfg.cache_bytes && e->in_map;
    if (!keep) {
        map_remove(e);
        return;
    }
    while (f->lru_tail && (f->m.cache_bytes_used + b->cap > (uint64_t)f->cfg.cache_bytes ||
                           f->m.cache_entries_used + 1 > (uint64_t)f->cfg.cache_entries))
        cache_drop(f->lru_tail);
    e->expires = prism_now_s() + ttl;
    e->in_cache = true;
    list_push(&f->lru_head, &f->lru_tail, e, true);
    f->m.cache_bytes_used += b->cap;
    f->m.cache_entries_used++;
}

static void set_done(entry_t *e)
{
    prism_fetch_t *f = e->f;
    if (e->easy) {
        long v = 0;
        curl_easy_getinfo(e->easy, CURLINFO_HTTP_VERSION, &v);
        e->http_version = v == CURL_HTTP_VERSION_2_0 ? 2 : v ? 1 : 0;
    }
    stop_transfer(e);
    e->state = E_DONE;
    if (f->secret) {
        /* once per download, before any request hears of it: the blob is immutable from here */
        e->blob->hash = XXH3_64bits_withSecret(e->blob->data, e->blob->len, f->secret, f->secret_len);
        e->blob->hashed = true;
    }
    f->m.downloads_ok++;
    prism_hist_observe(&f->m.seconds, prism_now_s() - e->t_start);
    trim_and_cache(e);
}

/* A request's wish to pause or go on, applied to its download (outside libcurl's callbacks). */
static void apply_pause(entry_t *e)
{
    prism_fetch_t *f = e->f;
    if (e->easy) {
        if (e->n_paused > 0 && !e->curl_paused) {
            e->curl_paused = true;
            f->m.pauses++;
            curl_easy_pause(e->easy, CURLPAUSE_RECV);
        } else if (e->n_paused == 0 && e->curl_paused) {
            e->curl_paused = false;
            /* may hand over what libcurl held at once: the write callback runs inside this call */
            curl_easy_pause(e->easy, CURLPAUSE_CONT);
        }
    }
}

/* ---- file:// ---- */

static void finish_close(prism_fetch_t *f);

static void file_read_next(entry_t *e);

static void on_file_read(uv_fs_t *r)
{
    entry_t *e = r->data;
    prism_fetch_t *f = e->f;
    ssize_t n = r->result;
    uv_fs_req_cleanup(r);
    e->fs_pending = false;
    f->fs_pending--;
    if (f->closing) {
        entry_free(e);
        finish_close(f);   /* when this was the last thing it waited for */
        return;
    }
    if (e->state != E_RUNNING) {   /* abandoned while the read ran */
        mark_dirty(e);
        return;
    }
    if (n < 0) {
        set_failed(e, PRISM_FETCH_FILE_NOT_FOUND);
    } else if (n == 0 && e->blob->len < e->fsize) {
        set_failed(e, PRISM_FETCH_TRUNCATED);   /* the file shrank under us */
    } else {
        e->blob->len += (size_t)n;
        f->m.bytes += (uint64_t)n;
        deliver(e);
        if (e->blob->len >= e->fsize) set_done(e);
    }
    settle(e);
    pump(f);
}

static void file_read_next(entry_t *e)
{
    prism_fetch_t *f = e->f;
    if (e->state != E_RUNNING || e->fs_pending || e->n_paused > 0) return;
    if (e->blob->len >= e->fsize) {
        set_done(e);
        return;
    }
    size_t chunk = (size_t)PRISM_MIN((uint64_t)FETCH_FILE_CHUNK, e->fsize - e->blob->len);
    uv_buf_t b = uv_buf_init((char *)e->blob->data + e->blob->len, (unsigned)chunk);
    e->fsreq.data = e;
    if (uv_fs_read(f->loop, &e->fsreq, e->fd, &b, 1, (int64_t)e->blob->len, on_file_read) < 0) {
        set_failed(e, PRISM_FETCH_FILE_NOT_FOUND);
        return;
    }
    e->fs_pending = true;
    f->fs_pending++;
}

static prism_fetch_reason_t start_file(entry_t *e)
{
    prism_fetch_t *f = e->f;
    uint64_t size = 0;
    prism_fetch_reason_t why = prism_fetch_policy_open_local(&f->policy, &e->url, &e->fd, &size);
    if (why != PRISM_FETCH_OK) return why;
    if (size > (uint64_t)f->cfg.max_bytes) return PRISM_FETCH_TOO_LARGE_DECLARED;
    e->fsize = size;
    e->declared = (int64_t)size;
    if (!blob_reserve(e, size ? (size_t)size : 1)) return PRISM_FETCH_NOMEM;
    return PRISM_FETCH_OK;
}

/* ---- libcurl callbacks (no multi calls in here) ---- */

static curl_socket_t on_open_socket(void *ud, curlsocktype purpose, struct curl_sockaddr *a)
{
    entry_t *e = ud;
    if (purpose != CURLSOCKTYPE_IPCXN) return CURL_SOCKET_BAD;
    /* the address about to be connected, after DNS: the one check a rebinding name cannot dodge */
    prism_fetch_reason_t why = prism_fetch_policy_addr(&e->f->policy, &a->addr, a->addrlen);
    if (why != PRISM_FETCH_OK) {
        prism_ip_t ip;
        char txt[64] = "?";
        if (prism_ip_from_sockaddr(&a->addr, a->addrlen, &ip) == PRISM_OK) prism_ip_format(&ip, txt, sizeof txt);
        PRISM_INFO("image fetch: refused to connect to %s (%s; --allowed-media-networks can allow it)", txt,
                   prism_fetch_reason_names[why]);
        if (e->addr_why == PRISM_FETCH_OK) e->addr_why = why;
        return CURL_SOCKET_BAD;
    }
    return socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
}

static int on_prereq(void *ud, char *peer_ip, char *local_ip, int peer_port, int local_port)
{
    entry_t *e = ud;
    /* the connection the request goes out on, new or reused: checked again */
    char buf[64];
    size_t n = strcspn(peer_ip, "%");   /* an IPv6 zone */
    prism_ip_t ip;
    prism_fetch_reason_t why = PRISM_FETCH_ADDR_RESERVED;
    if (n < sizeof buf) {
        memcpy(buf, peer_ip, n);
        if (prism_ip_parse(buf, n, &ip) == PRISM_OK) why = prism_fetch_policy_ip(&e->f->policy, &ip);
    }
    if (why != PRISM_FETCH_OK) {
        e->why = why;
        return CURL_PREREQFUNC_ABORT;
    }
    return CURL_PREREQFUNC_OK;
}

static bool header_is(const char *p, size_t n, const char *name, const char **val, size_t *vlen)
{
    size_t k = strlen(name);
    if (n <= k || strncasecmp(p, name, k) || p[k] != ':') return false;
    const char *v = p + k + 1, *end = p + n;
    while (v < end && (*v == ' ' || *v == '\t')) v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' ' || end[-1] == '\t')) end--;
    *val = v;
    *vlen = (size_t)(end - v);
    return true;
}

static void parse_cache_control(entry_t *e, const char *v, size_t n)
{
    const char *end = v + n;
    while (v < end) {
        while (v < end && (*v == ' ' || *v == ',' || *v == '\t')) v++;
        const char *t = v;
        while (v < end && *v != ',') v++;
        size_t tl = (size_t)(v - t);
        while (tl && (t[tl - 1] == ' ' || t[tl - 1] == '\t')) tl--;
        if ((tl == 8 && !strncasecmp(t, "no-store", 8)) || (tl == 8 && !strncasecmp(t, "no-cache", 8)) ||
            (tl == 7 && !strncasecmp(t, "private", 7)))
            e->no_store = true;
        else if (tl > 8 && !strncasecmp(t, "max-age=", 8)) {
            double a = 0;
            size_t i = 8;
            for (; i < tl && t[i] >= '0' && t[i] <= '9' && a < 1e9; i++) a = a * 10 + (t[i] - '0');
            if (i == tl) e->max_age = a;
        }
    }
}

static size_t end_of_headers(entry_t *e)
{
    prism_fetch_t *f = e->f;
    long code = 0;
    curl_easy_getinfo(e->easy, CURLINFO_RESPONSE_CODE, &code);
    e->http_status = (int)code;
    if (code >= 100 && code < 200) return 1;          /* an interim answer: the real one follows */
    if (code == 301 || code == 302 || code == 303 || code == 307 || code == 308) {
        if (e->location) e->redirect = true;           /* followed by us, checked like the first URL */
        else e->why = PRISM_FETCH_REDIRECTS;
        return 0;                                      /* stop here: its body is of no use */
    }
    if (code != 200 && code != 203) {
        e->why = PRISM_FETCH_HTTP_STATUS;
        return 0;
    }
    curl_off_t cl = -1;
    curl_easy_getinfo(e->easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &cl);
    if (cl > f->cfg.max_bytes) {
        e->why = PRISM_FETCH_TOO_LARGE_DECLARED;     /* before a byte of the body is read */
        return 0;
    }
    e->declared = cl >= 0 ? (int64_t)cl : -1;
    if (cl > 0 && !blob_reserve(e, (size_t)cl)) {
        e->why = PRISM_FETCH_NOMEM;
        return 0;
    }
    e->hdr_done = true;
    return 1;
}

static size_t on_header(char *p, size_t size, size_t nmemb, void *ud)
{
    entry_t *e = ud;
    size_t n = size * nmemb;
    const char *v;
    size_t vl;
    if (n >= 5 && !memcmp(p, "HTTP/", 5)) {           /* a new answer (after an interim one) */
        prism_free(e->location);
        e->location = NULL;
        e->no_store = false;
        e->max_age = -1;
    } else if (n <= 2 && (p[0] == '\r' || p[0] == '\n')) {
        if (e->hdr_done) return n;                     /* the end of trailers */
        return end_of_headers(e) ? n : 0;
    } else if (header_is(p, n, "location", &v, &vl)) {
        prism_free(e->location);
        e->location = NULL;
        if (vl == 0 || vl > FETCH_MAX_LOCATION) {
            e->why = PRISM_FETCH_REDIRECTS;
            return 0;
        }
        e->location = prism_strndup(v, vl);
        if (!e->location) {
            e->why = PRISM_FETCH_NOMEM;
            return 0;
        }
    } else if (header_is(p, n, "cache-control", &v, &vl)) {
        parse_cache_control(e, v, vl);
    }
    return n;
}

static size_t on_write(char *p, size_t size, size_t nmemb, void *ud)
{
    entry_t *e = ud;
    prism_fetch_t *f = e->f;
    size_t n = size * nmemb;
    if (e->why != PRISM_FETCH_OK || !e->hdr_done) return 0;
    if (e->n_paused > 0) {
        /* libcurl keeps these bytes and stops reading the socket until apply_pause goes on */
        if (!e->curl_paused) f->m.pauses++;
        e->curl_paused = true;
        return CURL_WRITEFUNC_PAUSE;
    }
    if (e->blob->len + n > (uint64_t)f->cfg.max_bytes) {
        e->why = PRISM_FETCH_TOO_LARGE;
        return 0;
    }
    if (!blob_reserve(e, e->blob->len + n)) {
        e->why = PRISM_FETCH_NOMEM;
        return 0;
    }
    memcpy(e->blob->data + e->blob->len, p, n);
    e->blob->len += n;
    f->m.bytes += n;
    deliver(e);
    if (e->n_active == 0) mark_dirty(e);   /* nobody wants it any more: stopped from the kick */
    return n;
}

/* ---- starting and finishing downloads ---- */

static void hop_reset(entry_t *e)
{
    e->hdr_done = e->redirect = e->no_store = e->curl_paused = false;
    e->max_age = -1;
    prism_free(e->location);
    e->location = NULL;
    e->http_status = 0;
    e->declared = -1;
    e->why = e->addr_why = PRISM_FETCH_OK;
    e->errbuf[0] = 0;
}

static prism_fetch_reason_t easy_setup(entry_t *e)
{
    prism_fetch_t *f = e->f;
    const prism_fetch_config_t *c = &f->cfg;
    double left = e->deadline - prism_now_s();
    if (left <= 0) return PRISM_FETCH_TIMEOUT;
    if (!e->easy && !(e->easy = curl_easy_init())) return PRISM_FETCH_NOMEM;
    CURL *h = e->easy;
    long total_ms = (long)(left * 1000) + 1;
    long conn_ms = PRISM_MIN((long)(c->connect_timeout_s * 1000) + 1, total_ms);
    CURLcode rc = CURLE_OK;
#define SET(opt, val) if (rc == CURLE_OK) rc = curl_easy_setopt(h, opt, val)
    SET(CURLOPT_CURLU, e->url.u);
    SET(CURLOPT_PRIVATE, e);
    SET(CURLOPT_PROTOCOLS_STR, "http,https");
    SET(CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
    SET(CURLOPT_FOLLOWLOCATION, 0L);
    SET(CURLOPT_PROXY, "");                  /* no proxy, whatever the environment says */
    SET(CURLOPT_NOSIGNAL, 1L);
    SET(CURLOPT_HTTP_VERSION, c->http2 ? (long)CURL_HTTP_VERSION_2TLS : (long)CURL_HTTP_VERSION_1_1);
    /* over TLS with HTTP/2, wait for a connection being opened to the same host and share it;
     * plain http (HTTP/1.1) would only queue behind it */
    char *scheme = NULL;
    bool tls = curl_url_get(e->url.u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK && !strcmp(scheme, "https");
    curl_free(scheme);
    SET(CURLOPT_PIPEWAIT, tls && c->http2 ? 1L : 0L);
    SET(CURLOPT_SSL_VERIFYPEER, 1L);
    SET(CURLOPT_SSL_VERIFYHOST, 2L);
    if (f->ca_file) {
        SET(CURLOPT_CAINFO, f->ca_file);
        if (f->ca_path) SET(CURLOPT_CAPATH, f->ca_path);   /* the system's store stays trusted */
    }
    SET(CURLOPT_USERAGENT, "prism-router (image fetch)");
    SET(CURLOPT_WRITEFUNCTION, on_write);
    SET(CURLOPT_WRITEDATA, e);
    SET(CURLOPT_HEADERFUNCTION, on_header);
    SET(CURLOPT_HEADERDATA, e);
    SET(CURLOPT_OPENSOCKETFUNCTION, on_open_socket);
    SET(CURLOPT_OPENSOCKETDATA, e);
    SET(CURLOPT_PREREQFUNCTION, on_prereq);
    SET(CURLOPT_PREREQDATA, e);
    SET(CURLOPT_ERRORBUFFER, e->errbuf);
    SET(CURLOPT_CONNECTTIMEOUT_MS, conn_ms);
    SET(CURLOPT_TIMEOUT_MS, total_ms);
    if (c->min_rate > 0) {
        SET(CURLOPT_LOW_SPEED_LIMIT, (long)c->min_rate);
        SET(CURLOPT_LOW_SPEED_TIME, PRISM_MAX(1L, (long)(c->min_rate_window_s + 0.5)));
    }
    SET(CURLOPT_BUFFERSIZE, (long)FETCH_CURL_BUFFER);
#undef SET
    if (rc != CURLE_OK) {
        PRISM_ERROR("image fetch: libcurl refused an option: %s", curl_easy_strerror(rc));
        return rc == CURLE_OUT_OF_MEMORY ? PRISM_FETCH_NOMEM : PRISM_FETCH_NETWORK;
    }
    hop_reset(e);
    if (curl_multi_add_handle(f->multi, h) != CURLM_OK) return PRISM_FETCH_NOMEM;
    return PRISM_FETCH_OK;
}

static void start_entry(entry_t *e)
{
    prism_fetch_t *f = e->f;
    list_unlink(&f->queue_head, &f->queue_tail, e);
    f->m.queued--;
    e->state = E_RUNNING;
    e->t_start = prism_now_s();
    f->m.inflight++;
    f->m.downloads++;
    if (f->m.inflight > f->m.peak_inflight) f->m.peak_inflight = f->m.inflight;
    prism_fetch_reason_t why = e->url.is_file ? start_file(e) : easy_setup(e);
    if (why != PRISM_FETCH_OK) {
        set_failed(e, why);
        mark_dirty(e);
        return;
    }
    if (e->url.is_file) file_read_next(e);
    if (e->state != E_RUNNING) mark_dirty(e);   /* an empty file is done at once */
}

static void pump(prism_fetch_t *f)
{
    double now = prism_now_s();
    while (!f->closing && f->queue_head && f->m.inflight < (uint64_t)f->cfg.max_inflight) {
        entry_t *e = f->queue_head;
        if (now >= e->deadline) {
            set_failed(e, PRISM_FETCH_TIMEOUT);
            mark_dirty(e);
            continue;
        }
        start_entry(e);
    }
}

static prism_fetch_reason_t classify_curl(entry_t *e, CURLcode rc)
{
    switch (rc) {
    case CURLE_OK: return PRISM_FETCH_OK;
    case CURLE_WRITE_ERROR:
    case CURLE_ABORTED_BY_CALLBACK: return e->why != PRISM_FETCH_OK ? e->why : PRISM_FETCH_NETWORK;
    case CURLE_COULDNT_RESOLVE_HOST: return PRISM_FETCH_DNS;
    case CURLE_COULDNT_CONNECT: return e->addr_why != PRISM_FETCH_OK ? e->addr_why : PRISM_FETCH_CONNECT;
    case CURLE_OPERATION_TIMEDOUT: {
        if (prism_now_s() >= e->deadline - 0.005) return PRISM_FETCH_TIMEOUT;
        curl_off_t conn = 0, app = 0;
        curl_easy_getinfo(e->easy, CURLINFO_CONNECT_TIME_T, &conn);
        curl_easy_getinfo(e->easy, CURLINFO_APPCONNECT_TIME_T, &app);
        char *scheme = NULL;
        bool tls = curl_url_get(e->url.u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK && !strcmp(scheme, "https");
        curl_free(scheme);
        if (conn == 0 || (tls && app == 0)) return e->addr_why != PRISM_FETCH_OK ? e->addr_why : PRISM_FETCH_CONNECT_TIMEOUT;
        return PRISM_FETCH_TOO_SLOW;
    }
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CIPHER:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_ISSUER_ERROR:
    case CURLE_SSL_INVALIDCERTSTATUS:
    case CURLE_SSL_PINNEDPUBKEYNOTMATCH:
    case CURLE_SSL_CRL_BADFILE:
    case CURLE_USE_SSL_FAILED: return PRISM_FETCH_TLS;
    case CURLE_PARTIAL_FILE: return PRISM_FETCH_TRUNCATED;
    case CURLE_FILESIZE_EXCEEDED: return PRISM_FETCH_TOO_LARGE_DECLARED;
    case CURLE_UNSUPPORTED_PROTOCOL: return PRISM_FETCH_SCHEME;
    case CURLE_OUT_OF_MEMORY: return PRISM_FETCH_NOMEM;
    case CURLE_TOO_MANY_REDIRECTS: return PRISM_FETCH_REDIRECTS;
    default: return PRISM_FETCH_NETWORK;
    }
}

/* A redirect: the next hop is the Location resolved against this one, checked like the first URL;
 * its connection goes through the same address checks. */
static prism_fetch_reason_t next_hop(entry_t *e)
{
    prism_fetch_t *f = e->f;
    if (e->redirects >= f->cfg.max_redirects) return PRISM_FETCH_REDIRECTS;
    prism_fetch_url_t next;
    prism_fetch_reason_t why = prism_fetch_policy_redirect(&f->policy, &e->url, e->location, strlen(e->location), &next);
    if (why != PRISM_FETCH_OK) return why;
    curl_multi_remove_handle(f->multi, e->easy);
    prism_fetch_url_free(&e->url);
    e->url = next;
    e->redirects++;
    f->m.redirects++;
    e->blob->len = 0;
    return easy_setup(e);
}

static void transfer_done(entry_t *e, CURLcode rc)
{
    if (rc == CURLE_WRITE_ERROR && e->redirect && e->why == PRISM_FETCH_OK) {
        prism_fetch_reason_t why = next_hop(e);
        if (why != PRISM_FETCH_OK) set_failed(e, why);
    } else {
        prism_fetch_reason_t why = classify_curl(e, rc);
        if (why == PRISM_FETCH_OK && !e->hdr_done) why = PRISM_FETCH_NETWORK;
        if (why == PRISM_FETCH_OK) set_done(e);
        else set_failed(e, why);
    }
    if (e->state != E_RUNNING) settle(e);
}

static void check_done(prism_fetch_t *f)
{
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(f->multi, &left))) {
        if (msg->msg != CURLMSG_DONE) continue;
        entry_t *e = NULL;
        curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&e);
        transfer_done(e, msg->data.result);
    }
    pump(f);
}

/* ---- settling an entry: what its requests are owed (never inside a libcurl callback) ---- */

static void settle(entry_t *e)
{
    switch (e->state) {
    case E_QUEUED:
    case E_RUNNING:
        if (e->n_active == 0) {   /* every request gone: stop the download */
            stop_transfer(e);
            map_remove(e);
            e->state = E_FAILED;
            e->why = PRISM_FETCH_NETWORK;
            break;
        }
        deliver(e);               /* requests that joined get what is there */
        if (e->state == E_RUNNING) {
            apply_pause(e);
            if (e->url.is_file) file_read_next(e);
        }
        if (e->state == E_RUNNING || e->state == E_QUEUED) break;
        __attribute__((fallthrough));   /* an empty file is done in file_read_next */
    case E_DONE:
    case E_FAILED:
        for (prism_fetch_req_t *q = e->reqs; q; q = q->next) {
            if (q->cancelled || q->done) continue;
            if (e->state == E_DONE) {
                deliver(e);
                if (q->cancelled) continue;
            }
            req_done(q, e, e->state == E_DONE ? PRISM_FETCH_OK : e->why);
        }
        break;
    }
    for (prism_fetch_req_t *q = e->reqs, *next; q; q = next) {
        next = q->next;
        if (q->cancelled || q->done) {
            req_unlink(e, q);
            prism_free(q);
        }
    }
    if (!e->reqs && !e->in_map && !e->in_cache && !e->dirty && !e->fs_pending &&
        (e->state == E_DONE || e->state == E_FAILED))
        entry_free(e);
}

/* ---- loop glue ---- */

static void on_sock_closed(uv_handle_t *h)
{
    sock_t *s = h->data;
    prism_fetch_t *f = s->f;
    prism_free(s);
    f->open_handles--;
    if (f->closing) finish_close(f);
}

static void on_poll(uv_poll_t *h, int status, int events)
{
    sock_t *s = h->data;
    prism_fetch_t *f = s->f;
    int flags = 0, running = 0;
    if (status < 0) flags = CURL_CSELECT_ERR;
    if (events & UV_READABLE) flags |= CURL_CSELECT_IN;
    if (events & UV_WRITABLE) flags |= CURL_CSELECT_OUT;
    curl_multi_socket_action(f->multi, s->fd, flags, &running);
    check_done(f);
}

static int on_curl_socket(CURL *easy, curl_socket_t fd, int what, void *ud, void *sockp)
{
    prism_fetch_t *f = ud;
    sock_t *s = sockp;
    if (what == CURL_POLL_REMOVE) {
        if (s) {
            curl_multi_assign(f->multi, fd, NULL);
            if (s->prev) s->prev->next = s->next;
            else f->socks = s->next;
            if (s->next) s->next->prev = s->prev;
            uv_close((uv_handle_t *)&s->poll, on_sock_closed);   /* stops watching fd now, frees later */
        }
        return 0;
    }
    if (!s) {
        s = prism_calloc(1, sizeof *s);
        if (!s) return -1;
        if (uv_poll_init_socket(f->loop, &s->poll, fd) != 0) {
            prism_free(s);
            return -1;
        }
        s->f = f;
        s->fd = fd;
        s->poll.data = s;
        s->next = f->socks;
        if (f->socks) f->socks->prev = s;
        f->socks = s;
        f->open_handles++;
        curl_multi_assign(f->multi, fd, s);
    }
    int ev = (what & CURL_POLL_IN ? UV_READABLE : 0) | (what & CURL_POLL_OUT ? UV_WRITABLE : 0);
    uv_poll_start(&s->poll, ev, on_poll);
    return 0;
}

static void on_timer(uv_timer_t *t)
{
    prism_fetch_t *f = t->data;
    int running = 0;
    curl_multi_socket_action(f->multi, CURL_SOCKET_TIMEOUT, 0, &running);
    check_done(f);
}

static int on_curl_timer(CURLM *m, long ms, void *ud)
{
    prism_fetch_t *f = ud;
    if (f->closing) return 0;
    if (ms < 0) uv_timer_stop(&f->timer);
    else uv_timer_start(&f->timer, on_timer, (uint64_t)ms, 0);   /* 0: on the next loop turn, not here */
    return 0;
}


static void on_kick(uv_timer_t *t)
{
    prism_fetch_t *f = t->data;
    f->kick_pending = false;
    prism_fetch_req_t *o = f->orphans;
    f->orphans = NULL;
    while (o) {
        prism_fetch_req_t *next = o->next;
        if (!o->cancelled) req_done(o, NULL, o->why);
        prism_free(o);
        o = next;
    }
    while (f->dirty) {
        entry_t *list = f->dirty;
        f->dirty = NULL;
        while (list) {
            entry_t *e = list;
            list = e->dnext;
            e->dnext = NULL;
            e->dirty = false;
            settle(e);
        }
    }
    pump(f);
    /* apply_pause's CONT may have let a transfer complete inside libcurl */
    check_done(f);
}

static void kick(prism_fetch_t *f)
{
    if (f->kick_pending) return;
    f->kick_pending = true;
    uv_timer_start(&f->kick, on_kick, 0, 0);
}

static void on_sweep(uv_timer_t *t)
{
    prism_fetch_t *f = t->data;
    double now = prism_now_s();
    for (entry_t *e = f->lru_head, *next; e; e = next) {
        next = e->lnext;
        if (now >= e->expires) cache_drop(e);
    }
    for (entry_t *e = f->queue_head, *next; e; e = next) {
        next = e->lnext;
        if (now >= e->deadline) {
            set_failed(e, PRISM_FETCH_TIMEOUT);
            mark_dirty(e);
        }
    }
}

/* ---- public ---- */

void prism_fetch_config_default(prism_fetch_config_t *c)
{
    *c = (prism_fetch_config_t){
        .connect_timeout_s = 5,
        .timeout_s = 30,
        .min_rate = 8 << 10,
        .min_rate_window_s = 10,
        .max_bytes = 20 << 20,
        .max_redirects = 3,
        .max_inflight = 64,
        .max_queued = 1024,
        .cache_bytes = 256 << 20,
        .cache_entries = 4096,
        .cache_ttl_s = 600,
        .http2 = true,
    };
}

void prism_fetch_config_bounds(const prism_fetch_config_t *c, prism_fetch_bounds_t *out)
{
    out->downloads = (uint64_t)PRISM_MAX(c->max_inflight, 0) * ((uint64_t)PRISM_MAX(c->max_bytes, 0) + FETCH_CURL_BUFFER);
    out->cache = (uint64_t)PRISM_MAX(c->cache_bytes, 0);
    out->total = out->downloads + out->cache;
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;
static void curl_init(void)
{
    /* libcurl's own allocations go through the counting allocator (prism:router_memory_bytes) */
    curl_init_rc = curl_global_init_mem(CURL_GLOBAL_DEFAULT, prism_malloc, prism_free, prism_realloc, prism_strdup,
                                        prism_calloc);
}

int prism_fetch_open(uv_loop_t *loop, const prism_fetch_config_t *cfg, prism_fetch_t **out, char *why, size_t why_n)
{
    *out = NULL;
    if (cfg->connect_timeout_s <= 0 || cfg->timeout_s <= 0 || cfg->max_bytes < 1 || cfg->max_redirects < 0 ||
        cfg->max_redirects > 20 || cfg->max_inflight < 1 || cfg->max_queued < 0 || cfg->min_rate < 0 ||
        cfg->min_rate_window_s < 1 || cfg->cache_bytes < 0 || cfg->cache_entries < 0 || cfg->cache_ttl_s < 0) {
        snprintf(why, why_n, "image fetch limits out of range (timeouts > 0, max bytes >= 1, redirects 0..20, "
                             "in flight >= 1, the rest >= 0)");
        return PRISM_EINVAL;
    }
    if (cfg->hash_secret && cfg->hash_secret_len < FETCH_MIN_SECRET) {
        snprintf(why, why_n, "image hash secret of %zu bytes (at least %d)", cfg->hash_secret_len, FETCH_MIN_SECRET);
        return PRISM_EINVAL;
    }
    pthread_once(&curl_once, curl_init);
    if (curl_init_rc != CURLE_OK) {
        snprintf(why, why_n, "libcurl: %s", curl_easy_strerror(curl_init_rc));
        return PRISM_EIO;
    }
    curl_version_info_data *vi = curl_version_info(CURLVERSION_NOW);
    if (!(vi->features & CURL_VERSION_SSL)) {
        snprintf(why, why_n, "libcurl %s was built without TLS", vi->version);
        return PRISM_ENOTSUP;
    }
    prism_fetch_t *f = prism_calloc(1, sizeof *f);
    if (!f) return PRISM_ENOMEM;
    f->loop = loop;
    f->cfg = *cfg;
    prism_hist_init(&f->m.seconds, fetch_buckets, (int)PRISM_ARRAY_LEN(fetch_buckets));
    if (prism_random_bytes(&f->seed, sizeof f->seed) != PRISM_OK) f->seed = prism_now_ns();
    int rc = prism_fetch_policy_init(&f->policy, cfg->allowed_networks.items, cfg->allowed_networks.n,
                                     cfg->allowed_domains.items, cfg->allowed_domains.n, cfg->allowed_local_path, why,
                                     why_n);
    if (rc != PRISM_OK) {
        prism_free(f);
        return rc;
    }
    f->cfg.allowed_local_path = NULL;  /* the policy holds it; the caller's strings are not kept */
    f->cfg.allowed_networks.n = f->cfg.allowed_domains.n = 0;
    f->cfg.ca_file = NULL;
    f->cfg.hash_secret = NULL;
    if (cfg->ca_file && *cfg->ca_file) {
        if (access(cfg->ca_file, R_OK) != 0) {
            snprintf(why, why_n, "media CA file '%s' cannot be read: %s", cfg->ca_file, strerror(errno));
            prism_fetch_policy_free(&f->policy);
            prism_free(f);
            return PRISM_EINVAL;
        }
        f->ca_file = prism_strdup(cfg->ca_file);
        if (vi->capath) f->ca_path = prism_strdup(vi->capath);
        else PRISM_WARN("libcurl has no CA directory: --media-ca-file replaces its CA bundle instead of adding to it");
    }
    f->multi = curl_multi_init();
    if (cfg->hash_secret && f->multi && (f->secret = prism_malloc(cfg->hash_secret_len)) != NULL) {
        memcpy(f->secret, cfg->hash_secret, cfg->hash_secret_len);
        f->secret_len = cfg->hash_secret_len;
    }
    if (!f->multi || (cfg->hash_secret && !f->secret)) {
        if (f->multi) curl_multi_cleanup(f->multi);
        prism_fetch_policy_free(&f->policy);
        prism_free(f->ca_file);
        prism_free(f->ca_path);
        prism_free(f);
        return PRISM_ENOMEM;
    }
    curl_multi_setopt(f->multi, CURLMOPT_SOCKETFUNCTION, on_curl_socket);
    curl_multi_setopt(f->multi, CURLMOPT_SOCKETDATA, f);
    curl_multi_setopt(f->multi, CURLMOPT_TIMERFUNCTION, on_curl_timer);
    curl_multi_setopt(f->multi, CURLMOPT_TIMERDATA, f);
    curl_multi_setopt(f->multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, (long)cfg->max_inflight);
    curl_multi_setopt(f->multi, CURLMOPT_PIPELINING, (long)CURLPIPE_MULTIPLEX);
    uv_timer_init(loop, &f->timer);
    uv_timer_init(loop, &f->kick);
    uv_timer_init(loop, &f->sweep);
    f->timer.data = f->kick.data = f->sweep.data = f;
    f->open_handles = 3;
    uv_timer_start(&f->sweep, on_sweep, 1000, 1000);
    uv_unref((uv_handle_t *)&f->sweep);   /* housekeeping alone keeps no loop running */
    *out = f;
    return PRISM_OK;
}

static void on_timer_closed(uv_handle_t *h)
{
    prism_fetch_t *f = h->data;
    f->open_handles--;
    finish_close(f);
}

static void finish_close(prism_fetch_t *f)
{
    if (f->open_handles > 0 || f->fs_pending > 0) return;
    void (*cb)(void *) = f->close_cb;
    void *ud = f->close_ud;
    prism_fetch_policy_free(&f->policy);
    prism_free(f->ca_file);
    prism_free(f->ca_path);
    prism_free(f->secret);
    prism_free(f);
    if (cb) cb(ud);
}

void prism_fetch_close(prism_fetch_t *f, void (*cb)(void *ud), void *ud)
{
    PRISM_ASSERT(f->depth == 0 && !f->closing);
    f->closing = true;
    f->close_cb = cb;
    f->close_ud = ud;
    for (prism_fetch_req_t *o = f->orphans, *next; o; o = next) {
        next = o->next;
        prism_free(o);
    }
    f->orphans = NULL;
    f->dirty = NULL;
    for (entry_t *e = f->all, *next; e; e = next) {
        next = e->anext;
        for (prism_fetch_req_t *q = e->reqs, *qn; q; q = qn) {
            qn = q->next;
            prism_free(q);
        }
        e->reqs = e->reqs_tail = NULL;
        e->dirty = false;
        e->in_cache = false;
        map_remove(e);
        if (e->fs_pending) {
            uv_cancel((uv_req_t *)&e->fsreq);   /* freed by its callback */
            continue;
        }
        entry_free(e);
    }
    curl_multi_cleanup(f->multi);   /* closes the connections: their sockets' polls are closed */
    f->multi = NULL;
    while (f->socks) {
        sock_t *s = f->socks;
        f->socks = s->next;
        uv_close((uv_handle_t *)&s->poll, on_sock_closed);
    }
    uv_close((uv_handle_t *)&f->timer, on_timer_closed);
    uv_close((uv_handle_t *)&f->kick, on_timer_closed);
    uv_close((uv_handle_t *)&f->sweep, on_timer_closed);
}

int prism_fetch_start(prism_fetch_t *f, const char *url, size_t len, const prism_fetch_cb_t *cb, prism_fetch_req_t **out)
{
    PRISM_ASSERT(!f->closing && cb && cb->on_done);
    prism_fetch_req_t *q = prism_calloc(1, sizeof *q);
    if (!q) return PRISM_ENOMEM;
    q->f = f;
    q->cb = *cb;
    q->t_start = prism_now_s();
    f->m.requests++;
    *out = q;
    prism_fetch_url_t u;
    prism_fetch_reason_t why = prism_fetch_policy_url(&f->policy, url, len, &u);
    entry_t *e = NULL;
    uint64_t h = 0;
    if (why == PRISM_FETCH_OK) {
        h = key_hash(f, u.key);
        e = map_find(f, u.key, h);
        if (e && e->in_cache && prism_now_s() >= e->expires) {
            cache_drop(e);
            e = NULL;
        }
        /* waiting beyond the free slots: the queue proper */
        uint64_t free_slots = (uint64_t)f->cfg.max_inflight - PRISM_MIN(f->m.inflight, (uint64_t)f->cfg.max_inflight);
        if (!e && f->m.queued >= (uint64_t)f->cfg.max_queued + free_slots) why = PRISM_FETCH_BUSY;
    }
    if (why == PRISM_FETCH_OK && !e) {
        e = prism_calloc(1, sizeof *e);
        char *key = e ? prism_strdup(u.key) : NULL;
        prism_fetch_blob_t *b = key ? prism_calloc(1, sizeof *b) : NULL;
        if (!b) {
            prism_free(key);
            prism_free(e);
            e = NULL;
            why = PRISM_FETCH_NOMEM;
        } else {
            atomic_init(&b->refs, 1);
            e->f = f;
            e->key = key;
            e->hash = h;
            e->fd = -1;
            e->blob = b;
            e->url = u;
            memset(&u, 0, sizeof u);
            e->declared = -1;
            e->max_age = -1;
            e->t_created = prism_now_s();
            e->deadline = e->t_created + f->cfg.timeout_s;
            e->state = E_QUEUED;
            e->anext = f->all;
            if (f->all) f->all->aprev = e;
            f->all = e;
            e->hnext = f->buckets[h & (FETCH_BUCKETS - 1)];
            f->buckets[h & (FETCH_BUCKETS - 1)] = e;
            e->in_map = true;
            list_push(&f->queue_head, &f->queue_tail, e, false);
            f->m.queued++;
        }
    } else if (e) {
        if (e->in_cache) {
            q->cache_hit = true;
            f->m.cache_hits++;
            list_unlink(&f->lru_head, &f->lru_tail, e);   /* most recently used */
            list_push(&f->lru_head, &f->lru_tail, e, true);
        } else {
            q->joined = true;
            f->m.joined++;
        }
    }
    prism_fetch_url_free(&u);
    if (why != PRISM_FETCH_OK) {
        q->why = why;
        q->next = f->orphans;
        f->orphans = q;
        kick(f);
        return PRISM_OK;
    }
    q->e = e;
    q->prev = e->reqs_tail;
    if (e->reqs_tail) e->reqs_tail->next = q;
    else e->reqs = q;
    e->reqs_tail = q;
    e->n_active++;
    mark_dirty(e);
    return PRISM_OK;
}

void prism_fetch_cancel(prism_fetch_req_t *q)
{
    if (q->cancelled || q->done) return;
    q->cancelled = true;
    if (!q->e) return;   /* an orphan: skipped and freed by the kick */
    q->e->n_active--;
    if (q->paused) q->e->n_paused--;
    mark_dirty(q->e);
}

void prism_fetch_pause(prism_fetch_req_t *q)
{
    if (q->paused || q->cancelled || q->done || !q->e) return;
    q->paused = true;
    q->e->n_paused++;
    mark_dirty(q->e);
}

void prism_fetch_resume(prism_fetch_req_t *q)
{
    if (!q->paused || q->cancelled || q->done || !q->e) return;
    q->paused = false;
    q->e->n_paused--;
    mark_dirty(q->e);
}

prism_fetch_reason_t prism_fetch_check_url(const prism_fetch_t *f, const char *url, size_t len)
{
    prism_fetch_url_t u;
    prism_fetch_reason_t why = prism_fetch_policy_url(&f->policy, url, len, &u);
    prism_fetch_url_free(&u);
    return why;
}

const prism_fetch_policy_t *prism_fetch_policy(const prism_fetch_t *f) { return &f->policy; }
const prism_fetch_metrics_t *prism_fetch_metrics(const prism_fetch_t *f) { return &f->m; }

void prism_fetch_metrics_write(const prism_fetch_t *f, prism_buf_t *b)
{
    const prism_fetch_metrics_t *m = &f->m;
    prism_metric_write(b, "prism:image_fetch_requests_total", "counter", "Image URLs asked for.", "", (double)m->requests);
    prism_metric_write(b, "prism:image_fetch_downloads_total", "counter",
                       "Image downloads started (a URL being downloaded or cached is not downloaded again).", "",
                       (double)m->downloads);
    prism_metric_write(b, "prism:image_fetch_downloads_ok_total", "counter", "Image downloads that gave an image.", "",
                       (double)m->downloads_ok);
    prism_metric_write(b, "prism:image_fetch_cache_hits_total", "counter", "Image URLs served from the URL cache.", "",
                       (double)m->cache_hits);
    prism_metric_write(b, "prism:image_fetch_joined_total", "counter",
                       "Image URLs that joined a download another request had started.", "", (double)m->joined);
    prism_metric_write(b, "prism:image_fetch_bytes_total", "counter", "Image bytes downloaded.", "", (double)m->bytes);
    prism_metric_write(b, "prism:image_fetch_redirects_total", "counter", "Redirects followed.", "", (double)m->redirects);
    prism_metric_write(b, "prism:image_fetch_pauses_total", "counter", "Downloads paused for their readers (backpressure).",
                       "", (double)m->pauses);
    bool first = true;
    for (int i = 1; i < PRISM_FETCH_REASON_COUNT; i++) {
        char lbl[64];
        snprintf(lbl, sizeof lbl, "reason=\"%s\"", prism_fetch_reason_names[i]);
        prism_metric_write(b, "prism:image_fetch_refused_total", "counter",
                           first ? "Image URLs that gave no image, by the rule or failure that stopped them." : NULL,
                           lbl, (double)m->refused[i]);
        first = false;
    }
    prism_hist_write(&m->seconds, b, "prism:image_fetch_seconds", "Image download time (successful downloads).", "");
    prism_metric_write(b, "prism:image_fetch_in_flight", "gauge", "Image downloads running.", "", (double)m->inflight);
    prism_metric_write(b, "prism:image_fetch_queued", "gauge", "Image downloads waiting for a slot.", "", (double)m->queued);
    prism_metric_write(b, "prism:image_fetch_held_bytes", "gauge", "Bytes of image downloads and the URL cache.", "",
                       (double)m->held_bytes);
    prism_metric_write(b, "prism:image_fetch_cache_bytes", "gauge", "Bytes of images in the URL cache.", "",
                       (double)m->cache_bytes_used);
    prism_metric_write(b, "prism:image_fetch_cache_entries", "gauge", "Images in the URL cache.", "",
                       (double)m->cache_entries_used);
}
