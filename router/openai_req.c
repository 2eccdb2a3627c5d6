/* OpenAI request parsing and validation. See openai_req.h. */
#include "openai_req.h"

#include "guide/guide.h"   /* prism_guide_kind_t */

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
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

/* ------------------------------------------------------------------ the field rule */

enum { F_CHAT = 1, F_COMPL = 2, F_BOTH = 3 };
typedef enum { F_IMPL, F_META, F_REFUSE } field_policy_t;

typedef struct {
    const char *name;
    uint8_t where;             /* F_CHAT | F_COMPL */
    uint8_t policy;            /* field_policy_t */
    const char *dflt;          /* F_REFUSE: JSON of the value accepted as "not asked for" (NULL: only null) */
} field_rule_t;

/* Every field of the spec's CreateChatCompletionRequest / CreateCompletionRequest (openai-openapi
 * 2.3.0) and the vLLM extras a vLLM user may send. */
static const field_rule_t k_fields[] = {
    /* implemented */
    {"model", F_BOTH, F_IMPL, NULL}, {"messages", F_CHAT, F_IMPL, NULL}, {"prompt", F_COMPL, F_IMPL, NULL},
    {"stream", F_BOTH, F_IMPL, NULL}, {"stream_options", F_BOTH, F_IMPL, NULL},
    {"max_tokens", F_BOTH, F_IMPL, NULL}, {"max_completion_tokens", F_BOTH, F_IMPL, NULL},
    {"temperature", F_BOTH, F_IMPL, NULL}, {"top_p", F_BOTH, F_IMPL, NULL}, {"top_k", F_BOTH, F_IMPL, NULL},
    {"seed", F_BOTH, F_IMPL, NULL}, {"stop", F_BOTH, F_IMPL, NULL}, {"stop_token_ids", F_BOTH, F_IMPL, NULL},
    {"logprobs", F_BOTH, F_IMPL, NULL}, {"top_logprobs", F_CHAT, F_IMPL, NULL}, {"n", F_BOTH, F_IMPL, NULL},
    {"best_of", F_COMPL, F_IMPL, NULL}, {"ignore_eos", F_BOTH, F_IMPL, NULL},
    {"presence_penalty", F_BOTH, F_IMPL, NULL}, {"frequency_penalty", F_BOTH, F_IMPL, NULL},
    {"repetition_penalty", F_BOTH, F_IMPL, NULL}, {"logit_bias", F_BOTH, F_IMPL, NULL},
    {"response_format", F_BOTH, F_IMPL, NULL}, {"guided_json", F_BOTH, F_IMPL, NULL},
    {"guided_regex", F_BOTH, F_IMPL, NULL}, {"guided_choice", F_BOTH, F_IMPL, NULL},
    {"tools", F_CHAT, F_IMPL, NULL}, {"tool_choice", F_CHAT, F_IMPL, NULL},
    {"parallel_tool_calls", F_CHAT, F_IMPL, NULL}, {"add_generation_prompt", F_CHAT, F_IMPL, NULL},
    {"add_special_tokens", F_BOTH, F_IMPL, NULL}, {"skip_special_tokens", F_BOTH, F_IMPL, NULL},
    {"chat_template_kwargs", F_CHAT, F_IMPL, NULL}, {"return_tokens_as_token_ids", F_BOTH, F_IMPL, NULL},
    {"mm_processor_kwargs", F_BOTH, F_IMPL, NULL},
    /* metadata: cannot change the answer */
    {"user", F_BOTH, F_META, NULL}, {"metadata", F_BOTH, F_META, NULL}, {"store", F_BOTH, F_META, NULL},
    {"service_tier", F_BOTH, F_META, NULL}, {"safety_identifier", F_BOTH, F_META, NULL},
    {"prompt_cache_key", F_BOTH, F_META, NULL}, {"prompt_cache_retention", F_BOTH, F_META, NULL},
    {"prompt_cache_options", F_BOTH, F_META, NULL}, {"prediction", F_BOTH, F_META, NULL},
    {"request_id", F_BOTH, F_META, NULL}, {"priority", F_BOTH, F_IMPL, NULL},
    {"cache_salt", F_BOTH, F_IMPL, NULL},
    /* refused: they would change the answer and are not implemented */
    {"audio", F_CHAT, F_REFUSE, NULL}, {"modalities", F_CHAT, F_REFUSE, "[\"text\"]"},
    {"web_search_options", F_CHAT, F_REFUSE, NULL}, {"moderation", F_CHAT, F_REFUSE, NULL},
    {"function_call", F_CHAT, F_REFUSE, NULL}, {"functions", F_CHAT, F_REFUSE, NULL},
    {"reasoning_effort", F_CHAT, F_REFUSE, NULL}, {"verbosity", F_CHAT, F_REFUSE, NULL},
    {"echo", F_BOTH, F_REFUSE, "false"}, {"suffix", F_COMPL, F_REFUSE, "\"\""},
    {"continue_final_message", F_CHAT, F_REFUSE, "false"}, {"documents", F_CHAT, F_REFUSE, NULL},
    {"chat_template", F_CHAT, F_REFUSE, NULL}, {"min_p", F_BOTH, F_REFUSE, "0"},
    {"min_tokens", F_BOTH, F_REFUSE, "0"}, {"use_beam_search", F_BOTH, F_REFUSE, "false"},
    {"length_penalty", F_BOTH, F_REFUSE, "1"}, {"include_stop_str_in_output", F_BOTH, F_REFUSE, "false"},
    {"prompt_logprobs", F_BOTH, F_REFUSE, NULL}, {"truncate_prompt_tokens", F_BOTH, F_REFUSE, NULL},
    {"bad_words", F_BOTH, F_REFUSE, "[]"}, {"allowed_token_ids", F_BOTH, F_REFUSE, NULL},
    {"logits_processors", F_BOTH, F_REFUSE, NULL}, {"guided_grammar", F_BOTH, F_REFUSE, NULL},
    {"guided_decoding_backend", F_BOTH, F_REFUSE, NULL}, {"guided_whitespace_pattern", F_BOTH, F_REFUSE, NULL},
    {"structured_outputs", F_BOTH, F_REFUSE, NULL},
    {"spaces_between_special_tokens", F_BOTH, F_REFUSE, "true"},
};

