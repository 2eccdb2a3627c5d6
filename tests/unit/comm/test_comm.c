/* Collectives and group formation with real rank processes (fork) over loopback: the shared-memory
 * transport and the ZeroMQ transport give the exact rank-order sums and gathers on every rank
 * (bit-identical), across chunk boundaries; a rank that dies or hangs takes the others down with
 * PRISM_EIO quickly instead of hanging them; the rendezvous refuses what does not belong. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>

#include "comm/comm_impl.h"
#include "tp_fork.h"

/* Rank r's deterministic input: non-integral values, so a different summation order would show. */
static float input(int r, size_t i) { return (float)sin((double)(r + 1) * 0.37 + (double)i * 0.011) * (1.0f + (float)r); }

/* Sizes crossing the small-reduce threshold and (with 4 KiB slots) many chunk boundaries. */
static const size_t k_sizes[] = {1, 7, 1024, 1025, 5000, 40000};

static int body_collectives(int rank, int size, prism_group_t *g, prism_backend_t *be, void *ud)
{
    (void)be; (void)ud;
    prism_comm_t *c = prism_group_comm(g);
    TP_CHECK(c->size == size && c->rank == rank, "comm %d/%d", c->rank, c->size);
    size_t maxn = 40000;
    float *x = malloc(maxn * 4), *want = malloc(maxn * 4);
    uint8_t *gat = malloc(maxn * (size_t)size), *piece = malloc(maxn);
    for (int rep = 0; rep < 2; rep++)
        for (size_t k = 0; k < sizeof k_sizes / sizeof k_sizes[0]; k++) {
            size_t n = k_sizes[k];
            for (size_t i = 0; i < n; i++) {
                x[i] = input(rank, i);
                float s = input(0, i);
                for (int r = 1; r < size; r++) s += input(r, i);   /* rank order */
                want[i] = s;
            }
            TP_CHECK(prism_comm_all_reduce_sum(c, x, n) == PRISM_OK, "all_reduce n=%zu", n);
            TP_CHECK(memcmp(x, want, n * 4) == 0, "all_reduce n=%zu: not the rank-order sum bit for bit", n);
            /* all_gather: rank r contributes bytes (r * 31 + i) & 255 */
            for (size_t i = 0; i < n; i++) piece[i] = (uint8_t)(rank * 31 + i);
            memset(gat, 0xee, n * (size_t)size);
            TP_CHECK(prism_comm_all_gather(c, gat, piece, n) == PRISM_OK, "all_gather n=%zu", n);
            for (int r = 0; r < size; r++)
                for (size_t i = 0; i < n; i++)
                    TP_CHECK(gat[(size_t)r * n + i] == (uint8_t)(r * 31 + i), "all_gather n=%zu r=%d i=%zu", n, r, i);
            /* broadcast from every root */
            for (int root = 0; root < size; root++) {
                for (size_t i = 0; i < n; i++) piece[i] = rank == root ? (uint8_t)(root * 7 + i * 3) : 0;
                TP_CHECK(prism_comm_broadcast(c, piece, n, root) == PRISM_OK, "broadcast n=%zu root=%d", n, root);
                for (size_t i = 0; i < n; i++) TP_CHECK(piece[i] == (uint8_t)(root * 7 + i * 3), "broadcast root=%d", root);
            }
        }
    TP_CHECK(prism_comm_wait(c) == PRISM_OK, "wait");
    TP_CHECK(prism_group_check(g) == PRISM_OK, "check");
    TP_CHECK(c->n_ops > 0, "statistics");
    /* nobody exits (which peers would rightly report as a death) before everyone has checked */
    TP_CHECK(prism_comm_all_reduce_sum(c, x, 1) == PRISM_OK, "final barrier");
    free(x); free(want); free(gat); free(piece);
    return 0;
}

static void run_collectives(int size, prism_comm_transport_t tr)
{
    tp_fork_opts_t o = {.size = size, .transport = tr, .slot_bytes = 4096, .timeout_s = 20, .max_wall_s = 90};
    int codes[PRISM_TP_MAX];
    assert_int_equal(tp_fork_run(&o, body_collectives, NULL, codes), size);
}

static void test_shm_collectives(void **state)
{
    (void)state;
    run_collectives(2, PRISM_COMM_TRANSPORT_AUTO);
    run_collectives(3, PRISM_COMM_TRANSPORT_SHM);
    run_collectives(4, PRISM_COMM_TRANSPORT_AUTO);
}

static void test_zmq_collectives(void **state)
{
    (void)state;
    run_collectives(2, PRISM_COMM_TRANSPORT_ZMQ);
    run_collectives(3, PRISM_COMM_TRANSPORT_ZMQ);
}

