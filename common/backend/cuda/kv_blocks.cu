/* KV block export/import: packs whole cache blocks (base + id*block_bytes) into one contiguous
 * device buffer (or unpacks one), so a transfer of n blocks is one gather launch plus one
 * PCIe copy instead of n small copies. 16-byte accesses when everything is 16-byte aligned. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

template <typename T>
static __global__ void kv_move_kernel(T *packed, T *base, size_t block_elems, const int32_t *ids, int n, int gather)
{
    size_t total = block_elems * (size_t)n;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        size_t i = k / block_elems, e = k % block_elems;
        T *cache = base + (size_t)ids[i] * block_elems + e;
        if (gather) packed[k] = *cache;
        else *cache = packed[k];
    }
}

static int launch(cudaStream_t st, void *packed, void *base, size_t block_bytes, const int32_t *ids, int n, int gather)
{
    bool v16 = ((uintptr_t)packed % 16 == 0) && ((uintptr_t)base % 16 == 0) && block_bytes % 16 == 0;
    if (v16) {
        size_t be = block_bytes / 16;
        kv_move_kernel<uint4><<<prism_cuda_blocks(be * n, THREADS), THREADS, 0, st>>>((uint4 *)packed, (uint4 *)base,
                                                                                     be, ids, n, gather);
    } else {
        kv_move_kernel<uint8_t><<<prism_cuda_blocks(block_bytes * n, THREADS), THREADS, 0, st>>>(
            (uint8_t *)packed, (uint8_t *)base, block_bytes, ids, n, gather);
    }
    return PRISM_CUDA_LAUNCHED(gather ? "kv_gather" : "kv_scatter");
}

extern "C" int prism_cuda_kv_gather(cudaStream_t st, void *dst, const void *base, size_t block_bytes, const int32_t *ids,
                                    int n)
{
    if (n < 0 || block_bytes == 0) return PRISM_EINVAL;
    if (n == 0) return PRISM_OK;
    return launch(st, dst, (void *)base, block_bytes, ids, n, 1);
}

extern "C" int prism_cuda_kv_scatter(cudaStream_t st, void *base, size_t block_bytes, const int32_t *ids, int n,
                                     const void *src)
{
    if (n < 0 || block_bytes == 0) return PRISM_EINVAL;
    if (n == 0) return PRISM_OK;
    return launch(st, (void *)src, base, block_bytes, ids, n, 0);
}
