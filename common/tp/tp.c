#include "tp/tp.h"
#include "worker/start.h"
#include "net/net.h"

#include <stdio.h>
#include <string.h>

void prism_tp_opts_defaults(prism_tp_opts_t *o)
{
    memset(o, 0, sizeof *o);
    o->size = 1;
    o->rank = 0;
    o->leader = "";
    o->transport = "auto";
    o->timeout_s = 30;
}

int prism_tp_opts_check(const prism_tp_opts_t *o)
{
    if (o->size < 1 || o->size > PRISM_TP_MAX || o->rank < 0 || o->rank >= o->size) {
        PRISM_ERROR("--tp-size must be 1..%d and --tp-rank 0..tp-size-1 (got %lld, %lld)", PRISM_TP_MAX,
                    (long long)o->size, (long long)o->rank);
        return PRISM_EINVAL;
    }
    if (o->size > 1 && (!o->leader || strncmp(o->leader, "tcp://", 6) != 0)) {
        PRISM_ERROR("--tp-size %lld needs --tp-leader tcp://host:port (the leader binds it, the others connect)",
                    (long long)o->size);
        return PRISM_EINVAL;
    }
    if (strcmp(o->transport, "auto") && strcmp(o->transport, "shm") && strcmp(o->transport, "zmq")) {
        PRISM_ERROR("--tp-transport must be auto, shm or zmq");
        return PRISM_EINVAL;
    }
    if (!(o->timeout_s > 0 && o->timeout_s <= 3600)) {
        PRISM_ERROR("--tp-timeout must be in (0, 3600] seconds");
        return PRISM_EINVAL;
    }
    return PRISM_OK;
}

int prism_tp_opts_apply(const prism_tp_opts_t *o, prism_model_config_t *cfg, prism_model_config_t *full)
{
    if (prism_tp_opts_check(o) != PRISM_OK) return PRISM_EINVAL;
    *full = *cfg;
    if (o->size == 1) return PRISM_OK;
    char err[512] = "";
    if (prism_model_config_set_tp(cfg, (int)o->size, (int)o->rank, err, sizeof err) != PRISM_OK) {
        PRISM_ERROR("--tp-size %lld: %s", (long long)o->size, err);
        return PRISM_EINVAL;
    }
    if (prism_kv_local_ring(cfg, 16, 1) > 0) {
        /* Their KV transfer splits the layers (chunked ones from the current chunk only); a group's
         * KV scatter and gather move whole-cache blocks. */
        PRISM_ERROR("--tp-size %lld: models with chunked-attention layers (Llama-4) run at --tp-size 1 for now",
                    (long long)o->size);
        return PRISM_EINVAL;
    }
    return PRISM_OK;
}

static int blocks_of(const prism_tp_t *t, int tokens) { return (tokens + t->setup.block_size - 1) / t->setup.block_size; }

int prism_tp_join(prism_tp_t *t, const prism_tp_opts_t *o, struct prism_net *net, prism_backend_t *be,
                  const prism_model_config_t *cfg, const char *name, int max_blocks_per_seq, int block_size)
{
    prism_tp_opts_t opts = *o;   /* o may be t->opts */
    memset(t, 0, sizeof *t);
    t->opts = opts;
    o = &t->opts;
    t->size = (int)o->size;
    t->rank = (int)o->rank;
    t->cfg = cfg;
    t->full = *cfg;
    t->full.tp_size = 0;
    t->full.tp_rank = 0;
    t->max_blocks_per_seq = max_blocks_per_seq;
    char err[512] = "";
    for (int r = 0; r < t->size; r++)
        if (prism_tp_shard(cfg, t->size, r, &t->shard[r], err, sizeof err) != PRISM_OK) {
            PRISM_ERROR("tensor parallelism: %s", err);
            return PRISM_EINVAL;
        }
    /* The largest link message: one request's KV heads for one rank. */
    size_t kv_bytes = (size_t)max_blocks_per_seq * prism_kv_cache_block_bytes(cfg, block_size);
    prism_group_opts_t go = {
        .size = t->size, .rank = t->rank, .leader = o->leader, .name = name, .be = be,
        .transport = !strcmp(o->transport, "shm") ? PRISM_COMM_TRANSPORT_SHM
                   : !strcmp(o->transport, "zmq") ? PRISM_COMM_TRANSPORT_ZMQ : PRISM_COMM_TRANSPORT_AUTO,
        .timeout_s = o->timeout_s,
        .link_max_msg_bytes = (int64_t)PRISM_MAX(kv_bytes * 2 + ((size_t)1 << 20), (size_t)64 << 20),
    };
    int rc = prism_group_create(net, &go, &t->g, err, sizeof err);
    if (rc != PRISM_OK) {
        PRISM_ERROR("%s", err);
        return rc;
    }
    return PRISM_OK;
}

