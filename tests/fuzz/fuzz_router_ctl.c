/* libFuzzer: the router's control messages (router/control.c dispatch: Register, Heartbeat, Tokens,
 * EncodeDone from workers; requests.c router_handle_tokens / router_handle_encode_done, early_encode.c)
 * with requests in flight. The router is built by its own start-up (router_open in router/main.c,
 * compiled into the harness) on the bundled tiny model, its control socket on an inproc endpoint and
 * its HTTP listener on a loopback port; its loop runs inside the harness (uv_run, UV_RUN_NOWAIT).
 * Three workers are DEALER sockets of the harness, registered as encoder-0, prefill-0 and decode-0;
 * what the router sends them (Prefill, Encode, Abort, acks) is read and checked to unpack.
 *
 * Input: flags:u8 (bits 0-1: HTTP requests opened first, 0-3; bit 2: streamed; bit 3: chat instead of
 * completions; bit 4: n = 2; bits 5-6: max_tokens 1, 4, 16 or 64; bit 7: one more client sends a chat
 * body that stops right after its image, which goes to the encoder as an early job and never becomes
 * a request), then records
 *   worker:u8 (mod 3: encoder, prefill, decode)  len:u16le  envelope[len]
 * each sent up from that worker's socket as it is; an envelope that unpacks and names a request id
 * below 16 is sent for the (id mod n)-th request the router dispatched in this input, both halves of
 * its id (ids are 128 random bits: a fuzzer could never guess one).
 * Invariants: the router stays up and answers what it sends well-formed; decode Tokens held for a
 * first token stay within the request's n x max_tokens token ids; once every client hangs up,
 * no request is left (r->n_reqs == 0) and every registered worker is back at nothing in flight and no
 * image bytes queued (an abandoned body's early job included: issue 26 finding 5). After each input the workers register again as new processes, so no input's
 * registrations or load reach the next. */
#define main router_main
#include "../../router/main.c"
#undef main

#include "../../router/request.h"
#include "fuzz_common.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#define CTL_EP "inproc://prism-fuzz-ctl"
#define N_WORKERS 3
#define MAX_CLIENTS 3
#define MAX_RIDS 16

static router_t g_r;
static void *g_wk[N_WORKERS];
static const char *const g_ids[N_WORKERS] = {"encoder-0", "prefill-0", "decode-0"};
static const Prism__Role g_roles[N_WORKERS] = {PRISM__ROLE__ROLE_ENCODER, PRISM__ROLE__ROLE_PREFILL,
                                               PRISM__ROLE__ROLE_DECODE};
static uint64_t g_rids[MAX_RIDS], g_rids_hi[MAX_RIDS];   /* 128-bit ids: both halves */
static int g_n_rids;
static int g_acks;
static int g_fd[MAX_CLIENTS + 1];
static int g_n_fd;

static void note_rid(uint64_t rid, uint64_t hi)
{
    for (int i = 0; i < g_n_rids; i++)
        if (g_rids[i] == rid && g_rids_hi[i] == hi) return;
    if (g_n_rids < MAX_RIDS) g_rids[g_n_rids] = rid, g_rids_hi[g_n_rids++] = hi;
}

/* What the router sent the workers: it unpacks (prism_msg_recv), and a request's id is learnt. */
static void read_workers(void)
{
    for (int k = 0; k < N_WORKERS; k++)
        for (;;) {
            prism_msg_t m;
            int rc = prism_msg_recv(g_wk[k], false, &m, ZMQ_DONTWAIT);
            if (rc == PRISM_EAGAIN) break;
            if (rc == PRISM_EIO && errno == EINTR) continue;   /* libFuzzer's SIGALRM (-timeout) */
            if (rc != PRISM_OK)
                fprintf(stderr, "from the router to %s: %s (errno %d)\n", g_ids[k], prism_strerror(rc), errno);
            FUZZ_ASSERT(rc == PRISM_OK);
            Prism__MsgType t = m.env->type;
            if (t == PRISM__MSG_TYPE__MSG_PREFILL || t == PRISM__MSG_TYPE__MSG_ENCODE) note_rid(m.env->request_id, m.env->request_id_hi);
            if (t == PRISM__MSG_TYPE__MSG_REGISTER_ACK && m.env->reg_ack && m.env->reg_ack->ok) g_acks++;
            prism_msg_close(&m);
        }
    char buf[4096];
    for (int i = 0; i < g_n_fd; i++)
        while (recv(g_fd[i], buf, sizeof(buf), MSG_DONTWAIT) > 0) {}
}

/* Runs the router's loop without waiting, rounds times, reading what it sends. */
static void pump(int rounds)
{
    for (int i = 0; i < rounds; i++) {
        uv_run(g_r.loop, UV_RUN_NOWAIT);
        read_workers();
    }
}

static void send_env(int k, Prism__Envelope *e)
{
    FUZZ_ASSERT(prism_msg_send(g_wk[k], NULL, 0, e, NULL, 0, 0) == PRISM_OK);
}

