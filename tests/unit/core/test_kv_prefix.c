/* Unit tests: the block-level prefix cache (kv/prefix.h): the key chain (what it separates), the
 * index (match, insert, LRU eviction that never takes a block a request holds), and a randomized
 * run against a reference model of what the cache may hold. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <string.h>
#include <stdlib.h>

#include "core/core.h"
#include "kv/prefix.h"

#define BS 4

static void fill(int32_t *t, int n, int seed)
{
    for (int i = 0; i < n; i++) t[i] = (seed * 131 + i * 7) % 1000;
}

static bool same(prism_kv_key_t a, prism_kv_key_t b) { return a.lo == b.lo && a.hi == b.hi; }

/* Block i's key depends on everything before and in it, and on nothing after it. */
static void test_chain_separates(void **state)
{
    prism_kv_blocks_t b;
    prism_kv_prefix_t c;
    assert_int_equal(prism_kv_blocks_init(&b, 16, BS), PRISM_OK);
    assert_int_equal(prism_kv_prefix_init(&c, &b), PRISM_OK);
    int32_t t[24], u[24];
    prism_kv_key_t k[6], k2[6];
    fill(t, 24, 1);
    assert_int_equal(prism_kv_prefix_keys(&c, NULL, 0, t, 23, NULL, 0, k), 5);   /* full blocks only */
    assert_int_equal(prism_kv_prefix_keys(&c, NULL, 0, t, 24, NULL, 0, k), 6);
    /* a token changed in block 2: blocks 0-1 equal, 2.. differ (the chain carries it on) */
    memcpy(u, t, sizeof t);
    u[9]++;
    prism_kv_prefix_keys(&c, NULL, 0, u, 24, NULL, 0, k2);
    assert_true(same(k[0], k2[0]) && same(k[1], k2[1]));
    for (int i = 2; i < 6; i++) assert_false(same(k[i], k2[i]));
    /* the salt is in the root: every block differs; an empty salt is no salt */
    prism_kv_prefix_keys(&c, "alice", 5, t, 24, NULL, 0, k2);
    for (int i = 0; i < 6; i++) assert_false(same(k[i], k2[i]));
    prism_kv_prefix_keys(&c, "", 0, t, 24, NULL, 0, k2);
    assert_true(same(k[5], k2[5]));
    prism_kv_key_t k3[6];
    prism_kv_prefix_keys(&c, "alicf", 5, t, 24, NULL, 0, k3);
    prism_kv_prefix_keys(&c, "alice", 5, t, 24, NULL, 0, k2);
    assert_false(same(k3[0], k2[0]));
    /* an image over tokens 6..13 (blocks 1-3): its content hash and its grid are in those blocks'
     * keys and every later one, not in block 0 */
    prism_kv_image_t img = {.offset = 6, .n_tokens = 8, .content_hash = 0x1234};
    prism_kv_key_t ki[6], kj[6];
    prism_kv_prefix_keys(&c, NULL, 0, t, 24, &img, 1, ki);
    assert_true(same(ki[0], k[0]));
    for (int i = 1; i < 6; i++) assert_false(same(ki[i], k[i]));   /* an image is not its placeholder tokens */
    img.content_hash ^= 1;   /* one bit of another image */
    prism_kv_prefix_keys(&c, NULL, 0, t, 24, &img, 1, kj);
    assert_true(same(ki[0], kj[0]));
    for (int i = 1; i < 6; i++) assert_false(same(ki[i], kj[i]));
    img.content_hash ^= 1;
    img.grid_cols = 2;   /* the same file under another geometry */
    prism_kv_prefix_keys(&c, NULL, 0, t, 24, &img, 1, kj);
    for (int i = 1; i < 6; i++) assert_false(same(ki[i], kj[i]));
    /* another cache (process) keys with another secret */
    prism_kv_prefix_t c2;
    assert_int_equal(prism_kv_prefix_init(&c2, &b), PRISM_OK);
    prism_kv_prefix_keys(&c2, NULL, 0, t, 24, NULL, 0, k2);
    assert_false(same(k[0], k2[0]));
    prism_kv_prefix_free(&c2);
    prism_kv_prefix_free(&c);
    prism_kv_blocks_free_all(&b);
}

