/* safetensors reader: valid files, sharded index, and corrupt inputs that must fail cleanly. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/safetensors.h"

/* Builds a file image: 8-byte length, header JSON (space padded to 8), then data_len bytes. */
static uint8_t *make_image(const char *header, size_t data_len, size_t *out_len)
{
    size_t h = strlen(header), hp = (h + 7) & ~(size_t)7;
    size_t n = 8 + hp + data_len;
    uint8_t *b = calloc(1, n);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)hp >> (8 * i));
    memcpy(b + 8, header, h);
    memset(b + 8 + h, ' ', hp - h);
    for (size_t i = 0; i < data_len; i++) b[8 + hp + i] = (uint8_t)i;
    *out_len = n;
    return b;
}

/* Opens an image built from header; *img_out keeps the bytes alive (caller frees after close). */
static int open_hdr(const char *header, size_t data_len, prism_st_t **st, uint8_t **img_out)
{
    size_t n;
    uint8_t *img = make_image(header, data_len, &n);
    char err[256] = "";
    int rc = prism_st_open_memory(img, n, st, err, sizeof err);
    if (rc != PRISM_OK) assert_true(err[0] != '\0');  /* every failure explains itself */
    *img_out = img;
    return rc;
}

static void test_valid(void **state)
{
    (void)state;
    prism_st_t *st;
    const char *h = "{\"__metadata__\":{\"format\":\"pt\"},"
                    "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[16,24]},"
                    "\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                    "\"s\":{\"dtype\":\"F16\",\"shape\":[],\"data_offsets\":[24,26]}}";
    uint8_t *img;
    assert_int_equal(open_hdr(h, 26, &st, &img), PRISM_OK);
    assert_int_equal(prism_st_count(st), 3);
    const prism_st_tensor_t *a = prism_st_find(st, "a"), *b = prism_st_find(st, "b"), *s = prism_st_find(st, "s");
    assert_non_null(a); assert_non_null(b); assert_non_null(s);
    assert_null(prism_st_find(st, "c"));
    assert_int_equal(a->dtype, PRISM_ST_F32);
    assert_int_equal(b->ndim, 2);
    assert_int_equal(b->shape[1], 2);
    assert_int_equal(b->nbytes, 8);
    assert_int_equal(s->numel, 1);
    float f[4];
    assert_int_equal(prism_st_read_f32(b, 1, 3, f), PRISM_OK);
    assert_int_equal(prism_st_read_f32(b, 2, 3, f), PRISM_EINVAL);
    prism_st_close(st);
    free(img);
}

/* A header with no tensors ("{}" or metadata only) is a valid, empty file. Found by fuzz_safetensors:
 * the empty table was sorted and searched through a NULL pointer (undefined; UBSan's nonnull). */
static void test_empty_header(void **state)
{
    (void)state;
    static const char *hdrs[] = {"{}", "{\"__metadata__\":{\"format\":\"pt\"}}"};
    for (size_t i = 0; i < 2; i++) {
        prism_st_t *st;
        uint8_t *img;
        assert_int_equal(open_hdr(hdrs[i], 0, &st, &img), PRISM_OK);
        assert_int_equal(prism_st_count(st), 0);
        assert_null(prism_st_find(st, "a"));
        assert_null(prism_st_get(st, 0));
        prism_st_close(st);
        free(img);
    }
}

