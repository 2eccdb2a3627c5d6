/* Unit tests: how the router picks a worker (router/workers.c) — least loaded with a free slot,
 * equally loaded workers in turn, embedding-cache affinity bounded by ROUTER_AFFINITY_SLACK, and a
 * worker whose last send failed passed over until it is heard from again; stuck and draining workers
 * are never picked, ties included; a migration's target (router_pick_kv_target); the images requests
 * let go unanswered, whose late EncodeDone is taken once from the encoder they went to. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "router.h"

static router_t R;

static router_worker_t *add(const char *id, Prism__Role role, uint32_t slots)
{
    Prism__Register g = PRISM__REGISTER__INIT;
    g.worker_id = (char *)id;
    g.role = role;
    g.data_endpoint = role == PRISM__ROLE__ROLE_ENCODER ? "" : "tcp://127.0.0.1:1";
    g.max_running = slots;
    g.kv_blocks = role == PRISM__ROLE__ROLE_DECODE ? 100 : 0;
    char why[200];
    assert_int_equal(router_worker_register(&R, id, "", &g, why, sizeof(why)), PRISM_OK);
    router_worker_t *w = router_worker_by_id(&R, id);
    assert_non_null(w);
    return w;
}

static int setup(void **state)
{
    (void)state;
    memset(&R, 0, sizeof(R));
    R.max_model_len = 0;
    return 0;
}

static router_worker_t *pick(Prism__Role role, uint64_t hash)
{
    bool any;
    return router_pick(&R, role, hash, &any);
}

static void test_ties_take_turns(void **state)
{
    (void)state;
    router_worker_t *w[3] = {add("e0", PRISM__ROLE__ROLE_ENCODER, 4), add("e1", PRISM__ROLE__ROLE_ENCODER, 4),
                             add("e2", PRISM__ROLE__ROLE_ENCODER, 4)};
    int got[3] = {0};
    for (int i = 0; i < 30; i++) {
        router_worker_t *p = pick(PRISM__ROLE__ROLE_ENCODER, 0);
        for (int k = 0; k < 3; k++) got[k] += p == w[k];
    }
    /* idle and equal: each gets a third, not the first all */
    assert_int_equal(got[0], 10);
    assert_int_equal(got[1], 10);
    assert_int_equal(got[2], 10);
    /* a less loaded worker still wins outright */
    w[0]->inflight = 1;
    w[2]->inflight = 1;
    for (int i = 0; i < 5; i++) assert_ptr_equal(pick(PRISM__ROLE__ROLE_ENCODER, 0), w[1]);
    /* decode: equal free KV and in-flight is a tie too */
    router_worker_t *d0 = add("d0", PRISM__ROLE__ROLE_DECODE, 8), *d1 = add("d1", PRISM__ROLE__ROLE_DECODE, 8);
    router_worker_t *a = pick(PRISM__ROLE__ROLE_DECODE, 0), *b = pick(PRISM__ROLE__ROLE_DECODE, 0);
    assert_true((a == d0 && b == d1) || (a == d1 && b == d0));
    d0->kv_free_blocks = 50;   /* less free KV: more loaded */
    assert_ptr_equal(pick(PRISM__ROLE__ROLE_DECODE, 0), d1);
}

static void test_full_and_unreachable_workers_are_passed_over(void **state)
{
    (void)state;
    router_worker_t *a = add("p0", PRISM__ROLE__ROLE_PREFILL, 2), *b = add("p1", PRISM__ROLE__ROLE_PREFILL, 2);
    a->inflight = 2;                       /* full */
    assert_ptr_equal(pick(PRISM__ROLE__ROLE_PREFILL, 0), b);
    b->send_failed_at = b->last_seen + 1;  /* its connection is gone */
    bool any = false;
    assert_null(router_pick(&R, PRISM__ROLE__ROLE_PREFILL, 0, &any));
    assert_true(any);                      /* registered: the request waits instead of a 503 */
    b->last_seen = b->send_failed_at + 1;  /* heard from again */
    assert_ptr_equal(pick(PRISM__ROLE__ROLE_PREFILL, 0), b);
}

