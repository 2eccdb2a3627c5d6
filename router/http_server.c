/* HTTP/1.1 server on libuv + llhttp. See http_server.h for behaviour and the ownership rule.
 *
 * Shape: one conn_t per socket, holding at most one request at a time (conn->req). Bytes read are
 * appended to conn->inbuf and fed to llhttp by conn_process(); on_message_complete pauses the
 * parser, so pipelined bytes stay in inbuf until the current response completes. Requests are
 * reference counted (connection + caller) so a late respond after a disconnect touches nothing
 * freed. Connections are freed only from uv_close callbacks (two handles: tcp + timer).
 * Error answers (400/413/431/417/503) are written, the write side is shut down and the connection
 * "lingers" reading and discarding for a moment so the client sees the answer instead of a reset. */
#include "http_server.h"
#include "body_lift.h"
#include "openai_write.h"

#include <linux/sockios.h>
#include <llhttp.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <string.h>
#include <strings.h>

#define HTTP_READ_CHUNK      (64 * 1024)
#define HTTP_MAX_HEADERS     256
/* After an error answer the connection "lingers": it reads and discards what the client still sends
 * (the rest of a refused body) so the client can finish and read the answer instead of getting a
 * reset. It ends when the client closes, goes quiet for HTTP_LINGER_IDLE_MS, has sent more than any
 * request could hold, or after HTTP_LINGER_MAX_MS. Discarding costs no memory. */
#define HTTP_LINGER_IDLE_MS  30000  /* a client starved of CPU may pause long mid-upload */
#define HTTP_LINGER_MAX_MS   120000
#define HTTP_LINGER_REJECTED_MS 5000
#define HTTP_BODY_MIN_CAP    (16 * 1024)  /* first body allocation; then doubling, never past Content-Length */

typedef struct conn conn_t;

typedef struct {
    uint32_t name_off;   /* into req->hdrs, NUL-terminated */
    uint32_t value_off;
} hdr_ent_t;

struct prism_http_req {
    int refs;
    conn_t *conn;          /* NULL once detached (response done or connection gone) */
    char method[24];
    prism_buf_t url;       /* raw target; split in place into path '\0' query */
    const char *path, *query;
    prism_buf_t hdrs;      /* packed "name\0value\0" */
    hdr_ent_t *hents;      /* [n_hdr] */
    int n_hdr, cap_hdr;
    bool in_field;
    prism_buf_t body;        /* the body, or its skeleton when lifted */
    size_t body_raw;         /* body bytes received (the max_body_bytes bound) */
    prism_lift_t *lift;      /* lift_data_urls: the lifter and its images */
    int img_asked;           /* image_check: images before this one have their answer */
    int img_told;            /* image_done: images before this one were told */
    size_t img_ask_at;       /* ask about image img_asked once it holds this many bytes */
    size_t body_charged;     /* bytes of this body counted in srv->body_bytes: the buffer's capacity plus
                              * the lifted image bytes not taken */
    uint64_t declared_len;   /* Content-Length, 0 when absent (chunked) */
    prism_http_server_t *srv;
    int http_major, http_minor;
    bool keep_alive, is_head;
    bool dispatched, started, streaming, chunked_out, done, aborted;
    bool images_told;        /* image_done told the caller of an image (body_gone is owed if undispatched) */
    uint64_t id, conn_id;    /* prism_http_req_id, prism_http_req_conn_id */
    double t_begin;          /* prism_now_s() at its first byte (prism_http_req_began) */
    void (*abort_cb)(prism_http_req_t *r, void *ud);
    void *abort_ud;
    void *user;
};

struct conn {
    uv_tcp_t tcp;
    uv_timer_t timer;        /* idle timeout, or linger deadline when discarding */
    uv_timer_t wtimer;       /* the write deadline: unsent answer bytes (conn_arm_write) */
    uint64_t w_total;        /* bytes ever passed to uv_write */
    uint64_t w_t0, w_base;   /* the backlog began at loop time w_t0, with w_base bytes handed to the kernel */
    bool w_active;           /* a backlog is being timed */
    bool write_blocked;      /* the next pipelined request waits for the backlog to shrink */
    const char *exec_start;  /* the bytes given to the current llhttp_execute */
    char exec_prev;          /* the last byte given to the previous one */
    uv_shutdown_t shutdown_req;
    prism_http_server_t *srv;
    uint64_t id;             /* the connection's serial (prism_http_req_conn_id) */
    llhttp_t parser;
    prism_buf_t inbuf;       /* unparsed bytes starting at in_off */
    size_t in_off;
    prism_http_req_t *req;   /* being parsed, or dispatched and waiting for its response */
    size_t hdr_bytes;
    size_t ext_bytes;        /* chunk extensions of the current request */
    uint64_t t_req_start;    /* loop time (ms) of the current request's first byte */
    uint64_t t_rate;         /* loop time the body's rate window began: its headers, or the end of its
                              * last pause (see conn_arm_timer) */
    size_t raw_rate;         /* body bytes received before that */
    bool headers_done;
    int fail_status;
    char fail_msg[256];      /* message for fail_status when set (on_headers refusals, chunk extensions) */
    int open_handles;
    bool reading, closing, handles_closed, discard, rejected, in_process, shutdown_started, shutdown_done;
    bool broken;             /* a write failed: closing from the loop (see conn_break) */
    bool in_body;            /* on the server's list of bodies in progress (headers done, not dispatched) */
    bool hold;               /* the parser paused after the headers: the body waits for room */
    bool paused;             /* not reading its body: the budget is spent or the caller's gate holds it */
    bool yielded;            /* its body filled a whole read: it reads on at the next loop turn (on_read) */
    bool complete;           /* the request is whole and waits only for the caller's gate to dispatch */
    uint64_t t_paused;       /* loop time the pause began */
    conn_t *bprev, *bnext;   /* bodies in progress, oldest first */
    uint64_t linger_end;     /* loop time a lingering connection closes at the latest */
    size_t discarded;        /* bytes read and dropped while lingering */
    conn_t *prev, *next;
};

struct prism_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    prism_http_config_t cfg;
    prism_http_handler_fn fn;
    void *ud;
    llhttp_settings_t settings;
    conn_t *conns;           /* intrusive list of all open connections */
    size_t n_conns;
    size_t n_reqs;           /* requests tied to this server (r->srv) not yet freed: a handler may
                              * release one after the server stopped, and its body is uncharged here */
    size_t n_active;         /* accepted, not rejected, socket not closed yet (read atomically) */
    bool stopping, listener_closed, resume_closed;
    bool draining, listener_closing;  /* prism_http_server_drain: no new connections, no keep-alive */
    uv_timer_t resume_timer; /* runs server_resume_bodies from the loop, never inside a caller's call */
    int port;
    size_t body_bytes;       /* request bodies held right now: buffer bytes, charged as bodies arrive */
    conn_t *bodies, *bodies_tail;  /* connections with a body in progress, oldest first */
    prism_http_refusals_t refused;
    uint64_t pauses;         /* bodies that stopped reading for room (each pause once) */
    uint64_t next_req_id, next_conn_id;   /* serials, from 1 */
    char scratch[HTTP_READ_CHUNK];  /* libuv reads here; read_cb copies into conn->inbuf */
};

static void conn_process(conn_t *c);
static void conn_close_graceful(conn_t *c);
static void conn_close_now(conn_t *c);
static void conn_arm_timer(conn_t *c);
static void conn_arm_write(conn_t *c);

/* ------------------------------------------------------------------ small helpers */

const char *prism_http_status_text(int status)
{
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 201: return "Created";
    case 202: return "Accepted";
    case 204: return "No Content";
    case 301: return "Moved Permanently";
    case 302: return "Found";
    case 304: return "Not Modified";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 422: return "Unprocessable Entity";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Unknown";
    }
}

/* ------------------------------------------------------------------ requests */

static prism_http_req_t *req_new(void)
{
    prism_http_req_t *r = prism_calloc(1, sizeof *r);
    if (!r) return NULL;
    r->refs = 1;  /* the connection's */
    r->query = "";
    r->path = "";
    return r;
}

static void server_resume_bodies(prism_http_server_t *s);
static void server_maybe_free(prism_http_server_t *s);

/* Charges what the body holds now: its buffer's capacity and the lifted image bytes not taken. A
 * decrease lets paused bodies read again. */
static void body_recharge(prism_http_req_t *r)
{
    size_t now = r->body.cap + (r->lift ? prism_lift_held(r->lift) : 0);
    if (now == r->body_charged) return;
    if (!r->srv) {
        r->body_charged = now;
        return;
    }
    PRISM_ASSERT(r->srv->body_bytes >= r->body_charged);
    r->srv->body_bytes = r->srv->body_bytes - r->body_charged + now;
    bool less = now < r->body_charged;
    r->body_charged = now;
    if (less) server_resume_bodies(r->srv);
}

