/* shm: collectives between the rank processes of one host through one shared-memory segment.
 *
 * Segment: a header page (barrier words, the peers' processes, a broken flag) then two generations of
 * per-rank slots [2][T][slot] and two result areas [2][slot]. Op k (every chunk of every collective
 * counts) uses generation k % 2, so op k+1 can fill its slots while a slow rank still reads op k's:
 * nobody can start op k+2, which reuses k's buffers, before everyone has arrived at op k+1's
 * barrier, i.e. finished op k. Hence one barrier per all_gather / broadcast chunk, one per small
 * all-reduce (every rank sums all slots itself) and two per large one (each rank sums a 1/T share
 * into the result area, then everyone copies it). Sums run in rank order 0..T-1 whoever computes
 * them, so every rank gets the same bits.
 *
 * Barrier: a central counter and a generation word. Waiters spin a little, then sleep on the
 * generation with futex (shared, not private: the word lives in a MAP_SHARED mapping of several
 * processes) in slices of 20 ms; between slices they check the broken flag, the deadline (the
 * step timeout) and, every 100 ms, that the peers' processes still exist (pid + start time, so a
 * reused pid does not count as alive). Whoever finds a failure sets the broken flag and wakes
 * everyone, so the whole group fails within about a slice.
 */
#include "comm/comm_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SHM_MAGIC 0x50544d53u   /* "SMTP" */
#define SHM_VERSION 1
#define SHM_HDR_BYTES 8192
#define SPIN_ITERS 256
#define SLICE_NS (20 * 1000 * 1000)
#define CHECK_NS (100 * 1000 * 1000)
#define SMALL_REDUCE_FLOATS 16384  /* below this (n * T), every rank sums all slots itself */

typedef struct {
    uint32_t magic, version, size, pad;
    uint64_t slot_bytes, group_id;
    alignas(64) _Atomic uint32_t arrive;
    alignas(64) _Atomic uint32_t gen;         /* futex word */
    _Atomic uint32_t waiters;
    _Atomic uint32_t broken;
    alignas(64) _Atomic uint64_t seq[PRISM_TP_MAX];   /* barriers each rank has entered (diagnostics) */
    prism_comm_peer_t peer[PRISM_TP_MAX];
} shm_hdr_t;

_Static_assert(sizeof(shm_hdr_t) <= SHM_HDR_BYTES, "shm header fits its page");

typedef struct {
    shm_hdr_t *h;
    uint8_t *base;
    size_t map_bytes, slot;
    int size, rank;
    uint64_t op;                  /* ops so far (every chunk counts): the generation parity */
    uint64_t nbar;                /* barriers entered (diagnostics: who is missing) */
    double timeout_s;
    bool broken;                  /* seen locally: every later call fails at once */
} shm_t;

static uint8_t *slot_ptr(shm_t *s, uint64_t op, int r)
{
    return s->base + SHM_HDR_BYTES + ((size_t)(op & 1) * s->size + (size_t)r) * s->slot;
}

static uint8_t *result_ptr(shm_t *s, uint64_t op)
{
    return s->base + SHM_HDR_BYTES + (size_t)2 * s->size * s->slot + (size_t)(op & 1) * s->slot;
}

size_t prism_comm_shm_bytes(int size, size_t slot_bytes)
{
    if (!slot_bytes) slot_bytes = (size_t)1 << 20;
    slot_bytes = PRISM_ALIGN_UP(slot_bytes, 64);
    return SHM_HDR_BYTES + (size_t)2 * size * slot_bytes + 2 * slot_bytes;
}

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void mark_broken(shm_t *s)
{
    s->broken = true;
    atomic_store(&s->h->broken, 1);
    futex(&s->h->gen, FUTEX_WAKE, INT_MAX, NULL);
}

static int peers_check(shm_t *s, char *why, size_t n)
{
    for (int r = 0; r < s->size; r++) {
        if (r == s->rank) continue;
        const prism_comm_peer_t *p = &s->h->peer[r];
        if (!prism_proc_alive(p->pid, p->start)) {
            snprintf(why, n, "rank %d (pid %d) is gone", r, (int)p->pid);
            return PRISM_EIO;
        }
    }
    return PRISM_OK;
}

/* Ranks that have not yet entered op `want` (for the timeout message). */
static void missing_ranks(shm_t *s, uint64_t want, char *out, size_t n)
{
    size_t len = 0;
    out[0] = 0;
    for (int r = 0; r < s->size && len + 8 < n; r++)
        if (atomic_load(&s->h->seq[r]) < want) len += (size_t)snprintf(out + len, n - len, "%s%d", len ? "," : "", r);
}