static void test_corrupt(void **state)
{
    (void)state;
    static const struct { const char *hdr; size_t data; int rc; } cases[] = {
        {"[1,2]", 0, PRISM_ECORRUPT},                                                         /* not object */
        {"{\"a\":", 0, PRISM_ECORRUPT},                                                       /* bad JSON */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}} x", 16, PRISM_ECORRUPT}, /* trailing */
        {"{\"a\":{\"dtype\":\"Q4\",\"shape\":[4],\"data_offsets\":[0,16]}}", 16, PRISM_ECORRUPT},   /* dtype */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[5],\"data_offsets\":[0,16]}}", 16, PRISM_ECORRUPT},  /* shape/bytes */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,32]}}", 16, PRISM_ECORRUPT},  /* beyond data */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[16,0]}}", 16, PRISM_ECORRUPT},  /* reversed */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-4],\"data_offsets\":[0,16]}}", 16, PRISM_ECORRUPT}, /* negative */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0]}}", 16, PRISM_ECORRUPT},     /* offsets[1] */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":\"4\",\"data_offsets\":[0,16]}}", 16, PRISM_ECORRUPT},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, PRISM_ECORRUPT},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776],\"data_offsets\":[0,4]}}", 4, PRISM_ECORRUPT},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16, PRISM_ECORRUPT},   /* overlap */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, PRISM_ECORRUPT},     /* duplicate */
        {"{\"a\":7}", 0, PRISM_ECORRUPT},
        {"{\"__metadata__\":3}", 0, PRISM_ECORRUPT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        prism_st_t *st = NULL;
        uint8_t *img;
        int rc = open_hdr(cases[i].hdr, cases[i].data, &st, &img);
        free(img);
        if (rc != cases[i].rc) fprintf(stderr, "case %zu: rc %d\n", i, rc);
        assert_int_equal(rc, cases[i].rc);
        assert_null(st);
    }
    /* header length fields out of range, and truncated files */
    uint8_t small[8] = {0};
    prism_st_t *st = NULL;
    char err[128];
    assert_int_equal(prism_st_open_memory(small, 4, &st, err, sizeof err), PRISM_ECORRUPT);
    uint8_t big[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}'};
    assert_int_equal(prism_st_open_memory(big, sizeof big, &st, err, sizeof err), PRISM_ECORRUPT);
    uint8_t over[16] = {200, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    assert_int_equal(prism_st_open_memory(over, sizeof over, &st, err, sizeof err), PRISM_ECORRUPT);
    /* every truncation of a valid file fails cleanly (never reads out of bounds under ASan) */
    size_t n;
    uint8_t *img = make_image("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 16, &n);
    for (size_t cut = 0; cut < n; cut++) {
        uint8_t *t = malloc(cut ? cut : 1);
        memcpy(t, img, cut);
        assert_int_not_equal(prism_st_open_memory(t, cut, &st, err, sizeof err), PRISM_OK);
        free(t);
    }
    /* random byte flips: must never crash; results either valid or an error */
    for (int it = 0; it < 2000; it++) {
        uint8_t *t = malloc(n);
        memcpy(t, img, n);
        unsigned r = (unsigned)it * 2654435761u;
        t[r % n] ^= (uint8_t)(1u << ((r >> 8) % 8));
        if (prism_st_open_memory(t, n, &st, err, sizeof err) == PRISM_OK) prism_st_close(st);
        free(t);
    }
    free(img);
}

static void write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
}