/* Equal JSON values, numbers compared by value (1 == 1.0). */
static bool json_same(json_t *a, json_t *b)
{
    if (json_is_number(a) && json_is_number(b)) return json_number_value(a) == json_number_value(b);
    return json_equal(a, b);
}

static int check_fields(json_t *root, bool chat, prism_oai_error_t *err)
{
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        const field_rule_t *f = NULL;
        for (size_t i = 0; i < PRISM_ARRAY_LEN(k_fields) && !f; i++)
            if (!strcmp(key, k_fields[i].name) && (k_fields[i].where & (chat ? F_CHAT : F_COMPL))) f = &k_fields[i];
        if (!f) {
            PRISM_DEBUG("openai: ignoring unknown field '%.64s'", key);
            continue;
        }
        if (f->policy != F_REFUSE || json_is_null(v)) continue;
        if (f->dflt) {
            json_t *d = json_loads(f->dflt, JSON_DECODE_ANY, NULL);
            bool same = d && json_same(v, d);
            json_decref(d);
            if (same) continue;
        }
        char param[64];
        snprintf(param, sizeof param, "%s", key);
        return oai_fail(err, param, "'%s' is not supported by this server; leave it out%s%s.", key,
                        f->dflt ? " or set it to " : "", f->dflt ? f->dflt : "");
    }
    return PRISM_OK;
}

/* ------------------------------------------------------------------ the parse budget */

/* What jansson holds per parsed value (glibc malloc, measured: an empty object 224 bytes and 122
 * more per member, an empty array 138, an integer or real 42, a string 90 plus its bytes; true,
 * false and null are shared), rounded up. A body of "{}," costs 75 times its size. */
#define OAI_COST_OBJECT 232
#define OAI_COST_MEMBER 128
#define OAI_COST_ARRAY  144
#define OAI_COST_STRING 96
#define OAI_COST_NUMBER 48
#define OAI_COST_SLOT   8
#define OAI_DEFAULT_MAX_PARSE_BYTES   (96u << 20)
#define OAI_DEFAULT_MAX_IGNORED_BYTES (1u << 20)

static size_t parse_limit(const prism_oai_parse_opts_t *o)
{
    return o && o->max_parse_bytes ? o->max_parse_bytes : OAI_DEFAULT_MAX_PARSE_BYTES;
}

size_t prism_oai_parse_bound(const prism_oai_parse_opts_t *o) { return parse_limit(o); }

/* Whether a top-level field is one the endpoint reads (its size is then bounded by the field's own
 * rules); any other (unknown, metadata, refused) only costs memory. */
static bool field_is_read(const char *k, size_t n, int endpoint)
{
    if (endpoint == PRISM_OAI_SCAN_ANY) return true;
    int where = endpoint == PRISM_OAI_SCAN_CHAT ? F_CHAT : F_COMPL;
    for (size_t i = 0; i < PRISM_ARRAY_LEN(k_fields); i++)
        if (k_fields[i].policy == F_IMPL && (k_fields[i].where & where) && strlen(k_fields[i].name) == n &&
            !memcmp(k_fields[i].name, k, n))
            return true;
    return false;
}

static bool scan_delim(char c)
{
    return c == ',' || c == ':' || c == '{' || c == '}' || c == '[' || c == ']' || c == '"' || c == ' ' ||
           c == '\t' || c == '\n' || c == '\r';
}

