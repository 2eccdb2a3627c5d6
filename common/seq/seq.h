/* seq: one generation sequence, the record prefill and decode both keep per request — who owns it
 * (request id, router), its sampling request exactly as the router sent it (the Sampling message,
 * which prefill forwards to decode unchanged inside Kv), the sampler's RNG, how far it got, and
 * the rules for when it ends and what its Tokens message carries — and the worker's sequence
 * sampler, which applies the request's logits processors before sampling: logit_bias, penalties
 * from a per-slot token-count table, and the grammar mask of a guided request (response_format,
 * guided_*, forced tool calls).
 *
 *   router --Prefill.sampling--> prefill: prism_seq_start(); prism_seq_attach(slot 0, prompt);
 *     prism_seq_first_tokens() samples the first token of each of the request's n sequences
 *     (one Tokens message each); Kv.sampling = the same message, Kv.choice_* = the sequences
 *     that go on --> decode: per choice, prism_seq_start() with its RNG, prism_seq_attach(its slot,
 *     prompt ids when a penalty needs them, its first token); every step:
 *
 *   int32_t tok = prism_seq_sample(&s, &sampler, logits);
 *   Prism__Tokens t = PRISM__TOKENS__INIT;
 *   prism_seq_lp_msg_t lpm;                         // storage t points into until it is sent
 *   prism_seq_tokens(&s, &t, &tok, &lpm, &sampler, logits, cfg, max_model_len);
 *   if (t.finish != PRISM__FINISH__FINISH_NONE) ... the sequence is done: prism_seq_detach(&s)
 *
 * Copies: the record holds no pointer into a received message (repeated fields are copied into
 * it; prism_seq_sampling points the forwarded message back into the record). Its one owned
 * pointer is a reference to the compiled guide: a copy that outlives the original takes its own
 * (prism_seq_copy), and whoever releases a record calls prism_seq_detach (idempotent).
 *
 * Logprobs are computed from the raw logits (vLLM's default "raw_logprobs"): processors change
 * which token is sampled, not the reported distribution. */
#ifndef PRISM_SEQ_H
#define PRISM_SEQ_H

#include "core/core.h"
#include "model/model.h"
#include "net/net.h"
#include "sample/sample.h"
#include "guide/guide.h"

#define PRISM_SEQ_MAX_TOP_LOGPROBS 20
#define PRISM_SEQ_MAX_STOP_IDS 16
#define PRISM_SEQ_MAX_LOGIT_BIAS 300   /* logit_bias entries per request */
#define PRISM_SEQ_MAX_N 128            /* sequences per prompt (OpenAI's n maximum) */
#define PRISM_SEQ_MAX_BIAS 100.0f      /* |logit_bias value| */

/* The worker's sequence sampler: sampling scratch, the logits processors' state per sequence
 * slot (token counts for penalties, a grammar matcher for guided requests), the grammar
 * vocabulary built from the model's tokenizer.json and a bounded cache of compiled guides.
 * Sized at start-up; one thread uses it. */
typedef struct {
    prism_sampler_t base;
    int vocab, n_slots;
    float *work;                     /* [vocab] logits after the processors */
    prism_token_counts_t counts;     /* [n_slots] */
    prism_grammar_vocab_t *gvocab;   /* NULL: no tokenizer, guided requests are refused */
    prism_guide_cache_t *guides;
    prism_grammar_matcher_t **matchers;  /* [n_slots]; made on a slot's first guided request */
    int32_t *mask;                   /* [mask words] */
    int32_t eos;                     /* ends a sequence whose grammar has nothing left to allow */
    uint64_t mask_ns, n_masks;       /* time computing grammar masks (logged at exit) */
    void *first;                     /* prism_seq_first_tokens scratch */
} prism_seq_sampler_t;

/* n_slots: sequences the worker runs at once (decode: its batch; prefill: 1). model_path: where
 * tokenizer.json is (NULL: no grammar support). Fails only on memory; a missing or unreadable
 * tokenizer.json leaves guided requests refused (logged). Everything is allocated here (the
 * workers measure it into their memory plan as "sampling"). */