void prism_tp_close(prism_tp_t *t)
{
    prism_group_destroy(t->g);
    prism_free(t->plan);
    prism_free(t->tables);
    prism_free(t->rows);
    prism_free(t->row_ptrs);
    prism_free(t->kv_scratch);
    memset(t, 0, sizeof *t);
}

int prism_tp_check(prism_tp_t *t) { return prism_group_check(t->g); }

/* A rank's group looks dead, but the leader's stop may still be on its way: the leader sends it to
 * the ranks one after another, so a rank that got its own stop may exit (and be seen gone) before
 * the next rank's arrives, and the monitor's disconnect races the delivery of the leader's last
 * message. A stop that arrives within a short grace is returned (the rank leaves cleanly); anything
 * else, or nothing, makes the group dead (PRISM_EIO). The leader gets no grace. */
#define TP_LAST_WORDS_MS 500

/* Waits until the link has a message, the deadline passes or cap_ms elapse, whichever is first. */
static void wait_link(void *sock, uint64_t deadline, uint64_t cap_ms)
{
    uint64_t now = prism_now_ns();
    if (now >= deadline) return;
    zmq_pollitem_t it = {.socket = sock, .events = ZMQ_POLLIN};
    zmq_poll(&it, 1, (long)PRISM_MIN((deadline - now) / 1000000ull + 1, cap_ms));
}

static int last_words(prism_tp_t *t, void *sock, prism_msg_t *m)
{
    if (t->rank == 0) return PRISM_EIO;
    uint64_t deadline = prism_now_ns() + (uint64_t)TP_LAST_WORDS_MS * 1000000ull;
    for (;;) {
        if (prism_msg_recv(sock, false, m, ZMQ_DONTWAIT) == PRISM_OK) {
            if (m->env->type == PRISM__MSG_TYPE__MSG_TP_STOP) return PRISM_OK;
            prism_msg_close(m);
        }
        if (prism_now_ns() >= deadline) return PRISM_EIO;
        wait_link(sock, deadline, TP_LAST_WORDS_MS);
    }
}

/* Waits for one message on the link; PRISM_EAGAIN after timeout_ms, PRISM_EIO when the group died. */
static int link_recv(prism_tp_t *t, prism_msg_t *m, int timeout_ms)
{
    void *sock = prism_group_link(t->g);
    uint64_t deadline = prism_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        int rc = prism_msg_recv(sock, t->rank == 0, m, ZMQ_DONTWAIT);
        if (rc == PRISM_OK) return rc;
        if (rc != PRISM_EAGAIN && rc != PRISM_ECORRUPT) return PRISM_EIO;
        if (prism_group_check(t->g) != PRISM_OK) return last_words(t, sock, m);
        if (prism_worker_should_stop()) return PRISM_EAGAIN;
        if (prism_now_ns() >= deadline) return PRISM_EAGAIN;
        wait_link(sock, deadline, 100);   /* a 100 ms cap: the group's liveness is checked between waits */
    }
}

static int send_setup(prism_tp_t *t, int rank, const prism_tp_setup_t *s, bool ok, const char *error)
{
    Prism__TpSetup ts = PRISM__TP_SETUP__INIT;
    ts.kv_blocks = (uint32_t)s->kv_blocks;
    ts.block_size = (uint32_t)s->block_size;
    ts.max_seqs = (uint32_t)s->max_seqs;
    ts.max_tokens = (uint32_t)s->max_tokens;
    ts.ok = ok;
    ts.error = (char *)(error ? error : "");
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TP_SETUP;
    env.tp_setup = &ts;
    const void *id = NULL;
    size_t idlen = 0;
    if (t->rank == 0 && prism_group_peer_identity(t->g, rank, &id, &idlen) != PRISM_OK) return PRISM_EINVAL;
    return prism_msg_send(prism_group_link(t->g), id, idlen, &env, NULL, 0, 0);
}

/* The step plan's int32 entries: tokens + seq_start + pos0 + every block table + the indices of
 * embedded tokens (+ M-RoPE models: every token's three rotary positions). */
