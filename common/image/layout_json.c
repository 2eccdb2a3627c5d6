/* The processors' JSON configs (layout_json.h). */
#include "image/layout_json.h"

#include <stdio.h>

#define MAX_CONFIG_BYTES (1u << 20)
#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)

json_t *prism_layout_load_json(const char *path, bool optional, int *rc, char *err, size_t errlen)
{
    *rc = PRISM_OK;
    if (optional && !prism_file_exists(path)) return NULL;
    char *text = NULL;
    size_t n = 0;
    *rc = prism_read_file(path, MAX_CONFIG_BYTES, &text, &n);
    if (*rc != PRISM_OK) {
        ERR("%s: %s", path, prism_strerror(*rc));
        return NULL;
    }
    json_error_t jerr;
    json_t *j = json_loadb(text, n, JSON_REJECT_DUPLICATES, &jerr);
    prism_free(text);
    if (!j || !json_is_object(j)) {
        ERR("%s: %s", path, j ? "not a JSON object" : jerr.text);
        json_decref(j);
        *rc = PRISM_EINVAL;
        return NULL;
    }
    return j;
}

bool prism_layout_opt_num(json_t *o, const char *k, double *v)
{
    json_t *j = json_object_get(o, k);
    if (!j || json_is_null(j)) return true;
    if (!json_is_number(j)) return false;
    *v = json_number_value(j);
    return true;
}

bool prism_layout_opt_triplet(json_t *o, const char *k, float out[3])
{
    json_t *j = json_object_get(o, k);
    if (!j || json_is_null(j)) return true;
    if (json_is_number(j)) {
        out[0] = out[1] = out[2] = (float)json_number_value(j);
        return true;
    }
    if (!json_is_array(j) || json_array_size(j) != 3) return false;
    for (int c = 0; c < 3; c++) {
        if (!json_is_number(json_array_get(j, c))) return false;
        out[c] = (float)json_number_value(json_array_get(j, c));
    }
    return true;
}

bool prism_layout_opt_bool(json_t *o, const char *k, bool *v)
{
    json_t *j = json_object_get(o, k);
    if (!j || json_is_null(j)) return true;
    if (!json_is_boolean(j)) return false;
    *v = json_is_true(j);
    return true;
}