static void test_stuck_and_draining_workers_are_passed_over(void **state)
{
    (void)state;
    /* first in table order: a tie scan that forgot one of them would hand it every other request */
    router_worker_t *stuck = add("p0", PRISM__ROLE__ROLE_PREFILL, 4), *drain = add("p1", PRISM__ROLE__ROLE_PREFILL, 4);
    router_worker_t *a = add("p2", PRISM__ROLE__ROLE_PREFILL, 4), *b = add("p3", PRISM__ROLE__ROLE_PREFILL, 4);
    stuck->stuck = true;
    drain->draining = true;
    int got_a = 0, got_b = 0;
    for (int i = 0; i < 20; i++) {
        router_worker_t *p = pick(PRISM__ROLE__ROLE_PREFILL, 0);
        assert_true(p == a || p == b);
        got_a += p == a;
        got_b += p == b;
    }
    assert_int_equal(got_a, 10);
    assert_int_equal(got_b, 10);
    /* only a draining worker left: nothing is picked, but the request waits (no 503) */
    a->used = b->used = false;
    bool any = false;
    assert_null(router_pick(&R, PRISM__ROLE__ROLE_PREFILL, 0, &any));
    assert_true(any);
    /* only a stuck one: nothing to wait for */
    drain->used = false;
    assert_null(router_pick(&R, PRISM__ROLE__ROLE_PREFILL, 0, &any));
    assert_false(any);
}

static void test_migration_target(void **state)
{
    (void)state;
    /* preemption by migration: another decode worker, of the source's block size, with a slot and the
     * sequence's blocks + 2% of its pool free (its last heartbeat), the most free first */
    router_worker_t *src = add("d0", PRISM__ROLE__ROLE_DECODE, 4), *a = add("d1", PRISM__ROLE__ROLE_DECODE, 4);
    router_worker_t *b = add("d2", PRISM__ROLE__ROLE_DECODE, 4);
    add("p0", PRISM__ROLE__ROLE_PREFILL, 4);
    src->block_size = a->block_size = b->block_size = 16;
    src->kv_free_blocks = 100;   /* the most free of all, but the source itself */
    a->kv_free_blocks = 40;
    b->kv_free_blocks = 30;
    assert_ptr_equal(router_pick_kv_target(&R, src, 10), a);
    assert_ptr_equal(router_pick_kv_target(&R, src, 28), a);   /* 28 + 2 <= 40 (and <= 30: the most free wins) */
    assert_ptr_equal(router_pick_kv_target(&R, src, 38), a);
    assert_null(router_pick_kv_target(&R, src, 39));   /* 39 + 2 > 40: none has room */
    a->inflight = 4;                                   /* no slot */
    assert_ptr_equal(router_pick_kv_target(&R, src, 10), b);
    b->draining = true;
    assert_null(router_pick_kv_target(&R, src, 10));
    b->draining = false;
    b->block_size = 32;                                /* another layout */
    assert_null(router_pick_kv_target(&R, src, 10));
    b->block_size = 16;
    b->send_failed_at = b->last_seen + 1;              /* unreachable */
    assert_null(router_pick_kv_target(&R, src, 10));
}

static void test_affinity_is_bounded(void **state)
{
    (void)state;
    router_worker_t *warm = add("e0", PRISM__ROLE__ROLE_ENCODER, 64), *cold = add("e1", PRISM__ROLE__ROLE_ENCODER, 64);
    router_worker_note_image(warm, 0xabc);
    /* the warm encoder wins while it is not much busier than the least loaded */
    for (int load = 0; load <= ROUTER_AFFINITY_SLACK; load++) {
        warm->inflight = load;
        assert_ptr_equal(pick(PRISM__ROLE__ROLE_ENCODER, 0xabc), warm);
    }
    /* beyond the slack the least loaded takes it (a new encoder must get work even when every
     * image of the load was seen before) */
    warm->inflight = ROUTER_AFFINITY_SLACK + 1;
    assert_ptr_equal(pick(PRISM__ROLE__ROLE_ENCODER, 0xabc), cold);
    /* an unknown image goes by load alone */
    warm->inflight = 1;
    assert_ptr_equal(pick(PRISM__ROLE__ROLE_ENCODER, 0x123), cold);
    /* a full warm encoder is not picked at all */
    warm->inflight = 64;
    cold->inflight = 63;
    assert_ptr_equal(pick(PRISM__ROLE__ROLE_ENCODER, 0xabc), cold);
}

