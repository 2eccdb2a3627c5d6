/* core: logging, status codes, counting allocator, arenas, time and file helpers.
 *
 * Every Prism library includes this. Conventions used across the tree:
 *  - names are prism_<thing>_<action>; types end in _t; enum values are PRISM_<TYPE>_<NAME>.
 *  - recoverable failures return a negative prism_status_t (PRISM_EAGAIN means "try again later");
 *    broken invariants hit PRISM_ASSERT, which is always on and aborts with file:line.
 *  - all heap memory goes through prism_malloc & co., so used and peak bytes are a metric;
 *    workers additionally carve big regions up front with prism_arena_t.
 */
#ifndef PRISM_CORE_H
#define PRISM_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdarg.h>

/* Symbols: every library is built with hidden visibility, so a process exports nothing but PRISM_API.
 * What carries it is the part of core the shared modules a process dlopens (the CUDA backend, the NCCL
 * communicator) use: logging, the counting allocator, time, status text. A module has no copy of
 * prism_core; it binds to the process's (one allocator count, one log configuration), and a module
 * that needs a core function without PRISM_API fails to load, loudly, instead of quietly using a
 * copy. A module's own entry points carry PRISM_API too. */
#define PRISM_API __attribute__((visibility("default")))

/* ---- status codes (second error tier: recoverable) ---- */
typedef enum {
    PRISM_OK        = 0,
    PRISM_EAGAIN    = -1,  /* resource temporarily full: retry later / backpressure */
    PRISM_EINVAL    = -2,  /* bad argument or malformed input */
    PRISM_ENOMEM    = -3,  /* allocation or budget exhausted */
    PRISM_EIO       = -4,  /* OS / file / socket error */
    PRISM_ECORRUPT  = -5,  /* input file or message is corrupt */
    PRISM_ELIMIT    = -6,  /* input exceeds a configured bound */
    PRISM_ENOTSUP   = -7,  /* valid but unsupported */
    PRISM_ENOTFOUND = -8,
} prism_status_t;

PRISM_API const char *prism_strerror(int status);

/* Process exit status of a worker that stops because a peer it cannot work without is gone (a rank
 * of its tensor-parallel group): not a configuration error, so a supervisor restarts it even in its
 * first seconds (sysexits' EX_TEMPFAIL). */
#define PRISM_EXIT_PEER_LOST 75

/* ---- logging ----
 * One line per call on stderr, as text ("12:00:00.123 router[42] WARN file.c:10: trace=<32 hex> msg")
 * or, with prism_log_set_format(PRISM_LOG_JSON) (--log-format json), one JSON object per line:
 *   {"time":"2026-01-02T12:00:00.123Z","level":"warn","process":"router","pid":42,"worker_id":"...",
 *    "request_id":"123","trace_id":"4bf9...","file":"file.c","line":10,"message":"..."}
 * (request_id and trace_id are null on lines about no request).
 *
 * A line about a request carries the request's log context (its id and its W3C trace id): given
 * explicitly (prism_log_ctx, PRISM_LOGC), or as the calling thread's current request
 * (prism_log_ctx_enter / _leave: a worker sets it where it handles one request's message or runs one
 * request, the router's loop where it prepares one or handles a worker's result about it; every line
 * logged meanwhile, in any function below, carries it). Setting it is a pointer store: cheap enough
 * for every message. A line never allocates (formatted on the stack; a JSON message is cut at 4 KiB). */
typedef enum { PRISM_LOG_DEBUG, PRISM_LOG_INFO, PRISM_LOG_WARN, PRISM_LOG_ERROR } prism_log_level_t;
typedef enum { PRISM_LOG_TEXT, PRISM_LOG_JSON } prism_log_format_t;

/* A W3C trace id (16 bytes; hi holds the first 8 as the hex reads them). {0, 0}: none. */
typedef struct {
    uint64_t hi, lo;
} prism_trace_id_t;

/* The 32 lowercase hex digits of a W3C trace id at hex (not NUL-terminated there): false when they
 * are not, or all zeros (invalid in W3C). */
bool prism_trace_id_parse(const char *hex, prism_trace_id_t *out);
void prism_trace_id_hex(prism_trace_id_t t, char out[33]);

/* What a line is about: one request (the low half of its id, as the router keys it) and its trace. */
typedef struct {
    uint64_t request_id;
    prism_trace_id_t trace;
} prism_log_ctx_t;

