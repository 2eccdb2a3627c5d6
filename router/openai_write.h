/* openai_write: OpenAI-compatible response JSON (chat / completion chunks and responses, logprobs,
 * usage, errors) and the SSE framing around it.
 *
 * Writing: the writers append to a prism_buf_t so the router can build each SSE event with a
 * few appends per token. All text is JSON-escaped; invalid UTF-8 in token text becomes U+FFFD
 * (maximal-subpart rule, like Python's errors="replace"), so the output is always valid JSON.
 * Floats: -inf/NaN logprobs are floored to -9999.0.
 *
 * Shapes follow the OpenAI spec (openai-openapi 2.3.0; tests validate them against its schemas):
 * a chat message always has "refusal": null beside "content" (content null when the answer is
 * only tool calls), chat logprobs are {"content": [...], "refusal": null}.
 *
 * Usage (streaming chat, n choices):
 *   prism_oai_resp_meta_t m; prism_oai_resp_meta_init(&m, true, req.model ? req.model : served_name);
 *   per choice i: prism_oai_write_chat_delta(&buf, &m, &(prism_oai_delta_t){.index = i, .role = true,
 *                                            .content = "", .len = 0});             // role chunk
 *   per token:    prism_oai_write_chat_delta(&buf, &m, &(prism_oai_delta_t){.index = i, .content = t, ...});
 *   last:         ... .finish_reason = "stop" ...
 *   if (req.include_usage) prism_oai_write_usage_chunk(&buf, &m, &usage);
 *   prism_oai_write_sse_done(&buf);  prism_oai_resp_meta_free(&m);
 * Whole responses: prism_oai_write_response_begin, one prism_oai_write_chat_choice /
 * prism_oai_write_completion_choice per choice, prism_oai_write_response_end.
 */
#ifndef PRISM_ROUTER_OPENAI_WRITE_H
#define PRISM_ROUTER_OPENAI_WRITE_H

#include "core/core.h"

#define PRISM_OAI_LOGPROB_FLOOR      (-9999.0)

/* ------------------------------------------------------------------ response writers */

/* Identity shared by every chunk of one response. */
typedef struct {
    bool chat;
    char id[48];              /* "chatcmpl-<32 hex>" or "cmpl-<32 hex>" */
    int64_t created;          /* unix seconds */
    prism_buf_t model_json;   /* the model name, already a JSON string literal */
} prism_oai_resp_meta_t;

int  prism_oai_resp_meta_init(prism_oai_resp_meta_t *m, bool chat, const char *model);
void prism_oai_resp_meta_free(prism_oai_resp_meta_t *m);
/* Writes a fresh random id "<prefix><32 hex>" into out (n >= strlen(prefix) + 33). */
void prism_oai_make_id(char *out, size_t n, const char *prefix);

typedef struct {
    int64_t prompt_tokens;
    int64_t completion_tokens;
    int64_t cached_tokens;    /* < 0: omit prompt_tokens_details */
} prism_oai_usage_t;

/* One candidate in a token's top list. text = decoded token bytes (may be partial UTF-8). */
typedef struct {
    const char *text;
    size_t len;
    double logprob;
} prism_oai_top_logprob_t;

typedef struct {
    const char *text;         /* the sampled token's decoded bytes (may be partial UTF-8) */
    size_t len;
    double logprob;
    const prism_oai_top_logprob_t *top;  /* [n_top]; chat: the top_logprobs list;
                                          * completions: the {token: logprob} map (duplicates after
                                          * UTF-8 replacement keep the first) */
    int n_top;
} prism_oai_token_logprob_t;

/* Accumulates logprobs of the tokens of one chunk (stream) or of the whole response. Chat format:
 * {"content":[{token, logprob, bytes, top_logprobs:[{token, logprob, bytes}]}]} where bytes are the
 * token's raw bytes. Completions format: {tokens, token_logprobs, top_logprobs:[{tok: lp}],
 * text_offset} with text_offset counted in code points of the generated text (like vLLM). */
typedef struct {
    bool chat;
    int n_tokens;
    size_t text_offset;       /* completions: offset of the next token */
    prism_buf_t content;      /* chat: comma-joined entries */
    prism_buf_t tokens, token_logprobs, top_logprobs, text_offsets;  /* completions: comma-joined */
} prism_oai_logprobs_t;

