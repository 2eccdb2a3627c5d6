/* Fixture helpers shared by the image tests: locate tests/data/image, read files, load the
 * manifest written by tools/gen_image_goldens.py, FNV-1a 64 checksums. */
#ifndef PRISM_IMAGE_TEST_UTIL_H
#define PRISM_IMAGE_TEST_UTIL_H

#include "core/core.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline const char *itu_data_dir(void)
{
    static char dir[1024];
    if (!dir[0]) {
        const char *src = getenv("PRISM_SOURCE_DIR");
        if (!src || !src[0])
            src = PRISM_SOURCE_DIR;
        snprintf(dir, sizeof dir, "%s/tests/data/image", src);
    }
    return dir;
}

/* Reads tests/data/image/<name>; aborts the test binary when missing (fixtures are committed). */
static inline uint8_t *itu_read(const char *name, size_t *len)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", itu_data_dir(), name);
    char *buf = NULL;
    int rc = prism_read_file(path, 64u << 20, &buf, len);
    if (rc != PRISM_OK) {
        fprintf(stderr, "missing fixture %s (%s)\n", path, prism_strerror(rc));
        abort();
    }
    return (uint8_t *)buf;
}

/* Loads tests/data/image/<name> as JSON; NULL (said on stderr) when it cannot. */
static inline json_t *itu_load_json(const char *name)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", itu_data_dir(), name);
    json_error_t err;
    json_t *j = json_load_file(path, 0, &err);
    if (!j) fprintf(stderr, "cannot load %s: %s\n", path, err.text);
    return j;
}

static inline json_t *itu_manifest(void)
{
    json_t *m = itu_load_json("manifest.json");
    if (!m) abort();
    return m;
}

static inline int itu_int(json_t *o, const char *key) { return (int)json_integer_value(json_object_get(o, key)); }

static inline const char *itu_str(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static inline uint64_t itu_fnv1a64(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001B3ull;
    }
    return h;
}

static inline bool itu_fnv_matches(json_t *o, const char *key, const void *p, size_t n)
{
    const char *s = itu_str(o, key);
    if (!s)
        return false;
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)itu_fnv1a64(p, n));
    return strcmp(hex, s) == 0;
}

#endif