static size_t plan_entries(const prism_model_config_t *cfg, const prism_tp_setup_t *s, int max_blocks_per_seq)
{
    size_t n = 2 * (size_t)s->max_tokens + 2 * (size_t)s->max_seqs + 1 + (size_t)s->max_seqs * max_blocks_per_seq;
    return n + (prism_model_mrope(cfg) ? 3 * (size_t)s->max_tokens : 0);
}

size_t prism_tp_buffer_bytes(const prism_model_config_t *cfg, int size, const prism_tp_setup_t *s, int max_blocks_per_seq)
{
    if (size <= 1) return 0;
    return plan_entries(cfg, s, max_blocks_per_seq) * sizeof(int32_t) + (size_t)s->max_seqs * sizeof(int32_t *) +
           (size_t)s->max_tokens * prism_model_embed_row_floats(cfg) * sizeof(float) + (size_t)s->max_tokens * sizeof(float *) +
           (size_t)max_blocks_per_seq * prism_kv_cache_block_bytes(cfg, s->block_size);
}

/* What the plan counts (prism_tp_buffer_bytes); a group of one sends no plan and moves no KV slice. */
static int alloc_buffers(prism_tp_t *t)
{
    const prism_tp_setup_t *s = &t->setup;
    if (t->size == 1) return PRISM_OK;
    t->plan_cap = plan_entries(t->cfg, s, t->max_blocks_per_seq);
    t->plan = prism_calloc(t->plan_cap, sizeof(int32_t));
    t->tables = prism_calloc((size_t)s->max_seqs, sizeof(int32_t *));
    t->rows = prism_malloc((size_t)s->max_tokens * prism_model_embed_row_floats(t->cfg) * sizeof(float));
    t->row_ptrs = prism_calloc((size_t)s->max_tokens, sizeof(float *));
    t->kv_scratch_bytes = (size_t)t->max_blocks_per_seq * prism_kv_cache_block_bytes(t->cfg, s->block_size);
    t->kv_scratch = prism_malloc(t->kv_scratch_bytes);
    if (!t->plan || !t->tables || !t->rows || !t->row_ptrs || !t->kv_scratch) return PRISM_ENOMEM;
    return PRISM_OK;
}

int prism_tp_setup(prism_tp_t *t, prism_tp_setup_t *s)
{
    double timeout_ms = 120e3;
    if (t->size == 1) {
        t->setup = *s;
        return alloc_buffers(t);
    }
    prism_msg_t m;
    if (t->rank > 0) {
        int rc = send_setup(t, 0, s, true, NULL);
        if (rc != PRISM_OK) return rc;
        for (;;) {
            rc = link_recv(t, &m, (int)timeout_ms);
            if (rc != PRISM_OK) {
                PRISM_ERROR("tensor parallelism: no capacity answer from the leader");
                return PRISM_EIO;
            }
            bool mine = m.env->type == PRISM__MSG_TYPE__MSG_TP_SETUP && m.env->tp_setup;
            if (mine) {
                const Prism__TpSetup *a = m.env->tp_setup;
                if (!a->ok) {
                    PRISM_ERROR("tensor parallelism: the leader refused this rank: %s", a->error ? a->error : "");
                    prism_msg_close(&m);
                    return PRISM_EINVAL;
                }
                if ((int)a->kv_blocks > s->kv_blocks || (int)a->block_size != s->block_size ||
                    (int)a->max_seqs != s->max_seqs || (int)a->max_tokens != s->max_tokens) {
                    prism_msg_close(&m);
                    PRISM_ERROR("tensor parallelism: the leader's capacity answer does not fit this rank");
                    return PRISM_EINVAL;
                }
                s->kv_blocks = (int)a->kv_blocks;
                prism_msg_close(&m);
                break;
            }
            prism_msg_close(&m);
        }
    } else {
        prism_tp_setup_t got[PRISM_TP_MAX];
        bool have[PRISM_TP_MAX] = {0};
        int n_have = 1;
        have[0] = true;
        got[0] = *s;
        while (n_have < t->size) {
            int rc = link_recv(t, &m, (int)timeout_ms);
            if (rc != PRISM_OK) {
                PRISM_ERROR("tensor parallelism: %d of %d ranks sent no capacity", t->size - n_have, t->size);
                return PRISM_EIO;
            }
            const Prism__TpSetup *a = m.env->tp_setup;
            int r = -1;
            for (int i = 1; i < t->size; i++) {
                const void *id;
                size_t len;
                if (prism_group_peer_identity(t->g, i, &id, &len) == PRISM_OK && len == m.identity_len &&
                    !memcmp(id, m.identity, len))
                    r = i;
            }
            if (r > 0 && !have[r] && m.env->type == PRISM__MSG_TYPE__MSG_TP_SETUP && a) {
                got[r] = (prism_tp_setup_t){(int)a->kv_blocks, (int)a->block_size, (int)a->max_seqs, (int)a->max_tokens};
                have[r] = true;
                n_have++;
            }
            prism_msg_close(&m);
        }
        char why[256] = "";
        for (int r = 1; r < t->size; r++) {
            if (got[r].block_size != s->block_size || got[r].max_seqs != s->max_seqs ||
                got[r].max_tokens != s->max_tokens)
                snprintf(why, sizeof why, "rank %d has block size %d, %d sequences, %d tokens per step; the leader "
                         "%d, %d, %d: give every rank the same flags", r, got[r].block_size, got[r].max_seqs,
                         got[r].max_tokens, s->block_size, s->max_seqs, s->max_tokens);
            s->kv_blocks = PRISM_MIN(s->kv_blocks, got[r].kv_blocks);
        }
        for (int r = 1; r < t->size; r++) send_setup(t, r, s, !why[0], why);
        if (why[0]) {
            PRISM_ERROR("tensor parallelism: %s", why);
            return PRISM_EINVAL;
        }
    }
    t->setup = *s;
    PRISM_INFO("tensor parallelism: rank %d of %d, group capacity %d KV blocks (the smallest rank's)", t->rank,
               t->size, s->kv_blocks);
    return alloc_buffers(t);
}