void prism_log_init(const char *process_name, prism_log_level_t min_level);
void prism_log_set_level(prism_log_level_t min_level);
prism_log_level_t prism_log_level_parse(const char *s); /* "debug".."error"; INFO if unknown */
void prism_log_set_format(prism_log_format_t format);
/* "text" or "json": PRISM_OK, else PRISM_EINVAL (*out untouched). */
int  prism_log_format_parse(const char *s, prism_log_format_t *out);
/* The JSON lines' worker_id (a worker's --worker-id, the router's id); copied. */
void prism_log_set_worker(const char *worker_id);
PRISM_API void prism_log(prism_log_level_t level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A line about the request ctx names (NULL: as prism_log). */
void prism_log_ctx(prism_log_level_t level, const char *file, int line, const prism_log_ctx_t *ctx, const char *fmt,
                   ...) __attribute__((format(printf, 5, 6)));
/* The calling thread's current request from here (NULL: none); returns the one it replaces, to be
 * given back to prism_log_ctx_leave. ctx must stay valid until then. */
const prism_log_ctx_t *prism_log_ctx_enter(const prism_log_ctx_t *ctx);
void prism_log_ctx_leave(const prism_log_ctx_t *previous);

#define PRISM_DEBUG(...) prism_log(PRISM_LOG_DEBUG, __FILE__, __LINE__, __VA_ARGS__)
#define PRISM_INFO(...)  prism_log(PRISM_LOG_INFO,  __FILE__, __LINE__, __VA_ARGS__)
#define PRISM_WARN(...)  prism_log(PRISM_LOG_WARN,  __FILE__, __LINE__, __VA_ARGS__)
#define PRISM_ERROR(...) prism_log(PRISM_LOG_ERROR, __FILE__, __LINE__, __VA_ARGS__)
/* PRISM_LOGC(WARN, &q->log, "...", ...): a line about the request ctx names. */
#define PRISM_LOGC(level, ctx, ...) prism_log_ctx(PRISM_LOG_##level, __FILE__, __LINE__, (ctx), __VA_ARGS__)

/* ---- first error tier: broken invariants, always on ---- */
PRISM_API _Noreturn void prism_abort(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define PRISM_ASSERT(x) \
    do { if (!(x)) prism_abort(__FILE__, __LINE__, "assertion failed: %s", #x); } while (0)
#define PRISM_FATAL(...) prism_abort(__FILE__, __LINE__, __VA_ARGS__)

/* ---- counting allocator ----
 * Thread-safe counters of live and peak heap bytes. prism_malloc returns NULL on failure
 * (callers handle it); prism_xmalloc aborts (for start-up paths only). */
PRISM_API void *prism_malloc(size_t n);
PRISM_API void *prism_calloc(size_t count, size_t n);
PRISM_API void *prism_realloc(void *p, size_t n);
PRISM_API void  prism_free(void *p);
void *prism_xmalloc(size_t n);
void *prism_xcalloc(size_t count, size_t n);
char *prism_strdup(const char *s);
char *prism_strndup(const char *s, size_t n);
size_t prism_mem_used(void);
size_t prism_mem_peak(void);
uint64_t prism_mem_alloc_count(void);  /* number of prism_malloc/calloc/realloc calls so far */

/* Aligned large region (pools, arenas); counted too. Freed with prism_free_aligned. */
PRISM_API void *prism_malloc_aligned(size_t n, size_t align);
PRISM_API void  prism_free_aligned(void *p);

/* ---- arena: bump allocator over one region carved at start-up ----
 * prism_arena_alloc returns NULL when full (never grows). Reset frees everything at once. */
typedef struct {
    uint8_t *base;
    size_t   cap;
    size_t   used;
    size_t   peak;
    const char *name;
} prism_arena_t;

void  prism_arena_init(prism_arena_t *a, const char *name, void *base, size_t cap);
void *prism_arena_alloc(prism_arena_t *a, size_t n, size_t align);
void  prism_arena_reset(prism_arena_t *a);

/* ---- growable byte buffer (router, serializers; not for worker hot paths) ---- */
typedef struct {
    char  *data;
    size_t len;
    size_t cap;
} prism_buf_t;

int  prism_buf_reserve(prism_buf_t *b, size_t extra);
int  prism_buf_append(prism_buf_t *b, const void *p, size_t n);
int  prism_buf_appendf(prism_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int  prism_buf_append_str(prism_buf_t *b, const char *s);
void prism_buf_reset(prism_buf_t *b);
void prism_buf_free(prism_buf_t *b);

/* ---- shared bytes: one buffer, several holders (any thread) ----
 * A prism_malloc'd buffer with a reference count: the router's copy of an image and the ZeroMQ
 * frames that carry it are the same bytes (net.h prism_frame_t.release drops a frame's reference),
 * freed when the last holder lets go, from whichever thread that is. The bytes never change once
 * shared. */
typedef struct prism_shared prism_shared_t;
/* Takes data[0..len) over (one reference, the caller's); NULL when the small record cannot be
 * allocated, and then data is still the caller's. */
prism_shared_t *prism_shared_take(void *data, size_t len);
prism_shared_t *prism_shared_ref(prism_shared_t *s);
void prism_shared_unref(prism_shared_t *s);   /* NULL: nothing */
const uint8_t *prism_shared_data(const prism_shared_t *s);
size_t prism_shared_len(const prism_shared_t *s);

/* ---- time, files, misc ---- */
PRISM_API uint64_t prism_now_ns(void);   /* monotonic */
PRISM_API double   prism_now_s(void);    /* monotonic, seconds */
int64_t  prism_unix_time(void);       /* wall clock, seconds */
int64_t  prism_unix_time_us(void);    /* wall clock, microseconds */
/* n bytes from the kernel's CSPRNG (getrandom): for what must be unguessable (request ids, process
 * instance nonces). PRISM_EIO when the kernel cannot give them. */
int      prism_random_bytes(void *out, size_t n);

/* Reads a whole file into a prism_malloc'd, NUL-terminated buffer; fails with PRISM_ELIMIT
 * when the file is larger than max_bytes. */
int prism_read_file(const char *path, size_t max_bytes, char **out, size_t *out_len);
/* Joins dir + "/" + name into out (size n); returns PRISM_ELIMIT if it does not fit. */
int prism_path_join(char *out, size_t n, const char *dir, const char *name);
bool prism_file_exists(const char *path);
/* Files that decide who the cluster trusts (key directories, run directories) must be ours: a
 * directory other local users can change, or a file they own, would let them plant keys or aim our
 * writes. prism_dir_trusted: dir is a directory owned by the effective user or root, writable by
 * no one else, and so is every directory above it; one writable by others is fine when sticky
 * and root's (/tmp: others cannot rename or remove what is ours there).
 * prism_fd_trusted: the open file is a regular file owned by the effective user or root and
 * writable by no one else. (A Kubernetes Secret volume passes: root's files, a root-owned sticky
 * directory.) Both return PRISM_OK or PRISM_EINVAL with a message naming path. */
int prism_dir_trusted(const char *dir, char *err, size_t errlen);
int prism_fd_trusted(int fd, const char *path, char *err, size_t errlen);
/* A secret kept in a file (an API key): the file and its directory trusted as above, and no other
 * user may read the file (its group may: a Kubernetes Secret mounted with fsGroup). Its bytes,
 * surrounding whitespace (a trailing newline) dropped, NUL-terminated into out[cap]. PRISM_OK, or
 * PRISM_EIO / PRISM_EINVAL (untrusted, readable by others, empty) / PRISM_ELIMIT (cap - 1 bytes or
 * more) with a message naming path. */
int prism_secret_file_read(const char *path, char *out, size_t cap, char *err, size_t errlen);
/* Compares a secret with a presented value in time that depends only on the presented length
 * (API keys): no early exit on the first differing byte. */
bool prism_ct_equal(const void *presented, size_t presented_len, const void *secret, size_t secret_len);

/* Parses sizes such as "512M", "2G", "1.5GiB", "1000000"; returns -1 on error. */
int64_t prism_parse_bytes(const char *s);
/* Formats bytes human-readably ("1.50 GiB") into out. */
PRISM_API const char *prism_fmt_bytes(size_t bytes, char *out, size_t n);

#define PRISM_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define PRISM_MIN(a, b) ((a) < (b) ? (a) : (b))
#define PRISM_MAX(a, b) ((a) > (b) ? (a) : (b))
#define PRISM_ALIGN_UP(x, a) (((x) + ((a) - 1)) & ~((size_t)(a) - 1))

#endif
