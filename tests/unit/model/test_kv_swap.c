/* The decode worker's KV swap region (decode_worker/swap.c): blocks swapped out and back into other
 * blocks keep their bytes, the slots are counted (fits, bytes in use, EAGAIN when full, freed by
 * swap-in and by release), a region of 0 slots is off, and a split cache (Llama-4's chunked layers
 * in rings) swaps only its pool's layers. CPU backend, tiny shapes. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "model/model.h"
#include "../../../decode_worker/swap.h"

static prism_model_config_t config(const char *rel)
{
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/%s", PRISM_SOURCE_DIR, rel);
    prism_model_config_t cfg;
    assert_int_equal(prism_model_config_load(dir, &cfg, err, sizeof err), PRISM_OK);
    return cfg;
}

/* Fills blocks ids[0..n) of class cls (-1: every layer) with a pattern of seed. */
static void fill(prism_kv_cache_t *kv, int cls, const int32_t *ids, int n, size_t bb, uint8_t seed)
{
    uint8_t *h = prism_malloc(bb * (size_t)n);
    for (size_t i = 0; i < bb * (size_t)n; i++) h[i] = (uint8_t)(seed + i * 7 + i / bb);
    int rc = cls < 0 ? prism_kv_cache_import(kv, ids, n, h) : prism_kv_cache_import_class(kv, cls, ids, n, h);
    assert_int_equal(rc, PRISM_OK);
    prism_free(h);
}

static uint8_t *read_blocks(prism_kv_cache_t *kv, int cls, const int32_t *ids, int n, size_t bb)
{
    uint8_t *h = prism_malloc(bb * (size_t)n);
    int rc = cls < 0 ? prism_kv_cache_export(kv, ids, n, h) : prism_kv_cache_export_class(kv, cls, ids, n, h);
    assert_int_equal(rc, PRISM_OK);
    return h;
}

/* Swaps blocks {5, 2, 7} out, scribbles over them, swaps them into {1, 6, 3}: the same bytes. */
static void round_trip(prism_kv_cache_t *kv, int cls, size_t bb)
{
    const int32_t out_ids[3] = {5, 2, 7}, in_ids[3] = {1, 6, 3};
    fill(kv, cls, out_ids, 3, bb, 11);
    uint8_t *want = read_blocks(kv, cls, out_ids, 3, bb);
    uint8_t *region = prism_calloc(4, bb);
    prism_kv_swap_t sw;
    assert_int_equal(prism_kv_swap_init(&sw, region, 4, bb, cls), PRISM_OK);
    assert_true(prism_kv_swap_fits(&sw, 4));
    assert_false(prism_kv_swap_fits(&sw, 5));
    assert_false(prism_kv_swap_fits(&sw, 0));
    int32_t slots[4], more[2];
    assert_int_equal(prism_kv_swap_out(&sw, kv, out_ids, 3, slots), PRISM_OK);
    assert_int_equal(prism_kv_swap_used_bytes(&sw), 3 * bb);
    assert_int_equal(sw.swapped_out, 1);
    /* one slot left: two more blocks do not fit, nothing taken */
    assert_false(prism_kv_swap_fits(&sw, 2));
    assert_int_equal(prism_kv_swap_out(&sw, kv, in_ids, 2, more), PRISM_EAGAIN);
    assert_int_equal(prism_kv_swap_used_bytes(&sw), 3 * bb);
    fill(kv, cls, out_ids, 3, bb, 99);   /* the pool's blocks go to others meanwhile */
    fill(kv, cls, in_ids, 3, bb, 42);
    assert_int_equal(prism_kv_swap_in(&sw, kv, slots, 3, in_ids), PRISM_OK);
    assert_int_equal(prism_kv_swap_used_bytes(&sw), 0);
    assert_int_equal(sw.swapped_in, 1);
    uint8_t *got = read_blocks(kv, cls, in_ids, 3, bb);
    assert_memory_equal(got, want, 3 * bb);
    /* slots come back in the order they were taken (one copy per run), and release frees them */
    int32_t again[3];
    assert_int_equal(prism_kv_swap_out(&sw, kv, in_ids, 3, again), PRISM_OK);
    assert_memory_equal(again, slots, sizeof again);
    assert_true(again[1] == again[0] + 1 && again[2] == again[1] + 1);
    prism_kv_swap_release(&sw, again, 3);
    assert_int_equal(prism_kv_swap_used_bytes(&sw), 0);
    assert_true(prism_kv_swap_fits(&sw, 4));
    prism_kv_swap_free(&sw);
    prism_free(got);
    prism_free(want);
    prism_free(region);
}

