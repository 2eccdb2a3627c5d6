#include "core/core.h"
#include "core/utf8.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <pthread.h>

const char *prism_strerror(int status)
{
    switch (status) {
    case PRISM_OK:        return "ok";
    case PRISM_EAGAIN:    return "resource temporarily unavailable";
    case PRISM_EINVAL:    return "invalid argument";
    case PRISM_ENOMEM:    return "out of memory or budget";
    case PRISM_EIO:       return "I/O error";
    case PRISM_ECORRUPT:  return "corrupt input";
    case PRISM_ELIMIT:    return "input exceeds a limit";
    case PRISM_ENOTSUP:   return "not supported";
    case PRISM_ENOTFOUND: return "not found";
    default:              return "unknown error";
    }
}

/* ---------------------------------------------------------------- logging */

static char g_proc[32] = "prism";
static char g_worker[72];
static prism_log_level_t g_level = PRISM_LOG_INFO;
static prism_log_format_t g_format = PRISM_LOG_TEXT;
static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local const prism_log_ctx_t *t_ctx;   /* the calling thread's current request */

void prism_log_init(const char *process_name, prism_log_level_t min_level)
{
    snprintf(g_proc, sizeof(g_proc), "%s", process_name ? process_name : "prism");
    g_level = min_level;
    const char *env = getenv("PRISM_LOG_LEVEL");
    if (env && *env)
        g_level = prism_log_level_parse(env);
}

void prism_log_set_level(prism_log_level_t min_level) { g_level = min_level; }
void prism_log_set_format(prism_log_format_t format) { g_format = format; }
void prism_log_set_worker(const char *worker_id)
{
    snprintf(g_worker, sizeof g_worker, "%s", worker_id ? worker_id : "");
}

int prism_log_format_parse(const char *s, prism_log_format_t *out)
{
    if (!s) return PRISM_EINVAL;
    if (!strcmp(s, "text")) *out = PRISM_LOG_TEXT;
    else if (!strcmp(s, "json")) *out = PRISM_LOG_JSON;
    else return PRISM_EINVAL;
    return PRISM_OK;
}

prism_log_level_t prism_log_level_parse(const char *s)
{
    if (!s) return PRISM_LOG_INFO;
    if (!strcmp(s, "debug")) return PRISM_LOG_DEBUG;
    if (!strcmp(s, "warn") || !strcmp(s, "warning")) return PRISM_LOG_WARN;
    if (!strcmp(s, "error")) return PRISM_LOG_ERROR;
    return PRISM_LOG_INFO;
}

const prism_log_ctx_t *prism_log_ctx_enter(const prism_log_ctx_t *ctx)
{
    const prism_log_ctx_t *prev = t_ctx;
    t_ctx = ctx;
    return prev;
}

void prism_log_ctx_leave(const prism_log_ctx_t *previous) { t_ctx = previous; }

bool prism_trace_id_parse(const char *hex, prism_trace_id_t *out)
{
    uint64_t h[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
        char c = hex[i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) return false;   /* W3C: lowercase hex only (the end of the string too) */
        h[i / 16] = h[i / 16] << 4 | (uint64_t)v;
    }
    if (!h[0] && !h[1]) return false;   /* all zeros: invalid */
    out->hi = h[0];
    out->lo = h[1];
    return true;
}

void prism_trace_id_hex(prism_trace_id_t t, char out[33])
{
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)t.hi, (unsigned long long)t.lo);
}

/* s[0..n) as a JSON string's contents into out[0..cap): escapes, ill-formed UTF-8 as U+FFFD, cut
 * short (never inside an escape) when out is full. prism_json_string's rules, but into a fixed buffer:
 * a log line must not allocate (worker hot paths, any thread, the counting allocator's totals). */
static size_t log_json_escape(char *out, size_t cap, const char *s, size_t n)
{
    static const char hexd[] = "0123456789abcdef";
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        char e[8];
        size_t el = 0, used = 1;
        if (c >= 0x80) {
            if (prism_utf8_next(s + i, n - i, &used) == PRISM_UTF8_OK) {
                if (o + used >= cap) break;
                memcpy(out + o, s + i, used);
                o += used;
                i += used;
                continue;
            }
            memcpy(e, "\xEF\xBF\xBD", 3);
            el = 3;
        } else if (c == '"' || c == '\\') {
            e[0] = '\\', e[1] = (char)c, el = 2;
        } else if (c == '\n') {
            memcpy(e, "\\n", 2), el = 2;
        } else if (c < 0x20 || c == 0x7f) {
            memcpy(e, "\\u00", 4), e[4] = hexd[c >> 4], e[5] = hexd[c & 15], el = 6;
        } else {
            e[0] = (char)c, el = 1;
        }
        if (o + el >= cap) break;
        memcpy(out + o, e, el);
        o += el;
        i += used;
    }
    return o;
}

