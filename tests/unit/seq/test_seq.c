/* The per-sequence record prefill and decode share (common/seq/seq.h): the Sampling message
 * is kept as the router sent it (within bounds) and forwarded unchanged, copies are safe, and the
 * finish / logprob rules are the ones both workers apply. */
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "seq/seq.h"

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

static Prism__Finish finish_for(prism_seq_t *s, prism_seq_sampler_t *sm, const prism_model_config_t *c, int32_t winner,
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
    assert_null(prism_seq_start(&a, NULL, 5, "router-a", &in, 17, prism_seq_seed(&in, 5)));
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
    assert_null(prism_seq_start(&c, NULL, 6, "router-b", out, 17, prism_seq_seed(out, 6)));
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
    assert_non_null(prism_seq_start(&s, NULL, 1, "r", &in, 3, 1));   /* refused, not cut */
    assert_false(s.used);
    in.n_stop_token_ids = PRISM_SEQ_MAX_STOP_IDS;
    in.logprobs = PRISM_SEQ_MAX_TOP_LOGPROBS + 1;
    assert_null(prism_seq_start(&s, NULL, 1, "r", &in, 3, 1));
    assert_int_equal(s.sampling.n_stop_token_ids, PRISM_SEQ_MAX_STOP_IDS);
    assert_int_equal(s.sampling.logprobs, PRISM_SEQ_MAX_TOP_LOGPROBS + 1);
    assert_int_equal(s.stop_ids[PRISM_SEQ_MAX_STOP_IDS - 1], 100 + PRISM_SEQ_MAX_STOP_IDS - 1);
    Prism__Sampling none = PRISM__SAMPLING__INIT;   /* no stop list at all: NULL pointer, 0 entries */
    none.max_tokens = 1;
    assert_null(prism_seq_start(&s, NULL, 2, NULL, &none, 3, 1));
    assert_int_equal(s.sampling.n_stop_token_ids, 0);
    assert_string_equal(s.router_id, "");
    assert_null(prism_seq_check(&none, 4096, 2048));
    none.max_tokens = 0;
    assert_non_null(prism_seq_check(&none, 4096, 2048));
    assert_non_null(prism_seq_start(&s, NULL, 2, NULL, &none, 3, 1));
    assert_false(s.used);
    assert_non_null(prism_seq_check(NULL, 4096, 2048));
    none.max_tokens = 1;
    none.n = PRISM_SEQ_MAX_N + 1;
    assert_non_null(prism_seq_check(&none, 4096, 2048));
    none.n = 2;
    int32_t ids[2] = {1, 2};
    float vals[2] = {5, 101};
    none.n_logit_bias_ids = 2;
    none.logit_bias_ids = ids;
    none.n_logit_bias_values = 1;            /* ids and values must pair up */
    none.logit_bias_values = vals;
    assert_non_null(prism_seq_check(&none, 4096, 2048));
    none.n_logit_bias_values = 2;            /* 101 is out of [-100, 100] */
    assert_non_null(prism_seq_check(&none, 4096, 2048));
    vals[1] = -100;
    assert_null(prism_seq_check(&none, 4096, 2048));
    none.guide = NULL;
}

/* Finding 4 of issue 8: decode trusted Kv.sampling; every field is now checked against the model
 * and context before a sequence starts. */
