/* The requests in flight, by id (an open-addressing map sized at start-up from
 * --max-running-requests), and one request's memory: router_req_alloc makes it, router_req_free
 * frees everything it owns. Counts, workers and the HTTP request are its owner's business
 * (requests.c req_destroy gives those back first). */
#include "request.h"

#include <string.h>
#include <xxhash.h>

static size_t slot_of(uint64_t rid, size_t cap) { return (size_t)(XXH3_64bits(&rid, sizeof(rid)) & (cap - 1)); }

router_req_t *router_req_get(router_t *r, uint64_t rid)
{
    if (!r->reqs_cap) return NULL;
    for (size_t i = slot_of(rid, r->reqs_cap), k = 0; k < r->reqs_cap; i = (i + 1) & (r->reqs_cap - 1), k++) {
        router_req_t *q = r->reqs[i];
        if (!q) return NULL;
        if (q->rid == rid) return q;
    }
    return NULL;
}

int router_req_new_id(router_t *r, uint64_t *out, uint64_t *hi)
{
    /* Unguessable: a peer inside the trust boundary cannot aim messages at a request it was not
     * given. 128 random bits; the low half is unique among the requests in flight and never 0. */
    uint64_t id[2];
    do {
        if (prism_random_bytes(id, sizeof(id)) != PRISM_OK) return PRISM_EIO;
    } while (id[0] == 0 || router_req_get(r, id[0]));
    *out = id[0];
    *hi = id[1];
    return PRISM_OK;
}

int router_req_put(router_t *r, uint64_t rid, router_req_t *q)
{
    if ((r->n_reqs + 1) * 2 > r->reqs_cap) return PRISM_ELIMIT;  /* sized at start-up from --max-running */
    size_t i = slot_of(rid, r->reqs_cap);
    while (r->reqs[i]) i = (i + 1) & (r->reqs_cap - 1);
    r->reqs[i] = q;
    r->n_reqs++;
    return PRISM_OK;
}

void router_req_del(router_t *r, uint64_t rid)
{
    size_t cap = r->reqs_cap, i = slot_of(rid, cap);
    while (r->reqs[i] && r->reqs[i]->rid != rid) i = (i + 1) & (cap - 1);
    if (!r->reqs[i]) return;
    r->reqs[i] = NULL;
    r->n_reqs--;
    /* Backward-shift deletion keeps probe chains intact without tombstones. */
    for (size_t j = (i + 1) & (cap - 1); r->reqs[j]; j = (j + 1) & (cap - 1)) {
        router_req_t *q = r->reqs[j];
        size_t home = slot_of(q->rid, cap);
        bool between = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (!between) {
            r->reqs[i] = q;
            r->reqs[j] = NULL;
            i = j;
        }
    }
}

void router_req_rekey(router_t *r, router_req_t *q)
{
    router_req_del(r, q->rid);
    int rc = router_req_new_id(r, &q->rid, &q->rid_hi);
    PRISM_ASSERT(rc == PRISM_OK);           /* getrandom gave ids at the first dispatch */
    rc = router_req_put(r, q->rid, q);      /* takes the entry just freed */
    PRISM_ASSERT(rc == PRISM_OK);
}

size_t router_req_bytes_max(const router_t *r)
{
    return sizeof(router_req_t) + 2 * (size_t)r->max_model_len * sizeof(int32_t) + ROUTER_REQ_OUTPUT_BYTES;
}

prism_log_ctx_t router_req_log(router_t *r, uint64_t rid)
{
    router_req_t *q = rid ? router_req_get(r, rid) : NULL;
    return q ? (prism_log_ctx_t){q->rid, q->trace} : (prism_log_ctx_t){rid, {0, 0}};
}

/* The W3C traceparent "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>": its trace id and
 * flags, else one made here (a trace starts at the router). */
void router_trace_of(const router_t *r, const prism_http_req_t *h, prism_trace_id_t *trace, uint8_t *flags)
{
    const char *tp = h ? prism_http_req_header(h, "traceparent") : NULL;
    *flags = 1;
    if (tp && strlen(tp) >= 55 && tp[2] == '-' && tp[35] == '-' && tp[52] == '-' && strncmp(tp, "ff", 2) &&
        (tp[55] == 0 || tp[55] == '-') && prism_trace_id_parse(tp + 3, trace)) {
        unsigned f;
        if (sscanf(tp + 53, "%2x", &f) == 1) *flags = (uint8_t)f;
        return;
    }
    /* the body's id under the router's seed: its early encodes (before its request exists) and its
     * request get the same id without keeping one per body */
    uint64_t what[2] = {h ? prism_http_req_id(h) : 0, h ? 0 : (uint64_t)(prism_now_s() * 1e9)};
    XXH128_hash_t x = XXH3_128bits_withSeed(what, sizeof what, r->trace_seed);
    *trace = (prism_trace_id_t){x.high64, x.low64 ? x.low64 : 1};   /* never all zero: W3C's invalid id */
}

