/* libFuzzer: the protobuf envelope every internal message starts with (common/net prism_msg_unpack:
 * size bound, protobuf-c unpack, protocol version). Every field of an accepted envelope is read (so
 * ASan sees any bad pointer or length), and it packs again to the size it announces. */
#include "fuzz_common.h"
#include "net/net.h"

static volatile size_t g_sink;

static void touch_str(const char *s)
{
    if (s) g_sink += strlen(s);
}

static void touch_sampling(const Prism__Sampling *s)
{
    if (!s) return;
    for (size_t i = 0; i < s->n_stop_token_ids; i++) g_sink += (size_t)s->stop_token_ids[i];
    g_sink += s->max_tokens + (size_t)s->top_k + s->logprobs;
}

static void touch(const Prism__Envelope *e)
{
    touch_str(e->router_id);
    if (e->reg) touch_str(e->reg->worker_id), touch_str(e->reg->data_endpoint);
    if (e->reg_ack) touch_str(e->reg_ack->message);
    if (e->heartbeat) touch_str(e->heartbeat->worker_id);
    if (e->encode) touch_str(e->encode->prefill_endpoint);
    if (e->encode_done) touch_str(e->encode_done->error);
    if (e->prefill) {
        for (size_t i = 0; i < e->prefill->n_token_ids; i++) g_sink += (size_t)e->prefill->token_ids[i];
        for (size_t i = 0; i < e->prefill->n_images; i++)
            if (e->prefill->images[i]) g_sink += e->prefill->images[i]->offset + e->prefill->images[i]->n_tokens;
        touch_sampling(e->prefill->sampling);
        touch_str(e->prefill->decode_endpoint);
    }
    if (e->embeddings) touch_str(e->embeddings->error);
    if (e->tokens) {
        for (size_t i = 0; i < e->tokens->n_token_ids; i++) g_sink += (size_t)e->tokens->token_ids[i];
        for (size_t i = 0; i < e->tokens->n_logprobs; i++) {
            const Prism__TokenLogprobs *l = e->tokens->logprobs[i];
            for (size_t k = 0; l && k < l->n_top; k++) g_sink += (size_t)l->top[k]->token_id;
        }
        touch_str(e->tokens->error);
    }
    if (e->kv) touch_sampling(e->kv->sampling), g_sink += e->kv->n_blocks;
    if (e->abort) touch_str(e->abort->reason);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_init_once();
    Prism__Envelope *e = prism_msg_unpack(data, size);
    if (!e) return 0;
    FUZZ_ASSERT(e->version == PRISM_PROTOCOL_VERSION);
    touch(e);
    /* Packing what was unpacked writes exactly the size it announces. (No re-unpack check:
     * protobuf-c keeps unknown fields with tag 0 on unpack but refuses them when they come back.) */
    size_t n = prism__envelope__get_packed_size(e);
    uint8_t *a = malloc(n ? n : 1);
    FUZZ_ASSERT(prism__envelope__pack(e, a) == n);
    free(a);
    prism_msg_env_free(e);
    return 0;
}
