/* OpenAI request parsing/validation and response writers. See openai_req.h. */
#include "openai_req.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#define OAI_DEFAULT_MAX_IMAGES      8
#define OAI_DEFAULT_MAX_MESSAGES    4096
#define OAI_DEFAULT_MAX_DEPTH       64
#define OAI_DEFAULT_MAX_PROMPT_IDS  (1 << 20)
#define OAI_COMPLETIONS_MAX_TOKENS  16

/* ------------------------------------------------------------------ UTF-8 */

typedef enum { UTF8_OK, UTF8_INVALID, UTF8_TRUNCATED } utf8_res_t;

/* Decodes one sequence at s[0..n). *used = bytes to consume: the sequence when OK, otherwise the
 * maximal subpart (the valid prefix of an ill-formed sequence, at least 1), which gets one U+FFFD. */
static utf8_res_t utf8_next(const unsigned char *s, size_t n, size_t *used)
{
    unsigned char c = s[0];
    if (c < 0x80) {
        *used = 1;
        return UTF8_OK;
    }
    int need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) need = 1;
    else if (c == 0xE0) { need = 2; lo = 0xA0; }
    else if (c >= 0xE1 && c <= 0xEC) need = 2;
    else if (c == 0xED) { need = 2; hi = 0x9F; }
    else if (c >= 0xEE && c <= 0xEF) need = 2;
    else if (c == 0xF0) { need = 3; lo = 0x90; }
    else if (c >= 0xF1 && c <= 0xF3) need = 3;
    else if (c == 0xF4) { need = 3; hi = 0x8F; }
    else {
        *used = 1;
        return UTF8_INVALID;
    }
    size_t i = 1;
    for (int k = 0; k < need; k++, i++) {
        if (i >= n) {
            *used = i;
            return UTF8_TRUNCATED;
        }
        unsigned char l = k == 0 ? lo : 0x80, h = k == 0 ? hi : 0xBF;
        if (s[i] < l || s[i] > h) {
            *used = i;
            return UTF8_INVALID;
        }
    }
    *used = i;
    return UTF8_OK;
}

size_t prism_oai_utf8_complete_prefix(const char *s, size_t len)
{
    const unsigned char *u = (const unsigned char *)s;
    /* a sequence is at most 4 bytes: only the last 3 can start an unfinished one */
    size_t from = len > 3 ? len - 3 : 0;
    for (size_t p = from; p < len; p++) {
        if (u[p] < 0xC2 || u[p] > 0xF4) continue;
        size_t used;
        if (utf8_next(u + p, len - p, &used) == UTF8_TRUNCATED && p + used == len) return p;
    }
    return len;
}

/* Code points after replacement (what Python's len() sees on the decoded text). */
static size_t utf8_count_cps(const char *s, size_t len)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        size_t used;
        utf8_next(u + i, len - i, &used);
        i += used;
        n++;
    }
    return n;
}

/* ------------------------------------------------------------------ JSON output primitives */

int prism_oai_json_string(prism_buf_t *b, const char *s, size_t len)
{
    static const char hexd[] = "0123456789abcdef";
    const unsigned char *u = (const unsigned char *)s;
    /* worst case 6 bytes out per byte in; reserve a typical amount up front */
    int rc = prism_buf_reserve(b, len + 2 + 16);
    if (rc) return rc;
    rc = prism_buf_append(b, "\"", 1);
    size_t i = 0;
    while (!rc && i < len) {
        size_t run = i;
        while (run < len && u[run] >= 0x20 && u[run] < 0x80 && u[run] != '"' && u[run] != '\\') run++;
        if (run > i) {
            rc = prism_buf_append(b, s + i, run - i);
            i = run;
            continue;
        }
        unsigned char c = u[i];
        if (c < 0x80) {
            char e[6] = {'\\', 0};
            size_t el = 2;
            switch (c) {
            case '"': e[1] = '"'; break;
            case '\\': e[1] = '\\'; break;
            case '\n': e[1] = 'n'; break;
            case '\r': e[1] = 'r'; break;
            case '\t': e[1] = 't'; break;
            case '\b': e[1] = 'b'; break;
            case '\f': e[1] = 'f'; break;
            default:
                e[1] = 'u'; e[2] = '0'; e[3] = '0'; e[4] = hexd[c >> 4]; e[5] = hexd[c & 15];
                el = 6;
                break;
            }
            rc = prism_buf_append(b, e, el);
            i++;
            continue;
        }
        size_t used;
        if (utf8_next(u + i, len - i, &used) == UTF8_OK) rc = prism_buf_append(b, s + i, used);
        else rc = prism_buf_append(b, "\xEF\xBF\xBD", 3);  /* U+FFFD */
        i += used;
    }
    if (!rc) rc = prism_buf_append(b, "\"", 1);
    return rc;
}