/* ---------------------------------------------------------------- leader */

static int send_all(prism_tp_t *t, Prism__Envelope *env, const prism_frame_t *frames, int n_frames)
{
    int rc = PRISM_OK;
    for (int r = 1; r < t->size; r++) {
        const void *id;
        size_t len;
        PRISM_ASSERT(prism_group_peer_identity(t->g, r, &id, &len) == PRISM_OK);
        int e = prism_msg_send(prism_group_link(t->g), id, len, env, frames, n_frames, 0);
        if (e != PRISM_OK) rc = PRISM_EIO;
    }
    return rc;
}

int prism_tp_send_step(prism_tp_t *t, const prism_llm_batch_t *b, bool logits)
{
    if (t->size == 1) return PRISM_OK;
    PRISM_ASSERT(!b->embeds && b->n_seqs <= t->setup.max_seqs && b->n_tokens <= t->setup.max_tokens);
    size_t k = 0;
    memcpy(t->plan + k, b->tokens, (size_t)b->n_tokens * 4);
    k += (size_t)b->n_tokens;
    memcpy(t->plan + k, b->seq_start, ((size_t)b->n_seqs + 1) * 4);
    k += (size_t)b->n_seqs + 1;
    memcpy(t->plan + k, b->pos0, (size_t)b->n_seqs * 4);
    k += (size_t)b->n_seqs;
    size_t n_table = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        int nb = blocks_of(t, b->pos0[i] + b->seq_start[i + 1] - b->seq_start[i]);
        PRISM_ASSERT(nb <= t->max_blocks_per_seq && k + (size_t)nb <= t->plan_cap);
        memcpy(t->plan + k, b->block_tables[i], (size_t)nb * 4);
        k += (size_t)nb;
        n_table += (size_t)nb;
    }
    /* M-RoPE models: every token's three rotary positions (given, or its position + the sequence's
     * delta), so the ranks need no per-request state. */
    if (prism_model_mrope(t->cfg)) {
        PRISM_ASSERT(k + 3 * (size_t)b->n_tokens <= t->plan_cap);
        for (int s = 0; s < b->n_seqs; s++)
            for (int i = b->seq_start[s]; i < b->seq_start[s + 1]; i++)
                for (int r = 0; r < 3; r++)
                    t->plan[k + (size_t)r * b->n_tokens + (size_t)i] =
                        b->rope_pos ? b->rope_pos[(size_t)r * b->n_tokens + (size_t)i]
                                    : b->pos0[s] + (i - b->seq_start[s]) + (b->rope_delta ? b->rope_delta[s] : 0);
        k += 3 * (size_t)b->n_tokens;
    }
    /* Embedding rows (image tokens): their token indices, and the rows packed into one frame. */
    size_t n_embed = 0, hb = (size_t)prism_model_embed_row_floats(t->cfg) * sizeof(float);   /* + DeepStack */
    for (int i = 0; b->embed_rows && i < b->n_tokens; i++)
        if (b->embed_rows[i]) {
            t->plan[k++] = i;
            memcpy((uint8_t *)t->rows + n_embed * hb, b->embed_rows[i], hb);
            n_embed++;
        }
    PRISM_ASSERT(k <= t->plan_cap);
    Prism__TpStep st = PRISM__TP_STEP__INIT;
    st.step = ++t->step;
    st.n_seqs = (uint32_t)b->n_seqs;
    st.n_tokens = (uint32_t)b->n_tokens;
    st.n_table = (uint32_t)n_table;
    st.all_logits = b->all_logits;
    st.n_embed = (uint32_t)n_embed;
    st.no_logits = !logits;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TP_STEP;
    env.tp_step = &st;
    prism_frame_t f[2] = {{t->plan, k * 4}, {t->rows, n_embed * hb}};
    return send_all(t, &env, f, n_embed ? 2 : 1);
}