/* ---- which transport auto picks, and nothing left in /dev/shm ---- */

static int body_transport(int rank, int size, prism_group_t *g, prism_backend_t *be, void *ud)
{
    (void)size; (void)be;
    const char *want = ud;
    TP_CHECK(!strcmp(prism_group_transport(g), want), "transport %s, want %s", prism_group_transport(g), want);
    if (!strcmp(want, "shm")) TP_CHECK(prism_group_mem_bytes(g) == prism_comm_shm_bytes(size, 4096), "mem bytes");
    /* The segment's name is gone once the group formed: no /dev/shm/prism-tp-<leader pid>-* entry. */
    if (rank == 0) {
        char prefix[64];
        snprintf(prefix, sizeof prefix, "prism-tp-%d-", (int)getpid());
        DIR *d = opendir("/dev/shm");
        if (d) {
            struct dirent *e;
            while ((e = readdir(d)))
                TP_CHECK(strncmp(e->d_name, prefix, strlen(prefix)) != 0, "left in /dev/shm: %s", e->d_name);
            closedir(d);
        }
    }
    return 0;
}

static void test_transport_choice_and_cleanup(void **state)
{
    (void)state;
    int codes[PRISM_TP_MAX];
    tp_fork_opts_t o = {.size = 3, .slot_bytes = 4096, .max_wall_s = 60};
    assert_int_equal(tp_fork_run(&o, body_transport, "shm", codes), 3);
    o.transport = PRISM_COMM_TRANSPORT_ZMQ;
    assert_int_equal(tp_fork_run(&o, body_transport, "zmq", codes), 3);
}

/* ---- a rank that dies, a rank that hangs ---- */

typedef struct {
    int victim;
    int mode;                 /* 0: SIGKILL itself, 1: sleep (hang) */
    double fail_s[PRISM_TP_MAX];   /* how long each survivor's failing op took */
    int fail_rc[PRISM_TP_MAX];
} fault_t;

static int body_fault(int rank, int size, prism_group_t *g, prism_backend_t *be, void *ud)
{
    (void)size; (void)be;
    fault_t *f = ud;
    prism_comm_t *c = prism_group_comm(g);
    float x[256];
    for (int step = 0; step < 5; step++) {
        for (int i = 0; i < 256; i++) x[i] = 1.0f;
        TP_CHECK(prism_comm_all_reduce_sum(c, x, 256) == PRISM_OK, "warm-up step %d", step);
        TP_CHECK(x[0] == (float)size, "sum");
    }
    if (rank == f->victim) {
        /* ZeroMQ sends from its I/O thread: let the last results leave before dying */
        if (f->mode == 0) {
            usleep(200 * 1000);
            raise(SIGKILL);
        }
        usleep(2500 * 1000);   /* hang past the others' step timeout, then find the group broken */
        int rc = prism_comm_all_reduce_sum(c, x, 256);
        TP_CHECK(rc == PRISM_EIO, "a hung rank's next op must fail (got %d)", rc);
        return 0;
    }
    double t0 = tp_now();
    int rc = prism_comm_all_reduce_sum(c, x, 256);
    f->fail_s[rank] = tp_now() - t0;
    f->fail_rc[rank] = rc;
    TP_CHECK(rc == PRISM_EIO, "op with a dead peer returned %d", rc);
    TP_CHECK(prism_comm_all_reduce_sum(c, x, 256) == PRISM_EIO, "a broken communicator stays broken");
    TP_CHECK(prism_comm_wait(c) == PRISM_EIO, "wait after failure");
    return 0;
}

static void run_fault(int size, prism_comm_transport_t tr, int victim, int mode, double timeout_s, double max_fail_s)
{
    fault_t *f = tp_shared(sizeof *f);
    memset(f, 0, sizeof *f);
    f->victim = victim;
    f->mode = mode;
    tp_fork_opts_t o = {.size = size, .transport = tr, .slot_bytes = 4096, .timeout_s = timeout_s, .max_wall_s = 40};
    int codes[PRISM_TP_MAX];
    tp_fork_run(&o, body_fault, f, codes);
    for (int r = 0; r < size; r++) {
        if (r == victim && mode == 0) {
            assert_int_equal(codes[r], 128 + SIGKILL);
            continue;
        }
        if (codes[r] != 0) fprintf(stderr, "rank %d exit %d\n", r, codes[r]);
        assert_int_equal(codes[r], 0);
        if (r != victim) {
            fprintf(stderr, "  %s T=%d victim %d mode %d: rank %d failed after %.3f s\n", tr == PRISM_COMM_TRANSPORT_ZMQ ? "zmq" : "shm",
                    size, victim, mode, r, f->fail_s[r]);
            assert_true(f->fail_s[r] < max_fail_s);
        }
    }
    munmap(f, sizeof *f);
}

