/* body_lift: a streaming pre-pass over a JSON request body that lifts base64 data-URL strings out
 * of it while the bytes arrive, so no layer ever holds an image request's body whole.
 *
 * Feed the body in pieces of any size (a piece may end anywhere: inside an escape, a \uXXXX, a
 * base64 quantum). Every byte goes to `out` (the "skeleton", which the usual whole-body JSON parser
 * reads afterwards) except the payload of a lifted string: a string value of the key "url" or
 * "image_url" whose unescaped text starts with a base64 data-URL header that prism_data_url_parse
 * accepts ("data:image/png;base64,"). Its base64 payload is JSON-unescaped (`\/` and the rest) and
 * decoded as it streams into an image buffer, and the string in the skeleton becomes
 * "prism-lifted:N" (N = the lift's index, in body order). Anything else (short strings, other keys,
 * a header longer than PRISM_LIFT_MAX_HEADER or not ASCII, more than PRISM_LIFT_MAX strings) stays
 * in the skeleton as sent, and the caller's whole-string path handles it as before.
 *
 * Decoding is as strict as prism_base64_decode (the same alphabet, padding and length rules): a
 * payload it would refuse is marked `bad` (the caller answers 400 for it, as for the whole string);
 * its bytes are not kept. Malformed JSON is not this layer's business: the skeleton keeps it and
 * the JSON parser refuses it.
 *
 * Memory: an image buffer grows by doubling (never past what the rest of a declared body can decode
 * to) and is trimmed to its length when the string ends, so it is at most twice what arrived.
 * held() counts the image buffers' capacity (what the HTTP server charges to its budget).
 * Ownership: the images belong to the lifter until taken (prism_lift_take); prism_lift_free frees
 * the rest. One thread, except prism_lift_peek (below).
 */
#ifndef PRISM_ROUTER_BODY_LIFT_H
#define PRISM_ROUTER_BODY_LIFT_H

#include "core/core.h"

#define PRISM_LIFT_MAX        64   /* lifted strings per body; more stay in the skeleton */
#define PRISM_LIFT_MAX_HEADER 256  /* unescaped bytes up to and including the data URL's comma */
#define PRISM_LIFT_REF_PREFIX "prism-lifted:"

typedef struct {
    uint8_t *data;       /* decoded bytes [len] (NULL when empty or bad) */
    size_t len, cap;
    char mime[64];       /* the data URL's media type, NUL-terminated (a longer one is not lifted) */
    bool bad;            /* the payload is not valid base64 (strict) */
    bool done;           /* its closing quote was seen */
    bool taken;
    int ordinal;         /* string values of "url" / "image_url" keys before it in the body, lifted or
                          * not: its image's index among the request's image parts when each part
                          * carries one URL (the OpenAI shape) */
} prism_lift_image_t;

typedef struct {
    /* scanner state */
    int state;
    bool esc;                 /* inside a normal string: the next byte is escaped */
    bool expect_value;        /* last significant byte outside strings was ':' */
    bool key_is_url;          /* the key before that ':' was "url" or "image_url" */
    char cur[16];             /* first bytes of the string being scanned (to know keys) */
    size_t cur_len;
    bool last_is_url;         /* the last string that ended was "url" / "image_url" */
    int n_urls;               /* string values of "url" / "image_url" keys seen so far */
    /* unescaping (candidate header and lifted payload) */
    int u_state;              /* 0 plain, 1 after '\\', 2..5 reading \uXXXX digits */
    uint32_t u_val;
    /* candidate header: raw bytes (to write back when not lifted) and their unescaped text */
    char raw[PRISM_LIFT_MAX_HEADER * 6 + 8];
    size_t raw_len;
    char hdr[PRISM_LIFT_MAX_HEADER + 1];
    size_t hdr_len;
    /* base64 of the image being lifted */
    uint8_t quad[4];
    int nq, pads;
    /* input */
    uint64_t declared;        /* whole body length when known, else 0 */
    uint64_t fed;             /* bytes fed so far */
    size_t max_image;         /* largest decoded image buffer */
    size_t held;              /* image buffer capacity, over all images not taken */
    prism_lift_image_t img[PRISM_LIFT_MAX];
    int n;
} prism_lift_t;

/* declared: the body's Content-Length (0 = unknown); max_image bounds one image buffer. */
void prism_lift_init(prism_lift_t *l, uint64_t declared, size_t max_image);
/* Appends the skeleton part of p[0..n) to out. PRISM_ENOMEM when a buffer cannot grow. */
int  prism_lift_feed(prism_lift_t *l, prism_buf_t *out, const char *p, size_t n);
/* End of body: a candidate string cut off by the end goes back to the skeleton as it came (the JSON
 * parser then refuses the body). */
int  prism_lift_finish(prism_lift_t *l, prism_buf_t *out);
/* Image buffer bytes the lifter holds (capacity, not taken). */
static inline size_t prism_lift_held(const prism_lift_t *l) { return l->held; }
/* Hands image i over (*data is the caller's to prism_free; NULL with *len 0 for an empty or bad
 * payload). PRISM_EINVAL when i is out of range or already taken. */
int  prism_lift_take(prism_lift_t *l, int i, uint8_t **data, size_t *len, const char **mime, bool *bad);
/* Image i's bytes, left with the lifter (what take would hand over); the same errors. Once the body
 * is whole nothing changes the lifter until it is freed or an image taken: another thread may peek
 * then while the owner keeps off it. */
int  prism_lift_peek(const prism_lift_t *l, int i, const uint8_t **data, size_t *len, const char **mime, bool *bad);
void prism_lift_free(prism_lift_t *l);
/* i when s[0..len) is exactly PRISM_LIFT_REF_PREFIX "<i>", else -1. */
int  prism_lift_ref(const char *s, size_t len);

#endif