int prism_tp_scatter_kv(prism_tp_t *t, prism_kv_cache_t *kv, const int32_t *blocks, int n_blocks, const void *whole)
{
    if (t->size == 1) return prism_kv_cache_import(kv, blocks, n_blocks, whole);
    PRISM_ASSERT(n_blocks <= t->max_blocks_per_seq);
    size_t bytes = (size_t)n_blocks * prism_kv_cache_block_bytes(t->cfg, t->setup.block_size);
    PRISM_ASSERT(bytes <= t->kv_scratch_bytes);
    Prism__TpKv tk = PRISM__TP_KV__INIT;
    tk.n_blocks = (uint32_t)n_blocks;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TP_KV;
    env.tp_kv = &tk;
    int rc = PRISM_OK;
    /* One message per rank per request: the rank's heads of every block and layer at once. */
    for (int r = 1; r < t->size; r++) {
        const prism_tp_shard_t *sh = &t->shard[r];
        prism_kv_slice_heads(&t->full, t->setup.block_size, n_blocks, whole, sh->kv_head0, sh->n_kv_heads,
                             t->kv_scratch);
        const void *id;
        size_t len;
        PRISM_ASSERT(prism_group_peer_identity(t->g, r, &id, &len) == PRISM_OK);
        prism_frame_t f[2] = {{blocks, (size_t)n_blocks * 4}, {t->kv_scratch, bytes}};
        if (prism_msg_send(prism_group_link(t->g), id, len, &env, f, 2, 0) != PRISM_OK) rc = PRISM_EIO;
    }
    const prism_tp_shard_t *sh = &t->shard[0];
    prism_kv_slice_heads(&t->full, t->setup.block_size, n_blocks, whole, sh->kv_head0, sh->n_kv_heads, t->kv_scratch);
    int irc = prism_kv_cache_import(kv, blocks, n_blocks, t->kv_scratch);
    return irc != PRISM_OK ? irc : rc;
}

int prism_tp_gather_kv(prism_tp_t *t, prism_kv_cache_t *kv, const int32_t *blocks, int n_blocks, void *whole)
{
    if (t->size == 1) return prism_kv_cache_export(kv, blocks, n_blocks, whole);
    PRISM_ASSERT(n_blocks >= 1 && n_blocks <= t->max_blocks_per_seq);
    Prism__TpKv tk = PRISM__TP_KV__INIT;
    tk.n_blocks = (uint32_t)n_blocks;
    tk.gather = true;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TP_KV;
    env.tp_kv = &tk;
    prism_frame_t f = {blocks, (size_t)n_blocks * 4};
    if (send_all(t, &env, &f, 1) != PRISM_OK) return PRISM_EIO;
    /* Our own heads while the ranks export theirs. */
    int rc = prism_kv_cache_export(kv, blocks, n_blocks, t->kv_scratch);
    if (rc != PRISM_OK) return rc;
    const prism_tp_shard_t *sh = &t->shard[0];
    prism_kv_merge_heads(&t->full, t->setup.block_size, n_blocks, t->kv_scratch, sh->kv_head0, sh->n_kv_heads, whole);
    size_t want = (size_t)n_blocks * prism_kv_cache_block_bytes(t->cfg, t->setup.block_size);
    bool have[PRISM_TP_MAX] = {0};
    for (int got = 1; got < t->size;) {
        prism_msg_t m;
        rc = link_recv(t, &m, (int)(prism_group_comm(t->g)->timeout_s * 1000));
        if (rc != PRISM_OK) return PRISM_EIO;   /* no answer within the step timeout: the group is broken */
        int r = -1;
        for (int i = 1; i < t->size; i++) {
            const void *id;
            size_t len;
            if (prism_group_peer_identity(t->g, i, &id, &len) == PRISM_OK && len == m.identity_len &&
                !memcmp(id, m.identity, len))
                r = i;
        }
        size_t blen = 0;
        const void *bytes = m.n_frames == 1 ? prism_msg_frame(&m, 0, &blen) : NULL;
        const Prism__TpKv *a = m.env->tp_kv;
        if (r > 0 && !have[r] && m.env->type == PRISM__MSG_TYPE__MSG_TP_KV && a && a->gather &&
            a->n_blocks == (uint32_t)n_blocks && bytes && blen == want) {
            sh = &t->shard[r];
            prism_kv_merge_heads(&t->full, t->setup.block_size, n_blocks, bytes, sh->kv_head0, sh->n_kv_heads, whole);
            have[r] = true;
            got++;
        } else {
            PRISM_WARN("tensor parallelism: unexpected message on the group link during a KV gather");
        }
        prism_msg_close(&m);
    }
    return PRISM_OK;
}