/* The canonical registration and an idle heartbeat of worker k, from a new process each time: the
 * router forgets whatever an input made of the worker before (draining, odd capacity, load). */
static void register_worker(int k)
{
    static uint64_t instance = 1000;
    Prism__Register g = PRISM__REGISTER__INIT;
    g.role = g_roles[k];
    g.worker_id = (char *)g_ids[k];
    g.data_endpoint = k ? "tcp://127.0.0.1:1" : "";
    g.kv_blocks = k == 2 ? 1024 : 64;
    g.block_size = 16;
    g.max_batch_tokens = 512;
    g.max_running = 8;
    g.max_model_len = 2048;
    g.tp_size = 1;
    g.instance = ++instance;
    g.max_queued_bytes = k == 0 ? 1 << 20 : 0;
    g.embedding_cache_units = k == 0 ? 8 : 0;
    Prism__Envelope e = PRISM__ENVELOPE__INIT;
    e.type = PRISM__MSG_TYPE__MSG_REGISTER;
    e.reg = &g;
    send_env(k, &e);
    Prism__Heartbeat hb = PRISM__HEARTBEAT__INIT;
    hb.worker_id = (char *)g_ids[k];
    hb.kv_free_blocks = g.kv_blocks;
    hb.pool_free = 8;
    Prism__Envelope h = PRISM__ENVELOPE__INIT;
    h.type = PRISM__MSG_TYPE__MSG_HEARTBEAT;
    h.heartbeat = &hb;
    send_env(k, &h);
}

static void open_client(uint8_t flags, int i)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    FUZZ_ASSERT(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)prism_http_server_port(g_r.http))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    FUZZ_ASSERT(connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0);
    static const int max_tokens[4] = {1, 4, 16, 64};
    char body[512], req[1024];
    int mt = max_tokens[(flags >> 5) & 3];
    const char *stream = flags & 4 ? "true" : "false";
    int n = flags & 16 ? 2 : 1;
    if (flags & 8)
        snprintf(body, sizeof(body), "{\"messages\":[{\"role\":\"user\",\"content\":\"Say %d things\"}],"
                 "\"max_tokens\":%d,\"stream\":%s,\"n\":%d,\"temperature\":0.5,\"logprobs\":true,\"top_logprobs\":2}",
                 i, mt, stream, n);
    else
        snprintf(body, sizeof(body), "{\"prompt\":\"A red circle %d\",\"max_tokens\":%d,\"stream\":%s,\"n\":%d,"
                 "\"stop\":[\"x\"]}", i, mt, stream, n);
    int len = snprintf(req, sizeof(req), "POST /v1/%s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       "Content-Length: %zu\r\n\r\n%s", flags & 8 ? "chat/completions" : "completions", strlen(body),
                       body);
    FUZZ_ASSERT(send(fd, req, (size_t)len, MSG_NOSIGNAL) == len);
    g_fd[g_n_fd++] = fd;
}

/* A chat body that stops right after its image (a 16x16 PNG): the router sends the image to the
 * encoder as an early job while it waits for the rest, which never comes. */
static void open_abandoned_body(void)
{
    static const char png[] = "iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAATElEQVR4nGP8//8/AymAiSTV5GhgwRS6Ky8PZys/fEjABm"
                              "TVmFx0DZjSmIJMuCRw6aF9KFGgATMEsUox4ZLAJYjuJDRpTCMYB1/iAwBQURsb8oJojgAAAABJRU5ErkJggg==";
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    FUZZ_ASSERT(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)prism_http_server_port(g_r.http))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    FUZZ_ASSERT(connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0);
    char req[1024];
    int len = snprintf(req, sizeof(req), "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                       "application/json\r\nContent-Length: 4096\r\n\r\n{\"messages\":[{\"role\":\"user\",\"content\":"
                       "[{\"type\":\"image_url\",\"image_url\":{\"url\":\"data:image/png;base64,%s\"}}", png);
    FUZZ_ASSERT(send(fd, req, (size_t)len, MSG_NOSIGNAL) == len);
    g_fd[g_n_fd++] = fd;
}

/* Pumps until want requests were dispatched (or half a second passed: under load they may not be). */
static void wait_dispatched(int want)
{
    double t0 = prism_now_s();
    while (g_n_rids < want && prism_now_s() - t0 < 0.5) {
        pump(1);
        if (g_n_rids < want) usleep(200);
    }
}

