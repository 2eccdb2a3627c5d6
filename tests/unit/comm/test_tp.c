/* The worker side of tensor-parallel groups (tp/tp.h) with T real rank processes (fork) on the
 * bundled model (8 query heads, 4 KV heads):
 *  - KV: the leader scatters whole-model blocks (every rank imports exactly its heads) and gathers
 *    them back bit for bit, at T = 2, 4 and 8 (8: each KV head replicated on two ranks);
 *  - a step plan with two sequences (one decoding over the scattered KV, one prefilling with image
 *    embedding rows) run by the leader and followed by the ranks gives the T = 1 logits (1e-4) and
 *    the same KV for the new block;
 *  - the capacity exchange gives every rank the smallest rank's KV blocks;
 *  - a plan out of order makes the rank refuse it and break the group: the leader's check fails
 *    promptly, nobody hangs.
 * The transport is the shared-memory collective; the group link is ZeroMQ without CURVE (the CURVE
 * link is tested in test_comm). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "model/model.h"
#include "net/net.h"
#include "tp/tp.h"
#include "tp_fork.h"

#define BS 16
#define NBLK 16            /* blocks in each cache */
#define PROMPT 20          /* tokens of the scattered KV (2 blocks) */
#define NB 6               /* tokens of the prefilling sequence */

typedef struct {
    float logits[2][4096];
    size_t whole_bytes;            /* one block of the whole model */
    uint8_t before[2 << 17];       /* blocks 0, 1 as scattered */
    uint8_t after[3 << 17];        /* blocks 0, 1, 2 after the step at T = 1 (A wrote into 1, B filled 2) */
    int kv_blocks_seen[PRISM_TP_MAX];
    int done;
} shared_t;

static const char *source_dir(void)
{
    const char *s = getenv("PRISM_SOURCE_DIR");
    return s && *s ? s : PRISM_SOURCE_DIR;
}

static void model_dir(char *out, size_t n) { snprintf(out, n, "%s/models/prism-tiny-llava", source_dir()); }

static float img[3][1024];

/* The batch every run uses: sequence A decodes one token at position PROMPT over blocks {0,1};
 * sequence B prefills NB tokens into block {2}, tokens 1..3 replaced by image rows. */
static void make_batch(prism_llm_batch_t *b, int32_t *toks, int32_t *seq_start, int32_t *pos0,
                       const int32_t **tables, const float **rows, int hidden)
{
    static const int32_t tabA[2] = {0, 1}, tabB[1] = {2};
    for (int r = 0; r < 3; r++)
        for (int h = 0; h < hidden; h++) img[r][h] = 0.05f * (float)sin(0.7 * r + 0.13 * h);
    toks[0] = 42;
    for (int i = 0; i < NB; i++) toks[1 + i] = 100 + 7 * i;
    for (int i = 0; i < 1 + NB; i++) rows[i] = i >= 2 && i < 5 ? img[i - 2] : NULL;
    seq_start[0] = 0;
    seq_start[1] = 1;
    seq_start[2] = 1 + NB;
    pos0[0] = PROMPT;
    pos0[1] = 0;
    tables[0] = tabA;
    tables[1] = tabB;
    *b = (prism_llm_batch_t){.n_seqs = 2, .n_tokens = 1 + NB, .tokens = toks, .seq_start = seq_start, .pos0 = pos0,
                             .block_tables = tables, .embed_rows = rows};
}

/* Deterministic whole-model KV for blocks 0 and 1 (what a prefill of T = 1 would send). */
static void make_kv(uint8_t *dst, size_t bytes)
{
    float *f = (float *)dst;
    for (size_t i = 0; i < bytes / 4; i++) f[i] = 0.5f * (float)sin(0.001 * (double)i + 0.3);
}

typedef struct {
    shared_t *sh;
    int size;
    bool out_of_order;
    char leader[64];
} job_t;

