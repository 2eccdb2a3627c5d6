/* Unit tests: core (allocator accounting, arena, buffer, byte sizes, CLI), kv blocks, metrics,
 * and the encoder's embedding cache. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/stat.h>

#include "core/core.h"
#include "core/cli.h"
#include "backend/dtype.h"
#include "kv/kv.h"
#include "metrics/metrics.h"
#include "embed_cache.h"

static void test_alloc_counts(void **state)
{
    size_t before = prism_mem_used();
    uint64_t calls = prism_mem_alloc_count();
    char *p = prism_malloc(1000);
    assert_non_null(p);
    assert_int_equal(prism_mem_used(), before + 1000);
    assert_true(prism_mem_peak() >= before + 1000);
    p = prism_realloc(p, 5000);
    assert_int_equal(prism_mem_used(), before + 5000);
    prism_free(p);
    assert_int_equal(prism_mem_used(), before);
    assert_int_equal(prism_mem_alloc_count(), calls + 2);
    void *a = prism_malloc_aligned(4096, 256);
    assert_int_equal((uintptr_t)a % 256, 0);
    assert_int_equal(prism_mem_used(), before + 4096);
    prism_free_aligned(a);
    assert_int_equal(prism_mem_used(), before);
    assert_null(prism_calloc(SIZE_MAX / 2, 4));  /* overflow is refused, not wrapped */
}

static void test_arena(void **state)
{
    uint8_t region[1024];
    prism_arena_t a;
    prism_arena_init(&a, "t", region, sizeof(region));
    void *x = prism_arena_alloc(&a, 100, 64);
    void *y = prism_arena_alloc(&a, 100, 64);
    assert_non_null(x);
    assert_non_null(y);
    assert_int_equal(((uintptr_t)y - (uintptr_t)region) % 64, 0);
    assert_null(prism_arena_alloc(&a, 2000, 64));  /* never grows */
    assert_true(a.peak >= 228);
    prism_arena_reset(&a);
    assert_ptr_equal(prism_arena_alloc(&a, 10, 1), region);
}

static void test_buf(void **state)
{
    prism_buf_t b = {0};
    for (int i = 0; i < 1000; i++) assert_int_equal(prism_buf_appendf(&b, "%d,", i), PRISM_OK);
    assert_int_equal(strncmp(b.data, "0,1,2,", 6), 0);
    assert_int_equal(b.data[b.len], 0);
    prism_buf_reset(&b);
    assert_int_equal(b.len, 0);
    prism_buf_free(&b);
}

static void test_parse_bytes(void **state)
{
    assert_int_equal(prism_parse_bytes("1000"), 1000);
    assert_int_equal(prism_parse_bytes("2K"), 2048);
    assert_int_equal(prism_parse_bytes("512M"), 512ll << 20);
    assert_int_equal(prism_parse_bytes("1.5GiB"), 3ll << 29);
    assert_int_equal(prism_parse_bytes("2GB"), 2ll << 30);
    assert_int_equal(prism_parse_bytes("abc"), -1);
    assert_int_equal(prism_parse_bytes("-5"), -1);
    assert_int_equal(prism_parse_bytes("5X"), -1);
    assert_int_equal(prism_parse_bytes("1e30"), -1);
}

static void test_cli(void **state)
{
    const char *s = "def";
    int64_t n = 1, bytes = 0;
    bool flag = false;
    prism_str_list_t list = {0};
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("name", &s, "a string"), PRISM_FLAG_INT("n", &n, "a number"),
        PRISM_FLAG_BYTES("mem", &bytes, "bytes"), PRISM_FLAG_BOOL("on", &flag, "a switch"),
        PRISM_FLAG_LIST("router", &list, "list"), PRISM_FLAG_END,
    };
    char a0[] = "x", a1[] = "--name", a2[] = "abc", a3[] = "--n=42", a4[] = "--mem", a5[] = "1G", a6[] = "--on",
         a7[] = "--router", a8[] = "tcp://a:1,tcp://b:2", a9[] = "--router=tcp://c:3";
    char *argv[] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9};
    assert_int_equal(prism_cli_parse(10, argv, "x", "test", flags), 0);
    assert_string_equal(s, "abc");
    assert_int_equal(n, 42);
    assert_int_equal(bytes, 1ll << 30);
    assert_true(flag);
    assert_int_equal(list.n, 3);
    assert_string_equal(list.items[1], "tcp://b:2");
    char b1[] = "--nope";
    char *bad[] = {a0, b1};
    assert_true(prism_cli_parse(2, bad, "x", "test", flags) < 0);
    char c1[] = "--n", c2[] = "12x";
    char *bad2[] = {a0, c1, c2};
    assert_true(prism_cli_parse(3, bad2, "x", "test", flags) < 0);
    char d1[] = "--n";
    char *bad3[] = {a0, d1};
    assert_true(prism_cli_parse(2, bad3, "x", "test", flags) < 0);
}

