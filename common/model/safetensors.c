/* safetensors reader: mmap + strict header validation (jansson).
 *
 * Built without jansson (PRISM_HAVE_JANSSON undefined: tools/gpu on GPU machines that lack it)
 * the reader opens nothing and says why; the model's --random-weights path reads no checkpoint. */
#include "model/safetensors.h"
#include "backend/backend.h"

#include <errno.h>
#include <fcntl.h>
#ifdef PRISM_HAVE_JANSSON
#include <jansson.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    void *map;       /* NULL for in-memory images */
    size_t len;
} st_map_t;

struct prism_st {
    st_map_t maps[PRISM_ST_MAX_SHARDS];
    int n_maps;
    prism_st_tensor_t *tensors;   /* [n] sorted by name after open */
    int n, cap;
};

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)

static const struct { const char *name; prism_st_dtype_t t; size_t size; } k_dtypes[] = {
    {"F32", PRISM_ST_F32, 4}, {"BF16", PRISM_ST_BF16, 2}, {"F16", PRISM_ST_F16, 2},
    {"F64", PRISM_ST_F64, 8}, {"I64", PRISM_ST_I64, 8}, {"I32", PRISM_ST_I32, 4},
    {"I16", PRISM_ST_I16, 2}, {"I8", PRISM_ST_I8, 1}, {"U8", PRISM_ST_U8, 1}, {"BOOL", PRISM_ST_BOOL, 1},
    {"F8_E4M3", PRISM_ST_F8_E4M3, 1}, {"F8_E5M2", PRISM_ST_F8_E5M2, 1},
};

size_t prism_st_dtype_size(prism_st_dtype_t t)
{
    for (size_t i = 0; i < PRISM_ARRAY_LEN(k_dtypes); i++)
        if (k_dtypes[i].t == t) return k_dtypes[i].size;
    return 0;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp(((const prism_st_tensor_t *)a)->name, ((const prism_st_tensor_t *)b)->name);
}

typedef struct { uint64_t begin, end; } span_t;

#ifdef PRISM_HAVE_JANSSON
static int cmp_span(const void *a, const void *b)
{
    const span_t *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : 0;
}