static router_worker_t *add_decode(const char *id, uint32_t blocks, uint32_t slots)
{
    Prism__Register g = PRISM__REGISTER__INIT;
    g.worker_id = (char *)id;
    g.role = PRISM__ROLE__ROLE_DECODE;
    g.data_endpoint = "tcp://127.0.0.1:1";
    g.max_running = slots;
    g.kv_blocks = blocks;
    g.block_size = 16;
    g.max_model_len = 1024;
    char why[200];
    assert_int_equal(router_worker_register(&R, id, "", &g, why, sizeof(why)), PRISM_OK);
    return router_worker_by_id(&R, id);
}

static router_worker_t *add_prefill(const char *id, uint32_t kv_blocks)
{
    Prism__Register g = PRISM__REGISTER__INIT;
    g.worker_id = (char *)id;
    g.role = PRISM__ROLE__ROLE_PREFILL;
    g.data_endpoint = "tcp://127.0.0.1:1";
    g.max_running = 64;
    g.kv_blocks = kv_blocks;
    g.block_size = 16;
    char why[200];
    assert_int_equal(router_worker_register(&R, id, "", &g, why, sizeof(why)), PRISM_OK);
    return router_worker_by_id(&R, id);
}

static router_worker_t *pick_kv(uint64_t prompt, uint64_t more)
{
    bool any;
    router_want_t want = {.role = PRISM__ROLE__ROLE_DECODE, .slots = 1, .kv_prompt = prompt, .kv_more = more};
    return router_pick_want(&R, &want, &any);
}

/* The decode pick weighs KV room (issue 28 item 4): free blocks less the expected growth of what
 * runs there and the request's own, not the count of sequences alone. */
static void test_decode_pick_weighs_kv_room(void **state)
{
    (void)state;
    router_worker_t *small = add_decode("d0", 48, 8), *big = add_decode("d1", 512, 8);
    /* blocks for 20 + 200 tokens of 16: 14 */
    assert_int_equal(router_kv_blocks(small, 20, 200, 1), 14);
    assert_int_equal(router_kv_blocks(small, 20, 5000, 1), 64);      /* at most its context */
    assert_int_equal(router_kv_blocks(small, 64, 64, 3), 4 + 3 * 4); /* n = 3 share the prompt's blocks */
    /* small: one long sequence expected to grow to 39 blocks (10 used so far); big: two, more running */
    small->inflight = 1;
    small->kv_free_blocks = 38;
    small->kv_expect = 39;
    big->inflight = 2;
    big->kv_free_blocks = 492;
    big->kv_expect = 78;
    assert_int_equal(router_kv_room(small, &(router_want_t){.slots = 1, .kv_prompt = 20, .kv_more = 200}), 48 - 39 - 14);
    for (int i = 0; i < 4; i++) assert_ptr_equal(pick_kv(20, 200), big);
    /* what was sent since the last heartbeat counts although its blocks are not reported yet ... */
    small->kv_expect = 0;
    small->kv_free_blocks = 48;
    assert_ptr_equal(pick_kv(20, 10), small);
    small->kv_sent = 40;
    assert_ptr_equal(pick_kv(20, 10), big);
    /* ... until a heartbeat reports the pool */
    Prism__Heartbeat hb = PRISM__HEARTBEAT__INIT;
    hb.kv_free_blocks = 48;
    assert_true(router_worker_heartbeat(&R, "d0", &hb));
    assert_int_equal(small->kv_sent, 0);
    assert_ptr_equal(pick_kv(20, 10), small);
    /* room anywhere beats none: the small one full, the big one busier but with room */
    small->kv_expect = 60;
    big->inflight = 7;
    assert_ptr_equal(pick_kv(20, 200), big);
    /* no room anywhere: one of them rather than nothing (the decode worker preempts) */
    big->kv_expect = 600;
    assert_non_null(pick_kv(20, 200));
}

