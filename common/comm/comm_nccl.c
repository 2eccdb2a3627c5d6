/* nccl: collectives between CUDA ranks, built as its own shared module (libprism_comm_nccl.so) that
 * group.c opens with dlopen when a CUDA group forms: a CPU run, or a CUDA run at T = 1, maps no NCCL.
 *
 * The communicator is non-blocking (ncclConfig_t.blocking = 0), so no NCCL call can hang the
 * process: init and every op may answer ncclInProgress, and we poll ncclCommGetAsyncError until
 * the call settles. Ops are enqueued on the CUDA backend's own stream (prism_cuda_stream), ordered
 * with the model's kernels; `wait` polls that stream (cudaStreamQuery) while checking, about every
 * 100 ms, NCCL's asynchronous error, the group's liveness of the peers and the step timeout. A peer
 * that dies inside an all-reduce leaves the kernel spinning on the GPU; the timeout or the liveness
 * check then calls ncclCommAbort, which tears the kernel down, and the op fails with PRISM_EIO.
 *
 * The NCCL id travels from the leader over the group's ZeroMQ link (group.c); NCCL's own bootstrap
 * sockets follow NCCL_SOCKET_IFNAME (the launcher pins them to the workers' interface).
 */
#include "comm/comm_impl.h"
#include "backend/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

_Static_assert(NCCL_UNIQUE_ID_BYTES == PRISM_COMM_NCCL_ID_BYTES, "NCCL id size");

#define POLL_NS (100 * 1000)             /* sleep between polls */
#define CHECK_NS (100 * 1000 * 1000)     /* liveness checks */

typedef struct {
    ncclComm_t comm;
    cudaStream_t stream;
    int device, size, rank;
    double timeout_s;
    prism_comm_alive_fn alive;
    void *alive_ud;
    bool broken;
} nc_t;

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)

static void nap(void)
{
    struct timespec ts = {0, POLL_NS};
    nanosleep(&ts, NULL);
}

static void nc_break(nc_t *c, const char *why)
{
    if (!c->broken) {
        PRISM_ERROR("comm nccl: rank %d: %s; aborting the communicator", c->rank, why);
        c->broken = true;
        if (c->comm) ncclCommAbort(c->comm);
        c->comm = NULL;
    }
}

/* Waits for a non-blocking NCCL call to settle (res is what the call returned). */
static int nc_settle(nc_t *c, ncclResult_t res, const char *what)
{
    uint64_t t0 = prism_now_ns(), next = t0 + CHECK_NS, deadline = t0 + (uint64_t)(c->timeout_s * 1e9);
    char why[256];
    while (res == ncclInProgress) {
        nap();
        if (ncclCommGetAsyncError(c->comm, &res) != ncclSuccess) res = ncclInternalError;
        if (res != ncclInProgress) break;
        uint64_t now = prism_now_ns();
        if (now >= next) {
            next = now + CHECK_NS;
            if (c->alive && c->alive(c->alive_ud, why, sizeof why) != PRISM_OK) {
                nc_break(c, why);
                return PRISM_EIO;
            }
        }
        if (now >= deadline) {
            snprintf(why, sizeof why, "%s did not complete within %.1f s", what, c->timeout_s);
            nc_break(c, why);
            return PRISM_EIO;
        }
    }
    if (res != ncclSuccess) {
        snprintf(why, sizeof why, "%s: %s (%s)", what, ncclGetErrorString(res), ncclGetLastError(c->comm));
        nc_break(c, why);
        return PRISM_EIO;
    }
    return PRISM_OK;
}

static const char *nc_name(void *ctx) { (void)ctx; return "nccl"; }

static int nc_all_reduce(void *ctx, float *buf, size_t n)
{
    nc_t *c = ctx;
    if (c->broken) return PRISM_EIO;
    if (!n) return PRISM_OK;
    return nc_settle(c, ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, c->comm, c->stream), "ncclAllReduce");
}

static int nc_all_gather(void *ctx, void *out, const void *in, size_t bytes)
{
    nc_t *c = ctx;
    if (c->broken) return PRISM_EIO;
    if (!bytes) return PRISM_OK;
    return nc_settle(c, ncclAllGather(in, out, bytes, ncclUint8, c->comm, c->stream), "ncclAllGather");
}

static int nc_broadcast(void *ctx, void *buf, size_t bytes, int root)
{
    nc_t *c = ctx;
    if (c->broken) return PRISM_EIO;
    if (root < 0 || root >= c->size) return PRISM_EINVAL;
    if (!bytes) return PRISM_OK;
    return nc_settle(c, ncclBroadcast(buf, buf, bytes, ncclUint8, root, c->comm, c->stream), "ncclBroadcast");
}