/* Parses one file image and appends its tensors. */
static int parse_image(prism_st_t *st, const uint8_t *buf, size_t len, const char *what, char *err, size_t errlen)
{
    json_t *root = NULL;
    span_t *spans = NULL;
    int rc = PRISM_ECORRUPT;
    if (len < 8) {
        ERR("%s: file too short for a safetensors header", what);
        goto fail;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | buf[i];
    if (hlen < 2 || hlen > PRISM_ST_MAX_HEADER || hlen > len - 8) {
        ERR("%s: header length %llu out of range (file %zu bytes)", what, (unsigned long long)hlen, len);
        goto fail;
    }
    json_error_t jerr;
    root = json_loadb((const char *)buf + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root || !json_is_object(root)) {
        ERR("%s: header is not a JSON object (%s)", what, root ? "wrong type" : jerr.text);
        goto fail;
    }
    const uint8_t *data = buf + 8 + hlen;
    uint64_t data_len = len - 8 - hlen;
    size_t n_entries = json_object_size(root);
    if (n_entries > PRISM_ST_MAX_TENSORS || (size_t)st->n + n_entries > PRISM_ST_MAX_TENSORS) {
        rc = PRISM_ELIMIT;
        ERR("%s: too many tensors", what);
        goto fail;
    }
    if (st->n + (int)n_entries > st->cap) {
        int cap = st->n + (int)n_entries + 16;
        prism_st_tensor_t *nt = prism_realloc(st->tensors, (size_t)cap * sizeof *nt);
        if (!nt) { rc = PRISM_ENOMEM; goto fail; }
        st->tensors = nt;
        st->cap = cap;
    }
    spans = prism_calloc(n_entries ? n_entries : 1, sizeof *spans);
    if (!spans) { rc = PRISM_ENOMEM; goto fail; }
    int n_spans = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(val)) {
                ERR("%s: __metadata__ is not an object", what);
                goto fail;
            }
            continue;
        }
        size_t klen = strlen(key);
        if (klen == 0 || klen > PRISM_ST_MAX_NAME) {
            ERR("%s: tensor name length %zu out of range", what, klen);
            goto fail;
        }
        if (!json_is_object(val)) {
            ERR("%s: tensor '%s' entry is not an object", what, key);
            goto fail;
        }
        json_t *jd = json_object_get(val, "dtype"), *js = json_object_get(val, "shape"),
               *jo = json_object_get(val, "data_offsets");
        if (!json_is_string(jd) || !json_is_array(js) || !json_is_array(jo) || json_array_size(jo) != 2) {
            ERR("%s: tensor '%s' needs dtype, shape and data_offsets[2]", what, key);
            goto fail;
        }
        prism_st_tensor_t t = {0};
        size_t esize = 0;
        for (size_t i = 0; i < PRISM_ARRAY_LEN(k_dtypes); i++)
            if (strcmp(json_string_value(jd), k_dtypes[i].name) == 0) {
                t.dtype = k_dtypes[i].t;
                esize = k_dtypes[i].size;
            }
        if (!esize) {
            ERR("%s: tensor '%s' has unknown dtype '%s'", what, key, json_string_value(jd));
            goto fail;
        }
        size_t nd = json_array_size(js);
        if (nd > PRISM_ST_MAX_DIMS) {
            ERR("%s: tensor '%s' has %zu dims (max %d)", what, key, nd, PRISM_ST_MAX_DIMS);
            goto fail;
        }
        t.ndim = (int)nd;
        uint64_t numel = 1;
        for (size_t d = 0; d < nd; d++) {
            json_t *e = json_array_get(js, d);
            if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > ((int64_t)1 << 40)) {
                ERR("%s: tensor '%s' has a bad shape", what, key);
                goto fail;
            }
            t.shape[d] = json_integer_value(e);
            if (t.shape[d] && numel > UINT64_MAX / 16 / (uint64_t)t.shape[d]) {
                ERR("%s: tensor '%s' shape overflows", what, key);
                goto fail;
            }
            numel *= (uint64_t)t.shape[d];
        }
        json_t *jb = json_array_get(jo, 0), *je = json_array_get(jo, 1);
        if (!json_is_integer(jb) || !json_is_integer(je) || json_integer_value(jb) < 0 ||
            json_integer_value(je) < json_integer_value(jb)) {
            ERR("%s: tensor '%s' has bad data_offsets", what, key);
            goto fail;
        }
        uint64_t b = (uint64_t)json_integer_value(jb), e = (uint64_t)json_integer_value(je);
        if (e > data_len) {
            ERR("%s: tensor '%s' data [%llu, %llu) beyond the %llu data bytes", what, key,
                (unsigned long long)b, (unsigned long long)e, (unsigned long long)data_len);
            goto fail;
        }
        if (e - b != numel * esize) {
            ERR("%s: tensor '%s' has %llu bytes but shape needs %llu", what, key,
                (unsigned long long)(e - b), (unsigned long long)(numel * esize));
            goto fail;
        }
        t.name = prism_strdup(key);
        if (!t.name) { rc = PRISM_ENOMEM; goto fail; }
        t.data = data + b;
        t.nbytes = (size_t)(e - b);
        t.numel = (int64_t)numel;
        st->tensors[st->n++] = t;
        spans[n_spans++] = (span_t){b, e};
    }
    if (n_spans > 1) qsort(spans, (size_t)n_spans, sizeof *spans, cmp_span);  /* qsort(NULL, 0) is undefined */
    for (int i = 1; i < n_spans; i++)
        if (spans[i].begin < spans[i - 1].end) {
            ERR("%s: tensor data ranges overlap", what);
            goto fail;
        }
    rc = PRISM_OK;
fail:
    prism_free(spans);
    json_decref(root);
    return rc;
}
#else
static int parse_image(prism_st_t *st, const uint8_t *buf, size_t len, const char *what, char *err, size_t errlen)
{
    ERR("%s: this build has no JSON parser (jansson), so it reads no checkpoints", what);
    return PRISM_ENOTSUP;
}
#endif