static void body_free(prism_http_req_t *r)
{
    prism_buf_free(&r->body);
    if (r->lift) {
        prism_lift_free(r->lift);
        prism_free(r->lift);
        r->lift = NULL;
    }
    body_recharge(r);
}

static void req_unref(prism_http_req_t *r)
{
    PRISM_ASSERT(r->refs > 0);
    if (--r->refs > 0) return;
    body_free(r);
    prism_buf_free(&r->url);
    prism_buf_free(&r->hdrs);
    prism_free(r->hents);
    prism_http_server_t *s = r->srv;
    prism_free(r);
    if (s) {
        s->n_reqs--;
        server_maybe_free(s);
    }
}

void prism_http_req_release(prism_http_req_t *r)
{
    if (!r) return;
    /* The caller gave the request up: its abort callback must never run after this (it would see
     * whatever the caller freed with the request), even if the connection closes later. */
    r->abort_cb = NULL;
    r->abort_ud = NULL;
    req_unref(r);
}

const char *prism_http_req_method(const prism_http_req_t *r) { return r->method; }
const char *prism_http_req_path(const prism_http_req_t *r) { return r->path; }
const char *prism_http_req_query(const prism_http_req_t *r) { return r->query; }
int prism_http_req_http_minor(const prism_http_req_t *r) { return r->http_minor; }
void prism_http_req_set_user(prism_http_req_t *r, void *user) { r->user = user; }
void *prism_http_req_user(prism_http_req_t *r) { return r->user; }
uint64_t prism_http_req_id(const prism_http_req_t *r) { return r->id; }
uint64_t prism_http_req_conn_id(const prism_http_req_t *r) { return r->conn_id; }
double prism_http_req_began(const prism_http_req_t *r) { return r->t_begin; }
bool prism_http_req_aborted(const prism_http_req_t *r) { return r->aborted; }

const char *prism_http_req_header(const prism_http_req_t *r, const char *name)
{
    for (int i = 0; i < r->n_hdr; i++) {
        if (strcasecmp(r->hdrs.data + r->hents[i].name_off, name) == 0) return r->hdrs.data + r->hents[i].value_off;
    }
    return NULL;
}

const char *prism_http_req_body(const prism_http_req_t *r, size_t *len)
{
    if (len) *len = r->body.len;
    return r->body.data ? r->body.data : "";
}

void prism_http_req_drop_body(prism_http_req_t *r)
{
    body_free(r);
}

bool prism_http_req_has_images(const prism_http_req_t *r) { return r->lift && r->lift->n > 0; }
size_t prism_http_req_image_bytes(const prism_http_req_t *r) { return r->lift ? prism_lift_held(r->lift) : 0; }

int prism_http_req_take_image(prism_http_req_t *r, int i, uint8_t **data, size_t *len, const char **mime, bool *bad)
{
    if (!r->lift) return PRISM_EINVAL;
    int rc = prism_lift_take(r->lift, i, data, len, mime, bad);
    if (rc == PRISM_OK) body_recharge(r);
    return rc;
}

int prism_http_req_peek_image(const prism_http_req_t *r, int i, const uint8_t **data, size_t *len, const char **mime,
                              bool *bad)
{
    return r->lift ? prism_lift_peek(r->lift, i, data, len, mime, bad) : PRISM_EINVAL;
}

void prism_http_req_on_abort(prism_http_req_t *r, void (*cb)(prism_http_req_t *r, void *ud), void *ud)
{
    r->abort_cb = cb;
    r->abort_ud = ud;
}

size_t prism_http_req_pending_bytes(const prism_http_req_t *r)
{
    if (!r->conn || r->conn->closing || r->conn->broken) return 0;
    size_t n = uv_stream_get_write_queue_size((const uv_stream_t *)&r->conn->tcp);
    /* Plus what the kernel holds unsent or unacknowledged: a send buffer autotunes to megabytes, so
     * a client that stopped reading shows up there long before libuv queues anything. */
    uv_os_fd_t fd;
    int outq = 0;
    if (uv_fileno((const uv_handle_t *)&r->conn->tcp, &fd) == 0 && ioctl(fd, SIOCOUTQ, &outq) == 0 && outq > 0)
        n += (size_t)outq;
    return n;
}

/* ------------------------------------------------------------------ connection lifecycle */

static void server_maybe_free(prism_http_server_t *s)
{
    if (s->stopping && s->listener_closed && s->resume_closed && s->n_conns == 0 && s->n_reqs == 0) prism_free(s);
}

static void on_conn_handle_closed(uv_handle_t *h)
{
    conn_t *c = h->data;
    if (--c->open_handles > 0) return;
    prism_http_server_t *s = c->srv;
    if (c->prev) c->prev->next = c->next;
    else s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->n_conns--;
    PRISM_ASSERT(c->req == NULL);
    prism_buf_free(&c->inbuf);
    prism_free(c);
    server_maybe_free(s);
}

/* ---- bodies in progress and the body budget ----
 * Every connection between its request's headers and its dispatch is on srv->bodies, oldest first.
 * When the bytes held reach max_body_bytes_total, such connections stop reading (the client's TCP
 * window closes) except the oldest, which always may finish: bodies that wait for each other would
 * otherwise wait forever. Held bytes may so pass the budget by one body plus one read per
 * connection that resumed. */

static bool body_budget_spent(const prism_http_server_t *s)
{
    return s->body_bytes >= s->cfg.max_body_bytes_total;
}

static prism_http_body_gate_t body_gate(const conn_t *c)
{
    const prism_http_server_t *s = c->srv;
    return s->cfg.body_gate && c->req ? s->cfg.body_gate(c->req, s->ud) : PRISM_HTTP_BODY_READ;
}

static void body_list_add(conn_t *c)
{
    prism_http_server_t *s = c->srv;
    PRISM_ASSERT(!c->in_body);
    c->in_body = true;
    c->bnext = NULL;
    c->bprev = s->bodies_tail;
    if (s->bodies_tail) s->bodies_tail->bnext = c;
    else s->bodies = c;
    s->bodies_tail = c;
}

static void body_list_del(conn_t *c)
{
    if (!c->in_body) return;
    prism_http_server_t *s = c->srv;
    bool was_head = s->bodies == c;
    if (c->bprev) c->bprev->bnext = c->bnext;
    else s->bodies = c->bnext;
    if (c->bnext) c->bnext->bprev = c->bprev;
    else s->bodies_tail = c->bprev;
    c->bprev = c->bnext = NULL;
    c->in_body = false;
    c->paused = false;
    if (was_head) server_resume_bodies(s);  /* the new oldest may read past the budget */
}

static void conn_update_reading(conn_t *c);
static void conn_arm_timer(conn_t *c);

static void conn_process(conn_t *c);

/* Bytes were released (or the oldest body changed): paused bodies go on, as many as the room left
 * can take one read each (at least the oldest), in arrival order. Deferred to the loop: the release
 * may happen inside a handler, which must not see another request dispatched under it. */
static void on_resume_timer(uv_timer_t *t)
{
    prism_http_server_t *s = t->data;
    if (s->stopping) return;
    for (conn_t *c = s->bodies; c; c = c->bnext)   /* bodies that gave way for one turn (on_read) */
        if (c->yielded) {
            c->yielded = false;
            conn_update_reading(c);
        }
    size_t room = s->body_bytes < s->cfg.max_body_bytes_total ? s->cfg.max_body_bytes_total - s->body_bytes : 0;
    size_t n = room / s->cfg.read_bytes + 1;
    conn_t *next;
    for (conn_t *c = s->bodies; c && n; c = next) {
        next = c->bnext;
        if (!c->paused || body_gate(c) == PRISM_HTTP_BODY_HOLD) continue;
        if (c != s->bodies && !room) break;
        conn_process(c);  /* parses what it had read, then reads again */
        conn_arm_timer(c);
        n--;
    }
}

static void server_resume_bodies(prism_http_server_t *s)
{
    if (s->stopping || s->resume_closed || !s->bodies) return;
    if (!uv_is_active((uv_handle_t *)&s->resume_timer)) uv_timer_start(&s->resume_timer, on_resume_timer, 0, 0);
}

/* This connection's body waits for room: the budget is spent and it is not the oldest (a whole
 * body needs no more budget), or the caller's gate says so (a whole body too: a small one arrives
 * in one read, before a check between reads could stop it). */
