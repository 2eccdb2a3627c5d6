/* openai_req: OpenAI-compatible request parsing and validation (the response writers are
 * openai_write.h).
 *
 * Parsing: prism_oai_parse() turns a /v1/chat/completions (chat=true) or /v1/completions body into
 * a prism_oai_request_t, or fills a prism_oai_error_t with a 400 and a vLLM-style message
 * ("'messages' is a required property", "max_tokens must be at least 1, got -5.") naming the
 * offending field in `param`. Strings in the result point into out->root (a jansson tree) and live
 * until prism_oai_request_free().
 *
 * The field rule: every field of the OpenAI spec's CreateChatCompletionRequest /
 * CreateCompletionRequest (and every vLLM extra a vLLM user may send) is either implemented,
 * accepted as metadata that cannot change the answer (user, metadata, store, service_tier,
 * prompt_cache_key, safety_identifier, prediction), or refused with a 400 naming it — never
 * accepted and ignored where it would change the result. A refused field sent as null or as its
 * default value (min_p: 0, echo: false, ...) is accepted. Fields neither the spec nor vLLM
 * defines are accepted and logged at debug level (as vLLM does). The table is k_fields in
 * openai_req.c; README lists the implemented ones.
 *
 * Output constraints are parsed and their shape checked here (response_format, guided_json /
 * guided_regex / guided_choice, tools / tool_choice); the router compiles them (guide.h) and
 * answers a bad schema with a 400 naming guide_param.
 *
 * Bounds: messages, stop strings and their length, stop token ids, prompt token ids, images per
 * request, logit_bias entries, tools, n, JSON nesting depth (see prism_oai_parse_opts_t), and what
 * the parsed tree may cost: one pass over the body, allocating nothing, refuses a body whose tree
 * would take more than max_parse_bytes (jansson spends ~230 bytes on a 3-byte "{},"), or whose
 * fields the server does not read (unknown, metadata) hold more than max_ignored_bytes of it,
 * before jansson builds any of it (prism_oai_scan; issue 26).
 */
#ifndef PRISM_ROUTER_OPENAI_REQ_H
#define PRISM_ROUTER_OPENAI_REQ_H

#include "core/core.h"

#include <jansson.h>

#define PRISM_OAI_MAX_STOP           8
#define PRISM_OAI_MAX_STOP_LEN       1024
#define PRISM_OAI_MAX_CACHE_SALT     256   /* kv/prefix.h PRISM_KV_PREFIX_MAX_SALT */
#define PRISM_OAI_MAX_STOP_TOKEN_IDS 16
#define PRISM_OAI_MAX_TOP_LOGPROBS   20
#define PRISM_OAI_MAX_LOGIT_BIAS     300
#define PRISM_OAI_MAX_N              128
#define PRISM_OAI_MAX_TOOLS          128
#define PRISM_OAI_MAX_TOOLS_BYTES    (1u << 20)   /* the tools array as JSON text (it travels to the workers) */
#define PRISM_OAI_MAX_CHOICES        1024   /* guided_choice strings */
#define PRISM_OAI_MAX_MM_PIXELS      (1ll << 40)   /* mm_processor_kwargs pixels (the model's own bound is lower) */