void prism_tp_stop(prism_tp_t *t)
{
    if (t->size == 1 || !t->g) return;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_TP_STOP;
    send_all(t, &env, NULL, 0);
    /* Links linger 0 ms (a dead peer must not hold up a close), which would drop a stop still
     * queued when the leader closes the group: the ranks would see the link close and exit as if
     * the leader had died. The stop waits up to a second to leave. */
    int linger = 1000;
    zmq_setsockopt(prism_group_link(t->g), ZMQ_LINGER, &linger, sizeof linger);
}

/* ---------------------------------------------------------------- ranks */

static int follow_step(prism_tp_t *t, prism_msg_t *m, prism_llm_t *llm, prism_kv_cache_t *kv, float *logits)
{
    const Prism__TpStep *st = m->env->tp_step;
    size_t len = 0;
    size_t hb = (size_t)prism_model_embed_row_floats(t->cfg) * sizeof(float), rlen = 0;
    const int32_t *p = st && m->n_frames == (st->n_embed ? 2 : 1) ? prism_msg_frame(m, 0, &len) : NULL;
    const void *rows = p && st->n_embed ? prism_msg_frame(m, 1, &rlen) : NULL;
    const size_t n_rope = st && prism_model_mrope(t->cfg) ? 3 * (size_t)st->n_tokens : 0;
    if (!st || !p || st->n_seqs < 1 || st->n_seqs > (uint32_t)t->setup.max_seqs || st->n_tokens < st->n_seqs ||
        st->n_tokens > (uint32_t)t->setup.max_tokens || st->n_table > t->plan_cap || st->n_embed > st->n_tokens ||
        len != ((size_t)st->n_tokens + 2 * (size_t)st->n_seqs + 1 + st->n_table + n_rope + st->n_embed) * 4 ||
        (st->n_embed && rlen != st->n_embed * hb) || st->step != t->step + 1) {
        PRISM_ERROR("tensor parallelism: malformed or out-of-order step plan from the leader");
        return PRISM_ECORRUPT;
    }
    /* Copy out of the frame: it is aligned for int32 only by luck. */
    memcpy(t->plan, p, len);
    int n = (int)st->n_seqs;
    const int32_t *tokens = t->plan, *seq_start = tokens + st->n_tokens, *pos0 = seq_start + n + 1;
    const int32_t *tab = pos0 + n;
    size_t used = 0;
    if (seq_start[0] != 0 || seq_start[n] != (int32_t)st->n_tokens) return PRISM_ECORRUPT;
    for (int i = 0; i < n; i++) {
        int ntok = seq_start[i + 1] - seq_start[i];
        if (ntok < 1 || pos0[i] < 0 || pos0[i] > t->cfg->max_pos) return PRISM_ECORRUPT;
        int nb = blocks_of(t, pos0[i] + ntok);
        if (nb > t->max_blocks_per_seq || used + (size_t)nb > st->n_table) return PRISM_ECORRUPT;
        t->tables[i] = tab + used;
        used += (size_t)nb;
    }
    if (used != st->n_table) return PRISM_ECORRUPT;
    const int32_t *rope_pos = n_rope ? tab + used : NULL;
    if (st->n_embed) {
        memcpy(t->rows, rows, rlen);
        memset(t->row_ptrs, 0, st->n_tokens * sizeof(*t->row_ptrs));
        const int32_t *idx = tab + used + n_rope;
        for (uint32_t j = 0; j < st->n_embed; j++) {
            if (idx[j] < 0 || (uint32_t)idx[j] >= st->n_tokens || t->row_ptrs[idx[j]]) return PRISM_ECORRUPT;
            t->row_ptrs[idx[j]] = t->rows + (size_t)j * prism_model_embed_row_floats(t->cfg);
        }
    }
    t->step = st->step;
    prism_llm_batch_t b = {
        .n_seqs = n, .n_tokens = (int)st->n_tokens, .tokens = tokens, .seq_start = seq_start, .pos0 = pos0,
        .block_tables = t->tables, .all_logits = st->all_logits, .embed_rows = st->n_embed ? t->row_ptrs : NULL,
        .rope_pos = rope_pos,
    };
    int rc = st->no_logits ? prism_llm_forward_begin(llm, kv, &b) : prism_llm_forward(llm, kv, &b, logits);
    if (rc != PRISM_OK) PRISM_ERROR("tensor parallelism: step %llu failed on rank %d: %s",
                                    (unsigned long long)t->step, t->rank, prism_strerror(rc));
    t->steps_followed++;
    return rc;
}

