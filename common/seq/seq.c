/* One generation sequence and the worker's sequence sampler: see seq.h. */
#include "seq/seq.h"
#include "tokenizer/tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------ the sequence sampler */

typedef struct {
    Prism__Tokens t[PRISM_SEQ_MAX_N];
    int32_t tok[PRISM_SEQ_MAX_N];
    prism_seq_lp_msg_t lpm[PRISM_SEQ_MAX_N];
} seq_first_t;

int prism_seq_sampler_init(prism_seq_sampler_t *ss, const prism_model_config_t *cfg, const char *model_path,
                           int n_slots)
{
    memset(ss, 0, sizeof *ss);
    ss->vocab = cfg->vocab;
    ss->n_slots = n_slots > 0 ? n_slots : 1;
    ss->eos = cfg->n_eos > 0 ? cfg->eos_token_ids[0] : 0;
    int rc = prism_sampler_init(&ss->base, cfg->vocab);
    if (rc) goto fail;
    rc = prism_token_counts_init(&ss->counts, ss->n_slots, cfg->vocab);
    if (rc) goto fail;
    ss->work = prism_malloc((size_t)cfg->vocab * sizeof *ss->work);
    ss->matchers = prism_calloc((size_t)ss->n_slots, sizeof *ss->matchers);
    ss->first = prism_calloc(1, sizeof(seq_first_t));
    rc = PRISM_ENOMEM;
    if (!ss->work || !ss->matchers || !ss->first) goto fail;
    if (model_path && cfg->n_eos > 0) {
        /* The grammar vocabulary: every token's bytes, from the same tokenizer.json the router uses. */
        char path[1024], err[256] = "";
        prism_tokenizer_t *tok = NULL;
        prism_path_join(path, sizeof path, model_path, "tokenizer.json");
        if (prism_tokenizer_load(path, &tok, err, sizeof err) != PRISM_OK) {
            PRISM_WARN("no grammar support (guided requests will be refused): cannot load %s: %s", path, err);
        } else if (prism_grammar_vocab_create(tok, cfg->eos_token_ids, (size_t)cfg->n_eos, (size_t)cfg->vocab,
                                              &ss->gvocab) != PRISM_OK ||
                   prism_guide_cache_create(ss->gvocab, 0, 0, &ss->guides) != PRISM_OK) {
            PRISM_WARN("no grammar support (guided requests will be refused): the grammar vocabulary could not be built");
            prism_grammar_vocab_free(ss->gvocab);
            ss->gvocab = NULL;
        } else {
            ss->mask = prism_calloc(prism_grammar_mask_words(ss->gvocab), sizeof *ss->mask);
            if (!ss->mask) {
                prism_tokenizer_free(tok);
                goto fail;
            }
        }
        prism_tokenizer_free(tok);
    }
    return PRISM_OK;
fail:
    prism_seq_sampler_free(ss);
    return rc ? rc : PRISM_ENOMEM;
}

void prism_seq_sampler_free(prism_seq_sampler_t *ss)
{
    if (ss->n_masks)
        PRISM_INFO("grammar masks: %llu computed, %.1f us each on average", (unsigned long long)ss->n_masks,
                   (double)ss->mask_ns / 1e3 / (double)ss->n_masks);
    for (int i = 0; ss->matchers && i < ss->n_slots; i++) prism_grammar_matcher_free(ss->matchers[i]);
    prism_guide_cache_destroy(ss->guides);
    prism_grammar_vocab_free(ss->gvocab);
    prism_sampler_free(&ss->base);
    prism_token_counts_free(&ss->counts);
    prism_free(ss->work);
    prism_free(ss->matchers);
    prism_free(ss->mask);
    prism_free(ss->first);
    memset(ss, 0, sizeof *ss);
}

/* ------------------------------------------------------------------ the record */