/* One PrefixEvents message into w's index: stored keys[lo, hi), evicted keys[elo, ehi). */
static bool events(router_worker_t *w, const prism_kv_key_t *k, int lo, int hi, int elo, int ehi, bool reset)
{
    uint8_t st[64 * PRISM_KV_PREFIX_KEY_BYTES], ev[64 * PRISM_KV_PREFIX_KEY_BYTES];
    prism_kv_prefix_keys_put(k + lo, hi - lo, st);
    prism_kv_prefix_keys_put(k + elo, ehi - elo, ev);
    Prism__PrefixEvents e = PRISM__PREFIX_EVENTS__INIT;
    e.stored = (ProtobufCBinaryData){(size_t)(hi - lo) * PRISM_KV_PREFIX_KEY_BYTES, st};
    e.evicted = (ProtobufCBinaryData){(size_t)(ehi - elo) * PRISM_KV_PREFIX_KEY_BYTES, ev};
    e.reset = reset;
    return router_prefix_index_apply(&w->prefix, &e);
}

static router_worker_t *pick_prefix(const prism_kv_key_t *k, int n)
{
    bool any;
    router_want_t want = {.role = PRISM__ROLE__ROLE_PREFILL, .slots = 1, .prefix_keys = k, .n_prefix_keys = n,
                          .prefix_block_size = 16};
    return router_pick_want(&R, &want, &any);
}

/* A prompt goes to the prefill whose index (its events) holds its longest leading run of block
 * keys, within ROUTER_AFFINITY_SLACK of the least loaded; evictions and resets shorten it; a
 * malformed or oversized message changes nothing; the set never outgrows the worker's pool. */
static void test_prefix_affinity_and_events(void **state)
{
    (void)state;
    router_worker_t *a = add_prefill("p0", 64), *b = add_prefill("p1", 64);
    prism_kv_key_t k[8];
    for (int i = 0; i < 8; i++) k[i] = (prism_kv_key_t){0x1000 + (uint64_t)i * 977, 0x77 + (uint64_t)i};
    assert_true(events(b, k, 0, 5, 0, 0, false));
    assert_int_equal(router_worker_prefix_hit(b, k, 8, 16), 5);
    assert_int_equal(router_worker_prefix_hit(b, k, 8, 32), 0);   /* another block size: no hit */
    for (int load = 0; load <= ROUTER_AFFINITY_SLACK; load++) {
        b->inflight = load;
        assert_ptr_equal(pick_prefix(k, 8), b);
    }
    b->inflight = ROUTER_AFFINITY_SLACK + 1;   /* beyond the slack: the least loaded */
    assert_ptr_equal(pick_prefix(k, 8), a);
    b->inflight = 1;
    /* the longest prefix wins: b loses block 2 (its run is 2), a holds 6 */
    assert_true(events(b, k, 0, 0, 2, 3, false));
    assert_int_equal(router_worker_prefix_hit(b, k, 8, 16), 2);
    assert_true(events(a, k, 0, 6, 0, 0, false));
    a->inflight = 2;
    assert_ptr_equal(pick_prefix(k, 8), a);
    /* malformed: not whole keys, or more than a message carries: refused, nothing changed */
    Prism__PrefixEvents e = PRISM__PREFIX_EVENTS__INIT;
    uint8_t junk[(PRISM_KV_PREFIX_EVENTS + 1) * PRISM_KV_PREFIX_KEY_BYTES] = {0};
    e.stored = (ProtobufCBinaryData){17, junk};
    e.reset = true;
    assert_false(router_prefix_index_apply(&a->prefix, &e));
    e.stored = (ProtobufCBinaryData){sizeof junk, junk};
    assert_false(router_prefix_index_apply(&a->prefix, &e));
    assert_false(router_prefix_index_apply(&a->prefix, NULL));
    assert_int_equal(router_worker_prefix_hit(a, k, 8, 16), 6);
    /* a reset forgets all (then lists what is held) */
    assert_true(events(a, k, 0, 1, 0, 0, true));
    assert_int_equal(router_worker_prefix_hit(a, k, 8, 16), 1);
    assert_int_equal(a->prefix.n, 1);
    /* bounded by the worker's pool: a worker of 4 blocks claiming 8 has its set started again */
    router_worker_t *c = add_prefill("p2", 4);
    assert_true(events(c, k, 0, 8, 0, 0, false));
    assert_true(c->prefix.n <= 4);
    assert_true(c->prefix.resets >= 1);
    router_worker_drop(a);
    router_worker_drop(b);
    router_worker_drop(c);
}

