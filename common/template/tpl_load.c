/* Compile entry point, loaders (tokenizer_config.json, .jinja files) and the transformers-style
 * chat context builder. */
#include "template/tpl_internal.h"

#include <stdio.h>
#include <string.h>

int prism_template_compile(const char *source, size_t len, prism_template_t **out, char *err, size_t errlen)
{
    if (err && errlen) err[0] = 0;
    if (!out || (!source && len)) return PRISM_EINVAL;
    *out = NULL;
    if (len > PRISM_TEMPLATE_MAX_SOURCE) {
        if (err && errlen) snprintf(err, errlen, "template is %zu bytes, over the %u byte limit", len, PRISM_TEMPLATE_MAX_SOURCE);
        return PRISM_ELIMIT;
    }
    if (len && !prism_utf8_valid(source, len)) {   /* jinja2 works on Python str: never invalid */
        if (err && errlen) snprintf(err, errlen, "template is not valid UTF-8");
        return PRISM_EINVAL;
    }
    int rc;
    prism_template_t *t = prism_calloc(1, sizeof(*t));
    if (!t) return PRISM_ENOMEM;
    tpl_pool_init(&t->pool, 0);
    t->source = tpl_pool_strndup(&t->pool, source ? source : "", len);
    char *norm = tpl_pool_alloc(&t->pool, len + 1);
    if (!t->source || !norm) { rc = PRISM_ENOMEM; goto fail; }
    t->source_len = len;
    /* jinja2 normalizes \r\n and \r to \n and drops one trailing newline (keep_trailing_newline=False) */
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (source[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && source[i + 1] == '\n') i++;
        } else {
            norm[n++] = source[i];
        }
    }
    if (n && norm[n - 1] == '\n') n--;
    norm[n] = 0;
    tpl_tokens_t toks;
    rc = tpl_lex(&t->pool, norm, n, &toks, err, errlen);
    if (rc) goto fail;
    rc = tpl_parse(t, &toks, err, errlen);
    if (rc) goto fail;
    *out = t;
    return 0;
fail:
    if (err && errlen && !err[0]) snprintf(err, errlen, "%s", prism_strerror(rc));
    tpl_pool_free(&t->pool);
    prism_free(t);
    return rc;
}

void prism_template_free(prism_template_t *t)
{
    if (!t) return;
    tpl_pool_free(&t->pool);
    prism_free(t);
}

const char *prism_template_source(const prism_template_t *t, size_t *len)
{
    if (len) *len = t ? t->source_len : 0;
    return t ? t->source : NULL;
}

/* ------------------------------------------------------------------ chat context */

static const char *const reasoning_keys[] = {"reasoning_content", "thinking", "reasoning"};

json_t *prism_template_chat_context(const json_t *messages, const json_t *tools, bool add_generation_prompt,
                                    const char *bos_token, const char *eos_token, const json_t *extra)
{
    if (!json_is_array(messages)) return NULL;
    json_t *ctx = json_object(), *msgs = json_array();
    if (!ctx || !msgs) goto fail;
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        if (!json_is_object(m)) goto fail;
        json_t *nm = json_object();
        if (!nm || json_array_append_new(msgs, nm)) goto fail;
        /* transformers drops null-valued keys, then copies the first reasoning field to "thinking"
         * (first key) and "reasoning_content" */
        json_t *reasoning = NULL;
        for (size_t k = 0; k < PRISM_ARRAY_LEN(reasoning_keys) && !reasoning; k++) {
            json_t *r = json_object_get(m, reasoning_keys[k]);
            if (r && !json_is_null(r)) reasoning = r;
        }
        if (reasoning && json_object_set_new(nm, "thinking", json_deep_copy(reasoning))) goto fail;
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)m, key, val) {
            if (json_is_null(val)) continue;
            if (json_object_set_new(nm, key, json_deep_copy(val))) goto fail;
        }
        if (reasoning && json_object_set_new(nm, "reasoning_content", json_deep_copy(reasoning))) goto fail;
    }
    if (json_object_set_new(ctx, "messages", msgs)) { msgs = NULL; goto fail; }
    msgs = NULL;
    if (json_object_set_new(ctx, "tools", tools ? json_deep_copy(tools) : json_null()) ||
        json_object_set_new(ctx, "documents", json_null()) ||
        json_object_set_new(ctx, "add_generation_prompt", json_boolean(add_generation_prompt)))
        goto fail;
    if (bos_token && json_object_set_new(ctx, "bos_token", json_string(bos_token))) goto fail;
    if (eos_token && json_object_set_new(ctx, "eos_token", json_string(eos_token))) goto fail;
    /* the caller's variables never replace the ones set above (the router refuses them too) */
    if (extra && json_is_object(extra) && json_object_update_missing(ctx, (json_t *)extra)) goto fail;
    return ctx;
fail:
    json_decref(msgs);
    json_decref(ctx);
    return NULL;
}

/* ------------------------------------------------------------------ loaders */

#define MAX_CONFIG_BYTES (64u << 20)