static void test_kv_blocks(void **state)
{
    prism_kv_blocks_t b;
    assert_int_equal(prism_kv_blocks_init(&b, 10, 16), PRISM_OK);
    assert_int_equal(prism_kv_blocks_for_tokens(&b, 1), 1);
    assert_int_equal(prism_kv_blocks_for_tokens(&b, 16), 1);
    assert_int_equal(prism_kv_blocks_for_tokens(&b, 17), 2);
    int32_t ids[10], more[10];
    assert_int_equal(prism_kv_blocks_alloc(&b, 7, ids), PRISM_OK);
    assert_int_equal(b.n_free, 3);
    /* all-or-nothing: 4 > 3 free, nothing taken */
    assert_int_equal(prism_kv_blocks_alloc(&b, 4, more), PRISM_EAGAIN);
    assert_int_equal(b.n_free, 3);
    bool seen[10] = {0};
    for (int i = 0; i < 7; i++) {
        assert_true(ids[i] >= 0 && ids[i] < 10);
        assert_false(seen[ids[i]]);
        seen[ids[i]] = true;
    }
    assert_true(fabs(prism_kv_blocks_usage(&b) - 0.7) < 1e-9);
    prism_kv_blocks_release(&b, ids, 7);
    assert_int_equal(b.n_free, 10);
    assert_int_equal(prism_kv_blocks_alloc(&b, 10, more), PRISM_OK);
    prism_kv_blocks_free_all(&b);
}

/* n sequences of one request share their prompt's full blocks: a shared block is free only when
 * its last holder releases it, and the reservation counts the shared prefix once. */
static void test_kv_blocks_shared_prefix(void **state)
{
    prism_kv_blocks_t b;
    assert_int_equal(prism_kv_blocks_init(&b, 12, 4), PRISM_OK);
    /* prompt 10 tokens (2 full blocks + 2 tokens), 3 sequences to 15 tokens each:
     * 2 shared + 3 x (4 - 2) private */
    assert_int_equal(prism_kv_blocks_for_shared(&b, 10, 15, 3), 8);
    assert_int_equal(prism_kv_blocks_for_shared(&b, 10, 15, 1), prism_kv_blocks_for_tokens(&b, 15));
    assert_int_equal(prism_kv_blocks_for_shared(&b, 8, 8, 2), 2);   /* exact blocks: nothing private */
    int32_t shared[2], priv[3][2];
    assert_int_equal(prism_kv_blocks_alloc(&b, 2, shared), PRISM_OK);
    assert_int_equal(prism_kv_blocks_share(&b, shared, 2), PRISM_OK);
    assert_int_equal(prism_kv_blocks_share(&b, shared, 2), PRISM_OK);
    for (int s = 0; s < 3; s++) assert_int_equal(prism_kv_blocks_alloc(&b, 2, priv[s]), PRISM_OK);
    assert_int_equal(b.n_free, 12 - 8);
    assert_int_equal(prism_kv_blocks_holders(&b, shared[0]), 3);
    /* the first two sequences leave: their private blocks come back, the prefix stays */
    for (int s = 0; s < 2; s++) {
        int32_t all[4] = {shared[0], shared[1], priv[s][0], priv[s][1]};
        prism_kv_blocks_release(&b, all, 4);
    }
    assert_int_equal(b.n_free, 12 - 4);
    assert_int_equal(prism_kv_blocks_holders(&b, shared[1]), 1);
    int32_t more[8];
    assert_int_equal(prism_kv_blocks_alloc(&b, 8, more), PRISM_OK);
    for (int i = 0; i < 8; i++) assert_true(more[i] != shared[0] && more[i] != shared[1]);  /* never handed out twice */
    prism_kv_blocks_release(&b, more, 8);
    int32_t last[4] = {shared[0], shared[1], priv[2][0], priv[2][1]};
    prism_kv_blocks_release(&b, last, 4);
    assert_int_equal(b.n_free, 12);
    assert_int_equal(prism_kv_blocks_holders(&b, shared[0]), 0);
    prism_kv_blocks_free_all(&b);
}