/* One line: text, or one JSON object (--log-format json). */
static void log_v(const char *tag, const char *file, int line, const prism_log_ctx_t *ctx, const char *fmt,
                  va_list ap)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    if (!ctx) ctx = t_ctx;
    bool traced = ctx && (ctx->trace.hi || ctx->trace.lo);
    char trace[33] = "";
    if (traced) prism_trace_id_hex(ctx->trace, trace);
    if (g_format == PRISM_LOG_JSON) {
        char msg[4096], esc[8192], proc[96], worker[224], rid[32] = "null", tid[40] = "null", lower[8];
        int n = vsnprintf(msg, sizeof msg, fmt, ap);
        size_t len = n < 0 ? 0 : PRISM_MIN((size_t)n, sizeof msg - 1);
        esc[log_json_escape(esc, sizeof esc, msg, len)] = 0;
        proc[log_json_escape(proc, sizeof proc, g_proc, strlen(g_proc))] = 0;
        worker[log_json_escape(worker, sizeof worker, g_worker, strlen(g_worker))] = 0;
        if (ctx && ctx->request_id) snprintf(rid, sizeof rid, "\"%llu\"", (unsigned long long)ctx->request_id);
        if (traced) snprintf(tid, sizeof tid, "\"%s\"", trace);
        size_t k = 0;
        for (; tag[k] && k < sizeof lower - 1; k++) lower[k] = (char)(tag[k] | 0x20);
        lower[k] = 0;
        pthread_mutex_lock(&g_log_mu);
        fprintf(stderr,
                "{\"time\":\"%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ\",\"level\":\"%s\",\"process\":\"%s\",\"pid\":%d,"
                "\"worker_id\":%s%s%s,\"request_id\":%s,\"trace_id\":%s,\"file\":\"%s\",\"line\":%d,"
                "\"message\":\"%s\"}\n",
                tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
                lower, proc, (int)getpid(), g_worker[0] ? "\"" : "", g_worker[0] ? worker : "null",
                g_worker[0] ? "\"" : "", rid, tid, base, line, esc);
        fflush(stderr);
        pthread_mutex_unlock(&g_log_mu);
        return;
    }
    pthread_mutex_lock(&g_log_mu);
    fprintf(stderr, "%02d:%02d:%02d.%03ld %s[%d] %s %s:%d: ", tm.tm_hour, tm.tm_min, tm.tm_sec,
            ts.tv_nsec / 1000000, g_proc, (int)getpid(), tag, base, line);
    if (traced) fprintf(stderr, "trace=%s ", trace);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    fflush(stderr);
    pthread_mutex_unlock(&g_log_mu);
}

static const char *const g_tags[] = {"DEBUG", "INFO", "WARN", "ERROR"};

void prism_log(prism_log_level_t level, const char *file, int line, const char *fmt, ...)
{
    if (level < g_level)
        return;
    va_list ap;
    va_start(ap, fmt);
    log_v(g_tags[level], file, line, NULL, fmt, ap);
    va_end(ap);
}

void prism_log_ctx(prism_log_level_t level, const char *file, int line, const prism_log_ctx_t *ctx, const char *fmt,
                   ...)
{
    if (level < g_level)
        return;
    va_list ap;
    va_start(ap, fmt);
    log_v(g_tags[level], file, line, ctx, fmt, ap);
    va_end(ap);
}

void prism_abort(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_v("FATAL", file, line, NULL, fmt, ap);
    va_end(ap);
    abort();
}

/* ---------------------------------------------------------------- allocator */

/* A 16-byte header in front of every block records its size so free can count it. */
#define HDR 16
static atomic_size_t g_used;
static atomic_size_t g_peak;
static atomic_uint_fast64_t g_count;

static void count_add(size_t n)
{
    size_t now = atomic_fetch_add(&g_used, n) + n;
    size_t peak = atomic_load(&g_peak);
    while (now > peak && !atomic_compare_exchange_weak(&g_peak, &peak, now)) {}
    atomic_fetch_add(&g_count, 1);
}

