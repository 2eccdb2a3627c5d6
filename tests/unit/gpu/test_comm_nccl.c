/* The NCCL communicator module (libprism_comm_nccl.so) on a real GPU: it loads through the same
 * module search as the CUDA backend, ncclGetUniqueId works, a one-rank communicator on the CUDA
 * backend's stream runs all-reduce / all-gather / broadcast in stream order with the backend's own
 * ops, wait drains the stream, and an aborted communicator fails every later op with PRISM_EIO.
 * One GPU cannot host a two-rank NCCL group (NCCL refuses two ranks on one device): multi-rank
 * numerics are covered by the CPU transports (tests/unit/comm), which run the same model code.
 * SKIPPED (exit 77) without a GPU. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_backend.h"
#include "comm/comm_impl.h"

#define CHECK(c) do { if (!(c)) { fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, #c); return 1; } } while (0)

int main(void)
{
    if (!prism_cuda_available()) {
        printf("SKIPPED: no CUDA device\n");
        return 77;
    }
    char why[512];
    void *mod = prism_backend_module_open(PRISM_COMM_NCCL_MODULE, why, sizeof why);
    if (!mod) {
        fprintf(stderr, "cannot open %s: %s\n", PRISM_COMM_NCCL_MODULE, why);
        return 1;
    }
    prism_comm_nccl_id_fn id_fn = (prism_comm_nccl_id_fn)dlsym(mod, "prism_comm_nccl_unique_id");
    prism_comm_nccl_create_fn create_fn = (prism_comm_nccl_create_fn)dlsym(mod, "prism_comm_nccl_create");
    CHECK(id_fn && create_fn);
    int st = 0;
    prism_backend_t *be = prism_backend_cuda_create(0, (size_t)256 << 20, &st);
    CHECK(be);
    uint8_t id[PRISM_COMM_NCCL_ID_BYTES];
    CHECK(id_fn(id, why, sizeof why) == PRISM_OK);
    prism_comm_t *c = NULL;
    CHECK(create_fn(be, id, 1, 0, 10.0, NULL, NULL, &c, why, sizeof why) == PRISM_OK);
    CHECK(!strcmp(c->i.name(c->ctx), "nccl"));

    enum { N = 1 << 20 };
    float *h = malloc(N * 4), *back = malloc(N * 4);
    for (int i = 0; i < N; i++) h[i] = (float)i * 0.25f;
    float *d = prism_backend_buf_alloc(be, N * 4), *g = prism_backend_buf_alloc(be, N * 4);
    CHECK(d && g);
    CHECK(be->i.upload(be->ctx, d, h, N * 4) == PRISM_OK);
    /* stream order: scale by 2 (a backend op), all-reduce over one rank, gather, broadcast */
    CHECK(be->i.scale(be->ctx, d, d, 2.0f, N) == PRISM_OK);
    CHECK(prism_comm_all_reduce_sum(c, d, N) == PRISM_OK);
    CHECK(prism_comm_all_gather(c, g, d, (size_t)N * 4) == PRISM_OK);
    CHECK(prism_comm_broadcast(c, g, (size_t)N * 4, 0) == PRISM_OK);
    CHECK(prism_comm_wait(c) == PRISM_OK);
    CHECK(be->i.download(be->ctx, back, g, N * 4) == PRISM_OK);
    for (int i = 0; i < N; i++) CHECK(back[i] == h[i] * 2.0f);
    CHECK(c->i.broadcast(c->ctx, g, 4, 1) == PRISM_EINVAL);   /* root out of range */

    c->i.abort(c->ctx);
    CHECK(prism_comm_all_reduce_sum(c, d, N) == PRISM_EIO);
    CHECK(prism_comm_wait(c) == PRISM_EIO);
    prism_comm_destroy(c);
    prism_backend_buf_free(be, d);
    prism_backend_buf_free(be, g);
    prism_backend_destroy(be);
    free(h);
    free(back);
    printf("nccl module: one-rank communicator ok\n");
    return 0;
}