static int finish(prism_st_t *st, char *err, size_t errlen)
{
    if (st->n > 1) qsort(st->tensors, (size_t)st->n, sizeof *st->tensors, cmp_tensor_name);  /* "{}": no table */
    for (int i = 1; i < st->n; i++)
        if (strcmp(st->tensors[i].name, st->tensors[i - 1].name) == 0) {
            ERR("tensor '%s' appears twice", st->tensors[i].name);
            return PRISM_ECORRUPT;
        }
    return PRISM_OK;
}

static int map_file(prism_st_t *st, const char *path, char *err, size_t errlen)
{
    if (st->n_maps >= PRISM_ST_MAX_SHARDS) {
        ERR("too many shards");
        return PRISM_ELIMIT;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        ERR("%s: %s", path, strerror(errno));
        return errno == ENOENT ? PRISM_ENOTFOUND : PRISM_EIO;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        ERR("%s: not a regular file", path);
        close(fd);
        return PRISM_EIO;
    }
    if (sb.st_size < 8) {
        ERR("%s: file too short for a safetensors header", path);
        close(fd);
        return PRISM_ECORRUPT;
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        ERR("%s: mmap: %s", path, strerror(errno));
        return PRISM_EIO;
    }
    st->maps[st->n_maps++] = (st_map_t){m, (size_t)sb.st_size};
    return parse_image(st, m, (size_t)sb.st_size, path, err, errlen);
}

int prism_st_open(const char *path, prism_st_t **out, char *err, size_t errlen)
{
    *out = NULL;
    prism_st_t *st = prism_calloc(1, sizeof *st);
    if (!st) return PRISM_ENOMEM;
    int rc = map_file(st, path, err, errlen);
    if (rc == PRISM_OK) rc = finish(st, err, errlen);
    if (rc != PRISM_OK) {
        prism_st_close(st);
        return rc;
    }
    *out = st;
    return PRISM_OK;
}

int prism_st_open_memory(const void *buf, size_t len, prism_st_t **out, char *err, size_t errlen)
{
    *out = NULL;
    prism_st_t *st = prism_calloc(1, sizeof *st);
    if (!st) return PRISM_ENOMEM;
    int rc = parse_image(st, buf, len, "<memory>", err, errlen);
    if (rc == PRISM_OK) rc = finish(st, err, errlen);
    if (rc != PRISM_OK) {
        prism_st_close(st);
        return rc;
    }
    *out = st;
    return PRISM_OK;
}

int prism_st_matrix_dtype(const prism_st_t *st, prism_st_dtype_t *out)
{
    bool any = false;
    for (int i = 0; i < st->n; i++) {
        const prism_st_tensor_t *t = &st->tensors[i];
        if (t->ndim < 2) continue;
        if (any && t->dtype != *out) return PRISM_EINVAL;
        *out = t->dtype;
        any = true;
    }
    return any ? PRISM_OK : PRISM_ENOTFOUND;
}

static int open_index(const char *dir, const char *path, prism_st_t **out, char *err, size_t errlen);

int prism_st_open_dir(const char *dir, prism_st_t **out, char *err, size_t errlen)
{
    char path[4096];
    *out = NULL;
    if (prism_path_join(path, sizeof path, dir, "model.safetensors") != PRISM_OK) {
        ERR("model path too long");
        return PRISM_ELIMIT;
    }
    if (prism_file_exists(path)) return prism_st_open(path, out, err, errlen);
    if (prism_path_join(path, sizeof path, dir, "model.safetensors.index.json") != PRISM_OK) return PRISM_ELIMIT;
    return open_index(dir, path, out, err, errlen);
}

#ifdef PRISM_HAVE_JANSSON
static bool shard_name_ok(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 255 || s[0] == '.') return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] == '/' || s[i] == '\\') return false;
    return true;
}

