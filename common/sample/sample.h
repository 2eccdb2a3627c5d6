/* sample: turning logits into tokens. Greedy, temperature, top-k, top-p, with a per-request
 * RNG whose state travels with the request (prefill samples the first token, decode the rest),
 * so a seeded request gives the same tokens whichever workers run it.
 *
 * Before sampling, logits processors (logits.c) change a copy of a row of logits: logit_bias
 * (OpenAI), presence / frequency penalties (OpenAI: over the generated tokens) and
 * repetition_penalty (vLLM: over prompt and generated tokens), the last three read from a
 * per-sequence token-count table. The functions here are the CPU reference; the CUDA backend has
 * one kernel per op over the same table layout (common/backend/cuda/penalties.cu,
 * logit_bias.cu, token_mask.cu), so a device build keeps the table on the device and only token
 * ids cross PCIe.
 *
 * The sampler owns vocab-sized scratch allocated once; sampling allocates nothing.
 *
 * What a worker samples with is one level up, in common/seq (seq.h): the per-sequence record and
 * the sequence sampler that applies a request's processors and grammar mask, then these. */
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
/* Whether prism_sample draws from the RNG with these parameters (exactly one uniform per token);
 * greedy draws nothing. A sequence's RNG state after g tokens is thus its seed advanced g draws. */
static inline bool prism_sample_draws(const prism_sample_params_t *p)
{
    return p->temperature >= PRISM_SAMPLE_MIN_TEMPERATURE && p->top_k != 1;
}

/* Log-softmax of the raw logits (what HF's log_softmax gives): the chosen token's logprob and
 * the n_top most likely tokens, best first. -inf is floored to -9999 as OpenAI clients expect. */
void prism_logprobs(prism_sampler_t *s, const float *logits, int32_t chosen, int n_top,
                    float *chosen_lp, int32_t *top_ids, float *top_lps);

/* ---- logits processors (logits.c) ---- */

/* Penalties as vLLM applies them (and in its order): repetition first (a logit of a token seen in
 * the prompt or the output is divided by r when positive, multiplied by r when not), then
 * frequency (minus f * times generated), then presence (minus p once generated). */
typedef struct {
    float presence;      /* [-2, 2]; 0 = off */
    float frequency;     /* [-2, 2]; 0 = off */
    float repetition;    /* > 0; 1 = off */
} prism_penalty_params_t;

static inline bool prism_penalty_active(const prism_penalty_params_t *p)
{
    return p->presence != 0.0f || p->frequency != 0.0f || (p->repetition != 1.0f && p->repetition > 0.0f);
}

/* Per-sequence token counts, one row per sequence slot, laid out as a device would keep them:
 * counts [n_rows][vocab] int32 (times each token was generated), prompt [n_rows][words] bits
 * (token in the prompt). Sized once; nothing allocated per token. */
typedef struct {
    int vocab, n_rows, words;
    int32_t *counts;
    uint32_t *prompt;
} prism_token_counts_t;

size_t prism_token_counts_bytes(int n_rows, int vocab);
int  prism_token_counts_init(prism_token_counts_t *t, int n_rows, int vocab);
void prism_token_counts_free(prism_token_counts_t *t);
/* Starts a row: counts cleared, prompt bits from ids (ids outside [0, vocab) are ignored). */
void prism_token_counts_reset(prism_token_counts_t *t, int row, const int32_t *prompt, size_t n_prompt);
/* One generated token (ids outside [0, vocab) are ignored). */
void prism_token_counts_add(prism_token_counts_t *t, int row, int32_t tok);
static inline const int32_t *prism_token_counts_row(const prism_token_counts_t *t, int row)
{
    return t->counts + (size_t)row * t->vocab;
}
static inline const uint32_t *prism_token_counts_prompt(const prism_token_counts_t *t, int row)
{
    return t->prompt + (size_t)row * t->words;
}

/* logits[vocab] in place, from one row of the table. */
void prism_apply_penalties(float *logits, int vocab, const int32_t *counts, const uint32_t *prompt_bits,
                           const prism_penalty_params_t *p);
/* logits[ids[i]] += bias[i] (ids outside [0, vocab) are skipped; the caller validated them). */
void prism_apply_logit_bias(float *logits, int vocab, const int32_t *ids, const float *bias, int n);

#endif