router_req_t *router_req_alloc(router_t *r, prism_http_req_t *h, bool chat)
{
    router_req_t *q = prism_calloc(1, sizeof(*q));
    if (!q) return NULL;
    q->r = r;
    q->h = h;
    q->body = prism_http_req_id(h);
    q->chat = chat;
    router_trace_of(r, h, &q->trace, &q->trace_flags);
    q->time.start = q->time.wait = prism_now_s();
    q->time.began = h ? PRISM_MIN(prism_http_req_began(h), q->time.start) : q->time.start;
    q->prep.job.work.data = q;
    return q;
}

/* Copies s[0..n) (plus a NUL) to *at and moves *at on; returns the copy. */
static char *keep(char **at, const char *s, size_t n)
{
    char *d = *at;
    if (n) memcpy(d, s, n);
    d[n] = 0;
    *at += n + 1;
    return d;
}

int router_req_keep_inputs(router_req_t *q)
{
    prism_oai_request_t *o = &q->oai;
    if (!o->root) return PRISM_OK;
    bool guide_in_tree = o->guide_kind && o->guide_text != o->guide_owned;
    size_t need = (o->model ? strlen(o->model) + 1 : 0) + (guide_in_tree ? o->guide_len + 1 : 0) +
                  (o->tool_name ? strlen(o->tool_name) + 1 : 0);
    for (int i = 0; i < o->n_stop; i++) need += o->stop_len[i] + 1;
    const router_prompt_t *p = &q->prompt;
    for (int i = 0; i < p->n_images; i++) need += p->img_url[i] ? p->img_url_len[i] + 1 : 0;
    char *buf = prism_malloc(need ? need : 1), *at = buf;
    if (!buf) return PRISM_ENOMEM;
    prism_oai_request_t tree = *o;   /* what goes: the tree and the parser's arrays over it */
    tree.guide_owned = NULL;         /* these two stay the request's (not in the tree) */
    tree.tools_text = NULL;
    const char *tree_guide = o->guide_text, *tree_tool = o->tool_name;
    if (o->model) o->model = keep(&at, o->model, strlen(o->model));
    if (guide_in_tree) o->guide_text = keep(&at, o->guide_text, o->guide_len);
    if (o->tool_name) o->tool_name = keep(&at, o->tool_name, strlen(o->tool_name));
    /* the output constraint (guide_setup, on the same preparation thread) names them too */
    if (q->guide.text == tree_guide) q->guide.text = o->guide_text;
    if (q->guide.tool_name == tree_tool) q->guide.tool_name = o->tool_name;
    for (int i = 0; i < o->n_stop; i++) o->stop[i] = keep(&at, o->stop[i], o->stop_len[i]);
    for (int i = 0; i < p->n_images; i++)   /* images by URL: fetched once the request is admitted */
        if (p->img_url[i]) q->prompt.img_url[i] = keep(&at, p->img_url[i], p->img_url_len[i]);
    o->root = o->tools = NULL;
    o->messages = NULL;
    o->n_messages = 0;
    o->prompt = NULL;
    o->prompt_len = 0;
    o->prompt_token_ids = NULL;
    o->n_prompt_token_ids = 0;
    prism_oai_request_free(&tree);
    prism_free(q->kept);
    q->kept = buf;
    return PRISM_OK;
}

void router_req_drop_held(router_req_t *q)
{
    for (int i = 0; i < q->n_held; i++) prism_msg_env_free(q->held[i]);
    q->n_held = 0;
    q->held_tokens = 0;
}

static void choice_free(router_choice_t *c)
{
    prism_detok_free(&c->detok);
    prism_oai_logprobs_free(&c->lp);
    prism_buf_free(&c->text);
    prism_toolcall_parser_free(c->tc);
    prism_buf_free(&c->d_content);
    prism_buf_free(&c->d_args);
    prism_free(c->d_tools);
}

static void output_free(router_output_t *o, int n)
{
    if (o->choices)
        for (int i = 0; i < n; i++) choice_free(&o->choices[i]);
    prism_free(o->choices);
    prism_oai_resp_meta_free(&o->meta);
    prism_buf_free(&o->buf);
    for (size_t i = 0; i < PRISM_ARRAY_LEN(o->tok_bytes); i++) prism_buf_free(&o->tok_bytes[i]);
}

void router_req_free(router_req_t *q)
{
    output_free(&q->out, router_req_n(q));
    prism_oai_request_free(&q->oai);
    prism_free(q->kept);
    router_prompt_free(&q->prompt);
    prism_free(q->msg.ids);
    prism_free(q->msg.keys);
    prism_free(q->msg.key_bytes);
    prism_free(q->mig.gen);
    router_req_drop_held(q);
    prism_free(q->held);
    prism_free(q->fetch);   /* its downloads were cancelled (req_destroy) */
    prism_free(q);
}