const char *prism_seq_check(const Prism__Sampling *s, int vocab, int max_model_len)
{
    if (!s) return "malformed request: no sampling parameters";
    if (s->max_tokens == 0) return "max_tokens must be at least 1";
    if (s->max_tokens > (uint32_t)max_model_len) return "max_tokens exceeds the context length";
    if (!isfinite(s->temperature) || s->temperature < 0) return "temperature out of range";
    if (!isfinite(s->top_p) || s->top_p < 0 || s->top_p > 1) return "top_p out of range";
    if (s->n_stop_token_ids > PRISM_SEQ_MAX_STOP_IDS) return "too many stop token ids";
    for (size_t i = 0; i < s->n_stop_token_ids; i++)
        if (s->stop_token_ids[i] < 0 || s->stop_token_ids[i] >= vocab) return "stop token id out of range";
    if (s->logprobs > PRISM_SEQ_MAX_TOP_LOGPROBS + 1) return "too many top logprobs";
    if (s->n > PRISM_SEQ_MAX_N) return "n is out of range";
    /* a migrated sequence has tokens left to generate, and only n = 1 is migrated (the other
     * choices' RNG streams derive from the first token's position) */
    if (s->generated >= s->max_tokens) return "generated tokens out of range";
    if (s->generated && s->n > 1) return "a migrated request has one sequence";
    if (s->n_logit_bias_ids != s->n_logit_bias_values) return "malformed logit_bias";
    if (s->n_logit_bias_ids > PRISM_SEQ_MAX_LOGIT_BIAS) return "too many logit_bias entries";
    for (size_t i = 0; i < s->n_logit_bias_values; i++)
        if (!(fabsf(s->logit_bias_values[i]) <= PRISM_SEQ_MAX_BIAS)) return "logit_bias value out of range";
    for (size_t i = 0; i < s->n_logit_bias_ids; i++)
        if (s->logit_bias_ids[i] < 0 || s->logit_bias_ids[i] >= vocab) return "logit_bias token id out of range";
    if (!isfinite(s->presence_penalty) || !isfinite(s->frequency_penalty) || !isfinite(s->repetition_penalty) ||
        s->repetition_penalty < 0.0f)
        return "penalty out of range";
    return NULL;
}

static const char *bind_guide(prism_seq_t *s, prism_seq_sampler_t *ss, const Prism__Guide *g)
{
    if (!g || g->kind == PRISM__GUIDE_KIND__GUIDE_NONE) return NULL;
    if (!ss || !ss->guides) return "this worker has no grammar support (no tokenizer.json)";
    prism_guide_spec_t spec = {
        .kind = (int)g->kind, .text = g->text ? g->text : "", .len = g->text ? strlen(g->text) : 0,
        .tool_name = g->tool_name, .tool_parallel = g->tool_parallel, .tool_format = (int)g->tool_format,
    };
    prism_grammar_error_t err;
    if (prism_guide_get(ss->guides, &spec, &s->guide, &err) != PRISM_OK) {
        PRISM_WARN("request %llu: guide refused: %s %s", (unsigned long long)s->rid, err.path, err.message);
        s->guide = NULL;
        return "the request's output constraint could not be compiled";
    }
    return NULL;
}

const char *prism_seq_start(prism_seq_t *s, prism_seq_sampler_t *ss, uint64_t rid, const char *router_id,
                            const Prism__Sampling *sampling, int prompt_tokens, uint64_t rng)
{
    memset(s, 0, sizeof *s);
    const char *why = prism_seq_check(sampling, ss ? ss->vocab : INT32_MAX, INT32_MAX);  /* the caller checked the context */
    if (why) return why;
    s->rid = rid;
    snprintf(s->router_id, sizeof s->router_id, "%s", router_id ? router_id : "");
    s->sampling = *sampling;
    s->sampling.base.n_unknown_fields = 0;    /* the copy points into no unpacked message */
    s->sampling.base.unknown_fields = NULL;
    s->sampling.n_stop_token_ids = PRISM_MIN(sampling->n_stop_token_ids, (size_t)PRISM_SEQ_MAX_STOP_IDS);
    if (s->sampling.n_stop_token_ids)
        memcpy(s->stop_ids, sampling->stop_token_ids, sizeof(int32_t) * s->sampling.n_stop_token_ids);
    s->sampling.stop_token_ids = NULL;
    size_t nb = sampling->n_logit_bias_ids;
    for (size_t i = 0; i < nb; i++) {
        if (sampling->logit_bias_ids[i] < 0 || (ss && sampling->logit_bias_ids[i] >= ss->vocab))
            return "logit_bias token id out of range";
        s->bias_ids[i] = sampling->logit_bias_ids[i];
        s->bias_values[i] = sampling->logit_bias_values[i];
    }
    s->sampling.logit_bias_ids = NULL;
    s->sampling.logit_bias_values = NULL;
    s->sampling.guide = NULL;
    s->sampling.logprobs = PRISM_MIN(sampling->logprobs, (uint32_t)PRISM_SEQ_MAX_TOP_LOGPROBS + 1);
    s->sp = (prism_sample_params_t){sampling->temperature, sampling->top_p, sampling->top_k};
    s->pen = (prism_penalty_params_t){sampling->presence_penalty, sampling->frequency_penalty,
                                      sampling->repetition_penalty > 0.0f ? sampling->repetition_penalty : 1.0f};
    s->rng = rng;
    s->prompt_tokens = prompt_tokens;
    s->slot = -1;
    why = bind_guide(s, ss, sampling->guide);
    if (why) {
        memset(s, 0, sizeof *s);
        return why;
    }
    s->used = true;
    return NULL;
}

