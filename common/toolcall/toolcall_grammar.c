/* Grammars that force tool calls in a parser's format (tool_choice "required" or a named
 * function), built from the request's "tools" with the grammar builder. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "toolcall/toolcall.h"

/* json_dumps output goes back to the allocator jansson was given (prism_free in the router). */
static void json_text_free(void *p)
{
    json_free_t f = NULL;
    json_get_alloc_funcs(NULL, &f);
    if (p) (f ? f : free)(p);
}

#define TC_MAX_TOOLS 128

static int32_t lit(prism_grammar_builder_t *b, const char *s) { return prism_gexpr_literal(b, s, strlen(s)); }

static int32_t fail(prism_grammar_builder_t *b, int code, const char *path, const char *msg)
{
    return prism_grammar_builder_fail(b, code, path, "%s", msg);
}

/* A sub-schema compiled on its own keeps the root's definitions so its $refs resolve. */
static char *sub_schema_text(json_t *root, json_t *sub)
{
    json_t *c = json_deep_copy(sub);
    if (!c) return NULL;
    if (json_is_object(c)) {
        static const char *const DEFS[] = { "$defs", "definitions" };
        for (int i = 0; i < 2; i++) {
            json_t *d = json_object_get(root, DEFS[i]);
            if (d && !json_object_get(c, DEFS[i])) json_object_set(c, DEFS[i], d);
        }
    }
    char *s = json_dumps(c, JSON_COMPACT | JSON_ENCODE_ANY);
    json_decref(c);
    return s;
}

/* name(k=v, ...) for a function whose parameters are an object schema. */
static int32_t pythonic_call(prism_grammar_builder_t *b, const char *name, json_t *params, const char *path)
{
    prism_grammar_json_opts_t py = { .pythonic = true };
    char p[256];
    json_t *props = params ? json_object_get(params, "properties") : NULL;
    json_t *req = params ? json_object_get(params, "required") : NULL;
    if (params && !json_is_object(params)) return fail(b, PRISM_EINVAL, path, "parameters must be a JSON Schema object");
    if (props && !json_is_object(props)) return fail(b, PRISM_EINVAL, path, "'properties' must be an object");
    /* extra keyword arguments (additionalProperties) are never produced: the declared ones are */
    size_t np = props ? json_object_size(props) : 0;
    if (np > 64) return fail(b, PRISM_ELIMIT, path, "more than 64 parameters");
    int32_t kv[64];
    bool required[64] = { false };
    size_t i = 0, first_req = np;
    const char *k;
    json_t *v;
    json_object_foreach(props, k, v) {
        for (size_t r = 0; req && r < json_array_size(req); r++)
            if (json_is_string(json_array_get(req, r)) && !strcmp(json_string_value(json_array_get(req, r)), k))
                required[i] = true;
        if (required[i] && first_req == np) first_req = i;
        bool ident = (k[0] >= 'a' && k[0] <= 'z') || (k[0] >= 'A' && k[0] <= 'Z') || k[0] == '_';
        for (const char *c = k; *c && ident; c++)
            ident = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '_';
        snprintf(p, sizeof p, "%s.properties.%s", path, k);
        if (!ident) return fail(b, PRISM_EINVAL, p, "a pythonic tool call needs parameter names that are identifiers");
        char *txt = sub_schema_text(params, v);
        if (!txt) return fail(b, PRISM_ENOMEM, p, "out of memory");
        int32_t val = prism_gexpr_json_schema(b, txt, strlen(txt), &py, p);
        json_text_free(txt);
        char key[300];
        snprintf(key, sizeof key, "%s=", k);
        int32_t parts[2] = { prism_gexpr_literal(b, key, strlen(key)), val };
        kv[i++] = prism_gexpr_shared(b, prism_gexpr_seq(b, parts, 2));
    }
    /* as JSON objects: the first given argument is some j0 (all before it optional), later
     * ones follow ", " and are optional unless required */
    int32_t alts[66];
    size_t na = 0;
    int32_t sep = prism_gexpr_literal(b, ", ", 2);
    for (size_t j0 = 0; j0 < np && j0 <= first_req; j0++) {
        int32_t chain[65];
        size_t nc = 0;
        chain[nc++] = kv[j0];
        for (size_t x = j0 + 1; x < np; x++) {
            int32_t two[2] = { sep, kv[x] };
            int32_t s = prism_gexpr_seq(b, two, 2);
            chain[nc++] = required[x] ? s : prism_gexpr_repeat(b, s, 0, 1);
        }
        alts[na++] = prism_gexpr_seq(b, chain, nc);
    }
    int32_t args = na ? prism_gexpr_alt(b, alts, na) : prism_gexpr_literal(b, "", 0);
    if (first_req == np && na) args = prism_gexpr_repeat(b, args, 0, 1);
    char head[300];
    snprintf(head, sizeof head, "%s(", name);
    int32_t parts[3] = { prism_gexpr_literal(b, head, strlen(head)), args, prism_gexpr_literal(b, ")", 1) };
    return prism_gexpr_seq(b, parts, 3);
}