static int barrier(shm_t *s)
{
    shm_hdr_t *h = s->h;
    if (s->broken || atomic_load(&h->broken)) {
        s->broken = true;
        return PRISM_EIO;
    }
    /* The generation is read before arriving: the last arriver bumps it only after everyone's
     * increment, so reading it afterwards could see the bump and wait for the next barrier. */
    uint32_t g = atomic_load(&h->gen);
    atomic_store(&h->seq[s->rank], ++s->nbar);
    if (atomic_fetch_add(&h->arrive, 1) + 1 == (uint32_t)s->size) {
        atomic_store(&h->arrive, 0);
        atomic_fetch_add(&h->gen, 1);
        if (atomic_load(&h->waiters)) futex(&h->gen, FUTEX_WAKE, INT_MAX, NULL);
        return PRISM_OK;
    }
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load(&h->gen) != g) return PRISM_OK;
        cpu_relax();
    }
    uint64_t t0 = prism_now_ns(), next_check = t0 + CHECK_NS;
    uint64_t deadline = t0 + (uint64_t)(s->timeout_s * 1e9);
    atomic_fetch_add(&h->waiters, 1);
    int rc = PRISM_OK;
    char why[256] = "";   /* room for the longest missing-ranks list */
    while (atomic_load(&h->gen) == g) {
        if (atomic_load(&h->broken)) {
            snprintf(why, sizeof why, "another rank failed");
            rc = PRISM_EIO;
            break;
        }
        struct timespec ts = {0, SLICE_NS};
        futex(&h->gen, FUTEX_WAIT, g, &ts);
        uint64_t now = prism_now_ns();
        if (now >= next_check) {
            next_check = now + CHECK_NS;
            if ((rc = peers_check(s, why, sizeof why)) != PRISM_OK) break;
        }
        if (now >= deadline && atomic_load(&h->gen) == g) {
            char miss[128];
            missing_ranks(s, s->nbar, miss, sizeof miss);
            snprintf(why, sizeof why, "step timeout: waited %.1f s for rank(s) %s", s->timeout_s, miss);
            rc = PRISM_EIO;
            break;
        }
    }
    atomic_fetch_sub(&h->waiters, 1);
    if (rc != PRISM_OK) {
        /* The barrier may have completed while we looked: that is not a failure. */
        if (atomic_load(&h->gen) != g && !atomic_load(&h->broken)) return PRISM_OK;
        PRISM_ERROR("comm shm: rank %d: %s", s->rank, why);
        mark_broken(s);
    }
    return rc;
}

static const char *shm_name(void *ctx) { (void)ctx; return "shm"; }

static int shm_all_reduce(void *ctx, float *buf, size_t n)
{
    shm_t *s = ctx;
    size_t per = s->slot / sizeof(float);
    const int T = s->size;
    for (size_t off = 0; off < n; off += per, s->op++) {
        size_t m = PRISM_MIN(per, n - off);
        float *x = buf + off;
        memcpy(slot_ptr(s, s->op, s->rank), x, m * sizeof(float));
        int rc = barrier(s);
        if (rc != PRISM_OK) return rc;
        if (m * (size_t)T <= SMALL_REDUCE_FLOATS) {
            const float *src0 = (const float *)slot_ptr(s, s->op, 0);
            for (size_t i = 0; i < m; i++) x[i] = src0[i];
            for (int r = 1; r < T; r++) {
                const float *src = (const float *)slot_ptr(s, s->op, r);
                for (size_t i = 0; i < m; i++) x[i] += src[i];
            }
        } else {
            /* Each rank sums its share into the result area, then everyone copies the result. */
            size_t lo = m * (size_t)s->rank / T, hi = m * (size_t)(s->rank + 1) / T;
            float *res = (float *)result_ptr(s, s->op);
            const float *src0 = (const float *)slot_ptr(s, s->op, 0);
            for (size_t i = lo; i < hi; i++) res[i] = src0[i];
            for (int r = 1; r < T; r++) {
                const float *src = (const float *)slot_ptr(s, s->op, r);
                for (size_t i = lo; i < hi; i++) res[i] += src[i];
            }
            rc = barrier(s);
            if (rc != PRISM_OK) return rc;
            memcpy(x, res, m * sizeof(float));
        }
    }
    return PRISM_OK;
}

static int shm_all_gather(void *ctx, void *out, const void *in, size_t bytes)
{
    shm_t *s = ctx;
    for (size_t off = 0; off < bytes; off += s->slot, s->op++) {
        size_t m = PRISM_MIN(s->slot, bytes - off);
        memcpy(slot_ptr(s, s->op, s->rank), (const uint8_t *)in + off, m);
        int rc = barrier(s);
        if (rc != PRISM_OK) return rc;
        for (int r = 0; r < s->size; r++) memcpy((uint8_t *)out + (size_t)r * bytes + off, slot_ptr(s, s->op, r), m);
    }
    return PRISM_OK;
}