/* Images a request let go unanswered (it ended before its encoder's EncodeDone came, or its attempt
 * was released): the answer is taken once, under the whole id, from the encoder it went to, the same
 * process; nothing else matches. The table is a ring of ROUTER_MAX_ENC_LATE: when full, the oldest
 * goes (never grown), so a flood of ids costs nothing but late timings. */
static void test_let_go_answers_taken_once(void **state)
{
    (void)state;
    router_worker_t *e0 = add("e0", PRISM__ROLE__ROLE_ENCODER, 4), *e1 = add("e1", PRISM__ROLE__ROLE_ENCODER, 4);
    e0->instance = 7;
    e1->instance = 8;
    router_worker_note_let_go(&R, e0, 100, 1, 0);
    router_worker_note_let_go(&R, e0, 100, 1, 1);
    assert_false(router_worker_take_let_go(&R, e1, 100, 1, 0));   /* another encoder */
    assert_false(router_worker_take_let_go(&R, e0, 100, 2, 0));   /* the low half only */
    assert_false(router_worker_take_let_go(&R, e0, 101, 1, 0));   /* an id never let go */
    assert_false(router_worker_take_let_go(&R, e0, 100, 1, 2));   /* an image not sent there */
    assert_false(router_worker_take_let_go(&R, e0, 0, 0, 0));     /* a free entry */
    e0->instance = 9;                                             /* it restarted under the same id */
    assert_false(router_worker_take_let_go(&R, e0, 100, 1, 0));
    e0->instance = 7;
    assert_true(router_worker_take_let_go(&R, e0, 100, 1, 0));
    assert_false(router_worker_take_let_go(&R, e0, 100, 1, 0));   /* once: a duplicate counts nothing */
    assert_true(router_worker_take_let_go(&R, e0, 100, 1, 1));
    /* bounded: the ring overwrites its oldest */
    for (uint64_t k = 0; k < ROUTER_MAX_ENC_LATE + 10; k++) router_worker_note_let_go(&R, e1, 1000 + k, 5, 3);
    for (uint64_t k = 0; k < 10; k++) assert_false(router_worker_take_let_go(&R, e1, 1000 + k, 5, 3));
    for (uint64_t k = 10; k < ROUTER_MAX_ENC_LATE + 10; k++) assert_true(router_worker_take_let_go(&R, e1, 1000 + k, 5, 3));
    router_worker_drop(e0);
    router_worker_drop(e1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_ties_take_turns, setup),
        cmocka_unit_test_setup(test_full_and_unreachable_workers_are_passed_over, setup),
        cmocka_unit_test_setup(test_stuck_and_draining_workers_are_passed_over, setup),
        cmocka_unit_test_setup(test_affinity_is_bounded, setup),
        cmocka_unit_test_setup(test_migration_target, setup),
        cmocka_unit_test_setup(test_decode_pick_weighs_kv_room, setup),
        cmocka_unit_test_setup(test_prefix_affinity_and_events, setup),
        cmocka_unit_test_setup(test_let_go_answers_taken_once, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