static int rank_main(job_t *j, int rank)
{
    char dir[1024], err[512];
    model_dir(dir, sizeof dir);
    prism_model_config_t cfg;
    TP_CHECK(prism_model_config_load(dir, &cfg, err, sizeof err) == PRISM_OK, "%s", err);
    TP_CHECK(prism_model_config_set_tp(&cfg, j->size, rank, err, sizeof err) == PRISM_OK, "%s", err);
    prism_backend_t *be = prism_backend_cpu_create(1);
    prism_llm_t *llm = NULL;
    TP_CHECK(prism_llm_load(be, &cfg, dir, 8, 2, &llm, err, sizeof err) == PRISM_OK, "%s", err);
    prism_net_t *net = NULL;
    prism_net_opts_t no = {.role = PRISM_NET_ROLE_DECODE, .insecure = true};
    TP_CHECK(prism_net_create(&no, &net, err, sizeof err) == PRISM_OK, "%s", err);
    prism_tp_opts_t o;
    prism_tp_opts_defaults(&o);
    o.size = j->size;
    o.rank = rank;
    o.leader = j->leader;
    o.timeout_s = 10;
    prism_tp_t tp;
    TP_CHECK(prism_tp_join(&tp, &o, net, be, &cfg, "test", 4, BS) == PRISM_OK, "join");
    /* every rank offers a different capacity: the group takes the smallest */
    prism_tp_setup_t s = {.kv_blocks = NBLK + 3 * (j->size - 1 - rank), .block_size = BS, .max_seqs = 2, .max_tokens = 8};
    TP_CHECK(prism_tp_setup(&tp, &s) == PRISM_OK, "setup");
    j->sh->kv_blocks_seen[rank] = s.kv_blocks;
    prism_kv_cache_t *kv = NULL;
    TP_CHECK(prism_kv_cache_create(be, &cfg, s.kv_blocks, BS, &kv) == PRISM_OK, "kv");
    TP_CHECK(prism_llm_set_comm(llm, prism_group_comm(tp.g)) == PRISM_OK, "comm");
    float *logits = malloc((size_t)2 * cfg.vocab * sizeof(float));
    int code = 0;
    if (rank > 0) {
        code = prism_tp_follow(&tp, llm, kv, logits);
    } else {
        const size_t bb = prism_kv_cache_block_bytes(&tp.full, BS);
        static const int32_t b01[2] = {0, 1}, b012[3] = {0, 1, 2};
        TP_CHECK(prism_tp_scatter_kv(&tp, kv, b01, 2, j->sh->before) == PRISM_OK, "scatter");
        if (j->out_of_order) {
            tp.step += 5;   /* the next plan skips steps: a rank must refuse it, not run it */
            prism_llm_batch_t b;
            int32_t toks[8], seq_start[3], pos0[2];
            const int32_t *tables[2];
            const float *rows[8];
            make_batch(&b, toks, seq_start, pos0, tables, rows, cfg.hidden);
            TP_CHECK(prism_tp_send_step(&tp, &b, true) == PRISM_OK, "send");
            /* the rank breaks the group instead of running the forward */
            double t0 = tp_now();
            while (prism_tp_check(&tp) == PRISM_OK && tp_now() - t0 < 10) {
                struct timespec ts = {0, 10 * 1000 * 1000};
                nanosleep(&ts, NULL);
            }
            TP_CHECK(prism_tp_check(&tp) != PRISM_OK, "the leader never saw the group break");
            TP_CHECK(tp_now() - t0 < 5, "the group took %.1fs to break", tp_now() - t0);
        } else {
            prism_llm_batch_t b;
            int32_t toks[8], seq_start[3], pos0[2];
            const int32_t *tables[2];
            const float *rows[8];
            make_batch(&b, toks, seq_start, pos0, tables, rows, cfg.hidden);
            TP_CHECK(prism_tp_send_step(&tp, &b, true) == PRISM_OK, "send");
            TP_CHECK(prism_llm_forward(llm, kv, &b, logits) == PRISM_OK, "forward");
            for (int q = 0; q < 2; q++) {
                double worst = 0;
                for (int v = 0; v < cfg.vocab; v++)
                    worst = fmax(worst, fabs((double)logits[(size_t)q * cfg.vocab + v] - j->sh->logits[q][v]));
                TP_CHECK(worst < 1e-4, "sequence %d: logits differ from T = 1 by %g", q, worst);
            }
            /* gather: block 0 comes back bit for bit; block 1 (A's new token) and block 2 (B's
             * prompt) equal T = 1's */
            uint8_t *back = malloc(3 * bb);
            TP_CHECK(prism_tp_gather_kv(&tp, kv, b012, 3, back) == PRISM_OK, "gather");
            TP_CHECK(!memcmp(back, j->sh->before, bb), "a scattered block did not come back unchanged");
            const float *got = (const float *)back, *want = (const float *)j->sh->after;
            double kw = 0;
            for (size_t i = 0; i < 3 * bb / 4; i++) kw = fmax(kw, fabs((double)got[i] - want[i]));
            TP_CHECK(kw < 1e-4, "gathered blocks differ from T = 1 by %g", kw);
            free(back);
            prism_tp_stop(&tp);
        }
    }
    free(logits);
    prism_kv_cache_free(kv);
    prism_tp_close(&tp);
    prism_llm_free(llm);
    prism_backend_destroy(be);
    prism_net_destroy(net);
    return code;
}

