/* template: a Jinja-subset interpreter for Hugging Face chat templates.
 *
 * Renders byte-identically to transformers' apply_chat_template, which uses jinja2's
 * ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols extension,
 * a {% generation %} tag, HF's tojson filter (json.dumps, ensure_ascii=False) and the globals
 * raise_exception, strftime_now, namespace, dict and range.
 *
 * Everything the interpreter does not implement is rejected by prism_template_compile with
 * PRISM_ENOTSUP and a message naming the construct and its line, so a template that compiles
 * only fails at render time where jinja2 would fail too (undefined values used in arithmetic,
 * type errors, raise_exception, sandbox violations such as list.append) or on a bound below.
 *
 * Usage:
 *     prism_template_t *t; char *bos, *eos; char err[256];
 *     if (prism_template_load_from_tokenizer_config(path, &t, &bos, &eos, err, sizeof err)) ...
 *     json_t *ctx = prism_template_chat_context(messages, tools, true, bos, eos, NULL);
 *     prism_buf_t out = {0};
 *     int rc = prism_template_render(t, ctx, &out, err, sizeof err);   // out.data: the prompt
 *     json_decref(ctx); prism_buf_free(&out); prism_template_free(t); prism_free(bos); prism_free(eos);
 *
 * Known deviations from jinja2 (none is hit by the goldens; see tests/data/template):
 *  - reprs of generators/bound methods carry no name or address ("<generator object>"); dict views
 *    (d.items()/keys()/values()) are plain lists and print as such;
 *  - escape/e return a plain string (no Markup escaping of what is later concatenated to it);
 *  - jinja2 constant-folds literal-only expressions with its own rules ((7)[1:] renders '' there, an
 *    error here; -2 ** x is folded like jinja2, but not when the exponent is a folded expression);
 *  - an unknown filter/test name fails at compile time even in a branch that never runs;
 *  - integers are 64-bit (overflow is PRISM_ELIMIT); Unicode case mapping is the 1:1 C.UTF-8 one;
 *  - str.find/startswith/endswith with start/end arguments fail at render time.
 *
 * A compiled template is immutable: several threads may render it at once.
 * strftime_now() uses the wall clock (local time) unless the context holds an integer
 * "__prism_fixed_time" or the environment variable PRISM_TEMPLATE_FIXED_TIME is set (unix seconds,
 * formatted as UTC), which tests use to get deterministic output.
 */
#ifndef PRISM_TEMPLATE_H
#define PRISM_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "core/core.h"

/* Bounds. Exceeding one is PRISM_ELIMIT. */
#define PRISM_TEMPLATE_MAX_SOURCE     (1u << 20)   /* template source bytes */
#define PRISM_TEMPLATE_MAX_OUTPUT     (16u << 20)  /* rendered bytes (and any one string value) */
#define PRISM_TEMPLATE_MAX_NESTING    96           /* parser nesting of blocks + expressions */
#define PRISM_TEMPLATE_MAX_CALL_DEPTH 48           /* nested macro calls */
#define PRISM_TEMPLATE_MAX_ITERATIONS 2000000      /* loop iterations per render, all loops */
#define PRISM_TEMPLATE_MAX_MEMORY     (256u << 20) /* scratch memory per render */
#define PRISM_TEMPLATE_MAX_VALUE_DEPTH 128         /* nesting of context JSON and built values */
#define PRISM_TEMPLATE_MAX_EVAL_DEPTH 1024         /* expressions + statements being evaluated at once, macro
                                                      calls included: bounds the C stack of a render */

typedef struct prism_template prism_template_t;

/* Parses the template; any construct the interpreter does not support fails here with PRISM_ENOTSUP
 * and an error message naming it (e.g. "unsupported filter 'xmlattr' at line 3"), syntax errors with
 * PRISM_EINVAL, oversize sources with PRISM_ELIMIT. */
int  prism_template_compile(const char *source, size_t len, prism_template_t **out, char *err, size_t errlen);
void prism_template_free(prism_template_t *t);

/* Renders with the given context (a JSON object: messages, add_generation_prompt, bos_token, eos_token,
 * tools, any extra kwargs). Appends to out. raise_exception() yields PRISM_EINVAL with its message in
 * err; other render errors (jinja2 would raise too) are PRISM_EINVAL; bounds PRISM_ELIMIT. On failure
 * out is left as it was. */
int  prism_template_render(const prism_template_t *t, const json_t *context, prism_buf_t *out, char *err,
                           size_t errlen);

/* The context transformers' apply_chat_template hands to its template: messages with null-valued keys
 * dropped and reasoning ("reasoning_content", "thinking", "reasoning") aliased the way transformers
 * does, tools (null when NULL), documents = null, add_generation_prompt, bos_token/eos_token when
 * non-NULL, then every key of extra (may be NULL) overriding. Returns a new reference, NULL when
 * messages is not an array of objects or on allocation failure. */
json_t *prism_template_chat_context(const json_t *messages, const json_t *tools, bool add_generation_prompt,
                                    const char *bos_token, const char *eos_token, const json_t *extra);

/* Reads tokenizer_config.json: chat_template is a string or a list of {name, template} (the one named
 * "default" is used); bos/eos come back as prism_malloc'd strings (NULL when absent; either a string or
 * an {"content": ...} object in the file). bos/eos may be NULL when not wanted. A config without a
 * chat template is PRISM_ENOTFOUND. */
int prism_template_load_from_tokenizer_config(const char *path, prism_template_t **out, char **bos, char **eos,
                                              char *err, size_t errlen);
/* Compiles a template file (--chat-template FILE, a .jinja file). */
int prism_template_load_file(const char *path, prism_template_t **out, char *err, size_t errlen);

/* The source a compiled template was built from (NUL-terminated, as given). */
const char *prism_template_source(const prism_template_t *t, size_t *len);

#endif
