/* Unit tests: sampling (greedy, temperature, top-k, top-p, seeded reproducibility) and logprobs. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <string.h>

#include "sample/sample.h"

#define V 50

static void fill(float *l)
{
    for (int i = 0; i < V; i++) l[i] = (float)((i * 37) % V) * 0.1f;  /* a permutation of 0..4.9 */
}

static void test_greedy(void **state)
{
    prism_sampler_t s;
    assert_int_equal(prism_sampler_init(&s, V), PRISM_OK);
    float l[V];
    fill(l);
    int best = 0;
    for (int i = 1; i < V; i++) if (l[i] > l[best]) best = i;
    uint64_t rng = prism_rng_seed(1);
    prism_sample_params_t p = {0.0f, 1.0f, -1};
    assert_int_equal(prism_sample(&s, l, &p, &rng), best);
    prism_sample_params_t k1 = {1.0f, 1.0f, 1};
    assert_int_equal(prism_sample(&s, l, &k1, &rng), best);
    /* ties: first index wins, as torch.argmax */
    float t[V] = {0};
    t[7] = t[3] = 5;
    assert_int_equal(prism_sample(&s, t, &p, &rng), 3);
    prism_sampler_free(&s);
}

/* Finding 17: 0 < T < ~1e-38 made 1/T infinite, every probability NaN, and the sampler returned the
 * LEAST likely token. Tiny, denormal and NaN temperatures must act as greedy (vLLM: T < 1e-5). */
static void test_tiny_temperature_is_greedy(void **state)
{
    prism_sampler_t s;
    assert_int_equal(prism_sampler_init(&s, V), PRISM_OK);
    float l[V];
    fill(l);
    int best = 0;
    for (int i = 1; i < V; i++) if (l[i] > l[best]) best = i;
    const float temps[] = {1e-39f, 1e-45f, 1e-30f, 1e-6f, NAN};
    for (size_t k = 0; k < sizeof(temps) / sizeof(temps[0]); k++) {
        for (int seed = 0; seed < 20; seed++) {
            uint64_t rng = prism_rng_seed((uint64_t)seed);
            prism_sample_params_t p = {temps[k], 1.0f, -1};
            assert_int_equal(prism_sample(&s, l, &p, &rng), best);
            prism_sample_params_t pp = {temps[k], 0.9f, 10};
            assert_int_equal(prism_sample(&s, l, &pp, &rng), best);
        }
    }
    prism_sampler_free(&s);
}

static void test_topk_topp_support(void **state)
{
    prism_sampler_t s;
    prism_sampler_init(&s, V);
    float l[V];
    fill(l);
    /* the 5 largest logits */
    int order[V];
    for (int i = 0; i < V; i++) order[i] = i;
    for (int i = 0; i < V; i++)
        for (int j = i + 1; j < V; j++)
            if (l[order[j]] > l[order[i]]) { int x = order[i]; order[i] = order[j]; order[j] = x; }
    uint64_t rng = prism_rng_seed(7);
    prism_sample_params_t pk = {1.0f, 1.0f, 5};
    for (int it = 0; it < 2000; it++) {
        int t = prism_sample(&s, l, &pk, &rng);
        bool in = false;
        for (int k = 0; k < 5; k++) in |= t == order[k];
        assert_true(in);
    }
    /* top_p tiny: only the best token survives */
    prism_sample_params_t pp = {1.0f, 1e-6f, -1};
    for (int it = 0; it < 200; it++) assert_int_equal(prism_sample(&s, l, &pp, &rng), order[0]);
    /* top_p 0.5 at temperature 1: the kept set is the smallest prefix with mass >= 0.5 */
    double z = 0, mx = l[order[0]];
    for (int i = 0; i < V; i++) z += exp(l[i] - mx);
    double cum = 0;
    int keep = 0;
    while (cum < 0.5 * z) cum += exp(l[order[keep++]] - mx);
    prism_sample_params_t ph = {1.0f, 0.5f, -1};
    int hist[V] = {0};
    for (int it = 0; it < 4000; it++) hist[prism_sample(&s, l, &ph, &rng)]++;
    for (int i = keep; i < V; i++) assert_int_equal(hist[order[i]], 0);
    for (int i = 0; i < keep; i++) assert_true(hist[order[i]] > 0);
    prism_sampler_free(&s);
}

static void test_distribution_matches_softmax(void **state)
{
    prism_sampler_t s;
    prism_sampler_init(&s, 4);
    float l[4] = {0.0f, 1.0f, 2.0f, 0.5f};
    uint64_t rng = prism_rng_seed(99);
    prism_sample_params_t p = {0.7f, 1.0f, -1};
    int hist[4] = {0};
    const int N = 40000;
    for (int i = 0; i < N; i++) hist[prism_sample(&s, l, &p, &rng)]++;
    double z = 0;
    for (int i = 0; i < 4; i++) z += exp(l[i] / 0.7);
    for (int i = 0; i < 4; i++) {
        double want = exp(l[i] / 0.7) / z, got = (double)hist[i] / N;
        assert_true(fabs(want - got) < 0.015);
    }
    prism_sampler_free(&s);
}

static void test_seeded_reproducible(void **state)
{
    prism_sampler_t s;
    prism_sampler_init(&s, V);
    float l[V];
    fill(l);
    prism_sample_params_t p = {0.9f, 0.95f, 20};
    int a[64], b[64];
    uint64_t r1 = prism_rng_seed(42), r2 = prism_rng_seed(42), r3 = prism_rng_seed(43);
    int diff = 0;
    for (int i = 0; i < 64; i++) a[i] = prism_sample(&s, l, &p, &r1);
    for (int i = 0; i < 64; i++) b[i] = prism_sample(&s, l, &p, &r2);
    for (int i = 0; i < 64; i++) diff += prism_sample(&s, l, &p, &r3) != a[i];
    assert_memory_equal(a, b, sizeof(a));
    assert_true(diff > 0);
    prism_sampler_free(&s);
}

static void test_logprobs(void **state)
{
    prism_sampler_t s;
    prism_sampler_init(&s, 5);
    float l[5] = {1.0f, 3.0f, -INFINITY, 2.0f, 0.0f};
    double z = exp(1) + exp(3) + exp(2) + exp(0);
    float lp;
    int32_t ids[3];
    float lps[3];
    prism_logprobs(&s, l, 3, 3, &lp, ids, lps);
    assert_true(fabsf(lp - (float)(2 - log(z))) < 1e-5f);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 3);
    assert_int_equal(ids[2], 0);
    assert_true(fabsf(lps[0] - (float)(3 - log(z))) < 1e-5f);
    prism_logprobs(&s, l, 2, 0, &lp, ids, lps);
    assert_true(lp == -9999.0f);  /* -inf floored as OpenAI clients expect */
    prism_sampler_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy), cmocka_unit_test(test_tiny_temperature_is_greedy),
        cmocka_unit_test(test_topk_topp_support),
        cmocka_unit_test(test_distribution_matches_softmax), cmocka_unit_test(test_seeded_reproducible),
        cmocka_unit_test(test_logprobs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