static void test_swap_round_trip(void **state)
{
    (void)state;
    prism_model_config_t cfg = config("models/prism-tiny-llava");
    prism_backend_t *be = prism_backend_cpu_create(1);
    prism_kv_cache_t *kv = NULL;
    assert_int_equal(prism_kv_cache_create(be, &cfg, 8, 16, &kv), PRISM_OK);
    round_trip(kv, -1, prism_kv_cache_block_bytes(&cfg, 16));
    prism_kv_cache_free(kv);
    prism_backend_destroy(be);
}

/* A split cache: the pool holds the full-attention layers; the rings are not touched by a swap. */
static void test_swap_split_cache(void **state)
{
    (void)state;
    prism_model_config_t cfg = config("tests/data/model/llama4_text");
    prism_backend_t *be = prism_backend_cpu_create(1);
    prism_kv_cache_t *kv = NULL;
    assert_int_equal(prism_kv_cache_create_split(be, &cfg, 8, 4, 16, &kv), PRISM_OK);
    size_t lbb = prism_kv_cache_class_block_bytes(&cfg, 16, PRISM_KV_CLASS_LOCAL);
    const int32_t ring[4] = {0, 1, 2, 3};
    fill(kv, PRISM_KV_CLASS_LOCAL, ring, 4, lbb, 5);
    uint8_t *before = read_blocks(kv, PRISM_KV_CLASS_LOCAL, ring, 4, lbb);
    round_trip(kv, PRISM_KV_CLASS_FULL, prism_kv_cache_class_block_bytes(&cfg, 16, PRISM_KV_CLASS_FULL));
    uint8_t *after = read_blocks(kv, PRISM_KV_CLASS_LOCAL, ring, 4, lbb);
    assert_memory_equal(after, before, 4 * lbb);
    prism_free(before);
    prism_free(after);
    prism_kv_cache_free(kv);
    prism_backend_destroy(be);
}

/* A choice of an n > 1 request swapped out while its sibling holds their shared prompt blocks (the
 * decode worker's swap_out: copy every block of the choice, then release them in the pool): the
 * shared blocks stay in the pool for the sibling (released once, not freed), only the choice's own
 * block is free; it comes back into fresh blocks of its own (no longer shared) with its bytes, the
 * sibling's untouched, and once both end every block is free. */
