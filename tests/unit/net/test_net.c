/* Unit tests: ZeroMQ + protobuf framing, including corrupt messages, over real inproc sockets. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <string.h>
#include <stdatomic.h>
#include <unistd.h>

#include "net/net.h"

typedef struct {
    prism_net_t *net;
    void *router, *dealer;
} pair_t;

static int setup(void **state)
{
    static pair_t p;
    char err[256];
    prism_net_opts_t no = {.role = PRISM_NET_ROLE_ROUTER, .insecure = true};
    if (prism_net_create(&no, &p.net, err, sizeof(err)) != PRISM_OK) return -1;
    p.router = prism_sock_bind(p.net, &(prism_sock_opts_t){.type = ZMQ_ROUTER, .endpoint = "inproc://t", .hwm = 1000,
                                                          .max_msg_bytes = 1 << 20});
    p.dealer = prism_sock_connect(p.net, &(prism_sock_opts_t){.type = ZMQ_DEALER, .endpoint = "inproc://t", .hwm = 1000,
                                                             .max_msg_bytes = 1 << 20, .identity = "worker-1"});
    *state = &p;
    return p.router && p.dealer ? 0 : -1;
}

static int teardown(void **state)
{
    pair_t *p = *state;
    zmq_close(p->router);
    zmq_close(p->dealer);
    prism_net_destroy(p->net);
    return 0;
}

static void test_roundtrip_with_frames(void **state)
{
    pair_t *p = *state;
    Prism__Prefill pf = PRISM__PREFILL__INIT;
    int32_t ids[5] = {1, 2, 3, 4, 32000};
    pf.n_token_ids = 5;
    pf.token_ids = ids;
    pf.decode_endpoint = "tcp://127.0.0.1:9";
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_PREFILL;
    env.request_id = 77;
    env.router_id = "r1";
    env.prefill = &pf;
    float payload[1000];
    for (int i = 0; i < 1000; i++) payload[i] = (float)i * 0.5f;
    prism_frame_t f[2] = {{payload, sizeof(payload)}, {"abc", 3}};
    assert_int_equal(prism_msg_send(p->dealer, NULL, 0, &env, f, 2, 0), PRISM_OK);
    prism_msg_t m;
    assert_int_equal(prism_msg_recv(p->router, true, &m, 0), PRISM_OK);
    assert_int_equal(m.identity_len, 8);
    assert_memory_equal(m.identity, "worker-1", 8);
    assert_int_equal(m.env->type, PRISM__MSG_TYPE__MSG_PREFILL);
    assert_int_equal(m.env->request_id, 77);
    assert_string_equal(m.env->router_id, "r1");
    assert_int_equal(m.env->prefill->n_token_ids, 5);
    assert_int_equal(m.env->prefill->token_ids[4], 32000);
    assert_int_equal(m.n_frames, 2);
    size_t len;
    const float *got = prism_msg_frame(&m, 0, &len);
    assert_int_equal(len, sizeof(payload));
    assert_memory_equal(got, payload, sizeof(payload));
    assert_null(prism_msg_frame(&m, 5, &len));
    prism_msg_close(&m);
    /* reply by identity */
    Prism__Envelope ack = PRISM__ENVELOPE__INIT;
    ack.type = PRISM__MSG_TYPE__MSG_REGISTER_ACK;
    assert_int_equal(prism_msg_send(p->router, "worker-1", 8, &ack, NULL, 0, 0), PRISM_OK);
    assert_int_equal(prism_msg_recv(p->dealer, false, &m, 0), PRISM_OK);
    assert_int_equal(m.env->type, PRISM__MSG_TYPE__MSG_REGISTER_ACK);
    prism_msg_close(&m);
    assert_int_equal(prism_msg_recv(p->dealer, false, &m, ZMQ_DONTWAIT), PRISM_EAGAIN);
}

/* prism_msg_send_take: the frame's own buffer goes out (no copy) and ZeroMQ frees it once sent; an
 * envelope that cannot be sent still frees the buffers it was given. */