typedef enum {
    PRISM_OAI_TOOL_NONE = 0,     /* no tool calls: tools (if any) only reach the chat template */
    PRISM_OAI_TOOL_AUTO,         /* the model may call tools: its output is parsed for calls */
    PRISM_OAI_TOOL_REQUIRED,     /* at least one call, forced by a grammar */
    PRISM_OAI_TOOL_NAMED,        /* a call of tool_name, forced by a grammar */
} prism_oai_tool_choice_t;

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
    int32_t priority;         /* vLLM's: lower runs first (every tier's queue) and is preempted last (decode); 0 */
    char cache_salt[PRISM_OAI_MAX_CACHE_SALT + 1];  /* vLLM's: keys the prefix cache; "" = none (a copy: the body goes) */
    const char *stop[PRISM_OAI_MAX_STOP];  /* [n_stop], each non-empty, <= PRISM_OAI_MAX_STOP_LEN bytes */
    size_t stop_len[PRISM_OAI_MAX_STOP];
    int n_stop;
    int64_t stop_token_ids[PRISM_OAI_MAX_STOP_TOKEN_IDS];  /* [n_stop_token_ids] */
    int n_stop_token_ids;
    bool logprobs;            /* chat: logprobs:true; completions: logprobs:int present */
    int top_logprobs;         /* 0..20 */
    int n;                    /* choices, 1..PRISM_OAI_MAX_N (completions best_of must equal it) */
    bool greedy;              /* top_p: 0 (as OpenAI, greedy) or temperature 0 */
    int n_logit_bias;
    int32_t logit_bias_ids[PRISM_OAI_MAX_LOGIT_BIAS];   /* < opts.vocab when it is set */
    float logit_bias_values[PRISM_OAI_MAX_LOGIT_BIAS];  /* [-100, 100] */
    /* output constraint (prism_guide_kind_t in guide/guide.h; 0 = none) */
    int guide_kind;
    const char *guide_text;   /* schema / regex / JSON array of choices (NUL-terminated) */
    size_t guide_len;
    const char *guide_param;  /* the field it came from, for errors ("response_format.json_schema.schema") */
    char *guide_owned;        /* guide_text when the parser serialised it */
    /* tools (chat) */
    json_t *tools;            /* borrowed from root; NULL when absent */
    char *tools_text;         /* the tools array as compact JSON text (forced calls travel as it) */
    int n_tools;
    int tool_choice;          /* prism_oai_tool_choice_t */
    const char *tool_name;    /* NAMED: the function */
    bool parallel_tool_calls; /* default true */
    bool ignore_eos;          /* vLLM extension */
    bool add_generation_prompt; /* chat, default true (vLLM extension) */
    bool add_special_tokens;  /* vLLM extension: default false for chat, true for completions */
    bool skip_special_tokens; /* vLLM extension: default true */
    bool return_tokens_as_token_ids; /* vLLM extension: logprobs name tokens "token_id:<id>" */
    int64_t mm_min_pixels;    /* mm_processor_kwargs (vLLM extension; Qwen-VL): -1 = the processor's; */
    int64_t mm_max_pixels;    /*   1..PRISM_OAI_MAX_MM_PIXELS, min <= max when both are given */
    int n_images;             /* total image parts over all messages */
    size_t parse_bytes;       /* what the parsed tree costs (estimated by prism_oai_scan) */
} prism_oai_request_t;

/* Why a request was refused, where the router counts it apart from other invalid requests. */
typedef enum {
    PRISM_OAI_REFUSED_INVALID = 0,        /* any other validation error */
    PRISM_OAI_REFUSED_TOO_MANY_IMAGES,    /* more image parts than max_images */
} prism_oai_refusal_t;

typedef struct {
    int status;               /* HTTP status, 400 */
    char type[32];            /* "BadRequestError" */
    char message[512];
    char param[64];           /* offending field ("messages[2].content[0].type"), "" when none */
    prism_oai_refusal_t refusal;
} prism_oai_error_t;

typedef struct {
    int max_images;           /* images per request; 0 = default 8; negative = images not allowed */
    int max_messages;         /* 0 = 4096 */
    int max_depth;            /* JSON nesting depth; 0 = 64 */
    int max_prompt_token_ids; /* 0 = 1 << 20 */
    int vocab;                /* logit_bias and stop_token_ids must be below it; 0 = not checked */
    size_t max_parse_bytes;   /* the parsed tree's cost; 0 = 96 MiB (a 64 MiB text prompt, 1 Mi token ids) */
    size_t max_ignored_bytes; /* of that, the structure (all but string bytes) of fields the endpoint
                               * does not read; 0 = 1 MiB (about 4,500 objects) */
} prism_oai_parse_opts_t;

/* opts may be NULL (defaults). On failure returns PRISM_EINVAL (or PRISM_ENOMEM), fills err and
 * leaves out empty (prism_oai_request_free on it is still fine). */
int  prism_oai_parse(const char *body, size_t len, bool chat, const prism_oai_parse_opts_t *opts,
                     prism_oai_request_t *out, prism_oai_error_t *err);
void prism_oai_request_free(prism_oai_request_t *r);

/* The parse budget, for bodies parsed elsewhere too (/tokenize, /detokenize: PRISM_OAI_SCAN_ANY,
 * every field counted as read). One pass, no allocation, valid or not: nesting past max_depth, a
 * tree over max_parse_bytes or ignored fields over max_ignored_bytes fill err (400, param naming
 * the field) and return PRISM_EINVAL; otherwise *tree_bytes is the tree's estimated cost. */
enum { PRISM_OAI_SCAN_ANY = 0, PRISM_OAI_SCAN_CHAT = 1, PRISM_OAI_SCAN_COMPLETIONS = 2 };
int prism_oai_scan(const char *body, size_t len, int endpoint, const prism_oai_parse_opts_t *opts, size_t *tree_bytes,
                   prism_oai_error_t *err);
/* The most one parse may hold in heap (opts' max_parse_bytes): what a memory plan counts per
 * thread that parses bodies. */
size_t prism_oai_parse_bound(const prism_oai_parse_opts_t *opts);

#endif