static void test_sharded(void **state)
{
    (void)state;
    char dir[] = "/tmp/prism_st_testXXXXXX";
    assert_non_null(mkdtemp(dir));
    char p[512], err[256];
    size_t n;
    uint8_t *a = make_image("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, &n);
    snprintf(p, sizeof p, "%s/s1.safetensors", dir);
    write_file(p, a, n);
    free(a);
    a = make_image("{\"y\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,6]}}", 6, &n);
    snprintf(p, sizeof p, "%s/s2.safetensors", dir);
    write_file(p, a, n);
    free(a);
    const char *idx = "{\"metadata\":{},\"weight_map\":{\"x\":\"s1.safetensors\",\"y\":\"s2.safetensors\"}}";
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_file(p, idx, strlen(idx));
    prism_st_t *st = NULL;
    assert_int_equal(prism_st_open_dir(dir, &st, err, sizeof err), PRISM_OK);
    assert_int_equal(prism_st_count(st), 2);
    assert_non_null(prism_st_find(st, "y"));
    prism_st_close(st);
    /* a listed tensor missing from its shard */
    idx = "{\"weight_map\":{\"x\":\"s1.safetensors\",\"z\":\"s2.safetensors\"}}";
    write_file(p, idx, strlen(idx));
    assert_int_equal(prism_st_open_dir(dir, &st, err, sizeof err), PRISM_ECORRUPT);
    /* path traversal in a shard name */
    idx = "{\"weight_map\":{\"x\":\"../s1.safetensors\"}}";
    write_file(p, idx, strlen(idx));
    assert_int_equal(prism_st_open_dir(dir, &st, err, sizeof err), PRISM_ECORRUPT);
    /* missing shard file */
    idx = "{\"weight_map\":{\"x\":\"s3.safetensors\"}}";
    write_file(p, idx, strlen(idx));
    assert_int_equal(prism_st_open_dir(dir, &st, err, sizeof err), PRISM_ENOTFOUND);
    idx = "{\"weight_map\":[]}";
    write_file(p, idx, strlen(idx));
    assert_int_equal(prism_st_open_dir(dir, &st, err, sizeof err), PRISM_ECORRUPT);
    /* a real tiny file on disk: too short */
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    write_file(p, "abc", 3);
    assert_int_equal(prism_st_open_dir(dir, &st, err, sizeof err), PRISM_ECORRUPT);
    const char *names[] = {"s1.safetensors", "s2.safetensors", "model.safetensors.index.json", "model.safetensors"};
    for (size_t i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        unlink(p);
    }
    rmdir(dir);
    assert_int_equal(prism_st_open_dir("/nonexistent/prism", &st, err, sizeof err), PRISM_ENOTFOUND);
}

/* The dtype of a checkpoint's matrices (what --weight-dtype auto keeps on the CPU): tensors of one
 * dimension or none (norms, biases, scalars) do not count; two matrix dtypes are no answer. */
static void test_matrix_dtype(void **state)
{
    (void)state;
    static const struct { const char *hdr; size_t data; int rc; prism_st_dtype_t dt; } cases[] = {
        {"{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,8]},"
         "\"n\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16, PRISM_OK, PRISM_ST_BF16},
        {"{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1,2],\"data_offsets\":[8,16]}}", 16, PRISM_EINVAL, 0},
        {"{\"w\":{\"dtype\":\"F16\",\"shape\":[1,1,2],\"data_offsets\":[0,4]}}", 4, PRISM_OK, PRISM_ST_F16},
        {"{\"n\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, PRISM_ENOTFOUND, 0},
        {"{}", 0, PRISM_ENOTFOUND, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        prism_st_t *st;
        uint8_t *img;
        assert_int_equal(open_hdr(cases[i].hdr, cases[i].data, &st, &img), PRISM_OK);
        prism_st_dtype_t dt = (prism_st_dtype_t)-1;
        assert_int_equal(prism_st_matrix_dtype(st, &dt), cases[i].rc);
        if (cases[i].rc == PRISM_OK) assert_int_equal(dt, cases[i].dt);
        prism_st_close(st);
        free(img);
    }
}

static void test_bundled_model(void **state)
{
    (void)state;
    const char *src = getenv("PRISM_SOURCE_DIR");
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/models/prism-tiny-llava", src && *src ? src : PRISM_SOURCE_DIR);
    prism_st_t *st;
    assert_int_equal(prism_st_open_dir(dir, &st, err, sizeof err), PRISM_OK);
    const prism_st_tensor_t *t = prism_st_find(st, "language_model.model.embed_tokens.weight");
    assert_non_null(t);
    assert_int_equal(t->dtype, PRISM_ST_BF16);
    assert_int_equal(t->shape[1], 256);
    prism_st_dtype_t dt;
    assert_int_equal(prism_st_matrix_dtype(st, &dt), PRISM_OK);
    assert_int_equal(dt, PRISM_ST_BF16);
    prism_st_close(st);
}

int main(void)
{
    prism_log_init("test_safetensors", PRISM_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid), cmocka_unit_test(test_empty_header),
        cmocka_unit_test(test_corrupt),
        cmocka_unit_test(test_sharded),
        cmocka_unit_test(test_matrix_dtype), cmocka_unit_test(test_bundled_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