int prism_oai_scan(const char *body, size_t len, int endpoint, const prism_oai_parse_opts_t *o, size_t *tree_bytes,
                   prism_oai_error_t *err)
{
    size_t max_total = parse_limit(o);
    size_t max_ignored = o && o->max_ignored_bytes ? o->max_ignored_bytes : OAI_DEFAULT_MAX_IGNORED_BYTES;
    int max_depth = o && o->max_depth > 0 ? o->max_depth : OAI_DEFAULT_MAX_DEPTH;
    size_t total = 0, ignored = 0;
    int depth = 0;
    bool root_object = false, read = true;
    char name[64] = "";   /* the top-level field being scanned (for the error) */
    *tree_bytes = 0;
    for (size_t i = 0; i < len;) {
        char c = body[i];
        size_t cost = 0, text = 0;   /* text: string bytes, which cost what they weigh in the body */
        switch (c) {
        case '{':
        case '[':
            if (++depth > max_depth)
                return oai_fail(err, NULL, "JSON nesting is too deep (the limit is %d levels).", max_depth);
            if (depth == 1) root_object = c == '{';
            cost = c == '{' ? OAI_COST_OBJECT : OAI_COST_ARRAY;
            i++;
            break;
        case '}':
        case ']':
            if (depth > 0) depth--;
            i++;
            break;
        case '"': {
            size_t s = ++i;
            while (i < len && body[i] != '"') i += body[i] == '\\' ? 2 : 1;
            size_t e = PRISM_MIN(i, len);
            i = e + 1;
            size_t j = i;
            while (j < len && (body[j] == ' ' || body[j] == '\t' || body[j] == '\n' || body[j] == '\r')) j++;
            bool key = j < len && body[j] == ':';
            if (key && depth == 1 && root_object) {   /* a new top-level field */
                read = field_is_read(body + s, e - s, endpoint);
                snprintf(name, sizeof name, "%.*s", (int)PRISM_MIN(e - s, sizeof name - 1), body + s);
            }
            text = e - s;
            cost = (key ? OAI_COST_MEMBER : OAI_COST_STRING) + text;
            break;
        }
        case ',': case ':': case ' ': case '\t': case '\n': case '\r':
            i++;
            break;
        default: {
            size_t s = i;
            while (i < len && !scan_delim(body[i])) i++;
            if (i == s) i++;
            cost = OAI_COST_SLOT + (c == 't' || c == 'f' || c == 'n' ? 0 : OAI_COST_NUMBER);
            break;
        }
        }
        total += cost;
        if (!read && depth >= 1) ignored += cost - text;
        if (total > max_total)
            return oai_fail(err, NULL, "The request is too large to parse: it would take more than %zu MiB of memory "
                            "once parsed (JSON objects and arrays cost far more than their bytes).", max_total >> 20);
        if (ignored > max_ignored) {
            char param[64];
            snprintf(param, sizeof param, "%s", name);
            return oai_fail(err, param, "'%s' is too large: fields this server does not read may hold at most %zu KiB "
                            "of JSON structure (objects, arrays, numbers) once parsed.", name, max_ignored >> 10);
        }
    }
    *tree_bytes = total;
    return PRISM_OK;
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
        } else if (!strcmp(t, "video_url") || !strcmp(t, "audio_url") || !strcmp(t, "input_audio") ||
                   !strcmp(t, "file")) {
            /* other media vLLM takes: said plainly rather than as an unknown type */
            snprintf(param, sizeof param, "messages[%zu].content[%zu].type", idx, j);
            return oai_fail(err, param, "Content part type '%s' is not supported: this server takes text and "
                            "images (image_url) only.", t);
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
    if (total_images > max_images) {
        oai_fail(err, "messages", "At most %d image(s) may be provided in one prompt.", max_images);
        if (err) err->refusal = PRISM_OAI_REFUSED_TOO_MANY_IMAGES;
        return PRISM_EINVAL;
    }
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

static int parse_stop(json_t *root, int vocab, prism_oai_request_t *out, prism_oai_error_t *err)
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
        if (vocab > 0 && id >= vocab)   /* a worker would refuse it: a client error, not a 500 */
            return oai_fail(err, "stop_token_ids", "Token id %lld in 'stop_token_ids' is out of vocabulary (%d tokens).",
                            (long long)id, vocab);
        out->stop_token_ids[out->n_stop_token_ids++] = id;
    }
    return PRISM_OK;
}

/* logit_bias: {"token id": bias}, ids as decimal strings, bias in [-100, 100]. */
static int parse_logit_bias(json_t *root, prism_oai_request_t *out, int vocab, prism_oai_error_t *err)
{
    json_t *lb = field(root, "logit_bias");
    if (!lb) return PRISM_OK;
    if (!json_is_object(lb))
        return oai_fail(err, "logit_bias", "'logit_bias' must be an object mapping token ids to a bias, got %s.",
                        json_type_name(lb));
    size_t n = json_object_size(lb);
    if (n > PRISM_OAI_MAX_LOGIT_BIAS)
        return oai_fail(err, "logit_bias", "'logit_bias' may have at most %d entries, got %zu.", PRISM_OAI_MAX_LOGIT_BIAS, n);
    const char *k;
    json_t *v;
    json_object_foreach(lb, k, v) {
        char *end = NULL;
        long long id = strtoll(k, &end, 10);
        if (!*k || *end || id < 0 || id > INT32_MAX || (k[0] == '0' && k[1]) || k[0] == '+' || k[0] == ' ')
            return oai_fail(err, "logit_bias", "'logit_bias' keys must be token ids (non-negative integers), got '%.32s'.", k);
        if (vocab > 0 && id >= vocab)
            return oai_fail(err, "logit_bias", "Token id %lld in 'logit_bias' is out of vocabulary (%d tokens).", id, vocab);
        if (!json_is_number(v))
            return oai_fail(err, "logit_bias", "'logit_bias' values must be numbers, got %s for token %lld.",
                            json_type_name(v), id);
        double b = json_number_value(v);
        if (!(b >= -100 && b <= 100))
            return oai_fail(err, "logit_bias", "'logit_bias' values must be in [-100, 100], got %g for token %lld.", b, id);
        out->logit_bias_ids[out->n_logit_bias] = (int32_t)id;
        out->logit_bias_values[out->n_logit_bias] = (float)b;
        out->n_logit_bias++;
    }
    return PRISM_OK;
}

