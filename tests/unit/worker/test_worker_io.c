/* The worker's I/O thread against a fake router on loopback: heartbeats keep their interval while
 * the compute thread does not come back (and say busy, with its progress); an abort is visible to
 * the between-layer check while the compute thread is away; work, frames and replies travel the
 * channel intact; the data socket passes only as many messages as the compute thread granted; the
 * last replies of a worker that gives up its requests and exits (prism_worker_close_linger) all
 * reach the router. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "worker/worker.h"

#define MAX_HB 1024

typedef struct {
    prism_net_t *net;
    void *sock;
    char endpoint[128];
    pthread_t thread;
    pthread_mutex_t mu;
    bool stop;
    bool paused;            /* reads nothing (a router that is slow to take its messages) */
    /* what the router saw */
    int n_hb;
    double hb_t[MAX_HB];
    uint64_t hb_progress[MAX_HB];
    bool hb_busy[MAX_HB];
    int n_tokens;
    uint64_t tokens_rid, tokens_rid_hi;
    bool tokens_from_worker;
    /* what it should send (under mu) */
    int send_type;          /* 0 = nothing */
    uint64_t send_rid;
    char worker[64];
} fake_router_t;

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static void *router_main(void *arg)
{
    fake_router_t *r = arg;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        bool stop = r->stop, paused = r->paused;
        int type = r->send_type;
        uint64_t rid = r->send_rid;
        r->send_type = 0;
        pthread_mutex_unlock(&r->mu);
        if (stop) break;
        if (paused) {
            sleep_s(0.005);
            continue;
        }
        if (type) {
            Prism__Envelope env = PRISM__ENVELOPE__INIT;
            Prism__Abort ab = PRISM__ABORT__INIT;
            Prism__Encode en = PRISM__ENCODE__INIT;
            env.type = (Prism__MsgType)type;
            env.request_id = rid;
            env.router_id = "r1";
            if (type == PRISM__MSG_TYPE__MSG_ABORT) env.abort = &ab;
            en.image_index = 3;
            en.prefill_endpoint = "tcp://127.0.0.1:1";
            if (type == PRISM__MSG_TYPE__MSG_ENCODE) env.encode = &en;
            prism_frame_t f = {"image-bytes", 11};
            prism_msg_send(r->sock, r->worker, strlen(r->worker), &env, type == PRISM__MSG_TYPE__MSG_ENCODE ? &f : NULL,
                           type == PRISM__MSG_TYPE__MSG_ENCODE, 0);
        }
        zmq_pollitem_t it = {r->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 5) <= 0) continue;
        prism_msg_t m;
        while (prism_msg_recv(r->sock, true, &m, ZMQ_DONTWAIT) == PRISM_OK) {
            double now = prism_now_s();
            if (m.env->type == PRISM__MSG_TYPE__MSG_REGISTER) {
                pthread_mutex_lock(&r->mu);
                snprintf(r->worker, sizeof(r->worker), "%.*s", (int)m.identity_len, (const char *)m.identity);
                pthread_mutex_unlock(&r->mu);
                Prism__RegisterAck a = PRISM__REGISTER_ACK__INIT;
                a.ok = true;
                Prism__Envelope env = PRISM__ENVELOPE__INIT;
                env.type = PRISM__MSG_TYPE__MSG_REGISTER_ACK;
                env.router_id = "r1";
                env.reg_ack = &a;
                prism_msg_send(r->sock, m.identity, m.identity_len, &env, NULL, 0, 0);
            } else if (m.env->type == PRISM__MSG_TYPE__MSG_HEARTBEAT) {
                pthread_mutex_lock(&r->mu);
                if (r->n_hb < MAX_HB) {
                    r->hb_t[r->n_hb] = now;
                    r->hb_progress[r->n_hb] = m.env->heartbeat->progress;
                    r->hb_busy[r->n_hb] = m.env->heartbeat->busy;
                    r->n_hb++;
                }
                pthread_mutex_unlock(&r->mu);
            } else if (m.env->type == PRISM__MSG_TYPE__MSG_TOKENS) {
                pthread_mutex_lock(&r->mu);
                r->n_tokens++;
                r->tokens_rid = m.env->request_id;
                r->tokens_rid_hi = m.env->request_id_hi;
                r->tokens_from_worker = m.identity_len == strlen("w-test") && !memcmp(m.identity, "w-test", 6);
                pthread_mutex_unlock(&r->mu);
            }
            prism_msg_close(&m);
        }
    }
    prism_msg_thread_exit();
    return NULL;
}

