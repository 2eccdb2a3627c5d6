/* Benchmark (not a test): what CURVE costs on the data plane. Pushes frames of one size over a real
 * TCP loopback PUSH -> PULL pair made by common/net, with CURVE and without, and prints MB/s.
 *   prism_bench_net [frame_bytes] [total_bytes]      (default 16 MiB frames, 1 GiB in total) */
#include "net/net.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static double run(const char *keys, size_t frame, size_t total)
{
    char err[512];
    prism_net_t *srv, *cli;
    prism_net_opts_t so = {.role = PRISM_NET_ROLE_DECODE, .curve_keys = keys, .insecure = !keys};
    prism_net_opts_t co = {.role = PRISM_NET_ROLE_PREFILL, .curve_keys = keys, .insecure = !keys};
    if (prism_net_create(&so, &srv, err, sizeof err) || prism_net_create(&co, &cli, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        exit(1);
    }
    void *pull = prism_sock_bind(srv, &(prism_sock_opts_t){.type = ZMQ_PULL, .endpoint = "tcp://127.0.0.1:*", .hwm = 1,
                                                        .max_msg_bytes = (int64_t)frame + (1 << 20),
                                                        .allow = PRISM_NET_ALLOW(PRISM_NET_ROLE_PREFILL)});
    char ep[256];
    prism_sock_last_endpoint(pull, ep, sizeof ep);
    void *push = prism_sock_connect(cli, &(prism_sock_opts_t){.type = ZMQ_PUSH, .endpoint = ep, .hwm = 1,
                                                           .max_msg_bytes = 1 << 16, .server = PRISM_NET_ROLE_DECODE});
    char *buf = malloc(frame);
    memset(buf, 7, frame);
    size_t n = total / frame;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_KV;
    prism_frame_t f = {buf, frame};
    /* warm-up: the handshake */
    prism_msg_send(push, NULL, 0, &env, &f, 1, 0);
    prism_msg_t m;
    prism_msg_recv(pull, false, &m, 0);
    prism_msg_close(&m);
    double t0 = prism_now_s();
    size_t sent = 0, got = 0;
    while (got < n) {
        while (sent < n && prism_msg_send(push, NULL, 0, &env, &f, 1, ZMQ_DONTWAIT) == PRISM_OK) sent++;
        zmq_pollitem_t it = {pull, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 10) > 0 && prism_msg_recv(pull, false, &m, ZMQ_DONTWAIT) == PRISM_OK) {
            got++;
            prism_msg_close(&m);
        }
    }
    double dt = prism_now_s() - t0;
    free(buf);
    zmq_close(push);
    zmq_close(pull);
    prism_net_destroy(cli);
    prism_net_destroy(srv);
    return (double)(n * frame) / dt / 1e6;
}

int main(int argc, char **argv)
{
    size_t frame = argc > 1 ? strtoull(argv[1], NULL, 0) : 16u << 20;
    size_t total = argc > 2 ? strtoull(argv[2], NULL, 0) : 1u << 30;
    prism_log_init("bench_net", PRISM_LOG_ERROR);
    char dir[] = "/tmp/prism-bench-net-XXXXXX", err[512];
    if (!mkdtemp(dir) || prism_net_keygen(dir, PRISM_NET_ALLOW(PRISM_NET_ROLE_PREFILL) | PRISM_NET_ALLOW(PRISM_NET_ROLE_DECODE), true, err, sizeof err)) {
        fprintf(stderr, "keygen: %s\n", err);
        return 1;
    }
    double plain = run(NULL, frame, total), curve = run(dir, frame, total);
    printf("frame %zu bytes, %zu MiB: plain %.0f MB/s, CURVE %.0f MB/s (%.2fx)\n", frame, total >> 20, plain, curve,
           plain / curve);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : 1;
}
