/* prism_wire: sends one hand-made protocol message to a worker's data endpoint, as an encoder
 * would (embeddings, to a prefill) or a prefill would (KV, to a decode). For tests and debugging of what workers do with messages the router never arranged:
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
    int64_t request_id = 1, request_id_hi = 0, image_index = 0, n_tokens = 64, hidden = 256, bytes = -1, count = 1;
    int64_t block_size = 16, block_bytes = 0, max_tokens = 16, first_token = 1, local_first_block = -1, kv_dtype = 0;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("endpoint", &endpoint, "Data endpoint to PUSH to, e.g. tcp://127.0.0.1:5555 (required)"),
        PRISM_FLAG_STR("type", &type, "Message type: embeddings (to a prefill, as an encoder) or kv (to a decode, as a prefill)"),
        PRISM_FLAG_INT("request-id", &request_id, "Envelope request id (the low half of the 128-bit id)"),
        PRISM_FLAG_INT("request-id-hi", &request_id_hi, "Envelope request id's high half"),
        PRISM_FLAG_STR("router-id", &router_id, "Envelope router id (the owner of the request)"),
        PRISM_FLAG_INT("image-index", &image_index, "Embeddings: image index within the request"),
        PRISM_FLAG_INT("n-tokens", &n_tokens, "Embeddings: tokens per image (the model's image_seq_length); kv: prompt tokens"),
        PRISM_FLAG_INT("block-size", &block_size, "KV: tokens per block"),
        PRISM_FLAG_INT("block-bytes", &block_bytes, "KV: bytes per block (payload = blocks for n-tokens x this)"),
        PRISM_FLAG_INT("local-first-block", &local_first_block,
                       "KV: first block of the chunked-attention layers' part (default: the block count, as for a "
                       "model without such layers)"),
        PRISM_FLAG_INT("kv-dtype", &kv_dtype,
                       "KV: Kv.wire_dtype, the frame's element type (0 f32, 1 bf16: --block-bytes is the wire's; "
                       "any other number is sent as it is)"),
        PRISM_FLAG_INT("max-tokens", &max_tokens, "KV: Sampling.max_tokens (sent as uint32: -1 is 0xFFFFFFFF)"),
        PRISM_FLAG_INT("first-token", &first_token, "KV: the token prefill sampled"),
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
    bool kv = !strcmp(type, "kv");
    if (!endpoint || (!kv && strcmp(type, "embeddings") != 0) || n_tokens < 0 || hidden < 0 || count < 1 ||
        n_tokens * hidden > ((int64_t)1 << 28) || block_size < 1 || block_bytes < 0 || block_bytes > (1 << 24) ||
        n_tokens > (1 << 20) || kv_dtype < INT32_MIN || kv_dtype > INT32_MAX) {
        fprintf(stderr, "prism_wire: --endpoint is required, --type must be embeddings or kv, sizes in range (see --help)\n");
        return 2;
    }
    int64_t n_blocks = (n_tokens + block_size - 1) / block_size;
    size_t len = bytes >= 0 ? (size_t)bytes : kv ? (size_t)(n_blocks * block_bytes) : (size_t)(n_tokens * hidden) * sizeof(float);
    void *payload = prism_calloc(len ? len : 1, 1);
    char err[512];
    prism_net_t *net = NULL;
    prism_net_opts_t no = {.role = kv ? PRISM_NET_ROLE_PREFILL : PRISM_NET_ROLE_ENCODER, .curve_keys = keys,
                           .insecure = insecure};
    if (prism_net_create(&no, &net, err, sizeof(err)) != PRISM_OK) {
        fprintf(stderr, "prism_wire: %s\n", err);
        prism_free(payload);
        return 2;
    }
    void *s = prism_sock_connect(net, &(prism_sock_opts_t){.type = ZMQ_PUSH, .endpoint = endpoint, .hwm = 1,
                                                          .max_msg_bytes = 1 << 20,
                                                          .server = kv ? PRISM_NET_ROLE_DECODE : PRISM_NET_ROLE_PREFILL});
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
    env.request_id_hi = (uint64_t)request_id_hi;
    env.router_id = (char *)router_id;
    env.embeddings = &em;
    Prism__Sampling sp = PRISM__SAMPLING__INIT;
    Prism__Kv k = PRISM__KV__INIT;
    uint32_t choice = 0;
    int32_t first = (int32_t)first_token;
    uint64_t rng = 0;
    if (kv) {
        sp.max_tokens = (uint32_t)max_tokens;
        sp.ignore_eos = true;
        k.n_tokens = (uint32_t)n_tokens;
        k.block_size = (uint32_t)block_size;
        k.n_blocks = (uint32_t)n_blocks;
        k.block_bytes = (uint64_t)block_bytes;
        k.local_first_block = (uint32_t)(local_first_block < 0 ? n_blocks : local_first_block);
        k.wire_dtype = (Prism__KvDtype)kv_dtype;
        k.sampling = &sp;
        k.n_choice_index = k.n_choice_first_token = k.n_choice_rng_state = 1;   /* one choice */
        k.choice_index = &choice;
        k.choice_first_token = &first;
        k.choice_rng_state = &rng;
        env.type = PRISM__MSG_TYPE__MSG_KV;
        env.embeddings = NULL;
        env.kv = &k;
    }
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
    printf("sent %lld %s message(s) for request %lld (router '%s') to %s\n", (long long)count, type,
           (long long)request_id, router_id, endpoint);
    return 0;
}
