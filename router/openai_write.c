/* OpenAI response writers (chunks, whole responses, logprobs, usage, errors). See openai_write.h. */
#include "openai_write.h"
#include "openai_req.h"   /* PRISM_OAI_MAX_TOP_LOGPROBS */
#include "core/utf8.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ JSON output primitives */

int prism_oai_json_logprob(prism_buf_t *b, double v)
{
    if (isnan(v) || v < PRISM_OAI_LOGPROB_FLOOR) v = PRISM_OAI_LOGPROB_FLOOR;
    if (isinf(v)) v = 0.0;  /* +inf is not a log-probability; never emit an invalid JSON number */
    char tmp[40];
    int n = snprintf(tmp, sizeof tmp, "%.9g", v);
    if (n <= 0 || (size_t)n >= sizeof tmp) return PRISM_EINVAL;
    if (!strpbrk(tmp, ".eE")) {
        tmp[n++] = '.';
        tmp[n++] = '0';
    }
    return prism_buf_append(b, tmp, (size_t)n);
}

/* ------------------------------------------------------------------ ids and meta */

void prism_oai_make_id(char *out, size_t n, const char *prefix)
{
    static _Thread_local uint64_t st[2];
    static _Thread_local bool seeded;
    if (!seeded) {
        if (getrandom(st, sizeof st, 0) != (ssize_t)sizeof st) {
            st[0] = prism_now_ns() ^ ((uint64_t)getpid() << 32);
            st[1] = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull;
        }
        if (!st[0] && !st[1]) st[1] = 1;
        seeded = true;
    }
    uint64_t r[2];
    for (int k = 0; k < 2; k++) {  /* xorshift128+ */
        uint64_t s1 = st[0];
        const uint64_t s0 = st[1];
        st[0] = s0;
        s1 ^= s1 << 23;
        st[1] = s1 ^ s0 ^ (s1 >> 17) ^ (s0 >> 26);
        r[k] = st[1] + s0;
    }
    snprintf(out, n, "%s%016llx%016llx", prefix, (unsigned long long)r[0], (unsigned long long)r[1]);
}

int prism_oai_resp_meta_init(prism_oai_resp_meta_t *m, bool chat, const char *model)
{
    memset(m, 0, sizeof *m);
    m->chat = chat;
    prism_oai_make_id(m->id, sizeof m->id, chat ? "chatcmpl-" : "cmpl-");
    m->created = prism_unix_time();
    return prism_json_cstr(&m->model_json, model ? model : "");
}

void prism_oai_resp_meta_free(prism_oai_resp_meta_t *m)
{
    prism_buf_free(&m->model_json);
}

/* {"id":"..","object":"<object>","created":N,"model":".." */
static int write_head(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *object)
{
    int rc = prism_buf_appendf(b, "{\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", m->id, object,
                               (long long)m->created);
    if (!rc) rc = prism_buf_append(b, m->model_json.data ? m->model_json.data : "\"\"",
                                   m->model_json.data ? m->model_json.len : 2);
    return rc;
}

/* ------------------------------------------------------------------ usage / errors */

int prism_oai_write_usage(prism_buf_t *b, const prism_oai_usage_t *u)
{
    if (!u) return prism_buf_append_str(b, "null");
    int rc = prism_buf_appendf(b, "{\"prompt_tokens\":%lld,\"total_tokens\":%lld,\"completion_tokens\":%lld",
                               (long long)u->prompt_tokens, (long long)(u->prompt_tokens + u->completion_tokens),
                               (long long)u->completion_tokens);
    if (!rc && u->cached_tokens >= 0)
        rc = prism_buf_appendf(b, ",\"prompt_tokens_details\":{\"cached_tokens\":%lld}", (long long)u->cached_tokens);
    if (!rc) rc = prism_buf_append(b, "}", 1);
    return rc;
}

const char *prism_oai_error_type(int status)
{
    switch (status) {
    case 401: return "AuthenticationError";
    case 403: return "PermissionDeniedError";
    case 404: return "NotFoundError";
    case 413: return "RequestEntityTooLargeError";
    case 429: return "RateLimitError";
    case 503: return "ServiceUnavailableError";
    default:  return status >= 500 ? "InternalServerError" : "BadRequestError";
    }
}

