/* Peer links of a worker (finding 10 of issue 8): peers that restart on new ports must not fill
 * the fixed peer table for good. Real sockets (insecure, loopback; nothing listens: ZeroMQ connects
 * in the background and queues nothing here). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "worker/worker.h"

static void endpoint(char *out, size_t n, int i) { snprintf(out, n, "tcp://127.0.0.1:%d", 20000 + i); }

static void test_full_table_reuses_idle_links(void **state)
{
    (void)state;
    prism_worker_opts_t o;
    prism_worker_opts_defaults(&o, "prefill");
    o.insecure_no_curve = true;
    o.routers.items[0] = "tcp://127.0.0.1:1";
    o.routers.n = 1;
    static prism_worker_t w;
    assert_int_equal(prism_worker_init(&w, PRISM__ROLE__ROLE_PREFILL, &o, NULL, 0), PRISM_OK);
    char ep[64];
    for (int i = 0; i < PRISM_WORKER_MAX_PEERS; i++) {
        endpoint(ep, sizeof(ep), i);
        assert_non_null(prism_worker_peer_sock(&w, ep));
    }
    /* every link busy (used just now): a new endpoint waits rather than close one in use */
    endpoint(ep, sizeof(ep), 1000);
    assert_null(prism_worker_peer_sock(&w, ep));
    /* the decode workers behind the first links restarted elsewhere long ago */
    for (int i = 0; i < PRISM_WORKER_MAX_PEERS; i++) w.peers[i].last_used -= 2 * PRISM_WORKER_PEER_IDLE_S - i * 0.01;
    for (int k = 0; k < 3; k++) {
        endpoint(ep, sizeof(ep), 1000 + k);
        assert_non_null(prism_worker_peer_sock(&w, ep));
        assert_int_equal(w.n_peers, PRISM_WORKER_MAX_PEERS);
    }
    assert_int_equal(w.peers_closed, 3);
    /* the three least recently used went; a later one is still there (same socket back) */
    for (int i = 0; i < w.n_peers; i++) {
        endpoint(ep, sizeof(ep), 0);
        assert_string_not_equal(w.peers[i].endpoint, ep);
        endpoint(ep, sizeof(ep), 2);
        assert_string_not_equal(w.peers[i].endpoint, ep);
    }
    endpoint(ep, sizeof(ep), 3);
    void *s3 = NULL;
    for (int i = 0; i < w.n_peers; i++)
        if (!strcmp(w.peers[i].endpoint, ep)) s3 = w.peers[i].sock;
    assert_non_null(s3);
    assert_ptr_equal(prism_worker_peer_sock(&w, ep), s3);
    prism_worker_close(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_full_table_reuses_idle_links),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