static void test_send_take_frees(void **state)
{
    pair_t *p = *state;
    size_t base = prism_mem_used();
    size_t n = 1 << 20;
    uint8_t *img = prism_malloc(n);
    for (size_t i = 0; i < n; i++) img[i] = (uint8_t)(i * 131);
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_ENCODE;
    env.request_id = 5;
    prism_frame_t f = {img, n};
    assert_int_equal(prism_msg_send_take(p->dealer, NULL, 0, &env, &f, 1, 0), PRISM_OK);
    prism_msg_t m;
    assert_int_equal(prism_msg_recv(p->router, true, &m, 0), PRISM_OK);
    size_t len;
    const uint8_t *got = prism_msg_frame(&m, 0, &len);
    assert_int_equal(len, n);
    for (size_t i = 0; i < n; i += 4099) assert_int_equal(got[i], (uint8_t)(i * 131));
    prism_msg_close(&m);
    /* freed from ZeroMQ's I/O thread once sent: wait for that state */
    for (int i = 0; i < 5000 && prism_mem_used() > base + 65536; i++) usleep(1000);
    assert_true(prism_mem_used() <= base + 65536);
    /* an envelope over the limit is refused before anything is sent: the frame is freed all the same */
    uint8_t *b2 = prism_malloc(n);
    Prism__Prefill pf = PRISM__PREFILL__INIT;
    pf.n_token_ids = (PRISM_MSG_MAX_ENVELOPE / 4) + 16;
    pf.token_ids = prism_calloc(pf.n_token_ids, sizeof(int32_t));
    for (size_t i = 0; i < pf.n_token_ids; i++) pf.token_ids[i] = 0x7fffffff;
    env.type = PRISM__MSG_TYPE__MSG_PREFILL;
    env.prefill = &pf;
    size_t before = prism_mem_used();
    prism_frame_t f2 = {b2, n};
    assert_int_equal(prism_msg_send_take(p->dealer, NULL, 0, &env, &f2, 1, 0), PRISM_ELIMIT);
    assert_true(prism_mem_used() <= before - n);
    prism_free(pf.token_ids);
}

/* A frame with a release callback goes by reference: the bytes received are the caller's buffer's,
 * and release runs exactly once, after the send (from ZeroMQ's I/O thread) or, when the message
 * cannot be sent, before the call returns; a copied frame beside it is untouched. */
static atomic_int released;
static void on_release(void *data, void *hint)
{
    assert_ptr_equal(data, hint);
    atomic_fetch_add(&released, 1);
}

static void test_send_by_reference(void **state)
{
    pair_t *p = *state;
    static uint8_t shared[100000];
    for (size_t i = 0; i < sizeof shared; i++) shared[i] = (uint8_t)(i * 7);
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_ENCODE;
    prism_frame_t f[2] = {{"copied", 6}, {shared, sizeof shared, on_release, shared}};
    atomic_store(&released, 0);
    assert_int_equal(prism_msg_send(p->dealer, NULL, 0, &env, f, 2, 0), PRISM_OK);
    prism_msg_t m;
    assert_int_equal(prism_msg_recv(p->router, true, &m, 0), PRISM_OK);
    size_t len;
    const uint8_t *got = prism_msg_frame(&m, 1, &len);
    assert_int_equal(len, sizeof shared);
    assert_memory_equal(got, shared, sizeof shared);
    prism_msg_close(&m);
    for (int i = 0; i < 5000 && atomic_load(&released) == 0; i++) usleep(1000);
    assert_int_equal(atomic_load(&released), 1);
    /* an envelope over the limit: nothing sent, the frame released before the call returns */
    Prism__Prefill pf = PRISM__PREFILL__INIT;
    pf.n_token_ids = (PRISM_MSG_MAX_ENVELOPE / 4) + 16;
    pf.token_ids = prism_calloc(pf.n_token_ids, sizeof(int32_t));
    for (size_t i = 0; i < pf.n_token_ids; i++) pf.token_ids[i] = 0x7fffffff;
    env.type = PRISM__MSG_TYPE__MSG_PREFILL;
    env.prefill = &pf;
    assert_int_equal(prism_msg_send(p->dealer, NULL, 0, &env, f, 2, 0), PRISM_ELIMIT);
    assert_int_equal(atomic_load(&released), 2);
    prism_free(pf.token_ids);
}

/* Shared bytes sent by reference (prism_shared_t, release = unref): twice here, and freed only once
 * the holder and both frames have let go, whoever is last. */
static void unref_hint(void *data, void *hint)
{
    (void)data;
    prism_shared_unref(hint);
}