static int parse_stream(json_t *root, prism_oai_request_t *out, prism_oai_error_t *err)
{
    int rc;
    if ((rc = get_bool(root, "stream", &out->stream, err))) return rc;
    json_t *so = field(root, "stream_options");
    if (!so) return PRISM_OK;
    if (!out->stream) return oai_fail(err, "stream_options", "Stream options can only be defined when `stream=True`.");
    if (!json_is_object(so))
        return oai_fail(err, "stream_options", "'stream_options' must be an object, got %s.", json_type_name(so));
    if ((rc = get_bool(so, "include_usage", &out->include_usage, err))) return rc;
    bool continuous = false;
    if ((rc = get_bool(so, "continuous_usage_stats", &continuous, err))) return rc;
    if (continuous)
        return oai_fail(err, "stream_options.continuous_usage_stats",
                        "'stream_options.continuous_usage_stats' is not supported by this server; usage comes "
                        "in the last chunk (include_usage).");
    return PRISM_OK;
}

static int parse_max_tokens(json_t *root, bool chat, prism_oai_request_t *out, prism_oai_error_t *err)
{
    int rc;
    bool present;
    int64_t iv, mt = -1;
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
    return PRISM_OK;
}

/* temperature, top_p, top_k, the penalties, seed, priority. The workers take them as 32-bit floats: a
 * double past FLT_MAX (temperature 1e308) is infinite there and refused with a 500, so it is a
 * client error here. */
static int parse_sampler(json_t *root, prism_oai_request_t *out, prism_oai_error_t *err)
{
    int rc;
    bool present;
    int64_t iv;
    if ((rc = get_number(root, "temperature", &out->temperature, NULL, err))) return rc;
    if (out->temperature < 0)
        return oai_fail(err, "temperature", "temperature must be non-negative, got %g.", out->temperature);
    if (out->temperature > FLT_MAX)
        return oai_fail(err, "temperature", "temperature must be at most %g, got %g.", (double)FLT_MAX, out->temperature);
    if ((rc = get_number(root, "top_p", &out->top_p, NULL, err))) return rc;
    if (!(out->top_p >= 0 && out->top_p <= 1)) return oai_fail(err, "top_p", "top_p must be in [0, 1], got %g.", out->top_p);
    /* top_p 0 keeps only the most likely token (OpenAI treats it as greedy) */
    out->greedy = out->top_p == 0 || out->temperature == 0;
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
    if (!(out->repetition_penalty > 0 && out->repetition_penalty <= FLT_MAX))
        return oai_fail(err, "repetition_penalty", "repetition_penalty must be greater than zero and at most %g, got %g.",
                        (double)FLT_MAX, out->repetition_penalty);
    if ((rc = get_int(root, "seed", &out->seed, &out->has_seed, err))) return rc;
    if ((rc = get_int(root, "priority", &iv, &present, err))) return rc;
    if (present) {
        if (iv < -1000000 || iv > 1000000)
            return oai_fail(err, "priority", "priority must be in [-1000000, 1000000], got %lld.", (long long)iv);
        out->priority = (int32_t)iv;
    }
    /* vLLM's cache_salt: only requests with the same salt share cached prefix KV (docs/SECURITY.md) */
    json_t *salt = json_object_get(root, "cache_salt");
    if (salt && !json_is_null(salt)) {
        if (!json_is_string(salt)) return oai_fail(err, "cache_salt", "cache_salt must be a string.");
        size_t len = json_string_length(salt);
        if (len == 0 || len > PRISM_OAI_MAX_CACHE_SALT)
            return oai_fail(err, "cache_salt", "cache_salt must be 1 to %d bytes, got %zu.", PRISM_OAI_MAX_CACHE_SALT, len);
        if (strlen(json_string_value(salt)) != len)   /* travels as a C string: "a\u0000b" would be "a" */
            return oai_fail(err, "cache_salt", "cache_salt must not contain U+0000.");
        memcpy(out->cache_salt, json_string_value(salt), len);
        out->cache_salt[len] = 0;
    }
    return PRISM_OK;
}