/* T = 1 reference in the parent: logits of the batch and the whole blocks 0, 1, 2. */
static shared_t *reference(void)
{
    shared_t *sh = tp_shared(sizeof *sh);
    assert_non_null(sh);
    char dir[1024], err[512];
    model_dir(dir, sizeof dir);
    prism_model_config_t cfg;
    assert_int_equal(prism_model_config_load(dir, &cfg, err, sizeof err), PRISM_OK);
    assert_true(cfg.vocab <= 4096);
    sh->whole_bytes = prism_kv_cache_block_bytes(&cfg, BS);
    assert_true(sh->whole_bytes <= sizeof sh->before / 2);
    prism_backend_t *be = prism_backend_cpu_create(1);
    prism_llm_t *llm = NULL;
    assert_int_equal(prism_llm_load(be, &cfg, dir, 8, 2, &llm, err, sizeof err), PRISM_OK);
    prism_kv_cache_t *kv = NULL;
    assert_int_equal(prism_kv_cache_create(be, &cfg, NBLK, BS, &kv), PRISM_OK);
    make_kv(sh->before, 2 * sh->whole_bytes);
    static const int32_t b01[2] = {0, 1}, b012[3] = {0, 1, 2};
    assert_int_equal(prism_kv_cache_import(kv, b01, 2, sh->before), PRISM_OK);
    prism_llm_batch_t b;
    int32_t toks[8], seq_start[3], pos0[2];
    const int32_t *tables[2];
    const float *rows[8];
    make_batch(&b, toks, seq_start, pos0, tables, rows, cfg.hidden);
    float *logits = malloc((size_t)2 * cfg.vocab * sizeof(float));
    assert_int_equal(prism_llm_forward(llm, kv, &b, logits), PRISM_OK);
    for (int q = 0; q < 2; q++) memcpy(sh->logits[q], logits + (size_t)q * cfg.vocab, (size_t)cfg.vocab * 4);
    assert_int_equal(prism_kv_cache_export(kv, b012, 3, sh->after), PRISM_OK);
    free(logits);
    prism_kv_cache_free(kv);
    prism_llm_free(llm);
    prism_backend_destroy(be);
    return sh;
}

static void run_group(int size, bool out_of_order)
{
    shared_t *sh = reference();
    job_t j = {.sh = sh, .size = size, .out_of_order = out_of_order};
    snprintf(j.leader, sizeof j.leader, "tcp://127.0.0.1:%d", tp_free_port());
    pid_t pids[PRISM_TP_MAX];
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < size; r++) {
        pid_t p = fork();
        assert_true(p >= 0);
        if (p == 0) _exit(rank_main(&j, r));
        pids[r] = p;
    }
    int codes[PRISM_TP_MAX];
    double deadline = tp_now() + 120;
    for (int r = 0; r < size; r++) {
        int st = 0;
        for (;;) {
            pid_t p = waitpid(pids[r], &st, WNOHANG);
            if (p == pids[r]) break;
            if (tp_now() > deadline) {   /* a hang fails the test (and leaves nothing behind) */
                for (int k = 0; k < size; k++) kill(pids[k], SIGKILL);
                waitpid(pids[r], &st, 0);
                break;
            }
            struct timespec ts = {0, 5 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    for (int r = 0; r < size; r++) {
        int want = r == 0 || !out_of_order ? 0 : 1;   /* a refused plan: the rank exits 1 */
        if (codes[r] != want) fprintf(stderr, "T=%d: rank %d exited %d, expected %d\n", size, r, codes[r], want);
        assert_int_equal(codes[r], want);
        if (!out_of_order) assert_int_equal(sh->kv_blocks_seen[r], NBLK);   /* the smallest rank's */
    }
    munmap(sh, sizeof *sh);
}

static void test_t2(void **state) { (void)state; run_group(2, false); }
static void test_t4(void **state) { (void)state; run_group(4, false); }
static void test_t8_kv_heads_replicated(void **state) { (void)state; run_group(8, false); }
static void test_plan_out_of_order_breaks_the_group(void **state) { (void)state; run_group(2, true); }

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_t2),
        cmocka_unit_test(test_t4),
        cmocka_unit_test(test_t8_kv_heads_replicated),
        cmocka_unit_test(test_plan_out_of_order_breaks_the_group),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