static void init(void)
{
    static char model[512];
    snprintf(model, sizeof(model), "%s/models/prism-tiny-llava", PRISM_SOURCE_DIR);
    const char *argv[] = {"router", "--model-path", model, "--insecure-no-curve", "--control-endpoint", CTL_EP,
                          "--port", "0", "--host", "127.0.0.1", "--log-level", "error", "--prep-threads", "1",
                          "--worker-timeout", "1e6", "--worker-stuck-timeout", "0", "--max-running-requests", "8",
                          "--stage-timeout", "0", NULL};
    struct sigaction old_int, old_term;
    sigaction(SIGINT, NULL, &old_int);
    sigaction(SIGTERM, NULL, &old_term);
    FUZZ_ASSERT(router_open(&g_r, (int)PRISM_ARRAY_LEN(argv) - 1, (char **)argv) == -1);
    prism_log_init("fuzz", PRISM_LOG_ERROR + 1);
    for (int k = 0; k < N_WORKERS; k++) {
        g_wk[k] = zmq_socket(prism_net_zctx(g_r.net), ZMQ_DEALER);
        int linger = 0;
        zmq_setsockopt(g_wk[k], ZMQ_ROUTING_ID, g_ids[k], strlen(g_ids[k]));
        zmq_setsockopt(g_wk[k], ZMQ_LINGER, &linger, sizeof(linger));
        FUZZ_ASSERT(zmq_connect(g_wk[k], CTL_EP) == 0);
        register_worker(k);
    }
    double t0 = prism_now_s();
    while (g_acks < N_WORKERS && prism_now_s() - t0 < 10) pump(1);
    FUZZ_ASSERT(g_acks == N_WORKERS);
    FUZZ_ASSERT(router_count_workers(&g_r, PRISM__ROLE__ROLE_PREFILL) == 1);
}

/* Whether a registered worker has something in flight or image bytes queued (the router's view). */
static bool workers_busy(void)
{
    for (int i = 0; i < ROUTER_MAX_WORKERS; i++) {
        const router_worker_t *w = &g_r.workers[i];
        if (w->used && (w->inflight || w->queued_bytes)) return true;
    }
    return false;
}

/* Decode Tokens held for a prefill's first token stay within what the request may be sent. */
static void check_held(void)
{
    for (size_t i = 0; i < g_r.reqs_cap; i++) {
        const router_req_t *q = g_r.reqs[i];
        if (!q) continue;
        int64_t may = (int64_t)router_req_n(q) * q->prompt.max_tokens;
        FUZZ_ASSERT(q->held_tokens <= may && q->n_held <= may + ROUTER_MAX_HELD_TOKENS);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool ready_once;
    if (!ready_once) {
        fuzz_init_once();
        init();
        ready_once = true;
    }
    g_n_rids = 0;
    g_n_fd = 0;
    uint8_t flags = size ? data[0] : 0;
    if (size) data++, size--;
    int n_clients = flags & 3;
    for (int i = 0; i < n_clients; i++) open_client(flags, i);
    wait_dispatched(n_clients);
    if (flags & 128) {
        int before = g_n_rids;
        open_abandoned_body();
        wait_dispatched(before + 1);   /* its early job's Encode (its id learnt like a request's) */
    }
    while (size >= 3) {
        int k = data[0] % N_WORKERS;
        size_t len = (size_t)data[1] | (size_t)data[2] << 8;
        data += 3, size -= 3;
        if (len > size) break;
        Prism__Envelope *e = prism_msg_unpack(data, len);
        if (e && e->request_id < 16 && g_n_rids) {
            int i = (int)(e->request_id % (uint64_t)g_n_rids);
            e->request_id = g_rids[i];
            e->request_id_hi = g_rids_hi[i];
            send_env(k, e);
        } else {
            zmq_send(g_wk[k], data, len, 0);   /* as it is: the router's own checks decide */
        }
        prism_msg_env_free(e);
        data += len, size -= len;
        pump(3);
        check_held();
    }
    pump(3);
    /* Every client hangs up: the router forgets every request (and tells the workers). */
    /* Hung up with a reset: a client that closes first keeps its port in TIME_WAIT for a minute, and
     * hundreds of inputs a second ran out of ephemeral ports (connect failed after ~80,000 inputs). */
    const struct linger rst = {.l_onoff = 1, .l_linger = 0};
    for (int i = 0; i < g_n_fd; i++) {
        setsockopt(g_fd[i], SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
        close(g_fd[i]);
    }
    g_n_fd = 0;
    double t0 = prism_now_s();
    while ((g_r.n_reqs || workers_busy()) && prism_now_s() - t0 < 5) {   /* immediate on an idle machine; slack for a loaded one */
        pump(1);
        usleep(100);
    }
    if (getenv("FUZZ_VERBOSE"))   /* what an input did: to check that a seed does what it says */
        fprintf(stderr, "router: %d requests dispatched, %zu left after the clients hung up, %llu control messages "
                "refused\n", g_n_rids, g_r.n_reqs, (unsigned long long)g_r.ctl_refused);
    FUZZ_ASSERT(g_r.n_reqs == 0);
    FUZZ_ASSERT(!workers_busy());
    /* The next input starts from the same registry. */
    g_acks = 0;
    for (int k = 0; k < N_WORKERS; k++) register_worker(k);
    t0 = prism_now_s();
    while (g_acks < N_WORKERS && prism_now_s() - t0 < 2) pump(1);
    return 0;
}
