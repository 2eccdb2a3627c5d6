/* prism_wire: sends one hand-made protocol message to a worker's data endpoint, as an encoder
 * would. For tests and debugging of what workers do with messages the router never arranged:
 * embeddings for a request that never comes (the prefill worker's orphan drop), wrong sizes,
 * duplicates. Uses the same framing and the same authenticated sockets as the workers (common/net):
 * with --curve-keys it speaks CURVE as the encoder role, which a prefill data socket admits. */
#include "core/core.h"
#include "core/cli.h"
#include "net/net.h"

#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    const char *endpoint = NULL, *router_id = "prism-wire", *type = "embeddings", *error = NULL, *keys = NULL;
    bool insecure = false;
    int64_t request_id = 1, image_index = 0, n_tokens = 64, hidden = 256, bytes = -1, count = 1;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("endpoint", &endpoint, "Data endpoint to PUSH to, e.g. tcp://127.0.0.1:5555 (required)"),
        PRISM_FLAG_STR("type", &type, "Message type: embeddings"),
        PRISM_FLAG_INT("request-id", &request_id, "Envelope request id"),
        PRISM_FLAG_STR("router-id", &router_id, "Envelope router id (the owner of the request)"),
        PRISM_FLAG_INT("image-index", &image_index, "Embeddings: image index within the request"),
        PRISM_FLAG_INT("n-tokens", &n_tokens, "Embeddings: tokens per image (the model's image_seq_length)"),
        PRISM_FLAG_INT("hidden", &hidden, "Embeddings: hidden size of the language model"),
        PRISM_FLAG_INT("bytes", &bytes, "Payload bytes (default n-tokens * hidden * 4; zeros)"),
        PRISM_FLAG_STR("error", &error, "Embeddings: send this encoder error instead of a payload"),
        PRISM_FLAG_INT("count", &count, "Send the message this many times"),
        PRISM_FLAG_STR("curve-keys", &keys, "CURVE key directory of the cluster (prism_keygen); sends as the encoder role"),
        PRISM_FLAG_BOOL("insecure-no-curve", &insecure, "Plain ZMTP, for a cluster running with --insecure-no-curve"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "prism_wire",
                             "Sends one hand-made protocol message to a worker's data endpoint (tests, debugging).", flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init("prism_wire", PRISM_LOG_INFO);
    if (!endpoint || strcmp(type, "embeddings") != 0 || n_tokens < 0 || hidden < 0 || count < 1 ||
        n_tokens * hidden > ((int64_t)1 << 28)) {
        fprintf(stderr, "prism_wire: --endpoint is required, --type must be embeddings, sizes in range (see --help)\n");
        return 2;
    }
    size_t len = bytes >= 0 ? (size_t)bytes : (size_t)(n_tokens * hidden) * sizeof(float);
    void *payload = prism_calloc(len ? len : 1, 1);
    char err[512];
    prism_net_t *net = NULL;
    prism_net_opts_t no = {.role = PRISM_NET_ROLE_ENCODER, .curve_keys = keys, .insecure = insecure};
    if (prism_net_create(&no, &net, err, sizeof(err)) != PRISM_OK) {
        fprintf(stderr, "prism_wire: %s\n", err);
        prism_free(payload);
        return 2;
    }
    void *s = prism_sock_connect(net, &(prism_sock_opts_t){.type = ZMQ_PUSH, .endpoint = endpoint, .hwm = 1,
                                                          .max_msg_bytes = 1 << 20, .server = PRISM_NET_ROLE_PREFILL});
    if (!payload || !s) {
        fprintf(stderr, "prism_wire: cannot connect to %s\n", endpoint);
        return 1;
    }
    int linger = 5000;  /* deliver what was queued before closing */
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    Prism__Embeddings em = PRISM__EMBEDDINGS__INIT;
    em.image_index = (uint32_t)image_index;
    em.n_tokens = (uint32_t)n_tokens;
    em.hidden = (uint32_t)hidden;
    em.error = (char *)(error ? error : "");
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_EMBEDDINGS;
    env.request_id = (uint64_t)request_id;
    env.router_id = (char *)router_id;
    env.embeddings = &em;
    prism_frame_t f = {payload, len};
    for (int64_t i = 0; i < count && rc == PRISM_OK; i++)
        rc = prism_msg_send(s, NULL, 0, &env, error ? NULL : &f, error ? 0 : 1, 0);
    zmq_close(s);
    prism_net_destroy(net);
    prism_free(payload);
    if (rc != PRISM_OK) {
        fprintf(stderr, "prism_wire: send failed: %s\n", prism_strerror(rc));
        return 1;
    }
    printf("sent %lld embeddings message(s) for request %lld (router '%s') to %s\n", (long long)count,
           (long long)request_id, router_id, endpoint);
    return 0;
}
