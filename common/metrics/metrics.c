#include "metrics/metrics.h"

#include <math.h>
#include <string.h>

const double prism_buckets_ttft[] = {.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1,
                                     2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560};
const int prism_buckets_ttft_n = (int)PRISM_ARRAY_LEN(prism_buckets_ttft);
const double prism_buckets_itl[] = {.01, .025, .05, .075, .1, .15, .2, .3, .4, .5, .75, 1, 2.5, 5, 7.5,
                                    10, 20, 40, 80};
const int prism_buckets_itl_n = (int)PRISM_ARRAY_LEN(prism_buckets_itl);
const double prism_buckets_e2e[] = {.3, .5, .8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120,
                                    240, 480, 960, 1920, 7680};
const int prism_buckets_e2e_n = (int)PRISM_ARRAY_LEN(prism_buckets_e2e);

const char *const prism_refusal_names[PRISM_REFUSE_COUNT] = {
    "body_too_large", "too_many_images", "image_too_large", "queue_full",
    "no_workers", "bad_request", "queue_wait", "body_bytes_inflight", "connections",
    "slow_client", "image_fetch",
};

void prism_hist_init(prism_hist_t *h, const double *bounds, int n)
{
    PRISM_ASSERT(n <= PRISM_HIST_MAX_BUCKETS);
    *h = (prism_hist_t){.bounds = bounds, .n = n};
}

void prism_hist_observe(prism_hist_t *h, double v)
{
    int i = 0;
    while (i < h->n && v > h->bounds[i]) i++;
    if (i < h->n) h->counts[i]++;
    h->count++;
    h->sum += v;
}

void prism_hist_write(const prism_hist_t *h, prism_buf_t *out, const char *name, const char *help, const char *labels)
{
    if (help) prism_buf_appendf(out, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    const char *sep = labels && *labels ? "," : "";
    for (int i = 0; i < h->n; i++) {
        cum += h->counts[i];
        prism_buf_appendf(out, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels ? labels : "", sep, h->bounds[i],
                          (unsigned long long)cum);
    }
    prism_buf_appendf(out, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels ? labels : "", sep,
                      (unsigned long long)h->count);
    prism_buf_appendf(out, "%s_sum{%s} %.6f\n%s_count{%s} %llu\n", name, labels ? labels : "", h->sum, name,
                      labels ? labels : "", (unsigned long long)h->count);
}

void prism_metric_write(prism_buf_t *out, const char *name, const char *type, const char *help,
                        const char *labels, double value)
{
    if (help) prism_buf_appendf(out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
    if (value == floor(value) && fabs(value) < 1e15)
        prism_buf_appendf(out, "%s{%s} %.0f\n", name, labels ? labels : "", value);
    else
        prism_buf_appendf(out, "%s{%s} %.6g\n", name, labels ? labels : "", value);
}

size_t prism_metric_label_value(char *out, size_t n, const char *value)
{
    size_t o = 0;
    if (!n) return 0;
    for (const unsigned char *p = (const unsigned char *)(value ? value : ""); *p; p++) {
        char e[2] = {0, 0};
        size_t k = 1;
        if (*p == '\\' || *p == '"') e[0] = '\\', e[1] = (char)*p, k = 2;
        else if (*p == '\n') e[0] = '\\', e[1] = 'n', k = 2;
        else e[0] = (*p < 0x20 || *p >= 0x7F) ? '?' : (char)*p;
        if (o + k >= n) break;
        memcpy(out + o, e, k);
        o += k;
    }
    out[o] = 0;
    return o;
}

void prism_router_metrics_init(prism_router_metrics_t *m)
{
    *m = (prism_router_metrics_t){0};
    prism_hist_init(&m->ttft, prism_buckets_ttft, prism_buckets_ttft_n);
    prism_hist_init(&m->itl, prism_buckets_itl, prism_buckets_itl_n);
    prism_hist_init(&m->e2e, prism_buckets_e2e, prism_buckets_e2e_n);
    prism_hist_init(&m->queue, prism_buckets_e2e, prism_buckets_e2e_n);
}