int  prism_seq_sampler_init(prism_seq_sampler_t *ss, const prism_model_config_t *cfg, const char *model_path,
                            int n_slots);
void prism_seq_sampler_free(prism_seq_sampler_t *ss);

typedef struct {
    bool used;
    uint64_t rid;
    uint64_t rid_hi;              /* the high half of the request's 128-bit id (set by the worker) */
    prism_trace_id_t trace;       /* its W3C trace id (set by the worker; passed on with its KV, in its logs) */
    char router_id[128];
    Prism__Sampling sampling;     /* as received (stop ids, logprobs and n clamped to the bounds
                                   * below); its repeated fields and guide are set by
                                   * prism_seq_sampling() */
    int32_t stop_ids[PRISM_SEQ_MAX_STOP_IDS];
    int32_t bias_ids[PRISM_SEQ_MAX_LOGIT_BIAS];
    float bias_values[PRISM_SEQ_MAX_LOGIT_BIAS];
    Prism__Guide guide_msg;       /* the forwarded guide (points into *guide) */
    prism_guide_t *guide;         /* reference; NULL = unguided */
    prism_sample_params_t sp;     /* the sampler's view of sampling */
    prism_penalty_params_t pen;
    uint64_t rng;                 /* sampler state; travels prefill -> decode */
    int prompt_tokens;
    int len;                      /* tokens whose K/V are in the cache */
    int generated;                /* tokens sampled so far (the first is prefill's; a migrated
                                   * sequence counts the ones before, Sampling.generated) */
    uint32_t index;               /* choice index of this sequence (Sampling.n > 1) */
    int slot;                     /* sampler slot (prism_seq_attach); -1 = none */
    bool grammar_done;            /* the grammar allowed nothing but the end: finish STOP */
    bool grammar_broken;          /* a sampled token was outside the grammar: finish ERROR */
    /* prefill: the sequences that go on after their first token (for Kv.choice_*) */
    int n_fork;
    uint32_t fork_index[PRISM_SEQ_MAX_N];
    int32_t fork_first[PRISM_SEQ_MAX_N];
    uint64_t fork_rng[PRISM_SEQ_MAX_N];
} prism_seq_t;

/* NULL when a Sampling message can start a sequence of this model (vocab) and context
 * (max_model_len), else the reason (for the error reply). Every field is checked: max_tokens
 * 1..max_model_len, finite temperature >= 0 and top_p, at most PRISM_SEQ_MAX_STOP_IDS stop ids,
 * each in the vocabulary, logprobs <= 1 + PRISM_SEQ_MAX_TOP_LOGPROBS. Prefill checks what the router
 * sent, decode what prefill forwarded: neither trusts the sender's arithmetic. */
const char *prism_seq_check(const Prism__Sampling *s, int vocab, int max_model_len);
/* Takes the record: owner, a copy of the sampling message, the RNG state (prefill:
 * prism_seq_seed(); decode: what Kv carried), and a reference to its guide, compiled against
 * ss's vocabulary (or found in its cache). len = generated = 0, index 0, no slot. Returns NULL,
 * or why the message cannot start a sequence (then the record is left unused). */
const char *prism_seq_start(prism_seq_t *s, prism_seq_sampler_t *ss, uint64_t rid, const char *router_id,
                            const Prism__Sampling *sampling, int prompt_tokens, uint64_t rng);
/* Binds the sequence to sampler slot `slot`: the slot's token counts restart from the prompt
 * (prompt ids are read only when repetition_penalty is on; may be NULL otherwise) and its matcher
 * from the guide; then the tokens already generated (done[0..n_done): decode gets the first) are
 * counted and fed to the matcher. NULL, or why not (a token outside the grammar). */
const char *prism_seq_attach(prism_seq_t *s, prism_seq_sampler_t *ss, int slot, const int32_t *prompt,
                             size_t n_prompt, const int32_t *done, size_t n_done);