void prism_seq_detach(prism_seq_t *s)
{
    prism_guide_release(s->guide);
    s->guide = NULL;
}

void prism_seq_copy(prism_seq_t *dst, const prism_seq_t *src)
{
    *dst = *src;
    prism_guide_retain(dst->guide);
}

uint64_t prism_seq_seed(const Prism__Sampling *sampling, uint64_t rid)
{
    uint64_t rng = prism_rng_seed(sampling->has_seed ? sampling->seed : (rid ^ prism_now_ns()));
    /* A migrated sequence: one draw per token generated before (prism_sample_draws), so the next
     * draw is the one the lost worker would have made. O(generated), once per migration. */
    prism_sample_params_t sp = {sampling->temperature, sampling->top_p, sampling->top_k};
    if (prism_sample_draws(&sp))
        for (uint32_t i = 0; i < sampling->generated; i++) (void)prism_rng_uniform(&rng);
    return rng;
}

const Prism__Sampling *prism_seq_sampling(prism_seq_t *s)
{
    s->sampling.stop_token_ids = s->stop_ids;
    s->sampling.logit_bias_ids = s->bias_ids;
    s->sampling.logit_bias_values = s->bias_values;
    s->sampling.n_logit_bias_values = s->sampling.n_logit_bias_ids;
    s->sampling.guide = NULL;
    if (s->guide) {
        const prism_guide_spec_t *g = prism_guide_spec(s->guide);
        prism__guide__init(&s->guide_msg);
        s->guide_msg.kind = (Prism__GuideKind)g->kind;
        s->guide_msg.text = (char *)g->text;
        s->guide_msg.tool_name = (char *)(g->tool_name ? g->tool_name : "");
        s->guide_msg.tool_parallel = g->tool_parallel;
        s->guide_msg.tool_format = (uint32_t)g->tool_format;
        s->sampling.guide = &s->guide_msg;
    }
    return &s->sampling;
}

/* ------------------------------------------------------------------ logits processors */

static bool has_processors(const prism_seq_t *s)
{
    return s->sampling.n_logit_bias_ids || prism_penalty_active(&s->pen) || s->guide;
}

/* Feeds one generated token to the slot's state: counts and grammar. */
static void advance(prism_seq_t *s, prism_seq_sampler_t *ss, int32_t tok)
{
    if (s->slot < 0) return;
    if (prism_penalty_active(&s->pen)) prism_token_counts_add(&ss->counts, s->slot, tok);
    if (s->guide && !s->grammar_done && !s->grammar_broken) {
        prism_grammar_matcher_t *m = ss->matchers[s->slot];
        if (prism_grammar_matcher_accept_token(m, tok) != PRISM_OK) {
            PRISM_ERROR("request %llu: token %d is outside the request's grammar", (unsigned long long)s->rid, tok);
            s->grammar_broken = true;
        } else if (prism_grammar_matcher_is_terminated(m)) {
            s->grammar_done = true;
        }
    }
}

const char *prism_seq_feed(prism_seq_t *s, prism_seq_sampler_t *ss, const int32_t *done, size_t n_done)
{
    for (size_t i = 0; i < n_done; i++) advance(s, ss, done[i]);
    return s->grammar_broken ? "a generated token is outside the request's grammar" : NULL;
}

const char *prism_seq_attach(prism_seq_t *s, prism_seq_sampler_t *ss, int slot, const int32_t *prompt,
                             size_t n_prompt, const int32_t *done, size_t n_done)
{
    PRISM_ASSERT(slot >= 0 && slot < ss->n_slots);
    s->slot = slot;
    s->grammar_done = s->grammar_broken = false;
    if (prism_penalty_active(&s->pen))
        prism_token_counts_reset(&ss->counts, slot, prism_seq_needs_prompt(s) ? prompt : NULL,
                                 prism_seq_needs_prompt(s) && prompt ? n_prompt : 0);
    if (s->guide) {
        prism_grammar_t *g = prism_guide_grammar(s->guide);
        int rc = ss->matchers[slot] ? prism_grammar_matcher_rebind(ss->matchers[slot], g)
                                    : prism_grammar_matcher_create(g, NULL, &ss->matchers[slot]);
        if (rc != PRISM_OK) return "out of memory for the grammar matcher";
    }
    return prism_seq_feed(s, ss, done, n_done);
}

