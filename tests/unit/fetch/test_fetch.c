/* The image fetcher (router/fetch.h) on a libuv loop against an HTTP/1.1 server this test runs on the
 * same loop (127.0.0.1, allowed by --allowed-media-networks where a test needs it): bytes as they
 * arrive and whole, limits (declared and actual size, redirects, stalls, slow and endless bodies, a
 * Content-Length lie, connect timeout, queue), the loopback refusal with no connection made, one
 * download for concurrent requests, the URL cache (no-store, max-age, TTL, LRU), pause and resume,
 * cancellation, callbacks that call back in, file:// through the loop, and closing with downloads in
 * flight. TLS, HTTP/2 and the default rules on real addresses: tests/integration/test_fetch.py. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fetch.h"

#include <xxhash.h>

/* ---- the test server ---- */

enum { R_IMG, R_NOLEN, R_404, R_REDIR, R_CHAIN, R_NOSTORE, R_MAXAGE0, R_MAXAGE1, R_BIG, R_LIE, R_ENDLESS, R_STALL,
       R_SLOW, R_NOLOC, R_N };
static const char *route_names[R_N] = {"/img", "/nolen", "/404", "/redir", "/chain", "/nostore", "/maxage0",
                                       "/maxage1", "/big", "/lie", "/endless", "/stall", "/slow", "/noloc"};

typedef struct srv srv_t;
typedef struct conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    srv_t *s;
    char req[8192];
    size_t rlen;
    bool answered, closing;
    uint64_t left;        /* body bytes still to send (UINT64_MAX: endless) */
    uint64_t off;         /* body offset of the next byte */
    uint64_t rate;        /* bytes per 100 ms when dripping, 0: as fast as writes complete */
    int writes;           /* writes in flight */
    int handles;          /* open handles (tcp, timer) */
    struct conn *prev, *next;
} conn_t;

struct srv {
    uv_loop_t *loop;
    uv_tcp_t listener;
    int port;
    int accepted, open;
    conn_t *conns;
    int hits[R_N];
    uint64_t body_sent;
};

static uint8_t pattern(uint64_t i) { return (uint8_t)((i * 2654435761u) >> 13 ^ i); }

/* Both handles of a connection close; the last close frees it (libuv finishes closes in no
 * promised order). */
static void handle_closed(uv_handle_t *h)
{
    conn_t *c = h->data;
    if (--c->handles == 0) {
        if (c->prev) c->prev->next = c->next;
        else c->s->conns = c->next;
        if (c->next) c->next->prev = c->prev;
        free(c);
    }
}

static void conn_close(conn_t *c)
{
    if (c->closing) return;
    c->closing = true;
    uv_timer_stop(&c->timer);
    uv_close((uv_handle_t *)&c->tcp, handle_closed);
    uv_close((uv_handle_t *)&c->timer, handle_closed);
    c->s->open--;
}

static void pump_body(conn_t *c);

static void on_written(uv_write_t *w, int status)
{
    conn_t *c = w->data;
    free(w);
    c->writes--;
    if (status < 0) {
        conn_close(c);
        return;
    }
    if (!c->closing && !c->rate) pump_body(c);
    if (!c->closing && c->left == 0 && c->writes == 0) conn_close(c);
}

static void send_bytes(conn_t *c, const void *p, size_t n)
{
    uv_write_t *w = malloc(sizeof *w + n);
    memcpy(w + 1, p, n);
    uv_buf_t b = uv_buf_init((char *)(w + 1), (unsigned)n);
    w->data = c;
    c->writes++;
    if (uv_write(w, (uv_stream_t *)&c->tcp, &b, 1, on_written) < 0) {
        free(w);
        c->writes--;
        conn_close(c);
    }
}

static void send_body_chunk(conn_t *c, uint64_t want)
{
    uint64_t n = PRISM_MIN(want, c->left);
    if (n == 0) return;
    uint8_t *buf = malloc(n);
    for (uint64_t i = 0; i < n; i++) buf[i] = pattern(c->off + i);
    send_bytes(c, buf, n);
    free(buf);
    c->off += n;
    c->s->body_sent += n;
    if (c->left != UINT64_MAX) c->left -= n;
}

static void pump_body(conn_t *c)
{
    if (c->writes == 0 && c->left > 0) send_body_chunk(c, 64 << 10);
}

static void on_drip(uv_timer_t *t)
{
    conn_t *c = t->data;
    if (c->closing) return;
    send_body_chunk(c, c->rate);
    if (c->left == 0) uv_timer_stop(t);
}

static uint64_t param(const char *path, const char *name, uint64_t dflt)
{
    char key[32];
    snprintf(key, sizeof key, "%s=", name);
    const char *q = strchr(path, '?');
    for (const char *p = q; p && (p = strstr(p, key));) {
        if (p[-1] == '?' || p[-1] == '&') return strtoull(p + strlen(key), NULL, 10);
        p++;
    }
    return dflt;
}