static int32_t hermes_call(prism_grammar_builder_t *b, const char *name, json_t *params, const char *path)
{
    int32_t args;
    if (params) {
        char *txt = sub_schema_text(params, params);
        if (!txt) return fail(b, PRISM_ENOMEM, path, "out of memory");
        args = prism_gexpr_json_schema(b, txt, strlen(txt), NULL, path);
        json_text_free(txt);
    } else {
        args = prism_gexpr_literal(b, "{}", 2);
    }
    int32_t parts[5] = {
        lit(b, "<tool_call>\n{\"name\": "),
        prism_gexpr_json_string_literal(b, name, strlen(name)),
        lit(b, ", \"arguments\": "),
        args,
        lit(b, "}\n</tool_call>"),
    };
    return prism_gexpr_seq(b, parts, 5);
}

int prism_toolcall_grammar(prism_toolcall_format_t fmt, const prism_grammar_vocab_t *v, const char *tools_json,
                           size_t len, const char *only_name, bool parallel, const prism_grammar_limits_t *limits,
                           prism_grammar_t **out, prism_grammar_error_t *err)
{
    *out = NULL;
    prism_grammar_builder_t *b = prism_grammar_builder_create(limits);
    if (!b) return PRISM_ENOMEM;
    json_error_t je;
    json_t *tools = json_loadb(tools_json, len, 0, &je);
    int32_t calls[TC_MAX_TOOLS];
    size_t nc = 0;
    char path[96];
    if (!tools || !json_is_array(tools) || json_array_size(tools) == 0) {
        fail(b, PRISM_EINVAL, "tools", "tools must be a non-empty array");
    } else if (json_array_size(tools) > TC_MAX_TOOLS) {
        fail(b, PRISM_ELIMIT, "tools", "more than 128 tools");
    } else {
        for (size_t i = 0; i < json_array_size(tools); i++) {
            json_t *t = json_array_get(tools, i), *f = json_object_get(t, "function");
            json_t *ty = json_object_get(t, "type");
            snprintf(path, sizeof path, "tools[%zu]", i);
            if (!json_is_object(t) || (ty && (!json_is_string(ty) || strcmp(json_string_value(ty), "function")))) {
                fail(b, PRISM_EINVAL, path, "each tool must be {\"type\": \"function\", \"function\": {...}}");
                break;
            }
            json_t *nm = json_object_get(f, "name");
            snprintf(path, sizeof path, "tools[%zu].function.name", i);
            if (!json_is_string(nm) || json_string_length(nm) == 0 || json_string_length(nm) > 64) {
                fail(b, PRISM_EINVAL, path, "function name must be a string of 1 to 64 characters");
                break;
            }
            const char *name = json_string_value(nm);
            if (only_name && strcmp(only_name, name)) continue;
            json_t *params = json_object_get(f, "parameters");
            snprintf(path, sizeof path, "tools[%zu].function.parameters", i);
            calls[nc++] = fmt == PRISM_TOOLCALL_HERMES ? hermes_call(b, name, params, path)
                                                       : pythonic_call(b, name, params, path);
        }
        if (nc == 0 && only_name)
            prism_grammar_builder_fail(b, PRISM_EINVAL, "tool_choice.function.name",
                                       "tool_choice names function '%.64s', which is not in tools", only_name);
    }
    int32_t root = -1;
    if (nc) {
        int32_t one = prism_gexpr_shared(b, prism_gexpr_alt(b, calls, nc));
        if (fmt == PRISM_TOOLCALL_HERMES) {
            int32_t more[2] = { prism_gexpr_literal(b, "\n", 1), one };
            int32_t seq[2] = { one, prism_gexpr_repeat(b, prism_gexpr_seq(b, more, 2), 0, -1) };
            root = parallel ? prism_gexpr_seq(b, seq, 2) : one;
        } else {
            int32_t more[2] = { prism_gexpr_literal(b, ", ", 2), one };
            int32_t list[3] = { prism_gexpr_literal(b, "[", 1), one, prism_gexpr_literal(b, "]", 1) };
            if (parallel) {
                int32_t inner[2] = { one, prism_gexpr_repeat(b, prism_gexpr_seq(b, more, 2), 0, -1) };
                list[1] = prism_gexpr_seq(b, inner, 2);
            }
            root = prism_gexpr_seq(b, list, 3);
        }
    }
    json_decref(tools);
    int rc = prism_grammar_builder_finish(b, root < 0 ? 0 : root, v, out, err);
    prism_grammar_builder_free(b);
    return rc;
}