static void test_check_bounds_every_field(void **state)
{
    (void)state;
    int32_t stops[PRISM_SEQ_MAX_STOP_IDS + 1] = {0};
    Prism__Sampling s = PRISM__SAMPLING__INIT;
    s.max_tokens = 2048;
    s.top_p = 1;
    assert_null(prism_seq_check(&s, 4096, 2048));
    s.max_tokens = 2049;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    s.max_tokens = 0xFFFFFFFFu;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    s.max_tokens = 0x80000000u;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    s.max_tokens = 8;
    s.temperature = NAN;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    s.temperature = -1;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    s.temperature = INFINITY;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    s.temperature = 0.7f;
    s.top_p = 1.5f;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    s.top_p = NAN;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    s.top_p = 0.9f;
    s.stop_token_ids = stops;
    s.n_stop_token_ids = PRISM_SEQ_MAX_STOP_IDS;
    assert_null(prism_seq_check(&s, 4096, 2048));
    s.n_stop_token_ids = PRISM_SEQ_MAX_STOP_IDS + 1;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    s.n_stop_token_ids = 1;
    stops[0] = 4096;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    stops[0] = -1;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
    stops[0] = 4095;
    s.logprobs = PRISM_SEQ_MAX_TOP_LOGPROBS + 1;
    assert_null(prism_seq_check(&s, 4096, 2048));
    s.logprobs = PRISM_SEQ_MAX_TOP_LOGPROBS + 2;
    assert_non_null(prism_seq_check(&s, 4096, 2048));
}

static void test_finish_rules(void **state)
{
    prism_model_config_t c = config();
    prism_seq_sampler_t sm;
    assert_int_equal(prism_seq_sampler_init(&sm, &c, NULL, 1), PRISM_OK);
    int32_t stop[1] = {9};
    Prism__Sampling in = PRISM__SAMPLING__INIT;   /* greedy */
    in.max_tokens = 3;
    in.n_stop_token_ids = 1;
    in.stop_token_ids = stop;
    prism_seq_t s;

    prism_seq_start(&s, &sm, 1, "r", &in, 10, 1);
    s.len = 10;
    assert_int_equal(finish_for(&s, &sm, &c, 7, 1000), PRISM__FINISH__FINISH_STOP);   /* second EOS id */
    prism_seq_start(&s, &sm, 1, "r", &in, 10, 1);
    assert_int_equal(finish_for(&s, &sm, &c, 9, 1000), PRISM__FINISH__FINISH_STOP);   /* stop token id */
    in.ignore_eos = true;
    prism_seq_start(&s, &sm, 1, "r", &in, 10, 1);
    s.len = 10;
    assert_int_equal(finish_for(&s, &sm, &c, 2, 1000), PRISM__FINISH__FINISH_NONE);   /* EOS ignored */
    assert_int_equal(finish_for(&s, &sm, &c, 9, 1000), PRISM__FINISH__FINISH_STOP);   /* stop ids are not */
    prism_seq_start(&s, &sm, 1, "r", &in, 10, 1);
    s.len = 10;
    assert_int_equal(finish_for(&s, &sm, &c, 30, 1000), PRISM__FINISH__FINISH_NONE);
    assert_int_equal(finish_for(&s, &sm, &c, 30, 1000), PRISM__FINISH__FINISH_NONE);
    assert_int_equal(finish_for(&s, &sm, &c, 30, 1000), PRISM__FINISH__FINISH_LENGTH); /* max_tokens 3 */
    prism_seq_start(&s, &sm, 1, "r", &in, 10, 1);
    s.len = 99;                          /* the next token would not fit a 100-token context */
    assert_int_equal(finish_for(&s, &sm, &c, 30, 100), PRISM__FINISH__FINISH_LENGTH);
    prism_seq_sampler_free(&sm);
}