static void test_send_shared_by_reference(void **state)
{
    pair_t *p = *state;
    size_t base = prism_mem_used();
    size_t n = 4 << 20;
    uint8_t *img = prism_malloc(n);
    for (size_t i = 0; i < n; i++) img[i] = (uint8_t)(i * 7);
    prism_shared_t *sh = prism_shared_take(img, n);
    assert_non_null(sh);
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_ENCODE;
    for (int k = 0; k < 2; k++) {
        prism_frame_t f = {img, n, unref_hint, prism_shared_ref(sh)};
        assert_int_equal(prism_msg_send(p->dealer, NULL, 0, &env, &f, 1, 0), PRISM_OK);
    }
    prism_shared_unref(sh);                           /* the holder lets go first: the frames keep it */
    assert_true(prism_mem_used() >= base + n);        /* (a copy would have let it go here) */
    for (int k = 0; k < 2; k++) {
        prism_msg_t m;
        assert_int_equal(prism_msg_recv(p->router, true, &m, 0), PRISM_OK);
        size_t len;
        const uint8_t *got = prism_msg_frame(&m, 0, &len);
        assert_int_equal(len, n);
        for (size_t i = 0; i < n; i += 4099) assert_int_equal(got[i], (uint8_t)(i * 7));
        prism_msg_close(&m);
    }
    for (int i = 0; i < 5000 && prism_mem_used() > base + 65536; i++) usleep(1000);
    assert_true(prism_mem_used() <= base + 65536);
}

static void test_corrupt_messages_dropped(void **state)
{
    pair_t *p = *state;
    prism_msg_t m;
    /* garbage envelope */
    zmq_send(p->dealer, "\xff\xff\xff\xff\x0f", 5, 0);
    assert_int_equal(prism_msg_recv(p->router, true, &m, 0), PRISM_ECORRUPT);
    /* valid protobuf, wrong protocol version */
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.version = 999;
    env.type = PRISM__MSG_TYPE__MSG_HEARTBEAT;
    uint8_t buf[64];
    size_t n = prism__envelope__pack(&env, buf);
    zmq_send(p->dealer, buf, n, ZMQ_SNDMORE);
    zmq_send(p->dealer, "x", 1, 0);
    assert_int_equal(prism_msg_recv(p->router, true, &m, 0), PRISM_ECORRUPT);
    /* too many frames */
    Prism__Envelope ok = PRISM__ENVELOPE__INIT;
    ok.type = PRISM__MSG_TYPE__MSG_HEARTBEAT;
    prism_frame_t f[PRISM_MSG_MAX_FRAMES + 1];
    for (int i = 0; i < PRISM_MSG_MAX_FRAMES + 1; i++) f[i] = (prism_frame_t){"y", 1};
    prism_msg_send(p->dealer, NULL, 0, &ok, f, PRISM_MSG_MAX_FRAMES + 1, 0);
    assert_int_equal(prism_msg_recv(p->router, true, &m, 0), PRISM_ECORRUPT);
    /* random mutations of a real envelope: never a crash, every part consumed */
    Prism__Tokens t = PRISM__TOKENS__INIT;
    int32_t ids[3] = {5, 6, 7};
    t.n_token_ids = 3;
    t.token_ids = ids;
    t.error = "e";
    ok.type = PRISM__MSG_TYPE__MSG_TOKENS;
    ok.version = PRISM_PROTOCOL_VERSION;
    ok.tokens = &t;
    uint8_t good[256];
    size_t gn = prism__envelope__pack(&ok, good);
    uint64_t s = 12345;
    for (int it = 0; it < 2000; it++) {
        uint8_t mut[256];
        memcpy(mut, good, gn);
        size_t len = gn;
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        if (s % 3 == 0) len = (size_t)(s >> 33) % gn;
        for (int k = 0; k < 3; k++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            mut[(s >> 33) % gn] ^= (uint8_t)(s >> 20);
        }
        zmq_send(p->dealer, mut, len, 0);
        int rc = prism_msg_recv(p->router, true, &m, 0);
        assert_true(rc == PRISM_OK || rc == PRISM_ECORRUPT);
        if (rc == PRISM_OK) prism_msg_close(&m);
    }
    assert_int_equal(prism_msg_recv(p->router, true, &m, ZMQ_DONTWAIT), PRISM_EAGAIN);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_with_frames),
        cmocka_unit_test(test_send_take_frees),
        cmocka_unit_test(test_send_by_reference),
        cmocka_unit_test(test_send_shared_by_reference),
        cmocka_unit_test(test_corrupt_messages_dropped),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
