/* prism_fetch_probe: the router's image fetcher (router/fetch.h) alone, for tests/integration/test_fetch.py.
 *
 *   prism_fetch_probe [fetcher flags] [--max-image-bytes N] [--repeat N] [--rounds N] [--pause-ms MS] -- URL...
 *
 * Starts every URL (each --repeat times) at once on one libuv loop; when all are answered, starts
 * them again (--rounds). Prints one JSON line per answer:
 *   {"round":0,"url":"...","reason":"ok","http_status":200,"http_version":2,"bytes":N,"crc32":N,
 *    "redirects":0,"cache_hit":false,"joined":false,"data_calls":N,"seconds":0.01,"message":"..."}
 * then one line {"metrics":{...}} with the fetcher's counters. --pause-ms: each request pauses at its
 * first bytes and resumes MS milliseconds later (backpressure over a real connection). */
#include "fetch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

typedef struct {
    const char *url;
    int round;
    int data_calls;
    bool paused_once;
    prism_fetch_req_t *q;
    uv_timer_t resume;
} probe_t;

static prism_fetch_t *F;
static uv_loop_t *L;
static int64_t pause_ms;
static int pending;

static void json_str(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

static void on_resume(uv_timer_t *t)
{
    probe_t *p = t->data;
    if (p->q) prism_fetch_resume(p->q);
}

static int on_data(prism_fetch_req_t *q, const uint8_t *d, size_t n, int64_t declared, void *ud)
{
    probe_t *p = ud;
    p->data_calls++;
    if (pause_ms > 0 && !p->paused_once) {
        p->paused_once = true;
        uv_timer_start(&p->resume, on_resume, (uint64_t)pause_ms, 0);
        return PRISM_FETCH_PAUSE;
    }
    return PRISM_FETCH_CONTINUE;
}

static void on_done(prism_fetch_req_t *q, const prism_fetch_result_t *r, void *ud)
{
    probe_t *p = ud;
    p->q = NULL;
    size_t len = r->blob ? prism_fetch_blob_len(r->blob) : 0;
    unsigned long crc = crc32(0L, Z_NULL, 0);
    if (len) crc = crc32(crc, prism_fetch_blob_data(r->blob), (uInt)len);
    printf("{\"round\":%d,\"url\":", p->round);
    json_str(p->url);
    printf(",\"reason\":\"%s\",\"http_status\":%d,\"http_version\":%d,\"bytes\":%zu,\"crc32\":%lu,\"redirects\":%d,"
           "\"cache_hit\":%s,\"joined\":%s,\"data_calls\":%d,\"seconds\":%.4f,\"message\":",
           prism_fetch_reason_names[r->reason], r->http_status, r->http_version, len, crc, r->redirects,
           r->cache_hit ? "true" : "false", r->joined ? "true" : "false", p->data_calls, r->seconds);
    json_str(r->message);
    printf("}\n");
    fflush(stdout);
    pending--;
}

static prism_fetch_cb_t CB = {on_data, on_done, NULL};

static void print_metrics(void)
{
    const prism_fetch_metrics_t *m = prism_fetch_metrics(F);
    printf("{\"metrics\":{\"requests\":%llu,\"downloads\":%llu,\"downloads_ok\":%llu,\"cache_hits\":%llu,"
           "\"joined\":%llu,\"bytes\":%llu,\"redirects\":%llu,\"pauses\":%llu,\"peak_inflight\":%llu,\"refused\":{",
           (unsigned long long)m->requests, (unsigned long long)m->downloads, (unsigned long long)m->downloads_ok,
           (unsigned long long)m->cache_hits, (unsigned long long)m->joined, (unsigned long long)m->bytes,
           (unsigned long long)m->redirects, (unsigned long long)m->pauses, (unsigned long long)m->peak_inflight);
    for (int i = 1; i < PRISM_FETCH_REASON_COUNT; i++)
        printf("%s\"%s\":%llu", i > 1 ? "," : "", prism_fetch_reason_names[i], (unsigned long long)m->refused[i]);
    printf("}}}\n");
    prism_buf_t b = {0};
    prism_fetch_metrics_write(F, &b);   /* the exposition must at least be produced */
    prism_buf_free(&b);
}

static void on_closed(void *ud) { *(bool *)ud = true; }

int main(int argc, char **argv)
{
    prism_log_init("prism_fetch_probe", PRISM_LOG_WARN);
    int sep = argc;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--")) {
            sep = i;
            break;
        }
    prism_fetch_config_t cfg;
    prism_fetch_config_default(&cfg);
    int64_t max_bytes = cfg.max_bytes, repeat = 1, rounds = 1;
    const char *log_level = "warn";
    prism_flag_t flags[] = {
        PRISM_FETCH_FLAGS(&cfg),
        PRISM_FLAG_BYTES("max-image-bytes", &max_bytes, "Largest image"),
        PRISM_FLAG_INT("repeat", &repeat, "Requests per URL, at once"),
        PRISM_FLAG_INT("rounds", &rounds, "Times the whole set is fetched, one round after the other"),
        PRISM_FLAG_INT("pause-ms", &pause_ms, "Pause each request at its first bytes for this long"),
        PRISM_FLAG_STR("log-level", &log_level, "debug, info, warn or error"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(sep, argv, "prism_fetch_probe", "Fetches image URLs with the router's fetcher", flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_set_level(prism_log_level_parse(log_level));
    cfg.max_bytes = max_bytes;
    int n_urls = argc - sep - 1;
    if (n_urls <= 0 || repeat < 1 || rounds < 1) {
        fprintf(stderr, "prism_fetch_probe: give URLs after --\n");
        return 2;
    }
    L = uv_default_loop();
    char why[512];
    if (prism_fetch_open(L, &cfg, &F, why, sizeof why) != PRISM_OK) {
        fprintf(stderr, "prism_fetch_probe: %s\n", why);
        return 2;
    }
    size_t n = (size_t)n_urls * (size_t)repeat;
    probe_t *p = calloc(n, sizeof *p);
    for (size_t i = 0; i < n; i++) {
        uv_timer_init(L, &p[i].resume);
        p[i].resume.data = &p[i];
    }
    for (int r = 0; r < rounds; r++) {
        for (size_t i = 0; i < n; i++) {
            p[i] = (probe_t){.url = argv[sep + 1 + i / (size_t)repeat], .round = r, .resume = p[i].resume};
            prism_fetch_cb_t cb = CB;
            cb.ud = &p[i];
            if (prism_fetch_start(F, p[i].url, strlen(p[i].url), &cb, &p[i].q) != PRISM_OK) return 1;
            pending++;
        }
        while (pending > 0) uv_run(L, UV_RUN_ONCE);
    }
    print_metrics();
    bool closed = false;
    prism_fetch_close(F, on_closed, &closed);
    for (size_t i = 0; i < n; i++) uv_close((uv_handle_t *)&p[i].resume, NULL);
    uv_run(L, UV_RUN_DEFAULT);
    if (!closed) return 1;
    free(p);
    return uv_loop_close(L) == 0 ? 0 : 1;
}