static bool conn_body_waits(const conn_t *c)
{
    if (!c->in_body || c->discard) return false;
    prism_http_body_gate_t g = body_gate(c);
    if (g == PRISM_HTTP_BODY_HOLD) return true;
    return c != c->srv->bodies && (g == PRISM_HTTP_BODY_WAIT || (!c->complete && body_budget_spent(c->srv)));
}

void prism_http_server_resume_bodies(prism_http_server_t *s)
{
    if (s) server_resume_bodies(s);
}

/* A request the handler never got is let go: the caller, told of its images, hears it once. */
static void req_body_gone(conn_t *c, prism_http_req_t *r)
{
    if (r->dispatched || !r->images_told) return;
    r->images_told = false;
    if (c->srv->cfg.body_gone) c->srv->cfg.body_gone(r, c->srv->ud);
}

/* Logical close: detach the request (firing its abort callback when its response was not complete)
 * and stop reading. Handles are closed separately (now, or after a shutdown flushes writes). */
static void conn_begin_close(conn_t *c)
{
    if (c->closing) return;
    c->closing = true;
    body_list_del(c);
    if (c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = false;
    }
    uv_timer_stop(&c->timer);
    prism_http_req_t *r = c->req;
    c->req = NULL;
    if (r) {
        r->conn = NULL;
        req_body_gone(c, r);
        if (r->dispatched && !r->done) {
            r->aborted = true;
            if (r->abort_cb) {
                void (*cb)(prism_http_req_t *, void *) = r->abort_cb;
                r->abort_cb = NULL;
                cb(r, r->abort_ud);
            }
        }
        req_unref(r);
    }
}

/* A closing connection (its answer still flushing) counts as open until here. */
static void conn_close_handles(conn_t *c)
{
    if (c->handles_closed) return;
    c->handles_closed = true;
    if (!c->rejected) __atomic_sub_fetch(&c->srv->n_active, 1, __ATOMIC_RELAXED);
    uv_close((uv_handle_t *)&c->tcp, on_conn_handle_closed);
    uv_close((uv_handle_t *)&c->timer, on_conn_handle_closed);
    uv_close((uv_handle_t *)&c->wtimer, on_conn_handle_closed);
}

static void conn_close_now(conn_t *c)
{
    conn_begin_close(c);
    conn_close_handles(c);
}

static void conn_fail(conn_t *c, int status, const char *message);

static void on_timer(uv_timer_t *t)
{
    conn_t *c = t->data;
    if (!c->broken && !c->closing && !c->discard && c->paused) {
        /* the body waited for room longer than max_pause_s: 503, then its upload is discarded */
        char msg[200];
        if (body_gate(c) == PRISM_HTTP_BODY_READ) {   /* the budget kept it */
            c->srv->refused.body_bytes_in_flight++;
            snprintf(msg, sizeof msg, "Too many request bytes in flight (limit %zu); waited %.0f s; retry shortly.",
                     c->srv->cfg.max_body_bytes_total, c->srv->cfg.max_pause_s);
        } else {
            c->srv->refused.body_gate++;
            snprintf(msg, sizeof msg, "The request waited too long for room (its upload paused %.0f s); "
                     "retry after a short wait.", c->srv->cfg.max_pause_s);
        }
        conn_fail(c, 503, msg);
        return;
    }
    if (!c->broken && !c->closing && !c->discard && c->req && !c->req->dispatched) {
        /* Bytes waiting in the kernel mean the client kept up and we did not (the loop was busy):
         * read them first, the deadline is judged again after. */
        uv_os_fd_t fd;
        int avail = 0;
        if (uv_fileno((const uv_handle_t *)&c->tcp, &fd) == 0 && ioctl(fd, FIONREAD, &avail) == 0 && avail > 0 &&
            c->reading) {
            uv_timer_start(&c->timer, on_timer, 10, 0);
            return;
        }
        /* a request that came in too slowly (slowloris): answer 408, then close */
        conn_fail(c, 408, c->headers_done ? "The request body arrived too slowly; send it faster."
                                          : "The request headers did not arrive in time.");
        return;
    }
    /* idle keep-alive timeout, the end of a linger, or a broken connection: just close */
    conn_close_now(c);
}

/* A write failed inside a respond / stream call (or the caller dropped the client). The close, and
 * with it the abort callback, must not run inside that call: the caller may go on using what its
 * abort callback frees. So the connection stops here and closes from the loop's next turn. */
static void conn_break(conn_t *c)
{
    if (c->broken || c->closing || c->handles_closed) return;
    c->broken = true;
    if (c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = false;
    }
    uv_timer_start(&c->timer, on_timer, 0, 0);
}

/* Deadline of what the connection is waiting for: the next request (idle keep-alive), the headers
 * of the current one, or its body at the minimum rate. Each body byte moves the body deadline by
 * 1/min_body_rate seconds, never more, so a trickle falls behind and times out. The body is judged
 * from the start of its rate window: its headers, or the end of its last pause. A pause is the
 * router's doing, not the client's, and so is what follows it: while we did not read, the client's
 * TCP saw a closed window and backs off its probes (seconds, growing with the pause), so after a
 * pause the client gets the grace again before its rate counts. A paused body has its own deadline
 * (max_pause_s). */
static void conn_arm_timer(conn_t *c)
{
    if (c->closing || c->handles_closed || c->discard || c->broken) return;
    prism_http_req_t *r = c->req;
    if (!r || r->dispatched) return;  /* idle: armed when the last response completed; else the handler's time */
    const prism_http_config_t *cfg = &c->srv->cfg;
    uint64_t now = uv_now(c->srv->loop), due;
    if (c->paused)
        due = c->t_paused + (uint64_t)(cfg->max_pause_s * 1000.0);
    else if (!c->headers_done)
        due = c->t_req_start + (uint64_t)(cfg->header_timeout_s * 1000.0);
    else
        due = c->t_rate + (uint64_t)(cfg->body_grace_s * 1000.0) +
              (uint64_t)(r->body_raw - c->raw_rate) * 1000u / cfg->min_body_rate;
    uv_timer_start(&c->timer, on_timer, due > now ? due - now : 0, 0);
}

/* While lingering: close once the client is quiet for a while, and never past linger_end. */
static void conn_linger_timer(conn_t *c)
{
    uint64_t now = uv_now(c->srv->loop);
    uint64_t left = c->linger_end > now ? c->linger_end - now : 0;
    uv_timer_start(&c->timer, on_timer, PRISM_MIN(left, (uint64_t)HTTP_LINGER_IDLE_MS), 0);
}

static void on_shutdown(uv_shutdown_t *sr, int status)
{
    conn_t *c = sr->data;
    c->shutdown_done = true;
    if (c->handles_closed) return;
    if (c->discard && status == 0 && !c->closing) {
        /* our error answer is flushed: let the client finish sending, read it and close */
        conn_linger_timer(c);
        return;
    }
    conn_close_now(c);
}

/* Close after queued writes reach the kernel. */
static void conn_close_graceful(conn_t *c)
{
    conn_begin_close(c);
    if (c->handles_closed) return;
    if (c->shutdown_started && !c->shutdown_done) return;  /* on_shutdown closes */
    if (!c->shutdown_started && uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > 0) {
        c->shutdown_started = true;
        c->shutdown_req.data = c;
        if (uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->tcp, on_shutdown) == 0) return;
        c->shutdown_done = true;
    }
    conn_close_handles(c);
}

/* ------------------------------------------------------------------ writing */

typedef struct {
    uv_write_t w;
    conn_t *c;
    char data[];
} wreq_t;

static size_t conn_backlog(const conn_t *c)
{
    return c->handles_closed ? 0 : uv_stream_get_write_queue_size((const uv_stream_t *)&c->tcp);
}

static void on_write_timer(uv_timer_t *t)
{
    conn_t *c = t->data;
    if (c->handles_closed || !c->w_active) return;
    conn_arm_write(c);   /* progress since it was armed moves the deadline */
    if (!c->w_active || uv_is_active((uv_handle_t *)&c->wtimer)) return;
    PRISM_DEBUG("http: the client took too few of %zu unsent answer bytes in time; closing", conn_backlog(c));
    c->srv->refused.slow_readers++;
    conn_close_now(c);
}

/* The write deadline. From the moment answer bytes wait in our queue (the kernel's send buffer is
 * full: the client does not read), the client has write_grace_s, plus 1/min_write_rate seconds per
 * byte it takes meanwhile: a trickle falls behind. Computed from bytes the kernel took, never from
 * bytes queued, so a producer that keeps writing cannot push it back. */