int prism_template_load_file(const char *path, prism_template_t **out, char *err, size_t errlen)
{
    char *buf = NULL;
    size_t n = 0;
    int rc = prism_read_file(path, PRISM_TEMPLATE_MAX_SOURCE, &buf, &n);
    if (rc) {
        if (err && errlen) snprintf(err, errlen, "cannot read chat template %s: %s", path, prism_strerror(rc));
        return rc;
    }
    rc = prism_template_compile(buf, n, out, err, errlen);
    prism_free(buf);
    return rc;
}

static char *token_string(const json_t *v)
{
    if (json_is_string(v)) return prism_strdup(json_string_value(v));
    if (json_is_object(v)) {
        const json_t *c = json_object_get(v, "content");
        if (json_is_string(c)) return prism_strdup(json_string_value(c));
    }
    return NULL;
}

/* chat_template as stored in tokenizer_config.json: a string or [{name, template}] */
static int pick_template(const json_t *ct, const char **src, size_t *len, char *err, size_t errlen)
{
    if (json_is_string(ct)) {
        *src = json_string_value(ct);
        *len = json_string_length(ct);
        return 0;
    }
    if (json_is_array(ct)) {
        size_t i;
        json_t *e;
        json_array_foreach(ct, i, e) {
            const json_t *name = json_object_get(e, "name"), *tpl = json_object_get(e, "template");
            if (json_is_string(name) && !strcmp(json_string_value(name), "default") && json_is_string(tpl)) {
                *src = json_string_value(tpl);
                *len = json_string_length(tpl);
                return 0;
            }
        }
        if (err && errlen) snprintf(err, errlen, "tokenizer config has several chat templates and none named \"default\"");
        return PRISM_ENOTFOUND;
    }
    if (err && errlen) snprintf(err, errlen, "chat_template must be a string or a list of {name, template}");
    return PRISM_EINVAL;
}

int prism_template_load_from_tokenizer_config(const char *path, prism_template_t **out, char **bos, char **eos,
                                              char *err, size_t errlen)
{
    if (bos) *bos = NULL;
    if (eos) *eos = NULL;
    if (out) *out = NULL;
    if (err && errlen) err[0] = 0;
    char *buf = NULL, *side = NULL;
    size_t n = 0;
    json_t *root = NULL, *side_root = NULL;
    int rc = prism_read_file(path, MAX_CONFIG_BYTES, &buf, &n);
    if (rc) {
        if (err && errlen) snprintf(err, errlen, "cannot read %s: %s", path, prism_strerror(rc));
        return rc;
    }
    json_error_t jerr;
    /* configs carry integers beyond int64 (model_max_length = 1e30); only strings are read here */
    root = json_loadb(buf, n, JSON_DECODE_INT_AS_REAL, &jerr);
    if (!json_is_object(root)) {
        if (err && errlen) snprintf(err, errlen, "%s: invalid JSON: %s (line %d)", path, jerr.text, jerr.line);
        rc = PRISM_ECORRUPT;
        goto fail;
    }
    const char *src = NULL;
    size_t len = 0;
    const json_t *ct = json_object_get(root, "chat_template");
    if (ct && !json_is_null(ct)) {
        rc = pick_template(ct, &src, &len, err, errlen);
        if (rc) goto fail;
        rc = prism_template_compile(src, len, out, err, errlen);
    } else {
        /* newer checkpoints keep the template beside the config: chat_template.jinja, or a processor's
         * chat_template.json ({"chat_template": ...}) */
        char dir[4096], p2[4200];
        snprintf(dir, sizeof(dir), "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
        else snprintf(dir, sizeof(dir), ".");
        snprintf(p2, sizeof(p2), "%s/chat_template.jinja", dir);
        if (prism_file_exists(p2)) {
            rc = prism_template_load_file(p2, out, err, errlen);
        } else {
            snprintf(p2, sizeof(p2), "%s/chat_template.json", dir);
            size_t sn = 0;
            if (!prism_file_exists(p2) || prism_read_file(p2, MAX_CONFIG_BYTES, &side, &sn) ||
                !(side_root = json_loadb(side, sn, JSON_DECODE_INT_AS_REAL, &jerr)) ||
                !(ct = json_object_get(side_root, "chat_template"))) {
                if (err && errlen) snprintf(err, errlen, "%s has no chat_template", path);
                rc = PRISM_ENOTFOUND;
                goto fail;
            }
            rc = pick_template(ct, &src, &len, err, errlen);
            if (!rc) rc = prism_template_compile(src, len, out, err, errlen);
        }
    }
    if (rc) goto fail;
    if (bos) *bos = token_string(json_object_get(root, "bos_token"));
    if (eos) *eos = token_string(json_object_get(root, "eos_token"));
    json_decref(side_root);
    json_decref(root);
    prism_free(side);
    prism_free(buf);
    return 0;
fail:
    json_decref(side_root);
    json_decref(root);
    prism_free(side);
    prism_free(buf);
    return rc;
}