/* A sharded checkpoint: model.safetensors.index.json's weight_map names the shard files. */
static int open_index(const char *dir, const char *path, prism_st_t **out, char *err, size_t errlen)
{
    char *text = NULL;
    size_t tlen = 0;
    json_t *root = NULL;
    prism_st_t *st = NULL;
    int rc = prism_read_file(path, 64u << 20, &text, &tlen);
    if (rc != PRISM_OK) {
        ERR("%s: no model.safetensors or index (%s)", dir, prism_strerror(rc));
        return rc == PRISM_EIO ? PRISM_ENOTFOUND : rc;
    }
    json_error_t jerr;
    root = json_loadb(text, tlen, JSON_REJECT_DUPLICATES, &jerr);
    json_t *wm = root ? json_object_get(root, "weight_map") : NULL;
    rc = PRISM_ECORRUPT;
    if (!json_is_object(wm)) {
        ERR("%s: no weight_map object (%s)", path, root ? "missing" : jerr.text);
        goto fail;
    }
    st = prism_calloc(1, sizeof *st);
    if (!st) { rc = PRISM_ENOMEM; goto fail; }
    /* Shard names in first-seen order, deduplicated (the map is small: linear scan is fine). */
    const char *shards[PRISM_ST_MAX_SHARDS];
    int n_shards = 0;
    const char *key;
    json_t *val;
    json_object_foreach(wm, key, val) {
        if (!json_is_string(val) || !shard_name_ok(json_string_value(val))) {
            ERR("%s: bad shard file name for '%s'", path, key);
            goto fail;
        }
        const char *f = json_string_value(val);
        bool seen = false;
        for (int i = 0; i < n_shards && !seen; i++) seen = strcmp(shards[i], f) == 0;
        if (!seen) {
            if (n_shards >= PRISM_ST_MAX_SHARDS) { rc = PRISM_ELIMIT; ERR("too many shards"); goto fail; }
            shards[n_shards++] = f;
        }
    }
    for (int i = 0; i < n_shards; i++) {
        char sp[4096];
        if (prism_path_join(sp, sizeof sp, dir, shards[i]) != PRISM_OK) { rc = PRISM_ELIMIT; goto fail; }
        rc = map_file(st, sp, err, errlen);
        if (rc != PRISM_OK) goto fail;
    }
    rc = finish(st, err, errlen);
    if (rc != PRISM_OK) goto fail;
    json_object_foreach(wm, key, val) {
        if (!prism_st_find(st, key)) {
            ERR("%s: tensor '%s' listed in the index is missing from %s", path, key, json_string_value(val));
            rc = PRISM_ECORRUPT;
            goto fail;
        }
    }
    json_decref(root);
    prism_free(text);
    *out = st;
    return PRISM_OK;
fail:
    prism_st_close(st);
    json_decref(root);
    prism_free(text);
    return rc;
}
#else
static int open_index(const char *dir, const char *path, prism_st_t **out, char *err, size_t errlen)
{
    ERR("%s: this build has no JSON parser (jansson), so it reads no checkpoints", path);
    return PRISM_ENOTSUP;
}
#endif

void prism_st_close(prism_st_t *st)
{
    if (!st) return;
    for (int i = 0; i < st->n; i++) prism_free((void *)st->tensors[i].name);
    prism_free(st->tensors);
    for (int i = 0; i < st->n_maps; i++)
        if (st->maps[i].map) munmap(st->maps[i].map, st->maps[i].len);
    prism_free(st);
}

int prism_st_count(const prism_st_t *st) { return st->n; }

const prism_st_tensor_t *prism_st_get(const prism_st_t *st, int i)
{
    return i >= 0 && i < st->n ? &st->tensors[i] : NULL;
}

const prism_st_tensor_t *prism_st_find(const prism_st_t *st, const char *name)
{
    int lo = 0, hi = st->n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2, c = strcmp(st->tensors[mid].name, name);
        if (c == 0) return &st->tensors[mid];
        if (c < 0) lo = mid + 1; else hi = mid - 1;
    }
    return NULL;
}

int prism_st_read_f32(const prism_st_tensor_t *t, int64_t off, int64_t n, float *dst)
{
    if (off < 0 || n < 0 || off + n > t->numel) return PRISM_EINVAL;
    const uint8_t *p = t->data;
    switch (t->dtype) {
    case PRISM_ST_F32: memcpy(dst, p + off * 4, (size_t)n * 4); return PRISM_OK;
    case PRISM_ST_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + (off + i) * 2, 2);
            dst[i] = prism_bf16_to_f32(h);
        }
        return PRISM_OK;
    case PRISM_ST_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + (off + i) * 2, 2);
            dst[i] = prism_f16_to_f32(h);
        }
        return PRISM_OK;
    default: return PRISM_ENOTSUP;
    }
}
