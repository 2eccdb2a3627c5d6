/* openai_req: OpenAI-compatible request parsing/validation and response JSON writers.
 *
 * Parsing: prism_oai_parse() turns a /v1/chat/completions (chat=true) or /v1/completions body into
 * a prism_oai_request_t, or fills a prism_oai_error_t with a 400 and a vLLM-style message
 * ("'messages' is a required property", "max_tokens must be at least 1, got -5.") naming the
 * offending field in `param`. Strings in the result point into out->root (a jansson tree) and live
 * until prism_oai_request_free(). Unknown top-level fields are accepted and logged at debug level.
 * Bounds: messages, stop strings and their length, stop token ids, prompt token ids, images per
 * request, JSON nesting depth (see prism_oai_parse_opts_t).
 *
 * Writing: the writers append to a prism_buf_t so the router can build each SSE event with a
 * few appends per token. All text is JSON-escaped; invalid UTF-8 in token text becomes U+FFFD
 * (maximal-subpart rule, like Python's errors="replace"), so the output is always valid JSON.
 * Floats: -inf/NaN logprobs are floored to -9999.0.
 *
 * Usage (streaming chat):
 *   prism_oai_resp_meta_t m; prism_oai_resp_meta_init(&m, true, req.model ? req.model : served_name);
 *   prism_oai_write_chat_chunk(&buf, &m, true, "", 0, NULL, NULL);            // role chunk
 *   per token: prism_oai_write_chat_chunk(&buf, &m, false, text, len, lp, NULL);
 *   last:      prism_oai_write_chat_chunk(&buf, &m, false, "", 0, NULL, "stop");
 *   if (req.include_usage) prism_oai_write_usage_chunk(&buf, &m, &usage);
 *   prism_oai_write_sse_done(&buf);  prism_oai_resp_meta_free(&m);
 */
#ifndef PRISM_ROUTER_OPENAI_REQ_H
#define PRISM_ROUTER_OPENAI_REQ_H

#include "core/core.h"

#include <jansson.h>

#define PRISM_OAI_MAX_STOP           8
#define PRISM_OAI_MAX_STOP_LEN       1024
#define PRISM_OAI_MAX_STOP_TOKEN_IDS 16
#define PRISM_OAI_MAX_TOP_LOGPROBS   20
#define PRISM_OAI_LOGPROB_FLOOR      (-9999.0)

/* ------------------------------------------------------------------ parsing */

typedef enum {
    PRISM_OAI_PART_TEXT  = 0,
    PRISM_OAI_PART_IMAGE = 1,
} prism_oai_part_kind_t;

typedef struct {
    int kind;                 /* prism_oai_part_kind_t */
    const char *text;         /* TEXT: may contain NUL bytes, use text_len */
    size_t text_len;
    const char *image_url;    /* IMAGE: as sent (data:, http(s):, file:); the router vets it */
    size_t image_url_len;
} prism_oai_part_t;

typedef struct {
    const char *role;         /* system | user | assistant | tool | developer */
    bool content_is_string;   /* content was a string: parts[0] is one TEXT part holding it */
    bool content_is_null;     /* content absent or null (e.g. assistant with tool_calls): no parts */
    prism_oai_part_t *parts;  /* [n_parts], in order */
    int n_parts;
    int n_images;
    json_t *raw;              /* the original message object (borrowed from root), for the chat template */
} prism_oai_message_t;