static int json_cstr(prism_buf_t *b, const char *s)
{
    if (!s) return prism_buf_append(b, "null", 4);
    return prism_oai_json_string(b, s, strlen(s));
}

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
    return json_cstr(&m->model_json, model ? model : "");
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

int prism_oai_write_error(prism_buf_t *b, const char *type, const char *message, const char *param,
                          const char *code)
{
    int rc = prism_buf_append_str(b, "{\"error\":{\"message\":");
    if (!rc) rc = json_cstr(b, message ? message : "");
    if (!rc) rc = prism_buf_append_str(b, ",\"type\":");
    if (!rc) rc = json_cstr(b, type ? type : "BadRequestError");
    if (!rc) rc = prism_buf_append_str(b, ",\"param\":");
    if (!rc) rc = json_cstr(b, param);
    if (!rc) rc = prism_buf_append_str(b, ",\"code\":");
    if (!rc) rc = json_cstr(b, code);
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
    if (!rc) rc = prism_oai_json_string(b, text ? text : "", len);
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
    if (!rc) rc = prism_oai_json_string(&lp->tokens, t->text ? t->text : "", t->len);
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
        if (!rc) rc = prism_oai_json_string(&lp->top_logprobs, t->top[i].text ? t->top[i].text : "", t->top[i].len);
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
    lp->text_offset += utf8_count_cps(t->text ? t->text : "", t->len);
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
        if (!rc) rc = prism_buf_append_str(b, "]}");
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
    if (!rc) rc = json_cstr(b, finish_reason);
    return rc;
}

int prism_oai_write_chat_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, bool role, const char *content,
                               size_t content_len, const prism_oai_logprobs_t *lp, const char *finish_reason)
{
    int rc = prism_buf_append(b, "data: ", 6);
    if (!rc) rc = write_head(b, m, "chat.completion.chunk");
    if (!rc) rc = prism_buf_append_str(b, ",\"choices\":[{\"index\":0,\"delta\":{");
    if (!rc && role) rc = prism_buf_append_str(b, content ? "\"role\":\"assistant\"," : "\"role\":\"assistant\"");
    if (!rc && content) {
        rc = prism_buf_append_str(b, "\"content\":");
        if (!rc) rc = prism_oai_json_string(b, content, content_len);
    }
    if (!rc) rc = prism_buf_append(b, "}", 1);
    if (!rc) rc = write_tail(b, lp, finish_reason);
    if (!rc) rc = prism_buf_append_str(b, "}]}\n\n");
    return rc;
}