void *prism_malloc(size_t n)
{
    if (n > SIZE_MAX - HDR) return NULL;
    uint8_t *p = malloc(n + HDR);
    if (!p) return NULL;
    *(size_t *)p = n;
    count_add(n);
    return p + HDR;
}

void *prism_calloc(size_t count, size_t n)
{
    if (n && count > (SIZE_MAX - HDR) / n) return NULL;
    /* calloc, not malloc + memset: the C library hands a large block fresh zero pages, which stay
     * untouched (not resident) until used */
    uint8_t *p = calloc(1, count * n + HDR);
    if (!p) return NULL;
    *(size_t *)p = count * n;
    count_add(count * n);
    return p + HDR;
}

void *prism_realloc(void *p, size_t n)
{
    if (!p) return prism_malloc(n);
    if (n > SIZE_MAX - HDR) return NULL;
    uint8_t *h = (uint8_t *)p - HDR;
    size_t old = *(size_t *)h;
    uint8_t *q = realloc(h, n + HDR);
    if (!q) return NULL;
    *(size_t *)q = n;
    atomic_fetch_sub(&g_used, old);
    count_add(n);
    return q + HDR;
}

void prism_free(void *p)
{
    if (!p) return;
    uint8_t *h = (uint8_t *)p - HDR;
    atomic_fetch_sub(&g_used, *(size_t *)h);
    free(h);
}

void *prism_xmalloc(size_t n)
{
    void *p = prism_malloc(n);
    if (!p) PRISM_FATAL("out of memory allocating %zu bytes", n);
    return p;
}

void *prism_xcalloc(size_t count, size_t n)
{
    void *p = prism_calloc(count, n);
    if (!p) PRISM_FATAL("out of memory allocating %zu x %zu bytes", count, n);
    return p;
}

char *prism_strndup(const char *s, size_t n)
{
    char *d = prism_malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

char *prism_strdup(const char *s) { return s ? prism_strndup(s, strlen(s)) : NULL; }

bool prism_ct_equal(const void *presented, size_t presented_len, const void *secret, size_t secret_len)
{
    const volatile uint8_t *a = presented, *b = secret;
    uint8_t diff = (uint8_t)(presented_len != secret_len);
    for (size_t i = 0; i < presented_len; i++)
        diff |= (uint8_t)(a[i] ^ (secret_len ? b[i % secret_len] : 0));
    return diff == 0;
}

size_t prism_mem_used(void) { return atomic_load(&g_used); }
size_t prism_mem_peak(void) { return atomic_load(&g_peak); }
uint64_t prism_mem_alloc_count(void) { return atomic_load(&g_count); }

void *prism_malloc_aligned(size_t n, size_t align)
{
    if (align < HDR) align = HDR;
    if (n > SIZE_MAX - align) return NULL;
    void *raw = NULL;
    if (posix_memalign(&raw, align, n + align)) return NULL;
    uint8_t *p = (uint8_t *)raw + align;
    ((size_t *)p)[-1] = n;
    ((size_t *)p)[-2] = align;
    count_add(n);
    return p;
}

void prism_free_aligned(void *p)
{
    if (!p) return;
    size_t n = ((size_t *)p)[-1], align = ((size_t *)p)[-2];
    atomic_fetch_sub(&g_used, n);
    free((uint8_t *)p - align);
}

/* ---------------------------------------------------------------- arena */

void prism_arena_init(prism_arena_t *a, const char *name, void *base, size_t cap)
{
    a->base = base;
    a->cap = cap;
    a->used = 0;
    a->peak = 0;
    a->name = name;
}

void *prism_arena_alloc(prism_arena_t *a, size_t n, size_t align)
{
    if (!align) align = 64;
    size_t off = PRISM_ALIGN_UP(a->used, align);
    if (off > a->cap || n > a->cap - off)
        return NULL;
    a->used = off + n;
    if (a->used > a->peak) a->peak = a->used;
    return a->base + off;
}

void prism_arena_reset(prism_arena_t *a) { a->used = 0; }

/* ---------------------------------------------------------------- buffer */

int prism_buf_reserve(prism_buf_t *b, size_t extra)
{
    if (b->len + extra + 1 <= b->cap) return PRISM_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) {
        if (cap > SIZE_MAX / 2) return PRISM_ENOMEM;
        cap *= 2;
    }
    char *d = prism_realloc(b->data, cap);
    if (!d) return PRISM_ENOMEM;
    b->data = d;
    b->cap = cap;
    return PRISM_OK;
}