static void test_logprobs_only_when_asked(void **state)
{
    prism_model_config_t c = config();
    prism_seq_sampler_t sm;
    assert_int_equal(prism_seq_sampler_init(&sm, &c, NULL, 1), PRISM_OK);
    float l[VOCAB];
    peaked(l, 30);
    Prism__Sampling in = PRISM__SAMPLING__INIT;
    in.max_tokens = 8;
    prism_seq_t s;
    prism_seq_start(&s, &sm, 1, "r", &in, 4, 1);
    int32_t tok = prism_seq_sample(&s, &sm, l);
    Prism__Tokens t = PRISM__TOKENS__INIT;
    prism_seq_lp_msg_t lpm;
    prism_seq_tokens(&s, &t, &tok, &lpm, &sm, l, &c, 100);
    assert_int_equal(t.n_logprobs, 0);
    assert_int_equal(t.prompt_tokens, 4);
    in.logprobs = 1 + 3;                 /* the token's logprob and 3 alternatives */
    prism_seq_start(&s, &sm, 1, "r", &in, 4, 1);
    tok = prism_seq_sample(&s, &sm, l);
    Prism__Tokens t2 = PRISM__TOKENS__INIT;
    prism_seq_tokens(&s, &t2, &tok, &lpm, &sm, l, &c, 100);
    assert_int_equal(t2.n_logprobs, 1);
    assert_int_equal(t2.logprobs[0]->n_top, 3);
    assert_int_equal(t2.logprobs[0]->top[0]->token_id, 30);
    assert_true(t2.logprobs[0]->logprob > -1e-3f);
    prism_seq_sampler_free(&sm);
}

/* ------------------------------------------------------------------ logits processors */

static Prism__Sampling greedy_sampling(void)
{
    Prism__Sampling in = PRISM__SAMPLING__INIT;
    in.max_tokens = 16;
    return in;
}

/* logit_bias changes what is sampled, not the reported logprobs (raw, as vLLM's default). */
static void test_logit_bias(void **state)
{
    prism_model_config_t c = config();
    prism_seq_sampler_t sm;
    assert_int_equal(prism_seq_sampler_init(&sm, &c, NULL, 2), PRISM_OK);
    float l[VOCAB];
    peaked(l, 30);
    int32_t ids[2] = {30, 5};
    float down[2] = {-100, 0}, up[2] = {0, 100};
    Prism__Sampling in = greedy_sampling();
    in.logprobs = 1;
    in.n_logit_bias_ids = in.n_logit_bias_values = 2;
    in.logit_bias_ids = ids;
    in.logit_bias_values = down;
    prism_seq_t s;
    assert_null(prism_seq_start(&s, &sm, 1, "r", &in, 4, 1));
    assert_null(prism_seq_attach(&s, &sm, 1, NULL, 0, NULL, 0));
    int32_t tok = prism_seq_sample(&s, &sm, l);
    assert_int_not_equal(tok, 30);                     /* the greedy winner is banned */
    assert_int_equal(tok, 4);                          /* next best: (i % 5) * 0.1, first index wins */
    Prism__Tokens t = PRISM__TOKENS__INIT;
    prism_seq_lp_msg_t lpm;
    prism_seq_tokens(&s, &t, &tok, &lpm, &sm, l, &c, 100);
    assert_true(t.logprobs[0]->logprob < -15.0f);      /* raw logits: 4 is unlikely */
    in.logit_bias_values = up;
    assert_null(prism_seq_start(&s, &sm, 1, "r", &in, 4, 1));
    assert_null(prism_seq_attach(&s, &sm, 1, NULL, 0, NULL, 0));
    assert_int_equal(prism_seq_sample(&s, &sm, l), 5);
    /* the forwarded message carries the bias unchanged */
    uint8_t buf[256];
    size_t n = prism__sampling__pack(prism_seq_sampling(&s), buf);
    Prism__Sampling *out = prism__sampling__unpack(NULL, n, buf);
    assert_non_null(out);
    assert_int_equal(out->n_logit_bias_ids, 2);
    assert_int_equal(out->logit_bias_ids[1], 5);
    assert_true(out->logit_bias_values[1] == 100.0f);
    prism__sampling__free_unpacked(out, NULL);
    /* an id outside the vocabulary is refused at start */
    ids[1] = VOCAB;
    assert_non_null(prism_seq_start(&s, &sm, 1, "r", &in, 4, 1));
    prism_seq_sampler_free(&sm);
}

/* Penalties read the slot's token counts: the prompt (repetition) and what was generated
 * (frequency, presence), counted at attach and at every sample. */
