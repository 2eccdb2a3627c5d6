/* sample: turning logits into tokens. Greedy, temperature, top-k, top-p, with a per-request
 * RNG whose state travels with the request (prefill samples the first token, decode the rest),
 * so a seeded request gives the same tokens whichever workers run it.
 *
 * The sampler owns vocab-sized scratch allocated once; sampling allocates nothing. */
#ifndef PRISM_SAMPLE_H
#define PRISM_SAMPLE_H

#include "core/core.h"

#define PRISM_SAMPLE_MIN_TEMPERATURE 1e-5f  /* lower (or NaN) = greedy, as vLLM's _SAMPLING_EPS */

typedef struct {
    float temperature;  /* < PRISM_SAMPLE_MIN_TEMPERATURE = greedy */
    float top_p;        /* (0, 1]; 1 = off */
    int   top_k;        /* <= 0 = off */
} prism_sample_params_t;

typedef struct {
    int vocab;
    float   *prob;  /* [vocab] scratch */
    int32_t *idx;   /* [vocab] scratch */
} prism_sampler_t;

int  prism_sampler_init(prism_sampler_t *s, int vocab);
void prism_sampler_free(prism_sampler_t *s);

/* RNG: splitmix64 seeding, xorshift64* stream. */
uint64_t prism_rng_seed(uint64_t seed);
double   prism_rng_uniform(uint64_t *state);  /* [0, 1) */

int32_t prism_sample(prism_sampler_t *s, const float *logits, const prism_sample_params_t *p, uint64_t *rng);

/* Log-softmax of the raw logits (what HF's log_softmax gives): the chosen token's logprob and
 * the n_top most likely tokens, best first. -inf is floored to -9999 as OpenAI clients expect. */
void prism_logprobs(prism_sampler_t *s, const float *logits, int32_t chosen, int n_top,
                    float *chosen_lp, int32_t *top_ids, float *top_lps);

#endif