static int follow_kv(prism_tp_t *t, prism_msg_t *m, prism_kv_cache_t *kv)
{
    const Prism__TpKv *tk = m->env->tp_kv;
    size_t ilen = 0, blen = 0;
    if (tk && tk->gather) {   /* the leader wants this rank's heads of these blocks */
        const void *ids = m->n_frames == 1 ? prism_msg_frame(m, 0, &ilen) : NULL;
        if (!ids || tk->n_blocks < 1 || tk->n_blocks > (uint32_t)t->max_blocks_per_seq || ilen != (size_t)tk->n_blocks * 4) {
            PRISM_ERROR("tensor parallelism: malformed KV gather from the leader");
            return PRISM_ECORRUPT;
        }
        memcpy(t->plan, ids, ilen);
        int rc = prism_kv_cache_export(kv, t->plan, (int)tk->n_blocks, t->kv_scratch);
        if (rc != PRISM_OK) return rc;
        Prism__TpKv out = PRISM__TP_KV__INIT;
        out.n_blocks = tk->n_blocks;
        out.gather = true;
        Prism__Envelope env = PRISM__ENVELOPE__INIT;
        env.type = PRISM__MSG_TYPE__MSG_TP_KV;
        env.tp_kv = &out;
        prism_frame_t f = {t->kv_scratch, (size_t)tk->n_blocks * prism_kv_cache_block_bytes(t->cfg, t->setup.block_size)};
        return prism_msg_send(prism_group_link(t->g), NULL, 0, &env, &f, 1, 0) == PRISM_OK ? PRISM_OK : PRISM_EIO;
    }
    const void *ids = m->n_frames == 2 ? prism_msg_frame(m, 0, &ilen) : NULL;
    const void *bytes = ids ? prism_msg_frame(m, 1, &blen) : NULL;
    if (!tk || !ids || tk->n_blocks < 1 || tk->n_blocks > (uint32_t)t->max_blocks_per_seq ||
        ilen != (size_t)tk->n_blocks * 4 ||
        blen != (size_t)tk->n_blocks * prism_kv_cache_block_bytes(t->cfg, t->setup.block_size)) {
        PRISM_ERROR("tensor parallelism: malformed KV from the leader");
        return PRISM_ECORRUPT;
    }
    memcpy(t->plan, ids, ilen);
    int rc = prism_kv_cache_import(kv, t->plan, (int)tk->n_blocks, bytes);
    if (rc != PRISM_OK) PRISM_ERROR("tensor parallelism: KV import failed on rank %d: %s", t->rank, prism_strerror(rc));
    return rc;
}

static int follow(prism_tp_t *t, prism_llm_t *llm, prism_kv_cache_t *kv, float *logits);

int prism_tp_follow(prism_tp_t *t, prism_llm_t *llm, prism_kv_cache_t *kv, float *logits)
{
    int code = follow(t, llm, kv, logits);
    PRISM_INFO("rank %d of %d leaves the group after %llu steps (%s)", t->rank, t->size,
               (unsigned long long)t->steps_followed, code ? "the group failed" : "stopped");
    return code;
}