static void router_send(fake_router_t *r, int type, uint64_t rid)
{
    pthread_mutex_lock(&r->mu);
    r->send_type = type;
    r->send_rid = rid;
    pthread_mutex_unlock(&r->mu);
}

static int router_hb(fake_router_t *r)
{
    pthread_mutex_lock(&r->mu);
    int n = r->n_hb;
    pthread_mutex_unlock(&r->mu);
    return n;
}

static bool wait_for(bool (*cond)(void *), void *arg, double timeout_s)
{
    double end = prism_now_s() + timeout_s;
    while (prism_now_s() < end) {
        if (cond(arg)) return true;
        sleep_s(0.005);
    }
    return cond(arg);
}

static bool has_hb(void *arg) { return router_hb(arg) >= 2; }

static void *resume_after(void *arg)
{
    fake_router_t *r = arg;
    sleep_s(0.5);
    pthread_mutex_lock(&r->mu);
    r->paused = false;
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

typedef struct {
    int n;
    int type;
    uint64_t rid;
    int source;
    char frame[32];
    int32_t expect_type;
} seen_t;

static void on_msg(prism_worker_t *w, prism_msg_t *m, int source, void *ud)
{
    (void)w;
    seen_t *s = ud;
    s->n++;
    s->type = m->env->type;
    s->rid = m->env->request_id;
    s->source = source;
    size_t len = 0;
    const void *d = prism_msg_frame(m, 0, &len);
    snprintf(s->frame, sizeof(s->frame), "%.*s", (int)len, d ? (const char *)d : "");
}

static char g_keys[256];

static prism_net_t *net_new(prism_net_role_t role)
{
    char err[512];
    prism_net_t *n = NULL;
    prism_net_opts_t o = {.role = role, .curve_keys = g_keys};
    int rc = prism_net_create(&o, &n, err, sizeof(err));
    if (rc) fprintf(stderr, "prism_net_create: %s\n", err);
    assert_int_equal(rc, PRISM_OK);
    return n;
}

static void test_worker_io(void **state)
{
    (void)state;
    /* Every link authenticated, as in a cluster: the worker's I/O thread owns CURVE sockets. */
    char err[256];
    unsigned all = 0;
    for (int role = 1; role < PRISM_NET_ROLE_COUNT; role++) all |= PRISM_NET_ALLOW(role);
    snprintf(g_keys, sizeof(g_keys), "/tmp/prism-test-worker-io-%d", (int)getpid());
    assert_int_equal(prism_net_keygen(g_keys, all, false, err, sizeof(err)), PRISM_OK);

    static fake_router_t r;
    memset(&r, 0, sizeof(r));
    pthread_mutex_init(&r.mu, NULL);
    r.net = net_new(PRISM_NET_ROLE_ROUTER);
    prism_sock_opts_t ro = {.type = ZMQ_ROUTER, .endpoint = "tcp://127.0.0.1:*", .hwm = PRISM_NET_CONTROL_HWM,
                            .max_msg_bytes = 1 << 20,
                            .allow = PRISM_NET_ALLOW(PRISM_NET_ROLE_ENCODER) | PRISM_NET_ALLOW(PRISM_NET_ROLE_PREFILL) |
                                     PRISM_NET_ALLOW(PRISM_NET_ROLE_DECODE)};
    r.sock = prism_sock_bind(r.net, &ro);
    assert_non_null(r.sock);
    prism_sock_last_endpoint(r.sock, r.endpoint, sizeof(r.endpoint));
    assert_int_equal(pthread_create(&r.thread, NULL, router_main, &r), 0);

    static prism_worker_t w;
    prism_worker_opts_t o;
    prism_worker_opts_defaults(&o, "prefill");
    o.worker_id = "w-test";
    o.routers = (prism_str_list_t){.items = {r.endpoint}, .n = 1};
    o.curve_keys = g_keys;
    assert_int_equal(prism_worker_init(&w, PRISM__ROLE__ROLE_PREFILL, &o, "tcp://127.0.0.1:*", 1 << 20), PRISM_OK);
    w.heartbeat_s = 0.05;
    assert_int_equal(prism_worker_start(&w), PRISM_OK);
    assert_true(wait_for(has_hb, &r, 30));

    /* The compute thread goes away for 1.5 s (30 intervals) without polling: heartbeats go on, say
     * busy from the second one on, and carry the progress counted before it left. The bounds
     * allow a loaded machine (or a sanitizer build) to delay a heartbeat several intervals; a
     * compute thread that sent them itself would send none at all. */
    prism_worker_progress(&w, 5);
    prism_worker_poll(&w, 0, on_msg, &(seen_t){0});
    int h0 = router_hb(&r);
    sleep_s(1.5);
    int h1 = router_hb(&r);
    assert_true(h1 - h0 >= 5);
    pthread_mutex_lock(&r.mu);
    double max_gap = 0;
    for (int i = h0 + 1; i < h1; i++) max_gap = PRISM_MAX(max_gap, r.hb_t[i] - r.hb_t[i - 1]);
    for (int i = h0 + 2; i < h1; i++) {
        assert_true(r.hb_busy[i]);
        assert_int_equal(r.hb_progress[i], 5);
    }
    pthread_mutex_unlock(&r.mu);
    print_message("heartbeats while the compute thread is away: %d in 1.5 s, largest gap %.3f s\n", h1 - h0, max_gap);
    assert_true(max_gap < 1.0);

    /* An abort is visible to the between-layer check without the compute thread polling. */
    assert_false(prism_worker_layer_done(&w, 1, 2));
    assert_false(prism_worker_aborted(&w, 7, "r1", NULL));
    router_send(&r, PRISM__MSG_TYPE__MSG_ABORT, 7);
    double t0 = prism_now_s();
    while (!prism_worker_layer_done(&w, 1, 2) && prism_now_s() - t0 < 30) sleep_s(0.001);
    double waited = -1;
    assert_true(prism_worker_aborted(&w, 7, "r1", &waited));
    assert_true(waited >= 0 && waited < 30);
    assert_false(prism_worker_aborted(&w, 7, "r2", NULL));
    assert_false(prism_worker_aborted(&w, 8, "r1", NULL));
    assert_false(prism_worker_layer_done(&w, 1, 2));   /* seen once */

    /* The abort message itself follows, then work with its raw frame, from router 0. */
    seen_t s = {0};
    t0 = prism_now_s();
    while (s.n < 1 && prism_now_s() - t0 < 30) prism_worker_poll(&w, 10, on_msg, &s);
    assert_int_equal(s.type, PRISM__MSG_TYPE__MSG_ABORT);
    router_send(&r, PRISM__MSG_TYPE__MSG_ENCODE, 9);
    s = (seen_t){0};
    t0 = prism_now_s();
    while (s.n < 1 && prism_now_s() - t0 < 30) prism_worker_poll(&w, 10, on_msg, &s);
    assert_int_equal(s.n, 1);
    assert_int_equal(s.type, PRISM__MSG_TYPE__MSG_ENCODE);
    assert_int_equal(s.rid, 9);
    assert_int_equal(s.source, 0);
    assert_string_equal(s.frame, "image-bytes");

    /* A reply goes out through the I/O thread under the worker's identity; an unknown router is refused. */
    Prism__Tokens t = PRISM__TOKENS__INIT;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TOKENS;
    env.tokens = &t;
    assert_int_equal(prism_worker_reply(&w, "r1", 9, 0xfeedfacecafebeefull, &env), PRISM_OK);
    assert_int_equal(prism_worker_reply(&w, "nobody", 9, 1, &env), PRISM_ENOTFOUND);
    t0 = prism_now_s();
    for (;;) {
        pthread_mutex_lock(&r.mu);
        int n = r.n_tokens;
        pthread_mutex_unlock(&r.mu);
        if (n || prism_now_s() - t0 > 30) break;
        sleep_s(0.005);
    }
    assert_int_equal(r.n_tokens, 1);
    assert_int_equal(r.tokens_rid, 9);
    assert_true(r.tokens_rid_hi == 0xfeedfacecafebeefull);   /* both halves of the 128-bit id */
    assert_true(r.tokens_from_worker);

    /* Data credit: three messages pushed, one granted -> one arrives; two more granted -> the rest. */
    prism_net_t *enc = net_new(PRISM_NET_ROLE_ENCODER);   /* a prefill's data socket admits encoders */
    prism_sock_opts_t po = {.type = ZMQ_PUSH, .endpoint = w.data_endpoint, .hwm = 10, .max_msg_bytes = 1 << 16,
                            .server = PRISM_NET_ROLE_PREFILL};
    void *push = prism_sock_connect(enc, &po);
    assert_non_null(push);
    for (int i = 0; i < 3; i++) {
        Prism__Envelope e = PRISM__ENVELOPE__INIT;
        e.type = PRISM__MSG_TYPE__MSG_EMBEDDINGS;
        e.request_id = 100 + (uint64_t)i;
        prism_frame_t f = {"rows", 4};
        assert_int_equal(prism_msg_send(push, NULL, 0, &e, &f, 1, 0), PRISM_OK);
    }
    prism_worker_accept_data(&w, 1);
    s = (seen_t){0};
    t0 = prism_now_s();
    while (s.n < 1 && prism_now_s() - t0 < 30) prism_worker_poll(&w, 10, on_msg, &s);
    t0 = prism_now_s();
    while (prism_now_s() - t0 < 0.3) prism_worker_poll(&w, 10, on_msg, &s);  /* no second one passes */
    assert_int_equal(s.n, 1);
    assert_int_equal(s.source, -1);
    assert_int_equal(s.rid, 100);
    prism_worker_accept_data(&w, 0);   /* the slot is taken: still nothing more */
    t0 = prism_now_s();
    while (prism_now_s() - t0 < 0.2) prism_worker_poll(&w, 10, on_msg, &s);
    assert_int_equal(s.n, 1);
    prism_worker_accept_data(&w, 2);
    t0 = prism_now_s();
    while (s.n < 3 && prism_now_s() - t0 < 30) prism_worker_poll(&w, 10, on_msg, &s);
    assert_int_equal(s.n, 3);
    assert_int_equal(s.rid, 102);

    /* Waiting for work is not busy. */
    h0 = router_hb(&r);
    t0 = prism_now_s();
    do {
        prism_worker_poll(&w, 20, on_msg, &s);
        h1 = router_hb(&r);
    } while (h1 < h0 + 4 && prism_now_s() - t0 < 30);
    assert_true(h1 >= h0 + 4);
    pthread_mutex_lock(&r.mu);
    for (int i = h0 + 1; i < h1; i++) assert_false(r.hb_busy[i]);
    pthread_mutex_unlock(&r.mu);

    zmq_close(push);
    prism_net_destroy(enc);

    /* A worker that fails its requests and exits at once (a tensor-parallel group that lost a rank)
     * while its router is slow to read: every reply queued before close still reaches the router
     * (32 MiB of them: more than the kernel's socket buffers hold, so most wait in the worker's
     * socket when it closes). */
    enum { LAST = 64 };
    static char big[512 << 10];
    memset(big, 'x', sizeof(big) - 1);
    t.error = big;
    pthread_mutex_lock(&r.mu);
    r.paused = true;
    pthread_mutex_unlock(&r.mu);
    for (int i = 0; i < LAST; i++) assert_int_equal(prism_worker_reply(&w, "r1", 1000 + (uint64_t)i, 0, &env), PRISM_OK);
    pthread_t resume;
    assert_int_equal(pthread_create(&resume, NULL, resume_after, &r), 0);
    prism_worker_close_linger(&w, 5000);
    prism_worker_close(&w);
    pthread_join(resume, NULL);
    t0 = prism_now_s();
    for (;;) {
        pthread_mutex_lock(&r.mu);
        int n = r.n_tokens;
        pthread_mutex_unlock(&r.mu);
        if (n >= 1 + LAST || prism_now_s() - t0 > 10) break;
        sleep_s(0.005);
    }
    assert_int_equal(r.n_tokens, 1 + LAST);
    assert_int_equal(r.tokens_rid, 1000 + LAST - 1);

    pthread_mutex_lock(&r.mu);
    r.stop = true;
    pthread_mutex_unlock(&r.mu);
    pthread_join(r.thread, NULL);
    zmq_close(r.sock);
    prism_net_destroy(r.net);
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_keys);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_worker_io)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