/* Match takes the leading blocks held; insert keeps new ones; eviction frees only blocks nobody
 * but the cache holds, the tail of a prompt before its head. */
static void test_match_insert_evict(void **state)
{
    prism_kv_blocks_t b;
    prism_kv_prefix_t c;
    assert_int_equal(prism_kv_blocks_init(&b, 8, BS), PRISM_OK);
    assert_int_equal(prism_kv_prefix_init(&c, &b), PRISM_OK);
    int32_t t[16], ids[8], got[8];
    prism_kv_key_t k[4];
    fill(t, 16, 2);
    prism_kv_prefix_keys(&c, NULL, 0, t, 16, NULL, 0, k);
    assert_int_equal(prism_kv_prefix_match(&c, k, 4, got), 0);
    assert_int_equal(prism_kv_prefix_alloc(&c, 4, ids), PRISM_OK);
    prism_kv_prefix_insert(&c, k, ids, 4);
    assert_int_equal(c.n_cached, 4);
    prism_kv_blocks_release(&b, ids, 4);          /* the request is done: the cache keeps them */
    assert_int_equal(b.n_free, 4);
    /* a request sharing the first 3 blocks */
    assert_int_equal(prism_kv_prefix_match(&c, k, 3, got), 3);
    for (int i = 0; i < 3; i++) assert_int_equal(got[i], ids[i]);
    assert_int_equal(prism_kv_blocks_holders(&b, ids[0]), 2);
    /* it needs 5 more: 4 free, and the one block only the cache holds (block 3, the tail) goes */
    int32_t more[8];
    assert_int_equal(prism_kv_prefix_alloc(&c, 5, more), PRISM_OK);
    assert_int_equal(c.n_cached, 3);
    assert_int_equal(c.evictions, 1);
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 3; j++) assert_true(more[i] != ids[j]);   /* a held block is never handed out */
    /* nothing left to evict: all-or-nothing */
    int32_t one[1];
    assert_int_equal(prism_kv_prefix_alloc(&c, 1, one), PRISM_EAGAIN);
    assert_int_equal(c.n_cached, 3);
    prism_kv_blocks_release(&b, more, 5);
    prism_kv_blocks_release(&b, got, 3);
    assert_int_equal(prism_kv_prefix_match(&c, k, 4, got), 3);   /* block 3 is gone, so is its match */
    prism_kv_blocks_release(&b, got, 3);
    /* after the tail, the least recent goes: block 2 before 1 before 0 */
    assert_int_equal(prism_kv_prefix_alloc(&c, 6, more), PRISM_OK);
    assert_int_equal(c.n_cached, 2);
    assert_int_equal(prism_kv_prefix_match(&c, k, 4, got), 2);
    prism_kv_blocks_release(&b, got, 2);
    prism_kv_blocks_release(&b, more, 6);
    assert_int_equal(prism_kv_prefix_clear(&c), 2);
    assert_int_equal(b.n_free, 8);
    prism_kv_prefix_free(&c);
    prism_kv_blocks_free_all(&b);
}

/* Random prompts from a few shared stems through a tiny pool: every match names blocks inserted
 * under that key and not evicted since (a reference map says which id holds which key), no block is
 * held twice by the cache, and the pool is whole at the end. */