int prism_oai_write_completion_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *text, size_t len,
                                     const prism_oai_logprobs_t *lp, const char *finish_reason)
{
    int rc = prism_buf_append(b, "data: ", 6);
    if (!rc) rc = write_head(b, m, "text_completion");
    if (!rc) rc = prism_buf_append_str(b, ",\"choices\":[{\"index\":0,\"text\":");
    if (!rc) rc = prism_oai_json_string(b, text ? text : "", text ? len : 0);
    if (!rc) rc = write_tail(b, lp, finish_reason);
    if (!rc) rc = prism_buf_append_str(b, "}]}\n\n");
    return rc;
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

int prism_oai_write_chat_response(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *content, size_t len,
                                  const prism_oai_logprobs_t *lp, const char *finish_reason,
                                  const prism_oai_usage_t *u)
{
    int rc = write_head(b, m, "chat.completion");
    if (!rc) rc = prism_buf_append_str(b, ",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":");
    if (!rc) rc = prism_oai_json_string(b, content ? content : "", content ? len : 0);
    if (!rc) rc = prism_buf_append(b, "}", 1);
    if (!rc) rc = write_tail(b, lp, finish_reason);
    if (!rc) rc = prism_buf_append_str(b, "}],\"usage\":");
    if (!rc) rc = prism_oai_write_usage(b, u);
    if (!rc) rc = prism_buf_append(b, "}", 1);
    return rc;
}

int prism_oai_write_completion_response(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *text,
                                        size_t len, const prism_oai_logprobs_t *lp, const char *finish_reason,
                                        const prism_oai_usage_t *u)
{
    int rc = write_head(b, m, "text_completion");
    if (!rc) rc = prism_buf_append_str(b, ",\"choices\":[{\"index\":0,\"text\":");
    if (!rc) rc = prism_oai_json_string(b, text ? text : "", text ? len : 0);
    if (!rc) rc = write_tail(b, lp, finish_reason);
    if (!rc) rc = prism_buf_append_str(b, "}],\"usage\":");
    if (!rc) rc = prism_oai_write_usage(b, u);
    if (!rc) rc = prism_buf_append(b, "}", 1);
    return rc;
}

/* ------------------------------------------------------------------ parsing helpers */

static int oai_fail(prism_oai_error_t *err, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int oai_fail(prism_oai_error_t *err, const char *param, const char *fmt, ...)
{
    if (err) {
        err->status = 400;
        snprintf(err->type, sizeof err->type, "BadRequestError");
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
        snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    }
    return PRISM_EINVAL;
}

static const char *json_type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    case JSON_STRING: return "string";
    case JSON_INTEGER: return "integer";
    case JSON_REAL: return "number";
    case JSON_TRUE:
    case JSON_FALSE: return "boolean";
    case JSON_NULL: return "null";
    }
    return "unknown";
}

/* The field or NULL when absent or JSON null (both mean "use the default", as in vLLM). */
static json_t *field(json_t *obj, const char *key)
{
    json_t *v = json_object_get(obj, key);
    return (v && !json_is_null(v)) ? v : NULL;
}

/* Integers, and reals with an integral value in range (pydantic's lax int accepts 10.0). */
static bool as_int64(const json_t *v, int64_t *out)
{
    if (json_is_integer(v)) {
        *out = json_integer_value(v);
        return true;
    }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (d == floor(d) && d >= -9.2e18 && d <= 9.2e18) {
            *out = (int64_t)d;
            return true;
        }
    }
    return false;
}

static int get_bool(json_t *root, const char *key, bool *out, prism_oai_error_t *err)
{
    json_t *v = field(root, key);
    if (!v) return PRISM_OK;
    if (!json_is_boolean(v)) return oai_fail(err, key, "'%s' must be a boolean, got %s.", key, json_type_name(v));
    *out = json_is_true(v);
    return PRISM_OK;
}

static int get_int(json_t *root, const char *key, int64_t *out, bool *present, prism_oai_error_t *err)
{
    json_t *v = field(root, key);
    if (present) *present = v != NULL;
    if (!v) return PRISM_OK;
    if (!as_int64(v, out)) return oai_fail(err, key, "'%s' must be an integer, got %s.", key, json_type_name(v));
    return PRISM_OK;
}

static int get_number(json_t *root, const char *key, double *out, bool *present, prism_oai_error_t *err)
{
    json_t *v = field(root, key);
    if (present) *present = v != NULL;
    if (!v) return PRISM_OK;
    if (!json_is_number(v)) return oai_fail(err, key, "'%s' must be a number, got %s.", key, json_type_name(v));
    double d = json_number_value(v);
    if (!isfinite(d)) return oai_fail(err, key, "'%s' must be a finite number.", key);
    *out = d;
    return PRISM_OK;
}

static bool depth_ok(const json_t *v, int depth, int max_depth)
{
    if (depth > max_depth) return false;
    if (json_is_object(v)) {
        const char *k;
        json_t *c;
        json_object_foreach((json_t *)v, k, c) {
            if ((json_is_object(c) || json_is_array(c)) && !depth_ok(c, depth + 1, max_depth)) return false;
        }
    } else if (json_is_array(v)) {
        size_t i;
        json_t *c;
        json_array_foreach(v, i, c) {
            if ((json_is_object(c) || json_is_array(c)) && !depth_ok(c, depth + 1, max_depth)) return false;
        }
    }
    return true;
}

