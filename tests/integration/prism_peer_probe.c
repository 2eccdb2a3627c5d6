/* prism_peer_probe: an intruder on the cluster's internal network, for the security tests.
 *
 * It connects to a router's control endpoint and to prefill/decode data endpoints with whatever keys
 * it is given (none, another cluster's, a stranger's, or a cluster key of the wrong role) and tries
 * everything a worker could do: register, send Tokens for a range of request ids, push embeddings,
 * a Prefill and Aborts to a prefill, KV and Aborts to a decode. It prints, per link, whether the
 * CURVE handshake succeeded, and whether the router acknowledged the registration:
 *   router: handshake ok|refused
 *   register: acked|refused|no answer
 *   prefill-data: handshake ok|refused
 *   decode-data: handshake ok|refused
 * The test that runs it checks that nothing it sent had any effect on the cluster. */
#include "core/cli.h"
#include "net/net.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    const char *name;
    void *sock, *mon;
    int ok, failed;
} link_t;

static void link_watch(prism_net_t *net, link_t *l, int idx)
{
    char ep[64];
    snprintf(ep, sizeof(ep), "inproc://probe-monitor-%d", idx);
    zmq_socket_monitor(l->sock, ep, ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                        ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                                        ZMQ_EVENT_DISCONNECTED);
    l->mon = zmq_socket(prism_net_zctx(net), ZMQ_PAIR);
    zmq_connect(l->mon, ep);
}

static void link_events(link_t *l)
{
    for (;;) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, l->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        uint16_t e = 0;
        memcpy(&e, zmq_msg_data(&ev), 2);
        bool more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        if (more) {
            zmq_msg_init(&ev);
            zmq_msg_recv(&ev, l->mon, 0);
            zmq_msg_close(&ev);
        }
        if (e == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) l->ok++;
        else l->failed++;
    }
}

static void send_or_warn(void *s, Prism__Envelope *env, const prism_frame_t *f, int nf)
{
    int rc = prism_msg_send(s, NULL, 0, env, f, nf, ZMQ_DONTWAIT);
    if (rc != PRISM_OK && rc != PRISM_EAGAIN) fprintf(stderr, "probe: send: %s\n", prism_strerror(rc));
}

