/* One generation sequence: see seq.h. */
#include "worker/seq.h"

#include <stdio.h>
#include <string.h>

const char *prism_seq_check(const Prism__Sampling *s)
{
    if (!s) return "malformed request: no sampling parameters";
    if (s->max_tokens == 0) return "max_tokens must be at least 1";
    return NULL;
}

void prism_seq_start(prism_seq_t *s, uint64_t rid, const char *router_id, const Prism__Sampling *sampling,
                     int prompt_tokens, uint64_t rng)
{
    memset(s, 0, sizeof *s);
    s->used = true;
    s->rid = rid;
    snprintf(s->router_id, sizeof s->router_id, "%s", router_id ? router_id : "");
    s->sampling = *sampling;
    s->sampling.base.n_unknown_fields = 0;    /* the copy points into no unpacked message */
    s->sampling.base.unknown_fields = NULL;
    s->sampling.n_stop_token_ids = PRISM_MIN(sampling->n_stop_token_ids, (size_t)PRISM_SEQ_MAX_STOP_IDS);
    if (s->sampling.n_stop_token_ids)
        memcpy(s->stop_ids, sampling->stop_token_ids, sizeof(int32_t) * s->sampling.n_stop_token_ids);
    s->sampling.stop_token_ids = NULL;
    s->sampling.logprobs = PRISM_MIN(sampling->logprobs, (uint32_t)PRISM_SEQ_MAX_TOP_LOGPROBS + 1);
    s->sp = (prism_sample_params_t){sampling->temperature, sampling->top_p, sampling->top_k};
    s->rng = rng;
    s->prompt_tokens = prompt_tokens;
}

uint64_t prism_seq_seed(const Prism__Sampling *sampling, uint64_t rid)
{
    return prism_rng_seed(sampling->has_seed ? sampling->seed : (rid ^ prism_now_ns()));
}

const Prism__Sampling *prism_seq_sampling(prism_seq_t *s)
{
    s->sampling.stop_token_ids = s->stop_ids;
    return &s->sampling;
}

int32_t prism_seq_sample(prism_seq_t *s, prism_sampler_t *sm, const float *logits)
{
    s->generated++;
    return prism_sample(sm, logits, &s->sp, &s->rng);
}

static bool is_stop_token(const prism_seq_t *s, const prism_model_config_t *cfg, int32_t tok)
{
    if (!s->sampling.ignore_eos)
        for (int i = 0; i < cfg->n_eos; i++)
            if (tok == cfg->eos_token_ids[i]) return true;
    for (size_t i = 0; i < s->sampling.n_stop_token_ids; i++)
        if (tok == s->stop_ids[i]) return true;
    return false;
}

static void set_logprobs(Prism__Tokens *t, prism_seq_lp_msg_t *m, prism_sampler_t *s, const float *logits,
                         int32_t tok, int n_top)
{
    int32_t ids[PRISM_SEQ_MAX_TOP_LOGPROBS];
    float lps[PRISM_SEQ_MAX_TOP_LOGPROBS];
    n_top = PRISM_MAX(0, PRISM_MIN(n_top, PRISM_SEQ_MAX_TOP_LOGPROBS));
    prism__token_logprobs__init(&m->lp);
    prism_logprobs(s, logits, tok, n_top, &m->lp.logprob, ids, lps);
    for (int k = 0; k < n_top; k++) {
        prism__top_logprob__init(&m->top[k]);
        m->top[k].token_id = ids[k];
        m->top[k].logprob = lps[k];
        m->topp[k] = &m->top[k];
    }
    m->lp.n_top = (size_t)n_top;
    m->lp.top = m->topp;
    m->lpp = &m->lp;
    t->n_logprobs = 1;
    t->logprobs = &m->lpp;
}

void prism_seq_tokens(const prism_seq_t *s, Prism__Tokens *t, const int32_t *tok, prism_seq_lp_msg_t *lpm,
                      prism_sampler_t *sm, const float *logits, const prism_model_config_t *cfg, int max_model_len)
{
    t->n_token_ids = 1;
    t->token_ids = (int32_t *)tok;
    t->prompt_tokens = (uint32_t)s->prompt_tokens;
    if (s->sampling.logprobs > 0) set_logprobs(t, lpm, sm, logits, *tok, (int)s->sampling.logprobs - 1);
    if (is_stop_token(s, cfg, *tok)) t->finish = PRISM__FINISH__FINISH_STOP;
    else if (s->generated >= (int)s->sampling.max_tokens || s->len + 1 >= max_model_len)
        t->finish = PRISM__FINISH__FINISH_LENGTH;
    else t->finish = PRISM__FINISH__FINISH_NONE;
}