int prism_oai_write_error(prism_buf_t *b, const char *type, const char *message, const char *param,
                          const char *code)
{
    int rc = prism_buf_append_str(b, "{\"error\":{\"message\":");
    if (!rc) rc = prism_json_cstr(b, message ? message : "");
    if (!rc) rc = prism_buf_append_str(b, ",\"type\":");
    if (!rc) rc = prism_json_cstr(b, type ? type : "BadRequestError");
    if (!rc) rc = prism_buf_append_str(b, ",\"param\":");
    if (!rc) rc = prism_json_cstr(b, param);
    if (!rc) rc = prism_buf_append_str(b, ",\"code\":");
    if (!rc) rc = prism_json_cstr(b, code);
    if (!rc) rc = prism_buf_append_str(b, "}}");
    return rc;
}

int prism_oai_write_sse_error(prism_buf_t *b, const char *type, const char *message, const char *param,
                              const char *code)
{
    int rc = prism_buf_append(b, "data: ", 6);
    if (!rc) rc = prism_oai_write_error(b, type, message, param, code);
    if (!rc) rc = prism_buf_append(b, "\n\n", 2);
    return rc;
}

int prism_oai_write_sse_done(prism_buf_t *b)
{
    return prism_buf_append_str(b, "data: [DONE]\n\n");
}

/* ------------------------------------------------------------------ logprobs */

void prism_oai_logprobs_init(prism_oai_logprobs_t *lp, bool chat)
{
    memset(lp, 0, sizeof *lp);
    lp->chat = chat;
}

void prism_oai_logprobs_clear(prism_oai_logprobs_t *lp)
{
    lp->n_tokens = 0;
    lp->content.len = 0;
    lp->tokens.len = 0;
    lp->token_logprobs.len = 0;
    lp->top_logprobs.len = 0;
    lp->text_offsets.len = 0;
}

void prism_oai_logprobs_free(prism_oai_logprobs_t *lp)
{
    prism_buf_free(&lp->content);
    prism_buf_free(&lp->tokens);
    prism_buf_free(&lp->token_logprobs);
    prism_buf_free(&lp->top_logprobs);
    prism_buf_free(&lp->text_offsets);
    lp->n_tokens = 0;
}

static int write_bytes_array(prism_buf_t *b, const char *s, size_t len)
{
    /* per token on the hot path: format by hand (at most 4 chars per byte) */
    int rc = prism_buf_reserve(b, 2 + 4 * len);
    if (rc) return rc;
    char *o = b->data + b->len;
    *o++ = '[';
    for (size_t i = 0; i < len; i++) {
        unsigned v = (unsigned char)s[i];
        if (i) *o++ = ',';
        if (v >= 100) *o++ = (char)('0' + v / 100);
        if (v >= 10) *o++ = (char)('0' + v / 10 % 10);
        *o++ = (char)('0' + v % 10);
    }
    *o++ = ']';
    *o = 0;
    b->len = (size_t)(o - b->data);
    return PRISM_OK;
}

/* {"token":..,"logprob":..,"bytes":[..]} without the closing brace */
static int write_chat_lp_fields(prism_buf_t *b, const char *text, size_t len, double logprob)
{
    int rc = prism_buf_append_str(b, "{\"token\":");
    if (!rc) rc = prism_json_string(b, text ? text : "", len);
    if (!rc) rc = prism_buf_append_str(b, ",\"logprob\":");
    if (!rc) rc = prism_oai_json_logprob(b, logprob);
    if (!rc) rc = prism_buf_append_str(b, ",\"bytes\":");
    if (!rc) rc = write_bytes_array(b, text, len);
    return rc;
}