/* Feeds more generated tokens to an attached sequence's counts and matcher (decode: the first
 * token after a migrated request's earlier ones). NULL, or why not (a token outside the grammar). */
const char *prism_seq_feed(prism_seq_t *s, prism_seq_sampler_t *ss, const int32_t *done, size_t n_done);
/* Drops the guide reference (safe to call twice, and on a record never started). */
void prism_seq_detach(prism_seq_t *s);
/* *dst = *src with a guide reference of its own (prefill keeps a copy for the KV export). */
void prism_seq_copy(prism_seq_t *dst, const prism_seq_t *src);
/* RNG state of a new request: its own seed, or a fresh one; for a migrated one (Sampling.generated
 * > 0) the seed's state after the draws of the tokens it generated before (a seeded request goes
 * on exactly; an unseeded one goes on from a fresh stream, as random as the lost one). */
uint64_t prism_seq_seed(const Prism__Sampling *sampling, uint64_t rid);
/* The sampling message to forward (points into s). */
const Prism__Sampling *prism_seq_sampling(prism_seq_t *s);
/* Sequences this record's request samples from its prompt (Sampling.n, at least 1). */
static inline int prism_seq_n(const prism_seq_t *s) { return s->sampling.n ? (int)s->sampling.n : 1; }
/* Whether a penalty needs the prompt's token ids (decode gets them in Kv.prompt_token_ids). */
static inline bool prism_seq_needs_prompt(const prism_seq_t *s)
{
    return s->pen.repetition > 0.0f && s->pen.repetition != 1.0f;
}
/* Whether decode needs the token ids Kv.prompt_token_ids carries: the prompt for
 * repetition_penalty; for a migrated request also the tokens generated before, which the
 * penalties count and the guide's matcher is fed. */
static inline bool prism_seq_needs_history(const prism_seq_t *s)
{
    return prism_seq_needs_prompt(s) || (s->sampling.generated && (prism_penalty_active(&s->pen) || s->guide));
}

/* Samples the next token (logit_bias, penalties and the grammar mask applied to a copy of the
 * logits when the request has them), counts it and advances the grammar. */
int32_t prism_seq_sample(prism_seq_t *s, prism_seq_sampler_t *ss, const float *logits);

/* Storage for the logprobs of one token in a Tokens message. */
typedef struct {
    Prism__TokenLogprobs lp;
    Prism__TokenLogprobs *lpp;
    Prism__TopLogprob top[PRISM_SEQ_MAX_TOP_LOGPROBS];
    Prism__TopLogprob *topp[PRISM_SEQ_MAX_TOP_LOGPROBS];
} prism_seq_lp_msg_t;

/* Fills t for the token just sampled: the token, prompt_tokens, the choice index, its logprobs
 * when the request asked (into lpm), and finish: STOP for EOS (unless ignore_eos), a stop token
 * id or a grammar with nothing left to allow; LENGTH when max_tokens are out or the context
 * (len + 1 >= max_model_len) is full; ERROR (with t->error) when a token broke the grammar; else
 * NONE. */
void prism_seq_tokens(const prism_seq_t *s, Prism__Tokens *t, const int32_t *tok, prism_seq_lp_msg_t *lpm,
                      prism_seq_sampler_t *ss, const float *logits, const prism_model_config_t *cfg,
                      int max_model_len);

/* Prefill: the first token of each of the request's n sequences, all from one row of logits
 * (nothing generated yet, so the processors are the same for all), each with its own RNG stream
 * (choice 0 keeps the request's, so n = 1 samples exactly as before). Returns n and points *out
 * at n Tokens messages (index i, finish as prism_seq_tokens decides) that live in the sampler
 * until the next call; s->n_fork / fork_* list the sequences that go on, for Kv. s must be
 * attached (slot 0). */
int  prism_seq_first_tokens(prism_seq_t *s, prism_seq_sampler_t *ss, const float *logits,
                            const prism_model_config_t *cfg, int max_model_len, Prism__Tokens **out);

#endif