static int nc_wait(void *ctx)
{
    nc_t *c = ctx;
    if (c->broken) return PRISM_EIO;
    uint64_t t0 = prism_now_ns(), next = t0 + CHECK_NS, deadline = t0 + (uint64_t)(c->timeout_s * 1e9);
    char why[256];
    for (;;) {
        cudaError_t e = cudaStreamQuery(c->stream);
        if (e == cudaSuccess) return PRISM_OK;
        if (e != cudaErrorNotReady) {
            snprintf(why, sizeof why, "stream error: %s", cudaGetErrorString(e));
            nc_break(c, why);
            return PRISM_EIO;
        }
        ncclResult_t ae = ncclSuccess;
        if (ncclCommGetAsyncError(c->comm, &ae) != ncclSuccess || (ae != ncclSuccess && ae != ncclInProgress)) {
            snprintf(why, sizeof why, "asynchronous NCCL error: %s", ncclGetErrorString(ae));
            nc_break(c, why);
            return PRISM_EIO;
        }
        uint64_t now = prism_now_ns();
        if (now >= next) {
            next = now + CHECK_NS;
            if (c->alive && c->alive(c->alive_ud, why, sizeof why) != PRISM_OK) {
                nc_break(c, why);
                return PRISM_EIO;
            }
        }
        if (now >= deadline) {
            snprintf(why, sizeof why, "step timeout: the stream did not drain within %.1f s", c->timeout_s);
            nc_break(c, why);
            return PRISM_EIO;
        }
        nap();
    }
}

static void nc_abort(void *ctx) { nc_break(ctx, "aborted by the group"); }

static void nc_destroy(void *ctx)
{
    nc_t *c = ctx;
    if (!c) return;
    if (c->comm) {
        /* Finalize flushes outstanding ops; a communicator that will not settle is aborted. */
        ncclResult_t r = ncclCommFinalize(c->comm);
        if (nc_settle(c, r, "ncclCommFinalize") == PRISM_OK && c->comm) ncclCommDestroy(c->comm);
        c->comm = NULL;
    }
    prism_free(c);
}

int prism_comm_nccl_unique_id(uint8_t id[PRISM_COMM_NCCL_ID_BYTES], char *err, size_t errlen)
{
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess) {
        ERR("ncclGetUniqueId: %s", ncclGetErrorString(r));
        return PRISM_EIO;
    }
    memcpy(id, u.internal, PRISM_COMM_NCCL_ID_BYTES);
    return PRISM_OK;
}

int prism_comm_nccl_create(prism_backend_t *be, const uint8_t id[PRISM_COMM_NCCL_ID_BYTES], int size, int rank,
                           double timeout_s, prism_comm_alive_fn alive, void *alive_ud, prism_comm_t **out,
                           char *err, size_t errlen)
{
    *out = NULL;
    void *stream = prism_cuda_stream(be);
    int device = prism_cuda_device(be);
    if (!stream || device < 0 || size < 1 || size > PRISM_TP_MAX || rank < 0 || rank >= size) {
        ERR("comm nccl: needs a CUDA backend and a valid rank (%d of %d)", rank, size);
        return PRISM_EINVAL;
    }
    if (cudaSetDevice(device) != cudaSuccess) {
        ERR("comm nccl: cudaSetDevice(%d) failed", device);
        return PRISM_EIO;
    }
    nc_t *c = prism_calloc(1, sizeof *c);
    prism_comm_t *pc = prism_calloc(1, sizeof *pc);
    if (!c || !pc) {
        prism_free(c);
        prism_free(pc);
        return PRISM_ENOMEM;
    }
    c->stream = (cudaStream_t)stream;
    c->device = device;
    c->size = size;
    c->rank = rank;
    c->timeout_s = timeout_s > 0 ? timeout_s : 30;
    c->alive = alive;
    c->alive_ud = alive_ud;
    ncclUniqueId u;
    memcpy(u.internal, id, PRISM_COMM_NCCL_ID_BYTES);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&c->comm, size, u, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        ERR("comm nccl: ncclCommInitRankConfig: %s", ncclGetErrorString(r));
        if (c->comm) ncclCommAbort(c->comm);
        prism_free(c);
        prism_free(pc);
        return PRISM_EIO;
    }
    if (nc_settle(c, r, "ncclCommInitRankConfig") != PRISM_OK) {
        ERR("comm nccl: rank %d of %d: the communicator did not form", rank, size);
        prism_free(c);
        prism_free(pc);
        return PRISM_EIO;
    }
    pc->i = (prism_comm_i){
        .name = nc_name, .all_reduce_sum = nc_all_reduce, .all_gather = nc_all_gather, .broadcast = nc_broadcast,
        .wait = nc_wait, .abort = nc_abort, .destroy = nc_destroy,
    };
    pc->ctx = c;
    pc->size = size;
    pc->rank = rank;
    pc->timeout_s = c->timeout_s;
    *out = pc;
    return PRISM_OK;
}