static void test_random_against_reference(void **state)
{
    enum { NB = 12, MAXB = 6 };
    prism_kv_blocks_t b;
    prism_kv_prefix_t c;
    assert_int_equal(prism_kv_blocks_init(&b, NB, BS), PRISM_OK);
    assert_int_equal(prism_kv_prefix_init(&c, &b), PRISM_OK);
    srand(7);
    /* what each block's contents are: the key of the prompt block written into it last */
    prism_kv_key_t content[NB];
    memset(content, 0, sizeof content);
    for (int it = 0; it < 3000; it++) {
        int32_t t[MAXB * BS];
        int stem = rand() % 4, n_tok = BS + rand() % (MAXB * BS - BS + 1);
        fill(t, MAXB * BS, stem);
        if (rand() % 2) t[rand() % n_tok] = 5000 + rand() % 3;   /* a variant */
        prism_kv_key_t k[MAXB];
        int n_full = prism_kv_prefix_keys(&c, NULL, 0, t, n_tok, NULL, 0, k);
        int nb = (n_tok + BS - 1) / BS;
        int32_t ids[MAXB];
        int h = prism_kv_prefix_match(&c, k, PRISM_MIN(n_full, (n_tok - 1) / BS), ids);
        for (int i = 0; i < h; i++) assert_true(same(content[ids[i]], k[i]));   /* never a stale block */
        if (prism_kv_prefix_alloc(&c, nb - h, ids + h) != PRISM_OK) {
            prism_kv_blocks_release(&b, ids, h);
            continue;
        }
        for (int i = h; i < nb; i++) content[ids[i]] = i < n_full ? k[i] : (prism_kv_key_t){0, 0};   /* "computed" */
        prism_kv_prefix_insert(&c, k, ids, n_full);
        prism_kv_blocks_release(&b, ids, nb);
        /* the cache holds each of its blocks once, and only those */
        int held = 0;
        for (int i = 0; i < NB; i++) {
            int hold = prism_kv_blocks_holders(&b, i);
            assert_true(hold <= 1);
            held += hold;
        }
        assert_int_equal(held, c.n_cached);
        assert_int_equal(b.n_free, NB - c.n_cached);
    }
    assert_true(c.evictions > 0);
    prism_kv_prefix_free(&c);
    assert_int_equal(b.n_free, NB);
    prism_kv_blocks_free_all(&b);
}

/* The routers' side of the keys: the chain under an explicit secret is the cache's own under its
 * secret; derived secrets agree for one seed and differ across seeds; keys survive the wire. */
static void test_chain_secret_and_wire(void **state)
{
    prism_kv_blocks_t b;
    prism_kv_prefix_t c;
    assert_int_equal(prism_kv_blocks_init(&b, 16, BS), PRISM_OK);
    assert_int_equal(prism_kv_prefix_init(&c, &b), PRISM_OK);
    int32_t t[24];
    fill(t, 24, 3);
    prism_kv_image_t img = {.offset = 5, .n_tokens = 6, .grid_rows = 2, .grid_cols = 3, .content_hash = 77};
    prism_kv_key_t k[6], k2[6], k3[6];
    prism_kv_prefix_keys(&c, "s", 1, t, 24, &img, 1, k);
    assert_int_equal(prism_kv_prefix_chain(c.secret, BS, "s", 1, t, 24, &img, 1, k2), 6);
    for (int i = 0; i < 6; i++) assert_true(same(k[i], k2[i]));
    uint8_t s1[PRISM_KV_PREFIX_SECRET_BYTES], s2[PRISM_KV_PREFIX_SECRET_BYTES], s3[PRISM_KV_PREFIX_SECRET_BYTES];
    assert_int_equal(prism_kv_prefix_secret(s1, "router-key-A", 12), PRISM_OK);
    assert_int_equal(prism_kv_prefix_secret(s2, "router-key-A", 12), PRISM_OK);
    assert_int_equal(prism_kv_prefix_secret(s3, "router-key-B", 12), PRISM_OK);
    assert_memory_equal(s1, s2, sizeof s1);   /* two routers of one cluster name a prefix alike */
    prism_kv_prefix_chain(s1, BS, NULL, 0, t, 24, NULL, 0, k);
    prism_kv_prefix_chain(s3, BS, NULL, 0, t, 24, NULL, 0, k2);
    for (int i = 0; i < 6; i++) assert_false(same(k[i], k2[i]));   /* another cluster never aliases */
    uint8_t wire[6 * PRISM_KV_PREFIX_KEY_BYTES];
    prism_kv_prefix_keys_put(k, 6, wire);
    prism_kv_prefix_keys_get(wire, 6, k3);
    for (int i = 0; i < 6; i++) assert_true(same(k[i], k3[i]));
    assert_int_equal(wire[0], (uint8_t)k[0].lo);   /* little endian, lo first */
    assert_int_equal(wire[8], (uint8_t)k[0].hi);
    prism_kv_prefix_free(&c);
    prism_kv_blocks_free_all(&b);
    (void)state;
}

static bool listed(const prism_kv_key_t *l, int n, prism_kv_key_t k)
{
    for (int i = 0; i < n; i++)
        if (same(l[i], k)) return true;
    return false;
}

/* The event log: what was kept and evicted since the last take, net; past its bound a reset that
 * lists the most recent keys held. */
