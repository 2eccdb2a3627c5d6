/* Test helper: runs a function in T forked rank processes that form a real group (group.h) over
 * loopback, and collects each rank's exit status. Children never use cmocka (a failed assertion
 * would longjmp into the parent's test runner inside the child): they print what went wrong and
 * exit non-zero. Results travel back through a shared anonymous mapping made before the fork. */
#ifndef PRISM_TEST_TP_FORK_H
#define PRISM_TEST_TP_FORK_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "comm/group.h"
#include "net/net.h"

#define TP_CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "rank check failed at %s:%d: %s: ", __FILE__, __LINE__, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); return 1; } } while (0)

typedef struct {
    int size;
    prism_comm_transport_t transport;
    size_t slot_bytes;
    double timeout_s, join_timeout_s;
    double max_wall_s;        /* parent kills what is still running after this (a hang fails the test) */
    int threads;              /* CPU backend threads per rank */
    const char *curve_keys;   /* key directory (CURVE on the link), or NULL: --insecure-no-curve */
    prism_net_role_t role;    /* the ranks' role (NONE: decode) */
} tp_fork_opts_t;

/* Runs in each child after the group formed; returns the exit code. */
typedef int (*tp_rank_fn)(int rank, int size, prism_group_t *g, prism_backend_t *be, void *ud);

static inline int tp_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &l) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    close(fd);
    return ntohs(a.sin_port);
}

static inline void *tp_shared(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static inline double tp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* One rank: forms the group and runs fn. Exit 90 when the group does not form. */
static inline int tp_rank_main(const tp_fork_opts_t *o, const char *leader, int rank, tp_rank_fn fn, void *ud)
{
    prism_net_t *net = NULL;
    char err[512];
    prism_net_opts_t no = {.role = o->role ? o->role : PRISM_NET_ROLE_DECODE, .curve_keys = o->curve_keys,
                           .insecure = o->curve_keys == NULL};
    if (prism_net_create(&no, &net, err, sizeof err) != PRISM_OK) {
        fprintf(stderr, "rank %d: net: %s\n", rank, err);
        return 91;
    }
    prism_backend_t *be = prism_backend_cpu_create(o->threads > 0 ? o->threads : 1);
    prism_group_opts_t go = {.size = o->size, .rank = rank, .leader = leader, .name = "test", .be = be,
                             .transport = o->transport, .shm_slot_bytes = o->slot_bytes,
                             .timeout_s = o->timeout_s, .join_timeout_s = o->join_timeout_s > 0 ? o->join_timeout_s : 20};
    prism_group_t *g = NULL;
    int rc = prism_group_create(net, &go, &g, err, sizeof err);
    if (rc != PRISM_OK) {
        fprintf(stderr, "rank %d: group: %s\n", rank, err);
        return 90;
    }
    int code = fn(rank, o->size, g, be, ud);
    prism_group_destroy(g);
    prism_backend_destroy(be);
    prism_net_destroy(net);
    return code;
}

/* Forks o->size ranks; codes[r] = exit code of rank r (128 + signal when killed; -1 when it had to
 * be killed at max_wall_s). Returns the number of ranks that exited 0. */
static inline int tp_fork_run(const tp_fork_opts_t *o, tp_rank_fn fn, void *ud, int *codes)
{
    char leader[64];
    snprintf(leader, sizeof leader, "tcp://127.0.0.1:%d", tp_free_port());
    pid_t pids[PRISM_TP_MAX];
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < o->size; r++) {
        pid_t p = fork();
        if (p == 0) _exit(tp_rank_main(o, leader, r, fn, ud));
        pids[r] = p;
        codes[r] = -1;
    }
    double deadline = tp_now() + (o->max_wall_s > 0 ? o->max_wall_s : 60);
    int left = o->size, ok = 0;
    while (left > 0) {
        int st;
        pid_t p = waitpid(-1, &st, WNOHANG);
        if (p > 0) {
            for (int r = 0; r < o->size; r++)
                if (pids[r] == p) {
                    codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
                    ok += codes[r] == 0;
                    left--;
                }
            continue;
        }
        if (tp_now() > deadline) {
            for (int r = 0; r < o->size; r++)
                if (codes[r] == -1) {
                    fprintf(stderr, "rank %d (pid %d) still running after %.0f s: killed\n", r, (int)pids[r], o->max_wall_s);
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], NULL, 0);
                }
            break;
        }
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return ok;
}

#endif