static void conn_arm_write(conn_t *c)
{
    if (c->handles_closed) return;
    size_t q = conn_backlog(c);
    uint64_t now = uv_now(c->srv->loop);
    if (q == 0) {
        c->w_active = false;
        uv_timer_stop(&c->wtimer);
        return;
    }
    uint64_t taken = c->w_total - q;
    if (!c->w_active) {
        c->w_active = true;
        c->w_t0 = now;
        c->w_base = taken;
    }
    const prism_http_config_t *cfg = &c->srv->cfg;
    uint64_t due = c->w_t0 + (uint64_t)(cfg->write_grace_s * 1000.0) + (taken - c->w_base) * 1000u / cfg->min_write_rate;
    if (due > now) uv_timer_start(&c->wtimer, on_write_timer, due - now, 0);
    else uv_timer_stop(&c->wtimer);   /* overdue: on_write_timer closes */
}

static void on_write(uv_write_t *w, int status)
{
    wreq_t *wr = (wreq_t *)w;
    conn_t *c = wr->c;
    prism_free(wr);
    if (status < 0 && status != UV_ECANCELED && !c->closing) {
        PRISM_DEBUG("http: write failed: %s", uv_strerror(status));
        conn_close_now(c);
        return;
    }
    if (c->handles_closed) return;
    conn_arm_write(c);
    if (c->write_blocked && conn_backlog(c) <= c->srv->cfg.max_pipeline_bytes) {
        c->write_blocked = false;
        conn_process(c);   /* the next pipelined request may go */
    }
}

/* Queues head + body + tail as one write (copied: callers' buffers are theirs). A failure breaks the
 * connection (a response with a hole is worthless) but never closes it from inside this call. */
static int conn_write(conn_t *c, const void *head, size_t hl, const void *body, size_t bl, const void *tail,
                      size_t tl)
{
    if (c->closing || c->handles_closed || c->shutdown_started || c->broken) return PRISM_EIO;
    size_t total = hl + bl + tl;
    if (total == 0) return PRISM_OK;
    wreq_t *wr = prism_malloc(sizeof *wr + total);
    if (!wr) {
        conn_break(c);
        return PRISM_ENOMEM;
    }
    wr->c = c;
    if (hl) memcpy(wr->data, head, hl);
    if (bl) memcpy(wr->data + hl, body, bl);
    if (tl) memcpy(wr->data + hl + bl, tail, tl);
    uv_buf_t buf = uv_buf_init(wr->data, (unsigned)total);
    int rc = uv_write(&wr->w, (uv_stream_t *)&c->tcp, &buf, 1, on_write);
    if (rc) {
        prism_free(wr);
        PRISM_DEBUG("http: uv_write: %s", uv_strerror(rc));
        conn_break(c);
        return PRISM_EIO;
    }
    c->w_total += total;
    if (!c->w_active) conn_arm_write(c);   /* a running deadline is not pushed back by more bytes */
    return PRISM_OK;
}

static int build_head(prism_buf_t *h, int status, const char *content_type, const char *extra, bool chunked,
                      bool has_length, size_t len, bool keep_alive)
{
    int rc = prism_buf_appendf(h, "HTTP/1.1 %d %s\r\n", status, prism_http_status_text(status));
    if (!rc && content_type) rc = prism_buf_appendf(h, "Content-Type: %s\r\n", content_type);
    if (!rc && chunked) rc = prism_buf_append_str(h, "Transfer-Encoding: chunked\r\n");
    if (!rc && has_length) rc = prism_buf_appendf(h, "Content-Length: %zu\r\n", len);
    if (!rc) rc = prism_buf_append_str(h, keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n");
    if (!rc && extra && *extra) {
        size_t el = strlen(extra);
        rc = prism_buf_append(h, extra, el);
        if (!rc && (el < 2 || extra[el - 2] != '\r' || extra[el - 1] != '\n')) rc = prism_buf_append(h, "\r\n", 2);
    }
    if (!rc) rc = prism_buf_append(h, "\r\n", 2);
    return rc;
}

/* Answer a request-level failure the handler never saw, then linger and close. */
static void conn_fail(conn_t *c, int status, const char *message)
{
    if (c->closing || c->discard) return;
    PRISM_DEBUG("http: answering %d and closing: %s", status, message);
    c->discard = true;
    body_list_del(c);
    if (c->req) {
        PRISM_ASSERT(!c->req->dispatched);
        req_body_gone(c, c->req);
        req_unref(c->req);
        c->req = NULL;
    }
    prism_buf_t body = {0}, head = {0};
    int rc = prism_oai_write_error(&body, prism_oai_error_type(status), message, NULL, NULL);
    if (!rc) rc = build_head(&head, status, "application/json", status == 503 ? "Retry-After: 1\r\n" : NULL, false, true,
                             body.len, false);
    if (!rc) rc = conn_write(c, head.data, head.len, body.data, body.len, NULL, 0);
    prism_buf_free(&body);
    prism_buf_free(&head);
    if (c->closing || c->handles_closed) return;
    if (rc) {  /* parsing, not inside a respond call: closing now is safe */
        conn_close_now(c);
        return;
    }
    /* A connection over max_connections does not count as open: it may not linger long. */
    c->linger_end = uv_now(c->srv->loop) + (c->rejected ? HTTP_LINGER_REJECTED_MS : HTTP_LINGER_MAX_MS);
    conn_linger_timer(c);
    c->shutdown_started = true;
    c->shutdown_req.data = c;
    if (uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->tcp, on_shutdown) != 0) {
        c->shutdown_done = true;
        conn_close_now(c);
    }
}

/* ------------------------------------------------------------------ responses */

static int req_can_respond(prism_http_req_t *r)
{
    if (!r) return PRISM_EINVAL;
    if (r->aborted) return PRISM_EIO;
    if (r->started || r->done) return PRISM_EINVAL;
    if (!r->conn || r->conn->closing || r->conn->broken) return PRISM_EIO;
    return PRISM_OK;
}

void prism_http_req_drop(prism_http_req_t *r)
{
    if (r && r->conn && !r->done) conn_break(r->conn);
}

/* Response fully queued: move on to the next pipelined request or close. */
static void req_complete(prism_http_req_t *r)
{
    conn_t *c = r->conn;
    r->done = true;
    if (!c) return;
    if (!r->keep_alive || c->srv->stopping || c->srv->draining) {
        conn_close_graceful(c);
        return;
    }
    c->req = NULL;
    r->conn = NULL;
    req_unref(r);
    uv_timer_start(&c->timer, on_timer, (uint64_t)(c->srv->cfg.idle_timeout_s * 1000.0), 0);
    conn_process(c);
}

int prism_http_respond(prism_http_req_t *r, int status, const char *content_type, const char *extra_headers,
                       const void *body, size_t len)
{
    int rc = req_can_respond(r);
    if (rc) return rc;
    conn_t *c = r->conn;
    prism_buf_t head = {0};
    bool ka = r->keep_alive && !c->srv->stopping && !c->srv->draining;
    rc = build_head(&head, status, content_type, extra_headers, false, true, len, ka);
    if (rc) goto fail;
    r->started = true;
    rc = conn_write(c, head.data, head.len, r->is_head ? NULL : body, r->is_head ? 0 : len, NULL, 0);
    if (rc) goto fail;
    prism_buf_free(&head);
    req_complete(r);
    return PRISM_OK;
fail:
    prism_buf_free(&head);
    return rc;
}

int prism_http_respond_error(prism_http_req_t *r, int status, const char *type, const char *message,
                             const char *param, const char *code, const char *extra_headers)
{
    int rc = req_can_respond(r);
    if (rc) return rc;
    prism_buf_t body = {0};
    rc = prism_oai_write_error(&body, type, message, param, code);
    if (!rc) rc = prism_http_respond(r, status, "application/json", extra_headers, body.data, body.len);
    prism_buf_free(&body);
    return rc;
}

int prism_http_stream_begin(prism_http_req_t *r, int status, const char *content_type, const char *extra_headers)
{
    int rc = req_can_respond(r);
    if (rc) return rc;
    conn_t *c = r->conn;
    /* HTTP/1.0 has no chunked encoding: send raw bytes and mark the end by closing. */
    r->chunked_out = !(r->http_major == 1 && r->http_minor == 0);
    if (!r->chunked_out) r->keep_alive = false;
    bool ka = r->keep_alive && !c->srv->stopping && !c->srv->draining;
    prism_buf_t head = {0};
    rc = build_head(&head, status, content_type, extra_headers, r->chunked_out, false, 0, ka);
    if (!rc) {
        r->started = true;
        r->streaming = true;
        rc = conn_write(c, head.data, head.len, NULL, 0, NULL, 0);
    }
    prism_buf_free(&head);
    return rc;
}