static void test_swap_choice_with_shared_blocks(void **state)
{
    (void)state;
    prism_model_config_t cfg = config("models/prism-tiny-llava");
    prism_backend_t *be = prism_backend_cpu_create(1);
    prism_kv_cache_t *kv = NULL;
    assert_int_equal(prism_kv_cache_create(be, &cfg, 8, 16, &kv), PRISM_OK);
    size_t bb = prism_kv_cache_block_bytes(&cfg, 16);
    prism_kv_blocks_t pool;
    assert_int_equal(prism_kv_blocks_init(&pool, 8, 16), PRISM_OK);
    int32_t a[3], b[3];   /* two choices: 2 shared prompt blocks, 1 own each */
    assert_int_equal(prism_kv_blocks_alloc(&pool, 2, a), PRISM_OK);
    memcpy(b, a, 2 * sizeof *a);
    assert_int_equal(prism_kv_blocks_share(&pool, b, 2), PRISM_OK);
    assert_int_equal(prism_kv_blocks_alloc(&pool, 1, a + 2), PRISM_OK);
    assert_int_equal(prism_kv_blocks_alloc(&pool, 1, b + 2), PRISM_OK);
    assert_int_equal(pool.n_free, 4);
    fill(kv, -1, a, 3, bb, 3);
    fill(kv, -1, b + 2, 1, bb, 77);
    uint8_t *want_a = read_blocks(kv, -1, a, 3, bb), *want_b = read_blocks(kv, -1, b, 3, bb);
    uint8_t *region = prism_calloc(4, bb);
    prism_kv_swap_t sw;
    assert_int_equal(prism_kv_swap_init(&sw, region, 4, bb, -1), PRISM_OK);
    int32_t slots[3];
    assert_int_equal(prism_kv_swap_out(&sw, kv, b, 3, slots), PRISM_OK);
    prism_kv_blocks_release(&pool, b, 3);
    assert_int_equal(pool.n_free, 5);   /* its own block only: the shared ones are the sibling's too */
    /* the pool's free block goes to another sequence meanwhile */
    int32_t other;
    assert_int_equal(prism_kv_blocks_alloc(&pool, 1, &other), PRISM_OK);
    fill(kv, -1, &other, 1, bb, 200);
    int32_t back[3];
    assert_int_equal(prism_kv_blocks_alloc(&pool, 3, back), PRISM_OK);
    for (int i = 0; i < 3; i++) assert_true(back[i] != a[0] && back[i] != a[1] && back[i] != a[2] && back[i] != other);
    assert_int_equal(prism_kv_swap_in(&sw, kv, slots, 3, back), PRISM_OK);
    uint8_t *got_b = read_blocks(kv, -1, back, 3, bb), *got_a = read_blocks(kv, -1, a, 3, bb);
    assert_memory_equal(got_b, want_b, 3 * bb);
    assert_memory_equal(got_a, want_a, 3 * bb);
    prism_kv_blocks_release(&pool, back, 3);
    prism_kv_blocks_release(&pool, a, 3);
    prism_kv_blocks_release(&pool, &other, 1);
    assert_int_equal(pool.n_free, 8);
    assert_int_equal(prism_kv_swap_used_bytes(&sw), 0);
    prism_kv_swap_free(&sw);
    prism_kv_blocks_free_all(&pool);
    prism_free(want_a);
    prism_free(want_b);
    prism_free(got_a);
    prism_free(got_b);
    prism_free(region);
    prism_kv_cache_free(kv);
    prism_backend_destroy(be);
}

static void test_swap_off_and_bad_args(void **state)
{
    (void)state;
    prism_kv_swap_t sw;
    assert_int_equal(prism_kv_swap_init(&sw, NULL, 0, 64, -1), PRISM_OK);   /* --kv-swap-bytes 0 */
    assert_false(prism_kv_swap_fits(&sw, 1));
    int32_t slot, block = 0;
    assert_int_equal(prism_kv_swap_out(&sw, NULL, &block, 1, &slot), PRISM_EAGAIN);
    assert_int_equal(prism_kv_swap_used_bytes(&sw), 0);
    prism_kv_swap_release(&sw, &slot, 0);
    prism_kv_swap_free(&sw);
    uint8_t buf[64];
    assert_int_equal(prism_kv_swap_init(&sw, buf, -1, 64, -1), PRISM_EINVAL);
    assert_int_equal(prism_kv_swap_init(&sw, buf, 1, 0, -1), PRISM_EINVAL);
    assert_int_equal(prism_kv_swap_init(&sw, buf, 1, 64, 7), PRISM_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_swap_round_trip),
        cmocka_unit_test(test_swap_split_cache),
        cmocka_unit_test(test_swap_choice_with_shared_blocks),
        cmocka_unit_test(test_swap_off_and_bad_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