static const char *const k_chat_fields[] = {
    "messages", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "n", "ignore_eos",
    "add_generation_prompt", "add_special_tokens", "skip_special_tokens", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "return_tokens_as_token_ids",
};
static const char *const k_completion_fields[] = {
    "prompt", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs", "n", "ignore_eos", "add_special_tokens",
    "skip_special_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "echo", "suffix",
    "best_of", "return_tokens_as_token_ids",
};

static void log_unknown_fields(json_t *root, bool chat)
{
    const char *const *known = chat ? k_chat_fields : k_completion_fields;
    size_t n_known = chat ? PRISM_ARRAY_LEN(k_chat_fields) : PRISM_ARRAY_LEN(k_completion_fields);
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        bool found = false;
        for (size_t i = 0; i < n_known && !found; i++) found = strcmp(key, known[i]) == 0;
        if (!found) PRISM_DEBUG("openai: ignoring unsupported field '%.64s'", key);
    }
}

/* ------------------------------------------------------------------ messages */

static bool valid_role(const char *r)
{
    static const char *const roles[] = {"system", "user", "assistant", "tool", "developer"};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(roles); i++)
        if (strcmp(r, roles[i]) == 0) return true;
    return false;
}

/* Validates message idx; counts its parts and images; fills m/parts when they are non-NULL. */
static int parse_message(json_t *msg, size_t idx, prism_oai_message_t *m, prism_oai_part_t *parts, int *n_parts,
                         int *n_images, prism_oai_error_t *err)
{
    char param[64];
    snprintf(param, sizeof param, "messages[%zu]", idx);
    if (!json_is_object(msg)) return oai_fail(err, param, "%s must be an object, got %s.", param, json_type_name(msg));
    json_t *role = json_object_get(msg, "role");
    snprintf(param, sizeof param, "messages[%zu].role", idx);
    if (!role) return oai_fail(err, param, "'role' is a required property (%s).", param);
    if (!json_is_string(role)) return oai_fail(err, param, "%s must be a string, got %s.", param, json_type_name(role));
    if (!valid_role(json_string_value(role)))
        return oai_fail(err, param, "Unsupported role '%.64s' in %s; expected one of system, user, assistant, tool, developer.",
                        json_string_value(role), param);
    *n_parts = 0;
    *n_images = 0;
    if (m) {
        m->role = json_string_value(role);
        m->raw = msg;
        m->parts = parts;
    }
    json_t *content = json_object_get(msg, "content");
    snprintf(param, sizeof param, "messages[%zu].content", idx);
    if (!content || json_is_null(content)) {
        if (m) m->content_is_null = true;
        return PRISM_OK;
    }
    if (json_is_string(content)) {
        if (parts) {
            parts[0].kind = PRISM_OAI_PART_TEXT;
            parts[0].text = json_string_value(content);
            parts[0].text_len = json_string_length(content);
        }
        if (m) m->content_is_string = true;
        *n_parts = 1;
        goto done;
    }
    if (!json_is_array(content))
        return oai_fail(err, param, "%s must be a string or a list of content parts, got %s.", param,
                        json_type_name(content));
    size_t j;
    json_t *part;
    json_array_foreach(content, j, part) {
        snprintf(param, sizeof param, "messages[%zu].content[%zu]", idx, j);
        if (!json_is_object(part)) return oai_fail(err, param, "%s must be an object, got %s.", param, json_type_name(part));
        json_t *type = json_object_get(part, "type");
        if (!json_is_string(type)) {
            snprintf(param, sizeof param, "messages[%zu].content[%zu].type", idx, j);
            return oai_fail(err, param, "Content part is missing a string 'type' (%s).", param);
        }
        const char *t = json_string_value(type);
        prism_oai_part_t *p = parts ? &parts[*n_parts] : NULL;
        if (strcmp(t, "text") == 0) {
            json_t *text = json_object_get(part, "text");
            if (!json_is_string(text)) {
                snprintf(param, sizeof param, "messages[%zu].content[%zu].text", idx, j);
                return oai_fail(err, param, "A text content part needs a string 'text' (%s).", param);
            }
            if (p) {
                p->kind = PRISM_OAI_PART_TEXT;
                p->text = json_string_value(text);
                p->text_len = json_string_length(text);
            }
        } else if (strcmp(t, "image_url") == 0) {
            json_t *iu = json_object_get(part, "image_url");
            json_t *url = json_is_object(iu) ? json_object_get(iu, "url") : iu;  /* also {"image_url": "url"} */
            snprintf(param, sizeof param, "messages[%zu].content[%zu].image_url", idx, j);
            if (!json_is_string(url) || json_string_length(url) == 0)
                return oai_fail(err, param, "An image_url content part needs a non-empty 'image_url.url' string (%s).",
                                param);
            if (p) {
                p->kind = PRISM_OAI_PART_IMAGE;
                p->image_url = json_string_value(url);
                p->image_url_len = json_string_length(url);
            }
            (*n_images)++;
        } else {
            snprintf(param, sizeof param, "messages[%zu].content[%zu].type", idx, j);
            return oai_fail(err, param, "Unsupported content part type '%.64s'", t);
        }
        (*n_parts)++;
    }
done:
    if (m) {
        m->n_parts = *n_parts;
        m->n_images = *n_images;
    }
    return PRISM_OK;
}

