/* Logits processors before sampling: penalties from a token-count table, logit bias. See
 * sample.h; the CUDA kernels in common/backend/cuda/ implement the same rules over the same
 * layout. */
#include "sample/sample.h"

#include <string.h>

size_t prism_token_counts_bytes(int n_rows, int vocab)
{
    size_t words = ((size_t)vocab + 31) / 32;
    return (size_t)n_rows * ((size_t)vocab * sizeof(int32_t) + words * sizeof(uint32_t));
}

int prism_token_counts_init(prism_token_counts_t *t, int n_rows, int vocab)
{
    memset(t, 0, sizeof *t);
    if (n_rows <= 0 || vocab <= 0) return PRISM_EINVAL;
    t->vocab = vocab;
    t->n_rows = n_rows;
    t->words = (vocab + 31) / 32;
    t->counts = prism_calloc((size_t)n_rows * vocab, sizeof *t->counts);
    t->prompt = prism_calloc((size_t)n_rows * t->words, sizeof *t->prompt);
    if (!t->counts || !t->prompt) {
        prism_token_counts_free(t);
        return PRISM_ENOMEM;
    }
    return PRISM_OK;
}

void prism_token_counts_free(prism_token_counts_t *t)
{
    prism_free(t->counts);
    prism_free(t->prompt);
    memset(t, 0, sizeof *t);
}

void prism_token_counts_reset(prism_token_counts_t *t, int row, const int32_t *prompt, size_t n_prompt)
{
    PRISM_ASSERT(row >= 0 && row < t->n_rows);
    memset(t->counts + (size_t)row * t->vocab, 0, (size_t)t->vocab * sizeof *t->counts);
    uint32_t *bits = t->prompt + (size_t)row * t->words;
    memset(bits, 0, (size_t)t->words * sizeof *bits);
    for (size_t i = 0; i < n_prompt; i++)
        if (prompt[i] >= 0 && prompt[i] < t->vocab) bits[prompt[i] >> 5] |= 1u << (prompt[i] & 31);
}

void prism_token_counts_add(prism_token_counts_t *t, int row, int32_t tok)
{
    PRISM_ASSERT(row >= 0 && row < t->n_rows);
    if (tok >= 0 && tok < t->vocab) t->counts[(size_t)row * t->vocab + tok]++;
}

void prism_apply_penalties(float *logits, int vocab, const int32_t *counts, const uint32_t *prompt_bits,
                           const prism_penalty_params_t *p)
{
    bool rep = p->repetition > 0.0f && p->repetition != 1.0f;
    float r = p->repetition, f = p->frequency, pr = p->presence;
    for (int i = 0; i < vocab; i++) {
        int32_t c = counts[i];
        bool in_prompt = (prompt_bits[i >> 5] >> (i & 31)) & 1u;
        if (!c && !in_prompt) continue;
        float x = logits[i];
        if (rep) x = x > 0.0f ? x / r : x * r;
        if (c) x -= f * (float)c + pr;
        logits[i] = x;
    }
}

void prism_apply_logit_bias(float *logits, int vocab, const int32_t *ids, const float *bias, int n)
{
    for (int i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < vocab) logits[ids[i]] += bias[i];
}