static int follow(prism_tp_t *t, prism_llm_t *llm, prism_kv_cache_t *kv, float *logits)
{
    PRISM_ASSERT(t->rank > 0);
    PRISM_INFO("rank %d of %d following the leader", t->rank, t->size);
    while (!prism_worker_should_stop()) {
        prism_msg_t m;
        int rc = link_recv(t, &m, 200);
        if (rc == PRISM_EAGAIN) continue;
        if (rc != PRISM_OK) {
            PRISM_ERROR("tensor parallelism: the group failed (a rank or the leader is gone): rank %d exits", t->rank);
            return PRISM_EXIT_PEER_LOST;
        }
        switch (m.env->type) {
        case PRISM__MSG_TYPE__MSG_TP_STEP: rc = follow_step(t, &m, llm, kv, logits); break;
        case PRISM__MSG_TYPE__MSG_TP_KV:   rc = follow_kv(t, &m, kv); break;
        case PRISM__MSG_TYPE__MSG_TP_STOP:
            prism_msg_close(&m);
            return 0;
        default:
            PRISM_WARN("tensor parallelism: unexpected message type %d on the group link", m.env->type);
            rc = PRISM_OK;
        }
        prism_msg_close(&m);
        if (rc != PRISM_OK) {
            /* The ranks' forwards have diverged or cannot run: the group cannot go on. Breaking the
             * communicator lets the leader (blocked in this step's collectives) fail fast. */
            prism_group_comm(t->g)->i.abort(prism_group_comm(t->g)->ctx);
            return 1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- start-up (worker/start.h) */

static int group_flags(void *g, prism_flag_t *t, int n)
{
    prism_tp_t *tp = g;
    prism_tp_opts_defaults(&tp->opts);
    prism_flag_t f[] = {PRISM_TP_FLAGS(&tp->opts)};
    _Static_assert(PRISM_ARRAY_LEN(f) == PRISM_TP_N_FLAGS && PRISM_TP_N_FLAGS <= PRISM_WORKER_GROUP_FLAGS, "flags");
    for (size_t i = 0; i < PRISM_ARRAY_LEN(f); i++) t[n++] = f[i];
    return n;
}

static int group_shard(prism_worker_startup_t *s)
{
    prism_tp_t *tp = s->group;
    if (prism_tp_opts_apply(&tp->opts, s->cfg, s->full) != PRISM_OK) return PRISM_EINVAL;
    s->leader = tp->opts.rank == 0;
    return PRISM_OK;
}

static prism_tp_setup_t group_setup(const prism_worker_startup_t *s)
{
    return (prism_tp_setup_t){.kv_blocks = (int)s->cap.kv_blocks, .block_size = (int)s->cap.block_size,
                              .max_seqs = s->batch_seqs, .max_tokens = s->batch_tokens};
}

static void group_plan(prism_worker_startup_t *s)
{
    const prism_tp_t *tp = s->group;
    prism_tp_setup_t setup = group_setup(s);
    int size = (int)tp->opts.size;
    prism_mem_plan_add(&s->plan, "tp-buffers", prism_tp_buffer_bytes(s->cfg, size, &setup, s->max_blocks_per_seq),
                       PRISM_MEM_LIBRARY);
    prism_mem_plan_add(&s->plan, "tp-shared-memory", size > 1 ? prism_comm_shm_bytes(size, 0) : 0, PRISM_MEM_OUTSIDE);
}

static int group_join(prism_worker_startup_t *s)
{
    prism_tp_t *tp = s->group;
    if (prism_tp_join(tp, &tp->opts, s->leader ? s->w->net : s->rank_net, s->be, s->cfg, s->o.worker_id,
                      s->max_blocks_per_seq, (int)s->cap.block_size) != PRISM_OK)
        return PRISM_EINVAL;
    prism_tp_setup_t setup = group_setup(s);
    if (prism_tp_setup(tp, &setup) != PRISM_OK) return PRISM_EINVAL;
    s->cap.kv_blocks = (uint32_t)setup.kv_blocks;
    s->cap.tp_size = (uint32_t)tp->size;
    if (tp->size > 1) prism_llm_set_comm(s->llm, prism_group_comm(tp->g));
    return PRISM_OK;
}

static int group_follow(prism_worker_startup_t *s) { return prism_tp_follow(s->group, s->llm, s->kv, s->logits); }

static void group_close(void *g, bool stop_ranks)
{
    if (stop_ranks) prism_tp_stop(g);
    prism_tp_close(g);
}

const prism_worker_group_i prism_tp_group = {
    .flags = group_flags, .shard = group_shard, .plan = group_plan, .join = group_join, .follow = group_follow,
    .close = group_close,
};