static void test_events(void **state)
{
    enum { N = PRISM_KV_PREFIX_EVENTS + 8 };
    prism_kv_blocks_t b;
    prism_kv_prefix_t c;
    prism_kv_prefix_log_t log;
    assert_int_equal(prism_kv_blocks_init(&b, N, BS), PRISM_OK);
    assert_int_equal(prism_kv_prefix_init(&c, &b), PRISM_OK);
    assert_false(prism_kv_prefix_events_take(&c, &log));
    int32_t t[8 * BS], ids[8];
    prism_kv_key_t k[8];
    fill(t, 8 * BS, 5);
    prism_kv_prefix_keys(&c, NULL, 0, t, 8 * BS, NULL, 0, k);
    assert_int_equal(prism_kv_blocks_alloc(&b, 8, ids), PRISM_OK);
    prism_kv_prefix_insert(&c, k, ids, 8);
    prism_kv_blocks_release(&b, ids, 8);
    assert_true(prism_kv_prefix_events_take(&c, &log));
    assert_int_equal(log.n_stored, 8);
    assert_int_equal(log.n_evicted, 0);
    assert_false(log.reset);
    for (int i = 0; i < 8; i++) assert_true(listed(log.stored, log.n_stored, k[i]));
    assert_false(prism_kv_prefix_events_take(&c, &log));   /* taken: nothing new */
    /* evicted: announced as such */
    assert_int_equal(prism_kv_prefix_clear(&c), 8);
    assert_true(prism_kv_prefix_events_take(&c, &log));
    assert_int_equal(log.n_stored, 0);
    assert_int_equal(log.n_evicted, 8);
    /* kept and evicted between two takes: never announced */
    assert_int_equal(prism_kv_blocks_alloc(&b, 8, ids), PRISM_OK);
    prism_kv_prefix_insert(&c, k, ids, 8);
    prism_kv_blocks_release(&b, ids, 8);
    prism_kv_prefix_clear(&c);
    assert_false(prism_kv_prefix_events_take(&c, &log));
    /* more keys than a message carries: a reset, then every held key listed again, a message's worth per take */
    int32_t *big = malloc(sizeof(int32_t) * (size_t)N * BS), *bid = malloc(sizeof(int32_t) * N);
    prism_kv_key_t *bk = malloc(sizeof(prism_kv_key_t) * N);
    fill(big, N * BS, 9);
    prism_kv_prefix_keys(&c, NULL, 0, big, N * BS, NULL, 0, bk);
    assert_int_equal(prism_kv_blocks_alloc(&b, N, bid), PRISM_OK);
    prism_kv_prefix_insert(&c, bk, bid, N);
    prism_kv_blocks_release(&b, bid, N);
    int seen = 0;
    assert_true(prism_kv_prefix_events_take(&c, &log));
    assert_true(log.reset);
    assert_int_equal(log.n_stored, PRISM_KV_PREFIX_EVENTS);
    assert_int_equal(log.n_evicted, 0);
    for (int i = 0; i < N; i++) seen += listed(log.stored, log.n_stored, bk[i]);
    assert_true(prism_kv_prefix_events_take(&c, &log));
    assert_false(log.reset);
    assert_int_equal(log.n_stored, N - PRISM_KV_PREFIX_EVENTS);
    for (int i = 0; i < N; i++) seen += listed(log.stored, log.n_stored, bk[i]);
    assert_int_equal(seen, N);   /* every held key, once */
    assert_false(prism_kv_prefix_events_take(&c, &log));
    /* a resync (a router registered): reset, then what is held */
    prism_kv_prefix_events_resync(&c);
    assert_true(prism_kv_prefix_events_take(&c, &log));
    assert_true(log.reset);
    assert_int_equal(log.n_stored, PRISM_KV_PREFIX_EVENTS);
    assert_true(prism_kv_prefix_events_take(&c, &log) && !log.reset);
    assert_false(prism_kv_prefix_events_take(&c, &log));
    free(big);
    free(bid);
    free(bk);
    prism_kv_prefix_free(&c);
    prism_kv_blocks_free_all(&b);
    (void)state;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_separates),
        cmocka_unit_test(test_match_insert_evict),
        cmocka_unit_test(test_random_against_reference),
        cmocka_unit_test(test_chain_secret_and_wire),
        cmocka_unit_test(test_events),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
