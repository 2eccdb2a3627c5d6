/* The per-sequence record prefill and decode share (common/worker/seq.h): the Sampling message
 * is kept as the router sent it (within bounds) and forwarded unchanged, copies are safe, and the
 * finish / logprob rules are the ones both workers apply. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <string.h>

#include "worker/seq.h"

#define VOCAB 64

static prism_model_config_t config(void)
{
    prism_model_config_t c;
    memset(&c, 0, sizeof c);
    c.vocab = VOCAB;
    c.n_eos = 2;
    c.eos_token_ids[0] = 2;
    c.eos_token_ids[1] = 7;
    return c;
}

/* logits with one clear winner */
static void peaked(float *l, int32_t winner)
{
    for (int i = 0; i < VOCAB; i++) l[i] = (float)(i % 5) * 0.1f;
    l[winner] = 20.0f;
}

static Prism__Finish finish_for(prism_seq_t *s, prism_sampler_t *sm, const prism_model_config_t *c, int32_t winner,
                                int max_model_len)
{
    float l[VOCAB];
    peaked(l, winner);
    int32_t tok = prism_seq_sample(s, sm, l);
    assert_int_equal(tok, winner);
    Prism__Tokens t = PRISM__TOKENS__INIT;
    prism_seq_lp_msg_t lpm;
    prism_seq_tokens(s, &t, &tok, &lpm, sm, l, c, max_model_len);
    assert_int_equal(t.n_token_ids, 1);
    assert_int_equal(t.token_ids[0], winner);
    return t.finish;
}

static void test_sampling_forwarded_unchanged(void **state)
{
    int32_t stops[3] = {11, 12, 13};
    Prism__Sampling in = PRISM__SAMPLING__INIT;
    in.temperature = 0.7f;
    in.top_p = 0.9f;
    in.top_k = 40;
    in.has_seed = true;
    in.seed = 1234;
    in.max_tokens = 99;
    in.n_stop_token_ids = 3;
    in.stop_token_ids = stops;
    in.ignore_eos = true;
    in.logprobs = 3;
    prism_seq_t a, b;
    prism_seq_start(&a, 5, "router-a", &in, 17, prism_seq_seed(&in, 5));
    stops[0] = -1;                       /* the record keeps its own copy */
    b = a;                               /* and may be copied (prefill's staged KV) */
    memset(&a, 0xab, sizeof a);
    uint8_t buf[256];
    size_t n = prism__sampling__pack(prism_seq_sampling(&b), buf);
    Prism__Sampling *out = prism__sampling__unpack(NULL, n, buf);
    assert_non_null(out);
    assert_true(out->temperature == 0.7f && out->top_p == 0.9f && out->top_k == 40);
    assert_true(out->has_seed && out->seed == 1234 && out->max_tokens == 99 && out->ignore_eos);
    assert_int_equal(out->logprobs, 3);
    assert_int_equal(out->n_stop_token_ids, 3);
    assert_int_equal(out->stop_token_ids[0], 11);
    assert_int_equal(out->stop_token_ids[2], 13);
    assert_string_equal(b.router_id, "router-a");
    assert_int_equal(b.prompt_tokens, 17);
    /* same seed, same RNG state: seeded requests reproduce whichever worker samples */
    prism_seq_t c;
    prism_seq_start(&c, 6, "router-b", out, 17, prism_seq_seed(out, 6));
    assert_true(c.rng == b.rng);
    prism__sampling__free_unpacked(out, NULL);
}

static void test_bounds_and_empty_lists(void **state)
{
    int32_t many[40];
    for (int i = 0; i < 40; i++) many[i] = 100 + i;
    Prism__Sampling in = PRISM__SAMPLING__INIT;
    in.max_tokens = 4;
    in.n_stop_token_ids = 40;            /* more than a sequence keeps */
    in.stop_token_ids = many;
    in.logprobs = 500;
    prism_seq_t s;
    prism_seq_start(&s, 1, "r", &in, 3, 1);
    assert_int_equal(s.sampling.n_stop_token_ids, PRISM_SEQ_MAX_STOP_IDS);
    assert_int_equal(s.sampling.logprobs, PRISM_SEQ_MAX_TOP_LOGPROBS + 1);
    assert_int_equal(s.stop_ids[PRISM_SEQ_MAX_STOP_IDS - 1], 100 + PRISM_SEQ_MAX_STOP_IDS - 1);
    Prism__Sampling none = PRISM__SAMPLING__INIT;   /* no stop list at all: NULL pointer, 0 entries */
    none.max_tokens = 1;
    prism_seq_start(&s, 2, NULL, &none, 3, 1);
    assert_int_equal(s.sampling.n_stop_token_ids, 0);
    assert_string_equal(s.router_id, "");
    assert_null(prism_seq_check(&none));
    none.max_tokens = 0;
    assert_non_null(prism_seq_check(&none));
    assert_non_null(prism_seq_check(NULL));
}