static int parse_choices_logprobs(json_t *root, bool chat, prism_oai_request_t *out, prism_oai_error_t *err)
{
    int rc;
    bool present;
    int64_t iv;
    if ((rc = get_int(root, "n", &iv, &present, err))) return rc;
    if (present) {
        if (iv < 1 || iv > PRISM_OAI_MAX_N)
            return oai_fail(err, "n", "n must be between 1 and %d, got %lld.", PRISM_OAI_MAX_N, (long long)iv);
        out->n = (int)iv;
    }
    if (!chat) {
        /* best_of > n would rank candidates by likelihood: not implemented (vLLM's V1 engine
         * dropped it too); best_of == n is plain n. */
        if ((rc = get_int(root, "best_of", &iv, &present, err))) return rc;
        if (present && iv != out->n)
            return oai_fail(err, "best_of", "best_of must equal n (%d) on this server, got %lld: ranking candidates "
                            "is not supported.", out->n, (long long)iv);
        if ((rc = get_int(root, "logprobs", &iv, &present, err))) return rc;
        if (!present) return PRISM_OK;
        if (iv < 0) return oai_fail(err, "logprobs", "`logprobs` must be a positive value.");
        if (iv > PRISM_OAI_MAX_TOP_LOGPROBS)
            return oai_fail(err, "logprobs", "logprobs must be at most %d, got %lld.", PRISM_OAI_MAX_TOP_LOGPROBS,
                            (long long)iv);
        out->logprobs = true;
        out->top_logprobs = (int)iv;
        return PRISM_OK;
    }
    if ((rc = get_bool(root, "logprobs", &out->logprobs, err))) return rc;
    if ((rc = get_int(root, "top_logprobs", &iv, &present, err))) return rc;
    if (!present) return PRISM_OK;
    if (iv < 0) return oai_fail(err, "top_logprobs", "`top_logprobs` must be a positive value.");
    if (iv > PRISM_OAI_MAX_TOP_LOGPROBS)
        return oai_fail(err, "top_logprobs", "top_logprobs must be at most %d, got %lld.", PRISM_OAI_MAX_TOP_LOGPROBS,
                        (long long)iv);
    if (iv > 0 && !out->logprobs)
        return oai_fail(err, "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.");
    out->top_logprobs = (int)iv;
    return PRISM_OK;
}

/* chat_template_kwargs: more variables for the chat template. Its keys may not be the ones the
 * router sets from what it validated (a "messages" there rendered roles the parser refuses and
 * slipped past the message bound; bos_token could forge special tokens). */
static const char *const k_template_reserved[] = {"messages", "tools", "documents", "add_generation_prompt",
                                                  "bos_token", "eos_token"};

static int parse_template_kwargs(json_t *root, prism_oai_error_t *err)
{
    json_t *kw = field(root, "chat_template_kwargs");
    if (!kw) return PRISM_OK;
    if (!json_is_object(kw))
        return oai_fail(err, "chat_template_kwargs", "'chat_template_kwargs' must be an object, got %s.",
                        json_type_name(kw));
    const char *k;
    json_t *v;
    json_object_foreach(kw, k, v) {
        for (size_t i = 0; i < PRISM_ARRAY_LEN(k_template_reserved); i++) {
            if (strcmp(k, k_template_reserved[i])) continue;
            char param[64];
            snprintf(param, sizeof param, "chat_template_kwargs.%s", k);
            return oai_fail(err, param, "'%s' is set by the server from the request and cannot be passed in "
                            "chat_template_kwargs.", k);
        }
    }
    return PRISM_OK;
}

/* mm_processor_kwargs (vLLM's): the image processor's min_pixels / max_pixels for this request's
 * images (Qwen-VL); any other key is refused rather than silently not applied. Whether the model has
 * such a processor and the values fit it, the router checks (router_prompt). */
static int parse_mm_kwargs(json_t *root, prism_oai_request_t *out, prism_oai_error_t *err)
{
    json_t *kw = field(root, "mm_processor_kwargs");
    if (!kw) return PRISM_OK;
    if (!json_is_object(kw))
        return oai_fail(err, "mm_processor_kwargs", "'mm_processor_kwargs' must be an object, got %s.",
                        json_type_name(kw));
    const char *k;
    json_t *v;
    json_object_foreach(kw, k, v) {
        char param[64];
        snprintf(param, sizeof param, "mm_processor_kwargs.%.40s", k);
        int64_t *at = !strcmp(k, "min_pixels") ? &out->mm_min_pixels : !strcmp(k, "max_pixels") ? &out->mm_max_pixels
                                                                                                  : NULL;
        if (!at) return oai_fail(err, param, "'%.40s' is not supported in mm_processor_kwargs (min_pixels and "
                                 "max_pixels are).", k);
        if (json_is_null(v)) continue;
        int64_t iv;
        if (!as_int64(v, &iv) || iv < 1 || iv > PRISM_OAI_MAX_MM_PIXELS)   /* 0: transformers refuses it too */
            return oai_fail(err, param, "'%s' must be an integer in [1, %lld].", param,
                            (long long)PRISM_OAI_MAX_MM_PIXELS);
        *at = iv;
    }
    if (out->mm_min_pixels >= 0 && out->mm_max_pixels >= 0 && out->mm_min_pixels > out->mm_max_pixels)
        return oai_fail(err, "mm_processor_kwargs.min_pixels", "min_pixels (%lld) must not exceed max_pixels (%lld).",
                        (long long)out->mm_min_pixels, (long long)out->mm_max_pixels);
    return PRISM_OK;
}