static void test_penalties(void **state)
{
    prism_model_config_t c = config();
    prism_seq_sampler_t sm;
    assert_int_equal(prism_seq_sampler_init(&sm, &c, NULL, 2), PRISM_OK);
    float l[VOCAB];
    for (int i = 0; i < VOCAB; i++) l[i] = 0;
    l[30] = 1.0f;
    l[31] = 0.8f;
    int32_t prompt[3] = {30, 30, 12};
    prism_seq_t s;
    Prism__Sampling in = greedy_sampling();
    in.repetition_penalty = 1.5f;                    /* 1.0 / 1.5 < 0.8 */
    assert_null(prism_seq_start(&s, &sm, 1, "r", &in, 3, 1));
    assert_true(prism_seq_needs_prompt(&s));
    assert_null(prism_seq_attach(&s, &sm, 0, prompt, 3, NULL, 0));
    assert_int_equal(prism_seq_sample(&s, &sm, l), 31);
    /* the same without 30 in the prompt: the raw winner */
    int32_t other[1] = {12};
    assert_null(prism_seq_start(&s, &sm, 1, "r", &in, 1, 1));
    assert_null(prism_seq_attach(&s, &sm, 0, other, 1, NULL, 0));
    assert_int_equal(prism_seq_sample(&s, &sm, l), 30);
    /* frequency: 30 generated once (decode gets the first token at attach) costs 0.3 > 0.2 */
    in = greedy_sampling();
    in.frequency_penalty = 0.3f;
    assert_null(prism_seq_start(&s, &sm, 1, "r", &in, 3, 1));
    assert_false(prism_seq_needs_prompt(&s));
    int32_t first = 30;
    assert_null(prism_seq_attach(&s, &sm, 1, NULL, 0, &first, 1));
    assert_int_equal(prism_seq_sample(&s, &sm, l), 31);
    /* ...and then 31 once: 1.0 - 0.3 > 0.8 - 0.3 */
    assert_int_equal(prism_seq_sample(&s, &sm, l), 30);
    /* presence: once is enough, twice is no worse */
    in = greedy_sampling();
    in.presence_penalty = 0.25f;
    assert_null(prism_seq_start(&s, &sm, 1, "r", &in, 3, 1));
    assert_null(prism_seq_attach(&s, &sm, 1, NULL, 0, &first, 1));
    assert_int_equal(prism_seq_sample(&s, &sm, l), 31);
    assert_int_equal(prism_seq_sample(&s, &sm, l), 30);   /* both penalised once: 0.75 > 0.55 */
    /* a slot taken by another sequence starts clean: no count carried over */
    in = greedy_sampling();
    in.presence_penalty = 0.25f;
    assert_null(prism_seq_start(&s, &sm, 1, "r", &in, 3, 1));
    assert_null(prism_seq_attach(&s, &sm, 1, NULL, 0, NULL, 0));
    assert_int_equal(prism_seq_sample(&s, &sm, l), 30);
    prism_seq_sampler_free(&sm);
}