int prism_buf_append(prism_buf_t *b, const void *p, size_t n)
{
    int rc = prism_buf_reserve(b, n);
    if (rc) return rc;
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
    return PRISM_OK;
}

int prism_buf_append_str(prism_buf_t *b, const char *s) { return prism_buf_append(b, s, strlen(s)); }

int prism_buf_appendf(prism_buf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return PRISM_EINVAL;
    int rc = prism_buf_reserve(b, (size_t)n);
    if (rc) return rc;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return PRISM_OK;
}

void prism_buf_reset(prism_buf_t *b)
{
    b->len = 0;
    if (b->data) b->data[0] = 0;
}

void prism_buf_free(prism_buf_t *b)
{
    prism_free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* ---------------------------------------------------------------- shared bytes */

struct prism_shared {
    atomic_int refs;
    size_t len;
    void *data;
};

prism_shared_t *prism_shared_take(void *data, size_t len)
{
    prism_shared_t *s = prism_malloc(sizeof *s);
    if (!s) return NULL;
    atomic_init(&s->refs, 1);
    s->len = len;
    s->data = data;
    return s;
}

prism_shared_t *prism_shared_ref(prism_shared_t *s)
{
    atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
    return s;
}

void prism_shared_unref(prism_shared_t *s)
{
    if (!s || atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1) return;
    prism_free(s->data);
    prism_free(s);
}

const uint8_t *prism_shared_data(const prism_shared_t *s) { return s->data; }
size_t prism_shared_len(const prism_shared_t *s) { return s->len; }

/* ---------------------------------------------------------------- time, files */

uint64_t prism_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double prism_now_s(void) { return (double)prism_now_ns() * 1e-9; }

int prism_random_bytes(void *out, size_t n)
{
    uint8_t *p = out;
    while (n) {
        ssize_t k = getrandom(p, n, 0);
        if (k < 0) {
            if (errno == EINTR) continue;
            return PRISM_EIO;
        }
        p += k;
        n -= (size_t)k;
    }
    return PRISM_OK;
}

int64_t prism_unix_time(void) { return (int64_t)time(NULL); }
int64_t prism_unix_time_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int prism_read_file(const char *path, size_t max_bytes, char **out, size_t *out_len)
{
    *out = NULL;
    if (out_len) *out_len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return PRISM_EIO;
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return PRISM_EIO;
    }
    if ((uint64_t)st.st_size > max_bytes) {
        fclose(f);
        return PRISM_ELIMIT;
    }
    size_t n = (size_t)st.st_size;
    char *buf = prism_malloc(n + 1);
    if (!buf) {
        fclose(f);
        return PRISM_ENOMEM;
    }
    if (n && fread(buf, 1, n, f) != n) {
        prism_free(buf);
        fclose(f);
        return PRISM_EIO;
    }
    fclose(f);
    buf[n] = 0;
    *out = buf;
    if (out_len) *out_len = n;
    return PRISM_OK;
}

int prism_path_join(char *out, size_t n, const char *dir, const char *name)
{
    int w = snprintf(out, n, "%s/%s", dir, name);
    return (w < 0 || (size_t)w >= n) ? PRISM_ELIMIT : PRISM_OK;
}

bool prism_file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

static bool owner_ok(const struct stat *st) { return st->st_uid == geteuid() || st->st_uid == 0; }

int prism_fd_trusted(int fd, const char *path, char *err, size_t errlen)
{
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(err, errlen, "cannot stat %s: %s", path, strerror(errno));
        return PRISM_EIO;
    }
    if (!S_ISREG(st.st_mode) || !owner_ok(&st) || (st.st_mode & 022)) {
        snprintf(err, errlen, "%s is %s: it must be a file of this user (uid %d) or root that no one else may "
                 "write", path, !S_ISREG(st.st_mode) ? "not a regular file" : !owner_ok(&st) ? "owned by another user"
                 : "writable by other users", (int)geteuid());
        return PRISM_EINVAL;
    }
    return PRISM_OK;
}

