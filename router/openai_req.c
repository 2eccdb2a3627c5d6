/* OpenAI request parsing and validation. See openai_req.h. */
#include "openai_req.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define OAI_DEFAULT_MAX_IMAGES      8
#define OAI_DEFAULT_MAX_MESSAGES    4096
#define OAI_DEFAULT_MAX_DEPTH       64
#define OAI_DEFAULT_MAX_PROMPT_IDS  (1 << 20)
#define OAI_COMPLETIONS_MAX_TOKENS  16

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
