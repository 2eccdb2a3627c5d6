/* toolcall: parsing tool calls out of model text (vLLM's --tool-call-parser formats), whole or
 * incrementally, and the grammar that forces a call for tool_choice "required" / a named function.
 *
 * Formats:
 *  - PRISM_TOOLCALL_HERMES: <tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number,
 *    with content around them (Qwen, Hermes). "arguments" may also be a JSON string holding the
 *    JSON text (then its decoded text is the arguments).
 *  - PRISM_TOOLCALL_PYTHONIC: the whole output is [f(a=1, b="x"), g()] (Llama-4; optionally
 *    inside <|python_start|> ... <|python_end|>); argument values are Python literals (strings,
 *    numbers, True/False/None, lists, tuples, dicts) converted to JSON. Output that does not start
 *    with '[' is plain content.
 *
 * One incremental state machine per format does both jobs: prism_toolcall_parse feeds the whole
 * text at once, so streaming and non-streaming agree on every split point by construction (and a
 * test checks it). The machine decides only on complete constructs: text that might still become
 * a tool-call marker is held back until it cannot.
 *
 * Events (in order): CONTENT text outside tool calls; CALL_BEGIN once per call with its index, id
 * and function name; ARGS fragments whose concatenation is the call's arguments JSON text. For
 * OpenAI streaming, a CALL_BEGIN is a delta.tool_calls[] entry {index, id, type, function.name}
 * and ARGS are entries {index, function.arguments}. Malformed text inside a call stops tool
 * parsing: the call is marked incomplete and the rest of the text becomes content.
 *
 * Ownership: a parser owns its buffers; event pointers are valid only during the callback.
 * Input is bounded (PRISM_ELIMIT past max_bytes). Not thread-safe; one parser per sequence. */
#ifndef PRISM_TOOLCALL_H
#define PRISM_TOOLCALL_H

#include "core/core.h"
#include "grammar/grammar.h"

typedef enum { PRISM_TOOLCALL_HERMES, PRISM_TOOLCALL_PYTHONIC } prism_toolcall_format_t;

/* "hermes" / "pythonic" (and "llama4_pythonic" as vLLM names it); -1 if unknown. */
int prism_toolcall_format_parse(const char *name);

typedef enum { PRISM_TC_CONTENT, PRISM_TC_CALL_BEGIN, PRISM_TC_ARGS } prism_toolcall_event_kind_t;

typedef struct {
    prism_toolcall_event_kind_t kind;
    int index;                 /* CALL_BEGIN / ARGS: tool call index, from 0 */
    const char *id;            /* CALL_BEGIN: "call_" + 24 hex digits */
    const char *name;          /* CALL_BEGIN: function name */
    const char *text;          /* CONTENT / ARGS */
    size_t len;
} prism_toolcall_event_t;

typedef void (*prism_toolcall_cb)(void *ud, const prism_toolcall_event_t *ev);

typedef struct prism_toolcall_parser prism_toolcall_parser_t;

/* id_seed makes ids reproducible (e.g. a hash of the request id). max_bytes bounds the text
 * (0 = 1 MiB). max_calls > 0 keeps only the first max_calls calls (OpenAI's parallel_tool_calls
 * false is 1): later calls are parsed (so they never turn into content) but send no events;
 * 0 keeps every call. */
int  prism_toolcall_parser_create(prism_toolcall_format_t fmt, uint64_t id_seed, size_t max_bytes, int max_calls,
                                  prism_toolcall_cb cb, void *ud, prism_toolcall_parser_t **out);
void prism_toolcall_parser_free(prism_toolcall_parser_t *p);
/* Feeds a text delta; events for everything now decided come out through cb. */
int  prism_toolcall_parser_feed(prism_toolcall_parser_t *p, const char *text, size_t len);
/* End of output: held-back text is decided (as content, or an incomplete call). */
int  prism_toolcall_parser_finish(prism_toolcall_parser_t *p);
int  prism_toolcall_parser_n_calls(const prism_toolcall_parser_t *p);
/* true when every call seen so far was well formed and closed (after finish: the output was
 * content plus complete tool calls). */
bool prism_toolcall_parser_ok(const prism_toolcall_parser_t *p);

/* ---- whole text ---- */
typedef struct {
    char id[32];
    char *name;
    prism_buf_t arguments;     /* JSON text */
    bool complete;
} prism_toolcall_t;

typedef struct {
    prism_buf_t content;
    prism_toolcall_t *calls;
    size_t n_calls;
    bool ok;                   /* prism_toolcall_parser_ok after finish */
} prism_toolcall_result_t;

int  prism_toolcall_parse(prism_toolcall_format_t fmt, const char *text, size_t len, uint64_t id_seed, int max_calls,
                          prism_toolcall_result_t *out);
void prism_toolcall_result_free(prism_toolcall_result_t *r);

/* ---- forcing a call: grammar for tool_choice "required" or a named function ----
 * tools_json: the request's OpenAI "tools" array as JSON text. only_name: NULL for "required"
 * (any of the tools), else the function that must be called (PRISM_EINVAL naming the field when
 * unknown). parallel: several calls allowed (parallel_tool_calls), else exactly one. Errors
 * name the field, e.g. path "tools[1].function.parameters#/properties/x/type". */
int prism_toolcall_grammar(prism_toolcall_format_t fmt, const prism_grammar_vocab_t *v, const char *tools_json,
                           size_t len, const char *only_name, bool parallel, const prism_grammar_limits_t *limits,
                           prism_grammar_t **out, prism_grammar_error_t *err);

#endif