int prism_oai_logprobs_add(prism_oai_logprobs_t *lp, const prism_oai_token_logprob_t *t)
{
    int rc = PRISM_OK;
    int n_top = t->n_top < 0 ? 0 : t->n_top;
    if (lp->chat) {
        prism_buf_t *b = &lp->content;
        if (lp->n_tokens) rc = prism_buf_append(b, ",", 1);
        if (!rc) rc = write_chat_lp_fields(b, t->text, t->len, t->logprob);
        if (!rc) rc = prism_buf_append_str(b, ",\"top_logprobs\":[");
        for (int i = 0; !rc && i < n_top; i++) {
            if (i) rc = prism_buf_append(b, ",", 1);
            if (!rc) rc = write_chat_lp_fields(b, t->top[i].text, t->top[i].len, t->top[i].logprob);
            if (!rc) rc = prism_buf_append(b, "}", 1);
        }
        if (!rc) rc = prism_buf_append(b, "]}", 2);
        if (rc) return rc;
        lp->n_tokens++;
        return PRISM_OK;
    }
    const char *sep = lp->n_tokens ? "," : "";
    rc = prism_buf_append_str(&lp->tokens, sep);
    if (!rc) rc = prism_json_string(&lp->tokens, t->text ? t->text : "", t->len);
    if (!rc) rc = prism_buf_append_str(&lp->token_logprobs, sep);
    if (!rc) rc = prism_oai_json_logprob(&lp->token_logprobs, t->logprob);
    if (!rc) rc = prism_buf_appendf(&lp->text_offsets, "%s%zu", sep, lp->text_offset);
    if (!rc) rc = prism_buf_append_str(&lp->top_logprobs, sep);
    if (!rc) rc = prism_buf_append(&lp->top_logprobs, "{", 1);
    /* keys must be unique: compare escaped keys (escaping is deterministic, so equal escaped forms
     * mean equal strings after replacement); at most 21 entries, so quadratic is fine */
    size_t key_off[PRISM_OAI_MAX_TOP_LOGPROBS + 2], key_len[PRISM_OAI_MAX_TOP_LOGPROBS + 2];
    int n_keys = 0;
    bool first = true;
    for (int i = 0; !rc && i < n_top && n_keys < (int)PRISM_ARRAY_LEN(key_off); i++) {
        size_t at = lp->top_logprobs.len + (first ? 0 : 1);
        if (!first) rc = prism_buf_append(&lp->top_logprobs, ",", 1);
        if (!rc) rc = prism_json_string(&lp->top_logprobs, t->top[i].text ? t->top[i].text : "", t->top[i].len);
        if (rc) break;
        size_t kl = lp->top_logprobs.len - at;
        bool dup = false;
        for (int k = 0; k < n_keys && !dup; k++)
            dup = key_len[k] == kl && memcmp(lp->top_logprobs.data + key_off[k], lp->top_logprobs.data + at, kl) == 0;
        if (dup) {
            lp->top_logprobs.len = at - (first ? 0 : 1);
            lp->top_logprobs.data[lp->top_logprobs.len] = 0;
            continue;
        }
        key_off[n_keys] = at;
        key_len[n_keys] = kl;
        n_keys++;
        rc = prism_buf_append(&lp->top_logprobs, ":", 1);
        if (!rc) rc = prism_oai_json_logprob(&lp->top_logprobs, t->top[i].logprob);
        first = false;
    }
    if (!rc) rc = prism_buf_append(&lp->top_logprobs, "}", 1);
    if (rc) return rc;
    lp->text_offset += prism_utf8_count(t->text ? t->text : "", t->len);
    lp->n_tokens++;
    return PRISM_OK;
}

static int append_buf(prism_buf_t *b, const prism_buf_t *src)
{
    return src->len ? prism_buf_append(b, src->data, src->len) : PRISM_OK;
}

int prism_oai_write_logprobs(prism_buf_t *b, const prism_oai_logprobs_t *lp)
{
    if (!lp) return prism_buf_append_str(b, "null");
    int rc;
    if (lp->chat) {
        rc = prism_buf_append_str(b, "{\"content\":[");
        if (!rc) rc = append_buf(b, &lp->content);
        if (!rc) rc = prism_buf_append_str(b, "],\"refusal\":null}");
        return rc;
    }
    rc = prism_buf_append_str(b, "{\"tokens\":[");
    if (!rc) rc = append_buf(b, &lp->tokens);
    if (!rc) rc = prism_buf_append_str(b, "],\"token_logprobs\":[");
    if (!rc) rc = append_buf(b, &lp->token_logprobs);
    if (!rc) rc = prism_buf_append_str(b, "],\"top_logprobs\":[");
    if (!rc) rc = append_buf(b, &lp->top_logprobs);
    if (!rc) rc = prism_buf_append_str(b, "],\"text_offset\":[");
    if (!rc) rc = append_buf(b, &lp->text_offsets);
    if (!rc) rc = prism_buf_append_str(b, "]}");
    return rc;
}

/* ------------------------------------------------------------------ chunks and responses */

static int write_tail(prism_buf_t *b, const prism_oai_logprobs_t *lp, const char *finish_reason)
{
    int rc = prism_buf_append_str(b, ",\"logprobs\":");
    if (!rc) rc = prism_oai_write_logprobs(b, lp);
    if (!rc) rc = prism_buf_append_str(b, ",\"finish_reason\":");
    if (!rc) rc = prism_json_cstr(b, finish_reason);
    return rc;
}