/* n sequences from one prompt: one RNG stream each, choice 0 samples exactly as n = 1 would. */
static void test_first_tokens_of_n(void **state)
{
    prism_model_config_t c = config();
    prism_seq_sampler_t sm;
    assert_int_equal(prism_seq_sampler_init(&sm, &c, NULL, 1), PRISM_OK);
    float l[VOCAB];
    for (int i = 0; i < VOCAB; i++) l[i] = (float)(i % 7) * 0.05f;   /* flat: sampling varies */
    l[2] = l[7] = -50.0f;                                               /* EOS unlikely */
    Prism__Sampling in = greedy_sampling();
    in.temperature = 1.0f;
    in.has_seed = true;
    in.seed = 99;
    prism_seq_t one, many;
    assert_null(prism_seq_start(&one, &sm, 7, "r", &in, 5, prism_seq_seed(&in, 7)));
    assert_null(prism_seq_attach(&one, &sm, 0, NULL, 0, NULL, 0));
    one.len = 5;
    Prism__Tokens *t;
    assert_int_equal(prism_seq_first_tokens(&one, &sm, l, &c, 100, &t), 1);
    int32_t tok0 = t[0].token_ids[0];
    assert_int_equal(one.n_fork, 1);
    assert_int_equal(one.fork_first[0], tok0);
    in.n = 6;
    assert_null(prism_seq_start(&many, &sm, 7, "r", &in, 5, prism_seq_seed(&in, 7)));
    assert_int_equal(prism_seq_n(&many), 6);
    assert_null(prism_seq_attach(&many, &sm, 0, NULL, 0, NULL, 0));
    many.len = 5;
    assert_int_equal(prism_seq_first_tokens(&many, &sm, l, &c, 100, &t), 6);
    assert_int_equal(t[0].token_ids[0], tok0);
    assert_true(many.fork_rng[0] == one.fork_rng[0]);
    int distinct = 0;
    for (int i = 0; i < 6; i++) {
        assert_int_equal(t[i].index, i);
        assert_int_equal(t[i].finish, PRISM__FINISH__FINISH_NONE);
        assert_int_equal(many.fork_index[i], i);
        assert_int_equal(many.fork_first[i], t[i].token_ids[0]);
        for (int k = 0; k < i; k++) assert_true(many.fork_rng[k] != many.fork_rng[i]);
        distinct += i > 0 && t[i].token_ids[0] != t[0].token_ids[0];
    }
    assert_true(distinct > 0);                           /* 5 draws over ~60 tokens */
    /* the record itself is left as choice 0 with the request's RNG: nothing advanced twice */
    assert_int_equal(many.index, 0);
    /* a sequence that ends at its first token does not go on to decode */
    peaked(l, 7);
    in.temperature = 0;
    assert_null(prism_seq_start(&many, &sm, 7, "r", &in, 5, 1));
    assert_null(prism_seq_attach(&many, &sm, 0, NULL, 0, NULL, 0));
    assert_int_equal(prism_seq_first_tokens(&many, &sm, l, &c, 100, &t), 6);
    for (int i = 0; i < 6; i++) assert_int_equal(t[i].finish, PRISM__FINISH__FINISH_STOP);
    assert_int_equal(many.n_fork, 0);
    prism_seq_sampler_free(&sm);
}

/* ------------------------------------------------------------------ guided sequences (real tokenizer) */

#include "tokenizer/tokenizer.h"

#define MODEL PRISM_SOURCE_DIR "/models/prism-tiny-llava"

static void text_of(prism_tokenizer_t *tok, const int32_t *ids, int n, char *out, size_t cap)
{
    prism_buf_t b = {0};
    prism_tokenizer_decode(tok, ids, (size_t)n, true, &b);
    snprintf(out, cap, "%.*s", (int)b.len, b.data ? b.data : "");
    prism_buf_free(&b);
}

/* A guide is compiled from the Sampling message against the worker's own vocabulary, masks what
 * is sampled, travels on unchanged, and its matcher is replayed on the first token in decode. */