static void test_dead_rank_fails_group_fast(void **state)
{
    (void)state;
    /* Step timeout 30 s: failing within 2 s proves the liveness checks, not the timeout, found it. */
    run_fault(3, PRISM_COMM_TRANSPORT_SHM, 2, 0, 30, 2.0);
    run_fault(3, PRISM_COMM_TRANSPORT_SHM, 0, 0, 30, 2.0);   /* the leader dies */
    run_fault(3, PRISM_COMM_TRANSPORT_ZMQ, 1, 0, 30, 2.0);
    run_fault(2, PRISM_COMM_TRANSPORT_ZMQ, 0, 0, 30, 2.0);
}

static void test_hung_rank_hits_step_timeout(void **state)
{
    (void)state;
    run_fault(3, PRISM_COMM_TRANSPORT_SHM, 1, 1, 1.0, 3.0);
    run_fault(2, PRISM_COMM_TRANSPORT_ZMQ, 1, 1, 1.0, 3.0);
}

/* ---- rendezvous refusals ---- */

static int join_one(const char *leader, int size, int rank, double join_s, char *err, size_t errlen)
{
    prism_net_t *z = NULL;
    prism_net_opts_t no = {.role = PRISM_NET_ROLE_DECODE, .insecure = true};
    if (prism_net_create(&no, &z, err, errlen) != PRISM_OK) return PRISM_EIO;
    prism_backend_t *be = prism_backend_cpu_create(1);
    prism_group_opts_t go = {.size = size, .rank = rank, .leader = leader, .name = "t", .be = be,
                             .join_timeout_s = join_s, .timeout_s = 5};
    prism_group_t *g = NULL;
    int rc = prism_group_create(z, &go, &g, err, errlen);
    if (rc == PRISM_OK) {
        /* hold the group a moment so a late duplicate meets a formed group */
        struct timespec ts = {0, 300 * 1000 * 1000};
        nanosleep(&ts, NULL);
        prism_group_destroy(g);
    }
    prism_backend_destroy(be);
    prism_net_destroy(z);
    return rc;
}

static void test_rendezvous_refusals(void **state)
{
    (void)state;
    char err[512] = "";
    /* listening on every interface is refused */
    assert_int_equal(join_one("tcp://*:7", 2, 0, 1, err, sizeof err), PRISM_EINVAL);
    assert_non_null(strstr(err, "every interface"));
    assert_int_equal(join_one("tcp://0.0.0.0:7", 2, 0, 1, err, sizeof err), PRISM_EINVAL);
    assert_int_equal(join_one("tcp://127.0.0.1:7", 2, 2, 1, err, sizeof err), PRISM_EINVAL);   /* rank out of range */
    assert_int_equal(join_one("ipc:///tmp/x", 2, 1, 1, err, sizeof err), PRISM_EINVAL);

    /* a missing rank: the leader gives up at the join timeout and names it */
    char leader[64];
    snprintf(leader, sizeof leader, "tcp://127.0.0.1:%d", tp_free_port());
    double t0 = tp_now();
    assert_int_equal(join_one(leader, 3, 0, 1.0, err, sizeof err), PRISM_EIO);
    assert_true(tp_now() - t0 < 5);
    assert_non_null(strstr(err, "rank(s) 1,2 did not join"));

    /* a rank with another group size is refused with the reason; a second live process claiming
     * rank 1 is refused; the real rank 1 joins */
    snprintf(leader, sizeof leader, "tcp://127.0.0.1:%d", tp_free_port());
    char *shared = tp_shared(4096);
    pid_t lp = fork();
    if (lp == 0) _exit(join_one(leader, 2, 0, 10, err, sizeof err) == PRISM_OK ? 0 : 1);
    pid_t wrong = fork();
    if (wrong == 0) {
        int rc = join_one(leader, 3, 1, 10, shared, 2048);
        _exit(rc == PRISM_EINVAL ? 0 : 1);
    }
    int st;
    assert_int_equal(waitpid(wrong, &st, 0), wrong);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    assert_non_null(strstr(shared, "group size 3"));
    pid_t good = fork();
    if (good == 0) _exit(join_one(leader, 2, 1, 10, err, sizeof err) == PRISM_OK ? 0 : 1);
    pid_t dup = fork();
    if (dup == 0) {
        usleep(100 * 1000);
        int rc = join_one(leader, 2, 1, 3, shared + 2048, 2048);
        _exit(rc != PRISM_OK ? 0 : 1);
    }
    assert_int_equal(waitpid(good, &st, 0), good);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    assert_int_equal(waitpid(lp, &st, 0), lp);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    assert_int_equal(waitpid(dup, &st, 0), dup);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    fprintf(stderr, "  duplicate rank: %s\n", shared + 2048);
    munmap(shared, 4096);
}