int prism_http_stream_write(prism_http_req_t *r, const void *data, size_t len)
{
    if (!r) return PRISM_EINVAL;
    if (r->aborted) return PRISM_EIO;
    if (!r->streaming || r->done) return PRISM_EINVAL;
    if (!r->conn || r->conn->closing || r->conn->broken) return PRISM_EIO;
    if (len == 0 || r->is_head) return PRISM_OK;
    if (!r->chunked_out) return conn_write(r->conn, data, len, NULL, 0, NULL, 0);
    char hex[24];
    int hl = snprintf(hex, sizeof hex, "%zx\r\n", len);
    return conn_write(r->conn, hex, (size_t)hl, data, len, "\r\n", 2);
}

int prism_http_stream_end(prism_http_req_t *r)
{
    if (!r) return PRISM_EINVAL;
    if (r->aborted) return PRISM_EIO;
    if (!r->streaming || r->done) return PRISM_EINVAL;
    if (!r->conn || r->conn->closing || r->conn->broken) return PRISM_EIO;
    if (r->chunked_out && !r->is_head) {
        int rc = conn_write(r->conn, "0\r\n\r\n", 5, NULL, 0, NULL, 0);
        if (rc) return rc;
    }
    req_complete(r);
    return PRISM_OK;
}

/* ------------------------------------------------------------------ parsing (llhttp callbacks) */

static int hdr_account(conn_t *c, size_t n)
{
    c->hdr_bytes += n;
    if (c->hdr_bytes > c->srv->cfg.max_header_bytes) {
        c->fail_status = 431;
        return -1;
    }
    return 0;
}

static int on_message_begin(llhttp_t *p)
{
    conn_t *c = p->data;
    PRISM_ASSERT(c->req == NULL);
    c->req = req_new();
    c->hdr_bytes = 0;
    c->ext_bytes = 0;
    c->headers_done = false;
    c->fail_msg[0] = 0;
    c->t_req_start = uv_now(c->srv->loop);
    if (!c->req) {
        c->fail_status = 500;
        return -1;
    }
    c->req->conn = c;
    c->req->id = ++c->srv->next_req_id;
    c->req->conn_id = c->id;
    c->req->t_begin = prism_now_s();
    return 0;
}

static int on_url(llhttp_t *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    if (hdr_account(c, len)) return -1;
    if (prism_buf_append(&c->req->url, at, len)) {
        c->fail_status = 500;
        return -1;
    }
    return 0;
}

static int on_header_field(llhttp_t *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    prism_http_req_t *r = c->req;
    if (hdr_account(c, len + 4)) return -1;  /* + ": " and CRLF, roughly what the client sent */
    if (!r->in_field) {
        if (r->n_hdr >= HTTP_MAX_HEADERS) {
            c->fail_status = 431;
            return -1;
        }
        if (r->n_hdr == r->cap_hdr) {
            int cap = r->cap_hdr ? r->cap_hdr * 2 : 16;
            hdr_ent_t *e = prism_realloc(r->hents, (size_t)cap * sizeof *e);
            if (!e) goto oom;
            r->hents = e;
            r->cap_hdr = cap;
        }
        r->hents[r->n_hdr].name_off = (uint32_t)r->hdrs.len;
        r->in_field = true;
    }
    if (prism_buf_append(&r->hdrs, at, len)) goto oom;
    return 0;
oom:
    c->fail_status = 500;
    return -1;
}

static int on_header_field_complete(llhttp_t *p)
{
    conn_t *c = p->data;
    prism_http_req_t *r = c->req;
    if (!r->in_field) return 0;
    /* the buffer always ends with a NUL, but appending one makes it part of the data */
    if (prism_buf_append(&r->hdrs, "", 1)) goto oom;
    r->hents[r->n_hdr].value_off = (uint32_t)r->hdrs.len;
    return 0;
oom:
    c->fail_status = 500;
    return -1;
}

static int on_header_value(llhttp_t *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    if (hdr_account(c, len)) return -1;
    /* obs-fold: llhttp hands a header line continued on the next ("X: a\r\n b") to us as a second
     * piece of the value starting right after the line break (leading whitespace of a value is
     * skipped, so no other piece starts with it there). RFC 9112 5.2: a server rejects it (400). */
    char before = at > c->exec_start ? at[-1] : c->exec_prev;
    if (len && (at[0] == ' ' || at[0] == '\t') && before == '\n') {
        c->fail_status = 400;
        snprintf(c->fail_msg, sizeof c->fail_msg, "Malformed HTTP request: a header line continued on the next "
                 "(obs-fold).");
        return -1;
    }
    if (prism_buf_append(&c->req->hdrs, at, len)) {
        c->fail_status = 500;
        return -1;
    }
    return 0;
}

static int on_header_value_complete(llhttp_t *p)
{
    conn_t *c = p->data;
    prism_http_req_t *r = c->req;
    if (!r->in_field) return 0;
    if (prism_buf_append(&r->hdrs, "", 1)) {
        c->fail_status = 500;
        return -1;
    }
    r->in_field = false;
    r->n_hdr++;
    return 0;
}

/* ---- strict framing and the caller's request rules (http_server.h) ---- */

bool prism_http_host_is_loopback(const char *host)
{
    if (!host) return false;
    if (!strcasecmp(host, "localhost") || !strcmp(host, "::1") || !strcmp(host, "[::1]")) return true;
    unsigned a, b, cc, d;
    char tail;
    return sscanf(host, "%u.%u.%u.%u%c", &a, &b, &cc, &d, &tail) == 4 && a == 127 && b < 256 && cc < 256 && d < 256;
}

/* The name in a Host header value, without the port ("[::1]:8000" -> "::1"): into out. */
static void host_name(const char *v, char *out, size_t n)
{
    while (*v == ' ' || *v == '\t') v++;
    size_t len;
    if (*v == '[') {
        const char *e = strchr(v, ']');
        v++;
        len = e ? (size_t)(e - v) : strlen(v);
    } else {
        const char *e = strchr(v, ':');
        len = e && !strchr(e + 1, ':') ? (size_t)(e - v) : strlen(v);   /* a bare IPv6 address has no port */
    }
    while (len && (v[len - 1] == ' ' || v[len - 1] == '\t')) len--;
    snprintf(out, n, "%.*s", (int)PRISM_MIN(len, n - 1), v);
}

/* Whether name is in the comma-separated list (entries may carry brackets or a port, ignored). */
static bool host_listed(const char *list, const char *name)
{
    for (const char *p = list; *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        char entry[256], want[256];
        snprintf(entry, sizeof entry, "%.*s", (int)PRISM_MIN(len, sizeof entry - 1), p);
        host_name(entry, want, sizeof want);
        if (want[0] && !strcasecmp(want, name)) return true;
        p += len;
        if (*p == ',') p++;
    }
    return false;
}

static bool media_type_is(const char *v, const char *type)
{
    while (*v == ' ' || *v == '\t') v++;
    size_t n = strlen(type);
    return !strncasecmp(v, type, n) && (v[n] == 0 || v[n] == ';' || v[n] == ' ' || v[n] == '\t');
}

/* Returns 0, or the status to refuse the request with (c->fail_msg filled). */
static int check_framing(conn_t *c, const prism_http_req_t *r)
{
    const prism_http_config_t *cfg = &c->srv->cfg;
    int n_host = 0, n_te = 0;
    const char *host = NULL;
    for (int i = 0; i < r->n_hdr; i++) {
        const char *name = r->hdrs.data + r->hents[i].name_off, *value = r->hdrs.data + r->hents[i].value_off;
        if (!strcasecmp(name, "host")) {
            n_host++;
            host = value;
        } else if (!strcasecmp(name, "transfer-encoding")) {
            /* llhttp reads "gzip, chunked" as chunked and ignores the gzip: refuse what we do not do */
            n_te++;
            const char *v = value;
            while (*v == ' ' || *v == '\t') v++;
            size_t len = strlen(v);
            while (len && (v[len - 1] == ' ' || v[len - 1] == '\t')) len--;
            if (len != 7 || strncasecmp(v, "chunked", 7)) {
                snprintf(c->fail_msg, sizeof c->fail_msg, "Unsupported Transfer-Encoding '%.64s': only chunked is.", v);
                return 400;
            }
        }
    }
    if (n_te > 1) {
        snprintf(c->fail_msg, sizeof c->fail_msg, "Malformed HTTP request: several Transfer-Encoding headers.");
        return 400;
    }
    if (n_host > 1 || (n_host == 0 && cfg->require_host && r->http_major == 1 && r->http_minor >= 1)) {
        snprintf(c->fail_msg, sizeof c->fail_msg, "Malformed HTTP request: %s Host header.",
                 n_host ? "more than one" : "no");
        return 400;
    }
    if (cfg->allowed_hosts && *cfg->allowed_hosts && strcmp(cfg->allowed_hosts, "*")) {
        char name[256] = "";
        if (host) host_name(host, name, sizeof name);
        if (!host_listed(cfg->allowed_hosts, name) && strcasecmp(name, cfg->host)) {
            c->srv->refused.host++;
            snprintf(c->fail_msg, sizeof c->fail_msg, "Host '%.64s' is not allowed here (the server's "
                     "--allowed-hosts).", name);
            return 403;
        }
    }
    return 0;
}