static void test_guided_choice(void **state)
{
    prism_model_config_t c;
    char err[256];
    assert_int_equal(prism_model_config_load(MODEL, &c, err, sizeof err), PRISM_OK);
    prism_tokenizer_t *tok;
    assert_int_equal(prism_tokenizer_load(MODEL "/tokenizer.json", &tok, err, sizeof err), PRISM_OK);
    size_t base = prism_mem_used();
    prism_seq_sampler_t sm;
    assert_int_equal(prism_seq_sampler_init(&sm, &c, MODEL, 2), PRISM_OK);
    assert_non_null(sm.gvocab);
    float *l = malloc(sizeof(float) * (size_t)c.vocab);
    Prism__Guide g = PRISM__GUIDE__INIT;
    g.kind = PRISM__GUIDE_KIND__GUIDE_CHOICE;
    g.text = "[\"purple elephant\", \"no\"]";
    Prism__Sampling in = greedy_sampling();
    in.max_tokens = 40;
    in.temperature = 1.0f;
    in.guide = &g;
    uint64_t seed = 1;
    for (int round = 0; round < 6; round++) {
        /* prefill: first token from slot 0 */
        prism_seq_t pf, dc;
        in.seed = (uint64_t)round;
        in.has_seed = true;
        assert_null(prism_seq_start(&pf, &sm, 3, "r", &in, 4, prism_seq_seed(&in, 3)));
        assert_non_null(pf.guide);
        assert_null(prism_seq_attach(&pf, &sm, 0, NULL, 0, NULL, 0));
        for (int i = 0; i < c.vocab; i++) {       /* arbitrary logits: the mask decides */
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            l[i] = (float)((seed >> 33) % 1000) * 0.01f;
        }
        pf.len = 4;
        Prism__Tokens *t;
        assert_int_equal(prism_seq_first_tokens(&pf, &sm, l, &c, 1000, &t), 1);
        int32_t ids[64];
        int n = 0;
        ids[n++] = t[0].token_ids[0];
        /* forwarded to decode as text, compiled there from the cache */
        uint8_t buf[512];
        size_t len = prism__sampling__pack(prism_seq_sampling(&pf), buf);
        Prism__Sampling *fw = prism__sampling__unpack(NULL, len, buf);
        assert_non_null(fw);
        assert_non_null(fw->guide);
        assert_string_equal(fw->guide->text, g.text);
        assert_null(prism_seq_start(&dc, &sm, 3, "r", fw, 4, pf.fork_rng[0]));
        prism__sampling__free_unpacked(fw, NULL);
        prism_seq_detach(&pf);
        dc.generated = 1;
        assert_null(prism_seq_attach(&dc, &sm, 1, NULL, 0, ids, 1));
        Prism__Finish fin = t[0].finish;
        while (fin == PRISM__FINISH__FINISH_NONE && n < 40) {
            for (int i = 0; i < c.vocab; i++) {
                seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                l[i] = (float)((seed >> 33) % 1000) * 0.01f;
            }
            ids[n] = prism_seq_sample(&dc, &sm, l);
            Prism__Tokens tt = PRISM__TOKENS__INIT;
            prism_seq_lp_msg_t lpm;
            prism_seq_tokens(&dc, &tt, &ids[n], &lpm, &sm, l, &c, 1000);
            fin = tt.finish;
            n++;
        }
        assert_int_equal(fin, PRISM__FINISH__FINISH_STOP);
        char text[256];
        text_of(tok, ids, n, text, sizeof text);
        assert_true(!strcmp(text, "purple elephant") || !strcmp(text, "no"));
        prism_seq_detach(&dc);
        prism_seq_detach(&dc);                  /* idempotent */
    }
    prism_guide_cache_stats_t st;
    prism_guide_cache_stats(sm.guides, &st);
    assert_int_equal(st.misses, 1);             /* compiled once, found 11 times */
    assert_int_equal(st.hits, 11);
    /* a replayed token outside the grammar is refused */
    prism_seq_t s;
    assert_null(prism_seq_start(&s, &sm, 3, "r", &in, 4, 1));
    int32_t bad = c.eos_token_ids[0] == 5 ? 6 : 5;
    assert_non_null(prism_seq_attach(&s, &sm, 0, NULL, 0, &bad, 1));
    prism_seq_detach(&s);
    /* steady state: a guided request in a used slot allocates nothing */
    uint64_t allocs = prism_mem_alloc_count();
    assert_null(prism_seq_start(&s, &sm, 3, "r", &in, 4, 1));
    assert_null(prism_seq_attach(&s, &sm, 1, NULL, 0, NULL, 0));
    int32_t x = prism_seq_sample(&s, &sm, l);
    (void)x;
    prism_seq_detach(&s);
    assert_int_equal(prism_mem_alloc_count(), allocs);
    /* a malformed guide is refused at start, naming no field (the router already validated) */
    g.text = "[1, 2]";
    assert_non_null(prism_seq_start(&s, &sm, 3, "r", &in, 4, 1));
    /* without a tokenizer a worker refuses guided requests */
    prism_seq_sampler_t plain;
    assert_int_equal(prism_seq_sampler_init(&plain, &c, NULL, 1), PRISM_OK);
    g.text = "[\"a\"]";
    assert_non_null(prism_seq_start(&s, &plain, 3, "r", &in, 4, 1));
    prism_seq_sampler_free(&plain);
    free(l);
    prism_seq_sampler_free(&sm);
    assert_int_equal(prism_mem_used(), base);
    prism_tokenizer_free(tok);
}