void prism_oai_logprobs_init(prism_oai_logprobs_t *lp, bool chat);
int  prism_oai_logprobs_add(prism_oai_logprobs_t *lp, const prism_oai_token_logprob_t *t);
/* Forget the entries (after a chunk went out); keeps text_offset running. */
void prism_oai_logprobs_clear(prism_oai_logprobs_t *lp);
void prism_oai_logprobs_free(prism_oai_logprobs_t *lp);
/* The logprobs JSON object; lp NULL -> null. */
int  prism_oai_write_logprobs(prism_buf_t *b, const prism_oai_logprobs_t *lp);

/* A tool call of a whole response: {"id", "type": "function", "function": {"name", "arguments"}}. */
typedef struct {
    const char *id;
    const char *name;
    const char *arguments;    /* JSON text */
    size_t arguments_len;
} prism_oai_tool_call_t;

/* One entry of a chunk's delta.tool_calls: {"index", ["id", "type", "function": {"name",]
 * "arguments"}}: the first entry of a call carries id and name (arguments ""), later ones
 * argument fragments (id / name NULL). */
typedef struct {
    int index;
    const char *id;
    const char *name;
    const char *arguments;
    size_t arguments_len;
} prism_oai_tool_delta_t;

/* One chat chunk of choice `index`. content NULL -> omitted; tool calls omitted when none;
 * lp NULL -> null; finish_reason NULL -> null; role: "role":"assistant" in the delta. */
typedef struct {
    int index;
    bool role;
    const char *content;
    size_t len;
    const prism_oai_tool_delta_t *tool_calls;
    int n_tool_calls;
    const prism_oai_logprobs_t *lp;
    const char *finish_reason;
} prism_oai_delta_t;

/* SSE events ("data: {...}\n\n"). */
int prism_oai_write_chat_delta(prism_buf_t *b, const prism_oai_resp_meta_t *m, const prism_oai_delta_t *d);
/* Choice 0, content only (content NULL -> omitted). */
int prism_oai_write_chat_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, bool role, const char *content,
                               size_t content_len, const prism_oai_logprobs_t *lp, const char *finish_reason);
int prism_oai_write_completion_chunk_at(prism_buf_t *b, const prism_oai_resp_meta_t *m, int index, const char *text,
                                        size_t len, const prism_oai_logprobs_t *lp, const char *finish_reason);
int prism_oai_write_completion_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *text, size_t len,
                                     const prism_oai_logprobs_t *lp, const char *finish_reason);
/* The include_usage chunk: choices [] and usage. */
int prism_oai_write_usage_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, const prism_oai_usage_t *u);
int prism_oai_write_sse_done(prism_buf_t *b);   /* "data: [DONE]\n\n" */
/* Mid-stream error event: data: {"error":{...}} (follow with prism_oai_write_sse_done). */
int prism_oai_write_sse_error(prism_buf_t *b, const char *type, const char *message, const char *param,
                              const char *code);

/* Whole (non-streaming) responses with any number of choices. */
typedef struct {
    int index;
    const char *content;      /* NULL -> null */
    size_t len;
    const prism_oai_tool_call_t *tool_calls;   /* chat: [n_tool_calls] */
    int n_tool_calls;
    const prism_oai_logprobs_t *lp;            /* NULL -> null */
    const char *finish_reason;
} prism_oai_choice_t;

int prism_oai_write_response_begin(prism_buf_t *b, const prism_oai_resp_meta_t *m);
int prism_oai_write_chat_choice(prism_buf_t *b, const prism_oai_choice_t *c);
int prism_oai_write_completion_choice(prism_buf_t *b, const prism_oai_choice_t *c);
int prism_oai_write_response_end(prism_buf_t *b, const prism_oai_usage_t *u);

/* One choice (index 0), content only. */
int prism_oai_write_chat_response(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *content, size_t len,
                                  const prism_oai_logprobs_t *lp, const char *finish_reason,
                                  const prism_oai_usage_t *u);
int prism_oai_write_completion_response(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *text,
                                        size_t len, const prism_oai_logprobs_t *lp, const char *finish_reason,
                                        const prism_oai_usage_t *u);
int prism_oai_write_usage(prism_buf_t *b, const prism_oai_usage_t *u);
/* The OpenAI error type of an HTTP status, as openai-python names its exceptions ("RateLimitError"
 * for 429, "InternalServerError" for any 5xx but 503, "BadRequestError" for a 4xx it has no name
 * for): the one mapping the HTTP server's own answers and the router's share. */
const char *prism_oai_error_type(int status);
/* {"error":{"message","type","param","code"}}; param/code NULL -> null. */
int prism_oai_write_error(prism_buf_t *b, const char *type, const char *message, const char *param,
                          const char *code);

/* JSON number for a logprob (-inf/NaN -> -9999.0; always has a '.' or exponent). */
int prism_oai_json_logprob(prism_buf_t *b, double v);

#endif
