/* Internal to prism_image_layout: reading the small JSON configs of the image processors
 * (preprocessor_config.json, processor_config.json) the same way for every model. */
#ifndef PRISM_IMAGE_LAYOUT_JSON_H
#define PRISM_IMAGE_LAYOUT_JSON_H

#include "core/core.h"

#include <jansson.h>

/* The JSON object in path (at most 1 MiB). NULL with *rc = PRISM_OK when optional and absent;
 * NULL with *rc set and err filled on failure. */
json_t *prism_layout_load_json(const char *path, bool optional, int *rc, char *err, size_t errlen);
/* Optional number / number-or-triplet: absent or null leaves *v unchanged; false for another type. */
bool prism_layout_opt_num(json_t *o, const char *k, double *v);
bool prism_layout_opt_triplet(json_t *o, const char *k, float out[3]);
/* Optional boolean: absent or null leaves *v unchanged; false for another type. */
bool prism_layout_opt_bool(json_t *o, const char *k, bool *v);

#endif
