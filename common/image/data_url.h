/* data_url: strict base64 and `data:` URL parsing for OpenAI image_url parts.
 *
 *   const char *mime, *b64; size_t mime_len, b64_len;
 *   if (prism_data_url_parse(url, url_len, &mime, &mime_len, &b64, &b64_len) != PRISM_OK) -> 400
 *   size_t cap = prism_base64_decoded_max(b64_len), n;
 *   prism_base64_decode(b64, b64_len, buf, cap, &n);
 *
 * Strict like Python's base64.b64decode(s, validate=True), which vLLM uses: every byte must be in the
 * standard alphabet (A-Z a-z 0-9 + /), the length must be a multiple of 4 and '=' may only pad the
 * final quantum (one or two of them). Whitespace, URL-safe symbols, missing padding and data after
 * padding are rejected. Unused low bits of the last symbol are ignored, as Python does.
 */
#ifndef PRISM_IMAGE_DATA_URL_H
#define PRISM_IMAGE_DATA_URL_H

#include "core/core.h"

/* Upper bound on the decoded size of len base64 characters. */
size_t prism_base64_decoded_max(size_t len);

/* Decodes into out[0..cap). PRISM_EINVAL on any invalid character, misplaced or missing padding;
 * PRISM_ELIMIT when the output would exceed cap. */
int prism_base64_decode(const char *in, size_t len, uint8_t *out, size_t cap, size_t *out_len);

/* Splits "data:<mime>[;param=value]*;base64,<payload>". mime points into url (e.g. "image/png",
 * lower-cased comparison is the caller's business); b64 is the payload. Only base64 data URLs are
 * accepted (PRISM_ENOTSUP for percent-encoded ones); anything else malformed is PRISM_EINVAL. */
int prism_data_url_parse(const char *url, size_t len, const char **mime, size_t *mime_len,
                         const char **b64, size_t *b64_len);

/* True when mime is image/jpeg, image/jpg, image/pjpeg or image/png (ASCII case-insensitive). */
bool prism_data_url_mime_is_image(const char *mime, size_t mime_len);

#endif
