/* The SIGTERM drain on the worker's I/O thread, against a fake router on loopback: after the first
 * SIGTERM the heartbeats say `draining` at the drain rate and the worker registers nowhere; it does
 * not stop while the router still holds a request on it, nor while the compute thread's published
 * load is busy, nor on an idle load published before the router's release (the reply that emptied
 * the router's count may leave before the state it left behind is published); a fresh idle load
 * after the release ends the drain (prism_worker_should_stop). One test per process: the signal
 * state is the process's. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "worker/worker.h"

typedef struct {
    prism_net_t *net;
    void *sock;
    char endpoint[128];
    pthread_t thread;
    pthread_mutex_t mu;
    bool stop;
    uint32_t hold;           /* what DrainAck says we still have on the worker */
    int registers, hb, hb_draining, acks_zero;
    double last_draining_t, max_draining_gap;
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
        bool stop = r->stop;
        pthread_mutex_unlock(&r->mu);
        if (stop) break;
        zmq_pollitem_t it = {r->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 5) <= 0) continue;
        prism_msg_t m;
        while (prism_msg_recv(r->sock, true, &m, ZMQ_DONTWAIT) == PRISM_OK) {
            Prism__Envelope env = PRISM__ENVELOPE__INIT;
            env.router_id = "r1";
            pthread_mutex_lock(&r->mu);
            if (m.env->type == PRISM__MSG_TYPE__MSG_REGISTER) {
                r->registers++;
                Prism__RegisterAck a = PRISM__REGISTER_ACK__INIT;
                a.ok = true;
                env.type = PRISM__MSG_TYPE__MSG_REGISTER_ACK;
                env.reg_ack = &a;
                prism_msg_send(r->sock, m.identity, m.identity_len, &env, NULL, 0, 0);
            } else if (m.env->type == PRISM__MSG_TYPE__MSG_HEARTBEAT && m.env->heartbeat) {
                r->hb++;
                if (m.env->heartbeat->draining) {
                    double now = prism_now_s();
                    if (r->hb_draining) r->max_draining_gap = PRISM_MAX(r->max_draining_gap, now - r->last_draining_t);
                    r->last_draining_t = now;
                    r->hb_draining++;
                    Prism__DrainAck d = PRISM__DRAIN_ACK__INIT;
                    d.inflight = r->hold;
                    r->acks_zero += r->hold == 0;
                    env.type = PRISM__MSG_TYPE__MSG_DRAIN_ACK;
                    env.drain_ack = &d;
                    prism_msg_send(r->sock, m.identity, m.identity_len, &env, NULL, 0, 0);
                }
            }
            pthread_mutex_unlock(&r->mu);
            prism_msg_close(&m);
        }
    }
    prism_msg_thread_exit();
    return NULL;
}

static int get(fake_router_t *r, const int *field)
{
    pthread_mutex_lock(&r->mu);
    int v = *field;
    pthread_mutex_unlock(&r->mu);
    return v;
}

static void on_msg(prism_worker_t *w, prism_msg_t *m, int source, void *ud)
{
    (void)w, (void)m, (void)source, (void)ud;
}

/* The compute thread's loop for s seconds (or until it is told to stop): true when it was. */
static bool compute_for(prism_worker_t *w, double s)
{
    double end = prism_now_s() + s;
    while (prism_now_s() < end) {
        if (prism_worker_should_stop()) return true;
        prism_worker_poll(w, 10, on_msg, NULL);
    }
    return prism_worker_should_stop();
}

static void set_running(prism_worker_t *w, uint32_t running)
{
    prism_worker_load_t l = {.running = running};
    prism_worker_set_load(w, &l);
}