static int parse_sampling(json_t *root, bool chat, int vocab, prism_oai_request_t *out, prism_oai_error_t *err)
{
    int rc;
    if ((rc = parse_stream(root, out, err)) || (rc = parse_max_tokens(root, chat, out, err)) ||
        (rc = parse_sampler(root, out, err)) || (rc = parse_choices_logprobs(root, chat, out, err)) ||
        (rc = parse_logit_bias(root, out, vocab, err)))
        return rc;
    if ((rc = get_bool(root, "ignore_eos", &out->ignore_eos, err))) return rc;
    if ((rc = get_bool(root, "add_special_tokens", &out->add_special_tokens, err))) return rc;
    if ((rc = get_bool(root, "skip_special_tokens", &out->skip_special_tokens, err))) return rc;
    if ((rc = get_bool(root, "return_tokens_as_token_ids", &out->return_tokens_as_token_ids, err))) return rc;
    if (chat && (rc = get_bool(root, "add_generation_prompt", &out->add_generation_prompt, err))) return rc;
    if (chat && (rc = parse_template_kwargs(root, err))) return rc;
    if ((rc = parse_mm_kwargs(root, out, err))) return rc;
    return parse_stop(root, vocab, out, err);
}

/* ------------------------------------------------------------------ output constraints */

static int set_guide(prism_oai_request_t *out, int kind, const char *text, size_t len, char *owned, const char *param,
                     prism_oai_error_t *err)
{
    if (out->guide_kind) {
        prism_free(owned);
        return oai_fail(err, param, "Only one of response_format (json_object / json_schema), guided_json, "
                        "guided_regex and guided_choice may be given; got %s and %s.", out->guide_param, param);
    }
    out->guide_kind = kind;
    out->guide_text = text ? text : "";
    out->guide_len = text ? len : 0;
    out->guide_owned = owned;
    out->guide_param = param;
    return PRISM_OK;
}

/* Compact JSON text of v in a prism_malloc'd string (whatever allocator jansson was given). */
static char *dump_json(json_t *v, size_t *len)
{
    size_t n = json_dumpb(v, NULL, 0, JSON_COMPACT | JSON_ENCODE_ANY);
    char *s = n ? prism_malloc(n + 1) : NULL;
    if (!s) return NULL;
    json_dumpb(v, s, n, JSON_COMPACT | JSON_ENCODE_ANY);
    s[n] = 0;
    if (len) *len = n;
    return s;
}

static int guide_json_text(json_t *v, char **owned, const char **text, size_t *len)
{
    *owned = dump_json(v, len);
    if (!*owned) return PRISM_ENOMEM;
    *text = *owned;
    return PRISM_OK;
}

static int oom(prism_oai_error_t *err)
{
    oai_fail(err, NULL, "Out of memory.");
    if (err) err->status = 500;
    return PRISM_ENOMEM;
}