static void test_finish_rules(void **state)
{
    prism_model_config_t c = config();
    prism_sampler_t sm;
    assert_int_equal(prism_sampler_init(&sm, VOCAB), PRISM_OK);
    int32_t stop[1] = {9};
    Prism__Sampling in = PRISM__SAMPLING__INIT;   /* greedy */
    in.max_tokens = 3;
    in.n_stop_token_ids = 1;
    in.stop_token_ids = stop;
    prism_seq_t s;

    prism_seq_start(&s, 1, "r", &in, 10, 1);
    s.len = 10;
    assert_int_equal(finish_for(&s, &sm, &c, 7, 1000), PRISM__FINISH__FINISH_STOP);   /* second EOS id */
    prism_seq_start(&s, 1, "r", &in, 10, 1);
    assert_int_equal(finish_for(&s, &sm, &c, 9, 1000), PRISM__FINISH__FINISH_STOP);   /* stop token id */
    in.ignore_eos = true;
    prism_seq_start(&s, 1, "r", &in, 10, 1);
    s.len = 10;
    assert_int_equal(finish_for(&s, &sm, &c, 2, 1000), PRISM__FINISH__FINISH_NONE);   /* EOS ignored */
    assert_int_equal(finish_for(&s, &sm, &c, 9, 1000), PRISM__FINISH__FINISH_STOP);   /* stop ids are not */
    prism_seq_start(&s, 1, "r", &in, 10, 1);
    s.len = 10;
    assert_int_equal(finish_for(&s, &sm, &c, 30, 1000), PRISM__FINISH__FINISH_NONE);
    assert_int_equal(finish_for(&s, &sm, &c, 30, 1000), PRISM__FINISH__FINISH_NONE);
    assert_int_equal(finish_for(&s, &sm, &c, 30, 1000), PRISM__FINISH__FINISH_LENGTH); /* max_tokens 3 */
    prism_seq_start(&s, 1, "r", &in, 10, 1);
    s.len = 99;                          /* the next token would not fit a 100-token context */
    assert_int_equal(finish_for(&s, &sm, &c, 30, 100), PRISM__FINISH__FINISH_LENGTH);
    prism_sampler_free(&sm);
}

static void test_logprobs_only_when_asked(void **state)
{
    prism_model_config_t c = config();
    prism_sampler_t sm;
    assert_int_equal(prism_sampler_init(&sm, VOCAB), PRISM_OK);
    float l[VOCAB];
    peaked(l, 30);
    Prism__Sampling in = PRISM__SAMPLING__INIT;
    in.max_tokens = 8;
    prism_seq_t s;
    prism_seq_start(&s, 1, "r", &in, 4, 1);
    int32_t tok = prism_seq_sample(&s, &sm, l);
    Prism__Tokens t = PRISM__TOKENS__INIT;
    prism_seq_lp_msg_t lpm;
    prism_seq_tokens(&s, &t, &tok, &lpm, &sm, l, &c, 100);
    assert_int_equal(t.n_logprobs, 0);
    assert_int_equal(t.prompt_tokens, 4);
    in.logprobs = 1 + 3;                 /* the token's logprob and 3 alternatives */
    prism_seq_start(&s, 1, "r", &in, 4, 1);
    tok = prism_seq_sample(&s, &sm, l);
    Prism__Tokens t2 = PRISM__TOKENS__INIT;
    prism_seq_tokens(&s, &t2, &tok, &lpm, &sm, l, &c, 100);
    assert_int_equal(t2.n_logprobs, 1);
    assert_int_equal(t2.logprobs[0]->n_top, 3);
    assert_int_equal(t2.logprobs[0]->top[0]->token_id, 30);
    assert_true(t2.logprobs[0]->logprob > -1e-3f);
    prism_sampler_free(&sm);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sampling_forwarded_unchanged),
        cmocka_unit_test(test_bounds_and_empty_lists),
        cmocka_unit_test(test_finish_rules),
        cmocka_unit_test(test_logprobs_only_when_asked),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