/* KV transfers in bf16 (Kv.wire_dtype): --kv-transfer-dtype, the wire sizes, and the narrowing in
 * place (nearest even, the export staging's first half) and widening (exact) around the wire. */
static void test_kv_wire(void **state)
{
    (void)state;
    prism_kv_wire_t w = PRISM_KV_WIRE_BF16;
    assert_int_equal(prism_kv_wire_parse("auto", "auto", &w), PRISM_OK);
    assert_int_equal(w, PRISM_KV_WIRE_F32);
    assert_int_equal(prism_kv_wire_parse("auto", "f32", &w), PRISM_OK);
    assert_int_equal(w, PRISM_KV_WIRE_F32);
    assert_int_equal(prism_kv_wire_parse("auto", "bf16", &w), PRISM_OK);
    assert_int_equal(w, PRISM_KV_WIRE_BF16);
    assert_int_equal(prism_kv_wire_parse("f32", "bf16", &w), PRISM_OK);
    assert_int_equal(w, PRISM_KV_WIRE_F32);
    assert_int_equal(prism_kv_wire_parse("bf16", "f32", &w), PRISM_OK);
    assert_int_equal(w, PRISM_KV_WIRE_BF16);
    assert_int_equal(prism_kv_wire_parse("fp16", "f32", &w), PRISM_EINVAL);
    assert_string_equal(prism_kv_wire_name(PRISM_KV_WIRE_BF16), "bf16");
    assert_int_equal(prism_kv_wire_bytes(PRISM_KV_WIRE_F32, 65536), 65536);
    assert_int_equal(prism_kv_wire_bytes(PRISM_KV_WIRE_BF16, 65536), 32768);
    /* a bf16 piece holds twice the blocks in the same wire bytes (at most a piece) */
    assert_int_equal(prism_kv_piece_blocks(prism_kv_wire_bytes(PRISM_KV_WIRE_BF16, 65536)), 2 * prism_kv_piece_blocks(65536));
    assert_true((size_t)prism_kv_piece_blocks(32768) * 32768 <= PRISM_KV_PIECE_BYTES);

    /* 1 + 2^-8 ties to 1 (even), 1 + 3 * 2^-8 ties up to 1 + 2^-6 (even), 1 + 2^-8 + 2^-20 rounds
     * up; signed zeros, a large value, a denormal, infinity keep their bf16 (bit patterns as torch's
     * .to(torch.bfloat16)) */
    const float in[] = {1.0f, 1.00390625f, 1.01171875f, 1.0039072f, -2.5f, 0.0f, -0.0f, 3.0e38f, 1e-40f, INFINITY};
    const uint16_t want[] = {0x3f80, 0x3f80, 0x3f82, 0x3f81, 0xc020, 0x0000, 0x8000, 0x7f62, 0x0001, 0x7f80};
    enum { N = sizeof in / sizeof in[0] };
    float buf[N + 1];
    memcpy(buf, in, sizeof in);
    buf[N] = NAN;
    prism_kv_wire_narrow(buf, N + 1);   /* in place: the first half of buf holds them now */
    assert_memory_equal(buf, want, sizeof want);
    float back[N + 1];
    prism_kv_wire_widen(buf, N + 1, back);
    for (int i = 0; i < N; i++) {
        uint32_t u;
        memcpy(&u, &back[i], 4);
        assert_int_equal(u, (uint32_t)want[i] << 16);
    }
    assert_true(isnan(back[N]));
    /* widening is exact: a bf16 value narrows back to itself */
    uint16_t h[4] = {0x3f80, 0xc020, 0x0001, 0x7f7f}, h2[8];
    float f[4];
    prism_kv_wire_widen(h, 4, f);
    memcpy(h2, f, sizeof f);
    prism_kv_wire_narrow(h2, 4);
    assert_memory_equal(h, h2, sizeof h);
    /* a piece's worth: whole chunks (the vectorized loops) and a tail, in place, every value as
     * alone, the cases above scattered through it */
    enum { LONG = 1000 };
    float *big = malloc(LONG * sizeof(float)), *wide = malloc(LONG * sizeof(float));
    uint16_t *one = malloc(LONG * sizeof(uint16_t));
    assert_non_null(big);
    assert_non_null(wide);
    assert_non_null(one);
    for (int i = 0; i < LONG; i++) {
        big[i] = i % 7 == 3 ? in[i % N] : (float)(i - 500) * 1.00390625f / 3.0f;
        one[i] = prism_f32_to_bf16(big[i]);
    }
    big[777] = NAN;
    one[777] = prism_f32_to_bf16(NAN);
    prism_kv_wire_narrow(big, LONG);
    assert_memory_equal(big, one, LONG * sizeof(uint16_t));
    prism_kv_wire_widen(big, LONG, wide);
    for (int i = 0; i < LONG; i++) {
        uint32_t u;
        memcpy(&u, &wide[i], 4);
        assert_int_equal(u, (uint32_t)one[i] << 16);
    }
    free(big);
    free(wide);
    free(one);
}