static int parse_guides(json_t *root, prism_oai_request_t *out, prism_oai_error_t *err)
{
    int rc;
    char *owned;
    const char *text;
    size_t len;
    json_t *rf = field(root, "response_format");
    if (rf) {
        json_t *type = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
        if (!json_is_string(type))
            return oai_fail(err, "response_format", "'response_format' must be an object with a string 'type' "
                            "(text, json_object or json_schema).");
        const char *t = json_string_value(type);
        if (!strcmp(t, "json_object")) {
            if ((rc = set_guide(out, PRISM_GUIDE_JSON_OBJECT, NULL, 0, NULL, "response_format", err))) return rc;
        } else if (!strcmp(t, "json_schema")) {
            json_t *js = json_object_get(rf, "json_schema");
            if (!json_is_object(js))
                return oai_fail(err, "response_format.json_schema", "'response_format.json_schema' must be an object "
                                "with 'name' and 'schema'.");
            json_t *name = json_object_get(js, "name"), *schema = field(js, "schema"), *strict = field(js, "strict");
            if (!json_is_string(name) || json_string_length(name) == 0 || json_string_length(name) > 64)
                return oai_fail(err, "response_format.json_schema.name",
                                "'response_format.json_schema.name' must be a string of 1 to 64 characters.");
            if (strict && !json_is_boolean(strict))
                return oai_fail(err, "response_format.json_schema.strict",
                                "'response_format.json_schema.strict' must be a boolean.");
            if (schema && !json_is_object(schema))
                return oai_fail(err, "response_format.json_schema.schema",
                                "'response_format.json_schema.schema' must be a JSON Schema object, got %s.",
                                json_type_name(schema));
            /* no schema: any JSON value. strict or not, the schema is enforced (as strict mode). */
            if (schema) {
                if (guide_json_text(schema, &owned, &text, &len)) return oom(err);
            } else {
                owned = prism_strdup("{}");
                if (!owned) return oom(err);
                text = owned;
                len = 2;
            }
            if ((rc = set_guide(out, PRISM_GUIDE_JSON_SCHEMA, text, len, owned, "response_format.json_schema.schema", err)))
                return rc;
        } else if (strcmp(t, "text")) {
            return oai_fail(err, "response_format.type", "Unsupported response_format type '%.64s'; expected text, "
                            "json_object or json_schema.", t);
        }
    }
    json_t *gj = field(root, "guided_json");
    if (gj) {
        if (json_is_string(gj)) {
            if (strlen(json_string_value(gj)) != json_string_length(gj))
                return oai_fail(err, "guided_json", "'guided_json' must not contain NUL characters.");
            owned = prism_strdup(json_string_value(gj));
            if (!owned) return oom(err);
            text = owned;
            len = json_string_length(gj);
        } else if (json_is_object(gj)) {
            if (guide_json_text(gj, &owned, &text, &len)) return oom(err);
        } else {
            return oai_fail(err, "guided_json", "'guided_json' must be a JSON Schema (object or string), got %s.",
                            json_type_name(gj));
        }
        if ((rc = set_guide(out, PRISM_GUIDE_JSON_SCHEMA, text, len, owned, "guided_json", err))) return rc;
    }
    json_t *gr = field(root, "guided_regex");
    if (gr) {
        if (!json_is_string(gr) || json_string_length(gr) == 0)
            return oai_fail(err, "guided_regex", "'guided_regex' must be a non-empty string.");
        if (strlen(json_string_value(gr)) != json_string_length(gr))
            return oai_fail(err, "guided_regex", "'guided_regex' must not contain NUL characters.");
        if ((rc = set_guide(out, PRISM_GUIDE_REGEX, json_string_value(gr), json_string_length(gr), NULL,
                            "guided_regex", err)))
            return rc;
    }
    json_t *gc = field(root, "guided_choice");
    if (gc) {
        size_t n = json_is_array(gc) ? json_array_size(gc) : 0;
        if (n == 0 || n > PRISM_OAI_MAX_CHOICES)
            return oai_fail(err, "guided_choice", "'guided_choice' must be a list of 1 to %d strings.", PRISM_OAI_MAX_CHOICES);
        for (size_t i = 0; i < n; i++)
            if (!json_is_string(json_array_get(gc, i)))
                return oai_fail(err, "guided_choice", "'guided_choice' must contain only strings (item %zu is %s).", i,
                                json_type_name(json_array_get(gc, i)));
        if (guide_json_text(gc, &owned, &text, &len)) return oom(err);
        if ((rc = set_guide(out, PRISM_GUIDE_CHOICE, text, len, owned, "guided_choice", err))) return rc;
    }
    return PRISM_OK;
}

static bool valid_function_name(const char *s, size_t n)
{
    if (n == 0 || n > 64) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return false;
    }
    return true;
}