static int write_tool_delta(prism_buf_t *b, const prism_oai_tool_delta_t *t)
{
    int rc = prism_buf_appendf(b, "{\"index\":%d", t->index);
    if (!rc && t->id) {
        rc = prism_buf_append_str(b, ",\"id\":");
        if (!rc) rc = prism_json_cstr(b, t->id);
        if (!rc) rc = prism_buf_append_str(b, ",\"type\":\"function\"");
    }
    if (!rc) rc = prism_buf_append_str(b, ",\"function\":{");
    if (!rc && t->name) {
        rc = prism_buf_append_str(b, "\"name\":");
        if (!rc) rc = prism_json_cstr(b, t->name);
        if (!rc) rc = prism_buf_append(b, ",", 1);
    }
    if (!rc) rc = prism_buf_append_str(b, "\"arguments\":");
    if (!rc) rc = prism_json_string(b, t->arguments ? t->arguments : "", t->arguments ? t->arguments_len : 0);
    if (!rc) rc = prism_buf_append_str(b, "}}");
    return rc;
}

int prism_oai_write_chat_delta(prism_buf_t *b, const prism_oai_resp_meta_t *m, const prism_oai_delta_t *d)
{
    int rc = prism_buf_append(b, "data: ", 6);
    if (!rc) rc = write_head(b, m, "chat.completion.chunk");
    if (!rc) rc = prism_buf_appendf(b, ",\"choices\":[{\"index\":%d,\"delta\":{", d->index);
    bool comma = false;
    if (!rc && d->role) {
        rc = prism_buf_append_str(b, "\"role\":\"assistant\"");
        comma = true;
    }
    if (!rc && d->content) {
        rc = prism_buf_append_str(b, comma ? ",\"content\":" : "\"content\":");
        if (!rc) rc = prism_json_string(b, d->content, d->len);
        comma = true;
    }
    if (!rc && d->n_tool_calls > 0) {
        rc = prism_buf_append_str(b, comma ? ",\"tool_calls\":[" : "\"tool_calls\":[");
        for (int i = 0; !rc && i < d->n_tool_calls; i++) {
            if (i) rc = prism_buf_append(b, ",", 1);
            if (!rc) rc = write_tool_delta(b, &d->tool_calls[i]);
        }
        if (!rc) rc = prism_buf_append(b, "]", 1);
    }
    if (!rc) rc = prism_buf_append(b, "}", 1);
    if (!rc) rc = write_tail(b, d->lp, d->finish_reason);
    if (!rc) rc = prism_buf_append_str(b, "}]}\n\n");
    return rc;
}

int prism_oai_write_chat_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, bool role, const char *content,
                               size_t content_len, const prism_oai_logprobs_t *lp, const char *finish_reason)
{
    prism_oai_delta_t d = {.role = role, .content = content, .len = content_len, .lp = lp, .finish_reason = finish_reason};
    return prism_oai_write_chat_delta(b, m, &d);
}

int prism_oai_write_completion_chunk_at(prism_buf_t *b, const prism_oai_resp_meta_t *m, int index, const char *text,
                                        size_t len, const prism_oai_logprobs_t *lp, const char *finish_reason)
{
    int rc = prism_buf_append(b, "data: ", 6);
    if (!rc) rc = write_head(b, m, "text_completion");
    if (!rc) rc = prism_buf_appendf(b, ",\"choices\":[{\"index\":%d,\"text\":", index);
    if (!rc) rc = prism_json_string(b, text ? text : "", text ? len : 0);
    if (!rc) rc = write_tail(b, lp, finish_reason);
    if (!rc) rc = prism_buf_append_str(b, "}]}\n\n");
    return rc;
}

int prism_oai_write_completion_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *text, size_t len,
                                     const prism_oai_logprobs_t *lp, const char *finish_reason)
{
    return prism_oai_write_completion_chunk_at(b, m, 0, text, len, lp, finish_reason);
}

int prism_oai_write_usage_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, const prism_oai_usage_t *u)
{
    int rc = prism_buf_append(b, "data: ", 6);
    if (!rc) rc = write_head(b, m, m->chat ? "chat.completion.chunk" : "text_completion");
    if (!rc) rc = prism_buf_append_str(b, ",\"choices\":[],\"usage\":");
    if (!rc) rc = prism_oai_write_usage(b, u);
    if (!rc) rc = prism_buf_append_str(b, "}\n\n");
    return rc;
}