int main(int argc, char **argv)
{
    const char *keys = NULL, *role_name = "encoder", *router = NULL, *router_id = "", *prefill_data = NULL,
               *decode_data = NULL, *worker_id = "probe", *nul_suffix = NULL;
    bool from_prefill = false;
    const char *register_as = "decode", *data_endpoint = "tcp://127.0.0.1:1", *rid_file = NULL;
    int64_t first_rid = 1, last_rid = 64, token = 5, emb_bytes = 0, kv_blocks = 0;
    double wait_s = 2.0;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("curve-keys", &keys, "Key directory to use (none: no CURVE at all)"),
        PRISM_FLAG_STR("role", &role_name, "Whose key in --curve-keys to present"),
        PRISM_FLAG_STR("router", &router, "Router control endpoint to attack"),
        PRISM_FLAG_STR("router-id", &router_id, "Router id to put in envelopes (aborts match on it)"),
        PRISM_FLAG_STR("worker-id", &worker_id, "Worker id to register as"),
        PRISM_FLAG_STR("identity-nul-suffix", &nul_suffix,
                       "Connect with the identity WORKER_ID NUL SUFFIX (register as WORKER_ID): truncation aliasing"),
        PRISM_FLAG_STR("register-as", &register_as, "Role to register as: encoder, prefill or decode"),
        PRISM_FLAG_STR("data-endpoint", &data_endpoint, "Data endpoint to register"),
        PRISM_FLAG_STR("rid-file", &rid_file,
                       "Stay registered; once this file holds a request id (\"LOW HIGH\": decimal low half, hex high half), send the Tokens for it (within --wait)"),
        PRISM_FLAG_BOOL("from-prefill", &from_prefill, "Send the Tokens as a prefill's first token"),
        PRISM_FLAG_STR("prefill-data", &prefill_data, "Prefill data endpoint to attack"),
        PRISM_FLAG_STR("decode-data", &decode_data, "Decode data endpoint to attack"),
        PRISM_FLAG_INT("first-rid", &first_rid, "First request id to target"),
        PRISM_FLAG_INT("last-rid", &last_rid, "Last request id to target"),
        PRISM_FLAG_INT("token", &token, "Token id to inject"),
        PRISM_FLAG_INT("kv-blocks", &kv_blocks,
                       "KV blocks to register (0: none to show, the router keeps picking a real decode worker)"),
        PRISM_FLAG_INT("embedding-bytes", &emb_bytes, "Size of the forged embeddings frame"),
        PRISM_FLAG_DOUBLE("wait", &wait_s, "Seconds to wait for handshakes and answers"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "prism_peer_probe", "Tries to act as a cluster peer (security tests).", flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init("probe", PRISM_LOG_ERROR);
    char err[512];
    prism_net_t *net;
    prism_net_opts_t no = {.role = prism_net_role_parse(role_name), .curve_keys = keys, .insecure = keys == NULL};
    if (prism_net_create(&no, &net, err, sizeof(err)) != PRISM_OK) {
        fprintf(stderr, "probe: %s\n", err);
        return 1;
    }
    link_t links[3] = {{"router"}, {"prefill-data"}, {"decode-data"}};
    const char *eps[3] = {router, prefill_data, decode_data};
    prism_net_role_t servers[3] = {PRISM_NET_ROLE_ROUTER, PRISM_NET_ROLE_PREFILL, PRISM_NET_ROLE_DECODE};
    char identity[256];
    if (strlen(worker_id) > 200) return 2;
    size_t identity_len = (size_t)snprintf(identity, sizeof(identity), "%s", worker_id);
    if (nul_suffix) {
        size_t k = strlen(nul_suffix);
        if (identity_len + 1 + k > 255) return 2;
        identity[identity_len] = 0;
        memcpy(identity + identity_len + 1, nul_suffix, k);
        identity_len += 1 + k;
    }
    for (int i = 0; i < 3; i++) {
        if (!eps[i]) continue;
        prism_sock_opts_t so = {.type = i == 0 ? ZMQ_DEALER : ZMQ_PUSH, .endpoint = eps[i], .hwm = 100000,
                                .max_msg_bytes = 16 << 20, .identity = i == 0 ? identity : NULL,
                                .identity_len = i == 0 ? identity_len : 0, .server = servers[i]};
        links[i].sock = prism_sock_connect(net, &so);
        if (!links[i].sock) return 1;
        link_watch(net, &links[i], i);
    }
    Prism__Envelope env;
    if (links[0].sock) {
        Prism__Register reg = PRISM__REGISTER__INIT;
        reg.role = !strcmp(register_as, "prefill") ? PRISM__ROLE__ROLE_PREFILL
                 : !strcmp(register_as, "encoder") ? PRISM__ROLE__ROLE_ENCODER : PRISM__ROLE__ROLE_DECODE;
        reg.worker_id = (char *)worker_id;
        reg.data_endpoint = (char *)data_endpoint;
        reg.kv_blocks = (uint32_t)PRISM_MIN(PRISM_MAX(kv_blocks, 0), 1 << 20);
        reg.block_size = 16;
        reg.max_running = 64;
        prism__envelope__init(&env);
        env.type = PRISM__MSG_TYPE__MSG_REGISTER;
        env.reg = &reg;
        send_or_warn(links[0].sock, &env, NULL, 0);
        int32_t ids[1] = {(int32_t)token};
        for (int64_t rid = first_rid; rid <= last_rid; rid++) {
            Prism__Tokens t = PRISM__TOKENS__INIT;
            t.n_token_ids = 1;
            t.token_ids = ids;
            t.from_prefill = from_prefill;
            prism__envelope__init(&env);
            env.type = PRISM__MSG_TYPE__MSG_TOKENS;
            env.request_id = (uint64_t)rid;
            env.router_id = (char *)router_id;
            env.tokens = &t;
            send_or_warn(links[0].sock, &env, NULL, 0);
        }
    }
    void *zeros = calloc(1, emb_bytes > 0 ? (size_t)emb_bytes : 1);
    if (links[1].sock) {
        for (int64_t rid = first_rid; rid <= last_rid; rid++) {
            Prism__Embeddings em = PRISM__EMBEDDINGS__INIT;
            prism__envelope__init(&env);
            env.type = PRISM__MSG_TYPE__MSG_EMBEDDINGS;
            env.request_id = (uint64_t)rid;
            env.router_id = (char *)router_id;
            env.embeddings = &em;
            prism_frame_t f = {zeros, (size_t)emb_bytes};
            send_or_warn(links[1].sock, &env, &f, emb_bytes > 0);
            Prism__Abort ab = PRISM__ABORT__INIT;
            prism__envelope__init(&env);
            env.type = PRISM__MSG_TYPE__MSG_ABORT;
            env.request_id = (uint64_t)rid;
            env.router_id = (char *)router_id;
            env.abort = &ab;
            send_or_warn(links[1].sock, &env, NULL, 0);
        }
        int32_t prompt[3] = {1, 2, 3};
        Prism__Sampling sp = PRISM__SAMPLING__INIT;
        sp.max_tokens = 4;
        Prism__Prefill pf = PRISM__PREFILL__INIT;
        pf.n_token_ids = 3;
        pf.token_ids = prompt;
        pf.sampling = &sp;
        pf.decode_endpoint = decode_data ? (char *)decode_data : "";
        prism__envelope__init(&env);
        env.type = PRISM__MSG_TYPE__MSG_PREFILL;
        env.request_id = (uint64_t)first_rid;
        env.router_id = (char *)router_id;
        env.prefill = &pf;
        send_or_warn(links[1].sock, &env, NULL, 0);
    }
    if (links[2].sock) {
        for (int64_t rid = first_rid; rid <= last_rid; rid++) {
            Prism__Sampling sp = PRISM__SAMPLING__INIT;
            Prism__Kv kv = PRISM__KV__INIT;
            kv.sampling = &sp;
            kv.n_tokens = 1;
            prism__envelope__init(&env);
            env.type = PRISM__MSG_TYPE__MSG_KV;
            env.request_id = (uint64_t)rid;
            env.router_id = (char *)router_id;
            env.kv = &kv;
            prism_frame_t f = {"kv", 2};
            send_or_warn(links[2].sock, &env, &f, 1);
            Prism__Kv piece = PRISM__KV__INIT;   /* a later piece of it (of no transfer the decode holds) */
            piece.piece_first = 1;
            piece.piece_blocks = 1;
            env.kv = &piece;
            send_or_warn(links[2].sock, &env, &f, 1);
            Prism__Abort ab = PRISM__ABORT__INIT;
            prism__envelope__init(&env);
            env.type = PRISM__MSG_TYPE__MSG_ABORT;
            env.request_id = (uint64_t)rid;
            env.router_id = (char *)router_id;
            env.abort = &ab;
            send_or_warn(links[2].sock, &env, NULL, 0);
        }
    }
    /* Wait until every link's handshake has succeeded or failed (and, when the router took us, for its
     * answer to the registration), at most --wait seconds; an admitted link also gets a moment to
     * flush what was queued on it. */
    bool acked = false, nacked = false;
    double t_end = prism_now_s() + wait_s, t_resolved = 0;
    while (prism_now_s() < t_end) {
        bool resolved = true, any_ok = false;
        for (int i = 0; i < 3; i++) {
            if (!links[i].sock) continue;
            resolved &= links[i].ok > 0 || links[i].failed > 0;
            any_ok |= links[i].ok > 0;
        }
        if (links[0].sock && links[0].ok && !acked && !nacked) resolved = false;
        if (resolved && !t_resolved) t_resolved = prism_now_s();
        if (rid_file && links[0].sock) {   /* a registered worker that answers for one request, later */
            resolved = false;
            FILE *f = fopen(rid_file, "r");
            long long rid = 0;
            unsigned long long rid_hi = 0;   /* "LOW HIGH": both halves of the 128-bit id (hex high) */
            if (f && fscanf(f, "%lld %llx", &rid, &rid_hi) == 2) {
                int32_t ids[1] = {(int32_t)token};
                Prism__Tokens t = PRISM__TOKENS__INIT;
                t.n_token_ids = 1;
                t.token_ids = ids;
                t.from_prefill = from_prefill;
                prism__envelope__init(&env);
                env.type = PRISM__MSG_TYPE__MSG_TOKENS;
                env.request_id = (uint64_t)rid;
                env.request_id_hi = rid_hi;
                env.router_id = (char *)router_id;
                env.tokens = &t;
                send_or_warn(links[0].sock, &env, NULL, 0);
                rid_file = NULL;
                t_end = prism_now_s() + 1.0;   /* flush, then go */
            }
            if (f) fclose(f);
        }
        if (resolved && (!any_ok || prism_now_s() - t_resolved > 0.3)) break;
        zmq_pollitem_t it[1] = {{links[0].sock, 0, ZMQ_POLLIN, 0}};
        if (links[0].sock && zmq_poll(it, 1, 20) > 0) {
            prism_msg_t m;
            if (prism_msg_recv(links[0].sock, false, &m, ZMQ_DONTWAIT) == PRISM_OK) {
                if (m.env->type == PRISM__MSG_TYPE__MSG_REGISTER_ACK && m.env->reg_ack) {
                    if (m.env->reg_ack->ok) acked = true;
                    else nacked = true;
                }
                prism_msg_close(&m);
            }
        } else if (!links[0].sock) {
            usleep(20000);
        }
        for (int i = 0; i < 3; i++)
            if (links[i].sock) link_events(&links[i]);
    }
    for (int i = 0; i < 3; i++) {
        if (!links[i].sock) continue;
        /* (an acknowledged registration proves the handshake even when its event was not read) */
        printf("%s: handshake %s\n", links[i].name, links[i].ok || (i == 0 && acked) ? "ok" : "refused");
        if (i == 0) printf("register: %s\n", acked ? "acked" : nacked ? "refused" : "no answer");
        zmq_close(links[i].mon);
        zmq_close(links[i].sock);
    }
    fflush(stdout);
    free(zeros);
    prism_net_destroy(net);
    return 0;
}
