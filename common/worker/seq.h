/* seq: one generation sequence, the record prefill and decode both keep per request — who owns it
 * (request id, router), its sampling request exactly as the router sent it (the Sampling message,
 * which prefill forwards to decode unchanged inside Kv), the sampler's RNG, how far it got, and
 * the rules for when it ends and what its Tokens message carries.
 *
 *   router --Prefill.sampling--> prefill: prism_seq_start(); first token; Kv.sampling = the same
 *   message, Kv.rng_state = s.rng --> decode: prism_seq_start() with that RNG; every step:
 *
 *   int32_t tok = prism_seq_sample(&s, &sampler, logits);
 *   Prism__Tokens t = PRISM__TOKENS__INIT;
 *   prism_seq_lp_msg_t lpm;                         // storage t points into until it is sent
 *   prism_seq_tokens(&s, &t, &tok, &lpm, &sampler, logits, cfg, max_model_len);
 *   if (t.finish != PRISM__FINISH__FINISH_NONE) ... the sequence is done
 *
 * The record holds no pointers into other memory, so it may be copied (prefill keeps a copy of
 * the request it is handing to decode while the slot takes a new one). */
#ifndef PRISM_WORKER_SEQ_H
#define PRISM_WORKER_SEQ_H

#include "core/core.h"
#include "model/model.h"
#include "net/net.h"
#include "sample/sample.h"

#define PRISM_SEQ_MAX_TOP_LOGPROBS 20
#define PRISM_SEQ_MAX_STOP_IDS 16

typedef struct {
    bool used;
    uint64_t rid;
    char router_id[128];
    Prism__Sampling sampling;     /* as received (stop ids and logprobs clamped to the bounds below);
                                   * its stop_token_ids is set by prism_seq_sampling() */
    int32_t stop_ids[PRISM_SEQ_MAX_STOP_IDS];
    prism_sample_params_t sp;     /* the sampler's view of sampling */
    uint64_t rng;                 /* sampler state; travels prefill -> decode */
    int prompt_tokens;
    int len;                      /* tokens whose K/V are in the cache */
    int generated;                /* tokens sampled so far (the first is prefill's) */
} prism_seq_t;

/* NULL when a Sampling message can start a sequence, else the reason (for the error reply). */
const char *prism_seq_check(const Prism__Sampling *s);
/* Takes the slot: owner, a copy of the sampling message, the RNG state (prefill:
 * prism_seq_seed(); decode: what Kv carried). len = generated = 0. */
void prism_seq_start(prism_seq_t *s, uint64_t rid, const char *router_id, const Prism__Sampling *sampling,
                     int prompt_tokens, uint64_t rng);
/* RNG seed of a new request: its own seed, or a fresh one. */
uint64_t prism_seq_seed(const Prism__Sampling *sampling, uint64_t rid);
/* The sampling message to forward (points into s). */
const Prism__Sampling *prism_seq_sampling(prism_seq_t *s);

/* Samples the next token and counts it. */
int32_t prism_seq_sample(prism_seq_t *s, prism_sampler_t *sm, const float *logits);

/* Storage for the logprobs of one token in a Tokens message. */
typedef struct {
    Prism__TokenLogprobs lp;
    Prism__TokenLogprobs *lpp;
    Prism__TopLogprob top[PRISM_SEQ_MAX_TOP_LOGPROBS];
    Prism__TopLogprob *topp[PRISM_SEQ_MAX_TOP_LOGPROBS];
} prism_seq_lp_msg_t;

/* Fills t for the token just sampled: the token, prompt_tokens, its logprobs when the request
 * asked (into lpm), and finish: STOP for EOS (unless ignore_eos) or a stop token id, LENGTH when
 * max_tokens are out or the context (len + 1 >= max_model_len) is full, else NONE. */
void prism_seq_tokens(const prism_seq_t *s, Prism__Tokens *t, const int32_t *tok, prism_seq_lp_msg_t *lpm,
                      prism_sampler_t *sm, const float *logits, const prism_model_config_t *cfg, int max_model_len);

#endif