int prism_oai_write_response_begin(prism_buf_t *b, const prism_oai_resp_meta_t *m)
{
    int rc = write_head(b, m, m->chat ? "chat.completion" : "text_completion");
    if (!rc) rc = prism_buf_append_str(b, ",\"choices\":[");
    return rc;
}

/* a comma before every choice but the first of the array */
static int choice_sep(prism_buf_t *b)
{
    return b->len && b->data[b->len - 1] != '[' ? prism_buf_append(b, ",", 1) : PRISM_OK;
}

int prism_oai_write_chat_choice(prism_buf_t *b, const prism_oai_choice_t *c)
{
    int rc = choice_sep(b);
    if (!rc) rc = prism_buf_appendf(b, "{\"index\":%d,\"message\":{\"role\":\"assistant\",\"content\":", c->index);
    if (!rc) rc = c->content ? prism_json_string(b, c->content, c->len) : prism_buf_append_str(b, "null");
    if (!rc) rc = prism_buf_append_str(b, ",\"refusal\":null");
    if (!rc && c->n_tool_calls > 0) {
        rc = prism_buf_append_str(b, ",\"tool_calls\":[");
        for (int i = 0; !rc && i < c->n_tool_calls; i++) {
            const prism_oai_tool_call_t *t = &c->tool_calls[i];
            if (i) rc = prism_buf_append(b, ",", 1);
            if (!rc) rc = prism_buf_append_str(b, "{\"id\":");
            if (!rc) rc = prism_json_cstr(b, t->id);
            if (!rc) rc = prism_buf_append_str(b, ",\"type\":\"function\",\"function\":{\"name\":");
            if (!rc) rc = prism_json_cstr(b, t->name);
            if (!rc) rc = prism_buf_append_str(b, ",\"arguments\":");
            if (!rc) rc = prism_json_string(b, t->arguments ? t->arguments : "", t->arguments ? t->arguments_len : 0);
            if (!rc) rc = prism_buf_append_str(b, "}}");
        }
        if (!rc) rc = prism_buf_append(b, "]", 1);
    }
    if (!rc) rc = prism_buf_append(b, "}", 1);
    if (!rc) rc = write_tail(b, c->lp, c->finish_reason);
    if (!rc) rc = prism_buf_append(b, "}", 1);
    return rc;
}

int prism_oai_write_completion_choice(prism_buf_t *b, const prism_oai_choice_t *c)
{
    int rc = choice_sep(b);
    if (!rc) rc = prism_buf_appendf(b, "{\"index\":%d,\"text\":", c->index);
    if (!rc) rc = prism_json_string(b, c->content ? c->content : "", c->content ? c->len : 0);
    if (!rc) rc = write_tail(b, c->lp, c->finish_reason);
    if (!rc) rc = prism_buf_append(b, "}", 1);
    return rc;
}

int prism_oai_write_response_end(prism_buf_t *b, const prism_oai_usage_t *u)
{
    int rc = prism_buf_append_str(b, "],\"usage\":");
    if (!rc) rc = prism_oai_write_usage(b, u);
    if (!rc) rc = prism_buf_append(b, "}", 1);
    return rc;
}

int prism_oai_write_chat_response(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *content, size_t len,
                                  const prism_oai_logprobs_t *lp, const char *finish_reason,
                                  const prism_oai_usage_t *u)
{
    prism_oai_choice_t c = {.content = content ? content : "", .len = content ? len : 0, .lp = lp,
                            .finish_reason = finish_reason};
    int rc = prism_oai_write_response_begin(b, m);
    if (!rc) rc = prism_oai_write_chat_choice(b, &c);
    if (!rc) rc = prism_oai_write_response_end(b, u);
    return rc;
}

int prism_oai_write_completion_response(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *text,
                                        size_t len, const prism_oai_logprobs_t *lp, const char *finish_reason,
                                        const prism_oai_usage_t *u)
{
    prism_oai_choice_t c = {.content = text, .len = len, .lp = lp, .finish_reason = finish_reason};
    int rc = prism_oai_write_response_begin(b, m);
    if (!rc) rc = prism_oai_write_completion_choice(b, &c);
    if (!rc) rc = prism_oai_write_response_end(b, u);
    return rc;
}