/* After the caller's on_headers (a client without the API key learns nothing more than 401). */
static int check_media_type(conn_t *c, const prism_http_req_t *r)
{
    if (!c->srv->cfg.require_json || strcmp(r->method, "POST")) return 0;
    const char *ct = prism_http_req_header(r, "content-type");
    if (ct && media_type_is(ct, "application/json")) return 0;
    snprintf(c->fail_msg, sizeof c->fail_msg, "Send the body as JSON with 'Content-Type: application/json' "
             "(got '%.64s').", ct ? ct : "none");
    c->srv->refused.malformed++;
    return 415;
}

static int on_headers_complete(llhttp_t *p)
{
    conn_t *c = p->data;
    prism_http_req_t *r = c->req;
    const prism_http_config_t *cfg = &c->srv->cfg;
    snprintf(r->method, sizeof r->method, "%s", llhttp_method_name((llhttp_method_t)llhttp_get_method(p)));
    r->http_major = llhttp_get_http_major(p);
    r->http_minor = llhttp_get_http_minor(p);
    r->keep_alive = llhttp_should_keep_alive(p) != 0;
    r->is_head = llhttp_get_method(p) == HTTP_HEAD;
    if (r->url.data) {
        r->path = r->url.data;
        char *q = memchr(r->url.data, '?', r->url.len);
        if (q) {
            *q = '\0';
            r->query = q + 1;
        }
    }
    bool has_cl = (p->flags & F_CONTENT_LENGTH) != 0;
    c->headers_done = true;
    c->t_rate = uv_now(c->srv->loop);
    c->raw_rate = 0;
    r->srv = c->srv;
    r->srv->n_reqs++;
    r->declared_len = has_cl ? p->content_length : 0;
    int st = check_framing(c, r);
    if (st) {
        if (st != 403) c->srv->refused.malformed++;
        c->fail_status = st;
        return -1;
    }
    /* Refusals that need no body (an API key check) come before anything else is spent on it. */
    if (cfg->on_headers) {
        st = cfg->on_headers(r, c->srv->ud, c->fail_msg, sizeof c->fail_msg);
        if (st) {
            c->fail_status = st;
            return -1;
        }
        c->fail_msg[0] = 0;
    }
    if ((st = check_media_type(c, r))) {
        c->fail_status = st;
        return -1;
    }
    if (has_cl && p->content_length > cfg->max_body_bytes) {   /* after the key: no limit told to a stranger */
        c->fail_status = 413;
        return -1;
    }
    /* Bodies held at once: one that could never fit is refused from the header; any other waits for
     * room (see body_list_add). Nothing is charged until bytes arrive (on_body), so declaring a large
     * body and trickling it locks no one out. */
    if (has_cl && p->content_length > cfg->max_body_bytes_total) {
        c->fail_status = 503;
        return -1;
    }
    const char *expect = prism_http_req_header(r, "Expect");
    if (expect) {
        if (strcasecmp(expect, "100-continue") != 0) {
            c->fail_status = 417;
            return -1;
        }
        bool body_expected = (has_cl && p->content_length > 0) || (p->flags & F_CHUNKED);
        if (r->http_minor >= 1 && body_expected) {
            static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
            if (conn_write(c, cont, sizeof cont - 1, NULL, 0, NULL, 0)) return -1;
        }
    }
    if ((has_cl && p->content_length > 0) || (p->flags & F_CHUNKED)) {
        if (cfg->lift_data_urls) {
            r->lift = prism_malloc(sizeof *r->lift);
            if (!r->lift) {
                c->fail_status = 500;
                return -1;
            }
            prism_lift_init(r->lift, r->declared_len, cfg->max_body_bytes);
        }
        body_list_add(c);
        if (conn_body_waits(c)) {  /* not one body byte parsed until there is room */
            c->hold = true;
            return HPE_PAUSED;
        }
    }
    return 0;
}

/* image_check: asks about each lifted image as its bytes arrive, each time they have doubled since
 * the last ask (so the header probes of one image cost O(its bytes) in all), once its string has
 * ended, or once it is known to be bad, until the caller answers. image_done: then tells each whole
 * image that passed, once. Images arrive one after another: only the last one can still grow.
 * Returns 0, or the caller's HTTP status (c->fail_msg filled). */
#define LIFT_FIRST_ASK 64   /* bytes: a PNG's IHDR, most of a JPEG's SOI and APP0 */
static int lift_check_images(conn_t *c, prism_http_req_t *r)
{
    const prism_http_config_t *cfg = &c->srv->cfg;
    const prism_lift_t *l = r->lift;
    while (cfg->image_check && r->img_asked < l->n) {
        const prism_lift_image_t *im = &l->img[r->img_asked];
        if (!im->done && !im->bad && im->len < PRISM_MAX(r->img_ask_at, (size_t)LIFT_FIRST_ASK)) break;
        c->fail_msg[0] = 0;
        int v = cfg->image_check(r, im->ordinal, im->mime, im->data, im->len, im->bad, im->done, c->fail_msg,
                                 sizeof c->fail_msg, c->srv->ud);
        if (v >= 400) {
            if (!c->fail_msg[0]) snprintf(c->fail_msg, sizeof c->fail_msg, "Image %d was refused.", im->ordinal);
            return v;
        }
        c->fail_msg[0] = 0;
        if (v == PRISM_HTTP_IMAGE_MORE && !im->done && !im->bad) {
            r->img_ask_at = 2 * im->len;
            break;
        }
        r->img_asked++;   /* answered, or whole: the handler's own checks have the last word */
        r->img_ask_at = 0;
    }
    int passed = cfg->image_check ? r->img_asked : l->n;
    while (cfg->image_done && r->img_told < passed && l->img[r->img_told].done) {
        const prism_lift_image_t *im = &l->img[r->img_told++];
        if (im->bad || !im->len) continue;
        r->images_told = true;
        cfg->image_done(r, im->ordinal, im->data, im->len, c->srv->ud);
    }
    return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    prism_http_req_t *r = c->req;
    if (r->body_raw + len > c->srv->cfg.max_body_bytes) {
        c->fail_status = 413;
        return -1;
    }
    r->body_raw += len;
    if (r->lift) {
        /* the skeleton grows as prism_buf does; the images as body_lift.h says */
        int rc = prism_lift_feed(r->lift, &r->body, at, len);
        body_recharge(r);
        if (rc) {
            c->fail_status = 500;
            return -1;
        }
        int st = lift_check_images(c, r);
        if (st) {
            c->fail_status = st;
            return -1;
        }
        return 0;
    }
    size_t need = r->body.len + len;
    if (need + 1 > r->body.cap) {
        /* Grow as bytes arrive and charge the buffer's capacity: doubling from a small start, never
         * past the declared length (+1 for the NUL prism_http_req_body promises). */
        size_t cap = PRISM_MAX(r->body.cap * 2, (size_t)HTTP_BODY_MIN_CAP);
        while (cap < need + 1) cap *= 2;
        if (r->declared_len && cap > r->declared_len + 1) cap = (size_t)r->declared_len + 1;
        PRISM_ASSERT(cap >= need + 1 && r->body_charged == r->body.cap);
        char *d = prism_realloc(r->body.data, cap);
        if (!d) {
            c->fail_status = 500;
            return -1;
        }
        r->body.data = d;
        r->body.cap = cap;
        body_recharge(r);
    }
    memcpy(r->body.data + r->body.len, at, len);
    r->body.len = need;
    r->body.data[need] = 0;
    return 0;
}

/* Chunk extensions ("1a;name=value") are metadata like headers: bounded by the same budget. */
static int on_chunk_extension(llhttp_t *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    (void)at;
    c->ext_bytes += len;
    if (c->ext_bytes > c->srv->cfg.max_header_bytes) {
        c->fail_status = 400;
        snprintf(c->fail_msg, sizeof c->fail_msg, "Chunk extensions exceed %zu bytes.", c->srv->cfg.max_header_bytes);
        return -1;
    }
    return 0;
}