static int parse_tools(json_t *root, prism_oai_request_t *out, prism_oai_error_t *err)
{
    int rc;
    char param[96];
    json_t *tools = field(root, "tools");
    if (tools) {
        if (!json_is_array(tools)) return oai_fail(err, "tools", "'tools' must be a list, got %s.", json_type_name(tools));
        size_t n = json_array_size(tools);
        if (n > PRISM_OAI_MAX_TOOLS)
            return oai_fail(err, "tools", "'tools' may have at most %d entries, got %zu.", PRISM_OAI_MAX_TOOLS, n);
        for (size_t i = 0; i < n; i++) {
            json_t *t = json_array_get(tools, i);
            snprintf(param, sizeof param, "tools[%zu]", i);
            if (!json_is_object(t)) return oai_fail(err, param, "%s must be an object.", param);
            json_t *type = json_object_get(t, "type");
            snprintf(param, sizeof param, "tools[%zu].type", i);
            if (!json_is_string(type) || strcmp(json_string_value(type), "function"))
                return oai_fail(err, param, "%s must be \"function\"%s.", param,
                                json_is_string(type) ? " (custom tools are not supported by this server)" : "");
            json_t *fn = json_object_get(t, "function");
            snprintf(param, sizeof param, "tools[%zu].function", i);
            if (!json_is_object(fn)) return oai_fail(err, param, "%s must be an object.", param);
            json_t *name = json_object_get(fn, "name");
            snprintf(param, sizeof param, "tools[%zu].function.name", i);
            if (!json_is_string(name) || !valid_function_name(json_string_value(name), json_string_length(name)))
                return oai_fail(err, param, "%s must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'.", param);
            json_t *params = field(fn, "parameters");
            snprintf(param, sizeof param, "tools[%zu].function.parameters", i);
            if (params && !json_is_object(params))
                return oai_fail(err, param, "%s must be a JSON Schema object, got %s.", param, json_type_name(params));
            json_t *strict = field(fn, "strict");
            snprintf(param, sizeof param, "tools[%zu].function.strict", i);
            if (strict && !json_is_boolean(strict)) return oai_fail(err, param, "%s must be a boolean.", param);
        }
        if (n) {
            out->tools = tools;
            out->n_tools = (int)n;
            size_t len = 0;
            out->tools_text = dump_json(tools, &len);
            if (!out->tools_text) return oom(err);
            if (len > PRISM_OAI_MAX_TOOLS_BYTES)
                return oai_fail(err, "tools", "'tools' is %zu bytes of JSON; the limit is %u.", len, PRISM_OAI_MAX_TOOLS_BYTES);
        }
    }
    if ((rc = get_bool(root, "parallel_tool_calls", &out->parallel_tool_calls, err))) return rc;
    json_t *tc = field(root, "tool_choice");
    out->tool_choice = out->n_tools ? PRISM_OAI_TOOL_AUTO : PRISM_OAI_TOOL_NONE;
    if (tc) {
        if (json_is_string(tc)) {
            const char *c = json_string_value(tc);
            if (!strcmp(c, "none")) out->tool_choice = PRISM_OAI_TOOL_NONE;
            else if (!strcmp(c, "auto")) out->tool_choice = out->n_tools ? PRISM_OAI_TOOL_AUTO : PRISM_OAI_TOOL_NONE;
            else if (!strcmp(c, "required")) out->tool_choice = PRISM_OAI_TOOL_REQUIRED;
            else return oai_fail(err, "tool_choice", "'tool_choice' must be none, auto, required or a function, got '%.64s'.", c);
        } else if (json_is_object(tc)) {
            json_t *type = json_object_get(tc, "type"), *fn = json_object_get(tc, "function");
            json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
            if (!json_is_string(type) || strcmp(json_string_value(type), "function") || !json_is_string(name))
                return oai_fail(err, "tool_choice", "'tool_choice' must be none, auto, required or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}} (allowed_tools and custom "
                                "tools are not supported by this server).");
            out->tool_choice = PRISM_OAI_TOOL_NAMED;
            out->tool_name = json_string_value(name);
            bool found = false;
            for (int i = 0; i < out->n_tools && !found; i++) {
                json_t *nm = json_object_get(json_object_get(json_array_get(out->tools, (size_t)i), "function"), "name");
                found = !strcmp(json_string_value(nm), out->tool_name);
            }
            if (!found)
                return oai_fail(err, "tool_choice", "tool_choice names the function '%.64s', which is not in 'tools'.",
                                out->tool_name);
        } else {
            return oai_fail(err, "tool_choice", "'tool_choice' must be a string or an object, got %s.", json_type_name(tc));
        }
    }
    if (out->tool_choice == PRISM_OAI_TOOL_REQUIRED && !out->n_tools)
        return oai_fail(err, "tool_choice", "tool_choice \"required\" needs at least one tool in 'tools'.");
    if (out->tool_choice != PRISM_OAI_TOOL_NONE && out->guide_kind)
        return oai_fail(err, "tool_choice", "%s cannot be combined with tool calling; set tool_choice to \"none\" "
                        "or leave the output constraint out.", out->guide_param);
    return PRISM_OK;
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
    out->mm_min_pixels = out->mm_max_pixels = -1;
    out->repetition_penalty = 1.0;
    out->n = 1;
    out->add_generation_prompt = true;
    out->add_special_tokens = !chat;
    out->skip_special_tokens = true;
    out->parallel_tool_calls = true;

    int rc;
    /* bounded before jansson builds anything (nesting, and what the tree would cost) */
    if ((rc = prism_oai_scan(body ? body : "", len, chat ? PRISM_OAI_SCAN_CHAT : PRISM_OAI_SCAN_COMPLETIONS, &o,
                             &out->parse_bytes, err)))
        return rc;
    json_error_t je;
    json_t *root = json_loadb(body ? body : "", len, JSON_ALLOW_NUL, &je);
    if (!root) return oai_fail(err, NULL, "Invalid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    out->root = root;
    if (!json_is_object(root)) {
        rc = oai_fail(err, NULL, "The request body must be a JSON object, got %s.", json_type_name(root));
        goto fail;
    }
    json_t *model = field(root, "model");
    if (model && !json_is_string(model)) {
        rc = oai_fail(err, "model", "'model' must be a string, got %s.", json_type_name(model));
        goto fail;
    }
    out->model = model ? json_string_value(model) : NULL;
    if ((rc = check_fields(root, chat, err))) goto fail;

    rc = chat ? parse_messages(root, out, &o, err) : parse_prompt(root, out, &o, err);
    if (rc) goto fail;
    rc = parse_sampling(root, chat, o.vocab, out, err);
    if (rc) goto fail;
    rc = parse_guides(root, out, err);
    if (rc) goto fail;
    if (chat && (rc = parse_tools(root, out, err))) goto fail;
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
    prism_free(r->guide_owned);
    prism_free(r->tools_text);
    if (r->root) json_decref(r->root);
    bool chat = r->chat;
    memset(r, 0, sizeof *r);
    r->chat = chat;
}