int prism_dir_trusted(const char *dir, char *err, size_t errlen)
{
    char *real = realpath(dir, NULL);   /* libc's allocation: free() */
    if (!real) {
        snprintf(err, errlen, "cannot resolve %s: %s", dir, strerror(errno));
        return PRISM_EIO;
    }
    int rc = PRISM_OK;
    /* the directory itself, then each one above it up to / */
    for (bool first = true;; first = false) {
        struct stat st;
        if (stat(real, &st) != 0) {
            snprintf(err, errlen, "cannot stat %s: %s", real, strerror(errno));
            rc = PRISM_EIO;
            break;
        }
        /* sticky and root's (/tmp, a Kubernetes Secret volume): others cannot replace what is ours
         * there, and what they add is theirs, which the file check refuses */
        bool shared_ok = (st.st_mode & S_ISVTX) && st.st_uid == 0;
        if (!S_ISDIR(st.st_mode) || !owner_ok(&st) || ((st.st_mode & 022) && !shared_ok)) {
            snprintf(err, errlen, "%s%s%s is %s: it must be a directory of this user (uid %d) or root that no one "
                     "else may write", real, first ? "" : ", above ", first ? "" : dir,
                     !S_ISDIR(st.st_mode) ? "not a directory" : !owner_ok(&st) ? "owned by another user"
                     : "writable by other users", (int)geteuid());
            rc = PRISM_EINVAL;
            break;
        }
        char *slash = strrchr(real, '/');
        if (!slash || slash == real) {
            if (slash && real[1]) {   /* the last step: "/" itself */
                real[1] = 0;
                continue;
            }
            break;
        }
        *slash = 0;
    }
    free(real);
    return rc;
}

int prism_secret_file_read(const char *path, char *out, size_t cap, char *err, size_t errlen)
{
    PRISM_ASSERT(cap > 1);
    out[0] = 0;
    char *real = realpath(path, NULL);   /* libc's allocation: free(); a Secret volume's file is a link */
    if (!real) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        return PRISM_EIO;
    }
    char *slash = strrchr(real, '/');
    if (slash == real) slash[1] = 0;
    else *slash = 0;
    int rc = prism_dir_trusted(real, err, errlen);   /* else someone could put another file in its place */
    free(real);
    if (rc) return rc;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        return PRISM_EIO;
    }
    struct stat st;
    if ((rc = prism_fd_trusted(fd, path, err, errlen)) == PRISM_OK && fstat(fd, &st) == 0 && (st.st_mode & 007)) {
        snprintf(err, errlen, "%s is readable by other users: chmod 600 (or 640) it", path);
        rc = PRISM_EINVAL;
    }
    ssize_t n = 0;
    if (!rc && (n = read(fd, out, cap)) < 0) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        rc = PRISM_EIO;
    }
    close(fd);
    if (!rc && (size_t)n >= cap) {
        snprintf(err, errlen, "%s holds %zu bytes or more: not a secret of at most %zu", path, cap, cap - 1);
        rc = PRISM_ELIMIT;
    }
    if (rc) {
        memset(out, 0, cap);
        return rc;
    }
    size_t s = 0, e = (size_t)n;
    while (s < e && (out[s] == ' ' || out[s] == '\t' || out[s] == '\n' || out[s] == '\r')) s++;
    while (e > s && (out[e - 1] == ' ' || out[e - 1] == '\t' || out[e - 1] == '\n' || out[e - 1] == '\r')) e--;
    memmove(out, out + s, e - s);
    memset(out + (e - s), 0, cap - (e - s));
    if (e == s) {
        snprintf(err, errlen, "%s is empty", path);
        return PRISM_EINVAL;
    }
    return PRISM_OK;
}

int64_t prism_parse_bytes(const char *s)
{
    if (!s || !*s) return -1;
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0) return -1;
    while (*end == ' ') end++;
    double mul = 1;
    switch (*end) {
    case 0: break;
    case 'k': case 'K': mul = 1024.0; end++; break;
    case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
    case 'b': case 'B': break;
    default: return -1;
    }
    if (*end == 'i' || *end == 'I') end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end) return -1;
    double r = v * mul;
    if (r > 9.0e18) return -1;
    return (int64_t)r;
}

const char *prism_fmt_bytes(size_t bytes, char *out, size_t n)
{
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024 && u < 4) { v /= 1024; u++; }
    snprintf(out, n, u ? "%.2f %s" : "%.0f %s", v, units[u]);
    return out;
}