static int on_message_complete(llhttp_t *p)
{
    conn_t *c = p->data;
    /* No protocol upgrades (Connection: Upgrade, CONNECT): the request is answered, then the
     * connection closes; the bytes after it are never parsed. */
    if (p->upgrade && c->req) c->req->keep_alive = false;
    if (c->req && c->req->lift) {
        int rc = prism_lift_finish(c->req->lift, &c->req->body);
        body_recharge(c->req);
        if (rc) {
            c->fail_status = 500;
            return -1;
        }
    }
    return HPE_PAUSED;  /* hand the request over before parsing any pipelined bytes */
}

/* ------------------------------------------------------------------ reading / processing */

static void conn_dispatch(conn_t *c)
{
    prism_http_req_t *r = c->req;
    PRISM_ASSERT(r && !r->dispatched);
    r->dispatched = true;
    r->refs++;  /* the caller's reference */
    body_list_del(c);
    uv_timer_stop(&c->timer);
    c->srv->fn(r, c->srv->ud);
}

static void conn_process(conn_t *c)
{
    if (c->in_process) return;  /* a synchronous response inside the handler: the outer loop goes on */
    c->in_process = true;
    for (;;) {
        if (c->closing || c->discard) break;
        if (c->req && c->req->dispatched) break;  /* one request at a time */
        if (!c->req && conn_backlog(c) > c->srv->cfg.max_pipeline_bytes) {
            c->write_blocked = true;               /* the client does not read its answers: on_write resumes */
            break;
        }
        if (conn_body_waits(c)) break;            /* its bytes stay unparsed until there is room */
        if (c->complete) {
            c->complete = false;
            conn_dispatch(c);
            continue;
        }
        size_t avail = c->inbuf.len - c->in_off;
        if (avail == 0) break;
        const char *start = c->inbuf.data + c->in_off;
        c->exec_start = start;
        llhttp_errno_t e = llhttp_execute(&c->parser, start, avail);
        if (e == HPE_OK) {
            c->in_off += avail;
            c->exec_prev = start[avail - 1];
        } else if (e == HPE_PAUSED || e == HPE_PAUSED_UPGRADE) {
            const char *pos = llhttp_get_error_pos(&c->parser);
            c->in_off += (size_t)(pos - start);
            if (pos > start) c->exec_prev = pos[-1];
            if (e == HPE_PAUSED) llhttp_resume(&c->parser);
            else llhttp_resume_after_upgrade(&c->parser);
            if (c->hold) {  /* on_headers_complete: the body waits for room (checked above) */
                c->hold = false;
                continue;
            }
            if (!c->req || c->req->dispatched) {
                /* bytes after an upgrade request (on_message_complete made it the last one) */
                c->srv->refused.malformed++;
                conn_fail(c, 400, "Malformed HTTP request.");
                break;
            }
            if (c->parser.upgrade) c->req->keep_alive = false;
            c->complete = true;   /* dispatched above, once the gate lets it */
        } else {
            int status = c->fail_status ? c->fail_status : 400;
            char msg[256];
            const prism_http_config_t *cfg = &c->srv->cfg;
            if (c->fail_msg[0]) {
                conn_fail(c, status, c->fail_msg);
                break;
            }
            switch (status) {
            case 413: snprintf(msg, sizeof msg, "Request body too large: the limit is %zu bytes.", cfg->max_body_bytes); break;
            case 431: snprintf(msg, sizeof msg, "Request header fields too large: the limit is %zu bytes.", cfg->max_header_bytes); break;
            case 417: snprintf(msg, sizeof msg, "Unsupported Expect header; only 100-continue is supported."); break;
            case 500: snprintf(msg, sizeof msg, "Out of memory while reading the request."); break;
            case 503: snprintf(msg, sizeof msg, "Too many request bytes in flight (limit %zu); retry shortly.",
                               cfg->max_body_bytes_total); break;
            default:
                snprintf(msg, sizeof msg, "Malformed HTTP request: %s", llhttp_get_error_reason(&c->parser));
                break;
            }
            prism_http_refusals_t *rf = &c->srv->refused;
            if (status == 413) rf->body_too_large++;
            else if (status == 503) rf->body_bytes_in_flight++;
            else if (status == 400 || status == 431 || status == 417) rf->malformed++;
            conn_fail(c, status, msg);
            break;
        }
    }
    if (c->in_off > 0) {
        size_t rest = c->inbuf.len - c->in_off;
        if (rest) memmove(c->inbuf.data, c->inbuf.data + c->in_off, rest);
        c->inbuf.len = rest;
        c->in_off = 0;
    }
    if (c->inbuf.len == 0) prism_buf_free(&c->inbuf);   /* an idle connection holds no buffer */
    c->in_process = false;
    conn_update_reading(c);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    conn_t *c = h->data;
    *buf = uv_buf_init(c->srv->scratch, (unsigned)c->srv->cfg.read_bytes);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    conn_t *c = st->data;
    if (nread == 0) return;
    if (nread < 0) {
        /* EOF or error. A client that goes away mid-response aborts the request (as uvicorn does). */
        if (nread == UV_EOF) conn_close_graceful(c);
        else conn_close_now(c);
        return;
    }
    if (c->closing) return;
    if (c->discard) {
        c->discarded += (size_t)nread;
        if (c->discarded > c->srv->cfg.max_body_bytes + c->srv->cfg.max_header_bytes) conn_close_now(c);
        else conn_linger_timer(c);  /* still sending: keep lingering (up to linger_end) */
        return;
    }
    if (prism_buf_append(&c->inbuf, buf->base, (size_t)nread)) {
        conn_close_now(c);
        return;
    }
    conn_process(c);
    conn_arm_timer(c);
    /* A body that filled the whole read has more waiting: libuv would read it again and again (up
     * to 32 reads) in this turn; with many uploads at once that is megabytes of body work between
     * two turns of everything else on the loop (a text request's bytes, the control socket). One
     * read per body and turn: it reads on at the next turn (on_resume_timer). */
    if (c->in_body && c->reading && !c->closing && (size_t)nread == c->srv->cfg.read_bytes) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = false;
        c->yielded = true;
        server_resume_bodies(c->srv);
    }
}

static void conn_update_reading(conn_t *c)
{
    if (c->closing || c->handles_closed || c->broken || c->yielded) return;
    bool want = c->discard || (c->inbuf.len - c->in_off) < c->srv->cfg.max_pipeline_bytes;
    if (!c->discard && c->in_body) {
        /* the body budget (spent: only the oldest body in progress reads on) and the caller's gate */
        bool wait = conn_body_waits(c);
        if (wait && !c->paused) {
            __atomic_fetch_add(&c->srv->pauses, 1, __ATOMIC_RELAXED);
            c->paused = true;
            c->t_paused = uv_now(c->srv->loop);
        } else if (!wait && c->paused) {
            /* the pause and the client's way back from it do not count against the body's
             * minimum rate: a new rate window (conn_arm_timer) */
            c->paused = false;
            c->t_rate = uv_now(c->srv->loop);
            c->raw_rate = c->req ? c->req->body_raw : 0;
        }
        if (wait) want = false;
    }
    if (want && !c->reading) {
        if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) == 0) c->reading = true;
    } else if (!want && c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = false;
    }
}

/* ------------------------------------------------------------------ server */

prism_http_config_t prism_http_config_default(void)
{
    prism_http_config_t c = {0};
    c.host = "127.0.0.1";
    c.port = 8000;
    c.max_header_bytes = 64 * 1024;
    c.max_body_bytes = 64u * 1024 * 1024;
    c.max_body_bytes_total = (size_t)1 << 30;
    c.max_connections = 1024;
    c.idle_timeout_s = 60.0;
    c.header_timeout_s = 30.0;
    c.min_body_rate = 8 * 1024;
    c.body_grace_s = 10.0;
    c.max_pause_s = 120.0;
    c.write_grace_s = 10.0;
    c.min_write_rate = 32 * 1024;
    c.require_host = true;
    return c;
}

size_t prism_http_conn_bytes(const prism_http_config_t *cfg_in)
{
    prism_http_config_t def = prism_http_config_default(), c = *cfg_in;
    if (!c.max_header_bytes) c.max_header_bytes = def.max_header_bytes;
    if (!c.max_pipeline_bytes) c.max_pipeline_bytes = c.max_header_bytes + HTTP_READ_CHUNK;
    if (!c.read_bytes || c.read_bytes > HTTP_READ_CHUNK) c.read_bytes = HTTP_READ_CHUNK;
    /* the request line and headers are copied as they are parsed (buffers growing by doubling);
     * unparsed bytes wait in inbuf: less than max_pipeline_bytes, plus one read */
    return sizeof(conn_t) + sizeof(prism_http_req_t) + sizeof(prism_lift_t) + HTTP_MAX_HEADERS * sizeof(hdr_ent_t) +
           2 * c.max_header_bytes + 2 * (c.max_pipeline_bytes + c.read_bytes);
}