/* The logits to sample from: the raw row, or the sampler's copy with the processors applied.
 * NULL when the grammar allows nothing (the sequence ends). */
static const float *processed(prism_seq_t *s, prism_seq_sampler_t *ss, const float *logits)
{
    if (!has_processors(s)) return logits;
    PRISM_ASSERT(s->slot >= 0);
    float *w = ss->work;
    memcpy(w, logits, (size_t)ss->vocab * sizeof *w);
    if (s->sampling.n_logit_bias_ids)
        prism_apply_logit_bias(w, ss->vocab, s->bias_ids, s->bias_values, (int)s->sampling.n_logit_bias_ids);
    if (prism_penalty_active(&s->pen))
        prism_apply_penalties(w, ss->vocab, prism_token_counts_row(&ss->counts, s->slot),
                              prism_token_counts_prompt(&ss->counts, s->slot), &s->pen);
    if (s->guide && !s->grammar_broken) {
        if (s->grammar_done) return NULL;
        uint64_t t0 = prism_now_ns();
        int n = prism_grammar_matcher_fill_mask(ss->matchers[s->slot], ss->mask);
        ss->mask_ns += prism_now_ns() - t0;
        ss->n_masks++;
        if (n <= 0) {
            if (n < 0) PRISM_ERROR("request %llu: grammar mask failed: %s", (unsigned long long)s->rid, prism_strerror(n));
            else PRISM_WARN("request %llu: the grammar allows no token (a run-time limit pruned every path); ending it",
                            (unsigned long long)s->rid);
            return NULL;
        }
        prism_grammar_apply_mask(w, ss->mask, (size_t)ss->vocab);
    }
    return w;
}

int32_t prism_seq_sample(prism_seq_t *s, prism_seq_sampler_t *ss, const float *logits)
{
    s->generated++;
    const float *l = processed(s, ss, logits);
    if (!l) {
        s->grammar_done = true;
        return ss->eos;
    }
    int32_t tok = prism_sample(&ss->base, l, &s->sp, &s->rng);
    advance(s, ss, tok);
    return tok;
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
                      prism_seq_sampler_t *ss, const float *logits, const prism_model_config_t *cfg,
                      int max_model_len)
{
    t->n_token_ids = 1;
    t->token_ids = (int32_t *)tok;
    t->prompt_tokens = (uint32_t)s->prompt_tokens;
    t->index = s->index;
    if (s->sampling.logprobs > 0) set_logprobs(t, lpm, &ss->base, logits, *tok, (int)s->sampling.logprobs - 1);
    if (s->grammar_broken) {
        t->finish = PRISM__FINISH__FINISH_ERROR;
        t->error = "a sampled token broke the request's output constraint";
    } else if (s->grammar_done || is_stop_token(s, cfg, *tok)) {
        t->finish = PRISM__FINISH__FINISH_STOP;
    } else if (s->generated >= (int)s->sampling.max_tokens || s->len + 1 >= max_model_len) {
        t->finish = PRISM__FINISH__FINISH_LENGTH;
    } else {
        t->finish = PRISM__FINISH__FINISH_NONE;
    }
}

int prism_seq_first_tokens(prism_seq_t *s, prism_seq_sampler_t *ss, const float *logits,
                           const prism_model_config_t *cfg, int max_model_len, Prism__Tokens **out)
{
    seq_first_t *f = ss->first;
    int n = prism_seq_n(s);
    const float *l = processed(s, ss, logits);
    uint64_t rng0 = s->rng;
    s->n_fork = 0;
    for (int i = 0; i < n; i++) {
        /* choice 0 keeps the request's stream; the others start from streams derived from it */
        s->rng = i == 0 ? rng0 : prism_rng_seed(rng0 + (uint64_t)i * 0x9E3779B97F4A7C15ull);
        s->index = (uint32_t)i;
        s->generated = (int)s->sampling.generated + 1;   /* a migrated sequence goes on from there */
        s->grammar_done = l == NULL;
        f->tok[i] = l ? prism_sample(&ss->base, l, &s->sp, &s->rng) : ss->eos;
        prism__tokens__init(&f->t[i]);
        prism_seq_tokens(s, &f->t[i], &f->tok[i], &f->lpm[i], ss, logits, cfg, max_model_len);
        if (f->t[i].finish == PRISM__FINISH__FINISH_NONE) {
            s->fork_index[s->n_fork] = (uint32_t)i;
            s->fork_first[s->n_fork] = f->tok[i];
            s->fork_rng[s->n_fork] = s->rng;
            s->n_fork++;
        }
    }
    s->index = 0;
    s->rng = rng0;
    s->grammar_done = false;
    *out = f->t;
    return n;
}
