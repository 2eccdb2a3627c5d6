#include "sample/sample.h"

#include <math.h>
#include <string.h>

int prism_sampler_init(prism_sampler_t *s, int vocab)
{
    s->vocab = vocab;
    s->prob = prism_malloc(sizeof(float) * (size_t)vocab);
    s->idx = prism_malloc(sizeof(int32_t) * (size_t)vocab);
    if (!s->prob || !s->idx) {
        prism_sampler_free(s);
        return PRISM_ENOMEM;
    }
    return PRISM_OK;
}

void prism_sampler_free(prism_sampler_t *s)
{
    prism_free(s->prob);
    prism_free(s->idx);
    s->prob = NULL;
    s->idx = NULL;
}

uint64_t prism_rng_seed(uint64_t seed)
{
    uint64_t z = seed + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return z ? z : 0x2545F4914F6CDD1Dull;
}

double prism_rng_uniform(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return (double)((x * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
}

static int32_t argmax(const float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;  /* first maximum wins, as torch.argmax */
    return best;
}

/* Sorts idx[0..n) by prob descending (ties: lower id first) — heap-free quicksort on indices. */
static void sort_desc(const float *prob, int32_t *idx, int lo, int hi)
{
    while (hi - lo > 16) {
        float pv = prob[idx[(lo + hi) / 2]];
        int32_t pid = idx[(lo + hi) / 2];
        int i = lo, j = hi - 1;
        while (i <= j) {
            while (prob[idx[i]] > pv || (prob[idx[i]] == pv && idx[i] < pid)) i++;
            while (prob[idx[j]] < pv || (prob[idx[j]] == pv && idx[j] > pid)) j--;
            if (i <= j) {
                int32_t t = idx[i]; idx[i] = idx[j]; idx[j] = t;
                i++; j--;
            }
        }
        if (j - lo < hi - i) { sort_desc(prob, idx, lo, j + 1); lo = i; }
        else { sort_desc(prob, idx, i, hi); hi = j + 1; }
    }
    for (int i = lo + 1; i < hi; i++) {
        int32_t v = idx[i];
        int j = i - 1;
        while (j >= lo && (prob[idx[j]] < prob[v] || (prob[idx[j]] == prob[v] && idx[j] > v))) {
            idx[j + 1] = idx[j];
            j--;
        }
        idx[j + 1] = v;
    }
}

/* Moves the k largest entries to idx[0..k) (unordered): quickselect. */
static void select_top(const float *prob, int32_t *idx, int n, int k)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        float pv = prob[idx[(lo + hi) / 2]];
        int i = lo, j = hi;
        while (i <= j) {
            while (prob[idx[i]] > pv) i++;
            while (prob[idx[j]] < pv) j--;
            if (i <= j) {
                int32_t t = idx[i]; idx[i] = idx[j]; idx[j] = t;
                i++; j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

int32_t prism_sample(prism_sampler_t *s, const float *logits, const prism_sample_params_t *p, uint64_t *rng)
{
    int n = s->vocab;
    /* Below PRISM_SAMPLE_MIN_TEMPERATURE (and for NaN) sampling is greedy, as in vLLM: 1/T would
     * overflow to inf near 1e-38, turn every probability into NaN and pick the least likely token. */
    if (!(p->temperature >= PRISM_SAMPLE_MIN_TEMPERATURE) || p->top_k == 1)
        return argmax(logits, n);

    /* Softmax of logits / T over the candidates. */
    float mx = logits[argmax(logits, n)];
    float inv_t = 1.0f / p->temperature;
    for (int i = 0; i < n; i++) {
        s->idx[i] = i;
        s->prob[i] = expf((logits[i] - mx) * inv_t);
    }
    int m = n;
    if (p->top_k > 0 && p->top_k < n) {
        select_top(s->prob, s->idx, n, p->top_k);
        m = p->top_k;
    }
    bool sorted = false;
    if (p->top_p > 0.0f && p->top_p < 1.0f) {
        sort_desc(s->prob, s->idx, 0, m);
        sorted = true;
        double total = 0;
        for (int i = 0; i < m; i++) total += s->prob[s->idx[i]];
        /* Keep the smallest prefix whose mass reaches top_p (always at least one token). */
        double cum = 0, limit = p->top_p * total;
        int keep = m;
        for (int i = 0; i < m; i++) {
            cum += s->prob[s->idx[i]];
            if (cum >= limit) { keep = i + 1; break; }
        }
        m = keep;
    }
    if (!sorted) sort_desc(s->prob, s->idx, 0, m);  /* a fixed order makes seeded runs reproducible */
    double total = 0;
    for (int i = 0; i < m; i++) total += s->prob[s->idx[i]];
    double r = prism_rng_uniform(rng) * total, cum = 0;
    for (int i = 0; i < m; i++) {
        cum += s->prob[s->idx[i]];
        if (r < cum) return s->idx[i];
    }
    return s->idx[m - 1];
}

void prism_logprobs(prism_sampler_t *s, const float *logits, int32_t chosen, int n_top,
                    float *chosen_lp, int32_t *top_ids, float *top_lps)
{
    int n = s->vocab;
    double mx = logits[argmax(logits, n)], sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - mx);
    double lse = mx + log(sum);
    float lp = (float)((double)logits[chosen] - lse);
    *chosen_lp = isfinite(lp) ? lp : -9999.0f;
    if (n_top <= 0) return;
    if (n_top > n) n_top = n;
    for (int i = 0; i < n; i++) {
        s->idx[i] = i;
        s->prob[i] = logits[i];
    }
    select_top(s->prob, s->idx, n, n_top);
    sort_desc(s->prob, s->idx, 0, n_top);
    for (int i = 0; i < n_top; i++) {
        top_ids[i] = s->idx[i];
        float v = (float)((double)logits[s->idx[i]] - lse);
        top_lps[i] = isfinite(v) ? v : -9999.0f;
    }
}