/* ------------------------------------------------------------------ migration */

/* Step j's logits: varied, EOS out of reach. */
static void step_logits(float *l, int j)
{
    for (int i = 0; i < VOCAB; i++) l[i] = (float)((i * 7 + j * 13) % 11) * 0.3f;
    l[2] = l[7] = -50.0f;
}

/* Prefill (first token) then decode (the rest) as the workers run a sequence, from `from` tokens
 * generated before (a migrated request: in->generated = from, done = those tokens); writes the
 * tokens from there on into out[from..], and the RNG state after each into rng[]. Returns the
 * finish of the last one. */
static Prism__Finish run_seq(prism_seq_sampler_t *sm, const prism_model_config_t *c, const Prism__Sampling *in,
                             const int32_t *prompt, int n_prompt, int from, int32_t *out, uint64_t *rng)
{
    prism_seq_t pf, dc;
    assert_null(prism_seq_start(&pf, sm, 9, "r", in, n_prompt, prism_seq_seed(in, 9)));
    assert_null(prism_seq_attach(&pf, sm, 0, prompt, (size_t)n_prompt, out, (size_t)from));
    pf.len = n_prompt + from;
    float l[VOCAB];
    step_logits(l, from);
    Prism__Tokens *t;
    assert_int_equal(prism_seq_first_tokens(&pf, sm, l, c, 1000, &t), 1);
    out[from] = t[0].token_ids[0];
    Prism__Finish fin = t[0].finish;
    assert_int_equal(pf.n_fork, fin == PRISM__FINISH__FINISH_NONE);
    rng[from] = pf.n_fork ? pf.fork_rng[0] : 0;
    if (fin != PRISM__FINISH__FINISH_NONE) {
        prism_seq_detach(&pf);
        return fin;
    }
    /* decode: Kv carries the sampling, the RNG after the first token, the history */
    assert_null(prism_seq_start(&dc, sm, 9, "r", prism_seq_sampling(&pf), n_prompt, pf.fork_rng[0]));
    prism_seq_detach(&pf);
    dc.len = n_prompt + from;
    dc.generated = from + 1;
    assert_null(prism_seq_attach(&dc, sm, 1, prompt, (size_t)n_prompt, out, (size_t)from));
    assert_null(prism_seq_feed(&dc, sm, &out[from], 1));
    for (int j = from + 1; fin == PRISM__FINISH__FINISH_NONE; j++) {
        dc.len++;
        step_logits(l, j);
        out[j] = prism_seq_sample(&dc, sm, l);
        rng[j] = dc.rng;
        Prism__Tokens tt = PRISM__TOKENS__INIT;
        prism_seq_lp_msg_t lpm;
        prism_seq_tokens(&dc, &tt, &out[j], &lpm, sm, l, c, 1000);
        fin = tt.finish;
    }
    prism_seq_detach(&dc);
    return fin;
}

/* A request whose decode worker died goes on from Sampling.generated tokens: the new prefill
 * counts them for the penalties and advances the RNG past them (prism_seq_seed), the new decode
 * gets them as history; every token after that is the one the undisturbed run samples, and the
 * length finish comes at the same token. */