typedef struct {
    bool chat;
    const char *model;        /* NULL when absent */
    json_t *root;             /* owned: the parsed body */

    prism_oai_message_t *messages;  /* chat: [n_messages] */
    int n_messages;

    const char *prompt;       /* completions: string prompt (also from a list of one string) */
    size_t prompt_len;
    int32_t *prompt_token_ids;      /* completions: [n_prompt_token_ids] when the prompt was token ids */
    int n_prompt_token_ids;

    bool stream, include_usage;
    int64_t max_tokens;       /* -1 = unset (up to the context); max_completion_tokens supersedes;
                               * completions default 16 */
    double temperature;       /* default 1.0 */
    double top_p;             /* default 1.0 */
    int64_t top_k;            /* -1 = off (0 in the request is normalised to -1) */
    double presence_penalty;  /* default 0, [-2, 2] */
    double frequency_penalty; /* default 0, [-2, 2] */
    double repetition_penalty;/* default 1 (vLLM extension), > 0 */
    bool has_seed;
    int64_t seed;
    const char *stop[PRISM_OAI_MAX_STOP];  /* [n_stop], each non-empty, <= PRISM_OAI_MAX_STOP_LEN bytes */
    size_t stop_len[PRISM_OAI_MAX_STOP];
    int n_stop;
    int64_t stop_token_ids[PRISM_OAI_MAX_STOP_TOKEN_IDS];  /* [n_stop_token_ids] */
    int n_stop_token_ids;
    bool logprobs;            /* chat: logprobs:true; completions: logprobs:int present */
    int top_logprobs;         /* 0..20 */
    int n;                    /* always 1 (n > 1 is rejected) */
    bool ignore_eos;          /* vLLM extension */
    bool add_generation_prompt; /* chat, default true (vLLM extension) */
    bool add_special_tokens;  /* vLLM extension: default false for chat, true for completions */
    bool skip_special_tokens; /* vLLM extension: default true */
    bool return_tokens_as_token_ids; /* vLLM extension: logprobs name tokens "token_id:<id>" */
    int n_images;             /* total image parts over all messages */
} prism_oai_request_t;

typedef struct {
    int status;               /* HTTP status, 400 */
    char type[32];            /* "BadRequestError" */
    char message[512];
    char param[64];           /* offending field ("messages[2].content[0].type"), "" when none */
} prism_oai_error_t;

typedef struct {
    int max_images;           /* images per request; 0 = default 8; negative = images not allowed */
    int max_messages;         /* 0 = 4096 */
    int max_depth;            /* JSON nesting depth; 0 = 64 */
    int max_prompt_token_ids; /* 0 = 1 << 20 */
} prism_oai_parse_opts_t;

/* opts may be NULL (defaults). On failure returns PRISM_EINVAL (or PRISM_ENOMEM), fills err and
 * leaves out empty (prism_oai_request_free on it is still fine). */
int  prism_oai_parse(const char *body, size_t len, bool chat, const prism_oai_parse_opts_t *opts,
                     prism_oai_request_t *out, prism_oai_error_t *err);
void prism_oai_request_free(prism_oai_request_t *r);

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

/* SSE events ("data: {...}\n\n"). content/text NULL -> omitted (chat delta {}); lp NULL -> null;
 * finish_reason NULL -> null. role: include "role":"assistant" in the delta. */
int prism_oai_write_chat_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, bool role, const char *content,
                               size_t content_len, const prism_oai_logprobs_t *lp, const char *finish_reason);
int prism_oai_write_completion_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *text, size_t len,
                                     const prism_oai_logprobs_t *lp, const char *finish_reason);
/* The include_usage chunk: choices [] and usage. */
int prism_oai_write_usage_chunk(prism_buf_t *b, const prism_oai_resp_meta_t *m, const prism_oai_usage_t *u);
int prism_oai_write_sse_done(prism_buf_t *b);   /* "data: [DONE]\n\n" */
/* Mid-stream error event: data: {"error":{...}} (follow with prism_oai_write_sse_done). */
int prism_oai_write_sse_error(prism_buf_t *b, const char *type, const char *message, const char *param,
                              const char *code);

/* Whole (non-streaming) responses. */
int prism_oai_write_chat_response(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *content, size_t len,
                                  const prism_oai_logprobs_t *lp, const char *finish_reason,
                                  const prism_oai_usage_t *u);
int prism_oai_write_completion_response(prism_buf_t *b, const prism_oai_resp_meta_t *m, const char *text,
                                        size_t len, const prism_oai_logprobs_t *lp, const char *finish_reason,
                                        const prism_oai_usage_t *u);
int prism_oai_write_usage(prism_buf_t *b, const prism_oai_usage_t *u);
/* {"error":{"message","type","param","code"}}; param/code NULL -> null. */
int prism_oai_write_error(prism_buf_t *b, const char *type, const char *message, const char *param,
                          const char *code);

/* JSON string literal (with quotes) of len bytes; invalid UTF-8 -> U+FFFD. */
int prism_oai_json_string(prism_buf_t *b, const char *s, size_t len);
/* JSON number for a logprob (-inf/NaN -> -9999.0; always has a '.' or exponent). */
int prism_oai_json_logprob(prism_buf_t *b, double v);
/* Length of the longest prefix of s that does not end inside an incomplete-but-valid-so-far UTF-8
 * sequence (hold the tail back until the next token completes it). */
size_t prism_oai_utf8_complete_prefix(const char *s, size_t len);

#endif