static int parse_messages(json_t *root, prism_oai_request_t *out, const prism_oai_parse_opts_t *o,
                          prism_oai_error_t *err)
{
    json_t *msgs = json_object_get(root, "messages");
    if (!msgs || json_is_null(msgs)) return oai_fail(err, "messages", "'messages' is a required property");
    if (!json_is_array(msgs)) return oai_fail(err, "messages", "'messages' must be a list, got %s.", json_type_name(msgs));
    size_t n = json_array_size(msgs);
    if (n == 0) return oai_fail(err, "messages", "[] is too short - 'messages'");
    if (n > (size_t)o->max_messages)
        return oai_fail(err, "messages", "Too many messages: %zu (the limit is %d).", n, o->max_messages);
    size_t total_parts = 0;
    int total_images = 0;
    for (size_t i = 0; i < n; i++) {
        int np, ni;
        int rc = parse_message(json_array_get(msgs, i), i, NULL, NULL, &np, &ni, err);
        if (rc) return rc;
        total_parts += (size_t)np;
        total_images += ni;
    }
    int max_images = o->max_images < 0 ? 0 : o->max_images;
    if (total_images > max_images)
        return oai_fail(err, "messages", "At most %d image(s) may be provided in one prompt.", max_images);
    out->messages = prism_calloc(n, sizeof *out->messages);
    prism_oai_part_t *parts = prism_calloc(total_parts ? total_parts : 1, sizeof *parts);
    if (!out->messages || !parts) {
        prism_free(parts);
        oai_fail(err, NULL, "Out of memory.");
        if (err) err->status = 500;
        return PRISM_ENOMEM;
    }
    out->n_messages = (int)n;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        int np, ni;
        parse_message(json_array_get(msgs, i), i, &out->messages[i], parts + at, &np, &ni, NULL);
        at += (size_t)np;
    }
    out->n_images = total_images;
    return PRISM_OK;
}

/* ------------------------------------------------------------------ prompt (completions) */

static int parse_token_ids(json_t *arr, prism_oai_request_t *out, const prism_oai_parse_opts_t *o,
                           prism_oai_error_t *err)
{
    size_t n = json_array_size(arr);
    if (n == 0) return oai_fail(err, "prompt", "Prompt cannot be empty.");
    if (n > (size_t)o->max_prompt_token_ids)
        return oai_fail(err, "prompt", "Too many prompt token ids: %zu (the limit is %d).", n, o->max_prompt_token_ids);
    out->prompt_token_ids = prism_malloc(n * sizeof *out->prompt_token_ids);
    if (!out->prompt_token_ids) {
        oai_fail(err, NULL, "Out of memory.");
        if (err) err->status = 500;
        return PRISM_ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        int64_t id;
        json_t *v = json_array_get(arr, i);
        if (!as_int64(v, &id))
            return oai_fail(err, "prompt", "'prompt' token ids must be integers, got %s at index %zu.", json_type_name(v), i);
        if (id < 0 || id > INT32_MAX)
            return oai_fail(err, "prompt", "Token id %lld at index %zu is out of range.", (long long)id, i);
        out->prompt_token_ids[i] = (int32_t)id;
    }
    out->n_prompt_token_ids = (int)n;
    return PRISM_OK;
}

