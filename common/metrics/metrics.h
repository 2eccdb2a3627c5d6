/* metrics: Prometheus text exposition — histograms with fixed buckets, counters, and helpers to
 * write gauges. The router keeps one prism_router_metrics_t; workers report their numbers in
 * heartbeats and the router exports them with a worker label. */
#ifndef PRISM_METRICS_H
#define PRISM_METRICS_H

#include "core/core.h"

#define PRISM_HIST_MAX_BUCKETS 32

typedef struct {
    const double *bounds;   /* [n] upper bounds, ascending */
    int n;
    uint64_t counts[PRISM_HIST_MAX_BUCKETS];  /* non-cumulative */
    uint64_t count;
    double sum;
} prism_hist_t;

void prism_hist_init(prism_hist_t *h, const double *bounds, int n);
void prism_hist_observe(prism_hist_t *h, double v);
/* Writes name_bucket{labels,le=...} / name_sum / name_count lines (labels: `model_name="x"`),
 * after the HELP and TYPE lines unless help is NULL (further label sets of one metric). */
void prism_hist_write(const prism_hist_t *h, prism_buf_t *out, const char *name, const char *help, const char *labels);
void prism_metric_write(prism_buf_t *out, const char *name, const char *type, const char *help,
                        const char *labels, double value);
/* Writes value into out[n] as a label value for the text exposition format: backslash, double quote
 * and line feed escaped (\\, \", \n); other control bytes and bytes >= 0x80 become '?' (label
 * values must be valid UTF-8, and ids from the network are not trusted to be). Never splits an
 * escape; always NUL-terminated. Returns the length written. */
size_t prism_metric_label_value(char *out, size_t n, const char *value);

/* vLLM's bucket lists (CONVENTIONS.md). */
extern const double prism_buckets_ttft[];
extern const int prism_buckets_ttft_n;
extern const double prism_buckets_itl[];
extern const int prism_buckets_itl_n;
extern const double prism_buckets_e2e[];
extern const int prism_buckets_e2e_n;

typedef struct {
    prism_hist_t ttft, itl, e2e, queue;
    uint64_t prompt_tokens, generation_tokens;
    uint64_t success_stop, success_length, success_abort, failed;
    uint64_t retried;              /* requests re-dispatched after a worker died before their first token */
    uint64_t migrated;             /* requests that went on elsewhere after their decode worker died mid-generation */
    uint64_t preempted;            /* sequences a decode worker preempted (KV pool full): prefilled again */
    uint64_t swapped;              /* sequences a decode worker preempted by swapping their KV to host memory */
    uint64_t preempted_migrate;    /* ... whose KV moved to another decode worker instead (its first token came) */
    uint64_t stage_timeouts;       /* encode or prefill stages that overran --stage-timeout */
    uint64_t workers_disconnected; /* workers dropped because their connection closed */
    uint64_t early_encodes;        /* images sent to an encoder's cache before their body ended */
    uint64_t early_encodes_failed; /* ... that failed, timed out or lost their encoder */
    uint64_t early_encodes_adopted; /* ... still running when their request came: it took the job over */
    uint64_t early_encodes_abandoned; /* ... aborted: their body never became a request, or the request ended */
    uint64_t early_encodes_preempted; /* ... aborted: a request needed the encoder slot */
    /* prefill workers' prefix caches, summed from their heartbeats (vLLM counts tokens) */
    uint64_t prefix_queries, prefix_hits, prefill_computed;
    uint64_t encoder_skips;        /* images sent to no encoder: the chosen prefill's prefix cache covers them */
    uint64_t prefix_resent;        /* requests sent again with every image encoded: the prefix was evicted meanwhile */
    uint64_t refused_limit[16];   /* by prism_refusal_t (the HTTP server's own are added when exported) */
} prism_router_metrics_t;

typedef enum {
    PRISM_REFUSE_BODY_TOO_LARGE,
    PRISM_REFUSE_TOO_MANY_IMAGES,
    PRISM_REFUSE_IMAGE_TOO_LARGE,
    PRISM_REFUSE_QUEUE_FULL,
    PRISM_REFUSE_NO_WORKERS,
    PRISM_REFUSE_BAD_REQUEST,
    PRISM_REFUSE_QUEUE_WAIT,
    PRISM_REFUSE_BODY_BYTES_INFLIGHT,  /* counted by the HTTP server (503 from the header) */
    PRISM_REFUSE_CONNECTIONS,          /* counted by the HTTP server (--max-connections) */
    PRISM_REFUSE_SLOW_CLIENT,   /* a streaming client that stopped reading, dropped */
    PRISM_REFUSE_IMAGE_FETCH,   /* an image URL that gave no image (prism:image_fetch_refused_total says why) */
    PRISM_REFUSE_COUNT
} prism_refusal_t;

extern const char *const prism_refusal_names[PRISM_REFUSE_COUNT];

void prism_router_metrics_init(prism_router_metrics_t *m);

#endif