static void answer(conn_t *c, const char *path)
{
    srv_t *s = c->s;
    int r = -1;
    for (int i = 0; i < R_N; i++) {
        size_t n = strlen(route_names[i]);
        if (!strncmp(path, route_names[i], n) && (path[n] == 0 || path[n] == '?')) r = i;
    }
    char hdr[1024];
    uint64_t n = param(path, "n", 1000);
    if (r >= 0) s->hits[r]++;
    switch (r) {
    case R_IMG:
    case R_NOSTORE:
    case R_MAXAGE0:
    case R_MAXAGE1:
        snprintf(hdr, sizeof hdr, "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: image/jpeg\r\n%s"
                 "Content-Length: %llu\r\n\r\n",
                 r == R_NOSTORE ? "Cache-Control: public, no-store\r\n" : r == R_MAXAGE0 ? "Cache-Control: max-age=0\r\n"
                 : r == R_MAXAGE1 ? "cache-control: max-age=1\r\n" : "", (unsigned long long)n);
        c->left = n;
        break;
    case R_NOLEN:
        snprintf(hdr, sizeof hdr, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
        c->left = n;
        break;
    case R_BIG:
        snprintf(hdr, sizeof hdr, "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1000000000\r\n\r\n");
        c->left = UINT64_MAX;   /* it would send: the client must not read it */
        break;
    case R_LIE:
        snprintf(hdr, sizeof hdr, "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %llu\r\n\r\n",
                 (unsigned long long)param(path, "cl", 100000));
        c->left = n;
        break;
    case R_ENDLESS:
        snprintf(hdr, sizeof hdr, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
        c->left = UINT64_MAX;
        break;
    case R_SLOW:
        if (param(path, "nolen", 0)) snprintf(hdr, sizeof hdr, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
        else snprintf(hdr, sizeof hdr, "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %llu\r\n\r\n",
                      (unsigned long long)n);
        c->left = n;
        c->rate = PRISM_MAX(param(path, "rate", 1000) / 10, 1);
        break;
    case R_STALL:
        return;   /* says nothing, ever */
    case R_REDIR: {
        const char *to = strstr(path, "to=");
        snprintf(hdr, sizeof hdr, "HTTP/1.1 %d Found\r\nConnection: close\r\nLocation: %s\r\nContent-Length: 5\r\n\r\nmoved",
                 (int)param(path, "code", 302), to ? to + 3 : "/img");
        c->left = 0;
        break;
    }
    case R_CHAIN: {
        uint64_t k = param(path, "k", 0);
        if (k == 0) snprintf(hdr, sizeof hdr, "HTTP/1.1 301 Moved\r\nConnection: close\r\nLocation: /img?n=%llu\r\n\r\n",
                             (unsigned long long)n);
        else snprintf(hdr, sizeof hdr, "HTTP/1.1 307 Moved\r\nConnection: close\r\nLocation: chain?k=%llu&n=%llu\r\n\r\n",
                      (unsigned long long)(k - 1), (unsigned long long)n);
        c->left = 0;
        break;
    }
    case R_NOLOC:
        snprintf(hdr, sizeof hdr, "HTTP/1.1 302 Found\r\nConnection: close\r\n\r\n");
        c->left = 0;
        break;
    default:
        snprintf(hdr, sizeof hdr, "HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 9\r\n\r\nnot found");
        c->left = 0;
        break;
    }
    send_bytes(c, hdr, strlen(hdr));
    if (c->rate) uv_timer_start(&c->timer, on_drip, 100, 100);
    else pump_body(c);
}

static void on_alloc(uv_handle_t *h, size_t sz, uv_buf_t *b)
{
    conn_t *c = h->data;
    b->base = c->req + c->rlen;
    b->len = sizeof c->req - c->rlen - 1;
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *b)
{
    conn_t *c = st->data;
    if (n < 0) {
        conn_close(c);
        return;
    }
    c->rlen += (size_t)n;
    c->req[c->rlen] = 0;
    if (!c->answered && strstr(c->req, "\r\n\r\n")) {
        c->answered = true;
        char path[4096] = "";
        sscanf(c->req, "GET %4095s", path);
        answer(c, path);
    }
    if (c->rlen >= sizeof c->req - 1) c->rlen = 0;
}

static void on_conn(uv_stream_t *l, int status)
{
    srv_t *s = l->data;
    conn_t *c = calloc(1, sizeof *c);
    c->s = s;
    uv_tcp_init(s->loop, &c->tcp);
    uv_timer_init(s->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->handles = 2;
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->open++;
    if (uv_accept(l, (uv_stream_t *)&c->tcp) != 0) {
        conn_close(c);
        return;
    }
    s->accepted++;
    uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

static void srv_start(srv_t *s, uv_loop_t *loop)
{
    memset(s, 0, sizeof *s);
    s->loop = loop;
    uv_tcp_init(loop, &s->listener);
    s->listener.data = s;
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", 0, &a);
    assert_int_equal(uv_tcp_bind(&s->listener, (struct sockaddr *)&a, 0), 0);
    assert_int_equal(uv_listen((uv_stream_t *)&s->listener, 128, on_conn), 0);
    struct sockaddr_in got;
    int len = sizeof got;
    uv_tcp_getsockname(&s->listener, (struct sockaddr *)&got, &len);
    s->port = ntohs(got.sin_port);
}

/* ---- harness ---- */

typedef struct {
    int done;
    prism_fetch_reason_t reason;
    int http_status, redirects, http_version;
    bool cache_hit, joined;
    prism_fetch_blob_t *blob;
    int data_calls;
    size_t data_len;          /* len of the last on_data */
    size_t first_len;         /* len of the first on_data */
    int64_t declared;
    /* behaviour */
    int action_at_first;      /* what on_data answers on its first call */
    prism_fetch_req_t *q;
    prism_fetch_t *f;
    char restart_url[256];    /* on_done starts this (re-entrancy) */
    struct rec *restarted;
} rec_t;

static uv_loop_t loop;
static srv_t S;
static prism_fetch_t *F;
static char url_buf[512];

static const char *U(const char *fmt, ...)
{
    va_list ap;
    char path[400];
    va_start(ap, fmt);
    vsnprintf(path, sizeof path, fmt, ap);
    va_end(ap);
    snprintf(url_buf, sizeof url_buf, "http://127.0.0.1:%d%s", S.port, path);
    return url_buf;
}

static int on_data(prism_fetch_req_t *q, const uint8_t *p, size_t n, int64_t declared, void *ud)
{
    rec_t *r = ud;
    assert_true(n >= r->data_len);
    for (size_t i = r->data_len; i < n; i++)
        if (p[i] != pattern(i)) fail_msg("byte %zu: %u, expected %u", i, p[i], pattern(i));
    r->data_calls++;
    if (r->data_calls == 1) r->first_len = n;
    r->data_len = n;
    r->declared = declared;
    if (r->data_calls == 1) return r->action_at_first;
    return PRISM_FETCH_CONTINUE;
}

static void on_done(prism_fetch_req_t *q, const prism_fetch_result_t *res, void *ud);

static prism_fetch_cb_t CB = {on_data, on_done, NULL};

static void start(rec_t *r, const char *url)
{
    prism_fetch_cb_t cb = CB;
    cb.ud = r;
    r->f = F;
    assert_int_equal(prism_fetch_start(F, url, strlen(url), &cb, &r->q), PRISM_OK);
}

static void on_done(prism_fetch_req_t *q, const prism_fetch_result_t *res, void *ud)
{
    rec_t *r = ud;
    assert_ptr_equal(q, r->q);
    assert_int_equal(r->done, 0);
    r->done = 1;
    r->reason = res->reason;
    r->http_status = res->http_status;
    r->redirects = res->redirects;
    r->http_version = res->http_version;
    r->cache_hit = res->cache_hit;
    r->joined = res->joined;
    assert_non_null(res->message);
    if (res->reason == PRISM_FETCH_OK) {
        assert_non_null(res->blob);
        r->blob = prism_fetch_blob_ref(res->blob);
        size_t len = prism_fetch_blob_len(r->blob);
        const uint8_t *d = prism_fetch_blob_data(r->blob);
        for (size_t i = 0; i < len; i++)
            if (d[i] != pattern(i)) fail_msg("blob byte %zu differs", i);
    } else {
        assert_null(res->blob);
    }
    if (r->restart_url[0]) start((rec_t *)r->restarted, r->restart_url);   /* from inside on_done */
}

static void rec_free(rec_t *r)
{
    if (r->blob) prism_fetch_blob_unref(r->blob);
    r->blob = NULL;
}

static void on_tick(uv_timer_t *t) { (void)t; }

/* Runs the loop until cond(arg) or timeout_s; false on timeout. */
static bool run_until(bool (*cond)(void *), void *arg, double timeout_s)
{
    uv_timer_t tick;
    uv_timer_init(&loop, &tick);
    uv_timer_start(&tick, on_tick, 5, 5);
    double end = prism_now_s() + timeout_s;
    bool ok;
    while (!(ok = cond(arg)) && prism_now_s() < end) uv_run(&loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&tick, NULL);
    uv_run(&loop, UV_RUN_NOWAIT);
    return ok;
}

static bool is_done(void *a) { return ((rec_t *)a)->done; }
static bool server_idle(void *a) { (void)a; return S.open == 0; }
static bool is_called(void *a) { return ((rec_t *)a)->data_calls > 0; }
static bool never(void *a) { (void)a; return false; }
static void run_for(double s) { run_until(never, NULL, s); }

typedef struct {
    rec_t *r;
    int n;
} recs_t;
static bool all_done(void *a)
{
    recs_t *rs = a;
    for (int i = 0; i < rs->n; i++)
        if (!rs->r[i].done) return false;
    return true;
}

static void wait_done(rec_t *r, double s)
{
    if (!run_until(is_done, r, s)) fail_msg("no answer within %.1f s", s);
}

static prism_fetch_config_t base_config(void)
{
    prism_fetch_config_t c;
    prism_fetch_config_default(&c);
    c.allowed_networks.items[0] = "127.0.0.1/32";
    c.allowed_networks.n = 1;
    c.timeout_s = 10;
    return c;
}

static void open_fetcher(const prism_fetch_config_t *c)
{
    char why[256];
    if (prism_fetch_open(&loop, c, &F, why, sizeof why) != PRISM_OK) fail_msg("open: %s", why);
}

static bool closed_flag;
static void on_closed(void *ud) { *(bool *)ud = true; }
static bool is_true(void *a) { return *(bool *)a; }

static void close_fetcher(void)
{
    closed_flag = false;
    prism_fetch_close(F, on_closed, &closed_flag);
    assert_true(run_until(is_true, &closed_flag, 5));
    F = NULL;
}

static int setup(void **state)
{
    (void)state;
    uv_loop_init(&loop);
    srv_start(&S, &loop);
    prism_fetch_config_t c = base_config();
    open_fetcher(&c);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (F) close_fetcher();
    for (conn_t *c = S.conns; c; c = c->next) conn_close(c);
    uv_close((uv_handle_t *)&S.listener, NULL);
    while (uv_run(&loop, UV_RUN_NOWAIT)) {}
    assert_int_equal(uv_loop_close(&loop), 0);
    return 0;
}

static void reopen(prism_fetch_config_t *c)
{
    close_fetcher();
    open_fetcher(c);
}

/* ---- tests ---- */

static void test_fetch_ok(void **state)
{
    (void)state;
    rec_t r = {0};
    start(&r, U("/img?n=300000"));
    wait_done(&r, 5);
    assert_int_equal(r.reason, PRISM_FETCH_OK);
    assert_int_equal(r.http_status, 200);
    assert_int_equal(r.http_version, 1);
    assert_int_equal(prism_fetch_blob_len(r.blob), 300000);
    assert_true(r.data_calls >= 1);
    assert_int_equal(r.data_len, 300000);
    assert_int_equal(r.declared, 300000);
    assert_false(r.cache_hit);
    rec_free(&r);
    /* a body without Content-Length grows its buffer as it comes */
    rec_t n = {0};
    start(&n, U("/nolen?n=1000000"));
    wait_done(&n, 5);
    assert_int_equal(n.reason, PRISM_FETCH_OK);
    assert_int_equal(n.declared, -1);
    assert_int_equal(prism_fetch_blob_len(n.blob), 1000000);
    rec_free(&n);
    /* an empty body is an empty image (the caller's header check refuses it) */
    rec_t z = {0};
    start(&z, U("/img?n=0"));
    wait_done(&z, 5);
    assert_int_equal(z.reason, PRISM_FETCH_OK);
    assert_int_equal(prism_fetch_blob_len(z.blob), 0);
    assert_int_equal(z.data_calls, 0);
    rec_free(&z);
    const prism_fetch_metrics_t *m = prism_fetch_metrics(F);
    assert_int_equal(m->downloads, 3);
    assert_int_equal(m->downloads_ok, 3);
    assert_int_equal(m->bytes, 1300000);
    assert_int_equal(m->seconds.count, 3);
    prism_buf_t b = {0};
    prism_fetch_metrics_write(F, &b);
    assert_non_null(strstr(b.data, "prism:image_fetch_downloads_total{} 3\n"));
    assert_non_null(strstr(b.data, "prism:image_fetch_refused_total{reason=\"loopback\"} 0\n"));
    assert_non_null(strstr(b.data, "prism:image_fetch_seconds_count{} 3\n"));
    prism_buf_free(&b);
}

static void test_http_errors(void **state)
{
    (void)state;
    rec_t r = {0};
    start(&r, U("/nothing-here"));
    wait_done(&r, 5);
    assert_int_equal(r.reason, PRISM_FETCH_HTTP_STATUS);
    assert_int_equal(r.http_status, 404);
    assert_int_equal(r.data_calls, 0);   /* the error page's body is nobody's image */
    /* a redirect without a Location */
    rec_t n = {0};
    start(&n, U("/noloc"));
    wait_done(&n, 5);
    assert_int_equal(n.reason, PRISM_FETCH_REDIRECTS);
    assert_int_equal(prism_fetch_metrics(F)->refused[PRISM_FETCH_HTTP_STATUS], 1);
    assert_int_equal(prism_fetch_metrics(F)->refused[PRISM_FETCH_REDIRECTS], 1);
}

static void test_redirects(void **state)
{
    (void)state;
    rec_t r = {0};
    start(&r, U("/chain?k=2&n=5000"));   /* chain?k=1, chain?k=0, img: three redirects */
    wait_done(&r, 5);
    assert_int_equal(r.reason, PRISM_FETCH_OK);
    assert_int_equal(r.redirects, 3);
    assert_int_equal(prism_fetch_blob_len(r.blob), 5000);
    rec_free(&r);
    rec_t t = {0};
    start(&t, U("/chain?k=3&n=5000"));   /* four: one too many (max 3) */
    wait_done(&t, 5);
    assert_int_equal(t.reason, PRISM_FETCH_REDIRECTS);
    assert_int_equal(S.hits[R_IMG], 1);  /* the too-long chain never reached the image */
    /* each hop is checked like the first URL: a scheme, then an address the first URL could not use */
    rec_t f = {0};
    start(&f, U("/redir?to=file:///etc/passwd"));
    wait_done(&f, 5);
    assert_int_equal(f.reason, PRISM_FETCH_SCHEME);
    rec_t g = {0};
    start(&g, U("/redir?to=gopher://127.0.0.1:%d/x", S.port));
    wait_done(&g, 5);
    assert_int_equal(g.reason, PRISM_FETCH_SCHEME);
    int accepted = S.accepted;
    rec_t l = {0};
    char to[128];
    snprintf(to, sizeof to, "/redir?code=308&to=http://127.0.0.2:%d/img", S.port);
    start(&l, U("%s", to));
    wait_done(&l, 5);
    /* refused by the address rule (127.0.0.2 is not allowed), not by a failed connection: the server
     * listens on 127.0.0.1 only, so a connection attempt would have been refused as "connect" */
    assert_int_equal(l.reason, PRISM_FETCH_ADDR_LOOPBACK);
    assert_int_equal(S.accepted, accepted + 1);   /* only the redirect itself */
    assert_int_equal(prism_fetch_metrics(F)->redirects, 7);   /* 3, 3 (the fourth refused), 127.0.0.2 */
}

static void test_loopback_refused_by_default(void **state)
{
    (void)state;
    prism_fetch_config_t c;
    prism_fetch_config_default(&c);   /* no allowed networks */
    reopen(&c);
    const char *urls[] = {U("/img"), "http://localhost:1/img", "http://[::1]:1/img", "http://127.1:1/img",
                          "http://2130706433:1/img", "http://0x7f.0.0.1:1/img", "http://[::ffff:127.0.0.1]:1/img",
                          "http://0.0.0.0:1/img"};
    char first[256];
    snprintf(first, sizeof first, "%s", urls[0]);
    urls[0] = first;
    rec_t r[8] = {{0}};
    for (int i = 0; i < 8; i++) start(&r[i], urls[i]);
    recs_t rs = {r, 8};
    assert_true(run_until(all_done, &rs, 10));
    for (int i = 0; i < 8; i++) {
        prism_fetch_reason_t want = i == 7 ? PRISM_FETCH_ADDR_UNSPECIFIED : PRISM_FETCH_ADDR_LOOPBACK;
        if (r[i].reason != want)
            fail_msg("%s: %s, expected %s", urls[i], prism_fetch_reason_names[r[i].reason], prism_fetch_reason_names[want]);
    }
    assert_int_equal(S.accepted, 0);   /* no connection was ever opened */
    assert_int_equal(prism_fetch_metrics(F)->refused[PRISM_FETCH_ADDR_LOOPBACK], 7);
}

static void test_size_limits(void **state)
{
    (void)state;
    prism_fetch_config_t c = base_config();
    c.max_bytes = 1 << 20;
    reopen(&c);
    /* a Content-Length beyond the limit: refused from the headers, no body byte read */
    rec_t big = {0};
    start(&big, U("/big"));
    wait_done(&big, 5);
    assert_int_equal(big.reason, PRISM_FETCH_TOO_LARGE_DECLARED);
    assert_int_equal(big.data_calls, 0);
    assert_int_equal(prism_fetch_metrics(F)->bytes, 0);
    /* an endless body: cut off at the limit */
    rec_t e = {0};
    start(&e, U("/endless"));
    wait_done(&e, 5);
    assert_int_equal(e.reason, PRISM_FETCH_TOO_LARGE);
    assert_true(e.data_len <= (1u << 20));
    assert_true(prism_fetch_metrics(F)->bytes <= (1u << 20));
    /* exactly the limit is fine; one more byte (undeclared) is not */
    rec_t x = {0}, y = {0};
    start(&x, U("/nolen?n=%d", 1 << 20));
    start(&y, U("/nolen?n=%d", (1 << 20) + 1));
    wait_done(&x, 5);
    wait_done(&y, 5);
    assert_int_equal(x.reason, PRISM_FETCH_OK);
    assert_int_equal(y.reason, PRISM_FETCH_TOO_LARGE);
    rec_free(&x);
    /* a Content-Length lie: declared 100000, 1000 sent, then the connection closes */
    rec_t l = {0};
    start(&l, U("/lie?n=1000&cl=100000"));
    wait_done(&l, 5);
    assert_int_equal(l.reason, PRISM_FETCH_TRUNCATED);
    /* ... and the other way: declared 1000, more sent: only the declared bytes are read */
    rec_t m = {0};
    start(&m, U("/lie?n=500000&cl=1000"));
    wait_done(&m, 5);
    assert_int_equal(m.reason, PRISM_FETCH_OK);
    assert_int_equal(prism_fetch_blob_len(m.blob), 1000);
    rec_free(&m);
}

static void test_stall_and_slow(void **state)
{
    (void)state;
    prism_fetch_config_t c = base_config();
    c.min_rate = 20000;
    c.min_rate_window_s = 1;
    c.timeout_s = 5;
    reopen(&c);
    rec_t st = {0}, sl = {0}, ok = {0};
    double t0 = prism_now_s();
    start(&st, U("/stall"));
    start(&sl, U("/slow?n=100000&rate=2000"));        /* 2 KB/s: below 20 KB/s */
    start(&ok, U("/slow?n=120000&rate=100000"));      /* 100 KB/s: fine */
    wait_done(&st, 6);
    wait_done(&sl, 6);
    wait_done(&ok, 6);
    assert_int_equal(st.reason, PRISM_FETCH_TOO_SLOW);
    assert_int_equal(sl.reason, PRISM_FETCH_TOO_SLOW);
    assert_true(sl.data_calls >= 1);                   /* it did get bytes, too few */
    assert_int_equal(ok.reason, PRISM_FETCH_OK);
    assert_true(prism_now_s() - t0 < 4.5);   /* the minimum rate, not the total timeout, ended them */
    rec_free(&ok);
    /* without a minimum rate the total timeout ends a stall */
    c.min_rate = 0;
    c.timeout_s = 1;
    reopen(&c);
    rec_t t = {0};
    t0 = prism_now_s();
    start(&t, U("/stall"));
    wait_done(&t, 5);
    assert_int_equal(t.reason, PRISM_FETCH_TIMEOUT);
    assert_true(prism_now_s() - t0 >= 0.9);
}

static void test_connect_timeout(void **state)
{
    (void)state;
    /* a listener whose accept queue is full drops new SYNs: the connection never completes */
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    assert_int_equal(bind(l, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(l, 0), 0);
    socklen_t al = sizeof a;
    getsockname(l, (struct sockaddr *)&a, &al);
    int fill[4];
    for (int i = 0; i < 4; i++) {
        fill[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        connect(fill[i], (struct sockaddr *)&a, sizeof a);
    }
    usleep(100000);
    prism_fetch_config_t c = base_config();
    c.connect_timeout_s = 0.5;
    c.min_rate = 0;
    reopen(&c);
    rec_t r = {0};
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/img", ntohs(a.sin_port));
    double t0 = prism_now_s();
    start(&r, url);
    wait_done(&r, 5);
    assert_int_equal(r.reason, PRISM_FETCH_CONNECT_TIMEOUT);
    assert_true(prism_now_s() - t0 < 3);
    for (int i = 0; i < 4; i++) close(fill[i]);
    close(l);
    /* nobody listening: refused at once */
    rec_t n = {0};
    start(&n, "http://127.0.0.1:1/img");
    wait_done(&n, 5);
    assert_int_equal(n.reason, PRISM_FETCH_CONNECT);
    /* a name that does not resolve */
    prism_fetch_config_t d;
    prism_fetch_config_default(&d);
    reopen(&d);
    rec_t x = {0};
    start(&x, "http://no-such-host.invalid/img");
    wait_done(&x, 10);
    assert_int_equal(x.reason, PRISM_FETCH_DNS);
}

static void test_dedup(void **state)
{
    (void)state;
    enum { N = 16 };
    rec_t r[N] = {{0}};
    for (int i = 0; i < N; i++) start(&r[i], U("/slow?n=50000&rate=500000"));
    recs_t rs = {r, N};
    assert_true(run_until(all_done, &rs, 10));
    int joined = 0;
    for (int i = 0; i < N; i++) {
        assert_int_equal(r[i].reason, PRISM_FETCH_OK);
        assert_int_equal(r[i].data_len, 50000);
        assert_ptr_equal(r[i].blob, r[0].blob);   /* one buffer for all: no copy each */
        joined += r[i].joined;
    }
    assert_int_equal(joined, N - 1);
    assert_int_equal(S.hits[R_SLOW], 1);
    assert_int_equal(prism_fetch_metrics(F)->downloads, 1);
    assert_int_equal(prism_fetch_metrics(F)->joined, N - 1);
    for (int i = 0; i < N; i++) rec_free(&r[i]);
    /* a request that joins late gets what has arrived in one call, then the rest */
    rec_t a = {0}, b = {0};
    start(&a, U("/slow?n=40000&rate=20000"));
    run_for(0.5);
    assert_true(a.data_len > 0 && a.data_len < 40000);
    size_t a_at_join = a.data_len;
    start(&b, U("/slow?n=40000&rate=20000"));
    assert_int_equal(b.data_calls, 0);          /* never from inside prism_fetch_start */
    run_until(is_called, &b, 5);
    assert_true(b.first_len >= a_at_join);      /* everything there so far, in its first call */
    wait_done(&a, 10);
    wait_done(&b, 10);
    assert_true(b.joined);
    assert_int_equal(S.hits[R_SLOW], 2);
    rec_free(&a);
    rec_free(&b);
}

static void test_cache(void **state)
{
    (void)state;
    rec_t a = {0}, b = {0};
    start(&a, U("/img?n=7000#one"));
    wait_done(&a, 5);
    start(&b, U("/img?n=7000#two"));    /* another fragment: the same download */
    wait_done(&b, 5);
    assert_true(b.cache_hit);
    assert_int_equal(b.data_calls, 1);
    assert_int_equal(b.data_len, 7000);
    assert_int_equal(S.hits[R_IMG], 1);
    assert_int_equal(prism_fetch_metrics(F)->cache_hits, 1);
    assert_int_equal(prism_fetch_metrics(F)->cache_entries_used, 1);
    assert_int_equal(prism_fetch_metrics(F)->cache_bytes_used, 7000);
    rec_free(&a);
    rec_free(&b);
    /* no-store and max-age=0: fetched every time */
    for (int i = 0; i < 2; i++) {
        rec_t n = {0}, z = {0};
        start(&n, U("/nostore?n=100"));
        start(&z, U("/maxage0?n=100"));
        wait_done(&n, 5);
        wait_done(&z, 5);
        assert_false(n.cache_hit);
        assert_false(z.cache_hit);
        rec_free(&n);
        rec_free(&z);
    }
    assert_int_equal(S.hits[R_NOSTORE], 2);
    assert_int_equal(S.hits[R_MAXAGE0], 2);
    /* max-age=1: kept for one second */
    rec_t m1 = {0}, m2 = {0}, m3 = {0};
    start(&m1, U("/maxage1?n=100"));
    wait_done(&m1, 5);
    start(&m2, U("/maxage1?n=100"));
    wait_done(&m2, 5);
    assert_true(m2.cache_hit);
    run_for(1.1);
    start(&m3, U("/maxage1?n=100"));
    wait_done(&m3, 5);
    assert_false(m3.cache_hit);
    assert_int_equal(S.hits[R_MAXAGE1], 2);
    rec_free(&m1);
    rec_free(&m2);
    rec_free(&m3);
    /* failures are not cached */
    rec_t e1 = {0}, e2 = {0};
    start(&e1, U("/missing"));
    wait_done(&e1, 5);
    start(&e2, U("/missing"));
    wait_done(&e2, 5);
    assert_false(e2.cache_hit);
    assert_int_equal(e2.reason, PRISM_FETCH_HTTP_STATUS);
}

static void test_cache_budget(void **state)
{
    (void)state;
    prism_fetch_config_t c = base_config();
    c.cache_bytes = 25000;
    c.cache_entries = 2;
    reopen(&c);
    rec_t r[4] = {{0}};
    start(&r[0], U("/img?n=10000&a=1"));
    wait_done(&r[0], 5);
    start(&r[1], U("/img?n=10000&a=2"));
    wait_done(&r[1], 5);
    start(&r[2], U("/img?n=10000&a=1"));   /* a hit: a=1 becomes the most recent */
    wait_done(&r[2], 5);
    assert_true(r[2].cache_hit);
    start(&r[3], U("/img?n=10000&a=3"));   /* evicts a=2, the least recently used */
    wait_done(&r[3], 5);
    const prism_fetch_metrics_t *m = prism_fetch_metrics(F);
    assert_int_equal(m->cache_entries_used, 2);
    assert_true(m->cache_bytes_used <= 25000);
    for (int i = 0; i < 4; i++) rec_free(&r[i]);
    rec_t h = {0}, g = {0};
    start(&h, U("/img?n=10000&a=1"));
    wait_done(&h, 5);
    assert_true(h.cache_hit);
    start(&g, U("/img?n=10000&a=2"));
    wait_done(&g, 5);
    assert_false(g.cache_hit);
    rec_free(&h);
    rec_free(&g);
    /* an image larger than the whole budget is not kept */
    rec_t b1 = {0}, b2 = {0};
    start(&b1, U("/img?n=30000"));
    wait_done(&b1, 5);
    start(&b2, U("/img?n=30000"));
    wait_done(&b2, 5);
    assert_false(b2.cache_hit);
    rec_free(&b1);
    rec_free(&b2);
    /* the blob outlives its eviction for whoever holds it */
    assert_true(prism_fetch_metrics(F)->held_bytes <= 25000);
}

static void test_pause_resume(void **state)
{
    (void)state;
    prism_fetch_config_t c = base_config();
    c.min_rate = 100000;           /* a paused download is not "too slow" */
    c.min_rate_window_s = 1;
    c.max_bytes = 64 << 20;
    reopen(&c);
    rec_t r = {0};
    r.action_at_first = PRISM_FETCH_PAUSE;
    start(&r, U("/img?n=%d", 32 << 20));
    run_for(1.5);
    assert_int_equal(r.data_calls, 1);       /* nothing after the pause */
    assert_true(r.data_len < (32u << 20));
    assert_int_equal(r.done, 0);
    assert_true(prism_fetch_metrics(F)->pauses >= 1);
    /* the server is held back by TCP (socket buffers are a few MiB): it could not send everything */
    assert_true(S.body_sent < (32u << 20));
    prism_fetch_resume(r.q);
    wait_done(&r, 20);
    assert_int_equal(r.reason, PRISM_FETCH_OK);
    assert_int_equal(prism_fetch_blob_len(r.blob), 32u << 20);
    rec_free(&r);
    /* pause and resume from outside the callback, while bytes flow */
    rec_t s = {0};
    start(&s, U("/slow?n=200000&rate=200000"));
    run_for(0.35);
    prism_fetch_pause(s.q);
    run_for(0.1);                       /* what libcurl had in hand may still come */
    int calls = s.data_calls;
    run_for(0.6);
    assert_int_equal(s.data_calls, calls);
    prism_fetch_resume(s.q);
    wait_done(&s, 5);
    assert_int_equal(s.reason, PRISM_FETCH_OK);
    rec_free(&s);
    /* with two requests on one download, it waits for the paused one */
    rec_t a = {0}, b = {0};
    a.action_at_first = PRISM_FETCH_PAUSE;
    start(&a, U("/img?n=%d", 4 << 20));
    start(&b, U("/img?n=%d", 4 << 20));
    run_for(0.5);
    assert_int_equal(b.done, 0);
    prism_fetch_cancel(a.q);            /* the pauser leaves: the download goes on for b */
    wait_done(&b, 10);
    assert_int_equal(b.reason, PRISM_FETCH_OK);
    assert_int_equal(a.done, 0);
    rec_free(&b);
}

static void test_cancel_and_stop(void **state)
{
    (void)state;
    /* the only request cancelled: the download stops, the server sees its client leave */
    rec_t r = {0};
    start(&r, U("/slow?n=100000000&rate=1000000&nolen=1"));   /* endless at its pace, far from any limit */
    run_for(0.3);
    assert_true(r.data_calls > 0);
    prism_fetch_cancel(r.q);
    run_for(0.3);
    assert_int_equal(r.done, 0);
    assert_true(run_until(server_idle, NULL, 5));   /* the server saw its client leave */
    assert_int_equal(prism_fetch_metrics(F)->inflight, 0);
    /* STOP from on_data (a header check that refuses): no on_done, download stopped */
    rec_t s = {0};
    s.action_at_first = PRISM_FETCH_STOP;
    start(&s, U("/slow?n=100000000&rate=1000000&nolen=1"));
    run_for(0.3);
    assert_int_equal(s.done, 0);
    assert_int_equal(s.data_calls, 1);
    assert_true(run_until(server_idle, NULL, 5));   /* the server saw its client leave */
    /* cancelled before it started: nothing is fetched */
    rec_t q = {0};
    int hits = S.hits[R_IMG];
    start(&q, U("/img?n=10"));
    prism_fetch_cancel(q.q);
    run_for(0.2);
    assert_int_equal(q.done, 0);
    assert_int_equal(S.hits[R_IMG], hits);
    /* a refused URL cancelled before its answer */
    rec_t u = {0};
    start(&u, "ftp://x/");
    prism_fetch_cancel(u.q);
    run_for(0.05);
    assert_int_equal(u.done, 0);
}

static void test_reentrant_callbacks(void **state)
{
    (void)state;
    /* on_done starts another fetch of the same URL (a cache hit) and of another one */
    rec_t a = {0}, b = {0}, c = {0}, d = {0};
    snprintf(a.restart_url, sizeof a.restart_url, "%s", U("/img?n=1234"));
    a.restarted = (struct rec *)&b;
    snprintf(b.restart_url, sizeof b.restart_url, "%s", U("/404"));
    b.restarted = (struct rec *)&c;
    start(&a, U("/img?n=1234"));
    wait_done(&c, 5);
    assert_int_equal(a.reason, PRISM_FETCH_OK);
    assert_true(b.cache_hit);
    assert_int_equal(c.reason, PRISM_FETCH_HTTP_STATUS);
    /* the callback is never called from inside prism_fetch_start, even for a cache hit */
    start(&d, U("/img?n=1234"));
    assert_int_equal(d.done, 0);
    assert_int_equal(d.data_calls, 0);
    wait_done(&d, 5);
    assert_true(d.cache_hit);
    rec_free(&a);
    rec_free(&b);
    rec_free(&d);
}

static void test_queue_limits(void **state)
{
    (void)state;
    prism_fetch_config_t c = base_config();
    c.max_inflight = 2;
    c.max_queued = 3;
    reopen(&c);
    rec_t r[6] = {{0}};
    for (int i = 0; i < 6; i++) start(&r[i], U("/slow?n=20000&rate=100000&i=%d", i));
    recs_t rs = {r, 6};
    assert_true(run_until(all_done, &rs, 10));
    for (int i = 0; i < 5; i++) assert_int_equal(r[i].reason, PRISM_FETCH_OK);
    assert_int_equal(r[5].reason, PRISM_FETCH_BUSY);   /* 2 running + 3 waiting */
    assert_int_equal(prism_fetch_metrics(F)->peak_inflight, 2);
    assert_int_equal(prism_fetch_metrics(F)->refused[PRISM_FETCH_BUSY], 1);
    for (int i = 0; i < 6; i++) rec_free(&r[i]);
    /* the total timeout counts the wait for a slot */
    c.max_inflight = 1;
    c.timeout_s = 1;
    c.min_rate = 0;
    reopen(&c);
    rec_t st = {0}, w = {0};
    start(&st, U("/stall"));
    start(&w, U("/img?n=10"));
    wait_done(&w, 5);
    assert_int_equal(w.reason, PRISM_FETCH_TIMEOUT);
    wait_done(&st, 5);
}

static char fdir[PATH_MAX];

static void test_file_urls(void **state)
{
    (void)state;
    snprintf(fdir, sizeof fdir, "%s/prism-fetch-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    assert_non_null(mkdtemp(fdir));
    char path[PATH_MAX + 64], url[PATH_MAX + 80];
    snprintf(path, sizeof path, "%s/img.bin", fdir);
    FILE *fp = fopen(path, "w");
    size_t n = 3 << 20;   /* several reads */
    for (size_t i = 0; i < n; i++) fputc(pattern(i), fp);
    fclose(fp);
    snprintf(path, sizeof path, "%s/link.bin", fdir);
    assert_int_equal(symlink("img.bin", path), 0);
    snprintf(path, sizeof path, "%s/empty.bin", fdir);
    fclose(fopen(path, "w"));
    prism_fetch_config_t c = base_config();
    c.allowed_local_path = fdir;
    c.max_bytes = 4 << 20;
    reopen(&c);
    rec_t r = {0}, p = {0}, l = {0}, o = {0}, e = {0}, big = {0};
    snprintf(url, sizeof url, "file://%s/img.bin", fdir);
    start(&r, url);
    p.action_at_first = PRISM_FETCH_PAUSE;
    start(&p, url);   /* joins r's read; pausing it holds the read for both */
    run_for(0.3);
    assert_int_equal(r.done, 0);
    assert_true(r.data_len < n);
    prism_fetch_resume(p.q);
    wait_done(&r, 5);
    wait_done(&p, 5);
    assert_int_equal(r.reason, PRISM_FETCH_OK);
    assert_int_equal(prism_fetch_blob_len(r.blob), n);
    assert_int_equal(r.declared, (int64_t)n);
    assert_int_equal(r.http_version, 0);
    snprintf(url, sizeof url, "file://%s/link.bin", fdir);
    start(&l, url);
    snprintf(url, sizeof url, "file://%s/../etc/passwd", fdir);
    start(&o, url);
    snprintf(url, sizeof url, "file://%s/empty.bin", fdir);
    start(&e, url);
    wait_done(&l, 5);
    wait_done(&o, 5);
    wait_done(&e, 5);
    assert_int_equal(l.reason, PRISM_FETCH_FILE_SYMLINK);
    assert_int_equal(o.reason, PRISM_FETCH_FILE_OUTSIDE);
    assert_int_equal(e.reason, PRISM_FETCH_OK);
    assert_int_equal(prism_fetch_blob_len(e.blob), 0);
    /* files are not kept: read again next time */
    rec_t again = {0};
    snprintf(url, sizeof url, "file://%s/img.bin", fdir);
    start(&again, url);
    wait_done(&again, 5);
    assert_false(again.cache_hit);
    /* larger than the limit: refused from its size */
    c.max_bytes = 1 << 20;
    reopen(&c);
    start(&big, url);
    wait_done(&big, 5);
    assert_int_equal(big.reason, PRISM_FETCH_TOO_LARGE_DECLARED);
    rec_free(&r);
    rec_free(&p);
    rec_free(&e);
    rec_free(&again);
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", fdir);
    assert_int_equal(system(cmd), 0);
}

static void test_close_in_flight(void **state)
{
    (void)state;
    /* downloads of every kind in flight when the fetcher closes: no callback, nothing left behind */
    rec_t r[4] = {{0}};
    start(&r[0], U("/slow?n=100000000&rate=1000000&nolen=1"));
    start(&r[1], U("/stall"));
    start(&r[2], U("/slow?n=4000000&rate=1000000"));
    run_for(0.2);
    assert_true(r[0].data_calls > 0 && r[2].data_calls > 0);
    start(&r[3], "ftp://refused/");   /* its refusal not yet told */
    close_fetcher();
    for (int i = 0; i < 4; i++) assert_int_equal(r[i].done, 0);
    run_for(0.2);
    assert_true(run_until(server_idle, NULL, 5));   /* the server saw its client leave */
}

static void test_blob_take(void **state)
{
    (void)state;
    rec_t a = {0};
    start(&a, U("/img?n=5000"));
    wait_done(&a, 5);
    /* the cache holds a reference too: take copies */
    size_t len = 0;
    const uint8_t *orig = prism_fetch_blob_data(a.blob);
    uint8_t *d = prism_fetch_blob_take(a.blob, &len);
    a.blob = NULL;
    assert_int_equal(len, 5000);
    assert_ptr_not_equal(d, orig);
    assert_int_equal(d[4999], pattern(4999));
    prism_free(d);
    /* the last reference: take hands the buffer itself over */
    prism_fetch_config_t c = base_config();
    c.cache_bytes = 0;
    reopen(&c);
    rec_t b = {0};
    start(&b, U("/img?n=5000"));
    wait_done(&b, 5);
    run_for(0.05);   /* the download lets go of its own reference */
    orig = prism_fetch_blob_data(b.blob);
    d = prism_fetch_blob_take(b.blob, &len);
    assert_ptr_equal(d, orig);
    prism_free(d);
}

/* With a secret, each image carries its keyed content hash, computed once when its download
 * completes: a joiner and a cache hit read the same one; without a secret there is none. */
static void test_blob_hash(void **state)
{
    (void)state;
    rec_t a = {0};
    start(&a, U("/img?n=5000"));
    wait_done(&a, 5);
    uint64_t h = 0;
    assert_false(prism_fetch_blob_hash(a.blob, &h));
    rec_free(&a);
    uint8_t secret[192];
    for (size_t i = 0; i < sizeof secret; i++) secret[i] = (uint8_t)(i * 37 + 11);
    prism_fetch_config_t c = base_config();
    c.hash_secret = secret;
    c.hash_secret_len = sizeof secret;
    reopen(&c);
    memset(secret, 0, sizeof secret);   /* copied at open */
    for (size_t i = 0; i < sizeof secret; i++) secret[i] = (uint8_t)(i * 37 + 11);
    rec_t r[3] = {{0}};
    start(&r[0], U("/img?n=300000"));
    start(&r[1], U("/img?n=300000"));   /* joins */
    wait_done(&r[0], 5);
    wait_done(&r[1], 5);
    start(&r[2], U("/img?n=300000"));   /* the cache */
    wait_done(&r[2], 5);
    assert_true(r[1].joined && r[2].cache_hit);
    uint64_t want = XXH3_64bits_withSecret(prism_fetch_blob_data(r[0].blob), 300000, secret, sizeof secret);
    for (int i = 0; i < 3; i++) {
        assert_true(prism_fetch_blob_hash(r[i].blob, &h));
        assert_true(h == want);
        rec_free(&r[i]);
    }
    /* a secret too short for XXH3 is a configuration error */
    c.hash_secret_len = 100;
    prism_fetch_t *f;
    char why[256];
    assert_int_equal(prism_fetch_open(&loop, &c, &f, why, sizeof why), PRISM_EINVAL);
}

/* The bounds a memory plan counts: every download at its largest plus libcurl's buffer, and the cache. */
static void test_bounds(void **state)
{
    (void)state;
    prism_fetch_config_t c;
    prism_fetch_config_default(&c);
    c.max_inflight = 4;
    c.max_bytes = 1 << 20;
    c.cache_bytes = 8 << 20;
    prism_fetch_bounds_t b;
    prism_fetch_config_bounds(&c, &b);
    assert_int_equal(b.downloads, 4 * ((1 << 20) + (128 << 10)));
    assert_int_equal(b.cache, 8 << 20);
    assert_int_equal(b.total, b.downloads + b.cache);
}

static void test_bad_config(void **state)
{
    (void)state;
    prism_fetch_config_t c;
    prism_fetch_t *f;
    char why[256];
    prism_fetch_config_default(&c);
    c.max_inflight = 0;
    assert_int_equal(prism_fetch_open(&loop, &c, &f, why, sizeof why), PRISM_EINVAL);
    prism_fetch_config_default(&c);
    c.allowed_networks.items[0] = "10.0.0.0/40";
    c.allowed_networks.n = 1;
    assert_int_equal(prism_fetch_open(&loop, &c, &f, why, sizeof why), PRISM_EINVAL);
    assert_non_null(strstr(why, "10.0.0.0/40"));
    prism_fetch_config_default(&c);
    c.ca_file = "/nonexistent/ca.pem";
    assert_int_equal(prism_fetch_open(&loop, &c, &f, why, sizeof why), PRISM_EINVAL);
    prism_fetch_config_default(&c);
    c.allowed_local_path = "/nonexistent-prism-dir";
    assert_int_equal(prism_fetch_open(&loop, &c, &f, why, sizeof why), PRISM_EINVAL);
}

int main(void)
{
    prism_log_init("test_fetch", PRISM_LOG_WARN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_fetch_ok, setup, teardown),
        cmocka_unit_test_setup_teardown(test_http_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_redirects, setup, teardown),
        cmocka_unit_test_setup_teardown(test_loopback_refused_by_default, setup, teardown),
        cmocka_unit_test_setup_teardown(test_size_limits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stall_and_slow, setup, teardown),
        cmocka_unit_test_setup_teardown(test_connect_timeout, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dedup, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cache, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cache_budget, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pause_resume, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel_and_stop, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reentrant_callbacks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_queue_limits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_file_urls, setup, teardown),
        cmocka_unit_test_setup_teardown(test_close_in_flight, setup, teardown),
        cmocka_unit_test_setup_teardown(test_blob_take, setup, teardown),
        cmocka_unit_test_setup_teardown(test_blob_hash, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bounds, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_config, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