static int parse_prompt(json_t *root, prism_oai_request_t *out, const prism_oai_parse_opts_t *o,
                        prism_oai_error_t *err)
{
    json_t *p = field(root, "prompt");
    if (!p) return oai_fail(err, "prompt", "'prompt' is a required property");
    if (json_is_string(p)) {
        out->prompt = json_string_value(p);
        out->prompt_len = json_string_length(p);
        return PRISM_OK;
    }
    if (!json_is_array(p))
        return oai_fail(err, "prompt", "'prompt' must be a string, a list of one string or a list of token ids, got %s.",
                        json_type_name(p));
    size_t n = json_array_size(p);
    if (n == 0) return oai_fail(err, "prompt", "Prompt cannot be empty.");
    json_t *first = json_array_get(p, 0);
    if (json_is_string(first) || json_is_array(first)) {
        if (n > 1)
            return oai_fail(err, "prompt", "Batched prompts (%zu in one request) are not supported; send one prompt per request.", n);
        if (json_is_string(first)) {
            out->prompt = json_string_value(first);
            out->prompt_len = json_string_length(first);
            return PRISM_OK;
        }
        return parse_token_ids(first, out, o, err);
    }
    return parse_token_ids(p, out, o, err);
}

/* ------------------------------------------------------------------ sampling fields */

static int parse_stop(json_t *root, prism_oai_request_t *out, prism_oai_error_t *err)
{
    json_t *s = field(root, "stop");
    if (!s) goto ids;
    size_t n = 1;
    if (json_is_array(s)) {
        n = json_array_size(s);
        if (n > PRISM_OAI_MAX_STOP)
            return oai_fail(err, "stop", "'stop' may contain at most %d sequences, got %zu.", PRISM_OAI_MAX_STOP, n);
    } else if (!json_is_string(s)) {
        return oai_fail(err, "stop", "'stop' must be a string or a list of strings, got %s.", json_type_name(s));
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_is_array(s) ? json_array_get(s, i) : s;
        if (!json_is_string(v))
            return oai_fail(err, "stop", "'stop' must be a string or a list of strings, got %s in the list.",
                            json_type_name(v));
        size_t len = json_string_length(v);
        if (len == 0) return oai_fail(err, "stop", "stop cannot contain an empty string.");
        if (len > PRISM_OAI_MAX_STOP_LEN)
            return oai_fail(err, "stop", "Each stop sequence may be at most %d bytes, got %zu.", PRISM_OAI_MAX_STOP_LEN, len);
        out->stop[out->n_stop] = json_string_value(v);
        out->stop_len[out->n_stop] = len;
        out->n_stop++;
    }
ids:;
    json_t *ids = field(root, "stop_token_ids");
    if (!ids) return PRISM_OK;
    if (!json_is_array(ids))
        return oai_fail(err, "stop_token_ids", "'stop_token_ids' must be a list of integers, got %s.", json_type_name(ids));
    size_t m = json_array_size(ids);
    if (m > PRISM_OAI_MAX_STOP_TOKEN_IDS)
        return oai_fail(err, "stop_token_ids", "'stop_token_ids' may contain at most %d ids, got %zu.",
                        PRISM_OAI_MAX_STOP_TOKEN_IDS, m);
    for (size_t i = 0; i < m; i++) {
        int64_t id;
        if (!as_int64(json_array_get(ids, i), &id) || id < 0 || id > INT32_MAX)
            return oai_fail(err, "stop_token_ids", "'stop_token_ids' must contain non-negative integer token ids.");
        out->stop_token_ids[out->n_stop_token_ids++] = id;
    }
    return PRISM_OK;
}