static void test_ct_equal(void **state)
{
    (void)state;
    assert_true(prism_ct_equal("sekrit", 6, "sekrit", 6));
    assert_false(prism_ct_equal("sekriT", 6, "sekrit", 6));
    assert_false(prism_ct_equal("sekrit2", 7, "sekrit", 6));   /* a longer value sharing the prefix */
    assert_false(prism_ct_equal("sek", 3, "sekrit", 6));
    assert_false(prism_ct_equal("", 0, "sekrit", 6));
    assert_true(prism_ct_equal("", 0, "", 0));
    assert_false(prism_ct_equal("x", 1, "", 0));
    assert_false(prism_ct_equal("sekritsekrit", 12, "sekrit", 6));  /* the secret repeated */
}

/* An API key file (issue 26 finding 10): its bytes without the trailing newline; refused when
 * others may read it, when it is empty or too long; a file through a link (a Kubernetes Secret
 * volume's layout) is read. */
static void test_secret_file(void **state)
{
    (void)state;
    char dir[] = "/tmp/prism-secret-XXXXXX", path[256], link_path[256], out[64], err[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/key", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("  0123456789abcdef0123\n", f);
    fclose(f);
    assert_int_equal(chmod(path, 0600), 0);
    assert_int_equal(prism_secret_file_read(path, out, sizeof out, err, sizeof err), PRISM_OK);
    assert_string_equal(out, "0123456789abcdef0123");
    snprintf(link_path, sizeof link_path, "%s/api-key", dir);
    assert_int_equal(symlink("key", link_path), 0);
    assert_int_equal(prism_secret_file_read(link_path, out, sizeof out, err, sizeof err), PRISM_OK);
    assert_string_equal(out, "0123456789abcdef0123");
    assert_int_equal(chmod(path, 0640), 0);   /* a Secret mounted group-readable (fsGroup) */
    assert_int_equal(prism_secret_file_read(path, out, sizeof out, err, sizeof err), PRISM_OK);
    assert_int_equal(chmod(path, 0644), 0);
    assert_int_equal(prism_secret_file_read(path, out, sizeof out, err, sizeof err), PRISM_EINVAL);
    assert_non_null(strstr(err, "readable by other users"));
    assert_string_equal(out, "");
    assert_int_equal(chmod(path, 0600), 0);
    assert_int_equal(prism_secret_file_read(path, out, 8, err, sizeof err), PRISM_ELIMIT);
    assert_int_equal(chmod(dir, 0777), 0);    /* anyone could swap the file */
    assert_int_equal(prism_secret_file_read(path, out, sizeof out, err, sizeof err), PRISM_EINVAL);
    assert_int_equal(chmod(dir, 0700), 0);
    f = fopen(path, "w");
    fputs(" \n", f);
    fclose(f);
    assert_int_equal(prism_secret_file_read(path, out, sizeof out, err, sizeof err), PRISM_EINVAL);
    snprintf(path, sizeof path, "%s/absent", dir);
    assert_int_equal(prism_secret_file_read(path, out, sizeof out, err, sizeof err), PRISM_EIO);
    unlink(link_path);
    snprintf(path, sizeof path, "%s/key", dir);
    unlink(path);
    rmdir(dir);
}

static void test_histogram(void **state)
{
    prism_hist_t h;
    prism_hist_init(&h, prism_buckets_ttft, prism_buckets_ttft_n);
    prism_hist_observe(&h, 0.003);
    prism_hist_observe(&h, 0.5);
    prism_hist_observe(&h, 9999);
    prism_buf_t b = {0};
    prism_hist_write(&h, &b, "t", "help", "model_name=\"m\"");
    assert_non_null(strstr(b.data, "t_bucket{model_name=\"m\",le=\"0.005\"} 1\n"));
    assert_non_null(strstr(b.data, "t_bucket{model_name=\"m\",le=\"0.5\"} 2\n"));
    assert_non_null(strstr(b.data, "t_bucket{model_name=\"m\",le=\"+Inf\"} 3\n"));
    assert_non_null(strstr(b.data, "t_count{model_name=\"m\"} 3\n"));
    prism_buf_free(&b);
}

/* The first unit of key's entry (NULL on a miss), unpinned again. */
static const float *cache_peek(prism_embed_cache_t *c, uint64_t key)
{
    int e = prism_embed_cache_get_pinned(c, key);
    if (e < 0)
        return NULL;
    const float *parts[4];
    prism_embed_cache_units(c, e, parts, 4);
    prism_embed_cache_unpin(c, e);
    return parts[0];
}

static void test_embed_cache_lru(void **state)
{
    prism_embed_cache_t c;
    size_t floats = 8, unit = prism_embed_cache_unit_bytes(floats);
    assert_int_equal(prism_embed_cache_init(&c, 3 * unit, floats, 1), PRISM_OK);
    assert_int_equal(c.n_units, 3);
    float e[8];
    for (uint64_t k = 1; k <= 3; k++) {
        for (int i = 0; i < 8; i++) e[i] = (float)(k * 10 + i);
        prism_embed_cache_put(&c, k, e, 1);
    }
    assert_non_null(cache_peek(&c, 1));  /* 1 becomes most recent; 2 is LRU */
    for (int i = 0; i < 8; i++) e[i] = 99;
    prism_embed_cache_put(&c, 4, e, 1);
    assert_null(cache_peek(&c, 2));
    const float *g = cache_peek(&c, 3);
    assert_non_null(g);
    assert_true(g[0] == 30.0f && g[7] == 37.0f);
    assert_true(cache_peek(&c, 4)[3] == 99.0f);
    assert_int_equal(c.hits, 3);
    assert_int_equal(c.misses, 1);
    prism_embed_cache_free(&c);
    /* a zero budget disables the cache */
    assert_int_equal(prism_embed_cache_init(&c, 0, floats, 1), PRISM_OK);
    prism_embed_cache_put(&c, 1, e, 1);
    assert_null(cache_peek(&c, 1));
}

/* Audit finding: a hit read in place while a later miss of the same batch is stored must keep its
 * own embeddings. One unit: the hit pins it, the miss finds nothing to evict and is not cached. */
static void test_embed_cache_pinned_hit_survives_puts(void **state)
{
    prism_embed_cache_t c;
    size_t floats = 8, unit = prism_embed_cache_unit_bytes(floats);
    assert_int_equal(prism_embed_cache_init(&c, unit, floats, 1), PRISM_OK);
    assert_int_equal(c.n_units, 1);
    float a[8], b[8];
    for (int i = 0; i < 8; i++) {
        a[i] = 1.0f + i;
        b[i] = -1.0f - i;
    }
    prism_embed_cache_put(&c, 0xA, a, 1);
    int s = prism_embed_cache_get_pinned(&c, 0xA);      /* user A's request: a hit */
    assert_true(s >= 0);
    const float *held;
    assert_int_equal(prism_embed_cache_units(&c, s, &held, 1), 1);
    assert_int_equal(prism_embed_cache_get_pinned(&c, 0xB), -1);   /* user B: a miss ... */
    prism_embed_cache_put(&c, 0xB, b, 1);               /* ... encoded and stored */
    assert_memory_equal(held, a, sizeof a);             /* A is still answered with A's image */
    assert_int_equal(prism_embed_cache_get_pinned(&c, 0xB), -1);
    prism_embed_cache_put(&c, 0xA, b, 1);               /* same key, pinned: refreshed, never rewritten */
    assert_memory_equal(held, a, sizeof a);
    prism_embed_cache_unpin(&c, s);
    prism_embed_cache_put(&c, 0xB, b, 1);               /* unpinned: now B may take the unit */
    s = prism_embed_cache_get_pinned(&c, 0xB);
    assert_true(s >= 0);
    const float *got;
    prism_embed_cache_units(&c, s, &got, 1);
    assert_memory_equal(got, b, sizeof b);
    prism_embed_cache_unpin(&c, s);
    assert_int_equal(prism_embed_cache_get_pinned(&c, 0xA), -1);
    prism_embed_cache_free(&c);
}

/* Entries of several units (Llama-4 images: one unit per tile) share the budget: a 3-unit image
 * evicts least recently used entries until it fits (never a pinned one), its units come back in
 * order though they are scattered, and an image larger than everything unpinned is not cached. */
static void test_embed_cache_multi_unit(void **state)
{
    prism_embed_cache_t c;
    size_t floats = 4, unit = prism_embed_cache_unit_bytes(floats);
    assert_int_equal(prism_embed_cache_init(&c, 5 * unit, floats, 4), PRISM_OK);
    float img[4][4];
    for (int u = 0; u < 4; u++)
        for (int i = 0; i < 4; i++) img[u][i] = (float)(u * 10 + i);
    prism_embed_cache_put(&c, 1, img[0], 1);
    prism_embed_cache_put(&c, 2, img[0], 2);
    prism_embed_cache_put(&c, 3, img[0], 1);
    assert_int_equal(c.n_free, 1);
    int p1 = prism_embed_cache_get_pinned(&c, 1);       /* 1 is pinned and most recent; 2 is LRU */
    prism_embed_cache_put(&c, 4, img[0], 3);            /* needs 2 more: evicts 2 (2 units) */
    assert_null(cache_peek(&c, 2));
    assert_non_null(cache_peek(&c, 3));
    int e4 = prism_embed_cache_get_pinned(&c, 4);
    const float *parts[4];
    assert_int_equal(prism_embed_cache_units(&c, e4, parts, 4), 3);
    for (int u = 0; u < 3; u++) assert_memory_equal(parts[u], img[u], sizeof img[u]);
    prism_embed_cache_unpin(&c, e4);
    /* 4 units wanted: only 3 (entry 4) + 1 (entry 3) are unpinned besides pinned 1 -> would fit
     * after evicting both; 5 units can never fit while 1 is pinned. */
    prism_embed_cache_put(&c, 5, img[0], 4);
    assert_non_null(cache_peek(&c, 5));
    assert_non_null(cache_peek(&c, 1));
    prism_embed_cache_put(&c, 6, img[0], 5);            /* above max_units: ignored */
    assert_null(cache_peek(&c, 6));
    prism_embed_cache_unpin(&c, p1);
    assert_int_equal(c.n_free, 0);
    prism_embed_cache_free(&c);
}

/* W3C trace ids: 32 lowercase hex digits, not all zeros; the hex written back is the hex read. */
static void test_trace_id(void **state)
{
    (void)state;
    prism_trace_id_t t;
    assert_true(prism_trace_id_parse("4bf92f3577b34da6a3ce929d0e0e4736", &t));
    assert_int_equal(t.hi, 0x4bf92f3577b34da6ull);
    assert_int_equal(t.lo, 0xa3ce929d0e0e4736ull);
    char hex[33];
    prism_trace_id_hex(t, hex);
    assert_string_equal(hex, "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_false(prism_trace_id_parse("4BF92F3577B34DA6A3CE929D0E0E4736", &t));   /* uppercase: invalid */
    assert_false(prism_trace_id_parse("00000000000000000000000000000000", &t));   /* all zeros: invalid */
    assert_false(prism_trace_id_parse("4bf92f3577b34da6a3ce929d0e0e47", &t));     /* short */
}

/* --log-format json: one object per line with the request's id and trace (given, or the thread's
 * current request), the message escaped (quotes, control bytes, ill-formed UTF-8 as U+FFFD). */
static void test_log_json(void **state)
{
    (void)state;
    char path[] = "/tmp/prism-test-log-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    int saved = dup(2);
    dup2(fd, 2);
    prism_log_init("unit", PRISM_LOG_INFO);
    prism_log_set_format(PRISM_LOG_JSON);
    prism_log_set_worker("w-1");
    prism_log_ctx_t ctx = {42, {0x4bf92f3577b34da6ull, 0xa3ce929d0e0e4736ull}};
    PRISM_LOGC(WARN, &ctx, "say \"%s\"\tnow\n%s", "hi", "\xff!");
    const prism_log_ctx_t *prev = prism_log_ctx_enter(&ctx);
    PRISM_INFO("inside");
    prism_log_ctx_leave(prev);
    PRISM_INFO("outside");
    PRISM_DEBUG("below the level");
    prism_log_set_format(PRISM_LOG_TEXT);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char buf[4096] = {0};
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    close(fd);
    unlink(path);
    assert_true(n > 0);
    const char *l1 = buf, *l2 = strchr(l1, '\n') + 1, *l3 = strchr(l2, '\n') + 1;
    assert_non_null(strstr(l1, "\"level\":\"warn\",\"process\":\"unit\""));
    assert_non_null(strstr(l1, "\"worker_id\":\"w-1\",\"request_id\":\"42\","
                               "\"trace_id\":\"4bf92f3577b34da6a3ce929d0e0e4736\""));
    assert_non_null(strstr(l1, "\"message\":\"say \\\"hi\\\"\\u0009now\\n\xEF\xBF\xBD!\"}\n"));
    assert_non_null(strstr(l2, "\"request_id\":\"42\",\"trace_id\":\"4bf92f3577b34da6a3ce929d0e0e4736\""));
    assert_non_null(strstr(l2, "\"message\":\"inside\""));
    assert_non_null(strstr(l3, "\"request_id\":null,\"trace_id\":null"));
    assert_non_null(strstr(l3, "\"message\":\"outside\"}\n"));
    assert_null(strstr(buf, "below the level"));
    prism_log_format_t f;
    assert_int_equal(prism_log_format_parse("json", &f), PRISM_OK);
    assert_int_equal(f, PRISM_LOG_JSON);
    assert_int_equal(prism_log_format_parse("xml", &f), PRISM_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_counts), cmocka_unit_test(test_arena),      cmocka_unit_test(test_buf),
        cmocka_unit_test(test_parse_bytes),  cmocka_unit_test(test_cli),        cmocka_unit_test(test_kv_blocks),
        cmocka_unit_test(test_kv_blocks_shared_prefix),
        cmocka_unit_test(test_kv_wire),
        cmocka_unit_test(test_histogram),    cmocka_unit_test(test_embed_cache_lru),
        cmocka_unit_test(test_embed_cache_pinned_hit_survives_puts), cmocka_unit_test(test_embed_cache_multi_unit),
        cmocka_unit_test(test_ct_equal),     cmocka_unit_test(test_secret_file), cmocka_unit_test(test_trace_id),
        cmocka_unit_test(test_log_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