static void test_migrated_sequence_goes_on(void **state)
{
    prism_model_config_t c = config();
    prism_seq_sampler_t sm;
    assert_int_equal(prism_seq_sampler_init(&sm, &c, NULL, 2), PRISM_OK);
    int32_t prompt[5] = {10, 11, 12, 13, 14};
    enum { N = 30 };
    Prism__Sampling in = greedy_sampling();
    in.max_tokens = N;
    in.temperature = 1.0f;
    in.has_seed = true;
    in.seed = 42;
    in.presence_penalty = 1.5f;
    in.frequency_penalty = 0.5f;
    in.repetition_penalty = 1.3f;
    for (int greedy = 0; greedy < 2; greedy++) {
        in.temperature = greedy ? 0.0f : 1.0f;
        int32_t ref[N + 1], got[N + 1];
        uint64_t ref_rng[N + 1], got_rng[N + 1];
        in.generated = 0;
        assert_int_equal(run_seq(&sm, &c, &in, prompt, 5, 0, ref, ref_rng), PRISM__FINISH__FINISH_LENGTH);
        int distinct = 0;
        for (int j = 1; j < N; j++) distinct += ref[j] != ref[j - 1];
        assert_true(distinct > N / 2);          /* the penalties steer it: nothing trivially repeats */
        for (int k = 1; k < N; k++) {           /* migrated after k tokens */
            memcpy(got, ref, sizeof(int32_t) * (size_t)k);
            in.generated = (uint32_t)k;
            assert_null(prism_seq_check(&in, VOCAB, 1000));
            assert_int_equal(run_seq(&sm, &c, &in, prompt, 5, k, got, got_rng), PRISM__FINISH__FINISH_LENGTH);
            assert_memory_equal(got + k, ref + k, sizeof(int32_t) * (size_t)(N - k));
            /* the RNG after each token (but the last: a sequence that ends at prefill forks nothing) */
            if (!greedy && k < N - 1)
                assert_memory_equal(got_rng + k, ref_rng + k, sizeof(uint64_t) * (size_t)(N - 1 - k));
        }
    }
    /* without the history the penalties would be blind to the earlier tokens: a different token */
    {
        prism_seq_t s;
        float l[VOCAB];
        int32_t ref[N + 1];
        uint64_t ref_rng[N + 1];
        in.temperature = 0.0f;
        in.generated = 0;
        run_seq(&sm, &c, &in, prompt, 5, 0, ref, ref_rng);
        in.generated = 20;
        assert_null(prism_seq_start(&s, &sm, 9, "r", &in, 5, 1));
        assert_true(prism_seq_needs_history(&s));
        assert_null(prism_seq_attach(&s, &sm, 0, prompt, 5, NULL, 0));
        step_logits(l, 20);
        assert_int_not_equal(prism_seq_sample(&s, &sm, l), ref[20]);
        prism_seq_detach(&s);
    }
    /* no processors: decode needs no history */
    Prism__Sampling plain = greedy_sampling();
    plain.generated = 3;
    prism_seq_t s;
    assert_null(prism_seq_start(&s, &sm, 9, "r", &plain, 5, 1));
    assert_false(prism_seq_needs_history(&s));
    /* bounds: something left to generate, one sequence */
    plain.generated = plain.max_tokens;
    assert_non_null(prism_seq_check(&plain, VOCAB, 1000));
    plain.generated = 3;
    plain.n = 2;
    assert_non_null(prism_seq_check(&plain, VOCAB, 1000));
    prism_seq_sampler_free(&sm);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sampling_forwarded_unchanged),
        cmocka_unit_test(test_bounds_and_empty_lists),
        cmocka_unit_test(test_finish_rules),
        cmocka_unit_test(test_check_bounds_every_field),
        cmocka_unit_test(test_logprobs_only_when_asked),
        cmocka_unit_test(test_logit_bias),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_first_tokens_of_n),
        cmocka_unit_test(test_guided_choice),
        cmocka_unit_test(test_migrated_sequence_goes_on),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