static int parse_sampling(json_t *root, bool chat, prism_oai_request_t *out, prism_oai_error_t *err)
{
    int rc;
    bool present;
    int64_t iv;

    if ((rc = get_bool(root, "stream", &out->stream, err))) return rc;
    json_t *so = field(root, "stream_options");
    if (so) {
        if (!out->stream) return oai_fail(err, "stream_options", "Stream options can only be defined when `stream=True`.");
        if (!json_is_object(so))
            return oai_fail(err, "stream_options", "'stream_options' must be an object, got %s.", json_type_name(so));
        if ((rc = get_bool(so, "include_usage", &out->include_usage, err))) return rc;
    }

    int64_t mt = -1;
    if ((rc = get_int(root, "max_tokens", &iv, &present, err))) return rc;
    if (present) {
        if (iv < 1) return oai_fail(err, "max_tokens", "max_tokens must be at least 1, got %lld.", (long long)iv);
        mt = iv;
    }
    if ((rc = get_int(root, "max_completion_tokens", &iv, &present, err))) return rc;
    if (present) {
        if (iv < 1)
            return oai_fail(err, "max_completion_tokens", "max_completion_tokens must be at least 1, got %lld.",
                            (long long)iv);
        mt = iv;
    }
    out->max_tokens = (mt < 0 && !chat) ? OAI_COMPLETIONS_MAX_TOKENS : mt;

    if ((rc = get_number(root, "temperature", &out->temperature, NULL, err))) return rc;
    if (out->temperature < 0)
        return oai_fail(err, "temperature", "temperature must be non-negative, got %g.", out->temperature);
    if ((rc = get_number(root, "top_p", &out->top_p, NULL, err))) return rc;
    if (!(out->top_p > 0 && out->top_p <= 1)) return oai_fail(err, "top_p", "top_p must be in (0, 1], got %g.", out->top_p);
    if ((rc = get_int(root, "top_k", &iv, &present, err))) return rc;
    if (present) {
        if (iv < -1) return oai_fail(err, "top_k", "top_k must be -1 or 0 (disable), or at least 1, got %lld.", (long long)iv);
        out->top_k = iv <= 0 ? -1 : iv;
    }
    if ((rc = get_number(root, "presence_penalty", &out->presence_penalty, NULL, err))) return rc;
    if (out->presence_penalty < -2 || out->presence_penalty > 2)
        return oai_fail(err, "presence_penalty", "presence_penalty must be in [-2, 2], got %g.", out->presence_penalty);
    if ((rc = get_number(root, "frequency_penalty", &out->frequency_penalty, NULL, err))) return rc;
    if (out->frequency_penalty < -2 || out->frequency_penalty > 2)
        return oai_fail(err, "frequency_penalty", "frequency_penalty must be in [-2, 2], got %g.", out->frequency_penalty);
    if ((rc = get_number(root, "repetition_penalty", &out->repetition_penalty, NULL, err))) return rc;
    if (!(out->repetition_penalty > 0))
        return oai_fail(err, "repetition_penalty", "repetition_penalty must be greater than zero, got %g.",
                        out->repetition_penalty);

    if ((rc = get_int(root, "seed", &out->seed, &out->has_seed, err))) return rc;

    if ((rc = get_int(root, "n", &iv, &present, err))) return rc;
    if (present) {
        if (iv < 1) return oai_fail(err, "n", "n must be at least 1, got %lld.", (long long)iv);
        if (iv > 1) return oai_fail(err, "n", "n must be 1 (one choice per request is supported), got %lld.", (long long)iv);
    }
    if (!chat) {
        if ((rc = get_int(root, "best_of", &iv, &present, err))) return rc;
        if (present && iv != 1) return oai_fail(err, "best_of", "best_of must be 1 (one choice per request is supported), got %lld.", (long long)iv);
        bool echo = false;
        if ((rc = get_bool(root, "echo", &echo, err))) return rc;
        if (echo) return oai_fail(err, "echo", "'echo' is not supported.");
        if (field(root, "suffix")) return oai_fail(err, "suffix", "suffix is not currently supported");
    }

    if (chat) {
        if ((rc = get_bool(root, "logprobs", &out->logprobs, err))) return rc;
        if ((rc = get_int(root, "top_logprobs", &iv, &present, err))) return rc;
        if (present) {
            if (iv < 0) return oai_fail(err, "top_logprobs", "`top_logprobs` must be a positive value.");
            if (iv > PRISM_OAI_MAX_TOP_LOGPROBS)
                return oai_fail(err, "top_logprobs", "top_logprobs must be at most %d, got %lld.", PRISM_OAI_MAX_TOP_LOGPROBS,
                                (long long)iv);
            if (iv > 0 && !out->logprobs)
                return oai_fail(err, "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.");
            out->top_logprobs = (int)iv;
        }
    } else {
        if ((rc = get_int(root, "logprobs", &iv, &present, err))) return rc;
        if (present) {
            if (iv < 0) return oai_fail(err, "logprobs", "`logprobs` must be a positive value.");
            if (iv > PRISM_OAI_MAX_TOP_LOGPROBS)
                return oai_fail(err, "logprobs", "logprobs must be at most %d, got %lld.", PRISM_OAI_MAX_TOP_LOGPROBS,
                                (long long)iv);
            out->logprobs = true;
            out->top_logprobs = (int)iv;
        }
    }

    if ((rc = get_bool(root, "ignore_eos", &out->ignore_eos, err))) return rc;
    if ((rc = get_bool(root, "add_special_tokens", &out->add_special_tokens, err))) return rc;
    if ((rc = get_bool(root, "skip_special_tokens", &out->skip_special_tokens, err))) return rc;
    if ((rc = get_bool(root, "return_tokens_as_token_ids", &out->return_tokens_as_token_ids, err))) return rc;
    if (chat && (rc = get_bool(root, "add_generation_prompt", &out->add_generation_prompt, err))) return rc;
    return parse_stop(root, out, err);
}