static void test_drain(void **state)
{
    (void)state;
    static fake_router_t r;
    memset(&r, 0, sizeof(r));
    pthread_mutex_init(&r.mu, NULL);
    char err[256];
    prism_net_opts_t no = {.role = PRISM_NET_ROLE_ROUTER, .insecure = true};
    assert_int_equal(prism_net_create(&no, &r.net, err, sizeof(err)), PRISM_OK);
    prism_sock_opts_t ro = {.type = ZMQ_ROUTER, .endpoint = "tcp://127.0.0.1:*", .hwm = PRISM_NET_CONTROL_HWM,
                            .max_msg_bytes = 1 << 20};
    r.sock = prism_sock_bind(r.net, &ro);
    assert_non_null(r.sock);
    prism_sock_last_endpoint(r.sock, r.endpoint, sizeof(r.endpoint));
    assert_int_equal(pthread_create(&r.thread, NULL, router_main, &r), 0);

    static prism_worker_t w;
    prism_worker_opts_t o;
    prism_worker_opts_defaults(&o, "decode");
    o.worker_id = "w-drain";
    o.routers = (prism_str_list_t){.items = {r.endpoint}, .n = 1};
    o.insecure_no_curve = true;
    prism_worker_install_signals();
    assert_int_equal(prism_worker_init(&w, PRISM__ROLE__ROLE_DECODE, &o, "tcp://127.0.0.1:*", 1 << 20), PRISM_OK);
    w.heartbeat_s = 1.0;   /* the drain's heartbeats must be faster than this */
    set_running(&w, 1);
    assert_int_equal(prism_worker_start(&w), PRISM_OK);
    double t0 = prism_now_s();
    while (get(&r, &r.hb) < 1 && prism_now_s() - t0 < 30) compute_for(&w, 0.01);
    assert_true(get(&r, &r.hb) >= 1);
    assert_int_equal(get(&r, &r.hb_draining), 0);

    /* SIGTERM while a request runs and the router holds it: draining heartbeats, no stop. */
    pthread_mutex_lock(&r.mu);
    r.hold = 1;
    pthread_mutex_unlock(&r.mu);
    assert_int_equal(raise(SIGTERM), 0);
    assert_false(prism_worker_should_stop());
    t0 = prism_now_s();
    while (get(&r, &r.hb_draining) < 5 && prism_now_s() - t0 < 30) assert_false(compute_for(&w, 0.01));
    assert_true(get(&r, &r.hb_draining) >= 5);
    assert_false(compute_for(&w, 0.4));

    /* Idle now, but the router still holds a request (its reply is on the way): no stop. */
    set_running(&w, 0);
    assert_false(compute_for(&w, 0.4));

    /* The router releases the worker; the idle load it sees was published before the release. */
    pthread_mutex_lock(&r.mu);
    r.hold = 0;
    pthread_mutex_unlock(&r.mu);
    t0 = prism_now_s();
    while (get(&r, &r.acks_zero) < 3 && prism_now_s() - t0 < 30) {
        /* a compute thread that publishes nothing (it is inside a unit of work) */
        prism_worker_poll(&w, 10, on_msg, NULL);
        assert_false(prism_worker_should_stop());
    }
    assert_true(get(&r, &r.acks_zero) >= 3);
    sleep_s(0.3);
    assert_false(prism_worker_should_stop());

    /* A load published after the release, still busy: no stop; then idle: the drain ends. */
    set_running(&w, 1);
    assert_false(compute_for(&w, 0.3));
    set_running(&w, 0);
    t0 = prism_now_s();
    assert_true(compute_for(&w, 10));
    pthread_mutex_lock(&r.mu);
    double gap = r.max_draining_gap;
    pthread_mutex_unlock(&r.mu);
    print_message("drain ended %.3f s after the last idle load; largest gap between draining heartbeats %.3f s\n",
                  prism_now_s() - t0, gap);
    assert_true(gap < 0.9);   /* drain rate (0.2 s), not the 1 s interval, with room for a loaded machine */
    assert_int_equal(get(&r, &r.registers), 1);   /* never registered again while draining */

    prism_worker_close(&w);
    pthread_mutex_lock(&r.mu);
    r.stop = true;
    pthread_mutex_unlock(&r.mu);
    pthread_join(r.thread, NULL);
    zmq_close(r.sock);
    prism_net_destroy(r.net);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_drain)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