/* ---- the link is authenticated: CURVE with the role keys; another role is not let in ---- */

static void test_curve_link(void **state)
{
    (void)state;
    char dir[] = "/tmp/prism-tp-keys-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char err[256];
    assert_int_equal(prism_net_keygen(dir, PRISM_NET_ALLOW(PRISM_NET_ROLE_DECODE) | PRISM_NET_ALLOW(PRISM_NET_ROLE_PREFILL),
                                      false, err, sizeof err), PRISM_OK);
    int codes[PRISM_TP_MAX];
    tp_fork_opts_t o = {.size = 3, .transport = PRISM_COMM_TRANSPORT_ZMQ, .slot_bytes = 4096, .timeout_s = 20,
                        .max_wall_s = 90, .curve_keys = dir};
    assert_int_equal(tp_fork_run(&o, body_collectives, NULL, codes), 3);
    o.role = PRISM_NET_ROLE_PREFILL;
    o.transport = PRISM_COMM_TRANSPORT_AUTO;
    assert_int_equal(tp_fork_run(&o, body_transport, "shm", codes), 3);

    /* A prefill process cannot join a decode group's link: its handshake is refused, so the
     * leader never hears it and gives up at the join timeout. */
    char leader[64];
    snprintf(leader, sizeof leader, "tcp://127.0.0.1:%d", tp_free_port());
    pid_t intruder = fork();
    if (intruder == 0) {
        prism_net_t *n = NULL;
        prism_net_opts_t no = {.role = PRISM_NET_ROLE_PREFILL, .curve_keys = dir};
        char e[256];
        if (prism_net_create(&no, &n, e, sizeof e) != PRISM_OK) _exit(2);
        prism_backend_t *be = prism_backend_cpu_create(1);
        prism_group_opts_t go = {.size = 2, .rank = 1, .leader = leader, .be = be, .join_timeout_s = 3};
        prism_group_t *g = NULL;
        int rc = prism_group_create(n, &go, &g, e, sizeof e);
        _exit(rc == PRISM_OK ? 1 : 0);
    }
    prism_net_t *n = NULL;
    prism_net_opts_t no = {.role = PRISM_NET_ROLE_DECODE, .curve_keys = dir};
    assert_int_equal(prism_net_create(&no, &n, err, sizeof err), PRISM_OK);
    prism_backend_t *be = prism_backend_cpu_create(1);
    prism_group_opts_t go = {.size = 2, .rank = 0, .leader = leader, .be = be, .join_timeout_s = 2};
    prism_group_t *g = NULL;
    assert_int_equal(prism_group_create(n, &go, &g, err, sizeof err), PRISM_EIO);
    assert_non_null(strstr(err, "rank(s) 1 did not join"));
    assert_true(prism_net_refused(n) >= 1);   /* refused at the handshake, counted */
    int wst;
    assert_int_equal(waitpid(intruder, &wst, 0), intruder);
    assert_true(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    prism_backend_destroy(be);
    prism_net_destroy(n);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* ---- process liveness ---- */

static void test_proc_liveness(void **state)
{
    (void)state;
    uint64_t me = prism_proc_start_time(getpid());
    assert_true(me > 0);
    assert_true(prism_proc_alive(getpid(), me));
    assert_false(prism_proc_alive(getpid(), me + 1));   /* a reused pid is not the same process */
    pid_t p = fork();
    if (p == 0) _exit(0);
    usleep(100 * 1000);
    assert_int_equal(prism_proc_start_time(p), 0);      /* zombie: dead */
    waitpid(p, NULL, 0);
    assert_int_equal(prism_proc_start_time(p), 0);      /* reaped */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_proc_liveness),
        cmocka_unit_test(test_shm_collectives),
        cmocka_unit_test(test_zmq_collectives),
        cmocka_unit_test(test_transport_choice_and_cleanup),
        cmocka_unit_test(test_dead_rank_fails_group_fast),
        cmocka_unit_test(test_hung_rank_hits_step_timeout),
        cmocka_unit_test(test_rendezvous_refusals),
        cmocka_unit_test(test_curve_link),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