static int shm_broadcast(void *ctx, void *buf, size_t bytes, int root)
{
    shm_t *s = ctx;
    if (root < 0 || root >= s->size) return PRISM_EINVAL;
    for (size_t off = 0; off < bytes; off += s->slot, s->op++) {
        size_t m = PRISM_MIN(s->slot, bytes - off);
        if (s->rank == root) memcpy(slot_ptr(s, s->op, 0), (const uint8_t *)buf + off, m);
        int rc = barrier(s);
        if (rc != PRISM_OK) return rc;
        if (s->rank != root) memcpy((uint8_t *)buf + off, slot_ptr(s, s->op, 0), m);
    }
    return PRISM_OK;
}

static int shm_wait(void *ctx)
{
    shm_t *s = ctx;
    return s->broken || atomic_load(&s->h->broken) ? PRISM_EIO : PRISM_OK;
}

static void shm_abort(void *ctx)
{
    shm_t *s = ctx;
    if (s->h) mark_broken(s);
}

static void shm_destroy(void *ctx)
{
    shm_t *s = ctx;
    if (!s) return;
    if (s->base) munmap(s->base, s->map_bytes);
    prism_free(s);
}

void prism_comm_shm_unlink(const char *name)
{
    if (name && *name) shm_unlink(name);
}

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)

int prism_comm_shm_create(const char *name, uint64_t group_id, int size, int rank, size_t slot_bytes,
                          const prism_comm_peer_t *peers, double timeout_s, prism_comm_t **out,
                          char *err, size_t errlen)
{
    *out = NULL;
    if (size < 1 || size > PRISM_TP_MAX || rank < 0 || rank >= size || !name || name[0] != '/') {
        ERR("comm shm: bad arguments");
        return PRISM_EINVAL;
    }
    if (!slot_bytes) slot_bytes = (size_t)1 << 20;
    slot_bytes = PRISM_ALIGN_UP(slot_bytes, 64);
    size_t total = prism_comm_shm_bytes(size, slot_bytes);
    bool leader = rank == 0;
    int fd = shm_open(name, leader ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
    if (fd < 0) {
        ERR("comm shm: shm_open %s: %s", name, strerror(errno));
        return PRISM_EIO;
    }
    if (leader && ftruncate(fd, (off_t)total) != 0) {
        ERR("comm shm: cannot size %s to %zu bytes: %s", name, total, strerror(errno));
        close(fd);
        shm_unlink(name);
        return PRISM_EIO;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != total) {
        ERR("comm shm: %s has %lld bytes, expected %zu", name, (long long)st.st_size, total);
        close(fd);
        return PRISM_ECORRUPT;
    }
    void *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) {
        ERR("comm shm: mmap %zu bytes: %s", total, strerror(errno));
        if (leader) shm_unlink(name);
        return PRISM_ENOMEM;
    }
    shm_hdr_t *h = base;
    if (leader) {
        /* A fresh mapping is zero: atomics start at 0. Touch every page now (tmpfs allocates on
         * first touch), so a /dev/shm too small for the group fails here, not with SIGBUS in a step. */
        memset((uint8_t *)base + SHM_HDR_BYTES, 0, total - SHM_HDR_BYTES);
        h->size = (uint32_t)size;
        h->slot_bytes = slot_bytes;
        h->group_id = group_id;
        for (int r = 0; r < size; r++) h->peer[r] = peers[r];
        h->version = SHM_VERSION;
        atomic_thread_fence(memory_order_release);
        h->magic = SHM_MAGIC;
    } else {
        atomic_thread_fence(memory_order_acquire);
        if (h->magic != SHM_MAGIC || h->version != SHM_VERSION || h->size != (uint32_t)size ||
            h->slot_bytes != slot_bytes || h->group_id != group_id) {
            ERR("comm shm: %s is not this group's segment", name);
            munmap(base, total);
            return PRISM_ECORRUPT;
        }
    }
    shm_t *s = prism_calloc(1, sizeof *s);
    prism_comm_t *c = prism_calloc(1, sizeof *c);
    if (!s || !c) {
        prism_free(s);
        prism_free(c);
        munmap(base, total);
        if (leader) shm_unlink(name);
        return PRISM_ENOMEM;
    }
    s->h = h;
    s->base = base;
    s->map_bytes = total;
    s->slot = slot_bytes;
    s->size = size;
    s->rank = rank;
    s->timeout_s = timeout_s > 0 ? timeout_s : 30;
    c->i = (prism_comm_i){
        .name = shm_name, .all_reduce_sum = shm_all_reduce, .all_gather = shm_all_gather,
        .broadcast = shm_broadcast, .wait = shm_wait, .abort = shm_abort, .destroy = shm_destroy,
    };
    c->ctx = s;
    c->size = size;
    c->rank = rank;
    c->timeout_s = s->timeout_s;
    *out = c;
    return PRISM_OK;
}