/* ------------------------------------------------------------------ entry points */

int prism_oai_parse(const char *body, size_t len, bool chat, const prism_oai_parse_opts_t *opts_in,
                    prism_oai_request_t *out, prism_oai_error_t *err)
{
    prism_oai_parse_opts_t o = opts_in ? *opts_in : (prism_oai_parse_opts_t){0};
    if (o.max_images == 0) o.max_images = OAI_DEFAULT_MAX_IMAGES;
    if (o.max_messages <= 0) o.max_messages = OAI_DEFAULT_MAX_MESSAGES;
    if (o.max_depth <= 0) o.max_depth = OAI_DEFAULT_MAX_DEPTH;
    if (o.max_prompt_token_ids <= 0) o.max_prompt_token_ids = OAI_DEFAULT_MAX_PROMPT_IDS;

    memset(out, 0, sizeof *out);
    if (err) memset(err, 0, sizeof *err);
    out->chat = chat;
    out->max_tokens = -1;
    out->temperature = 1.0;
    out->top_p = 1.0;
    out->top_k = -1;
    out->repetition_penalty = 1.0;
    out->n = 1;
    out->add_generation_prompt = true;
    out->add_special_tokens = !chat;
    out->skip_special_tokens = true;

    int rc;
    json_error_t je;
    json_t *root = json_loadb(body ? body : "", len, JSON_ALLOW_NUL, &je);
    if (!root) return oai_fail(err, NULL, "Invalid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    out->root = root;
    if (!json_is_object(root)) {
        rc = oai_fail(err, NULL, "The request body must be a JSON object, got %s.", json_type_name(root));
        goto fail;
    }
    if (!depth_ok(root, 1, o.max_depth)) {
        rc = oai_fail(err, NULL, "JSON nesting is too deep (the limit is %d levels).", o.max_depth);
        goto fail;
    }
    json_t *model = field(root, "model");
    if (model && !json_is_string(model)) {
        rc = oai_fail(err, "model", "'model' must be a string, got %s.", json_type_name(model));
        goto fail;
    }
    out->model = model ? json_string_value(model) : NULL;

    rc = chat ? parse_messages(root, out, &o, err) : parse_prompt(root, out, &o, err);
    if (rc) goto fail;
    rc = parse_sampling(root, chat, out, err);
    if (rc) goto fail;
    log_unknown_fields(root, chat);
    return PRISM_OK;
fail:
    prism_oai_request_free(out);
    return rc;
}

void prism_oai_request_free(prism_oai_request_t *r)
{
    if (!r) return;
    if (r->messages) {
        prism_free(r->messages[0].parts);  /* one block for all messages */
        prism_free(r->messages);
    }
    prism_free(r->prompt_token_ids);
    if (r->root) json_decref(r->root);
    bool chat = r->chat;
    memset(r, 0, sizeof *r);
    r->chat = chat;
}