static void on_listener_closed(uv_handle_t *h);
static void on_resume_closed(uv_handle_t *h);

static void on_connection(uv_stream_t *l, int status)
{
    prism_http_server_t *s = l->data;
    if (status < 0) {
        PRISM_WARN("http: accept: %s", uv_strerror(status));
        return;
    }
    conn_t *c = prism_calloc(1, sizeof *c);
    if (!c) {
        PRISM_ERROR("http: out of memory accepting a connection");
        return;
    }
    c->srv = s;
    c->id = ++s->next_conn_id;
    uv_tcp_init(s->loop, &c->tcp);
    uv_timer_init(s->loop, &c->timer);
    uv_timer_init(s->loop, &c->wtimer);
    c->tcp.data = c;
    c->timer.data = c;
    c->wtimer.data = c;
    c->open_handles = 3;
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->n_conns++;
    llhttp_init(&c->parser, HTTP_REQUEST, &s->settings);
    c->parser.data = c;
    c->rejected = __atomic_load_n(&s->n_active, __ATOMIC_RELAXED) >= (size_t)s->cfg.max_connections;
    if (!c->rejected) __atomic_add_fetch(&s->n_active, 1, __ATOMIC_RELAXED);
    if (uv_accept(l, (uv_stream_t *)&c->tcp) != 0) {
        conn_close_now(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    if (c->rejected) {
        PRISM_WARN("http: connection limit (%d) reached; answering 503", s->cfg.max_connections);
        s->refused.connections++;
        conn_fail(c, 503, "Too many connections; try again later.");
        conn_update_reading(c);
        return;
    }
    uv_timer_start(&c->timer, on_timer, (uint64_t)(s->cfg.idle_timeout_s * 1000.0), 0);
    conn_update_reading(c);
}

int prism_http_server_start(uv_loop_t *loop, const prism_http_config_t *cfg_in, prism_http_handler_fn fn,
                            void *ud, prism_http_server_t **out)
{
    PRISM_ASSERT(loop && cfg_in && fn && out);
    prism_http_config_t def = prism_http_config_default();
    prism_http_server_t *s = prism_calloc(1, sizeof *s);
    if (!s) return PRISM_ENOMEM;
    s->loop = loop;
    s->fn = fn;
    s->ud = ud;
    s->cfg = *cfg_in;
    if (!s->cfg.host) s->cfg.host = def.host;
    if (!s->cfg.max_header_bytes) s->cfg.max_header_bytes = def.max_header_bytes;
    if (!s->cfg.max_body_bytes) s->cfg.max_body_bytes = def.max_body_bytes;
    if (!s->cfg.max_body_bytes_total) s->cfg.max_body_bytes_total = def.max_body_bytes_total;
    if (s->cfg.max_connections <= 0) s->cfg.max_connections = def.max_connections;
    if (s->cfg.idle_timeout_s <= 0) s->cfg.idle_timeout_s = def.idle_timeout_s;
    if (s->cfg.header_timeout_s <= 0) s->cfg.header_timeout_s = def.header_timeout_s;
    if (!s->cfg.min_body_rate) s->cfg.min_body_rate = def.min_body_rate;
    if (s->cfg.body_grace_s <= 0) s->cfg.body_grace_s = def.body_grace_s;
    if (!(s->cfg.max_pause_s > 0)) s->cfg.max_pause_s = def.max_pause_s;
    if (!(s->cfg.write_grace_s > 0)) s->cfg.write_grace_s = def.write_grace_s;
    if (!s->cfg.min_write_rate) s->cfg.min_write_rate = def.min_write_rate;
    if (!s->cfg.max_pipeline_bytes) s->cfg.max_pipeline_bytes = s->cfg.max_header_bytes + HTTP_READ_CHUNK;
    if (!s->cfg.read_bytes || s->cfg.read_bytes > HTTP_READ_CHUNK) s->cfg.read_bytes = HTTP_READ_CHUNK;

    llhttp_settings_init(&s->settings);
    s->settings.on_message_begin = on_message_begin;
    s->settings.on_url = on_url;
    s->settings.on_header_field = on_header_field;
    s->settings.on_header_field_complete = on_header_field_complete;
    s->settings.on_header_value = on_header_value;
    s->settings.on_header_value_complete = on_header_value_complete;
    s->settings.on_headers_complete = on_headers_complete;
    s->settings.on_body = on_body;
    s->settings.on_chunk_extension_name = on_chunk_extension;
    s->settings.on_chunk_extension_value = on_chunk_extension;
    s->settings.on_message_complete = on_message_complete;

    union {
        struct sockaddr sa;
        struct sockaddr_in in4;
        struct sockaddr_in6 in6;
    } addr;
    int rc = strchr(s->cfg.host, ':') ? uv_ip6_addr(s->cfg.host, s->cfg.port, &addr.in6)
                                      : uv_ip4_addr(s->cfg.host, s->cfg.port, &addr.in4);
    if (rc) {
        PRISM_ERROR("http: bad listen address '%s': %s", s->cfg.host, uv_strerror(rc));
        prism_free(s);
        return PRISM_EINVAL;
    }
    uv_tcp_init(loop, &s->listener);
    s->listener.data = s;
    uv_timer_init(loop, &s->resume_timer);
    s->resume_timer.data = s;
    rc = uv_tcp_bind(&s->listener, &addr.sa, 0);
    if (!rc) rc = uv_listen((uv_stream_t *)&s->listener, 511, on_connection);
    if (rc) {
        PRISM_ERROR("http: cannot listen on %s:%d: %s", s->cfg.host, s->cfg.port, uv_strerror(rc));
        /* the handle memory must live until its close callback, which frees s */
        s->stopping = s->listener_closing = true;
        uv_close((uv_handle_t *)&s->resume_timer, on_resume_closed);
        uv_close((uv_handle_t *)&s->listener, on_listener_closed);
        *out = NULL;
        return PRISM_EIO;
    }
    struct sockaddr_storage bound;
    int blen = sizeof bound;
    if (uv_tcp_getsockname(&s->listener, (struct sockaddr *)&bound, &blen) == 0) {
        s->port = bound.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                                              : ntohs(((struct sockaddr_in *)&bound)->sin_port);
    }
    PRISM_INFO("http: listening on %s:%d", s->cfg.host, s->port);
    *out = s;
    return PRISM_OK;
}

static void on_resume_closed(uv_handle_t *h)
{
    prism_http_server_t *s = h->data;
    s->resume_closed = true;
    server_maybe_free(s);
}

static void on_listener_closed(uv_handle_t *h)
{
    prism_http_server_t *s = h->data;
    s->listener_closed = true;
    server_maybe_free(s);
}

void prism_http_server_drain(prism_http_server_t *s)
{
    if (!s || s->stopping || s->draining) return;
    s->draining = s->listener_closing = true;
    uv_close((uv_handle_t *)&s->listener, on_listener_closed);
    /* Idle keep-alive connections have nothing to finish; the others end after their response. */
    for (conn_t *c = s->conns; c; c = c->next)
        if (!c->req && c->inbuf.len == c->in_off && !c->closing) conn_close_now(c);
}

void prism_http_server_stop(prism_http_server_t *s)
{
    if (!s || s->stopping) return;
    s->stopping = true;
    uv_close((uv_handle_t *)&s->resume_timer, on_resume_closed);
    if (!s->listener_closing) uv_close((uv_handle_t *)&s->listener, on_listener_closed);
    s->listener_closing = true;
    /* conn_close_now may run abort callbacks, which must not free other connections: they are
     * freed only from close callbacks, so walking the list here is safe. */
    for (conn_t *c = s->conns; c; c = c->next) conn_close_now(c);
}

int prism_http_server_port(const prism_http_server_t *s) { return s->port; }

void prism_http_server_refusals(const prism_http_server_t *s, prism_http_refusals_t *out) { *out = s->refused; }

size_t prism_http_server_active_connections(const prism_http_server_t *s)
{
    return __atomic_load_n(&s->n_active, __ATOMIC_RELAXED);
}

uint64_t prism_http_server_pauses(const prism_http_server_t *s) { return __atomic_load_n(&s->pauses, __ATOMIC_RELAXED); }

size_t prism_http_server_body_bytes(const prism_http_server_t *s)
{
    return __atomic_load_n(&s->body_bytes, __ATOMIC_RELAXED);
}
